//! A fence store in memory: not durable, so never selectable by config. It exists for unit
//! tests of the gate and as the reference the other stores are compared with.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;

use crate::fence::{
    AdvanceOutcome, FencePage, FenceStore, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord,
    IdempotencyStore, Keep, LeaseCommand, LeaseOutcome, LeasePage, LeaseRecord, LeaseStore, LeaseWrite, ListingStore,
    Owner, Page, RecordLimits, RecordPage, ResourceKey, StoreError, Tally, UploadPage, UploadRecord, UploadStore,
    apply_lease, listing_start,
};

#[derive(Default)]
pub struct MemoryStore {
    fences: Mutex<HashMap<ResourceKey, FenceToken>>,
    leases: Mutex<HashMap<ResourceKey, LeaseRecord>>,
    idempotency: Mutex<HashMap<IdempotencyKey, IdempotencyRecord>>,
    uploads: Mutex<Uploads>,
    /// Makes every call fail, to test that callers fail closed.
    failing: AtomicBool,
}

/// The upload records, each with what it counts, and their tally.
#[derive(Default)]
struct Uploads {
    records: BTreeMap<String, (UploadRecord, Owner)>,
    tally: Tally,
}

impl MemoryStore {
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Backend("memory store told to fail".into()));
        }
        Ok(())
    }
}

#[async_trait]
impl FenceStore for MemoryStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.check()?;
        Ok(self.fences.lock().expect("memory store lock").get(resource).copied())
    }

    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        self.check()?;
        let mut fences = self.fences.lock().expect("memory store lock");
        let previous = fences.get(resource).copied();
        match previous {
            Some(current) if current >= token => Ok(AdvanceOutcome::Unchanged { current }),
            _ => {
                fences.insert(resource.clone(), token);
                Ok(AdvanceOutcome::Advanced { previous })
            }
        }
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.check()
    }
}

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        self.check()?;
        let mut fences = self.fences.lock().expect("memory store lock");
        let mut leases = self.leases.lock().expect("memory store lock");
        let t = apply_lease(fences.get(resource).copied(), leases.get(resource), command, now_ms);
        if let Some(fence) = t.fence {
            fences.insert(resource.clone(), fence);
        }
        match t.lease {
            LeaseWrite::Keep => {}
            LeaseWrite::Put(record) => {
                leases.insert(resource.clone(), record);
            }
            LeaseWrite::Delete => {
                leases.remove(resource);
            }
        }
        Ok(t.outcome)
    }

    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        self.check()?;
        Ok(self.leases.lock().expect("memory store lock").get(resource).cloned())
    }
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        self.check()?;
        let mut records = self.idempotency.lock().expect("memory store lock");
        records.retain(|_, r| !r.is_expired(now_ms));
        if let Some(existing) = records.get(key) {
            return Ok(IdempotencyBegin::Existing(existing.clone()));
        }
        records.insert(key.clone(), claim.clone());
        Ok(IdempotencyBegin::Claimed)
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.check()?;
        let records = self.idempotency.lock().expect("memory store lock");
        Ok(records.get(key).filter(|r| !r.is_expired(now_ms)).cloned())
    }

    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        self.check()?;
        let mut records = self.idempotency.lock().expect("memory store lock");
        let Some(current) = records.get_mut(key).filter(|r| r.claim == claim) else {
            return Ok(());
        };
        match record {
            Some(record) => {
                let expires_at_ms = current.expires_at_ms;
                *current = IdempotencyRecord { expires_at_ms, ..record.clone() };
            }
            None => {
                records.remove(key);
            }
        }
        Ok(())
    }
}

#[async_trait]
impl UploadStore for MemoryStore {
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError> {
        self.check()?;
        let mut uploads = self.uploads.lock().expect("memory store lock");
        let name = record.storage_name();
        let owner = record.owner(&record.to_json());
        let old = uploads.records.get(&name).map(|(_, owner)| owner.clone());
        let keep = uploads.tally.put(old.as_ref(), &owner, limits);
        if keep == Keep::Kept {
            uploads.records.insert(name, (record.clone(), owner));
        }
        Ok(keep)
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        self.check()?;
        let uploads = self.uploads.lock().expect("memory store lock");
        Ok(uploads.records.get(&UploadRecord::name(bucket, upload_id)).map(|(record, _)| record.clone()))
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        self.check()?;
        let mut uploads = self.uploads.lock().expect("memory store lock");
        if let Some((_, owner)) = uploads.records.remove(&UploadRecord::name(bucket, upload_id)) {
            uploads.tally.remove(&owner);
        }
        Ok(())
    }

    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        self.check()?;
        let uploads = self.uploads.lock().expect("memory store lock");
        let from = cursor.unwrap_or_default();
        let mut records: Vec<UploadRecord> =
            uploads.records.range(from..).take(limit.max(1) + 1).map(|(_, (r, _))| r.clone()).collect();
        let next = (records.len() > limit.max(1)).then(|| records.pop().expect("one past the page").storage_name());
        Ok(UploadPage { records, next })
    }
}

impl crate::fence::ReplicaList for MemoryStore {}

#[async_trait]
impl ListingStore for MemoryStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        self.check()?;
        Ok(page_of(&self.fences.lock().expect("memory store lock"), prefix, after, limit))
    }

    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        self.check()?;
        Ok(page_of(&self.leases.lock().expect("memory store lock"), prefix, after, limit))
    }

    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        self.check()?;
        let limit = limit.max(1);
        let records = self.idempotency.lock().expect("memory store lock");
        let mut named: Vec<(String, &IdempotencyKey, &IdempotencyRecord)> = records
            .iter()
            .map(|(k, r)| (k.storage_name(), k, r))
            .filter(|(name, _, _)| cursor.as_ref().is_none_or(|c| name >= c))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let next = named.get(limit).map(|(name, _, _)| name.clone());
        let records = named.into_iter().take(limit).map(|(_, k, r)| (k.resource().clone(), r.clone())).collect();
        Ok(RecordPage { records, next, ..RecordPage::default() })
    }
}

/// The page of a listing of `map` (prefix, after, limit as [`ListingStore::fences`]).
fn page_of<T: Clone>(map: &HashMap<ResourceKey, T>, prefix: &str, after: Option<&str>, limit: usize) -> Page<T> {
    let limit = limit.max(1);
    let start = listing_start(prefix, after);
    let mut page: Vec<(ResourceKey, T)> = map
        .iter()
        .filter(|(r, _)| {
            let r = r.as_str();
            r.starts_with(prefix)
                && match start {
                    std::ops::Bound::Excluded(after) => r > after,
                    _ => true,
                }
        })
        .map(|(r, t)| (r.clone(), t.clone()))
        .collect();
    page.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
    page.truncate(limit + 1);
    Page::of(page, limit)
}
