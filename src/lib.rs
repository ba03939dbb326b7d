//! fencegate: a fenced write proxy. Writes carry a fencing token; fencegate rejects any write
//! whose token is older than the newest one seen for its resource, atomically with the commit.
//!
//! The layout:
//! - [`fence`]: the core. Tokens and resources, the pure [`fence::decide`], the store traits
//!   ([`fence::FenceStore`], [`fence::LeaseStore`], [`fence::IdempotencyStore`]), every store
//!   call timed once ([`fence::TimedStore`]), and the [`fence::Gate`] that orders writes.
//! - [`store`]: the fence stores (`embedded`: redb).
//! - [`s3`]: the S3 front end (s3s for SigV4 and aws-chunked; fencing and forwarding here).
//! - [`gateway`]: the HTTP API front end: `[[routes]]` to third-party APIs behind the same gate
//!   (idempotency keys and records, conditional requests).
//! - [`upstream`]: where writes land (`local` directory, `s3` endpoint) and the start-up probe.
//! - [`lease`]: the lease service; a grant fences its resource in the same store step.
//! - [`admin`]: the admin listener (health, metrics, fences).
//! - [`server`]: accept loops, connection limits, graceful shutdown.
//! - [`threads`]: the serving threads, one runtime and one upstream pool each, that the main
//!   listener's connections run on.
//! - [`sigv4`]: SigV4 signing of forwarded requests and the lean check of received ones.
//! - [`config`]: the one configuration struct, validated at start-up.
//! - [`metrics`]: every exported metric.
//! - [`outbound`]: the one HTTP client builder (the S3 upstream, the gateway's APIs).
//! - [`percent`]: percent-decoding of paths.
//! - [`amz`]: the S3 header names looked up on the request path, as constants.
//! - [`problem`]: the RFC 9457 problem documents of fencegate's own endpoints.
//! - [`body`]: the forwarded write's body, for both fronts: streamed, cut off when a newer
//!   token cancels the write, kept for one retry when small.
//! - [`refusal`]: the fencing protocol's refusals, one type for both fronts, and the token
//!   header read once.
//!
//! The design, with the commit protocol and every crash point, is in `docs/design.md`.

pub mod admin;
pub mod amz;
pub mod body;
pub mod config;
pub mod fence;
pub mod gateway;
pub mod lease;
pub mod metrics;
pub mod outbound;
pub mod percent;
pub mod problem;
pub mod refusal;
pub mod s3;
pub mod server;
pub mod sigv4;
pub mod store;
pub mod threads;
pub mod upstream;

mod app;

pub use app::{App, Bound, init_store};

/// The size of the future `f` returns, found without calling it: for tests of what a future
/// carries in every request or connection.
#[cfg(test)]
pub(crate) fn future_size<A, B, F: std::future::Future>(_f: impl Fn(A, B) -> F) -> usize {
    std::mem::size_of::<F>()
}
