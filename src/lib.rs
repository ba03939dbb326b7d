//! fencegate: a fenced write proxy. Writes carry a fencing token; fencegate rejects any write
//! whose token is older than the newest one seen for its resource, atomically with the commit.
//!
//! The layout:
//! - [`fence`]: the core. Tokens and resources, the pure [`fence::decide`], the store traits
//!   ([`fence::FenceStore`], [`fence::LeaseStore`], [`fence::IdempotencyStore`]), every store
//!   call timed once ([`fence::TimedStore`]), and the [`fence::Gate`] that orders writes.
//! - [`store`]: the fence stores (`embedded`: redb).
//! - [`s3`]: the S3 front end (s3s for SigV4 and aws-chunked). `s3/mod.rs` is a request's flow
//!   from authorisation to answer; `s3/ops/` holds each fenced operation as a command over a
//!   narrow context; `s3/hop.rs` is the bounded call to the upstream.
//! - [`gateway`]: the HTTP API front end: `[[routes]]` to third-party APIs behind the same gate
//!   (idempotency keys and records, conditional requests).
//! - [`upstream`]: where writes land (`local` directory, `s3` endpoint) and the start-up probe.
//! - [`lease`]: the lease service; a grant fences its resource in the same store step.
//! - [`admin`]: the admin listener (health, metrics, fences).
//! - [`jobs`]: what an operator's reconciliation is asked and tells; [`upkeep`] runs it, and
//!   sweeps the upload records, over a narrow context of its own.
//! - [`net`]: HTTP plumbing with nothing of fencing in it: accept loops, connection limits and
//!   graceful shutdown, the serving threads (one runtime and one upstream pool each), the one
//!   outbound HTTP client, the forwarded write's body (streamed, cut off when a newer token
//!   cancels the write, kept for one retry when small), problem documents, percent-decoding.
//! - [`aws`]: S3 header names and SigV4 (signing forwarded requests, the lean check of
//!   received ones).
//! - [`config`]: the one configuration struct, validated at start-up.
//! - [`metrics`]: every exported metric; [`logs`]: repeated log lines limited and counted.
//! - [`refusal`]: the fencing protocol's refusals, one type for both fronts, and the token
//!   header read once.
//! - [`feed`]: every write decision recorded once (span, counter, the operator's live feed).
//! - [`sim`]: the deterministic simulator (`--features simulation`), and the seeded bugs it
//!   proves itself on (off, and compiled out, in every other build).
//!
//! The design, with the commit protocol and every crash point, is in `docs/design.md`.

pub mod admin;
pub mod aws;
pub mod config;
pub mod feed;
pub mod fence;
pub mod gateway;
pub mod jobs;
pub mod lease;
pub mod logs;
pub mod metrics;
pub mod net;
pub mod refusal;
pub mod s3;
pub mod sim;
pub mod store;
pub mod upkeep;
pub mod upstream;

mod app;

pub use app::{App, Bound, accept_restored_store, init_store, probe_failure, reconcile};

/// The size of the future `f` returns, found without calling it: for tests of what a future
/// carries in every request or connection.
#[cfg(test)]
pub(crate) fn future_size<A, B, F: std::future::Future>(_f: impl Fn(A, B) -> F) -> usize {
    std::mem::size_of::<F>()
}
