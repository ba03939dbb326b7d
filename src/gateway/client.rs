//! The HTTP client to third-party APIs: hyper's pooled client over rustls (certificates verified
//! against the web PKI roots, or a route's own CA), with the outcome of a failed call classified
//! as "never sent" or "unknown".

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use s3s::Body;

/// Why a call got no response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection was made: the API never saw the request.
    #[error("cannot connect to the upstream")]
    NotSent(#[source] hyper_util::client::legacy::Error),
    /// No response head within the request timeout: the API may have executed it.
    #[error("no response within {after_ms} ms")]
    Timeout { after_ms: u64 },
    /// The connection broke after the request started: the API may have executed it.
    #[error("the upstream connection broke")]
    Broken(#[source] hyper_util::client::legacy::Error),
    /// The write's body was cut off before it reached the API whole: nothing executed.
    #[error("the request body was cut off")]
    CutOff,
}

pub struct ApiClient {
    client: Client<HttpsConnector<HttpConnector>, Body>,
}

impl ApiClient {
    /// A client verifying `https` upstreams against `ca_cert_path` if given, else the web PKI
    /// roots.
    pub fn new(
        ca_cert_path: Option<&Path>,
        connect_timeout: Duration,
        idle_connections_max: usize,
    ) -> anyhow::Result<Self> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = match ca_cert_path {
            None => builder.with_webpki_roots(),
            Some(path) => builder.with_tls_config(tls_config(path)?),
        };
        let connector = builder.https_or_http().enable_all_versions().wrap_connector(http);
        let client =
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(idle_connections_max).build(connector);
        Ok(Self { client })
    }

    /// Sends a read (or an unfenced write), given up after `timeout`.
    pub async fn send(
        &self,
        req: http::Request<Body>,
        timeout: Duration,
    ) -> Result<http::Response<Incoming>, SendError> {
        match tokio::time::timeout(timeout, self.send_unbounded(req)).await {
            Err(_) => Err(SendError::Timeout { after_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX) }),
            Ok(result) => result,
        }
    }

    /// Sends a fenced write: never given up here, the caller bounds it (`fence::outcome`).
    pub fn send_unbounded(
        &self,
        req: http::Request<Body>,
    ) -> impl Future<Output = Result<http::Response<Incoming>, SendError>> + Send + 'static {
        let request = self.client.request(req);
        async move {
            match request.await {
                Ok(resp) => Ok(resp),
                Err(e) if e.is_connect() => Err(SendError::NotSent(e)),
                Err(e) => Err(SendError::Broken(e)),
            }
        }
    }
}

impl crate::fence::outcome::Delivery for SendError {
    fn maybe_delivered(&self) -> bool {
        !matches!(self, Self::NotSent(_) | Self::CutOff)
    }
}

/// rustls with only the CA certificates of `path` as roots.
fn tls_config(path: &Path) -> anyhow::Result<rustls::ClientConfig> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("routes.ca_cert_path: cannot read certificates from {}", path.display()))?;
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        anyhow::bail!("routes.ca_cert_path: no usable CA certificate in {}", path.display());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
