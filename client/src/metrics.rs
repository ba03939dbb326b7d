//! The client's metrics, through the `metrics` facade: install any recorder (for example
//! `metrics-exporter-prometheus`) to export them. Every name is here, once.

use std::time::Duration;

/// Leases granted to this process.
pub const LEASE_ACQUIRED: &str = "lease_acquired";
/// Leases this process lost: a renewal was refused, or the local deadline passed.
pub const LEASE_LOST: &str = "lease_lost";
/// Round trip of each answered renewal, in seconds.
pub const HEARTBEAT_LATENCY: &str = "heartbeat_latency";

pub(crate) fn acquired() {
    metrics::counter!(LEASE_ACQUIRED).increment(1);
}

pub(crate) fn lost() {
    metrics::counter!(LEASE_LOST).increment(1);
}

pub(crate) fn heartbeat_latency(took: Duration) {
    metrics::histogram!(HEARTBEAT_LATENCY).record(took.as_secs_f64());
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    /// A recorder that keeps what it was given, for assertions.
    #[derive(Default)]
    pub(crate) struct Recording {
        counters: Mutex<HashMap<String, Arc<Count>>>,
        histograms: Mutex<HashMap<String, Arc<Samples>>>,
    }

    #[derive(Default)]
    struct Count(AtomicU64);

    impl CounterFn for Count {
        fn increment(&self, value: u64) {
            self.0.fetch_add(value, Ordering::Relaxed);
        }
        fn absolute(&self, value: u64) {
            self.0.fetch_max(value, Ordering::Relaxed);
        }
    }

    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    impl Recording {
        pub(crate) fn counter(&self, name: &str) -> u64 {
            self.counters.lock().unwrap().get(name).map_or(0, |c| c.0.load(Ordering::Relaxed))
        }

        pub(crate) fn histogram(&self, name: &str) -> Vec<f64> {
            self.histograms.lock().unwrap().get(name).map(|h| h.0.lock().unwrap().clone()).unwrap_or_default()
        }
    }

    impl Recorder for Recording {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let mut counters = self.counters.lock().unwrap();
            Counter::from_arc(counters.entry(key.name().to_owned()).or_default().clone())
        }

        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }

        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            let mut histograms = self.histograms.lock().unwrap();
            Histogram::from_arc(histograms.entry(key.name().to_owned()).or_default().clone())
        }
    }
}
