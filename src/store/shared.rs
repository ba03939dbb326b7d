//! The store-independent half of a shared in-flight registry: [`Shared`] is the
//! `SharedRegistry` a shared store hands out. It does the admission
//! of a registered write (plan, check or register, settle), the background renewal and
//! revocation of registrations in use, their withdrawal when due, and what an announced
//! advance does here. A store (Redis, etcd) supplies only its calls ([`RegistryCalls`]) and a
//! listener that hands announced advances to [`Announcements::announced`].

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, mpsc};

use super::registrations::{Member, Plan, Registrations, Renewal, Withdrawal};
use crate::fence::millis;
use crate::fence::{
    BootInstant as Instant, FenceToken, InflightBounds, ResourceKey, SharedAdmit, SharedRegistry, StoreError,
    StoreEvent,
};
use crate::metrics;

/// Announcements not yet handled by the gate; beyond this, older ones are dropped (the store's
/// in-flight registry still orders commits; announcements only speed up cancellation).
const ANNOUNCEMENTS_QUEUED_MAX: usize = 4096;

/// How often idle registrations are looked at; an announced advance wakes the withdrawer at
/// once.
const WITHDRAW_TICK: Duration = Duration::from_millis(100);

/// How often registrations in use are looked at for renewal and revocation.
const RENEW_TICK: Duration = Duration::from_millis(50);

/// What an admission asks besides the token: the replica's floor, whether the write may raise
/// the fence, and how long the store keeps the registration (`InflightBounds::registration_ttl`).
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub floor: Option<FenceToken>,
    pub may_advance: bool,
    pub ttl_ms: u64,
}

/// A renewal's answer: whether the registration is still in the store, and the fence there.
#[derive(Debug)]
pub struct Renewed {
    pub still_there: bool,
    pub fence: Option<FenceToken>,
}

/// The calls a store makes for the shared registry.
#[async_trait]
pub trait RegistryCalls: Send + Sync + 'static {
    /// The admission of a write whose registration `member` is in place and fresh, writing
    /// nothing. `None`: the full admission ([`Self::register`]) has to decide.
    async fn check(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        member: Member,
    ) -> Result<Option<SharedAdmit>, StoreError>;

    /// The full admission, atomic in the store: withdraws `withdraw`, raises the store back to
    /// the floor if it fell below, checks `token` against the fence (raising it if allowed),
    /// and, if `member` is given and no older write is in flight, registers it for
    /// `ask.ttl_ms`.
    async fn register(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        ask: &Ask,
        member: Option<Member>,
        withdraw: &[Member],
    ) -> Result<SharedAdmit, StoreError>;

    /// Pushes a registration in use to a full `renewal.ttl` from when the call is received, if
    /// it is still there; also reads the fence.
    async fn renew(&self, renewal: &Renewal) -> Result<Renewed, StoreError>;

    /// Removes a registration from the store.
    async fn withdraw(&self, withdrawal: &Withdrawal) -> Result<(), StoreError>;
}

/// What a [`RegistryCalls::check`] read means: the store's `fence`, and whether the member
/// is still `registered`. `None` when only the full admission can tell (no fence, one below
/// this replica's `floor` to repair, a token that would advance it, a registration gone).
pub fn checked(
    fence: Option<FenceToken>,
    token: FenceToken,
    floor: Option<FenceToken>,
    registered: bool,
) -> Option<SharedAdmit> {
    let fence = fence?;
    if floor.is_some_and(|floor| fence < floor) {
        return None;
    }
    if token < fence {
        return Some(SharedAdmit::Stale { current: fence });
    }
    (fence == token && registered).then_some(SharedAdmit::Admitted { advanced: false, repaired_from: None })
}

/// This replica's registrations on a shared store, with the tasks that keep them.
pub struct Shared<C: RegistryCalls> {
    calls: Arc<C>,
    registrations: Arc<Registrations>,
    /// Wakes the withdrawer when a registration is due at once.
    withdraw_now: Arc<Notify>,
    events_tx: mpsc::Sender<StoreEvent>,
    events: Mutex<Option<mpsc::Receiver<StoreEvent>>>,
}

impl<C: RegistryCalls> Shared<C> {
    /// Starts the renewal and withdrawal tasks; they end when this is dropped.
    pub fn start(calls: Arc<C>) -> Self {
        let registrations = Arc::new(Registrations::default());
        let withdraw_now = Arc::new(Notify::new());
        let (events_tx, rx) = mpsc::channel(ANNOUNCEMENTS_QUEUED_MAX);
        tokio::spawn(renew_registrations(calls.clone(), Arc::downgrade(&registrations), events_tx.clone()));
        tokio::spawn(withdraw_registrations(calls.clone(), Arc::downgrade(&registrations), withdraw_now.clone()));
        Self { calls, registrations, withdraw_now, events_tx, events: Mutex::new(Some(rx)) }
    }

