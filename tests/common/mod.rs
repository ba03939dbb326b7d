//! Shared by the Rust black-box tests: a fencegate served in-process on loopback ports, and
//! real aws-sdk-s3 clients pointed at it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use fencegate::App;
use fencegate::config::Config;
use fencegate::lease::{Clock, SystemClock};
use tokio::sync::oneshot;

pub const ACCESS_KEY: &str = "fencegate-dev";
pub const SECRET_KEY: &str = "fencegate-dev-secret";

/// A running fencegate; stopped when dropped.
pub struct Fencegate {
    pub s3: SocketAddr,
    pub admin: SocketAddr,
    pub dir: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Fencegate {
    /// Starts fencegate on the embedded store and local upstream in `dir`, with `extra` TOML
    /// appended: `Fencegate::setup(dir).extra(extra).start()`.
    pub async fn start_local(dir: &Path, extra: &str) -> Self {
        Self::setup(dir).extra(extra).start().await
    }

    /// The one way the Rust tests start fencegate: on loopback ports, the embedded store in
    /// `dir/fences` and the local upstream in `dir/objects` unless told otherwise, the dev
    /// credentials as an issuer, and the system clock unless given one.
    pub fn setup(dir: &Path) -> Setup {
        Setup {
            dir: dir.into(),
            store: format!("[store]\nkind = \"embedded\"\npath = \"{}\"\n", dir.join("fences").display()),
            upstream: format!("[upstream]\nkind = \"local\"\npath = \"{}\"\n", dir.join("objects").display()),
            server: String::new(),
            extra: String::new(),
            clock: None,
        }
    }

    /// Waits (bounded) until the fence of `resource` is `token`, read on the admin API: a race test's proof that
    /// a write was admitted.
    pub async fn wait_for_fence(&self, resource: &str, token: u64) {
        let path: String = resource
            .bytes()
            .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") })
            .collect();
        let url = format!("http://{}/v1/fences/{path}", self.admin);
        let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        for _ in 0..200 {
            if let Ok(resp) = client.get(url.parse().unwrap()).await
                && resp.status() == 200
            {
                let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap().to_bytes();
                if serde_json::from_slice::<serde_json::Value>(&body).unwrap()["token"] == token {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the fence of {resource} never became {token}");
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.s3)
    }

    /// Stops serving and waits until the store is closed, so the same directory can be
    /// reopened.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Fencegate {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// An aws-sdk-s3 client for `endpoint`, path-style, with the given credentials.
pub fn s3_client(endpoint: &str, access_key: &str, secret_key: &str) -> aws_sdk_s3::Client {
    let http = aws_smithy_http_client::Builder::new().build_http();
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(Credentials::new(access_key, secret_key, None, None, "test"))
        .http_client(http)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// A client for fencegate with the dev credentials.
pub fn client(fg: &Fencegate) -> aws_sdk_s3::Client {
    s3_client(&fg.endpoint(), ACCESS_KEY, SECRET_KEY)
}

/// The service error code, HTTP status and `Fencing-Token-Current` of a failed SDK call.
pub fn error_of<E>(err: &aws_sdk_s3::error::SdkError<E, HttpResponse>) -> (Option<String>, u16, Option<String>)
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::fmt::Debug,
{
    let raw = err.raw_response().unwrap_or_else(|| panic!("no HTTP response: {err:?}"));
    let code = err.as_service_error().and_then(|e| e.code()).map(str::to_owned);
    let current = raw.headers().get("fencing-token-current").map(str::to_owned);
    (code, raw.status().as_u16(), current)
}

/// Runs `bin serve --config config` and waits (at most `wait_max`) for its `fencegate ready:`
/// line, which names the S3 address it bound: a config that listens on port 0 races no other
/// process for its ports. Its stderr is the test's.
pub fn spawn_fencegate(bin: &str, config: &Path, wait_max: std::time::Duration) -> (std::process::Child, SocketAddr) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(bin)
        .args(["serve", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e}"));
    // The ready line is read on a thread, so that a silent fencegate fails the test in time;
    // the thread drains stdout until the child ends.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("fencegate ready: ") {
                let _ = tx.send(rest.to_owned());
            }
        }
    });
    let ready = rx.recv_timeout(wait_max);
    let s3 = ready.as_deref().ok().and_then(|ready| {
        ready.split(' ').find_map(|f| f.strip_prefix("s3=")).and_then(|a| a.parse::<SocketAddr>().ok())
    });
    let Some(s3) = s3 else {
        let exited = child.try_wait().ok().flatten();
        let _ = child.kill();
        let _ = child.wait();
        match (ready, exited) {
            (Ok(line), _) => panic!("unparseable ready line {line:?}"),
            (Err(_), Some(status)) => panic!("fencegate exited ({status}) before its ready line"),
            (Err(_), None) => panic!("fencegate printed no ready line within {wait_max:?}"),
        }
    };
    (child, s3)
}

/// A free loopback port (bound then released; good enough for test processes).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `n` free loopback ports, each picked while the others are still held, so no two are the same.
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    held.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// How many times a third-party server is started on a new port when the one `free_port()`
/// picked was taken before the server could bind it.
const PORT_ATTEMPTS: usize = 5;

/// How long a third-party server may take to serve once started.
const SERVER_START_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// What a third-party server answers once it serves, so that a start knows the process on the
/// port is the one it started: another process can take a port between `free_port()` and the
/// server's bind (a Redis cluster node's bus, on its port + 10,000, once took moto's), and then
/// the server exits while something else answers there.
enum Probe {
    /// `INFO server` names the process id.
    Redis,
    /// `GET /` lists buckets, and the process is the one listening on the port (another test's
    /// moto would answer the same).
    Moto,
    /// The process listens on the port; nothing is asked of it.
    Listening,
}

impl Probe {
    async fn answers(&self, pid: u32, port: u16) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (request, expected) = match self {
            Probe::Listening => return listens(pid, port),
            Probe::Redis => ("INFO server\r\n".to_string(), format!("process_id:{pid}\r\n")),
            Probe::Moto => {
                ("GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".to_string(), "ListAllMyBucketsResult".to_string())
            }
        };
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut reply = Vec::new();
            let mut chunk = [0u8; 4096];
            while reply.len() < 64 * 1024 {
                let n = stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    break;
                }
                reply.extend_from_slice(&chunk[..n]);
                if String::from_utf8_lossy(&reply).contains(&expected) {
                    return Some(true);
                }
            }
            Some(false)
        };
        let answered = tokio::time::timeout(std::time::Duration::from_secs(2), exchange).await;
        matches!(answered, Ok(Some(true))) && (matches!(self, Probe::Redis) || listens(pid, port))
    }
}

