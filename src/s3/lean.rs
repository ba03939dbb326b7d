//! The lean path: the common header-signed request, verified here and handed straight to
//! fencegate's route, without the S3 library's preparation of it.
//!
//! For every request the S3 library parses and validates the path, parses the query and the
//! headers, derives the signing key (four HMACs) and builds the canonical request through
//! several allocations: about a sixth of fencegate's CPU per accepted write, and more of a
//! rejected one's (docs/perf-log.md, "the bare hyper proxy on the ladder, and the lean path").
//! Most requests have one shape: HTTP/1,
//! path-style, signed in the `Authorization` header by a `[[credentials]]` entry or by a lease
//! credential (its session token in a signed `x-amz-security-token` header), with an unsigned
//! or empty payload and no presign parameters. For those, [`LeanPath::take`] checks what the
//! library would check (the path and bucket name, the credential scope, the clock skew, the
//! signature, with keys cached per day and per secret) and builds the route's request itself;
//! a lease credential's claims go to the route in the request's extensions.
//!
//! Anything else, and any request whose signature does not verify here, goes through the
//! library unchanged: it alone answers errors and the other ways of signing (presigned URLs,
//! SigV2, aws-chunked bodies, signed payloads, virtual hosts, HTTP/2). So the lean path can
//! only take a request the library would have taken.

use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, Method, Version};
use s3s::route::S3Route;
use s3s::{Body, S3Request};

use crate::aws::amz::X_AMZ_SECURITY_TOKEN;
use crate::aws::sigv4::{EMPTY_PAYLOAD_SHA256, HeaderSignature, UNSIGNED_PAYLOAD, Verifier};
use crate::lease::LeaseService;
use crate::lease::credentials::{ACCESS_KEY_PREFIX, Claims, CredentialError, Issuers};

/// The lean path's verifier, the issuers whose secrets lease credentials derive from, and the
/// route it hands requests to.
pub(super) struct LeanPath {
    pub(super) verifier: Verifier,
    pub(super) issuers: Arc<Issuers>,
    pub(super) route: Arc<dyn S3Route>,
}

/// The claims of the lease credential whose signature the lean path verified, handed to the
/// route in the request's extensions (which only fencegate itself can set).
#[derive(Clone)]
pub(super) struct LeaseClaims(pub(super) Claims);

impl LeanPath {
    /// The request, made ready for the route, if it has the common shape and its signature
    /// verifies; otherwise the request back, untouched, for the S3 library.
    #[allow(clippy::result_large_err)]
    pub(super) fn take(&self, req: http::Request<Body>) -> Result<S3Request<Body>, http::Request<Body>> {
        if !common_shape(&req) {
            return Err(req);
        }
        let mut claims = None;
        let verified = self.verifier.verify_with(
            req.method().as_str(),
            req.uri(),
            req.headers(),
            SystemTime::now(),
            |signature| self.secret(signature, req.headers(), &mut claims),
        );
        let Some(verified) = verified else { return Err(req) };
        let Ok(region) = s3s::region::Region::new(verified.region.into()) else { return Err(req) };
        let (mut parts, body) = req.into_parts();
        if let Some(claims) = claims {
            parts.extensions.insert(LeaseClaims(claims));
        }
        Ok(S3Request {
            input: body,
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            extensions: parts.extensions,
            credentials: Some(s3s::auth::Credentials {
                access_key: verified.access_key,
                secret_key: verified.secret.into(),
            }),
            region: Some(region),
            service: Some("s3".into()),
            trailing_headers: None,
        })
    }

    /// The secret `signature` must have been made with: a `[[credentials]]` entry's, or a lease
    /// credential's, derived from its session token (`claims` are then set: they count only
    /// once the signature verifies). The session token must be one `x-amz-security-token`
    /// header, and signed; anything else is the library's to judge.
    fn secret(
        &self,
        signature: &HeaderSignature<'_>,
        headers: &HeaderMap,
        claims: &mut Option<Claims>,
    ) -> Option<String> {
        if let Some(secret) = self.verifier.secret(signature.access_key) {
            return Some(secret.to_owned());
        }
        if !signature.access_key.starts_with(ACCESS_KEY_PREFIX)
            || !signature.names().any(|name| name == X_AMZ_SECURITY_TOKEN.as_str())
        {
            return None;
        }
        let token = crate::aws::sigv4::single(headers, &X_AMZ_SECURITY_TOKEN)?;
        match self.issuers.secret(signature.access_key, Some(token)) {
            Ok((secret, verified)) => {
                *claims = Some(verified);
                Some(secret)
            }
            // Checked against a secret nobody has, as an issuer's forged claims are: how long
            // the answer takes does not tell which access keys are issuers (the library then
            // answers both alike).
            Err(CredentialError::UnknownIssuer) => Some(uuid::Uuid::new_v4().simple().to_string()),
            Err(_) => None,
        }
    }

