//! The etcd store behind two fencegate replicas, with etcd's leader killed (`kill -9`) again and
//! again while lease grants and writes go on: every grant is above every earlier one (never the
//! same token twice, never a lower one), the fence never goes down, and no write with a token
//! older than an already answered grant or write commits. An acknowledged advance is on a
//! majority of etcd's members, so it survives any leader change (Redis's asynchronous
//! replication cannot promise that: `tests/python/test_failover.py`).
#![cfg(feature = "etcd")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_s3::Client;
use aws_sdk_s3::config::Credentials;
use aws_sdk_s3::primitives::ByteStream;
use common::{ACCESS_KEY, EtcdCluster, Fencegate, Moto, SECRET_KEY, client, error_of, s3_client};
use fencegate::fence::{FenceStore, ResourceKey};
use fencegate_client::LeaseClient;

const BUCKET: &str = "etcd";
const RESOURCE: &str = "job:etcd";
/// Leader kills in the run; each round grants, writes and kills once.
const ROUNDS: usize = 4;
/// Bound on how long a grant may keep failing while etcd elects a leader.
const GRANT_PATIENCE: Duration = Duration::from_secs(15);

async fn put(c: &Client, key: &str, token: u64) -> Result<(), (Option<String>, u16, Option<String>)> {
    c.put_object()
        .bucket(BUCKET)
        .key(key)
        .body(ByteStream::from(format!("written with {token}").into_bytes()))
        .customize()
        .mutate_request(move |req| {
            req.headers_mut().insert("fencing-token", token.to_string());
            req.headers_mut().insert("fencing-resource", RESOURCE);
        })
        .send()
        .await
        .map(|_| ())
        .map_err(|e| error_of(&e))
}

/// A write or a grant, with when it was sent and answered.
#[derive(Debug, Clone)]
struct Event {
    token: u64,
    sent: Instant,
    answered: Instant,
    ok: bool,
    status: u16,
}

/// A grant, retried while etcd has no leader (those attempts fail closed with 503).
async fn grant(lease: &LeaseClient, holder: &str) -> (u64, String, Instant, Instant) {
    let give_up = Instant::now() + GRANT_PATIENCE;
    loop {
        let sent = Instant::now();
        match lease.try_acquire(RESOURCE, holder, Duration::from_secs(30)).await {
            Ok(g) => return (g.token.0, g.lease_id, sent, Instant::now()),
            Err(e) if e.is_retryable() && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("grant failed: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_and_fences_survive_killing_the_etcd_leader() {
    let mut etcd = EtcdCluster::start(3).await;
    let moto = Moto::start().await;
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        let store = etcd.store_toml(name);
        replicas.push(
            Fencegate::setup(&dir.path().join(name)).store(&store).upstream(&moto.upstream_toml(BUCKET)).start().await,
        );
    }
    let clients: Vec<Client> = replicas.iter().map(client).collect();
    let leases: Vec<LeaseClient> = replicas
        .iter()
        .map(|fg| {
            let creds = Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test");
            LeaseClient::new(&fg.endpoint(), creds, "us-east-1").unwrap()
        })
        .collect();
    let observer = fencegate::store::EtcdStore::connect(&etcd.endpoints(), Duration::from_secs(2), "observer".into())
        .await
        .unwrap();
    let resource = ResourceKey::new(RESOURCE).unwrap();

    let history: Arc<Mutex<Vec<Event>>> = Arc::default();
    let mut grants: Vec<Event> = Vec::new();
    let mut fences_seen: Vec<u64> = Vec::new();
    let mut previous_token = 0u64;
    for round in 0..ROUNDS {
        let (token, lease_id, sent, answered) = grant(&leases[round % 2], &format!("holder-{round}")).await;
        grants.push(Event { token, sent, answered, ok: true, status: 201 });

        // The holder writes through both replicas while the previous holder (stale) keeps
        // trying; the etcd leader is killed in the middle.
        let mut tasks = Vec::new();
        for n in 0..12u64 {
            let c = clients[(n % 2) as usize].clone();
            let history = history.clone();
            let (t, key) = if n % 3 == 0 { (previous_token, "stale.bin") } else { (token, "current.bin") };
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(n * 40)).await;
                let sent = Instant::now();
                let result = put(&c, key, t).await;
                let status = result.as_ref().err().map_or(200, |e| e.1);
                history.lock().unwrap().push(Event {
                    token: t,
                    sent,
                    answered: Instant::now(),
                    ok: result.is_ok(),
                    status,
                });
            }));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let leader = etcd.wait_for_leader().await;
        etcd.kill(leader);
        for task in tasks {
            task.await.unwrap();
        }
        etcd.wait_for_leader().await;
        etcd.restart(leader).await;
        let fence = observer.load(&resource).await.unwrap().map(|t| t.0).unwrap_or(0);
        fences_seen.push(fence);
        assert!(fence >= token, "round {round}: the fence {fence} is below the grant {token} answered before");
        let _ = leases[round % 2].release(RESOURCE, &lease_id).await;
        previous_token = token;
    }

    // Grants: strictly increasing in the order they were answered (they were sequential).
    let tokens: Vec<u64> = grants.iter().map(|g| g.token).collect();
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "grants repeated or went down across leader kills: {tokens:?}");
    assert!(fences_seen.windows(2).all(|w| w[0] <= w[1]), "the fence went down: {fences_seen:?}");

    // Writes: every answer is an accept, a stale refusal or a fail-closed 503 (etcd electing);
    // and once a token t was granted or accepted, no write with an older token sent after that
    // commits.
    let history = history.lock().unwrap().clone();
    assert!(history.iter().all(|e| e.ok || e.status == 409 || e.status == 503), "{history:?}");
    assert!(history.iter().any(|e| e.ok), "no write went through: {history:?}");
    assert!(history.iter().any(|e| !e.ok && e.status == 409), "no stale write was tried after a grant: {history:?}");
    let answered: Vec<&Event> = history.iter().filter(|e| e.ok).chain(grants.iter()).collect();
    for accepted in history.iter().filter(|e| e.ok) {
        for before in answered.iter().filter(|e| e.token > accepted.token) {
            assert!(
                accepted.sent < before.answered,
                "token {} was accepted though it was sent after token {} was answered",
                accepted.token,
                before.token
            );
        }
    }
    let direct = s3_client(&moto.endpoint, "moto", "moto");
    let object = direct.get_object().bucket(BUCKET).key("current.bin").send().await.unwrap();
    let stamp = object.metadata().and_then(|m| m.get("fencing-token")).cloned();
    assert_eq!(stamp, Some(tokens.last().unwrap().to_string()), "the last holder's write is the one kept");

    // A replica started now has no mark of its own: only etcd can refuse the previous
    // holder's token on an object nobody wrote, and grant above every earlier grant.
    let late = Fencegate::setup(&dir.path().join("late"))
        .store(&etcd.store_toml("late"))
        .upstream(&moto.upstream_toml(BUCKET))
        .start()
        .await;
    let (code, status, current) = put(&client(&late), "never-written.bin", tokens[tokens.len() - 2]).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FencingTokenStale"), 409));
    assert_eq!(current, Some(tokens.last().unwrap().to_string()));
    let late_lease =
        LeaseClient::new(&late.endpoint(), Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "t"), "us-east-1")
            .unwrap();
    let (after, ..) = grant(&late_lease, "late").await;
    assert_eq!(after, tokens.last().unwrap() + 1, "a grant through a fresh replica is above every earlier one");
    late.stop().await;
    for fg in replicas {
        fg.stop().await;
    }
}

