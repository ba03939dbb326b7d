//! The upload records in etcd, one key each under `fg/u/`, and their counts under `fg/n/`:
//! `all` (count and bytes), `c/<caller>` and `r/<resource>`. A record is written in one
//! transaction with its counts, on the condition that none of them changed since they were
//! read: the bounds (`crate::fence::RecordLimits`) hold across replicas. Every new upload
//! writes `all`, so concurrent creations retry each other; creations are rare next to writes.

use std::collections::BTreeMap;

use super::*;
use crate::fence::{Keep, Kept, Owner, RecordLimits};

fn all_key() -> String {
    format!("{TALLY}all")
}

fn caller_key(caller: &str) -> String {
    format!("{TALLY}c/{caller}")
}

fn resource_key(resource: &str) -> String {
    format!("{TALLY}r/{resource}")
}

/// Who a stored record counts against. A value that is no record counts its bytes against
/// nobody, rather than failing every change of it.
fn owner_of(name: &str, json: &[u8]) -> Owner {
    match serde_json::from_slice::<UploadRecord>(json) {
        Ok(record) => record.owner(std::str::from_utf8(json).unwrap_or_default()),
        Err(_) => Owner { caller: String::new(), resource: String::new(), bytes: (name.len() + json.len()) as u64 },
    }
}

fn number(read: &Read) -> i64 {
    read.value.as_deref().and_then(|v| std::str::from_utf8(v).ok()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// `all`'s value: "count bytes".
fn count_and_bytes(read: &Read) -> (i64, i64) {
    let text = read.value.as_deref().and_then(|v| std::str::from_utf8(v).ok()).unwrap_or("");
    let mut parts = text.split(' ').map(|n| n.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

impl EtcdStore {
    /// Writes `new` in place of `old` (what the record under `key`, read as `current`, counts
    /// against), or removes it (`new` = `None`), with the counts. `None`: another writer
    /// changed the record or a count first (read again and retry).
    async fn counted(
        &self,
        key: &str,
        current: &Read,
        new: Option<(&str, Owner)>,
        limits: &RecordLimits,
    ) -> Result<Option<Keep>, StoreError> {
        let old = current.value.as_deref().map(|v| owner_of(key, v));
        let mut deltas: BTreeMap<String, i64> = BTreeMap::new();
        let mut all_delta = (0i64, 0i64);
        for (owner, sign) in old.iter().map(|o| (o, -1)).chain(new.iter().map(|(_, o)| (o, 1))) {
            *deltas.entry(caller_key(&owner.caller)).or_default() += sign;
            *deltas.entry(resource_key(&owner.resource)).or_default() += sign;
            all_delta = (all_delta.0 + sign, all_delta.1 + sign * i64::try_from(owner.bytes).unwrap_or(i64::MAX));
        }
        let all = all_key();
        let keys: Vec<&str> = std::iter::once(all.as_str()).chain(deltas.keys().map(String::as_str)).collect();
        let reads = self.read(&keys).await?;
        let counts: BTreeMap<&str, &Read> = keys.iter().copied().zip(reads.iter()).collect();
        let (count, bytes) = count_and_bytes(counts[all.as_str()]);
        if let (Some((_, owner)), None) = (&new, &old) {
            let at_least_0 = |n: i64| u64::try_from(n).unwrap_or(0);
            let kept = Kept {
                caller: at_least_0(number(counts[caller_key(&owner.caller).as_str()])),
                resource: at_least_0(number(counts[resource_key(&owner.resource).as_str()])),
                count: at_least_0(count),
                bytes: at_least_0(bytes),
            };
            if let Some(full) = limits.refuses(kept, owner.bytes) {
                return Ok(Some(Keep::Full(full)));
            }
        }
        let mut when = vec![current.unchanged(key)];
        when.extend(counts.iter().map(|(k, read)| read.unchanged(k)));
        let mut ops = vec![match &new {
            Some((json, _)) => TxnOp::put(key, *json, None),
            None => TxnOp::delete(key, None),
        }];
        let (count, bytes) = ((count + all_delta.0).max(0), (bytes + all_delta.1).max(0));
        ops.push(TxnOp::put(all.as_str(), format!("{count} {bytes}"), None));
        for (k, delta) in &deltas {
            match number(counts[k.as_str()]) + delta {
                n if n > 0 => ops.push(TxnOp::put(k.as_str(), n.to_string(), None)),
                _ => ops.push(TxnOp::delete(k.as_str(), None)),
            }
        }
        Ok(self.commit(when, ops).await?.then_some(Keep::Kept))
    }
}

#[async_trait]
impl UploadStore for EtcdStore {
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError> {
        let key = upload_key(&record.bucket, &record.upload_id);
        let json = record.to_json();
        let attempts = Attempts::new(self.timeout);
        loop {
            let current = self.read(&[&key]).await?.remove(0);
            if let Some(keep) = self.counted(&key, &current, Some((&json, record.owner(&json))), limits).await? {
                return Ok(keep);
            }
            attempts.again()?;
        }
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        let read = self.read(&[&upload_key(bucket, upload_id)]).await?.remove(0);
        read.value.as_deref().map(|v| serde_json::from_slice(v).map_err(|_| corrupt("upload record"))).transpose()
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        let key = upload_key(bucket, upload_id);
        let attempts = Attempts::new(self.timeout);
        loop {
            let current = self.read(&[&key]).await?.remove(0);
            if current.value.is_none() || self.counted(&key, &current, None, &RecordLimits::default()).await?.is_some()
            {
                return Ok(());
            }
            attempts.again()?;
        }
    }

    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        let limit = limit.max(1);
        let from = format!("{UPLOADS}{}", cursor.unwrap_or_default());
        let range = || {
            let (mut kv, from) = (self.client.kv_client(), from.clone());
            let options =
                GetOptions::new().with_range(UPLOADS_END).with_limit(i64::try_from(limit + 1).unwrap_or(i64::MAX));
            async move { kv.get(from, Some(options)).await }
        };
        let resp = read_bounded(self.timeout, range).await?;
        let mut records = resp
            .kvs()
            .iter()
            .map(|kv| serde_json::from_slice(kv.value()).map_err(|_| corrupt("upload record")))
            .collect::<Result<Vec<UploadRecord>, _>>()?;
        let next = (records.len() > limit).then(|| records.pop().expect("one past the page").storage_name());
        Ok(UploadPage { records, next })
    }
}
