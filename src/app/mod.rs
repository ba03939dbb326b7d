//! Wiring: from a validated config to running listeners.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use hyper::service::service_fn;
use tokio::net::TcpListener;

use crate::admin::{Admin, ServedHosts};
use crate::config::UpstreamBackend;
use crate::config::{Config, ProbeMode, StoreBackend, StoreKind, ms};
use crate::feed::Feed;
use crate::fence::{BootHold, Gate, GateLimits, Hold, InflightBounds, Store};
use crate::fence::{Clock, SystemClock};
use crate::gateway::Gateway;
use crate::lease::{LeaseService, RandomLeaseIds};
use crate::net::server::{self, ConnectionLimits};
use crate::net::threads::{CloseOnDrop, ServingThreads};
use crate::store::{EmbeddedOptions, EmbeddedStore, RedisStore, Wait};
use crate::upstream::health::UpstreamHealth;
use crate::upstream::{self, Enforcement, EtagForm, ProbeError, Probed, Upstream, probe_preconditions};

pub mod reconcile;
mod router;

use router::Router;

/// Everything fencegate runs, built from a config.
pub struct App {
    config: Config,
    gate: Arc<Gate>,
    /// The fence store, for its own lifecycle (a clean start and stop); every fence, lease
    /// and record call goes through the gate.
    store: Arc<dyn Store>,
    upstream: Arc<dyn Upstream>,
    /// The `[[routes]]` to third-party APIs, served on the main listener before S3.
    gateway: Arc<Gateway>,
    /// Set when the main listener speaks HTTPS.
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// What the start-up probe found the upstream enforces, once it ran.
    enforcement: Option<Enforcement>,
    /// Whether the upstream answers fencegate's credentials now (`/readyz`).
    upstream_health: Arc<UpstreamHealth>,
    /// Wall-clock time of leases and idempotency records.
    clock: Arc<dyn Clock>,
    /// Every write decision, to whoever watches (`/v1/events`).
    feed: Arc<Feed>,
}

/// How long (ms from now) no fence may advance because an earlier process may still have
/// writes in flight at the upstream. An unclean start holds for `deadline_ms` (D) from now, and
/// records the hold's end durably before anything is admitted, so that no later start, clean
/// stop or crash loop shortens it; a clean start honours what is left of a recorded hold.
/// Within the boot it was recorded in, what is left is read on the boot clock (`boot`: this
/// boot's id and `CLOCK_BOOTTIME` now), which a wall-clock jump does not move; after a reboot,
/// on the wall clock (`now_ms`). Either way at most D (a clock that went back).
fn hold_after_earlier_processes(
    store: &dyn Store,
    now_ms: u64,
    boot: Option<(u64, u64)>,
    deadline_ms: u64,
) -> anyhow::Result<u64> {
    let left = store.held().map(|hold| match (hold.boot, boot) {
        (Some(recorded), Some((boot_id, boot_ms))) if recorded.boot_id == boot_id => {
            recorded.until_ms.saturating_sub(boot_ms)
        }
        _ => hold.until_ms.saturating_sub(now_ms),
    });
    let recorded = left.filter(|left| *left > 0).map(|left| left.min(deadline_ms));
    if store.opened_clean() {
        if crate::sim::seeded(crate::sim::Bug::CleanStopEndsHold) {
            return Ok(0);
        }
        if let Some(left) = recorded {
            tracing::warn!(
                hold_ms = left,
                "an earlier fencegate process did not shut down cleanly and its hold has not passed: no fence \
                 advances until it has"
            );
        }
        return Ok(recorded.unwrap_or(0));
    }
    let hold = Hold {
        until_ms: now_ms.saturating_add(deadline_ms),
        boot: boot.map(|(boot_id, boot_ms)| BootHold { boot_id, until_ms: boot_ms.saturating_add(deadline_ms) }),
    };
    store.hold_until(hold).context("fence store: recording the hold after an unclean start")?;
    tracing::warn!(
        hold_ms = deadline_ms,
        "the last fencegate process did not shut down cleanly: writes it sent may still commit at the \
         upstream, so no fence advances for fencing.inflight_deadline_ms"
    );
    Ok(deadline_ms)
}

