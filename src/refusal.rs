//! The refusals of the fencing protocol, the same on both fronts (the S3 front in `src/s3/` and
//! the API gateway in `src/gateway/`): a token or resource that cannot be read, and what
//! admission refuses. Each says whose fault it is and whether a retry can help; each front
//! renders it in its own protocol (S3 XML in `src/s3/error.rs`, problem+json in
//! `src/gateway/error.rs`) with the same status, the same `Fencing-Token-Current` and the same
//! `Retry-After`. The one difference is deliberate: S3 clients know a busy resource as
//! `SlowDown` (their SDKs back off on it), so the S3 front names both busy refusals so.

use http::{HeaderMap, HeaderName, StatusCode};

use crate::fence::{AdmitError, FenceToken, Full, ResourceKeyError, StoreError, TokenParseError};

/// The response header that tells a refused writer the current fence.
pub const CURRENT_TOKEN_HEADER: HeaderName = HeaderName::from_static("fencing-token-current");

#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("this write needs a fencing token")]
    MissingToken,
    #[error("invalid fencing token: {0}")]
    InvalidToken(TokenParseError),
    #[error("the fencing token appears more than once in the {0} header")]
    RepeatedToken(&'static str),
    #[error("invalid fencing resource: {0}")]
    InvalidResource(ResourceKeyError),
    #[error("the request belongs to resource {bound:?} by its rule or route, not to {presented:?}")]
    ResourceMismatch { bound: String, presented: String },
    #[error("fencing token {presented} is older than the current fence {current}")]
    Stale { presented: FenceToken, current: FenceToken },
    /// The object's stamp refused it (G4), not the resource's fence, which admitted it: the
    /// object was last written with `stamp`, under a resource its writer named, or under a
    /// fence the store has since lost.
    #[error(
        "fencing token {presented} is older than this object's stamp {stamp}, the token that last wrote it \
         (the resource's fence admitted {presented}: the object was written under another resource, or under \
         a fence the store lost)"
    )]
    StaleByStamp { presented: FenceToken, stamp: FenceToken },
    #[error(
        "fencing token {presented} is above the fence, and here only registrations and lease grants raise it (advance = \"registration\")"
    )]
    Unregistered { presented: FenceToken, current: Option<FenceToken> },
    #[error("fence state unknown; the write was not forwarded{}", said_why(.0))]
    StoreUnavailable(#[source] StoreError),
    #[error("older writes on the resource were still in flight after {waited_ms} ms; retry")]
    DrainTimeout { waited_ms: u64 },
    #[error("{max} writes are already in flight on the resource; retry")]
    TooManyInflight { max: usize },
    #[error("this caller already has {max} writes in flight on the resource (fencing.inflight_per_caller_max); retry")]
    TooManyInflightForCaller { max: usize },
    /// A record fencegate would keep for the caller (an upload's), refused by its bounds:
    /// complete or abort uploads, or retry later. Never a fence operation.
    #[error("nothing was created: {0}; complete or abort uploads, or retry later")]
    RecordsFull(Full),
}

/// `Retry-After` of [`Refusal::RecordsFull`].
const RECORDS_FULL_RETRY_AFTER_S: u64 = 30;

/// Whose fault a refusal is, which says whether the same request can succeed later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request itself (a missing, malformed or stale token, a wrong resource): the same
    /// request is refused again.
    Client,
    /// The fence store could not be read or written: a retry may succeed.
    Store,
    /// Other writes hold the resource: a retry after `Retry-After` may succeed.
    Busy,
}

/// The store's reason, for a refusal that says when a retry can succeed (a quiet period, the
/// hold after an unclean start): the caller and its operator should know what is waited for.
/// Other store errors stay in the log (they may name hosts).
fn said_why(error: &StoreError) -> String {
    if error.retry_after_ms().is_some() { format!(": {error}") } else { String::new() }
}

