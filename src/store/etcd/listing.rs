//! The etcd store's listings: ranges of its keys, which etcd keeps in byte order, read a page
//! at a time (`limit` + 1 keys, the one past the page telling whether more follow).

use std::ops::Bound;

use async_trait::async_trait;
use etcd_client::GetOptions;

use super::{EtcdStore, FENCES, LEASES, corrupt, read_bounded};
use crate::fence::{FencePage, FenceToken, LeaseRecord, ListingStore, ResourceKey, StoreError, listing_start};

#[async_trait]
impl ListingStore for EtcdStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        let limit = limit.max(1);
        let from = match listing_start(prefix, after) {
            Bound::Excluded(after) => format!("{FENCES}{after}\0"),
            _ => format!("{FENCES}{prefix}"),
        };
        let mut fences = Vec::new();
        for (resource, value) in self.range(from, FENCES, prefix, limit + 1).await? {
            let token = FenceToken::parse(&value).ok();
            fences.push((resource, token.ok_or_else(|| corrupt("fence"))?));
        }
        Ok(FencePage::of(fences, limit))
    }

    async fn leases(&self, prefix: &str, limit: usize) -> Result<Vec<(ResourceKey, LeaseRecord)>, StoreError> {
        let rows = self.range(format!("{LEASES}{prefix}"), LEASES, prefix, limit.max(1)).await?;
        rows.into_iter()
            .map(|(resource, value)| Ok((resource, serde_json::from_slice(&value).map_err(|_| corrupt("lease"))?)))
            .collect()
    }
}

impl EtcdStore {
    /// At most `limit` keys from `from` up to the end of `space` + `prefix`, as resources and
    /// values.
    async fn range(
        &self,
        from: String,
        space: &str,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(ResourceKey, Vec<u8>)>, StoreError> {
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
