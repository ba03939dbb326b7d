//! A served request's body, which closes its connection gently when the request is answered
//! before the body was read (a refused write): the rest is read and discarded, bounded, while
//! the answer goes out.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;

/// At most this much of a refused request's body is read and discarded after the answer.
const LINGER_BYTES_MAX: u64 = 16 * 1024 * 1024;
/// For at most this long.
const LINGER_TIME: Duration = Duration::from_secs(5);
/// Frames of an already arrived remainder read in place before a task takes over.
const LINGER_INLINE_FRAMES_MAX: usize = 16;

/// A request body that closes its connection gently when the request is answered before the
/// body was read (a refused write).
///
/// A client that sent no `Expect: 100-continue` is writing its body while the answer comes
/// back; closing the connection at once makes it fail with a broken pipe before it reads the
/// answer. So the rest of the body is read and discarded in the background (bounded by
/// [`LINGER_BYTES_MAX`] and [`LINGER_TIME`]) while the answer is sent. A client that asked
/// `Expect: 100-continue` and was never told to continue is not drained: it never sends the
/// body, and its connection is closed (see [`answered_early`]).
pub struct RequestBody {
    inner: Option<Incoming>,
    expect_continue: bool,
    polled: Arc<AtomicBool>,
    finished: bool,
}

impl RequestBody {
    /// Wraps a request's body; the flag tells later whether anything polled it.
    pub fn new(inner: Incoming, expect_continue: bool) -> (Self, Arc<AtomicBool>) {
        let polled = Arc::new(AtomicBool::new(false));
        (Self { inner: Some(inner), expect_continue, polled: polled.clone(), finished: false }, polled)
    }
}

impl http_body::Body for RequestBody {
    type Data = bytes::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, hyper::Error>>> {
        self.polled.store(true, Ordering::Relaxed);
        let Some(inner) = self.inner.as_mut() else { return Poll::Ready(None) };
        let polled = Pin::new(inner).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &polled {
            self.finished = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.as_ref().map(http_body::Body::size_hint).unwrap_or_default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else { return };
        let untouched_expect = self.expect_continue && !self.polled.load(Ordering::Relaxed);
        // Even a small remainder is drained here: hyper reads only what has already arrived and
        // closes the connection on the rest, so a client still sending it got a broken pipe
        // instead of the answer (seen in CI with a 2 KB aws-chunked upload refused with 428).
        if self.finished || untouched_expect || http_body::Body::is_end_stream(&inner) {
            return;
        }
        // What has already arrived is read here (the common case of a small refused body); a
        // task is spawned only for a remainder still on its way.
        let mut inner = inner;
        for _ in 0..LINGER_INLINE_FRAMES_MAX {
            use futures_util::FutureExt;
            use http_body_util::BodyExt;
            match inner.frame().now_or_never() {
                Some(Some(Ok(_))) => continue,
                Some(None | Some(Err(_))) => return,
                None => break,
            }
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                use http_body_util::BodyExt;
                let mut inner = inner;
                let mut read = 0u64;
                let _ = tokio::time::timeout(LINGER_TIME, async {
                    while read < LINGER_BYTES_MAX {
                        match inner.frame().await {
                            Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len() as u64),
                            _ => break,
                        }
                    }
                })
                .await;
            });
        }
    }
}

/// Whether an answer went out to an `Expect: 100-continue` request without the client being
/// told to continue (or with nothing to continue): then the connection is closed after the
/// answer, since some clients (botocore) misread the next response on it.
pub fn answered_early(expect_continue: bool, polled: bool, content_length: Option<u64>) -> bool {
    expect_continue && (!polled || content_length == Some(0))
}
