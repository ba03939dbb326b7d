//! The local store's records and its one commit: an object's name, metadata and data files
//! live in redb (`local.redb`), its bytes in files named by a fresh id (`data/<id>`), never by
//! the key. A key is a string like any other: `a` and `a/b` coexist, `a//b` is its own object,
//! and no two names reach the same bytes.
//!
//! A write streams its body to a new data file (synced) with no lock held, then commits its
//! record in one redb write transaction, which is also where its preconditions are judged:
//! a condition and the write it guards are one atomic step. Replaced data files are removed
//! after the commit. Crash points: before the commit, the new file is an orphan (no record
//! names it) and is removed at the next open; after it, the old files are orphans, likewise.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

/// Buckets: name → creation time (Unix ms).
const BUCKETS: TableDefinition<&str, u64> = TableDefinition::new("buckets");
/// Objects: `bucket/key` → [`ObjectRecord`] (JSON). Bucket names have no `/`, so the first `/`
/// ends the bucket, and a bucket's objects are one contiguous range in key order.
const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
/// Multipart uploads: upload id → [`UploadRecord`] (JSON).
const UPLOADS: TableDefinition<&str, &[u8]> = TableDefinition::new("uploads");
/// Parts: (upload id, part number) → [`PartRecord`] (JSON).
const PARTS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("parts");
/// Completed uploads: upload id → [`Completed`] (JSON), kept [`COMPLETED_KEEP_MS`] so that a
/// client retrying a completion whose answer it lost gets the same answer, as from S3.
const COMPLETED: TableDefinition<&str, &[u8]> = TableDefinition::new("completed");
const COMPLETED_KEEP_MS: u64 = 24 * 60 * 60 * 1000;
/// What this file is: `format` → [`FORMAT`].
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const FORMAT: u64 = 1;

pub const DB_FILE: &str = "local.redb";
pub const DATA_DIR: &str = "data";

/// The attributes a client sets on an object and reads back.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Attributes {
    pub metadata: BTreeMap<String, String>,
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub content_disposition: Option<String>,
    pub content_language: Option<String>,
    pub cache_control: Option<String>,
    /// `Expires` as the client sent it (HTTP date).
    pub expires: Option<String>,
    pub website_redirect_location: Option<String>,
}

/// The checksums a client sent with a single-part object (base64, as S3 returns them).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Checksums {
    pub crc32: Option<String>,
    pub crc32c: Option<String>,
    pub crc64nvme: Option<String>,
    pub sha1: Option<String>,
    pub sha256: Option<String>,
}

/// A run of an object's bytes: one data file, whole.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Segment {
    pub file: String,
    pub size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// Without quotes: the MD5 of the bytes, or `md5-of-part-md5s-N` for a multipart object.
    pub etag: String,
    pub size: u64,
    pub modified_ms: u64,
    /// The bytes, in order: one segment, or a multipart object's parts as they were uploaded.
    pub segments: Vec<Segment>,
    pub attributes: Attributes,
    pub checksums: Checksums,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UploadRecord {
    pub bucket: String,
    pub key: String,
    pub initiated_ms: u64,
    pub attributes: Attributes,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartRecord {
    pub etag: String,
    pub size: u64,
    pub modified_ms: u64,
    pub file: String,
    pub checksums: Checksums,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Completed {
    bucket: String,
    key: String,
    etag: String,
    completed_ms: u64,
}

/// A condition on the object a write replaces, judged inside the commit.
#[derive(Debug, Clone, Default)]
pub struct Precondition {
    /// `If-Match`: `Some(None)` is `*`.
    pub if_match: Option<Option<String>>,
    /// `If-None-Match`: `Some(None)` is `*`.
    pub if_none_match: Option<Option<String>>,
}

impl Precondition {
    pub fn holds(&self, current: Option<&ObjectRecord>) -> bool {
        let etag = current.map(|o| o.etag.as_str());
        let matches = |wanted: &Option<String>| match (wanted, etag) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(w), Some(e)) => w == e,
        };
        self.if_match.as_ref().is_none_or(matches) && self.if_none_match.as_ref().is_none_or(|w| !matches(w))
    }

    /// [`holds`](Self::holds), or S3's answer: `If-Match` on no object is `NoSuchKey` (404),
    /// any other failure `PreconditionFailed` (412).
    pub fn check(&self, current: Option<&ObjectRecord>) -> Result<(), StoreError> {
        match (self.holds(current), current) {
            (true, _) => Ok(()),
            (false, None) if self.if_match.is_some() => Err(StoreError::NoSuchKey),
            (false, _) => Err(StoreError::PreconditionFailed),
        }
    }
}

