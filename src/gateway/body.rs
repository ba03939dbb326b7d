//! A route request's body: cut off past the route's bound as it streams, or held whole (an
//! idempotency-keyed call, sent again from memory) within a buffer shared per route and per
//! peer.

use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use s3s::Body;

use super::error::GatewayError;
use super::route::{BufferHold, Route};
use crate::config::millis;

/// The request's body, held whole until the call ends: bounded per route across requests,
/// and per caller within the route; what its length announces is held (the most a body may
/// be without one), and it must arrive within the route's request timeout. The share is the
/// peer's (its address), not the caller headers': fencegate does not authenticate a route's
/// callers, and made-up `Authorization` values would each get a share of their own. Behind a
/// proxy every caller is the proxy's.
pub(super) async fn held(
    route: &Route,
    parts: &http::request::Parts,
    caller: &str,
    body: Incoming,
) -> Result<(Bytes, BufferHold), GatewayError> {
    let reserve = content_length(&parts.headers)
        .map_or(route.body_bytes_max, |n| usize::try_from(n).unwrap_or(usize::MAX).min(route.body_bytes_max));
    let share = parts.extensions.get::<crate::net::server::Peer>().map_or_else(|| caller.to_owned(), |p| p.share());
    let buffered = route.hold_buffer(&share, reserve).ok_or(GatewayError::BufferFull)?;
    match tokio::time::timeout(route.request_timeout, read_body(body, reserve)).await {
        Ok(body) => Ok((body?, buffered)),
        Err(_) => Err(GatewayError::BodyReadTimeout { after_ms: millis(route.request_timeout) }),
    }
}

/// The client body, cut off (failing) past `bytes_max`.
pub(super) fn limited(body: Incoming, bytes_max: usize) -> Body {
    Body::http_body(http_body_util::Limited::new(body, bytes_max))
}

/// The whole client body, up to `bytes_max`.
async fn read_body(body: Incoming, bytes_max: usize) -> Result<Bytes, GatewayError> {
    match http_body_util::Limited::new(body, bytes_max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(GatewayError::BodyTooLarge { max: bytes_max }),
        Err(_) => Err(GatewayError::IncompleteBody),
    }
}

pub(super) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}
