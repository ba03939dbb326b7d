//! Several fencegate replicas on one Redis: racing writers through different replicas never
//! commit a stale write; Redis failures fail closed and heal without restarting fencegate; a
//! Redis that comes back empty cannot make a replica accept a token older than one it has
//! seen; and a Redis Cluster of three masters works as the store.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_s3::Client;
use aws_sdk_s3::primitives::ByteStream;
use common::{Fencegate, Moto, RedisServer, client, error_of, redis_store_toml, s3_client};

const BUCKET: &str = "shared";

async fn put(c: &Client, key: &str, token: u64, body: Vec<u8>) -> Result<(), (Option<String>, u16, Option<String>)> {
    c.put_object()
        .bucket(BUCKET)
        .key(key)
        .body(ByteStream::from(body))
        .customize()
        .mutate_request(move |req| {
            req.headers_mut().insert("fencing-token", token.to_string());
        })
        .send()
        .await
        .map(|_| ())
        .map_err(|e| error_of(&e))
}

/// What one write did, with when it was sent and answered.
#[derive(Debug, Clone)]
struct Event {
    token: u64,
    sent: Instant,
    answered: Instant,
    ok: bool,
    status: u16,
}

/// 3 replicas, 24 writers with tokens 1..=24 in random order on one object, each through a
/// replica of its own choosing. Checked on the upstream's final state and on the history: the
/// object holds the highest accepted token's bytes, and once a write with token t was
/// answered OK, no write with a lower token sent after that moment was accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_through_three_replicas_never_commit_a_stale_write() {
    let redis = RedisServer::start().await;
    let moto = Moto::start().await;
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();

    let mut replicas = Vec::new();
    let mut dirs = Vec::new();
    for i in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let fg = Fencegate::setup(dir.path())
            .store(&redis_store_toml(&redis.url(), &format!("replica-{i}")))
            .upstream(&moto.upstream_toml(BUCKET))
            .start()
            .await;
        replicas.push(fg);
        dirs.push(dir);
    }
    let clients: Vec<Client> = replicas.iter().map(client).collect();

    // A fixed shuffle of 1..=24 (no randomness: the run is repeatable).
    let mut tokens: Vec<u64> = (1..=24).collect();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for i in (1..tokens.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        tokens.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    let history = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (n, token) in tokens.into_iter().enumerate() {
        let c = clients[n % 3].clone();
        let history = history.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis((n as u64 % 6) * 15)).await;
            let sent = Instant::now();
            let result = put(&c, "race.bin", token, format!("written with {token}").into_bytes()).await;
            let status = result.as_ref().err().map_or(200, |e| e.1);
            history.lock().unwrap().push(Event { token, sent, answered: Instant::now(), ok: result.is_ok(), status });
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let history = history.lock().unwrap().clone();
    assert!(history.iter().all(|e| e.ok || e.status == 409), "only accepted or stale: {history:?}");
    let max_ok = history.iter().filter(|e| e.ok).map(|e| e.token).max().expect("some write was accepted");
    assert_eq!(max_ok, history.iter().map(|e| e.token).max().unwrap(), "the highest token is never refused");
    for accepted in history.iter().filter(|e| e.ok) {
        for later in history.iter().filter(|e| e.ok && e.token < accepted.token) {
            assert!(
                later.sent < accepted.answered,
                "token {} accepted after {} was answered",
                later.token,
                accepted.token
            );
        }
    }
    let direct = s3_client(&moto.endpoint, "moto", "moto");
    let object = direct.get_object().bucket(BUCKET).key("race.bin").send().await.unwrap();
    let stamp = object.metadata().and_then(|m| m.get("fencing-token")).cloned();
    let body = object.body.collect().await.unwrap().into_bytes();
    assert_eq!(stamp, Some(max_ok.to_string()));
    assert_eq!(body.as_ref(), format!("written with {max_ok}").as_bytes());
    for fg in replicas {
        fg.stop().await;
    }
}

