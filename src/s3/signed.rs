//! What the signature of a verified request covers (docs/security.md, "Signatures"): the signature the S3
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
        let (mut v4_query, mut v2_query, mut signed, mut credential) = (false, false, None, None);
        for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
            // Names as the library matches them: exactly.
            if name == "X-Amz-Signature" {
                v4_query = true;
            } else if name == "Signature" {
                v2_query = true;
            } else if name == "X-Amz-SignedHeaders" {
                signed = Some(value.to_ascii_lowercase());
            } else if name == "X-Amz-Credential" {
                credential = Some(value.into_owned());
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
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let authorization = match (values.next(), values.next()) {
            (None, _) => None,
            (Some(one), None) => Some(one.to_str().map_err(|_| FrontError::AuthorizationMalformed)?),
            // The library takes such a request as unsigned, and refuses it.
            (Some(_), Some(_)) => return Err(FrontError::AuthorizationMalformed),
        };
        if authorization.is_some() && (v2_query || v4_query) {
            return Err(FrontError::TwoAuthMechanisms);
        }
        // In the library's order, each told as it tells it: SigV2 in the query, SigV2 in the
        // header (`AWS key:signature`), SigV4 in the query, SigV4 in the header. A SigV2
        // signature covers no other query parameter: an `X-Amz-SignedHeaders` beside a SigV2
        // `Signature` is the URL holder's word, not the signer's.
        if v2_query {
            return Ok(Self::V2 { presigned: true });
        }
        if let Some(value) = authorization {
            if value.strip_prefix("AWS ").is_some_and(|rest| rest.contains(':')) {
                return Ok(Self::V2 { presigned: false });
            }
            let Some(rest) = value.strip_prefix("AWS4-HMAC-SHA256 ") else {
                return Err(FrontError::AuthorizationMalformed);
            };
            check_service(credential_scope(rest))?;
            return Ok(Self::V4 { signed: signed_headers(rest).unwrap_or_default().to_owned(), presigned: false });
        }
        if v4_query {
            check_service(credential.as_deref())?;
            return Ok(Self::V4 { signed: signed.unwrap_or_default(), presigned: true });
        }
        Ok(Self::None)
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

/// A POST Object form upload, or what the library could take for one: a POST with any
/// `Content-Type` that says `multipart` in any case or spelling (the library parses the value
/// as UTF-8 and as a MIME type, more leniently than an HTTP header value reads). Such a body is
/// signed inside itself, by the form's fields, and read before anyone is authenticated.
pub fn is_form_upload(method: &Method, headers: &HeaderMap) -> bool {
    method == Method::POST
        && headers
            .get_all(header::CONTENT_TYPE)
            .iter()
            .any(|v| v.as_bytes().windows(9).any(|w| w.eq_ignore_ascii_case(b"multipart")))
}

/// The region of a SigV4 credential scope (in the `Authorization` header or the query), when
/// the S3 library would refuse it as no region at all (`US`, as s3cmd signs by default): S3
/// answers such a request 400 `AuthorizationHeaderMalformed` naming the region to sign for,
/// and clients correct themselves from that answer.
pub fn unusable_region(query: Option<&str>, headers: &HeaderMap) -> Option<String> {
    let from_header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("AWS4-HMAC-SHA256 "))
        .and_then(credential_scope)
        .map(str::to_owned);
    let credential = from_header.or_else(|| {
        form_urlencoded::parse(query.unwrap_or_default().as_bytes())
            .find(|(name, _)| name == "X-Amz-Credential")
            .map(|(_, value)| value.into_owned())
    })?;
    let region = credential.split('/').nth(2)?;
    s3s::region::Region::new(region.into()).is_err().then(|| region.to_owned())
}

/// The credential of a SigV4 `Authorization` value (after the algorithm).
fn credential_scope(rest: &str) -> Option<&str> {
    let credential = rest.trim_start().strip_prefix("Credential=")?;
    credential.split(',').next()
}

/// fencegate serves S3: a credential scope of another service (`sts`, for which the library
/// reads the body before it checks the signature) is refused before anything is read.
fn check_service(credential: Option<&str>) -> Result<(), FrontError> {
    match credential.and_then(|c| c.split('/').nth(3)) {
        Some("s3") | None => Ok(()),
        Some(_) => Err(FrontError::AuthorizationMalformed),
    }
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
    let value = headers.get(crate::aws::amz::X_AMZ_DATE).or_else(|| headers.get(header::DATE));
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
        // A header and a query signature together: refused (the library and fencegate could
        // tell them apart differently; S3 allows one mechanism).
        assert!(matches!(Signature::of(&put, Some(query), &v2), Err(FrontError::TwoAuthMechanisms)));
        // `AWS x` without `key:signature` is no SigV2 to the library: not to fencegate either.
        let not_v2 = headers(&[("authorization", "AWS x")]);
        assert!(matches!(Signature::of(&put, None, &not_v2), Err(FrontError::AuthorizationMalformed)));
        // Another service's scope (the library reads an `sts` body before the signature).
        let sts = headers(&[(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=k/20261204/us-east-1/sts/aws4_request, SignedHeaders=host, Signature=00",
        )]);
        assert!(matches!(Signature::of(&Method::POST, None, &sts), Err(FrontError::AuthorizationMalformed)));
        let sts_query = "X-Amz-Credential=k%2F20261204%2Fus-east-1%2Fsts%2Faws4_request&X-Amz-SignedHeaders=host&X-Amz-Signature=ab";
        assert!(Signature::of(&put, Some(sts_query), &HeaderMap::new()).is_err());
        // Query names are matched as the library matches them: exactly.
        assert_eq!(Signature::of(&put, Some("signature=ab"), &HeaderMap::new()).unwrap(), Signature::None);
        // Two `SignedHeaders`: the list is nobody's, nothing counts as covered.
        let twice = headers(&[("authorization", "AWS4-HMAC-SHA256 SignedHeaders=host, SignedHeaders=x-amz-acl,")]);
        assert!(!Signature::of(&put, None, &twice).unwrap().covers("x-amz-acl"));
        let form = headers(&[("content-type", "multipart/form-data; boundary=x"), ("authorization", V4_AUTH)]);
        assert_eq!(Signature::of(&Method::POST, None, &form).unwrap(), Signature::Form);
        // Whatever spelling the library could still parse as a form.
        let mut utf8 = HeaderMap::new();
        utf8.insert(
            "content-type",
            http::HeaderValue::from_bytes("Multipart/Form-Data; boundary=\"x\"; n=\"\u{e9}\"".as_bytes()).unwrap(),
        );
        assert!(is_form_upload(&Method::POST, &utf8));
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
