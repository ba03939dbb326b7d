//! Configuration: one struct, read from a TOML file and the environment, validated once at
//! start-up. Every limit has a unit in its name and a documented default
//! (docs/configuration.md).
//!
//! Environment overrides: `FENCEGATE_<SECTION>__<KEY>`, e.g. `FENCEGATE_SERVER__LISTEN` or
//! `FENCEGATE_UPSTREAM__SECRET_ACCESS_KEY`; they win over the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::Deserialize;

/// The environment prefix of every override.
pub const ENV_PREFIX: &str = "FENCEGATE_";

/// The most `server.threads` fencegate starts: each is an OS thread with a runtime and a pool
/// of upstream connections.
const THREADS_MAX: usize = 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub upstream: UpstreamConfig,
    #[serde(default)]
    pub credentials: Vec<CredentialConfig>,
    #[serde(default)]
    pub fencing: FencingConfig,
    #[serde(default)]
    pub leases: LeasesConfig,
    /// Third-party HTTP APIs behind the same gate (README.md, "HTTP API gateway").
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub log: LogConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeasesConfig {
    /// The longest lease a client may ask for.
    #[serde(default = "defaults::lease_ttl_ms_max")]
    pub ttl_ms_max: u64,
}

impl Default for LeasesConfig {
    fn default() -> Self {
        Self { ttl_ms_max: defaults::lease_ttl_ms_max() }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The S3 (and API gateway) listener.
    pub listen: SocketAddr,
    /// The admin listener: health, metrics, fences. Keep it off public networks.
    pub admin_listen: SocketAddr,
    /// When set, the admin API wants `Authorization: Bearer <admin_token>`.
    #[serde(default)]
    pub admin_token: Option<Secret>,
    /// PEM certificate chain: when set (with `tls_key_path`), the main listener speaks HTTPS
    /// (HTTP/1.1 and HTTP/2 through ALPN).
    #[serde(default)]
    pub tls_cert_path: Option<PathBuf>,
    /// PEM private key of `tls_cert_path`.
    #[serde(default)]
    pub tls_key_path: Option<PathBuf>,
    /// Base domain for virtual-hosted addressing (`bucket.<domain>`); path-style always works.
    #[serde(default)]
    pub domain: Option<String>,
    /// Largest request head (request line and headers) accepted.
    #[serde(default = "defaults::header_bytes_max")]
    pub header_bytes_max: usize,
    /// Largest request body accepted (S3's own limit for one PUT is 5 GiB).
    #[serde(default = "defaults::body_bytes_max")]
    pub body_bytes_max: u64,
    /// Time a client has to send its request head.
    #[serde(default = "defaults::header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// A connection on which no byte moved, either way, for this long is closed. It counts
    /// during a request too (a silent upstream call), so it stays above
    /// `upstream.request_timeout_ms` by default.
    #[serde(default = "defaults::idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// Open client connections at most; further ones wait in the kernel's backlog.
    #[serde(default = "defaults::connections_max")]
    pub connections_max: usize,
    /// Open admin connections at most (probes and metrics scrapes need few).
    #[serde(default = "defaults::admin_connections_max")]
    pub admin_connections_max: usize,
    /// Host names the admin listener answers to besides the address it listens on (and
    /// `localhost` on a loopback or unspecified address): any other `Host` gets 421, so that a
    /// web page whose name was rebound to this address cannot reach the admin API.
    #[serde(default)]
    pub admin_host_names: Vec<String>,
    /// How long a stop (SIGTERM, SIGINT) may take: open requests finish and writes in flight
    /// settle within it; what is still in flight after it is left to the next start (which
    /// then holds advances for `fencing.inflight_deadline_ms`, as after a crash). Below the 10 s
    /// `docker stop` and Kubernetes give before SIGKILL.
    #[serde(default = "defaults::shutdown_timeout_ms")]
    pub shutdown_timeout_ms: u64,
    /// Accept SigV2 signatures (off by default, as S3 in every region opened since 2014). SigV2
    /// signs neither the body nor the fencing headers: a SigV2 request never raises a fence,
    /// grants a lease or registers a token, and its `Date` must be within 15 minutes.
    #[serde(default)]
    pub sigv2: bool,
    /// Threads serving the main listener's connections, each with a runtime and upstream
    /// connections of its own (`crate::net::threads`); 0: one per CPU.
    #[serde(default)]
    pub threads: usize,
}

impl FencingConfig {
    /// [`FencingConfig::inflight_per_caller_max`], with its default resolved.
    pub fn inflight_per_caller(&self) -> usize {
        self.inflight_per_caller_max.unwrap_or((self.inflight_per_resource_max / 2).max(1))
    }
}

impl ServerConfig {
    /// [`ServerConfig::threads`], with 0 resolved to the number of CPUs fencegate may use.
    pub fn serving_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    Embedded,
    Redis,
    Etcd,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// Directory of the embedded store.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Redis URL of the redis store (`redis://host:port/db`, `rediss://` for TLS).
    #[serde(default)]
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster, instead of `url`.
    #[serde(default)]
    pub cluster_urls: Vec<String>,
    /// Embedded store: idempotency records kept at most (the API gateway's); beyond, those that
    /// expire first are dropped, so route traffic cannot fill the disk under the fences.
    #[serde(default = "defaults::store_idempotency_records_max")]
    pub idempotency_records_max: usize,
    /// Embedded store: the bytes those records take at most (keys, claims, recorded responses).
    #[serde(default = "defaults::store_idempotency_records_bytes_max")]
    pub idempotency_records_bytes_max: u64,
    /// Redis: after every change of a fence, a grant or a registration, wait until this many
    /// Redis replicas have it (`WAIT`), and fail closed (503) when fewer confirm within
    /// `wait_timeout_ms`. 0: do not wait.
    #[serde(default)]
    pub wait_replicas: u32,
    /// Redis: how long a change waits for `wait_replicas`.
    #[serde(default = "defaults::store_wait_timeout_ms")]
    pub wait_timeout_ms: u64,
    /// etcd: client URLs of the cluster's members (`http://host:2379`).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// This replica's name in the shared in-flight registry; default: host name and process id.
    #[serde(default)]
    pub replica_id: Option<String>,
    /// The embedded store's page cache (redb); the rest of the file is read from disk.
    #[serde(default = "defaults::store_cache_bytes_max")]
    pub cache_bytes_max: usize,
    /// A store call that takes longer has an unknown outcome: the write gets 503.
    #[serde(default = "defaults::store_timeout_ms")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamKind {
    Local,
    S3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeMode {
    /// Probe, and refuse to start if the upstream ignores preconditions.
    Require,
    /// Probe, and warn loudly if the upstream ignores preconditions.
    Warn,
    /// Do not probe.
    Off,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub kind: UpstreamKind,
    /// Directory of the local upstream; each bucket is a sub-directory.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Base URL of the S3-compatible upstream (`http://127.0.0.1:9100`, `https://s3.amazonaws.com`).
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default = "defaults::region")]
    pub region: String,
    #[serde(default)]
    pub access_key_id: Option<String>,
    #[serde(default)]
    pub secret_access_key: Option<Secret>,
    #[serde(default = "defaults::upstream_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Time from sending a request to the upstream until its response head arrives.
    #[serde(default = "defaults::upstream_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Idle pooled connections kept per upstream host.
    #[serde(default = "defaults::upstream_idle_connections_max")]
    pub idle_connections_max: usize,
    /// The start-up probe of precondition support (G6).
    #[serde(default = "defaults::probe")]
    pub probe: ProbeMode,
    /// Bucket the probe writes its object into; default: the first bucket listed.
    #[serde(default)]
    pub probe_bucket: Option<String>,
    /// With a shared store (several replicas), fencegate refuses to start unless the probe
    /// shows that the upstream enforces preconditions (G4 across replicas depends on it).
    /// `true` starts anyway and accepts the documented risk.
    #[serde(default)]
    pub accept_no_preconditions: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialConfig {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    /// What requests signed with this credential may do.
    #[serde(default)]
    pub role: Role,
    /// Where it may read and write: `"bucket"` or `"bucket/prefix"` entries; empty: everywhere.
    #[serde(default)]
    pub buckets: Vec<String>,
}

/// The credential shipped in `config/fencegate.toml` for development: public, so flagged.
pub const DEV_ACCESS_KEY_ID: &str = "fencegate-dev";
pub const DEV_SECRET_ACCESS_KEY: &str = "fencegate-dev-secret";

/// A credential's role (docs/security.md, "Who can move a fence").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads, and writes with tokens.
    #[default]
    Writer,
    /// Also grants leases and registers tokens (`/_fencegate/v1/leases/`, `/_fencegate/v1/fences/`).
    Issuer,
    /// A worker's key: writes, and acquires, renews and releases leases (with lease
    /// credentials), but never registers a token: a grant moves a fence by one, a registration
    /// to any value (2^64-1 locks a resource for good).
    Lessee,
}

