//! The gate: orders writes per resource so that no write with an older token commits after a
//! write with a newer one was forwarded (G2, G3). See `docs/design.md`, section 3.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::millis;
use super::{
    AdvanceOutcome, Decision, FenceToken, IdempotencyRecords, LeaseCommand, LeaseOutcome, LeaseRecord, Listings,
    RecordLimits, ResourceKey, SharedAdmit, SharedRegistry, Store, StoreError, StoreEvent, TimedStore, UploadRecords,
    decide, stale_below,
};
use crate::metrics;

mod leases;
mod permit;
mod shared;

pub use permit::Permit;
use permit::RemoteTicket;

/// Who holds a write in flight, for [`GateLimits::inflight_per_caller_max`]: a keyed hash of
/// a credential's access key or a route caller's identity (the key drawn per process, so that
/// nobody can choose a name that shares another's budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerId(u64);

impl CallerId {
    pub fn of(name: &str) -> Self {
        use std::hash::BuildHasher;
        static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
        Self(KEYS.get_or_init(std::collections::hash_map::RandomState::new).hash_one(name))
    }
}

/// The gate's named limits.
#[derive(Debug, Clone)]
pub struct GateLimits {
    /// How long a write may wait for older in-flight writes (or an advance) on its resource.
    pub inflight_deadline: Duration,
    /// How long one fence store call may take before its outcome counts as unknown.
    pub store_timeout: Duration,
    /// Admitted, unfinished writes per resource; one more is refused with 503.
    pub inflight_per_resource_max: usize,
    /// Of those, what one caller (a credential, a route's caller) may hold: one tenant cannot
    /// fill the resource's budget for the others.
    pub inflight_per_caller_max: usize,
    /// Resources whose fence is kept in memory; idle ones beyond this are forgotten (and
    /// reloaded from the store when used again).
    pub cached_resources_max: usize,
    /// The bounds on the upload records kept for callers (`store.upload_records_*`).
    pub upload_records: RecordLimits,
}

impl Default for GateLimits {
    fn default() -> Self {
        Self {
            inflight_deadline: Duration::from_millis(30_000),
            store_timeout: Duration::from_millis(2_000),
            inflight_per_resource_max: 1024,
            inflight_per_caller_max: 512,
            cached_resources_max: 100_000,
            upload_records: RecordLimits::default(),
        }
    }
}

/// Why a write (or a registration) was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("token {presented} is older than the fence {current}")]
    Stale { presented: FenceToken, current: FenceToken },
    #[error("fence state unknown")]
    StoreUnavailable(#[from] StoreError),
    #[error("older writes on the resource were still in flight after {waited_ms} ms")]
    DrainTimeout { waited_ms: u64 },
    #[error("{max} writes are already in flight on the resource")]
    TooManyInflight { max: usize },
    #[error("this caller already has {max} writes in flight on the resource")]
    TooManyInflightForCaller { max: usize },
    #[error("token {presented} is above the fence {current:?}, and only registrations and lease grants may raise it")]
    Unregistered { presented: FenceToken, current: Option<FenceToken> },
}

/// Orders writes per resource against a fence store ([`Store`]).
pub struct Gate {
    store: TimedStore,
    limits: GateLimits,
    slots: Mutex<HashMap<ResourceKey, Arc<Slot>>>,
    next_write_id: AtomicU64,
    /// No write admitted before this instant: set after an unclean start, while writes the
    /// previous process sent may still commit at the upstream.
    writes_from: Mutex<Option<Instant>>,
    /// Set at shutdown: no more admissions, so that "no write in flight" stays true.
    closed: AtomicBool,
    /// Grants being withdrawn in the background ([`Gate::withdraw_grant`]), at most
    /// [`leases::WITHDRAWALS_MAX`]: a store outage with many grants asked does not grow tasks without
    /// end.
    withdrawals: Arc<AtomicUsize>,
}

/// The in-memory state of one resource in use.
struct Slot {
    state: Mutex<SlotState>,
    /// Serialises store I/O (first load, advances) for this resource, so that at most one
    /// advance is in progress and waiters re-check the fence after it.
    io: tokio::sync::Mutex<()>,
    /// Woken when the fence changes or an in-flight write finishes.
    changed: Notify,
}

#[derive(Default)]
struct SlotState {
    /// `None` until loaded from the store.
    fence: Option<Option<FenceToken>>,
    inflight: Vec<Inflight>,
    /// Admissions of a newer token waiting for older writes in flight to finish.
    waiting: usize,
    /// When this replica last asked a shared store to come back up to its mark without an
    /// admission (a refusal from the mark, an announcement below it): at most once per
    /// [`REPAIR_EVERY`].
    repair_asked: Option<Instant>,
}

