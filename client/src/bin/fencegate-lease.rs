//! `fencegate-lease`: unmodified S3 tools fenced by a lease (docs/leases.md).
//!
//! ```text
//! fencegate-lease run NAME [--ttl-ms N] -- COMMAND [ARGS...]
//! fencegate-lease acquire NAME [--ttl-ms N] [--env]
//! fencegate-lease renew NAME LEASE_ID
//! fencegate-lease release NAME LEASE_ID
//! ```
//!
//! `run` acquires lease NAME with lease credentials, runs COMMAND with `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN` and `AWS_ENDPOINT_URL` set to them (and
//! `FENCEGATE_LEASE_NAME`, `FENCEGATE_LEASE_TOKEN`), renews the lease every ttl/3, and when the
//! lease is lost stops COMMAND (SIGTERM to its process group, SIGKILL after `--grace-ms`).
//! SIGINT, SIGTERM and SIGHUP sent to `fencegate-lease` go on to COMMAND. The lease is released
//! when COMMAND ends. A watchdog process (`fencegate-lease __watch`) stops COMMAND's group if
//! `fencegate-lease` itself is killed without the chance to. Like `etcdctl lock NAME -- COMMAND`, but fenced at the storage: a write
//! COMMAND sends after the lease was lost is refused by fencegate, whether or not it was
//! stopped in time.
//!
//! fencegate's endpoint comes from `--endpoint` or `FENCEGATE_ENDPOINT`; the credential that
//! asks for the lease (`role = "lessee"`, a worker's key, or `"issuer"`) from
//! `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`. After `eval "$(fencegate-lease acquire
//! NAME --env)"` those are the lease credential's (with `AWS_SESSION_TOKEN`), which renews and
//! releases its own lease, so `renew` and `release` work in the same shell.
//!
//! Exit status of `run`: COMMAND's own (128 + N if a signal N ended it); 75 if the lease was lost
//! while COMMAND ran (it was stopped, or it had ended by the time the loss was seen: lapsed,
//! released by someone else, or superseded by a newer token, which it says); 69 if someone else holds the lease (after `--wait-ms`);
//! 1 if fencegate refused or could not be reached; 2 for bad arguments. `acquire`, `renew` and
//! `release` exit 0, 69 (held), 1 (refused, gone, unreachable) or 2.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fencegate_client::cli::Connection;
use fencegate_client::{Grant, Lease, LeaseClient, LeaseError, LeaseOptions, LeaseStatus, LostReason};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::Child;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

const EXIT_FAILED: u8 = 1;
const EXIT_USAGE: u8 = 2;
/// `EX_UNAVAILABLE`: the lease is someone else's.
const EXIT_HELD: u8 = 69;
/// `EX_TEMPFAIL`: the lease was lost under the command, which was stopped; try again.
const EXIT_LOST: u8 = 75;

/// The longest pause between two acquire attempts while someone else holds the lease.
const ACQUIRE_RETRY_MAX: Duration = Duration::from_millis(500);

#[derive(Parser, Debug)]
#[command(
    name = "fencegate-lease",
    version,
    about = "Run a command under a fencegate lease, fenced by lease credentials"
)]
struct Cli {
    /// fencegate, and the issuer credential (`role = "issuer"`) that asks for the lease.
    #[command(flatten)]
    connection: Connection,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug)]