/// Why a store step did not happen; the S3 operations map each to S3's error.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the specified bucket does not exist")]
    NoSuchBucket,
    #[error("the specified key does not exist")]
    NoSuchKey,
    #[error("the specified multipart upload does not exist")]
    NoSuchUpload,
    #[error("at least one of the pre-conditions you specified did not hold")]
    PreconditionFailed,
    #[error("the bucket you tried to delete is not empty")]
    BucketNotEmpty,
    #[error("the bucket already exists and is yours")]
    BucketAlreadyOwnedByYou,
    #[error("part {0} was not uploaded, or its ETag does not match")]
    InvalidPart(u32),
    #[error("the list of parts was not in ascending order")]
    InvalidPartOrder,
    #[error("part {0} is smaller than the minimum allowed object size (5 MiB)")]
    EntityTooSmall(u32),
    #[error("the local store failed: {0}")]
    Internal(String),
}

impl From<redb::Error> for StoreError {
    fn from(e: redb::Error) -> Self {
        Self::Internal(e.to_string())
    }
}

macro_rules! redb_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                Self::Internal(e.to_string())
            }
        }
    )*};
}
redb_errors!(
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    serde_json::Error,
    std::io::Error
);

/// Parts other than the last must be at least this large (S3's rule).
pub const PART_BYTES_MIN: u64 = 5 * 1024 * 1024;

pub fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

fn object_key(bucket: &str, key: &str) -> String {
    format!("{bucket}/{key}")
}

/// The first key after every `bucket/…` key: `bucket0` (`0` follows `/`).
fn bucket_end(bucket: &str) -> String {
    format!("{bucket}0")
}

/// The store: the database and the directory of data files. Every call blocks (redb and the
/// file system); the S3 operations run them on the blocking pool.
#[derive(Clone)]
pub struct Records {
    db: Arc<Database>,
    data: PathBuf,
}