/// How often one resource's store is asked to come back up to a replica's mark outside an
/// admission.
const REPAIR_EVERY: Duration = Duration::from_secs(1);

struct Inflight {
    id: u64,
    token: FenceToken,
    /// When it was admitted, for the operator's view of writes in flight.
    since: Instant,
    caller: Option<CallerId>,
    cancel: CancellationToken,
    /// Set once the whole body was handed to the upstream: from then on the write can only be
    /// awaited, never cancelled.
    body_sent: Arc<AtomicBool>,
    /// Why the write was cut off, once it is ([`CutOff`] as a number, 0 for none).
    cut_off: Arc<AtomicU8>,
}

/// What a registration did ([`Gate::register`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// The fence is now this token (200).
    Raised(FenceToken),
    /// The fence already stood at this, above the token registered (409).
    Below(FenceToken),
}

/// One resource's writes in flight on this replica ([`Gate::inflight`]).
#[derive(Debug, Clone)]
pub struct InflightView {
    pub resource: ResourceKey,
    /// The tokens of its writes in flight, in admission order.
    pub tokens: Vec<FenceToken>,
    /// How long the oldest of them has been in flight.
    pub oldest: Duration,
    /// Whether an admission of a newer token waits for them.
    pub newer_waiting: bool,
}

/// Counts an admission waiting for older writes while it lives.
struct Waiting<'a>(&'a Slot);

impl<'a> Waiting<'a> {
    fn on(slot: &'a Slot) -> Self {
        slot.state().waiting += 1;
        Self(slot)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().waiting -= 1;
    }
}

/// Why an admitted write was cut off before its whole body reached the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutOff {
    /// A newer token was admitted, registered or announced on the resource.
    Superseded = 1,
    /// The write's own deadline passed.
    Deadline = 2,
    /// Its registration in a shared store was lost or could not be renewed in time.
    Revoked = 3,
}

impl CutOff {
    fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::Superseded),
            2 => Some(Self::Deadline),
            3 => Some(Self::Revoked),
            _ => None,
        }
    }
}

/// What the admit loop does next, decided under the slot's lock.
enum Step {
    Load,
    Advance,
    WaitForOlder,
}

impl SlotState {
    fn has_older(&self, token: FenceToken) -> bool {
        self.inflight.iter().any(|w| w.token < token)
    }

    /// Cancels older writes whose body has not fully reached the upstream.
    fn cancel_unsent_older(&self, token: FenceToken) {
        self.cancel_unsent(CutOff::Superseded, |t| t < token);
    }

    /// Cancels the writes with a token that `which` selects and whose body has not fully
    /// reached the upstream; they also send nothing more.
    fn cancel_unsent(&self, why: CutOff, which: impl Fn(FenceToken) -> bool) {
        for w in self.inflight.iter().filter(|w| which(w.token)) {
            if !w.body_sent.load(Ordering::Acquire) && !w.cancel.is_cancelled() {
                w.cut_off.store(why as u8, Ordering::Release);
                w.cancel.cancel();
                metrics::inflight_cancelled();
            }
        }
    }
}

