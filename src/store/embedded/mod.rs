//! The embedded fence store: one redb file, fsync on every advance, advances from many
//! resources group-committed by one writer thread. Layout and crash points: `docs/design.md`,
//! section 5. The API gateway's idempotency records live in the same file and go through the
//! same writer; expired ones are swept in bounded batches by the commits that add records.

use self::place::{Place, PlaceError};
use self::witness::{Seen, Witness, WitnessError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use crate::fence::{
    AdvanceOutcome, BootHold, FenceStore, FenceToken, Hold, IdempotencyBegin, IdempotencyKey, IdempotencyRecord,
    IdempotencyStore, Keep, LeaseCommand, LeaseOutcome, LeaseRecord, LeaseStore, LeaseWrite, RecordLimits, ResourceKey,
    StoreError, apply_lease,
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
/// The same hold's boot and its end on that boot's `CLOCK_BOOTTIME` (ms), when known.
const HOLD_BOOT_ID: &str = "hold_boot_id";
const HOLD_UNTIL_BOOT_MS: &str = "hold_until_boot_ms";
/// The store's id, made at its first commit: its witness names it ([`witness`]).
const STORE_ID: &str = "store_id";
/// Commits made to the store, this one included: one more in every commit's transaction.
const GENERATION: &str = "generation";

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
    #[error(
        "the fence store {path} went back in time: it has {generation} commits, but its witness {witness} saw \
         {witnessed} (an older copy restored, or the file replaced). Its fences may be below tokens already \
         admitted, granted or registered: refusing to start. Put the newest copy back, or take this one as it is \
         with `fencegate init-store --accept-restored`"
    )]
    WentBack { path: PathBuf, witness: PathBuf, generation: u64, witnessed: u64 },
    #[error(
        "the fence store {path} is not the one its witness {witness} saw after {generation} commits (a new or \
         another store where that one was: removed, moved or replaced): refusing to start with its fences. Put \
         that store back, or take this one as it is with `fencegate init-store --accept-restored`"
    )]
    Replaced { path: PathBuf, witness: PathBuf, generation: u64 },
    #[error(
        "the fence store {path} has {generation} commits but its witness {witness} is missing (removed, or the \
         store was moved without it), as it would be for a restored copy: refusing to start. Put the witness \
         back, or, if this is the newest copy, take it as it is with `fencegate init-store --accept-restored`"
    )]
    WitnessMissing { path: PathBuf, witness: PathBuf, generation: u64 },
    #[error(
        "store.witness_path ({witness}) is inside the store directory {dir}: restored with it, it would agree with any copy"
    )]
    WitnessInside { witness: PathBuf, dir: PathBuf },
    #[error(
        "the fence store {dir} belongs to uid {owner}: run this as its owner (this is uid {me}), or the files made \
         would be another user's"
    )]
    NotOwner { dir: PathBuf, owner: u32, me: u32 },
    #[error(transparent)]
    Witness(#[from] WitnessError),
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
    /// Keep (or, with `None`, forget) the upload record under `name`, a new one within
    /// `limits`.
    Upload {
        name: String,
        json: Option<String>,
        limits: RecordLimits,
        reply: oneshot::Sender<Result<Keep, StoreError>>,
    },
}

/// The outcome of one request inside a committed batch.
enum WriteOutcome {
    Advance(AdvanceOutcome),
    Lease(LeaseOutcome),
    /// The live record that was already there, if any.
    IdempotencyBegin(Option<Vec<u8>>),
    IdempotencyFinish,
    Upload(Keep),
}

