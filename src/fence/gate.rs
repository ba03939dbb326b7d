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
    AdvanceOutcome, Decision, FenceToken, IdempotencyRecords, LeaseCommand, LeaseOutcome, LeaseRecord, ResourceKey,
    SharedAdmit, SharedRegistry, Store, StoreError, StoreEvent, TimedStore, UploadRecords, decide,
};
use crate::metrics;

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

/// How long the withdrawal of a grant whose outcome is unknown is sent again while the store
/// does not answer (see `Gate::withdraw_grant`): half the time its tombstone is kept, so the
/// tombstone outlives any grant the store can still apply after it.
const WITHDRAW_FOR: Duration = Duration::from_millis(super::WITHDRAWN_GRANT_TTL_MS / 2);

/// Withdrawals in the background at most. One more is sent once, inline, and then left: a
/// grant it misses, if applied, expires with its TTL.
const WITHDRAWALS_MAX: usize = 1024;

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
}

impl Default for GateLimits {
    fn default() -> Self {
        Self {
            inflight_deadline: Duration::from_millis(30_000),
            store_timeout: Duration::from_millis(2_000),
            inflight_per_resource_max: 1024,
            inflight_per_caller_max: 512,
            cached_resources_max: 100_000,
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
    /// [`WITHDRAWALS_MAX`]: a store outage with many grants asked does not grow tasks without
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
    caller: Option<CallerId>,
    cancel: CancellationToken,
    /// Set once the whole body was handed to the upstream: from then on the write can only be
    /// awaited, never cancelled.
    body_sent: Arc<AtomicBool>,
    /// Why the write was cut off, once it is ([`CutOff`] as a number, 0 for none).
    cut_off: Arc<AtomicU8>,
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

    /// After an unclean start, admits no write, registration or lease grant for the in-flight
    /// deadline: writes the previous process had sent may still commit at the upstream until
    /// then (`docs/design.md`, section 8). Current tokens wait too: the dead process may have
    /// made a newer token durable while older writes of it were still in flight.
    pub fn hold_writes_after_unclean_start(&self) {
        let until = Instant::now() + self.limits.inflight_deadline;
        *self.writes_from.lock().expect("gate lock poisoned") = Some(until);
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
        UploadRecords::new(self.store.clone())
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
        match mark {
            Some(current) if token < current => {
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

    /// Applies a lease command. A grant raises the fence in the same store step: from then on
    /// every older token is rejected (G7), and older uploads still streaming are cancelled.
    pub async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, AdmitError> {
        let slot = self.slot(resource);
        let mut command = command;
        if let LeaseCommand::Acquire { floor, .. } = &mut command {
            // While no fence may advance (after an unclean start), a grant is refused at once
            // with the time to retry: a caller waiting D for it gives up first (5 s, for
            // `fencegate-lease`), and retries anyway.
            let holding = *self.writes_from.lock().expect("gate lock poisoned");
            if let Some(from) = holding.filter(|from| *from > Instant::now()) {
                // A live lease is still answered as held: its holder's rival learns that, not
                // to come back in a moment.
                if let Some(live) = self.store.lease_record(resource).await?.filter(|l| l.is_live(now_ms)) {
                    return Ok(LeaseOutcome::Held { remaining_ms: live.expires_at_ms - now_ms, holder: live.holder });
                }
                let retry_after_ms = millis(from.saturating_duration_since(Instant::now())).max(1);
                return Err(AdmitError::StoreUnavailable(StoreError::UncleanStart { retry_after_ms }));
            }
            // A grant is above every token this replica has seen, whatever the store says.
            *floor = (*floor).max(slot.state().fence.flatten());
        }
        let granting = match &command {
            LeaseCommand::Acquire { lease_id, .. } => Some(lease_id.clone()),
            _ => None,
        };
        let outcome = {
            let _io = slot.io.lock().await;
            let outcome = match self.store.lease(resource, command, now_ms).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    if let (Some(lease_id), StoreError::Timeout { .. } | StoreError::Backend(_)) = (granting, &error) {
                        self.withdraw_grant(resource, lease_id, now_ms);
                    }
                    return Err(error.into());
                }
            };
            if let LeaseOutcome::Granted(lease) = &outcome {
                let mut state = slot.state();
                let fence = state.fence.flatten().max(Some(lease.token));
                state.fence = Some(fence);
                // Older uploads still streaming are cut off now; the new holder's own writes
                // wait for the rest at admission. The grant is answered without waiting, so a
                // slow older write cannot turn a stored grant into an error for its holder.
                state.cancel_unsent_older(lease.token);
                drop(state);
                metrics::advanced();
                slot.changed.notify_waiters();
            }
            outcome
        };
        Ok(outcome)
    }

    /// A grant answered with an error whose outcome is unknown (the store did not answer in
    /// time, or its connection broke after the call was sent) may still be applied: nobody was
    /// told its lease id, so a lease it made would be held by no one for its whole TTL (a ghost
    /// lease, seen when Redis stalled). It is withdrawn ([`LeaseCommand::Withdraw`]), again
    /// until the store answers, for at most [`WITHDRAW_FOR`]: the withdrawal removes the
    /// lease if the grant was applied, and leaves a tombstone that a grant applied after it
    /// finds and does nothing (the grant's bytes may reach a shared store after the withdrawal's,
    /// on a connection that broke).
    fn withdraw_grant(&self, resource: &ResourceKey, lease_id: String, now_ms: u64) {
        let (store, resource) = (self.store.clone(), resource.clone());
        metrics::lease_event("grant_withdrawn");
        let pending = self.withdrawals.clone();
        let until = if pending.fetch_add(1, Ordering::AcqRel) < WITHDRAWALS_MAX {
            Instant::now() + WITHDRAW_FOR
        } else {
            metrics::lease_event("grant_withdrawal_capped");
            Instant::now()
        };
        tokio::spawn(async move {
            let _pending = DecrementOnDrop(pending);
            let mut pause = Duration::from_millis(100);
            loop {
                let withdraw = LeaseCommand::Withdraw { lease_id: lease_id.clone() };
                match store.lease(&resource, withdraw, now_ms).await {
                    Ok(_) => return,
                    Err(error) => tracing::debug!(%error, resource = resource.as_str(), "withdrawing a grant"),
                }
                if Instant::now() + pause >= until {
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            tracing::warn!(
                resource = resource.as_str(),
                "a grant answered with an error could not be withdrawn: if it was applied, its lease expires by itself"
            );
        });
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
                                return self.register(slot, &mut state, token, caller).map(Some);
                            }
                        },
                    },
                }
            };
            match step {
                Step::Load => self.load(slot, resource).await?,
                Step::Advance => self.advance_store(slot, resource, token).await?,
                Step::WaitForOlder => {
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

    /// `settle` for a store shared by several replicas: the store checks the token and
    /// registers the write in its cross-replica in-flight registry in one step, and answers
    /// "wait" while an older write is in flight on any replica. The slot's fence is this
    /// replica's high-water mark: a token below it is refused whatever the store says, and a
    /// store found below it is raised back (rollback defence).
    async fn settle_shared(
        &self,
        shared: &dyn SharedRegistry,
        slot: &Arc<Slot>,
        resource: &ResourceKey,
        token: FenceToken,
        register: Option<Option<CallerId>>,
        may_advance: bool,
    ) -> Result<Option<Permit>, AdmitError> {
        let started = Instant::now();
        let deadline = started + self.limits.inflight_deadline;
        let deadline_ms = millis(self.limits.inflight_deadline);
        self.refuse_below_mark(slot, resource, token)?;
        // Registered locally first, so that an announced advance can cancel it while the
        // store is being asked.
        let mut permit = match register {
            Some(caller) => {
                let mut state = slot.state();
                self.check_budget(&state, caller)?;
                Some(self.register(slot, &mut state, token, caller)?)
            }
            None => None,
        };
        let mut backoff = Duration::from_millis(1);
        loop {
            let floor = slot.state().fence.flatten();
            // On an error the store withdraws what the call may have registered.
            let call = shared.admit(resource, token, floor, register.is_some(), may_advance, deadline_ms);
            let answer = self.store.call(call).await?;
            match answer {
                SharedAdmit::Unregistered { current, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    if let Some(current) = current {
                        slot.raise_fence(current);
                    }
                    return Err(AdmitError::Unregistered { presented: token, current });
                }
                SharedAdmit::Stale { current } => {
                    slot.raise_fence(current);
                    return Err(AdmitError::Stale { presented: token, current });
                }
                SharedAdmit::OlderInflight { advanced, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    if advanced {
                        metrics::advanced();
                        slot.raise_fence(token);
                        slot.state().cancel_unsent_older(token);
                    }
                    if Instant::now() >= deadline {
                        return Err(AdmitError::DrainTimeout { waited_ms: millis(started.elapsed()) });
                    }
                    tokio::time::sleep(backoff.min(deadline - Instant::now())).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                    metrics::drain_wait(started.elapsed());
                }
                SharedAdmit::Admitted { advanced, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    if advanced {
                        metrics::advanced();
                    }
                    slot.raise_fence(token);
                    if let Some(p) = permit.as_mut() {
                        p.remote = Some(RemoteTicket { store: self.store.clone(), resource: resource.clone(), token });
                    }
                    return Ok(permit);
                }
            }
        }
    }

    /// Acts on what a shared store reports by itself: an advance announced by another replica
    /// (or seen at a renewal) cuts off older uploads still streaming here at once, without
    /// waiting for their next store call; a registration this replica could not keep stops its
    /// writes that have not sent their whole body (`docs/design.md`, section 6).
    pub fn listen_for_store_events(self: &Arc<Self>) {
        let Some(mut events) = self.store.shared().and_then(|s| s.take_events()) else { return };
        let gate = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let Some(gate) = gate.upgrade() else { return };
                let resource = match &event {
                    StoreEvent::Advanced { resource, .. } | StoreEvent::Revoked { resource, .. } => resource,
                };
                let slot = gate.slots.lock().expect("gate map lock poisoned").get(resource).cloned();
                let Some(slot) = slot else { continue };
                match event {
                    StoreEvent::Advanced { fence, .. } => {
                        let mark = slot.state().fence.flatten(); // not held into the repair
                        if let Some(mark) = mark
                            && fence < mark
                        {
                            // Some replica set the store below what this one has seen.
                            gate.repair_in_background(&slot, resource, mark);
                        }
                        slot.raise_fence(fence);
                        slot.state().cancel_unsent_older(fence);
                    }
                    StoreEvent::Revoked { token, .. } => {
                        tracing::warn!(
                            resource = resource.as_str(),
                            token = token.0,
                            "in-flight registration lost or not renewed in time: stopping this replica's unsent writes"
                        );
                        slot.state().cancel_unsent(CutOff::Revoked, |t| t <= token);
                    }
                }
                slot.changed.notify_waiters();
            }
        });
    }

