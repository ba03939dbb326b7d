//! The ETag fencegate last saw per resource of a `conditional` route: the `If-Match` of the
//! resource's next write.

use std::collections::HashMap;
use std::sync::Mutex;

use http::{HeaderName, HeaderValue, header};

use crate::fence::ResourceKey;

/// A bounded map; a forgotten entry only turns the next write into a create (`If-None-Match:
/// *`), which the API refuses with 412 if the resource exists.
pub struct ResourceEtags {
    entries: Mutex<HashMap<ResourceKey, HeaderValue>>,
    entries_max: usize,
}

impl ResourceEtags {
    pub fn new(entries_max: usize) -> Self {
        Self { entries: Mutex::new(HashMap::new()), entries_max }
    }

    /// `If-Match: <last ETag>`, or `If-None-Match: *` when none is known.
    pub fn precondition(&self, resource: &ResourceKey) -> (HeaderName, HeaderValue) {
        match self.entries.lock().expect("etag cache lock").get(resource) {
            Some(etag) => (header::IF_MATCH, etag.clone()),
            None => (header::IF_NONE_MATCH, HeaderValue::from_static("*")),
        }
    }

    pub fn put(&self, resource: ResourceKey, etag: HeaderValue) {
        if self.entries_max == 0 {
            return;
        }
        let mut entries = self.entries.lock().expect("etag cache lock");
        if entries.len() >= self.entries_max && !entries.contains_key(&resource) {
            // Forget an arbitrary eighth rather than track recency on every write.
            let victims: Vec<ResourceKey> = entries.keys().take((self.entries_max / 8).max(1)).cloned().collect();
            for victim in victims {
                entries.remove(&victim);
            }
        }
        entries.insert(resource, etag);
    }

    pub fn forget(&self, resource: &ResourceKey) {
        self.entries.lock().expect("etag cache lock").remove(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_etags_give_if_match_and_unknown_ones_if_none_match() {
        let cache = ResourceEtags::new(2);
        let r = |n: &str| ResourceKey::new(n).unwrap();
        assert_eq!(cache.precondition(&r("a")), (header::IF_NONE_MATCH, HeaderValue::from_static("*")));
        cache.put(r("a"), HeaderValue::from_static("\"v1\""));
        assert_eq!(cache.precondition(&r("a")), (header::IF_MATCH, HeaderValue::from_static("\"v1\"")));
        cache.put(r("b"), HeaderValue::from_static("\"v2\""));
        cache.put(r("c"), HeaderValue::from_static("\"v3\""));
        assert!(cache.entries.lock().unwrap().len() <= 2, "bounded");
        cache.forget(&r("c"));
        assert_eq!(cache.precondition(&r("c")).0, header::IF_NONE_MATCH);
    }
}