/// A failed probe in one line: whether it could not run or ran and found the upstream wanting.
pub fn probe_failure(error: &ProbeError) -> String {
    if error.could_not_run() {
        format!("upstream probe could not run: {error}")
    } else {
        format!("upstream precondition probe failed: {error}")
    }
}

/// The listeners' bound addresses.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub s3: SocketAddr,
    pub admin: SocketAddr,
}

impl App {
    /// Opens the fence store and the upstream. Fails with a message naming what is wrong.
    pub async fn build(config: Config) -> anyhow::Result<Self> {
        Self::build_with_clock(config, Arc::new(SystemClock)).await
    }

    /// [`App::build`], with the wall clock that leases and idempotency records expire by (a
    /// test's manual clock, so expiry is tested without sleeping).
    pub async fn build_with_clock(config: Config, clock: Arc<dyn Clock>) -> anyhow::Result<Self> {
        if config.store.kind != StoreKind::Embedded
            && config.store.timeout_ms * 4 >= config.fencing.inflight_deadline_ms
        {
            // A renewal that takes this long comes back after the hand-over window (a quarter
            // of the deadline) closed: the writes of a slow store are then cut off (503).
            tracing::warn!(
                store_timeout_ms = config.store.timeout_ms,
                inflight_deadline_ms = config.fencing.inflight_deadline_ms,
                "store.timeout_ms should be well below a quarter of fencing.inflight_deadline_ms with a shared store"
            );
        }
        let store = open_store(&config).await?;
        let limits = GateLimits {
            inflight_deadline: ms(config.fencing.inflight_deadline_ms),
            store_timeout: ms(config.store.timeout_ms),
            inflight_per_resource_max: config.fencing.inflight_per_resource_max,
            inflight_per_caller_max: config.fencing.inflight_per_caller(),
            cached_resources_max: config.fencing.cached_resources_max,
            upload_records: config.store.upload_records(),
        };
        let gate = open_gate(store.clone(), limits, clock.as_ref(), config.fencing.inflight_deadline_ms)?;
        let upstream = upstream::from_config(&config)?;
        let upstream_health = Arc::new(match config.upstream.backend().map_err(crate::config::at_fault)? {
            UpstreamBackend::Local { .. } => UpstreamHealth::in_process(),
            UpstreamBackend::S3(_) => {
                UpstreamHealth::new(config.upstream.probe_bucket.clone(), ms(config.upstream.health_interval_ms))
            }
        });
        let feed = Feed::new(config.store.replica_id.clone().unwrap_or_else(default_replica_id));
        let gateway = Arc::new(Gateway::new(&config, gate.clone(), clock.clone(), feed.clone())?);
        let tls = match (&config.server.tls_cert_path, &config.server.tls_key_path) {
            (Some(cert), Some(key)) => Some(server::tls_acceptor(cert, key)?),
            _ => None,
        };
        Ok(Self { config, gate, store, upstream, gateway, tls, enforcement: None, upstream_health, clock, feed })
    }