    /// Asks a shared store, without waiting, to come back up to `mark` (at most once per
    /// [`REPAIR_EVERY`] per resource); a store found below it is counted and logged.
    fn repair_in_background(&self, slot: &Arc<Slot>, resource: &ResourceKey, mark: FenceToken) {
        if self.store.shared().is_none() {
            return;
        }
        {
            let mut state = slot.state();
            let now = Instant::now();
            if state.repair_asked.is_some_and(|at| now.duration_since(at) < REPAIR_EVERY) {
                return;
            }
            state.repair_asked = Some(now);
        }
        let (store, resource) = (self.store.clone(), resource.clone());
        let slot = slot.clone();
        tokio::spawn(async move {
            match store.advance(&resource, mark).await {
                Ok(AdvanceOutcome::Advanced { previous }) => rollback_repaired(&resource, previous, Some(mark)),
                Ok(AdvanceOutcome::Unchanged { .. }) => {}
                Err(error) => {
                    tracing::warn!(%error, resource = resource.as_str(), "could not check the store against this replica's mark");
                    slot.state().repair_asked = None; // the next refusal asks again
                }
            }
        });
    }

    /// Registers a write in flight, unless the gate closed. Checked under the slot's lock: a
    /// write that waited (for a load, an advance, an older write) while shutdown began is
    /// either counted by [`Gate::inflight_writes`], which takes the same lock after
    /// [`Gate::close`], or refused here; never registered unseen after the count.
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

