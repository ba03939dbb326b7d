//! Serving connections: an accept loop over a bound listener, with the connection limit,
//! header limits and timeouts applied, and graceful shutdown.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::Service;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::net::threads::ServingThreads;

/// How long an accept loop waits after a failed accept (out of file descriptors and the like)
/// before it tries again, instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// A connection idle for less than a tenth of the header read timeout, and at most this, keeps
/// its slot when the listener is full (see [`run`]).
const EVICT_AFTER_MAX: Duration = Duration::from_secs(1);

/// Request headers about the hop to fencegate (RFC 9110 hop-by-hop fields, the host it was
/// addressed as, and `Expect`, which fencegate itself answers): never forwarded upstream.
pub const REQUEST_HOP_HEADERS: &[&str] = &[
    "host",
    "connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
];

/// Response headers about the hop from the upstream: never passed on to the client.
pub const RESPONSE_HOP_HEADERS: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"];

/// Removes [`RESPONSE_HOP_HEADERS`] from an upstream's answer. Most answers carry none: one
/// pass over the names finds that, where a removal per name would look each one up.
pub fn remove_response_hop_headers(headers: &mut http::HeaderMap) {
    if !headers.keys().any(|name| RESPONSE_HOP_HEADERS.contains(&name.as_str())) {
        return;
    }
    for name in RESPONSE_HOP_HEADERS {
        headers.remove(*name);
    }
}

/// The limits of one listener.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub connections_max: usize,
    pub header_bytes_max: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Serves `service` on `listener` (over TLS when `tls` is given) until `shutdown` resolves,
/// then lets open requests finish (for at most `drain_for`). Each connection is served on one
/// of `threads` when given (an HTTP/2 connection's streams on all of them), else on the
/// caller's runtime.
pub async fn run<S, B>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    service: S,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
    drain_for: Duration,
    threads: Option<Arc<ServingThreads>>,
) where
    S: Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let permits = Arc::new(Semaphore::new(limits.connections_max));
    let open = Arc::new(OpenConnections::default());
    let evict_after = (limits.header_read_timeout / 10).min(EVICT_AFTER_MAX);
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&limits, threads.clone()));
    tokio::pin!(shutdown);
    loop {
        let Some((stream, peer)) = accept(&listener, shutdown.as_mut()).await else { break };
        let Some(permit) = free_slot(&permits, &open, evict_after, shutdown.as_mut()).await else {
            return drain(listener, graceful, drain_for).await;
        };
        let (builder, service, tls, watcher) = (builder.clone(), service.clone(), tls.clone(), graceful.watcher());
        let requests = open.insert();
        let open = open.clone();
        let connection = async move {
            let _permit = permit;
            let _registered = Registered { open, requests: requests.clone() };
            let stream = match TcpStream::from_std(stream) {
                Ok(stream) => stream,
                Err(error) => return tracing::warn!(%peer, %error, "cannot serve an accepted connection"),
            };
            let activity = Arc::new(AtomicU64::new(0));
            let tracked = Tracked { inner: stream, activity: activity.clone() };
            let idle = idle_watch(activity, limits.idle_timeout);
            // Timed from accept, whatever protocol the connection turns out to speak: hyper's
            // own header timeout starts only once it has told HTTP/1 from HTTP/2, and a client
            // that sends nothing, or half an HTTP/2 preface, never gets that far. Then, on
            // HTTP/2 as on HTTP/1, a connection with no request in flight for that long is
            // closed: PINGs and SETTINGS are not requests.
            let unused = requests.clone().unused_for(limits.header_read_timeout);
            let service = Counted { inner: service, requests, peer };
            match tls {
                None => serve(&builder, TokioIo::new(tracked), service, watcher, idle, unused, peer).await,
                // Boxed: the handshake's and a TLS connection's futures are about twice a plain
                // connection's, and every connection's task, plain or not, would hold them.
                Some(acceptor) => {
                    Box::pin(async move {
                        let handshake = acceptor.accept(tracked);
                        let Some(stream) = handshaken(handshake, limits.header_read_timeout, peer).await else {
                            return;
                        };
                        serve(&builder, TokioIo::new(stream), service, watcher, idle, unused, peer).await;
                    })
                    .await
                }
            }
        };
        spawn(threads.as_deref(), connection);
    }
    drain(listener, graceful, drain_for).await;
}

