//! What fencegate knows of objects at the upstream: their ETag (for the precondition of the
//! next write) and their fencing stamp (G4). See `docs/design.md`, section 4.

use std::collections::HashMap;
use std::sync::Mutex;

use http::{HeaderValue, Method, StatusCode};
use s3s::Body;

use super::error::FrontError;
use super::wire::METADATA_TOKEN_HEADER;
use crate::fence::FenceToken;
use crate::upstream::Upstream;

/// An object as last seen at the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectState {
    Absent,
    Present { etag: HeaderValue, stamp: Option<FenceToken> },
}

impl ObjectState {
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
            Self::Present { stamp: Some(s), .. } if *s > token => Some(*s),
            _ => None,
        }
    }
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
    let req =
        http::Request::builder().method(Method::HEAD).uri(raw_path).body(Body::empty()).expect("a path is a valid URI");
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
    let stamp = headers.get(METADATA_TOKEN_HEADER).and_then(|v| FenceToken::parse(v.as_bytes()).ok());
    Some(ObjectState::Present { etag, stamp })
}
