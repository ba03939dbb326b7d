//! Every error of the S3 front, and the one place it becomes an S3 error response.
//!
//! Each variant says who is at fault: the client (4xx, retrying the same request will not
//! help), the fence store or the upstream (5xx, a retry may help), or fencegate itself.

use http::{HeaderValue, StatusCode};

use crate::fence::{AdmitError, FenceToken};
use crate::refusal::{CURRENT_TOKEN_HEADER, Refusal};
use crate::upstream::UpstreamError;

#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    /// The fencing protocol's own refusals, shared with the API gateway.
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("the {0} header counts only if the request's SigV4 signature covers it: sign it (SignedHeaders)")]
    Unsigned(String),
    /// The stamp named in the query (`?x-amz-meta-fencing-token=...`) with another value than
    /// the token presented: an upstream that takes metadata from the query would store it over
    /// fencegate's own.
    #[error("x-amz-meta-fencing-token in the query must be the write's token: it is the stamp fencegate stores")]
    StampInQuery,
    #[error("There were headers present in the request which were not signed: {0}")]
    HeadersNotSigned(String),
    #[error(
        "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256. \
         (SigV2 is off unless server.sigv2 = true)"
    )]
    SigV2Off,
    #[error("AWS authentication requires a valid Date or x-amz-date header")]
    SigV2Date,
    #[error("The difference between the request time and the current time is too large.")]
    RequestTimeTooSkewed,
    #[error("a request signed with SigV2 may not {0}: sign it with SigV4")]
    SigV2Refused(&'static str),
    #[error("The authorization header is malformed: one AWS4-HMAC-SHA256 (or, with server.sigv2, AWS) value for s3")]
    AuthorizationMalformed,
    #[error(
        "Only one auth mechanism allowed; only the X-Amz-Algorithm query parameter or the Authorization header should be specified"
    )]
    TwoAuthMechanisms,
    #[error("The authorization header is malformed; the region '{got}' is wrong; expecting '{expected}'")]
    WrongRegion { got: String, expected: String },
    #[error("X-Amz-Expires must be at most 604800 seconds (7 days)")]
    PresignTooLong,
    #[error("the fencing token header ({header}) and object metadata ({metadata}) disagree")]
    TokenMismatch { header: FenceToken, metadata: FenceToken },
    #[error(
        "fencing token {presented} became stale while its body was streaming (fence {current}); the upload was cut off and nothing was committed"
    )]
    StaleWhileStreaming { presented: FenceToken, current: FenceToken },
    #[error("the body is {bytes} bytes, more than server.body_bytes_max ({max})")]
    TooLarge { bytes: u64, max: u64 },
    #[error("object keys with `.` or `..` path segments are refused")]
    UnsafeKey,
    #[error("the value of {0} is not US-ASCII: encode it (RFC 2047), as S3 expects")]
    NonAsciiMetadata(String),
    #[error("At least one of the pre-conditions you specified did not hold")]
    ClientPrecondition,
    #[error("this credential may not reach {0} (its [[credentials]] buckets)")]
    OutOfScope(String),
    #[error("The specified key does not exist.")]
    ClientNoSuchKey,
    #[error("The specified multipart upload does not exist for this key.")]
    NoSuchUpload,
    /// Its parts and completion are refused before fencegate aborts it
    /// (`fencing.abort_uploads_after_ms`), as S3 answers an upload its lifecycle rule aborted.
    #[error("The multipart upload expires (fencing.abort_uploads_after_ms): start a new one.")]
    UploadExpiring,
    #[error(
        "This copy request is illegal because it is trying to copy an object to itself without changing the \
         object's metadata, storage class, website redirect location or encryption attributes."
    )]
    SelfCopyUnchanged,
    #[error("the lease of this credential expired or was released")]
    LeaseExpired,
    #[error("a lease credential writes only the objects of its lease's resource {lease:?}; not {what}")]
    OutsideLease { lease: String, what: String },
    #[error("a request signed with a lease credential carries fencing token {presented}, not its lease's {lease}")]
    LeaseTokenMismatch { presented: FenceToken, lease: FenceToken },
    #[error("a request signed with a lease credential names resource {presented:?}, not its lease's {lease:?}")]
    LeaseResourceMismatch { presented: String, lease: String },
    #[error("the key is longer than S3 allows ({max} bytes)")]
    KeyTooLong { max: usize },
    #[error("{0} is not supported through fencegate yet")]
    NotSupported(&'static str),
    #[error("malformed XML body: {0}")]
    MalformedXml(String),
    #[error("the body's {algorithm} checksum does not match its trailer; nothing was committed")]
    BadDigest { algorithm: &'static str },
    #[error("the client's body ended early or failed; nothing was committed")]
    IncompleteBody,
    #[error("the object changed under a concurrent write with the same token; retry")]
    PreconditionRace,
    #[error(
        "the upstream refused fencegate's precondition ({precondition:?}) twice on an object that did not change: it \
         does not honour the ETags it answers (a form it does not compare, or a versioned bucket on Ceph RGW 16); \
         nothing was committed (run `fencegate probe`)"
    )]
    PreconditionNotHonoured { precondition: http::HeaderValue },
    #[error("upstream request failed")]
    Upstream(#[source] UpstreamError),
    #[error(
        "the write did not finish within upstream.request_timeout_ms ({after_ms} ms); its body was cut off and nothing was committed"
    )]
    WriteDeadline { after_ms: u64 },
    #[error(
        "the upstream has not answered within upstream.request_timeout_ms ({after_ms} ms); the write may still commit, and newer tokens wait for its outcome"
    )]
    OutcomeUnknown { after_ms: u64 },
    #[error(
        "this fencegate replica could not keep the write registered in the fence store; nothing was committed; retry"
    )]
    RegistrationLost,
    #[error("method {0} is not an S3 method")]
    MethodNotAllowed(String),
    #[error("At least one of the pre-conditions you specified did not hold (on the copy source)")]
    CopySourceCondition,
    #[error("upstream answered {status} to {step}")]
    UpstreamStatus { step: &'static str, status: StatusCode },
}