impl Records {
    /// Opens (or creates) the store in `root`. Refuses a database that is not this store's
    /// (an empty file, another program's), and a directory holding anything else, such as
    /// the one-file-per-key layout of fencegate's earlier local upstream.
    pub fn open(root: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(root)
            .map_err(|e| anyhow::anyhow!("cannot create the local upstream directory {}: {e}", root.display()))?;
        let path = root.join(DB_FILE);
        let created = !path.exists();
        if created {
            let foreign: Vec<String> = std::fs::read_dir(root)?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name != DATA_DIR)
                .collect();
            if !foreign.is_empty() {
                anyhow::bail!(
                    "the local upstream directory {} holds files that are not fencegate's local store ({}); \
                     point upstream.path at an empty directory (objects written by fencegate before 0.2 kept one \
                     file per key: copy them in through fencegate, e.g. with `aws s3 sync`)",
                    root.display(),
                    foreign.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
                );
            }
        } else if std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
            anyhow::bail!(
                "the local upstream's {} is empty: not one fencegate wrote, refusing to start with no objects; \
                 restore it, or move it away to start empty on purpose",
                path.display()
            );
        }
        let db = Database::create(&path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        let format = (|| -> Result<Option<u64>, StoreError> {
            let read = db.begin_read()?;
            match read.open_table(META) {
                Ok(meta) => Ok(meta.get("format")?.map(|v| v.value())),
                Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })()
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        match format {
            Some(FORMAT) => {}
            None if created => {}
            other => {
                anyhow::bail!("{} is not a fencegate local store (format {other:?}); refusing to start", path.display())
            }
        }
        let init = || -> Result<(), StoreError> {
            let txn = db.begin_write()?;
            txn.open_table(BUCKETS)?;
            txn.open_table(OBJECTS)?;
            txn.open_table(UPLOADS)?;
            txn.open_table(PARTS)?;
            txn.open_table(COMPLETED)?;
            txn.open_table(META)?.insert("format", FORMAT)?;
            txn.commit()?;
            Ok(())
        };
        init().map_err(|e| anyhow::anyhow!("cannot initialise {}: {e}", path.display()))?;
        let data = root.join(DATA_DIR);
        std::fs::create_dir_all(&data)?;
        let records = Self { db: Arc::new(db), data };
        let removed = records.remove_orphans().map_err(|e| anyhow::anyhow!("local store: {e}"))?;
        if removed > 0 {
            tracing::info!(removed, "local store: removed data files no record names (writes a crash interrupted)");
        }
        Ok(records)
    }

    pub fn data_path(&self, file: &str) -> PathBuf {
        self.data.join(file)
    }

    /// A new data file's name and path.
    pub fn new_data_file(&self) -> (String, PathBuf) {
        let name = uuid::Uuid::new_v4().simple().to_string();
        let path = self.data.join(&name);
        (name, path)
    }

    /// Makes the data directory's entries durable (after a data file was created in it).
    pub fn sync_data_dir(&self) -> std::io::Result<()> {
        std::fs::File::open(&self.data)?.sync_all()
    }

    /// Removes data files, best effort: they are no longer named by any record.
    pub fn remove_files<'a>(&self, files: impl IntoIterator<Item = &'a str>) {
        for file in files {
            if let Err(e) = std::fs::remove_file(self.data.join(file))
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(file, error = %e, "local store: cannot remove a replaced data file");
            }
        }
    }

    /// At open, nothing else runs: every data file no record names is a crash's leftover.
    fn remove_orphans(&self) -> Result<usize, StoreError> {
        let mut named = HashSet::new();
        let read = self.db.begin_read()?;
        for entry in read.open_table(OBJECTS)?.iter()? {
            let (_, value) = entry?;
            let record: ObjectRecord = serde_json::from_slice(value.value())?;
            named.extend(record.segments.into_iter().map(|s| s.file));
        }
        for entry in read.open_table(PARTS)?.iter()? {
            let (_, value) = entry?;
            named.insert(serde_json::from_slice::<PartRecord>(value.value())?.file);
        }
        let mut removed = 0;
        for entry in std::fs::read_dir(&self.data)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !named.contains(&name) {
                std::fs::remove_file(entry.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    // -- buckets --------------------------------------------------------------------------

    pub fn create_bucket(&self, bucket: &str) -> Result<(), StoreError> {
        let txn = self.db.begin_write()?;
        {
            let mut buckets = txn.open_table(BUCKETS)?;
            if buckets.get(bucket)?.is_some() {
                return Err(StoreError::BucketAlreadyOwnedByYou);
            }
            buckets.insert(bucket, now_ms())?;
        }
        txn.commit()?;
        Ok(())
    }

    pub fn bucket_exists(&self, bucket: &str) -> Result<bool, StoreError> {
        Ok(self.db.begin_read()?.open_table(BUCKETS)?.get(bucket)?.is_some())
    }

    /// Deletes a bucket that holds no object. Uploads in progress go with it, as in S3 (their
    /// parts' files are returned, for the caller to remove).
    pub fn delete_bucket(&self, bucket: &str) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_write()?;
        let freed = {
            let mut buckets = txn.open_table(BUCKETS)?;
            if buckets.get(bucket)?.is_none() {
                return Err(StoreError::NoSuchBucket);
            }
            let objects = txn.open_table(OBJECTS)?;
            let start = object_key(bucket, "");
            if objects.range(start.as_str()..bucket_end(bucket).as_str())?.next().is_some() {
                return Err(StoreError::BucketNotEmpty);
            }
            let mut uploads = txn.open_table(UPLOADS)?;
            let mut ids = Vec::new();
            for entry in uploads.iter()? {
                let (id, value) = entry?;
                if serde_json::from_slice::<UploadRecord>(value.value())?.bucket == bucket {
                    ids.push(id.value().to_owned());
                }
            }
            let mut parts = txn.open_table(PARTS)?;
            let mut freed = Vec::new();
            for id in &ids {
                let mut numbers = Vec::new();
                for entry in parts.range((id.as_str(), 0)..=(id.as_str(), u32::MAX))? {
                    let (k, v) = entry?;
                    numbers.push(k.value().1);
                    freed.push(serde_json::from_slice::<PartRecord>(v.value())?.file);
                }
                for number in numbers {
                    parts.remove((id.as_str(), number))?;
                }
                uploads.remove(id.as_str())?;
            }
            buckets.remove(bucket)?;
            freed
        };
        txn.commit()?;
        Ok(freed)
    }

    /// Every bucket and its creation time, by name.
    pub fn buckets(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let read = self.db.begin_read()?;
        let mut out = Vec::new();
        for entry in read.open_table(BUCKETS)?.iter()? {
            let (name, created) = entry?;
            out.push((name.value().to_owned(), created.value()));
        }
        Ok(out)
    }

    // -- objects --------------------------------------------------------------------------

    /// The object, or why there is none (its bucket missing, or the key).
    pub fn object(&self, bucket: &str, key: &str) -> Result<ObjectRecord, StoreError> {
        let read = self.db.begin_read()?;
        if read.open_table(BUCKETS)?.get(bucket)?.is_none() {
            return Err(StoreError::NoSuchBucket);
        }
        let objects = read.open_table(OBJECTS)?;
        let value = objects.get(object_key(bucket, key).as_str())?.ok_or(StoreError::NoSuchKey)?;
        Ok(serde_json::from_slice(value.value())?)
    }

    /// Puts `record` at `bucket/key` if `condition` holds on what is there, in one
    /// transaction. Returns the data files the replaced object no longer needs; the caller
    /// removes them. On an error nothing changed, and the caller removes the new files.
    pub fn commit_object(
        &self,
        bucket: &str,
        key: &str,
        condition: &Precondition,
        record: &ObjectRecord,
    ) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_write()?;
        let replaced = {
            let (mut objects, name, current) = object_in(&txn, bucket, key)?;
            condition.check(current.as_ref())?;
            objects.insert(name.as_str(), serde_json::to_vec(record)?.as_slice())?;
            current
        };
        txn.commit()?;
        Ok(unneeded(replaced, record))
    }

    /// Deletes `bucket/key` if `condition` holds. Returns the freed data files (none when
    /// there was no object: a delete of nothing succeeds, as in S3).
    pub fn delete_object(&self, bucket: &str, key: &str, condition: &Precondition) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_write()?;
        let removed = {
            let (mut objects, name, current) = object_in(&txn, bucket, key)?;
            condition.check(current.as_ref())?;
            if current.is_some() {
                objects.remove(name.as_str())?;
            }
            current
        };
        txn.commit()?;
        Ok(removed.map(|r| r.segments.into_iter().map(|s| s.file).collect()).unwrap_or_default())
    }

    /// Keys of `bucket` after `after` (exclusive) that start with `prefix`, in key order, at
    /// most `limit` (a listing's page is cut from these).
    pub fn keys(
        &self,
        bucket: &str,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, ObjectRecord)>, StoreError> {
        let read = self.db.begin_read()?;
        if read.open_table(BUCKETS)?.get(bucket)?.is_none() {
            return Err(StoreError::NoSuchBucket);
        }
        let objects = read.open_table(OBJECTS)?;
        let from = object_key(bucket, after.filter(|a| *a > prefix).unwrap_or(prefix));
        let end = bucket_end(bucket);
        let mut out = Vec::new();
        for entry in objects.range(from.as_str()..end.as_str())? {
            let (name, value) = entry?;
            let key = &name.value()[bucket.len() + 1..];
            if after.is_some_and(|a| key <= a) {
                continue;
            }
            if !key.starts_with(prefix) {
                break;
            }
            out.push((key.to_owned(), serde_json::from_slice(value.value())?));
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }
}

