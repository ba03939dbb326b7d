//! The processes a suite runs (the in-memory upstream, fencegate, nginx) and what the bench
//! reads about them from `/proc`.
//!
//! Every child is ended by its own pid when its handle is dropped, so a failed or interrupted
//! run leaves nothing behind.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};

/// How long a child may take to print its ready line.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long nginx may take to stop after SIGQUIT before it is killed.
const NGINX_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A child process, ended when dropped.
pub struct Proc {
    child: Child,
    /// nginx stops its workers on SIGQUIT; SIGKILL to the master would orphan them.
    graceful_signal: Option<&'static str>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(signal) = self.graceful_signal {
            let _ = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status();
            let until = std::time::Instant::now() + NGINX_STOP_TIMEOUT;
            while std::time::Instant::now() < until {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads the child's stdout until a line satisfies `ready`, then keeps draining it in the
/// background (a full pipe would block the child).
fn wait_for_line(
    stdout: impl std::io::Read + Send + 'static,
    name: &str,
    ready: impl Fn(&str) -> bool + Send + 'static,
) -> anyhow::Result<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let mut sent = false;
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if !sent && ready(&line) {
                let _ = tx.send(line);
                sent = true;
            }
        }
    });
    rx.recv_timeout(READY_TIMEOUT)
        .with_context(|| format!("{name} did not print its ready line within {READY_TIMEOUT:?}"))
}

/// Starts `fencegate-bench upstream` (this very binary) and returns it with its address.
pub fn spawn_upstream(reject_all: bool) -> anyhow::Result<(Proc, SocketAddr)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(["upstream", "--listen", "127.0.0.1:0"]);
    if reject_all {
        cmd.arg("--reject-all");
    }
    let mut child =
        cmd.stdout(Stdio::piped()).stdin(Stdio::null()).spawn().context("starting the in-memory upstream")?;
    let stdout = child.stdout.take().expect("piped");
    let name = if reject_all { "rejection ceiling" } else { "in-memory upstream" };
    let proc = Proc { child, graceful_signal: None };
    let line = wait_for_line(stdout, name, |l| l.starts_with(crate::UPSTREAM_READY))?;
    let addr = line[crate::UPSTREAM_READY.len()..].trim().parse()?;
    Ok((proc, addr))
}

/// Starts the bare hyper reverse proxy (`fencegate-bench proxy`) in front of `upstream`, on
/// `threads` runtime workers; with `sigv4`, the signing proxy.
pub fn spawn_bare_proxy(
    upstream: SocketAddr,
    threads: usize,
    sigv4: bool,
    reject: bool,
) -> anyhow::Result<(Proc, SocketAddr)> {
    let exe = std::env::current_exe()?;
    let name = match (sigv4, reject) {
        (true, true) => "verifying 409 ceiling",
        (true, false) => "signing proxy",
        _ => "bare hyper proxy",
    };
    let mut child = Command::new(exe)
        .args(["--threads", &threads.to_string(), "proxy", "--listen", "127.0.0.1:0", "--upstream"])
        .arg(upstream.to_string())
        .args(sigv4.then_some("--sigv4"))
        .args(reject.then_some("--reject"))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting the {name}"))?;
    let stdout = child.stdout.take().expect("piped");
    let proc = Proc { child, graceful_signal: None };
    let line = wait_for_line(stdout, name, |l| l.starts_with(crate::UPSTREAM_READY))?;
    let addr = line[crate::UPSTREAM_READY.len()..].trim().parse()?;
    Ok((proc, addr))
}

/// fencegate's two listeners.
#[derive(Debug, Clone, Copy)]
pub struct FencegateAddrs {
    pub s3: SocketAddr,
    pub admin: SocketAddr,
}

/// Starts `fencegate serve` on a config written into `dir`, with its fence store in `dir`,
/// forwarding to the S3 upstream at `upstream`.
pub fn spawn_fencegate(
    binary: &Path,
    dir: &Path,
    upstream: SocketAddr,
    env: &[(&str, String)],
) -> anyhow::Result<(Proc, FencegateAddrs)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let config = fencegate_config(dir, upstream);
    let config_path = dir.join("fencegate.toml");
    std::fs::write(&config_path, config)?;
    // A shared store is marked new first, as an operator does once when making it (else its
    // first writes wait out the quiet period of a store that lost its state).
    let init = Command::new(binary)
        .args(["init-store", "--config"])
        .arg(&config_path)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {} init-store", binary.display()))?;
    anyhow::ensure!(init.status.success(), "init-store failed: {}", String::from_utf8_lossy(&init.stderr));
    let mut child = Command::new(binary)
        .args(["serve", "--config"])
        .arg(&config_path)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child.stdout.take().expect("piped");
    let proc = Proc { child, graceful_signal: None };
    let line = wait_for_line(stdout, "fencegate", |l| l.starts_with("fencegate ready:"))?;
    Ok((proc, parse_ready(&line)?))
}