impl WriteRequest {
    fn answer(self, outcome: Result<WriteOutcome, StoreError>) {
        match (self, outcome) {
            (Self::Advance { reply, .. }, Ok(WriteOutcome::Advance(o))) => drop(reply.send(Ok(o))),
            (Self::Lease { reply, .. }, Ok(WriteOutcome::Lease(o))) => drop(reply.send(Ok(o))),
            (Self::IdempotencyBegin { reply, .. }, Ok(WriteOutcome::IdempotencyBegin(o))) => drop(reply.send(Ok(o))),
            (Self::IdempotencyFinish { reply, .. }, Ok(WriteOutcome::IdempotencyFinish)) => drop(reply.send(Ok(()))),
            (Self::Upload { reply, .. }, Ok(WriteOutcome::Upload(keep))) => drop(reply.send(Ok(keep))),
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
    /// Written after every commit; held through the commit, so commits reach it in order.
    witness: Arc<Mutex<Witness>>,
    writes: mpsc::Sender<WriteRequest>,
    /// Set after any failed commit: from then on every call fails until a restart reopens
    /// (and so recovers) the file. A commit that failed half-way is never trusted.
    poisoned: Arc<AtomicBool>,
    /// Whether the last process that used the file shut down with no write in flight.
    opened_clean: bool,
    /// The hold an earlier start recorded (`HOLD_UNTIL_MS` and its boot's), as read at open.
    held: Option<Hold>,
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
        Self::open_with(dir, &Options::default())
    }

    /// Like [`Self::open`], with redb's page cache bounded to `cache_bytes`.
    pub fn open_with_cache(dir: &Path, cache_bytes: usize) -> Result<Self, OpenError> {
        Self::open_with(dir, &Options { cache_bytes, ..Options::default() })
    }

    /// Like [`Self::open`], with `options`. Refuses a store that went back in time (its
    /// witness saw later commits, or another store: [`witness`]) before it admits or commits
    /// anything.
    pub fn open_with(dir: &Path, options: &Options) -> Result<Self, OpenError> {
        Ok(Self::open_located(locate(dir, options)?, options, Trust::Witness)?.0)
    }

    /// `fencegate init-store --accept-restored`: the operator takes the store in `dir` as it
    /// is for the newest copy, whatever its witness saw (a new, empty store when there is
    /// none). It gets a new id, so that no copy set aside before (another descendant of the
    /// same store) passes its witness again; the witness is written anew; and the store is
    /// left as after a crash, so that the next start holds writes for D. Its fences may be
    /// below tokens used after the copy was made: `reconcile --apply=raise_fence` raises them to the
    /// upstream's stamps; registrations and grants made after the copy are lost.
    pub fn accept_as_newest(dir: &Path, options: &Options) -> Result<Accepted, OpenError> {
        let located = locate(dir, options)?;
        let me = rustix::process::geteuid().as_raw();
        if me != located.owner {
            // Its files would be another user's, which the store's owner could not open.
            return Err(OpenError::NotOwner { dir: located.claimed.dir().into(), owner: located.owner, me });
        }
        let (path, witness) = (located.path.clone(), located.witness_path.clone());
        let made_new = !path.exists();
        let (store, facts, witnessed) = Self::open_located(located, options, Trust::Operator)?;
        drop(store); // no clean-shutdown mark: the next start holds, as after a crash
        Ok(Accepted { path, witness, generation: facts.generation, witnessed, made_new })
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

    /// Facts about the file (`None`: removed), committed durably together (and witnessed)
    /// before it returns.
    fn set_meta(&self, facts: &[(&str, Option<u64>)]) -> Result<(), StoreError> {
        self.check_poisoned()?;
        let mut witness = self.witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut set = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let txn = self.db.begin_write()?;
            let generation = {
                let mut meta = txn.open_table(META)?;
                for (name, value) in facts {
                    match value {
                        Some(value) => drop(meta.insert(*name, *value)?),
                        None => drop(meta.remove(*name)?),
                    }
                }
                next_generation(&mut meta)?.generation
            };
            txn.commit()?;
            witness.record(generation)?;
            Ok(())
        };
        set().map_err(|error| {
            self.poisoned.store(true, Ordering::Release);
            StoreError::Backend(error)
        })
    }

    fn check_poisoned(&self) -> Result<(), StoreError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(StoreError::Poisoned);
        }
        Ok(())
    }
}