/// Whether process `pid` holds the socket listening on 127.0.0.1:`port` (Linux's
/// `/proc/net/tcp` names the socket's inode, `/proc/PID/fd` the process's sockets).
fn listens(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else { return false };
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[1] == local && f[3] == "0A") // 0A: LISTEN
        .map(|f| format!("socket:[{}]", f[9]))
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| inodes.iter().any(|inode| target.as_os_str() == inode.as_str()))
}

/// Waits until `child` answers `probe` on `port` (at most `SERVER_START_MAX`), or returns how
/// it exited if it ends first (its port was taken, most likely). The caller owns `child`, so a
/// panic here still kills it.
async fn wait_for_server(
    child: &mut std::process::Child,
    port: u16,
    what: &str,
    probe: &Probe,
) -> Result<(), std::process::ExitStatus> {
    let deadline = tokio::time::Instant::now() + SERVER_START_MAX;
    while tokio::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Err(status);
        }
        if probe.answers(child.id(), port).await {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{what} did not answer on port {port} within {SERVER_START_MAX:?}");
}

/// A `moto_server` (a real S3-compatible server) on a free loopback port, killed on drop.
pub struct Moto {
    child: std::process::Child,
    pub endpoint: String,
}

impl Moto {
    // The child is reaped by `Drop` on every path, the panics included.
    #[allow(clippy::zombie_processes)]
    pub async fn start() -> Self {
        Self::start_on_first_free((0..PORT_ATTEMPTS).map(|_| free_port())).await
    }

    /// Starts on the first of `ports` it can serve on.
    pub async fn start_on_first_free(ports: impl IntoIterator<Item = u16>) -> Self {
        for port in ports {
            let child = std::process::Command::new("moto_server")
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("moto_server is needed: run scripts/test, or pip install 'moto[server]'");
            let mut moto = Self { child, endpoint: format!("http://127.0.0.1:{port}") };
            match wait_for_server(&mut moto.child, port, "moto_server", &Probe::Moto).await {
                Ok(()) => return moto,
                Err(status) => eprintln!("moto_server on port {port} exited ({status}): trying another port"),
            }
        }
        panic!("moto_server exited before it served on any port it was given");
    }

