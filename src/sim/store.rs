//! The simulated fence store: one state the processes share (a Redis with `appendfsync
//! always`, or the embedded store's file with what an fsync made durable), reached by each
//! process over its own [`Link`] (`sim::link`). What runs on it is fencegate's own code: the gate, and for a shared store the
//! registry (`store::shared`) with this module's [`SimCalls`] as its calls, which do what the
//! Redis scripts do (`store/redis/lua`), step for step.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

pub use super::link::{Link, LinkFault};
use super::rng::Rng;
use crate::fence::{
    AdvanceOutcome, FencePage, FenceStore, FenceToken, Hold, IdempotencyBegin, IdempotencyKey, IdempotencyRecord,
    IdempotencyStore, Keep, LeaseCommand, LeaseOutcome, LeasePage, LeaseRecord, LeaseStore, LeaseWrite, ListingStore,
    RecordLimits, RecordPage, ReplicaList, ResourceKey, SharedAdmit, SharedRegistry, StoreError, UploadPage,
    UploadRecord, UploadStore, apply_lease,
};
use crate::store::MemoryStore;
use crate::store::epoch::KnownEpochs;
use crate::store::registrations::{Member, Renewal, Withdrawal};
use crate::store::shared::{Announcements, Ask, RegistryCalls, Renewed, Shared, checked};

/// The one slot the simulated resource lives on (its epoch mark's).
const SLOT: u16 = 0;

/// What the store keeps. One resource per schedule, so one of each.
#[derive(Debug, Default)]
pub struct StoreState {
    pub fence: Option<FenceToken>,
    pub lease: Option<LeaseRecord>,
    /// In-flight registrations (`replica:id:token`) and their deadline on the store's clock.
    pub members: BTreeMap<String, u64>,
    /// The slot's epoch mark and quiet period (a shared store's; `store::epoch`).
    pub epoch: Option<String>,
    pub quiet: Option<(String, u64)>,
    /// The embedded store's meta table: a clean stop recorded, and the hold after an unclean
    /// start.
    pub clean: bool,
    pub hold: Option<Hold>,
    /// Down (crashed and restarting from its append-only file, or failing over) until then.
    pub down_until: Option<Instant>,
}

/// The store, its clock and its subscribers.
pub struct Backend {
    pub shared: bool,
    pub state: Mutex<StoreState>,
    origin: Instant,
    /// The store's clock rate against the replicas', in parts per million (drift within the
    /// margin `fence::bounds` is sized for).
    rate_ppm: i64,
    subscribers: Mutex<Vec<(Arc<Link>, Announcements)>>,
    chance: Mutex<Rng>,
    resource: ResourceKey,
}

impl Backend {
    pub fn new(shared: bool, rate_ppm: i64, seed: u64, resource: ResourceKey) -> Arc<Self> {
        let state = StoreState { clean: true, ..Default::default() };
        Arc::new(Self {
            shared,
            state: Mutex::new(state),
            origin: Instant::now(),
            rate_ppm,
            subscribers: Mutex::default(),
            chance: Mutex::new(Rng::new(seed ^ 0x5707_e5eb)),
            resource,
        })
    }

    /// The store's own clock (Redis's `TIME`), ms.
    pub fn now_ms(&self) -> u64 {
        let real = u64::try_from(Instant::now().duration_since(self.origin).as_micros()).unwrap_or(u64::MAX);
        let rate = 1_000_000 + self.rate_ppm;
        let scaled = u128::from(real) * u128::try_from(rate).unwrap_or(1_000_000) / 1_000_000;
        1_000_000 + u64::try_from(scaled / 1_000).unwrap_or(u64::MAX)
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.state.lock().expect("sim store lock")
    }

    pub fn subscribe(&self, link: Arc<Link>, announcements: Announcements) {
        self.subscribers.lock().expect("subscribers").push((link, announcements));
    }

    /// `PUBLISH fg:advances`, from inside the script that raised the fence (so an advance
    /// whose answer is lost is still announced): each live subscriber hears it after its
    /// link's delay, unless the message is lost (one in six) or its link is cut or one-way.
    fn announce(&self, fence: FenceToken) {
        if self.shared {
            self.publish(fence);
        }
    }