struct AcquireArgs {
    /// The lease, which is also the resource its credentials write to.
    name: String,
    #[arg(long, default_value_t = 30_000)]
    ttl_ms: u64,
    /// Who holds the lease, for humans and logs (default: host and process id).
    #[arg(long)]
    holder: Option<String>,
    /// Keep trying this long while someone else holds the lease (0: try once).
    #[arg(long, default_value_t = 0)]
    wait_ms: u64,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Acquire NAME with credentials, run COMMAND with them, renew, stop COMMAND if the lease is lost.
    Run {
        #[command(flatten)]
        lease: AcquireArgs,
        /// After SIGTERM, how long COMMAND has to end before SIGKILL.
        #[arg(long, default_value_t = 10_000)]
        grace_ms: u64,
        /// The command and its arguments, after `--`.
        #[arg(required = true, last = true)]
        command: Vec<OsString>,
    },
    /// Acquire NAME with credentials; print the grant as JSON (or as shell `export` lines).
    Acquire {
        #[command(flatten)]
        lease: AcquireArgs,
        /// Print `export VAR='value'` lines for `eval` instead of JSON.
        #[arg(long)]
        env: bool,
    },
    /// Renew lease NAME held with LEASE_ID (extends its credentials too).
    Renew { name: String, lease_id: String },
    /// Release lease NAME held with LEASE_ID.
    Release { name: String, lease_id: String },
    /// Internal: the watchdog `run` (process RUN_PID, started at RUN_STARTED) starts beside
    /// COMMAND. When `run` ends without saying so (killed with SIGKILL), its end of the
    /// watchdog's stdin closes, and the watchdog stops COMMAND's process group and what had
    /// left it, as `run` would have.
    #[command(name = "__watch", hide = true)]
    Watch { group: i32, grace_ms: u64, run_pid: u32, run_started: u64 },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let client = match cli.connection.lease_client("fencegate-lease") {
        Ok(client) => client,
        Err(error) => {
            eprintln!("fencegate-lease: {error}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let code = match cli.command {
        Command::Run { ref lease, grace_ms, ref command } => {
            run(&client, &cli, lease, Duration::from_millis(grace_ms), command).await
        }
        Command::Acquire { ref lease, env } => acquire_once(&client, lease, env, &cli.connection.endpoint).await,
        Command::Renew { ref name, ref lease_id } => match client.renew(name, lease_id).await {
            Ok(grant) => {
                println!("{}", grant_json(&grant));
                0
            }
            Err(error) => failed(&error),
        },
        Command::Release { ref name, ref lease_id } => match client.release(name, lease_id).await {
            Ok(()) => 0,
            Err(error) => failed(&error),
        },
        Command::Watch { group, grace_ms, run_pid, run_started } => {
            watch(Pid::from_raw(group), Duration::from_millis(grace_ms), (run_pid, run_started)).await
        }
    };
    ExitCode::from(code)
}

async fn run(client: &LeaseClient, cli: &Cli, args: &AcquireArgs, grace: Duration, command: &[OsString]) -> u8 {
    // Whatever the command starts stays below fencegate-lease, even a process that leaves its
    // group (`setsid`) and whose parent ends: orphans come to fencegate-lease, not to init, so
    // `stop_escaped` finds them all.
    if let Err(error) = nix::sys::prctl::set_child_subreaper(true) {
        eprintln!(
            "fencegate-lease: cannot keep the command's orphans ({error}); one that leaves its group may outlive it"
        );
    }
    let options = LeaseOptions::default().with_credentials();
    let ttl = Duration::from_millis(args.ttl_ms);
    let holder = args.holder.clone().unwrap_or_else(default_holder);
    let lease = match acquire(args, || client.acquire_with(&args.name, &holder, ttl, options.clone())).await {
        Ok(lease) => lease,
        Err(code) => return code,
    };
    let Some(credentials) = lease.credentials().cloned() else {
        eprintln!("fencegate-lease: the grant came without credentials");
        return EXIT_FAILED;
    };
    eprintln!(
        "fencegate-lease: acquired {} token={} holder={} ttl_ms={}",
        lease.name(),
        lease.token(),
        lease.holder(),
        args.ttl_ms
    );

    let (program, rest) = command.split_first().expect("clap requires a command");
    let mut child = tokio::process::Command::new(program);
    child
        .args(rest)
        .env("AWS_ACCESS_KEY_ID", &credentials.access_key_id)
        .env("AWS_SECRET_ACCESS_KEY", &credentials.secret_access_key)
        .env("AWS_SESSION_TOKEN", &credentials.session_token)
        .env("AWS_ENDPOINT_URL", &cli.connection.endpoint)
        .env("FENCEGATE_LEASE_NAME", lease.name())
        .env("FENCEGATE_LEASE_TOKEN", lease.token().to_string())
        // The older name of the session token variable: it must not be some other session's.
        .env_remove("AWS_SECURITY_TOKEN")
        // Its own process group: the whole tree is stopped together if the lease is lost.
        .process_group(0);
    for region in ["AWS_REGION", "AWS_DEFAULT_REGION"] {
        if std::env::var_os(region).is_none() {
            child.env(region, &cli.connection.region);
        }
    }
    let mut child = match child.spawn() {
        Ok(child) => child,
        Err(error) => {
            eprintln!("fencegate-lease: cannot run {}: {error}", program.to_string_lossy());
            release(lease).await;
            return 127;
        }
    };
    // The command must not outlive fencegate-lease, even one killed with SIGKILL (its command
    // would write on until the lease ran out, then run on for ever): a watchdog process stops
    // the command's group when its stdin, held by fencegate-lease alone, closes.
    let watchdog = child.id().and_then(|group| spawn_watchdog(group, grace));
    supervise_and_end(&mut child, lease, grace, watchdog).await
}

/// Starts `fencegate-lease __watch GROUP GRACE_MS RUN_PID RUN_STARTED` with a pipe as its stdin.
fn spawn_watchdog(group: u32, grace: Duration) -> Option<Child> {
    let exe = std::env::current_exe().ok()?;
    let me = std::process::id();
    let spawned = tokio::process::Command::new(exe)
        .arg("__watch")
        .arg(group.to_string())
        .arg(grace.as_millis().to_string())
        .arg(me.to_string())
        .arg(start_time(me)?.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(false)
        .spawn();
    match spawned {
        Ok(watchdog) => Some(watchdog),
        Err(error) => {
            eprintln!(
                "fencegate-lease: cannot start the watchdog ({error}); the command may outlive a killed fencegate-lease"
            );
            None
        }
    }
}

/// The watchdog: waits until its stdin closes (fencegate-lease, `run`, ended), then stops
/// `group` (SIGTERM, SIGKILL after `grace`) and what had left it. Signals that would end it
/// first are ignored: it ends with fencegate-lease, or when fencegate-lease stops it.
async fn watch(group: Pid, grace: Duration, run: (u32, u64)) -> u8 {
    use tokio::io::AsyncReadExt;
    // 0 is the caller's own group and 1 would be every process it may signal: never a
    // command's group (`run` gives the command a group of its own, its id the command's pid).
    if group.as_raw() <= 1 {
        eprintln!("fencegate-lease: __watch needs the process group of a command run by fencegate-lease run");
        return EXIT_USAGE;
    }
    let _ignored = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), signal(SignalKind::hangup()));
    // What left the group stays below `run` (the subreaper) only while `run` lives: once it is
    // killed, those processes go to init. So they are noted while it lives, each with its
    // start time (a pid reused by then is not theirs), and only while `run` is still this
    // watchdog's parent and the very process that started it: never another's descendants.
    let (run_pid, run_started) = run;
    let run_is_parent = || std::os::unix::process::parent_id() == run_pid && start_time(run_pid) == Some(run_started);
    let mut noted: Vec<(u32, u64, String)> = Vec::new();
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    let mut snapshot = tokio::time::interval(WATCH_SNAPSHOT_EVERY);
    loop {
        tokio::select! {
            biased;
            read = stdin.read(&mut buf) => if !matches!(read, Ok(n) if n > 0) { break },
            _ = snapshot.tick() => {
                if !run_is_parent() {
                    // `run` ended: its stdin end is closed, and the read above says so next.
                    continue;
                }
                let me = std::process::id();
                let below = descendants(run_pid).into_iter().filter(|(pid, _)| *pid != me);
                let seen: Vec<_> =
                    below.filter_map(|(pid, name)| start_time(pid).map(|started| (pid, started, name))).collect();
                // Read once more: what was seen belongs to `run` only if it still ran after.
                if run_is_parent() {
                    noted = seen;
                }
            }
        }
    }
    if killpg(group, Signal::SIGTERM).is_ok() {
        eprintln!("fencegate-lease: ended without stopping its command; stopping it");
        let until = Instant::now() + grace;
        while Instant::now() < until && killpg(group, None).is_ok() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = killpg(group, Signal::SIGKILL);
    }
    // Then what had left the group, and what it started since.
    let alive = || {
        let mut alive: Vec<(u32, String)> = Vec::new();
        for (pid, started, name) in &noted {
            if start_time(*pid) == Some(*started) {
                alive.push((*pid, name.clone()));
                alive.extend(descendants(*pid));
            }
        }
        alive
    };
    let found = alive();
    if !found.is_empty() {
        let named: Vec<String> = found.iter().map(|(pid, name)| format!("{pid} ({name})")).collect();
        eprintln!("fencegate-lease: stopping what the command left outside its group: {}", named.join(", "));
        for signal in [Signal::SIGTERM, Signal::SIGKILL] {
            for (pid, _) in alive() {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), signal);
            }
            let until = Instant::now() + grace;
            while signal == Signal::SIGTERM && Instant::now() < until && !alive().is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    0
}

/// How often the watchdog notes what is below fencegate-lease: a process that leaves the
/// command's group less than this before fencegate-lease is killed may be missed.
const WATCH_SNAPSHOT_EVERY: Duration = Duration::from_millis(100);

/// When `pid` started (clock ticks after boot, /proc/PID/stat's 22nd field), if it lives.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Fields from the 3rd (state) on: the start time is the 22nd field, the 20th here.
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Waits for the command (or the loss of the lease), releases, and says how `run` exits. The
/// watchdog is stopped as soon as the command is known to have ended (or been stopped): from
/// then on its group id may be reused, and nothing must signal it.
async fn supervise_and_end(child: &mut Child, lease: Lease, grace: Duration, mut watchdog: Option<Child>) -> u8 {
    let group = child.id().map(|id| Pid::from_raw(id as i32));
    let supervised = supervise(child, &lease).await;
    if supervised.is_ok() {
        stop_leftovers(group, grace).await;
    }
    if supervised.is_err() {
        // Lost: the command is stopped first (its group still exists until it is reaped).
        let reason = match lease.status() {
            LeaseStatus::Lost(reason) => reason.explanation(),
            other => format!("{other:?}"),
        };
        eprintln!("fencegate-lease: lease {} lost ({reason}); stopping the command", lease.name());
        stop(child, grace).await;
    }
    // Then what left the group: it holds the lease's credentials too.
    stop_escaped(watchdog.as_ref().and_then(Child::id), grace).await;
    if let Some(watchdog) = watchdog.as_mut() {
        let _ = watchdog.kill().await;
    }
    match supervised {
        // The command ended, but the lease lapsed while it ran (fencegate-lease and the command
        // were frozen past the deadline, and the command finished first when they woke): what
        // it wrote after the lapse was refused, so its own status would say too much.
        Ok(_) if !lease.is_held() => {
            eprintln!("fencegate-lease: lease {} lapsed while the command ran", lease.name());
            EXIT_LOST
        }
        Ok(status) => match release(lease).await {
            // Not the lease's any more when the command ended: superseded by a newer token (the
            // command's writes were refused from then on, which its status may not say), or
            // lapsed, or released by someone else.
            Some(reason) => {
                eprintln!("fencegate-lease: the lease was lost while the command ran ({})", reason.explanation());
                EXIT_LOST
            }
            None => status.code().map_or_else(|| 128 + status.signal().unwrap_or(0) as u8, |c| c as u8),
        },
        Err(Lost) => EXIT_LOST,
    }
}

struct Lost;

/// Waits for the command to end, forwarding signals to it, unless the lease is lost first.
async fn supervise(child: &mut Child, lease: &Lease) -> Result<std::process::ExitStatus, Lost> {
    let group = child.id().map(|id| Pid::from_raw(id as i32));
    let lost = lease.lost();
    // Without a handler (it could not be installed) a signal acts on fencegate-lease as usual.
    let (mut interrupt, mut terminate, mut hangup) =
        (signal(SignalKind::interrupt()).ok(), signal(SignalKind::terminate()).ok(), signal(SignalKind::hangup()).ok());
    let forward = |sig: Signal| {
        if let Some(group) = group {
            let _ = killpg(group, sig);
        }
    };
    loop {
        tokio::select! {
            status = child.wait() => match status {
                Ok(status) => return Ok(status),
                Err(error) => {
                    eprintln!("fencegate-lease: waiting for the command failed: {error}");
                    return Ok(std::process::ExitStatus::from_raw(i32::from(EXIT_FAILED) << 8));
                }
            },
            () = lost.cancelled() => return Err(Lost),
            () = received(&mut interrupt) => forward(Signal::SIGINT),
            () = received(&mut terminate) => forward(Signal::SIGTERM),
            () = received(&mut hangup) => forward(Signal::SIGHUP),
        }
    }
}

/// The next delivery of a handled signal; never, for one without a handler.
async fn received(handler: &mut Option<tokio::signal::unix::Signal>) {
    let delivered = match handler {
        Some(handler) => handler.recv().await.is_some(),
        None => false,
    };
    if !delivered {
        std::future::pending::<()>().await;
    }
}

/// What the command left running in its process group when it ended (a `job &` it did not
/// wait for) holds the lease's credentials: it is stopped before the lease is released
/// (SIGTERM, SIGKILL after `grace`). The group id cannot be another's while a member is left.
async fn stop_leftovers(group: Option<Pid>, grace: Duration) {
    let Some(group) = group else { return };
    if killpg(group, Signal::SIGTERM).is_err() {
        return;
    }
    eprintln!("fencegate-lease: the command left processes running; stopping them");
    let until = Instant::now() + grace;
    while Instant::now() < until && killpg(group, None).is_ok() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = killpg(group, Signal::SIGKILL);
}

/// Stops every process still below fencegate-lease but the watchdog: those the command
/// started that left its process group (`setsid`, a daemon), kept below by the subreaper.
/// SIGTERM, SIGKILL after `grace`; says which it stopped.
async fn stop_escaped(watchdog: Option<u32>, grace: Duration) {
    let me = std::process::id();
    let escaped = || descendants(me).into_iter().filter(|(pid, _)| Some(*pid) != watchdog).collect::<Vec<_>>();
    let found = escaped();
    if found.is_empty() {
        return;
    }
    let named: Vec<String> = found.iter().map(|(pid, name)| format!("{pid} ({name})")).collect();
    eprintln!("fencegate-lease: stopping what the command left outside its group: {}", named.join(", "));
    let signal_all = |signal: Signal| {
        for (pid, _) in escaped() {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), signal);
        }
    };
    signal_all(Signal::SIGTERM);
    let until = Instant::now() + grace;
    while Instant::now() < until && !escaped().is_empty() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    signal_all(Signal::SIGKILL);
}

