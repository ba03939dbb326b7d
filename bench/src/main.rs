//! `fencegate-bench`: what fencing costs, and what rejection costs.
//!
//! - `upstream`: the in-memory S3-compatible upstream (or, with `--reject-all`, the 409
//!   ceiling), printing its bound address;
//! - `proxy`: the bare hyper reverse proxy (no authentication, no fence), the ladder's
//!   measure of what the Rust stack itself costs;
//! - `load`: one bounded load against any target, with throughput, p50/p99/p99.9 and status
//!   counts;
//! - `run`: the whole suite (upstream directly, nginx, fencegate side by side), written as a
//!   Markdown table and an SVG chart;
//! - `sigv4-cost`: what fencegate's SigV4 check and re-signing cost natively.
//!
//! Layout: `upstream` (the fixture), `proxy` (the bare proxy), `sign` (SigV4 heads), `scenario` (what each connection
//! sends), `load` (the keep-alive driver), `large` (64 MiB and 1 GiB bodies), `procs` (child
//! processes and `/proc`), `suite` (the `run` command), `report` (table and chart).

mod large;
mod listing;
mod load;
mod procs;
mod proxy;
mod report;
mod scenario;
mod sign;
mod sigv4_cost;
mod suite;
mod upstream;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use http::Method;

use crate::scenario::{Params, Scenario};
use crate::sign::Signer;

/// The first words of the upstream's ready line; the address follows.
pub const UPSTREAM_READY: &str = "fencegate-bench upstream listening on ";
/// The bucket every scenario writes into.
pub const BUCKET: &str = "bench";

