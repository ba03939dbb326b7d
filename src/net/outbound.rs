//! The one HTTP client builder for calls fencegate makes, over rustls: hyper's pooled client
//! for the gateway's third-party APIs, and [`Http1Pools`], HTTP/1.1 connections pooled per
//! serving thread, for the S3 upstream.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use s3s::Body;

/// Idle time before TCP keepalive probes on outbound connections.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// hyper's pooled client, for the gateway's third-party APIs (HTTP/1.1 and HTTP/2): one pool
/// per serving thread, and one for every other thread (`PerThread`).
pub struct PooledClient {
    pools: PerThread<Client<HttpsConnector<HttpConnector>, Body>>,
}

impl PooledClient {
    /// Sends `req` on a connection of the calling thread's pool. The connection's task, when
    /// one is opened, runs where the returned future is first polled: poll it on the calling
    /// thread.
    pub fn request(&self, req: http::Request<Body>) -> hyper_util::client::legacy::ResponseFuture {
        self.pools.current().request(req)
    }
}

/// One `T` (a pool of connections) per serving thread ([`crate::net::threads`]), and one for every
/// other thread.
///
/// hyper runs each connection as a task on the runtime that opened it. With one pool shared by
/// every thread, a write on one serving thread would often take a connection another one
/// opened, and each of its reads and writes would wake that thread. A request takes the pool
/// of its own serving thread. Calls from any other thread (the start-up probe, on the main
/// runtime; tests) take a pool of their own: a connection they open runs where they do, and a
/// serving thread that took it from its pool would cross to that runtime on every read and
/// write of each request it carried (the probe's connection once carried an eighth of the
/// bench's accepted writes that way: docs/perf-log.md, "The probe's connection").
struct PerThread<T> {
    /// The serving threads', by thread index.
    serving: Box<[T]>,
    /// Every other thread's.
    others: T,
}

impl<T> PerThread<T> {
    /// `serving` threads' (at least one) and the others', each made by `make(true)` for a
    /// serving thread and `make(false)` for the others.
    fn new(serving: usize, make: impl Fn(bool) -> T) -> Self {
        Self { serving: (0..serving.max(1)).map(|_| make(true)).collect(), others: make(false) }
    }

    /// The calling thread's.
    fn current(&self) -> &T {
        match crate::net::threads::current() {
            Some(index) => {
                debug_assert!(index < self.serving.len(), "one for each serving thread");
                &self.serving[index % self.serving.len()]
            }
            None => &self.others,
        }
    }
}

/// What an outbound client trusts and how it connects.
pub struct Outbound<'a> {
    /// Verify `https` peers against the CA certificates in this file instead of the web PKI
    /// roots (a config key's value, named in errors).
    pub ca_cert: Option<(&'static str, &'a Path)>,
    pub connect_timeout: Duration,
    /// Idle connections kept per upstream host, split between the serving threads' pools
    /// (each keeps at least one unless this is 0; the other threads' pool keeps at most
    /// [`OTHERS_IDLE_MAX`] of them).
    pub idle_connections_max: usize,
    /// HTTP/2 as well as HTTP/1.1 (by ALPN on `https`).
    pub http2: bool,
    /// How many serving threads' pools: `server.threads`, resolved.
    pub pools: usize,
}

/// Idle connections kept per upstream host by the pool of the threads that do not serve (the
/// start-up probe's calls are few).
pub const OTHERS_IDLE_MAX: usize = 2;

/// How long an idle connection of [`Http1Pools`] may be taken again (hyper's pooled client's
/// default): a peer that vanished silently is not found by TCP keepalive for minutes, and a
/// write sent on its connection would wait for its deadline.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

impl Outbound<'_> {
    /// The pools share one connector (and its TLS configuration).
    pub fn build(&self) -> anyhow::Result<PooledClient> {
        let connector = self.connector()?;
        let pools = PerThread::new(self.pools, |serving| {
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(self.idle_of(serving)).build(connector.clone())
        });
        Ok(PooledClient { pools })
    }

    /// HTTP/1.1 connections to `endpoint` (its scheme and authority), pooled as
    /// [`Outbound::build`]'s are.
    pub fn build_http1(&self, endpoint: http::Uri) -> anyhow::Result<Http1Pools> {
        anyhow::ensure!(!self.http2, "HTTP/1.1 pools do not speak HTTP/2");
        let connector = self.connector()?;
        Ok(Http1Pools {
            connector,
            endpoint,
            pools: PerThread::new(self.pools, |serving| Idle::new(self.idle_of(serving))),
        })
    }

    /// Idle connections kept by a serving thread's pool, or by the others'.
    fn idle_of(&self, serving: bool) -> usize {
        if serving {
            self.idle_connections_max.div_ceil(self.pools.max(1))
        } else {
            self.idle_connections_max.min(OTHERS_IDLE_MAX)
        }
    }

    fn connector(&self) -> anyhow::Result<HttpsConnector<HttpConnector>> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        // A write waits for the upstream's answer as long as its connection lives (its outcome
        // is unknown until then); keepalive probes find a dead peer.
        http.set_keepalive(Some(TCP_KEEPALIVE));
        http.set_connect_timeout(Some(self.connect_timeout));
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = match self.ca_cert {
            None => builder.with_webpki_roots(),
            Some((key, path)) => builder.with_tls_config(tls_config(key, path)?),
        };
        let builder = builder.https_or_http();
        Ok(if self.http2 {
            builder.enable_all_versions().wrap_connector(http)
        } else {
            builder.enable_http1().wrap_connector(http)
        })
    }
}