impl Gate {
    pub fn new(store: Arc<dyn Store>, limits: GateLimits) -> Self {
        Self {
            store: TimedStore::new(store, limits.store_timeout),
            limits,
            slots: Mutex::new(HashMap::new()),
            next_write_id: AtomicU64::new(1),
            writes_from: Mutex::new(None),
            closed: AtomicBool::new(false),
            withdrawals: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// After an unclean start, admits no write, registration or lease grant for `hold` (what
    /// is left of the in-flight deadline): writes an earlier process had sent may still commit
    /// at the upstream until then (`docs/design.md`, section 8). Current tokens wait too: the
    /// dead process may have made a newer token durable while older writes of it were still in
    /// flight.
    pub fn hold_writes_for(&self, hold: std::time::Duration) {
        let until = Instant::now() + hold;
        *self.writes_from.lock().expect("gate lock poisoned") = Some(until);
    }

    /// How long advances are still held after an unclean start, if they are.
    pub fn hold_remaining(&self) -> Option<std::time::Duration> {
        let from = (*self.writes_from.lock().expect("gate lock poisoned"))?;
        let left = from.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// Waits until advances are allowed, or fails at `deadline`.
    async fn wait_after_unclean_start(&self, started: Instant, deadline: Instant) -> Result<(), AdmitError> {
        let Some(from) = *self.writes_from.lock().expect("gate lock poisoned") else { return Ok(()) };
        if from <= Instant::now() {
            return Ok(());
        }
        if from > deadline {
            tokio::time::sleep_until(deadline).await;
            return Err(AdmitError::DrainTimeout { waited_ms: millis(started.elapsed()) });
        }
        tokio::time::sleep_until(from).await;
        Ok(())
    }

    /// Stops admitting (at shutdown): every later admission fails as if the store were gone.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Writes admitted and not yet known to be finished, on every resource.
    pub fn inflight_writes(&self) -> usize {
        let slots: Vec<Arc<Slot>> = self.slots.lock().expect("gate map lock poisoned").values().cloned().collect();
        slots.iter().map(|slot| slot.state().inflight.len()).sum()
    }

    /// This replica's writes in flight, per resource (at most `max` resources): for the
    /// operator (`/v1/inflight`), never on a write's path.
    pub fn inflight(&self, max: usize) -> Vec<InflightView> {
        let slots: Vec<(ResourceKey, Arc<Slot>)> = {
            let map = self.slots.lock().expect("gate map lock poisoned");
            map.iter().map(|(r, slot)| (r.clone(), slot.clone())).collect()
        };
        let now = Instant::now();
        let mut views = Vec::new();
        for (resource, slot) in slots {
            let state = slot.state();
            if state.inflight.is_empty() && state.waiting == 0 {
                continue;
            }
            views.push(InflightView {
                resource,
                tokens: state.inflight.iter().map(|w| w.token).collect(),
                oldest: state.inflight.iter().map(|w| now - w.since).max().unwrap_or_default(),
                newer_waiting: state.waiting > 0,
            });
        }
        // The oldest first, and those kept: they are the ones an operator looks for.
        views.sort_by_key(|view| std::cmp::Reverse(view.oldest));
        views.truncate(max);
        views
    }

    /// The store's listings, for the operator.
    pub fn listings(&self) -> Listings {
        self.store.listings()
    }

    /// The kind of the fence store (`embedded`, `redis`, `etcd`).
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// Whether the fence store is shared by several replicas.
    pub fn is_shared(&self) -> bool {
        self.store.shared().is_some()
    }

    /// Whether the fence store answers (for `/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }

    /// The API gateway's idempotency records, in the same store.
    pub fn idempotency_records(&self) -> IdempotencyRecords {
        IdempotencyRecords::new(self.store.clone())
    }

    /// The multipart uploads made with a token, in the same store.
    pub fn upload_records(&self) -> UploadRecords {
        UploadRecords::new(self.store.clone(), self.limits.upload_records)
    }

    /// Admits a write with `token` on `resource`: advances the fence durably if `token` is
    /// newer, resolves older in-flight writes, and registers the write. The returned permit
    /// must live until the upstream outcome of the write is known.
    pub async fn admit(&self, resource: &ResourceKey, token: FenceToken) -> Result<Permit, AdmitError> {
        self.admit_write(resource, token, true, None).await
    }

    /// [`Self::admit`], where `may_advance` says whether this write may raise the fence
    /// (`fencing.advance`): if not, a token above the fence is refused with
    /// [`AdmitError::Unregistered`] and nothing changes.
    pub async fn admit_write(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        may_advance: bool,
        caller: Option<CallerId>,
    ) -> Result<Permit, AdmitError> {
        let slot = self.slot(resource);
        match self.settle(&slot, resource, token, Some(caller), may_advance).await? {
            Some(permit) => Ok(permit),
            None => Err(AdmitError::StoreUnavailable(StoreError::Closed)), // settle registers when asked to
        }
    }

    /// Refuses `token` at once if it is below the fence this replica already knows for
    /// `resource`, without waiting or asking the store: fences only go up, so such a token
    /// stays stale (the refusal `admit_write` would give). `Ok` decides nothing: admission
    /// still checks. On a shared store the refusal is `settle_shared`'s own, store repair
    /// included.
    pub fn refuse_known_stale(&self, resource: &ResourceKey, token: FenceToken) -> Result<(), AdmitError> {
        self.refuse_below_mark(&self.slot(resource), resource, token)
    }

    /// The refusal of a token below the slot's fence (this replica's high-water mark); on a
    /// shared store the store may have rolled back below it (and other replicas would accept
    /// the token), so it is raised back.
    fn refuse_below_mark(&self, slot: &Arc<Slot>, resource: &ResourceKey, token: FenceToken) -> Result<(), AdmitError> {
        let mark = slot.state().fence.flatten(); // the guard must not outlive this line
        match stale_below(mark, token) {
            Some(current) => {
                self.repair_in_background(slot, resource, current);
                Err(AdmitError::Stale { presented: token, current })
            }
            _ => Ok(()),
        }
    }

    /// Registers `token` as the fence of `resource` without writing (G7): from the moment this
    /// returns, every older token is rejected and no older write is in flight. Returns the
    /// fence, which is `token`.
    pub async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<FenceToken, AdmitError> {
        let slot = self.slot(resource);
        self.settle(&slot, resource, token, None, true).await?;
        Ok(token)
    }

    /// A registration (G7), as both the admin listener and the lease endpoints take it
    /// (`PUT .../fences/{resource}`): the fence raised to `token`, or, when it already stands
    /// above, where it stands. Each front renders the errors its own way.
    pub async fn register(&self, resource: &ResourceKey, token: FenceToken) -> Result<Registered, AdmitError> {
        match self.advance(resource, token).await {
            Ok(token) => {
                tracing::info!(resource = resource.as_str(), token = token.0, "fence registered");
                Ok(Registered::Raised(token))
            }
            Err(AdmitError::Stale { current, .. }) => Ok(Registered::Below(current)),
            Err(error) => Err(error),
        }
    }

    /// The fence of `resource` as the store has it.
    pub async fn fence(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        let slot = self.slot(resource);
        if self.store.shared().is_some() {
            let stored = self.store.load(resource).await?;
            let floor = slot.state().fence.flatten();
            return Ok(stored.max(floor));
        }
        if let Some(fence) = slot.state().fence {
            return Ok(fence);
        }
        self.load(&slot, resource).await?;
        Ok(slot.state().fence.flatten())
    }

    /// The lease stored on `resource` (live or expired), as the store has it now.
    pub async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        self.store.lease_record(resource).await
    }

    /// Loops until `token` is the fence and no older write is in flight, then (if `register`,
    /// for its caller) registers the write in the same critical section as that last check.
    async fn settle(
        &self,
        slot: &Arc<Slot>,
        resource: &ResourceKey,
        token: FenceToken,
        register: Option<Option<CallerId>>,
        may_advance: bool,
    ) -> Result<Option<Permit>, AdmitError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(AdmitError::StoreUnavailable(StoreError::Closed));
        }
        if let Some(shared) = self.store.shared() {
            return self.settle_shared(shared, slot, resource, token, register, may_advance).await;
        }
        let started = Instant::now();
        let deadline = started + self.limits.inflight_deadline;
        self.wait_after_unclean_start(started, deadline).await?;
        let mut advanced = false;
        loop {
            let step = {
                let mut state = slot.state();
                match state.fence {
                    None => Step::Load,
                    Some(fence) => match decide(fence, token) {
                        Decision::Stale { current } => {
                            return Err(AdmitError::Stale { presented: token, current });
                        }
                        Decision::Advance if !may_advance => {
                            return Err(AdmitError::Unregistered { presented: token, current: fence });
                        }
                        Decision::Advance => Step::Advance,
                        Decision::Current if state.has_older(token) => {
                            state.cancel_unsent_older(token);
                            Step::WaitForOlder
                        }
                        Decision::Current => match register {
                            None => return Ok(None),
                            Some(caller) => {
                                self.check_budget(&state, caller)?;
                                let mut permit = self.track_inflight(slot, &mut state, token, caller)?;
                                permit.advanced = advanced;
                                return Ok(Some(permit));
                            }
                        },
                    },
                }
            };
            match step {
                Step::Load => self.load(slot, resource).await?,
                Step::Advance => advanced |= self.advance_store(slot, resource, token).await?,
                Step::WaitForOlder => {
                    let _waiting = Waiting::on(slot);
                    let wait_started = Instant::now();
                    let woken = slot.wait_until(deadline, |state| !state.has_older(token)).await;
                    metrics::drain_wait(wait_started.elapsed());
                    if !woken {
                        return Err(AdmitError::DrainTimeout { waited_ms: millis(started.elapsed()) });
                    }
                }
            }
        }
    }

