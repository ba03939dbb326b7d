//! The S3-compatible upstream: HTTP/1.1 connections pooled per serving thread (`outbound.rs`),
//! each request re-signed with SigV4 for the upstream's credentials. The body is streamed
//! (`UNSIGNED-PAYLOAD`), never buffered.

use std::time::SystemTime;

use async_trait::async_trait;
use s3s::Body;

use super::{Upstream, UpstreamError};
use crate::aws::sigv4::Signer;
use crate::config::{S3Endpoint, UpstreamConfig, ms};
use crate::net::outbound::{Http1Pools, Outbound, SendError};

pub struct S3Upstream {
    client: Http1Pools,
    host: http::HeaderValue,
    signer: Signer,
}

impl S3Upstream {
    /// A client with `pools` connection pools (one per serving thread).
    pub fn new(config: &UpstreamConfig, endpoint: S3Endpoint<'_>, pools: usize) -> anyhow::Result<Self> {
        let S3Endpoint { scheme, authority, access_key_id, secret_access_key } = endpoint;
        let client = Outbound {
            ca_cert: None,
            connect_timeout: ms(config.connect_timeout_ms),
            idle_connections_max: config.idle_connections_max,
            http2: false,
            pools,
        }
        .build_http1(http::Uri::builder().scheme(scheme).authority(authority.clone()).path_and_query("/").build()?)?;

        let signer =
            Signer::new(access_key_id.to_owned(), secret_access_key.expose().to_owned(), config.region.clone());

        let host = http::HeaderValue::from_str(authority.as_str())?;
        Ok(Self { client, host, signer })
    }
}

#[async_trait]
impl Upstream for S3Upstream {
    async fn send(&self, mut req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        // In origin form: the request's own path and query, sent to the endpoint's host.
        if req.uri().path_and_query().is_none() || req.uri().authority().is_some() {
            let path = req.uri().path_and_query().cloned().unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
            *req.uri_mut() = http::Uri::from(path);
        }
        req.headers_mut().insert(http::header::HOST, self.host.clone());
        self.signer.sign(&mut req, SystemTime::now()).map_err(|e| UpstreamError::Sign(Box::new(e)))?;
        let response = self.client.send(req).await.map_err(|e| match e {
            SendError::Connect(e) => UpstreamError::Connect(e),
            SendError::Transport(e) => UpstreamError::Transport(Box::new(e)),
        })?;
        Ok(response.map(Body::from))
    }

    fn kind(&self) -> &'static str {
        "s3"
    }
}
