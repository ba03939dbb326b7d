//! The fencing wire contract on S3 requests: which token a write presents, and which resource
//! it writes to (README.md, "Attaching the token").

use http::{HeaderMap, HeaderName};

use super::error::FrontError;
use super::signed::Signature;
use crate::config::{FencingConfig, RuleConfig};
use crate::fence::{FenceToken, ResourceKey};
use crate::refusal::{Refusal, single_token};

/// The metadata header SDKs send for object metadata `fencing-token`.
pub const METADATA_TOKEN_HEADER: &str = "x-amz-meta-fencing-token";
/// [`METADATA_TOKEN_HEADER`] as a header name, for lookups (`crate::aws::amz`).
pub const METADATA_TOKEN: HeaderName = HeaderName::from_static(METADATA_TOKEN_HEADER);

/// The header names of the wire contract (configurable) and the rules binding keys to
/// resources.
#[derive(Debug, Clone)]
pub struct WireContract {
    pub token_header: HeaderName,
    pub resource_header: HeaderName,
    pub rules: Vec<RuleConfig>,
}

impl WireContract {
    /// The contract `[fencing]` sets: its header names and its rules.
    pub fn new(fencing: &FencingConfig) -> anyhow::Result<Self> {
        Ok(Self {
            token_header: HeaderName::from_bytes(fencing.token_header.as_bytes())?,
            resource_header: HeaderName::from_bytes(fencing.resource_header.as_bytes())?,
            rules: fencing.rules.clone(),
        })
    }

    /// The presented token: the token header, or the object metadata, or both if they agree.
    pub fn token(&self, headers: &HeaderMap) -> Result<Option<FenceToken>, FrontError> {
        let header = single_token(headers, &self.token_header, "fencing token")?;
        let metadata = single_token(headers, &HeaderName::from_static(METADATA_TOKEN_HEADER), "metadata")?;
        match (header, metadata) {
            (Some(h), Some(m)) if h != m => Err(FrontError::TokenMismatch { header: h, metadata: m }),
            (h, m) => Ok(h.or(m)),
        }
    }

    /// The resource the most specific rule binds `bucket`/`key` to, if one does.
    pub fn rule_resource(&self, bucket: &str, key: &str) -> Option<&str> {
        self.rules
            .iter()
            .filter(|r| r.bucket == bucket && key.starts_with(&r.prefix))
            .max_by_key(|r| r.prefix.len())
            .map(|r| r.resource.as_str())
    }

    /// The resource a write to `bucket/key` belongs to: the rule that binds the key (a
    /// disagreeing header is refused), else the header, else the object itself.
    pub fn resource(&self, headers: &HeaderMap, bucket: &str, key: &str) -> Result<ResourceKey, FrontError> {
        let presented = match headers.get(&self.resource_header) {
            Some(v) => Some(
                v.to_str().map_err(|_| Refusal::InvalidResource(crate::fence::ResourceKeyError::ControlCharacter))?,
            ),
            None => None,
        };
        let name = match (self.rule_resource(bucket, key), presented) {
            (Some(bound), Some(p)) if p != bound => {
                return Err(Refusal::ResourceMismatch { bound: bound.to_owned(), presented: p.to_owned() }.into());
            }
            (Some(bound), _) => bound.to_owned(),
            (None, Some(p)) => p.to_owned(),
            (None, None) => {
                let mut name = String::with_capacity(bucket.len() + 1 + key.len());
                name.push_str(bucket);
                name.push('/');
                name.push_str(key);
                name
            }
        };
        Ok(ResourceKey::new(&name).map_err(Refusal::InvalidResource)?)
    }
}

