//! What fencegate knows of objects at the upstream: their ETag (for the precondition of the
//! next write) and their fencing stamp (G4). See `docs/design.md`, section 4.

use std::collections::HashMap;
use std::sync::Mutex;

use http::{HeaderValue, Method, StatusCode};
use s3s::Body;

use super::error::FrontError;
use super::wire::METADATA_TOKEN;
use crate::fence::FenceToken;
use crate::upstream::Upstream;

/// An object as last seen at the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectState {
    Absent,
    Present { etag: HeaderValue, stamp: Option<FenceToken> },
}

impl ObjectState {
    /// Whether `other` is the same object version as far as a precondition can tell (its ETag,
    /// or both absent): a write conditional on `self` would have passed on `other`.
    pub fn same_version(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Absent, Self::Absent) => true,
            (Self::Present { etag: a, .. }, Self::Present { etag: b, .. }) => a == b,
            _ => false,
        }
    }

    /// The precondition header that makes a write to this object conditional on it.
    pub fn precondition(&self) -> (http::HeaderName, HeaderValue) {
        match self {
            Self::Absent => (http::header::IF_NONE_MATCH, HeaderValue::from_static("*")),
            Self::Present { etag, .. } => (http::header::IF_MATCH, etag.clone()),
        }
    }

    /// The stamp, if it is newer than `token`: the write is stale whatever the fence store says.
    pub fn newer_stamp(&self, token: FenceToken) -> Option<FenceToken> {
        match self {
            Self::Present { stamp, .. } => crate::fence::stale_below(*stamp, token),
            Self::Absent => None,
        }
    }
}

/// The client's own precondition on the object it writes (`If-Match`, `If-None-Match`). It is
/// composed with fencegate's, never replaced: the client's is checked against the state
/// fencegate's own precondition names, so the upstream's enforcement of fencegate's covers both.
#[derive(Debug, Clone, Default)]
pub struct ClientCondition {
    if_match: Option<HeaderValue>,
    if_none_match: Option<HeaderValue>,
}

/// How a client's condition fails, answered as S3 does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionFailed {
    /// 412 `PreconditionFailed`.
    Precondition,
    /// 404 `NoSuchKey`: `If-Match` on an object that does not exist.
    NoSuchKey,
}

impl ClientCondition {
    /// The condition the request's headers state. A header sent on several lines is one list
    /// (RFC 9110, 5.3): none of its lines is dropped.
    pub fn of(headers: &http::HeaderMap) -> Self {
        Self {
            if_match: list(headers, http::header::IF_MATCH),
            if_none_match: list(headers, http::header::IF_NONE_MATCH),
        }
    }

    pub fn is_none(&self) -> bool {
        self.if_match.is_none() && self.if_none_match.is_none()
    }

    /// Whether the object as `state` fails the condition, and how.
    pub fn failure(&self, state: &ObjectState) -> Option<ConditionFailed> {
        if let Some(wanted) = &self.if_match {
            match state {
                ObjectState::Absent => return Some(ConditionFailed::NoSuchKey),
                ObjectState::Present { etag, .. } if !etag_listed(wanted, etag, Comparison::Strong) => {
                    return Some(ConditionFailed::Precondition);
                }
                ObjectState::Present { .. } => {}
            }
        }
        if let (Some(unwanted), ObjectState::Present { etag, .. }) = (&self.if_none_match, state)
            && etag_listed(unwanted, etag, Comparison::Weak)
        {
            return Some(ConditionFailed::Precondition);
        }
        None
    }
}

/// Every line of header `name`, as one comma-separated value.
fn list(headers: &http::HeaderMap, name: http::header::HeaderName) -> Option<HeaderValue> {
    let mut lines = headers.get_all(&name).iter();
    let first = lines.next()?;
    let rest: Vec<&[u8]> = lines.map(HeaderValue::as_bytes).collect();
    if rest.is_empty() {
        return Some(first.clone());
    }
    let joined = std::iter::once(first.as_bytes()).chain(rest).collect::<Vec<_>>().join(&b", "[..]);
    // Joined lines of header values are a header value; the fallback is never taken.
    Some(HeaderValue::from_bytes(&joined).unwrap_or_else(|_| HeaderValue::from_static("\"\"")))
}

/// RFC 9110, 8.8.3.2: `If-Match` compares strongly (a weak tag never matches), `If-None-Match`
/// weakly.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Comparison {
    Strong,
    Weak,
}

/// Whether `etag` is in the header's list (`*` is every ETag). Quotes are optional, as S3
/// takes them.
pub(super) fn etag_listed(list: &HeaderValue, etag: &HeaderValue, comparison: Comparison) -> bool {
    let bare = |s: &str| s.trim().trim_start_matches("W/").trim_matches('"').to_owned();
    let etag = bare(etag.to_str().unwrap_or(""));
    list.to_str().unwrap_or("").split(',').any(|item| {
        let item = item.trim();
        item == "*" || (bare(item) == etag && (comparison == Comparison::Weak || !item.starts_with("W/")))
    })
}

