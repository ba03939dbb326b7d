use std::time::Duration;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings, UriPathNormalizationMode,
    sign,
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
        SignableRequest::new(req.method().as_str(), uri, headers.into_iter(), SignableBody::UnsignedPayload).unwrap();
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
        http::Request::builder().method("GET").uri("http://127.0.0.1:9000/").header("host", "127.0.0.1:9000").body(()),
    ];
    for req in cases {
        check(req.unwrap(), now);
    }
}

#[test]
fn dates_are_written_as_sigv4_wants_them() {
    assert_eq!(amz_date(0).unwrap(), "19700101T000000Z");
    assert_eq!(amz_date(1_700_000_000).unwrap(), "20231114T221320Z");
    assert_eq!(amz_date(253_402_300_799).unwrap(), "99991231T235959Z");
    assert!(amz_date(253_402_300_800).is_err(), "year 10000");
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

/// A request signed by aws-sigv4 (the reference) at `now`, with its date and payload headers.
fn signed_by_reference(req: http::Request<()>, now: SystemTime) -> http::Request<()> {
    let authorization = reference_authorization(&req, now);
    let mut signed = req;
    let secs = now.duration_since(UNIX_EPOCH).unwrap().as_secs();
    signed.headers_mut().insert(X_AMZ_DATE, HeaderValue::from_str(&amz_date(secs).unwrap()).unwrap());
    signed.headers_mut().insert(X_AMZ_CONTENT_SHA256, HeaderValue::from_static(UNSIGNED_PAYLOAD));
    signed.headers_mut().insert(AUTHORIZATION, HeaderValue::from_str(&authorization).unwrap());
    signed
}

fn verifier() -> Verifier {
    Verifier::new(HashMap::from([(KEY_ID.to_owned(), SECRET.to_owned())]))
}

fn verify(req: &http::Request<()>, now: SystemTime) -> Option<Verified> {
    verifier().verify(req.method().as_str(), req.uri(), req.headers(), now)
}

fn origin_form(req: http::Request<()>) -> http::Request<()> {
    let (mut parts, ()) = req.into_parts();
    parts.uri = parts.uri.path_and_query().unwrap().as_str().parse().unwrap();
    http::Request::from_parts(parts, ())
}

#[test]
fn verifies_what_aws_sigv4_signs() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let cases = [
        put("http://127.0.0.1:9000/bucket/key").header("content-length", "1024").body(()),
        put("http://127.0.0.1:9000/bucket/a%20b/%E2%82%AC/c+d%2Bx~y")
            .header("fencing-token", "42")
            .header("if-match", "\"0123abcd\"")
            .header("x-amz-meta-note", "  two  spaces   inside  ")
            .header("x-amz-meta-list", "one")
            .header("x-amz-meta-list", "two")
            .body(()),
        put("http://127.0.0.1:9000/bucket/key?partNumber=3&uploadId=a%2Fb%3Dc+d").body(()),
        http::Request::builder().method("GET").uri("http://127.0.0.1:9000/").header("host", "127.0.0.1:9000").body(()),
    ];
    for req in cases {
        let signed = origin_form(signed_by_reference(req.unwrap(), now));
        let verified = verify(&signed, now + Duration::from_secs(60)).unwrap_or_else(|| panic!("{:?}", signed.uri()));
        assert_eq!(verified, Verified { access_key: KEY_ID.into(), secret: SECRET.into(), region: "eu-west-3".into() });
    }
}

