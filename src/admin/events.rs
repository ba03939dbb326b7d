//! `GET /v1/events`: the feed of decisions as server-sent events. The watcher is registered
//! before the answer's head is sent, and the first bytes (a comment) go at once: a client that
//! sees the stream open sees every decision made after.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};

use super::{AdminResponse, problem};
use crate::feed::{Feed, FeedItem, REFUSALS_QUEUED_MAX, Watch};

/// A comment this often on a quiet feed, so that proxies and the client's own timeouts keep
/// an idle stream open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

pub fn watch(feed: &std::sync::Arc<Feed>) -> AdminResponse {
    let Some(watch) = feed.watch() else {
        return problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "TooManyWatchers",
            &format!("at most {} clients watch the feed at once", crate::feed::WATCHERS_MAX),
        );
    };
    let stream = futures_util::stream::unfold(Some((watch, true)), |state| async move {
        let (mut watch, first): (Watch, bool) = state?;
        if first {
            return Some((Ok(frame(": watching\n\n".into())), Some((watch, false))));
        }
        let (text, more) = match tokio::time::timeout(KEEP_ALIVE, watch.next()).await {
            Err(_) => (": keep-alive\n\n".to_owned(), true),
            Ok(None) => return None,
            Ok(Some(FeedItem::Decision(json))) => (format!("event: decision\ndata: {json}\n\n"), true),
            Ok(Some(FeedItem::Dropped(n))) => (format!("event: dropped\ndata: {{\"accepted\":{n}}}\n\n"), true),
            Ok(Some(FeedItem::Overflow)) => {
                (format!("event: overflow\ndata: {{\"refusals_unread\":{REFUSALS_QUEUED_MAX}}}\n\n"), false)
            }
        };
        Some((Ok::<_, Infallible>(frame(text)), more.then_some((watch, false))))
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
