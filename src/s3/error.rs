//! Every error of the S3 front, and the one place it becomes an S3 error response.
//!
//! Each variant says who is at fault: the client (4xx, retrying the same request will not
//! help), the fence store or the upstream (5xx, a retry may help), or fencegate itself.

use http::{HeaderMap, HeaderValue, StatusCode};
use s3s::{S3Error, S3ErrorCode};

use crate::fence::{AdmitError, FenceToken, ResourceKeyError, StoreError, TokenParseError};
use crate::upstream::UpstreamError;

/// The response header that tells a rejected writer the current fence.
pub const CURRENT_TOKEN_HEADER: &str = "fencing-token-current";

#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("this write needs a fencing token")]
    MissingToken,
    #[error("invalid fencing token: {0}")]
    InvalidToken(TokenParseError),
    #[error("the fencing token appears more than once in the {0} header")]
    RepeatedToken(&'static str),
    #[error("a presigned request's {0} header counts only if the signature covers it: list it in X-Amz-SignedHeaders")]
    UnsignedOnPresigned(String),
    #[error("X-Amz-Expires must be at most 604800 seconds (7 days)")]
    PresignTooLong,
    #[error("the fencing token header ({header}) and object metadata ({metadata}) disagree")]
    TokenMismatch { header: FenceToken, metadata: FenceToken },
    #[error("invalid fencing resource: {0}")]
    InvalidResource(ResourceKeyError),
    #[error("the key belongs to resource {bound:?} by a rule, not to {presented:?}")]
    ResourceMismatch { bound: String, presented: String },
    #[error("fencing token {presented} is older than the current fence {current}")]
    Stale { presented: FenceToken, current: FenceToken },
    #[error(
        "fencing token {presented} became stale while its body was streaming (fence {current}); the upload was cut off and nothing was committed"
    )]
    StaleWhileStreaming { presented: FenceToken, current: FenceToken },
    #[error(
        "fencing token {presented} is above the fence; only registrations and lease grants raise it (fencing.advance = \"registration\")"
    )]
    Unregistered { presented: FenceToken, current: Option<FenceToken> },
    #[error("fence state unknown; the write was not forwarded")]
    StoreUnavailable(#[source] StoreError),
    #[error("older writes on the resource were still in flight after {waited_ms} ms; retry")]
    DrainTimeout { waited_ms: u64 },
    #[error("{max} writes are already in flight on the resource; retry")]
    TooManyInflight { max: usize },
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
    #[error(
        "the local upstream stores objects as files: a key with an empty path segment (`a//b`, `/a`) would be the \
         same file as another key, so it is refused"
    )]
    EmptySegmentOnLocal,
    #[error(
        "the local upstream holds keys of at most {max} bytes in this bucket (it names a file after the key, and a \
         file name is at most 255 bytes); use an S3 upstream for longer keys"
    )]
    KeyTooLongOnLocal { max: usize },
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
        match e {
            AdmitError::Stale { presented, current } => Self::Stale { presented, current },
            AdmitError::StoreUnavailable(source) => Self::StoreUnavailable(source),
            AdmitError::DrainTimeout { waited_ms } => Self::DrainTimeout { waited_ms },
            AdmitError::TooManyInflight { max } => Self::TooManyInflight { max },
            AdmitError::Unregistered { presented, current } => Self::Unregistered { presented, current },
        }
    }
}

