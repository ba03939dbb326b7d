//! What the signature of a verified request covers (SPEC section 11): the signature the S3
//! library chose, told the way it chooses (a form's, else SigV2 by query then by header, else
//! SigV4 by query then by header), and the rules that follow from it.
//!
//! - Every `x-amz-*` header must be signed, as S3 wants: a header the signer did not cover is
//!   the word of whoever relays the request (`x-amz-copy-source` on a presigned PUT copies
//!   another object's bytes; `x-amz-acl` makes an object public).
//! - SigV2 is off unless `server.sigv2`; then its `Date` must be within 15 minutes, as S3's,
//!   and it never moves a fence: it signs no body and no header outside `x-amz-*`.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, header};

use super::error::FrontError;

/// S3's longest presigned URL lifetime.
const PRESIGN_EXPIRES_MAX_S: u64 = 604_800;

/// How far a SigV2 request's date may be from fencegate's clock (S3's 15 minutes).
pub const SIGV2_SKEW_MAX: Duration = Duration::from_secs(15 * 60);

/// How a request was signed, and what that signature covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signature {
    /// SigV4, in the `Authorization` header or the query: the headers it names (lower case,
    /// `;`-separated).
    V4 { signed: String, presigned: bool },
    /// SigV2: every `x-amz-*` header and no other, never the body.
    V2 { presigned: bool },
    /// A POST Object form: its signature covers the form's policy, no header.
    Form,
    /// No signature (the library refuses such a request before fencegate's route).
    None,
}

impl Signature {
    /// The signature the S3 library verified on a request with these parts. A lifetime beyond
    /// S3's longest is refused (SigV4's `X-Amz-Expires` in seconds, SigV2's `Expires` as a Unix
    /// time).
    pub fn of(method: &Method, query: Option<&str>, headers: &HeaderMap) -> Result<Self, FrontError> {
        if is_form_upload(method, headers) {
            return Ok(Self::Form);
        }
        let (mut v4_query, mut v2_query, mut signed) = (false, false, None);
        for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
            if name.eq_ignore_ascii_case("X-Amz-Signature") {
                v4_query = true;
            } else if name.eq_ignore_ascii_case("Signature") {
                v2_query = true;
            } else if name.eq_ignore_ascii_case("X-Amz-SignedHeaders") {
                signed = Some(value.to_ascii_lowercase());
            } else if name.eq_ignore_ascii_case("X-Amz-Expires")
                && value.parse::<u64>().is_ok_and(|seconds| seconds > PRESIGN_EXPIRES_MAX_S)
            {
                return Err(FrontError::PresignTooLong);
            } else if name.eq_ignore_ascii_case("Expires")
                && let Ok(at) = value.parse::<u64>()
            {
                let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
                if at > now.as_secs() + PRESIGN_EXPIRES_MAX_S {
                    return Err(FrontError::PresignTooLong);
                }
            }
        }
        // The library checks a SigV2 `Signature` first, and a SigV2 signature covers no other
        // query parameter: with both present, the request is SigV2 and an
        // `X-Amz-SignedHeaders` beside it is the URL holder's word, not the signer's.
        if v2_query {
            return Ok(Self::V2 { presigned: true });
        }
        let authorization = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if authorization.is_some_and(|a| a.starts_with("AWS ")) {
            return Ok(Self::V2 { presigned: false });
        }
        if v4_query {
            return Ok(Self::V4 { signed: signed.unwrap_or_default(), presigned: true });
        }
        Ok(match authorization {
            Some(value) => Self::V4 { signed: signed_headers(value).unwrap_or_default().to_owned(), presigned: false },
            None => Self::None,
        })
    }

    /// Whether the signature covers the header `name` (lower case).
    pub fn covers(&self, name: &str) -> bool {
        match self {
            Self::V4 { signed, .. } => signed.split(';').any(|s| s == name),
            Self::V2 { .. } => name.starts_with("x-amz-"),
            Self::Form | Self::None => false,
        }
    }

    pub fn is_sigv2(&self) -> bool {
        matches!(self, Self::V2 { .. })
    }

    pub fn is_presigned(&self) -> bool {
        matches!(self, Self::V4 { presigned: true, .. } | Self::V2 { presigned: true })
    }

    /// The rules every signed request meets before fencegate acts on it: SigV2 only when
    /// `sigv2` allows it, and then dated within [`SIGV2_SKEW_MAX`] of `now`; every `x-amz-*`
    /// header signed.
    pub fn check(&self, headers: &HeaderMap, sigv2: bool, now: SystemTime) -> Result<(), FrontError> {
        if let Self::V2 { presigned } = self {
            if !sigv2 {
                return Err(FrontError::SigV2Off);
            }
            if !presigned {
                check_v2_date(headers, now)?;
            }
        }
        let mut unsigned: Vec<&str> = headers
            .keys()
            .map(http::HeaderName::as_str)
            .filter(|name| name.starts_with("x-amz-") && !self.covers(name))
            .collect();
        if unsigned.is_empty() {
            return Ok(());
        }
        unsigned.sort_unstable();
        Err(FrontError::HeadersNotSigned(unsigned.join(", ")))
    }
}

