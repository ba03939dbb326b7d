//! `fencegate reconcile`: asks a running fencegate (its admin listener, as the config names
//! it) to compare its upstream with its fences (`POST /v1/reconcile`, `upkeep::reconcile`), shows
//! what it finds as it finds it, and exits non-zero when it found anything, so that cron and
//! CI can run it.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Config;

/// What the command was asked.
pub struct Ask {
    pub bucket: Option<String>,
    pub prefix: String,
    /// The kinds of findings to fix.
    pub apply: Vec<crate::jobs::ApplyKind>,
    /// JSON lines on stdout (one per finding, then the summary) instead of a table.
    pub json: bool,
    /// `Job::old_upload_after_ms`, when asked (else the server's default, and the request reads
    /// as it did before the field existed).
    pub old_upload_after_ms: Option<u64>,
}

/// How a reconciliation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Clean,
    Found,
}

/// Runs one reconciliation against the fencegate `config` describes.
pub async fn reconcile(config: &Config, ask: &Ask) -> anyhow::Result<Outcome> {
    let admin = reachable(config.server.admin_listen);
    let stream = tokio::net::TcpStream::connect(admin).await.with_context(|| {
        format!("cannot reach fencegate's admin listener at {admin} (server.admin_listen): is it running?")
    })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    if ask.apply.contains(&crate::jobs::ApplyKind::RaiseFence) {
        eprintln!(
            "fencegate reconcile: raising fences to objects' stamps: a stamp is not authenticated, whoever can \
             write the upstream directly can forge one (and lock a resource's older tokens out)"
        );
    }
    // Nothing to apply is sent as `false`, which a fencegate of any version reads.
    let apply = if ask.apply.is_empty() { serde_json::json!(false) } else { serde_json::json!(ask.apply) };
    let mut body = serde_json::json!({ "bucket": ask.bucket, "prefix": ask.prefix, "apply": apply });
    if let Some(ms) = ask.old_upload_after_ms {
        body["old_upload_after_ms"] = ms.into();
    }
    let mut req = http::Request::post("/v1/reconcile")
        .header(http::header::HOST, admin.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    if let Some(token) = &config.server.admin_token {
        let value = http::HeaderValue::from_str(&format!("Bearer {}", token.expose()))
            .context("server.admin_token is not a header value")?;
        req.headers_mut().insert(http::header::AUTHORIZATION, value);
    }
    let resp = sender.send_request(req).await.context("the reconcile request failed")?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let detail: Value = serde_json::from_slice(&text).unwrap_or(Value::Null);
        anyhow::bail!("fencegate answered {status}: {}", detail["detail"].as_str().unwrap_or("(no detail)"));
    }
    let mut out = Output::new(ask.json);
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.context("the reconcile answer broke off")?.into_data() else { continue };
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let event: Value = serde_json::from_slice(&line).context("fencegate sent a line that is not JSON")?;
            if let Some(outcome) = out.event(&event)? {
                return Ok(outcome);
            }
        }
    }
    anyhow::bail!("the reconcile answer ended before its summary")
}