/// The live processes below `root` (not zombies), with their names, read from /proc.
fn descendants(root: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    // pid -> (parent, name, state), from /proc/PID/stat: "pid (name) state ppid ...", the name
    // possibly holding spaces and parentheses (the last ')' ends it).
    let mut processes = std::collections::HashMap::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let mut rest = stat[close + 1..].split_whitespace();
        let (Some(state), Some(parent)) = (rest.next(), rest.next().and_then(|p| p.parse::<u32>().ok())) else {
            continue;
        };
        processes.insert(pid, (parent, stat[open + 1..close].to_owned(), state.to_owned()));
    }
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for (pid, (of, name, state)) in &processes {
            if *of == parent && !found.iter().any(|(p, _)| p == pid) {
                frontier.push(*pid);
                if state != "Z" {
                    found.push((*pid, name.clone()));
                }
            }
        }
    }
    found
}

/// SIGTERM to the command's process group, SIGKILL after `grace`.
async fn stop(child: &mut Child, grace: Duration) {
    let Some(group) = child.id().map(|id| Pid::from_raw(id as i32)) else { return };
    let _ = killpg(group, Signal::SIGTERM);
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        eprintln!("fencegate-lease: the command did not stop within {} ms; killing it", grace.as_millis());
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait().await;
    }
}

