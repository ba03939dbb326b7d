//! SigV4 for the requests fencegate forwards, with the signing key cached per day.
//!
//! aws-sigv4's request-level `sign` derives the signing key (four HMACs) and builds the
//! canonical request through several maps and formatted strings on every call: about a tenth
//! of fencegate's CPU per forwarded write. This signer does the same canonicalisation (the
//! S3 flavour: path signed as sent, query decoded and re-encoded in order, `UNSIGNED-PAYLOAD`)
//! into one buffer, keeps the key of the current UTC day, and leaves the cryptography to
//! aws-sigv4's own `generate_signing_key` and `calculate_signature`. The tests sign the same
//! requests with both and compare the `Authorization` headers.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use aws_sigv4::sign::v4;
use http::header::{AUTHORIZATION, HeaderName, HeaderValue, TRANSFER_ENCODING, USER_AGENT};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::{Digest, Sha256};

const ALGORITHM: &str = "AWS4-HMAC-SHA256";
const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";
const SERVICE: &str = "s3";
const X_AMZ_DATE: HeaderName = HeaderName::from_static("x-amz-date");
const X_AMZ_CONTENT_SHA256: HeaderName = HeaderName::from_static("x-amz-content-sha256");
const X_AMZN_TRACE_ID: &str = "x-amzn-trace-id";

/// What a query name or value keeps unencoded in the canonical query: RFC 3986 unreserved.
const QUERY_KEEP_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("header {name} is not visible ASCII and cannot be signed")]
    HeaderValue { name: String },
    #[error("the clock is before 1970")]
    Clock,
}

/// The key of one UTC day and the credential scope it signs for.
struct DayKey {
    day: u64,
    /// `YYYYMMDD/region/s3/aws4_request`
    scope: String,
    key: Vec<u8>,
}

pub struct Signer {
    access_key_id: String,
    secret_access_key: String,
    region: String,
    today: Mutex<Option<Arc<DayKey>>>,
}

impl Signer {
    pub fn new(access_key_id: String, secret_access_key: String, region: String) -> Self {
        Self { access_key_id, secret_access_key, region, today: Mutex::new(None) }
    }

    /// Signs `req` in place for `now`: sets `x-amz-date`, `x-amz-content-sha256:
    /// UNSIGNED-PAYLOAD` and `authorization`, signing every header it carries except the ones
    /// proxies may change (user-agent, transfer-encoding, x-amzn-trace-id). The request must
    /// carry its `host` header already.
    pub fn sign<B>(&self, req: &mut http::Request<B>, now: SystemTime) -> Result<(), SignError> {
        let secs = now.duration_since(UNIX_EPOCH).map_err(|_| SignError::Clock)?.as_secs();
        let day = self.day_key(secs, now);
        let amz_date = amz_date(secs);

        let headers = req.headers_mut();
        headers.remove(AUTHORIZATION);
        headers.insert(X_AMZ_DATE, HeaderValue::from_str(&amz_date).expect("digits and letters"));
        headers.insert(X_AMZ_CONTENT_SHA256, HeaderValue::from_static(UNSIGNED_PAYLOAD));

        let mut names: Vec<&HeaderName> = req.headers().keys().filter(|name| !is_unsigned(name)).collect();
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));

        let mut canonical = String::with_capacity(512);
        canonical.push_str(req.method().as_str());
        canonical.push('\n');
        canonical.push_str(req.uri().path());
        canonical.push('\n');
        canonical_query(req.uri().query().unwrap_or_default(), &mut canonical);
        canonical.push('\n');
        for name in &names {
            canonical.push_str(name.as_str());
            canonical.push(':');
            for (i, value) in req.headers().get_all(*name).iter().enumerate() {
                let value = value.to_str().map_err(|_| SignError::HeaderValue { name: name.as_str().to_owned() })?;
                if i > 0 {
                    canonical.push(',');
                }
                push_trimmed(value, &mut canonical);
            }
            canonical.push('\n');
        }
        canonical.push('\n');
        let signed_from = canonical.len();
        for (i, name) in names.iter().enumerate() {
            if i > 0 {
                canonical.push(';');
            }
            canonical.push_str(name.as_str());
        }
        let signed_headers_end = canonical.len();
        canonical.push('\n');
        canonical.push_str(UNSIGNED_PAYLOAD);

        let mut string_to_sign = String::with_capacity(160);
        string_to_sign.push_str(ALGORITHM);
        string_to_sign.push('\n');
        string_to_sign.push_str(&amz_date);
        string_to_sign.push('\n');
        string_to_sign.push_str(&day.scope);
        string_to_sign.push('\n');
        push_hex(&Sha256::digest(canonical.as_bytes()), &mut string_to_sign);
        let signature = v4::calculate_signature(&day.key, string_to_sign.as_bytes());

        let signed_headers = &canonical[signed_from..signed_headers_end];
        let mut authorization = String::with_capacity(256);
        write!(
            authorization,
            "{ALGORITHM} Credential={}/{}, SignedHeaders={signed_headers}, Signature={signature}",
            self.access_key_id, day.scope
        )
        .expect("writing to a String");
        let mut authorization = HeaderValue::try_from(authorization).expect("visible ASCII");
        authorization.set_sensitive(true);
        req.headers_mut().insert(AUTHORIZATION, authorization);
        Ok(())
    }

    /// The signing key of the UTC day of `secs`, derived once per day.
    fn day_key(&self, secs: u64, now: SystemTime) -> Arc<DayKey> {
        let day = secs / 86_400;
        let mut today = self.today.lock().expect("signing key cache poisoned");
        match today.as_ref() {
            Some(cached) if cached.day == day => cached.clone(),
            _ => {
                let key = v4::generate_signing_key(&self.secret_access_key, now, &self.region, SERVICE);
                let fresh = Arc::new(DayKey {
                    day,
                    scope: format!("{}/{}/{SERVICE}/aws4_request", &amz_date(secs)[..8], self.region),
                    key: key.as_ref().to_vec(),
                });
                *today = Some(fresh.clone());
                fresh
            }
        }
    }
}