/// A replica cut off from etcd fails closed (503) and refuses nothing it should accept once
/// etcd is back; a grant made through one replica fences the other at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_on_one_replica_fences_the_other_and_a_lost_quorum_fails_closed() {
    let mut etcd = EtcdCluster::start(3).await;
    let moto = Moto::start().await;
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = Fencegate::setup(&dir.path().join("a"))
        .store(&etcd.store_toml("a"))
        .upstream(&moto.upstream_toml(BUCKET))
        .start()
        .await;
    let b = Fencegate::setup(&dir.path().join("b"))
        .store(&etcd.store_toml("b"))
        .upstream(&moto.upstream_toml(BUCKET))
        .start()
        .await;
    let (ca, cb) = (client(&a), client(&b));
    put(&ca, "doc", 7).await.unwrap();
    let lease = LeaseClient::new(&b.endpoint(), Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "t"), "us-east-1")
        .unwrap();
    let g = lease.try_acquire(RESOURCE, "b", Duration::from_secs(30)).await.unwrap();
    assert_eq!(g.token.0, 8, "the grant is above the token written through the other replica");
    let (code, status, current) = put(&ca, "doc", 7).await.unwrap_err();
    assert_eq!((code.as_deref(), status, current.as_deref()), (Some("FencingTokenStale"), 409, Some("8")));
    put(&cb, "doc", 8).await.unwrap();

    // Two of three members gone: no quorum, writes with a new token fail closed.
    etcd.kill(0);
    etcd.kill(1);
    let (code, status, _) = put(&ca, "doc", 9).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FenceStoreUnavailable"), 503));
    etcd.restart(0).await;
    etcd.restart(1).await;
    etcd.wait_for_leader().await;
    let mut resumed = false;
    for _ in 0..100 {
        if put(&ca, "doc", 9).await.is_ok() {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(resumed, "writes resume once etcd has a quorum again");
    let (code, status, _) = put(&cb, "doc", 8).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FencingTokenStale"), 409));
    a.stop().await;
    b.stop().await;
}

/// An etcd that lost what it acknowledged (its one member restarted on an empty data directory,
/// against etcd's rules) answers from an older history than the replica saw: the replica does
/// not trust it. Its writes fail closed (503) and the loss is counted, instead of being admitted
/// on a store that no longer knows the fence or the registrations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_lost_acknowledged_data_is_not_trusted() {
    let mut etcd = EtcdCluster::start(1).await;
    let dir = tempfile::tempdir().unwrap();
    let local = format!(
        "[upstream]\nkind = \"local\"\npath = \"{}\"\naccept_no_preconditions = true\n",
        dir.path().join("objects").display()
    );
    let fg = Fencegate::setup(dir.path()).store(&etcd.store_toml("a")).upstream(&local).start().await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    for token in [5, 6] {
        put(&c, "doc", token).await.unwrap();
    }
    etcd.restart_empty_single().await;
    // Writes are refused for as long as the test watches (the SDK retries a 503 by itself).
    for token in [6, 7] {
        let (code, status, _) = put(&c, "doc", token).await.unwrap_err();
        assert_eq!((code.as_deref(), status), (Some("FenceStoreUnavailable"), 503), "token {token}");
    }
    // The lost history grows past what the replica saw: still not trusted.
    let mut direct = etcd_client::Client::connect(etcd.endpoints(), None).await.unwrap();
    for i in 0..100 {
        direct.put(format!("other/{i}"), "x", None).await.unwrap();
    }
    let (code, status, _) = put(&c, "doc", 8).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FenceStoreUnavailable"), 503), "after the history grew back");
    let metrics = common::http_get(fg.admin, "/metrics", Duration::from_secs(10)).await;
    let lost: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("fencegate_store_state_lost_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the counter is exported");
    assert!(lost >= 1.0, "the loss was not counted:\n{metrics}");
    fg.stop().await;
}