    fn register(
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
            caller,
            cancel: cancel.clone(),
            body_sent: body_sent.clone(),
            cut_off: cut_off.clone(),
        });
        metrics::inflight_changed(1);
        Ok(Permit { slot: slot.clone(), id, token, cancel, body_sent, cut_off, remote: None })
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
    async fn advance_store(&self, slot: &Slot, resource: &ResourceKey, token: FenceToken) -> Result<(), StoreError> {
        let _io = slot.io.lock().await;
        let fence = slot.state().fence.flatten();
        if decide(fence, token) != Decision::Advance {
            return Ok(()); // raised while we waited for the io lock: the caller re-decides
        }
        let outcome = self.store.advance(resource, token).await?;
        let new_fence = match outcome {
            AdvanceOutcome::Advanced { .. } => {
                metrics::advanced();
                token
            }
            AdvanceOutcome::Unchanged { current } => current,
        };
        slot.state().fence = Some(Some(new_fence));
        slot.changed.notify_waiters();
        Ok(())
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

/// An admitted write. Keep it until the upstream outcome is known; dropping it lets newer
/// tokens on the resource proceed.
pub struct Permit {
    slot: Arc<Slot>,
    id: u64,
    token: FenceToken,
    cancel: CancellationToken,
    body_sent: Arc<AtomicBool>,
    cut_off: Arc<AtomicU8>,
    /// The registration in a shared store's in-flight registry, withdrawn on drop.
    remote: Option<RemoteTicket>,
}

/// A write registered in a shared store; dropping it ends the registration's use.
struct RemoteTicket {
    store: TimedStore,
    resource: ResourceKey,
    token: FenceToken,
}

impl RemoteTicket {
    fn still_registered(&self) -> bool {
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

impl Permit {
    pub fn token(&self) -> FenceToken {
        self.token
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

/// Counts one pending withdrawal down when its task ends.
struct DecrementOnDrop(Arc<AtomicUsize>);

impl Drop for DecrementOnDrop {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn gate() -> Gate {
        Gate::new(Arc::new(MemoryStore::default()), GateLimits::default())
    }

    fn key(name: &str) -> ResourceKey {
        ResourceKey::new(name).unwrap()
    }

    /// `token`'s admission on `r`, in a task of its own (for a test to watch it wait).
    fn admit_in_a_task(
        gate: &Arc<Gate>,
        r: &ResourceKey,
        token: FenceToken,
    ) -> tokio::task::JoinHandle<Result<FenceToken, AdmitError>> {
        let (gate, r) = (gate.clone(), r.clone());
        tokio::spawn(async move { gate.admit(&r, token).await.map(|p| p.token()) })
    }

    /// Stale tokens are refused with the current fence; equal tokens run side by side.
    #[tokio::test]
    async fn stale_is_refused_and_current_runs_concurrently() {
        let gate = gate();
        let r = key("job:a");
        let first = gate.admit(&r, FenceToken(12)).await.unwrap();
        let second = gate.admit(&r, FenceToken(12)).await.unwrap();
        match gate.admit(&r, FenceToken(11)).await {
            Err(AdmitError::Stale { current, .. }) => assert_eq!(current, FenceToken(12)),
            other => panic!("expected stale, got {:?}", other.map(|p| p.token())),
        }
        drop((first, second));
    }

    /// A newer token cancels an older write whose body is still streaming, and is admitted
    /// only after that write is gone (G3).
    #[tokio::test]
    async fn newer_token_cancels_unsent_older_write_and_waits_for_it() {
        let gate = Arc::new(gate());
        let r = key("job:b");
        let old = gate.admit(&r, FenceToken(11)).await.unwrap();
        let cancelled = old.cancellation().clone();

        let newer = admit_in_a_task(&gate, &r, FenceToken(12));
        cancelled.cancelled().await;
        assert!(!newer.is_finished(), "newer write admitted while the older one is in flight");
        assert!(!old.mark_body_sent(), "a cancelled write must not finish its body");
        drop(old);
        assert_eq!(newer.await.unwrap().unwrap(), FenceToken(12));
    }

    /// An older write whose body was fully sent is awaited, not cancelled.
    #[tokio::test]
    async fn sent_older_write_is_awaited_not_cancelled() {
        let gate = Arc::new(gate());
        let r = key("job:c");
        let old = gate.admit(&r, FenceToken(11)).await.unwrap();
        assert!(old.mark_body_sent());
        let newer = admit_in_a_task(&gate, &r, FenceToken(12));
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!old.cancellation().is_cancelled());
        assert!(!newer.is_finished());
        drop(old);
        assert_eq!(newer.await.unwrap().unwrap(), FenceToken(12));
    }

    /// A write still waiting when the gate closes (shutdown) is refused when its wait ends,
    /// not registered after shutdown counted the writes in flight.
    #[tokio::test]
    async fn a_write_waiting_when_the_gate_closes_is_not_registered() {
        let gate = Arc::new(gate());
        let r = key("job:closing");
        let old = gate.admit(&r, FenceToken(11)).await.unwrap();
        assert!(old.mark_body_sent());
        let newer = admit_in_a_task(&gate, &r, FenceToken(12));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!newer.is_finished(), "the newer write waits for the older one");
        gate.close();
        drop(old);
        assert_eq!(gate.inflight_writes(), 0);
        match newer.await.unwrap() {
            Err(AdmitError::StoreUnavailable(StoreError::Closed)) => {}
            other => panic!("expected a refusal after close, got {other:?}"),
        }
        assert_eq!(gate.inflight_writes(), 0, "nothing registered after shutdown counted");
    }

    /// Once a newer token is registered, the older token is refused even before any write
    /// with the newer one (G7).
    #[tokio::test]
    async fn registration_fences_older_tokens() {
        let gate = gate();
        let r = key("job:d");
        gate.admit(&r, FenceToken(11)).await.unwrap();
        assert_eq!(gate.advance(&r, FenceToken(12)).await.unwrap(), FenceToken(12));
        assert!(matches!(gate.admit(&r, FenceToken(11)).await, Err(AdmitError::Stale { .. })));
        assert!(matches!(gate.advance(&r, FenceToken(10)).await, Err(AdmitError::Stale { .. })));
        assert_eq!(gate.fence(&r).await.unwrap(), Some(FenceToken(12)));
    }

    /// A write that cannot drain older writes within the deadline gets an error, not an
    /// admission; the fence stays advanced.
    #[tokio::test(start_paused = true)]
    async fn drain_is_bounded_by_the_deadline() {
        let limits = GateLimits { inflight_deadline: Duration::from_millis(500), ..GateLimits::default() };
        let gate = Gate::new(Arc::new(MemoryStore::default()), limits);
        let r = key("job:e");
        let old = gate.admit(&r, FenceToken(1)).await.unwrap();
        assert!(old.mark_body_sent());
        assert!(matches!(gate.admit(&r, FenceToken(2)).await, Err(AdmitError::DrainTimeout { .. })));
        assert!(matches!(gate.admit(&r, FenceToken(1)).await, Err(AdmitError::Stale { .. })));
        drop(old);
        assert!(gate.admit(&r, FenceToken(2)).await.is_ok());
    }

    /// A store that fails makes the gate fail closed.
    #[tokio::test]
    async fn store_failure_fails_closed() {
        let store = Arc::new(MemoryStore::default());
        let gate = Gate::new(store.clone(), GateLimits::default());
        store.set_failing(true);
        assert!(matches!(gate.admit(&key("job:f"), FenceToken(3)).await, Err(AdmitError::StoreUnavailable(_))));
    }

    /// Idle resources are forgotten beyond the cache limit and come back from the store.
    #[tokio::test]
    async fn forgotten_resources_reload_their_fence() {
        let limits = GateLimits { cached_resources_max: 4, ..GateLimits::default() };
        let gate = Gate::new(Arc::new(MemoryStore::default()), limits);
        for i in 0..20 {
            drop(gate.admit(&key(&format!("r{i}")), FenceToken(i + 5)).await.unwrap());
        }
        assert!(gate.slots.lock().unwrap().len() <= 5);
        assert!(matches!(gate.admit(&key("r0"), FenceToken(4)).await, Err(AdmitError::Stale { .. })));
    }

    /// After an unclean start, no admission (write, registration or grant) for the in-flight
    /// deadline: the dead process's sent writes may still commit.
    #[tokio::test(start_paused = true)]
    async fn no_admission_for_the_deadline_after_an_unclean_start() {
        let deadline = Duration::from_secs(5);
        let store = Arc::new(MemoryStore::default());
        let before = Gate::new(store.clone(), GateLimits::default());
        drop(before.admit(&key("job:q"), FenceToken(5)).await.unwrap());
        let gate = Gate::new(store, GateLimits { inflight_deadline: deadline, ..GateLimits::default() });
        gate.hold_writes_after_unclean_start();
        let started = Instant::now();
        drop(gate.admit(&key("job:q"), FenceToken(5)).await.unwrap());
        assert!(started.elapsed() >= deadline, "the current token waits too: {:?}", started.elapsed());
        drop(gate.admit(&key("job:q"), FenceToken(6)).await.unwrap());
        let grant = LeaseCommand::Acquire { holder: "h".into(), ttl_ms: 1000, lease_id: "l".into(), floor: None };
        assert!(matches!(gate.lease(&key("job:q"), grant, 0).await, Ok(LeaseOutcome::Granted(_))));
        assert!(started.elapsed() < deadline * 2, "the hold ends once");
    }
}