    /// The start-up probe (G6). With the embedded store fencegate is the only writer and the
    /// gate orders every commit, so a failed probe is a loud warning unless
    /// `upstream.probe = "require"`. With a shared store (several replicas) a failed or
    /// skipped probe refuses to start, unless `upstream.accept_no_preconditions = true`.
    /// Operations whose preconditions the upstream ignores are named in the log: across
    /// replicas they rely on the gate's ordering alone (README, "Several replicas").
    pub async fn probe(&mut self) -> anyhow::Result<()> {
        let shared = self.gate.is_shared();
        let accepted = self.config.upstream.accept_no_preconditions;
        let mode = match self.config.upstream.probe {
            ProbeMode::Warn if shared && !accepted => ProbeMode::Require,
            mode => mode,
        };
        if mode == ProbeMode::Off {
            if shared && !accepted {
                anyhow::bail!(
                    "upstream.probe = \"off\" with a shared store: several replicas need an upstream that enforces \
                     preconditions; set upstream.accept_no_preconditions = true to accept the risk"
                );
            }
            return Ok(());
        }
        match self.run_probe().await {
            Ok(probed) => {
                self.log_probed(&probed);
                self.enforcement = Some(probed.enforcement);
                Ok(())
            }
            Err(error) if mode == ProbeMode::Require => {
                let why = if shared && self.config.upstream.probe != ProbeMode::Require {
                    "several replicas need an upstream that enforces preconditions (set \
                     upstream.accept_no_preconditions = true to accept the risk)"
                } else {
                    "upstream.probe = \"require\""
                };
                Err(anyhow::anyhow!("{}; refusing to start ({why})", probe_failure(&error)))
            }
            Err(ProbeError::NoBucket) => {
                tracing::warn!(
                    "upstream probe skipped: no bucket yet (set upstream.probe_bucket to probe at start-up)"
                );
                Ok(())
            }
            Err(error) if error.could_not_run() => {
                tracing::warn!(%error, "UPSTREAM PROBE COULD NOT RUN: nothing is known of the upstream's preconditions");
                Ok(())
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    "UPSTREAM PRECONDITION PROBE FAILED: per-object store-side checks (G4) are not enforced by this \
                     upstream; the single-process gate still orders every commit, but do not run several replicas"
                );
                Ok(())
            }
        }
    }

    /// Runs the probe once, each request bounded by `upstream.request_timeout_ms`, and leaves the upstream
    /// sending ETags in the form it found (`fencegate probe` reports the result as it is).
    pub async fn run_probe(&self) -> Result<Probed, ProbeError> {
        let bucket = self.config.upstream.probe_bucket.as_deref();
        probe_preconditions(self.upstream.as_ref(), bucket, ms(self.config.upstream.request_timeout_ms)).await
    }

    fn log_probed(&self, Probed { bucket, enforcement, etag_form }: &Probed) {
        let upstream = self.upstream.kind();
        if *etag_form == EtagForm::Bare {
            tracing::info!(bucket, upstream, "upstream compares a write's If-Match with the bare ETag: sent so");
        }
        let ignored = enforcement.ignored();
        if ignored.is_empty() {
            tracing::info!(bucket, upstream, "upstream enforces preconditions");
        } else {
            tracing::warn!(
                bucket,
                upstream,
                ignored = ignored.join(", "),
                "upstream enforces preconditions on PutObject but ignores them on the operations named; \
                 fencegate still orders them through the gate, but across replicas a stalled replica's \
                 late one is not refused per object"
            );
        }
        if !enforcement.upload_ids_tied_to_keys {
            tracing::info!(
                bucket,
                upstream,
                "upstream accepts a multipart upload's id under any key; fencegate checks each multipart \
                 step's key against the upstream's list of uploads (one more call per step)"
            );
        }
    }

    /// Ends a run that served nothing (`fencegate probe`): a store that opened clean is left
    /// clean, so that the next `serve` does not hold writes as after a crash.
    pub fn close_unused(&self) {
        if self.store.opened_clean()
            && let Err(error) = self.store.mark_clean_shutdown()
        {
            tracing::warn!(%error, "could not record a clean shutdown");
        }
    }

    /// Asks the upstream once whether it answers fencegate's credentials, so that `/readyz`
    /// tells the truth from the first request on (serving then checks every
    /// `upstream.health_interval_ms`).
    pub async fn check_upstream(&self) {
        self.upstream_health.check(self.upstream.as_ref()).await;
        if let Some(cause) = self.upstream_health.reach().cause() {
            tracing::warn!(cause, "not ready until the upstream answers: /readyz is 503");
        }
    }

    /// Binds both listeners (port 0 picks a free port).
    pub async fn bind(&self) -> anyhow::Result<(TcpListener, TcpListener)> {
        let s3 = TcpListener::bind(self.config.server.listen)
            .await
            .with_context(|| format!("server.listen: cannot bind {}", self.config.server.listen))?;
        let admin = TcpListener::bind(self.config.server.admin_listen)
            .await
            .with_context(|| format!("server.admin_listen: cannot bind {}", self.config.server.admin_listen))?;
        Ok((s3, admin))
    }

    /// The operator's jobs: the sweep of upload records, started here for as long as the
    /// process runs, and the reconciliations the admin listener starts.
    fn upkeep(&self) -> anyhow::Result<crate::upkeep::Reconciler> {
        let config = &self.config;
        let hop = crate::s3::Hop::new(self.upstream.clone(), ms(config.upstream.request_timeout_ms));
        let wire = crate::s3::WireContract::new(&config.fencing)?;
        let upkeep = Arc::new(crate::upkeep::Upkeep::new(self.gate.clone(), hop, wire, self.clock.clone()));
        let after = Some(config.fencing.abort_stale_uploads_after_ms).filter(|ms| *ms > 0).map(ms);
        tokio::spawn(upkeep.clone().sweep_uploads(after, ms(config.fencing.abort_uploads_after_ms)));
        // The gateway's records are read only where a route keeps them (on a Redis Cluster they
        // cannot be listed, which would fail every bucket's reconciliation).
        let keeps_records = config.routes.iter().any(|r| r.mode == crate::config::RouteMode::IdempotencyKey);
        Ok(crate::upkeep::Reconciler::new(upkeep, keeps_records))
    }
    /// What answers on each listener: the main listener's router (the S3 front, the lease
    /// endpoints and the API gateway) and the admin listener (at `admin_addr`).
    fn handlers(
        &self,
        metrics: metrics_exporter_prometheus::PrometheusHandle,
        admin_addr: SocketAddr,
    ) -> anyhow::Result<(Arc<Router>, Arc<Admin>)> {
        let issuers = Arc::new(crate::lease::credentials::Issuers::from_config(&self.config));
        let leases = Arc::new(LeaseService::new(
            self.gate.clone(),
            self.clock.clone(),
            Arc::new(RandomLeaseIds),
            self.config.leases.ttl_ms_max,
            issuers.clone(),
        ));
        let s3_service = crate::s3::service(
            &self.config,
            self.gate.clone(),
            self.upstream.clone(),
            leases,
            issuers,
            self.enforcement,
            self.feed.clone(),
        )?;
        let reconciler = self.upkeep()?;
        let router = Arc::new(Router::new(self.gateway.clone(), s3_service));
        let hosts = ServedHosts::new(admin_addr, self.config.server.admin_host_names.clone());
        let admin = Arc::new(
            Admin::new(
                self.gate.clone(),
                self.feed.clone(),
                Arc::new(reconciler),
                metrics,
                crate::admin::Tokens {
                    admin: self.config.server.admin_token.as_ref().map(|t| t.expose().to_owned()),
                    read: self.config.server.admin_read_token.as_ref().map(|t| t.expose().to_owned()),
                },
                hosts,
                ms(self.config.server.idle_timeout_ms),
            )
            .watching_upstream(self.upstream_health.clone()),
        );
        Ok((router, admin))
    }

    /// Serves on bound listeners until `shutdown` resolves.
    pub async fn serve(
        self,
        s3_listener: TcpListener,
        admin_listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let metrics = crate::metrics::install();
        crate::metrics::register_store(self.gate.store_kind());
        let (router, admin) = self.handlers(metrics, admin_listener.local_addr()?)?;
        let s3_service = service_fn(move |req| router.clone().handle(req));
        let admin_service = service_fn(move |req| admin.clone().handle(req));

        let server = &self.config.server;
        let limits = ConnectionLimits {
            connections_max: server.connections_max,
            header_bytes_max: server.header_bytes_max,
            header_read_timeout: ms(server.header_read_timeout_ms),
            idle_timeout: ms(server.idle_timeout_ms),
        };
        let threads = Arc::new(
            ServingThreads::start(self.config.server.serving_threads()).context("server.threads: cannot start")?,
        );
        let _close_threads = CloseOnDrop(threads.clone());
        // The whole stop, open requests and writes in flight included, fits in
        // `server.shutdown_timeout_ms` (below the 10 s a container runtime gives before SIGKILL).
        let shutdown_timeout = ms(self.config.server.shutdown_timeout_ms);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut admin_stop = stop_rx.clone();
        let mut s3_stop = stop_rx;
        let admin_task = tokio::spawn(server::run(
            admin_listener,
            None,
            admin_service,
            ConnectionLimits { connections_max: self.config.server.admin_connections_max, ..limits.clone() },
            async move {
                let _ = admin_stop.wait_for(|stop| *stop).await;
            },
            shutdown_timeout,
            None,
        ));
        let (s3_threads, tls) = (threads.clone(), self.tls.clone());
        let s3_task = tokio::spawn(async move {
            let stop = async move {
                let _ = s3_stop.wait_for(|stop| *stop).await;
            };
            server::run(s3_listener, tls, s3_service, limits, stop, shutdown_timeout, Some(s3_threads)).await;
        });
        let heartbeat =
            tokio::spawn(crate::admin::replicas::keep_telling(self.gate.clone(), self.feed.replica().clone()));
        let upstream_watch = self.upstream_health.is_remote().then(|| {
            let interval = ms(self.config.upstream.health_interval_ms);
            tokio::spawn(self.upstream_health.clone().watch(self.upstream.clone(), interval))
        });
        shutdown.await;
        heartbeat.abort();
        upstream_watch.inspect(tokio::task::JoinHandle::abort);
        let stop_by = tokio::time::Instant::now() + shutdown_timeout;
        // First: a stopping replica is not one to count on (and the drain may use the budget).
        crate::admin::replicas::forget(&self.gate, self.feed.replica(), FORGET_REPLICA_MAX.min(shutdown_timeout / 4))
            .await;
        tracing::info!("shutting down: finishing open requests");
        // A watcher's feed is an open request that never finishes by itself.
        self.feed.close();
        let _ = stop_tx.send(true);
        let _ = tokio::join!(s3_task, admin_task);
        self.await_writes_in_flight(stop_by).await;
        // Last: a write whose client left finishes on its serving thread.
        threads.stop().await;
        Ok(())
    }

    /// After the listeners stopped: no more admissions (a detached request could still be
    /// waiting for one), then writes whose client left wait for their upstream outcome until
    /// `stop_by` at most, and a stop with none left in flight is recorded as clean.
    async fn await_writes_in_flight(&self, stop_by: tokio::time::Instant) {
        let deadline = ms(self.config.fencing.inflight_deadline_ms);
        close_gate(&self.gate, self.store.as_ref(), deadline, stop_by).await;
    }
}

