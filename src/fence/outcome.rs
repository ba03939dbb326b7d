//! A write is in flight until its upstream outcome is known (G3). The gate's [`Permit`] says
//! "this write may still commit at the upstream"; this module keeps it alive exactly that long,
//! whatever happens to the client or to the call, for both fronts (S3 and the API gateway):
//!
//! - [`detached`] runs a request's handling to its end: on the caller's task while the caller
//!   waits, in a task of its own from the moment a client disconnects (hyper drops the service
//!   future), so the client cannot drop the permit while the upstream may still commit the
//!   write;
//! - [`bounded_call`] bounds the whole write by one deadline, not each upstream call: at the
//!   deadline a body not yet fully sent is cut off (the upstream never sees it complete and
//!   commits nothing), while a call whose body was fully sent is never abandoned: it goes on in
//!   the background holding the permit until the upstream answers;
//! - a call that fails after its whole request may have reached the upstream (a connection
//!   reset, a timeout), and an answer that does not prove the write was not committed (500,
//!   502, 503, 504: S3 says such a write may have succeeded, and a load balancer's 502 or 504
//!   says nothing of its backend), have an unknown outcome: the permit is held for the in-flight
//!   deadline, the time fencegate assumes an upstream takes at most to commit a request it
//!   received (`docs/design.md`, section 3a), counted and logged as ambiguous.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Permit;
use crate::metrics;

/// Whether a failed upstream call may still have reached the upstream whole.
pub trait Delivery {
    /// `false` only when the request certainly never left fencegate (the connection could not
    /// be opened); any other failure after sending started may have been committed.
    fn maybe_delivered(&self) -> bool;
}

/// Whether an upstream's answer settles a write's outcome.
pub trait Answer {
    /// Why the write may still commit although the upstream answered, `None` when the answer
    /// settles it: a server error other than 501 (S3's own documentation says a 500 or 503
    /// write may have succeeded; a proxy's 502 or 504 says nothing of what its backend did), or
    /// a 202, which says the call was accepted to be performed later (RFC 9110, 15.3.3). A
    /// success that performed the call committed; a 4xx or 501 is given before acting, and a
    /// failed precondition commits nothing.
    fn unsettled(&self) -> Option<&'static str>;
}

impl<B> Answer for http::Response<B> {
    fn unsettled(&self) -> Option<&'static str> {
        match self.status() {
            http::StatusCode::ACCEPTED => Some("accepted"),
            http::StatusCode::NOT_IMPLEMENTED => None,
            status if status.is_server_error() && !crate::sim::seeded(crate::sim::Bug::ServerErrorSettles) => {
                Some("server_error")
            }
            _ => None,
        }
    }
}

/// What became of one upstream call of an admitted write.
#[derive(Debug)]
pub enum Bounded<T, E> {
    /// The call ended before the write's deadline.
    Done(Result<T, E>),
    /// The deadline passed before the whole body was sent: the body was cut off, the upstream
    /// commits nothing.
    CutOff,
    /// The deadline passed after the whole body was sent: the outcome is unknown. The call goes
    /// on in the background, holding the permit, until the upstream answers.
    Unknown,
}

/// Runs `future` to its end even if the caller is dropped (the client went away, and hyper
/// drops the service future), so the permits it holds are released only when the write's
/// outcome is known.
///
/// The future runs on the caller's task while the caller waits for it, and moves into a task
/// of its own only when the caller is dropped before it ended. The common write is then
/// handled without a task of its own and without the hand-off between workers that comes
/// with one: alternated twelve times each, 4 % more accepted writes per second and 7 % less
/// user CPU per write than spawning every write (docs/perf-log.md, "the signing proxy, and where
/// the gap really is").
///
/// The future comes boxed: a request's handler is a large state machine (kilobytes), and every
/// future that holds it inline is that much larger and copied whole at each move. Boxed where
/// it is made, it is copied once, and the caller's future and the task hold a pointer (the
/// copies showed as 7 % of fencegate's CPU under load).
pub fn detached<F>(future: Pin<Box<F>>) -> Detached<F>
where
    F: Future + Send + ?Sized + 'static,
    F::Output: Send + 'static,
{
    Detached { future: Some(future) }
}

/// The future [`detached`] returns: the write, run by whoever polls it, and handed to a task
/// of its own if dropped before it ended.
#[must_use = "a detached future does nothing unless awaited"]
pub struct Detached<F>
where
    F: Future + Send + ?Sized + 'static,
    F::Output: Send + 'static,
{
    /// `None` once the future ended.
    future: Option<Pin<Box<F>>>,
}