impl WireContract {
    /// The fencing headers count only if the signature covers them (docs/security.md, "Signatures"): on a
    /// presigned URL whoever holds it adds headers at will, and a header-signed request
    /// captured on its way can be sent again with an unsigned header added. SigV2 covers
    /// `x-amz-*` headers only.
    pub fn check_signed(&self, signature: &Signature, headers: &HeaderMap) -> Result<(), FrontError> {
        for name in [&self.token_header, &self.resource_header, &METADATA_TOKEN] {
            if headers.contains_key(name) && !signature.covers(name.as_str()) {
                return Err(FrontError::Unsigned(name.as_str().to_owned()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contract(rules: Vec<RuleConfig>) -> WireContract {
        WireContract {
            token_header: HeaderName::from_static("fencing-token"),
            resource_header: HeaderName::from_static("fencing-resource"),
            rules,
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_signed_fencing_headers_count() {
        let c = contract(vec![]);
        let token = headers(&[("fencing-token", "7")]);
        let resource = headers(&[("fencing-resource", "job:a")]);
        let metadata = headers(&[(METADATA_TOKEN_HEADER, "7")]);
        for presigned in [true, false] {
            let host_only = Signature::V4 { signed: "host;x-amz-date".into(), presigned };
            for h in [&token, &resource, &metadata] {
                assert!(matches!(c.check_signed(&host_only, h), Err(FrontError::Unsigned(_))), "{h:?}");
            }
            let signed = Signature::V4 { signed: "fencing-token;host".into(), presigned };
            assert!(c.check_signed(&signed, &token).is_ok());
            assert!(c.check_signed(&host_only, &HeaderMap::new()).is_ok());
        }
        // SigV2 signs `x-amz-*` headers only.
        for presigned in [true, false] {
            let v2 = Signature::V2 { presigned };
            assert!(c.check_signed(&v2, &token).is_err());
            assert!(c.check_signed(&v2, &resource).is_err());
            assert!(c.check_signed(&v2, &metadata).is_ok());
        }
    }

    #[test]
    fn token_comes_from_header_or_metadata_and_both_must_agree() {
        let c = contract(vec![]);
        assert_eq!(c.token(&headers(&[])).unwrap(), None);
        assert_eq!(c.token(&headers(&[("fencing-token", "12")])).unwrap(), Some(FenceToken(12)));
        assert_eq!(c.token(&headers(&[(METADATA_TOKEN_HEADER, "12")])).unwrap(), Some(FenceToken(12)));
        assert!(c.token(&headers(&[("fencing-token", "12"), (METADATA_TOKEN_HEADER, "12")])).is_ok());
        assert!(matches!(
            c.token(&headers(&[("fencing-token", "12"), (METADATA_TOKEN_HEADER, "11")])),
            Err(FrontError::TokenMismatch { .. })
        ));
        assert!(matches!(
            c.token(&headers(&[("fencing-token", "0x10")])),
            Err(FrontError::Refused(Refusal::InvalidToken(_)))
        ));
        assert!(matches!(
            c.token(&headers(&[("fencing-token", "1"), ("fencing-token", "2")])),
            Err(FrontError::Refused(Refusal::RepeatedToken(_)))
        ));
    }

    #[test]
    fn rules_bind_prefixes_and_refuse_a_disagreeing_header() {
        let rule = RuleConfig { bucket: "b".into(), prefix: "jobs/".into(), resource: "job:x".into() };
        let c = contract(vec![rule]);
        assert_eq!(c.resource(&headers(&[]), "b", "jobs/1").unwrap().as_str(), "job:x");
        assert_eq!(c.resource(&headers(&[("fencing-resource", "job:x")]), "b", "jobs/1").unwrap().as_str(), "job:x");
        assert!(matches!(
            c.resource(&headers(&[("fencing-resource", "job:y")]), "b", "jobs/1"),
            Err(FrontError::Refused(Refusal::ResourceMismatch { .. }))
        ));
        assert_eq!(c.resource(&headers(&[("fencing-resource", "r")]), "b", "other").unwrap().as_str(), "r");
        assert_eq!(c.resource(&headers(&[]), "b", "other").unwrap().as_str(), "b/other");
    }
}
