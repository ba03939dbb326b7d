//! The store conformance suite: on every store (embedded, Redis, and etcd when built with it), random sequences of
//! loads, advances and reopens (a restart of fencegate) give exactly the answers of a plain
//! in-memory model, so fences never go back (G1) and every acknowledged advance survives a
//! restart (G2); lease commands give the answers of `fence::apply_lease`; and the API
//! gateway's idempotency records and the multipart upload records keep their contracts.

mod common;

use std::collections::HashMap;

use fencegate::fence::{
    AdvanceOutcome, FenceStore, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyOutcome, IdempotencyRecord,
    IdempotencyStore, Keep, LeaseCommand, LeaseOutcome, LeaseStore, ListingStore, RecordLimits, ReplicaList,
    ResourceKey, Store, UploadRecord, UploadStore,
};
use fencegate::store::{EmbeddedStore, MemoryStore, RedisStore};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Load(u8),
    Advance(u8, u64),
    /// Several advances issued at once, so the writer thread group-commits them.
    Concurrent(Vec<(u8, u64)>),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    // Few resources and small tokens, so sequences revisit the same fences often.
    let resource = 0u8..4;
    let token = prop_oneof![0u64..20, Just(u64::MAX)];
    prop_oneof![
        3 => resource.clone().prop_map(Op::Load),
        5 => (resource.clone(), token.clone()).prop_map(|(r, t)| Op::Advance(r, t)),
        2 => prop::collection::vec((resource, token), 1..6).prop_map(Op::Concurrent),
        1 => Just(Op::Reopen),
    ]
}

/// How a store under test is opened and reopened.
trait Harness {
    type Store: Store;
    async fn open(&self) -> Self::Store;
    /// Every case starts from an empty keyspace: resource names carry the case's prefix.
    fn prefix(&self) -> &str;
}

struct Embedded {
    dir: tempfile::TempDir,
}

impl Harness for Embedded {
    type Store = EmbeddedStore;
    async fn open(&self) -> EmbeddedStore {
        // Reopens once the previous writer thread let go of the file.
        for _ in 0..200 {
            match EmbeddedStore::open(self.dir.path()) {
                Ok(store) => return store,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            }
        }
        panic!("the store could not be reopened");
    }
    fn prefix(&self) -> &str {
        ""
    }
}

struct Redis {
    url: String,
    prefix: String,
}

/// A Redis store on a Redis marked new (`fencegate init-store`).
async fn redis_store(url: &str, timeout: std::time::Duration, threads: usize) -> RedisStore {
    let quiet = std::time::Duration::from_secs(30);
    let store = RedisStore::connect(&[url.to_owned()], timeout, "model".into(), None, threads, quiet).await.unwrap();
    store.init().await.unwrap();
    store
}

impl Harness for Redis {
    type Store = RedisStore;
    async fn open(&self) -> RedisStore {
        redis_store(&self.url, std::time::Duration::from_secs(5), 0).await
    }
    fn prefix(&self) -> &str {
        &self.prefix
    }
}

#[cfg(feature = "etcd")]
struct Etcd {
    endpoints: Vec<String>,
    prefix: String,
}

#[cfg(feature = "etcd")]
impl Harness for Etcd {
    type Store = fencegate::store::EtcdStore;
    async fn open(&self) -> Self::Store {
        fencegate::store::EtcdStore::connect(&self.endpoints, std::time::Duration::from_secs(5), "model".into())
            .await
            .unwrap()
    }
    fn prefix(&self) -> &str {
        &self.prefix
    }
}

fn key_in(prefix: &str, r: u8) -> ResourceKey {
    ResourceKey::new(&format!("{prefix}resource-{r}")).unwrap()
}

/// The model: a map that only ever grows.
fn model_advance(model: &mut HashMap<u8, u64>, r: u8, t: u64) -> AdvanceOutcome {
    match model.get(&r).copied() {
        Some(current) if current >= t => AdvanceOutcome::Unchanged { current: FenceToken(current) },
        previous => {
            model.insert(r, t);
            AdvanceOutcome::Advanced { previous: previous.map(FenceToken) }
        }
    }
}

async fn run<H: Harness>(harness: &H, ops: Vec<Op>) {
    let key = |r: u8| key_in(harness.prefix(), r);
    let mut store = harness.open().await;
    let mut model: HashMap<u8, u64> = HashMap::new();
    for op in ops {
        match op {
            Op::Load(r) => {
                assert_eq!(store.load(&key(r)).await.unwrap(), model.get(&r).copied().map(FenceToken), "load {r}");
            }
            Op::Advance(r, t) => {
                let want = model_advance(&mut model, r, t);
                assert_eq!(store.advance(&key(r), FenceToken(t)).await.unwrap(), want, "advance {r} to {t}");
            }
            Op::Concurrent(batch) => {
                // Issued together; the outcomes may interleave in any order, so only the end
                // state is compared: every resource ends at the maximum advanced to.
                let store_ref = &store;
                let futures =
                    batch.iter().map(|&(r, t)| async move { store_ref.advance(&key(r), FenceToken(t)).await });
                for outcome in futures_util::future::join_all(futures).await {
                    outcome.unwrap();
                }
                for &(r, t) in &batch {
                    model_advance(&mut model, r, t);
                }
                for &(r, _) in &batch {
                    assert_eq!(store.load(&key(r)).await.unwrap(), model.get(&r).copied().map(FenceToken));
                }
            }
            Op::Reopen => {
                drop(store);
                store = harness.open().await;
            }
        }
    }
    drop(store);
    let store = harness.open().await;
    for r in 0..4 {
        assert_eq!(store.load(&key(r)).await.unwrap(), model.get(&r).copied().map(FenceToken), "after reopen {r}");
    }
}