impl<F> Future for Detached<F>
where
    F: Future + Send + ?Sized + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let future = self.future.as_mut().expect("a detached future polled after it ended");
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        std::task::Poll::Ready(output)
    }
}

impl<F> Drop for Detached<F>
where
    F: Future + Send + ?Sized + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(future) = self.future.take() else { return };
        // A future that panicked is not resumed: it is dropped with its permits, as a task's
        // future is when it panics. Without a runtime (its shutdown drops every task anyway),
        // nothing could run it.
        if std::thread::panicking() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = future.await;
            });
        }
    }
}

/// One upstream call of the write that `permits` admitted (one permit per resource the call
/// writes; several only for a request whose body is in memory and marked sent), bounded by the
/// write's `deadline`. `hold` is how long the permits are kept after a call that may have
/// delivered its request failed (the in-flight deadline). The call must not be started before
/// this: a cancelled permit answers [`Bounded::CutOff`] without sending anything.
pub async fn bounded_call<T, E, F>(permits: &[Arc<Permit>], deadline: Instant, hold: Duration, call: F) -> Bounded<T, E>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Answer + Send + 'static,
    E: Delivery + std::fmt::Display + Send + 'static,
{
    let Some(permit) = permits.first() else { return Bounded::Done(call.await) };
    let permits: Vec<Arc<Permit>> = permits.to_vec();
    if Instant::now() >= deadline {
        // No call of a write starts past its deadline (a retry, say): nothing is sent.
        permit.cut_off_if_unsent();
        return Bounded::CutOff;
    }
    if permit.cancellation().is_cancelled() {
        return Bounded::CutOff;
    }
    let mut call = Box::pin(call);
    let result = tokio::select! {
        // An answer at the deadline itself is an answer (and a simulation replays exactly).
        biased;
        result = &mut call => Some(result),
        () = tokio::time::sleep_until(deadline) => None,
    };
    match result {
        Some(result) => {
            hold_unless_settled(permits, &result, hold);
            Bounded::Done(result)
        }
        None if permit.cut_off_if_unsent() => {
            // The body errors at its next poll and can never be completed (a cancelled permit
            // refuses the last chunk, and a released one cannot be upgraded by the body), so
            // the permits go now; the call ends on its own, in the background if it is slow.
            drop(permits);
            let _ = tokio::time::timeout(CUT_OFF_GRACE, tokio::spawn(call)).await;
            Bounded::CutOff
        }
        None => {
            metrics::ambiguous_outcome("deadline");
            tracing::warn!(
                token = permit.token().0,
                "the upstream has not answered by the write's deadline; its outcome is unknown and the write stays \
                 in flight until it answers"
            );
            tokio::spawn(async move {
                // An upstream commits a request it received within `hold` or never (the design's
                // one assumption): past that, the call is given up and the write released.
                match tokio::time::timeout(hold, call).await {
                    Ok(result) => {
                        tracing::info!(token = permits[0].token().0, "late upstream answer to an unknown outcome");
                        hold_unless_settled(permits, &result, hold);
                    }
                    Err(_) => {
                        metrics::ambiguous_outcome("abandoned");
                        tracing::warn!(
                            token = permits[0].token().0,
                            "the upstream did not answer within the in-flight deadline after the write's deadline; \
                             the call is given up and the write released"
                        );
                    }
                }
            });
            Bounded::Unknown
        }
    }
}

/// How long a cut-off call may take to end before the client is answered anyway.
const CUT_OFF_GRACE: Duration = Duration::from_secs(1);

/// Keeps `permits` for `hold` after a call whose request may have reached the upstream whole
/// and whose end does not say whether it committed: a failure after sending, or an answer
/// that settles nothing (a 5xx).
fn hold_unless_settled<T: Answer, E: Delivery + std::fmt::Display>(
    permits: Vec<Arc<Permit>>,
    result: &Result<T, E>,
    hold: Duration,
) {
    let Some(permit) = permits.first() else { return };
    if !permit.body_sent() {
        return;
    }
    let hold_ms = u64::try_from(hold.as_millis()).unwrap_or(u64::MAX);
    match result {
        Err(error) if !error.maybe_delivered() => return,
        Ok(answer) => {
            let Some(cause) = answer.unsettled() else { return };
            metrics::ambiguous_outcome(cause);
            tracing::warn!(
                token = permit.token().0,
                hold_ms,
                cause,
                "the upstream's answer to a write does not say it was performed (a server error, or 202 Accepted): \
                 outcome unknown, the write stays in flight"
            );
        }
        Err(error) => {
            metrics::ambiguous_outcome("failed_after_send");
            tracing::warn!(
                %error,
                token = permit.token().0,
                hold_ms,
                "upstream call failed after the whole request was sent: outcome unknown, the write stays in flight"
            );
        }
    }
    hold_for(permits, hold);
}

