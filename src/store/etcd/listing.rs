//! The etcd store's listings: ranges of its keys, which etcd keeps in byte order, read a page
//! at a time (`limit` + 1 keys, the one past the page telling whether more follow).

use std::ops::Bound;

use async_trait::async_trait;
use etcd_client::{GetOptions, TxnOp};

use super::{EtcdStore, FENCES, LEASES, RECORDS, RECORDS_END, corrupt, read_bounded};
use crate::fence::{
    FencePage, FenceToken, LeasePage, ListingStore, Page, REPLICAS_LISTED_MAX, RecordPage, ReplicaAge, ReplicaList,
    ResourceKey, StoreError, listing_start, replica_age,
};

/// The first key after every idempotency record's.
/// The replicas seen, one key each (`fg/r/<id>`): when it last said it was up (its wall clock,
/// ms).
const REPLICAS: &str = "fg/r/";
const REPLICAS_END: &str = "fg/r0";
/// Replicas forgotten in one transaction at most.
const REPLICAS_FORGOTTEN_PER_TXN: usize = 64;

#[async_trait]
impl ListingStore for EtcdStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        let limit = limit.max(1);
        let mut fences = Vec::new();
        for (resource, value) in self.range(FENCES, prefix, after, limit + 1).await? {
            let token = FenceToken::parse(&value).ok();
            fences.push((resource, token.ok_or_else(|| corrupt("fence"))?));
        }
        Ok(FencePage::of(fences, limit))
    }

    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        let limit = limit.max(1);
        let rows = self.range(LEASES, prefix, after, limit + 1).await?;
        let leases = rows
            .into_iter()
            .map(|(resource, value)| Ok((resource, serde_json::from_slice(&value).map_err(|_| corrupt("lease"))?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Page::of(leases, limit))
    }

    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        let limit = limit.max(1);
        let from = format!("{RECORDS}{}", cursor.unwrap_or_default());
        let get = || {
            let (mut kv, from) = (self.client.kv_client(), from.clone());
            let options =
                GetOptions::new().with_range(RECORDS_END).with_limit(i64::try_from(limit + 1).unwrap_or(i64::MAX));
            async move { kv.get(from, Some(options)).await }
        };
        let resp = read_bounded(self.timeout, get).await?;
        let mut kvs = resp.kvs().iter().collect::<Vec<_>>();
        let mut page = RecordPage::default();
        if kvs.len() > limit {
            let past = kvs.pop().expect("one past the page");
            page.next = Some(String::from_utf8_lossy(&past.key()[RECORDS.len()..]).into_owned());
        }
        for kv in kvs {
            let name = String::from_utf8_lossy(kv.key().strip_prefix(RECORDS.as_bytes()).unwrap_or(kv.key()));
            let resource = name.rsplit_once('\0').and_then(|(r, _)| ResourceKey::new(r).ok());
            page.read(&name, resource, kv.value());
        }
        Ok(page)
    }
}

/// Each replica's id and when it last said it was up (its wall clock, ms).
#[async_trait]
impl ReplicaList for EtcdStore {
    async fn replica_seen(&self, id: &str, now_ms: u64) -> Result<(), StoreError> {
        let put = TxnOp::put(format!("{REPLICAS}{id}"), now_ms.to_string(), None);
        self.commit(vec![], vec![put]).await.map(|_| ())
    }

    async fn replicas(&self, since_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        let get = || {
            let mut kv = self.client.kv_client();
            let limit = i64::try_from(REPLICAS_LISTED_MAX).unwrap_or(i64::MAX);
            async move { kv.get(REPLICAS, Some(GetOptions::new().with_range(REPLICAS_END).with_limit(limit))).await }
        };
        let resp = read_bounded(self.timeout, get).await?;
        let (mut seen, mut forgotten) = (Vec::new(), Vec::new());
        for kv in resp.kvs() {
            let id = kv.key_str().ok().and_then(|k| k.strip_prefix(REPLICAS));
            let at = kv.value_str().ok().and_then(|v| v.parse::<u64>().ok());
            match (id, at.map(|at| replica_age(at, since_ms))) {
                (Some(id), Some(ReplicaAge::Seen(at))) => seen.push((id.to_owned(), at)),
                (Some(_), Some(ReplicaAge::Silent)) => {}
                _ => forgotten.push(TxnOp::delete(kv.key().to_vec(), None)),
            }
        }
        // A few at a time (etcd takes 128 changes a transaction by default); one that fails
        // is tried again on the next listing, and lists nobody less.
        for chunk in forgotten.chunks(REPLICAS_FORGOTTEN_PER_TXN) {
            if let Err(error) = self.commit(vec![], chunk.to_vec()).await {
                tracing::debug!(%error, "cannot forget long silent replicas");
                break;
            }
        }
        Ok(seen)
    }

    async fn replica_gone(&self, id: &str) -> Result<(), StoreError> {
        self.commit(vec![], vec![TxnOp::delete(format!("{REPLICAS}{id}"), None)]).await.map(|_| ())
    }
}

impl EtcdStore {
    /// At most `limit` keys of `space` whose resource starts with `prefix`, from its start or
    /// after `after`, as resources and values.
    async fn range(
        &self,
        space: &str,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(ResourceKey, Vec<u8>)>, StoreError> {
        let from = match listing_start(prefix, after) {
            Bound::Excluded(after) => format!("{space}{after}\0"),
            _ => format!("{space}{prefix}"),
        };
        let end = prefix_end(format!("{space}{prefix}").into_bytes());
        let get = || {
            let (mut kv, from, end) = (self.client.kv_client(), from.clone(), end.clone());
            let options = GetOptions::new().with_range(end).with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
            async move { kv.get(from, Some(options)).await }
        };
        let resp = read_bounded(self.timeout, get).await?;
        resp.kvs()
            .iter()
            .map(|kv| {
                let name = kv.key_str().ok().and_then(|k| k.strip_prefix(space)).ok_or_else(|| corrupt("key"))?;
                let resource = ResourceKey::new(name).map_err(|_| corrupt("resource name"))?;
                Ok((resource, kv.value().to_vec()))
            })
            .collect()
    }
}

/// The first key after every key that starts with `prefix` (never empty here: the key spaces
/// are not, and UTF-8 has no byte 0xff to carry over).
fn prefix_end(mut prefix: Vec<u8>) -> Vec<u8> {
    while let Some(last) = prefix.pop() {
        if last < 0xff {
            prefix.push(last + 1);
            break;
        }
    }
    prefix
}
