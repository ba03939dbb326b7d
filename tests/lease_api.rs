//! Proves the lease API's compare-and-set contract over HTTP: a held lease refuses a second acquire (409), a stale release or an expired renewal gets 410 while the current lease survives, a grant fences its resource at once, and the client crate renews, loses and releases against a real fencegate.
mod common;

use std::time::Duration;

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::primitives::ByteStream;
use common::{ACCESS_KEY, Fencegate, ManualClock, SECRET_KEY, error_of};
use fencegate_client::{FencingInterceptor, LeaseClient, LeaseError, LeaseOptions, LeaseStatus, LostReason};

const BUCKET: &str = "leases";
/// Long enough that no lease in these tests expires unless a test waits for it.
const TTL_LONG: Duration = Duration::from_secs(30);
/// Bound on every wait for a background event, so a broken client fails instead of hanging.
const EVENT_WAIT_MAX: Duration = Duration::from_secs(10);

fn lease_client(fg: &Fencegate) -> LeaseClient {
    LeaseClient::new(&fg.endpoint(), Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"), "us-east-1").unwrap()
}

/// A data dir whose local upstream has the bucket `BUCKET` (a bucket there is a directory).
/// fencegate on the local upstream, with bucket [`BUCKET`] in it.
async fn with_bucket(dir: &std::path::Path) -> Fencegate {
    let fg = Fencegate::start_local(dir, "").await;
    common::client(&fg).create_bucket().bucket(BUCKET).send().await.unwrap();
    fg
}

/// An aws-sdk-s3 client whose requests carry the token of `fencing`'s lease.
fn fenced_s3(fg: &Fencegate, fencing: FencingInterceptor) -> aws_sdk_s3::Client {
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(fg.endpoint())
        .force_path_style(true)
        .credentials_provider(Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .interceptor(fencing)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_refuses_a_second_acquire_and_a_stale_release() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = lease_client(&fg);

    let a = c.try_acquire("job:api", "a", TTL_LONG).await.unwrap();
    assert_eq!((a.name.as_str(), a.holder.as_str(), a.ttl_ms), ("job:api", "a", 30_000));
    match c.try_acquire("job:api", "b", TTL_LONG).await {
        Err(LeaseError::Held { holder, remaining_ms }) => {
            assert_eq!(holder, "a");
            assert!(remaining_ms > 0 && remaining_ms <= 30_000, "remaining_ms={remaining_ms}");
        }
        other => panic!("a second acquire must get 409 LeaseHeld, got {other:?}"),
    }

    // A release with someone else's (or an old) lease id changes nothing.
    assert!(matches!(c.release("job:api", "0123456789abcdef").await, Err(LeaseError::Gone { .. })));
    let renewed = c.renew("job:api", &a.lease_id).await.expect("the current lease survives a stale release");
    assert_eq!((renewed.token, renewed.lease_id.as_str()), (a.token, a.lease_id.as_str()));
    assert!(matches!(c.try_acquire("job:api", "b", TTL_LONG).await, Err(LeaseError::Held { .. })));

    // Released: its id is dead, and the next holder gets a greater token at once.
    c.release("job:api", &a.lease_id).await.unwrap();
    assert!(matches!(c.renew("job:api", &a.lease_id).await, Err(LeaseError::Gone { .. })));
    assert!(matches!(c.release("job:api", &a.lease_id).await, Err(LeaseError::Gone { .. })));
    let b = c.try_acquire("job:api", "b", TTL_LONG).await.unwrap();
    assert!(b.token > a.token, "{:?} after {:?}", b.token, a.token);
    assert_ne!(b.lease_id, a.lease_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_after_expiry_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new();
    let fg = Fencegate::setup(dir.path()).clock(clock.clone()).start().await;
    let c = lease_client(&fg);

    let a = c.try_acquire("job:expiry", "a", Duration::from_millis(300)).await.unwrap();
    clock.advance(Duration::from_millis(299));
    let renewed = c.renew("job:expiry", &a.lease_id).await.expect("live until its TTL has passed");
    assert_eq!(renewed.token, a.token);
    // The renewal counts from now: 299 ms later it still stands, 300 ms later it is gone.
    clock.advance(Duration::from_millis(299));
    assert!(matches!(c.try_acquire("job:expiry", "b", TTL_LONG).await, Err(LeaseError::Held { .. })));
    clock.advance(Duration::from_millis(1));
    assert!(matches!(c.renew("job:expiry", &a.lease_id).await, Err(LeaseError::Gone { .. })));
    assert!(matches!(c.release("job:expiry", &a.lease_id).await, Err(LeaseError::Gone { .. })));
    let b = c.try_acquire("job:expiry", "b", TTL_LONG).await.expect("an expired lease does not block");
    assert!(b.token > a.token);
    assert!(matches!(c.renew("job:expiry", &a.lease_id).await, Err(LeaseError::Gone { .. })), "superseded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_a_code() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = lease_client(&fg);
    for (holder, ttl) in [("", TTL_LONG), ("a", Duration::ZERO), ("a", Duration::from_secs(3601))] {
        match c.try_acquire("job:bad", holder, ttl).await {
            Err(LeaseError::Refused { status: 400, code, .. }) => assert_eq!(code, "InvalidLeaseRequest"),
            other => panic!("holder={holder:?} ttl={ttl:?}: expected 400, got {other:?}"),
        }
    }
    let wrong_key =
        LeaseClient::new(&fg.endpoint(), Credentials::new(ACCESS_KEY, "wrong", None, None, "t"), "us-east-1").unwrap();
    match wrong_key.try_acquire("job:bad", "a", TTL_LONG).await {
        Err(LeaseError::Refused { status: 403, .. }) => {}
        other => panic!("a wrong signature must get 403, got {other:?}"),
    }
}

/// Names travel percent-encoded (slashes as they are), whatever they contain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_slashes_spaces_and_unicode_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = lease_client(&fg);
    for name in ["reports/2026 Q1/", "job:a+b=c&d?e#f", "größe", "x%2Fy", "/lead//double"] {
        let g = c.try_acquire(name, "a", TTL_LONG).await.unwrap_or_else(|e| panic!("{name:?}: {e:?}"));
        assert_eq!(g.name, name);
        c.renew(name, &g.lease_id).await.unwrap();
        c.release(name, &g.lease_id).await.unwrap();
    }
    // fencegate would read this one as a renewal of "job": refused before sending.
    assert!(matches!(c.try_acquire("job/renew", "a", TTL_LONG).await, Err(LeaseError::Invalid(_))));
}

/// A grant is the fence (G7 without a registration call): the old holder's next write is
/// refused before the new holder wrote anything, and the old holder's client learns of the
/// loss from its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_fences_the_resource_at_once_and_the_old_holder_learns_it() {
    let dir = tempfile::tempdir().unwrap();
    let fg = with_bucket(dir.path()).await;
    let c = lease_client(&fg);
    let options = LeaseOptions::default().renew_every(Duration::from_millis(200));

    let a = c.acquire_with("job:fence", "a", TTL_LONG, options.clone()).await.unwrap();
    let s3a = fenced_s3(&fg, FencingInterceptor::for_lease(&a));
    s3a.put_object().bucket(BUCKET).key("out.csv").body(ByteStream::from_static(b"a")).send().await.unwrap();

    // Someone (an operator, a bug) releases A's lease behind its back; B takes over.
    c.release("job:fence", a.lease_id()).await.unwrap();
    let b = c.acquire_with("job:fence", "b", TTL_LONG, options).await.unwrap();
    assert!(b.token() > a.token());

    let err = s3a.put_object().bucket(BUCKET).key("out.csv").body(ByteStream::from_static(b"a2")).send().await;
    let (code, status, current) = error_of(&err.expect_err("A's write after B's grant must be refused"));
    assert_eq!((code.as_deref(), status), (Some("FencingTokenStale"), 409));
    assert_eq!(current, Some(b.token().to_string()));

    tokio::time::timeout(EVENT_WAIT_MAX, a.lost().cancelled()).await.expect("A's client raises the loss");
    // B's grant is a newer token: A learns it was superseded, and by which token.
    assert_eq!(a.status(), LeaseStatus::Lost(LostReason::Superseded { fence: b.token().0 }));
    assert!(!a.is_held());
    assert_eq!(b.status(), LeaseStatus::Held);

    let s3b = fenced_s3(&fg, FencingInterceptor::for_lease(&b));
    s3b.put_object().bucket(BUCKET).key("out.csv").body(ByteStream::from_static(b"b")).send().await.unwrap();
    assert!(matches!(a.release().await, Err(LeaseError::Gone { .. })));
    b.release().await.unwrap();
}

/// A grant is above every token ever seen for the resource, including tokens that arrived on
/// writes from another issuer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_above_tokens_seen_on_writes() {
    let dir = tempfile::tempdir().unwrap();
    let fg = with_bucket(dir.path()).await;
    let s3 = common::client(&fg);
    s3.put_object()
        .bucket(BUCKET)
        .key("seen.csv")
        .body(ByteStream::from_static(b"x"))
        .customize()
        .mutate_request(|r| {
            r.headers_mut().insert("fencing-token", "100");
            r.headers_mut().insert("fencing-resource", "job:seen");
        })
        .send()
        .await
        .unwrap();
    let g = lease_client(&fg).try_acquire("job:seen", "a", TTL_LONG).await.unwrap();
    assert_eq!(g.token.0, 101);
}

/// The background renewal keeps a short lease alive well past its TTL, the heartbeats are
/// measured, and release hands the lease over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_renewal_keeps_a_short_lease_alive() {
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), "").await;
    let c = lease_client(&fg);
    let ttl = Duration::from_millis(900);
    let lease = c.acquire("job:bg", "a", ttl).await.unwrap();
    tokio::time::sleep(ttl * 3).await;
    assert_eq!(lease.status(), LeaseStatus::Held);
    assert!(matches!(c.try_acquire("job:bg", "b", ttl).await, Err(LeaseError::Held { .. })));

    // In-process, fencegate's Prometheus recorder is the global one: the client's metrics
    // show up on its /metrics.
    let metrics = common::http_get(fg.admin, "/metrics", EVENT_WAIT_MAX).await;
    for name in ["lease_acquired", "heartbeat_latency"] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }

    let lost = lease.lost();
    lease.release().await.unwrap();
    assert!(lost.is_cancelled());
    c.try_acquire("job:bg", "b", ttl).await.expect("released: free at once");
}
