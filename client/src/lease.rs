//! A held lease: renewed in the background, and a lost-lease signal for the code doing the work.
//!
//! The local deadline is `ttl` after the *sending* of the last successful renewal (or of the
//! acquire). fencegate measures its own expiry from when it processed that request, which is
//! later, so the holder always gives up no later than fencegate does. All time is
//! `tokio::time`, so the logic is tested with paused time.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::api::{FencingToken, Grant, LeaseClient, LeaseCredentials, LeaseError};
use crate::metrics;

/// The smallest pause between two renewal attempts, whatever the TTL.
const RETRY_EVERY_MIN: Duration = Duration::from_millis(10);

/// How a lease is kept alive. The defaults follow the TTL: renew every `ttl / 3`, and after a
/// failed attempt (no answer, fencegate unavailable) try again every `ttl / 10`.
#[derive(Debug, Clone, Default)]
pub struct LeaseOptions {
    renew_every: Option<Duration>,
    retry_every: Option<Duration>,
    pub(crate) credentials: bool,
}

impl LeaseOptions {
    /// Time between the sending of two renewals. Must be below the TTL.
    pub fn renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// Time between attempts after one failed without a verdict (transport error, timeout,
    /// 5xx). Each attempt is also cut off after `renew_every`.
    pub fn retry_every(mut self, every: Duration) -> Self {
        self.retry_every = Some(every);
        self
    }

    /// Also ask for lease credentials ([`Lease::credentials`]).
    pub fn with_credentials(mut self) -> Self {
        self.credentials = true;
        self
    }

    pub(crate) fn timing(&self, ttl: Duration) -> Result<Timing, LeaseError> {
        let renew_every = self.renew_every.unwrap_or(ttl / 3);
        let retry_every = self.retry_every.unwrap_or(ttl / 10).max(RETRY_EVERY_MIN);
        if ttl.is_zero() || renew_every.is_zero() || renew_every >= ttl {
            return Err(LeaseError::Invalid(format!(
                "renew_every ({renew_every:?}) must be above zero and below the ttl ({ttl:?})"
            )));
        }
        Ok(Timing { renew_every, retry_every })
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    renew_every: Duration,
    retry_every: Duration,
}

/// Where a lease stands. Once it is not `Held` it never is again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    Held,
    Lost(LostReason),
    /// Released at fencegate by [`Lease::release`].
    Released,
    /// The [`Lease`] was dropped without a release: renewals stopped, fencegate lets it expire.
    Abandoned,
}

/// Why a lease was lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReason {
    /// fencegate refused a renewal or release (410): the lease expired there or was released.
    Refused,
    /// fencegate refused it (410) and the resource's fence is above the lease's token: a newer
    /// token was registered or granted, and every write of this lease is refused.
    Superseded { fence: u64 },
    /// The local deadline passed without a successful renewal.
    Deadline,
}

impl LostReason {
    /// The reason in a sentence, for a person.
    pub fn explanation(&self) -> String {
        match self {
            Self::Refused => "refused: it expired at fencegate, or someone else released it".to_owned(),
            Self::Superseded { fence } => format!("superseded: a newer token ({fence}) was registered or granted"),
            Self::Deadline => "deadline: no renewal succeeded before it would have expired".to_owned(),
        }
    }
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Refused => "refused",
            Self::Superseded { .. } => "superseded",
            Self::Deadline => "deadline",
        })
    }
}

/// Leases kept renewed: made by the client (`crate::api` holds its one-shot calls).
impl LeaseClient {
    /// Acquires `name` for `holder` and keeps it renewed in the background every `ttl / 3`.
    /// Fails with [`LeaseError::Held`] if someone holds it.
    pub async fn acquire(&self, name: &str, holder: &str, ttl: Duration) -> Result<Lease, LeaseError> {
        self.acquire_with(name, holder, ttl, LeaseOptions::default()).await
    }