/// The next connection, or `None` once `shutdown` resolved, taken off this runtime's reactor
/// to be registered with the serving thread's. An accept that fails (out of file descriptors
/// and the like) is tried again after a pause instead of spinning.
async fn accept(
    listener: &TcpListener,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<(std::net::TcpStream, std::net::SocketAddr)> {
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => return None,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        match stream.into_std() {
            Ok(stream) => return Some((stream, peer)),
            Err(error) => tracing::debug!(%peer, %error, "accepted connection lost before it was served"),
        }
    }
}

/// A TLS connection once its handshake is done, within `timeout`.
async fn handshaken<S>(
    handshake: tokio_rustls::Accept<S>,
    timeout: Duration,
    peer: std::net::SocketAddr,
) -> Option<tokio_rustls::server::TlsStream<S>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    match tokio::time::timeout(timeout, handshake).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "TLS handshake failed");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

/// The HTTP/1 and HTTP/2 settings of a listener's connections.
fn builder(limits: &ConnectionLimits, threads: Option<Arc<ServingThreads>>) -> auto::Builder<Streams> {
    let mut builder = auto::Builder::new(Streams(threads));
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.header_bytes_max)
        .keep_alive(true);
    builder.http2().timer(TokioTimer::new()).max_header_list_size(limits.header_bytes_max as u32);
    builder
}

/// A slot for a connection just accepted; `None` when `shutdown` resolves first. When every
/// slot is taken, the connection that has been without a request the longest gives its slot up
/// (a silent socket, one that only pings), so idle connections cannot keep a client with a
/// request out; one idle for less than `evict_after` keeps it, so that a connection is not
/// closed before it could send its request, and connections opened again at once cannot close
/// each other faster than that. When no connection may give its slot up, the new one waits.
async fn free_slot(
    permits: &Arc<Semaphore>,
    open: &OpenConnections,
    evict_after: Duration,
    mut shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<OwnedSemaphorePermit> {
    loop {
        if let Ok(permit) = permits.clone().try_acquire_owned() {
            return Some(permit);
        }
        // When none could be closed now: when the longest idle one can be (far in the future
        // when every connection has a request in flight; a slot freed first ends the wait).
        let retry_at = match open.evict_longest_idle(evict_after) {
            Ok(()) => None,
            Err(at) => Some(at.unwrap_or_else(|| tokio::time::Instant::now() + evict_after)),
        };
        tokio::select! {
            _ = &mut shutdown => return None,
            permit = permits.clone().acquire_owned() => return Some(permit.expect("semaphore never closed")),
            () = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now)), if retry_at.is_some() => {}
        }
    }
}

/// Stops accepting, and lets open requests finish for at most `drain_for`.
async fn drain(listener: TcpListener, graceful: GracefulShutdown, drain_for: Duration) {
    drop(listener);
    if tokio::time::timeout(drain_for, graceful.shutdown()).await.is_err() {
        tracing::warn!(drain_ms = drain_for.as_millis() as u64, "connections still open after the drain period");
    }
}

/// Where hyper runs the streams of an HTTP/2 connection: spread over the serving threads, since
/// one HTTP/2 connection (a load balancer's, say) can carry many clients' requests at once;
/// without serving threads, on the caller's runtime. HTTP/1 requests run on their connection's
/// task, one at a time.
#[derive(Clone)]
struct Streams(Option<Arc<ServingThreads>>);

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, stream: F) {
        spawn(self.0.as_deref(), async move {
            stream.await;
        });
    }
}

/// Runs `task` on the next of `threads`, or on the caller's runtime without them.
fn spawn(threads: Option<&ServingThreads>, task: impl Future<Output = ()> + Send + 'static) {
    match threads {
        Some(threads) => threads.spawn(task),
        None => drop(tokio::spawn(task)),
    }
}

/// The open connections of one listener, each with its requests in flight.
#[derive(Default)]
struct OpenConnections {
    next: AtomicU64,
    by_id: std::sync::Mutex<std::collections::HashMap<u64, Arc<Requests>>>,
}

