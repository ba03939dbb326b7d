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
    /// The endpoint's scheme and authority, which every request's URI takes.
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    host: http::HeaderValue,
    signer: Signer,
}

impl S3Upstream {
    /// A client with `pools` connection pools (one per serving thread).
    pub fn new(config: &UpstreamConfig, pools: usize) -> anyhow::Result<Self> {
        let endpoint: http::Uri = config.endpoint.as_deref().expect("validated: upstream.endpoint").parse()?;
        let authority = endpoint.authority().expect("validated: endpoint has an authority").clone();
        let scheme = endpoint.scheme().expect("validated: endpoint has a scheme").clone();

        let client = Outbound {
            ca_cert: None,
            connect_timeout: ms(config.connect_timeout_ms),
            idle_connections_max: config.idle_connections_max,
            http2: false,
            pools,
        }
        .build()?;

        let signer = Signer::new(
            config.access_key_id.clone().expect("validated: upstream.access_key_id"),
            config.secret_access_key.as_ref().expect("validated: upstream.secret_access_key").expose().to_owned(),
            config.region.clone(),
        );

        let host = http::HeaderValue::from_str(authority.as_str())?;
        Ok(Self { client, scheme, authority, host, signer })
    }
}

#[async_trait]
impl Upstream for S3Upstream {
    async fn send(&self, mut req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        // The request's own path and query under the endpoint's scheme and authority: the
        // parsed path moves over, nothing is formatted or parsed again.
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        *req.uri_mut() = http::Uri::from_parts(parts).map_err(|e| UpstreamError::Sign(Box::new(e)))?;
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