/// Lease commands and advances, for the lease part of the contract.
#[derive(Debug, Clone)]
enum LeaseOp {
    /// Acquire on resource `.0` with the asking replica's floor `.1`.
    Acquire(u8, Option<u64>),
    /// Renew / release the `.1`-th lease id handed out so far (modulo their count).
    Renew(u8, usize),
    Release(u8, usize),
    /// Withdraw the `.1`-th lease id handed out so far, as the gate does after a grant failed.
    Withdraw(u8, usize),
    Advance(u8, u64),
}

fn lease_op() -> impl Strategy<Value = LeaseOp> {
    let resource = 0u8..3;
    prop_oneof![
        4 => (resource.clone(), prop::option::of(0u64..30)).prop_map(|(r, f)| LeaseOp::Acquire(r, f)),
        3 => (resource.clone(), 0usize..8).prop_map(|(r, i)| LeaseOp::Renew(r, i)),
        3 => (resource.clone(), 0usize..8).prop_map(|(r, i)| LeaseOp::Release(r, i)),
        1 => (resource.clone(), 0usize..8).prop_map(|(r, i)| LeaseOp::Withdraw(r, i)),
        2 => (resource, 0u64..30).prop_map(|(r, t)| LeaseOp::Advance(r, t)),
    ]
}

/// An outcome without its times (Redis expires leases on its own clock).
fn untimed(outcome: LeaseOutcome) -> String {
    match outcome {
        LeaseOutcome::Granted(l) => format!("granted {} {} {}", l.holder, l.lease_id, l.token.0),
        LeaseOutcome::Renewed(l) => format!("renewed {} {} {}", l.holder, l.lease_id, l.token.0),
        LeaseOutcome::Held { holder, .. } => format!("held by {holder}"),
        other => format!("{other:?}"),
    }
}

