//! Every call to the fence store, bounded by `store.timeout_ms` and counted in the store-call
//! metrics, written once for the gate and the API gateway. A store call that does not answer
//! in time is `StoreError::Timeout`: its outcome is unknown, and callers fail closed.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::millis;
use super::{
    AdvanceOutcome, FencePage, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord, Keep, LeaseCommand,
    LeaseOutcome, LeasePage, LeaseRecord, RecordLimits, RecordPage, ResourceKey, SharedRegistry, Store, StoreError,
    UploadPage, UploadRecord,
};
use crate::metrics;

/// The fence store with its deadline. Cheap to clone.
#[derive(Clone)]
pub struct TimedStore {
    store: Arc<dyn Store>,
    timeout: Duration,
}

impl TimedStore {
    pub fn new(store: Arc<dyn Store>, timeout: Duration) -> Self {
        Self { store, timeout }
    }

    pub fn kind(&self) -> &'static str {
        self.store.kind()
    }

    /// The cross-replica registry of a shared store (its calls bound themselves).
    pub fn shared(&self) -> Option<&dyn SharedRegistry> {
        self.store.shared()
    }

    pub(super) async fn call<T>(&self, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout { after_ms: millis(self.timeout) }),
        };
        metrics::store_call(self.store.kind(), started.elapsed(), result.is_ok());
        result
    }

    pub async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.call(self.store.load(resource)).await
    }

    pub async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        self.call(self.store.advance(resource, token)).await
    }

    pub async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        self.call(self.store.lease(resource, command, now_ms)).await
    }

    pub async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        self.call(self.store.lease_record(resource)).await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.call(self.store.ping()).await
    }

    /// The operator's listings, bounded by [`LISTING_TIMEOUT`] rather than the store timeout
    /// of a write's calls (a page of a Redis store is a walk of its keys), and not counted in
    /// the store-call metrics, which time writes.
    pub fn listings(&self) -> Listings {
        Listings(self.store.clone())
    }
}

/// How long a page of a listing may take.
pub const LISTING_TIMEOUT: Duration = Duration::from_secs(30);

/// The store's listings ([`TimedStore::listings`]).
pub struct Listings(Arc<dyn Store>);

impl Listings {
    pub async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        bounded(self.0.fences(prefix, after, limit)).await
    }

    pub async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        bounded(self.0.leases(prefix, after, limit)).await
    }

    pub async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        bounded(self.0.idempotency_records(cursor, limit)).await
    }

    pub async fn replica_seen(&self, id: &str, now_ms: u64) -> Result<(), StoreError> {
        bounded(self.0.replica_seen(id, now_ms)).await
    }

    pub async fn replicas(&self, since_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        bounded(self.0.replicas(since_ms)).await
    }

    pub async fn replica_gone(&self, id: &str) -> Result<(), StoreError> {
        bounded(self.0.replica_gone(id)).await
    }
}

async fn bounded<T>(call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    tokio::time::timeout(LISTING_TIMEOUT, call)
        .await
        .unwrap_or(Err(StoreError::Timeout { after_ms: millis(LISTING_TIMEOUT) }))
}

/// The API gateway's part of the store: its idempotency records, timed like every store call.
#[derive(Clone)]
pub struct IdempotencyRecords(TimedStore);

impl IdempotencyRecords {
    pub fn new(store: TimedStore) -> Self {
        Self(store)
    }

    /// See [`super::IdempotencyStore::idempotency_begin`].
    pub async fn begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        self.0.call(self.0.store.idempotency_begin(key, claim, now_ms)).await
    }

    /// See [`super::IdempotencyStore::idempotency_get`].
    pub async fn get(&self, key: &IdempotencyKey, now_ms: u64) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.0.call(self.0.store.idempotency_get(key, now_ms)).await
    }

    /// See [`super::IdempotencyStore::idempotency_finish`].
    pub async fn finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        self.0.call(self.0.store.idempotency_finish(key, claim, record)).await
    }
}

/// The multipart uploads made with a token, timed like every store call.
#[derive(Clone)]
pub struct UploadRecords {
    store: TimedStore,
    limits: RecordLimits,
}

impl UploadRecords {
    pub fn new(store: TimedStore, limits: RecordLimits) -> Self {
        Self { store, limits }
    }

    /// See [`super::UploadStore::upload_put`]: within the configured bounds.
    pub async fn put(&self, record: &UploadRecord) -> Result<Keep, StoreError> {
        let keep = self.store.call(self.store.store.upload_put(record, &self.limits)).await?;
        if let Keep::Full(full) = keep {
            crate::metrics::records_refused("upload", full.label());
        }
        Ok(keep)
    }

    /// See [`super::UploadStore::upload_get`].
    pub async fn get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        self.store.call(self.store.store.upload_get(bucket, upload_id)).await
    }

    /// See [`super::UploadStore::upload_remove`].
    pub async fn remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        self.store.call(self.store.store.upload_remove(bucket, upload_id)).await
    }

    /// See [`super::UploadStore::uploads`].
    pub async fn page(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        self.store.call(self.store.store.uploads(cursor, limit)).await
    }
}
