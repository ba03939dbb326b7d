//! The contract every fence store keeps.

use async_trait::async_trait;

use super::{
    FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord, Keep, LeaseCommand, LeaseOutcome, LeaseRecord,
    RecordLimits, ResourceKey, UploadPage, UploadRecord,
};

/// The result of a check-and-advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdvanceOutcome {
    /// The fence is now the requested token, durably. `previous` is what it replaced.
    Advanced { previous: Option<FenceToken> },
    /// The fence was already at or above the requested token; nothing changed.
    Unchanged { current: FenceToken },
}

/// A store call whose outcome is not known. Callers must treat every variant as "the fence
/// state is unknown" and fail closed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("fence store backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("fence store did not answer within {after_ms} ms")]
    Timeout { after_ms: u64 },
    #[error("fence store refuses work after an earlier I/O failure; restart fencegate to recover it")]
    Poisoned,
    #[error("fence store is shut down")]
    Closed,
    #[error(
        "the fence store file is no longer the one this process opened (removed, moved or replaced): no change is \
         made until it is restored and fencegate restarted"
    )]
    FileLost,
    #[error(
        "the fence store has no mark of continuity here: it lost its state (flushed, restarted empty, or failed over), or it is new and was never initialised; nothing is admitted for {retry_after_ms} ms more, until writes that were in flight before can no longer commit. A new store needs `fencegate init-store` once, before its first use; never run it on a store that lost its state"
    )]
    Recovering { retry_after_ms: u64 },
    #[error(
        "the last fencegate process did not shut down cleanly: no fence advances for {retry_after_ms} ms more, until writes it sent can no longer commit"
    )]
    UncleanStart { retry_after_ms: u64 },
}

impl StoreError {
    /// When the same call can succeed, if the store said so.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            Self::Recovering { retry_after_ms } | Self::UncleanStart { retry_after_ms } => Some(*retry_after_ms),
            _ => None,
        }
    }
}

/// Durable, monotonic per-resource fences.
///
/// Implementations guarantee: a fence never decreases (G1), and `advance` returns `Advanced`
/// only once the new value is durable (G2).
#[async_trait]
pub trait FenceStore: Send + Sync + 'static {
    /// The current fence of `resource`, `None` if no token was ever accepted for it.
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError>;

    /// Raises the fence of `resource` to `token` if `token` is greater, atomically.
    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError>;

    /// A short name for logs and metrics.
    fn kind(&self) -> &'static str;

    /// Whether the store answers at all (for `/readyz`).
    async fn ping(&self) -> Result<(), StoreError>;

    /// The cross-replica registry, for a store that several fencegate processes share. With
    /// one, the gate checks and registers every write in the store instead of trusting its
    /// own cache of the fence.
    fn shared(&self) -> Option<&dyn SharedRegistry> {
        None
    }

    /// Whether the last process that used this store shut down with no write in flight. When
    /// it did not (a crash, a kill), writes it had sent may still commit at the upstream, so
    /// the gate admits no advance for a while (`docs/design.md`, section 8). A shared store
    /// keeps a dead replica's registrations itself, so it answers `true`.
    fn opened_clean(&self) -> bool {
        true
    }

    /// Records that this process stops with no write in flight.
    fn mark_clean_shutdown(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// The hold recorded by [`Self::hold_until`]: no fence may advance before its end, as an
    /// earlier process's writes may still commit at the upstream until then. Read at open;
    /// `None` when nothing was recorded.
    fn held(&self) -> Option<Hold> {
        None
    }

    /// Records `hold` durably, so that every later start honours it whatever happens in
    /// between: a clean stop inside it does not end it. A shared store keeps a dead replica's
    /// registrations instead.
    fn hold_until(&self, _hold: Hold) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A hold after an unclean start: its end on the wall clock, and on the boot clock of the boot
/// it was recorded in. A start in the same boot reads the boot clock, which a wall-clock jump
/// (an NTP step, an operator's `date`) does not move and which counts a suspension; a start
/// after a reboot has only the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// Wall clock, ms since the epoch.
    pub until_ms: u64,
    pub boot: Option<BootHold>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootHold {
    /// The boot it was recorded in (`/proc/sys/kernel/random/boot_id`, hashed).
    pub boot_id: u64,
    /// `CLOCK_BOOTTIME`, ms.
    pub until_ms: u64,
}

/// Leases, kept with the fences they raise (`src/fence/lease.rs` is their state machine).
#[async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    /// Applies a lease command (see [`super::apply_lease`]) at wall-clock `now_ms`, atomically
    /// with the fence it raises: a grant and its fence are durable together or not at all.
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError>;

    /// The lease stored on `resource`, live or expired (a released or superseded lease is
    /// gone). Lease credentials are checked against it on every request.
    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError>;
}