/// HTTP/1.1 connections to one endpoint, pooled per serving thread (`PerThread`): the S3
/// upstream's client. A request takes the most recently used idle connection of the
/// calling thread's pool, or opens one on the thread. A request that a connection closed
/// before writing it (hyper hands it back, its body unread) goes to the next connection: it
/// was never sent. What hyper's pooled client does besides, fencegate's upstream does not need:
/// a pool key hashed twice per request, a race between a checkout and a lazy connect, HTTP/2,
/// absolute-form URIs and a Host header filled in (the caller sets it). Its per-request work
/// was a tenth of an accepted write's instructions outside SHA-256 (docs/perf-log.md, "The S3
/// upstream's own connection pools"). Like that client's, idle connections are dropped
/// after [`IDLE_TIMEOUT`].
pub struct Http1Pools {
    connector: HttpsConnector<HttpConnector>,
    /// Where connections go: the endpoint's scheme and authority.
    endpoint: http::Uri,
    pools: PerThread<Arc<Idle>>,
}

/// Why [`Http1Pools::send`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could take the request: it was not sent.
    #[error("cannot connect")]
    Connect(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The connection failed once the request was handed to it: it may have been sent.
    #[error("the connection failed")]
    Transport(#[source] hyper::Error),
}

impl Http1Pools {
    /// Sends `req` (its URI in origin form: path and query; its Host header set) on a
    /// connection of the calling thread's pool. The connection's task, when one is opened,
    /// runs on the calling thread.
    pub async fn send(&self, mut req: http::Request<Body>) -> Result<http::Response<Incoming>, SendError> {
        let idle = self.pools.current();
        while let Some(mut sender) = idle.take() {
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    idle.give_back(sender);
                    return Ok(resp);
                }
                Err(mut error) => match error.take_message() {
                    // Closed before the request was written: it goes to the next connection.
                    Some(unsent) => req = unsent,
                    None => return Err(SendError::Transport(error.into_error())),
                },
            }
        }
        // Boxed: a connection's opening is most of this future's size, and most requests
        // find an idle connection (the caller boxes this future with every request).
        let mut sender = Box::pin(self.connect()).await?;
        match sender.try_send_request(req).await {
            Ok(resp) => {
                idle.give_back(sender);
                Ok(resp)
            }
            Err(error) if error.message().is_some() => Err(SendError::Connect(Box::new(error.into_error()))),
            Err(error) => Err(SendError::Transport(error.into_error())),
        }
    }

    /// A new connection, its task spawned on the calling thread's runtime.
    async fn connect(&self) -> Result<SendRequest<Body>, SendError> {
        use tower_service::Service as _;
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx)).await.map_err(SendError::Connect)?;
        let io = connector.call(self.endpoint.clone()).await.map_err(SendError::Connect)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(io).await.map_err(|e| SendError::Connect(Box::new(e)))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}

/// One thread's idle connections, each with when it was kept, the most recently used last.
struct Idle {
    senders: Mutex<Vec<(SendRequest<Body>, Instant)>>,
    max: usize,
}

impl Idle {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { senders: Mutex::new(Vec::new()), max })
    }

    /// The most recently used connection still open and idle for less than [`IDLE_TIMEOUT`]
    /// (only ready ones are kept; the others are dropped on the way).
    fn take(&self) -> Option<SendRequest<Body>> {
        let mut senders = self.senders.lock().expect("idle connections lock poisoned");
        let now = Instant::now();
        while let Some((sender, kept)) = senders.pop() {
            if sender.is_ready() && now.duration_since(kept) < IDLE_TIMEOUT {
                return Some(sender);
            }
        }
        None
    }

    /// Keeps a connection whose response head arrived: now if it can take a request (a
    /// response without a body), otherwise once its response's body was read, from a task of
    /// its own. Closed, or beyond the pool's size, it is dropped (and closes once idle).
    fn give_back(self: &Arc<Self>, mut sender: SendRequest<Body>) {
        if sender.is_ready() {
            self.keep(sender);
        } else if !sender.is_closed() && !self.is_full() {
            let idle = Arc::clone(self);
            tokio::spawn(async move {
                if sender.ready().await.is_ok() {
                    idle.keep(sender);
                }
            });
        }
    }

    fn is_full(&self) -> bool {
        self.senders.lock().expect("idle connections lock poisoned").len() >= self.max
    }

    fn keep(&self, sender: SendRequest<Body>) {
        let mut senders = self.senders.lock().expect("idle connections lock poisoned");
        if senders.len() < self.max {
            senders.push((sender, Instant::now()));
        }
    }
}

