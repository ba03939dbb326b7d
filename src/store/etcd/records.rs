//! What the etcd store keeps beside the fences: leases, the API gateway's idempotency
//! records and the records of multipart uploads made with a token.

use super::*;

/// The transaction step that writes a lease as `write` says.
fn lease_write(write: &LeaseWrite, lkey: &str) -> Option<TxnOp> {
    match write {
        LeaseWrite::Keep => None,
        LeaseWrite::Put(record) => {
            let json = serde_json::to_vec(record).expect("a lease record serialises");
            Some(TxnOp::put(lkey, json, None))
        }
        LeaseWrite::Delete => Some(TxnOp::delete(lkey, None)),
    }
}

/// A grant over a store whose fence was below this replica's mark (`floor`): told loudly.
fn granted_above_floor(resource: &ResourceKey, stored: Option<FenceToken>, floor: FenceToken) {
    if stored.is_some_and(|s| s >= floor) {
        return;
    }
    metrics::store_rollback_repaired();
    tracing::error!(
        resource = resource.as_str(),
        store_had = stored.map(|t| t.0),
        floor = floor.0,
        "FENCE STORE ROLLBACK: etcd's fence was below this replica's mark at a lease grant \
         (restored from an older backup?); granted above the mark"
    );
}

#[async_trait]
impl LeaseStore for EtcdStore {
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        let (fkey, lkey) = (fence_key(resource), lease_key(resource));
        // A grant and its withdrawal meet at the withdrawn grant's tombstone.
        let tkey = match &command {
            LeaseCommand::Acquire { lease_id, .. } | LeaseCommand::Withdraw { lease_id } => {
                Some(withdrawn_key(resource, lease_id))
            }
            _ => None,
        };
        let attempts = Attempts::new(self.timeout);
        let mut tombstone_lease = None;
        loop {
            let mut reads = self.read(&[&fkey, &lkey, tkey.as_deref().unwrap_or(&lkey)]).await?;
            let (withdrawn, lease, fence) = (reads.remove(2), reads.remove(1), reads.remove(0));
            let stored = fence.token()?;
            let current: Option<LeaseRecord> =
                lease.value.as_deref().map(|v| serde_json::from_slice(v).map_err(|_| corrupt("lease"))).transpose()?;
            let mut when = vec![fence.unchanged(&fkey), lease.unchanged(&lkey)];
            let mut ops = Vec::new();
            match (&command, &tkey) {
                (LeaseCommand::Acquire { .. }, Some(tkey)) => {
                    if withdrawn.value.is_some() {
                        return Ok(LeaseOutcome::Gone);
                    }
                    when.push(withdrawn.unchanged(tkey));
                }
                (LeaseCommand::Withdraw { .. }, Some(tkey)) => {
                    let id = match tombstone_lease {
                        Some(id) => id,
                        None => *tombstone_lease.insert(self.grant_lease(ttl_seconds(WITHDRAWN_GRANT_TTL_MS)).await?),
                    };
                    ops.push(TxnOp::put(tkey.as_str(), "", Some(PutOptions::new().with_lease(id))));
                }
                _ => {}
            }
            let transition = apply_lease(stored, current.as_ref(), command.clone(), now_ms);
            if let Some(new) = transition.fence {
                ops.push(TxnOp::put(fkey.as_str(), new.0.to_string(), None));
            }
            ops.extend(lease_write(&transition.lease, &lkey));
            if ops.is_empty() || self.commit(when, ops).await? {
                if let (LeaseOutcome::Granted(_), LeaseCommand::Acquire { floor: Some(floor), .. }) =
                    (&transition.outcome, &command)
                {
                    granted_above_floor(resource, stored, *floor);
                }
                return Ok(transition.outcome);
            }
            attempts.again()?;
        }
    }

    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        let read = self.read(&[&lease_key(resource)]).await?.remove(0);
        read.value.as_deref().map(|v| serde_json::from_slice(v).map_err(|_| corrupt("lease"))).transpose()
    }
}

#[async_trait]
impl IdempotencyStore for EtcdStore {
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        let rkey = record_key(key);
        let attempts = Attempts::new(self.timeout);
        let mut granted: Option<i64> = None;
        let outcome = loop {
            let read = self.read(&[&rkey]).await?.remove(0);
            if let Some(existing) = decode_record(&read)?.filter(|r| !r.is_expired(now_ms)) {
                break IdempotencyBegin::Existing(existing);
            }
            if granted.is_none()
                && self.records_kept().await? >= self.records_max.load(std::sync::atomic::Ordering::Relaxed)
            {
                crate::metrics::idempotency_records_full();
                break IdempotencyBegin::Full;
            }
            // etcd drops the record when its retention is up.
            let lease = match granted {
                Some(id) => id,
                None => {
                    let ttl = ttl_seconds(claim.expires_at_ms.saturating_sub(now_ms));
                    let id = self.grant_lease(ttl).await?;
                    *granted.insert(id)
                }
            };
            let json = serde_json::to_vec(claim).expect("an idempotency record serialises");
            let put = TxnOp::put(rkey.as_str(), json, Some(PutOptions::new().with_lease(lease)));
            if self.commit(vec![read.unchanged(&rkey)], vec![put]).await? {
                return Ok(IdempotencyBegin::Claimed);
            }
            attempts.again()?;
        };
        if let Some(id) = granted {
            revoke_in_background(&self.client, id);
        }
        Ok(outcome)
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let read = self.read(&[&record_key(key)]).await?.remove(0);
        Ok(decode_record(&read)?.filter(|r| !r.is_expired(now_ms)))
    }

    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        let rkey = record_key(key);
        let attempts = Attempts::new(self.timeout);
        loop {
            let read = self.read(&[&rkey]).await?.remove(0);
            if decode_record(&read)?.is_none_or(|r| r.claim != claim) {
                return Ok(());
            }
            let op = match record {
                // Keeps the record's lease, so its expiry.
                Some(r) => TxnOp::put(
                    rkey.as_str(),
                    serde_json::to_vec(r).expect("an idempotency record serialises"),
                    Some(PutOptions::new().with_ignore_lease()),
                ),
                None => TxnOp::delete(rkey.as_str(), None),
            };
            if self.commit(vec![read.unchanged(&rkey)], vec![op]).await? {
                return Ok(());
            }
            attempts.again()?;
        }
    }
}

impl EtcdStore {
    /// How many idempotency records etcd keeps (it drops each when its retention is up).
    async fn records_kept(&self) -> Result<u64, StoreError> {
        let count = || {
            let mut kv = self.client.kv_client();
            let options = GetOptions::new().with_range(RECORDS_END).with_count_only();
            async move { kv.get(RECORDS, Some(options)).await }
        };
        Ok(u64::try_from(read_bounded(self.timeout, count).await?.count()).unwrap_or(0))
    }
}

pub(super) fn decode_record(read: &Read) -> Result<Option<IdempotencyRecord>, StoreError> {
    read.value.as_deref().map(|v| serde_json::from_slice(v).map_err(|_| corrupt("idempotency record"))).transpose()
}