/// Leases on the store under test give the answers of the reference (`MemoryStore`, which
/// applies `fence::apply_lease`): the Redis lease script and the etcd transactions included.
/// TTLs are an hour, so no lease expires during a case.
async fn run_leases<H: Harness>(harness: &H, ops: Vec<LeaseOp>) {
    let key = |r: u8| key_in(harness.prefix(), r);
    let store = harness.open().await;
    let model = MemoryStore::default();
    let mut ids: Vec<String> = Vec::new();
    for (n, op) in ops.into_iter().enumerate() {
        let now_ms =
            u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis())
                .unwrap();
        let pick = |ids: &[String], i: usize| ids.get(i % ids.len().max(1)).cloned().unwrap_or_else(|| "none".into());
        let (r, command) = match op {
            LeaseOp::Advance(r, t) => {
                let want = model.advance(&key(r), FenceToken(t)).await.unwrap();
                assert_eq!(store.advance(&key(r), FenceToken(t)).await.unwrap(), want, "advance {r} to {t}");
                continue;
            }
            LeaseOp::Acquire(r, floor) => {
                ids.push(format!("lease-{n}"));
                let command = LeaseCommand::Acquire {
                    holder: format!("holder-{n}"),
                    ttl_ms: 3_600_000,
                    lease_id: format!("lease-{n}"),
                    floor: floor.map(FenceToken),
                };
                (r, command)
            }
            LeaseOp::Renew(r, i) => (r, LeaseCommand::Renew { lease_id: pick(&ids, i) }),
            LeaseOp::Release(r, i) => (r, LeaseCommand::Release { lease_id: pick(&ids, i) }),
            LeaseOp::Withdraw(r, i) => (r, LeaseCommand::Withdraw { lease_id: pick(&ids, i) }),
        };
        let want = untimed(model.lease(&key(r), command.clone(), now_ms).await.unwrap());
        let got = untimed(store.lease(&key(r), command.clone(), now_ms).await.unwrap());
        assert_eq!(got, want, "{command:?} on {r}");
        assert_eq!(store.load(&key(r)).await.unwrap(), model.load(&key(r)).await.unwrap(), "fence of {r}");
        // The stored lease, which lease credentials are checked against on every request.
        let stored = |l: Option<fencegate::fence::LeaseRecord>| l.map(|l| (l.holder, l.lease_id, l.token, l.ttl_ms));
        assert_eq!(
            stored(store.lease_record(&key(r)).await.unwrap()),
            stored(model.lease_record(&key(r)).await.unwrap()),
            "lease of {r}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]
    #[test]
    fn embedded_store_matches_the_model(ops in prop::collection::vec(op(), 1..40)) {
        runtime().block_on(async {
            run(&Embedded { dir: tempfile::tempdir().unwrap() }, ops).await;
        });
    }

    #[test]
    fn embedded_leases_match_the_reference(ops in prop::collection::vec(lease_op(), 1..40)) {
        runtime().block_on(run_leases(&Embedded { dir: tempfile::tempdir().unwrap() }, ops));
    }
}

/// Runs `check` on 32 generated cases, each with a prefix of its own (one server for all).
fn cases<S: Strategy>(strategy: S, check: impl Fn(String, S::Value)) {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 32, ..ProptestConfig::default() });
    let count = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&strategy, |value| {
        check(format!("case-{}/", count.fetch_add(1, std::sync::atomic::Ordering::Relaxed)), value);
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

#[test]
fn redis_leases_match_the_reference() {
    let redis = runtime().block_on(common::RedisServer::start());
    cases(prop::collection::vec(lease_op(), 1..40), |prefix, ops| {
        runtime().block_on(run_leases(&Redis { url: redis.url(), prefix }, ops));
    });
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_leases_match_the_reference() {
    let etcd = runtime().block_on(common::EtcdCluster::start(1));
    cases(prop::collection::vec(lease_op(), 1..40), |prefix, ops| {
        runtime().block_on(run_leases(&Etcd { endpoints: etcd.endpoints(), prefix }, ops));
    });
}

/// The same cases on Redis: one redis-server for the whole run (each case uses its own key
/// prefix), stopped when the run ends, a failing one included.
#[test]
fn redis_store_matches_the_model() {
    let redis = runtime().block_on(common::RedisServer::start());
    cases(prop::collection::vec(op(), 1..40), |prefix, ops| {
        runtime().block_on(run(&Redis { url: redis.url(), prefix }, ops));
    });
}

/// The same cases on a three-member etcd cluster (each case with its own key prefix).
#[cfg(feature = "etcd")]
#[test]
fn etcd_store_matches_the_model() {
    let etcd = runtime().block_on(common::EtcdCluster::start(3));
    cases(prop::collection::vec(op(), 1..40), |prefix, ops| {
        runtime().block_on(run(&Etcd { endpoints: etcd.endpoints(), prefix }, ops));
    });
}

/// A store on a one-member etcd cluster.
#[cfg(feature = "etcd")]
async fn etcd_store(etcd: &common::EtcdCluster) -> fencegate::store::EtcdStore {
    fencegate::store::EtcdStore::connect(&etcd.endpoints(), std::time::Duration::from_secs(2), "t".into())
        .await
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Both durable stores keep the idempotency contract: one claim per live key, the existing
/// record to everyone else, only the claimant finishes it, removal frees the key, and an
/// expired record counts as absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_stores_keep_the_idempotency_record_contract() {
    let dir = tempfile::tempdir().unwrap();
    let embedded = fencegate::store::EmbeddedStore::open(dir.path()).unwrap();
    record_contract(&embedded, "embedded").await;
    let redis = common::RedisServer::start().await;
    let shared = redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await;
    record_contract(&shared, "redis").await;
    record_contract(&fencegate::store::MemoryStore::default(), "memory").await;
    #[cfg(feature = "etcd")]
    {
        let etcd = common::EtcdCluster::start(1).await;
        let store = etcd_store(&etcd).await;
        record_contract(&store, "etcd").await;
    }
}

/// etcd counts the live idempotency records before a claim (`store.idempotency_records_max`):
/// a claim that finds as many is refused, and a record removed makes room. Before: route traffic
/// could fill etcd's quota, and a full etcd refuses every write, fence advances included.
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_bounds_its_idempotency_records() {
    let etcd = common::EtcdCluster::start(1).await;
    let store = etcd_store(&etcd).await;
    store.set_idempotency_records_max(3);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let claim = |n: u8| {
        let key = IdempotencyKey::new(ResourceKey::new("payment:{1}").unwrap(), &[n]);
        let record = in_flight_claim(&key, &format!("c{n}"), now);
        (key, record)
    };
    for n in 0..3 {
        let (key, record) = claim(n);
        assert_eq!(store.idempotency_begin(&key, &record, now).await.unwrap(), IdempotencyBegin::Claimed);
    }
    let (key, record) = claim(3);
    assert_eq!(store.idempotency_begin(&key, &record, now).await.unwrap(), IdempotencyBegin::Full);
    let (first, first_record) = claim(0);
    assert!(matches!(
        store.idempotency_begin(&first, &first_record, now).await.unwrap(),
        IdempotencyBegin::Existing(_)
    ));
    store.idempotency_finish(&first, "c0", None).await.unwrap();
    assert_eq!(store.idempotency_begin(&key, &record, now).await.unwrap(), IdempotencyBegin::Claimed);
    let resource = ResourceKey::new("job:etcd-full").unwrap();
    assert_eq!(store.advance(&resource, FenceToken(2)).await.unwrap(), AdvanceOutcome::Advanced { previous: None });
}

/// A claim of `key` made at `now`, in flight for a second and kept for a minute.
fn in_flight_claim(key: &IdempotencyKey, claim: &str, now: u64) -> IdempotencyRecord {
    IdempotencyRecord {
        claim: claim.into(),
        fingerprint: "fp".into(),
        token: FenceToken(4),
        upstream_key: key.upstream_key(FenceToken(4)),
        expires_at_ms: now + 60_000,
        route: "/api/".into(),
        claimed_at_ms: now,
        outcome: IdempotencyOutcome::InFlight { deadline_ms: now + 1_000 },
    }
}

async fn record_contract(store: &dyn IdempotencyStore, name: &str) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let key = IdempotencyKey::new(ResourceKey::new("payment:{1}").unwrap(), b"client-key");
    let record = |claim: &str, expires_at_ms: u64| IdempotencyRecord {
        claim: claim.into(),
        fingerprint: "fp".into(),
        token: FenceToken(4),
        upstream_key: key.upstream_key(FenceToken(4)),
        expires_at_ms,
        route: "/api/".into(),
        claimed_at_ms: 0,
        outcome: IdempotencyOutcome::InFlight { deadline_ms: now + 1_000 },
    };
    let a = record("a", now + 60_000);
    assert_eq!(store.idempotency_begin(&key, &a, now).await.unwrap(), IdempotencyBegin::Claimed, "{name}");
    assert_eq!(
        store.idempotency_begin(&key, &record("b", now + 60_000), now).await.unwrap(),
        IdempotencyBegin::Existing(a.clone()),
        "{name}"
    );
    let done = IdempotencyRecord {
        outcome: IdempotencyOutcome::Completed(fencegate::fence::RecordedResponse {
            status: 201,
            headers: vec![("etag".into(), "\"e1\"".into())],
            body: Some(b"\x00\xffbody".to_vec()),
        }),
        ..a.clone()
    };
    store.idempotency_finish(&key, "b", Some(&done)).await.unwrap();
    assert_eq!(store.idempotency_get(&key, now).await.unwrap(), Some(a.clone()), "{name}: only the claimant finishes");
    store.idempotency_finish(&key, "a", Some(&done)).await.unwrap();
    assert_eq!(store.idempotency_get(&key, now).await.unwrap(), Some(done.clone()), "{name}");
    store.idempotency_finish(&key, "a", None).await.unwrap();
    assert_eq!(store.idempotency_get(&key, now).await.unwrap(), None, "{name}: removed");

    // Expiry: a short-lived record is absent once its time is up, and the key is free again.
    let short = record("c", now + 150);
    assert_eq!(store.idempotency_begin(&key, &short, now).await.unwrap(), IdempotencyBegin::Claimed);
    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    let later = now + 250;
    assert_eq!(store.idempotency_get(&key, later).await.unwrap(), None, "{name}: expired");
    assert_eq!(
        store.idempotency_begin(&key, &record("d", later + 60_000), later).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    store.idempotency_finish(&key, "d", None).await.unwrap();
}

/// On a shared store a grant's bytes can arrive after its withdrawal's (its connection broke,
/// a stalled Redis served the new connection first; an etcd transaction applied late): such a
/// grant does nothing, and the fence does not move. A withdrawal after its grant removes the
/// lease and keeps the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_arrives_after_its_withdrawal_does_nothing() {
    let redis = common::RedisServer::start().await;
    late_grant(&redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await, "redis").await;
    #[cfg(feature = "etcd")]
    {
        let etcd = common::EtcdCluster::start(1).await;
        let store = etcd_store(&etcd).await;
        late_grant(&store, "etcd").await;
    }
}

async fn late_grant(store: &dyn Store, name: &str) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let resource = ResourceKey::new("job:withdrawn").unwrap();
    let grant =
        |id: &str| LeaseCommand::Acquire { holder: "h".into(), ttl_ms: 60_000, lease_id: id.into(), floor: None };
    let withdraw = |id: &str| LeaseCommand::Withdraw { lease_id: id.into() };
    store.advance(&resource, FenceToken(4)).await.unwrap();
    assert_eq!(store.lease(&resource, withdraw("late"), now).await.unwrap(), LeaseOutcome::Gone, "{name}");
    assert_eq!(store.lease(&resource, grant("late"), now).await.unwrap(), LeaseOutcome::Gone, "{name}: late grant");
    assert_eq!(store.load(&resource).await.unwrap(), Some(FenceToken(4)), "{name}: the fence did not move");
    assert_eq!(store.lease_record(&resource).await.unwrap(), None, "{name}: no ghost lease");
    let LeaseOutcome::Granted(lease) = store.lease(&resource, grant("on-time"), now).await.unwrap() else {
        panic!("{name}: another grant is made");
    };
    assert_eq!(lease.token, FenceToken(5), "{name}");
    assert_eq!(store.lease(&resource, withdraw("on-time"), now).await.unwrap(), LeaseOutcome::Released, "{name}");
    assert_eq!(store.lease_record(&resource).await.unwrap(), None, "{name}: withdrawn");
    assert_eq!(store.load(&resource).await.unwrap(), Some(FenceToken(5)), "{name}: fences only go up");
}

