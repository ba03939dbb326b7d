use super::*;

const MINIMAL: &str = r#"
    [server]
    listen = "127.0.0.1:9000"
    admin_listen = "127.0.0.1:9001"
    [store]
    kind = "embedded"
    path = "data/fences"
    [upstream]
    kind = "local"
    path = "data/objects"
    [[credentials]]
    access_key_id = "k"
    secret_access_key = "s"
"#;

#[test]
fn risky_combinations_are_named_and_a_plain_config_has_none() {
    let plain = Config::from_toml(MINIMAL).unwrap();
    assert!(plain.risks().is_empty(), "{:?}", plain.risks());
    assert_eq!(plain.credentials[0].role, Role::Writer, "least privilege by default");
    let dev = MINIMAL.replace("access_key_id = \"k\"", "access_key_id = \"fencegate-dev\"\nrole = \"issuer\"");
    assert!(Config::from_toml(&dev).unwrap().risks().is_empty(), "only this host can sign on loopback");
    let dev = dev.replace("listen = \"127.0.0.1:9000\"", "listen = \"0.0.0.0:9000\"");
    let risks = Config::from_toml(&dev).unwrap().risks();
    assert!(risks.iter().any(|r| r.contains("development credential") && r.contains("grant leases")), "{risks:?}");
    let open = MINIMAL.replace("listen = \"127.0.0.1:9000\"", "listen = \"0.0.0.0:9000\"").replace(
        "admin_listen = \"127.0.0.1:9001\"",
        "admin_listen = \"0.0.0.0:9001\"\nadmin_token = \"a-token-of-16-bytes\"",
    );
    let risks = Config::from_toml(&open).unwrap().risks();
    assert_eq!(risks.len(), 2, "{risks:?}");
    assert!(risks.iter().any(|r| r.starts_with("server.admin_listen")));
    assert!(risks.iter().any(|r| r.starts_with("server.listen") && r.contains("without TLS")));
}

#[test]
fn an_entry_of_an_array_of_tables_is_named_by_its_index() {
    let route = |prefix: &str| {
        format!(
            "[[routes]]\nprefix = {prefix:?}\nupstream = \"http://127.0.0.1:1\"\nresource = \"api\"\nmode = \"fence-only\"\n"
        )
    };
    let bad = format!("{MINIMAL}{}{}", route("/ok/"), route("no-slash"));
    let Err(e) = Config::from_toml(&bad) else { panic!("a route without '/' accepted") };
    assert!(e.to_string().contains("routes[1].prefix"), "{e}");
    let rule = format!("{MINIMAL}[[fencing.rules]]\nbucket = \"\"\nresource = \"r\"\n");
    let rule = rule.replacen("[[credentials]]", "[fencing]\n[[credentials]]", 1);
    let Err(e) = Config::from_toml(&rule) else { panic!("a rule without a bucket accepted") };
    assert!(e.to_string().contains("fencing.rules[0].bucket"), "{e}");
}

#[test]
fn an_admin_token_shorter_than_16_bytes_is_refused() {
    for token in ["", "t", "fifteen-bytes!!"] {
        let short = MINIMAL.replace("[server]", &format!("[server]\nadmin_token = {token:?}"));
        let Err(e) = Config::from_toml(&short) else { panic!("{token:?} accepted") };
        assert!(e.to_string().contains("server.admin_token"), "{e}");
    }
    let ok = MINIMAL.replace("[server]", "[server]\nadmin_token = \"sixteen-bytes!!!\"");
    assert!(Config::from_toml(&ok).is_ok());
}

#[test]
fn the_minimal_config_gets_documented_defaults() {
    let c = Config::from_toml(MINIMAL).unwrap();
    assert!(c.fencing.require_token);
    assert_eq!(c.fencing.token_header, "Fencing-Token");
    assert_eq!(c.store.timeout_ms, 2_000);
}

#[test]
fn serving_threads_default_to_one_per_cpu_and_are_bounded() {
    let c = Config::from_toml(MINIMAL).unwrap();
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!((c.server.threads, c.server.serving_threads()), (0, cpus));
    let three = MINIMAL.replace("[server]", "[server]\nthreads = 3");
    assert_eq!(Config::from_toml(&three).unwrap().server.serving_threads(), 3);
    let too_many = MINIMAL.replace("[server]", "[server]\nthreads = 1025");
    let error = Config::from_toml(&too_many).unwrap_err().to_string();
    assert!(error.contains("server.threads") && error.contains("1024"), "{error}");
}

#[test]
fn errors_name_the_key() {
    let err = Config::from_toml(&MINIMAL.replace("kind = \"local\"", "kind = \"s3\"")).unwrap_err();
    assert!(err.to_string().contains("upstream.endpoint"), "{err}");
    let s3 = |endpoint: &str| {
        let upstream = format!(
            "kind = \"s3\"\nendpoint = \"{endpoint}\"\naccess_key_id = \"k\"\nsecret_access_key = \"s\"\nprobe_bucket = \"b\""
        );
        Config::from_toml(&MINIMAL.replace("kind = \"local\"", &upstream))
    };
    for root in ["http://127.0.0.1:9000", "http://127.0.0.1:9000/"] {
        assert!(s3(root).is_ok(), "{root}: {:?}", s3(root).err());
    }
    for with_path in ["http://127.0.0.1:9000/prefix", "http://127.0.0.1:9000/?x=1"] {
        let err = s3(with_path).unwrap_err().to_string();
        assert!(err.contains("upstream.endpoint") && err.contains("without a path"), "{with_path}: {err}");
    }
    let err = Config::from_toml(&MINIMAL.replace("listen = \"127.0.0.1:9000\"", "listen = \"nope\"")).unwrap_err();
    assert!(err.to_string().contains("listen"), "{err}");
    let err = Config::from_toml(&format!("{MINIMAL}\n[fencing]\nrequire_tokn = true\n")).unwrap_err();
    assert!(err.to_string().contains("require_tokn"), "{err}");
}

/// The defaults agree with each other on every store kind: with a shared store, the upstream's
/// timeout defaults to the in-flight deadline (before: 300 s against 30 s, a `risk:` line on a
/// config that set neither); set explicitly above it, the risk is named.
#[test]
fn the_defaults_raise_no_risk_on_any_store_kind() {
    let shared = [
        "kind = \"redis\"\nurl = \"redis://127.0.0.1:6379\"",
        "kind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]",
    ];
    for store in shared.iter().filter(|s| cfg!(feature = "etcd") || !s.contains("etcd")) {
        let text = MINIMAL.replace("kind = \"embedded\"\n    path = \"data/fences\"", store);
        let config = Config::from_toml(&text).unwrap();
        assert!(config.risks().is_empty(), "{store}: {:?}", config.risks());
        assert_eq!(config.upstream.request_timeout_ms, config.fencing.inflight_deadline_ms);
        let explicit = text.replace("kind = \"local\"", "kind = \"local\"\n    request_timeout_ms = 60000");
        let risks = Config::from_toml(&explicit).unwrap().risks();
        assert!(risks.len() == 1 && risks[0].starts_with("upstream.request_timeout_ms"), "{risks:?}");
    }
    assert_eq!(Config::from_toml(MINIMAL).unwrap().upstream.request_timeout_ms, 300_000);
}
