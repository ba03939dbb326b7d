use super::*;
use crate::store::MemoryStore;

fn gate() -> Gate {
    Gate::new(Arc::new(MemoryStore::default()), GateLimits::default())
}

fn key(name: &str) -> ResourceKey {
    ResourceKey::new(name).unwrap()
}

/// `token`'s admission on `r`, in a task of its own (for a test to watch it wait).
fn admit_in_a_task(
    gate: &Arc<Gate>,
    r: &ResourceKey,
    token: FenceToken,
) -> tokio::task::JoinHandle<Result<FenceToken, AdmitError>> {
    let (gate, r) = (gate.clone(), r.clone());
    tokio::spawn(async move { gate.admit(&r, token).await.map(|p| p.token()) })
}

/// Stale tokens are refused with the current fence; equal tokens run side by side.
#[tokio::test]
async fn stale_is_refused_and_current_runs_concurrently() {
    let gate = gate();
    let r = key("job:a");
    let first = gate.admit(&r, FenceToken(12)).await.unwrap();
    let second = gate.admit(&r, FenceToken(12)).await.unwrap();
    match gate.admit(&r, FenceToken(11)).await {
        Err(AdmitError::Stale { current, .. }) => assert_eq!(current, FenceToken(12)),
        other => panic!("expected stale, got {:?}", other.map(|p| p.token())),
    }
    drop((first, second));
}

/// A newer token cancels an older write whose body is still streaming, and is admitted
/// only after that write is gone (G3).
#[tokio::test]
async fn newer_token_cancels_unsent_older_write_and_waits_for_it() {
    let gate = Arc::new(gate());
    let r = key("job:b");
    let old = gate.admit(&r, FenceToken(11)).await.unwrap();
    let cancelled = old.cancellation().clone();

    let newer = admit_in_a_task(&gate, &r, FenceToken(12));
    cancelled.cancelled().await;
    assert!(!newer.is_finished(), "newer write admitted while the older one is in flight");
    assert!(!old.mark_body_sent(), "a cancelled write must not finish its body");
    drop(old);
    assert_eq!(newer.await.unwrap().unwrap(), FenceToken(12));
}

/// An older write whose body was fully sent is awaited, not cancelled.
#[tokio::test]
async fn sent_older_write_is_awaited_not_cancelled() {
    let gate = Arc::new(gate());
    let r = key("job:c");
    let old = gate.admit(&r, FenceToken(11)).await.unwrap();
    assert!(old.mark_body_sent());
    let newer = admit_in_a_task(&gate, &r, FenceToken(12));
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!old.cancellation().is_cancelled());
    assert!(!newer.is_finished());
    drop(old);
    assert_eq!(newer.await.unwrap().unwrap(), FenceToken(12));
}

/// A write still waiting when the gate closes (shutdown) is refused when its wait ends,
/// not registered after shutdown counted the writes in flight.
#[tokio::test]
async fn a_write_waiting_when_the_gate_closes_is_not_registered() {
    let gate = Arc::new(gate());
    let r = key("job:closing");
    let old = gate.admit(&r, FenceToken(11)).await.unwrap();
    assert!(old.mark_body_sent());
    let newer = admit_in_a_task(&gate, &r, FenceToken(12));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!newer.is_finished(), "the newer write waits for the older one");
    gate.close();
    drop(old);
    assert_eq!(gate.inflight_writes(), 0);
    match newer.await.unwrap() {
        Err(AdmitError::StoreUnavailable(StoreError::Closed)) => {}
        other => panic!("expected a refusal after close, got {other:?}"),
    }
    assert_eq!(gate.inflight_writes(), 0, "nothing registered after shutdown counted");
}

/// Once a newer token is registered, the older token is refused even before any write
/// with the newer one (G7).
#[tokio::test]
async fn registration_fences_older_tokens() {
    let gate = gate();
    let r = key("job:d");
    gate.admit(&r, FenceToken(11)).await.unwrap();
    assert_eq!(gate.advance(&r, FenceToken(12)).await.unwrap(), FenceToken(12));
    assert!(matches!(gate.admit(&r, FenceToken(11)).await, Err(AdmitError::Stale { .. })));
    assert!(matches!(gate.advance(&r, FenceToken(10)).await, Err(AdmitError::Stale { .. })));
    assert_eq!(gate.fence(&r).await.unwrap(), Some(FenceToken(12)));
}

/// A write that cannot drain older writes within the deadline gets an error, not an
/// admission; the fence stays advanced.
#[tokio::test(start_paused = true)]
async fn drain_is_bounded_by_the_deadline() {
    let limits = GateLimits { inflight_deadline: Duration::from_millis(500), ..GateLimits::default() };
    let gate = Gate::new(Arc::new(MemoryStore::default()), limits);
    let r = key("job:e");
    let old = gate.admit(&r, FenceToken(1)).await.unwrap();
    assert!(old.mark_body_sent());
    assert!(matches!(gate.admit(&r, FenceToken(2)).await, Err(AdmitError::DrainTimeout { .. })));
    assert!(matches!(gate.admit(&r, FenceToken(1)).await, Err(AdmitError::Stale { .. })));
    drop(old);
    assert!(gate.admit(&r, FenceToken(2)).await.is_ok());
}

/// A store that fails makes the gate fail closed.
#[tokio::test]
async fn store_failure_fails_closed() {
    let store = Arc::new(MemoryStore::default());
    let gate = Gate::new(store.clone(), GateLimits::default());
    store.set_failing(true);
    assert!(matches!(gate.admit(&key("job:f"), FenceToken(3)).await, Err(AdmitError::StoreUnavailable(_))));
}

/// Idle resources are forgotten beyond the cache limit and come back from the store.
#[tokio::test]
async fn forgotten_resources_reload_their_fence() {
    let limits = GateLimits { cached_resources_max: 4, ..GateLimits::default() };
    let gate = Gate::new(Arc::new(MemoryStore::default()), limits);
    for i in 0..20 {
        drop(gate.admit(&key(&format!("r{i}")), FenceToken(i + 5)).await.unwrap());
    }
    assert!(gate.slots.lock().unwrap().len() <= 5);
    assert!(matches!(gate.admit(&key("r0"), FenceToken(4)).await, Err(AdmitError::Stale { .. })));
}

/// After an unclean start, no admission (write, registration or grant) for the in-flight
/// deadline: the dead process's sent writes may still commit.
#[tokio::test(start_paused = true)]
async fn no_admission_for_the_deadline_after_an_unclean_start() {
    let deadline = Duration::from_secs(5);
    let store = Arc::new(MemoryStore::default());
    let before = Gate::new(store.clone(), GateLimits::default());
    drop(before.admit(&key("job:q"), FenceToken(5)).await.unwrap());
    let gate = Gate::new(store, GateLimits { inflight_deadline: deadline, ..GateLimits::default() });
    gate.hold_writes_for(deadline);
    let started = Instant::now();
    drop(gate.admit(&key("job:q"), FenceToken(5)).await.unwrap());
    assert!(started.elapsed() >= deadline, "the current token waits too: {:?}", started.elapsed());
    drop(gate.admit(&key("job:q"), FenceToken(6)).await.unwrap());
    let grant = LeaseCommand::Acquire { holder: "h".into(), ttl_ms: 1000, lease_id: "l".into(), floor: None };
    assert!(matches!(gate.lease(&key("job:q"), grant, 0).await, Ok(LeaseOutcome::Granted(_))));
    assert!(started.elapsed() < deadline * 2, "the hold ends once");
}
