//! Proves the classic scenario end to end with real worker processes (the `fencegate-worker` example binary): worker A is frozen with SIGSTOP past its TTL, worker B takes the lease and writes, A resumes and writes: fencegate refuses A with 409 FencingTokenStale, B's object is intact, and A's client raised the lost-lease signal.
mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use common::Fencegate;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

const BUCKET: &str = "reports";
/// Bound on waiting for one line of a worker's output.
const LINE_WAIT_MAX: Duration = Duration::from_secs(30);
/// Bound on a worker's whole run.
const WORKER_RUN_MAX: Duration = Duration::from_secs(60);

/// The example worker binary: `FENCEGATE_WORKER_BIN` if set, else built once with the cargo
/// that runs this test (a no-op when it is up to date). Cargo builds only the binaries of the
/// package under test, and the worker lives in the client crate.
fn worker_binary() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("FENCEGATE_WORKER_BIN") {
            return bin.into();
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        // `output()` drains the pipe while cargo runs: its JSON messages can fill a pipe buffer.
        let build = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "fencegate-client", "--bin", "fencegate-worker"])
            .args(["--message-format", "json", "--manifest-path"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running cargo to build the worker");
        assert!(build.status.success(), "cargo build -p fencegate-client --bin fencegate-worker failed");
        let out = String::from_utf8_lossy(&build.stdout);
        out.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "fencegate-worker")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported the worker executable")
    })
}

/// A running worker, its output collected line by line.
struct Worker {
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
}

impl Worker {
    fn spawn(fg: &Fencegate, holder: &'static str, ttl_ms: u64, args: &[&str]) -> Self {
        let mut child = Command::new(worker_binary())
            .args(["--endpoint", &fg.endpoint(), "--bucket", BUCKET, "--name", "job:report", "--holder", holder])
            .args(["--ttl-ms", &ttl_ms.to_string()])
            .args(["--access-key-id", common::ACCESS_KEY, "--secret-access-key", common::SECRET_KEY])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawning the worker");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Self { name: holder, child, stdin, lines, seen: Vec::new() }
    }

    /// Waits for the next line starting with `prefix`; fails with everything seen so far.
    async fn expect_line(&mut self, prefix: &str) -> String {
        let wait = async {
            while let Some(line) = self.lines.recv().await {
                self.seen.push(line.clone());
                if line.starts_with(prefix) {
                    return Some(line);
                }
            }
            None
        };
        match tokio::time::timeout(LINE_WAIT_MAX, wait).await {
            Ok(Some(line)) => line,
            _ => panic!("worker {} never printed {prefix:?}; it printed {:?}", self.name, self.seen),
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the worker is running").to_string();
        let status = std::process::Command::new("kill").args([signal, &pid]).status().expect("running kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    async fn say(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(format!("{line}\n").as_bytes()).await.unwrap();
        stdin.flush().await.unwrap();
    }

    /// Waits for the exit; returns the exit code and every line printed.
    async fn finish(mut self) -> (i32, Vec<String>) {
        let status = tokio::time::timeout(WORKER_RUN_MAX, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("worker {} did not exit; it printed {:?}", self.name, self.seen))
            .unwrap();
        while let Some(line) = self.lines.recv().await {
            self.seen.push(line);
        }
        (status.code().expect("exited, not killed"), self.seen)
    }
}

/// The value of `key=` in a worker line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(' ').find_map(|f| f.strip_prefix(key)?.strip_prefix('=')).unwrap_or_else(|| panic!("{key} in {line:?}"))
}

fn position(lines: &[String], prefix: &str) -> usize {
    lines.iter().position(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix:?} in {lines:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_worker_is_fenced_off_after_its_lease_passed_to_another() {
    tokio::task::spawn_blocking(worker_binary).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    common::client(&fg).create_bucket().bucket(BUCKET).send().await.unwrap();

    // A takes the lease (TTL 1 s), then waits for our word before writing.
    let mut a = Worker::spawn(&fg, "a", 1000, &["--ignore-lost", "wait", "write:2026/11.csv=written by A"]);
    let token_a: u64 = field(&a.expect_line("acquired ").await, "token").parse().unwrap();
    a.expect_line("waiting").await;
    a.signal("-STOP");

    // B can only get the lease once A's has expired at fencegate: A is frozen past its TTL.
    let b = Worker::spawn(&fg, "b", 10_000, &["--acquire-timeout-ms", "20000", "write:2026/11.csv=written by B"]);
    let (b_code, b_lines) = b.finish().await;
    assert_eq!(b_code, 0, "B: {b_lines:?}");
    let token_b: u64 = field(&b_lines[position(&b_lines, "acquired ")], "token").parse().unwrap();
    assert!(token_b > token_a, "B's token {token_b} after A's {token_a}");
    assert!(b_lines.iter().any(|l| l == "wrote key=2026/11.csv status=ok"), "B: {b_lines:?}");

    // A wakes up and writes as if nothing happened.
    a.signal("-CONT");
    a.say("go").await;
    let (a_code, a_lines) = a.finish().await;
    assert_eq!(a_code, 4, "A exits with 'write rejected': {a_lines:?}");
    let lost = position(&a_lines, "lease lost reason=");
    let rejected = position(&a_lines, "write rejected ");
    assert!(lost < rejected, "A's client raised the loss before its write came back: {a_lines:?}");
    // B's grant came first (superseded), or A's own deadline passed first.
    assert!(matches!(field(&a_lines[lost], "reason"), "deadline" | "refused" | "superseded"), "{a_lines:?}");
    assert_eq!(
        a_lines[rejected],
        format!("write rejected key=2026/11.csv status=409 code=FencingTokenStale current={token_b}")
    );

    // B's object is intact, stamped with B's token.
    let s3 = common::client(&fg);
    let object = s3.get_object().bucket(BUCKET).key("2026/11.csv").send().await.unwrap();
    let stamp = object.metadata().and_then(|m| m.get("fencing-token")).cloned();
    assert_eq!(stamp, Some(token_b.to_string()));
    assert_eq!(object.body.collect().await.unwrap().into_bytes().as_ref(), b"written by B");
}

/// A worker that heeds the signal stops by itself: after a stall past its TTL it does not even
/// try to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_careful_worker_stops_when_its_lease_is_lost() {
    tokio::task::spawn_blocking(worker_binary).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    common::client(&fg).create_bucket().bucket(BUCKET).send().await.unwrap();

    let mut a = Worker::spawn(&fg, "a", 500, &["write:first.csv=ok", "wait", "write:second.csv=late"]);
    a.expect_line("wrote key=first.csv status=ok").await;
    a.expect_line("waiting").await;
    a.signal("-STOP");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    a.signal("-CONT");
    a.say("go").await;
    let (code, lines) = a.finish().await;
    assert_eq!(code, 5, "{lines:?}");
    assert!(position(&lines, "lease lost reason=") < position(&lines, "stopped reason=lease-lost"), "{lines:?}");
    assert!(!lines.iter().any(|l| l.contains("second.csv")), "{lines:?}");
}