/// Redis killed: writes get 503 `FenceStoreUnavailable` and reads keep working. Redis back
/// (with its AOF): writes resume without restarting fencegate. Redis back empty: the replica
/// still refuses the older token, and raises the store back to what it has seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_failures_fail_closed_and_heal() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).await;
    let dir = tempfile::tempdir().unwrap();
    let local = format!(
        "[upstream]\nkind = \"local\"\npath = \"{}\"\naccept_no_preconditions = true\n",
        dir.path().join("objects").display()
    );
    let fg = Fencegate::setup(dir.path())
        .store(&redis_store_toml(&redis.url(), "solo"))
        .upstream(&local)
        .extra(SHORT_DEADLINE)
        .start()
        .await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    put(&c, "doc", 12, b"twelve".to_vec()).await.unwrap();

    redis.kill();
    let (code, status, _) = put(&c, "doc", 13, b"thirteen".to_vec()).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FenceStoreUnavailable"), 503));
    let read = c.get_object().bucket(BUCKET).key("doc").send().await.expect("reads work without the store");
    assert_eq!(read.body.collect().await.unwrap().into_bytes().as_ref(), b"twelve");

    redis.restart().await;
    let mut resumed = false;
    for _ in 0..50 {
        if put(&c, "doc", 13, b"thirteen".to_vec()).await.is_ok() {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(resumed, "writes resume once Redis is back");

    redis.restart_empty().await;
    let lost_at = Instant::now();
    let mut refused = None;
    for _ in 0..50 {
        match put(&c, "doc", 12, b"stale".to_vec()).await {
            Err((Some(code), 409, current)) => {
                refused = Some((code, current));
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(()) => panic!("a token older than one the replica has seen was accepted after Redis lost its data"),
        }
    }
    assert_eq!(refused, Some(("FencingTokenStale".to_owned(), Some("13".to_owned()))));
    // Redis lost its in-flight registrations with its data: nothing is admitted until writes
    // they covered can no longer commit (a registration's time to live, 11/8 of the in-flight
    // deadline), then a newer writer repairs the store: Redis holds 14 again afterwards.
    // (The SDK retries a 503 by itself: what is asserted is when the write got in.)
    let mut admitted = None;
    for _ in 0..100 {
        if put(&c, "doc", 14, b"fourteen".to_vec()).await.is_ok() {
            admitted = Some(lost_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admitted = admitted.expect("writes resume after the quiet period");
    assert!(admitted >= Duration::from_millis(1375), "admitted {admitted:?} after the loss, inside the quiet period");
    let stored: String = redis::cmd("GET")
        .arg("fg:{shared/doc}:fence")
        .query_async(&mut redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap())
        .await
        .unwrap();
    assert_eq!(stored, "14");
    fg.stop().await;
}

/// A lease holder writing again and again with its token costs Redis a read-only check per
/// write: the registration made by its first write stays (one member, `replica:id:token`) and
/// later writes add nothing to the append-only file. A newer token through another replica
/// still goes ahead, the older registration is withdrawn, and the older token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_writes_with_one_token_only_read_redis_and_a_newer_token_clears_them() {
    let redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).await;
    // Two replicas share one upstream (the local one is a single process's).
    let moto = Moto::start().await;
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = Fencegate::setup(&dir.path().join("a"))
        .store(&redis_store_toml(&redis.url(), "a"))
        .upstream(&moto.upstream_toml(BUCKET))
        .start()
        .await;
    let b = Fencegate::setup(&dir.path().join("b"))
        .store(&redis_store_toml(&redis.url(), "b"))
        .upstream(&moto.upstream_toml(BUCKET))
        .start()
        .await;
    let (ca, cb) = (client(&a), client(&b));
    let mut r = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let inflight = "fg:{shared/doc}:inflight";

    put(&ca, "doc", 5, b"five".to_vec()).await.unwrap();
    let members: Vec<String> = redis::cmd("ZRANGE").arg(inflight).arg(0).arg(-1).query_async(&mut r).await.unwrap();
    assert_eq!(members.len(), 1, "{members:?}");
    assert!(members[0].starts_with("a:") && members[0].ends_with(":5"), "{members:?}");

    let () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut r).await.unwrap();
    for body in [&b"five again"[..], b"five once more", b"five, last"] {
        put(&ca, "doc", 5, body.to_vec()).await.unwrap();
    }
    let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut r).await.unwrap();
    for write in ["cmdstat_zadd:", "cmdstat_zrem:", "cmdstat_set:", "cmdstat_pexpire:"] {
        assert!(!stats.contains(write), "a repeated write wrote to Redis ({write}):\n{stats}");
    }
    assert!(stats.contains("cmdstat_zscore:calls=3"), "each repeated write checked its registration:\n{stats}");

    put(&cb, "doc", 6, b"six".to_vec()).await.unwrap();
    let mut left: Vec<String> = Vec::new();
    for _ in 0..50 {
        left = redis::cmd("ZRANGE").arg(inflight).arg(0).arg(-1).query_async(&mut r).await.unwrap();
        if left.iter().all(|m| !m.ends_with(":5")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(left.iter().all(|m| !m.ends_with(":5")), "the older registration stayed: {left:?}");
    let (code, status, current) = put(&ca, "doc", 5, b"stale".to_vec()).await.unwrap_err();
    assert_eq!((code.as_deref(), status, current.as_deref()), (Some("FencingTokenStale"), 409, Some("6")));
    a.stop().await;
    b.stop().await;
}

/// Three cluster masters, slots spread over them: the classic scenario works on many
/// resources, whichever node each resource's slot lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_of_three_masters_is_a_fence_store() {
    let nodes = [
        RedisServer::start_cluster_node().await,
        RedisServer::start_cluster_node().await,
        RedisServer::start_cluster_node().await,
    ];
    let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
    let created = std::process::Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli runs");
    assert!(created.status.success(), "cluster create: {}", String::from_utf8_lossy(&created.stdout));
    wait_for_cluster(&nodes[0]).await;

    let dir = tempfile::tempdir().unwrap();
    let urls: Vec<String> = nodes.iter().map(|n| format!("\"{}\"", n.url())).collect();
    let store = format!(
        "[store]\nkind = \"redis\"\ncluster_urls = [{}]\ntimeout_ms = 2000\naccept_unsynced_changes = true\n",
        urls.join(", ")
    );
    let local = format!(
        "[upstream]\nkind = \"local\"\npath = \"{}\"\naccept_no_preconditions = true\n",
        dir.path().join("objects").display()
    );
    let fg = Fencegate::setup(dir.path()).store(&store).upstream(&local).start().await;
    let c = client(&fg);
    c.create_bucket().bucket(BUCKET).send().await.unwrap();
    for i in 0..12 {
        let key = format!("object-{i}");
        put(&c, &key, 11, b"A".to_vec()).await.unwrap();
        put(&c, &key, 12, b"B".to_vec()).await.unwrap();
        // The same token again: the read-only check, pipelined to the slot's node.
        put(&c, &key, 12, b"B again".to_vec()).await.unwrap();
        let (code, status, current) = put(&c, &key, 11, b"A again".to_vec()).await.unwrap_err();
        assert_eq!((code.as_deref(), status, current.as_deref()), (Some("FencingTokenStale"), 409, Some("12")));
    }
    fg.stop().await;
}

async fn wait_for_cluster(node: &RedisServer) {
    let client = redis::Client::open(node.url()).unwrap();
    for _ in 0..100 {
        if let Ok(mut con) = client.get_multiplexed_async_connection().await {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut con).await.unwrap_or_default();
            if info.contains("cluster_state:ok") {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the cluster did not become ready");
}

/// Redis comes back empty (a failover to a replica that had not received the last advances, a
/// restart without persistence): a replica's mark still keeps a lease grant above every token
/// it has seen (never the same token twice, never a lower one), and a replica that refuses a
/// token from its mark raises Redis back, so that a replica that never saw the resource refuses
/// it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_mark_outlives_a_redis_that_lost_its_data() {
    use aws_sdk_s3::config::Credentials;
    use fencegate_client::LeaseClient;

    let mut redis = RedisServer::start().await;
    let moto = Moto::start().await;
    s3_client(&moto.endpoint, "moto", "moto").create_bucket().bucket(BUCKET).send().await.unwrap();
    let dir_a = tempfile::tempdir().unwrap();
    let a = Fencegate::setup(dir_a.path())
        .store(&redis_store_toml(&redis.url(), "a"))
        .upstream(&moto.upstream_toml(BUCKET))
        .extra(SHORT_DEADLINE)
        .start()
        .await;
    let credentials = Credentials::new(common::ACCESS_KEY, common::SECRET_KEY, None, None, "test");
    let leases = LeaseClient::new(&a.endpoint(), credentials, "us-east-1").unwrap();
    let resource = "job:failover";

    let first = leases.acquire(resource, "holder-1", Duration::from_secs(30)).await.unwrap().token().0;
    put_on(&client(&a), "jobs/x", first, resource).await.unwrap();

    redis.restart_empty().await; // the grant and the fence are gone from Redis
    let second = acquire_eventually(&leases, resource, "holder-2").await;
    assert!(second > first, "a grant after the rollback must be above {first}, got {second}");

    redis.restart_empty().await; // again: Redis has nothing, replica a's mark is `second`
    let dir_b = tempfile::tempdir().unwrap();
    let b = Fencegate::setup(dir_b.path())
        .store(&redis_store_toml(&redis.url(), "b"))
        .upstream(&moto.upstream_toml(BUCKET))
        .extra(SHORT_DEADLINE)
        .start()
        .await;
    // The stale holder writes through a: refused from a's mark, which raises Redis back (a
    // refusal asks at most once a second, again at once if asking failed: Redis just restarted).
    let fence_key = format!("fg:{{{resource}}}:fence");
    let mut conn = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let mut stored = None;
    for _ in 0..50 {
        let (code, status, current) = put_on(&client(&a), "jobs/x", first, resource).await.unwrap_err();
        assert_eq!((code.as_deref(), status, current), (Some("FencingTokenStale"), 409, Some(second.to_string())));
        tokio::time::sleep(Duration::from_millis(50)).await;
        stored = redis::cmd("GET").arg(&fence_key).query_async::<Option<String>>(&mut conn).await.unwrap();
        if stored.is_some() {
            break;
        }
    }
    assert_eq!(stored, Some(second.to_string()), "the refusal raised Redis back to the mark");
    // b never saw the resource, and still refuses the stale token: Redis knows again.
    let (code, status, _) = put_on(&client(&b), "jobs/y", first, resource).await.unwrap_err();
    assert_eq!((code.as_deref(), status), (Some("FencingTokenStale"), 409));
    a.stop().await;
    b.stop().await;
}

async fn put_on(
    c: &Client,
    key: &str,
    token: u64,
    resource: &'static str,
) -> Result<(), (Option<String>, u16, Option<String>)> {
    c.put_object()
        .bucket(BUCKET)
        .key(key)
        .body(ByteStream::from_static(b"x"))
        .customize()
        .mutate_request(move |req| {
            req.headers_mut().insert("fencing-token", token.to_string());
            req.headers_mut().insert("fencing-resource", resource);
        })
        .send()
        .await
        .map(|_| ())
        .map_err(|e| error_of(&e))
}

/// An in-flight deadline of 1 s: a Redis that lost its state admits nothing for 1.375 s.
const SHORT_DEADLINE: &str = "[fencing]\ninflight_deadline_ms = 1000\n";

/// Acquires `name` once Redis answers again (it was just restarted); the granted token.
async fn acquire_eventually(leases: &fencegate_client::LeaseClient, name: &str, holder: &str) -> u64 {
    for _ in 0..100 {
        if let Ok(lease) = leases.acquire(name, holder, Duration::from_secs(30)).await {
            return lease.token().0;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no grant after Redis came back");
}
