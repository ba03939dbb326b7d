//! Large bodies: stale 64 MiB uploads (with and without `Expect: 100-continue`), and one
//! 1 GiB object streamed through while the proxy's memory is sampled.
//!
//! The stale uploads are written on raw TCP rather than through hyper's client, which does not
//! wait for `100 Continue`: the point is to see exactly how many body bytes leave the client
//! before the answer arrives. All requests share one `Bytes` of the body; nothing is copied.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::load::new_histogram;
use crate::procs;
use crate::scenario::Plan;

/// Body bytes written per `write` call.
const WRITE_CHUNK_BYTES: usize = 64 * 1024;
/// Like curl: after this long without an interim answer, send the body anyway.
const EXPECT_WAIT: Duration = Duration::from_secs(1);
/// Largest response head accepted.
const RESPONSE_HEAD_BYTES_MAX: usize = 64 * 1024;
/// How often the proxy's RSS is sampled while a large object streams.
const RSS_SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// What the stale large uploads measured.
pub struct LargeReport {
    pub requests: u64,
    pub statuses: std::collections::BTreeMap<u16, u64>,
    /// Connections that ended (reset, closed) before a final response arrived.
    pub no_response: u64,
    pub latency_us: Histogram<u64>,
    /// Body bytes the client managed to write before the final answer (kernel buffers
    /// included: an upper bound of what the server read).
    pub body_bytes_sent_max: u64,
    pub body_bytes_sent_total: u64,
    /// Bytes the server process read per upload, request head included, traced with strace
    /// over a few extra uploads after the timed ones (tracing slows the server, so those are
    /// not timed).
    pub server_read_per_request: Option<f64>,
    pub elapsed: Duration,
}

/// Uploads traced with strace to count what the server read.
const TRACED_UPLOADS: u64 = 5;

/// Sends `plan` (a PUT whose signed head announces `body.len()` bytes) `requests` times, one
/// at a time on a fresh connection, within `duration`.
pub async fn stale_uploads(
    addr: SocketAddr,
    plan: &Plan,
    body: Bytes,
    expect_continue: bool,
    requests: u64,
    duration: Duration,
    server_pid: Option<u32>,
) -> anyhow::Result<LargeReport> {
    let head = request_head(plan, body.len() as u64, expect_continue);
    let started = Instant::now();
    let mut report = LargeReport {
        requests: 0,
        statuses: Default::default(),
        no_response: 0,
        latency_us: new_histogram(),
        body_bytes_sent_max: 0,
        body_bytes_sent_total: 0,
        server_read_per_request: None,
        elapsed: Duration::ZERO,
    };
    while report.requests < requests && started.elapsed() < duration {
        let one = tokio::time::timeout(Duration::from_secs(30), one_upload(addr, &head, body.clone(), expect_continue))
            .await
            .unwrap_or(Ok(Upload { status: None, body_bytes_sent: 0, took: Duration::from_secs(30) }))?;
        report.requests += 1;
        report.latency_us.saturating_record((one.took.as_micros() as u64).max(1));
        report.body_bytes_sent_max = report.body_bytes_sent_max.max(one.body_bytes_sent);
        report.body_bytes_sent_total += one.body_bytes_sent;
        match one.status {
            Some(s) => *report.statuses.entry(s).or_default() += 1,
            None => report.no_response += 1,
        }
    }
    report.elapsed = started.elapsed();
    if let Some(pid) = server_pid {
        let output = std::env::temp_dir().join(format!("fencegate-bench-strace-{pid}.txt"));
        if let Some(strace) = procs::Strace::attach(pid, output.clone())? {
            for _ in 0..TRACED_UPLOADS {
                let _ = tokio::time::timeout(
                    Duration::from_secs(30),
                    one_upload(addr, &head, body.clone(), expect_continue),
                )
                .await;
            }
            let bytes = strace.finish()?;
            let _ = std::fs::remove_file(output);
            report.server_read_per_request = Some(bytes as f64 / TRACED_UPLOADS as f64);
        }
    }
    Ok(report)
}