impl From<AdmitError> for FrontError {
    fn from(e: AdmitError) -> Self {
        Self::Refused(e.into())
    }
}

impl FrontError {
    /// The label of `fencegate_decisions_total` for errors that are decisions.
    pub fn decision(&self) -> &'static str {
        match self {
            Self::Refused(refusal) => refusal.decision(),
            Self::TokenMismatch { .. } | Self::Unsigned(_) | Self::PresignTooLong | Self::StampInQuery => {
                "invalid_token"
            }
            Self::LeaseTokenMismatch { .. } => "invalid_token",
            Self::LeaseResourceMismatch { .. } => "invalid_resource",
            Self::LeaseExpired => "lease_expired",
            Self::StaleWhileStreaming { .. } => "stale",
            _ => "error",
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    fn parts(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            Self::Refused(refusal) => (refusal.status(), refusal.s3_code()),
            Self::TokenMismatch { .. } | Self::Unsigned(_) | Self::StampInQuery => {
                (S::BAD_REQUEST, "InvalidFencingToken")
            }
            Self::HeadersNotSigned(_) | Self::SigV2Date | Self::SigV2Refused(_) => (S::FORBIDDEN, "AccessDenied"),
            Self::SigV2Off => (S::BAD_REQUEST, "InvalidRequest"),
            Self::AuthorizationMalformed | Self::WrongRegion { .. } => (S::BAD_REQUEST, "AuthorizationHeaderMalformed"),
            Self::TwoAuthMechanisms => (S::BAD_REQUEST, "InvalidArgument"),
            Self::RequestTimeTooSkewed => (S::FORBIDDEN, "RequestTimeTooSkewed"),
            Self::PresignTooLong => (S::BAD_REQUEST, "AuthorizationQueryParametersError"),
            Self::StaleWhileStreaming { .. } => (S::CONFLICT, "FencingTokenStale"),
            Self::PreconditionRace => (S::SERVICE_UNAVAILABLE, "SlowDown"),
            Self::TooLarge { .. } => (S::BAD_REQUEST, "EntityTooLarge"),
            Self::UnsafeKey | Self::NonAsciiMetadata(_) => (S::BAD_REQUEST, "InvalidArgument"),
            Self::KeyTooLong { .. } => (S::BAD_REQUEST, "KeyTooLongError"),
            Self::ClientPrecondition => (S::PRECONDITION_FAILED, "PreconditionFailed"),
            Self::OutOfScope(_) | Self::OutsideLease { .. } => (S::FORBIDDEN, "AccessDenied"),
            Self::LeaseExpired => (S::FORBIDDEN, "ExpiredToken"),
            Self::LeaseTokenMismatch { .. } => (S::BAD_REQUEST, "InvalidFencingToken"),
            Self::LeaseResourceMismatch { .. } => (S::BAD_REQUEST, "FencingResourceMismatch"),
            Self::ClientNoSuchKey => (S::NOT_FOUND, "NoSuchKey"),
            Self::NoSuchUpload | Self::UploadExpiring => (S::NOT_FOUND, "NoSuchUpload"),
            Self::SelfCopyUnchanged => (S::BAD_REQUEST, "InvalidRequest"),
            Self::NotSupported(_) => (S::NOT_IMPLEMENTED, "NotImplemented"),
            Self::BadDigest { .. } => (S::BAD_REQUEST, "BadDigest"),
            Self::MalformedXml(_) => (S::BAD_REQUEST, "MalformedXML"),
            Self::IncompleteBody => (S::BAD_REQUEST, "IncompleteBody"),
            Self::Upstream(UpstreamError::Timeout { .. })
            | Self::WriteDeadline { .. }
            | Self::OutcomeUnknown { .. } => (S::GATEWAY_TIMEOUT, "UpstreamTimeout"),
            Self::RegistrationLost => (S::SERVICE_UNAVAILABLE, "FenceStoreUnavailable"),
            Self::MethodNotAllowed(_) => (S::METHOD_NOT_ALLOWED, "MethodNotAllowed"),
            Self::CopySourceCondition => (S::PRECONDITION_FAILED, "PreconditionFailed"),
            Self::Upstream(_) | Self::UpstreamStatus { .. } => (S::BAD_GATEWAY, "UpstreamUnavailable"),
            Self::PreconditionNotHonoured { .. } => (S::BAD_GATEWAY, "UpstreamPreconditionRefused"),
        }
    }