/// The objects table, opened in a write transaction.
type ObjectsTable<'t> = redb::Table<'t, &'static str, &'static [u8]>;

/// In a write transaction: the objects table, the object's name in it and the object there
/// now, or `NoSuchBucket`.
fn object_in<'t>(
    txn: &'t redb::WriteTransaction,
    bucket: &str,
    key: &str,
) -> Result<(ObjectsTable<'t>, String, Option<ObjectRecord>), StoreError> {
    if txn.open_table(BUCKETS)?.get(bucket)?.is_none() {
        return Err(StoreError::NoSuchBucket);
    }
    let objects = txn.open_table(OBJECTS)?;
    let name = object_key(bucket, key);
    let current = objects.get(name.as_str())?.map(|v| serde_json::from_slice(v.value())).transpose()?;
    Ok((objects, name, current))
}

/// The files of `replaced` that `record` does not reuse.
fn unneeded(replaced: Option<ObjectRecord>, record: &ObjectRecord) -> Vec<String> {
    let kept: HashSet<&str> = record.segments.iter().map(|s| s.file.as_str()).collect();
    replaced
        .map(|r| r.segments.into_iter().map(|s| s.file).filter(|f| !kept.contains(f.as_str())).collect())
        .unwrap_or_default()
}

mod uploads;
#[cfg(test)]
use uploads::multipart_etag;

#[cfg(test)]
mod tests;