/// The gate over `store`, as a start makes it: advances held for as long as an earlier
/// process may still have writes in flight at the upstream
/// ([`hold_after_earlier_processes`]), and the store's events listened to.
pub(crate) fn open_gate(
    store: Arc<dyn Store>,
    limits: GateLimits,
    clock: &dyn Clock,
    deadline_ms: u64,
) -> anyhow::Result<Arc<Gate>> {
    let gate = Arc::new(Gate::new(store.clone(), limits));
    let hold_ms = hold_after_earlier_processes(store.as_ref(), clock.now_ms(), clock.boot(), deadline_ms)?;
    if hold_ms > 0 {
        gate.hold_writes_for(ms(hold_ms));
    }
    gate.listen_for_store_events();
    Ok(gate)
}

/// A stop's end: no more admissions, then the writes still in flight are awaited for `D`
/// (`deadline`) until `stop_by` at most, and a stop with none left is recorded as clean.
pub(crate) async fn close_gate(
    gate: &Gate,
    store: &dyn Store,
    deadline: std::time::Duration,
    stop_by: tokio::time::Instant,
) {
    gate.close();
    // Past the budget, a write still in flight is left to the next start, which holds
    // advances for D (as after a crash): stopping sooner is safe, only slower to resume.
    let wait_until = (tokio::time::Instant::now() + deadline).min(stop_by);
    while gate.inflight_writes() > 0 && tokio::time::Instant::now() < wait_until {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    if gate.inflight_writes() == 0 {
        if let Err(error) = store.mark_clean_shutdown() {
            tracing::warn!(%error, "could not record a clean shutdown");
        }
    } else {
        tracing::warn!("stopping with writes still in flight: the next start holds advances");
    }
}

/// `fencegate init-store`: marks a new shared store as new, so that its first writes need not
/// wait out the quiet period of a store that lost its state (docs/design.md, section 6).
/// Returns what was done, for the operator.
pub async fn init_store(config: &Config) -> anyhow::Result<String> {
    let StoreBackend::Redis { urls, .. } = config.store.backend().map_err(crate::config::at_fault)? else {
        return Ok(format!(
            "store.kind = {:?}: nothing to initialise (only a Redis store carries epoch marks)",
            config.store.kind
        ));
    };
    let quiet = InflightBounds::new(ms(config.fencing.inflight_deadline_ms)).registration_ttl();
    let store = RedisStore::connect(urls, ms(config.store.timeout_ms), "init".into(), None, 0, quiet)
        .await
        .with_context(|| {
            let shown: Vec<_> = urls.iter().map(|u| crate::store::redis_url_without_secrets(u)).collect();
            format!("store.url: cannot connect to Redis at {}", shown.join(", "))
        })?;
    let marked = store.init().await.context("marking the store's slots")?;
    Ok(match marked {
        0 => "the store was already marked: nothing changed".to_owned(),
        n => format!("marked {n} slots of the store as new"),
    })
}

/// `fencegate init-store --accept-restored`: takes the embedded store as it is although its
/// witness saw later commits or another store (docs/design.md, section 5). Returns what was
/// done, for the operator.
pub fn accept_restored_store(config: &Config) -> anyhow::Result<String> {
    let StoreBackend::Embedded { path } = config.store.backend().map_err(crate::config::at_fault)? else {
        anyhow::bail!(
            "--accept-restored: only an embedded store has a witness to write anew (store.kind = {:?})",
            config.store.kind
        );
    };
    Ok(EmbeddedStore::accept_as_newest(path, &embedded_options(&config.store))?.to_string())
}

/// How the embedded store `[store]` names is opened.
fn embedded_options(store: &crate::config::StoreConfig) -> EmbeddedOptions {
    EmbeddedOptions { cache_bytes: store.cache_bytes_max, witness_path: store.witness_path.clone() }
}

/// Opens the fence store the config names.
async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    let store = &config.store;
    let replica_id = || store.replica_id.clone().unwrap_or_else(default_replica_id);
    Ok(match store.backend().map_err(crate::config::at_fault)? {
        StoreBackend::Embedded { path } => {
            let embedded = EmbeddedStore::open_with(path, &embedded_options(store))?;
            embedded.set_idempotency_records_max(store.idempotency_records_max, store.idempotency_records_bytes_max);
            Arc::new(embedded)
        }
        StoreBackend::Redis { urls, .. } => {
            let wait = (store.wait_replicas > 0)
                .then(|| Wait { replicas: store.wait_replicas, timeout: ms(store.wait_timeout_ms) });
            let threads = config.server.serving_threads();
            let quiet = InflightBounds::new(ms(config.fencing.inflight_deadline_ms)).registration_ttl();
            let redis = RedisStore::connect(urls, ms(store.timeout_ms), replica_id(), wait, threads, quiet)
                .await
                .with_context(|| {
                    let shown: Vec<_> = urls.iter().map(|u| crate::store::redis_url_without_secrets(u)).collect();
                    format!("store.url: cannot connect to Redis at {}", shown.join(", "))
                })?;
            refuse_unsynced_redis(urls, store).await?;
            Arc::new(redis)
        }
        #[cfg(feature = "etcd")]
        StoreBackend::Etcd { endpoints } => {
            let etcd = crate::store::EtcdStore::connect(endpoints, ms(store.timeout_ms), replica_id())
                .await
                .with_context(|| format!("store.endpoints: cannot reach etcd at {}", endpoints.join(", ")))?;
            etcd.set_idempotency_records_max(store.idempotency_records_max);
            Arc::new(etcd)
        }
        #[cfg(not(feature = "etcd"))]
        StoreBackend::Etcd { .. } => {
            anyhow::bail!("store.kind = \"etcd\": this fencegate was built without etcd support")
        }
    })
}