impl FrontError {
    /// The label of `fencegate_decisions_total` for errors that are decisions.
    pub fn decision(&self) -> &'static str {
        match self {
            Self::MissingToken => "missing_token",
            Self::InvalidToken(_)
            | Self::RepeatedToken(_)
            | Self::TokenMismatch { .. }
            | Self::UnsignedOnPresigned(_)
            | Self::PresignTooLong => "invalid_token",
            Self::LeaseTokenMismatch { .. } => "invalid_token",
            Self::InvalidResource(_) | Self::ResourceMismatch { .. } | Self::LeaseResourceMismatch { .. } => {
                "invalid_resource"
            }
            Self::LeaseExpired => "lease_expired",
            Self::Stale { .. } | Self::StaleWhileStreaming { .. } => "stale",
            Self::Unregistered { .. } => "unregistered",
            Self::StoreUnavailable(_) => "store_unavailable",
            Self::DrainTimeout { .. } => "drain_timeout",
            Self::TooManyInflight { .. } => "too_many_inflight",
            _ => "error",
        }
    }

    fn parts(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            Self::MissingToken => (S::PRECONDITION_REQUIRED, "FencingTokenRequired"),
            Self::InvalidToken(_)
            | Self::RepeatedToken(_)
            | Self::TokenMismatch { .. }
            | Self::UnsignedOnPresigned(_) => (S::BAD_REQUEST, "InvalidFencingToken"),
            Self::PresignTooLong => (S::BAD_REQUEST, "AuthorizationQueryParametersError"),
            Self::InvalidResource(_) => (S::BAD_REQUEST, "InvalidFencingResource"),
            Self::ResourceMismatch { .. } => (S::BAD_REQUEST, "FencingResourceMismatch"),
            Self::Stale { .. } | Self::StaleWhileStreaming { .. } => (S::CONFLICT, "FencingTokenStale"),
            Self::Unregistered { .. } => (S::CONFLICT, "FencingTokenUnregistered"),
            Self::StoreUnavailable(_) => (S::SERVICE_UNAVAILABLE, "FenceStoreUnavailable"),
            Self::DrainTimeout { .. } | Self::TooManyInflight { .. } | Self::PreconditionRace => {
                (S::SERVICE_UNAVAILABLE, "SlowDown")
            }
            Self::TooLarge { .. } => (S::BAD_REQUEST, "EntityTooLarge"),
            Self::UnsafeKey | Self::EmptySegmentOnLocal | Self::NonAsciiMetadata(_) => {
                (S::BAD_REQUEST, "InvalidArgument")
            }
            Self::KeyTooLongOnLocal { .. } => (S::BAD_REQUEST, "KeyTooLongError"),
            Self::ClientPrecondition => (S::PRECONDITION_FAILED, "PreconditionFailed"),
            Self::OutOfScope(_) | Self::OutsideLease { .. } => (S::FORBIDDEN, "AccessDenied"),
            Self::LeaseExpired => (S::FORBIDDEN, "ExpiredToken"),
            Self::LeaseTokenMismatch { .. } => (S::BAD_REQUEST, "InvalidFencingToken"),
            Self::LeaseResourceMismatch { .. } => (S::BAD_REQUEST, "FencingResourceMismatch"),
            Self::ClientNoSuchKey => (S::NOT_FOUND, "NoSuchKey"),
            Self::NoSuchUpload => (S::NOT_FOUND, "NoSuchUpload"),
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
        }
    }

    /// The S3 error code.
    pub fn code(&self) -> &'static str {
        self.parts().1
    }

    /// The S3 error this becomes: status, code, message, and `Fencing-Token-Current` on stale.
    pub fn into_s3_error(self, request_id: &str) -> S3Error {
        let (status, code) = self.parts();
        let code = S3ErrorCode::from_bytes(code.as_bytes()).expect("error codes are ASCII");
        let mut error = S3Error::with_message(code, self.to_string());
        error.set_status_code(status);
        error.set_request_id(request_id);
        let mut headers = HeaderMap::new();
        if let Self::Stale { current, .. }
        | Self::StaleWhileStreaming { current, .. }
        | Self::Unregistered { current: Some(current), .. } = &self
        {
            headers.insert(CURRENT_TOKEN_HEADER, HeaderValue::from(current.0));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        headers.insert("x-amz-request-id", HeaderValue::from_str(request_id).expect("request ids are ASCII"));
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        error.set_headers(headers);
        error
    }
}
