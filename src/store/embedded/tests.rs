use super::place::PlaceError;
use super::writer::record_bytes;
use super::*;
use crate::fence::IdempotencyOutcome;
use redb::ReadableTableMetadata;

#[tokio::test]
async fn a_full_store_refuses_claims_and_never_drops_a_live_record() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    store.set_idempotency_records_max(3, u64::MAX);
    let r = ResourceKey::new("r").unwrap();
    let key = |i: u64| IdempotencyKey::new(r.clone(), format!("req-{i}").as_bytes());
    for i in 0..3u64 {
        let claim = record(&format!("c{i}"), 1_000 + i);
        assert_eq!(store.idempotency_begin(&key(i), &claim, 1).await.unwrap(), IdempotencyBegin::Claimed);
    }
    // Full: the fourth claim is refused, and every live record stays.
    assert_eq!(store.idempotency_begin(&key(3), &record("c3", 1_003), 1).await.unwrap(), IdempotencyBegin::Full);
    for i in 0..3 {
        assert!(store.idempotency_get(&key(i), 1).await.unwrap().is_some(), "record {i} was dropped");
    }
    // Once the first has expired, there is room again (it is swept to make it).
    assert_eq!(store.idempotency_begin(&key(3), &record("c3", 2_000), 1_000).await.unwrap(), IdempotencyBegin::Claimed);
    assert!(store.idempotency_get(&key(0), 1_000).await.unwrap().is_none());
    assert!(store.idempotency_get(&key(1), 1_000).await.unwrap().is_some());
}

#[tokio::test]
async fn records_are_bounded_in_bytes_counted_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let r = ResourceKey::new("r").unwrap();
    let key = |i: u64| IdempotencyKey::new(r.clone(), format!("req-{i}").as_bytes());
    let one = {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let claim = record("c0", 10_000);
        assert_eq!(store.idempotency_begin(&key(0), &claim, 1).await.unwrap(), IdempotencyBegin::Claimed);
        let bytes = {
            let txn = redb::ReadableDatabase::begin_read(&*store.db).unwrap();
            let table = txn.open_table(IDEMPOTENCY).unwrap();
            let v = table.get(key(0).storage_name().as_str()).unwrap().unwrap();
            let (_, owner, json) = v.value();
            record_bytes(&key(0).storage_name(), owner, json)
        };
        store.mark_clean_shutdown().unwrap();
        bytes
    };
    // Reopened with room for two records of that size: the bytes already there count.
    let store = loop {
        if let Ok(s) = EmbeddedStore::open(dir.path()) {
            break s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    store.set_idempotency_records_max(100, 2 * one);
    assert_eq!(store.idempotency_begin(&key(1), &record("c1", 10_000), 1).await.unwrap(), IdempotencyBegin::Claimed);
    assert_eq!(store.idempotency_begin(&key(2), &record("c2", 10_000), 1).await.unwrap(), IdempotencyBegin::Full);
}

#[tokio::test]
async fn a_file_fencegate_cannot_prove_is_its_own_is_refused() {
    // Empty (a crash during creation, a truncated restore): no silent fresh start.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(FILE_NAME), b"").unwrap();
    assert!(matches!(EmbeddedStore::open(dir.path()), Err(OpenError::NotOurs { why: "it is empty", .. })));
    // Some other redb database.
    let other = tempfile::tempdir().unwrap();
    drop(redb::Database::create(other.path().join(FILE_NAME)).unwrap());
    assert!(matches!(EmbeddedStore::open(other.path()), Err(OpenError::NotOurs { .. })));
    // Its own file reopens with its fences.
    let ours = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(ours.path()).unwrap();
    let r = ResourceKey::new("r").unwrap();
    store.advance(&r, FenceToken(9)).await.unwrap();
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let mut reopened = None;
    for _ in 0..200 {
        match EmbeddedStore::open(ours.path()) {
            Ok(s) => {
                reopened = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
        }
    }
    assert_eq!(reopened.expect("reopens").load(&r).await.unwrap(), Some(FenceToken(9)));
}

fn record(claim: &str, expires_at_ms: u64) -> IdempotencyRecord {
    IdempotencyRecord {
        claim: claim.into(),
        fingerprint: "f".into(),
        token: FenceToken(1),
        upstream_key: "fg-x".into(),
        expires_at_ms,
        route: "/api/".into(),
        claimed_at_ms: 0,
        outcome: IdempotencyOutcome::InFlight { deadline_ms: expires_at_ms },
    }
}

fn key(i: usize) -> IdempotencyKey {
    IdempotencyKey::new(ResourceKey::new("payment:1").unwrap(), format!("req-{i}").as_bytes())
}

fn count(store: &EmbeddedStore) -> (u64, u64) {
    let txn = store.db.begin_read().unwrap();
    (txn.open_table(IDEMPOTENCY).unwrap().len().unwrap(), txn.open_table(IDEMPOTENCY_EXPIRY).unwrap().len().unwrap())
}

/// Expired records are swept by later commits that add records, a bounded batch at a time,
/// until none is left; live ones stay.
#[tokio::test]
async fn expired_records_are_swept_in_bounded_batches() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let old = 300;
    for i in 0..old {
        store.idempotency_begin(&key(i), &record("a", 1_000), 0).await.unwrap();
    }
    assert_eq!(count(&store), (old as u64, old as u64));
    // One live record per commit, at a time when the old ones have expired.
    let mut sweeps = 0;
    for i in old..old + 20 {
        store.idempotency_begin(&key(i), &record("b", 10_000), 2_000).await.unwrap();
        sweeps += 1;
        if count(&store).0 == (i - old + 1) as u64 {
            break;
        }
    }
    let swept_per_commit = SWEEP_PER_COMMIT_MIN;
    assert_eq!(sweeps, old.div_ceil(swept_per_commit), "a bounded batch per commit");
    assert_eq!(count(&store), (sweeps as u64, sweeps as u64), "only the live records are left");
    assert!(store.idempotency_get(&key(0), 2_000).await.unwrap().is_none());
    assert!(store.idempotency_get(&key(old), 2_000).await.unwrap().is_some());
}

/// A key whose record expired is claimed again; the old claimant can no longer finish it.
#[tokio::test]
async fn an_expired_record_is_claimed_again_and_its_old_claim_is_void() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let k = key(1);
    assert_eq!(store.idempotency_begin(&k, &record("a", 100), 0).await.unwrap(), IdempotencyBegin::Claimed);
    assert!(
        matches!(store.idempotency_begin(&k, &record("b", 500), 50).await.unwrap(), IdempotencyBegin::Existing(r) if r.claim == "a")
    );
    assert_eq!(store.idempotency_begin(&k, &record("b", 500), 100).await.unwrap(), IdempotencyBegin::Claimed);
    store.idempotency_finish(&k, "a", None).await.unwrap();
    assert_eq!(store.idempotency_get(&k, 100).await.unwrap().unwrap().claim, "b");
    assert_eq!(count(&store), (1, 1));
    store.idempotency_finish(&k, "b", None).await.unwrap();
    assert_eq!(count(&store), (0, 0));
}