/// Every store keeps the upload records' contract: a record is found by bucket and upload id
/// (an upload id that is another's prefix, or the same id in another bucket, is another
/// upload), survives a reopen, is forgotten once removed, and a walk in pages of any size
/// visits every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_keeps_the_upload_record_contract() {
    let dir = tempfile::tempdir().unwrap();
    upload_contract(&EmbeddedStore::open(dir.path()).unwrap(), "embedded").await;
    let reopened = Embedded { dir }.open().await;
    assert_eq!(reopened.upload_get("b1", "id-7").await.unwrap().map(|r| r.token), Some(FenceToken(7)), "reopened");
    let redis = common::RedisServer::start().await;
    upload_contract(&redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await, "redis").await;
    upload_contract(&MemoryStore::default(), "memory").await;
    #[cfg(feature = "etcd")]
    {
        let etcd = common::EtcdCluster::start(1).await;
        let store = etcd_store(&etcd).await;
        upload_contract(&store, "etcd").await;
    }
}

async fn upload_contract(store: &dyn UploadStore, name: &str) {
    let record = |bucket: &str, id: &str, token: u64| UploadRecord {
        bucket: bucket.into(),
        key: format!("data/{id}"),
        path: format!("/{bucket}/data/{id}"),
        upload_id: id.into(),
        resource: "job:uploads".into(),
        token: FenceToken(token),
        creator: "AKIA".into(),
        created_at_ms: 1,
        counted_as: String::new(),
    };
    assert_eq!(store.upload_get("b1", "id-7").await.unwrap(), None, "{name}");
    let kept: Vec<UploadRecord> =
        (0..23).map(|n| record(if n % 2 == 0 { "b1" } else { "b2" }, &format!("id-{n}"), n)).collect();
    for r in &kept {
        assert_eq!(store.upload_put(r, &RecordLimits::default()).await.unwrap(), Keep::Kept, "{name}");
    }
    assert_eq!(store.upload_get("b1", "id-7").await.unwrap(), None, "{name}: id-7 is in b2");
    assert_eq!(store.upload_get("b2", "id-7").await.unwrap(), Some(kept[7].clone()), "{name}");
    assert_eq!(store.upload_get("b2", "id-").await.unwrap(), None, "{name}: a prefix is another id");
    store.upload_put(&record("b1", "id-7", 7), &RecordLimits::default()).await.unwrap();
    for page in [1, 5, 23, 100] {
        let mut seen = std::collections::BTreeSet::new();
        let mut cursor = None;
        for _ in 0..1000 {
            let got = store.uploads(cursor.take(), page).await.unwrap();
            seen.extend(got.records.iter().map(UploadRecord::storage_name));
            match got.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        assert_eq!(seen.len(), 24, "{name}: a walk in pages of {page} sees every record");
    }
    store.upload_remove("b2", "id-7").await.unwrap();
    store.upload_remove("b2", "never-kept").await.unwrap();
    assert_eq!(store.upload_get("b2", "id-7").await.unwrap(), None, "{name}: removed");
    assert_eq!(store.upload_get("b1", "id-7").await.unwrap().map(|r| r.token), Some(FenceToken(7)), "{name}");
}

/// Every store bounds the upload records (per caller, per resource, in all, by bytes) in the
/// same step as it keeps one: a new record past a bound is refused and not kept, a removal
/// makes room again, a record taken over under the same name is never refused and moves its
/// counts, and the counts survive a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_bounds_its_upload_records() {
    let dir = tempfile::tempdir().unwrap();
    upload_bounds(&EmbeddedStore::open(dir.path()).unwrap(), "embedded").await;
    let embedded = Embedded { dir };
    upload_bounds_after_reopen(&embedded.open().await, "embedded").await;
    let redis = common::RedisServer::start().await;
    upload_bounds(&redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await, "redis").await;
    let again = redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await;
    upload_bounds_after_reopen(&again, "redis").await;
    upload_bounds(&MemoryStore::default(), "memory").await;
    #[cfg(feature = "etcd")]
    {
        let etcd = common::EtcdCluster::start(1).await;
        upload_bounds(&etcd_store(&etcd).await, "etcd").await;
        upload_bounds_after_reopen(&etcd_store(&etcd).await, "etcd").await;
    }
}