/// rustls with only the CA certificates of `path` as roots.
fn tls_config(key: &str, path: &Path) -> anyhow::Result<rustls::ClientConfig> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("{key}: cannot read certificates from {}", path.display()))?;
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        anyhow::bail!("{key}: no usable CA certificate in {}", path.display());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::net::threads::ServingThreads;

    /// An upstream answering every request `200` with `body_bytes` of body on keep-alive
    /// connections (or closing each after its answer, with `close`), counting the connections
    /// it accepted.
    async fn upstream(body_bytes: usize, close: bool) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    let mut answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {body_bytes}\r\n\r\n").into_bytes();
                    answer.resize(answer.len() + body_bytes, b'x');
                    while let Ok(n @ 1..) = conn.read(&mut buf).await {
                        seen.extend_from_slice(&buf[..n]);
                        // Bodiless requests: each ends at its blank line.
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            if conn.write_all(&answer).await.is_err() || close {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    async fn counting_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        upstream(0, false).await
    }

    async fn get(client: &PooledClient, addr: std::net::SocketAddr) {
        let req = http::Request::get(format!("http://{addr}/")).body(Body::empty()).unwrap();
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        // The empty body read to its end: the connection goes back to its pool.
        use http_body_util::BodyExt;
        resp.into_body().collect().await.unwrap();
    }

    async fn within<F: std::future::Future>(what: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(10), what).await.expect("in time")
    }

    #[tokio::test]
    async fn a_serving_thread_never_takes_a_connection_another_thread_opened() {
        let (addr, accepted) = counting_upstream().await;
        let client = Arc::new(outbound(2).build().unwrap());
        // From the test's runtime (as the start-up probe calls from the main one): its
        // connection is idle in a pool once this returns.
        within(get(&client, addr)).await;
        within(get(&client, addr)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the other threads' pool keeps its connection");
        let threads = ServingThreads::start(2).unwrap();
        one_after_another(&threads, 4, || {
            let client = client.clone();
            async move { get(&client, addr).await }
        })
        .await;
        // Each serving thread opened a connection of its own, and kept it for its next request.
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "one connection for each runtime");
        threads.stop().await;
    }

    /// Runs `count` requests made by `request` on `threads`, one after the other: the threads
    /// take them in turn (round robin), so each thread runs `count / threads` of them.
    async fn one_after_another<F, R>(threads: &ServingThreads, count: usize, request: F)
    where
        F: Fn() -> R,
        R: std::future::Future<Output = ()> + Send + 'static,
    {
        for _ in 0..count {
            let (done_tx, done) = tokio::sync::oneshot::channel();
            let request = request();
            threads.spawn(async move {
                request.await;
                let _ = done_tx.send(());
            });
            within(done).await.expect("the serving thread's request ended");
        }
    }

    /// Plain HTTP, 8 idle connections, `pools` serving threads' pools.
    fn outbound(pools: usize) -> Outbound<'static> {
        Outbound {
            ca_cert: None,
            connect_timeout: Duration::from_secs(5),
            idle_connections_max: 8,
            http2: false,
            pools,
        }
    }

    /// A GET of `/` at `addr` through `pools`, its body read: its length.
    async fn get_http1(pools: &Http1Pools, addr: std::net::SocketAddr) -> usize {
        let mut req = http::Request::get("/").body(Body::empty()).unwrap();
        req.headers_mut().insert(http::header::HOST, addr.to_string().parse().unwrap());
        let resp = within(pools.send(req)).await.unwrap();
        assert_eq!(resp.status(), 200);
        use http_body_util::BodyExt;
        within(resp.into_body().collect()).await.unwrap().to_bytes().len()
    }

    /// [`Http1Pools`] to `addr`.
    fn aimed(addr: std::net::SocketAddr, pools: usize) -> Arc<Http1Pools> {
        Arc::new(outbound(pools).build_http1(format!("http://{addr}/").parse().unwrap()).unwrap())
    }

    #[tokio::test]
    async fn http1_pools_keep_a_connection_per_thread_and_reuse_it() {
        let (addr, accepted) = counting_upstream().await;
        let pools = aimed(addr, 2);
        get_http1(&pools, addr).await;
        get_http1(&pools, addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the other threads' pool keeps its connection");
        let threads = ServingThreads::start(2).unwrap();
        one_after_another(&threads, 4, || {
            let pools = pools.clone();
            async move {
                get_http1(&pools, addr).await;
            }
        })
        .await;
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "one connection for each runtime");
        threads.stop().await;
    }

    #[tokio::test]
    async fn a_connection_is_reused_once_its_answers_body_was_read() {
        use http_body_util::BodyExt;
        let (addr, accepted) = upstream(256 * 1024, false).await;
        let pools = aimed(addr, 1);
        for _ in 0..3 {
            let mut req = http::Request::get("/").body(Body::empty()).unwrap();
            req.headers_mut().insert(http::header::HOST, addr.to_string().parse().unwrap());
            let resp = within(pools.send(req)).await.unwrap();
            // Its body still to read, the connection cannot take a request: not in the pool.
            assert!(pools.pools.others.senders.lock().unwrap().is_empty(), "a busy connection is not idle");
            let body = within(resp.into_body().collect()).await.unwrap().to_bytes();
            assert_eq!(body.len(), 256 * 1024);
            // It goes back from a task of its own, once idle.
            within(async {
                while pools.pools.others.senders.lock().unwrap().is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for 3 requests");
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_dropped_and_the_next_request_opens_one() {
        let (addr, accepted) = upstream(16, true).await;
        let pools = aimed(addr, 1);
        for _ in 0..3 {
            assert_eq!(get_http1(&pools, addr).await, 16);
            assert!(pools.pools.others.senders.lock().unwrap().is_empty(), "a closed connection is not kept");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "a connection per request");
    }

    /// An upstream on a thread of its own: answers the first request of its first connection,
    /// then closes it 100 ms later; answers every request of its later connections. Counts
    /// connections.
    fn closing_upstream_thread() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let first = count.fetch_add(1, Ordering::SeqCst) == 0;
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = conn.read(&mut buf) {
                        seen.extend_from_slice(&buf[..n]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
                            if first {
                                // Closed a while after the answer: idle by then.
                                std::thread::sleep(Duration::from_millis(100));
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    /// The race of an upstream closing an idle connection as a request goes out on it: hyper
    /// writes the request before it reads the close, so the request may have reached the
    /// upstream. It is never reported as unsent, nor sent again; the next one opens a
    /// connection. (hyper's pooled client does the same: it sends again only a request the
    /// connection handed back unwritten.)
    #[tokio::test]
    async fn a_request_on_a_connection_closed_unseen_may_have_been_sent() {
        let (addr, accepted) = closing_upstream_thread();
        let pools = aimed(addr, 1);
        get_http1(&pools, addr).await;
        assert_eq!(pools.pools.others.senders.lock().unwrap().len(), 1, "kept, as its answer was complete");
        // The upstream closes that connection meanwhile; this runtime's thread, blocked, does
        // not see it before the next request is handed to the connection.
        std::thread::sleep(Duration::from_millis(300));
        let mut req = http::Request::put("/b/k").body(Body::from("x".to_owned())).unwrap();
        req.headers_mut().insert(http::header::HOST, addr.to_string().parse().unwrap());
        let error = within(pools.send(req)).await.unwrap_err();
        assert!(matches!(error, SendError::Transport(_)), "{error:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "not sent again on another connection");
        get_http1(&pools, addr).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the next request opened a connection");
    }

    #[tokio::test]
    async fn a_request_the_upstream_read_without_answering_may_have_been_sent() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            // Read, then gone without an answer.
        });
        let pools = aimed(addr, 1);
        let mut req = http::Request::put("/b/k").body(Body::from("x".to_owned())).unwrap();
        req.headers_mut().insert(http::header::HOST, addr.to_string().parse().unwrap());
        let error = within(pools.send(req)).await.unwrap_err();
        assert!(matches!(error, SendError::Transport(_)), "{error:?}");
    }

    #[tokio::test]
    async fn no_connection_means_the_request_was_not_sent() {
        // Bound, not listening: connections are refused, and the port stays this test's.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = socket.local_addr().unwrap();
        let pools = aimed(addr, 1);
        let req = http::Request::put("/b/k").body(Body::from("x".to_owned())).unwrap();
        let error = within(pools.send(req)).await.unwrap_err();
        assert!(matches!(error, SendError::Connect(_)), "{error:?}");
    }

    #[test]
    fn a_request_that_finds_an_idle_connection_carries_no_connection_opening() {
        // The upstream call boxes this future with every write; opening a connection, boxed
        // apart, made it 3,000 bytes inline (docs/perf-log.md, "Futures' sizes").
        let size = crate::future_size(|pools: &'static Http1Pools, req: http::Request<Body>| pools.send(req));
        assert!(size <= 1536, "Http1Pools::send's future is {size} bytes");
    }
}