impl OpenConnections {
    fn insert(&self) -> Arc<Requests> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let requests = Arc::new(Requests::new(id));
        self.by_id.lock().expect("connections lock").insert(id, requests.clone());
        requests
    }

    /// Closes the connection that has been of no use the longest ([`Requests::idle_since`]), if
    /// for `at_least`. Otherwise, when that one could be closed (`None`: every connection has a
    /// request being handled or a response waiting on its source).
    fn evict_longest_idle(&self, at_least: Duration) -> Result<(), Option<tokio::time::Instant>> {
        let mut by_id = self.by_id.lock().expect("connections lock");
        let Some((since, id)) = by_id.values().filter_map(|r| r.idle_since().map(|since| (since, r.id))).min() else {
            return Err(None);
        };
        if tokio::time::Instant::now() < since + at_least {
            return Err(Some(since + at_least));
        }
        if let Some(requests) = by_id.remove(&id) {
            requests.evicted.notify_one();
        }
        Ok(())
    }
}

/// Removes a connection from [`OpenConnections`] when its task ends.
struct Registered {
    open: Arc<OpenConnections>,
    requests: Arc<Requests>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.open.by_id.lock().expect("connections lock").remove(&self.requests.id);
    }
}

/// One connection's requests, and since when it has been of no use: no request being handled
/// and no response body waiting on its source, while what it has to send does not move (a
/// client that stopped reading, or an HTTP/2 client that gave no flow-control window).
struct Requests {
    id: u64,
    opened: tokio::time::Instant,
    /// Requests whose response is still being made (their head arrived, their body may be
    /// arriving).
    handling: AtomicUsize,
    /// Response bodies waiting on their source (an upstream still sending): the wait is not
    /// the client's.
    waiting: AtomicUsize,
    /// Milliseconds from `opened` to the last progress: a request taken, answered or ended, a
    /// response body polled.
    progress_ms: AtomicU64,
    evicted: Notify,
}

impl Requests {
    fn new(id: u64) -> Self {
        Self {
            id,
            opened: tokio::time::Instant::now(),
            handling: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            progress_ms: AtomicU64::new(0),
            evicted: Notify::new(),
        }
    }

    fn progress(&self) {
        let now = self.opened.elapsed().as_millis() as u64;
        self.progress_ms.fetch_max(now, Ordering::AcqRel);
    }

    /// Since when the connection has been of no use; `None` while a request is being handled
    /// or a response body waits on its source.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        // Progress is recorded before a count goes down: a count of 0 read here comes with
        // the time it reached 0.
        (self.handling.load(Ordering::Acquire) == 0 && self.waiting.load(Ordering::Acquire) == 0)
            .then(|| self.opened + Duration::from_millis(self.progress_ms.load(Ordering::Acquire)))
    }

    fn start(self: &Arc<Self>) -> RequestGuard {
        self.handling.fetch_add(1, Ordering::AcqRel);
        self.progress();
        RequestGuard(self.clone())
    }

    /// Resolves once the connection has been of no use for `limit` (from its opening, for a
    /// connection that never sent a request), or was evicted.
    async fn unused_for(self: Arc<Self>, limit: Duration) {
        let mut deadline = self.opened + limit;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {}
                () = self.evicted.notified() => return,
            }
            match self.idle_since() {
                Some(since) if tokio::time::Instant::now() >= since + limit => return,
                Some(since) => deadline = since + limit,
                None => deadline = tokio::time::Instant::now() + limit,
            }
        }
    }
}

/// A request being handled, until its response is made (or the request dropped).
struct RequestGuard(Arc<Requests>);

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.progress();
        self.0.handling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection's service, counting its requests.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    requests: Arc<Requests>,
    /// The connection's peer, given to every request as a [`Peer`] extension.
    peer: std::net::SocketAddr,
}

/// The address of the peer a request came from (its TCP connection's): what a caller cannot
/// invent, unlike any header. A request extension.
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

impl Peer {
    /// The peer's share key: its IPv4 address, or its IPv6 /64 (what one host is usually
    /// given), so that one host's addresses are one share.
    pub fn share(&self) -> String {
        match self.0.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
                Some(v4) => v4.to_string(),
                None => {
                    let s = ip.segments();
                    format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
                }
            },
        }
    }
}

impl<S, T, B> Service<http::Request<T>> for Counted<S>
where
    S: Service<http::Request<T>, Response = http::Response<B>>,
{
    type Response = http::Response<CountedBody<B>>;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn call(&self, mut req: http::Request<T>) -> Self::Future {
        let guard = self.requests.start();
        req.extensions_mut().insert(Peer(self.peer));
        CountedFuture { inner: self.inner.call(req), guard: Some(guard) }
    }
}

