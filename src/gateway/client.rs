//! The HTTP client to third-party APIs (`outbound.rs`: certificates verified against the web
//! PKI roots, or a route's own CA), with the outcome of a failed call classified
//! as "never sent" or "unknown".

use std::path::Path;
use std::time::Duration;

use hyper::body::Incoming;
use s3s::Body;

use crate::net::outbound::{Outbound, PooledClient};

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
}

pub struct ApiClient {
    client: PooledClient,
}

impl ApiClient {
    /// A client verifying `https` upstreams against `ca_cert_path` if given, else the web PKI
    /// roots, with `pools` connection pools (one per serving thread).
    pub fn new(
        ca_cert_path: Option<&Path>,
        connect_timeout: Duration,
        idle_connections_max: usize,
        pools: usize,
    ) -> anyhow::Result<Self> {
        let ca_cert = ca_cert_path.map(|path| ("routes.ca_cert_path", path));
        let client = Outbound { ca_cert, connect_timeout, idle_connections_max, http2: true, pools }.build()?;
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
        !matches!(self, Self::NotSent(_))
    }
}
