//! The body of a forwarded write: streamed to the upstream chunk by chunk, cut off if a newer
//! token cancels the write, checked against its trailing checksum, and, when small, kept for
//! one retry. See `docs/design.md`, sections 3 and 8.

use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures_util::FutureExt;
use http_body::{Body as HttpBody, Frame, SizeHint};
use s3s::checksum::ChecksumHasher;
use s3s::{Body, TrailingHeaders};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::metrics;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a forwarded body was cut off before its end reached the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyFailure {
    #[error("a newer fencing token cancelled this write")]
    Cancelled,
    #[error("the {0} checksum does not match the trailer")]
    Checksum(&'static str),
    #[error("the client body failed or ended early")]
    Client,
    #[error("the client body is larger than allowed")]
    TooLarge,
}

/// What a forwarded body asks of the write it carries (the fence's permit): the signal that
/// cuts it off, and leave to hand its last byte over.
pub trait Handover: Send + Sync + 'static {
    /// Fires when the write must not reach the upstream whole.
    fn cancellation(&self) -> &CancellationToken;
    /// Marks the whole body as handed over; `false` if the write was cut off first (then the
    /// body must not finish).
    fn hand_over(&self) -> bool;
}

/// What the handler learns from the body after the upstream answered.
#[derive(Default)]
pub struct BodyReport {
    failure: Mutex<Option<BodyFailure>>,
    /// The whole body, if it was small enough to keep; `None` once it grew past the limit.
    retained: Mutex<Option<Vec<Bytes>>>,
}

impl BodyReport {
    pub fn failure(&self) -> Option<BodyFailure> {
        *self.failure.lock().expect("body report lock")
    }

    /// The retained body for a retry, if the whole body was kept.
    pub fn retained(&self) -> Option<Vec<Bytes>> {
        self.retained.lock().expect("body report lock").clone()
    }
}

/// A trailing checksum the client announced with `x-amz-trailer`.
pub struct TrailerCheck {
    header: &'static str,
    algorithm: &'static str,
    hasher: ChecksumHasher,
    trailers: TrailingHeaders,
}

impl TrailerCheck {
    /// The check for the trailer named in `x-amz-trailer`, if it is a checksum fencegate knows.
    pub fn new(announced: &str, trailers: TrailingHeaders) -> Option<Self> {
        let mut hasher = ChecksumHasher::default();
        let (header, algorithm) = match announced.trim().to_ascii_lowercase().as_str() {
            "x-amz-checksum-crc32" => {
                hasher.crc32 = Some(Default::default());
                ("x-amz-checksum-crc32", "CRC32")
            }
            "x-amz-checksum-crc32c" => {
                hasher.crc32c = Some(Default::default());
                ("x-amz-checksum-crc32c", "CRC32C")
            }
            "x-amz-checksum-sha1" => {
                hasher.sha1 = Some(Default::default());
                ("x-amz-checksum-sha1", "SHA1")
            }
            "x-amz-checksum-sha256" => {
                hasher.sha256 = Some(Default::default());
                ("x-amz-checksum-sha256", "SHA256")
            }
            "x-amz-checksum-crc64nvme" => {
                hasher.crc64nvme = Some(Default::default());
                ("x-amz-checksum-crc64nvme", "CRC64NVME")
            }
            _ => return None,
        };
        Some(Self { header, algorithm, hasher, trailers })
    }

    fn verify(self) -> Result<(), BodyFailure> {
        let Self { header, algorithm, hasher, trailers } = self;
        let sum = hasher.finalize();
        let computed =
            [sum.checksum_crc32, sum.checksum_crc32c, sum.checksum_sha1, sum.checksum_sha256, sum.checksum_crc64nvme]
                .into_iter()
                .flatten()
                .next();
        let announced = trailers.read(|t| t.get(header).and_then(|v| v.to_str().ok()).map(str::to_owned)).flatten();
        match (computed, announced) {
            (Some(c), Some(a)) if c == a => Ok(()),
            _ => Err(BodyFailure::Checksum(algorithm)),
        }
    }
}