/// The config of a benchmark run: the embedded fence store, the in-memory upstream, and logs
/// at `warn` (a log line per request would be measured too).
pub fn fencegate_config(dir: &Path, upstream: SocketAddr) -> String {
    format!(
        r#"[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[store]
kind = "embedded"
path = "{store}"

[upstream]
kind = "s3"
endpoint = "http://{upstream}"
region = "us-east-1"
access_key_id = "bench-upstream"
secret_access_key = "bench-upstream-secret"
probe_bucket = "{bucket}"

[[credentials]]
access_key_id = "{key}"
secret_access_key = "{secret}"
# An issuer: the lease-credentials rows grant a lease first.
role = "issuer"

# The objects of the lease-credentials rows belong to the lease's resource.
[[fencing.rules]]
bucket = "{bucket}"
prefix = "lease-"
resource = "{lease}"

[log]
level = "warn"
"#,
        store = dir.join("fences").display(),
        bucket = crate::BUCKET,
        key = crate::sign::ACCESS_KEY_ID,
        secret = crate::sign::SECRET_ACCESS_KEY,
        lease = crate::scenario::LEASE,
    )
}

/// `fencegate ready: s3=127.0.0.1:PORT admin=127.0.0.1:PORT`
fn parse_ready(line: &str) -> anyhow::Result<FencegateAddrs> {
    let field = |name: &str| -> anyhow::Result<SocketAddr> {
        let prefix = format!("{name}=");
        let value = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(prefix.as_str()))
            .with_context(|| format!("no {name}= in {line:?}"))?;
        Ok(value.parse()?)
    };
    Ok(FencegateAddrs { s3: field("s3")?, admin: field("admin")? })
}

/// The environment that points fencegate at a Redis fence store.
pub fn redis_store_env(redis: SocketAddr) -> Vec<(&'static str, String)> {
    vec![("FENCEGATE_STORE__KIND", "redis".into()), ("FENCEGATE_STORE__URL", format!("redis://{redis}"))]
}

/// The redis-server binary, if installed.
pub fn find_redis() -> Option<PathBuf> {
    ["/usr/bin/redis-server", "/usr/local/bin/redis-server"].iter().map(PathBuf::from).find(|p| p.is_file())
}

/// Starts redis-server on 127.0.0.1 with an fsync-always append-only file in `dir`: as durable
/// as the embedded store, which fsyncs every advance.
pub fn spawn_redis(binary: &Path, dir: &Path) -> anyhow::Result<(Proc, SocketAddr)> {
    std::fs::create_dir_all(dir)?;
    let port = free_port()?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let child = Command::new(binary)
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--appendonly", "yes", "--appendfsync", "always", "--save", ""])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(dir.join("redis.log"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .context("starting redis-server")?;
    let mut proc = Proc { child, graceful_signal: None };
    wait_listening(&mut proc, addr, &dir.join("redis.log")).context("redis-server")?;
    Ok((proc, addr))
}

/// The environment that points fencegate at an etcd fence store.
pub fn etcd_store_env(etcd: SocketAddr) -> Vec<(&'static str, String)> {
    vec![("FENCEGATE_STORE__KIND", "etcd".into()), ("FENCEGATE_STORE__ENDPOINTS", format!("[\"http://{etcd}\"]"))]
}

/// The etcd binary (Debian's `etcd-server`), if installed.
pub fn find_etcd() -> Option<PathBuf> {
    ["/usr/bin/etcd", "/usr/local/bin/etcd"].iter().map(PathBuf::from).find(|p| p.is_file())
}