/// Opens the store in `dir`, waiting for the writer thread of one just dropped to let go of it.
fn reopen(dir: &std::path::Path) -> EmbeddedStore {
    try_reopen(dir).unwrap_or_else(|e| panic!("reopening the store: {e}"))
}

/// [`reopen`], with any refusal but "still in use" returned.
fn try_reopen(dir: &std::path::Path) -> Result<EmbeddedStore, OpenError> {
    for _ in 0..200 {
        match EmbeddedStore::open(dir) {
            Err(OpenError::Place(PlaceError::Claimed { .. }) | OpenError::Open { .. }) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            opened => return opened,
        }
    }
    panic!("the store file stayed locked");
}

/// Waits until the store that was open in `dir` is closed (its writer thread lets go of the
/// file, then of the claim).
fn wait_closed(dir: &std::path::Path) {
    for _ in 0..200 {
        if Place::claim(dir).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("the store in {} stayed open", dir.display());
}

/// A copy of the store directory `dir`'s files, once the store open there is closed.
fn copy_of(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    wait_closed(dir);
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).map(|p| (p.clone(), std::fs::read(p).unwrap())).collect()
}

fn put_back(copy: &[(std::path::PathBuf, Vec<u8>)]) {
    for (path, bytes) in copy {
        std::fs::write(path, bytes).unwrap();
    }
}

