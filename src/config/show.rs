//! The effective config as a TOML file (`fencegate check-config`): every key, in the sections
//! of `config/fencegate.toml`, so that what is printed can be saved and served as it is. A key
//! not set (no default) is a comment, `# key: not set`, since TOML has no null. A secret is
//! shown as `"<hidden: its key>"` (a value `serve` takes, so that a saved copy still asks for a
//! token, never one that drops it) and Redis URLs lose their password (the config's
//! `Serialize`).

use std::fmt::Write;

use serde_json::{Map, Value};

use super::{Config, HIDDEN};

/// `config` as TOML.
pub fn to_toml(config: &Config) -> String {
    let value = serde_json::to_value(config).expect("the config serialises");
    let Value::Object(top) = value else { unreachable!("the config is a table") };
    let mut out = String::new();
    table(&mut out, "", &top);
    out
}

/// Writes the keys of `map` (at `path`), then its tables and arrays of tables.
fn table(out: &mut String, path: &str, map: &Map<String, Value>) {
    let is_table = |v: &Value| v.is_object();
    let is_array_of_tables = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_object));
    for (key, value) in map {
        if is_table(value) || is_array_of_tables(value) {
            continue;
        }
        let name = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        match value {
            Value::Null => writeln!(out, "# {key}: not set"),
            Value::String(s) if s == HIDDEN => writeln!(out, "{key} = {}", toml_string(&format!("<hidden: {name}>"))),
            value => writeln!(out, "{key} = {}", inline(value)),
        }
        .expect("writing to a string");
    }
    for (key, value) in map {
        let child = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        if let Value::Object(inner) = value {
            writeln!(out, "\n[{child}]").expect("writing to a string");
            table(out, &child, inner);
        } else if is_array_of_tables(value) {
            for entry in value.as_array().into_iter().flatten().filter_map(Value::as_object) {
                writeln!(out, "\n[[{child}]]").expect("writing to a string");
                table(out, &child, entry);
            }
        }
    }
}

/// A value on one line: a string, number or boolean, or an array or inline table of them.
fn inline(value: &Value) -> String {
    match value {
        Value::Null => "\"\"".to_owned(),
        Value::String(s) => toml_string(s),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::Array(items) => format!("[{}]", items.iter().map(inline).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("{} = {}", bare_or_quoted(k), inline(v)))
                .collect();
            format!("{{ {} }}", fields.join(", "))
        }
    }
}

/// A TOML basic string (JSON's escapes are TOML's, for every character JSON escapes).
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

fn bare_or_quoted(key: &str) -> String {
    let bare = !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare { key.to_owned() } else { toml_string(key) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is printed reads back as the same config, secrets aside.
    #[test]
    fn the_printed_config_reads_back_as_itself() {
        let text = r#"
            [server]
            listen = "127.0.0.1:9000"
            admin_listen = "127.0.0.1:9001"
            admin_token = "a-token-of-16-bytes"
            [store]
            kind = "redis"
            url = "redis://user:pass@127.0.0.1:6379/0"
            [upstream]
            kind = "s3"
            endpoint = "http://127.0.0.1:9100"
            access_key_id = "k"
            secret_access_key = "the-upstream-secret"
            [fencing]
            [[fencing.rules]]
            bucket = "b"
            prefix = "p/\"q\"\t"
            resource = "r"
            [[credentials]]
            access_key_id = "k"
            secret_access_key = "s"
            buckets = ["b"]
        "#;
        let config = Config::from_toml(text).unwrap();
        let shown = to_toml(&config);
        assert!(!shown.contains("the-upstream-secret") && !shown.contains("a-token-of-16-bytes"), "{shown}");
        assert!(!shown.contains("pass@"), "{shown}");
        assert!(shown.contains("# admin_read_token: not set"), "{shown}");
        let again = Config::from_toml(&shown).unwrap_or_else(|e| panic!("{e}\n{shown}"));
        assert_eq!(to_toml(&again), shown);
        assert_eq!(again.fencing.rules[0].prefix, "p/\"q\"\t");
    }
}