    /// Where a store's announcement listener hands what it hears.
    pub fn announcements(&self) -> Announcements {
        Announcements {
            registrations: Arc::downgrade(&self.registrations),
            withdraw_now: self.withdraw_now.clone(),
            events: self.events_tx.clone(),
        }
    }
}

#[async_trait]
impl<C: RegistryCalls> SharedRegistry for Shared<C> {
    async fn admit(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        register: bool,
        may_advance: bool,
        inflight_deadline_ms: u64,
    ) -> Result<SharedAdmit, StoreError> {
        let bounds = InflightBounds::new(Duration::from_millis(inflight_deadline_ms));
        let ask = Ask { floor, may_advance, ttl_ms: millis(bounds.registration_ttl()) };
        if !register {
            return self.calls.register(resource, token, &ask, None, &[]).await;
        }
        let plan = self.registrations.begin(resource, token, bounds, Instant::now());
        // Dropped before the answer (the store call failed or timed out, the client went
        // away): the call may have registered, so withdraw unless other writes use the
        // registration.
        let mut pending = PendingAdmission { shared: self, resource, plan: &plan, settled: false };
        let member = plan.member();
        let checked = match plan {
            Plan::Check { .. } => self.calls.check(resource, token, floor, member).await?,
            Plan::Register { .. } => None,
        };
        let (answer, registered_at) = match checked {
            Some(answer) => (answer, None),
            None => {
                let sent = Instant::now();
                let answer = self.calls.register(resource, token, &ask, Some(member), plan.withdraw()).await?;
                (answer, Some(sent))
            }
        };
        pending.settled = true;
        if matches!(answer, SharedAdmit::Admitted { .. }) {
            self.registrations.admitted(resource, member, registered_at);
        } else {
            self.registrations.refused(resource, &plan, false, Instant::now());
        }
        Ok(answer)
    }

    fn release(&self, resource: &ResourceKey, token: FenceToken) {
        if self.registrations.release(resource, token, Instant::now()) {
            self.withdraw_now.notify_one();
        }
    }

    fn still_registered(&self, resource: &ResourceKey, token: FenceToken) -> bool {
        self.registrations.still_registered(resource, token, Instant::now())
    }

    fn take_events(&self) -> Option<mpsc::Receiver<StoreEvent>> {
        self.events.lock().expect("events lock").take()
    }
}

/// An admission under way: unless settled, its drop tells `Registrations` the call failed.
struct PendingAdmission<'a, C: RegistryCalls> {
    shared: &'a Shared<C>,
    resource: &'a ResourceKey,
    plan: &'a Plan,
    settled: bool,
}

impl<C: RegistryCalls> Drop for PendingAdmission<'_, C> {
    fn drop(&mut self) {
        if !self.settled {
            self.shared.registrations.refused(self.resource, self.plan, true, Instant::now());
            self.shared.withdraw_now.notify_one();
        }
    }
}

/// The receiving end for a store's advance announcements.
#[derive(Clone)]
pub struct Announcements {
    registrations: Weak<Registrations>,
    withdraw_now: Arc<Notify>,
    events: mpsc::Sender<StoreEvent>,
}

impl Announcements {
    /// The fence of `resource` is now at least `fence`: this replica's registrations of older
    /// tokens go as soon as no write uses them, and the gate cuts off older writes still
    /// streaming. Returns `false` once nobody listens any more (the listener may stop).
    pub fn announced(&self, resource: ResourceKey, fence: FenceToken) -> bool {
        if let Some(registrations) = self.registrations.upgrade()
            && registrations.superseded(&resource, fence, Instant::now())
        {
            self.withdraw_now.notify_one();
        }
        // Dropped when the queue is full: announcements only speed up cancellation, renewals
        // find a moved fence too.
        !(self.events.try_send(StoreEvent::Advanced { resource, fence }).is_err() && self.events.is_closed())
    }

    /// Whether the gate still listens.
    pub fn is_closed(&self) -> bool {
        self.events.is_closed()
    }
}