/// The admin listener as a client on this host reaches it (`fencegate health`, `reconcile`): an
/// unspecified address is this host's loopback.
pub fn reachable(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

/// Findings as a table for people or JSON lines for scripts; progress on stderr.
struct Output {
    json: bool,
    header_shown: bool,
}

impl Output {
    fn new(json: bool) -> Self {
        Self { json, header_shown: false }
    }

    /// Shows one event; the outcome once the scan ended.
    fn event(&mut self, event: &Value) -> anyhow::Result<Option<Outcome>> {
        let mut stdout = std::io::stdout().lock();
        match event["event"].as_str() {
            Some("progress") => {
                eprintln!(
                    "scanned {} gateway records, {} uploads, {} objects",
                    event["records"], event["uploads"], event["objects"]
                );
            }
            Some("finding") if self.json => writeln!(stdout, "{event}")?,
            Some("finding") => self.finding(&mut stdout, event)?,
            Some("done") => return Ok(Some(self.done(&mut stdout, event)?)),
            Some("failed") => anyhow::bail!("the reconciliation failed: {}", event["error"].as_str().unwrap_or("?")),
            _ => {}
        }
        Ok(None)
    }

    /// One finding, as a line of the table (its header first) or of JSON.
    fn finding(&mut self, stdout: &mut impl Write, event: &Value) -> anyhow::Result<()> {
        if !self.header_shown {
            writeln!(
                stdout,
                "{:<20} {:<52} {:<30} {:>8} {:>8}  {:<40}  ACTION",
                "FINDING", "KEY", "RESOURCE", "TOKEN", "FENCE", "UPLOAD OR OBJECT TIME"
            )?;
            self.header_shown = true;
        }
        let token = event.get("token").or_else(|| event.get("stamp")).and_then(Value::as_u64);
        // A gateway record's key is the one the API was sent, to look it up there.
        let key = event.get("key").or_else(|| event.get("upstream_key")).or_else(|| event.get("name"));
        let show = |v: Option<u64>| v.map_or("-".to_owned(), |n| n.to_string());
        writeln!(
            stdout,
            "{:<20} {:<52} {:<30} {:>8} {:>8}  {:<40}  {}",
            event["kind"].as_str().unwrap_or("?"),
            shown(key.and_then(Value::as_str).unwrap_or("")),
            shown(event["resource"].as_str().unwrap_or("")),
            show(token),
            show(event["fence"].as_u64()),
            shown(&detail(event)),
            shown(&match (event["cause"].as_str(), event["error"].as_str()) {
                (Some(cause), _) => {
                    format!("ask the API ({cause}) behind {}", event["route"].as_str().unwrap_or("?"))
                }
                (None, Some(error)) => format!("unreadable: {error}"),
                (None, None) => action(&event["action"]),
            }),
        )?;
        Ok(())
    }

    /// The scan's summary, and what it came to.
    fn done(&self, stdout: &mut impl Write, event: &Value) -> anyhow::Result<Outcome> {
        let findings = event["findings"].as_u64().unwrap_or(0);
        if self.json {
            writeln!(stdout, "{event}")?;
        } else {
            writeln!(
                stdout,
                "{findings} found in {} gateway records, {} uploads and {} objects; {} applied",
                event["records"], event["uploads"], event["objects"], event["applied"]
            )?;
            if let Some(n) = event["unattributed"].as_u64().filter(|n| *n > 0) {
                writeln!(
                    stdout,
                    "{n} stamped objects outside every rule: their writers named their resource, which an \
                     object does not record, so their stamps are not judged (add a [[fencing.rules]] entry \
                     for their prefix to have them checked)"
                )?;
            }
            if let Some(n) = event["in_flight"].as_u64().filter(|n| *n > 0) {
                writeln!(
                    stdout,
                    "{n} gateway requests still within their claim's window: run again once it closed to know their outcome"
                )?;
            }
        }
        Ok(if findings == 0 { Outcome::Clean } else { Outcome::Found })
    }
}

/// What tells a finding apart beyond its key: an upload's id and when it was created, an
/// object's last modification as the upstream lists it.
fn detail(event: &Value) -> String {
    let when = |ms: Option<u64>| {
        let at =
            time::OffsetDateTime::from_unix_timestamp(i64::try_from(ms.filter(|ms| *ms > 0)? / 1000).ok()?).ok()?;
        at.format(&time::format_description::well_known::Rfc3339).ok()
    };
    match (event["upload_id"].as_str(), event["modified"].as_str()) {
        (Some(id), _) => match when(event["created_at_ms"].as_u64()) {
            Some(created) => format!("{id} created {created}"),
            None => id.to_owned(),
        },
        (None, Some(modified)) => format!("modified {modified}"),
        (None, None) => when(event["claimed_at_ms"].as_u64()).map(|t| format!("claimed {t}")).unwrap_or_default(),
    }
}

/// A name as the terminal shows it: control and format characters escaped (a key can hold
/// any), so that no key moves the cursor, retitles the window or reorders the line around it
/// (bidirectional overrides).
fn shown(name: &str) -> String {
    name.chars().map(|c| if prints(c) { c.to_string() } else { c.escape_unicode().to_string() }).collect()
}

/// Whether `c` shows as itself: not a control, not a space other than U+0020, not one of
/// Unicode's format characters nor its default-ignorable code points (bidirectional marks and
/// overrides, zero-width characters, the soft hyphen, variation selectors, Hangul fillers,
/// tags: they reorder a line or make two names look alike), not a private-use character nor a
/// noncharacter. The console escapes the same set (console.html, `INVISIBLE`).
fn prints(c: char) -> bool {
    let hidden = c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(c,
            // Default_Ignorable_Code_Point (Unicode 15.1)
            '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}'..='\u{1160}' | '\u{17B4}'..='\u{17B5}'
            | '\u{180B}'..='\u{180F}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2060}'..='\u{206F}'
            | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}' | '\u{FFA0}' | '\u{FFF0}'..='\u{FFF8}'
            | '\u{1BCA0}'..='\u{1BCA3}' | '\u{1D173}'..='\u{1D17A}' | '\u{E0000}'..='\u{E0FFF}'
            // the other format characters (Cf)
            | '\u{0600}'..='\u{0605}' | '\u{06DD}' | '\u{070F}' | '\u{0890}'..='\u{0891}' | '\u{08E2}'
            | '\u{FFF9}'..='\u{FFFB}' | '\u{110BD}' | '\u{110CD}' | '\u{13430}'..='\u{1343F}'
            // private use, and noncharacters
            | '\u{E000}'..='\u{F8FF}' | '\u{F0000}'..='\u{10FFFF}' | '\u{FDD0}'..='\u{FDEF}')
        || (c as u32 & 0xFFFE) == 0xFFFE;
    !hidden
}

fn action(value: &Value) -> String {
    match value {
        Value::String(s) if s == "none" => "-".into(),
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("failed").and_then(Value::as_str).map_or("failed".into(), |e| format!("failed: {e}")),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Control and bidirectional characters are shown escaped; the rest as they are.
    #[test]
    fn names_cannot_rewrite_the_terminal() {
        assert_eq!(shown("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(shown("pay\u{202e}nem"), "pay\\u{202e}nem");
        assert_eq!(shown("zero\u{200b}width"), "zero\\u{200b}width");
        assert_eq!(shown("été/報告.csv"), "été/報告.csv");
        // Look-alikes: a soft hyphen, a variation selector, a Hangul filler, a no-break space,
        // a tag character.
        for (name, escaped) in [
            ("in\u{ad}voice", "in\\u{ad}voice"),
            ("job\u{fe0f}", "job\\u{fe0f}"),
            ("a\u{3164}b", "a\\u{3164}b"),
            ("a\u{a0}b", "a\\u{a0}b"),
            ("a\u{e0041}", "a\\u{e0041}"),
            ("a\u{034f}b", "a\\u{34f}b"),
        ] {
            assert_eq!(shown(name), escaped);
        }
        assert_eq!(shown("a b"), "a b");
    }
}