/// Starts a one-member etcd on 127.0.0.1 with its data (write-ahead log fsynced on every
/// commit) in `dir`.
pub fn spawn_etcd(binary: &Path, dir: &Path) -> anyhow::Result<(Proc, SocketAddr)> {
    std::fs::create_dir_all(dir)?;
    let (port, peer) = (free_port()?, free_port()?);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let (client, peer) = (format!("http://{addr}"), format!("http://127.0.0.1:{peer}"));
    let log = dir.join("etcd.log");
    let child = Command::new(binary)
        .args(["--name", "bench", "--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("bench={peer}"), "--logger", "zap", "--log-level", "error"])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--log-outputs")
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .context("starting etcd")?;
    let mut proc = Proc { child, graceful_signal: None };
    wait_listening(&mut proc, addr, &log).context("etcd")?;
    Ok((proc, addr))
}

/// Waits until `addr` accepts connections, or the process exits (its log in the error).
fn wait_listening(proc: &mut Proc, addr: SocketAddr, log: &Path) -> anyhow::Result<()> {
    let until = std::time::Instant::now() + READY_TIMEOUT;
    while std::net::TcpStream::connect(addr).is_err() {
        if let Some(status) = proc.exited() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            bail!("exited ({status}): {log}");
        }
        if std::time::Instant::now() > until {
            bail!("not listening on {addr} within {READY_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The nginx binary, if installed.
pub fn find_nginx() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"].iter().map(PathBuf::from).find(|p| p.is_file())
}

/// Starts nginx in the foreground as a plain reverse proxy to `upstream`: keep-alive on both
/// sides, no request or response buffering, no access log.
pub fn spawn_nginx(binary: &Path, dir: &Path, upstream: SocketAddr) -> anyhow::Result<(Proc, SocketAddr)> {
    let port = free_port()?;
    let listen: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let conf = nginx_config(dir, listen, upstream);
    let conf_path = dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let child = Command::new(binary)
        .arg("-p")
        .arg(dir)
        .arg("-e")
        .arg(dir.join("nginx-error.log"))
        .arg("-c")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .context("starting nginx")?;
    let mut proc = Proc { child, graceful_signal: Some("QUIT") };
    wait_listening(&mut proc, listen, &dir.join("nginx-error.log")).context("nginx")?;
    Ok((proc, listen))
}

fn nginx_config(dir: &Path, listen: SocketAddr, upstream: SocketAddr) -> String {
    let d = dir.display();
    format!(
        r#"daemon off;
master_process on;
worker_processes auto;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    upstream bench_upstream {{
        server {upstream};
        keepalive 128;
        keepalive_requests 10000000;
    }}
    server {{
        listen {listen};
        client_max_body_size 0;
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_request_buffering off;
            proxy_buffering off;
        }}
    }}
}}
"#
    )
}

fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Clock ticks per second of `/proc/PID/stat` times (`USER_HZ`, 100 on every Linux ABI the
/// bench runs on).
const USER_HZ: f64 = 100.0;

/// CPU seconds (user and system) used so far by `pid` and, recursively, by its child
/// processes (nginx's workers). `None` if the process is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let mut seconds = own_cpu_seconds(&pid.to_string())?;
    for child in children(pid) {
        seconds += cpu_seconds(child).unwrap_or(0.0);
    }
    Some(seconds)
}

/// CPU seconds used so far by the bench's own process (its load client: the suite's other
/// threads wait meanwhile), not by the servers it started.
pub fn client_cpu_seconds() -> Option<f64> {
    own_cpu_seconds("self")
}

/// The threads of one process (`/proc/<pid>/stat`: live children's times are not in it).
fn own_cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat_ticks(&stat)? / USER_HZ)
}

/// utime + stime of a `/proc/PID/stat` line, in ticks.
fn stat_ticks(stat: &str) -> Option<f64> {
    // Fields after the command name, which is in parentheses and may contain spaces and ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    Some(fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?)
}

/// The machine's CPUs as `/proc/stat` counts them (its `cpuN` lines), and their busy seconds
/// so far, all together: every state but idle, I/O wait and steal (time the hypervisor gave
/// elsewhere), interrupts and softirqs included. So the client, the servers, the upstream,
/// the kernel's loopback work that no process is charged for, and anything else running.
pub fn machine_busy_seconds() -> Option<(usize, f64)> {
    proc_stat_busy(&std::fs::read_to_string("/proc/stat").ok()?).map(|(cpus, ticks)| (cpus, ticks / USER_HZ))
}

fn proc_stat_busy(stat: &str) -> Option<(usize, f64)> {
    let mut lines = stat.lines();
    let all = lines.next()?.strip_prefix("cpu ")?;
    let ticks = all.split_whitespace().map(str::parse::<f64>).collect::<Result<Vec<f64>, _>>().ok()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice, inside user and nice].
    let [user, nice, system, _idle, _iowait, irq, softirq, ..] = ticks[..] else { return None };
    let cpus = lines.take_while(|l| l.starts_with("cpu")).count();
    Some((cpus, user + nice + system + irq + softirq))
}

fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|list| list.split_whitespace().filter_map(|c| c.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// A process's resident set: now and its peak (kB), from `/proc/PID/status`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rss {
    pub now_kb: u64,
    pub peak_kb: u64,
}

pub fn rss(pid: u32) -> anyhow::Result<Rss> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok(Rss { now_kb: field("VmRSS:"), peak_kb: field("VmHWM:") })
}

/// Resets the process's peak RSS (`VmHWM`) to its current RSS (Linux ≥ 4.0; needs the same
/// user or root). Returns whether it worked.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