impl From<AdmitError> for Refusal {
    fn from(e: AdmitError) -> Self {
        match e {
            AdmitError::Stale { presented, current } => Self::Stale { presented, current },
            AdmitError::StoreUnavailable(source) => Self::StoreUnavailable(source),
            AdmitError::DrainTimeout { waited_ms } => Self::DrainTimeout { waited_ms },
            AdmitError::TooManyInflight { max } => Self::TooManyInflight { max },
            AdmitError::TooManyInflightForCaller { max } => Self::TooManyInflightForCaller { max },
            AdmitError::Unregistered { presented, current } => Self::Unregistered { presented, current },
        }
    }
}

impl Refusal {
    pub fn fault(&self) -> Fault {
        match self {
            Self::StoreUnavailable(_) => Fault::Store,
            Self::DrainTimeout { .. }
            | Self::TooManyInflight { .. }
            | Self::TooManyInflightForCaller { .. }
            | Self::RecordsFull(_) => Fault::Busy,
            _ => Fault::Client,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingToken => StatusCode::PRECONDITION_REQUIRED,
            Self::InvalidToken(_)
            | Self::RepeatedToken(_)
            | Self::InvalidResource(_)
            | Self::ResourceMismatch { .. } => StatusCode::BAD_REQUEST,
            Self::Stale { .. } | Self::StaleByStamp { .. } | Self::Unregistered { .. } => StatusCode::CONFLICT,
            Self::StoreUnavailable(_)
            | Self::DrainTimeout { .. }
            | Self::TooManyInflight { .. }
            | Self::TooManyInflightForCaller { .. }
            | Self::RecordsFull(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The error code, as problem+json names it (`type` ends in it).
    pub fn code(&self) -> &'static str {
        match self {
            Self::MissingToken => "FencingTokenRequired",
            Self::InvalidToken(_) | Self::RepeatedToken(_) => "InvalidFencingToken",
            Self::InvalidResource(_) => "InvalidFencingResource",
            Self::ResourceMismatch { .. } => "FencingResourceMismatch",
            Self::Stale { .. } | Self::StaleByStamp { .. } => "FencingTokenStale",
            Self::Unregistered { .. } => "FencingTokenUnregistered",
            Self::StoreUnavailable(_) => "FenceStoreUnavailable",
            Self::DrainTimeout { .. } => "FencingDrainTimeout",
            Self::TooManyInflight { .. } | Self::TooManyInflightForCaller { .. } => "TooManyInflightWrites",
            // As the API gateway names its full idempotency records.
            Self::RecordsFull(_) => "SlowDown",
        }
    }

    /// The error code as the S3 front names it: S3's `SlowDown` for a busy resource.
    pub fn s3_code(&self) -> &'static str {
        match self.fault() {
            Fault::Busy => "SlowDown",
            Fault::Client | Fault::Store => self.code(),
        }
    }

    /// The label of `fencegate_decisions_total`.
    pub fn decision(&self) -> &'static str {
        match self {
            Self::MissingToken => "missing_token",
            Self::InvalidToken(_) | Self::RepeatedToken(_) => "invalid_token",
            Self::InvalidResource(_) | Self::ResourceMismatch { .. } => "invalid_resource",
            Self::Stale { .. } | Self::StaleByStamp { .. } => "stale",
            Self::Unregistered { .. } => "unregistered",
            Self::StoreUnavailable(_) => "store_unavailable",
            Self::DrainTimeout { .. } => "drain_timeout",
            Self::TooManyInflight { .. } | Self::TooManyInflightForCaller { .. } => "too_many_inflight",
            Self::RecordsFull(_) => "records_full",
        }
    }

    /// When a retry may succeed (`Retry-After`, whole seconds), for refusals a retry can help:
    /// at once for a busy resource or a store that did not answer, when the quiet period ends
    /// for a store that lost its state.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            Self::StoreUnavailable(e) if e.retry_after_ms().is_some() => {
                Some(e.retry_after_ms().unwrap_or(1000).div_ceil(1000).max(1))
            }
            _ if self.fault() == Fault::Client => None,
            // Records free up as uploads end, not within a second.
            Self::RecordsFull(_) => Some(RECORDS_FULL_RETRY_AFTER_S),
            _ => Some(1),
        }
    }

    /// The resource's fence, when the refusal named it (the feed's `fence`; never an
    /// object's stamp, which is no fence of the resource).
    pub fn fence(&self) -> Option<FenceToken> {
        match self {
            Self::StaleByStamp { .. } => None,
            other => other.current_fence(),
        }
    }

    /// The fence a refused writer is told (`Fencing-Token-Current`), when it is known.
    pub fn current_fence(&self) -> Option<FenceToken> {
        match self {
            // The token a write must be newer than to land on this object.
            Self::Stale { current, .. }
            | Self::StaleByStamp { stamp: current, .. }
            | Self::Unregistered { current: Some(current), .. } => Some(*current),
            _ => None,
        }
    }
}