/// Releases the lease; why it was lost, when fencegate said it was not this lease's any more.
async fn release(lease: Lease) -> Option<LostReason> {
    let name = lease.name().to_owned();
    let status = lease.watch();
    match lease.release().await {
        Ok(()) => {
            eprintln!("fencegate-lease: released {name}");
            None
        }
        Err(LeaseError::Gone { .. }) => match *status.borrow() {
            LeaseStatus::Lost(reason) => Some(reason),
            _ => Some(LostReason::Refused),
        },
        Err(error) => {
            eprintln!("fencegate-lease: release of {name}: {error}");
            None
        }
    }
}

/// Tries `attempt` until it succeeds or `--wait-ms` has passed; an exit status on failure.
async fn acquire<T, F, Fut>(args: &AcquireArgs, attempt: F) -> Result<T, u8>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, LeaseError>>,
{
    let until = Instant::now() + Duration::from_millis(args.wait_ms);
    loop {
        let pause = match attempt().await {
            Ok(granted) => return Ok(granted),
            Err(LeaseError::Held { holder, remaining_ms }) => {
                if Instant::now() >= until {
                    eprintln!("fencegate-lease: {} is held by {holder} for {remaining_ms} more ms", args.name);
                    return Err(EXIT_HELD);
                }
                Duration::from_millis(remaining_ms).min(ACQUIRE_RETRY_MAX)
            }
            Err(error) if error.is_retryable() && Instant::now() < until => ACQUIRE_RETRY_MAX,
            Err(error) => return Err(failed(&error)),
        };
        tokio::time::sleep(pause.min(until.saturating_duration_since(Instant::now())).max(Duration::from_millis(1)))
            .await;
    }
}

