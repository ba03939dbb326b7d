//! An admitted write's hold on its resource: what the front asks of it while the write is
//! under way (its cancellation, whether its body was sent, why it was cut off), and what
//! dropping it releases.

use super::*;

/// An admitted write. Keep it until the upstream outcome is known; dropping it lets newer
/// tokens on the resource proceed.
pub struct Permit {
    pub(super) slot: Arc<Slot>,
    pub(super) id: u64,
    pub(super) token: FenceToken,
    pub(super) cancel: CancellationToken,
    pub(super) body_sent: Arc<AtomicBool>,
    pub(super) cut_off: Arc<AtomicU8>,
    /// The registration in a shared store's in-flight registry, withdrawn on drop.
    pub(super) remote: Option<RemoteTicket>,
    /// Whether this write's admission raised the fence to its token.
    pub(super) advanced: bool,
}

/// A write registered in a shared store; dropping it ends the registration's use.
pub(super) struct RemoteTicket {
    pub(super) store: TimedStore,
    pub(super) resource: ResourceKey,
    pub(super) token: FenceToken,
}

impl RemoteTicket {
    pub(super) fn still_registered(&self) -> bool {
        self.store.shared().is_none_or(|shared| shared.still_registered(&self.resource, self.token))
    }
}

impl Drop for RemoteTicket {
    fn drop(&mut self) {
        if let Some(shared) = self.store.shared() {
            shared.release(&self.resource, self.token);
        }
    }
}

/// A forwarded body is handed over only while its write may still go (`mark_body_sent`).
impl crate::net::body::Handover for Permit {
    fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    fn hand_over(&self) -> bool {
        self.mark_body_sent()
    }
}

impl Permit {
    pub fn token(&self) -> FenceToken {
        self.token
    }

    /// Whether this write's admission raised the fence to its token (made the advance durable).
    pub fn advanced(&self) -> bool {
        self.advanced
    }

    /// Fires when a newer token needs this write gone before its body reached the upstream.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Records that the whole body was handed to the upstream: the write is no longer
    /// cancellable. Returns `false` if it was cancelled first (then the body must not finish).
    /// A request whose body is in memory is marked before it is sent.
    pub fn mark_body_sent(&self) -> bool {
        let registered = self.remote.as_ref().is_none_or(RemoteTicket::still_registered);
        let _state = self.slot.state(); // ordered against cancel_unsent_older
        if !registered && !self.cancel.is_cancelled() {
            // A replica that stalled past its registration's safe age hands nothing over,
            // even before its renewer had the chance to revoke it.
            self.cut_off.store(CutOff::Revoked as u8, Ordering::Release);
            self.cancel.cancel();
            metrics::inflight_cancelled();
        }
        if self.cancel.is_cancelled() {
            return false;
        }
        self.body_sent.store(true, Ordering::Release);
        true
    }

    /// Whether the whole body was handed to the upstream: from then on the upstream may
    /// commit the write whatever fencegate does.
    pub fn body_sent(&self) -> bool {
        self.body_sent.load(Ordering::Acquire)
    }

    /// The write's own deadline passed: cancel it if its body has not fully been handed to
    /// the upstream. Returns `true` if the write is cut off (the upstream never gets a
    /// complete body), `false` if the body was already sent and the outcome is unknown.
    pub fn cut_off_if_unsent(&self) -> bool {
        let _state = self.slot.state(); // ordered against mark_body_sent
        if self.body_sent.load(Ordering::Acquire) {
            return false;
        }
        if !self.cancel.is_cancelled() {
            self.cut_off.store(CutOff::Deadline as u8, Ordering::Release);
            self.cancel.cancel();
            metrics::inflight_cancelled();
        }
        true
    }

    /// Why the write was cut off, if it was.
    pub fn cut_off(&self) -> Option<CutOff> {
        CutOff::from_u8(self.cut_off.load(Ordering::Acquire))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        {
            let mut state = self.slot.state();
            state.inflight.retain(|w| w.id != self.id);
        }
        metrics::inflight_changed(-1);
        self.slot.changed.notify_waiters();
    }
}