    /// [`Self::acquire`] with explicit renewal timing.
    pub async fn acquire_with(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
        options: LeaseOptions,
    ) -> Result<Lease, LeaseError> {
        let timing = options.timing(ttl)?;
        // The local deadline counts from when the request left, not from when the answer came.
        let sent = tokio::time::Instant::now();
        let grant = self.acquire_call(name, holder, ttl, options.credentials).await?;
        Ok(Lease::start(Arc::new(self.clone()), grant, sent, timing))
    }
}

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The two calls a held lease makes; fencegate over HTTP, or a script in the unit tests.
pub(crate) trait Transport: Send + Sync + 'static {
    fn renew<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<Grant, LeaseError>>;
    fn release<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<(), LeaseError>>;
}

impl Transport for LeaseClient {
    fn renew<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<Grant, LeaseError>> {
        Box::pin(LeaseClient::renew(self, name, lease_id))
    }

    fn release<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<(), LeaseError>> {
        Box::pin(LeaseClient::release(self, name, lease_id))
    }
}

/// The first pause before a release that got no answer is sent again; then doubling, up to
/// [`RELEASE_RETRY_MAX`].
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(100);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(1);

/// A lease held by this process. Renewed in the background until released, lost or dropped.
///
/// Watch [`Lease::lost`] (or [`Lease::watch`]) in the code doing the work and stop writing
/// when it fires; attach [`Lease::token`] to every write (see [`crate::FencingInterceptor`]).
pub struct Lease {
    shared: Arc<Shared>,
    transport: Arc<dyn Transport>,
    /// Stops the heartbeat task.
    stop: CancellationToken,
    heartbeat: Option<JoinHandle<()>>,
}

/// What the lease, its heartbeat task and any interceptor share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) holder: String,
    pub(crate) lease_id: String,
    pub(crate) token: FencingToken,
    pub(crate) credentials: Option<LeaseCredentials>,
    /// Moves forward with every successful renewal; the state and the signals change together.
    deadline: Mutex<Instant>,
    status: watch::Sender<LeaseStatus>,
    /// Cancelled when the lease stops being held, for whatever reason.
    lost: CancellationToken,
}

impl Shared {
    /// Why a lease that fencegate answered as gone (with the resource's `fence`) is lost.
    fn gone(&self, fence: Option<u64>) -> LostReason {
        match fence {
            Some(fence) if fence > self.token.0 => LostReason::Superseded { fence },
            _ => LostReason::Refused,
        }
    }

    fn new(grant: Grant, deadline: Instant) -> Self {
        Self {
            name: grant.name,
            holder: grant.holder,
            lease_id: grant.lease_id,
            token: grant.token,
            credentials: grant.credentials,
            deadline: Mutex::new(deadline),
            status: watch::Sender::new(LeaseStatus::Held),
            lost: CancellationToken::new(),
        }
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().expect("lease lock")
    }

    /// A renewal sent at `sent` succeeded: the lease is ours until `sent + ttl`.
    fn extend(&self, sent: Instant, ttl: Duration) {
        let mut deadline = self.deadline.lock().expect("lease lock");
        if *self.status.borrow() == LeaseStatus::Held {
            *deadline = (*deadline).max(sent + ttl);
        }
    }

    /// Whether the lease is still held now; raises the loss if the deadline has passed, so the
    /// signal fires even if the heartbeat task had no chance to run (a stalled process).
    pub(crate) fn check(&self) -> bool {
        let expired = Instant::now() >= self.deadline();
        if expired {
            self.end(LeaseStatus::Lost(LostReason::Deadline));
        }
        *self.status.borrow() == LeaseStatus::Held
    }

    /// Moves from `Held` to `status` once; later calls change nothing.
    fn end(&self, status: LeaseStatus) {
        let _deadline = self.deadline.lock().expect("lease lock"); // orders against extend()
        let changed = self.status.send_if_modified(|current| {
            if *current != LeaseStatus::Held {
                return false;
            }
            *current = status;
            true
        });
        if !changed {
            return;
        }
        if let LeaseStatus::Lost(reason) = status {
            metrics::lost();
            tracing::warn!(lease = self.name.as_str(), token = self.token.0, %reason, "lease lost");
        }
        self.lost.cancel();
    }
}

