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

    /// Opens the located store. With [`Trust::Witness`], a store that did not descend from what
    /// its witness saw is refused; with [`Trust::Operator`], it is taken as it is, under a new
    /// id. Returns the store, its facts after the opening commit, and what the witness said.
    fn open_located(
        located: Located,
        options: &Options,
        trust: Trust,
    ) -> Result<(Self, Facts, Option<Seen>), OpenError> {
        let Located { claimed, path, witness_path, owner } = located;
        let witnessed = match (witness::read(&witness_path, owner), trust) {
            (Ok(seen), _) => seen,
            // An unreadable witness is what the operator replaces.
            (Err(WitnessError::Unreadable { .. }), Trust::Operator) => None,
            (Err(e), _) => return Err(e.into()),
        };
        let created = !path.exists();
        // A witness that saw no commit (a crash during a first start) names the store to make.
        let seen_commits = witnessed.filter(|seen| seen.generation > 0);
        if trust == Trust::Witness
            && created
            && let Some(seen) = seen_commits
        {
            // Checked before the file is made: a refused start makes none.
            return Err(OpenError::Replaced { path, witness: witness_path, generation: seen.generation });
        }
        let db = open_file(&path, created, options)?;
        let stored = facts(&db).map_err(|source| OpenError::Init { path: path.clone(), source })?;
        if trust == Trust::Witness {
            judge_against_witness(&path, &witness_path, stored, seen_commits)?;
        }
        let new_id = || uuid::Uuid::new_v4().as_u64_pair().0;
        let store_id = match (trust, stored, witnessed) {
            (Trust::Operator, ..) => new_id(),
            (Trust::Witness, Some(facts), _) => facts.store_id,
            (Trust::Witness, None, Some(seen)) => seen.store_id,
            (Trust::Witness, None, None) => {
                // A store's witness is there before its first commit: a crash right after that
                // commit must leave a witness that names it.
                let id = new_id();
                drop(Witness::create(&witness_path, id, 0, owner)?);
                id
            }
        };
        let init = || -> Result<(Facts, bool, Option<Hold>), Box<dyn std::error::Error + Send + Sync>> {
            let txn = db.begin_write()?;
            txn.open_table(FENCES)?;
            txn.open_table(LEASES)?;
            txn.open_table(IDEMPOTENCY)?;
            txn.open_table(IDEMPOTENCY_EXPIRY)?;
            txn.open_table(UPLOADS)?;
            let (facts, opened_clean, held) = {
                let mut meta = txn.open_table(META)?;
                let boot = match (meta.get(HOLD_BOOT_ID)?.map(|v| v.value()), meta.get(HOLD_UNTIL_BOOT_MS)?) {
                    (Some(boot_id), Some(until)) => Some(BootHold { boot_id, until_ms: until.value() }),
                    _ => None,
                };
                let held = meta.get(HOLD_UNTIL_MS)?.map(|v| Hold { until_ms: v.value(), boot });
                meta.insert(STORE_ID, store_id)?;
                let facts = next_generation(&mut meta)?;
                (facts, meta.remove(CLEAN_SHUTDOWN)?.is_some(), held)
            };
            txn.commit()?;
            Ok((facts, opened_clean, held))
        };
        let (facts, opened_clean, held) = init().map_err(|source| OpenError::Init { path: path.clone(), source })?;
        // Written over whatever was there (never removed first: a crash in between would leave
        // a store with no witness, which a start would take for a restored copy's).
        let witness = Witness::create(&witness_path, facts.store_id, facts.generation, owner)?;
        // A new file had no process before this one (unless the operator made it in place of
        // a lost store: then its first start holds, as after a crash).
        let opened_clean = opened_clean || (created && trust == Trust::Witness);
        let place = Arc::new(claimed.opened(&path)?);

        let db = Arc::new(db);
        let witness = Arc::new(Mutex::new(witness));
        let poisoned = Arc::new(AtomicBool::new(false));
        let (writes, queue) = mpsc::channel(WRITE_QUEUE_MAX);
        let records_max = Arc::new(AtomicUsize::new(IDEMPOTENCY_RECORDS_MAX));
        let records_bytes_max = Arc::new(AtomicU64::new(IDEMPOTENCY_RECORDS_BYTES_MAX));
        let records_bytes = records_bytes(&db).map_err(|source| OpenError::Init { path: path.clone(), source })?;
        let uploads = uploads::Counted::of(&db).map_err(|source| OpenError::Init { path, source })?;
        let writer = Writer {
            db: db.clone(),
            place: place.clone(),
            witness: witness.clone(),
            poisoned: poisoned.clone(),
            records_max: records_max.clone(),
            records_bytes_max: records_bytes_max.clone(),
            records_bytes,
            uploads,
        };
        std::thread::Builder::new()
            .name("fence-store-writer".into())
            .spawn(move || writer.run(queue))
            .expect("spawning the fence store writer thread");
        let store = Self { db, place, witness, writes, poisoned, opened_clean, held, records_max, records_bytes_max };
        Ok((store, facts, witnessed))
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

/// Whom an open trusts about the store's past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trust {
    /// The witness: a store that did not descend from what it saw is refused.
    Witness,
    /// The operator, who takes the store as it is (`--accept-restored`).
    Operator,
}

/// A claimed store directory: the file's path, the witness's, and the directory's owner (the
/// witness's too).
struct Located {
    claimed: place::Claimed,
    path: PathBuf,
    witness_path: PathBuf,
    owner: u32,
}