/// Acquires once (or until `--wait-ms`); prints the grant, or with `env` the `export` lines a
/// shell `eval`s to run the AWS tools with the lease credentials (and, with the same variables,
/// `fencegate-lease renew` and `release`, which a lease credential may do for its own lease).
async fn acquire_once(client: &LeaseClient, args: &AcquireArgs, env: bool, endpoint: &str) -> u8 {
    let holder = args.holder.clone().unwrap_or_else(default_holder);
    let ttl = Duration::from_millis(args.ttl_ms);
    let grant = match acquire(args, || client.try_acquire_with_credentials(&args.name, &holder, ttl)).await {
        Ok(grant) => grant,
        Err(code) => return code,
    };
    if env {
        let credentials = grant.credentials.as_ref().expect("asked for credentials");
        for (name, value) in [
            ("AWS_ACCESS_KEY_ID", credentials.access_key_id.as_str()),
            ("AWS_SECRET_ACCESS_KEY", credentials.secret_access_key.as_str()),
            ("AWS_SESSION_TOKEN", credentials.session_token.as_str()),
            ("AWS_ENDPOINT_URL", endpoint),
            ("FENCEGATE_LEASE_NAME", grant.name.as_str()),
            ("FENCEGATE_LEASE_ID", grant.lease_id.as_str()),
            ("FENCEGATE_LEASE_TOKEN", &grant.token.to_string()),
        ] {
            println!("export {name}={}", shell_quote(value));
        }
    } else {
        println!("{}", grant_json(&grant));
    }
    0
}

fn grant_json(grant: &Grant) -> serde_json::Value {
    let mut json = serde_json::json!({
        "name": grant.name,
        "holder": grant.holder,
        "lease_id": grant.lease_id,
        "token": grant.token.0,
        "ttl_ms": grant.ttl_ms,
    });
    if let Some(c) = &grant.credentials {
        json["credentials"] = serde_json::json!({
            "access_key_id": c.access_key_id,
            "secret_access_key": c.secret_access_key,
            "session_token": c.session_token,
            "expiration": c.expiration,
        });
    }
    json
}

fn failed(error: &LeaseError) -> u8 {
    eprintln!("fencegate-lease: {error}");
    match error {
        LeaseError::Held { .. } => EXIT_HELD,
        LeaseError::Invalid(_) => EXIT_USAGE,
        _ => EXIT_FAILED,
    }
}

fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    format!("{}:{}", if host.is_empty() { "host" } else { host }, std::process::id())
}

/// `value` as one single-quoted shell word.
fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_words_survive_quotes() {
        assert_eq!(shell_quote("a/b+c="), "'a/b+c='");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
