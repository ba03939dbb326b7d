//! The embedded fence store: one redb file, fsync on every advance, advances from many
//! resources group-committed by one writer thread. Layout and crash points: `docs/design.md`,
//! section 5. The API gateway's idempotency records live in the same file and go through the
//! same writer; expired ones are swept in bounded batches by the commits that add records.

use self::place::{Place, PlaceError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use crate::fence::{
    AdvanceOutcome, FenceStore, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord, IdempotencyStore,
    LeaseCommand, LeaseOutcome, LeaseRecord, LeaseStore, LeaseWrite, ResourceKey, StoreError, UploadPage, UploadRecord,
    UploadStore, apply_lease,
};

/// resource name → fence token.
const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");
/// resource name → the lease on it, as JSON (a [`LeaseRecord`]).
const LEASES: TableDefinition<&str, &str> = TableDefinition::new("leases");
/// `resource \n request digest` → (expiry ms, claim, the record as JSON). Expiry and claim sit
/// beside the JSON so the writer checks them without decoding it.
const IDEMPOTENCY: TableDefinition<&str, (u64, &str, &[u8])> = TableDefinition::new("idempotency");
/// (expiry ms, record name): the sweep's index, oldest first.
const IDEMPOTENCY_EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("idempotency_expiry");
/// `bucket/upload id` → the multipart upload made with a token, as JSON (an [`UploadRecord`]).
const UPLOADS: TableDefinition<&str, &str> = TableDefinition::new("uploads");

/// redb's page cache when none is configured (`store.cache_bytes_max`).
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// The bytes idempotency records take at most when none is configured
/// (`store.idempotency_records_bytes_max`).
const IDEMPOTENCY_RECORDS_BYTES_MAX: u64 = 1 << 30;

/// Idempotency records kept at most when none is configured (`store.idempotency_records_max`).
pub const IDEMPOTENCY_RECORDS_MAX: usize = 200_000;

/// The database file inside `store.path`.
pub const FILE_NAME: &str = "fences.redb";

/// Facts about the file itself. `clean_shutdown` is written by a shutdown that left no write in
/// flight and removed at every start, so its absence at a start means the last process may have
/// died with writes in flight at the upstream.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const CLEAN_SHUTDOWN: &str = "clean_shutdown";
/// The wall-clock end (ms since the epoch) of the hold after the last unclean start: kept
/// until it has passed, through every later start and stop (`FenceStore::hold_until`).
const HOLD_UNTIL_MS: &str = "hold_until_ms";

/// Changes waiting for the writer thread; a full queue makes callers wait (backpressure).
const WRITE_QUEUE_MAX: usize = 4096;
/// Changes applied in one transaction (one fsync) at most.
const WRITES_PER_COMMIT_MAX: usize = 1024;
/// Expired idempotency records removed per commit at least, when the commit adds records; twice
/// the number added if that is more, so sweeping keeps up with any insert rate.
const SWEEP_PER_COMMIT_MIN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create the fence store directory {path}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the fence store {path} (is another fencegate using it?)")]
    Open { path: PathBuf, source: redb::DatabaseError },
    #[error("cannot initialise the fence store {path}")]
    Init { path: PathBuf, source: Box<dyn std::error::Error + Send + Sync> },
    /// Starting on it would start with no fences (G1 broken): the operator decides.
    #[error(
        "the fence store {path} exists but is not one fencegate wrote ({why}); refusing to start with no fences. \
         Restore the file, or move it away to start with an empty store on purpose"
    )]
    NotOurs { path: PathBuf, why: &'static str },
    #[error(transparent)]
    Place(#[from] PlaceError),
}

/// A change for the writer thread, with the channel its outcome goes back on.
enum WriteRequest {
    Advance {
        resource: ResourceKey,
        token: FenceToken,
        reply: oneshot::Sender<Result<AdvanceOutcome, StoreError>>,
    },
    Lease {
        resource: ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
        reply: oneshot::Sender<Result<LeaseOutcome, StoreError>>,
    },
    /// Store `json` under `name` unless a live record is there; answer with that one's JSON.
    IdempotencyBegin {
        name: String,
        claim: String,
        expires_at_ms: u64,
        json: Vec<u8>,
        now_ms: u64,
        reply: oneshot::Sender<Result<Option<Vec<u8>>, StoreError>>,
    },
    /// Replace (or, with `None`, remove) the record under `name` if it is still `claim`'s.
    IdempotencyFinish {
        name: String,
        claim: String,
        json: Option<Vec<u8>>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// Keep (or, with `None`, forget) the upload record under `name`.
    Upload {
        name: String,
        json: Option<String>,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

/// The outcome of one request inside a committed batch.
enum WriteOutcome {
    Advance(AdvanceOutcome),
    Lease(LeaseOutcome),
    /// The live record that was already there, if any.
    IdempotencyBegin(Option<Vec<u8>>),
    IdempotencyFinish,
    Upload,
}

impl WriteRequest {
    fn answer(self, outcome: Result<WriteOutcome, StoreError>) {
        match (self, outcome) {
            (Self::Advance { reply, .. }, Ok(WriteOutcome::Advance(o))) => drop(reply.send(Ok(o))),
            (Self::Lease { reply, .. }, Ok(WriteOutcome::Lease(o))) => drop(reply.send(Ok(o))),
            (Self::IdempotencyBegin { reply, .. }, Ok(WriteOutcome::IdempotencyBegin(o))) => drop(reply.send(Ok(o))),
            (Self::IdempotencyFinish { reply, .. }, Ok(WriteOutcome::IdempotencyFinish)) => drop(reply.send(Ok(()))),
            (Self::Upload { reply, .. }, Ok(WriteOutcome::Upload)) => drop(reply.send(Ok(()))),
            (Self::Advance { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            (Self::Lease { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            (Self::IdempotencyBegin { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            (Self::IdempotencyFinish { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            (Self::Upload { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            _ => unreachable!("outcomes are produced per request kind"),
        }
    }
}

pub struct EmbeddedStore {
    db: Arc<Database>,
    /// The file's path, claimed, and the file it names (a change is refused once it names
    /// another, or none).
    place: Arc<Place>,
    writes: mpsc::Sender<WriteRequest>,
    /// Set after any failed commit: from then on every call fails until a restart reopens
    /// (and so recovers) the file. A commit that failed half-way is never trusted.
    poisoned: Arc<AtomicBool>,
    /// Whether the last process that used the file shut down with no write in flight.
    opened_clean: bool,
    /// The hold an earlier start recorded (`HOLD_UNTIL_MS`), as read at open.
    held_until_ms: Option<u64>,
    records_max: Arc<AtomicUsize>,
    records_bytes_max: Arc<AtomicU64>,
}

/// Whether the database has the fences table (a fencegate store, not some other redb file).
fn has_fences_table(db: &Database) -> bool {
    use redb::ReadableDatabase;
    db.begin_read().is_ok_and(|txn| txn.open_table(FENCES).is_ok())
}

impl EmbeddedStore {
    /// Opens (or creates) the store in directory `dir`, recovering it if the last process
    /// died mid-commit.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        Self::open_with_cache(dir, DEFAULT_CACHE_BYTES)
    }

    /// Like [`Self::open`], with redb's page cache bounded to `cache_bytes`.
    pub fn open_with_cache(dir: &Path, cache_bytes: usize) -> Result<Self, OpenError> {
        std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir { path: dir.into(), source })?;
        let claimed = Place::claim(dir)?;
        let path = dir.join(FILE_NAME);
        let created = !path.exists();
        // redb would initialise an empty file as a new database: a crash during creation, a
        // failed restore or a truncation would silently drop every fence.
        if !created && std::fs::metadata(&path).is_ok_and(|m| m.len() == 0) {
            return Err(OpenError::NotOurs { path, why: "it is empty" });
        }
        let db = Database::builder()
            .set_cache_size(cache_bytes)
            .create(&path)
            .map_err(|source| OpenError::Open { path: path.clone(), source })?;
        // Every file fencegate creates has its tables from the first commit on.
        if !created && !has_fences_table(&db) {
            return Err(OpenError::NotOurs { path, why: "it has no fences table" });
        }
        let init = || -> Result<(bool, Option<u64>), Box<dyn std::error::Error + Send + Sync>> {
            let txn = db.begin_write()?;
            txn.open_table(FENCES)?;
            txn.open_table(LEASES)?;
            txn.open_table(IDEMPOTENCY)?;
            txn.open_table(IDEMPOTENCY_EXPIRY)?;
            txn.open_table(UPLOADS)?;
            let (opened_clean, held_until_ms) = {
                let mut meta = txn.open_table(META)?;
                let held_until_ms = meta.get(HOLD_UNTIL_MS)?.map(|v| v.value());
                (meta.remove(CLEAN_SHUTDOWN)?.is_some(), held_until_ms)
            };
            txn.commit()?;
            Ok((opened_clean, held_until_ms))
        };
        let (opened_clean, held_until_ms) = init().map_err(|source| OpenError::Init { path: path.clone(), source })?;
        // A new file had no process before this one.
        let opened_clean = opened_clean || created;
        let place = Arc::new(claimed.opened(&path)?);

        let db = Arc::new(db);
        let poisoned = Arc::new(AtomicBool::new(false));
        let (writes, queue) = mpsc::channel(WRITE_QUEUE_MAX);
        let records_max = Arc::new(AtomicUsize::new(IDEMPOTENCY_RECORDS_MAX));
        let records_bytes_max = Arc::new(AtomicU64::new(IDEMPOTENCY_RECORDS_BYTES_MAX));
        let records_bytes = records_bytes(&db).map_err(|source| OpenError::Init { path, source })?;
        let writer = Writer {
            db: db.clone(),
            place: place.clone(),
            poisoned: poisoned.clone(),
            records_max: records_max.clone(),
            records_bytes_max: records_bytes_max.clone(),
            records_bytes,
        };
        std::thread::Builder::new()
            .name("fence-store-writer".into())
            .spawn(move || writer.run(queue))
            .expect("spawning the fence store writer thread");
        Ok(Self { db, place, writes, poisoned, opened_clean, held_until_ms, records_max, records_bytes_max })
    }

    /// Bounds the idempotency records kept (`store.idempotency_records_max`, and their bytes
    /// `store.idempotency_records_bytes_max`): beyond, a new claim is refused; a record is
    /// never dropped before its retention ends (a retry of its request would execute again).
    pub fn set_idempotency_records_max(&self, max: usize, bytes_max: u64) {
        self.records_max.store(max, Ordering::Relaxed);
        self.records_bytes_max.store(bytes_max, Ordering::Relaxed);
    }

    async fn submit<T>(
        &self,
        request: WriteRequest,
        answer: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.check_poisoned()?;
        self.writes.send(request).await.map_err(|_| StoreError::Closed)?;
        // A dropped reply means the writer thread died: the outcome is unknown.
        answer.await.map_err(|_| StoreError::Closed)?
    }

    /// One fact about the file, committed durably before it returns.
    fn set_meta(&self, name: &str, value: u64) -> Result<(), StoreError> {
        self.check_poisoned()?;
        let set = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let txn = self.db.begin_write()?;
            txn.open_table(META)?.insert(name, value)?;
            txn.commit()?;
            Ok(())
        };
        set().map_err(StoreError::Backend)
    }

    fn check_poisoned(&self) -> Result<(), StoreError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(StoreError::Poisoned);
        }
        Ok(())
    }
}

#[async_trait]
impl FenceStore for EmbeddedStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.check_poisoned()?;
        // Read in place, not on the blocking pool: a lookup served from redb's cache (or the
        // OS page cache) takes a few microseconds, and the hand-off to a blocking thread and
        // back cost more than ten times that (futex wake-ups and context switches: 60 us per
        // lookup in the 1M-fence benchmark). The price is a worker held for the length of a
        // disk read when the file is not cached at all.
        let read = || -> Result<Option<FenceToken>, redb::Error> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(FENCES)?;
            Ok(table.get(resource.as_str())?.map(|v| FenceToken(v.value())))
        };
        read().map_err(|e| StoreError::Backend(Box::new(e)))
    }

    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.submit(WriteRequest::Advance { resource: resource.clone(), token, reply }, answer).await
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        if let Err(lost) = self.place.check() {
            if !self.poisoned.swap(true, Ordering::AcqRel) {
                tracing::error!(error = %lost, "fence store file lost");
            }
            return Err(StoreError::FileLost);
        }
        self.check_poisoned()
    }

    fn opened_clean(&self) -> bool {
        self.opened_clean
    }

    fn mark_clean_shutdown(&self) -> Result<(), StoreError> {
        self.set_meta(CLEAN_SHUTDOWN, 1)
    }

    fn held_until_ms(&self) -> Option<u64> {
        self.held_until_ms
    }

    fn hold_until(&self, until_ms: u64) -> Result<(), StoreError> {
        self.set_meta(HOLD_UNTIL_MS, until_ms)
    }
}

#[async_trait]
impl LeaseStore for EmbeddedStore {
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.submit(WriteRequest::Lease { resource: resource.clone(), command, now_ms, reply }, answer).await
    }

    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        self.check_poisoned()?;
        // In place, like `load`.
        let read = || -> Result<Option<String>, redb::Error> {
            let txn = self.db.begin_read()?;
            let table = txn.open_table(LEASES)?;
            Ok(table.get(resource.as_str())?.map(|v| v.value().to_owned()))
        };
        let json = read().map_err(|e| StoreError::Backend(Box::new(e)))?;
        json.map(|j| serde_json::from_str(&j).map_err(|e| StoreError::Backend(Box::new(e)))).transpose()
    }
}

#[async_trait]
impl IdempotencyStore for EmbeddedStore {
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        let (reply, answer) = oneshot::channel();
        let request = WriteRequest::IdempotencyBegin {
            name: key.storage_name(),
            claim: claim.claim.clone(),
            expires_at_ms: claim.expires_at_ms,
            json: encode(claim),
            now_ms,
            reply,
        };
        match self.submit(request, answer).await? {
            None => Ok(IdempotencyBegin::Claimed),
            Some(json) if json.is_empty() => Ok(IdempotencyBegin::Full),
            Some(json) => Ok(IdempotencyBegin::Existing(decode(&json)?)),
        }
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        self.check_poisoned()?;
        let db = self.db.clone();
        let name = key.storage_name();
        let json = tokio::task::spawn_blocking(move || -> Result<Option<Vec<u8>>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(IDEMPOTENCY)?;
            let Some(guard) = table.get(name.as_str())? else { return Ok(None) };
            let (expires, _, json) = guard.value();
            Ok((expires > now_ms).then(|| json.to_vec()))
        })
        .await
        .map_err(|e| StoreError::Backend(Box::new(e)))?
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
        json.map(|j| decode(&j)).transpose()
    }

    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        let request = WriteRequest::IdempotencyFinish {
            name: key.storage_name(),
            claim: claim.to_owned(),
            json: record.map(encode),
            reply,
        };
        self.submit(request, answer).await
    }
}