/// A bounded map of the ETags fencegate last saw per object.
pub struct EtagCache {
    entries: Mutex<HashMap<String, ObjectState>>,
    entries_max: usize,
}

impl EtagCache {
    pub fn new(entries_max: usize) -> Self {
        Self { entries: Mutex::new(HashMap::new()), entries_max }
    }

    pub fn get(&self, object: &str) -> Option<ObjectState> {
        self.entries.lock().expect("etag cache lock").get(object).cloned()
    }

    pub fn put(&self, object: String, state: ObjectState) {
        if self.entries_max == 0 {
            return;
        }
        let mut entries = self.entries.lock().expect("etag cache lock");
        if entries.len() >= self.entries_max && !entries.contains_key(&object) {
            // Forget an arbitrary eighth: a miss only costs one HEAD.
            let drop_n = (self.entries_max / 8).max(1);
            let victims: Vec<String> = entries.keys().take(drop_n).cloned().collect();
            for v in victims {
                entries.remove(&v);
            }
        }
        entries.insert(object, state);
    }

    pub fn forget(&self, object: &str) {
        self.entries.lock().expect("etag cache lock").remove(object);
    }
}

/// Reads an object's head at the upstream.
pub async fn head(upstream: &dyn Upstream, raw_path: &str) -> Result<ObjectState, FrontError> {
    let req = http::Request::builder()
        .method(Method::HEAD)
        .uri(raw_path)
        .body(Body::empty())
        .map_err(|_| FrontError::UnsafeKey)?;
    let resp = upstream.send(req).await.map_err(FrontError::Upstream)?;
    match resp.status() {
        StatusCode::NOT_FOUND => Ok(ObjectState::Absent),
        // An object without an ETag cannot be written conditionally, nor taken for absent.
        s if s.is_success() => state_from_headers(resp.headers())
            .ok_or(FrontError::UpstreamStatus { step: "the object head read (no ETag)", status: s }),
        status => Err(FrontError::UpstreamStatus { step: "the object head read", status }),
    }
}

/// The object state a successful write response or head describes, if it names an ETag.
pub fn state_from_headers(headers: &http::HeaderMap) -> Option<ObjectState> {
    let etag = headers.get(http::header::ETAG)?.clone();
    let stamp = headers.get(METADATA_TOKEN).and_then(|v| FenceToken::parse(v.as_bytes()).ok());
    Some(ObjectState::Present { etag, stamp })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_condition_is_judged_as_s3_does() {
        let present = ObjectState::Present { etag: HeaderValue::from_static("\"abc\""), stamp: None };
        let cond = |name: http::HeaderName, value: &'static str| {
            let mut h = http::HeaderMap::new();
            h.insert(name, HeaderValue::from_static(value));
            ClientCondition::of(&h)
        };
        let create_only = cond(http::header::IF_NONE_MATCH, "*");
        assert_eq!(create_only.failure(&present), Some(ConditionFailed::Precondition));
        assert_eq!(create_only.failure(&ObjectState::Absent), None);
        let swap = cond(http::header::IF_MATCH, "\"abc\"");
        assert_eq!(swap.failure(&present), None);
        assert_eq!(cond(http::header::IF_MATCH, "abc").failure(&present), None, "quotes aside");
        assert_eq!(cond(http::header::IF_MATCH, "\"x\", \"abc\"").failure(&present), None, "a list");
        assert_eq!(cond(http::header::IF_MATCH, "\"other\"").failure(&present), Some(ConditionFailed::Precondition));
        assert_eq!(swap.failure(&ObjectState::Absent), Some(ConditionFailed::NoSuchKey));
        assert_eq!(cond(http::header::IF_MATCH, "*").failure(&present), None);
        assert_eq!(cond(http::header::IF_MATCH, "W/\"abc\"").failure(&present), Some(ConditionFailed::Precondition));
        assert_eq!(
            cond(http::header::IF_NONE_MATCH, "W/\"abc\"").failure(&present),
            Some(ConditionFailed::Precondition)
        );
        assert!(ClientCondition::of(&http::HeaderMap::new()).is_none());
    }

    /// A condition sent on two lines is one list: the second line's ETag counts (it was
    /// dropped, and a write the client's `If-None-Match` forbade went ahead).
    #[test]
    fn a_condition_on_several_lines_is_one_list() {
        let present = ObjectState::Present { etag: HeaderValue::from_static("\"abc\""), stamp: None };
        let mut h = http::HeaderMap::new();
        h.append(http::header::IF_NONE_MATCH, HeaderValue::from_static("\"other\""));
        h.append(http::header::IF_NONE_MATCH, HeaderValue::from_static("\"abc\""));
        assert_eq!(ClientCondition::of(&h).failure(&present), Some(ConditionFailed::Precondition));
        let mut h = http::HeaderMap::new();
        h.append(http::header::IF_MATCH, HeaderValue::from_static("\"other\""));
        h.append(http::header::IF_MATCH, HeaderValue::from_static("\"abc\""));
        assert_eq!(ClientCondition::of(&h).failure(&present), None);
    }
}
