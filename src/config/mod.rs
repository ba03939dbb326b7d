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
use serde::{Deserialize, Serialize};

mod backend;
mod defaults;
mod validate;

pub use backend::{S3Endpoint, StoreBackend, UpstreamBackend};
pub use validate::Invalid;

/// The start of every lease credential's access key id: no `[[credentials]]` id may have it.
pub const LEASE_ACCESS_KEY_PREFIX: &str = "FGL";

/// A config key at fault, as an error (a config that passed validation has none).
pub fn at_fault((key, reason): Invalid) -> anyhow::Error {
    anyhow::anyhow!("{key}: {reason}")
}

/// The environment prefix of every override.
pub const ENV_PREFIX: &str = "FENCEGATE_";

/// The most `server.threads` fencegate starts: each is an OS thread with a runtime and a pool
/// of upstream connections.
const THREADS_MAX: usize = 1024;

#[derive(Debug, Clone, Deserialize, Serialize)]
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

#[derive(Debug, Clone, Deserialize, Serialize)]
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

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The S3 (and API gateway) listener.
    pub listen: SocketAddr,
    /// The admin listener: health, metrics, fences. Keep it off public networks.
    pub admin_listen: SocketAddr,
    /// When set, the admin API wants `Authorization: Bearer <admin_token>`.
    #[serde(default)]
    pub admin_token: Option<Secret>,
    /// A second bearer token that only reads: `/metrics`, every `GET /v1/...`, the event feed
    /// and the console's views; never a change. For monitoring, which then never holds the key
    /// to every fence. Needs `admin_token`.
    #[serde(default)]
    pub admin_read_token: Option<Secret>,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    Embedded,
    Redis,
    Etcd,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// Directory of the embedded store.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Redis URL of the redis store (`redis://host:port/db`, `rediss://` for TLS).
    #[serde(default, serialize_with = "url_without_secrets")]
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster, instead of `url`.
    #[serde(default, serialize_with = "urls_without_secrets")]
    pub cluster_urls: Vec<String>,
    /// Embedded store: idempotency records kept at most (the API gateway's); beyond, those that
    /// expire first are dropped, so route traffic cannot fill the disk under the fences.
    #[serde(default = "defaults::store_idempotency_records_max")]
    pub idempotency_records_max: usize,
    /// Embedded store: the bytes those records take at most (keys, claims, recorded responses).
    #[serde(default = "defaults::store_idempotency_records_bytes_max")]
    pub idempotency_records_bytes_max: u64,
    /// Upload records (one per multipart upload made with a token, until it is completed,
    /// aborted or expired) kept at most for one caller, the access key that created them.
    #[serde(default = "defaults::store_upload_records_per_caller_max")]
    pub upload_records_per_caller_max: u64,
    /// Upload records kept at most on one resource.
    #[serde(default = "defaults::store_upload_records_per_resource_max")]
    pub upload_records_per_resource_max: u64,
    /// Upload records kept at most in all; beyond, a new upload is refused (503), never a
    /// fence operation.
    #[serde(default = "defaults::store_upload_records_max")]
    pub upload_records_max: u64,
    /// The bytes those records take at most (names and JSON).
    #[serde(default = "defaults::store_upload_records_bytes_max")]
    pub upload_records_bytes_max: u64,
    /// Redis: after every change of a fence, a grant or a registration, wait until this many
    /// Redis replicas have it (`WAIT`), and fail closed (503) when fewer confirm within
    /// `wait_timeout_ms`. 0: do not wait.
    #[serde(default)]
    pub wait_replicas: u32,
    /// Redis: how long a change waits for `wait_replicas`.
    #[serde(default = "defaults::store_wait_timeout_ms")]
    pub wait_timeout_ms: u64,
    /// Redis: start although its settings can lose an acknowledged advance, grant or
    /// registration (no `appendonly yes` with `appendfsync always`, replicas with
    /// `wait_replicas = 0`, or settings it will not tell); without it fencegate refuses to.
    #[serde(default)]
    pub accept_unsynced_changes: bool,
    /// etcd: client URLs of the cluster's members (`http://host:2379`).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// This replica's name in the shared in-flight registry; default: host name and process id.
    #[serde(default)]
    pub replica_id: Option<String>,
    /// Embedded store: its witness, the record of its last commit kept outside the store
    /// directory, by which a restored older copy is refused; default `<store.path>.witness`.
    /// On another volume it finds out a whole data volume restored too.
    #[serde(default)]
    pub witness_path: Option<PathBuf>,
    /// The embedded store's page cache (redb); the rest of the file is read from disk.
    #[serde(default = "defaults::store_cache_bytes_max")]
    pub cache_bytes_max: usize,
    /// A store call that takes longer has an unknown outcome: the write gets 503.
    #[serde(default = "defaults::store_timeout_ms")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamKind {
    Local,
    S3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeMode {
    /// Probe, and refuse to start if the upstream ignores preconditions.
    Require,
    /// Probe, and warn loudly if the upstream ignores preconditions.
    Warn,
    /// Do not probe.
    Off,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
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
    /// How often fencegate asks the upstream whether it answers fencegate's credentials
    /// (`/readyz`); each check is bounded by the same time.
    #[serde(default = "defaults::upstream_health_interval_ms")]
    pub health_interval_ms: u64,
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

#[derive(Debug, Clone, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
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

/// A secret is shown as `<hidden>`, never as itself (`fencegate check-config`).
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(HIDDEN)
    }
}

/// A Redis URL is shown without its user's password.
fn url_without_secrets<S: serde::Serializer>(url: &Option<String>, serializer: S) -> Result<S::Ok, S::Error> {
    match url {
        Some(url) => serializer.serialize_some(&crate::store::redis_url_without_secrets(url)),
        None => serializer.serialize_none(),
    }
}

