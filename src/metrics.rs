//! Prometheus metrics. Every metric fencegate exports is named here, once.

use std::cell::RefCell;
use std::sync::OnceLock;
use std::thread::LocalKey;
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Latency buckets in seconds: 50 µs to 10 s.
const LATENCY_BUCKETS_S: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// Installs the process-wide recorder (once) and returns the handle that renders it.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS_S)
                .expect("static buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (tests embedding several servers);
            // then this handle renders an empty set, which is still valid output.
            if metrics::set_global_recorder(recorder).is_ok() {
                describe_and_register();
            }
            handle
        })
        .clone()
}

/// Every metric's `# HELP`, and the ones a dashboard or an alert reads from start-up (a counter
/// that appears only once it moved cannot be told apart from a missing scrape).
fn describe_and_register() {
    let counters: &[(&'static str, &'static str)] = &[
        ("fencegate_decisions_total", "Decisions on writes, by outcome"),
        ("fencegate_advances_total", "Fences raised by writes"),
        ("fencegate_inflight_cancelled_total", "Older writes still streaming cut off by a newer token"),
        ("fencegate_store_errors_total", "Fence store calls that failed or timed out"),
        ("fencegate_upstream_errors_total", "Upstream calls without an answer or answered 5xx, by operation"),
        ("fencegate_ambiguous_outcomes_total", "Writes whose upstream outcome could not be known, by operation"),
        ("fencegate_precondition_conflicts_total", "Conditional writes the upstream refused, by result"),
        ("fencegate_body_aborted_total", "Request bodies rejected while streaming, by reason"),
        ("fencegate_lease_events_total", "Lease service events"),
        ("fencegate_lease_reads_refused_total", "Reads signed with a lease credential whose lease lapsed"),
        (
            "fencegate_stale_uploads_aborted_total",
            "Multipart uploads of superseded tokens aborted, by who: their creator, or fencegate after the delay",
        ),
        ("fencegate_registrations_revoked_total", "Registrations of in-flight writes a replica could not keep"),
        ("fencegate_store_rollbacks_repaired_total", "Times a shared store was found below this replica's mark"),
        (
            "fencegate_store_state_lost_total",
            "Times a shared store's epoch mark changed under this replica (it lost its state)",
        ),
        (
            "fencegate_idempotency_records_full_total",
            "Idempotency claims refused: the records are at store.idempotency_records_max or its bytes",
        ),
        ("fencegate_store_wait_failures_total", "Changes fewer Redis replicas confirmed than store.wait_replicas"),
        (
            "fencegate_records_refused_total",
            "Records kept for a caller (kind) refused by a bound (store.upload_records_*, Redis's memory)",
        ),
        ("fencegate_uploads_expired_total", "Uploads aborted by fencegate at fencing.abort_uploads_after_ms"),
        ("fencegate_gateway_requests_total", "Requests through the HTTP API gateway, by mode and outcome"),
        ("fencegate_idempotency_record_errors_total", "Idempotency records that could not be written"),
        (
            "fencegate_s3_protocol_refusals_total",
            "S3 requests refused before fencegate saw them (signature, parse), by status",
        ),
    ];
    for (name, help) in counters {
        describe_counter!(*name, *help);
    }
    describe_gauge!("fencegate_inflight_writes", "Admitted writes not finished yet");
    describe_histogram!("fencegate_drain_wait_seconds", "Time a newer token waited for older in-flight writes");
    describe_histogram!("fencegate_store_latency_seconds", "Fence store call latency");
    describe_histogram!("fencegate_upstream_latency_seconds", "Upstream call latency, by operation");
    for outcome in ["accepted", "stale", "missing_token", "invalid_token", "unregistered", "store_unavailable"] {
        counter!("fencegate_decisions_total", "outcome" => outcome).absolute(0);
    }
    for name in [
        "fencegate_advances_total",
        "fencegate_inflight_cancelled_total",
        "fencegate_registrations_revoked_total",
        "fencegate_store_rollbacks_repaired_total",
        "fencegate_store_state_lost_total",
        "fencegate_store_wait_failures_total",
    ] {
        counter!(name).absolute(0);
    }
    for name in [
        "fencegate_lease_reads_refused_total",
        "fencegate_idempotency_records_full_total",
        "fencegate_idempotency_record_errors_total",
        "fencegate_uploads_expired_total",
    ] {
        counter!(name).absolute(0);
    }
    // The labelled ones, with every value fencegate gives them (the operations of the upstream
    // errors: the fenced writes'; of the gateway: its modes and what alerts read).
    let labelled: &[(&'static str, &'static str, &[&'static str])] = &[
        ("fencegate_stale_uploads_aborted_total", "by", &["creator", "fencegate"]),
        (
            "fencegate_ambiguous_outcomes_total",
            "op",
            &["deadline", "abandoned", "server_error", "accepted", "failed_after_send", "response_body", "api"],
        ),
        ("fencegate_precondition_conflicts_total", "result", &["retried", "stale", "gave_up", "api_refused"]),
        ("fencegate_body_aborted_total", "reason", &["cancelled", "checksum", "client", "too_large"]),
        (
            "fencegate_lease_events_total",
            "event",
            &[
                "granted",
                "renewed",
                "released",
                "gone",
                "credentials_issued",
                "grant_withdrawn",
                "grant_withdrawal_capped",
            ],
        ),
        (
            "fencegate_upstream_errors_total",
            "op",
            &["put_object", "copy_object", "delete_object", "complete_multipart", "fenced_write"],
        ),
        ("fencegate_s3_protocol_refusals_total", "status", &["400", "403"]),
    ];
    // Idempotency claims the embedded store refuses are `fencegate_idempotency_records_full_total`.
    for bound in ["per_caller", "per_resource", "count", "bytes", "memory"] {
        counter!("fencegate_records_refused_total", "kind" => "upload", "bound" => bound).absolute(0);
    }
    counter!("fencegate_records_refused_total", "kind" => "idempotency", "bound" => "memory").absolute(0);
    for (name, label, values) in labelled {
        for value in *values {
            counter!(*name, *label => *value).absolute(0);
        }
    }
    for mode in ["idempotency-key", "conditional", "fence-only"] {
        for outcome in ["forwarded", "refused", "outcome_unknown"] {
            counter!("fencegate_gateway_requests_total", "mode" => mode, "outcome" => outcome).absolute(0);
        }
    }
    gauge!("fencegate_inflight_writes").set(0.0);
}

/// The counters of the fence store's kind, at 0 from start-up (the kind is known once the
/// config is).
pub fn register_store(kind: &'static str) {
    counter!("fencegate_store_errors_total", "store" => kind).absolute(0);
}

/// The handles of the metrics recorded on every request, per thread and per (name, label
/// value). The `metrics` macros look their metric up in the recorder on every call (a key
/// built, its labels allocated, a sharded map searched): a fifth of the allocations of an
/// accepted write. A handle is the metric itself, so a cached one records the same.
type Handles<H> = RefCell<Vec<(&'static str, &'static str, H)>>;

thread_local! {
    static COUNTERS: Handles<Counter> = const { RefCell::new(Vec::new()) };
    static GAUGES: Handles<Gauge> = const { RefCell::new(Vec::new()) };
    static HISTOGRAMS: Handles<Histogram> = const { RefCell::new(Vec::new()) };
}

/// The handle of metric `name` with label value `value` (`""` for none), made by `make` the
/// first time on this thread. Only once the recorder is installed: a handle made before is
/// a no-op one, and would stay one. On a thread whose locals are being destroyed (a permit
/// dropped by another thread-local's destructor) the handle is made without the cache.
fn cached<H: Clone>(
    handles: &'static LocalKey<Handles<H>>,
    name: &'static str,
    value: &'static str,
    make: impl Fn() -> H,
) -> H {
    if HANDLE.get().is_none() {
        return make();
    }
    let cached = handles.try_with(|cell| {
        let mut handles = cell.try_borrow_mut().ok()?;
        if let Some((_, _, handle)) = handles.iter().find(|(n, v, _)| *n == name && *v == value) {
            return Some(handle.clone());
        }
        let handle = make();
        handles.push((name, value, handle.clone()));
        Some(handle)
    });
    cached.ok().flatten().unwrap_or_else(make)
}

/// An S3 request the S3 library refused before fencegate's handler saw it (a bad signature,
/// an unknown access key, a request it cannot parse), by HTTP status.
pub fn s3_protocol_refusal(status: u16) {
    counter!("fencegate_s3_protocol_refusals_total", "status" => status.to_string()).increment(1);
}

/// A decision on a write: `accepted`, `advanced`, `stale`, `missing_token`, `invalid_token`,
/// `unchecked` (no token, `require_token = false`), `store_unavailable`, `drain_timeout`.
pub fn decision(outcome: &'static str) {
    const NAME: &str = "fencegate_decisions_total";
    cached(&COUNTERS, NAME, outcome, || counter!(NAME, "outcome" => outcome)).increment(1);
}

pub fn advanced() {
    const NAME: &str = "fencegate_advances_total";
    cached(&COUNTERS, NAME, "", || counter!(NAME)).increment(1);
}

pub fn inflight_changed(delta: i32) {
    const NAME: &str = "fencegate_inflight_writes";
    cached(&GAUGES, NAME, "", || gauge!(NAME)).increment(f64::from(delta));
}

pub fn inflight_cancelled() {
    counter!("fencegate_inflight_cancelled_total").increment(1);
}

/// Time a newer token waited for older in-flight writes on its resource.
pub fn drain_wait(waited: Duration) {
    histogram!("fencegate_drain_wait_seconds").record(waited.as_secs_f64());
}

pub fn store_call(store: &'static str, took: Duration, ok: bool) {
    const NAME: &str = "fencegate_store_latency_seconds";
    cached(&HISTOGRAMS, NAME, store, || histogram!(NAME, "store" => store)).record(took.as_secs_f64());
    if !ok {
        counter!("fencegate_store_errors_total", "store" => store).increment(1);
    }
}

pub fn upstream_call(op: &'static str, took: Duration, status: Option<u16>) {
    const NAME: &str = "fencegate_upstream_latency_seconds";
    cached(&HISTOGRAMS, NAME, op, || histogram!(NAME, "op" => op)).record(took.as_secs_f64());
    match status {
        Some(s) if s < 500 => {}
        _ => counter!("fencegate_upstream_errors_total", "op" => op).increment(1),
    }
}

/// A write whose upstream outcome could not be known (the connection broke after the body
/// was sent).
pub fn ambiguous_outcome(op: &'static str) {
    counter!("fencegate_ambiguous_outcomes_total", "op" => op).increment(1);
}

/// The upstream refused a conditional write (412/409): `stale`, `retried` or `gave_up`.
pub fn precondition_conflict(result: &'static str) {
    counter!("fencegate_precondition_conflicts_total", "result" => result).increment(1);
}

/// A body rejected while streaming: `checksum`, `cancelled`, `client`.
pub fn body_aborted(reason: &'static str) {
    counter!("fencegate_body_aborted_total", "reason" => reason).increment(1);
}

/// A lease service event: `granted`, `renewed`, `released`, `gone` (a renewal or release of a
/// lease that is not live any more, i.e. a holder that lost its lease).
/// A read signed with a lease credential whose lease lapsed (403 `ExpiredToken`).
pub fn lease_read_refused() {
    counter!("fencegate_lease_reads_refused_total").increment(1);
}

/// A multipart upload of a superseded token aborted, `by` its creator or by fencegate's sweep.
pub fn stale_upload_aborted(by: &'static str) {
    counter!("fencegate_stale_uploads_aborted_total", "by" => by).increment(1);
}

pub fn lease_event(event: &'static str) {
    counter!("fencegate_lease_events_total", "event" => event).increment(1);
}

/// A shared fence store answered lower than this replica had seen, and was raised back.
/// A replica could not keep a registration of its writes in the shared store and stopped them.
pub fn registration_revoked() {
    counter!("fencegate_registrations_revoked_total").increment(1);
}

pub fn store_rollback_repaired() {
    counter!("fencegate_store_rollbacks_repaired_total").increment(1);
}

/// A shared store's epoch mark changed under this replica: it lost its state.
pub fn store_state_lost() {
    counter!("fencegate_store_state_lost_total").increment(1);
}

/// A record fencegate would keep for a caller, refused by a bound (`kind`: `upload`, or
/// `idempotency` on Redis; `bound`: `per_caller`, `per_resource`, `count`, `bytes`, `memory`).
pub fn records_refused(kind: &'static str, bound: &'static str) {
    counter!("fencegate_records_refused_total", "kind" => kind, "bound" => bound).increment(1);
}

/// An upload aborted by fencegate because it stayed incomplete `fencing.abort_uploads_after_ms`.
pub fn upload_expired() {
    counter!("fencegate_uploads_expired_total").increment(1);
}

/// An idempotency claim refused: the records are at `store.idempotency_records_max` (or
/// `store.idempotency_records_bytes_max`, or Redis's memory share), and none is dropped before
/// its retention ends.
pub fn idempotency_records_full() {
    counter!("fencegate_idempotency_records_full_total").increment(1);
}

/// A change fewer Redis replicas confirmed than `store.wait_replicas` asks (it failed closed).
pub fn store_wait_failed() {
    counter!("fencegate_store_wait_failures_total").increment(1);
}

/// A request through the HTTP API gateway, by route mode (`idempotency-key`, `conditional`,
/// `fence-only`) and outcome: `forwarded`, `read`, `unchecked`, `replayed`, `in_flight`,
/// `key_reused`, `outcome_unknown`, `not_retained`, `precondition_failed`, `refused`.
pub fn gateway_request(mode: &'static str, outcome: &'static str) {
    counter!("fencegate_gateway_requests_total", "mode" => mode, "outcome" => outcome).increment(1);
}

/// An idempotency record could not be written after the API answered: until its deadline a
/// retry gets 409, then the outcome is reported as unknown.
pub fn idempotency_record_failed() {
    counter!("fencegate_idempotency_record_errors_total").increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A permit dropped by another thread-local's destructor records a metric after this
    /// thread's handle cache is gone: the handle is made without it (using the cache there
    /// panics, and a panic in a thread-local destructor aborts the process).
    #[test]
    fn a_metric_recorded_while_thread_locals_are_destroyed_is_recorded() {
        struct RecordsOnDrop;
        impl Drop for RecordsOnDrop {
            fn drop(&mut self) {
                advanced();
            }
        }
        thread_local! {
            static LATE: RefCell<Option<RecordsOnDrop>> = const { RefCell::new(None) };
        }
        install();
        std::thread::spawn(|| {
            // Registered before the cache, so destroyed after it.
            LATE.with(|late| *late.borrow_mut() = Some(RecordsOnDrop));
            advanced();
            assert!(COUNTERS.with(|c| !c.borrow().is_empty()), "the handle is cached");
        })
        .join()
        .expect("the thread ends normally");
    }
}
