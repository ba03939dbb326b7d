//! From API responses to idempotency records, and from records back to answers.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use s3s::Body;

use super::RESPONSE_HOP_HEADERS;
use super::error::GatewayError;
use crate::fence::{AmbiguousCause, IdempotencyOutcome, IdempotencyRecord, RecordedResponse};

/// Marks an answer that came from a record rather than from the API.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// What a request finds in the record of an earlier one under the same key: the response to
/// replay, or why there is none. Pure.
pub fn judge<'r>(
    record: &'r IdempotencyRecord,
    fingerprint: &str,
    now_ms: u64,
) -> Result<&'r RecordedResponse, GatewayError> {
    if record.fingerprint != fingerprint {
        return Err(GatewayError::KeyReused);
    }
    let unknown = |cause| GatewayError::OutcomeUnknown { cause, upstream_key: Some(record.upstream_key.clone()) };
    match &record.outcome {
        IdempotencyOutcome::InFlight { deadline_ms } if now_ms < *deadline_ms => Err(GatewayError::RequestInFlight),
        IdempotencyOutcome::InFlight { .. } => Err(unknown(AmbiguousCause::Abandoned)),
        IdempotencyOutcome::Ambiguous { cause } => Err(unknown(*cause)),
        IdempotencyOutcome::Completed(resp) if resp.body.is_none() => {
            Err(GatewayError::NotRetained { status: resp.status })
        }
        IdempotencyOutcome::Completed(resp) => Ok(resp),
    }
}

/// Whether a response is kept for replay. 429 and 503 say the API did not do the work and the
/// client should come back: recording them would turn a short outage into a long one. 401 and
/// 403 say the caller was not allowed: recording them would let whoever sends a request first,
/// without credentials, decide what the real caller's retry is answered.
pub fn is_recorded(status: StatusCode) -> bool {
    !matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
    )
}

/// The record of a response head and (if it was kept) its body. Header values that are not
/// UTF-8 (never seen in practice) are not recorded.
pub fn record(head: &http::response::Parts, body: Option<&[u8]>) -> RecordedResponse {
    let headers = head
        .headers
        .iter()
        .filter(|(name, _)| !RESPONSE_HOP_HEADERS.contains(&name.as_str()))
        .filter_map(|(name, value)| {
            let value = std::str::from_utf8(value.as_bytes()).ok()?;
            Some((name.as_str().to_owned(), value.to_owned()))
        })
        .collect();
    RecordedResponse { status: head.status.as_u16(), headers, body: body.map(<[u8]>::to_vec) }
}

/// The recorded response, as the client first got it, marked `Idempotent-Replayed: true`.
pub fn replay(recorded: &RecordedResponse) -> http::Response<Body> {
    let body = recorded.body.clone().unwrap_or_default();
    let mut resp = http::Response::new(Body::from(Bytes::from(body)));
    *resp.status_mut() = StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = resp.headers_mut();
    for (name, value) in &recorded.headers {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    resp
}

/// A response body read up to a size.
pub enum Collected {
    Whole(Bytes),
    /// Larger than the limit: what was read, and the rest still to stream.
    TooLarge(Vec<Bytes>, Incoming),
    /// The body broke off or did not finish in time.
    Broken,
}

/// Reads `body` until it ends, passes `bytes_max`, fails, or `timeout` runs out.
pub async fn collect(mut body: Incoming, bytes_max: usize, timeout: Duration) -> Collected {
    let deadline = tokio::time::Instant::now() + timeout;
    let (mut chunks, mut size) = (Vec::new(), 0usize);
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) | Ok(Some(Err(_))) => return Collected::Broken,
            Ok(None) => return Collected::Whole(Bytes::from(chunks.concat())),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else { continue }; // trailers are not replayed
                size += data.len();
                chunks.push(data);
                if size > bytes_max {
                    return Collected::TooLarge(chunks, body);
                }
            }
        }
    }
}

/// What was read, then the rest of the body.
pub fn stream_on(read: Vec<Bytes>, rest: Incoming) -> Body {
    let head = futures_util::stream::iter(read.into_iter().map(|b| Ok::<_, hyper::Error>(http_body::Frame::data(b))));
    let tail = http_body_util::BodyStream::new(rest);
    Body::http_body_unsync(http_body_util::StreamBody::new(futures_util::StreamExt::chain(head, tail)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::FenceToken;

    fn record_with(outcome: IdempotencyOutcome) -> IdempotencyRecord {
        IdempotencyRecord {
            claim: "c".into(),
            fingerprint: "f1".into(),
            token: FenceToken(3),
            upstream_key: "fg-k".into(),
            expires_at_ms: 1_000,
            route: "/api/".into(),
            claimed_at_ms: 0,
            outcome,
        }
    }

    /// Every state of a record, and a different body under the same key, get their answer.
    #[test]
    fn records_answer_retries() {
        let done = RecordedResponse {
            status: 201,
            headers: vec![("etag".into(), "\"v1\"".into())],
            body: Some(b"{}".to_vec()),
        };
        let r = record_with(IdempotencyOutcome::Completed(done.clone()));
        assert_eq!(judge(&r, "f1", 10).unwrap(), &done);
        assert!(matches!(judge(&r, "f2", 10), Err(GatewayError::KeyReused)));

        let r = record_with(IdempotencyOutcome::InFlight { deadline_ms: 100 });
        assert!(matches!(judge(&r, "f1", 99), Err(GatewayError::RequestInFlight)));
        assert!(matches!(
            judge(&r, "f1", 100),
            Err(GatewayError::OutcomeUnknown { cause: AmbiguousCause::Abandoned, upstream_key: Some(k) }) if k == "fg-k"
        ));

        let r = record_with(IdempotencyOutcome::Ambiguous { cause: AmbiguousCause::Timeout });
        assert!(matches!(
            judge(&r, "f1", 10),
            Err(GatewayError::OutcomeUnknown { cause: AmbiguousCause::Timeout, .. })
        ));

        let r = record_with(IdempotencyOutcome::Completed(RecordedResponse { body: None, ..done }));
        assert!(matches!(judge(&r, "f1", 10), Err(GatewayError::NotRetained { status: 201 })));
    }

    /// A replay carries the recorded status, headers and body, and says it is a replay.
    #[test]
    fn replays_are_the_recorded_response() {
        let recorded = RecordedResponse {
            status: 201,
            headers: vec![("etag".into(), "\"v1\"".into()), ("x-a".into(), "1".into()), ("x-a".into(), "2".into())],
            body: Some(b"{\"id\":1}".to_vec()),
        };
        let resp = replay(&recorded);
        assert_eq!(resp.status(), 201);
        assert_eq!(resp.headers().get_all("x-a").iter().count(), 2);
        assert_eq!(resp.headers()[REPLAYED_HEADER], "true");
        assert_eq!(resp.into_body().bytes().unwrap(), Bytes::from_static(b"{\"id\":1}"));
        assert!(!is_recorded(StatusCode::SERVICE_UNAVAILABLE) && is_recorded(StatusCode::INTERNAL_SERVER_ERROR));
        assert!(!is_recorded(StatusCode::UNAUTHORIZED) && !is_recorded(StatusCode::FORBIDDEN));
    }
}