    fn publish(&self, fence: FenceToken) {
        let subscribers: Vec<(Arc<Link>, Announcements)> = self.subscribers.lock().expect("subscribers").clone();
        for (link, announcements) in subscribers {
            if link.is_dead() || self.chance.lock().expect("chance").chance(16) {
                continue;
            }
            let resource = self.resource.clone();
            tokio::spawn(async move {
                let Some(delay) = link.deliverable().await else { return };
                tokio::time::sleep(delay).await;
                announcements.announced(resource, fence);
            });
        }
    }

    /// The epoch gate every changing script passes first (`common.lua`, `epoch_gate`): `Err`
    /// with the answer the replica acts on.
    fn epoch_gate(&self, s: &mut StoreState, known: &str, fresh: &str, quiet_applies: bool) -> Result<(), Gate> {
        let now = self.now_ms();
        let quiet_ms = quiet_ms();
        let mark = match &s.epoch {
            Some(mark) => mark.clone(),
            None => {
                s.epoch = Some(fresh.to_owned());
                s.quiet = Some((fresh.to_owned(), now + quiet_ms));
                fresh.to_owned()
            }
        };
        let mut until = s.quiet.as_ref().map_or(0, |(_, until)| *until);
        if !known.is_empty() && mark != known && s.quiet.as_ref().is_none_or(|(q, _)| *q != mark) {
            until = now + quiet_ms;
            s.quiet = Some((mark.clone(), until));
        }
        let quiet = until.saturating_sub(now);
        if mark != known {
            return Err(Gate::Epoch(mark));
        }
        if quiet_applies && quiet > 0 {
            return Err(Gate::Quiet(quiet));
        }
        Ok(())
    }
}

/// A quiet period is a registration's time to live.
fn quiet_ms() -> u64 {
    crate::fence::millis(crate::fence::InflightBounds::new(super::schedule::DEADLINE).registration_ttl())
}

enum Gate {
    Epoch(String),
    Quiet(u64),
}

/// One process's view of the store: what `Store` asks, over the process's link.
pub struct SimStore {
    backend: Arc<Backend>,
    link: Arc<Link>,
    opened_clean: bool,
    held: Option<Hold>,
    calls: Arc<SimCalls>,
    shared: Option<Shared<SimCalls>>,
    /// What the simulation does not exercise (idempotency and upload records, listings).
    records: MemoryStore,
}

impl SimStore {
    /// Opens the store for a new process: the embedded store reads (and takes) the clean-stop
    /// mark and the recorded hold, as `store/embedded/open.rs` does; a shared store starts the
    /// registry and subscribes to announcements.
    pub fn open(backend: Arc<Backend>, link: Arc<Link>, replica_id: &str) -> Self {
        let (opened_clean, held) = {
            let mut state = backend.state();
            (std::mem::take(&mut state.clean), state.hold)
        };
        let calls = Arc::new(SimCalls {
            backend: backend.clone(),
            link: link.clone(),
            replica_id: replica_id.to_owned(),
            epochs: KnownEpochs::default(),
        });
        let shared = backend.shared.then(|| Shared::start(calls.clone()));
        if let Some(shared) = &shared {
            backend.subscribe(link.clone(), shared.announcements());
        }
        Self { backend, link, opened_clean, held, calls, shared, records: MemoryStore::default() }
    }

    fn timeout() -> Duration {
        super::schedule::STORE_TIMEOUT
    }
}

#[async_trait]
impl FenceStore for SimStore {
    async fn load(&self, _resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.link.call(&self.backend, Self::timeout(), |s| s.fence).await
    }

    async fn advance(&self, _resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        let backend = self.backend.clone();
        self.calls
            .gated(true, move |s, _| {
                let previous = s.fence;
                if previous.is_some_and(|fence| fence >= token) {
                    return AdvanceOutcome::Unchanged { current: previous.unwrap_or(token) };
                }
                s.fence = Some(token);
                backend.announce(token);
                AdvanceOutcome::Advanced { previous }
            })
            .await
    }

