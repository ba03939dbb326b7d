//! Proves that leases live in the fence store and survive crashes: with the real fencegate binary killed with SIGKILL between grants, every grant after a restart on the same data dir has a greater token (and older tokens stay fenced off), and a live lease survives the restart: its holder keeps renewing it and nobody else can take it.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::primitives::ByteStream;
use common::{ACCESS_KEY, SECRET_KEY};
use fencegate_client::{FencingInterceptor, LeaseClient, LeaseError, LeaseOptions, LeaseStatus};

/// Bound on fencegate's start-up (a debug build on a loaded machine).
const READY_WAIT_MAX: Duration = Duration::from_secs(60);
/// Bound on waiting for an old lease to expire.
const ACQUIRE_WAIT_MAX: Duration = Duration::from_secs(10);

/// A fencegate process on a data dir; SIGKILLed when dropped.
struct Process {
    child: Child,
    s3: SocketAddr,
}

impl Process {
    /// Starts `fencegate serve` on `dir` and waits for its `fencegate ready:` line.
    fn start(dir: &Path, s3_listen: &str) -> Self {
        let config = dir.join("fencegate.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"{s3_listen}\"\nadmin_listen = \"127.0.0.1:0\"\n\
                 [store]\nkind = \"embedded\"\npath = \"{}\"\n\
                 [upstream]\nkind = \"local\"\npath = \"{}\"\n\
                 [fencing]\ninflight_deadline_ms = 1000\n\
                 [[credentials]]\naccess_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{SECRET_KEY}\"\nrole = \"issuer\"\n\
                 [log]\nlevel = \"warn\"\n",
                dir.join("fences").display(),
                dir.join("objects").display()
            ),
        )
        .unwrap();
        let (child, s3) = common::spawn_fencegate(env!("CARGO_BIN_EXE_fencegate"), &config, READY_WAIT_MAX);
        Self { child, s3 }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.s3)
    }

    /// SIGKILL: no shutdown, no flush; only what the store committed survives.
    fn kill_9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lease_client(endpoint: &str) -> LeaseClient {
    LeaseClient::new(endpoint, Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"), "us-east-1")
        .unwrap()
        .with_request_timeout(Duration::from_secs(2))
}

/// An S3 client, its requests fenced by `fencing` when given.
fn s3(endpoint: &str, fencing: Option<FencingInterceptor>) -> aws_sdk_s3::Client {
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"))
        .http_client(aws_smithy_http_client::Builder::new().build_http());
    let config = match fencing {
        Some(fencing) => config.interceptor(fencing),
        None => config,
    };
    aws_sdk_s3::Client::from_conf(config.build())
}

/// Acquires `name`, waiting (bounded) while an older lease has not expired yet.
async fn acquire_when_free(c: &LeaseClient, name: &str, holder: &str, ttl: Duration) -> fencegate_client::Lease {
    let give_up = tokio::time::Instant::now() + ACQUIRE_WAIT_MAX;
    loop {
        match c.acquire(name, holder, ttl).await {
            Ok(lease) => return lease,
            Err(LeaseError::Held { remaining_ms, .. }) if tokio::time::Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(remaining_ms + 10)).await;
            }
            // After the kill, grants are refused (503, Retry-After) until the writes of the
            // process before can no longer commit: try again, as a client should.
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("acquire {name}: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_growing_across_kill_9_between_grants() {
    let dir = tempfile::tempdir().unwrap();
    let ttl = Duration::from_millis(500);
    let mut tokens = Vec::new();
    let mut previous: Option<fencegate_client::Lease> = None;
    for round in 0..3 {
        let fg = Process::start(dir.path(), "127.0.0.1:0");
        if round == 0 {
            // The bucket, in the local upstream: it outlives the restarts.
            s3(&fg.endpoint(), None).create_bucket().bucket("out").send().await.unwrap();
        }
        let c = lease_client(&fg.endpoint());
        // The lease of the round before may still be live in the store: wait it out.
        let lease = acquire_when_free(&c, "job:crash", &format!("holder-{round}"), ttl).await;
        if let Some(before) = previous.take() {
            assert!(lease.token() > before.token(), "round {round}: {} after {}", lease.token(), before.token());
            // The previous holder's token is fenced off on the restarted fencegate.
            let stale = s3(&fg.endpoint(), Some(FencingInterceptor::for_lease(&before)));
            let err = stale.put_object().bucket("out").key("k").body(ByteStream::from_static(b"old")).send().await;
            let status =
                err.expect_err("a token from before the crash is stale").raw_response().map(|r| r.status().as_u16());
            assert_eq!(status, Some(409));
        }
        let fresh = s3(&fg.endpoint(), Some(FencingInterceptor::for_lease(&lease)));
        fresh.put_object().bucket("out").key("k").body(ByteStream::from_static(b"new")).send().await.unwrap();
        tokens.push(lease.token().0);
        fg.kill_9();
        previous = Some(lease);
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_lease_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Process::start(dir.path(), "127.0.0.1:0");
    let addr = fg.s3;
    let c = lease_client(&fg.endpoint());
    // A TTL that outlasts a restart by far; renewals every 200 ms show it stays alive.
    let options =
        LeaseOptions::default().renew_every(Duration::from_millis(200)).retry_every(Duration::from_millis(50));
    let lease = c.acquire_with("job:live", "a", Duration::from_secs(20), options).await.unwrap();

    fg.kill_9();
    // Same data dir, same address: the holder's client just keeps renewing.
    let fg = Process::start(dir.path(), &addr.to_string());
    let c = lease_client(&fg.endpoint());

    let renewed = c.renew("job:live", lease.lease_id()).await.expect("the live lease survived the crash");
    assert_eq!((renewed.token, renewed.holder.as_str()), (lease.token(), "a"));
    match c.try_acquire("job:live", "b", Duration::from_secs(20)).await {
        Err(LeaseError::Held { holder, .. }) => assert_eq!(holder, "a"),
        other => panic!("the lease must still be held, got {other:?}"),
    }
    // The background heartbeat reaches the new process too.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(lease.status(), LeaseStatus::Held);
    let deadline_before = lease.deadline();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(lease.deadline() > deadline_before, "renewals go on after the restart");

    lease.release().await.unwrap();
    let next = c.try_acquire("job:live", "b", Duration::from_secs(20)).await.unwrap();
    assert!(next.token > renewed.token);
}