fn is_unsigned(name: &HeaderName) -> bool {
    name == AUTHORIZATION || name == USER_AGENT || name == TRANSFER_ENCODING || name.as_str() == X_AMZN_TRACE_ID
}

/// `YYYYMMDDTHHMMSSZ` of a Unix time, in UTC.
fn amz_date(secs: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(secs as i64).expect("a time after 1970 and before 9999");
    let mut out = String::with_capacity(16);
    write!(
        out,
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
    .expect("writing to a String");
    out
}

/// The query as SigV4 signs it: each pair decoded (`+` is a space), re-encoded with only
/// unreserved characters left as they are, pairs sorted by encoded name then value, a missing
/// value as `name=`.
fn canonical_query(query: &str, out: &mut String) {
    if query.is_empty() {
        return;
    }
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| {
            (
                utf8_percent_encode(&k, QUERY_KEEP_UNRESERVED).to_string(),
                utf8_percent_encode(&v, QUERY_KEEP_UNRESERVED).to_string(),
            )
        })
        .collect();
    pairs.sort_unstable();
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        out.push_str(k);
        out.push('=');
        out.push_str(v);
    }
}

/// A header value as SigV4 signs it: leading and trailing spaces removed, runs of spaces
/// collapsed to one (spaces only, as S3 does).
fn push_trimmed(value: &str, out: &mut String) {
    let mut previous_space = false;
    for c in value.trim_matches(' ').chars() {
        if c == ' ' {
            if previous_space {
                continue;
            }
            previous_space = true;
        } else {
            previous_space = false;
        }
        out.push(c);
    }
}

