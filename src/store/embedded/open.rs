//! Finding and opening the store's file: where it is, whether it is the one its witness saw,
//! and the facts each opening commit records.

use super::writer::records_bytes;
use super::*;

/// Whom an open trusts about the store's past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Trust {
    /// The witness: a store that did not descend from what it saw is refused.
    Witness,
    /// The operator, who takes the store as it is (`--accept-restored`).
    Operator,
}

/// A claimed store directory: the file's path, the witness's, and the directory's owner (the
/// witness's too).
pub(super) struct Located {
    pub(super) claimed: place::Claimed,
    pub(super) path: PathBuf,
    pub(super) witness_path: PathBuf,
    pub(super) owner: u32,
}

pub(super) fn locate(dir: &Path, options: &Options) -> Result<Located, OpenError> {
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
pub(super) fn open_file(path: &Path, created: bool, options: &Options) -> Result<Database, OpenError> {
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

/// The store's facts as they are (`None` for a new file, or one made before stores had them).
pub(super) fn facts(db: &Database) -> Result<Option<Facts>, Box<dyn std::error::Error + Send + Sync>> {
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

/// Whether the store has every commit its witness saw ([`witness`], the module doc).
pub(super) fn judge_against_witness(
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

/// The id the opened store goes by: a new one when the operator takes it as it is, else the
/// stored one, or the witness's, or a new one for a new store (its witness made first).
fn store_id(
    trust: Trust,
    stored: Option<Facts>,
    witnessed: Option<Seen>,
    witness_path: &Path,
    owner: u32,
) -> Result<u64, OpenError> {
    let new_id = || uuid::Uuid::new_v4().as_u64_pair().0;
    Ok(match (trust, stored, witnessed) {
        (Trust::Operator, ..) => new_id(),
        (Trust::Witness, Some(facts), _) => facts.store_id,
        (Trust::Witness, None, Some(seen)) => seen.store_id,
        (Trust::Witness, None, None) => {
            // A store's witness is there before its first commit: a crash right after that
            // commit must leave a witness that names it.
            let id = new_id();
            drop(Witness::create(witness_path, id, 0, owner)?);
            id
        }
    })
}

/// The opening commit: every table made, the store id and the next generation recorded, the
/// clean-shutdown mark taken. Returns the facts, whether the last process stopped cleanly, and
/// the hold it left.
fn init(db: &Database, store_id: u64) -> Result<(Facts, bool, Option<Hold>), Box<dyn std::error::Error + Send + Sync>> {
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
}

impl EmbeddedStore {
    /// Opens the located store. With [`Trust::Witness`], a store that did not descend from what
    /// its witness saw is refused; with [`Trust::Operator`], it is taken as it is, under a new
    /// id. Returns the store, its facts after the opening commit, and what the witness said.
    pub(super) fn open_located(
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
        let store_id = store_id(trust, stored, witnessed, &witness_path, owner)?;
        let (facts, opened_clean, held) =
            init(&db, store_id).map_err(|source| OpenError::Init { path: path.clone(), source })?;
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
}