/// Refuses a Redis whose settings can lose an acknowledged change, naming each setting, unless
/// `store.accept_unsynced_changes` accepts the risk (then each is a warning).
async fn refuse_unsynced_redis(urls: &[String], store: &crate::config::StoreConfig) -> anyhow::Result<()> {
    let timeout = ms(store.timeout_ms.max(1000));
    let lapses = crate::store::redis_durability_lapses(urls, store.wait_replicas, timeout).await;
    if lapses.is_empty() {
        return Ok(());
    }
    if store.accept_unsynced_changes {
        for lapse in &lapses {
            tracing::warn!("risk: {lapse} (accepted: store.accept_unsynced_changes = true)");
        }
        return Ok(());
    }
    anyhow::bail!(
        "{}; refusing to start (set store.accept_unsynced_changes = true to accept the risk)",
        lapses.join("; ")
    )
}

/// The longest a stop spends removing its replica from a shared store's list.
const FORGET_REPLICA_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// `<host name>-<pid>`: unique among replicas on one store unless two hosts share a name.
fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let host = if host.is_empty() { "fencegate".to_owned() } else { host };
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::FenceStore;

    fn reopen(dir: &std::path::Path) -> EmbeddedStore {
        for _ in 0..200 {
            if let Ok(store) = EmbeddedStore::open(dir) {
                return store;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the store stayed open");
    }

    /// The hold after an unclean start is read on the boot clock within its boot: a wall clock
    /// that jumped an hour forward while fencegate was stopped (an NTP step) does not shorten
    /// it. Before: the hold was a wall-clock end, and that start held nothing. After a reboot
    /// only the wall clock is left; a clock that went back is cut to D.
    #[test]
    fn a_wall_clock_jump_does_not_shorten_the_hold() {
        let dir = tempfile::tempdir().unwrap();
        let d = 30_000;
        drop(reopen(dir.path())); // killed: no clean-stop mark
        let store = reopen(dir.path());
        let (wall, boot) = (1_000_000_000, (7, 50_000));
        assert_eq!(hold_after_earlier_processes(&store, wall, Some(boot), d).unwrap(), d);
        store.mark_clean_shutdown().unwrap();
        drop(store);
        // 10 s later on the boot clock, an hour later on the wall clock.
        let store = reopen(dir.path());
        assert!(store.opened_clean());
        let later = wall + 3_600_000;
        assert_eq!(hold_after_earlier_processes(&store, later, Some((7, 60_000)), d).unwrap(), 20_000);
        // Another boot: the wall clock says it passed.
        assert_eq!(hold_after_earlier_processes(&store, later, Some((8, 1_000)), d).unwrap(), 0);
        // A wall clock gone back, after a reboot: at most D.
        assert_eq!(hold_after_earlier_processes(&store, 0, None, d).unwrap(), d);
    }
}