/// How to open an embedded store.
#[derive(Debug, Clone)]
pub struct Options {
    /// redb's page cache (`store.cache_bytes_max`).
    pub cache_bytes: usize,
    /// The witness (`store.witness_path`); default: beside the store directory
    /// ([`witness::default_path`]).
    pub witness_path: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self { cache_bytes: DEFAULT_CACHE_BYTES, witness_path: None }
    }
}

/// What `accept_as_newest` did.
#[derive(Debug)]
pub struct Accepted {
    pub path: PathBuf,
    pub witness: PathBuf,
    /// The store's generation now.
    pub generation: u64,
    /// What the witness said before, if it said anything.
    pub witnessed: Option<Seen>,
    /// There was no store file: a new, empty store was made.
    pub made_new: bool,
}

impl std::fmt::Display for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (path, witness) = (self.path.display(), self.witness.display());
        if self.made_new {
            return write!(
                f,
                "there was no store at {path}: made a new, empty one (every fence, lease and record it had is gone) \
                 with a new witness {witness}; the next start holds writes for fencing.inflight_deadline_ms, as \
                 after a crash. Raise the fences of resources with objects to the upstream's stamps with \
                 `fencegate reconcile --bucket BUCKET --apply=raise_fence` once fencegate runs"
            );
        }
        match self.witnessed {
            Some(seen) => write!(
                f,
                "accepted {path} as the newest copy (its witness {witness} had seen {} commits)",
                seen.generation
            )?,
            None => write!(f, "accepted {path} as the newest copy (its witness {witness} was missing or unreadable)")?,
        }
        write!(
            f,
            "; the next start holds writes for fencing.inflight_deadline_ms, as after a crash. Its fences may be \
             below tokens used since the copy was made: once fencegate runs, raise them to the upstream's stamps \
             with `fencegate reconcile --bucket BUCKET --apply=raise_fence`"
        )
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
        let witness = self.witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner).check();
        if let Err(lost) = witness {
            if !self.poisoned.swap(true, Ordering::AcqRel) {
                tracing::error!(error = %lost, "fence store witness lost");
            }
            return Err(StoreError::FileLost);
        }
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
        self.set_meta(&[(CLEAN_SHUTDOWN, Some(1))])
    }

    fn held(&self) -> Option<Hold> {
        self.held
    }

    fn hold_until(&self, hold: Hold) -> Result<(), StoreError> {
        let mut facts = vec![(HOLD_UNTIL_MS, Some(hold.until_ms))];
        facts.push((HOLD_BOOT_ID, hold.boot.map(|b| b.boot_id)));
        facts.push((HOLD_UNTIL_BOOT_MS, hold.boot.map(|b| b.until_ms)));
        self.set_meta(&facts)
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

/// Who the store is and how many commits it has had.
#[derive(Debug, Clone, Copy)]
struct Facts {
    store_id: u64,
    generation: u64,
}

/// One more commit, inside the transaction that makes it (the store's id made on the first).
fn next_generation(meta: &mut redb::Table<&str, u64>) -> Result<Facts, redb::Error> {
    let stored = meta.get(STORE_ID)?.map(|v| v.value());
    let store_id = match stored {
        Some(id) => id,
        None => {
            let id = uuid::Uuid::new_v4().as_u64_pair().0;
            meta.insert(STORE_ID, id)?;
            id
        }
    };
    let generation = meta.get(GENERATION)?.map_or(0, |v| v.value()) + 1;
    meta.insert(GENERATION, generation)?;
    Ok(Facts { store_id, generation })
}

mod listing;
mod open;
mod place;
mod uploads;
mod writer;

use self::open::{Trust, locate};
use self::writer::{Writer, decode, encode};
pub mod witness;

#[cfg(test)]
mod tests;
