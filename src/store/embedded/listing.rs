//! The embedded store's listings: ranges of its tables, read on the blocking pool (a page may
//! touch pages of the file no write keeps cached).

use std::ops::Bound;

use async_trait::async_trait;
use redb::ReadableDatabase;

use super::{EmbeddedStore, FENCES, LEASES};
use crate::fence::{FencePage, FenceToken, LeaseRecord, ListingStore, ResourceKey, StoreError, listing_start};

#[async_trait]
impl ListingStore for EmbeddedStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        self.check_poisoned()?;
        let (db, prefix, after, limit) = (self.db.clone(), prefix.to_owned(), after.map(str::to_owned), limit.max(1));
        let read = move || -> Result<Vec<(String, u64)>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(FENCES)?;
            let start = listing_start(&prefix, after.as_deref());
            let mut out = Vec::with_capacity(limit + 1);
            for entry in table.range::<&str>((start, Bound::Unbounded))? {
                let (key, token) = entry?;
                if !key.value().starts_with(prefix.as_str()) || out.len() > limit {
                    break;
                }
                out.push((key.value().to_owned(), token.value()));
            }
            Ok(out)
        };
        let rows = blocking(read).await?;
        let fences = rows
            .into_iter()
            .map(|(resource, token)| Ok((resource_of(&resource)?, FenceToken(token))))
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(FencePage::of(fences, limit))
    }

    async fn leases(&self, prefix: &str, limit: usize) -> Result<Vec<(ResourceKey, LeaseRecord)>, StoreError> {
        self.check_poisoned()?;
        let (db, prefix, limit) = (self.db.clone(), prefix.to_owned(), limit.max(1));
        let read = move || -> Result<Vec<(String, String)>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(LEASES)?;
            let mut out = Vec::new();
            for entry in table.range::<&str>(prefix.as_str()..)? {
                let (key, json) = entry?;
                if !key.value().starts_with(prefix.as_str()) || out.len() == limit {
                    break;
                }
                out.push((key.value().to_owned(), json.value().to_owned()));
            }
            Ok(out)
        };
        let rows = blocking(read).await?;
        rows.into_iter()
            .map(|(resource, json)| {
                let lease = serde_json::from_str(&json).map_err(|e| StoreError::Backend(Box::new(e)))?;
                Ok((resource_of(&resource)?, lease))
            })
            .collect()
    }
}

async fn blocking<T: Send + 'static>(
    read: impl FnOnce() -> Result<T, redb::Error> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| StoreError::Backend(Box::new(e)))?
        .map_err(|e| StoreError::Backend(Box::new(e)))
}

fn resource_of(name: &str) -> Result<ResourceKey, StoreError> {
    ResourceKey::new(name).map_err(|e| StoreError::Backend(Box::new(e)))
}