    fn kind(&self) -> &'static str {
        if self.backend.shared { "sim-redis" } else { "sim-embedded" }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.link.call(&self.backend, Self::timeout(), |_| ()).await
    }

    fn shared(&self) -> Option<&dyn SharedRegistry> {
        self.shared.as_ref().map(|shared| shared as &dyn SharedRegistry)
    }

    fn opened_clean(&self) -> bool {
        self.backend.shared || self.opened_clean
    }

    fn mark_clean_shutdown(&self) -> Result<(), StoreError> {
        if !self.link.is_dead() {
            self.backend.state().clean = true;
        }
        Ok(())
    }

    fn held(&self) -> Option<Hold> {
        if self.backend.shared { None } else { self.held }
    }

    fn hold_until(&self, hold: Hold) -> Result<(), StoreError> {
        if !self.backend.shared {
            self.backend.state().hold = Some(hold);
        }
        Ok(())
    }
}

#[async_trait]
impl LeaseStore for SimStore {
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        let _ = resource;
        let grant = matches!(command, LeaseCommand::Acquire { .. });
        let backend = self.backend.clone();
        let apply = move |s: &mut StoreState, _now: u64| {
            let t = apply_lease(s.fence, s.lease.as_ref(), command, now_ms);
            if let Some(fence) = t.fence {
                s.fence = Some(fence);
                backend.announce(fence);
            }
            match t.lease {
                LeaseWrite::Keep => {}
                LeaseWrite::Put(record) => s.lease = Some(record),
                LeaseWrite::Delete => s.lease = None,
            }
            t.outcome
        };
        // Only a grant passes the epoch gate (`lease.lua`); a renewal, release or withdrawal
        // acts on the lease as it is.
        if grant {
            self.calls.gated(true, apply).await
        } else {
            self.link.call(&self.backend, Self::timeout(), |s| apply(s, 0)).await
        }
    }

    async fn lease_record(&self, _resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        self.link.call(&self.backend, Self::timeout(), |s| s.lease.clone()).await
    }
}

#[async_trait]
impl IdempotencyStore for SimStore {
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        self.records.idempotency_begin(key, claim, now_ms).await
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.records.idempotency_get(key, now_ms).await
    }

    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        self.records.idempotency_finish(key, claim, record).await
    }
}

#[async_trait]
impl UploadStore for SimStore {
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError> {
        self.records.upload_put(record, limits).await
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        self.records.upload_get(bucket, upload_id).await
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        self.records.upload_remove(bucket, upload_id).await
    }

    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        self.records.uploads(cursor, limit).await
    }
}

#[async_trait]
impl ListingStore for SimStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        self.records.fences(prefix, after, limit).await
    }

    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        self.records.leases(prefix, after, limit).await
    }

    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        self.records.idempotency_records(cursor, limit).await
    }
}

impl ReplicaList for SimStore {}

/// The registry's calls on the simulated Redis: `admit.lua`, `renew.lua`, `ZREM`, and the
/// read-only check, with the replica's side of the epoch marks (`KnownEpochs`) as the Redis
/// store keeps it.
pub struct SimCalls {
    backend: Arc<Backend>,
    link: Arc<Link>,
    replica_id: String,
    epochs: KnownEpochs,
}

impl SimCalls {
    fn member(&self, member: Member) -> String {
        format!("{}:{}:{}", self.replica_id, member.id, member.token.0)
    }

    /// A changing call behind the slot's epoch gate (shared store only), run again once the
    /// replica learned a mark it did not know, as `RedisCalls` does.
    async fn gated<T: Send + 'static>(
        &self,
        quiet_applies: bool,
        op: impl FnOnce(&mut StoreState, u64) -> T + Send + Clone,
    ) -> Result<T, StoreError> {
        if !self.backend.shared {
            return self.link.call(&self.backend, SimStore::timeout(), |s| op(s, 0)).await;
        }
        let fresh = self.epochs.offer();
        for _ in 0..3 {
            let known = self.epochs.get(SLOT);
            let backend = &self.backend;
            let op = op.clone();
            let answer = self
                .link
                .call(backend, SimStore::timeout(), |s| match backend.epoch_gate(s, &known, &fresh, quiet_applies) {
                    Ok(()) => Ok(op(s, backend.now_ms())),
                    Err(gate) => Err(gate),
                })
                .await?;
            match answer {
                Ok(value) => return Ok(value),
                Err(Gate::Quiet(ms)) => return Err(StoreError::Recovering { retry_after_ms: ms }),
                Err(Gate::Epoch(mark)) => {
                    self.epochs.learned(SLOT, &mark, &self.backend.resource);
                }
            }
        }
        Err(StoreError::Backend("the store's epoch mark kept changing".into()))
    }
}