#[test]
fn any_change_to_what_was_signed_fails_verification() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let signed = origin_form(signed_by_reference(
        put("http://127.0.0.1:9000/bucket/key?uploadId=abc")
            .header("fencing-token", "42")
            .header("content-length", "5")
            .body(())
            .unwrap(),
        now,
    ));
    assert!(verify(&signed, now).is_some());
    let changed = |f: &dyn Fn(&mut http::Request<()>)| {
        let mut req = signed.clone();
        f(&mut req);
        verify(&req, now)
    };
    let set = |name: &'static str, value: &'static str| {
        move |r: &mut http::Request<()>| {
            r.headers_mut().insert(name, HeaderValue::from_static(value));
        }
    };
    assert!(changed(&set("fencing-token", "43")).is_none(), "a signed header's value");
    assert!(
        changed(&|r| {
            r.headers_mut().append("fencing-token", HeaderValue::from_static("1"));
        })
        .is_none()
    );
    assert!(
        changed(&|r| {
            r.headers_mut().remove("fencing-token");
        })
        .is_none(),
        "a signed header removed"
    );
    assert!(changed(&|r| *r.uri_mut() = "/bucket/other?uploadId=abc".parse().unwrap()).is_none(), "the path");
    assert!(changed(&|r| *r.uri_mut() = "/bucket/key?uploadId=abd".parse().unwrap()).is_none(), "the query");
    assert!(changed(&|r| *r.uri_mut() = "/bucket/key".parse().unwrap()).is_none(), "the query removed");
    assert!(changed(&|r| *r.method_mut() = http::Method::DELETE).is_none(), "the method");
    assert!(changed(&set("x-amz-content-sha256", EMPTY_PAYLOAD_SHA256)).is_none(), "the payload hash");
    assert!(changed(&set("x-amz-date", "20251130T101203Z")).is_none(), "the date");
    let authorization = signed.headers()[AUTHORIZATION].to_str().unwrap().to_owned();
    let with_authorization = |value: String| {
        let mut req = signed.clone();
        req.headers_mut().insert(AUTHORIZATION, HeaderValue::from_str(&value).unwrap());
        verify(&req, now)
    };
    let last = authorization.chars().last().unwrap();
    let flipped = format!("{}{}", &authorization[..authorization.len() - 1], if last == '0' { '1' } else { '0' });
    assert!(with_authorization(flipped).is_none(), "the signature");
    assert!(with_authorization(authorization.replace(KEY_ID, "AKIDOTHER")).is_none(), "another access key");
    assert!(with_authorization(authorization.replace("eu-west-3", "us-east-1")).is_none(), "another region");
    assert!(with_authorization(authorization.replace("/s3/", "/sts/")).is_none(), "another service");
    assert!(with_authorization(authorization.replace(";fencing-token", "")).is_none(), "fewer signed headers");
    let mut twice = signed.clone();
    twice.headers_mut().append(AUTHORIZATION, HeaderValue::from_str(&authorization).unwrap());
    assert!(verify(&twice, now).is_none(), "two Authorization headers");
    // An unsigned header is not the signature's business (as at S3).
    assert!(changed(&set("user-agent", "another")).is_some());
}

#[test]
fn the_date_must_be_the_scope_s_and_near_the_clock() {
    let signed_at = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let signed = origin_form(signed_by_reference(put("http://127.0.0.1:9000/bucket/key").body(()).unwrap(), signed_at));
    assert!(verify(&signed, signed_at + CLOCK_SKEW_MAX).is_some());
    assert!(verify(&signed, signed_at - CLOCK_SKEW_MAX).is_some());
    assert!(verify(&signed, signed_at + CLOCK_SKEW_MAX + Duration::from_secs(1)).is_none());
    assert!(verify(&signed, signed_at - CLOCK_SKEW_MAX - Duration::from_secs(1)).is_none());
    // Not rounded to the second: 900.3 s is too far, as the library has it.
    assert!(verify(&signed, signed_at + CLOCK_SKEW_MAX + Duration::from_millis(300)).is_none());
}

#[test]
fn a_signed_value_with_a_tab_is_left_to_the_library() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let req = put("http://127.0.0.1:9000/bucket/key").header("x-amz-meta-a", "a\tb").body(()).unwrap();
    assert!(verify(&origin_form(signed_by_reference(req, now)), now).is_none());
}

#[test]
fn only_verified_keys_are_kept() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let verifier = verifier();
    let mut forged = origin_form(signed_by_reference(put("http://127.0.0.1:9000/b/k").body(()).unwrap(), now));
    let authorization = forged.headers()[AUTHORIZATION].to_str().unwrap().replace("eu-west-3", "xx-forged-1");
    forged.headers_mut().insert(AUTHORIZATION, HeaderValue::from_str(&authorization).unwrap());
    assert!(verifier.verify("PUT", forged.uri(), forged.headers(), now).is_none());
    assert!(verifier.keys.lock().unwrap().is_empty(), "a key kept for a signature that did not verify");
}

/// A lease credential's secret derives from its session token, and its access key from the
/// grant only: whoever holds one could present edited claims (another derived secret)
/// under the same access key. A key cached for the real secret must not verify them.
#[test]
fn a_cached_key_serves_only_the_secret_it_was_derived_from() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123);
    let verifier = Verifier::new(HashMap::new());
    let req = origin_form(signed_by_reference(put("http://127.0.0.1:9000/b/k").body(()).unwrap(), now));
    let with = |secret: &'static str| {
        verifier.verify_with("PUT", req.uri(), req.headers(), now, |s| {
            assert_eq!(s.access_key, KEY_ID);
            Some(secret.to_owned())
        })
    };
    assert!(with(SECRET).is_some(), "signed with SECRET");
    assert_eq!(verifier.keys.lock().unwrap().len(), 1, "its key is kept");
    assert!(with("another secret under the same access key").is_none());
    assert!(with(SECRET).is_some(), "the kept key still serves its own secret");
    assert!(verifier.verify_with("PUT", req.uri(), req.headers(), now, |_| None).is_none(), "an unknown key");
}