/// Withdraws this replica's registrations when they are due (see `registrations`), several
/// at once, until the store is dropped. A failed withdrawal is tried again at the next tick
/// until the member's deadline, when the store drops it by itself.
async fn withdraw_registrations<C: RegistryCalls>(
    calls: Arc<C>,
    registrations: Weak<Registrations>,
    withdraw_now: Arc<Notify>,
) {
    let mut tick = tokio::time::interval(WITHDRAW_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let idle = tokio::select! {
            // In order, so that a simulation replays exactly.
            biased;
            () = withdraw_now.notified() => false,
            _ = tick.tick() => true,
        };
        let Some(due) = registrations.upgrade().map(|r| r.due(Instant::now(), idle)) else { return };
        if due.is_empty() {
            continue;
        }
        let calls = due.into_iter().map(|withdrawal| {
            let calls = &calls;
            async move {
                let result = calls.withdraw(&withdrawal).await;
                (withdrawal, result)
            }
        });
        let mut failed: Vec<Withdrawal> = Vec::new();
        for (withdrawal, result) in futures_util::future::join_all(calls).await {
            if let Err(error) = result {
                // Until it goes, newer writes on the resource wait.
                tracing::warn!(
                    %error,
                    resource = withdrawal.resource.as_str(),
                    "could not withdraw an in-flight registration yet"
                );
                failed.push(withdrawal);
            }
        }
        if !failed.is_empty()
            && let Some(registrations) = registrations.upgrade()
        {
            registrations.retry(failed, Instant::now());
        }
    }
}

/// Keeps this replica's registrations in use alive in the store, and stops the writes of any
/// it cannot keep (`docs/design.md`, section 6): every registration a write uses is renewed
/// well before its deadline; one that could not be renewed in time, or that the store lost, is
/// revoked (the gate cuts off its writes that have not sent their whole body) before another
/// replica can admit a newer token. A renewal also reads the fence, so a newer token is noticed
/// even if its announcement was lost.
async fn renew_registrations<C: RegistryCalls>(
    calls: Arc<C>,
    registrations: Weak<Registrations>,
    events: mpsc::Sender<StoreEvent>,
) {
    let mut tick = tokio::time::interval(RENEW_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(due) = registrations.upgrade().map(|r| r.renewals_due(Instant::now())) else { return };
        let renewals = due.into_iter().map(|renewal| {
            let calls = &calls;
            async move {
                let sent = Instant::now();
                let result = calls.renew(&renewal).await;
                (renewal, sent, result)
            }
        });
        let results = futures_util::future::join_all(renewals).await;
        let Some(regs) = registrations.upgrade() else { return };
        let mut revoked: Vec<(ResourceKey, FenceToken)> = Vec::new();
        let mut advanced: Vec<StoreEvent> = Vec::new();
        for (renewal, sent, result) in results {
            let (resource, member) = (&renewal.resource, renewal.member);
            match result {
                Ok(Renewed { still_there, fence }) => {
                    if still_there {
                        regs.renewed(resource, member, sent);
                    } else if regs.lost(&renewal) {
                        revoked.push((resource.clone(), member.token));
                    }
                    if let Some(fence) = fence
                        && fence > member.token
                    {
                        regs.superseded(resource, fence, Instant::now());
                        advanced.push(StoreEvent::Advanced { resource: resource.clone(), fence });
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, resource = resource.as_str(), "could not renew an in-flight registration");
                }
            }
        }
        revoked.extend(regs.expiring(Instant::now()));
        drop(regs);
        // Awaited, never dropped (unlike announcements): this is what makes cancellation
        // certain when an announcement was lost.
        for event in advanced {
            if events.send(event).await.is_err() {
                return;
            }
        }
        for (resource, token) in revoked {
            metrics::registration_revoked();
            // Awaited, never dropped: the writes must stop whatever the queue holds.
            if events.send(StoreEvent::Revoked { resource, token }).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A check admits only what the full admission would admit without writing: the token is
    /// the fence, the member is registered, and the store is not below this replica's mark.
    #[test]
    fn a_check_admits_only_a_registered_token_at_the_fence() {
        let t = FenceToken;
        let admitted = Some(SharedAdmit::Admitted { advanced: false, repaired_from: None });
        assert_eq!(checked(Some(t(5)), t(5), None, true), admitted);
        assert!(checked(Some(t(5)), t(5), None, false).is_none(), "a registration gone");
        assert!(checked(Some(t(5)), t(6), None, true).is_none(), "a token that would advance");
        assert!(checked(None, t(5), None, true).is_none(), "no fence");
        assert!(checked(Some(t(5)), t(5), Some(t(6)), true).is_none(), "a store below the mark");
        assert_eq!(checked(Some(t(5)), t(4), None, true), Some(SharedAdmit::Stale { current: t(5) }));
        assert!(checked(Some(t(5)), t(4), Some(t(6)), true).is_none(), "below the mark first: repaired");
    }
}