/// A member's token: after its last colon, as `admit.lua` reads it.
fn token_of(member: &str) -> Option<FenceToken> {
    member.rsplit_once(':').and_then(|(_, t)| t.parse().ok()).map(FenceToken)
}

#[async_trait]
impl RegistryCalls for SimCalls {
    async fn check(
        &self,
        _resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        member: Member,
    ) -> Result<Option<SharedAdmit>, StoreError> {
        let name = self.member(member);
        let (fence, registered) =
            self.link.call(&self.backend, SimStore::timeout(), |s| (s.fence, s.members.contains_key(&name))).await?;
        Ok(checked(fence, token, floor, registered))
    }

    async fn register(
        &self,
        _resource: &ResourceKey,
        token: FenceToken,
        ask: &Ask,
        member: Option<Member>,
        withdraw: &[Member],
    ) -> Result<SharedAdmit, StoreError> {
        let Ask { floor, may_advance, ttl_ms } = *ask;
        let member = member.map(|m| self.member(m));
        let withdraw: Vec<String> = withdraw.iter().map(|m| self.member(*m)).collect();
        let backend = self.backend.clone();
        self.gated(true, move |s, now| {
            for old in &withdraw {
                s.members.remove(old);
            }
            let mut repaired_from = None;
            if let Some(floor) = floor
                && s.fence.is_none_or(|fence| fence < floor)
            {
                repaired_from = Some(s.fence);
                s.fence = Some(floor);
            }
            if let Some(current) = s.fence.filter(|fence| token < *fence) {
                return SharedAdmit::Stale { current };
            }
            let mut advanced = false;
            if s.fence.is_none_or(|fence| fence < token) {
                if !may_advance {
                    return SharedAdmit::Unregistered { current: s.fence, repaired_from };
                }
                s.fence = Some(token);
                backend.announce(token);
                advanced = true;
            }
            s.members.retain(|_, deadline| *deadline > now);
            if s.members.keys().any(|m| token_of(m).is_some_and(|t| t < token)) {
                return SharedAdmit::OlderInflight { advanced, repaired_from };
            }
            if let Some(member) = member {
                s.members.insert(member, now + ttl_ms);
            }
            SharedAdmit::Admitted { advanced, repaired_from }
        })
        .await
    }

    async fn renew(&self, renewal: &Renewal) -> Result<Renewed, StoreError> {
        let name = self.member(renewal.member);
        let ttl_ms = crate::fence::millis(renewal.ttl);
        let known = self.epochs.get(SLOT);
        let fresh = self.epochs.offer();
        let backend = &self.backend;
        let answer = self
            .link
            .call(backend, SimStore::timeout(), |s| {
                backend.epoch_gate(s, &known, &fresh, false)?;
                let now = backend.now_ms();
                let fence = s.fence;
                match s.members.get_mut(&name) {
                    Some(deadline) if *deadline > now => {
                        *deadline = now + ttl_ms;
                        Ok(Renewed { still_there: true, fence })
                    }
                    _ => Ok(Renewed { still_there: false, fence }),
                }
            })
            .await?;
        match answer {
            Ok(renewed) => Ok(renewed),
            Err(Gate::Epoch(mark)) => {
                self.epochs.learned(SLOT, &mark, &renewal.resource);
                Ok(Renewed { still_there: false, fence: None })
            }
            Err(Gate::Quiet(_)) => Ok(Renewed { still_there: false, fence: None }),
        }
    }

    async fn withdraw(&self, withdrawal: &Withdrawal) -> Result<(), StoreError> {
        let name = self.member(withdrawal.member);
        self.link.call(&self.backend, SimStore::timeout(), |s| s.members.remove(&name)).await?;
        Ok(())
    }
}
