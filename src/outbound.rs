//! The one HTTP client builder for calls fencegate makes: hyper's pooled client over rustls,
//! for the S3 upstream and for the gateway's third-party APIs alike.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use s3s::Body;

/// Idle time before TCP keepalive probes on outbound connections.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// Pooled clients to one kind of upstream: one pool per serving thread ([`crate::threads`]),
/// and one more for every other thread.
///
/// hyper runs each upstream connection as a task on the runtime that opened it. With one pool
/// shared by every thread, a write on one serving thread would often take a connection another
/// one opened, and each of its reads and writes would wake that thread. A request takes the
/// pool of its own serving thread. Calls from any other thread (the start-up probe, on the
/// main runtime; tests) take a pool of their own: a connection they open runs where they do,
/// and a serving thread that took it from its pool would cross to that runtime on every read
/// and write of each request it carried (the probe's connection once carried an eighth of the
/// bench's accepted writes that way: docs/benchmarks.md, "The probe's connection").
pub struct PooledClient {
    /// The serving threads' pools, by thread index.
    serving: Box<[Client<HttpsConnector<HttpConnector>, Body>]>,
    /// The pool of every other thread.
    others: Client<HttpsConnector<HttpConnector>, Body>,
}

impl PooledClient {
    /// Sends `req` on a connection of the calling thread's pool. The connection's task, when
    /// one is opened, runs where the returned future is first polled: poll it on the calling
    /// thread.
    pub fn request(&self, req: http::Request<Body>) -> hyper_util::client::legacy::ResponseFuture {
        self.pool_of(crate::threads::current()).request(req)
    }

    /// The pool of serving thread `serving` (`None`: not a serving thread).
    fn pool_of(&self, serving: Option<usize>) -> &Client<HttpsConnector<HttpConnector>, Body> {
        match serving {
            Some(index) => {
                debug_assert!(index < self.serving.len(), "a pool for each serving thread");
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

impl Outbound<'_> {
    /// The pools share one connector (and its TLS configuration).
    pub fn build(&self) -> anyhow::Result<PooledClient> {
        let connector = self.connector()?;
        let serving = self.pools.max(1);
        let pool =
            |idle: usize| Client::builder(TokioExecutor::new()).pool_max_idle_per_host(idle).build(connector.clone());
        let idle_per_pool = self.idle_connections_max.div_ceil(serving);
        Ok(PooledClient {
            serving: (0..serving).map(|_| pool(idle_per_pool)).collect(),
            others: pool(self.idle_connections_max.min(OTHERS_IDLE_MAX)),
        })
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
    use crate::threads::ServingThreads;

    /// An upstream answering every request `200` on keep-alive connections, counting the
    /// connections it accepted.
    async fn counting_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
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
                    while let Ok(n @ 1..) = conn.read(&mut buf).await {
                        seen.extend_from_slice(&buf[..n]);
                        // Bodiless requests: each ends at its blank line.
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                            if conn.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
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
        let outbound = Outbound {
            ca_cert: None,
            connect_timeout: Duration::from_secs(5),
            idle_connections_max: 8,
            http2: false,
            pools: 2,
        };
        let client = Arc::new(outbound.build().unwrap());
        // From the test's runtime (as the start-up probe calls from the main one): its
        // connection is idle in a pool once this returns.
        within(get(&client, addr)).await;
        within(get(&client, addr)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the other threads' pool keeps its connection");
        let threads = ServingThreads::start(2).unwrap();
        // Round robin: two requests on each thread, one after the other.
        for _ in 0..4 {
            let (done_tx, done) = tokio::sync::oneshot::channel();
            let client = client.clone();
            threads.spawn(async move {
                get(&client, addr).await;
                let _ = done_tx.send(());
            });
            within(done).await.expect("the serving thread's request ended");
        }
        // Each serving thread opened a connection of its own, and kept it for its next request.
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "one connection for each runtime");
        threads.stop().await;
    }
}