/// A Redis past three quarters of its `maxmemory` (and below it, so it takes writes) refuses
/// new upload records and idempotency claims, and still takes advances and lease grants: the
/// last quarter is the fences'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_near_its_maxmemory_keeps_taking_fence_operations() {
    let redis = common::RedisServer::start().await;
    let store = redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await;
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut conn).await.unwrap();
    let used: u64 = info.split("used_memory:").nth(1).unwrap().split("\r\n").next().unwrap().parse().unwrap();
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(used * 6 / 5).query_async(&mut conn).await.unwrap();
    let full = fencegate::fence::Full::Memory;
    let upload = bounded_upload("m1", "A", "r1");
    assert_eq!(store.upload_put(&upload, &RecordLimits::default()).await.unwrap(), Keep::Full(full));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let key = IdempotencyKey::new(ResourceKey::new("payment:{1}").unwrap(), b"client-key");
    let claim = in_flight_claim(&key, "a", now);
    assert_eq!(store.idempotency_begin(&key, &claim, now).await.unwrap(), IdempotencyBegin::Full);
    let resource = ResourceKey::new("job:near-full").unwrap();
    assert_eq!(store.advance(&resource, FenceToken(3)).await.unwrap(), AdvanceOutcome::Advanced { previous: None });
    let grant = LeaseCommand::Acquire { holder: "w".into(), ttl_ms: 10_000, lease_id: "l1".into(), floor: None };
    assert!(matches!(store.lease(&resource, grant, now).await.unwrap(), LeaseOutcome::Granted(_)));
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).query_async(&mut conn).await.unwrap();
    assert_eq!(store.upload_put(&upload, &RecordLimits::default()).await.unwrap(), Keep::Kept, "room again");
}

fn bounded_upload(id: &str, caller: &str, resource: &str) -> UploadRecord {
    UploadRecord {
        bucket: "b".into(),
        key: format!("k/{id}"),
        path: format!("/b/k/{id}"),
        upload_id: id.into(),
        resource: resource.into(),
        token: FenceToken(1),
        // Counted as the caller, not the creator: a lease credential's records count against
        // the lease, not its issuer.
        creator: "ISSUER".into(),
        created_at_ms: 1,
        counted_as: caller.into(),
    }
}

const BOUNDS: RecordLimits = RecordLimits { per_caller: 3, per_resource: 4, count: 6, bytes: 1 << 20 };