/// The API gateway's idempotency records (`[[routes]] mode = "idempotency-key"`), kept in the
/// fence store so that a record and the fence it was written under share one durability.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Stores `claim` (an in-flight record) under `key` unless a live record is there, in
    /// which case that one is returned and nothing changes. A record whose `expires_at_ms` is
    /// at or before `now_ms` counts as absent. Returns `Claimed` only once the claim is
    /// durable.
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError>;

    /// The live record under `key`, if any.
    async fn idempotency_get(&self, key: &IdempotencyKey, now_ms: u64)
    -> Result<Option<IdempotencyRecord>, StoreError>;

    /// Replaces the record claimed as `claim` by `record`, or removes it (`None`: nothing was
    /// sent, so a retry may go ahead), keeping its expiry. Does nothing if the record under
    /// `key` is not that claim any more (it expired and another request claimed the key).
    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError>;
}

/// The multipart uploads created with a token (`super::uploads`), kept where the fences are so
/// that every replica of a shared store sees them. Names are [`UploadRecord::name`].
#[async_trait]
pub trait UploadStore: Send + Sync + 'static {
    /// Keeps `record`, durably once this returns, replacing one under the same name; a new
    /// one only within `limits`, checked atomically with the write ([`super::budget`]).
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError>;

    /// The record of upload `upload_id` in `bucket`, if one is kept.
    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError>;

    /// Forgets an upload (completed or aborted); nothing if none is kept.
    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError>;

    /// Up to about `limit` records from `cursor` on (`None`: from the start), in an order that
    /// visits every record kept for the whole walk once at least.
    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError>;
}

/// A page of a listing by resource, and where the next one starts (`None`: this was the last).
#[derive(Debug, PartialEq, Eq)]
pub struct Page<T> {
    pub items: Vec<(ResourceKey, T)>,
    /// The last resource of this page, when more may follow: pass it as `after`.
    pub next: Option<String>,
}

impl<T> Default for Page<T> {
    fn default() -> Self {
        Self { items: Vec::new(), next: None }
    }
}

impl<T> Page<T> {
    /// A page of `limit` from items read in order, one past the page when more follow.
    pub fn of(mut items: Vec<(ResourceKey, T)>, limit: usize) -> Self {
        let more = items.len() > limit;
        items.truncate(limit);
        let next = if more { items.last().map(|(r, _)| r.as_str().to_owned()) } else { None };
        Self { items, next }
    }
}

/// A page of fences.
pub type FencePage = Page<FenceToken>;

/// A page of leases, live or not.
pub type LeasePage = Page<LeaseRecord>;

/// A page of the API gateway's idempotency records, live or not, and the cursor of the next
/// (`None`: this was the last). The cursor is the store's own: pass it back as it is.
#[derive(Debug, Default)]
pub struct RecordPage {
    pub records: Vec<(ResourceKey, IdempotencyRecord)>,
    /// Records that could not be read (not JSON of a record, a key of no resource), by the
    /// name the store keeps them under, and why: one such record does not hide the others.
    pub unreadable: Vec<(String, String)>,
    pub next: Option<String>,
}

