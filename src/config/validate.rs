//! What serde cannot check: one validator per section, each naming the key at fault
//! (`routes[2].prefix` for an entry of an array of tables), and the risky combinations that
//! start but that `check-config` names.

use super::*;

impl Config {
    /// Combinations that start but that an operator should not run by accident; printed by
    /// `fencegate check-config` and logged as warnings at start.
    pub fn risks(&self) -> Vec<String> {
        let mut risks = Vec::new();
        if !self.server.admin_listen.ip().is_loopback() {
            risks.push(format!(
                "server.admin_listen ({}) is reachable from other hosts: whoever has server.admin_token can raise \
                 every fence for good",
                self.server.admin_listen
            ));
        }
        // On a loopback listener only this host's processes can sign: the shipped config's
        // development credential is a risk once the listener is reachable from elsewhere.
        let reachable = !self.server.listen.ip().is_loopback();
        for c in self.credentials.iter().filter(|_| reachable) {
            if c.access_key_id == DEV_ACCESS_KEY_ID || c.secret_access_key.expose() == DEV_SECRET_ACCESS_KEY {
                risks.push(format!(
                    "credentials {:?}: the development credential from the shipped config is public; anyone can \
                     sign with it{}",
                    c.access_key_id,
                    match c.role {
                        Role::Issuer => " and grant leases",
                        Role::Lessee => " and take leases",
                        Role::Writer => "",
                    }
                ));
            }
        }
        if self.store.kind == StoreKind::Redis && self.store.accept_unsynced_changes {
            risks.push(
                "store.accept_unsynced_changes = true: fencegate starts on a Redis whose settings can lose an \
                 acknowledged advance, grant or registration (a restart from a snapshot, a power loss, a failover), \
                 after which an older write can commit after a newer one"
                    .to_owned(),
            );
        }
        risks.extend(self.routes.iter().flat_map(route_risks));
        if self.store.kind != StoreKind::Embedded
            && self.upstream.request_timeout_ms > self.fencing.inflight_deadline_ms
        {
            risks.push(format!(
                "upstream.request_timeout_ms ({}) is above fencing.inflight_deadline_ms ({}) with a shared store: a \
                 slow write's registration can expire while it may still commit",
                self.upstream.request_timeout_ms, self.fencing.inflight_deadline_ms
            ));
        }
        if !self.server.listen.ip().is_loopback() && self.server.tls_cert_path.is_none() {
            risks.push(format!(
                "server.listen ({}) is reachable from other hosts without TLS: request bodies and lease ids travel \
                 in clear",
                self.server.listen
            ));
        }
        risks
    }