async fn upload_bounds(store: &dyn UploadStore, name: &str) {
    let put = |id: &str, caller: &str, resource: &str| {
        let record = bounded_upload(id, caller, resource);
        async move { store.upload_put(&record, &BOUNDS).await.unwrap() }
    };
    for id in ["a1", "a2", "a3"] {
        assert_eq!(put(id, "A", "r1").await, Keep::Kept, "{name}");
    }
    assert_eq!(put("a4", "A", "r2").await, Keep::Full(fencegate::fence::Full::Caller(3)), "{name}: per caller");
    assert_eq!(store.upload_get("b", "a4").await.unwrap(), None, "{name}: a refused record is not kept");
    assert_eq!(put("b1", "B", "r1").await, Keep::Kept, "{name}");
    assert_eq!(put("c1", "C", "r1").await, Keep::Full(fencegate::fence::Full::Resource(4)), "{name}: per resource");
    assert_eq!(put("b2", "B", "r2").await, Keep::Kept, "{name}");
    assert_eq!(put("c1", "C", "r3").await, Keep::Kept, "{name}");
    assert_eq!(put("d1", "D", "r4").await, Keep::Full(fencegate::fence::Full::Count(6)), "{name}: in all");
    // Taken over by a newer token of another caller: kept although every bound is reached.
    let mut taken = bounded_upload("a1", "D", "r1");
    taken.token = FenceToken(2);
    assert_eq!(store.upload_put(&taken, &BOUNDS).await.unwrap(), Keep::Kept, "{name}: a take-over");
    assert_eq!(put("a4", "A", "r2").await, Keep::Full(fencegate::fence::Full::Count(6)), "{name}");
    store.upload_remove("b", "a2").await.unwrap();
    assert_eq!(put("a4", "A", "r2").await, Keep::Kept, "{name}: a removal made room, and A's take-over freed A");
    let tight = RecordLimits { bytes: 1, ..RecordLimits::default() };
    let big = bounded_upload("e1", "E", "r5");
    assert_eq!(store.upload_put(&big, &tight).await.unwrap(), Keep::Full(fencegate::fence::Full::Bytes(1)), "{name}");
}

/// After [`upload_bounds`] and a reopen: A holds a3 and a4 (a1 was taken over by D), B holds
/// two, in all six.
async fn upload_bounds_after_reopen(store: &dyn UploadStore, name: &str) {
    let put = |id: &str, caller: &str, resource: &str| {
        let record = bounded_upload(id, caller, resource);
        async move { store.upload_put(&record, &BOUNDS).await.unwrap() }
    };
    assert_eq!(put("x1", "X", "r9").await, Keep::Full(fencegate::fence::Full::Count(6)), "{name}: counted at reopen");
    for id in ["a3", "a4", "b1", "b2"] {
        store.upload_remove("b", id).await.unwrap();
    }
    assert_eq!(put("x1", "A", "r9").await, Keep::Kept, "{name}");
    assert_eq!(put("x2", "A", "r9").await, Keep::Kept, "{name}");
    assert_eq!(put("x3", "A", "r9").await, Keep::Kept, "{name}");
    assert_eq!(put("x4", "A", "r9").await, Keep::Full(fencegate::fence::Full::Caller(3)), "{name}");
}

/// Every store lists its fences the same way: in byte order of the resource, by prefix (taken
/// literally: `*`, `}` and `%` are no patterns), after a resource, in pages of any size that
/// walk every fence once; its leases the same way; and its idempotency records in pages that
/// visit each once at least, each with its resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_keeps_the_listing_contract() {
    let dir = tempfile::tempdir().unwrap();
    listing_contract(&EmbeddedStore::open(dir.path()).unwrap(), "embedded").await;
    let redis = common::RedisServer::start().await;
    let shared = redis_store(&redis.url(), std::time::Duration::from_secs(2), 0).await;
    listing_contract(&shared, "redis").await;
    // A lease gone between Redis's scan and the read of it (here: only part of one is there)
    // does not end the listing: whether more follow is the scan's to say.
    let mut raw = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("HSET").arg("fg:{gap:a}:lease").arg("holder").arg("h").query_async(&mut raw).await.unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let acquire = LeaseCommand::Acquire { holder: "hb".into(), ttl_ms: 60_000, lease_id: "id-b".into(), floor: None };
    shared.lease(&ResourceKey::new("gap:b").unwrap(), acquire, now).await.unwrap();
    // A field of the replicas' hash that is not text (written by hand) hides no replica.
    let _: i64 =
        redis::cmd("HSET").arg("fg:replicas").arg(b"\xff\xfe".as_slice()).arg(now).query_async(&mut raw).await.unwrap();
    shared.replica_seen("r-text", now).await.unwrap();
    let listed = shared.replicas(now).await.unwrap();
    assert!(listed.contains(&("r-text".to_owned(), now)), "redis: the odd field skipped, {listed:?}");
    shared.replica_gone("r-text").await.unwrap();
    let first = shared.leases("gap:", None, 1).await.unwrap();
    assert_eq!((first.items.len(), first.next.as_deref()), (0, Some("gap:a")), "redis: the listing goes on");
    let second = shared.leases("gap:", first.next.as_deref(), 1).await.unwrap();
    assert_eq!(second.items.iter().map(|(r, _)| r.as_str()).collect::<Vec<_>>(), ["gap:b"]);
    listing_contract(&MemoryStore::default(), "memory").await;
    #[cfg(feature = "etcd")]
    {
        let etcd = common::EtcdCluster::start(1).await;
        let store = etcd_store(&etcd).await;
        listing_contract(&store, "etcd").await;
    }
}