#[derive(Parser)]
#[command(name = "fencegate-bench", version, about = "Load benchmarks for fencegate")]
struct Cli {
    /// Worker threads of the bench's own runtime (the load client). One keeps the client's
    /// share of a small machine bounded and the same for every path measured.
    #[arg(long, default_value_t = 1, global = true)]
    threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the in-memory S3-compatible upstream (accepts any signature: a fixture).
    Upstream {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// Answer 409 to everything without reading the body (the rejection ceiling).
        #[arg(long)]
        reject_all: bool,
        /// Bodies up to this size are kept; larger ones are counted and discarded.
        #[arg(long, default_value_t = upstream::RETAIN_BYTES_MAX_DEFAULT)]
        retain_bytes_max: usize,
    },
    /// Run the bare hyper reverse proxy (no authentication, no fence) in front of `--upstream`.
    Proxy {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        #[arg(long)]
        upstream: SocketAddr,
        /// The signing proxy: verify each request's SigV4 signature and sign it anew for the
        /// upstream, with fencegate's own code (the floor under a fenced write).
        #[arg(long)]
        sigv4: bool,
        /// Answer the 409 ceiling's 409 after the checks instead of forwarding: with `--sigv4`,
        /// the verifying 409 ceiling.
        #[arg(long)]
        reject: bool,
    },
    /// Drive one bounded load against a target and print what it measured.
    Load(LoadArgs),
    /// Run the whole suite and write `results.md` and `chart.svg` into `--out`.
    Run(suite::RunArgs),
    /// Time fencegate's SigV4 check of a client's head and its signing of the upstream's.
    Sigv4Cost {
        /// Calls per round (7 rounds; the median is printed).
        #[arg(long, default_value_t = 200_000)]
        iterations: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LoadScenario {
    Accepted,
    AcceptedOneResource,
    Advancing,
    Stale,
    /// `accepted-one-resource` signed with lease credentials: a lease on `bench:lease` is
    /// granted through the target first (signed with `--access-key-id`, which must be able to
    /// grant it) and released at the end.
    AcceptedLease,
    /// Stale uploads of `--large-bytes` (64 MiB), one at a time, without `Expect`.
    StaleLarge,
    /// Stale uploads of `--large-bytes` with `Expect: 100-continue`.
    StaleLargeExpect,
}

#[derive(Args)]
struct LoadArgs {
    /// `http://127.0.0.1:PORT` of fencegate, nginx or the upstream.
    #[arg(long)]
    target: String,
    #[arg(long, value_enum, default_value = "accepted")]
    scenario: LoadScenario,
    #[arg(long, default_value_t = 32)]
    connections: usize,
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    #[arg(long, default_value_t = 1_000_000)]
    requests_max: u64,
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Objects each connection writes in turn.
    #[arg(long, default_value_t = 32)]
    keys_per_connection: usize,
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    large_bytes: usize,
    /// The target's pid: large uploads then report the bytes it read (strace, when installed).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Create the bucket through the target first.
    #[arg(long)]
    create_bucket: bool,
    #[arg(long, default_value = BUCKET)]
    bucket: String,
    #[arg(long, default_value = sign::ACCESS_KEY_ID)]
    access_key_id: String,
    #[arg(long, default_value = sign::SECRET_ACCESS_KEY)]
    secret_access_key: String,
    #[arg(long, default_value = sign::REGION)]
    region: String,
    /// Names the run's objects: a second load with the same id, scenario, connections and
    /// keys per connection, and `--no-prime`, finds the steady state the first one left (the
    /// default is new names for every run). Not for `advancing`, whose tokens start at 1 again.
    #[arg(long)]
    run_id: Option<String>,
    /// Skip the untimed priming pass: only the scenario's own requests are sent. Needs a run
    /// with the same `--run-id` before it, or the first requests find no fence or object.
    #[arg(long, requires = "run_id")]
    no_prime: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(cli.threads.max(1)).enable_all().build();
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fencegate-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Upstream { listen, reject_all, retain_bytes_max } => {
                let mode = if reject_all { upstream::Mode::RejectAll } else { upstream::Mode::Store };
                upstream::serve(listen, mode, retain_bytes_max, |addr| {
                    // One parseable line on stdout: the suite waits for it.
                    println!("{UPSTREAM_READY}{addr}");
                })
                .await
            }
            Command::Proxy { listen, upstream, sigv4, reject } => {
                proxy::serve(listen, upstream, sigv4, reject, |addr| println!("{UPSTREAM_READY}{addr}")).await
            }
            Command::Load(args) => load_command(args).await,
            Command::Run(args) => suite::run(args).await,
            Command::Sigv4Cost { iterations } => {
                sigv4_cost::print(iterations);
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fencegate-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `http://host:port` → the socket address and the authority to sign.
pub fn parse_target(target: &str) -> anyhow::Result<(SocketAddr, String)> {
    let uri: http::Uri = target.parse().with_context(|| format!("--target {target:?}"))?;
    let authority = uri.authority().with_context(|| format!("--target {target:?} has no host:port"))?.to_string();
    let addr = authority.parse().with_context(|| format!("--target {target:?}: use an IP address and a port"))?;
    Ok((addr, authority))
}

/// Creates `bucket` through `addr` with a signed CreateBucket.
pub async fn create_bucket(addr: SocketAddr, authority: &str, signer: &Signer, bucket: &str) -> anyhow::Result<u16> {
    let path = format!("/{bucket}");
    let headers = signer.sign(&Method::PUT, authority, &path, &[])?;
    let mut sender = load::connect::<http_body_util::Empty<Bytes>>(addr).await?;
    let mut req = http::Request::new(http_body_util::Empty::new());
    *req.method_mut() = Method::PUT;
    *req.uri_mut() = path.parse()?;
    *req.headers_mut() = headers;
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    Ok(resp.status().as_u16())
}

pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{:x}", nanos & 0xffff_ffff_ffff)
}

async fn load_command(args: LoadArgs) -> anyhow::Result<()> {
    let (addr, authority) = parse_target(&args.target)?;
    let mut signer = Signer::new(&args.access_key_id, &args.secret_access_key, &args.region);
    if args.create_bucket {
        let status = create_bucket(addr, &authority, &signer, &args.bucket).await?;
        println!("create bucket {}: {status}", args.bucket);
    }
    let lease = match args.scenario {
        LoadScenario::AcceptedLease => {
            let (client, lease_id, (key, secret, token)) =
                suite::grant_lease(&args.target, &args.access_key_id, &args.secret_access_key, &args.region).await?;
            signer = Signer::with_session_token(&key, &secret, Some(token), &args.region);
            Some((client, lease_id))
        }
        _ => None,
    };
    let params = Params {
        signer: &signer,
        authority,
        bucket: args.bucket.clone(),
        run_id: args.run_id.clone().unwrap_or_else(run_id),
        connections: args.connections,
        keys_per_connection: args.keys_per_connection,
        body: Bytes::from(vec![b'x'; args.body_bytes]),
        requests_max: args.requests_max,
    };
    let limits = load::Limits {
        connections: args.connections,
        duration: Duration::from_secs(args.duration_s),
        requests_max: args.requests_max,
        request_timeout: Duration::from_secs(30),
    };
    let scenario = match args.scenario {
        LoadScenario::Accepted => Scenario::Accepted,
        LoadScenario::AcceptedOneResource => Scenario::AcceptedOneResource,
        LoadScenario::Advancing => Scenario::Advancing,
        LoadScenario::Stale => Scenario::Stale,
        LoadScenario::AcceptedLease => Scenario::AcceptedLease,
        LoadScenario::StaleLarge | LoadScenario::StaleLargeExpect => {
            let expect = args.scenario == LoadScenario::StaleLargeExpect;
            let body = Bytes::from(vec![b'x'; args.large_bytes]);
            let r = suite::stale_large(addr, &params, body, expect, &limits, args.server_pid).await?;
            println!("{}", suite::large_outcome(&r));
            return Ok(());
        }
    };
    let workload = scenario::build(scenario, &params)?;
    if !args.no_prime {
        let primed = load::run(addr, workload.prime.clone(), &suite::prime_limits(&limits)).await;
        if primed.completed > 0 {
            println!("primed: {}", primed.statuses_text());
        }
    }
    let report = load::run(addr, workload.timed.clone() as Arc<_>, &limits).await;
    println!(
        "{} against {}: {:.0} req/s over {:.1} s, p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms; {}; {} connections opened",
        scenario.name(),
        args.target,
        report.per_second(),
        report.elapsed.as_secs_f64(),
        report.ms(0.5),
        report.ms(0.99),
        report.ms(0.999),
        report.statuses_text(),
        report.connects
    );
    if let Some((client, lease_id)) = lease {
        client.release(scenario::LEASE, &lease_id).await?;
    }
    Ok(())
}