    /// The `[upstream]` section pointing fencegate at this server.
    pub fn upstream_toml(&self, bucket: &str) -> String {
        format!(
            "[upstream]\nkind = \"s3\"\nendpoint = \"{}\"\naccess_key_id = \"moto\"\nsecret_access_key = \"moto\"\n\
             probe = \"require\"\nprobe_bucket = \"{bucket}\"\n",
            self.endpoint
        )
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `redis-server` on a free loopback port, in its own directory, killed on drop.
pub struct RedisServer {
    child: Option<std::process::Child>,
    pub port: u16,
    /// A cluster node's bus port (picked like `port`, not Redis's default of port + 10,000,
    /// which nothing reserves).
    bus_port: Option<u16>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// Without persistence: a restart comes back empty.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> Self {
        Self::start_on_free_ports(extra, false).await
    }

    /// A node for a Redis cluster (`cluster-enabled`), not yet part of one.
    pub async fn start_cluster_node() -> Self {
        Self::start_on_free_ports(&["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"], true).await
    }

    async fn start_on_free_ports(extra: &[&str], cluster: bool) -> Self {
        let mut server = Self {
            child: None,
            port: 0,
            bus_port: None,
            dir: tempfile::tempdir().unwrap(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        for attempt in 1..=PORT_ATTEMPTS {
            let ports = free_ports(if cluster { 2 } else { 1 });
            server.port = ports[0];
            server.bus_port = ports.get(1).copied();
            match server.spawn().await {
                Ok(()) => return server,
                Err(status) => eprintln!("redis-server on port {} exited ({status}), attempt {attempt}", server.port),
            }
        }
        panic!("redis-server exited before it served, {PORT_ATTEMPTS} times");
    }

    // The child is reaped by `kill` and `Drop`.
    #[allow(clippy::zombie_processes)]
    async fn spawn(&mut self) -> Result<(), std::process::ExitStatus> {
        let mut args: Vec<String> = ["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push("--dir".into());
        args.push(self.dir.path().display().to_string());
        if let Some(bus_port) = self.bus_port {
            args.extend(["--cluster-port".to_string(), bus_port.to_string()]);
        }
        args.extend(self.extra.iter().cloned());
        let child = std::process::Command::new("redis-server")
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is needed: run scripts/test, or apt-get install redis-server");
        // Held by `self` while it starts, so that a panic kills it (`Drop`).
        let child = self.child.insert(child);
        let started = wait_for_server(child, self.port, "redis-server", &Probe::Redis).await;
        if started.is_err() {
            self.child = None; // it exited, and `wait_for_server` reaped it
        }
        started
    }

    /// Starts again on the same ports, panicking if it cannot: a test that restarts Redis
    /// needs it back where its clients look.
    async fn respawn(&mut self) {
        if let Err(status) = self.spawn().await {
            panic!("redis-server did not start again on port {} ({status})", self.port);
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port and directory (with whatever it persisted).
    pub async fn restart(&mut self) {
        self.kill();
        self.respawn().await;
    }

    /// Starts again on the same port with nothing: a restart without persistence, or one that
    /// lost what it persisted (files and directories: Redis 7 keeps its append-only file in
    /// `appendonlydir/`).
    pub async fn restart_empty(&mut self) {
        self.kill();
        for entry in std::fs::read_dir(self.dir.path()).unwrap() {
            let path = entry.unwrap().path();
            let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.unwrap_or_else(|e| panic!("removing {}: {e}", path.display()));
        }
        self.respawn().await;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(feature = "etcd")]
/// An etcd cluster of `n` members on loopback (Debian's `etcd-server`), each in its own
/// directory on a RAM disk when there is one, killed on drop.
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    initial_cluster: String,
    dir: tempfile::TempDir,
}

#[cfg(feature = "etcd")]
struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<std::process::Child>,
}

#[cfg(feature = "etcd")]
impl EtcdCluster {
    pub async fn start(n: usize) -> Self {
        for attempt in 1..=PORT_ATTEMPTS {
            match Self::start_on_free_ports(n).await {
                Ok(cluster) => return cluster,
                Err(status) => eprintln!("an etcd member exited ({status}), attempt {attempt}: new ports"),
            }
        }
        panic!("an etcd member exited before it served, {PORT_ATTEMPTS} times");
    }

    async fn start_on_free_ports(n: usize) -> Result<Self, std::process::ExitStatus> {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.unwrap();
        let ports = free_ports(2 * n);
        let members: Vec<EtcdMember> = (0..n)
            .map(|i| EtcdMember {
                name: format!("m{i}"),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self { members, initial_cluster, dir };
        for i in 0..n {
            cluster.spawn(i, "new");
        }
        cluster.wait_for_members().await?;
        cluster.wait_for_leader().await;
        Ok(cluster)
    }

    /// Waits until every member answers etcd's status call on its port (at most
    /// `SERVER_START_MAX`), or returns how one exited if one ends first (its port was taken,
    /// most likely; the others cannot form a cluster without it).
    async fn wait_for_members(&mut self) -> Result<(), std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + SERVER_START_MAX;
        let mut answered = vec![false; self.members.len()];
        while tokio::time::Instant::now() < deadline {
            for (i, m) in self.members.iter_mut().enumerate() {
                if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                    return Err(status);
                }
                answered[i] = answered[i] || is_leader(m.client_port).await.is_some();
            }
            if answered.iter().all(|a| *a) {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("the etcd members did not all answer within {SERVER_START_MAX:?}");
    }

    // The child is reaped by `kill` and `Drop`.
    #[allow(clippy::zombie_processes)]
    fn spawn(&mut self, i: usize, state: &str) {
        let data = self.dir.path().join(&self.members[i].name);
        let m = &mut self.members[i];
        let client = format!("http://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = std::process::Command::new("etcd")
            .args(["--name", &m.name, "--data-dir", &data.display().to_string()])
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster, "--initial-cluster-state", state])
            .args(["--initial-cluster-token", "fencegate-test", "--heartbeat-interval", "50"])
            .args(["--election-timeout", "500", "--logger", "zap", "--log-level", "error"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("etcd is needed: run scripts/test, or apt-get install etcd-server");
        m.child = Some(child);
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| format!("http://127.0.0.1:{}", m.client_port)).collect()
    }

    /// `[store]` for this cluster, to use with `Setup::store`.
    pub fn store_toml(&self, replica: &str) -> String {
        let endpoints = self.endpoints().iter().map(|e| format!("\"{e}\"")).collect::<Vec<_>>().join(", ");
        format!("[store]\nkind = \"etcd\"\nendpoints = [{endpoints}]\nreplica_id = \"{replica}\"\ntimeout_ms = 1000\n")
    }

    /// The index of the member that leads now, once one does (bounded wait).
    pub async fn wait_for_leader(&self) -> usize {
        for _ in 0..200 {
            for (i, m) in self.members.iter().enumerate() {
                if m.child.is_none() {
                    continue;
                }
                if let Some(true) = is_leader(m.client_port).await {
                    return i;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("the etcd cluster elected no leader");
    }

    /// `kill -9` of member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the only member of a one-member cluster again on an empty data directory, as a
    /// new cluster: what etcd's rules forbid, and what loses everything it acknowledged.
    pub async fn restart_empty_single(&mut self) {
        assert_eq!(self.members.len(), 1, "only a one-member cluster can start over on its own");
        self.kill(0);
        std::fs::remove_dir_all(self.dir.path().join(&self.members[0].name)).unwrap();
        self.spawn(0, "new");
        if let Err(status) = self.wait_for_members().await {
            panic!("the etcd member did not start again ({status})");
        }
        self.wait_for_leader().await;
    }

    /// Starts member `i` again on its data.
    pub async fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
        // Listening is enough: a member that comes back to a cluster without a quorum answers
        // no status call until one forms.
        let port = self.members[i].client_port;
        let child = self.members[i].child.as_mut().expect("just spawned");
        if let Err(status) = wait_for_server(child, port, "etcd", &Probe::Listening).await {
            panic!("etcd member {i} did not start again on port {port} ({status})");
        }
    }
}

#[cfg(feature = "etcd")]
/// Whether the member on `port` says it leads, through etcd's own status call.
async fn is_leader(port: u16) -> Option<bool> {
    let endpoint = format!("http://127.0.0.1:{port}");
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(std::time::Duration::from_millis(300))
        .with_timeout(std::time::Duration::from_millis(300));
    let mut client = etcd_client::Client::connect([endpoint], Some(options)).await.ok()?;
    let status = client.status().await.ok()?;
    let me = status.header()?.member_id();
    Some(status.leader() == me && me != 0)
}

#[cfg(feature = "etcd")]
impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// `[store]` for Redis, to use with `Setup::store`.
/// The Rust tests' Redis keeps nothing on disk unless told to: its risk is accepted here (the
/// refusal itself is tested in tests/python/test_redis_store.py).
pub fn redis_store_toml(url: &str, replica: &str) -> String {
    format!(
        "[store]\nkind = \"redis\"\nurl = \"{url}\"\nreplica_id = \"{replica}\"\ntimeout_ms = 500\naccept_unsynced_changes = true\n"
    )
}

// ---------------------------------------------------------------------------------------------
// Extra `[server]` keys (HTTPS, domain), the one throwaway test CA of the Rust tests, and
// aws-sdk-s3 clients that trust it or resolve test names to loopback.
// ---------------------------------------------------------------------------------------------

/// What a test fencegate runs on; `start` serves it.
pub struct Setup {
    dir: PathBuf,
    store: String,
    upstream: String,
    server: String,
    extra: String,
    clock: Option<Arc<dyn Clock>>,
}

impl Setup {
    /// The `[store]` section.
    pub fn store(mut self, toml: &str) -> Self {
        self.store = toml.into();
        self
    }

    /// The `[upstream]` section.
    pub fn upstream(mut self, toml: &str) -> Self {
        self.upstream = toml.into();
        self
    }

    /// Extra lines in `[server]` (e.g. `tls_cert_path = "..."`, `domain = "..."`).
    pub fn server(mut self, lines: &str) -> Self {
        self.server = lines.into();
        self
    }

    /// TOML appended after every section (`[fencing]`, `[[routes]]`, more `[[credentials]]`).
    pub fn extra(mut self, toml: &str) -> Self {
        self.extra = toml.into();
        self
    }

    /// The wall clock leases and idempotency records expire by.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    pub async fn start(self) -> Fencegate {
        let Self { dir, store, upstream, server, extra, clock } = self;
        let toml = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\n{store}\n{upstream}\n\
             [[credentials]]\naccess_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\nrole = \"issuer\"\n{extra}"
        );
        let mut config = Config::from_toml(&toml).expect("test config is valid");
        // The tests read the token that wrote an object through fencegate.
        config.fencing.show_stamp = true;
        // A Redis store is marked new, as an operator does once when making it (a test of a
        // store that lost its state restarts Redis empty afterwards).
        fencegate::init_store(&config).await.expect("the store initialises");
        let app = match clock {
            Some(clock) => App::build_with_clock(config, clock).await,
            None => App::build(config).await,
        }
        .expect("fencegate builds");
        let (s3, admin) = app.bind().await.expect("binds loopback");
        let (s3_addr, admin_addr) = (s3.local_addr().unwrap(), admin.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            app.serve(s3, admin, async move {
                let _ = stopped.await;
            })
            .await
            .expect("fencegate serves");
        });
        Fencegate { s3: s3_addr, admin: admin_addr, dir, stop: Some(stop), task: Some(task) }
    }
}

/// A wall clock that moves only when the test moves it: lease expiry without sleeping.
pub struct ManualClock(std::sync::atomic::AtomicU64);

impl ManualClock {
    /// Starts at the system's now, so what fencegate writes (RFC 3339 expirations) is sane.
    pub fn new() -> Arc<Self> {
        Arc::new(Self(std::sync::atomic::AtomicU64::new(SystemClock.now_ms())))
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.0.fetch_add(u64::try_from(by.as_millis()).unwrap(), std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Fencegate {
    /// `https://127.0.0.1:<port>` (for an instance started with TLS).
    pub fn https_endpoint(&self) -> String {
        format!("https://{}", self.s3)
    }
}

/// The test domain of virtual-hosted addressing; the test certificate covers `*.` of it.
pub const TEST_DOMAIN: &str = "s3.fencegate.test";

/// A throwaway CA and a server certificate it signed, made with the `openssl` CLI in a
/// temporary directory (never committed). Clients trust `ca_pem`.
pub struct TestTls {
    pub ca_pem: Vec<u8>,
    /// The CA's certificate file, for a configuration that names it (`ca_cert_path`).
    pub ca_path: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub fn make_test_tls(dir: &Path) -> TestTls {
    std::fs::create_dir_all(dir).unwrap();
    let p = |name: &str| dir.join(name).display().to_string();
    std::fs::write(
        dir.join("server.ext"),
        format!(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{TEST_DOMAIN},DNS:*.{TEST_DOMAIN}\n"
        ),
    )
    .unwrap();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let serial = format!("{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    let steps: Vec<Vec<String>> = vec![
        [&["req", "-x509"][..], &ec[..], &["-keyout", &p("ca.key"), "-out", &p("ca.pem"), "-days", "2"][..]]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .chain(["-subj".into(), "/CN=fencegate throwaway test CA".into()])
            .collect(),
        [&["req", "-new"][..], &ec[..], &["-keyout", &p("server.key"), "-out", &p("server.csr")][..]]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .chain(["-subj".into(), "/CN=127.0.0.1".into()])
            .collect(),
        [
            "x509",
            "-req",
            "-in",
            &p("server.csr"),
            "-CA",
            &p("ca.pem"),
            "-CAkey",
            &p("ca.key"),
            "-set_serial",
            &serial,
            "-days",
            "2",
            "-out",
            &p("server.pem"),
            "-extfile",
            &p("server.ext"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ];
    for args in steps {
        let out =
            std::process::Command::new("openssl").args(&args).output().expect("openssl is needed for the TLS tests");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    TestTls {
        ca_pem: std::fs::read(dir.join("ca.pem")).unwrap(),
        ca_path: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    }
}

/// `[server]` lines turning the S3 listener into HTTPS with `tls`.
pub fn tls_server_toml(tls: &TestTls) -> String {
    format!("tls_cert_path = \"{}\"\ntls_key_path = \"{}\"\n", tls.cert.display(), tls.key.display())
}

/// Resolves every name to 127.0.0.1 (virtual-hosted names under the test domain).
#[derive(Debug, Clone)]
pub struct LoopbackResolver;

impl aws_smithy_runtime_api::client::dns::ResolveDns for LoopbackResolver {
    fn resolve_dns<'a>(&'a self, _name: &'a str) -> aws_smithy_runtime_api::client::dns::DnsFuture<'a> {
        aws_smithy_runtime_api::client::dns::DnsFuture::ready(Ok(vec![std::net::IpAddr::from([127, 0, 0, 1])]))
    }
}

/// An HTTP client (rustls, HTTP/2 and HTTP/1.1 by ALPN) trusting only `ca_pem`; with
/// `loopback`, every name resolves to 127.0.0.1. It speaks plain HTTP to http:// endpoints.
pub fn tls_http_client(ca_pem: &[u8], loopback: bool) -> aws_sdk_s3::config::SharedHttpClient {
    use aws_smithy_http_client::tls::{self, TlsContext, TrustStore, rustls_provider::CryptoMode};
    let builder =
        aws_smithy_http_client::Builder::new().tls_provider(tls::Provider::Rustls(CryptoMode::Ring)).tls_context(
            TlsContext::builder()
                .with_trust_store(TrustStore::empty().with_pem_certificate(ca_pem.to_vec()))
                .build()
                .expect("TLS context"),
        );
    if loopback { builder.build_with_resolver(LoopbackResolver) } else { builder.build_https() }
}

/// An aws-sdk-s3 client for `endpoint` with `http`, path-style or virtual-hosted.
pub fn s3_client_on(
    endpoint: &str,
    http: aws_sdk_s3::config::SharedHttpClient,
    path_style: bool,
    access_key: &str,
    secret_key: &str,
) -> aws_sdk_s3::config::Builder {
    aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(path_style)
        .credentials_provider(Credentials::new(access_key, secret_key, None, None, "test"))
        .http_client(http)
}

/// `GET path` on `addr` over plain HTTP/1.1 (the admin listener's `/metrics`): the whole raw
/// response, read within `wait_max`.
pub async fn http_get(addr: std::net::SocketAddr, path: &str, wait_max: std::time::Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(wait_max, stream.read_to_string(&mut response)).await.unwrap().unwrap();
    response
}