    /// The resource's budget of writes in flight, and the caller's share of it.
    fn check_budget(&self, state: &SlotState, caller: Option<CallerId>) -> Result<(), AdmitError> {
        if state.inflight.len() >= self.limits.inflight_per_resource_max {
            return Err(AdmitError::TooManyInflight { max: self.limits.inflight_per_resource_max });
        }
        if let Some(caller) = caller
            && state.inflight.iter().filter(|w| w.caller == Some(caller)).count() >= self.limits.inflight_per_caller_max
        {
            return Err(AdmitError::TooManyInflightForCaller { max: self.limits.inflight_per_caller_max });
        }
        Ok(())
    }

    /// Tracks a write in flight, unless the gate closed. Checked under the slot's lock: a
    /// write that waited (for a load, an advance, an older write) while shutdown began is
    /// either counted by [`Gate::inflight_writes`], which takes the same lock after
    /// [`Gate::close`], or refused here; never registered unseen after the count.
    fn track_inflight(
        &self,
        slot: &Arc<Slot>,
        state: &mut MutexGuard<'_, SlotState>,
        token: FenceToken,
        caller: Option<CallerId>,
    ) -> Result<Permit, AdmitError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(AdmitError::StoreUnavailable(StoreError::Closed));
        }
        let id = self.next_write_id.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let body_sent = Arc::new(AtomicBool::new(false));
        let cut_off = Arc::new(AtomicU8::new(0));
        state.inflight.push(Inflight {
            id,
            token,
            since: Instant::now(),
            caller,
            cancel: cancel.clone(),
            body_sent: body_sent.clone(),
            cut_off: cut_off.clone(),
        });
        metrics::inflight_changed(1);
        Ok(Permit { slot: slot.clone(), id, token, cancel, body_sent, cut_off, remote: None, advanced: false })
    }

    /// Reads the fence from the store the first time the slot is used.
    async fn load(&self, slot: &Slot, resource: &ResourceKey) -> Result<(), StoreError> {
        let _io = slot.io.lock().await;
        if slot.state().fence.is_some() {
            return Ok(());
        }
        let fence = self.store.load(resource).await?;
        slot.state().fence = Some(fence);
        Ok(())
    }

    /// Makes `token` the fence, durably, unless someone else already raised it meanwhile.
    /// Whether this call raised it.
    async fn advance_store(&self, slot: &Slot, resource: &ResourceKey, token: FenceToken) -> Result<bool, StoreError> {
        let _io = slot.io.lock().await;
        let fence = slot.state().fence.flatten();
        if decide(fence, token) != Decision::Advance {
            return Ok(false); // raised while we waited for the io lock: the caller re-decides
        }
        let outcome = self.store.advance(resource, token).await?;
        let (new_fence, advanced) = match outcome {
            AdvanceOutcome::Advanced { .. } => {
                metrics::advanced();
                (token, true)
            }
            AdvanceOutcome::Unchanged { current } => (current, false),
        };
        slot.state().fence = Some(Some(new_fence));
        slot.changed.notify_waiters();
        Ok(advanced)
    }

    fn slot(&self, resource: &ResourceKey) -> Arc<Slot> {
        let mut slots = self.slots.lock().expect("gate map lock poisoned");
        if let Some(slot) = slots.get(resource) {
            return slot.clone();
        }
        if slots.len() >= self.limits.cached_resources_max {
            // Forget a sixteenth of the cache, idle resources only: nobody but the map holds
            // them, so no write is in flight and no task waits on them. Their fence is reloaded
            // from the store on next use. A bounded batch keeps the time under the lock short.
            let batch = (self.limits.cached_resources_max / 16).max(1);
            slots.extract_if(|_, slot| Arc::strong_count(slot) == 1).take(batch).for_each(drop);
        }
        let slot = Arc::new(Slot {
            state: Mutex::new(SlotState::default()),
            io: tokio::sync::Mutex::new(()),
            changed: Notify::new(),
        });
        slots.insert(resource.clone(), slot.clone());
        slot
    }
}

impl Slot {
    fn state(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().expect("slot lock poisoned")
    }

    /// Raises the cached fence (never lowers it).
    fn raise_fence(&self, token: FenceToken) {
        let mut state = self.state();
        let raised = state.fence.flatten().max(Some(token));
        state.fence = Some(raised);
    }

    /// Waits until `ready(state)` holds or the deadline passes; `false` on the deadline.
    async fn wait_until(&self, deadline: Instant, ready: impl Fn(&SlotState) -> bool) -> bool {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a wake-up between the check and the await is
            // not lost.
            notified.as_mut().enable();
            if ready(&self.state()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return ready(&self.state());
            }
        }
    }
}

/// The store was below this replica's mark and was raised back: counted and logged, whatever
/// else the call that found it did.
fn rollback_repaired(resource: &ResourceKey, had: Option<FenceToken>, mark: Option<FenceToken>) {
    metrics::store_rollback_repaired();
    tracing::error!(
        resource = resource.as_str(),
        store_had = had.map(|t| t.0),
        floor = mark.map(|t| t.0),
        "FENCE STORE ROLLBACK: the store answered lower than this replica has seen; raised it back"
    );
}

#[cfg(test)]
mod tests;