/// `strace` attached to every thread of a process, recording its read-family calls: the one
/// way to see how many bytes the process itself took off its sockets (`/proc/PID/io` does not
/// count `recv`, and the kernel's socket counters include what was buffered but never read).
pub struct Strace {
    proc: Proc,
    output: PathBuf,
}

/// The calls whose results are bytes read.
const READ_CALLS: &[&str] = &["read", "readv", "recvfrom", "recvmsg", "recvmmsg"];

impl Strace {
    /// Attaches to `pid`; `None` when strace is not installed.
    pub fn attach(pid: u32, output: PathBuf) -> anyhow::Result<Option<Self>> {
        let Some(binary) = ["/usr/bin/strace", "/usr/local/bin/strace"].iter().map(PathBuf::from).find(|p| p.is_file())
        else {
            return Ok(None);
        };
        let mut child = Command::new(binary)
            .args(["-f", "-s", "0", "-e", &format!("trace={}", READ_CALLS.join(",")), "-o"])
            .arg(&output)
            .args(["-p", &pid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting strace")?;
        let stderr = child.stderr.take().expect("piped");
        let proc = Proc { child, graceful_signal: Some("INT") };
        // strace says "Process N attached" once per thread; the first line means it is in.
        wait_for_line(stderr, "strace", |l| l.contains("attached"))?;
        std::thread::sleep(Duration::from_millis(200));
        Ok(Some(Self { proc, output }))
    }

    /// Detaches and returns the bytes read by all traced calls.
    pub fn finish(self) -> anyhow::Result<u64> {
        drop(self.proc);
        let text = std::fs::read_to_string(&self.output)?;
        Ok(text.lines().filter_map(bytes_of_read_call).sum())
    }
}

/// `1234 recvfrom(9, ""..., 8192, 0, NULL, NULL) = 517` → 517; also the `<... recvfrom
/// resumed>` half of an interrupted call. Errors and other calls → `None`.
fn bytes_of_read_call(line: &str) -> Option<u64> {
    let is_read =
        READ_CALLS.iter().any(|c| line.contains(&format!(" {c}(")) || line.contains(&format!("<... {c} resumed>")));
    if !is_read {
        return None;
    }
    let (_, result) = line.rsplit_once(") = ")?;
    result.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ready_line_is_parsed() {
        let a = parse_ready("fencegate ready: s3=127.0.0.1:4000 admin=127.0.0.1:4001").unwrap();
        assert_eq!(a.s3.port(), 4000);
        assert_eq!(a.admin.port(), 4001);
        assert!(parse_ready("fencegate ready:").is_err());
    }

    #[test]
    fn strace_lines_give_the_bytes_read() {
        assert_eq!(bytes_of_read_call("77 recvfrom(9, \"\"..., 8192, 0, NULL, NULL) = 517"), Some(517));
        assert_eq!(bytes_of_read_call("77 <... recvfrom resumed>\"\"..., 8192, 0, NULL, NULL) = 12"), Some(12));
        assert_eq!(bytes_of_read_call("77 recvfrom(9, 0x7f, 8192, 0, NULL, NULL) = -1 EAGAIN (Resource)"), None);
        assert_eq!(bytes_of_read_call("77 read(5, \"\"..., 8) = 8"), Some(8));
        assert_eq!(bytes_of_read_call("77 recvfrom(9,  <unfinished ...>"), None);
        assert_eq!(bytes_of_read_call("77 write(5, \"\"..., 8) = 8"), None);
    }

    #[test]
    fn this_process_has_an_rss() {
        let r = rss(std::process::id()).unwrap();
        assert!(r.now_kb > 0 && r.peak_kb >= r.now_kb);
        assert!(cpu_seconds(std::process::id()).is_some());
    }

    #[test]
    fn a_process_s_ticks_are_read_after_its_name_whatever_the_name_holds() {
        let line = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 500 0 0 0 120 35 0 0 20 0 3 0 100 0 0";
        assert_eq!(stat_ticks(line), Some(155.0));
        assert_eq!(stat_ticks("4242 (short) S 1"), None);
    }

    #[test]
    fn the_machine_s_busy_time_leaves_out_idle_io_wait_steal_and_guests() {
        let stat = "cpu  100 5 50 1000 20 3 7 2 40 1\ncpu0 50 2 25 500 10 1 3 1 20 0\n\
                    cpu1 50 3 25 500 10 2 4 1 20 1\nintr 12345\nctxt 999\n";
        assert_eq!(proc_stat_busy(stat), Some((2, 165.0)));
        assert_eq!(proc_stat_busy("cpu  100 5 x 1000\n"), None, "a field that is no number is refused");
        assert_eq!(proc_stat_busy("cpu  100 5 50\n"), None, "too few fields");
    }
}
