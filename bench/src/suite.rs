//! `fencegate-bench run`: the whole suite, every scenario on every path in one run, written
//! as `results.md` and `chart.svg`.
//!
//! Processes: the in-memory upstream, the 409 ceiling, fencegate (release build, embedded fence
//! store in a temp dir, forwarding to the upstream), the bare hyper proxy and the signing proxy
//! (`proxy.rs`) and, when installed, nginx as a plain reverse proxy to the same upstream. All
//! listen on 127.0.0.1 and are ended by pid at the end.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use http::Method;
use tokio::time::Instant;

use crate::large::{self, LargeReport, StreamReport};

/// The bare hyper reverse proxy's rows (`fencegate-bench proxy`).
const BARE_PROXY: &str = "bare hyper proxy";
/// The signing proxy's row (`fencegate-bench proxy --sigv4`): the floor under accepted writes.
const SIGNING_PROXY: &str = "signing proxy";
/// The signing proxy's check, then the 409 ceiling's answer: the floor under a rejection.
const VERIFYING_CEILING: &str = "verifying 409 ceiling";
use crate::load::{self, Limits};
use crate::procs::{self, FencegateAddrs, Proc};
use crate::report::{Row, Suite, Target};
use crate::scenario::{self, Params, Registrations, Scenario};
use crate::sign::{self, Signer};

const MIB: u64 = 1024 * 1024;
/// Priming passes send each distinct request once; they get this long at most.
const PRIME_DURATION: Duration = Duration::from_secs(120);
/// A pause between runs, so one run's leftovers (closing connections, group commits) do not
/// land in the next one's figures.
const SETTLE: Duration = Duration::from_millis(500);

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// The fencegate binary (build it with `cargo build --release -p fencegate`).
    #[arg(long, default_value = "target/release/fencegate")]
    fencegate_bin: PathBuf,
    /// Where `results.md` and `chart.svg` are written.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Length of each timed keep-alive run.
    #[arg(long, default_value_t = 8)]
    duration_s: u64,
    /// Requests per timed run at most.
    #[arg(long, default_value_t = 2_000_000)]
    requests_max: u64,
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    #[arg(long, default_value_t = 32)]
    keys_per_connection: usize,
    /// Body size of the stale large uploads.
    #[arg(long, default_value_t = 64 * MIB as usize)]
    large_bytes: usize,
    /// Stale large uploads per variant (one at a time), within `--large-duration-s`.
    #[arg(long, default_value_t = 200)]
    large_requests: u64,
    #[arg(long, default_value_t = 30)]
    large_duration_s: u64,
    /// Size of the object streamed through fencegate for the RSS figure.
    #[arg(long, default_value_t = 1024 * MIB)]
    stream_bytes: u64,
    /// The small fence store of the lookup comparison.
    #[arg(long, default_value_t = 1_000)]
    lookup_resources_small: u64,
    /// The large fence store of the lookup comparison (registration is bounded by
    /// `--register-duration-max-s`; the report says how many were registered).
    #[arg(long, default_value_t = 1_000_000)]
    lookup_resources_large: u64,
    #[arg(long, default_value_t = 400)]
    register_duration_max_s: u64,
    /// Distinct lookups signed per lookup run (each is sent once).
    #[arg(long, default_value_t = 150_000)]
    lookup_requests: u64,
    /// Extra environment for every fencegate started, `KEY=VALUE` (repeatable): config
    /// overrides such as `FENCEGATE_FENCING__CACHED_RESOURCES_MAX=2000000`, or
    /// `LD_PRELOAD=...` to try another allocator.
    #[arg(long = "fencegate-env", value_parser = parse_env_pair)]
    fencegate_env: Vec<(String, String)>,
    /// Leave nginx out even when it is installed.
    #[arg(long)]
    no_nginx: bool,
    /// Skip the 64 MiB and 1 GiB scenarios.
    #[arg(long)]
    no_large: bool,
    /// Skip the Redis fence store runs.
    #[arg(long)]
    no_redis: bool,
    /// Skip the etcd fence store runs (they need a fencegate built with `--features etcd`).
    #[arg(long)]
    no_etcd: bool,
    /// Skip the 1k / 1M fence lookup comparison.
    #[arg(long)]
    no_lookup: bool,
}