fn request_head(plan: &Plan, content_length: u64, expect_continue: bool) -> Bytes {
    let mut head = format!("{} {} HTTP/1.1\r\n", plan.method, plan.path);
    for (name, value) in &plan.headers {
        if *name == http::header::CONTENT_LENGTH {
            continue;
        }
        head.push_str(&format!("{}: {}\r\n", name, value.to_str().unwrap_or_default()));
    }
    head.push_str(&format!("content-length: {content_length}\r\n"));
    if expect_continue {
        head.push_str("expect: 100-continue\r\n");
    }
    head.push_str("\r\n");
    Bytes::from(head)
}

struct Upload {
    /// The final status, if one arrived.
    status: Option<u16>,
    body_bytes_sent: u64,
    /// From connect to the final response head.
    took: Duration,
}

async fn one_upload(addr: SocketAddr, head: &Bytes, body: Bytes, expect_continue: bool) -> anyhow::Result<Upload> {
    let started = Instant::now();
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    writer.write_all(head).await?;

    let sent = Arc::new(AtomicU64::new(0));
    let go = Arc::new(tokio::sync::Notify::new());
    let stop = Arc::new(AtomicBool::new(false));
    let body_task = {
        let (sent, go, stop) = (sent.clone(), go.clone(), stop.clone());
        tokio::spawn(async move {
            if expect_continue {
                // Wait for `100 Continue`, or for the curl-like timeout.
                let _ = tokio::time::timeout(EXPECT_WAIT, go.notified()).await;
            }
            for chunk in body.chunks(WRITE_CHUNK_BYTES) {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                if writer.write_all(chunk).await.is_err() {
                    break;
                }
                sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            writer
        })
    };
    let mut buf = Vec::with_capacity(4096);
    let status = loop {
        match read_head(&mut reader, &mut buf).await {
            Ok(Some(100)) => {
                go.notify_one();
                continue;
            }
            Ok(Some(s)) => break Some(s),
            Ok(None) | Err(_) => break None,
        }
    };
    let took = started.elapsed();
    stop.store(true, Ordering::Release);
    body_task.abort();
    let _ = body_task.await;
    Ok(Upload { status, body_bytes_sent: sent.load(Ordering::Relaxed), took })
}

/// Reads one response head (status line and headers) and returns its status; leftover bytes
/// stay in `buf`. `None` when the connection ended first.
async fn read_head(reader: &mut tokio::net::tcp::OwnedReadHalf, buf: &mut Vec<u8>) -> anyhow::Result<Option<u16>> {
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
            return Ok(status);
        }
        if buf.len() > RESPONSE_HEAD_BYTES_MAX {
            anyhow::bail!("response head larger than {RESPONSE_HEAD_BYTES_MAX} bytes");
        }
        let mut chunk = [0u8; 4096];
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// What streaming one large object measured.
pub struct StreamReport {
    pub status: u16,
    pub bytes: u64,
    pub elapsed: Duration,
    /// RSS of the sampled process before the transfer (kB).
    pub idle_kb: u64,
    /// Highest RSS sampled during the transfer (kB).
    pub sampled_peak_kb: u64,
    /// The kernel's peak (`VmHWM`), reset just before the transfer when possible (kB).
    pub hwm_kb: u64,
    pub hwm_was_reset: bool,
}

impl StreamReport {
    pub fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / (1024.0 * 1024.0) / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Peak above idle, in MiB: the larger of the sampled peak and the kernel's.
    pub fn peak_above_idle_mib(&self) -> f64 {
        let peak = if self.hwm_was_reset { self.sampled_peak_kb.max(self.hwm_kb) } else { self.sampled_peak_kb };
        peak.saturating_sub(self.idle_kb) as f64 / 1024.0
    }
}

type StreamBodyBox = BoxBody<Bytes, Infallible>;

/// PUTs `total_bytes` made of repeated `chunk`s (signed head `plan`), or GETs `plan` and
/// reads the body, while sampling `sampled_pid`'s RSS.
pub async fn stream_object(
    addr: SocketAddr,
    plan: &Plan,
    chunk: Bytes,
    total_bytes: u64,
    sampled_pid: Option<u32>,
) -> anyhow::Result<StreamReport> {
    let hwm_was_reset = sampled_pid.is_some_and(procs::reset_peak_rss);
    let idle_kb = sampled_pid.and_then(|p| procs::rss(p).ok()).map_or(0, |r| r.now_kb);
    let sampling = Arc::new(AtomicBool::new(true));
    let peak = Arc::new(AtomicU64::new(idle_kb));
    let sampler = sampled_pid.map(|pid| {
        let (sampling, peak) = (sampling.clone(), peak.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Acquire) {
                if let Ok(r) = procs::rss(pid) {
                    peak.fetch_max(r.now_kb, Ordering::Relaxed);
                }
                tokio::time::sleep(RSS_SAMPLE_EVERY).await;
            }
        })
    });

    let started = Instant::now();
    let result = transfer(addr, plan, chunk, total_bytes).await;
    let elapsed = started.elapsed();
    sampling.store(false, Ordering::Release);
    if let Some(s) = sampler {
        let _ = s.await;
    }
    let hwm_kb = sampled_pid.and_then(|p| procs::rss(p).ok()).map_or(0, |r| r.peak_kb);
    let (status, bytes) = result?;
    Ok(StreamReport {
        status,
        bytes,
        elapsed,
        idle_kb,
        sampled_peak_kb: peak.load(Ordering::Relaxed),
        hwm_kb,
        hwm_was_reset,
    })
}