/// An older copy put back (in place, so the file keeps its inode) is refused before it
/// admits anything, even after a clean stop; the newest copy put back opens; an operator who
/// takes the older one on purpose gets a start that holds writes as after a crash.
#[tokio::test]
async fn an_older_copy_put_back_is_refused_until_the_operator_accepts_it() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let r = ResourceKey::new("job:a").unwrap();
    let store = EmbeddedStore::open(&dir).unwrap();
    store.advance(&r, FenceToken(5)).await.unwrap();
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let older = copy_of(&dir);
    let store = reopen(&dir);
    store.advance(&r, FenceToken(7)).await.unwrap();
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let newest = copy_of(&dir);

    put_back(&older);
    let refused = try_reopen(&dir).err().expect("an older copy opened");
    assert!(matches!(refused, OpenError::WentBack { .. }), "{refused}");
    assert!(refused.to_string().contains("--accept-restored"), "{refused}");
    // Refusing changed nothing: it is refused again, and the newest copy still opens.
    assert!(matches!(try_reopen(&dir), Err(OpenError::WentBack { .. })));
    put_back(&newest);
    let store = reopen(&dir);
    assert_eq!(store.load(&r).await.unwrap(), Some(FenceToken(7)));
    assert!(store.opened_clean());
    store.mark_clean_shutdown().unwrap();
    drop(store);

    wait_closed(&dir);
    put_back(&older);
    let accepted = EmbeddedStore::accept_as_newest(&dir, &Options::default()).unwrap();
    assert!(accepted.witnessed.is_some(), "{accepted}");
    let store = reopen(&dir);
    assert_eq!(store.load(&r).await.unwrap(), Some(FenceToken(5)));
    assert!(!store.opened_clean(), "an accepted copy starts as after a crash");
    store.advance(&ResourceKey::new("job:b").unwrap(), FenceToken(9)).await.unwrap();
    store.mark_clean_shutdown().unwrap();
    drop(store);
    // The copy set aside before, though it ran longer, is not what was accepted: refused.
    let set_aside = copy_of(&dir);
    put_back(&newest);
    assert!(matches!(try_reopen(&dir), Err(OpenError::Replaced { .. })));
    put_back(&set_aside);
    drop(reopen(&dir));
}

/// A witness inside the store directory would be restored with it: refused however the path
/// names it (relative, through `..`).
#[test]
fn a_witness_inside_the_store_directory_is_refused() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    for inside in [dir.join("w"), dir.join("sub/../w"), parent.path().join("fences/./w")] {
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let options = Options { witness_path: Some(inside.clone()), ..Options::default() };
        let refused = EmbeddedStore::open_with(&dir, &options).err();
        assert!(matches!(refused, Some(OpenError::WitnessInside { .. })), "{inside:?}: {refused:?}");
    }
    let outside = Options { witness_path: Some(parent.path().join("elsewhere.witness")), ..Options::default() };
    drop(EmbeddedStore::open_with(&dir, &outside).unwrap());
}

/// A crash during a store's first start, after its witness named it and before its first
/// commit: the next start makes the store the witness named. Before: refused for good.
#[test]
fn a_first_start_that_crashed_before_its_first_commit_starts_again() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let me = rustix::process::geteuid().as_raw();
    drop(witness::Witness::create(&parent.path().join("fences.witness"), 42, 0, me).unwrap());
    std::fs::write(parent.path().join("empty.witness"), b"").unwrap();
    drop(reopen(&dir));
    let other = parent.path().join("empty");
    drop(EmbeddedStore::open(&other).unwrap());
}

/// The witness removed under a running store: no change is made any more (its records would
/// go to a file no later start reads), and readiness says so.
#[tokio::test]
async fn a_witness_removed_under_a_running_store_stops_every_change() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let store = EmbeddedStore::open(&dir).unwrap();
    let r = ResourceKey::new("job:a").unwrap();
    store.advance(&r, FenceToken(5)).await.unwrap();
    std::fs::remove_file(parent.path().join("fences.witness")).unwrap();
    assert!(matches!(store.advance(&r, FenceToken(6)).await, Err(StoreError::Poisoned)));
    assert!(matches!(store.ping().await, Err(StoreError::FileLost)));
}

