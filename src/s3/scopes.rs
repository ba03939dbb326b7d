//! Credentials restricted to some buckets or key prefixes (`[[credentials]] buckets`).

use http::{HeaderMap, Method};

use super::Target;
use super::error::FrontError;

/// Where a restricted credential may go: `(bucket, key prefix)` pairs, an empty prefix for the
/// whole bucket.
pub(super) struct Scopes(pub(super) Vec<(String, String)>);

impl Scopes {
    pub(super) fn new(entries: &[String]) -> Self {
        Self(
            entries
                .iter()
                .map(|e| match e.split_once('/') {
                    Some((bucket, prefix)) => (bucket.to_owned(), prefix.to_owned()),
                    None => (e.clone(), String::new()),
                })
                .collect(),
        )
    }

    /// Whether every object of `resource` is inside (`crate::lease::FenceScope`'s rule).
    pub(super) fn covers_resource(
        &self,
        resource: &crate::fence::ResourceKey,
        rules: &[crate::config::RuleConfig],
    ) -> bool {
        crate::lease::scope_covers(&self.0, rules, resource)
    }

    fn covers(&self, bucket: &str, key: &str) -> bool {
        self.0.iter().any(|(b, prefix)| b == bucket && key.starts_with(prefix.as_str()))
    }

    /// The object named, a bucket-wide call (allowed on a whole-bucket scope, or a listing
    /// whose `prefix` is inside a scoped prefix), and a copy's source.
    pub(super) fn check(
        &self,
        method: &Method,
        target: &Target,
        query: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<(), FrontError> {
        let out = |what: String| Err(FrontError::OutOfScope(what));
        let Some(bucket) = &target.bucket else {
            return if *method == Method::GET { Ok(()) } else { out("the service".into()) };
        };
        match &target.key {
            Some(key) if !self.covers(bucket, key) => return out(format!("{bucket}/{key}")),
            Some(_) => {}
            None => {
                let whole = self.0.iter().any(|(b, prefix)| b == bucket && prefix.is_empty());
                let listed_prefix = form_urlencoded::parse(query.unwrap_or("").as_bytes())
                    .find(|(name, _)| name == "prefix")
                    .map(|(_, value)| value.into_owned());
                let listing_inside = *method == Method::GET && listed_prefix.is_some_and(|p| self.covers(bucket, &p));
                if !whole && !listing_inside {
                    return out(format!("bucket {bucket}"));
                }
            }
        }
        if let Some(source) = headers.get(crate::aws::amz::X_AMZ_COPY_SOURCE).and_then(|v| v.to_str().ok()) {
            let source = source.split('?').next().unwrap_or("");
            let source = crate::net::percent::decode(source.trim_start_matches('/')).unwrap_or_default();
            let (b, k) = source.split_once('/').unwrap_or((&*source, ""));
            if !self.covers(b, k) {
                return out(format!("the copy source {source}"));
            }
        }
        Ok(())
    }
}