impl RecordPage {
    /// Adds a record as a store read it: the name it is kept under, the resource that name
    /// gave (if it gave one), and its JSON.
    pub fn read(&mut self, name: &str, resource: Option<ResourceKey>, json: &[u8]) {
        match (resource, serde_json::from_slice::<IdempotencyRecord>(json)) {
            (Some(resource), Ok(record)) => self.records.push((resource, record)),
            (None, _) => self.unreadable.push((name.to_owned(), "its name holds no resource".into())),
            (_, Err(e)) => self.unreadable.push((name.to_owned(), format!("not an idempotency record: {e}"))),
        }
    }
}

/// Where a listing of `prefix` after `after` starts: `after` (exclusive) when it is past the
/// prefix's start, else the prefix (inclusive).
pub fn listing_start<'a>(prefix: &'a str, after: Option<&'a str>) -> std::ops::Bound<&'a str> {
    match after {
        Some(after) if after >= prefix => std::ops::Bound::Excluded(after),
        _ => std::ops::Bound::Included(prefix),
    }
}

/// What an operator sees of a store (the admin listener's `/v1/fences` and `/v1/leases`):
/// reads only, in pages of a bounded size, never on a write's path.
#[async_trait]
pub trait ListingStore: Send + Sync + 'static {
    /// The fences of resources that start with `prefix` and come after `after` (byte order,
    /// exclusive), in that order, at most `limit` (at least 1).
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError>;

    /// The leases (live or not) of resources that start with `prefix` and come after `after`,
    /// in byte order of the resource, at most `limit` (at least 1).
    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError>;

    /// Idempotency records from `cursor` on (`None`: from the start), in an order that visits
    /// every record kept for the whole walk once at least (`fencegate reconcile` looks for the
    /// ones whose outcome is unknown). A page holds at most `limit` (at least 1), except on
    /// Redis, whose `SCAN` steps hold what they hold: `limit` bounds the keys walked there.
    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError>;
}

/// The replicas sharing a store, as they see each other (`/v1/status`): each notes itself
/// while it runs and forgets itself when it stops. A store of one process keeps nothing.
#[async_trait]
pub trait ReplicaList: Send + Sync + 'static {
    /// Notes that replica `id` is up at its wall-clock `now_ms`, for the others' view
    /// (`/v1/status`). A store of one process keeps nothing.
    async fn replica_seen(&self, _id: &str, _now_ms: u64) -> Result<(), StoreError> {
        Ok(())
    }

    /// The replicas last seen at or after `since_ms`, with when, by id; those not seen for
    /// [`REPLICAS_FORGOTTEN_AFTER_MS`] before `since_ms` are forgotten.
    async fn replicas(&self, _since_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        Ok(Vec::new())
    }

    /// Forgets replica `id` (it stops).
    async fn replica_gone(&self, _id: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A replica not seen for this long (an hour) is forgotten by the store.
pub const REPLICAS_FORGOTTEN_AFTER_MS: u64 = 3_600_000;

/// What a store does with a replica last seen at `at` when asked for those seen since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaAge {
    /// Listed.
    Seen(u64),
    /// Kept, not listed.
    Silent,
    /// Silent for [`REPLICAS_FORGOTTEN_AFTER_MS`] before `since`, or seen that far after it
    /// (a clock, or a hand, that wrote nonsense): removed.
    Forgotten,
}

/// See [`ReplicaAge`].
pub fn replica_age(at: u64, since_ms: u64) -> ReplicaAge {
    if at > since_ms.saturating_add(REPLICAS_FORGOTTEN_AFTER_MS)
        || at < since_ms.saturating_sub(REPLICAS_FORGOTTEN_AFTER_MS)
    {
        ReplicaAge::Forgotten
    } else if at >= since_ms {
        ReplicaAge::Seen(at)
    } else {
        ReplicaAge::Silent
    }
}

/// Replicas a store lists at most.
pub const REPLICAS_LISTED_MAX: usize = 1000;

/// A fence store as fencegate opens one: fences, leases, idempotency records and uploads in one
/// place.
pub trait Store: FenceStore + LeaseStore + IdempotencyStore + UploadStore + ListingStore + ReplicaList {}