fn push_hex(bytes: &[u8], out: &mut String) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 0xf) as usize] as char);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use aws_credential_types::Credentials;
    use aws_sigv4::http_request::{
        PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
        UriPathNormalizationMode, sign,
    };
    use aws_smithy_runtime_api::client::identity::Identity;

    use super::*;

    const KEY_ID: &str = "AKIDEXAMPLE";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";

    /// What aws-sigv4's request-level `sign` puts in `Authorization`, with the S3 settings
    /// fencegate used before this signer.
    fn reference_authorization(req: &http::Request<()>, now: SystemTime) -> String {
        let identity: Identity = Credentials::new(KEY_ID, SECRET, None, None, "test").into();
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region("eu-west-3")
            .name("s3")
            .time(now)
            .settings(settings)
            .build()
            .unwrap()
            .into();
        let headers: Vec<(&str, &str)> = req.headers().iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect();
        let uri = req.uri().to_string();
        let signable =
            SignableRequest::new(req.method().as_str(), uri, headers.into_iter(), SignableBody::UnsignedPayload)
                .unwrap();
        let (instructions, _) = sign(signable, &params).unwrap().into_parts();
        let mut signed = req.clone();
        instructions.apply_to_request_http1x(&mut signed);
        signed.headers()[AUTHORIZATION].to_str().unwrap().to_owned()
    }

    fn check(req: http::Request<()>, now: SystemTime) {
        let expected = reference_authorization(&req, now);
        let signer = Signer::new(KEY_ID.into(), SECRET.into(), "eu-west-3".into());
        let mut ours = req;
        signer.sign(&mut ours, now).unwrap();
        assert_eq!(ours.headers()[AUTHORIZATION].to_str().unwrap(), expected, "{:?}", ours.uri());
        assert_eq!(ours.headers()["x-amz-content-sha256"], UNSIGNED_PAYLOAD);
    }

    fn put(uri: &str) -> http::request::Builder {
        http::Request::builder().method("PUT").uri(uri).header("host", "127.0.0.1:9000")
    }

    #[test]
    fn signs_as_aws_sigv4_does() {
        let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
        let cases = [
            put("http://127.0.0.1:9000/bucket/key").header("content-length", "1024").body(()),
            put("http://127.0.0.1:9000/bucket/a%20b/%E2%82%AC/c+d%2Bx~y")
                .header("x-amz-meta-fencing-token", "42")
                .header("if-match", "\"0123abcd\"")
                .header("content-md5", "1B2M2Y8AsgTpgAmY7PhCfg==")
                .header("content-type", "application/octet-stream")
                .body(()),
            put("http://127.0.0.1:9000/bucket/key?partNumber=3&uploadId=a%2Fb%3Dc+d").body(()),
            put("http://127.0.0.1:9000/bucket/key?tagging").header("content-length", "0").body(()),
            http::Request::builder()
                .method("POST")
                .uri("http://127.0.0.1:9000/bucket?delete&x-id=DeleteObjects&empty=&z=1&a=2&a=1")
                .header("host", "127.0.0.1:9000")
                .body(()),
            put("http://127.0.0.1:9000/bucket/key")
                .header("x-amz-meta-note", "  two  spaces   inside  ")
                .header("x-amz-meta-list", "one")
                .header("x-amz-meta-list", "two")
                .header("user-agent", "worker/1.0")
                .header("transfer-encoding", "chunked")
                .header("x-amzn-trace-id", "Root=1-abc")
                .header("x-amz-date", "19990101T000000Z")
                .header("x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER")
                .body(()),
            http::Request::builder()
                .method("GET")
                .uri("http://127.0.0.1:9000/")
                .header("host", "127.0.0.1:9000")
                .body(()),
        ];
        for req in cases {
            check(req.unwrap(), now);
        }
    }

    #[test]
    fn the_key_follows_the_utc_day() {
        let signer = Signer::new(KEY_ID.into(), SECRET.into(), "eu-west-3".into());
        let before_midnight = UNIX_EPOCH + Duration::from_secs(1_764_547_199); // 2025-11-30T23:59:59Z
        for now in [before_midnight, before_midnight + Duration::from_secs(1), before_midnight] {
            let req = put("http://127.0.0.1:9000/bucket/key").body(()).unwrap();
            let expected = reference_authorization(&req, now);
            let mut ours = req;
            signer.sign(&mut ours, now).unwrap();
            assert_eq!(ours.headers()[AUTHORIZATION].to_str().unwrap(), expected);
        }
    }

    #[test]
    fn a_header_that_is_not_ascii_is_refused() {
        let signer = Signer::new(KEY_ID.into(), SECRET.into(), "eu-west-3".into());
        let mut req = put("http://127.0.0.1:9000/bucket/key")
            .header("x-amz-meta-name", HeaderValue::from_bytes("caf\u{e9}".as_bytes()).unwrap())
            .body(())
            .unwrap();
        let err = signer.sign(&mut req, SystemTime::now()).unwrap_err();
        assert!(matches!(err, SignError::HeaderValue { ref name } if name == "x-amz-meta-name"), "{err}");
    }

    #[test]
    fn trimming_collapses_spaces_only() {
        let mut out = String::new();
        push_trimmed("  a  b\t\tc   ", &mut out);
        assert_eq!(out, "a b\t\tc");
    }
}