    /// The resource's fence, when the refusal named it: what the feed shows as `fence` (an
    /// object's stamp that refused a write is not one).
    pub fn fence(&self) -> Option<FenceToken> {
        match self {
            Self::Refused(refusal) => refusal.fence(),
            other => other.current_fence(),
        }
    }

    /// The fence a refused writer is told (`Fencing-Token-Current`), when it is known.
    pub fn current_fence(&self) -> Option<FenceToken> {
        match self {
            Self::Refused(refusal) => refusal.current_fence(),
            Self::StaleWhileStreaming { current, .. } => Some(*current),
            _ => None,
        }
    }

    /// The S3 error code.
    pub fn code(&self) -> &'static str {
        self.parts().1
    }

    /// The S3 error response this becomes: status, `<Error>` with code, message and request
    /// id, `Fencing-Token-Current` on stale, `Retry-After` on 503. Rendered here, in the form
    /// the S3 library renders its own: a refusal is the most frequent answer under load.
    pub fn into_response(self, request_id: &str) -> http::Response<s3s::Body> {
        use std::fmt::Write as _;
        let (status, code) = self.parts();
        let mut xml = String::with_capacity(256);
        xml.push_str(r#"<?xml version="1.0" encoding="UTF-8"?><Error><Code>"#);
        xml.push_str(code);
        xml.push_str("</Code><Message>");
        // Written escaped straight into the body: no message string to make and copy again.
        let _ = write!(XmlEscaped(&mut xml), "{self}");
        xml.push_str("</Message>");
        if let Self::WrongRegion { expected, .. } = &self {
            // What clients read to sign again for the right region (s3cmd, the AWS SDKs).
            xml.push_str("<Region>");
            let _ = XmlEscaped(&mut xml).write_str(expected);
            xml.push_str("</Region>");
        }
        xml.push_str("<RequestId>");
        let _ = XmlEscaped(&mut xml).write_str(request_id);
        xml.push_str("</RequestId></Error>");
        let mut resp = http::Response::new(s3s::Body::from(xml));
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        if let Some(current) = self.current_fence() {
            headers.insert(CURRENT_TOKEN_HEADER, HeaderValue::from(current.0));
        }
        let retry_after = match &self {
            Self::Refused(refusal) => refusal.retry_after_s(),
            _ => (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1),
        };
        if let Some(seconds) = retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Ok(id) = HeaderValue::from_str(request_id) {
            headers.insert(crate::aws::amz::X_AMZ_REQUEST_ID, id);
        }
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        resp
    }
}