async fn listing_contract(store: &dyn Store, name: &str) {
    let named = ["job:a", "job:a/x", "job:b", "jobs", "x}y%z", "x}", "a*b", "ab", "été", "50%"];
    let paged: Vec<String> = (0..23).map(|n| format!("page/{n:02}")).collect();
    let all: Vec<&str> = named.iter().copied().chain(paged.iter().map(String::as_str)).collect();
    for (n, resource) in all.iter().enumerate() {
        store.advance(&ResourceKey::new(resource).unwrap(), FenceToken(n as u64 + 1)).await.unwrap();
    }
    let list = |prefix: &'static str, after: Option<&'static str>, limit: usize| async move {
        let page = store.fences(prefix, after, limit).await.unwrap();
        let names: Vec<String> = page.items.iter().map(|(r, _)| r.as_str().to_owned()).collect();
        (names, page.next)
    };
    let (everything, next) = list("", None, 1000).await;
    let mut sorted: Vec<String> = all.iter().map(|r| (*r).to_owned()).collect();
    sorted.sort();
    assert_eq!((everything, next), (sorted, None), "{name}: every fence, in byte order");
    let page = store.fences("job:a", None, 10).await.unwrap();
    let tokens: Vec<(String, u64)> = page.items.iter().map(|(r, t)| (r.as_str().to_owned(), t.0)).collect();
    assert_eq!(tokens, [("job:a".to_owned(), 1), ("job:a/x".to_owned(), 2)], "{name}: with their tokens");
    assert_eq!(list("job:", None, 10).await.0, ["job:a", "job:a/x", "job:b"], "{name}: a prefix");
    assert_eq!(list("x}", None, 10).await.0, ["x}", "x}y%z"], "{name}: `}}` is no pattern");
    assert_eq!(list("a*", None, 10).await.0, ["a*b"], "{name}: `*` is no pattern");
    assert_eq!(list("50%", None, 10).await.0, ["50%"], "{name}: `%` is no pattern");
    assert_eq!(list("nothing", None, 10).await, (vec![], None), "{name}: an empty page");
    assert_eq!(list("page/", Some("page/20"), 5).await, (vec!["page/21".into(), "page/22".into()], None), "{name}");
    assert_eq!(list("page/", Some("a"), 1).await.0, ["page/00"], "{name}: `after` before the prefix");
    for limit in [1, 5, 7, 23] {
        let (mut walked, mut after) = (Vec::new(), None::<String>);
        for _ in 0..100 {
            let page = store.fences("page/", after.as_deref(), limit).await.unwrap();
            assert!(page.items.len() <= limit, "{name}: a page holds at most its limit");
            walked.extend(page.items.iter().map(|(r, _)| r.as_str().to_owned()));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(walked, paged, "{name}: pages of {limit} walk every fence once, in order");
    }

    let acquire = |holder: &str| LeaseCommand::Acquire {
        holder: holder.into(),
        ttl_ms: 60_000,
        lease_id: format!("id-{holder}"),
        floor: None,
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    for (resource, holder) in [("lease:b", "hb"), ("lease:a", "ha"), ("other", "ho")] {
        store.lease(&ResourceKey::new(resource).unwrap(), acquire(holder), now).await.unwrap();
    }
    let leases = store.leases("lease:", None, 10).await.unwrap();
    let seen: Vec<(&str, &str)> = leases.items.iter().map(|(r, l)| (r.as_str(), l.holder.as_str())).collect();
    assert_eq!(seen, [("lease:a", "ha"), ("lease:b", "hb")], "{name}: leases by prefix, in order");
    assert_eq!(leases.next, None, "{name}");
    assert!(leases.items.iter().all(|(_, l)| l.is_live(now) && l.ttl_ms == 60_000), "{name}");
    let first = store.leases("", None, 1).await.unwrap();
    assert_eq!((first.items.len(), first.next.as_deref()), (1, Some("lease:a")), "{name}: up to the limit");
    let second = store.leases("", first.next.as_deref(), 5).await.unwrap();
    let rest: Vec<&str> = second.items.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!((rest, second.next), (vec!["lease:b", "other"], None), "{name}: and on after it");

    let resources = ["pay:1", "pay:2", "pay:2/x", "x}y%z"];
    let mut kept = std::collections::BTreeSet::new();
    for (n, resource) in resources.iter().enumerate() {
        for client in ["c1", "c2", "c3"] {
            let key = IdempotencyKey::new(ResourceKey::new(resource).unwrap(), client.as_bytes());
            let record = IdempotencyRecord {
                claim: format!("{resource}/{client}"),
                fingerprint: "fp".into(),
                token: FenceToken(n as u64 + 1),
                upstream_key: key.upstream_key(FenceToken(n as u64 + 1)),
                expires_at_ms: now + 60_000,
                route: "/api/".into(),
                claimed_at_ms: now,
                outcome: IdempotencyOutcome::InFlight { deadline_ms: now + 1_000 },
            };
            assert_eq!(store.idempotency_begin(&key, &record, now).await.unwrap(), IdempotencyBegin::Claimed);
            kept.insert(((*resource).to_owned(), record.claim));
        }
    }
    for limit in [1, 5, 7, 1000] {
        let (mut seen, mut cursor) = (std::collections::BTreeSet::new(), None);
        for _ in 0..1000 {
            let page = store.idempotency_records(cursor.take(), limit).await.unwrap();
            seen.extend(page.records.into_iter().map(|(r, record)| (r.as_str().to_owned(), record.claim)));
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        assert_eq!(seen, kept, "{name}: pages of {limit} visit every record, each with its resource");
    }

    // Replicas: a shared store lists those seen since a time, not those silent since, and
    // forgets the long silent and those dated far ahead; a store of one process keeps none.
    let hour = fencegate::fence::REPLICAS_FORGOTTEN_AFTER_MS;
    let t0 = now;
    let replicas = [
        ("r-a", t0),
        ("r-b", t0 + 2_000),
        ("r-old", t0 - 2 * hour),
        ("r-ahead", t0 + 2 * hour),
        ("r-quiet", t0 - 60_000),
    ];
    for (id, at) in replicas {
        store.replica_seen(id, at).await.unwrap();
    }
    // More long silent ones than etcd takes changes in one transaction (128): they are
    // forgotten a few at a time, and hide nobody meanwhile.
    for n in 0..200 {
        store.replica_seen(&format!("r-crashed-{n:03}"), t0 - 2 * hour - n).await.unwrap();
    }
    let seen = |since| async move { store.replicas(since).await.unwrap() };
    if store.shared().is_none() {
        assert_eq!(seen(t0).await, vec![], "{name}: one process, no list");
        return;
    }
    assert_eq!(seen(t0).await, [("r-a".to_owned(), t0), ("r-b".to_owned(), t0 + 2_000)], "{name}: seen since");
    assert_eq!(seen(t0 + 1).await, [("r-b".to_owned(), t0 + 2_000)], "{name}");
    let all: Vec<String> = seen(t0 - 60_000).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(all, ["r-a", "r-b", "r-quiet"], "{name}: neither the long silent nor one dated ahead");
    store.replica_gone("r-a").await.unwrap();
    store.replica_seen("r-b", t0 + 3_000).await.unwrap();
    assert_eq!(seen(t0).await, [("r-b".to_owned(), t0 + 3_000)], "{name}: gone, and seen again later");
}

// ---------------------------------------------------------------------------------------------
// The latency each mode adds.

/// Each serving thread calls Redis on a connection of its own, opened in the background on its
/// first call. While Redis refuses new connections, the threads' calls take the shared one and
/// still answer; once it accepts them again, each thread opens its own (after the retry pause)
/// and its calls go there, not to the shared connection. A thread whose connection broke
/// answers on the shared one and opens another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_serving_thread_calls_redis_on_a_connection_of_its_own() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let redis = common::RedisServer::start().await;
    let mut admin = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    // The last command of each connection but the admin's, as `CLIENT LIST` tells it.
    async fn last_commands(admin: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
        let list: String = redis::cmd("CLIENT").arg("LIST").query_async(admin).await.unwrap();
        let mut commands: Vec<String> = list
            .lines()
            .filter_map(|line| line.split(' ').find_map(|field| field.strip_prefix("cmd=")).map(str::to_owned))
            .filter(|cmd| cmd != "client|list")
            .collect();
        commands.sort();
        commands
    }
    let store = Arc::new(redis_store(&redis.url(), Duration::from_secs(2), 2).await);
    let threads = fencegate::net::threads::ServingThreads::start(2).unwrap();
    let resource = ResourceKey::new("b/k").unwrap();
    store.advance(&resource, FenceToken(7)).await.unwrap();
    // Waits for the shared connection and the announcements' subscription.
    let deadline = Instant::now() + Duration::from_secs(10);
    while last_commands(&mut admin).await.len() < 2 {
        assert!(Instant::now() < deadline, "the store's connections did not show up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let opened_by_the_store = last_commands(&mut admin).await.len();
    assert_eq!(opened_by_the_store, 2, "one shared connection and one subscription");

    // A load from each serving thread (round robin: one each), answered by the store.
    let load_on_each_thread = || {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..2 {
            let (store, resource, tx) = (store.clone(), resource.clone(), tx.clone());
            threads.spawn(async move {
                tx.send((fencegate::net::threads::current(), store.load(&resource).await)).unwrap();
            });
        }
        async move {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let (thread, loaded) = rx.recv().await.unwrap();
                assert_eq!(loaded.unwrap(), Some(FenceToken(7)));
                seen.push(thread.unwrap());
            }
            seen.sort();
            assert_eq!(seen, vec![0, 1]);
        }
    };

    // Redis takes no new connection: the threads' openings fail, their calls still answer.
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxclients").arg(1).query_async(&mut admin).await.unwrap();
    for _ in 0..3 {
        load_on_each_thread().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last_commands(&mut admin).await.len(), opened_by_the_store, "no connection could open");

    // Redis takes them again: each thread opens its own after its retry pause.
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxclients").arg(10000).query_async(&mut admin).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while last_commands(&mut admin).await.len() < opened_by_the_store + 2 {
        assert!(Instant::now() < deadline, "the serving threads did not open connections of their own");
        load_on_each_thread().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The shared connection's last command is readiness's from off the threads (a PING, then
    // slot 0's epoch gate: an EVALSHA); the threads' loads (GETs) then land on their own
    // connections only.
    store.ping().await.unwrap();
    load_on_each_thread().await;
    assert_eq!(last_commands(&mut admin).await, vec!["evalsha", "get", "get", "subscribe"]);

    // The threads' connections are killed: their next loads still answer (on the shared
    // connection), and each thread opens a new one of its own.
    let list: String = redis::cmd("CLIENT").arg("LIST").query_async(&mut admin).await.unwrap();
    for line in list.lines().filter(|line| line.contains(" cmd=get ")) {
        let id = line.split(' ').find_map(|field| field.strip_prefix("id=")).unwrap();
        let _: () = redis::cmd("CLIENT").arg("KILL").arg("ID").arg(id).query_async(&mut admin).await.unwrap();
    }
    assert_eq!(last_commands(&mut admin).await.len(), opened_by_the_store);
    load_on_each_thread().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while last_commands(&mut admin).await.len() < opened_by_the_store + 2 {
        assert!(Instant::now() < deadline, "the serving threads did not open new connections");
        load_on_each_thread().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    threads.stop().await;
}