#[async_trait]
impl UploadStore for EmbeddedStore {
    async fn upload_put(&self, record: &UploadRecord) -> Result<(), StoreError> {
        let (reply, answer) = oneshot::channel();
        let json = serde_json::to_string(record).expect("an upload record serialises");
        self.submit(WriteRequest::Upload { name: record.storage_name(), json: Some(json), reply }, answer).await
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
        self.submit(WriteRequest::Upload { name, json: None, reply }, answer).await
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

/// The one thread that writes: takes every queued change, applies them in one transaction,
/// commits (fsync) once, then answers each caller.
struct Writer {
    db: Arc<Database>,
    place: Arc<Place>,
    poisoned: Arc<AtomicBool>,
    /// `store.idempotency_records_max`.
    records_max: Arc<AtomicUsize>,
    /// `store.idempotency_records_bytes_max`.
    records_bytes_max: Arc<AtomicU64>,
    /// The bytes the records take now ([`record_bytes`] each), counted at open and kept up
    /// to date by every change (a failed commit poisons the store, so it never drifts).
    records_bytes: u64,
}

impl Writer {
    fn run(mut self, mut queue: mpsc::Receiver<WriteRequest>) {
        let mut batch = Vec::with_capacity(WRITES_PER_COMMIT_MAX);
        while let Some(first) = queue.blocking_recv() {
            batch.push(first);
            while batch.len() < WRITES_PER_COMMIT_MAX {
                match queue.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            if let Err(lost) = self.place.check() {
                // An advance made now would be fsynced into a file no later start reads.
                if !self.poisoned.swap(true, Ordering::AcqRel) {
                    tracing::error!(error = %lost, "fence store file lost");
                }
            }
            if self.poisoned.load(Ordering::Acquire) {
                for request in batch.drain(..) {
                    request.answer(Err(StoreError::Poisoned));
                }
                continue;
            }
            match self.commit(&mut batch) {
                Ok(outcomes) => {
                    for (request, outcome) in batch.drain(..).zip(outcomes) {
                        request.answer(Ok(outcome));
                    }
                }
                Err(error) => {
                    self.poisoned.store(true, Ordering::Release);
                    tracing::error!(%error, "fence store commit failed; refusing all work until restart");
                    for request in batch.drain(..) {
                        request.answer(Err(StoreError::Poisoned));
                    }
                }
            }
        }
    }

    fn commit(&mut self, batch: &mut [WriteRequest]) -> Result<Vec<WriteOutcome>, redb::Error> {
        let txn = self.db.begin_write()?; // durability Immediate: commit fsyncs
        let mut outcomes = Vec::with_capacity(batch.len());
        // The latest clock reading of the records added in this commit, and how many.
        let (mut sweep_now_ms, mut added) = (0u64, 0usize);
        {
            let mut fences = txn.open_table(FENCES)?;
            let mut leases = txn.open_table(LEASES)?;
            let mut records = txn.open_table(IDEMPOTENCY)?;
            let mut expiry = txn.open_table(IDEMPOTENCY_EXPIRY)?;
            let mut uploads = txn.open_table(UPLOADS)?;
            for request in batch.iter_mut() {
                let outcome = match request {
                    WriteRequest::Advance { resource, token, .. } => {
                        WriteOutcome::Advance(advance(&mut fences, resource, *token)?)
                    }
                    WriteRequest::Lease { resource, command, now_ms, .. } => {
                        WriteOutcome::Lease(lease(&mut fences, &mut leases, resource, command, *now_ms)?)
                    }
                    WriteRequest::IdempotencyBegin { name, claim, expires_at_ms, json, now_ms, .. } => {
                        sweep_now_ms = sweep_now_ms.max(*now_ms);
                        let claim = Claim { name, claim, expires_at_ms: *expires_at_ms, json, now_ms: *now_ms };
                        let existing = self.begin(&mut records, &mut expiry, &claim)?;
                        added += usize::from(existing.is_none());
                        WriteOutcome::IdempotencyBegin(existing)
                    }
                    WriteRequest::IdempotencyFinish { name, claim, json, .. } => {
                        self.finish(&mut records, &mut expiry, name, claim, json.as_deref())?;
                        WriteOutcome::IdempotencyFinish
                    }
                    WriteRequest::Upload { name, json, .. } => {
                        match json {
                            Some(json) => drop(uploads.insert(name.as_str(), json.as_str())?),
                            None => drop(uploads.remove(name.as_str())?),
                        }
                        WriteOutcome::Upload
                    }
                };
                outcomes.push(outcome);
            }
            if added > 0 {
                let swept =
                    sweep_expired(&mut records, &mut expiry, sweep_now_ms, SWEEP_PER_COMMIT_MIN.max(2 * added))?;
                self.records_bytes = self.records_bytes.saturating_sub(swept);
            }
        }
        txn.commit()?;
        Ok(outcomes)
    }

    /// Stores a claim unless a live record is there: `None` when it was stored, else the live
    /// record's JSON (empty when the records are full).
    fn begin(
        &mut self,
        records: &mut redb::Table<&str, (u64, &str, &[u8])>,
        expiry: &mut redb::Table<(u64, &str), ()>,
        claim: &Claim<'_>,
    ) -> Result<Option<Vec<u8>>, redb::Error> {
        use redb::ReadableTableMetadata;
        let Claim { name, claim: owner, expires_at_ms, json, now_ms } = *claim;
        let current = records.get(name.as_str())?.map(|v| {
            let (expires, owner, json) = v.value();
            (expires, json.to_vec(), record_bytes(name, owner, json))
        });
        match current {
            Some((expires, json, _)) if expires > now_ms => return Ok(Some(json)),
            Some((expires, _, bytes)) => {
                expiry.remove((expires, name.as_str()))?;
                records.remove(name.as_str())?;
                self.records_bytes = self.records_bytes.saturating_sub(bytes);
            }
            None => {}
        }
        // Full: room from what has expired first; a live record is never dropped to make room
        // (a retry of its request would execute again): the new claim is refused instead.
        let bytes = record_bytes(name, owner, json);
        let (count_max, bytes_max) =
            (self.records_max.load(Ordering::Relaxed) as u64, self.records_bytes_max.load(Ordering::Relaxed));
        let mut full = records.len()? >= count_max || self.records_bytes + bytes > bytes_max;
        if full {
            let swept = sweep_expired(records, expiry, now_ms, SWEEP_PER_COMMIT_MIN)?;
            self.records_bytes = self.records_bytes.saturating_sub(swept);
            full = records.len()? >= count_max || self.records_bytes + bytes > bytes_max;
        }
        if full {
            crate::metrics::idempotency_records_full();
            return Ok(Some(Vec::new()));
        }
        records.insert(name.as_str(), (expires_at_ms, owner.as_str(), json.as_slice()))?;
        expiry.insert((expires_at_ms, name.as_str()), ())?;
        self.records_bytes += bytes;
        Ok(None)
    }

    /// Replaces (or, with `None`, removes) the record under `name` if it is still `claim`'s.
    fn finish(
        &mut self,
        records: &mut redb::Table<&str, (u64, &str, &[u8])>,
        expiry: &mut redb::Table<(u64, &str), ()>,
        name: &str,
        claim: &str,
        json: Option<&[u8]>,
    ) -> Result<(), redb::Error> {
        let current = records.get(name)?.map(|v| {
            let (expires, owner, old) = v.value();
            (expires, owner == claim, record_bytes(name, owner, old))
        });
        match (current, json) {
            (Some((expires, true, old)), Some(json)) => {
                // The outcome may take the record past the bytes cap, by at most one response
                // per claim in flight: claims are what the cap refuses.
                records.insert(name, (expires, claim, json))?;
                self.records_bytes = self.records_bytes.saturating_sub(old) + record_bytes(name, claim, json);
            }
            (Some((expires, true, old)), None) => {
                records.remove(name)?;
                expiry.remove((expires, name))?;
                self.records_bytes = self.records_bytes.saturating_sub(old);
            }
            _ => {} // not ours any more: it expired and was claimed again
        }
        Ok(())
    }
}

/// An idempotency claim as the writer applies it.
#[derive(Clone, Copy)]
struct Claim<'a> {
    name: &'a String,
    claim: &'a String,
    expires_at_ms: u64,
    json: &'a Vec<u8>,
    now_ms: u64,
}

/// Raises the fence of `resource` to `token` if that is greater.
fn advance(
    fences: &mut redb::Table<&str, u64>,
    resource: &ResourceKey,
    token: FenceToken,
) -> Result<AdvanceOutcome, redb::Error> {
    let previous = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
    Ok(match previous {
        Some(current) if current >= token => AdvanceOutcome::Unchanged { current },
        _ => {
            fences.insert(resource.as_str(), token.0)?;
            AdvanceOutcome::Advanced { previous }
        }
    })
}

/// Applies a lease command and the fence it raises, in the same transaction.
fn lease(
    fences: &mut redb::Table<&str, u64>,
    leases: &mut redb::Table<&str, &str>,
    resource: &ResourceKey,
    command: &LeaseCommand,
    now_ms: u64,
) -> Result<LeaseOutcome, redb::Error> {
    let fence = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
    let current: Option<LeaseRecord> = match leases.get(resource.as_str())? {
        Some(json) => Some(serde_json::from_str(json.value()).map_err(|e| redb::Error::Corrupted(e.to_string()))?),
        None => None,
    };
    let t = apply_lease(fence, current.as_ref(), command.clone(), now_ms);
    if let Some(fence) = t.fence {
        fences.insert(resource.as_str(), fence.0)?;
    }
    match t.lease {
        LeaseWrite::Keep => {}
        LeaseWrite::Put(record) => {
            let json = serde_json::to_string(&record).expect("a lease record serialises");
            leases.insert(resource.as_str(), json.as_str())?;
        }
        LeaseWrite::Delete => {
            leases.remove(resource.as_str())?;
        }
    }
    Ok(t.outcome)
}

/// Removes up to `max` records that expired at or before `now_ms`, oldest first; the bytes
/// they took ([`record_bytes`]).
fn sweep_expired(
    records: &mut redb::Table<&str, (u64, &str, &[u8])>,
    expiry: &mut redb::Table<(u64, &str), ()>,
    now_ms: u64,
    max: usize,
) -> Result<u64, redb::Error> {
    let (mut swept, mut bytes) = (0, 0);
    while swept < max {
        let oldest = expiry.first()?.map(|(k, _)| {
            let (expires, name) = k.value();
            (expires, name.to_owned())
        });
        let Some((expires, name)) = oldest.filter(|(expires, _)| *expires <= now_ms) else { break };
        expiry.remove((expires, name.as_str()))?;
        // The index entry of a record claimed again after expiring was replaced; the record
        // is only removed if it is the one this entry is for.
        let same = records.get(name.as_str())?.and_then(|v| {
            let (at, owner, json) = v.value();
            (at == expires).then(|| record_bytes(&name, owner, json))
        });
        if let Some(size) = same {
            records.remove(name.as_str())?;
            bytes += size;
        }
        swept += 1;
    }
    Ok(bytes)
}

/// What one record counts against `store.idempotency_records_bytes_max`: its key, claim and
/// JSON, and its expiry twice (the record's and the index's), as stored.
fn record_bytes(name: &str, claim: &str, json: &[u8]) -> u64 {
    (2 * name.len() + claim.len() + json.len() + 16) as u64
}

/// The bytes of every record in the file, counted once at open.
fn records_bytes(db: &Database) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    use redb::{ReadableDatabase, ReadableTable};
    let txn = db.begin_read()?;
    let table = txn.open_table(IDEMPOTENCY)?;
    let mut bytes = 0;
    for entry in table.iter()? {
        let (name, value) = entry?;
        let (_, claim, json) = value.value();
        bytes += record_bytes(name.value(), claim, json);
    }
    Ok(bytes)
}

fn encode(record: &IdempotencyRecord) -> Vec<u8> {
    serde_json::to_vec(record).expect("an idempotency record serialises")
}

fn decode(json: &[u8]) -> Result<IdempotencyRecord, StoreError> {
    serde_json::from_slice(json).map_err(|e| StoreError::Backend(Box::new(e)))
}

mod listing;
mod place;

#[cfg(test)]
mod tests;
