//! An example worker that plays the classic fencing scenario: it acquires lease `--name`,
//! then runs its steps (writes through fencegate with aws-sdk-s3, the token attached by the
//! interceptor; pauses; waits for a line on stdin), printing one machine-readable line per
//! event on stdout:
//!
//! ```text
//! acquired name=job:report holder=a token=7 lease_id=... ttl_ms=1000
//! acquire waiting holder=b remaining_ms=420
//! waiting
//! resumed
//! slept ms=200
//! wrote key=report.csv status=ok
//! write rejected key=report.csv status=409 code=FencingTokenStale current=8
//! write failed key=report.csv status=503 code=SlowDown
//! lease lost reason=deadline            (or reason=refused)
//! stopped reason=lease-lost
//! released
//! done
//! ```
//!
//! Exit codes: 0 every step done; 1 unexpected error; 2 bad arguments; 3 the lease is held by
//! someone else (after `--acquire-timeout-ms`); 4 a write was rejected as stale (409
//! `FencingTokenStale`); 5 the lease was lost and the worker stopped before writing.
//!
//! By default the worker stops writing once its lease is lost, as a worker should. With
//! `--ignore-lost` it writes anyway, like a worker that never looked: fencegate refuses it.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::primitives::ByteStream;
use clap::Parser;
use fencegate_client::cli::Connection;
use fencegate_client::{Credentials, FencingInterceptor, Lease, LeaseClient, LeaseError, LeaseOptions, LeaseStatus};
use tokio::io::AsyncBufReadExt;

const EXIT_ERROR: u8 = 1;
const EXIT_HELD: u8 = 3;
const EXIT_REJECTED: u8 = 4;
const EXIT_LOST: u8 = 5;

/// The longest pause between two acquire attempts while someone else holds the lease.
const ACQUIRE_RETRY_MAX: Duration = Duration::from_millis(500);

#[derive(Parser, Debug)]
#[command(name = "fencegate-worker", about = "Acquire a fencegate lease and write through fencegate under it")]
struct Args {
    /// fencegate, and the credential that asks for the lease (an issuer).
    #[command(flatten)]
    connection: Connection,
    /// The lease, which is also the resource every write is fenced on.
    #[arg(long)]
    name: String,
    /// Who holds the lease (for humans and logs).
    #[arg(long)]
    holder: String,
    #[arg(long, default_value_t = 10_000)]
    ttl_ms: u64,
    /// Renewal interval; default a third of the TTL.
    #[arg(long)]
    renew_ms: Option<u64>,
    /// Keep trying this long while someone else holds the lease (0: try once).
    #[arg(long, default_value_t = 0)]
    acquire_timeout_ms: u64,
    /// The bucket the writes go to (created if missing).
    #[arg(long)]
    bucket: String,
    /// Write even after the lease is lost (to show that fencegate refuses it).
    #[arg(long)]
    ignore_lost: bool,
    /// Steps, in order: `write:KEY=BODY`, `sleep:MS`, `wait` (for a line on stdin), `release`.
    #[arg(required = true)]
    steps: Vec<Step>,
}

#[derive(Debug, Clone)]
enum Step {
    Write { key: String, body: String },
    Sleep(Duration),
    Wait,
    Release,
}

impl std::str::FromStr for Step {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(rest) = s.strip_prefix("write:") {
            let (key, body) = rest.split_once('=').ok_or("write:KEY=BODY")?;
            return Ok(Self::Write { key: key.into(), body: body.into() });
        }
        if let Some(ms) = s.strip_prefix("sleep:") {
            return Ok(Self::Sleep(Duration::from_millis(ms.parse().map_err(|_| "sleep:MS")?)));
        }
        match s {
            "wait" => Ok(Self::Wait),
            "release" => Ok(Self::Release),
            _ => Err(format!("unknown step {s:?}: write:KEY=BODY, sleep:MS, wait, release")),
        }
    }
}

/// Prints `lease lost reason=...` exactly once, whoever notices first.
#[derive(Clone, Default)]
struct LossReport(Arc<AtomicBool>);

impl LossReport {
    fn report(&self, lease: &Lease) {
        if let LeaseStatus::Lost(reason) = lease.status()
            && !self.0.swap(true, Ordering::SeqCst)
        {
            println!("lease lost reason={reason}");
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            println!("error message={:?}", format!("{error:#}"));
            ExitCode::from(EXIT_ERROR)
        }
    }
}