/// The forwarded body. See the module documentation.
pub struct ForwardBody {
    inner: Body,
    /// Weak: the write's handler owns the permit and may release it (a cut-off write); a body
    /// whose permit is gone never completes.
    permit: Option<Weak<dyn Handover>>,
    cancelled: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    check: Option<TrailerCheck>,
    /// The last chunk, held back until the end of the body is known (so the write is marked
    /// not-cancellable, and the checksum verified, before the upstream gets its last byte).
    held: Option<Bytes>,
    retain_bytes_max: usize,
    retained_bytes: usize,
    retained: Option<Vec<Bytes>>,
    report: Arc<BodyReport>,
    finished: bool,
}

impl ForwardBody {
    pub fn new(
        inner: Body,
        permit: Option<Arc<dyn Handover>>,
        check: Option<TrailerCheck>,
        retain_bytes_max: usize,
    ) -> (Self, Arc<BodyReport>) {
        let cancelled = permit.as_ref().map(|p| Box::pin(p.cancellation().clone().cancelled_owned()));
        let report = Arc::new(BodyReport::default());
        let body = Self {
            inner,
            permit: permit.as_ref().map(Arc::downgrade),
            cancelled,
            check,
            held: None,
            retain_bytes_max,
            retained_bytes: 0,
            retained: Some(Vec::new()),
            report: report.clone(),
            finished: false,
        };
        (body, report)
    }

    fn fail(&mut self, failure: BodyFailure) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        metrics::body_aborted(match failure {
            BodyFailure::Cancelled => "cancelled",
            BodyFailure::Checksum(_) => "checksum",
            BodyFailure::Client => "client",
            BodyFailure::TooLarge => "too_large",
        });
        *self.report.failure.lock().expect("body report lock") = Some(failure);
        self.finished = true;
        self.held = None;
        Poll::Ready(Some(Err(Box::new(failure))))
    }

    fn take_chunk(&mut self, data: &Bytes) {
        if let Some(check) = &mut self.check {
            check.hasher.update(data);
        }
        if let Some(kept) = &mut self.retained {
            self.retained_bytes += data.len();
            if self.retained_bytes <= self.retain_bytes_max {
                kept.push(data.clone());
            } else {
                self.retained = None;
            }
        }
    }

    /// The client body ended: verify, make the write non-cancellable, publish the retained
    /// copy, and hand over the last chunk.
    fn finish(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(check) = self.check.take()
            && let Err(failure) = check.verify()
        {
            return self.fail(failure);
        }
        if let Some(permit) = &self.permit
            && !permit.upgrade().is_some_and(|permit| permit.hand_over())
        {
            return self.fail(BodyFailure::Cancelled);
        }
        *self.report.retained.lock().expect("body report lock") = self.retained.take();
        self.finished = true;
        Poll::Ready(self.held.take().map(|b| Ok(Frame::data(b))))
    }
}

impl HttpBody for ForwardBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.finished {
                return Poll::Ready(this.held.take().map(|b| Ok(Frame::data(b))));
            }
            if let Some(cancelled) = &mut this.cancelled
                && cancelled.poll_unpin(cx).is_ready()
            {
                return this.fail(BodyFailure::Cancelled);
            }
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    }; // trailers: read via the handle
                    if data.is_empty() {
                        continue;
                    }
                    this.take_chunk(&data);
                    if let Some(previous) = this.held.replace(data) {
                        return Poll::Ready(Some(Ok(Frame::data(previous))));
                    }
                }
                Some(Err(e)) => {
                    // A body cut at its limit (`http_body_util::Limited`) is too large, not broken.
                    let too_large = e.downcast_ref::<http_body_util::LengthLimitError>().is_some();
                    return this.fail(if too_large { BodyFailure::TooLarge } else { BodyFailure::Client });
                }
                None => return this.finish(),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished && self.held.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn collect(body: ForwardBody) -> Result<Bytes, BoxError> {
        Ok(body.collect().await?.to_bytes())
    }

    /// A body passes through unchanged and is retained when small.
    #[tokio::test]
    async fn passes_bytes_through_and_retains_small_bodies() {
        let stream =
            futures_util::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from("ab")), Ok(Bytes::from("cd"))]);
        let inner = Body::http_body(http_body_util::StreamBody::new(futures_util::StreamExt::map(stream, |r| {
            r.map(Frame::data)
        })));
        let (body, report) = ForwardBody::new(inner, None, None, 1024);
        assert_eq!(collect(body).await.unwrap(), Bytes::from("abcd"));
        assert_eq!(report.retained().unwrap().concat(), b"abcd");
        assert_eq!(report.failure(), None);
    }
}