/// Redis URLs are shown without their user's password.
fn urls_without_secrets<S: serde::Serializer>(urls: &[String], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(urls.iter().map(|u| crate::store::redis_url_without_secrets(u)))
}

/// What a secret looks like when fencegate shows a config.
pub const HIDDEN: &str = "<hidden>";

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

#[derive(Debug, Clone, Deserialize, Serialize)]
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
    /// How long any multipart upload made with a token may stay incomplete: fencegate aborts
    /// it this long after its creation, whatever its token, and forgets its record. Not 0:
    /// what fencegate keeps for a caller expires.
    #[serde(default = "defaults::abort_uploads_after_ms")]
    pub abort_uploads_after_ms: u64,
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
            abort_uploads_after_ms: defaults::abort_uploads_after_ms(),
        }
    }
}

/// Maps objects to a resource: every key of `bucket` under `prefix` belongs to `resource`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub bucket: String,
    #[serde(default)]
    pub prefix: String,
    pub resource: String,
}

/// How a route makes writes safe for an API that knows nothing of fencing tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Deserialize, Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
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

/// A configuration that cannot be used, with the key and the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {file}: not found")]
    NotFound { file: PathBuf },
    /// Every error of the file and the environment, each once, in the file's words.
    #[error("config file {file}: {}", .errors.join("; "))]
    Parse { file: PathBuf, errors: Vec<String> },
    #[error("config file {file}: key `{key}`: {reason}")]
    Invalid { file: PathBuf, key: String, reason: String },
}

impl Config {
    /// The longest an admitted completion of a multipart upload may take to commit, in ms: it
    /// reaches the upstream within the request timeout and commits within D of that (the
    /// assumption), on clocks that may run apart by the drift allowed everywhere else.
    pub fn upload_completion_ms(&self) -> u64 {
        let ms = self.upstream.request_timeout_ms.saturating_add(self.fencing.inflight_deadline_ms);
        (ms as f64 * (1.0 + crate::fence::CLOCK_RATE_DRIFT_MAX)).ceil() as u64
    }

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
        let mut config: Config =
            figment.extract().map_err(|e| ConfigError::Parse { file: file.into(), errors: describe(e) })?;
        if figment.find_value("upstream.request_timeout_ms").is_err() && config.store.kind != StoreKind::Embedded {
            // With a shared store a write must settle within D (its registration lapses after),
            // so the default agrees with the deadline instead of exceeding it.
            config.upstream.request_timeout_ms =
                config.upstream.request_timeout_ms.min(config.fencing.inflight_deadline_ms);
        }
        config.validate().map_err(|(key, reason)| ConfigError::Invalid { file: file.into(), key, reason })?;
        Ok(config)
    }
}

/// A TOML file merged over the config file (`[[credentials]]`, `[[routes]]`, secrets), before
/// the environment.
pub const INCLUDE_ENV: &str = "FENCEGATE_INCLUDE";

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

/// Each of figment's errors in the words of the config file: the key as written there
/// (`upstream.secret_access_key`, not figment's `default.` profile), or the environment
/// variable that set it, then what is wrong.
fn describe(errors: figment::Error) -> Vec<String> {
    use figment::error::Kind;
    let listed = |names: &[&str]| names.join(", ");
    errors
        .into_iter()
        .map(|e| {
            let key = e.path.join(".").to_ascii_lowercase();
            let from_env = e.metadata.as_ref().is_some_and(|m| m.name.contains(ENV_PREFIX));
            let place = match (&e.kind, from_env) {
                (Kind::MissingField(field), _) if key.is_empty() => format!("`{field}`"),
                (Kind::MissingField(field), _) => format!("`{key}.{field}`"),
                // An unknown key's variable may name more below it (`..._SECTION__KEY`).
                (Kind::UnknownField(..), true) => format!("`{key}` (from the environment: {}*)", env_name(&e.path)),
                (_, true) => format!("`{key}` (from the environment: {})", env_name(&e.path)),
                (_, false) if key.is_empty() => String::new(),
                (_, false) => format!("`{key}`"),
            };
            let what = match &e.kind {
                Kind::UnknownField(field, expected) => {
                    let section = if key.contains('.') { key.rsplit_once('.').map_or("", |(s, _)| s) } else { "" };
                    let section = if section.is_empty() { "the top level".to_owned() } else { format!("[{section}]") };
                    format!("unknown key `{field}`; the keys of {section} are: {}", listed(expected))
                }
                Kind::UnknownVariant(value, expected) => {
                    format!("unknown value {value:?}; expected one of: {}", listed(expected))
                }
                Kind::InvalidType(actual, expected) => format!("expected {expected}, found {actual}"),
                Kind::InvalidValue(actual, expected) => format!("expected {expected}, found {actual}"),
                Kind::MissingField(_) => "required, and not set".to_owned(),
                Kind::DuplicateField(field) => format!("`{field}` is set twice"),
                Kind::Message(message) => message.clone(),
                other => other.to_string(),
            };
            if place.is_empty() { what } else { format!("{place}: {what}") }
        })
        .collect()
}

/// The environment variable that sets the key at `path` (`FENCEGATE_SERVER__LISTEN`).
fn env_name(path: &[String]) -> String {
    let keys: Vec<String> = path.iter().map(|k| k.to_ascii_uppercase()).collect();
    format!("{ENV_PREFIX}{}", keys.join("__"))
}

/// Milliseconds from config to a `Duration`.
pub fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

pub use crate::fence::millis;

mod show;

impl Config {
    /// The effective config as a TOML file `serve` reads (`show`), secrets hidden.
    pub fn to_toml(&self) -> String {
        show::to_toml(self)
    }
}

#[cfg(test)]
mod tests;
