//! Every error of the API gateway, and the one place it becomes an `application/problem+json`
//! response (RFC 9457) whose `type` ends in the code.
//!
//! Who is at fault decides the status: the client (4xx: the same request will fail again), the
//! fence store or the API (5xx: a retry may help, except where the outcome is unknown).

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use s3s::Body;

use crate::fence::{AdmitError, AmbiguousCause, StoreError};
use crate::refusal::{CURRENT_TOKEN_HEADER, Refusal};

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The fencing protocol's own refusals, shared with the S3 front.
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("the route's resource template needs path segment {0} after the prefix")]
    MissingSegment(usize),
    #[error("the path is malformed or has `.` or `..` segments")]
    UnsafePath,
    #[error(
        "this route (or this caller's share of it) holds as many request bodies as routes.buffered_bytes_max allows; retry"
    )]
    BufferFull,
    #[error("the request body did not arrive within the route's request_timeout_ms ({after_ms} ms)")]
    BodyReadTimeout { after_ms: u64 },
    #[error(
        "the fence store holds as many idempotency records as store.idempotency_records_max (or its bytes) allows, \
         none past its retention; retry"
    )]
    RecordsFull,
    #[error("the body is larger than routes.body_bytes_max ({max} bytes)")]
    BodyTooLarge { max: usize },
    #[error("the client's body ended early or failed; nothing was forwarded complete")]
    IncompleteBody,
    #[error("the Idempotency-Key header must appear once, with 1 to {max} visible ASCII characters")]
    InvalidIdempotencyKey { max: usize },
    #[error("a request with this idempotency key is still in flight; retry later")]
    RequestInFlight,
    #[error("this idempotency key was used for a different request (method, path or body)")]
    KeyReused,
    #[error("the request executed (upstream status {status}) but its response was not kept for replay")]
    NotRetained { status: u16 },
    #[error(
        "the upstream outcome is unknown ({cause:?}); fencegate will not send it again under idempotency key {upstream_key:?}"
    )]
    OutcomeUnknown { cause: AmbiguousCause, upstream_key: Option<String> },
    #[error("the upstream answered (status {status}) but its response body broke off")]
    ResponseIncomplete { status: u16 },
    #[error("the upstream did not answer within {after_ms} ms")]
    UpstreamTimeout { after_ms: u64 },
    #[error("the upstream could not be reached; nothing was sent")]
    UpstreamUnavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("fencegate failed internally")]
    Internal,
}

impl From<AdmitError> for GatewayError {
    fn from(e: AdmitError) -> Self {
        Self::Refused(e.into())
    }
}

impl From<StoreError> for GatewayError {
    fn from(e: StoreError) -> Self {
        Self::Refused(Refusal::StoreUnavailable(e))
    }
}

impl GatewayError {
    /// The label of `fencegate_decisions_total` for errors that are decisions.
    pub fn decision(&self) -> &'static str {
        match self {
            Self::Refused(refusal) => refusal.decision(),
            Self::MissingSegment(_) => "invalid_resource",
            _ => "error",
        }
    }

    /// The fence a refused writer is told (`Fencing-Token-Current`), when it is known.
    pub fn current_fence(&self) -> Option<crate::fence::FenceToken> {
        match self {
            Self::Refused(refusal) => refusal.current_fence(),
            _ => None,
        }
    }

    /// The label of `fencegate_gateway_requests_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::RequestInFlight => "in_flight",
            Self::KeyReused => "key_reused",
            Self::NotRetained { .. } => "not_retained",
            Self::OutcomeUnknown { .. } | Self::ResponseIncomplete { .. } => "outcome_unknown",
            _ => "refused",
        }
    }

    /// The code its problem's `type` ends in.
    pub fn code(&self) -> &'static str {
        self.parts().1
    }

    fn parts(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            Self::Refused(refusal) => (refusal.status(), refusal.code()),
            Self::MissingSegment(_) => (S::BAD_REQUEST, "InvalidFencingResource"),
            Self::UnsafePath => (S::BAD_REQUEST, "InvalidPath"),
            Self::BufferFull => (S::SERVICE_UNAVAILABLE, "SlowDown"),
            Self::BodyReadTimeout { .. } => (S::REQUEST_TIMEOUT, "RequestTimeout"),
            Self::RecordsFull => (S::SERVICE_UNAVAILABLE, "SlowDown"),
            Self::BodyTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, "RequestTooLarge"),
            Self::IncompleteBody => (S::BAD_REQUEST, "IncompleteBody"),
            Self::InvalidIdempotencyKey { .. } => (S::BAD_REQUEST, "InvalidIdempotencyKey"),
            Self::RequestInFlight => (S::CONFLICT, "IdempotentRequestInFlight"),
            Self::KeyReused => (S::UNPROCESSABLE_ENTITY, "IdempotencyKeyReused"),
            Self::NotRetained { .. } => (S::CONFLICT, "IdempotentResponseNotRetained"),
            Self::OutcomeUnknown { cause: AmbiguousCause::Timeout, .. } => {
                (S::GATEWAY_TIMEOUT, "UpstreamOutcomeUnknown")
            }
            Self::OutcomeUnknown { .. } | Self::ResponseIncomplete { .. } => (S::BAD_GATEWAY, "UpstreamOutcomeUnknown"),
            Self::UpstreamTimeout { .. } => (S::GATEWAY_TIMEOUT, "UpstreamTimeout"),
            Self::UpstreamUnavailable(_) => (S::BAD_GATEWAY, "UpstreamUnavailable"),
            Self::Internal => (S::INTERNAL_SERVER_ERROR, "InternalError"),
        }
    }

    /// The problem response; `Fencing-Token-Current` on a stale token, `Retry-After` where a
    /// plain retry may succeed.
    pub fn into_response(self) -> http::Response<Body> {
        let (status, code) = self.parts();
        let mut problem = crate::net::problem::document(status, code, &self.to_string());
        let current = self.current_fence();
        if let Some(current) = current {
            problem["fencing_token_current"] = serde_json::json!(current.0);
        }
        match &self {
            Self::OutcomeUnknown { upstream_key: Some(key), .. } => {
                problem["upstream_idempotency_key"] = serde_json::json!(key)
            }
            Self::NotRetained { status } | Self::ResponseIncomplete { status } => {
                problem["upstream_status"] = serde_json::json!(status)
            }
            _ => {}
        }
        let mut resp = http::Response::new(Body::from(Bytes::from(problem.to_string())));
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(crate::net::problem::CONTENT_TYPE));
        if let Some(current) = current {
            headers.insert(CURRENT_TOKEN_HEADER, HeaderValue::from(current.0));
        }
        let retry_after = match &self {
            Self::Refused(refusal) => refusal.retry_after_s(),
            Self::RequestInFlight => Some(1),
            _ => (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1),
        };
        if let Some(seconds) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::FenceToken;

    /// A stale token's problem names the code in `type` and the fence in a header.
    #[test]
    fn stale_tokens_become_409_problems_with_the_current_fence() {
        let resp =
            GatewayError::from(Refusal::Stale { presented: FenceToken(11), current: FenceToken(12) }).into_response();
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(resp.headers()[CURRENT_TOKEN_HEADER], "12");
        let body = resp.into_body().bytes().unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert!(json["type"].as_str().unwrap().ends_with("FencingTokenStale"));
        assert_eq!(json["status"], 409);
    }
}