fn locate(dir: &Path, options: &Options) -> Result<Located, OpenError> {
    std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir { path: dir.into(), source })?;
    let claimed = Place::claim(dir)?;
    let path = dir.join(FILE_NAME);
    let owner = std::fs::metadata(claimed.dir())
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .map_err(|source| OpenError::CreateDir { path: dir.into(), source })?;
    let witness_path = match &options.witness_path {
        None => witness::default_path(claimed.dir()),
        Some(configured) => {
            // Restored with the store, it would agree with any copy: it must be outside the
            // directory, whatever the path says (relative, `..`, a link).
            let parent = configured.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            let parent =
                parent.canonicalize().map_err(|source| WitnessError::Io { path: configured.clone(), source })?;
            if parent.starts_with(claimed.dir()) {
                return Err(OpenError::WitnessInside { witness: configured.clone(), dir: claimed.dir().into() });
            }
            parent.join(configured.file_name().unwrap_or_default())
        }
    };
    Ok(Located { claimed, path, witness_path, owner })
}

/// Opens the database at `path` (made now when `created`), refusing a file fencegate cannot
/// prove is its own.
fn open_file(path: &Path, created: bool, options: &Options) -> Result<Database, OpenError> {
    // redb would initialise an empty file as a new database: a crash during creation, a
    // failed restore or a truncation would silently drop every fence.
    if !created && std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Err(OpenError::NotOurs { path: path.into(), why: "it is empty" });
    }
    let db = Database::builder()
        .set_cache_size(options.cache_bytes)
        .create(path)
        .map_err(|source| OpenError::Open { path: path.into(), source })?;
    // Every file fencegate creates has its tables from the first commit on.
    if !created && !has_fences_table(&db) {
        return Err(OpenError::NotOurs { path: path.into(), why: "it has no fences table" });
    }
    Ok(db)
}

/// Who the store is and how many commits it has had.
#[derive(Debug, Clone, Copy)]
struct Facts {
    store_id: u64,
    generation: u64,
}

/// The store's facts as they are (`None` for a new file, or one made before stores had them).
fn facts(db: &Database) -> Result<Option<Facts>, Box<dyn std::error::Error + Send + Sync>> {
    let txn = db.begin_read()?;
    let meta = match txn.open_table(META) {
        Ok(meta) => meta,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let Some(store_id) = meta.get(STORE_ID)?.map(|v| v.value()) else { return Ok(None) };
    let generation = meta.get(GENERATION)?.map_or(0, |v| v.value());
    Ok(Some(Facts { store_id, generation }))
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

/// Whether the store has every commit its witness saw ([`witness`], the module doc).
fn judge_against_witness(
    path: &Path,
    witness: &Path,
    stored: Option<Facts>,
    witnessed: Option<Seen>,
) -> Result<(), OpenError> {
    let (path, witness) = (path.to_path_buf(), witness.to_path_buf());
    match (stored, witnessed) {
        (Some(facts), None) if facts.generation > 0 => {
            Err(OpenError::WitnessMissing { path, witness, generation: facts.generation })
        }
        (None, Some(seen)) => Err(OpenError::Replaced { path, witness, generation: seen.generation }),
        (Some(facts), Some(seen)) if facts.store_id != seen.store_id => {
            Err(OpenError::Replaced { path, witness, generation: seen.generation })
        }
        (Some(facts), Some(seen)) if facts.generation < seen.generation => {
            Err(OpenError::WentBack { path, witness, generation: facts.generation, witnessed: seen.generation })
        }
        _ => Ok(()),
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

/// The one thread that writes: takes every queued change, applies them in one transaction,
/// commits (fsync) once, then answers each caller.
struct Writer {
    db: Arc<Database>,
    place: Arc<Place>,
    witness: Arc<Mutex<Witness>>,
    poisoned: Arc<AtomicBool>,
    /// `store.idempotency_records_max`.
    records_max: Arc<AtomicUsize>,
    /// `store.idempotency_records_bytes_max`.
    records_bytes_max: Arc<AtomicU64>,
    /// The bytes the records take now ([`record_bytes`] each), counted at open and kept up
    /// to date by every change (a failed commit poisons the store, so it never drifts).
    records_bytes: u64,
    /// The upload records' counts, kept the same way.
    uploads: uploads::Counted,
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
            let witness = self.witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner).check();
            if let Err(lost) = witness {
                // Its records would go to a file no later start reads: a copy restored then
                // would pass.
                if !self.poisoned.swap(true, Ordering::AcqRel) {
                    tracing::error!(error = %lost, "fence store witness lost");
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

    fn commit(
        &mut self,
        batch: &mut [WriteRequest],
    ) -> Result<Vec<WriteOutcome>, Box<dyn std::error::Error + Send + Sync>> {
        let witness = self.witness.clone();
        let mut witness = witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
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
                    WriteRequest::Upload { name, json, limits, .. } => {
                        WriteOutcome::Upload(self.uploads.write(&mut uploads, name, json.as_deref(), limits)?)
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
        let generation = next_generation(&mut txn.open_table(META)?)?.generation;
        txn.commit()?;
        // Before any caller is answered: the witness never trails an acknowledged change.
        witness.record(generation)?;
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
mod uploads;
pub mod witness;

#[cfg(test)]
mod tests;
