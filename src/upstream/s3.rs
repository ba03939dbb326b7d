//! The S3-compatible upstream: hyper's pooled client, each request re-signed with SigV4 for
//! the upstream's credentials. The body is streamed (`UNSIGNED-PAYLOAD`), never buffered.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use s3s::Body;

use super::{Upstream, UpstreamError};
use crate::config::{UpstreamConfig, ms};
use crate::sigv4::Signer;

/// Idle time before TCP keepalive probes on upstream connections.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

pub struct S3Upstream {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    /// `scheme://authority` of the endpoint, without a trailing slash.
    base: String,
    host: http::HeaderValue,
    signer: Signer,
}

impl S3Upstream {
    pub fn new(config: &UpstreamConfig) -> anyhow::Result<Self> {
        let endpoint: http::Uri = config.endpoint.as_deref().expect("validated: upstream.endpoint").parse()?;
        let authority = endpoint.authority().expect("validated: endpoint has an authority").clone();
        let scheme = endpoint.scheme_str().expect("validated: endpoint has a scheme");
        let base = format!("{scheme}://{authority}");

        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        // A write waits for the upstream's answer as long as its connection lives (its outcome
        // is unknown until then); keepalive probes find a dead peer.
        http.set_keepalive(Some(TCP_KEEPALIVE));
        http.set_connect_timeout(Some(ms(config.connect_timeout_ms)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client =
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(config.idle_connections_max).build(connector);

        let signer = Signer::new(
            config.access_key_id.clone().expect("validated: upstream.access_key_id"),
            config.secret_access_key.as_ref().expect("validated: upstream.secret_access_key").expose().to_owned(),
            config.region.clone(),
        );

        Ok(Self { client, base, host: http::HeaderValue::from_str(authority.as_str())?, signer })
    }
}

#[async_trait]
impl Upstream for S3Upstream {
    async fn send(&self, mut req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        let path_and_query = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        *req.uri_mut() =
            format!("{}{}", self.base, path_and_query).parse().map_err(|e| UpstreamError::Sign(Box::new(e)))?;
        req.headers_mut().insert(http::header::HOST, self.host.clone());
        self.signer.sign(&mut req, SystemTime::now()).map_err(|e| UpstreamError::Sign(Box::new(e)))?;
        let response = self.client.request(req).await.map_err(|e| {
            if e.is_connect() { UpstreamError::Connect(Box::new(e)) } else { UpstreamError::Transport(Box::new(e)) }
        })?;
        Ok(response.map(Body::from))
    }

    fn kind(&self) -> &'static str {
        "s3"
    }
}