    /// Checks what serde cannot: one validator per section, each naming the key at fault
    /// (`routes[2].prefix` for an entry of an array of tables).
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        check_log_level(&self.log.level).map_err(|e| invalid("log.level", e))?;
        self.validate_server()?;
        self.validate_store()?;
        self.validate_upstream()?;
        self.validate_credentials()?;
        self.validate_fencing()?;
        self.validate_routes()
    }

    fn validate_server(&self) -> Result<(), Invalid> {
        let server = &self.server;
        if let Some(token) = &server.admin_token
            && token.expose().len() < ADMIN_TOKEN_BYTES_MIN
        {
            // An empty one comes from an unset shell variable (FENCEGATE_SERVER__ADMIN_TOKEN=$X),
            // and "Bearer " then opened the admin API; a short one can be guessed.
            return Err(invalid(
                "server.admin_token",
                format!(
                    "must be at least {ADMIN_TOKEN_BYTES_MIN} bytes (it is {}): whoever guesses it can raise every fence",
                    token.expose().len()
                ),
            ));
        }
        if let Some(read) = &server.admin_read_token {
            let Some(admin) = &server.admin_token else {
                return Err(invalid(
                    "server.admin_read_token",
                    "needs server.admin_token: without it, every caller may already change everything",
                ));
            };
            if read.expose().len() < ADMIN_TOKEN_BYTES_MIN {
                return Err(invalid(
                    "server.admin_read_token",
                    format!("must be at least {ADMIN_TOKEN_BYTES_MIN} bytes (it is {})", read.expose().len()),
                ));
            }
            if read.expose() == admin.expose() {
                return Err(invalid(
                    "server.admin_read_token",
                    "must differ from server.admin_token: a read token that is the admin token changes everything",
                ));
            }
        }
        if !server.admin_listen.ip().is_loopback() && server.admin_token.is_none() {
            // Whoever reaches the admin API can raise any fence to 2^64-1 and lock it for good.
            return Err(invalid(
                "server.admin_token",
                format!(
                    "required when server.admin_listen ({}) is not a loopback address: the admin API can raise \
                     every fence (set FENCEGATE_SERVER__ADMIN_TOKEN, or listen on 127.0.0.1)",
                    server.admin_listen
                ),
            ));
        }
        if server.tls_cert_path.is_some() != server.tls_key_path.is_some() {
            return Err(invalid(
                "server.tls_key_path",
                "set both server.tls_cert_path and server.tls_key_path, or neither",
            ));
        }
        if server.threads > THREADS_MAX {
            return Err(invalid("server.threads", format!("at most {THREADS_MAX} (0: one per CPU)")));
        }
        if server.header_bytes_max < 8192 {
            return Err(invalid("server.header_bytes_max", "must be at least 8192 (hyper's minimum read buffer)"));
        }
        positive(&[
            ("server.header_read_timeout_ms", server.header_read_timeout_ms),
            ("server.idle_timeout_ms", server.idle_timeout_ms),
            ("server.admin_connections_max", server.admin_connections_max as u64),
            ("server.connections_max", server.connections_max as u64),
            ("server.shutdown_timeout_ms", server.shutdown_timeout_ms),
        ])
    }

    fn validate_store(&self) -> Result<(), Invalid> {
        let store = &self.store;
        let backend = store.backend()?;
        if let StoreBackend::Redis { cluster, .. } = backend
            && store.wait_replicas > 0
        {
            if store.wait_timeout_ms >= store.timeout_ms {
                return Err(invalid("store.wait_timeout_ms", "must be below store.timeout_ms"));
            }
            if cluster {
                return Err(invalid("store.wait_replicas", "not supported with store.cluster_urls"));
            }
        }
        match (backend, &store.witness_path) {
            (StoreBackend::Embedded { path }, Some(witness)) if witness.starts_with(path) => {
                // Restored with the store, it would agree with any copy.
                return Err(invalid("store.witness_path", "must be outside store.path"));
            }
            (StoreBackend::Redis { .. } | StoreBackend::Etcd { .. }, Some(_)) => {
                return Err(invalid("store.witness_path", "only the embedded store has a witness"));
            }
            _ => {}
        }
        if backend.is_shared() && self.fencing.inflight_deadline_ms < crate::fence::SHARED_INFLIGHT_DEADLINE_MS_MIN {
            // Safety holds for any D (the store keeps a registration D past the latest
            // hand-over, `fence::bounds`); below this, renewals cannot keep a registration
            // inside its hand-over window and every write longer than a few ticks is cut off.
            return Err(invalid(
                "fencing.inflight_deadline_ms",
                format!(
                    "must be at least {} with a shared store: a replica hands bodies over only in the first \
                     quarter of a registration's renewal period, which the renewals (every eighth of the \
                     deadline, checked every 50 ms) must keep young",
                    crate::fence::SHARED_INFLIGHT_DEADLINE_MS_MIN
                ),
            ));
        }
        positive(&[
            ("store.timeout_ms", store.timeout_ms),
            ("store.idempotency_records_bytes_max", store.idempotency_records_bytes_max),
            ("store.upload_records_per_caller_max", store.upload_records_per_caller_max),
            ("store.upload_records_per_resource_max", store.upload_records_per_resource_max),
            ("store.upload_records_max", store.upload_records_max),
            ("store.upload_records_bytes_max", store.upload_records_bytes_max),
        ])
    }

    fn validate_upstream(&self) -> Result<(), Invalid> {
        let upstream = &self.upstream;
        upstream.backend()?;
        positive(&[
            ("upstream.request_timeout_ms", upstream.request_timeout_ms),
            ("upstream.connect_timeout_ms", upstream.connect_timeout_ms),
            ("upstream.health_interval_ms", upstream.health_interval_ms),
        ])
    }

    fn validate_credentials(&self) -> Result<(), Invalid> {
        if self.credentials.is_empty() {
            return Err(invalid(
                "credentials",
                "at least one [[credentials]] entry is required: fencegate only serves signed requests",
            ));
        }
        for (i, c) in self.credentials.iter().enumerate() {
            if c.access_key_id.is_empty() || c.secret_access_key.is_empty() {
                return Err(invalid(
                    format!("credentials[{i}]"),
                    "access_key_id and secret_access_key must not be empty",
                ));
            }
            if c.access_key_id.starts_with(super::LEASE_ACCESS_KEY_PREFIX) {
                return Err(invalid(
                    format!("credentials[{i}].access_key_id"),
                    format!(
                        "{:?}: ids starting with {:?} are lease credentials' (docs/leases.md)",
                        c.access_key_id,
                        super::LEASE_ACCESS_KEY_PREFIX
                    ),
                ));
            }
        }
        Ok(())
    }

    fn validate_fencing(&self) -> Result<(), Invalid> {
        let fencing = &self.fencing;
        for (key, name) in
            [("fencing.token_header", &fencing.token_header), ("fencing.resource_header", &fencing.resource_header)]
        {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(invalid(key, format!("{name:?} is not a valid header name")));
            }
        }
        for (i, rule) in fencing.rules.iter().enumerate() {
            if rule.bucket.is_empty() {
                return Err(invalid(format!("fencing.rules[{i}].bucket"), "must not be empty"));
            }
            if let Err(e) = crate::fence::ResourceKey::new(&rule.resource) {
                return Err(invalid(format!("fencing.rules[{i}].resource"), format!("{:?}: {e}", rule.resource)));
            }
        }
        positive(&[
            ("fencing.inflight_deadline_ms", fencing.inflight_deadline_ms),
            ("fencing.inflight_per_resource_max", fencing.inflight_per_resource_max as u64),
        ])?;
        if fencing.inflight_per_caller_max.is_some_and(|n| n == 0 || n > fencing.inflight_per_resource_max) {
            return Err(invalid(
                "fencing.inflight_per_caller_max",
                "must be greater than 0 and at most fencing.inflight_per_resource_max",
            ));
        }
        // A completion admitted just before its upload's token was superseded reaches the
        // upstream within the request timeout and commits within D of that (the assumption),
        // measured on clocks that may run apart by the drift allowed everywhere else.
        let completion_ms = self.upload_completion_ms();
        if fencing.abort_stale_uploads_after_ms != 0 && fencing.abort_stale_uploads_after_ms < completion_ms {
            return Err(invalid(
                "fencing.abort_stale_uploads_after_ms",
                format!(
                    "must be 0 (never) or at least {completion_ms} (upstream.request_timeout_ms plus \
                     fencing.inflight_deadline_ms, and 8 % for clock drift): a completion admitted before its \
                     upload was superseded may still commit until then"
                ),
            ));
        }
        if fencing.abort_uploads_after_ms < 2 * completion_ms {
            return Err(invalid(
                "fencing.abort_uploads_after_ms",
                format!(
                    "must be at least {} (twice upstream.request_timeout_ms plus fencing.inflight_deadline_ms, \
                     and 8 % for clock drift): what fencegate keeps for a caller expires; parts and \
                     completions are refused for the last {completion_ms} ms, so that none is in flight \
                     when the upload is aborted",
                    2 * completion_ms
                ),
            ));
        }
        Ok(())
    }

    fn validate_routes(&self) -> Result<(), Invalid> {
        for (i, route) in self.routes.iter().enumerate() {
            let key = |field: &str| format!("routes[{i}].{field}");
            if !route.prefix.starts_with('/') || !route.prefix.ends_with('/') {
                return Err(invalid(key("prefix"), format!("{:?} must start and end with '/'", route.prefix)));
            }
            if route.prefix.starts_with("/_fencegate/") {
                return Err(invalid(key("prefix"), "/_fencegate/ is reserved for fencegate's own endpoints"));
            }
            if route.buffered_bytes_max < route.body_bytes_max {
                return Err(invalid(key("buffered_bytes_max"), "must be at least routes.body_bytes_max"));
            }
            let uri: http::Uri =
                route.upstream.parse().map_err(|e| invalid(key("upstream"), format!("{:?}: {e}", route.upstream)))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
                return Err(invalid(
                    key("upstream"),
                    format!("{:?} must be an http:// or https:// URL", route.upstream),
                ));
            }
            if route.resource.is_empty() {
                return Err(invalid(key("resource"), "must not be empty"));
            }
        }
        Ok(())
    }
}