/// Writes text into an XML body with its special characters escaped by `quick_xml` (most
/// parts of a message have none, and are copied as they are).
struct XmlEscaped<'a>(&'a mut String);

impl std::fmt::Write for XmlEscaped<'_> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        if text.bytes().any(|b| matches!(b, b'<' | b'>' | b'&' | b'\'' | b'"')) {
            self.0.push_str(&quick_xml::escape::escape(text));
        } else {
            self.0.push_str(text);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_text(resp: http::Response<s3s::Body>) -> String {
        use http_body_util::BodyExt;
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_stale_refusal_names_the_fence() {
        let resp = FrontError::from(Refusal::Stale { presented: FenceToken(3), current: FenceToken(9) })
            .into_response("req-1");
        assert_eq!(resp.status(), StatusCode::CONFLICT);
        assert_eq!(resp.headers()[CURRENT_TOKEN_HEADER], "9");
        assert_eq!(resp.headers()["x-amz-request-id"], "req-1");
        assert_eq!(resp.headers()[http::header::CONTENT_TYPE], "application/xml");
        assert!(resp.headers().get(http::header::RETRY_AFTER).is_none());
        let xml = body_text(resp).await;
        assert!(
            xml.starts_with(r#"<?xml version="1.0" encoding="UTF-8"?><Error><Code>FencingTokenStale</Code><Message>"#)
        );
        assert!(xml.ends_with("</Message><RequestId>req-1</RequestId></Error>"), "{xml}");
    }

    #[tokio::test]
    async fn messages_are_escaped_and_503_says_when_to_retry() {
        let resp = FrontError::MethodNotAllowed("<x&y>".into()).into_response("r");
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
        let xml = body_text(resp).await;
        assert!(xml.contains("<Message>method &lt;x&amp;y&gt; is not an S3 method</Message>"), "{xml}");
        let busy = FrontError::PreconditionRace.into_response("r");
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[http::header::RETRY_AFTER], "1");
    }

    /// The message is written escaped piece by piece: the same text as the whole message
    /// escaped at once, whichever piece holds the special characters.
    #[tokio::test]
    async fn a_message_written_in_pieces_is_escaped_as_a_whole() {
        let errors = || {
            [
                FrontError::OutsideLease { lease: "a\"<b>'&".into(), what: "key \"x\" & 'y'".into() },
                FrontError::NonAsciiMetadata("x-amz-meta-<&>".into()),
                FrontError::from(Refusal::Stale { presented: FenceToken(u64::MAX - 1), current: FenceToken(u64::MAX) }),
                FrontError::UnsafeKey,
            ]
        };
        for (error, shown) in errors().into_iter().zip(errors()) {
            let xml = body_text(error.into_response("id<&>\"'")).await;
            let message = quick_xml::escape::escape(shown.to_string()).into_owned();
            assert!(xml.contains(&format!("<Message>{message}</Message>")), "{xml}");
            assert!(xml.ends_with("<RequestId>id&lt;&amp;&gt;&quot;&apos;</RequestId></Error>"), "{xml}");
        }
    }
}
