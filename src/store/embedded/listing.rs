//! The embedded store's listings: ranges of its tables, read on the blocking pool (a page may
//! touch pages of the file no write keeps cached).

use std::ops::Bound;

use async_trait::async_trait;
use redb::ReadableDatabase;

use super::{EmbeddedStore, FENCES, IDEMPOTENCY, LEASES};
use crate::fence::{
    FencePage, FenceToken, IdempotencyKey, LeasePage, ListingStore, Page, RecordPage, ResourceKey, StoreError,
    listing_start,
};

/// One process: no list of replicas.
impl crate::fence::ReplicaList for EmbeddedStore {}

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

    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        self.check_poisoned()?;
        let rows = self.range(LEASES, prefix, after, limit.max(1)).await?;
        let leases = rows
            .into_iter()
            .map(|(resource, json)| {
                let lease = serde_json::from_str(&json).map_err(|e| StoreError::Backend(Box::new(e)))?;
                Ok((resource_of(&resource)?, lease))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(Page::of(leases, limit.max(1)))
    }

    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        self.check_poisoned()?;
        let (db, limit) = (self.db.clone(), limit.max(1));
        let read = move || -> Result<Vec<(String, Vec<u8>)>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(IDEMPOTENCY)?;
            let from = cursor.unwrap_or_default();
            let mut out = Vec::with_capacity(limit + 1);
            for entry in table.range(from.as_str()..)?.take(limit + 1) {
                let (name, value) = entry?;
                out.push((name.value().to_owned(), value.value().2.to_vec()));
            }
            Ok(out)
        };
        let mut rows = blocking(read).await?;
        let next = (rows.len() > limit).then(|| rows.pop().expect("one past the page").0);
        let mut page = RecordPage { next, ..RecordPage::default() };
        for (name, json) in rows {
            page.read(&name, IdempotencyKey::resource_of_storage_name(&name), &json);
        }
        Ok(page)
    }
}

impl EmbeddedStore {
    /// Up to `limit` + 1 rows of a table keyed by resource, from the start of `prefix` or after
    /// `after`, as names and values.
    async fn range(
        &self,
        table: redb::TableDefinition<'static, &'static str, &'static str>,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let (db, prefix, after) = (self.db.clone(), prefix.to_owned(), after.map(str::to_owned));
        let read = move || -> Result<Vec<(String, String)>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(table)?;
            let start = listing_start(&prefix, after.as_deref());
            let mut out = Vec::with_capacity(limit + 1);
            for entry in table.range::<&str>((start, Bound::Unbounded))? {
                let (key, value) = entry?;
                if !key.value().starts_with(prefix.as_str()) || out.len() > limit {
                    break;
                }
                out.push((key.value().to_owned(), value.value().to_owned()));
            }
            Ok(out)
        };
        blocking(read).await
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
