//! The S3-compatible upstream: HTTP/1.1 connections pooled per serving thread (`outbound.rs`),
//! each request re-signed with SigV4 for the upstream's credentials. The body is streamed
//! (`UNSIGNED-PAYLOAD`), never buffered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use async_trait::async_trait;
use s3s::Body;

use super::{EtagForm, Upstream, UpstreamError};
use crate::aws::sigv4::Signer;
use crate::config::{S3Endpoint, UpstreamConfig, ms};
use crate::net::outbound::{Http1Pools, Outbound, SendError};

pub struct S3Upstream {
    client: Http1Pools,
    host: http::HeaderValue,
    signer: Signer,
    /// Whether a write's `If-Match` goes with bare ETags ([`EtagForm::Bare`]).
    bare_etags: AtomicBool,
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
        Ok(Self { client, host, signer, bare_etags: AtomicBool::new(false) })
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
        if self.bare_etags.load(Ordering::Relaxed) && is_write(req.method()) {
            render_if_match(req.headers_mut(), EtagForm::Bare);
        }
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

    fn use_etag_form(&self, form: EtagForm) {
        self.bare_etags.store(form == EtagForm::Bare, Ordering::Relaxed);
    }

    fn etag_form(&self) -> EtagForm {
        if self.bare_etags.load(Ordering::Relaxed) { EtagForm::Bare } else { EtagForm::Quoted }
    }
}

/// Reads judge `If-Match` in either form at every upstream known; only writes are rendered.
fn is_write(method: &http::Method) -> bool {
    matches!(*method, http::Method::PUT | http::Method::POST | http::Method::DELETE)
}

fn render_if_match(headers: &mut http::HeaderMap, form: EtagForm) {
    let Some(rendered) = headers
        .get(http::header::IF_MATCH)
        .and_then(|value| value.to_str().ok())
        .and_then(|list| http::HeaderValue::from_str(&form.render(list)).ok())
    else {
        return;
    };
    headers.insert(http::header::IF_MATCH, rendered);
}