    /// Runs the route on a request [`LeanPath::take`] made, and renders its answer as the S3
    /// library renders a route's.
    pub(super) async fn call(&self, req: S3Request<Body>) -> http::Response<Body> {
        match self.route.call(req).await {
            Ok(resp) => {
                let mut http = http::Response::new(resp.output);
                *http.status_mut() = resp.status.unwrap_or_default();
                *http.headers_mut() = resp.headers;
                *http.extensions_mut() = resp.extensions;
                http
            }
            Err(error) => error.to_http_response().unwrap_or_else(|_| {
                let mut http = http::Response::new(Body::empty());
                *http.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                http
            }),
        }
    }
}

/// The shape the lean path takes: everything the S3 library would do differently from
/// fencegate's route for it is excluded here.
fn common_shape(req: &http::Request<Body>) -> bool {
    let uri = req.uri();
    let headers = req.headers();
    // HTTP/2 names the host in `:authority`; an absolute-form target carries its own.
    let http1 = matches!(req.version(), Version::HTTP_11 | Version::HTTP_10) && uri.authority().is_none();
    // POST is a form upload or a body-carrying operation (DeleteObjects): the library's.
    let method = matches!(*req.method(), Method::GET | Method::HEAD | Method::PUT | Method::DELETE);
    http1
        && method
        && !LeaseService::handles(uri.path())
        && plain_query(uri.query().unwrap_or_default())
        && valid_path(uri.path())
        && plain_payload(req.method(), headers)
}

/// A query of unreserved characters, `=` and `&` only (nothing to decode), each name once (the
/// library orders repeated names as sent, SigV4 by value), without presign parameters
/// (`X-Amz-*`, SigV2's `Signature`, `AWSAccessKeyId`, `Expires`).
fn plain_query(query: &str) -> bool {
    if query.is_empty() {
        return true;
    }
    let plain =
        query.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'=' | b'&'));
    plain
        && query.split('&').all(|pair| {
            let name = pair.split_once('=').map_or(pair, |(name, _)| name);
            let amz = name.get(..6).is_some_and(|p| p.eq_ignore_ascii_case("x-amz-"));
            let sigv2 = ["signature", "awsaccesskeyid", "expires"].iter().any(|p| name.eq_ignore_ascii_case(p));
            !amz && !sigv2
        })
        && {
            let mut names: Vec<&str> =
                query.split('&').map(|pair| pair.split_once('=').map_or(pair, |(name, _)| name)).collect();
            let count = names.len();
            names.sort_unstable();
            names.dedup();
            names.len() == count
        }
}

/// The path as the library checks it (decodable, a valid bucket name and key), and already in
/// the form the library signs first (each byte that needs it escaped once, in upper-case hex,
/// nothing else escaped), so that both sign the same text.
fn valid_path(path: &str) -> bool {
    let b = path.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let escaped = b.get(i + 1..i + 3).and_then(|hex| {
                    let upper = |d: &u8| d.is_ascii_digit() || (b'A'..=b'F').contains(d);
                    hex.iter().all(upper).then(|| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())?
                });
                match escaped {
                    Some(byte) if !unreserved(byte) && byte != b'/' => i += 3,
                    _ => return false,
                }
            }
            byte if unreserved(byte) || byte == b'/' => i += 1,
            _ => return false,
        }
    }
    crate::net::percent::decode(path)
        .is_some_and(|decoded| s3s::path::parse_path_style_with_validation(&decoded, &BucketNames).is_ok())
}

fn unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