/// A POST Object form upload, as the library tells one (a POST whose body is
/// `multipart/form-data`): signed inside its body, by the form's fields.
pub fn is_form_upload(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::POST
        && headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().get(..19).is_some_and(|t| t.eq_ignore_ascii_case("multipart/form-data")))
}

/// The `SignedHeaders` of a SigV4 `Authorization` value, read as the library reads it (after
/// `Credential=...,`, up to the next comma); `None` unless the value names exactly one.
fn signed_headers(authorization: &str) -> Option<&str> {
    let mut parts = authorization.split("SignedHeaders=");
    let (_, list, None) = (parts.next()?, parts.next()?, parts.next()) else { return None };
    list.split(',').next()
}

/// A header-signed SigV2 request's date: `x-amz-date` if present (the date the signature
/// covers then), else `Date`; within [`SIGV2_SKEW_MAX`] of `now`.
fn check_v2_date(headers: &HeaderMap, now: SystemTime) -> Result<(), FrontError> {
    let value = headers.get(crate::amz::X_AMZ_DATE).or_else(|| headers.get(header::DATE));
    let Some(date) = value.and_then(|v| v.to_str().ok()).and_then(|v| httpdate::parse_http_date(v).ok()) else {
        return Err(FrontError::SigV2Date);
    };
    let skew = now.duration_since(date).or_else(|e| Ok::<_, ()>(e.duration())).unwrap_or_default();
    if skew > SIGV2_SKEW_MAX {
        return Err(FrontError::RequestTimeTooSkewed);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    const V4_AUTH: &str = "AWS4-HMAC-SHA256 Credential=k/20261204/us-east-1/s3/aws4_request, \
                           SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=ab";

    #[test]
    fn each_kind_of_signature_is_told_as_the_library_tells_it() {
        let put = Method::PUT;
        let v4 = headers(&[("authorization", V4_AUTH)]);
        let sig = Signature::of(&put, None, &v4).unwrap();
        assert_eq!(sig, Signature::V4 { signed: "host;x-amz-content-sha256;x-amz-date".into(), presigned: false });
        assert!(sig.covers("x-amz-date") && !sig.covers("fencing-token") && !sig.covers("x-amz-acl"));
        let v2 = headers(&[("authorization", "AWS k:c2ln")]);
        assert_eq!(Signature::of(&put, None, &v2).unwrap(), Signature::V2 { presigned: false });
        let query = "X-Amz-SignedHeaders=host%3BFencing-Token&X-Amz-Signature=ab";
        let sig = Signature::of(&put, Some(query), &HeaderMap::new()).unwrap();
        assert!(sig.is_presigned() && sig.covers("fencing-token"));
        // A SigV2 URL with SigV4 parameters appended by its holder is still SigV2.
        let mixed =
            "AWSAccessKeyId=k&Signature=ab&Expires=1&X-Amz-Signature=00&X-Amz-SignedHeaders=host%3Bfencing-token";
        let sig = Signature::of(&put, Some(mixed), &HeaderMap::new()).unwrap();
        assert_eq!(sig, Signature::V2 { presigned: true });
        assert!(!sig.covers("fencing-token") && sig.covers("x-amz-meta-fencing-token"));
        // A SigV2 header beside a SigV4 URL: the library checks SigV2 first.
        assert!(Signature::of(&put, Some(query), &v2).unwrap().is_sigv2());
        // Two `SignedHeaders`: the list is nobody's, nothing counts as covered.
        let twice = headers(&[("authorization", "AWS4-HMAC-SHA256 SignedHeaders=host, SignedHeaders=x-amz-acl,")]);
        assert!(!Signature::of(&put, None, &twice).unwrap().covers("x-amz-acl"));
        let form = headers(&[("content-type", "multipart/form-data; boundary=x"), ("authorization", V4_AUTH)]);
        assert_eq!(Signature::of(&Method::POST, None, &form).unwrap(), Signature::Form);
        // S3's longest lifetime.
        let long = "X-Amz-Expires=604801&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(matches!(Signature::of(&put, Some(long), &HeaderMap::new()), Err(FrontError::PresignTooLong)));
        let week = "X-Amz-Expires=604800&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(Signature::of(&put, Some(week), &HeaderMap::new()).is_ok());
        let v2_far = "AWSAccessKeyId=k&Signature=ab&Expires=99999999999";
        assert!(matches!(Signature::of(&put, Some(v2_far), &HeaderMap::new()), Err(FrontError::PresignTooLong)));
    }

    #[test]
    fn every_amz_header_must_be_signed() {
        let now = SystemTime::now();
        let sig = Signature::V4 { signed: "host;x-amz-date".into(), presigned: true };
        assert!(sig.check(&headers(&[("x-amz-date", "x"), ("content-type", "a")]), false, now).is_ok());
        let err = sig.check(
            &headers(&[("x-amz-date", "x"), ("x-amz-copy-source", "b/k"), ("x-amz-acl", "public-read")]),
            false,
            now,
        );
        assert!(matches!(err, Err(FrontError::HeadersNotSigned(names)) if names == "x-amz-acl, x-amz-copy-source"));
        // SigV2 signs every x-amz-* header by construction.
        let v2 = Signature::V2 { presigned: true };
        assert!(v2.check(&headers(&[("x-amz-acl", "private")]), true, now).is_ok());
        assert!(Signature::Form.check(&headers(&[("x-amz-acl", "private")]), false, now).is_err());
    }

    #[test]
    fn sigv2_is_off_unless_enabled_and_then_dated_within_fifteen_minutes() {
        let now = SystemTime::now();
        let header = Signature::V2 { presigned: false };
        let date = |offset: i64| {
            let at = if offset >= 0 {
                now + Duration::from_secs(offset as u64)
            } else {
                now - Duration::from_secs(offset.unsigned_abs())
            };
            httpdate::fmt_http_date(at)
        };
        let fresh = headers(&[("date", &date(-60))]);
        assert!(matches!(header.check(&fresh, false, now), Err(FrontError::SigV2Off)));
        assert!(header.check(&fresh, true, now).is_ok());
        let three_days = headers(&[("date", &date(-3 * 86_400))]);
        assert!(matches!(header.check(&three_days, true, now), Err(FrontError::RequestTimeTooSkewed)));
        assert!(matches!(
            header.check(&headers(&[("date", &date(16 * 60))]), true, now),
            Err(FrontError::RequestTimeTooSkewed)
        ));
        assert!(header.check(&headers(&[("date", &date(14 * 60))]), true, now).is_ok());
        // x-amz-date, when present, is the date the signature covers: it is the one judged.
        let both = headers(&[("date", &date(0)), ("x-amz-date", &date(-3 * 86_400))]);
        assert!(matches!(header.check(&both, true, now), Err(FrontError::RequestTimeTooSkewed)));
        assert!(matches!(header.check(&headers(&[("date", "yesterday")]), true, now), Err(FrontError::SigV2Date)));
        assert!(matches!(header.check(&HeaderMap::new(), true, now), Err(FrontError::SigV2Date)));
        // A presigned SigV2 URL carries its own expiry, checked by the library.
        assert!(Signature::V2 { presigned: true }.check(&HeaderMap::new(), true, now).is_ok());
    }
}