/// A secret from the config (a secret key, the admin token): never printed, not even by
/// `{:?}` (`fencegate check-config` prints the config with it).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

/// The shortest `server.admin_token` accepted.
pub const ADMIN_TOKEN_BYTES_MIN: usize = 16;

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"(secret, not shown)\"")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FencingConfig {
    /// `false`: writes without a token pass unchecked (gradual adoption). A write that carries
    /// a token is always checked.
    #[serde(default = "defaults::require_token")]
    pub require_token: bool,
    /// Request header carrying the token.
    #[serde(default = "defaults::token_header")]
    pub token_header: String,
    /// Request header naming the resource.
    #[serde(default = "defaults::resource_header")]
    pub resource_header: String,
    /// How long a newer token waits for older in-flight writes on its resource before 503.
    #[serde(default = "defaults::inflight_deadline_ms")]
    pub inflight_deadline_ms: u64,
    /// Admitted, unfinished writes per resource at most; one more gets 503.
    #[serde(default = "defaults::inflight_per_resource_max")]
    pub inflight_per_resource_max: usize,
    /// Of those, what one credential may hold: one tenant cannot fill a resource's budget.
    /// Half of `inflight_per_resource_max` (at least 1) when unset.
    #[serde(default)]
    pub inflight_per_caller_max: Option<usize>,
    /// Resources whose fence is cached in memory.
    #[serde(default = "defaults::cached_resources_max")]
    pub cached_resources_max: usize,
    /// Objects whose last ETag is remembered (saves a HEAD before a conditional write).
    #[serde(default = "defaults::etag_cache_entries_max")]
    pub etag_cache_entries_max: usize,
    /// Bodies up to this size are kept in memory while forwarded, so that a write that lost a
    /// precondition race can be retried once without the client.
    #[serde(default = "defaults::retry_body_bytes_max")]
    pub retry_body_bytes_max: usize,
    /// Who may raise a fence: any signed write (`write`), or only lease grants and
    /// registrations (`registration`; a write above the fence gets 409
    /// `FencingTokenUnregistered`).
    #[serde(default = "defaults::fencing_advance")]
    pub advance: AdvancePolicy,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// Show clients the stamp (`x-amz-meta-fencing-token`, the token that wrote the object) in
    /// GET and HEAD answers. Off: the stamp is fencegate's, and a client comparing metadata
    /// sees only its own.
    #[serde(default)]
    pub show_stamp: bool,
    /// How long a multipart upload made under a superseded token is left to its creator (who
    /// may still abort it) before fencegate aborts it; 0: never. At least the longest an
    /// admitted completion of it can take, so that none is cut short.
    #[serde(default = "defaults::abort_stale_uploads_after_ms")]
    pub abort_stale_uploads_after_ms: u64,
}