/// Returns the status and the body bytes moved (sent for a PUT, received for a GET).
async fn transfer(addr: SocketAddr, plan: &Plan, chunk: Bytes, total_bytes: u64) -> anyhow::Result<(u16, u64)> {
    let mut sender = crate::load::connect::<StreamBodyBox>(addr).await?;
    let is_put = plan.method == http::Method::PUT;
    let body: StreamBodyBox = if is_put {
        let full = total_bytes / chunk.len() as u64;
        let rest = (total_bytes % chunk.len() as u64) as usize;
        let tail = chunk.slice(..rest);
        let frames = (0..full)
            .map(move |_| chunk.clone())
            .chain(std::iter::once(tail).filter(|t| !t.is_empty()))
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
        StreamBody::new(futures_util::stream::iter(frames)).boxed()
    } else {
        http_body_util::Empty::new().boxed()
    };
    let mut req = http::Request::new(body);
    *req.method_mut() = plan.method.clone();
    *req.uri_mut() = plan.path.parse()?;
    *req.headers_mut() = plan.headers.clone();
    if is_put {
        req.headers_mut().insert(http::header::CONTENT_LENGTH, total_bytes.into());
    }
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut received = 0u64;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            received += data.len() as u64;
        }
    }
    Ok((status, if is_put { total_bytes } else { received }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_head_announces_the_body_and_the_expectation() {
        let plan = Plan {
            method: http::Method::PUT,
            path: "/b/k".into(),
            headers: [(http::header::CONTENT_LENGTH, http::HeaderValue::from(1u64))].into_iter().collect(),
            body: Bytes::new(),
        };
        let head = request_head(&plan, 64, true);
        let text = std::str::from_utf8(&head).unwrap();
        assert!(text.starts_with("PUT /b/k HTTP/1.1\r\n"));
        assert!(text.contains("content-length: 64\r\n"));
        assert!(!text.contains("content-length: 1\r\n"));
        assert!(text.ends_with("expect: 100-continue\r\n\r\n"));
    }
}
