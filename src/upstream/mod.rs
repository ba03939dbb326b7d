//! Where writes land: the upstream adapters, behind one HTTP-shaped interface so the S3 front
//! forwards the same way to both.
//!
//! A request given to [`Upstream::send`] is path-style (`/bucket/key?query`), carries only the
//! headers meant for the upstream, and no authentication: the adapter adds host and signature.

pub mod health;
mod local;
mod probe;
mod s3;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use async_trait::async_trait;
use s3s::Body;

pub use local::LocalUpstream;
pub(crate) use probe::xml_element;
pub use probe::{Enforcement, ProbeError, Probed, probe_preconditions};
pub use s3::S3Upstream;

use crate::config::{Config, UpstreamBackend};

/// Why the upstream gave no response. Who is at fault decides the status: the upstream (502,
/// 504) or fencegate's own configuration (500).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream did not answer within {after_ms} ms")]
    Timeout { after_ms: u64 },
    #[error("cannot connect to the upstream")]
    Connect(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("upstream connection failed")]
    Transport(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("cannot sign the upstream request")]
    Sign(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("local upstream failed")]
    Local(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl crate::fence::outcome::Delivery for UpstreamError {
    fn maybe_delivered(&self) -> bool {
        match self {
            Self::Timeout { .. } | Self::Transport(_) => true,
            // Never sent; the local upstream commits nothing once it answered.
            Self::Connect(_) | Self::Sign(_) | Self::Local(_) => false,
        }
    }
}

/// How an upstream reads an ETag in the `If-Match` of a write. S3 takes it quoted, as it
/// answers it (`"abc"`); Ceph RGW 16 compares a write's `If-Match` with the ETag bare
/// (`abc`) and refuses the quoted form. fencegate keeps ETags as the upstream answers them and
/// the adapter renders them in this form when it sends a write (the probe finds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EtagForm {
    #[default]
    Quoted,
    Bare,
}

impl EtagForm {
    /// Every entity tag of an `If-Match` list in this form: `"a", "b"` bare is `a, b`. `*`
    /// and weak tags (`W/"a"`, which a write's strong comparison never matches) are kept.
    pub fn render(self, list: &str) -> String {
        match self {
            Self::Quoted => list.to_owned(),
            Self::Bare => list
                .split(',')
                .map(|item| {
                    let item = item.trim();
                    match item.strip_prefix('"').and_then(|rest| rest.strip_suffix('"')) {
                        Some(bare) if !bare.is_empty() => bare,
                        _ => item,
                    }
                })
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// An upstream: where writes land. Adapters do not time calls out: the caller bounds each one
/// (a read by `upstream.request_timeout_ms`, a write by its own deadline, see
/// `fence::outcome`), since abandoning a write whose request was sent would end it early.
#[async_trait]
pub trait Upstream: Send + Sync + 'static {
    async fn send(&self, req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError>;

    /// A short name for logs and metrics.
    fn kind(&self) -> &'static str;

    /// What the upstream is known to judge without a probe. A remote store is trusted with
    /// nothing until the start-up probe says.
    fn enforcement_without_probe(&self) -> Enforcement {
        Enforcement::NONE
    }

    /// Sends every later write's `If-Match` in `form` (the start-up probe's finding). An
    /// upstream that reads every form alike ignores it.
    fn use_etag_form(&self, _form: EtagForm) {}

    /// The form a write's `If-Match` is sent in.
    fn etag_form(&self) -> EtagForm {
        EtagForm::Quoted
    }
}

/// Builds the upstream named by the config.
pub fn from_config(config: &Config) -> anyhow::Result<Arc<dyn Upstream>> {
    Ok(match config.upstream.backend().map_err(crate::config::at_fault)? {
        UpstreamBackend::Local { path } => Arc::new(LocalUpstream::open(path)?),
        UpstreamBackend::S3(endpoint) => {
            Arc::new(S3Upstream::new(&config.upstream, endpoint, config.server.serving_threads())?)
        }
    })
}