/// A key at fault and why.
pub type Invalid = (String, String);

pub(super) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Invalid {
    (key.into(), reason.into())
}

/// Each of `values` must be above 0.
fn positive(values: &[(&str, u64)]) -> Result<(), Invalid> {
    match values.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(invalid(*key, "must be greater than 0")),
        None => Ok(()),
    }
}

/// `log.level`: a level (`trace`, `debug`, `info`, `warn`, `error`, `off`) or directives
/// `target=level` separated by commas. A bare word that is no level would be read as a target
/// and turn every other log off, silently.
fn check_log_level(level: &str) -> Result<(), String> {
    let is_level = |s: &str| s.trim().parse::<tracing_subscriber::filter::LevelFilter>().is_ok();
    for directive in level.split(',') {
        let ok = match directive.rsplit_once('=') {
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
            None => is_level(directive),
        };
        if !ok {
            return Err(format!(
                "{directive:?} is neither a level (trace, debug, info, warn, error, off) nor `target=level`"
            ));
        }
    }
    Ok(())
}

/// What a route's settings risk.
fn route_risks(r: &RouteConfig) -> Vec<String> {
    let mut risks = Vec::new();
    if r.advance == AdvancePolicy::Write {
        risks.push(format!(
            "routes {:?}: advance = \"write\" lets callers fencegate does not authenticate raise the fence",
            r.prefix
        ));
    }
    if r.mode == RouteMode::IdempotencyKey
        && r.caller_headers.is_empty()
        && r.caller_header.eq_ignore_ascii_case("authorization")
    {
        risks.push(format!(
            "routes {:?}: callers are told apart by Authorization alone (routes.caller_headers is not set); \
             if the API takes its key in another header (X-Api-Key, a cookie), one caller can be answered \
             with another's recorded response",
            r.prefix
        ));
    }
    risks
}