/// `UNSIGNED-PAYLOAD` with a known length (or no body to speak of), or the empty payload's
/// hash with no body; never aws-chunked, a signed body, or a chunked transfer.
fn plain_payload(method: &Method, headers: &HeaderMap) -> bool {
    if headers.contains_key(http::header::TRANSFER_ENCODING)
        || headers.contains_key(crate::aws::amz::X_AMZ_DECODED_CONTENT_LENGTH)
        || headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .any(|v| v.as_bytes().windows(11).any(|w| w.eq_ignore_ascii_case(b"aws-chunked")))
    {
        return false;
    }
    let mut lengths = headers.get_all(http::header::CONTENT_LENGTH).iter();
    let length = lengths.next().map(|v| v.to_str().ok().and_then(|v| v.parse::<u64>().ok()));
    if lengths.next().is_some() || matches!(length, Some(None)) {
        return false;
    }
    let length = length.flatten();
    match headers.get(crate::aws::amz::X_AMZ_CONTENT_SHA256).map(http::HeaderValue::as_bytes) {
        Some(v) if v == UNSIGNED_PAYLOAD.as_bytes() => length.is_some() || *method != Method::PUT,
        Some(v) if v == EMPTY_PAYLOAD_SHA256.as_bytes() => length.is_none_or(|n| n == 0),
        _ => false,
    }
}

/// S3's bucket naming rules, plus the pseudo-bucket of the lease endpoints.
pub(super) struct BucketNames;

impl s3s::validation::NameValidation for BucketNames {
    fn validate_bucket_name(&self, name: &str) -> bool {
        name == crate::lease::PSEUDO_BUCKET || s3s::path::check_bucket_name(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presign_parameters_and_encoded_queries_go_to_the_library() {
        assert!(plain_query(""));
        assert!(plain_query("list-type=2&prefix=a"));
        assert!(plain_query("uploadId=abc&partNumber=3"));
        assert!(!plain_query("X-Amz-Signature=abc"));
        assert!(!plain_query("a=1&x-amz-credential=k"));
        assert!(!plain_query("Signature=abc&AWSAccessKeyId=k"));
        assert!(!plain_query("prefix=a%2Fb"));
        assert!(!plain_query("prefix=a+b"));
        assert!(!plain_query("prefix=a&prefix=b"), "a repeated name");
    }

    #[test]
    fn only_plain_payloads_are_taken() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, v.parse().unwrap());
            }
            h
        };
        let unsigned = ("x-amz-content-sha256", UNSIGNED_PAYLOAD);
        let empty = ("x-amz-content-sha256", EMPTY_PAYLOAD_SHA256);
        assert!(plain_payload(&Method::PUT, &headers(&[unsigned, ("content-length", "5")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[unsigned])));
        assert!(plain_payload(&Method::GET, &headers(&[unsigned])));
        assert!(plain_payload(&Method::GET, &headers(&[empty])));
        assert!(plain_payload(&Method::DELETE, &headers(&[empty, ("content-length", "0")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[empty, ("content-length", "5")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[unsigned, ("content-length", "5"), ("content-length", "5")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[unsigned, ("content-length", "x")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[unsigned, ("transfer-encoding", "chunked")])));
        assert!(!plain_payload(
            &Method::PUT,
            &headers(&[("x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"), ("content-length", "5")])
        ));
        assert!(!plain_payload(
            &Method::PUT,
            &headers(&[unsigned, ("content-length", "5"), ("content-encoding", "gzip, aws-chunked")])
        ));
        let signed_body = ("x-amz-content-sha256", "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
        assert!(!plain_payload(&Method::PUT, &headers(&[signed_body, ("content-length", "5")])));
        assert!(!plain_payload(&Method::PUT, &headers(&[("content-length", "5")])));
    }

    #[test]
    fn paths_the_library_refuses_go_to_it() {
        assert!(valid_path("/bucket/key"));
        assert!(valid_path("/bucket/a%20b"));
        assert!(valid_path("/bucket"));
        assert!(!valid_path("/Bad_Bucket/key"));
        assert!(!valid_path("/bucket/%ff"));
        assert!(valid_path("/bucket/%E2%82%AC"));
        for not_canonical in
            ["/bucket/%e2%82%ac", "/bucket/%41", "/bucket/x%2Fy", "/%62kt/k", "/bucket/a+b", "/bucket/a%2", "/b/%+f"]
        {
            assert!(!valid_path(not_canonical), "{not_canonical}");
        }
        assert!(!valid_path(&format!("/bucket/{}", "k".repeat(1025))));
    }
}
