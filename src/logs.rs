//! Logs an operator can read through an outage: a warning or an error repeated from one place
//! (one `warn!` of the code) is written at most [`BURST`] times per [`WINDOW`]; the rest are
//! counted, and one line per place and window tells how many were left out. A store outage
//! otherwise wrote the same line for every request that met it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// Lines written per place and window, at most.
pub const BURST: u32 = 5;
/// The window.
pub const WINDOW: Duration = Duration::from_secs(10);
/// The target of the lines that tell what was left out (never limited themselves).
pub const REPEATS_TARGET: &str = "fencegate::repeats";

/// The limit, as a layer of the subscriber: it decides before any other layer writes.
#[derive(Clone, Default)]
pub struct RepeatLimit {
    places: Arc<Mutex<HashMap<Identifier, Place>>>,
}

struct Place {
    /// `file:line`, or the target where the code has no location.
    at: String,
    since: Instant,
    written: u32,
    left_out: u64,
}

impl RepeatLimit {
    /// Tells, for each place, how many lines were left out since the last time, and starts
    /// their windows anew. Called every [`WINDOW`] by [`RepeatLimit::flush_every_window`].
    pub fn flush(&self) {
        let left: Vec<(String, u64)> = {
            let mut places = self.places.lock().expect("log limit lock");
            let now = Instant::now();
            let left = places.values().filter(|p| p.left_out > 0).map(|p| (p.at.clone(), p.left_out)).collect();
            places.retain(|_, p| now.duration_since(p.since) < WINDOW || p.left_out > 0);
            for place in places.values_mut() {
                if now.duration_since(place.since) >= WINDOW || place.left_out > 0 {
                    *place = Place { at: std::mem::take(&mut place.at), since: now, written: 0, left_out: 0 };
                }
            }
            left
        };
        for (at, count) in left {
            tracing::warn!(
                target: REPEATS_TARGET,
                at = %at,
                left_out = count,
                "the line logged at {at} repeated {count} more times in {} s: left out",
                WINDOW.as_secs()
            );
        }
    }

    /// Flushes every [`WINDOW`] on a thread of its own, for as long as the process runs.
    pub fn flush_every_window(&self) {
        let limit = self.clone();
        let spawned = std::thread::Builder::new().name("log-repeats".into()).spawn(move || {
            loop {
                std::thread::sleep(WINDOW);
                limit.flush();
            }
        });
        if let Err(error) = spawned {
            eprintln!("fencegate: repeated log lines will not be summed up: {error}");
        }
    }

    fn admits(&self, event: &Event<'_>) -> bool {
        let meta = event.metadata();
        if *meta.level() > Level::WARN || meta.target() == REPEATS_TARGET {
            return true;
        }
        let mut places = self.places.lock().expect("log limit lock");
        let now = Instant::now();
        let place = places.entry(meta.callsite()).or_insert_with(|| Place {
            at: match (meta.file(), meta.line()) {
                (Some(file), Some(line)) => format!("{file}:{line}"),
                _ => meta.target().to_owned(),
            },
            since: now,
            written: 0,
            left_out: 0,
        });
        if now.duration_since(place.since) >= WINDOW && place.left_out == 0 {
            place.since = now;
            place.written = 0;
        }
        if place.written < BURST {
            place.written += 1;
            true
        } else {
            place.left_out += 1;
            false
        }
    }
}

impl<S: Subscriber> Layer<S> for RepeatLimit {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        self.admits(event)
    }
}

/// An error and each of its causes, as one line (`cannot connect to the upstream: Connection
/// refused`).
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::prelude::*;

    /// An event that reached the end: its target, and its `left_out` field if it has one.
    type Line = (String, Option<u64>);

    /// The events that reach it.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<Line>>>);

    impl<S: Subscriber> Layer<S> for Seen {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            struct LeftOut(Option<u64>);
            impl tracing::field::Visit for LeftOut {
                fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
                    if field.name() == "left_out" {
                        self.0 = Some(value);
                    }
                }
                fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
            }
            let mut left = LeftOut(None);
            event.record(&mut left);
            self.0.lock().unwrap().push((event.metadata().target().to_owned(), left.0));
        }
    }

    #[test]
    fn a_repeated_warning_is_written_a_few_times_then_counted() {
        let (limit, seen) = (RepeatLimit::default(), Seen::default());
        let subscriber = tracing_subscriber::registry().with(limit.clone()).with(seen.clone());
        tracing::subscriber::with_default(subscriber, || {
            for n in 0..50 {
                tracing::warn!(n, "the store did not answer");
                tracing::info!(n, "an ordinary line");
            }
            tracing::error!("another place");
            limit.flush();
            tracing::warn!("the store did not answer, after the flush");
        });
        let seen = seen.0.lock().unwrap();
        let infos = seen.iter().filter(|(t, l)| t != REPEATS_TARGET && l.is_none()).count();
        assert_eq!(infos, 50 + BURST as usize + 1 + 1, "info lines pass; warnings up to the burst; each place its own");
        let summaries: Vec<u64> = seen.iter().filter(|(t, _)| t == REPEATS_TARGET).filter_map(|(_, l)| *l).collect();
        assert_eq!(summaries, vec![50 - u64::from(BURST)], "one line tells how many were left out");
        drop(seen);
        limit.flush();
    }
}