#[test]
fn malformed_dates_are_not_taken() {
    let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123); // 2025-11-30T10:22:03Z
    assert_eq!(within_skew("20251130T102203Z", now), Some(true));
    assert_eq!(within_skew("20251130T100703Z", now), Some(true));
    assert_eq!(within_skew("20251130T100702Z", now), Some(false));
    assert_eq!(within_skew("20251130T103703Z", now), Some(true));
    assert_eq!(within_skew("20251130T103704Z", now), Some(false));
    for bad in [
        "20251130T102203",
        "20251130 102203Z",
        "2025113aT102203Z",
        "20251330T102203Z",
        "20251130T252203Z",
        "+0251130T102203Z",
        "",
    ] {
        assert_eq!(within_skew(bad, now), None, "{bad}");
    }
}

#[test]
fn keys_are_cached_per_access_key_day_and_region() {
    let verifier = verifier();
    for day in 0..3u64 {
        let now = UNIX_EPOCH + Duration::from_secs(1_764_498_123 + day * 86_400);
        for _ in 0..2 {
            let signed = origin_form(signed_by_reference(put("http://127.0.0.1:9000/b/k").body(()).unwrap(), now));
            assert!(verifier.verify("PUT", signed.uri(), signed.headers(), now).is_some(), "day {day}");
        }
    }
    assert_eq!(verifier.keys.lock().unwrap().len(), 3);
}

#[test]
fn authorization_headers_are_parsed_strictly() {
    let good = "AWS4-HMAC-SHA256 Credential=AK/20251130/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-date, \
                Signature=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let parsed = HeaderSignature::parse(good).unwrap();
    assert_eq!((parsed.access_key, parsed.date, parsed.region), ("AK", "20251130", "us-east-1"));
    assert_eq!(parsed.names().collect::<Vec<_>>(), ["host", "x-amz-date"]);
    assert!(HeaderSignature::parse(&good.replace(", ", ",")).is_some());
    for bad in [
        good.replace("AWS4-HMAC-SHA256", "AWS4-ECDSA-P256-SHA256"),
        good.replace("host;x-amz-date", "x-amz-date;host"),
        good.replace("host;x-amz-date", "x-amz-date"),
        good.replace("host;", "Host;"),
        good.replace("/s3/", "/sts/"),
        good.replace("20251130", "2025113"),
        good.replace("Signature=0", "Signature=X"),
        good.replace(", Signature", ", Credential=AK/20251130/us-east-1/s3/aws4_request, Signature"),
        good.replace("aws4_request", "aws4_request/x"),
        good.replace("host;x-amz-date", "host;host;x-amz-date"),
        good.replace("host;x-amz-date", "host;;x-amz-date"),
        format!("{good}, Extra=1"),
        "AWS4-HMAC-SHA256 Signature=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef, \
         Credential=AK/20251130/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-date"
            .to_owned(),
        good.replace("us-east-1", &"r".repeat(REGION_BYTES_MAX + 1)),
        good.replace("AK/", "/"),
        good.replace("/us-east-1/", "//"),
        good.replace("host;x-amz-date", "host;x-amz-date;"),
        good.replace("SignedHeaders=host;x-amz-date", "SignedHeaders="),
        good.replace("/s3/aws4_request", "/s3/aws4_request/"),
        good.replace("/s3/aws4_request", "/s3"),
        format!("{good},"),
        good.split(", Signature").next().unwrap().to_owned(),
        good.replace(", SignedHeaders", " , SignedHeaders"),
        good.replace(", Signature", " , Signature"),
    ] {
        assert!(HeaderSignature::parse(&bad).is_none(), "{bad}");
    }
}

#[test]
fn signed_names_are_cut_as_split_cuts_them() {
    for list in ["", ";", "a;", ";a", "a;;b", "host", "host;x-amz-date"] {
        let signature = HeaderSignature { access_key: "", date: "", region: "", signed_headers: list, signature: "" };
        assert_eq!(signature.names().collect::<Vec<_>>(), list.split(';').collect::<Vec<_>>(), "{list:?}");
    }
}

#[test]
fn trimming_collapses_spaces_only() {
    let mut out = String::new();
    push_trimmed("  a  b\t\tc   ", &mut out);
    assert_eq!(out, "a b\t\tc");
    for (value, trimmed) in [(" a b ", "a b"), ("a", "a"), ("", ""), ("  ", ""), ("a   b", "a b"), ("a b  c", "a b c")]
    {
        let mut out = String::new();
        push_trimmed(value, &mut out);
        assert_eq!(out, trimmed, "{value:?}");
    }
}
