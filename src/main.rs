//! The `fencegate` command.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use fencegate::config::{Config, LogFormat};
use fencegate::{App, reconcile};
use tracing_subscriber::EnvFilter;

/// Every request allocates a few dozen small buffers (headers, signatures, paths): glibc's
/// allocator was a sixth of the CPU profile of an accepted write; mimalloc's thread-local
/// free lists make that a fraction (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A fenced write proxy: rejects writes from stale lease holders in front of S3-compatible
/// object storage.
#[derive(Parser)]
#[command(name = "fencegate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy and the admin listener.
    Serve {
        /// The TOML config file. Every key can be overridden from the environment as
        /// FENCEGATE_<SECTION>__<KEY> (e.g. FENCEGATE_SERVER__LISTEN=127.0.0.1:9000).
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
    },
    /// Validate a config file (with environment overrides) and print the result.
    CheckConfig {
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
    },
    /// Ask a running fencegate's admin listener whether it is ready (`GET /readyz`): exit 0 if
    /// it is, 1 otherwise. For container health checks.
    Health {
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
    },
    /// Mark a new Redis fence store as new, once, before its first use. A store found without
    /// its marks is taken as one that lost its state (flushed, restarted empty), and admits no
    /// write for the in-flight registrations' time to live. Never run it on a store that lost
    /// its state: that is what the quiet period protects. With --accept-restored, take an
    /// embedded store its witness refuses (an older copy put back) as it is.
    InitStore {
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
        /// Embedded store: take the store as it is for the newest copy although its witness
        /// saw later commits or another store (a restored copy it refuses). Its fences may be
        /// below tokens used since the copy; the next start holds writes as after a crash.
        #[arg(long)]
        accept_restored: bool,
    },
    /// Ask the running fencegate the config names to compare its upstream with its fences:
    /// API gateway requests whose outcome is unknown and, in a bucket, uploads of superseded
    /// tokens, objects written around fencegate, objects stamped above their fence. Exits 0
    /// when it found nothing, 1 when it found something, 2 on an error.
    Reconcile {
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
        /// The bucket to scan (without one, only the gateway's records are read).
        #[arg(long)]
        bucket: Option<String>,
        /// Only keys that start with this (in the bucket).
        #[arg(long, default_value = "", requires = "bucket")]
        prefix: String,
        /// Fix the findings of these kinds, comma-separated: `stale_upload` aborts the uploads
        /// of superseded tokens, `raise_fence` raises lost fences to their objects' stamps
        /// (never lowers one; stamps are not authenticated). Named, never implied.
        #[arg(long, value_name = "KINDS", num_args = 0..=1, default_missing_value = "")]
        apply: Option<String>,
        /// JSON lines on stdout (a finding per line, then the summary) instead of a table.
        #[arg(long)]
        json: bool,
        /// An upload of its resource's current token open longer than this is reported
        /// (`old_upload`; never applied). A day unless given.
        #[arg(long, value_name = "MS")]
        old_upload_after_ms: Option<u64>,
    },
    /// Check that the configured upstream enforces If-Match / If-None-Match, then exit.
    Probe {
        #[arg(long, short, default_value = "config/fencegate.toml")]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve { config } => load(&config).and_then(|c| runtime()?.block_on(serve(c))).map(done),
        Command::CheckConfig { config } => load(&config).map(|c| {
            // The effective config (file, include and environment), as a file `serve` reads;
            // secrets shown as `<hidden: key>`.
            print!("{}", c.to_toml());
            // As comments, so that the output stays a file `serve` reads.
            for risk in c.risks() {
                println!("# risk: {risk}");
            }
            ExitCode::SUCCESS
        }),
        Command::InitStore { config, accept_restored } => load(&config).and_then(|c| {
            let done = if accept_restored {
                fencegate::accept_restored_store(&c)?
            } else {
                runtime()?.block_on(fencegate::init_store(&c))?
            };
            println!("{done}");
            Ok(ExitCode::SUCCESS)
        }),
        Command::Health { config } => load(&config).and_then(|c| runtime()?.block_on(health(&c))).map(done),
        Command::Reconcile { config, bucket, prefix, apply, json, old_upload_after_ms } => {
            let apply = match apply.as_deref().map(fencegate::jobs::ApplyKind::parse_list).transpose() {
                Ok(kinds) => kinds.unwrap_or_default(),
                Err(_) if apply.as_deref() == Some("") => {
                    eprintln!(
                        "error: --apply needs the kinds of findings to fix, comma-separated:\n  \
                         stale_upload  abort the incomplete uploads of superseded tokens\n  \
                         raise_fence   raise lost fences to their objects' stamps, which are not \
                         authenticated: whoever can write the upstream directly can forge one"
                    );
                    return ExitCode::from(2);
                }
                Err(error) => {
                    eprintln!("error: --apply: {error}");
                    return ExitCode::from(2);
                }
            };
            let ask = reconcile::Ask { bucket, prefix, apply, json, old_upload_after_ms };
            // 1 says "found something" to cron and CI; an error is 2, not to be taken for it.
            match load(&config).and_then(|c| runtime()?.block_on(reconcile::reconcile(&c, &ask))) {
                Ok(reconcile::Outcome::Clean) => Ok(ExitCode::SUCCESS),
                Ok(reconcile::Outcome::Found) => Ok(ExitCode::from(1)),
                Err(error) => {
                    eprintln!("fencegate: {error:#}");
                    return ExitCode::from(2);
                }
            }
        }
        Command::Probe { config } => load(&config).and_then(|c| runtime()?.block_on(probe(c))).map(done),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("fencegate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn done((): ()) -> ExitCode {
    ExitCode::SUCCESS
}

/// `fencegate probe`: the probe's findings in one line, exit 0; a probe that failed or could
/// not run says why, exit 1.
async fn probe(config: Config) -> anyhow::Result<()> {
    let mut interrupted = Box::pin(shutdown_signal()?);
    let app = App::build(config).await?;
    let probed = tokio::select! {
        probed = app.run_probe() => Some(probed),
        () = &mut interrupted => None,
    };
    // Nothing was served: a store that opened clean stays clean, interrupted or not.
    app.close_unused();
    let probed = probed.ok_or_else(|| anyhow::anyhow!("interrupted: the upstream probe did not finish"))?;
    let probed = probed.map_err(|error| anyhow::anyhow!(fencegate::probe_failure(&error)))?;
    let form = match probed.etag_form {
        fencegate::upstream::EtagForm::Quoted => "",
        fencegate::upstream::EtagForm::Bare => " (If-Match sent with the bare ETag, the form this upstream compares)",
    };
    match probed.enforcement.ignored() {
        ignored if ignored.is_empty() => println!(
            "upstream enforces preconditions on PutObject, CopyObject, CompleteMultipartUpload, DeleteObject{form}"
        ),
        ignored => {
            println!("upstream enforces preconditions on PutObject; ignores them on: {}{form}", ignored.join(", "))
        }
    }
    Ok(())
}

fn load(path: &std::path::Path) -> anyhow::Result<Config> {
    let config = Config::load(path)?;
    init_tracing(&config);
    Ok(config)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// `GET /readyz` on the admin listener (on loopback when it listens on every address).
async fn health(config: &Config) -> anyhow::Result<()> {
    use http_body_util::Empty;
    let addr = reconcile::reachable(config.server.admin_listen);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let uri: http::Uri = format!("http://{addr}/readyz").parse()?;
    let asked = async {
        let answer = client.get(uri).await?;
        let status = answer.status();
        let body = http_body_util::BodyExt::collect(answer.into_body()).await?.to_bytes();
        anyhow::Ok((status, body))
    };
    let answer = tokio::time::timeout(std::time::Duration::from_secs(5), asked).await;
    let (status, body) = answer.map_err(|_| anyhow::anyhow!("{addr} did not answer within 5 s"))??;
    if status != http::StatusCode::OK {
        // Each cause, as /readyz names it (its problem document's `detail`).
        let detail = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|problem| problem["detail"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_owned());
        anyhow::bail!("not ready (/readyz answered {status}): {detail}");
    }
    println!("ready");
    Ok(())
}

async fn serve(config: Config) -> anyhow::Result<()> {
    for risk in config.risks() {
        tracing::warn!("{risk}");
    }
    let mut shutdown = Box::pin(shutdown_signal()?);
    let mut app = tokio::select! {
        app = App::build(config) => app?,
        // Stopped while the store opened (a Redis that does not answer): nothing was served.
        () = &mut shutdown => return Ok(()),
    };
    let prepared = tokio::select! {
        prepared = async {
            app.probe().await?;
            app.check_upstream().await;
            anyhow::Ok(())
        } => prepared,
        () = &mut shutdown => {
            // Stopped before serving: nothing was sent, and a clean store stays clean.
            app.close_unused();
            return Ok(());
        }
    };
    prepared?;
    let (s3, admin) = app.bind().await?;
    let bound = fencegate::Bound { s3: s3.local_addr()?, admin: admin.local_addr()? };
    // One parseable line on stdout: scripts and tests wait for it.
    println!("fencegate ready: s3={} admin={}", bound.s3, bound.admin);
    tracing::info!(s3 = %bound.s3, admin = %bound.admin, "listening");
    app.serve(s3, admin, shutdown).await
}

/// Resolves at the first SIGTERM or SIGINT. The handlers are installed when this is called, not
/// when it is first polled: a SIGTERM right after "fencegate ready" is then a clean stop, not
/// the default action's kill (which left the store unclean and made the next start hold).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

fn init_tracing(config: &Config) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.log.level));
    // The S3 library logs the signature it expected at debug level: a signing oracle for anyone
    // who reads the logs. It never logs below info, whatever the level asked for; below that
    // cap it follows the level asked for (a cap set at `warn` would turn its info spans on).
    let verbose = filter.max_level_hint().is_none_or(|max| max > tracing_subscriber::filter::LevelFilter::INFO);
    let filter = if verbose { filter.add_directive("s3s=info".parse().expect("a static directive")) } else { filter };
    // It also logs every 5xx it returns at ERROR with the whole response, and every error an
    // operation answers (a 404, a 412: the local upstream's ordinary answers, and the clients'
    // own mistakes) at ERROR too: fencegate logs its own refusals and failures with their
    // cause (and counts the library's refusals in `fencegate_s3_protocol_refusals_total`).
    let filter = filter.add_directive("s3s::service=off".parse().expect("a static directive"));
    let filter = filter.add_directive("s3s::ops=off".parse().expect("a static directive"));
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in a file or a log collector.
        .with_ansi(std::io::stderr().is_terminal());
    // Directives more specific than the ones above (`RUST_LOG=s3s::ops::signature=debug`) win
    // over them in an env filter: the library's cap is a filter of its own, which no directive
    // lifts.
    let repeats = fencegate::logs::RepeatLimit::default();
    repeats.flush_every_window();
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::filter::filter_fn(library_cap))
        .with(repeats);
    match config.log.format {
        LogFormat::Json => registry.with(fmt.json()).init(),
        LogFormat::Text => registry.with(fmt).init(),
    }
}

/// What the S3 library may log, whatever the level asked for: nothing of its services and
/// operations (their errors are fencegate's to log), and nothing below `info` elsewhere (at
/// `debug` it prints the signature it expected).
fn library_cap(meta: &tracing::Metadata<'_>) -> bool {
    let target = meta.target();
    if target != "s3s" && !target.starts_with("s3s::") {
        return true;
    }
    let quiet = ["s3s::service", "s3s::ops"].iter().any(|m| target == *m || target.starts_with(&format!("{m}::")));
    !quiet && *meta.level() <= tracing::Level::INFO
}