fn parse_env_pair(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

/// The limits of a priming pass: every request once, concurrently, bounded in time.
pub fn prime_limits(limits: &Limits) -> Limits {
    Limits { duration: PRIME_DURATION, ..limits.clone() }
}

/// One path a scenario runs against: the upstream directly, a proxy, or the ceiling.
struct Endpoint {
    name: &'static str,
    addr: SocketAddr,
    pid: Option<u32>,
}

struct Ctx {
    args: RunArgs,
    signer: Signer,
    suite: Suite,
    body: Bytes,
    limits: Limits,
    run_seq: u32,
    base_run_id: String,
    /// Kept for the target checks.
    large: Vec<(&'static str, bool, LargeReport)>,
    streams: Vec<(Method, StreamReport)>,
    /// Why the Redis store was not measured.
    redis_missing: Option<String>,
    /// Why the etcd store was not measured.
    etcd_missing: Option<String>,
    lookups: Vec<(u64, f64)>,
    /// Lease credentials (access key, secret, session token) to sign with instead of the
    /// static ones.
    lease_credentials: Option<(String, String, String)>,
}

impl Ctx {
    /// `base` plus the `--fencegate-env` pairs (which win).
    fn fencegate_env<'a>(&'a self, base: &[(&'a str, String)]) -> Vec<(&'a str, String)> {
        let mut env = base.to_vec();
        env.extend(self.args.fencegate_env.iter().map(|(k, v)| (k.as_str(), v.clone())));
        env
    }

    /// A fresh signer (signatures are valid for 15 minutes from their timestamp, and a suite
    /// can run longer) and a fresh run id per scenario.
    fn params(&mut self, addr: SocketAddr) -> Params<'_> {
        self.run_seq += 1;
        self.signer = match &self.lease_credentials {
            Some((key, secret, token)) => Signer::with_session_token(key, secret, Some(token.clone()), sign::REGION),
            None => Signer::new(sign::ACCESS_KEY_ID, sign::SECRET_ACCESS_KEY, sign::REGION),
        };
        Params {
            signer: &self.signer,
            authority: addr.to_string(),
            bucket: crate::BUCKET.into(),
            run_id: format!("{}x{}", self.base_run_id, self.run_seq),
            connections: self.args.connections,
            keys_per_connection: self.args.keys_per_connection,
            body: self.body.clone(),
            requests_max: self.args.requests_max,
        }
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.fencegate_bin.is_file(),
        "{} not found: build it with `cargo build --release -p fencegate -p fencegate-bench`",
        args.fencegate_bin.display()
    );
    let tmp = tempfile::Builder::new().prefix("fencegate-bench").tempdir()?;
    let limits = Limits {
        connections: args.connections,
        duration: Duration::from_secs(args.duration_s),
        requests_max: args.requests_max,
        request_timeout: Duration::from_secs(30),
    };
    let mut ctx = Ctx {
        signer: Signer::new(sign::ACCESS_KEY_ID, sign::SECRET_ACCESS_KEY, sign::REGION),
        suite: Suite { command: std::env::args().collect::<Vec<_>>().join(" "), ..Suite::default() },
        body: Bytes::from(vec![b'x'; args.body_bytes]),
        limits,
        run_seq: 0,
        base_run_id: crate::run_id(),
        large: Vec::new(),
        streams: Vec::new(),
        redis_missing: None,
        etcd_missing: None,
        lookups: Vec::new(),
        lease_credentials: None,
        args,
    };
    describe_setup(&mut ctx);

    let (upstream, upstream_addr) = procs::spawn_upstream(false)?;
    let status = crate::create_bucket(upstream_addr, &upstream_addr.to_string(), &ctx.signer, crate::BUCKET).await?;
    anyhow::ensure!(status == 200, "creating the bucket answered {status}");
    let (ceiling, ceiling_addr) = procs::spawn_upstream(true)?;
    let (mut fencegate, fg) = procs::spawn_fencegate(
        &ctx.args.fencegate_bin,
        &tmp.path().join("fg"),
        upstream_addr,
        &ctx.fencegate_env(&[]),
    )?;
    let nginx = start_nginx(&mut ctx, tmp.path(), upstream_addr);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (bare_proxy, bare_proxy_addr) = procs::spawn_bare_proxy(upstream_addr, cores, false, false)?;
    let (signing_proxy, signing_proxy_addr) = procs::spawn_bare_proxy(upstream_addr, cores, true, false)?;
    let (verifying, verifying_addr) = procs::spawn_bare_proxy(upstream_addr, cores, true, true)?;
    eprintln!("upstream {upstream_addr}, ceiling {ceiling_addr}, fencegate {}", fg.s3);
    ctx.suite.setup.push(idle_machine().await);

    let mut paths = vec![Endpoint { name: "upstream", addr: upstream_addr, pid: Some(upstream.pid()) }];
    if let Some((proc, addr)) = &nginx {
        paths.push(Endpoint { name: "nginx", addr: *addr, pid: Some(proc.pid()) });
    }
    paths.push(Endpoint { name: BARE_PROXY, addr: bare_proxy_addr, pid: Some(bare_proxy.pid()) });
    paths.push(Endpoint { name: SIGNING_PROXY, addr: signing_proxy_addr, pid: Some(signing_proxy.pid()) });
    paths.push(Endpoint { name: "fencegate", addr: fg.s3, pid: Some(fencegate.pid()) });
    let ceiling_path = Endpoint { name: "409 ceiling", addr: ceiling_addr, pid: Some(ceiling.pid()) };
    let verifying_path = Endpoint { name: VERIFYING_CEILING, addr: verifying_addr, pid: Some(verifying.pid()) };
    let fencegate_path = Endpoint { name: "fencegate", addr: fg.s3, pid: Some(fencegate.pid()) };

    for scenario in [Scenario::Accepted, Scenario::AcceptedOneResource, Scenario::Advancing] {
        for path in &paths {
            if path.name == SIGNING_PROXY && scenario != Scenario::Accepted {
                continue; // its one row is the floor under accepted writes
            }
            keep_alive_run(&mut ctx, scenario, path).await?;
            if let Some(status) = fencegate.exited() {
                anyhow::bail!("fencegate exited ({status}) during {}", scenario.name());
            }
        }
    }
    lease_credentials_run(&mut ctx, &fencegate_path).await?;
    for path in [&fencegate_path, &ceiling_path, &verifying_path] {
        keep_alive_run(&mut ctx, Scenario::Stale, path).await?;
    }
    let idle_rss = procs::rss(fencegate.pid()).ok();

    if !ctx.args.no_large {
        for expect in [true, false] {
            for path in [&fencegate_path, &ceiling_path] {
                stale_large_run(&mut ctx, path, expect).await?;
            }
        }
        stream_runs(&mut ctx, &fencegate_path, upstream_addr).await?;
    }
    drop((nginx, bare_proxy, signing_proxy, verifying));
    drop(fencegate);
    if let Some(rss) = idle_rss {
        ctx.suite.notes.push(format!(
            "fencegate's RSS after the keep-alive runs: {:.1} MiB (peak so far {:.1} MiB).",
            rss.now_kb as f64 / 1024.0,
            rss.peak_kb as f64 / 1024.0
        ));
    }

    if !ctx.args.no_redis {
        ctx.redis_missing = shared_store_runs(&mut ctx, tmp.path(), upstream_addr, SharedStore::Redis).await?;
    }
    if !ctx.args.no_etcd {
        ctx.etcd_missing = shared_store_runs(&mut ctx, tmp.path(), upstream_addr, SharedStore::Etcd).await?;
    }
    if !ctx.args.no_lookup {
        lookup_runs(&mut ctx, tmp.path(), upstream_addr).await?;
        if !ctx.args.no_redis {
            redis_listing_run(&mut ctx, tmp.path(), upstream_addr).await?;
        }
    }
    drop((upstream, ceiling));
    check_targets(&mut ctx);
    write_outputs(&ctx)
}

fn describe_setup(ctx: &mut Ctx) {
    let a = &ctx.args;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    ctx.suite.setup = vec![
        format!("{cpus} CPUs; everything on loopback (client, proxies, upstream share the CPUs)."),
        format!(
            "Keep-alive runs: {} connections, {} s each (at most {} requests), {}-byte SigV4-signed PUTs \
             (UNSIGNED-PAYLOAD), {} objects per connection; an untimed priming pass first.",
            a.connections, a.duration_s, a.requests_max, a.body_bytes, a.keys_per_connection
        ),
        "Client: fencegate-bench on one tokio thread, hyper `client::conn::http1`, heads pre-signed \
         and replayed; latency in an HDR histogram (µs)."
            .into(),
        "CPU per request, over the timed pass: the server's (its process and child processes, from \
         `/proc/PID/stat`; the upstream's own on the direct path), the client's (the bench's process), \
         and the machine's (all CPUs' busy time in `/proc/stat`, kernel included). A row whose \
         machine CPU per request times its rate is near the CPU count was bound by CPU; a client near \
         1 s of CPU per second was bound by its one thread."
            .into(),
        "Upstream: fencegate-bench's in-memory S3 (ETags, If-Match / If-None-Match, metadata; \
         signatures not verified), one tokio thread. 409 ceiling: the same server answering 409 \
         to everything without reading the body."
            .into(),
        "Bare hyper proxy: `fencegate-bench proxy`, hyper 1.x server and hyper-util's pooled legacy \
         client, URI rewritten, bodies streamed, on as many tokio workers as CPUs; no authentication, \
         no fence, no re-signing. Signing proxy: the same with `--sigv4`, verifying each request's \
         SigV4 signature and signing it anew for the upstream with fencegate's own code: the floor \
         under a fenced write."
            .into(),
        "fencegate: release build, embedded fence store (redb, fsync per advance) in a temp dir, \
         `upstream.kind = \"s3\"` to the in-memory upstream, `log.level = \"warn\"`, SigV4 \
         verification on."
            .into(),
    ];
    let binary = ctx.args.fencegate_bin.display().to_string();
    ctx.suite.setup.push(format!("fencegate binary: `{binary}`."));
    if !ctx.args.fencegate_env.is_empty() {
        let pairs: Vec<String> = ctx.args.fencegate_env.iter().map(|(k, v)| format!("`{k}={v}`")).collect();
        ctx.suite.setup.push(format!("fencegate environment: {}.", pairs.join(", ")));
    }
}

fn start_nginx(ctx: &mut Ctx, dir: &Path, upstream: SocketAddr) -> Option<(Proc, SocketAddr)> {
    if ctx.args.no_nginx {
        return None;
    }
    let Some(binary) = procs::find_nginx() else {
        ctx.suite.notes.push("nginx is not installed: its rows are missing (`apt-get install nginx-light`).".into());
        return None;
    };
    let nginx_dir = dir.join("nginx");
    let _ = std::fs::create_dir_all(&nginx_dir);
    match procs::spawn_nginx(&binary, &nginx_dir, upstream) {
        Ok(started) => {
            ctx.suite.setup.push(
                "nginx: `worker_processes auto`, keep-alive to the client and to the upstream \
                 (`keepalive 128`), `proxy_request_buffering off`, `proxy_buffering off`, no access log."
                    .into(),
            );
            Some(started)
        }
        Err(e) => {
            ctx.suite.notes.push(format!("nginx did not start: {e:#}"));
            None
        }
    }
}

async fn keep_alive_run(ctx: &mut Ctx, scenario: Scenario, path: &Endpoint) -> anyhow::Result<()> {
    let limits = ctx.limits.clone();
    let workload = {
        let params = ctx.params(path.addr);
        scenario::build(scenario, &params)?
    };
    let primed = load::run(path.addr, workload.prime.clone(), &prime_limits(&limits)).await;
    tokio::time::sleep(SETTLE).await;
    eprintln!("{} via {}: running", scenario.name(), path.name);
    let cpu_before = CpuReadings::now(path.pid);
    let report = load::run(path.addr, workload.timed.clone(), &limits).await;
    let cpu = CpuReadings::now(path.pid).per_request_since(&cpu_before, report.completed);
    let mut outcome = report.statuses_text();
    if primed.completed > 0 && scenario == Scenario::Stale {
        outcome.push_str(&format!(" (primed: {})", primed.statuses_text()));
    }
    outcome.push_str(&format!("; {} connections opened", report.connects));
    eprintln!("  {:.0} req/s p99 {:.2} ms {}", report.per_second(), report.ms(0.99), outcome);
    ctx.suite.rows.push(Row {
        scenario: scenario_label(scenario, ctx.args.body_bytes),
        path: path.name.into(),
        per_second: Some(report.per_second()),
        p50_ms: Some(report.ms(0.5)),
        p99_ms: Some(report.ms(0.99)),
        p999_ms: Some(report.ms(0.999)),
        cpu_us_per_request: cpu.server,
        client_cpu_us_per_request: cpu.client,
        machine_cpu_us_per_request: cpu.machine,
        outcome,
        charted: true,
    });
    tokio::time::sleep(SETTLE).await;
    Ok(())
}

/// The one-resource run again, signed with lease credentials instead of a static credential
/// and a fencing header: what a lease credential costs per request (the stored lease is read
/// on every request).
async fn lease_credentials_run(ctx: &mut Ctx, path: &Endpoint) -> anyhow::Result<()> {
    let target = format!("http://{}", path.addr);
    let (client, lease_id, credentials) =
        grant_lease(&target, sign::ACCESS_KEY_ID, sign::SECRET_ACCESS_KEY, sign::REGION).await?;
    ctx.lease_credentials = Some(credentials);
    let result = keep_alive_run(ctx, Scenario::AcceptedLease, path).await;
    ctx.lease_credentials = None;
    client.release(scenario::LEASE, &lease_id).await?;
    result
}

/// A lease on the lease-credentials rows' resource ([`scenario::LEASE`]), granted through
/// `target` (`http://...`) by the issuer whose keys are given: the client to release it with,
/// its lease id, and its credentials (access key id, secret, session token).
pub async fn grant_lease(
    target: &str,
    access_key_id: &str,
    secret_access_key: &str,
    region: &str,
) -> anyhow::Result<(fencegate_client::LeaseClient, String, (String, String, String))> {
    let issuer = fencegate_client::Credentials::new(access_key_id, secret_access_key, None, None, "bench");
    let client = fencegate_client::LeaseClient::new(target, issuer, region)?;
    let grant =
        client.try_acquire_with_credentials(scenario::LEASE, "fencegate-bench", Duration::from_secs(3600)).await?;
    let credentials = grant.credentials.context("the grant came without credentials")?;
    let credentials = (credentials.access_key_id, credentials.secret_access_key, credentials.session_token);
    Ok((client, grant.lease_id, credentials))
}

/// CPU seconds used so far by the server under test (with its child processes), by the load
/// client, and by the whole machine; or, from [`CpuReadings::per_request_since`], µs of each
/// per request of a pass.
struct CpuReadings {
    server: Option<f64>,
    client: Option<f64>,
    machine: Option<f64>,
}

impl CpuReadings {
    fn now(server: Option<u32>) -> Self {
        Self {
            server: server.and_then(procs::cpu_seconds),
            client: procs::client_cpu_seconds(),
            machine: procs::machine_busy_seconds().map(|(_, seconds)| seconds),
        }
    }

    fn per_request_since(&self, before: &Self, requests: u64) -> Self {
        let per = |after: Option<f64>, before: Option<f64>| Some((after? - before?) * 1e6 / requests.max(1) as f64);
        Self {
            server: per(self.server, before.server),
            client: per(self.client, before.client),
            machine: per(self.machine, before.machine),
        }
    }
}

fn scenario_label(scenario: Scenario, body_bytes: usize) -> String {
    let size = size_text(body_bytes as u64);
    match scenario {
        Scenario::Accepted => format!("accepted {size}, many resources"),
        Scenario::AcceptedOneResource => format!("accepted {size}, one resource"),
        Scenario::AcceptedLease => format!("accepted {size}, one resource, lease credentials"),
        Scenario::Advancing => format!("advancing {size} (new token per request)"),
        Scenario::Stale => format!("stale {size}"),
    }
}

fn size_text(bytes: u64) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= 1024 && bytes.is_multiple_of(1024) {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// Primes a fence above the token the uploads present (one small write with token 2), then
/// sends stale uploads of `body` one at a time.
pub async fn stale_large(
    addr: SocketAddr,
    params: &Params<'_>,
    body: Bytes,
    expect: bool,
    limits: &Limits,
    server_pid: Option<u32>,
) -> anyhow::Result<LargeReport> {
    let key = format!("big-{}", params.run_id);
    let prime = params.plan(Method::PUT, &key, Some(2), None, Bytes::from_static(b"p"))?;
    let source = Arc::new(scenario::Signed { per_connection: vec![vec![prime]], cycle: false });
    let one = Limits { connections: 1, ..prime_limits(limits) };
    load::run(addr, source, &one).await;
    let plan = params.plan(Method::PUT, &key, Some(1), None, body.clone())?;
    large::stale_uploads(addr, &plan, body, expect, limits.requests_max, limits.duration, server_pid).await
}

pub fn large_outcome(r: &LargeReport) -> String {
    let statuses: Vec<String> = r.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
    let mut text = statuses.join(" ");
    if r.no_response > 0 {
        text.push_str(&format!(" no-answer×{}", r.no_response));
    }
    text.push_str(&format!(
        "; client wrote ≤ {:.0} KiB of body per request (mean {:.0} KiB)",
        r.body_bytes_sent_max as f64 / 1024.0,
        r.body_bytes_sent_total as f64 / 1024.0 / r.requests.max(1) as f64
    ));
    if let Some(read) = r.server_read_per_request {
        text.push_str(&format!("; server read {:.1} KiB per request, head included (strace)", read / 1024.0));
    }
    text
}

async fn stale_large_run(ctx: &mut Ctx, path: &Endpoint, expect: bool) -> anyhow::Result<()> {
    let limits = Limits {
        connections: 1,
        duration: Duration::from_secs(ctx.args.large_duration_s),
        requests_max: ctx.args.large_requests,
        request_timeout: Duration::from_secs(30),
    };
    let body = Bytes::from(vec![b'x'; ctx.args.large_bytes]);
    let label = format!(
        "stale {} upload, {}",
        size_text(ctx.args.large_bytes as u64),
        if expect { "Expect: 100-continue" } else { "no Expect" }
    );
    eprintln!("{label} via {}: running", path.name);
    let report = {
        let params = ctx.params(path.addr);
        stale_large(path.addr, &params, body, expect, &limits, path.pid).await?
    };
    let outcome = large_outcome(&report);
    eprintln!("  p99 {:.2} ms {outcome}", report.latency_us.value_at_quantile(0.99) as f64 / 1000.0);
    let ms = |q: f64| Some(report.latency_us.value_at_quantile(q) as f64 / 1000.0);
    ctx.suite.rows.push(Row {
        scenario: label,
        path: path.name.into(),
        per_second: Some(report.requests as f64 / report.elapsed.as_secs_f64().max(1e-9)),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        p999_ms: ms(0.999),
        cpu_us_per_request: None,
        client_cpu_us_per_request: None,
        machine_cpu_us_per_request: None,
        outcome,
        charted: false,
    });
    ctx.large.push((path.name, expect, report));
    tokio::time::sleep(SETTLE).await;
    Ok(())
}

/// PUT then GET of one `--stream-bytes` object, through fencegate (its RSS sampled) and
/// directly (for the transfer rate without a proxy).
async fn stream_runs(ctx: &mut Ctx, fencegate: &Endpoint, upstream: SocketAddr) -> anyhow::Result<()> {
    let size = ctx.args.stream_bytes;
    let chunk = Bytes::from(vec![b's'; MIB as usize]);
    for (name, addr, pid) in [("fencegate", fencegate.addr, fencegate.pid), ("upstream", upstream, None)] {
        for method in [Method::PUT, Method::GET] {
            let plan = {
                let params = ctx.params(addr);
                let key = format!("stream-{}", params.run_id.split('x').next().unwrap_or("0"));
                params.head(method.clone(), &key, Some(1), None, size)?
            };
            eprintln!("stream {method} {} via {name}: running", size_text(size));
            let r = large::stream_object(addr, &plan, chunk.clone(), size, pid).await?;
            eprintln!("  {} {:.0} MiB/s", r.status, r.mib_per_s());
            ctx.suite.rows.push(stream_row(name, &method, size, &r));
            if name == "fencegate" {
                ctx.streams.push((method.clone(), r));
            }
            tokio::time::sleep(SETTLE).await;
        }
    }
    Ok(())
}

fn stream_row(path: &str, method: &Method, size: u64, r: &StreamReport) -> Row {
    let mut outcome = format!(
        "{}; {:.0} MiB in {:.2} s = {:.0} MiB/s",
        r.status,
        r.bytes as f64 / MIB as f64,
        r.elapsed.as_secs_f64(),
        r.mib_per_s()
    );
    if r.idle_kb > 0 {
        outcome.push_str(&format!(
            "; RSS idle {:.1} MiB, peak {:.1} MiB above idle (sampled every 5 ms: +{:.1}; VmHWM{}: +{:.1})",
            r.idle_kb as f64 / 1024.0,
            r.peak_above_idle_mib(),
            r.sampled_peak_kb.saturating_sub(r.idle_kb) as f64 / 1024.0,
            if r.hwm_was_reset { " after reset" } else { " (not reset)" },
            r.hwm_kb.saturating_sub(r.idle_kb) as f64 / 1024.0,
        ));
    }
    Row::untimed(format!("stream {} {}", size_text(size), method), path, None, outcome)
}

/// A fence store that runs as its own process.
#[derive(Clone, Copy)]
enum SharedStore {
    /// fsync-always append-only file.
    Redis,
    /// One member, its write-ahead log fsynced on every commit.
    Etcd,
}

impl SharedStore {
    fn path(self) -> &'static str {
        match self {
            Self::Redis => "fencegate (redis store)",
            Self::Etcd => "fencegate (etcd store)",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Etcd => "etcd",
        }
    }
}

/// The same keep-alive runs on a fencegate whose fence store is `store`. Returns why it was not
/// measured, if it was not.
async fn shared_store_runs(
    ctx: &mut Ctx,
    dir: &Path,
    upstream: SocketAddr,
    store: SharedStore,
) -> anyhow::Result<Option<String>> {
    let spawned = match store {
        SharedStore::Redis => procs::find_redis()
            .map(|binary| procs::spawn_redis(&binary, &dir.join("redis")).map(|(p, a)| (p, procs::redis_store_env(a)))),
        SharedStore::Etcd => procs::find_etcd()
            .map(|binary| procs::spawn_etcd(&binary, &dir.join("etcd")).map(|(p, a)| (p, procs::etcd_store_env(a)))),
    };
    let Some(spawned) = spawned else { return Ok(Some(format!("the store for {} is not installed", store.path()))) };
    let (server, env) = spawned?;
    let fg_dir = dir.join(format!("fg-{}", store.name()));
    let started = procs::spawn_fencegate(&ctx.args.fencegate_bin, &fg_dir, upstream, &ctx.fencegate_env(&env));
    let (mut fencegate, fg) = match started {
        Ok(started) => started,
        Err(e) => return Ok(Some(format!("{} did not start: {e:#}", store.path()))),
    };
    let path = Endpoint { name: store.path(), addr: fg.s3, pid: Some(fencegate.pid()) };
    for scenario in [Scenario::Accepted, Scenario::AcceptedOneResource, Scenario::Advancing, Scenario::Stale] {
        keep_alive_run(ctx, scenario, &path).await?;
        if let Some(status) = fencegate.exited() {
            anyhow::bail!("{} exited ({status}) during {}", store.path(), scenario.name());
        }
    }
    // A lease credential reads the stored lease on every request: over the network here.
    lease_credentials_run(ctx, &path).await?;
    drop(fencegate);
    drop(server);
    Ok(None)
}

/// Stale writes over uniformly picked resources, on a fresh fencegate whose store holds the
/// small count, then (registration continued) the large count.
async fn lookup_runs(ctx: &mut Ctx, dir: &Path, upstream: SocketAddr) -> anyhow::Result<()> {
    let (proc, fg) =
        procs::spawn_fencegate(&ctx.args.fencegate_bin, &dir.join("fg-lookup"), upstream, &ctx.fencegate_env(&[]))?;
    let run_id = format!("{}l", ctx.base_run_id);
    let mut registered = 0;
    for target in [ctx.args.lookup_resources_small, ctx.args.lookup_resources_large] {
        let (count, took) = register(ctx, fg, &run_id, registered, target).await;
        let rate = (count - registered) as f64 / took.as_secs_f64().max(1e-9);
        registered = count;
        eprintln!("registered {count} fences (last batch {took:?})");
        let label = format!("fence lookup (stale 1 KiB), {} fences", thousands(count));
        let limits = Limits { requests_max: ctx.args.lookup_requests, ..ctx.limits.clone() };
        let workload = {
            let lookup_requests = ctx.args.lookup_requests;
            let mut params = ctx.params(fg.s3);
            params.run_id = run_id.clone();
            params.requests_max = lookup_requests;
            scenario::lookups(&params, count, 0x5eed)?
        };
        let cpu_before = CpuReadings::now(Some(proc.pid()));
        let report = load::run(fg.s3, workload.timed.clone(), &limits).await;
        let cpu = CpuReadings::now(Some(proc.pid())).per_request_since(&cpu_before, report.completed);
        eprintln!("  {:.0} req/s p99 {:.2} ms", report.per_second(), report.ms(0.99));
        let rss = procs::rss(proc.pid()).ok();
        ctx.suite.rows.push(Row {
            scenario: label,
            path: "fencegate".into(),
            per_second: Some(report.per_second()),
            p50_ms: Some(report.ms(0.5)),
            p99_ms: Some(report.ms(0.99)),
            p999_ms: Some(report.ms(0.999)),
            cpu_us_per_request: cpu.server,
            client_cpu_us_per_request: cpu.client,
            machine_cpu_us_per_request: cpu.machine,
            outcome: format!(
                "{}; registered through the admin API at {:.0}/s; RSS {:.0} MiB",
                report.statuses_text(),
                rate,
                rss.map_or(0.0, |r| r.now_kb as f64 / 1024.0)
            ),
            charted: true,
        });
        ctx.lookups.push((count, report.ms(0.99)));
        if target == ctx.args.lookup_resources_large {
            listing_row(ctx, &proc, fg, count, count / 1000 + 10, "fencegate").await?;
        }
        if count < target {
            ctx.suite.notes.push(format!(
                "Fence registration stopped at {count} of {target} after --register-duration-max-s {} s.",
                ctx.args.register_duration_max_s
            ));
            break;
        }
        tokio::time::sleep(SETTLE).await;
    }
    drop(proc);
    Ok(())
}

/// A walk of every fence of a fencegate (`GET /v1/fences`, pages of 1,000) whose store holds
/// `count`: its time, its slowest page, and the server's memory before and at its peak during
/// the walk (the listing keeps one page: its memory must not grow with the store).
async fn listing_row(
    ctx: &mut Ctx,
    proc: &Proc,
    fg: FencegateAddrs,
    count: u64,
    pages_max: u64,
    path: &str,
) -> anyhow::Result<()> {
    let before = procs::rss(proc.pid()).ok();
    let peak_reset = procs::reset_peak_rss(proc.pid());
    let walk = crate::listing::walk(fg.admin, 1000, pages_max).await?;
    let after = procs::rss(proc.pid()).ok();
    let mib = |kb: u64| kb as f64 / 1024.0;
    eprintln!("  listed {} fences in {} pages, {:?}", walk.fences, walk.pages, walk.took);
    let outcome = format!(
        "{} fences in {} pages, {:.1} s, slowest page {:.0} ms; RSS {:.0} MiB before, {} {:.0} MiB during",
        walk.fences,
        walk.pages,
        walk.took.as_secs_f64(),
        walk.slowest_page.as_secs_f64() * 1000.0,
        before.map_or(0.0, |r| mib(r.now_kb)),
        if peak_reset { "peak" } else { "peak since start" },
        after.map_or(0.0, |r| mib(r.peak_kb)),
    );
    let rate = walk.fences as f64 / walk.took.as_secs_f64().max(1e-9);
    let scenario = format!("fence listing, {} fences, pages of 1,000", thousands(count));
    ctx.suite.rows.push(Row::untimed(scenario, path, Some(rate), outcome));
    Ok(())
}

/// Pages of the Redis listing walked.
const REDIS_LISTING_PAGES: u64 = 20;

/// The listing on a Redis store as large as the lookups' large one: Redis keeps no order of
/// its keys, so each page walks them all.
async fn redis_listing_run(ctx: &mut Ctx, dir: &Path, upstream: SocketAddr) -> anyhow::Result<()> {
    let Some(binary) = procs::find_redis() else { return Ok(()) };
    let (redis, redis_addr) = procs::spawn_redis(&binary, &dir.join("redis-listing"))?;
    let env = procs::redis_store_env(redis_addr);
    let (proc, fg) = procs::spawn_fencegate(
        &ctx.args.fencegate_bin,
        &dir.join("fg-redis-listing"),
        upstream,
        &ctx.fencegate_env(&env),
    )?;
    let run_id = format!("{}r", ctx.base_run_id);
    let (count, took) = register(ctx, fg, &run_id, 0, ctx.args.lookup_resources_large).await;
    eprintln!("registered {count} fences in Redis ({took:?})");
    // Each page walks every key: the first pages tell the cost of each.
    listing_row(ctx, &proc, fg, count, REDIS_LISTING_PAGES, "fencegate (redis store)").await?;
    drop(proc);
    drop(redis);
    Ok(())
}

/// Registers fences `from..to` through the admin API within the registration bound; returns
/// how many are registered in total and how long this batch took.
async fn register(ctx: &Ctx, fg: FencegateAddrs, run_id: &str, from: u64, to: u64) -> (u64, Duration) {
    let connections = ctx.args.connections.min(48);
    let source = Arc::new(Registrations {
        run_id: run_id.to_owned(),
        admin_authority: fg.admin.to_string(),
        from,
        to,
        connections,
    });
    let limits = Limits {
        connections,
        duration: Duration::from_secs(ctx.args.register_duration_max_s),
        requests_max: to - from,
        request_timeout: Duration::from_secs(30),
    };
    let started = Instant::now();
    let report = load::run(fg.admin, source, &limits).await;
    let ok = report.statuses.get(&200).copied().unwrap_or(0);
    if ok != report.completed || report.errors > 0 {
        eprintln!("registration: {}", report.statuses_text());
    }
    (from + ok, started.elapsed())
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn find_row<'a>(ctx: &'a Ctx, scenario_prefix: &str, path: &str) -> Option<&'a Row> {
    ctx.suite.rows.iter().find(|r| r.scenario.starts_with(scenario_prefix) && r.path == path)
}

fn check_targets(ctx: &mut Ctx) {
    let mut targets = Vec::new();
    let rps = |prefix: &str, path: &str| find_row(ctx, prefix, path).and_then(|r| r.per_second);

    let ratio_target = |goal: String, num: Option<f64>, den: Option<f64>, factor: f64, missing: &str| match (num, den) {
        (Some(n), Some(d)) => {
            Target { goal, measured: format!("{n:.0} / {d:.0} req/s = {:.2}×", n / d), met: Some(n >= factor * d) }
        }
        _ => Target { goal, measured: missing.to_string(), met: None },
    };
    let accepted = rps("accepted", "fencegate");
    let floor = match (rps("accepted", SIGNING_PROXY), rps("accepted", BARE_PROXY), accepted) {
        (Some(signing), Some(bare), Some(fenced)) => Some(format!(
            "The floor under a fenced write: the signing proxy (the bare proxy plus fencegate's SigV4 \
             check and re-signing) ran accepted writes at {signing:.0} / {bare:.0} req/s = {:.2}× the bare \
             proxy; fencegate at {:.2}× the signing proxy.",
            signing / bare,
            fenced / signing
        )),
        _ => None,
    };
    targets.push(ratio_target(
        "accepted 1 KiB writes: fencegate ≥ 0.9 × the bare hyper proxy".into(),
        accepted,
        rps("accepted", BARE_PROXY),
        0.9,
        "bare hyper proxy not measured",
    ));
    targets.push(ratio_target(
        "accepted 1 KiB writes: fencegate ≥ 0.9 × nginx".into(),
        accepted,
        rps("accepted", "nginx"),
        0.9,
        "nginx not measured",
    ));
    let stale = rps("stale", "fencegate");
    targets.push(ratio_target(
        "stale rejections/s ≥ 3 × accepted writes/s".into(),
        stale,
        accepted,
        3.0,
        "not measured",
    ));
    targets.push(ratio_target(
        "stale rejections/s ≥ 0.8 × the 409 ceiling".into(),
        stale,
        rps("stale", "409 ceiling"),
        0.8,
        "not measured",
    ));
    if let Some((_, _, r)) = ctx.large.iter().find(|(path, expect, _)| *path == "fencegate" && *expect) {
        let p99 = r.latency_us.value_at_quantile(0.99) as f64 / 1000.0;
        let read = r.server_read_per_request.unwrap_or(r.body_bytes_sent_max as f64);
        targets.push(Target {
            goal: "stale 64 MiB with 100-continue: < 64 KiB of body read, p99 < 5 ms".into(),
            measured: format!(
                "{:.1} KiB read per request (head included), client sent ≤ {:.0} KiB of body; p99 {p99:.2} ms",
                read / 1024.0,
                r.body_bytes_sent_max as f64 / 1024.0
            ),
            met: Some(read < 65536.0 && p99 < 5.0 && r.no_response == 0),
        });
    }
    if !ctx.streams.is_empty() {
        let worst = ctx.streams.iter().map(|(_, r)| r.peak_above_idle_mib()).fold(0.0, f64::max);
        let each: Vec<String> =
            ctx.streams.iter().map(|(m, r)| format!("{m} +{:.1} MiB", r.peak_above_idle_mib())).collect();
        let ok = ctx.streams.iter().all(|(_, r)| (200..300).contains(&r.status));
        targets.push(Target {
            goal: "peak RSS streaming 1 GiB: < 64 MiB above idle".into(),
            measured: each.join(", "),
            met: Some(worst < 64.0 && ok),
        });
    }
    targets.extend(cpu_targets(ctx));
    let redis_missing = ctx.redis_missing.clone().unwrap_or_else(|| "not run (--no-redis)".into());
    for (prefix, what) in [("accepted", "accepted 1 KiB"), ("advancing", "advancing 1 KiB")] {
        targets.push(ratio_target(
            format!("Redis store ≥ 0.8 × embedded store throughput ({what})"),
            rps(prefix, "fencegate (redis store)"),
            rps(prefix, "fencegate"),
            0.8,
            &redis_missing,
        ));
    }
    if let [(small_n, small), (large_n, large), ..] = ctx.lookups[..] {
        targets.push(Target {
            goal: "fence lookup p99 with 1M resources ≤ 2 × with 1k".into(),
            measured: format!(
                "{} fences: {large:.2} ms / {} fences: {small:.2} ms = {:.2}×",
                thousands(large_n),
                thousands(small_n),
                large / small
            ),
            met: Some(large <= 2.0 * small && large_n >= 1_000_000),
        });
    }
    ctx.suite.targets = targets;
    ctx.suite.notes.extend(floor);
    ctx.suite.notes.extend(joint_bound(ctx));
}

/// The cost of a fence in server CPU per request, each against the floor the same run
/// measures (so the load client's share of the CPUs does not enter): accepted against the
/// signing proxy, stale against the 409 ceiling plus one SigV4 verification (timed here, in
/// process), advancing against the bare proxy, the Redis store against the embedded one.
fn cpu_targets(ctx: &Ctx) -> Vec<Target> {
    let cpu = |prefix: &str, path: &str| find_row(ctx, prefix, path).and_then(|r| r.cpu_us_per_request);
    let ratio = |goal: &str, num: Option<f64>, den: Option<f64>, factor: f64| match (num, den) {
        (Some(n), Some(d)) => Target {
            goal: goal.to_owned(),
            measured: format!("{n:.1} / {d:.1} µs = {:.2}×", n / d),
            met: Some(n <= factor * d),
        },
        _ => Target { goal: goal.to_owned(), measured: "not measured".into(), met: None },
    };
    let mut targets = vec![ratio(
        "server CPU, accepted, many resources: fencegate ≤ 1.15 × the signing proxy",
        cpu("accepted", "fencegate"),
        cpu("accepted", SIGNING_PROXY),
        1.15,
    )];
    let verify_us = crate::sigv4_cost::measure(50_000).verify_ns / 1000.0;
    let goal = "server CPU, stale 1 KiB: fencegate ≤ the 409 ceiling + one SigV4 verification + 1 µs";
    targets.push(match (cpu("stale", "fencegate"), cpu("stale", "409 ceiling")) {
        (Some(fenced), Some(ceiling)) => {
            let bound = ceiling + verify_us + 1.0;
            let verifying = cpu("stale", VERIFYING_CEILING)
                .map(|v| format!(" (the verifying 409 ceiling, measured: {v:.1} µs)"))
                .unwrap_or_default();
            Target {
                goal: goal.to_owned(),
                measured: format!(
                    "{fenced:.1} µs against {ceiling:.1} + {verify_us:.2} + 1 = {bound:.1} µs{verifying}"
                ),
                met: Some(fenced <= bound),
            }
        }
        _ => Target { goal: goal.to_owned(), measured: "not measured".into(), met: None },
    });
    targets.push(ratio(
        "server CPU, advancing: fencegate ≤ 1.8 × the bare proxy",
        cpu("advancing", "fencegate"),
        cpu("advancing", BARE_PROXY),
        1.8,
    ));
    targets.push(ratio(
        "server CPU, accepted, many resources: Redis store (appendfsync always) ≤ 1.15 × the embedded store",
        cpu("accepted", "fencegate (redis store)"),
        cpu("accepted", "fencegate"),
        1.15,
    ));
    targets
}

/// What the first and third targets ask together, against what this run's own rows allow:
/// accepted ≥ 0.9 × the bare proxy and stale ≥ 3 × accepted mean stale ≥ 2.7 × the bare
/// proxy. A rejection has cost the machine and the client more than a request to the 409
/// ceiling (the same client and loopback work, and a server that only answers) in every run
/// measured, so the ceiling's costs bound what a rejection can run at.
fn joint_bound(ctx: &Ctx) -> Option<String> {
    let bare = find_row(ctx, "accepted", BARE_PROXY)?;
    let ceiling = find_row(ctx, "stale", "409 ceiling")?;
    let costs = CeilingCosts {
        rate: ceiling.per_second?,
        machine_us: ceiling.machine_cpu_us_per_request.filter(|us| *us > 0.0)?,
        client_us: ceiling.client_cpu_us_per_request.filter(|us| *us > 0.0)?,
        cpus: procs::machine_busy_seconds()?.0,
    };
    Some(joint_bound_text(bare.per_second?, &costs))
}

/// The 409 ceiling's row: its rate, the machine's and the client's CPU µs per request, and
/// the machine's CPUs.
struct CeilingCosts {
    rate: f64,
    machine_us: f64,
    client_us: f64,
    cpus: usize,
}

fn joint_bound_text(bare_rate: f64, c: &CeilingCosts) -> String {
    let by_cpus = c.cpus as f64 * 1e6 / c.machine_us;
    let by_client = 1e6 / c.client_us;
    format!(
        "Targets 1 and 3 together need stale rejections ≥ 2.7 × the bare proxy's accepted writes: \
         {:.0} req/s in this run. The 409 ceiling ran {:.0} req/s ({:.2}× the bare proxy) at {:.2} µs of \
         the machine's CPU and {:.2} µs of the client's per request. At those costs, a rejection runs at \
         most {by_cpus:.0} req/s with all {} CPUs busy ({:.2}× the bare proxy), and at most \
         {by_client:.0} req/s on the client's one thread ({:.2}×).",
        2.7 * bare_rate,
        c.rate,
        c.rate / bare_rate,
        c.machine_us,
        c.client_us,
        c.cpus,
        by_cpus / bare_rate,
        by_client / bare_rate,
    )
}

/// How busy the machine is while every server idles, before the runs: the machine CPU
/// figures include it.
async fn idle_machine() -> String {
    const SPAN: Duration = Duration::from_secs(1);
    let before = procs::machine_busy_seconds();
    tokio::time::sleep(SPAN).await;
    match (before, procs::machine_busy_seconds()) {
        (Some((cpus, before)), Some((_, after))) => format!(
            "The machine ({cpus} CPUs in `/proc/stat`) was {:.3} CPUs busy while every server idled before \
             the runs; the machine CPU figures include such background.",
            (after - before) / SPAN.as_secs_f64()
        ),
        _ => "The machine's busy time could not be read from `/proc/stat`.".into(),
    }
}

fn write_outputs(ctx: &Ctx) -> anyhow::Result<()> {
    std::fs::create_dir_all(&ctx.args.out)?;
    let md = ctx.suite.markdown();
    std::fs::write(ctx.args.out.join("results.md"), &md)?;
    std::fs::write(ctx.args.out.join("chart.svg"), ctx.suite.svg())?;
    println!("{md}");
    eprintln!("wrote {} and {}", ctx.args.out.join("results.md").display(), ctx.args.out.join("chart.svg").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounds divide the machine's CPUs, and the client's one thread, by what one ceiling
    /// request cost each.
    #[test]
    fn the_joint_bound_compares_the_ceiling_s_machine_cost_with_what_the_targets_need() {
        let costs = CeilingCosts { rate: 120_000.0, machine_us: 12.5, client_us: 8.0, cpus: 2 };
        let text = joint_bound_text(50_000.0, &costs);
        assert!(text.contains(": 135000 req/s in this run"), "{text}");
        assert!(text.contains("120000 req/s (2.40× the bare proxy) at 12.50 µs"), "{text}");
        assert!(text.contains("most 160000 req/s with all 2 CPUs busy (3.20× the bare proxy)"), "{text}");
        assert!(text.contains("most 125000 req/s on the client's one thread (2.50×)"), "{text}");
    }
}