/// The token a request presents in `name`: absent, or one value parsed by the token rules (`FenceToken::parse`)
/// (`what` names the header in the refusal).
pub fn single_token(headers: &HeaderMap, name: &HeaderName, what: &'static str) -> Result<Option<FenceToken>, Refusal> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(Refusal::RepeatedToken(what));
    }
    FenceToken::parse(first.as_bytes()).map(Some).map_err(Refusal::InvalidToken)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whose_fault_decides_the_status_and_whether_to_retry() {
        let stale = Refusal::Stale { presented: FenceToken(3), current: FenceToken(9) };
        assert_eq!(
            (stale.fault(), stale.status(), stale.current_fence()),
            (Fault::Client, StatusCode::CONFLICT, Some(FenceToken(9)))
        );
        let busy = Refusal::DrainTimeout { waited_ms: 10 };
        assert_eq!((busy.fault(), busy.status()), (Fault::Busy, StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!((busy.code(), busy.s3_code()), ("FencingDrainTimeout", "SlowDown"));
        let store = Refusal::StoreUnavailable(StoreError::Backend("down".into()));
        assert_eq!((store.fault(), store.s3_code()), (Fault::Store, "FenceStoreUnavailable"));
        assert_eq!(Refusal::Unregistered { presented: FenceToken(5), current: None }.current_fence(), None);
        assert_eq!((stale.retry_after_s(), busy.retry_after_s(), store.retry_after_s()), (None, Some(1), Some(1)));
        let quiet = Refusal::StoreUnavailable(StoreError::Recovering { retry_after_ms: 41_250 });
        assert_eq!((quiet.status(), quiet.retry_after_s()), (StatusCode::SERVICE_UNAVAILABLE, Some(42)));
    }

    /// An object's stamp is what a write must pass there (`Fencing-Token-Current`), never
    /// shown as the resource's fence, which admitted the write.
    #[test]
    fn a_stamp_is_told_as_the_bar_and_never_as_the_fence() {
        let by_stamp = Refusal::StaleByStamp { presented: FenceToken(3), stamp: FenceToken(4) };
        assert_eq!((by_stamp.status(), by_stamp.code()), (StatusCode::CONFLICT, "FencingTokenStale"));
        assert_eq!((by_stamp.current_fence(), by_stamp.fence()), (Some(FenceToken(4)), None));
        let message = by_stamp.to_string();
        assert!(message.contains("this object's stamp 4") && !message.contains("current fence"), "{message}");
        let stale = Refusal::Stale { presented: FenceToken(3), current: FenceToken(9) };
        assert_eq!(stale.fence(), Some(FenceToken(9)));
    }

    #[test]
    fn a_token_header_is_read_once() {
        let name = HeaderName::from_static("fencing-token");
        let mut headers = HeaderMap::new();
        assert!(matches!(single_token(&headers, &name, "fencing token"), Ok(None)));
        headers.append(&name, "7".parse().unwrap());
        assert!(matches!(single_token(&headers, &name, "fencing token"), Ok(Some(FenceToken(7)))));
        headers.append(&name, "8".parse().unwrap());
        assert!(matches!(single_token(&headers, &name, "fencing token"), Err(Refusal::RepeatedToken(_))));
        let bad: HeaderMap = [(name.clone(), "0x10".parse().unwrap())].into_iter().collect();
        assert!(matches!(single_token(&bad, &name, "fencing token"), Err(Refusal::InvalidToken(_))));
    }
}
