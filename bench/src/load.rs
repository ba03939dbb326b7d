//! The load driver: N keep-alive HTTP/1.1 connections (hyper's `client::conn::http1`), each
//! sending its next request as soon as the previous answer arrived, bounded by a duration and
//! a request count. Latency is recorded per request in an HDR histogram (microseconds).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::scenario::Source;

/// Highest latency the histograms record (longer ones are clamped to it): 60 s.
const LATENCY_US_MAX: u64 = 60_000_000;
/// Pause after a failed connect, so a dead target does not turn into a busy loop.
const RECONNECT_PAUSE: Duration = Duration::from_millis(20);

#[derive(Debug, Clone)]
pub struct Limits {
    pub connections: usize,
    pub duration: Duration,
    pub requests_max: u64,
    /// One request (send and read the whole response) at most; then it counts as an error.
    pub request_timeout: Duration,
}

/// What a run measured.
pub struct Report {
    pub completed: u64,
    pub errors: u64,
    pub elapsed: Duration,
    pub statuses: BTreeMap<u16, u64>,
    pub latency_us: Histogram<u64>,
    pub connects: u64,
}

impl Report {
    fn empty() -> Self {
        Self {
            completed: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            statuses: BTreeMap::new(),
            latency_us: new_histogram(),
            connects: 0,
        }
    }

    pub fn per_second(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 { self.completed as f64 / secs } else { 0.0 }
    }

    /// Latency at `quantile` (0..=1) in milliseconds.
    pub fn ms(&self, quantile: f64) -> f64 {
        self.latency_us.value_at_quantile(quantile) as f64 / 1000.0
    }

    /// `200×1234 409×5`, plus errors.
    pub fn statuses_text(&self) -> String {
        let mut parts: Vec<String> = self.statuses.iter().map(|(s, n)| format!("{s}×{n}")).collect();
        if self.errors > 0 {
            parts.push(format!("err×{}", self.errors));
        }
        parts.join(" ")
    }

    fn merge(&mut self, other: Report) {
        self.completed += other.completed;
        self.errors += other.errors;
        self.connects += other.connects;
        for (s, n) in other.statuses {
            *self.statuses.entry(s).or_default() += n;
        }
        self.latency_us.add(&other.latency_us).expect("histograms share their bounds");
    }
}

pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_US_MAX, 3).expect("static histogram bounds")
}

/// Runs `source` against `addr` within `limits`.
pub async fn run(addr: SocketAddr, source: Arc<dyn Source>, limits: &Limits) -> Report {
    let issued = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + limits.duration;
    let workers: Vec<_> = (0..limits.connections)
        .map(|conn| {
            let source = source.clone();
            let issued = issued.clone();
            let limits = limits.clone();
            tokio::spawn(async move { worker(addr, conn, source, issued, deadline, &limits).await })
        })
        .collect();
    let mut report = Report::empty();
    for w in workers {
        if let Ok(r) = w.await {
            report.merge(r);
        }
    }
    report.elapsed = started.elapsed();
    report
}

async fn worker(
    addr: SocketAddr,
    conn: usize,
    source: Arc<dyn Source>,
    issued: Arc<AtomicU64>,
    deadline: Instant,
    limits: &Limits,
) -> Report {
    let mut report = Report::empty();
    let mut sender: Option<SendRequest<Full<Bytes>>> = None;
    let mut i: u64 = 0;
    while Instant::now() < deadline {
        let Some(req) = source.request(conn, i) else {
            break;
        };
        if issued.fetch_add(1, Ordering::Relaxed) >= limits.requests_max {
            break;
        }
        i += 1;
        if sender.as_ref().is_none_or(|s| s.is_closed()) {
            match connect(addr).await {
                Ok(s) => {
                    report.connects += 1;
                    sender = Some(s);
                }
                Err(_) => {
                    report.errors += 1;
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                    continue;
                }
            }
        }
        let s = sender.as_mut().expect("connected above");
        let started = Instant::now();
        let outcome = tokio::time::timeout(limits.request_timeout, exchange(s, req)).await;
        match outcome {
            Ok(Ok((status, keep_alive))) => {
                let us = started.elapsed().as_micros() as u64;
                report.latency_us.saturating_record(us.max(1));
                report.completed += 1;
                *report.statuses.entry(status).or_default() += 1;
                if !keep_alive {
                    sender = None;
                }
            }
            _ => {
                report.errors += 1;
                sender = None;
            }
        }
    }
    report
}

async fn exchange(
    sender: &mut SendRequest<Full<Bytes>>,
    req: http::Request<Full<Bytes>>,
) -> anyhow::Result<(u16, bool)> {
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let keep_alive =
        !resp.headers().get(http::header::CONNECTION).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    resp.into_body().collect().await?;
    Ok((status, keep_alive))
}

pub async fn connect<B>(addr: SocketAddr) -> anyhow::Result<SendRequest<B>>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}
