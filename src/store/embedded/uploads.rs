//! The upload records in the embedded store: one row per upload in `UPLOADS`, written by the
//! writer thread within the bounds of `crate::fence::RecordLimits`. The counts live in the
//! writer (one writer, one process: the store is claimed), rebuilt from the rows at open.

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable};
use tokio::sync::oneshot;

use super::{EmbeddedStore, UPLOADS, WriteRequest};
use crate::fence::{Keep, Owner, RecordLimits, StoreError, Tally, UploadPage, UploadRecord, UploadStore};

type Table<'txn> = redb::Table<'txn, &'static str, &'static str>;

/// The writer's counts of the upload records.
#[derive(Default)]
pub(super) struct Counted(Tally);

impl Counted {
    /// Counts the records of an opened file.
    pub(super) fn of(db: &Database) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let txn = db.begin_read()?;
        let table = txn.open_table(UPLOADS)?;
        let mut tally = Tally::default();
        for entry in table.iter()? {
            let (name, json) = entry?;
            tally.add(&owner(name.value(), json.value()));
        }
        Ok(Self(tally))
    }

    /// Keeps `json` under `name` (a new record within `limits`), or forgets the record.
    pub(super) fn write(
        &mut self,
        table: &mut Table<'_>,
        name: &str,
        json: Option<&str>,
        limits: &RecordLimits,
    ) -> Result<Keep, Box<dyn std::error::Error + Send + Sync>> {
        let old = table.get(name)?.map(|v| owner(name, v.value()));
        match json {
            Some(json) => {
                let keep = self.0.put(old.as_ref(), &owner(name, json), limits);
                if keep == Keep::Kept {
                    table.insert(name, json)?;
                }
                Ok(keep)
            }
            None => {
                if let Some(old) = old {
                    self.0.remove(&old);
                    table.remove(name)?;
                }
                Ok(Keep::Kept)
            }
        }
    }
}

/// Who a row counts against. A row that is no record (never written so) counts its bytes
/// against nobody, rather than making every later commit fail.
fn owner(name: &str, json: &str) -> Owner {
    match serde_json::from_str::<UploadRecord>(json) {
        Ok(record) => record.owner(json),
        Err(_) => Owner { caller: String::new(), resource: String::new(), bytes: (name.len() + json.len()) as u64 },
    }
}

#[async_trait]
impl UploadStore for EmbeddedStore {
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError> {
        let (reply, answer) = oneshot::channel();
        let request =
            WriteRequest::Upload { name: record.storage_name(), json: Some(record.to_json()), limits: *limits, reply };
        self.submit(request, answer).await
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        self.check_poisoned()?;
        let name = UploadRecord::name(bucket, upload_id);
        let read = || -> Result<Option<String>, redb::Error> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(UPLOADS)?;
            Ok(table.get(name.as_str())?.map(|v| v.value().to_owned()))
        };
        let json = read().map_err(|e| StoreError::Backend(Box::new(e)))?;
        json.map(|j| serde_json::from_str(&j).map_err(|e| StoreError::Backend(Box::new(e)))).transpose()
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        let name = UploadRecord::name(bucket, upload_id);
        let request = WriteRequest::Upload { name, json: None, limits: RecordLimits::default(), reply };
        self.submit(request, answer).await.map(drop)
    }

    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        self.check_poisoned()?;
        let db = self.db.clone();
        let limit = limit.max(1);
        let page = tokio::task::spawn_blocking(move || -> Result<Vec<String>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(UPLOADS)?;
            let from = cursor.unwrap_or_default();
            let mut jsons = Vec::with_capacity(limit + 1);
            for entry in table.range(from.as_str()..)?.take(limit + 1) {
                jsons.push(entry?.1.value().to_owned());
            }
            Ok(jsons)
        })
        .await
        .map_err(|e| StoreError::Backend(Box::new(e)))?
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
        let mut records = page
            .iter()
            .map(|j| serde_json::from_str(j).map_err(|e| StoreError::Backend(Box::new(e))))
            .collect::<Result<Vec<UploadRecord>, _>>()?;
        let next = (records.len() > limit).then(|| records.pop().expect("one past the page").storage_name());
        Ok(UploadPage { records, next })
    }
}