impl Lease {
    /// Starts renewing `grant`, acquired by a request sent at `sent`.
    pub(crate) fn start(transport: Arc<dyn Transport>, grant: Grant, sent: Instant, timing: Timing) -> Self {
        let ttl = Duration::from_millis(grant.ttl_ms);
        let shared = Arc::new(Shared::new(grant, sent + ttl));
        let stop = CancellationToken::new();
        let heartbeat =
            tokio::spawn(heartbeat(shared.clone(), transport.clone(), timing, sent + timing.renew_every, stop.clone()));
        Self { shared, transport, stop, heartbeat: Some(heartbeat) }
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn holder(&self) -> &str {
        &self.shared.holder
    }

    /// The fencing token of this lease; attach it to every write.
    pub fn token(&self) -> FencingToken {
        self.shared.token
    }

    pub fn lease_id(&self) -> &str {
        &self.shared.lease_id
    }

    /// The lease credentials, when acquired with [`LeaseOptions::with_credentials`]. They stay
    /// the same for the whole lease; renewals extend them.
    pub fn credentials(&self) -> Option<&LeaseCredentials> {
        self.shared.credentials.as_ref()
    }

    /// When the lease ends locally unless a renewal succeeds before.
    pub fn deadline(&self) -> Instant {
        self.shared.deadline()
    }

    /// The lost-lease signal: cancelled when the lease is no longer held (renewal refused,
    /// deadline passed, released, or dropped). Clone it into the code doing the work.
    pub fn lost(&self) -> CancellationToken {
        self.shared.lost.clone()
    }

    /// The status, and its changes.
    pub fn watch(&self) -> watch::Receiver<LeaseStatus> {
        self.shared.status.subscribe()
    }

    pub fn status(&self) -> LeaseStatus {
        *self.shared.status.borrow()
    }

    /// Whether the lease is held right now. Checks the deadline against the clock (and raises
    /// the loss if it passed), so call it before a write that must not outlive the lease.
    pub fn is_held(&self) -> bool {
        self.shared.check()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops renewing and releases the lease at fencegate (compare-and-delete on the lease id).
    /// [`LeaseError::Gone`] means it was not ours any more. The lost signal fires either way.
    pub async fn release(mut self) -> Result<(), LeaseError> {
        self.stop_heartbeat().await;
        // A release that got no answer (fencegate restarting, unreachable, 5xx) is tried again
        // until the lease would have expired anyway: one that failed once held the lease for
        // its whole TTL.
        let mut pause = RELEASE_RETRY_FIRST;
        let result = loop {
            let result = self.transport.release(&self.shared.name, &self.shared.lease_id).await;
            match &result {
                Err(error) if error.is_retryable() && Instant::now() + pause < self.shared.deadline() => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RELEASE_RETRY_MAX);
                }
                _ => break result,
            }
        };
        match &result {
            Ok(()) => self.shared.end(LeaseStatus::Released),
            Err(LeaseError::Gone { fence }) => self.shared.end(LeaseStatus::Lost(self.shared.gone(*fence))),
            // Unknown outcome: it is ours until the deadline at most, and we stopped renewing.
            Err(_) => self.shared.end(LeaseStatus::Abandoned),
        }
        result
    }

