//! The S3-compatible upstream: the pooled client of `outbound.rs`, each request re-signed with SigV4 for
//! the upstream's credentials. The body is streamed (`UNSIGNED-PAYLOAD`), never buffered.

use std::time::SystemTime;

use async_trait::async_trait;
use s3s::Body;

use super::{Upstream, UpstreamError};
use crate::config::{UpstreamConfig, ms};
use crate::outbound::{Outbound, PooledClient};
use crate::sigv4::Signer;

pub struct S3Upstream {
    client: PooledClient,
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

        let client = Outbound {
            ca_cert: None,
            connect_timeout: ms(config.connect_timeout_ms),
            idle_connections_max: config.idle_connections_max,
            http2: false,
        }
        .build()?;

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