/// The store directory removed (or a new, empty one put in its place) while no process runs:
/// the witness beside it refuses a fresh start, and leaves no file behind doing so.
#[tokio::test]
async fn a_store_removed_while_stopped_is_not_started_anew() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let store = EmbeddedStore::open(&dir).unwrap();
    store.advance(&ResourceKey::new("job:a").unwrap(), FenceToken(5)).await.unwrap();
    drop(store);
    wait_closed(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(try_reopen(&dir), Err(OpenError::Replaced { .. })));
    assert!(!dir.join(FILE_NAME).exists(), "a refused start made a file");
    // Another store's file there is refused too.
    let other = parent.path().join("other");
    drop(EmbeddedStore::open(&other).unwrap());
    wait_closed(&other);
    std::fs::copy(other.join(FILE_NAME), dir.join(FILE_NAME)).unwrap();
    assert!(matches!(try_reopen(&dir), Err(OpenError::Replaced { .. })));
    // The operator starts anew on purpose: a new, empty store, held at its first start.
    std::fs::remove_file(dir.join(FILE_NAME)).unwrap();
    let accepted = EmbeddedStore::accept_as_newest(&dir, &Options::default()).unwrap();
    assert!(accepted.made_new && accepted.witnessed.is_some(), "{accepted:?}");
    let store = reopen(&dir);
    assert!(!store.opened_clean());
    assert_eq!(store.load(&ResourceKey::new("job:a").unwrap()).await.unwrap(), None);
}

/// A store with commits and no witness is refused (a removed witness looks like a restored
/// copy); a witness one commit behind (a crash between the store's commit and the witness's)
/// is the normal case of a crash and opens.
#[tokio::test]
async fn a_missing_witness_is_refused_and_one_a_commit_behind_is_not() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let witness_path = parent.path().join("fences.witness");
    let store = EmbeddedStore::open(&dir).unwrap();
    store.advance(&ResourceKey::new("job:a").unwrap(), FenceToken(5)).await.unwrap();
    drop(store);
    wait_closed(&dir);
    let me = rustix::process::geteuid().as_raw();
    let seen = witness::read(&witness_path, me).unwrap().expect("a witness beside the store");
    drop(witness::Witness::create(&witness_path, seen.store_id, seen.generation - 1, me).unwrap());
    drop(reopen(&dir));
    std::fs::remove_file(&witness_path).unwrap();
    assert!(matches!(try_reopen(&dir), Err(OpenError::WitnessMissing { .. })));
}

/// A new file and a clean shutdown open clean; a process that stopped without recording a
/// clean shutdown (killed, crashed) leaves the next start unclean, once.
#[test]
fn an_unclean_stop_is_seen_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let reopen = || reopen(dir.path());
    let store = reopen();
    assert!(store.opened_clean(), "a new file");
    drop(store); // as if killed: no mark
    let store = reopen();
    assert!(!store.opened_clean());
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let store = reopen();
    assert!(store.opened_clean());
    drop(store);
    assert!(!reopen().opened_clean(), "the mark is used up");
}

/// A recorded hold is read by every later open, a clean stop in between included, until
/// another is recorded.
#[test]
fn a_recorded_hold_outlives_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let reopen = || reopen(dir.path());
    let store = reopen();
    let hold = |until_ms| Hold { until_ms, boot: Some(BootHold { boot_id: 7, until_ms: until_ms / 10 }) };
    assert_eq!(store.held(), None, "a new file holds nothing");
    store.hold_until(hold(1_000_000)).unwrap();
    store.mark_clean_shutdown().unwrap();
    drop(store);
    let store = reopen();
    assert!(store.opened_clean());
    assert_eq!(store.held(), Some(hold(1_000_000)));
    store.hold_until(Hold { until_ms: 2_000_000, boot: None }).unwrap();
    drop(store); // killed
    let store = reopen();
    assert!(!store.opened_clean());
    assert_eq!(store.held(), Some(Hold { until_ms: 2_000_000, boot: None }), "a hold without its boot's");
}

/// The store directory removed under a running process: no change is made any more (it would
/// be fsynced into a file no later start reads), readiness says why, and no second store opens
/// on the path while the first is open (two gates, two fences).
#[tokio::test]
async fn a_store_whose_file_is_gone_refuses_changes_and_its_path_stays_claimed() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("fences");
    let store = EmbeddedStore::open(&dir).unwrap();
    let r = ResourceKey::new("job:a").unwrap();
    store.advance(&r, FenceToken(5)).await.unwrap();
    assert!(matches!(EmbeddedStore::open(&dir), Err(OpenError::Place(_))), "a second store on the same path");
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(store.ping().await, Err(StoreError::FileLost)));
    assert!(matches!(store.advance(&r, FenceToken(6)).await, Err(StoreError::Poisoned)));
    assert!(matches!(EmbeddedStore::open(&dir), Err(OpenError::Place(_))), "still claimed after the removal");
}