impl Default for FencingConfig {
    fn default() -> Self {
        Self {
            require_token: defaults::require_token(),
            token_header: defaults::token_header(),
            resource_header: defaults::resource_header(),
            inflight_deadline_ms: defaults::inflight_deadline_ms(),
            inflight_per_resource_max: defaults::inflight_per_resource_max(),
            inflight_per_caller_max: None,
            cached_resources_max: defaults::cached_resources_max(),
            etag_cache_entries_max: defaults::etag_cache_entries_max(),
            retry_body_bytes_max: defaults::retry_body_bytes_max(),
            advance: defaults::fencing_advance(),
            rules: Vec::new(),
            show_stamp: false,
            abort_stale_uploads_after_ms: defaults::abort_stale_uploads_after_ms(),
        }
    }
}

/// Maps objects to a resource: every key of `bucket` under `prefix` belongs to `resource`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub bucket: String,
    #[serde(default)]
    pub prefix: String,
    pub resource: String,
}

/// How a route makes writes safe for an API that knows nothing of fencing tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouteMode {
    /// Sends an `Idempotency-Key` derived from resource, token and request id, and answers
    /// retries from the recorded outcome.
    IdempotencyKey,
    /// Turns writes into `If-Match` (last ETag seen) or `If-None-Match: *` requests.
    Conditional,
    /// Checks the token and forwards.
    FenceOnly,
}