async fn run(args: Args) -> Result<u8, Box<dyn std::error::Error>> {
    let credentials = args.connection.credentials("fencegate-worker");
    let client = LeaseClient::new(&args.connection.endpoint, credentials.clone(), &args.connection.region)?;
    let Some(lease) = acquire(&client, &args).await? else {
        return Ok(EXIT_HELD);
    };
    println!(
        "acquired name={} holder={} token={} lease_id={} ttl_ms={}",
        lease.name(),
        lease.holder(),
        lease.token(),
        lease.lease_id(),
        args.ttl_ms
    );

    // Report a loss as soon as it happens, even while a step is waiting.
    let losses = LossReport::default();
    let mut watch = lease.watch();
    let watcher = tokio::spawn({
        let losses = losses.clone();
        async move {
            if let Ok(status) = watch.wait_for(|s| matches!(s, LeaseStatus::Lost(_))).await
                && let LeaseStatus::Lost(reason) = *status
                && !losses.0.swap(true, Ordering::SeqCst)
            {
                println!("lease lost reason={reason}");
            }
        }
    });

    let fencing = FencingInterceptor::for_lease(&lease);
    let s3 = s3_client(&args, credentials, fencing);
    ensure_bucket(&s3, &args.bucket).await?;

    let mut lease = Some(lease);
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    for step in &args.steps {
        match step {
            Step::Sleep(pause) => {
                tokio::time::sleep(*pause).await;
                println!("slept ms={}", pause.as_millis());
            }
            Step::Wait => {
                println!("waiting");
                let _ = stdin.next_line().await?;
                println!("resumed");
            }
            Step::Release => {
                let Some(held) = lease.take() else { continue };
                match held.release().await {
                    Ok(()) => println!("released"),
                    Err(LeaseError::Gone { .. }) => println!("release refused code=LeaseGone"),
                    Err(e) => return Err(e.into()),
                }
            }
            Step::Write { key, body } => {
                if let Some(held) = &lease {
                    let is_held = held.is_held();
                    losses.report(held);
                    if !is_held && !args.ignore_lost {
                        println!("stopped reason=lease-lost");
                        return Ok(EXIT_LOST);
                    }
                }
                if let Some(code) = write(&s3, &args.bucket, key, body).await {
                    return Ok(code);
                }
            }
        }
    }
    watcher.abort();
    println!("done");
    Ok(0)
}

/// Acquires the lease, retrying while it is held until `--acquire-timeout-ms`.
async fn acquire(client: &LeaseClient, args: &Args) -> Result<Option<Lease>, LeaseError> {
    let ttl = Duration::from_millis(args.ttl_ms);
    let options = match args.renew_ms {
        Some(ms) => LeaseOptions::default().renew_every(Duration::from_millis(ms)),
        None => LeaseOptions::default(),
    };
    let give_up = tokio::time::Instant::now() + Duration::from_millis(args.acquire_timeout_ms);
    loop {
        match client.acquire_with(&args.name, &args.holder, ttl, options.clone()).await {
            Ok(lease) => return Ok(Some(lease)),
            Err(LeaseError::Held { holder, remaining_ms }) => {
                let now = tokio::time::Instant::now();
                if now >= give_up {
                    println!("acquire refused code=LeaseHeld holder={holder} remaining_ms={remaining_ms}");
                    return Ok(None);
                }
                println!("acquire waiting holder={holder} remaining_ms={remaining_ms}");
                let pause = Duration::from_millis(remaining_ms + 1).min(ACQUIRE_RETRY_MAX).min(give_up - now);
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One fenced PutObject. `Some(exit code)` when the worker must stop.
async fn write(s3: &aws_sdk_s3::Client, bucket: &str, key: &str, body: &str) -> Option<u8> {
    let put = s3.put_object().bucket(bucket).key(key).body(ByteStream::from(body.as_bytes().to_vec())).send().await;
    let err = match put {
        Ok(_) => {
            println!("wrote key={key} status=ok");
            return None;
        }
        Err(err) => err,
    };
    let Some(raw) = err.raw_response() else {
        println!("write failed key={key} error={:?}", aws_sdk_s3::error::DisplayErrorContext(&err).to_string());
        return Some(EXIT_ERROR);
    };
    let status = raw.status().as_u16();
    let current = raw.headers().get("fencing-token-current").unwrap_or("-").to_owned();
    let code = err.as_service_error().and_then(|e| e.code()).unwrap_or("-").to_owned();
    if status == 409 && code == "FencingTokenStale" {
        println!("write rejected key={key} status={status} code={code} current={current}");
        return Some(EXIT_REJECTED);
    }
    println!("write failed key={key} status={status} code={code}");
    Some(EXIT_ERROR)
}

async fn ensure_bucket(s3: &aws_sdk_s3::Client, bucket: &str) -> Result<(), Box<dyn std::error::Error>> {
    if s3.head_bucket().bucket(bucket).send().await.is_ok() {
        return Ok(());
    }
    match s3.create_bucket().bucket(bucket).send().await {
        Ok(_) => Ok(()),
        // Another worker created it meanwhile.
        Err(e) if e.as_service_error().is_some_and(|e| e.is_bucket_already_owned_by_you()) => Ok(()),
        Err(e) if e.as_service_error().and_then(|e| e.code()) == Some("BucketAlreadyExists") => Ok(()),
        Err(e) => Err(aws_sdk_s3::error::DisplayErrorContext(e).to_string().into()),
    }
}

fn s3_client(args: &Args, credentials: Credentials, fencing: FencingInterceptor) -> aws_sdk_s3::Client {
    let http = aws_smithy_http_client::Builder::new().build_http();
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(args.connection.region.clone()))
        .endpoint_url(&args.connection.endpoint)
        .force_path_style(true)
        .credentials_provider(credentials)
        .http_client(http)
        .interceptor(fencing)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}