pin_project_lite::pin_project! {
    /// A request's response future, counted as handled until it resolves.
    struct CountedFuture<F> {
        #[pin]
        inner: F,
        guard: Option<RequestGuard>,
    }
}

impl<F, B, E> Future for CountedFuture<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<CountedBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = std::task::ready!(this.inner.poll(cx));
        let requests = this.guard.take().map(|guard| guard.0.clone());
        Poll::Ready(result.map(|resp| resp.map(|inner| CountedBody { inner, requests, waiting: false })))
    }
}

pin_project_lite::pin_project! {
    /// A response body, whose polls are the connection's progress and whose waits on its
    /// source keep the connection of use.
    pub struct CountedBody<B> {
        #[pin]
        inner: B,
        requests: Option<Arc<Requests>>,
        waiting: bool,
    }

    impl<B> PinnedDrop for CountedBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(requests) = this.requests.as_ref() {
                requests.progress();
                if *this.waiting {
                    requests.waiting.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
    }
}

impl<B: http_body::Body> http_body::Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Some(requests) = this.requests.as_ref() {
            requests.progress();
            let waiting = polled.is_pending();
            if waiting != *this.waiting {
                *this.waiting = waiting;
                if waiting {
                    requests.waiting.fetch_add(1, Ordering::AcqRel);
                } else {
                    requests.waiting.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves one connection until it ends, goes idle, has no request in flight for the header
/// read timeout or is evicted (`unused`), or shutdown drains it.
async fn serve<I, S, B>(
    builder: &auto::Builder<Streams>,
    io: I,
    service: S,
    watcher: hyper_util::server::graceful::Watcher,
    idle: impl Future<Output = ()>,
    unused: impl Future<Output = ()>,
    peer: std::net::SocketAddr,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let conn = watcher.watch(builder.serve_connection_with_upgrades(io, service).into_owned());
    tokio::pin!(conn);
    tokio::pin!(idle);
    tokio::pin!(unused);
    tokio::select! {
        () = &mut unused => tracing::debug!(%peer, "closing a connection of no use (no request, nothing moving)"),
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%peer, error = %error, "connection ended with an error");
            }
        }
        () = &mut idle => tracing::debug!(%peer, "closing idle connection"),
    }
}

/// Loads a PEM certificate chain and key into a TLS acceptor offering HTTP/2 and HTTP/1.1.
pub fn tls_acceptor(cert_path: &std::path::Path, key_path: &std::path::Path) -> anyhow::Result<TlsAcceptor> {
    use anyhow::Context;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert_path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("server.tls_cert_path: cannot read certificates from {}", cert_path.display()))?;
    let key = PrivateKeyDer::from_pem_file(key_path)
        .with_context(|| format!("server.tls_key_path: cannot read a private key from {}", key_path.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("server.tls_cert_path: the certificate and key do not match")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Resolves once no byte moved on the connection for `idle_timeout`.
async fn idle_watch(activity: Arc<AtomicU64>, idle_timeout: Duration) {
    let mut seen = activity.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(idle_timeout).await;
        let now = activity.load(Ordering::Relaxed);
        if now == seen {
            return;
        }
        seen = now;
    }
}

/// A TCP stream that counts activity, for the idle timeout.
struct Tracked {
    inner: TcpStream,
    activity: Arc<AtomicU64>,
}

impl Tracked {
    fn touch(&self) {
        self.activity.fetch_add(1, Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        result
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &result
            && *n > 0
        {
            self.touch();
        }
        result
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One HTTP/2 connection's streams run on every serving thread, not only its own.
    #[tokio::test]
    async fn http2_streams_are_spread_over_the_serving_threads() {
        let threads = Arc::new(ServingThreads::start(2).unwrap());
        let streams = Streams(Some(threads.clone()));
        let (ran_tx, mut ran) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..4 {
            let ran_tx = ran_tx.clone();
            hyper::rt::Executor::execute(&streams, async move {
                ran_tx.send(crate::net::threads::current()).unwrap();
            });
        }
        let mut on = Vec::new();
        for _ in 0..4 {
            on.push(ran.recv().await.unwrap());
        }
        on.sort();
        assert_eq!(on, vec![Some(0), Some(0), Some(1), Some(1)]);
        threads.stop().await;
    }
}