/// A third-party API behind the gate.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Path prefix on fencegate's listener (`/payments/`); matched before S3 handling.
    pub prefix: String,
    /// Base URL the rest of the path is appended to (`https://api.example.com/v1/payments/`).
    pub upstream: String,
    /// Resource template: `{n}` is the n-th path segment after the prefix (`payment:{1}`).
    pub resource: String,
    pub mode: RouteMode,
    /// Who may raise a fence through this route; `registration` by default: fencegate does not
    /// authenticate a route's callers, so a write must not be able to lock a resource.
    #[serde(default = "defaults::route_advance")]
    pub advance: AdvancePolicy,
    /// How long idempotency records are kept.
    #[serde(default = "defaults::idempotency_retention_ms")]
    pub idempotency_retention_ms: u64,
    /// From sending a request upstream until its response head.
    #[serde(default = "defaults::route_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// Largest request body forwarded (and hashed for the request id).
    #[serde(default = "defaults::route_body_bytes_max")]
    pub body_bytes_max: usize,
    /// Largest upstream response recorded for replay.
    #[serde(default = "defaults::route_response_bytes_max")]
    pub response_bytes_max: usize,
    /// Request bodies this route buffers at once (`idempotency-key` mode reads each whole
    /// before it is sent), in total; a request that would go beyond gets 503.
    #[serde(default = "defaults::route_buffered_bytes_max")]
    pub buffered_bytes_max: usize,
    /// The request header that identifies the caller; idempotency records are kept per caller
    /// (a hash of its value), so a replay reaches only the caller that made the request.
    #[serde(default = "defaults::route_caller_header")]
    pub caller_header: String,
    /// More headers that identify the caller, besides `caller_header` (an API keyed by
    /// `X-Api-Key`, a session cookie): a caller is told apart by the values of all of them.
    #[serde(default)]
    pub caller_headers: Vec<String>,
    /// PEM file of the CA certificates that verify an `https` upstream, instead of the public
    /// web PKI roots (a private CA of an internal API).
    #[serde(default)]
    pub ca_cert_path: Option<PathBuf>,
}

/// Who may raise a fence (a fence only goes up, so raising it is a privilege).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AdvancePolicy {
    /// A write with a token above the fence raises it.
    Write,
    /// Only lease grants and registrations raise a fence; a write above it is refused.
    Registration,
}

impl AdvancePolicy {
    pub fn writes_advance(self) -> bool {
        self == Self::Write
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    #[serde(default)]
    pub format: LogFormat,
    /// A `tracing` filter (`info`, `fencegate=debug`); `RUST_LOG` wins when set.
    #[serde(default = "defaults::log_level")]
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::default(), level: defaults::log_level() }
    }
}

mod defaults {
    use super::{AdvancePolicy, ProbeMode};
    pub fn header_bytes_max() -> usize {
        64 * 1024
    }
    pub fn body_bytes_max() -> u64 {
        5 * 1024 * 1024 * 1024
    }
    pub fn shutdown_timeout_ms() -> u64 {
        8_000
    }
    pub fn header_read_timeout_ms() -> u64 {
        10_000
    }
    pub fn idle_timeout_ms() -> u64 {
        310_000
    }
    pub fn route_buffered_bytes_max() -> usize {
        64 * 1024 * 1024
    }
    pub fn route_caller_header() -> String {
        "authorization".into()
    }
    pub fn admin_connections_max() -> usize {
        64
    }
    pub fn connections_max() -> usize {
        4096
    }
    pub fn store_cache_bytes_max() -> usize {
        crate::store::DEFAULT_CACHE_BYTES
    }
    pub fn store_timeout_ms() -> u64 {
        2_000
    }
    pub fn store_idempotency_records_bytes_max() -> u64 {
        1 << 30
    }
    pub fn store_idempotency_records_max() -> usize {
        crate::store::IDEMPOTENCY_RECORDS_MAX
    }
    pub fn store_wait_timeout_ms() -> u64 {
        500
    }
    pub fn region() -> String {
        "us-east-1".into()
    }
    pub fn upstream_connect_timeout_ms() -> u64 {
        5_000
    }
    pub fn upstream_request_timeout_ms() -> u64 {
        300_000
    }
    pub fn upstream_idle_connections_max() -> usize {
        256
    }
    pub fn probe() -> ProbeMode {
        ProbeMode::Warn
    }
    pub fn require_token() -> bool {
        true
    }
    pub fn token_header() -> String {
        "Fencing-Token".into()
    }
    pub fn resource_header() -> String {
        "Fencing-Resource".into()
    }
    pub fn inflight_deadline_ms() -> u64 {
        30_000
    }
    pub fn inflight_per_resource_max() -> usize {
        1024
    }
    /// An hour: a stale worker that wakes from a pause of minutes (a VM suspension, a long
    /// GC) still finds its upload to abort itself and sees its own error; an operator has
    /// time to look; and parts do not sit at the upstream for the day S3's shortest lifecycle
    /// rule would keep them.
    pub fn abort_stale_uploads_after_ms() -> u64 {
        3_600_000
    }
    pub fn cached_resources_max() -> usize {
        100_000
    }
    pub fn etag_cache_entries_max() -> usize {
        100_000
    }
    pub fn fencing_advance() -> AdvancePolicy {
        AdvancePolicy::Write
    }
    pub fn route_advance() -> AdvancePolicy {
        AdvancePolicy::Registration
    }
    pub fn retry_body_bytes_max() -> usize {
        1024 * 1024
    }
    pub fn idempotency_retention_ms() -> u64 {
        24 * 3600 * 1000
    }
    pub fn route_request_timeout_ms() -> u64 {
        30_000
    }
    pub fn route_body_bytes_max() -> usize {
        8 * 1024 * 1024
    }
    pub fn route_response_bytes_max() -> usize {
        1024 * 1024
    }
    pub fn lease_ttl_ms_max() -> u64 {
        3_600_000
    }
    pub fn log_level() -> String {
        "info".into()
    }
}