impl<T: FenceStore + LeaseStore + IdempotencyStore + UploadStore + ListingStore + ReplicaList> Store for T {}

/// The answer of a shared store to "may this write go ahead?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedAdmit {
    /// The token is the fence (`advanced`: this call raised it) and no older write is in
    /// flight on any replica; the write is registered (if a member was given).
    /// `repaired_from`: the store had fallen below the caller's floor (failover, restore, a
    /// restart without persistence) and was raised back; the value it had.
    Admitted { advanced: bool, repaired_from: Option<Option<FenceToken>> },
    /// Older than the fence.
    Stale { current: FenceToken },
    /// Above the fence, from a write that may not raise it (`fencing.advance = "registration"`).
    Unregistered { current: Option<FenceToken>, repaired_from: Option<Option<FenceToken>> },
    /// Older writes are still in flight somewhere (and within their deadline): ask again.
    OlderInflight { advanced: bool, repaired_from: Option<Option<FenceToken>> },
}

/// The in-flight registry and advance announcements of a store shared by several replicas.
#[async_trait]
pub trait SharedRegistry: Send + Sync {
    /// Checks `token` against the fence (raising it, and first raising the store back to
    /// `floor` if it fell below) and, if `register`, registers a write with `token` as in
    /// flight on this replica unless an older write is in flight. The store keeps the
    /// registration for `InflightBounds::registration_ttl` of the in-flight deadline
    /// (`inflight_deadline_ms`) on its own clock, renewed while writes use it. Every admitted registered write is ended by [`Self::release`].
    async fn admit(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        register: bool,
        may_advance: bool,
        inflight_deadline_ms: u64,
    ) -> Result<SharedAdmit, StoreError>;

    /// A registered write has finished. Never waits: the store withdraws the registration in
    /// the background (at once, or after a short linger for the next write with that token).
    fn release(&self, resource: &ResourceKey, token: FenceToken);

    /// Whether this replica's registration of `token` on `resource` is certainly still in the
    /// store: renewed recently enough, and not revoked. Checked before a write hands over its
    /// whole body.
    fn still_registered(&self, resource: &ResourceKey, token: FenceToken) -> bool;

    /// What the store learns about this replica's writes on its own: advances announced by
    /// any replica, and registrations it could not keep. Taken once, by the gate.
    fn take_events(&self) -> Option<tokio::sync::mpsc::Receiver<StoreEvent>>;
}

/// News from a shared store that the gate acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreEvent {
    /// The fence of `resource` is now at least `fence` (announced by a replica, or seen when a
    /// registration was renewed): older writes still streaming here are cut off.
    Advanced { resource: ResourceKey, fence: FenceToken },
    /// This replica's registration of `token` on `resource` is gone or could not be renewed in
    /// time: its writes with `token` or older that have not sent their whole body must stop
    /// now, before another replica can admit a newer token.
    Revoked { resource: ResourceKey, token: FenceToken },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Listed from `since` on; kept an hour before it; forgotten before that, or an hour past
    /// it (a date no clock should write).
    #[test]
    fn replicas_age_from_seen_to_forgotten() {
        let (since, hour) = (10 * REPLICAS_FORGOTTEN_AFTER_MS, REPLICAS_FORGOTTEN_AFTER_MS);
        assert_eq!(replica_age(since, since), ReplicaAge::Seen(since));
        assert_eq!(replica_age(since + hour, since), ReplicaAge::Seen(since + hour));
        assert_eq!(replica_age(since - 1, since), ReplicaAge::Silent);
        assert_eq!(replica_age(since - hour, since), ReplicaAge::Silent);
        assert_eq!(replica_age(since - hour - 1, since), ReplicaAge::Forgotten);
        assert_eq!(replica_age(since + hour + 1, since), ReplicaAge::Forgotten);
        assert_eq!(replica_age(u64::MAX, since), ReplicaAge::Forgotten);
        assert_eq!(replica_age(0, 0), ReplicaAge::Seen(0));
    }
}
