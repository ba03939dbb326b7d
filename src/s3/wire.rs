//! The fencing wire contract on S3 requests: which token a write presents, and which resource
//! it writes to (README.md, "Attaching the token").

use http::{HeaderMap, HeaderName};

use super::error::FrontError;
use crate::config::RuleConfig;
use crate::fence::{FenceToken, ResourceKey};
use crate::refusal::{Refusal, single_token};

/// The metadata header SDKs send for object metadata `fencing-token`.
pub const METADATA_TOKEN_HEADER: &str = "x-amz-meta-fencing-token";
/// [`METADATA_TOKEN_HEADER`] as a header name, for lookups (`crate::amz`).
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
    /// The presented token: the token header, or the object metadata, or both if they agree.
    pub fn token(&self, headers: &HeaderMap) -> Result<Option<FenceToken>, FrontError> {
        let header = single_token(headers, &self.token_header, "fencing token")?;
        let metadata = single_token(headers, &HeaderName::from_static(METADATA_TOKEN_HEADER), "metadata")?;
        match (header, metadata) {
            (Some(h), Some(m)) if h != m => Err(FrontError::TokenMismatch { header: h, metadata: m }),
            (h, m) => Ok(h.or(m)),
        }
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
        let rule = self
            .rules
            .iter()
            .filter(|r| r.bucket == bucket && key.starts_with(&r.prefix))
            .max_by_key(|r| r.prefix.len());
        let name = match (rule, presented) {
            (Some(rule), Some(p)) if p != rule.resource => {
                return Err(Refusal::ResourceMismatch { bound: rule.resource.clone(), presented: p.to_owned() }.into());
            }
            (Some(rule), _) => rule.resource.clone(),
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
    /// On a presigned request (query authentication) whoever holds the URL adds headers at
    /// will: the fencing headers count only if the signature covers them, so one that is not
    /// in `X-Amz-SignedHeaders` is refused. A header-signed request is its signer's own word.
    pub fn check_presigned(&self, query: Option<&str>, headers: &HeaderMap) -> Result<(), FrontError> {
        let Some(query) = query else { return Ok(()) };
        let Some(presign) = Presign::of(query)? else { return Ok(()) };
        let covered = |name: &str| match &presign {
            Presign::V4 { signed } => signed.split(';').any(|s| s == name),
            // SigV2 signs the `x-amz-*` headers and no other.
            Presign::V2 => name.starts_with("x-amz-"),
        };
        let metadata = HeaderName::from_static(METADATA_TOKEN_HEADER);
        for name in [&self.token_header, &self.resource_header, &metadata] {
            if headers.contains_key(name) && !covered(name.as_str()) {
                return Err(FrontError::UnsignedOnPresigned(name.as_str().to_owned()));
            }
        }
        Ok(())
    }
}

/// S3's longest presigned URL lifetime.
const PRESIGN_EXPIRES_MAX_S: u64 = 604_800;

/// A request authenticated by its query (a presigned URL), and what its signature covers.
pub enum Presign {
    /// SigV4: the headers named in `X-Amz-SignedHeaders` (lowercase, `;`-separated).
    V4 { signed: String },
    /// SigV2 (`AWSAccessKeyId`, `Signature`, `Expires`).
    V2,
}

impl Presign {
    /// `None` for a request not authenticated by its query. A lifetime beyond S3's longest is
    /// refused (SigV4's `X-Amz-Expires` in seconds, SigV2's `Expires` as a Unix time).
    pub fn of(query: &str) -> Result<Option<Self>, FrontError> {
        let (mut v4, mut v2, mut signed) = (false, false, String::new());
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            if name.eq_ignore_ascii_case("X-Amz-Signature") {
                v4 = true;
            } else if name.eq_ignore_ascii_case("Signature") {
                v2 = true;
            } else if name.eq_ignore_ascii_case("X-Amz-SignedHeaders") {
                signed = value.to_ascii_lowercase();
            } else if name.eq_ignore_ascii_case("X-Amz-Expires")
                && value.parse::<u64>().is_ok_and(|seconds| seconds > PRESIGN_EXPIRES_MAX_S)
            {
                return Err(FrontError::PresignTooLong);
            } else if name.eq_ignore_ascii_case("Expires")
                && let Ok(at) = value.parse::<u64>()
            {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                if at > now.as_secs() + PRESIGN_EXPIRES_MAX_S {
                    return Err(FrontError::PresignTooLong);
                }
            }
        }
        // The signature library checks a SigV2 `Signature` first, and a SigV2 signature covers
        // no other query parameter: with both present, the request is SigV2 and an
        // `X-Amz-SignedHeaders` beside it is the URL holder's word, not the signer's.
        Ok(if v2 {
            Some(Self::V2)
        } else if v4 {
            Some(Self::V4 { signed })
        } else {
            None
        })
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
    fn on_a_presigned_request_only_signed_fencing_headers_count() {
        let c = contract(vec![]);
        let token = headers(&[("fencing-token", "7")]);
        let presigned = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(
            matches!(c.check_presigned(Some(presigned), &token), Err(FrontError::UnsignedOnPresigned(h)) if h == "fencing-token")
        );
        let resource = headers(&[("fencing-resource", "job:a")]);
        assert!(c.check_presigned(Some(presigned), &resource).is_err());
        let metadata = headers(&[(METADATA_TOKEN_HEADER, "7")]);
        assert!(c.check_presigned(Some(presigned), &metadata).is_err());
        // Covered by the signature (names compared without case): it counts.
        let signed = "X-Amz-SignedHeaders=host%3BFencing-Token&X-Amz-Signature=ab";
        assert!(c.check_presigned(Some(signed), &token).is_ok());
        // Not presigned (header authentication), or no fencing header: nothing to check.
        assert!(c.check_presigned(Some("uploads"), &token).is_ok());
        assert!(c.check_presigned(None, &token).is_ok());
        assert!(c.check_presigned(Some(presigned), &HeaderMap::new()).is_ok());
        // S3's longest lifetime.
        let long = "X-Amz-Expires=604801&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(matches!(c.check_presigned(Some(long), &HeaderMap::new()), Err(FrontError::PresignTooLong)));
        let week = "X-Amz-Expires=604800&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(c.check_presigned(Some(week), &HeaderMap::new()).is_ok());
        // SigV2 query authentication signs `x-amz-*` headers only.
        let v2 = "AWSAccessKeyId=k&Signature=ab&Expires=1";
        assert!(c.check_presigned(Some(v2), &token).is_err());
        assert!(c.check_presigned(Some(v2), &resource).is_err());
        assert!(c.check_presigned(Some(v2), &metadata).is_ok());
        // A SigV2 URL with SigV4 parameters appended by its holder is still SigV2.
        let mixed =
            "AWSAccessKeyId=k&Signature=ab&Expires=1&X-Amz-Signature=00&X-Amz-SignedHeaders=host%3Bfencing-token";
        assert!(c.check_presigned(Some(mixed), &token).is_err());
        let v2_far = "AWSAccessKeyId=k&Signature=ab&Expires=99999999999";
        assert!(matches!(c.check_presigned(Some(v2_far), &HeaderMap::new()), Err(FrontError::PresignTooLong)));
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