/// A configuration that cannot be used, with the key and the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {file}: not found")]
    NotFound { file: PathBuf },
    #[error("config file {file}: {source}")]
    Parse { file: PathBuf, source: Box<figment::Error> },
    #[error("config file {file}: key `{key}`: {reason}")]
    Invalid { file: PathBuf, key: String, reason: String },
}

impl Config {
    /// Reads `file`, applies `FENCEGATE_*` environment overrides, and validates the result.
    pub fn load(file: &Path) -> Result<Self, ConfigError> {
        if !file.is_file() {
            return Err(ConfigError::NotFound { file: file.into() });
        }
        let mut figment = Figment::new().merge(Toml::file(file));
        if let Some(include) = std::env::var_os(INCLUDE_ENV) {
            // Secrets kept apart (a mounted secret file): what it sets replaces the main file's.
            let include = PathBuf::from(include);
            if !include.is_file() {
                return Err(ConfigError::NotFound { file: include });
            }
            figment = figment.merge(Toml::file(include));
        }
        Self::from_figment(figment.merge(overrides()), file)
    }

    /// Parses a TOML text (no environment); for tests and embedding.
    ///
    /// (See [`overrides`] for how the environment is read by [`Config::load`].)
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(text)), Path::new("<inline>"))
    }

    fn from_figment(figment: Figment, file: &Path) -> Result<Self, ConfigError> {
        let config: Config =
            figment.extract().map_err(|e| ConfigError::Parse { file: file.into(), source: Box::new(e) })?;
        config.validate().map_err(|(key, reason)| ConfigError::Invalid { file: file.into(), key, reason })?;
        Ok(config)
    }

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
        for c in &self.credentials {
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
        for r in &self.routes {
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
        }
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
    fn validate(&self) -> Result<(), Invalid> {
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
        match store.kind {
            StoreKind::Embedded if store.path.is_none() => {
                return Err(invalid("store.path", "required when store.kind = \"embedded\""));
            }
            StoreKind::Redis if store.url.is_none() && store.cluster_urls.is_empty() => {
                return Err(invalid("store.url", "required when store.kind = \"redis\" (or store.cluster_urls)"));
            }
            StoreKind::Redis if store.url.is_some() && !store.cluster_urls.is_empty() => {
                return Err(invalid("store.cluster_urls", "set either store.url or store.cluster_urls, not both"));
            }
            StoreKind::Redis if store.wait_replicas > 0 && store.wait_timeout_ms >= store.timeout_ms => {
                return Err(invalid("store.wait_timeout_ms", "must be below store.timeout_ms"));
            }
            StoreKind::Redis if store.wait_replicas > 0 && !store.cluster_urls.is_empty() => {
                return Err(invalid("store.wait_replicas", "not supported with store.cluster_urls"));
            }
            StoreKind::Etcd if store.endpoints.is_empty() => {
                return Err(invalid("store.endpoints", "required when store.kind = \"etcd\""));
            }
            StoreKind::Etcd if !cfg!(feature = "etcd") => {
                return Err(invalid(
                    "store.kind",
                    "this fencegate was built without etcd support: build it with `cargo build --features etcd`",
                ));
            }
            StoreKind::Redis | StoreKind::Etcd
                if self.fencing.inflight_deadline_ms < crate::fence::SHARED_INFLIGHT_DEADLINE_MS_MIN =>
            {
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
            StoreKind::Redis | StoreKind::Etcd | StoreKind::Embedded => {}
        }
        positive(&[
            ("store.timeout_ms", store.timeout_ms),
            ("store.idempotency_records_bytes_max", store.idempotency_records_bytes_max),
        ])
    }

    fn validate_upstream(&self) -> Result<(), Invalid> {
        let upstream = &self.upstream;
        match upstream.kind {
            UpstreamKind::Local if upstream.path.is_none() => {
                return Err(invalid("upstream.path", "required when upstream.kind = \"local\""));
            }
            UpstreamKind::S3 => {
                let endpoint = upstream
                    .endpoint
                    .as_deref()
                    .ok_or_else(|| invalid("upstream.endpoint", "required when upstream.kind = \"s3\""))?;
                let uri: http::Uri = endpoint
                    .parse()
                    .map_err(|e| invalid("upstream.endpoint", format!("{endpoint:?} is not a URL: {e}")))?;
                // A path or query would be dropped: requests go to the endpoint's root.
                let root = matches!(uri.path(), "" | "/") && uri.query().is_none();
                if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() || !root {
                    return Err(invalid(
                        "upstream.endpoint",
                        format!("{endpoint:?} must be http://host[:port] or https://host[:port], without a path"),
                    ));
                }
                if upstream.access_key_id.is_none() {
                    return Err(invalid("upstream.access_key_id", "required when upstream.kind = \"s3\""));
                }
                if upstream.secret_access_key.is_none() {
                    return Err(invalid("upstream.secret_access_key", "required when upstream.kind = \"s3\""));
                }
            }
            UpstreamKind::Local => {}
        }
        positive(&[
            ("upstream.request_timeout_ms", upstream.request_timeout_ms),
            ("upstream.connect_timeout_ms", upstream.connect_timeout_ms),
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
            if c.access_key_id.starts_with(crate::lease::credentials::ACCESS_KEY_PREFIX) {
                return Err(invalid(
                    format!("credentials[{i}].access_key_id"),
                    format!(
                        "{:?}: ids starting with {:?} are lease credentials' (docs/leases.md)",
                        c.access_key_id,
                        crate::lease::credentials::ACCESS_KEY_PREFIX
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
        let completion_ms = self.upstream.request_timeout_ms.saturating_add(fencing.inflight_deadline_ms);
        let completion_ms = (completion_ms as f64 * (1.0 + crate::fence::CLOCK_RATE_DRIFT_MAX)).ceil() as u64;
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
type Invalid = (String, String);

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Invalid {
    (key.into(), reason.into())
}

/// Each of `values` must be above 0.
fn positive(values: &[(&str, u64)]) -> Result<(), Invalid> {
    match values.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(invalid(*key, "must be greater than 0")),
        None => Ok(()),
    }
}

/// A TOML file merged over the config file (`[[credentials]]`, `[[routes]]`, secrets), before
/// the environment.
pub const INCLUDE_ENV: &str = "FENCEGATE_INCLUDE";

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

/// `FENCEGATE_<SECTION>__<KEY>` variables, and `FENCEGATE_CREDENTIALS` / `FENCEGATE_ROUTES`
/// (the arrays of tables, as inline TOML: `[{access_key_id="...", secret_access_key="..."}]`).
/// Any other variable without `__` (`FENCEGATE_BIN` in a test harness, `FENCEGATE_INCLUDE`)
/// cannot be an override and is ignored rather than refused as an unknown key.
fn overrides() -> Env {
    Env::prefixed(ENV_PREFIX)
        .filter(|key| {
            let key = key.as_str();
            key.contains("__") || key.eq_ignore_ascii_case("credentials") || key.eq_ignore_ascii_case("routes")
        })
        .split("__")
}

/// Milliseconds from config to a `Duration`.
pub fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

pub use crate::fence::millis;

#[cfg(test)]
mod tests {
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
        let risks = Config::from_toml(&dev).unwrap().risks();
        assert!(risks.len() == 1 && risks[0].contains("development credential") && risks[0].contains("grant leases"));
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
}
