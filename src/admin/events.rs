//! `GET /v1/events`: the feed of decisions as server-sent events. The watcher is registered
//! before the answer's head is sent, and the first bytes go at once: a client that sees the
//! stream open sees every decision made after.
//!
//! Each refusal carries an `id` (`<epoch>.<n>`, the process's n-th refusal). A client that
//! comes back with the last one it read (`Last-Event-ID`, which `EventSource` sends by itself
//! when it reconnects; or `?last_event_id=`, which a page opening a new stream can send) is
//! first told how many refusals it missed (`event: missed`), so that a feed cut by the
//! network, by fencegate or by an overflow never loses a refusal silently.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};

use super::{AdminResponse, problem};
use crate::feed::{Feed, FeedItem, Missed, REFUSALS_QUEUED_MAX, Viewer, Watch, WatchRefused};

/// A comment at least this often on a quiet feed, so that proxies and the client's own
/// timeouts keep an idle stream open ...
const KEEP_ALIVE_MAX: Duration = Duration::from_secs(15);
/// ... and at least three times within `server.idle_timeout_ms`, which would close it.
const KEEP_ALIVES_PER_IDLE_TIMEOUT: u32 = 3;
/// How soon a client (`EventSource`) reconnects when the stream breaks.
const RETRY_MS: u64 = 1000;

/// How often a quiet feed says it is alive, given the listener's idle timeout.
pub fn keep_alive(idle_timeout: Duration) -> Duration {
    (idle_timeout / KEEP_ALIVES_PER_IDLE_TIMEOUT).clamp(Duration::from_millis(100), KEEP_ALIVE_MAX)
}

pub fn watch(
    feed: &std::sync::Arc<Feed>,
    headers: &HeaderMap,
    query: Option<&str>,
    keep_alive: Duration,
    viewer: Viewer,
) -> AdminResponse {
    let from_query = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .find(|(name, _)| name == "last_event_id")
        .map(|(_, value)| value.into_owned());
    let last_seen =
        headers.get("last-event-id").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).or(from_query);
    let (watch, missed) = match feed.watch_as(last_seen.as_deref(), viewer) {
        Ok(watching) => watching,
        Err(refused) => {
            let detail = match refused {
                WatchRefused::ClientFull => format!(
                    "this client already watches the feed {} times; close one",
                    crate::feed::WATCHERS_PER_CLIENT_MAX
                ),
                WatchRefused::Full | WatchRefused::Closed => format!(
                    "at most {} clients watch the feed at once (the admin token always gets a place)",
                    crate::feed::WATCHERS_MAX
                ),
            };
            return problem(StatusCode::SERVICE_UNAVAILABLE, "TooManyWatchers", &detail);
        }
    };
    let opening = match missed {
        None => format!("retry: {RETRY_MS}\n: watching\n\n"),
        Some(Missed::Refusals(n)) => format!("retry: {RETRY_MS}\nevent: missed\ndata: {{\"refusals\":{n}}}\n\n"),
        Some(Missed::Unknown) => format!("retry: {RETRY_MS}\nevent: missed\ndata: {{\"refusals\":null}}\n\n"),
    };
    let feed = feed.clone();
    let stream = futures_util::stream::unfold(Some((watch, Some(opening))), move |state| {
        let feed = feed.clone();
        async move {
            let (mut watch, opening): (Watch, Option<String>) = state?;
            if let Some(opening) = opening {
                return Some((Ok(frame(opening)), Some((watch, None))));
            }
            let (text, more) = match tokio::time::timeout(keep_alive, watch.next()).await {
                Err(_) => (": keep-alive\n\n".to_owned(), true),
                Ok(None) => return None,
                Ok(Some(FeedItem::Decision(json, None))) => (format!("event: decision\ndata: {json}\n\n"), true),
                Ok(Some(FeedItem::Decision(json, Some(n)))) => {
                    (format!("id: {}\nevent: decision\ndata: {json}\n\n", feed.refusal_id(n)), true)
                }
                Ok(Some(FeedItem::Dropped(n))) => (format!("event: dropped\ndata: {{\"accepted\":{n}}}\n\n"), true),
                Ok(Some(FeedItem::Overflow)) => {
                    (format!("event: overflow\ndata: {{\"refusals_unread\":{REFUSALS_QUEUED_MAX}}}\n\n"), false)
                }
            };
            Some((Ok::<_, Infallible>(frame(text)), more.then_some((watch, None))))
        }
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, "text/event-stream".parse().expect("static"));
    headers.insert(header::CACHE_CONTROL, "no-store".parse().expect("static"));
    resp
}

fn frame(text: String) -> Frame<Bytes> {
    Frame::data(Bytes::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quiet feed speaks well within the idle timeout that would close it, and at least
    /// every 15 s.
    #[test]
    fn keep_alives_fit_in_the_idle_timeout() {
        assert_eq!(keep_alive(Duration::from_secs(310)), KEEP_ALIVE_MAX);
        assert_eq!(keep_alive(Duration::from_secs(3)), Duration::from_secs(1));
        assert_eq!(keep_alive(Duration::from_millis(1)), Duration::from_millis(100));
    }
}