    async fn stop_heartbeat(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.heartbeat.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.cancel();
        self.shared.end(LeaseStatus::Abandoned);
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("name", &self.shared.name)
            .field("token", &self.shared.token)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

/// Renews every `renew_every` (counted from the sending of the previous renewal) until
/// stopped; ends the lease on a refusal (410) or when the deadline passes first.
async fn heartbeat(
    shared: Arc<Shared>,
    transport: Arc<dyn Transport>,
    timing: Timing,
    mut next: Instant,
    stop: CancellationToken,
) {
    loop {
        let deadline = shared.deadline();
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = sleep_until(deadline) => {
                shared.check();
                return;
            }
            () = sleep_until(next) => {}
        }
        let sent = Instant::now();
        // An attempt that hangs is cut off after one interval, so that another can be made
        // before the deadline.
        let attempt = tokio::time::timeout(timing.renew_every, transport.renew(&shared.name, &shared.lease_id));
        let outcome = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = sleep_until(deadline) => {
                shared.check();
                return;
            }
            outcome = attempt => outcome,
        };
        match outcome {
            Ok(Ok(grant)) if grant.lease_id == shared.lease_id && grant.token == shared.token => {
                metrics::heartbeat_latency(sent.elapsed());
                shared.extend(sent, Duration::from_millis(grant.ttl_ms));
                next = sent + timing.renew_every;
            }
            Ok(Ok(grant)) => {
                // fencegate renewed something that is not this lease: trust nothing.
                tracing::error!(lease = shared.name.as_str(), ?grant, "renewal answered for another lease");
                shared.end(LeaseStatus::Lost(LostReason::Refused));
                return;
            }
            Ok(Err(LeaseError::Gone { fence })) => {
                metrics::heartbeat_latency(sent.elapsed());
                shared.end(LeaseStatus::Lost(shared.gone(fence)));
                return;
            }
            Ok(Err(error)) => {
                tracing::warn!(lease = shared.name.as_str(), %error, "lease renewal failed; retrying");
                next = Instant::now() + timing.retry_every;
            }
            Err(_elapsed) => {
                tracing::warn!(lease = shared.name.as_str(), "lease renewal timed out; retrying");
                next = Instant::now() + timing.retry_every;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    const TTL: Duration = Duration::from_millis(900);

    /// One scripted renewal answer: after `delay`, `result`.
    struct Step {
        delay: Duration,
        result: Result<(), LeaseError>,
    }

    fn ok_after(ms: u64) -> Step {
        Step { delay: Duration::from_millis(ms), result: Ok(()) }
    }

    fn err_after(ms: u64, error: LeaseError) -> Step {
        Step { delay: Duration::from_millis(ms), result: Err(error) }
    }

    fn unavailable() -> LeaseError {
        LeaseError::Refused { status: 503, code: "FenceStoreUnavailable".into(), detail: String::new() }
    }

    /// Answers renewals from a script (then succeeds at once), and records when each was sent.
    #[derive(Default)]
    struct Scripted {
        script: Mutex<VecDeque<Step>>,
        sent: Mutex<Vec<Instant>>,
        released: Mutex<Vec<String>>,
    }

    impl Scripted {
        fn new(steps: Vec<Step>) -> Arc<Self> {
            Arc::new(Self { script: Mutex::new(steps.into()), ..Self::default() })
        }

        fn sent_ms(&self, start: Instant) -> Vec<u64> {
            self.sent.lock().unwrap().iter().map(|t| (*t - start).as_millis() as u64).collect()
        }
    }

    impl Transport for Scripted {
        fn renew<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<Grant, LeaseError>> {
            self.sent.lock().unwrap().push(Instant::now());
            let step = self.script.lock().unwrap().pop_front().unwrap_or_else(|| ok_after(0));
            Box::pin(async move {
                tokio::time::sleep(step.delay).await;
                step.result.map(|()| grant(name, lease_id))
            })
        }

        fn release<'a>(&'a self, _name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<(), LeaseError>> {
            let attempt = {
                let mut released = self.released.lock().unwrap();
                released.push(lease_id.to_owned());
                released.iter().filter(|id| *id == lease_id).count()
            };
            Box::pin(async move {
                match lease_id {
                    "id-1" => Ok(()),
                    // Unreachable twice (fencegate restarting), then released.
                    "id-flaky" if attempt <= 2 => {
                        Err(LeaseError::Transport { endpoint: "http://fg".into(), cause: "refused".into() })
                    }
                    "id-flaky" => Ok(()),
                    "id-down" => Err(LeaseError::Timeout { after_ms: 10 }),
                    _ => Err(LeaseError::Gone { fence: None }),
                }
            })
        }
    }

    fn grant(name: &str, lease_id: &str) -> Grant {
        Grant {
            name: name.into(),
            holder: "w".into(),
            lease_id: lease_id.into(),
            token: FencingToken(7),
            ttl_ms: TTL.as_millis() as u64,
            credentials: None,
        }
    }

    fn start(transport: &Arc<Scripted>, lease_id: &str) -> (Lease, Instant) {
        let sent = Instant::now();
        let timing = LeaseOptions::default().timing(TTL).unwrap();
        let lease = Lease::start(transport.clone(), grant("job", lease_id), sent, timing);
        (lease, sent)
    }

    /// Renews every ttl/3, counted from the sending of the previous renewal, and stays held.
    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_ttl_and_stays_held() {
        let transport = Scripted::new(vec![ok_after(50), ok_after(50), ok_after(50)]);
        let (lease, start) = start(&transport, "id-1");
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert_eq!(transport.sent_ms(start), vec![300, 600, 900, 1200, 1500, 1800]);
        assert_eq!(lease.status(), LeaseStatus::Held);
        assert!(lease.is_held());
        assert!(!lease.lost().is_cancelled());
        assert_eq!(lease.deadline() - start, Duration::from_millis(1800) + TTL);
    }

    /// A refused renewal (410) raises the loss at once.
    #[tokio::test(start_paused = true)]
    async fn a_refused_renewal_loses_the_lease_at_once() {
        let transport = Scripted::new(vec![err_after(20, LeaseError::Gone { fence: None })]);
        let (lease, start) = start(&transport, "id-1");
        let lost = lease.lost();
        lost.cancelled().await;
        assert_eq!(Instant::now() - start, Duration::from_millis(320));
        assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Refused));
        assert!(!lease.is_held());
    }

    /// The deadline counts from when the last successful renewal was sent, not from when its
    /// slow answer came back.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_counts_from_the_sending_of_the_last_good_renewal() {
        // Sent at 300, answered at 500; then fencegate is unreachable.
        let mut steps = vec![ok_after(200)];
        steps.extend((0..100).map(|_| err_after(5, unavailable())));
        let transport = Scripted::new(steps);
        let (lease, start) = start(&transport, "id-1");
        let mut watch = lease.watch();
        watch.wait_for(|s| *s != LeaseStatus::Held).await.unwrap();
        assert_eq!(Instant::now() - start, Duration::from_millis(300) + TTL);
        assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Deadline));
        assert!(lease.lost().is_cancelled());
    }

    /// Without any good renewal the deadline is `ttl` after the acquire was sent; renewals
    /// that hang are cut off and retried before that.
    #[tokio::test(start_paused = true)]
    async fn hanging_renewals_are_retried_until_the_deadline() {
        let transport = Scripted::new((0..100).map(|_| ok_after(10_000)).collect());
        let (lease, start) = start(&transport, "id-1");
        lease.lost().cancelled().await;
        assert_eq!(Instant::now() - start, TTL);
        assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Deadline));
        // Sent at 300, cut off at 600, retried 90 ms later.
        assert_eq!(transport.sent_ms(start), vec![300, 690]);
    }

    /// Failed attempts are retried every ttl/10, and a later success keeps the lease.
    #[tokio::test(start_paused = true)]
    async fn failures_are_retried_and_a_success_keeps_the_lease() {
        let transport = Scripted::new(vec![err_after(5, unavailable()), err_after(5, unavailable()), ok_after(5)]);
        let (lease, start) = start(&transport, "id-1");
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(lease.status(), LeaseStatus::Held);
        // 300 fails (answer at 305), 395 fails (at 400), 490 succeeds, then every 300 ms.
        assert_eq!(transport.sent_ms(start), vec![300, 395, 490, 790]);
    }

    /// A stalled process whose heartbeat never ran still sees the loss when it checks.
    #[tokio::test(start_paused = true)]
    async fn a_check_after_the_deadline_raises_the_loss() {
        let shared = Shared::new(grant("job", "id-1"), Instant::now() + TTL);
        assert!(shared.check());
        tokio::time::advance(TTL).await;
        assert!(!shared.check());
        assert!(shared.lost.is_cancelled());
        assert_eq!(*shared.status.borrow(), LeaseStatus::Lost(LostReason::Deadline));
        // Terminal: a late success changes nothing.
        shared.extend(Instant::now(), TTL);
        assert!(!shared.check());
    }

    /// Release stops the heartbeat and ends the lease; a stale release reports Gone.
    #[tokio::test(start_paused = true)]
    async fn release_stops_renewing_and_ends_the_lease() {
        let transport = Scripted::new(vec![]);
        let (lease, t0) = start(&transport, "id-1");
        let (lost, mut watch) = (lease.lost(), lease.watch());
        tokio::time::sleep(Duration::from_millis(400)).await;
        lease.release().await.unwrap();
        assert!(lost.is_cancelled());
        assert_eq!(*watch.borrow_and_update(), LeaseStatus::Released);
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert_eq!(transport.sent_ms(t0), vec![300], "no renewal after release");

        let (stale, _) = start(&transport, "id-2");
        assert!(matches!(stale.release().await, Err(LeaseError::Gone { .. })));
        assert_eq!(*transport.released.lock().unwrap(), vec!["id-1".to_owned(), "id-2".to_owned()]);
    }

    /// A release with no answer is sent again until it gets one, or until the lease would have
    /// expired anyway (then the lease is abandoned: fencegate lets it expire).
    #[tokio::test(start_paused = true)]
    async fn a_release_without_an_answer_is_retried_until_the_lease_would_expire() {
        let transport = Scripted::new(vec![]);
        let (flaky, _) = start(&transport, "id-flaky");
        flaky.release().await.unwrap();
        let attempts = |id: &str| transport.released.lock().unwrap().iter().filter(|x| *x == id).count();
        assert_eq!(attempts("id-flaky"), 3);
        let (down, t0) = start(&transport, "id-down");
        let watch = down.watch();
        assert!(matches!(down.release().await, Err(LeaseError::Timeout { .. })));
        assert_eq!(*watch.borrow(), LeaseStatus::Abandoned);
        let took = Instant::now() - t0;
        assert!(
            took <= Duration::from_secs(1) && attempts("id-down") > 3,
            "{took:?}, {} attempts",
            attempts("id-down")
        );
    }

    /// Dropping a lease stops its renewals and fires the signal.
    #[tokio::test(start_paused = true)]
    async fn dropping_abandons_the_lease() {
        let transport = Scripted::new(vec![]);
        let (lease, start) = start(&transport, "id-1");
        let (lost, watch) = (lease.lost(), lease.watch());
        drop(lease);
        assert!(lost.is_cancelled());
        assert_eq!(*watch.borrow(), LeaseStatus::Abandoned);
        tokio::time::sleep(Duration::from_millis(2000)).await;
        assert!(transport.sent_ms(start).is_empty());
    }

    #[test]
    fn options_keep_renewals_inside_the_ttl() {
        let timing = LeaseOptions::default().timing(Duration::from_secs(10)).unwrap();
        assert_eq!(timing.renew_every, Duration::from_secs(10) / 3);
        assert_eq!(timing.retry_every, Duration::from_secs(1));
        assert!(LeaseOptions::default().renew_every(Duration::from_secs(10)).timing(Duration::from_secs(10)).is_err());
        assert!(LeaseOptions::default().timing(Duration::ZERO).is_err());
        let tiny = LeaseOptions::default().timing(Duration::from_millis(30)).unwrap();
        assert_eq!(tiny.retry_every, RETRY_EVERY_MIN);
    }

    /// `lease_lost` and `heartbeat_latency` reach the installed recorder.
    #[tokio::test(start_paused = true)]
    async fn losses_and_heartbeats_are_measured() {
        let recorder = crate::metrics::tests::Recording::default();
        let _guard = ::metrics::set_default_local_recorder(&recorder);
        let transport = Scripted::new(vec![ok_after(40), err_after(20, LeaseError::Gone { fence: None })]);
        let (lease, _) = start(&transport, "id-1");
        lease.lost().cancelled().await;
        assert_eq!(recorder.counter("lease_lost"), 1);
        assert_eq!(recorder.histogram("heartbeat_latency"), vec![0.04, 0.02]);
        drop(lease);
        assert_eq!(recorder.counter("lease_lost"), 1, "a loss is counted once");
    }
}
