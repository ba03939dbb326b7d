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

/// Pooled clients to one kind of upstream: one pool per serving thread ([`crate::threads`]).
///
/// hyper runs each upstream connection as a task on the runtime that opened it. With one pool
/// shared by every thread, a write on one serving thread would often take a connection another
/// one opened, and each of its reads and writes would wake that thread. A request takes the
/// pool of its own serving thread; anything else (the start-up probe, tests) takes the first.
pub struct PooledClient {
    pools: Box<[Client<HttpsConnector<HttpConnector>, Body>]>,
}

impl PooledClient {
    /// Sends `req` on a connection of the calling thread's pool.
    pub fn request(&self, req: http::Request<Body>) -> hyper_util::client::legacy::ResponseFuture {
        let pool = crate::threads::current().unwrap_or(0) % self.pools.len();
        self.pools[pool].request(req)
    }
}

/// What an outbound client trusts and how it connects.
pub struct Outbound<'a> {
    /// Verify `https` peers against the CA certificates in this file instead of the web PKI
    /// roots (a config key's value, named in errors).
    pub ca_cert: Option<(&'static str, &'a Path)>,
    pub connect_timeout: Duration,
    /// Idle connections kept per upstream host, split between the pools (each keeps at least
    /// one).
    pub idle_connections_max: usize,
    /// HTTP/2 as well as HTTP/1.1 (by ALPN on `https`).
    pub http2: bool,
    /// How many pools: `server.threads`, resolved.
    pub pools: usize,
}

impl Outbound<'_> {
    /// The pools share one connector (and its TLS configuration).
    pub fn build(&self) -> anyhow::Result<PooledClient> {
        let connector = self.connector()?;
        let pools = self.pools.max(1);
        let idle_per_pool = self.idle_connections_max.div_ceil(pools);
        let pools = (0..pools)
            .map(|_| {
                Client::builder(TokioExecutor::new()).pool_max_idle_per_host(idle_per_pool).build(connector.clone())
            })
            .collect();
        Ok(PooledClient { pools })
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