/// Keeps `permits` (the write stays in flight) for `hold`, in the background.
pub fn hold_for(permits: Vec<Arc<Permit>>, hold: Duration) {
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        drop(permits);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::{AdmitError, FenceToken, Gate, GateLimits, ResourceKey};
    use crate::store::MemoryStore;

    #[derive(Debug)]
    struct Failed {
        delivered: bool,
    }

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "failed (delivered: {})", self.delivered)
        }
    }

    impl Delivery for Failed {
        fn maybe_delivered(&self) -> bool {
            self.delivered
        }
    }

    /// A call that answers nothing but its success.
    impl Answer for () {
        fn unsettled(&self) -> Option<&'static str> {
            None
        }
    }

    const DEADLINE: Duration = Duration::from_secs(10);

    fn gate() -> Arc<Gate> {
        let limits = GateLimits { inflight_deadline: DEADLINE, ..GateLimits::default() };
        Arc::new(Gate::new(Arc::new(MemoryStore::default()), limits))
    }

    fn key() -> ResourceKey {
        ResourceKey::new("job:outcome").unwrap()
    }

    /// Whether a write with `token` is admitted within `within`.
    async fn admitted_within(gate: &Arc<Gate>, token: u64, within: Duration) -> bool {
        match tokio::time::timeout(within, gate.admit(&key(), FenceToken(token))).await {
            Ok(Ok(_)) => true,
            Ok(Err(AdmitError::DrainTimeout { .. })) | Err(_) => false,
            Ok(Err(other)) => panic!("unexpected refusal: {other}"),
        }
    }

    /// The client disconnects while the upstream holds a write whose body it received: the
    /// write stays in flight, and a newer token waits until the upstream answered.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_leaves_does_not_end_the_write() {
        let gate = gate();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<()>();
        let handler = {
            let gate = gate.clone();
            async move {
                let permit = Arc::new(gate.admit(&key(), FenceToken(5)).await.unwrap());
                assert!(permit.mark_body_sent());
                let call = async move {
                    let _ = answer_rx.await; // the upstream commits when told
                    Ok::<_, Failed>(())
                };
                bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(60), DEADLINE, call)
                    .await
            }
        };
        let client = tokio::spawn(detached(Box::pin(handler)));
        tokio::time::sleep(Duration::from_millis(10)).await;
        client.abort(); // hyper drops the service future when the client disconnects
        let _ = client.await;
        assert!(!admitted_within(&gate, 6, Duration::from_secs(1)).await, "token 6 admitted while 5 may commit");
        answer_tx.send(()).unwrap();
        assert!(admitted_within(&gate, 6, Duration::from_secs(1)).await);
    }

    /// At the deadline, a write whose body was fully sent is not abandoned: the call goes on in
    /// the background and the write stays in flight until the upstream answers, or for the
    /// in-flight deadline at most (then the upstream can no longer commit it, by assumption).
    #[tokio::test(start_paused = true)]
    async fn a_sent_write_outlives_its_deadline_until_the_upstream_answers() {
        let gate = gate();
        let permit = Arc::new(gate.admit(&key(), FenceToken(5)).await.unwrap());
        assert!(permit.mark_body_sent());
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<()>();
        let call = async move {
            let _ = answer_rx.await;
            Ok::<_, Failed>(())
        };
        let outcome =
            bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(1), DEADLINE, call).await;
        assert!(matches!(outcome, Bounded::Unknown));
        drop(permit);
        assert!(!admitted_within(&gate, 6, Duration::from_secs(3)).await);
        answer_tx.send(()).unwrap();
        assert!(admitted_within(&gate, 6, Duration::from_secs(1)).await);
    }

    /// At the deadline, a write whose body is still streaming is cut off: nothing commits, and
    /// the write ends with its call.
    #[tokio::test(start_paused = true)]
    async fn an_unsent_write_is_cut_off_at_its_deadline() {
        let gate = gate();
        let permit = Arc::new(gate.admit(&key(), FenceToken(5)).await.unwrap());
        let cancelled = permit.cancellation().clone();
        let call = async move {
            cancelled.cancelled().await; // the body stream errors when cancelled
            Err::<(), _>(Failed { delivered: true })
        };
        let outcome =
            bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(1), DEADLINE, call).await;
        assert!(matches!(outcome, Bounded::CutOff));
        assert!(!permit.mark_body_sent(), "a cut-off write must not finish its body");
        drop(permit);
        assert!(admitted_within(&gate, 6, Duration::from_millis(10)).await);
    }

    /// A call that failed after its whole request was sent (a reset, a timeout) may still
    /// commit: the write stays in flight for the in-flight deadline. One that never connected
    /// ends at once.
    #[tokio::test(start_paused = true)]
    async fn a_failure_after_sending_keeps_the_write_in_flight() {
        let gate = gate();
        let permit = Arc::new(gate.admit(&key(), FenceToken(5)).await.unwrap());
        assert!(permit.mark_body_sent());
        let call = async { Err::<(), _>(Failed { delivered: true }) };
        let outcome =
            bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(60), DEADLINE, call).await;
        assert!(matches!(outcome, Bounded::Done(Err(_))));
        drop(permit);
        assert!(!admitted_within(&gate, 6, DEADLINE / 2).await);
        assert!(admitted_within(&gate, 6, DEADLINE).await);

        let permit = Arc::new(gate.admit(&key(), FenceToken(6)).await.unwrap());
        assert!(permit.mark_body_sent());
        let call = async { Err::<(), _>(Failed { delivered: false }) };
        let outcome =
            bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(60), DEADLINE, call).await;
        assert!(matches!(outcome, Bounded::Done(Err(_))));
        drop(permit);
        assert!(admitted_within(&gate, 7, Duration::from_millis(10)).await);
    }

    /// An upstream that answers a sent write with 500, 502, 503 or 504 may still commit it (S3
    /// says so of its own 500 and 503; a load balancer's 502 or 504 says nothing of its
    /// backend): the write stays in flight for the in-flight deadline, as after a reset. A
    /// 4xx, a 501 and a success settle it at once.
    #[tokio::test(start_paused = true)]
    async fn a_server_error_keeps_the_write_in_flight() {
        let gate = gate();
        let mut token = 5;
        for status in [500, 502, 503, 504] {
            let permit = Arc::new(gate.admit(&key(), FenceToken(token)).await.unwrap());
            assert!(permit.mark_body_sent());
            let answer = http::Response::builder().status(status).body(()).unwrap();
            let call = async move { Ok::<_, Failed>(answer) };
            let outcome =
                bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(60), DEADLINE, call)
                    .await;
            assert!(matches!(outcome, Bounded::Done(Ok(_))));
            drop(permit);
            let waited = Instant::now();
            assert!(!admitted_within(&gate, token + 1, DEADLINE - Duration::from_millis(5)).await, "{status}");
            assert!(admitted_within(&gate, token + 1, DEADLINE).await, "{status}");
            assert!(waited.elapsed() >= DEADLINE, "{status}: held for the whole in-flight deadline");
            token += 2;
        }
        for status in [200, 404, 412, 501] {
            let permit = Arc::new(gate.admit(&key(), FenceToken(token)).await.unwrap());
            assert!(permit.mark_body_sent());
            let answer = http::Response::builder().status(status).body(()).unwrap();
            let call = async move { Ok::<_, Failed>(answer) };
            let deadline = Instant::now() + Duration::from_secs(60);
            let outcome = bounded_call(std::slice::from_ref(&permit), deadline, DEADLINE, call).await;
            assert!(matches!(outcome, Bounded::Done(Ok(_))));
            drop(permit);
            assert!(admitted_within(&gate, token + 1, Duration::from_millis(10)).await, "{status} settles the write");
            token += 2;
        }
    }

    /// A 5xx answered late, after the write's deadline, holds the write the in-flight deadline
    /// from that answer.
    #[tokio::test(start_paused = true)]
    async fn a_late_server_error_holds_the_write_from_its_answer() {
        let gate = gate();
        let permit = Arc::new(gate.admit(&key(), FenceToken(5)).await.unwrap());
        assert!(permit.mark_body_sent());
        let call = async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<_, Failed>(http::Response::builder().status(503).body(()).unwrap())
        };
        let outcome =
            bounded_call(std::slice::from_ref(&permit), Instant::now() + Duration::from_secs(1), DEADLINE, call).await;
        assert!(matches!(outcome, Bounded::Unknown));
        drop(permit);
        // Answered at 2 s: held until 2 s + D.
        assert!(!admitted_within(&gate, 6, DEADLINE + Duration::from_millis(500)).await);
        assert!(admitted_within(&gate, 6, Duration::from_secs(2)).await);
    }
}
