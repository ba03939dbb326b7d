//! One admitted write, the same for every front: its permit, its deadline, its calls to the
//! upstream, and why it failed, if it did. A front admits a write at the gate, makes a
//! [`FencedWrite`] of the permit, sends each upstream call of the write through
//! [`FencedWrite::call`], asks [`FencedWrite::body_failure`] what became of a streamed body,
//! and renders a [`WriteFailure`] in its own protocol (S3's XML, the gateway's problem JSON).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::millis;
use super::outcome::{Bounded, Delivery, bounded_call};
use super::{CutOff, FenceToken, Gate, Permit, ResourceKey};
use crate::metrics;
use crate::net::body::{BodyFailure, BodyReport};

/// An admitted write: what its calls to the upstream are bounded by.
#[derive(Clone)]
pub struct FencedWrite {
    pub token: FenceToken,
    pub resource: ResourceKey,
    /// Held until the write's upstream outcome is known (`super::outcome`).
    pub permit: Arc<Permit>,
    /// The whole write's deadline: every upstream call of it ends by then.
    pub deadline: Instant,
    /// The length of that deadline, for the client's message.
    timeout: Duration,
    /// How long a call whose outcome is unknown keeps the write in flight (the in-flight
    /// deadline, D).
    hold: Duration,
}

/// Why an admitted write did not commit, or may have without fencegate knowing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteFailure {
    /// Cut off before its whole body was sent: a newer token, `current`, superseded it.
    Superseded { presented: FenceToken, current: FenceToken },
    /// Its deadline passed before its whole body was sent.
    Deadline { after_ms: u64 },
    /// Its registration in a shared store was lost before its whole body was sent.
    Revoked,
    /// Sent whole, and not answered within the deadline: it stays in flight for D.
    OutcomeUnknown { after_ms: u64 },
    /// The client's body failed (ended early, a wrong checksum, past the size limit).
    Body(BodyFailure),
}

impl FencedWrite {
    /// The write `permit` admitted, due within `timeout`; a call whose outcome is unknown
    /// keeps it in flight for `hold`.
    pub fn new(permit: Permit, resource: ResourceKey, timeout: Duration, hold: Duration) -> Self {
        Self {
            token: permit.token(),
            resource,
            permit: Arc::new(permit),
            deadline: Instant::now() + timeout,
            timeout,
            hold,
        }
    }

    /// One upstream call of the write, bounded by its deadline and never abandoned once its
    /// request may have reached the upstream (`super::outcome`). `body_in_hand`: the request's
    /// body is whole already (empty, or in memory), so the write counts as sent before the
    /// call starts (the HTTP client hands an empty body over with the head, without polling
    /// the body that would mark it); a streamed body marks it when its last chunk goes.
    /// `op` names the call in the upstream metrics.
    pub async fn call<B, E, F>(
        &self,
        gate: &Gate,
        op: &'static str,
        body_in_hand: bool,
        call: F,
    ) -> Result<Result<http::Response<B>, E>, WriteFailure>
    where
        F: Future<Output = Result<http::Response<B>, E>> + Send + 'static,
        B: Send + 'static,
        E: Delivery + std::fmt::Display + Send + 'static,
    {
        if body_in_hand && !self.permit.mark_body_sent() {
            return Err(self.cut_off(gate).await);
        }
        let started = std::time::Instant::now();
        match bounded_call(std::slice::from_ref(&self.permit), self.deadline, self.hold, call).await {
            Bounded::Done(result) => {
                let status = result.as_ref().ok().map(|r| r.status().as_u16());
                metrics::upstream_call(op, started.elapsed(), status);
                if let Some(status) = status {
                    tracing::Span::current().record("upstream_status", status);
                }
                Ok(result)
            }
            Bounded::CutOff => Err(self.cut_off(gate).await),
            Bounded::Unknown => {
                // No answer within the deadline: an upstream error and a latency sample, like a
                // call that failed (a cut-off is fencegate's own doing, not the upstream's).
                metrics::upstream_call(op, started.elapsed(), None);
                Err(WriteFailure::OutcomeUnknown { after_ms: millis(self.timeout) })
            }
        }
    }

    /// What became of a streamed body, once its call ended: `None` if it went whole (the
    /// call's own result stands).
    pub async fn body_failure(&self, gate: &Gate, report: &BodyReport) -> Option<WriteFailure> {
        match report.failure()? {
            BodyFailure::Cancelled => Some(self.cut_off(gate).await),
            other => Some(WriteFailure::Body(other)),
        }
    }

    /// Why the write was cut off before its whole body reached the upstream.
    pub async fn cut_off(&self, gate: &Gate) -> WriteFailure {
        match self.permit.cut_off() {
            Some(CutOff::Deadline) => WriteFailure::Deadline { after_ms: millis(self.timeout) },
            Some(CutOff::Revoked) => WriteFailure::Revoked,
            // Not cancelled, yet not sent: a further call past the write's deadline.
            None if Instant::now() >= self.deadline => WriteFailure::Deadline { after_ms: millis(self.timeout) },
            Some(CutOff::Superseded) | None => {
                let current = gate.fence(&self.resource).await.ok().flatten().unwrap_or(self.token);
                WriteFailure::Superseded { presented: self.token, current }
            }
        }
    }
}
