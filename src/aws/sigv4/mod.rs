//! SigV4, both ways: signing the requests fencegate forwards, and verifying the common
//! requests it receives, with signing keys cached per day.
//!
//! aws-sigv4's request-level `sign` derives the signing key (four HMACs) and builds the
//! canonical request through several maps and formatted strings on every call: about a tenth
//! of fencegate's CPU per forwarded write. The S3 library's own check of an incoming signature
//! costs as much again, for the same reasons. Here the canonical request (the S3 flavour: path
//! signed as sent, query decoded and re-encoded in order) is built into one buffer by one
//! function for both directions, keys are derived once per access key, day and region, and
//! the key derivation is aws-sigv4's own (`generate_signing_key`), the signature its HMAC. The
//! tests sign requests with aws-sigv4 and check that this module signs and verifies them alike.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sigv4::sign::v4;

use crate::aws::amz::{X_AMZ_CONTENT_SHA256, X_AMZ_DATE};
use http::HeaderMap;
use http::header::{AUTHORIZATION, HeaderName, HeaderValue, TRANSFER_ENCODING, USER_AGENT};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

const ALGORITHM: &str = "AWS4-HMAC-SHA256";
pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";
/// `x-amz-content-sha256` of an empty body.
pub const EMPTY_PAYLOAD_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
const SERVICE: &str = "s3";
const X_AMZN_TRACE_ID: &str = "x-amzn-trace-id";

/// What a query name or value keeps unencoded in the canonical query: RFC 3986 unreserved.
const QUERY_KEEP_UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("header {name} is not visible ASCII and cannot be signed")]
    HeaderValue { name: String },
    #[error("the clock is before 1970 or after 9999")]
    Clock,
    #[error("HMAC refused the signing key")]
    Key,
}

/// A signing key, keyed into its HMAC once: each signature clones it, so the key's inner and
/// outer pads are not hashed again for every request (two SHA-256 blocks a signature).
type KeyedMac = hmac::Hmac<Sha256>;

/// The signing key of `key`'s bytes, keyed into its HMAC. `None` only if HMAC refused the key,
/// which it does for no length.
fn keyed(key: &[u8]) -> Option<KeyedMac> {
    use hmac::KeyInit;
    KeyedMac::new_from_slice(key).ok()
}

/// The key of one UTC day and the credential scope it signs for.
struct DayKey {
    day: u64,
    /// `YYYYMMDD/region/s3/aws4_request`
    scope: String,
    mac: KeyedMac,
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
        let amz_date = amz_date(secs)?;
        let day = self.day_key(secs, now, &amz_date[..8])?;

        let headers = req.headers_mut();
        headers.remove(AUTHORIZATION);
        let date = HeaderValue::from_str(&amz_date)
            .map_err(|_| SignError::HeaderValue { name: X_AMZ_DATE.as_str().into() })?;
        headers.insert(X_AMZ_DATE, date);
        headers.insert(X_AMZ_CONTENT_SHA256, HeaderValue::from_static(UNSIGNED_PAYLOAD));

        let mut names: Vec<&HeaderName> = Vec::with_capacity(req.headers().keys_len());
        names.extend(req.headers().keys().filter(|name| !is_unsigned(name)));
        names.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));

        let mut canonical = String::with_capacity(512);
        let (method, uri) = (req.method().as_str(), req.uri());
        let signed = canonical_request(
            method,
            uri.path(),
            uri.query().unwrap_or_default(),
            req.headers(),
            names.iter().map(|name| name.as_str()),
            UNSIGNED_PAYLOAD,
            Strict(false),
            &mut canonical,
        )?;
        let signature = signature(&day.mac, &amz_date, &[&day.scope], &canonical);
        let signature = std::str::from_utf8(&signature).expect("hex digits are ASCII");

        let signed_headers = &canonical[signed];
        let mut authorization = String::with_capacity(160 + signed_headers.len());
        for part in [
            ALGORITHM,
            " Credential=",
            &self.access_key_id,
            "/",
            &day.scope,
            ", SignedHeaders=",
            signed_headers,
            ", Signature=",
            signature,
        ] {
            authorization.push_str(part);
        }
        let mut authorization = HeaderValue::try_from(authorization)
            .map_err(|_| SignError::HeaderValue { name: AUTHORIZATION.as_str().into() })?;
        authorization.set_sensitive(true);
        req.headers_mut().insert(AUTHORIZATION, authorization);
        Ok(())
    }

    /// The signing key of the UTC day of `secs`, derived once per day.
    fn day_key(&self, secs: u64, now: SystemTime, yyyymmdd: &str) -> Result<Arc<DayKey>, SignError> {
        let day = secs / 86_400;
        let mut today = self.today.lock().expect("signing key cache poisoned");
        match today.as_ref() {
            Some(cached) if cached.day == day => Ok(cached.clone()),
            _ => {
                let key = v4::generate_signing_key(&self.secret_access_key, now, &self.region, SERVICE);
                let fresh = Arc::new(DayKey {
                    day,
                    scope: format!("{yyyymmdd}/{}/{SERVICE}/aws4_request", self.region),
                    mac: keyed(key.as_ref()).ok_or(SignError::Key)?,
                });
                *today = Some(fresh.clone());
                Ok(fresh)
            }
        }
    }
}

/// Whether [`canonical_request`] refuses a signed name without a value, and a value with a
/// tab or a line break (verifying: those are the S3 library's to judge).
struct Strict(bool);

/// Writes the canonical request into `out` and returns where its signed-headers line is:
/// `method`, the path as sent, the query in canonical form, each header of `names` (lower
/// case, sorted) with its values trimmed and joined by commas, the names, and `payload` (the
/// `x-amz-content-sha256` value).
#[allow(clippy::too_many_arguments)]
fn canonical_request<'n>(
    method: &str,
    path: &str,
    query: &str,
    headers: &HeaderMap,
    names: impl Iterator<Item = &'n str> + Clone,
    payload: &str,
    strict: Strict,
    out: &mut String,
) -> Result<Range<usize>, SignError> {
    out.push_str(method);
    out.push('\n');
    out.push_str(path);
    out.push('\n');
    canonical_query(query, out);
    out.push('\n');
    for name in names.clone() {
        out.push_str(name);
        out.push(':');
        let refused = || SignError::HeaderValue { name: name.to_owned() };
        let mut count = 0;
        for value in values(headers, name) {
            if strict.0 && value.as_bytes().iter().any(|b| matches!(b, b'\t' | b'\r' | b'\n')) {
                return Err(refused());
            }
            let value = value.to_str().map_err(|_| refused())?;
            if count > 0 {
                out.push(',');
            }
            push_trimmed(value, out);
            count += 1;
        }
        if strict.0 && count == 0 {
            return Err(refused());
        }
        out.push('\n');
    }
    out.push('\n');
    let signed_from = out.len();
    for (i, name) in names.enumerate() {
        if i > 0 {
            out.push(';');
        }
        out.push_str(name);
    }
    let signed = signed_from..out.len();
    out.push('\n');
    out.push_str(payload);
    Ok(signed)
}

/// The values of header `name` (lower case), in order. A scan of the map by name: a lookup
/// by a `&str` would parse and hash the name first, which costs more on a request's dozen
/// headers.
fn values<'h>(headers: &'h HeaderMap, name: &str) -> impl Iterator<Item = &'h HeaderValue> {
    headers.iter().filter(move |(n, _)| n.as_str() == name).map(|(_, value)| value)
}

/// The signature of a canonical request under a signing key, as 64 lower-case hex digits:
/// the HMAC-SHA256 of the string to sign (`AWS4-HMAC-SHA256`, the date, the scope joined by
/// `/`, the hex SHA-256 of `canonical`, one per line), which is fed to the HMAC piece by piece
/// rather than written out first (aws-sigv4's `calculate_signature`, without its two strings).
fn signature(key: &KeyedMac, amz_date: &str, scope: &[&str], canonical: &str) -> [u8; 64] {
    use hmac::Mac;
    let mut mac = key.clone();
    for part in [ALGORITHM, "\n", amz_date, "\n"] {
        mac.update(part.as_bytes());
    }
    for (i, part) in scope.iter().enumerate() {
        if i > 0 {
            mac.update(b"/");
        }
        mac.update(part.as_bytes());
    }
    mac.update(b"\n");
    mac.update(&hex(&Sha256::digest(canonical.as_bytes()).into()));
    hex(&mac.finalize().into_bytes().into())
}

/// How far a request's `x-amz-date` may be from fencegate's clock (the S3 library's default,
/// and S3's).
pub const CLOCK_SKEW_MAX: Duration = Duration::from_secs(15 * 60);

/// Signing keys kept at most (all dropped when full): the days and regions of the
/// credentials in use.
const VERIFY_KEYS_MAX: usize = 64;

/// The longest region name taken (AWS's are at most 25 bytes).
const REGION_BYTES_MAX: usize = 32;

/// The parts of an `Authorization: AWS4-HMAC-SHA256 ...` header.
#[derive(Debug, PartialEq, Eq)]
pub struct HeaderSignature<'a> {
    pub access_key: &'a str,
    /// `YYYYMMDD` of the credential scope.
    pub date: &'a str,
    pub region: &'a str,
    /// `SignedHeaders`: names in lower case, strictly ascending, separated by `;`.
    pub signed_headers: &'a str,
    /// 64 lower-case hex digits.
    pub signature: &'a str,
}

impl<'a> HeaderSignature<'a> {
    /// Parses the common form strictly (service `s3`, `host` signed, names sorted); anything
    /// else is `None`, for the S3 library to judge.
    pub fn parse(value: &'a str) -> Option<Self> {
        let rest = value.strip_prefix(ALGORITHM)?.strip_prefix(' ')?;
        // In the order every SDK writes them, each once.
        let (credential, rest) = cut(rest, b',')?;
        let (signed, signature) = cut(rest, b',')?;
        // Spaces may follow a comma, not precede it (the library reads a space before one as
        // part of the value: a signed name `x-amz-date `).
        let credential = credential.trim_start_matches(' ').strip_prefix("Credential=")?;
        let signed = signed.trim_start_matches(' ').strip_prefix("SignedHeaders=")?;
        let signature = signature.trim_matches(' ').strip_prefix("Signature=")?;
        let (access_key, scope) = cut(credential, b'/')?;
        let (date, scope) = cut(scope, b'/')?;
        let (region, scope) = cut(scope, b'/')?;
        if scope != "s3/aws4_request" {
            return None;
        }
        let date_ok = date.len() == 8 && date.bytes().all(|b| b.is_ascii_digit());
        let region_ok = (1..=REGION_BYTES_MAX).contains(&region.len())
            && region.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if access_key.is_empty() || !date_ok || !region_ok {
            return None;
        }
        let signed_headers = signed;
        let (mut previous, mut host) = ("", false);
        for name in (Names { rest: Some(signed_headers) }) {
            let name_ok = !name.is_empty() && name.bytes().all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-'));
            if !name_ok || name <= previous {
                return None;
            }
            host |= name == "host";
            previous = name;
        }
        // 64 hex digits: no comma, so no fourth part either.
        let signature_ok = signature.len() == 64 && signature.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !host || !signature_ok {
            return None;
        }
        Some(Self { access_key, date, region, signed_headers, signature })
    }

    /// The signed header names, in order.
    pub fn names(&self) -> Names<'a> {
        Names { rest: Some(self.signed_headers) }
    }
}

/// The names of a `SignedHeaders` list, in order.
#[derive(Clone)]
pub struct Names<'a> {
    rest: Option<&'a str>,
}

impl<'a> Iterator for Names<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let rest = self.rest?;
        Some(match cut(rest, b';') {
            Some((name, more)) => {
                self.rest = Some(more);
                name
            }
            None => {
                self.rest = None;
                rest
            }
        })
    }
}

/// `text` before and after the first `separator` (an ASCII byte). A byte loop: the parts here
/// are a few dozen bytes, where `split` and `split_once` spend more on setting up a `memchr`
/// than on the search.
fn cut(text: &str, separator: u8) -> Option<(&str, &str)> {
    let at = text.bytes().position(|b| b == separator)?;
    Some((&text[..at], &text[at + 1..]))
}

/// The signer of a request that [`Verifier::verify`] accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub access_key: String,
    pub secret: String,
    pub region: String,
}

/// Verifies header-signed SigV4 requests of the common shape against a fixed set of
/// credentials, each signing key derived once per access key, day and region.
pub struct Verifier {
    secrets: HashMap<String, String>,
    /// Searched in order: a handful in use at a time (a credential's region, today and
    /// yesterday near midnight).
    keys: Mutex<Vec<CachedKey>>,
}

impl Verifier {
    /// `secrets`: secret access key by access key id.
    pub fn new(secrets: HashMap<String, String>) -> Self {
        Self { secrets, keys: Mutex::new(Vec::new()) }
    }

    /// The secret of a `[[credentials]]` access key given to [`Verifier::new`].
    pub fn secret(&self, access_key: &str) -> Option<&str> {
        self.secrets.get(access_key).map(String::as_str)
    }

    /// `Some` only when the request is signed in its `Authorization` header by one of the
    /// credentials, for service `s3`, within [`CLOCK_SKEW_MAX`] of `now`, every signed header
    /// present, and the signature matches. `None` says nothing about the request: the S3
    /// library checks it and gives the answer (an error, or another way of signing).
    pub fn verify(&self, method: &str, uri: &http::Uri, headers: &HeaderMap, now: SystemTime) -> Option<Verified> {
        self.verify_with(method, uri, headers, now, |signature| self.secrets.get(signature.access_key).cloned())
    }

    /// [`Verifier::verify`], with the secret of the signature's access key given by
    /// `secret_of` (`None`: not one this caller knows), for credentials whose secret is
    /// derived from the request itself (lease credentials, from their session token). A
    /// signing key is cached with the secret it was derived from, and used only for that
    /// secret: two requests under one access key with different secrets never share a key.
    pub fn verify_with(
        &self,
        method: &str,
        uri: &http::Uri,
        headers: &HeaderMap,
        now: SystemTime,
        secret_of: impl FnOnce(&HeaderSignature<'_>) -> Option<String>,
    ) -> Option<Verified> {
        let mut authorization = headers.get_all(AUTHORIZATION).iter();
        let value = authorization.next()?.to_str().ok()?;
        if authorization.next().is_some() {
            return None;
        }
        let signature = HeaderSignature::parse(value)?;
        let secret = secret_of(&signature)?;
        let amz_date = single(headers, &X_AMZ_DATE)?;
        if amz_date.get(..8)? != signature.date || !within_skew(amz_date, now)? {
            return None;
        }
        let payload = single(headers, &X_AMZ_CONTENT_SHA256)?;
        // Strict: every signed header present, and no tab or line break in a value (the
        // library collapses every kind of whitespace, this module only spaces: such a value is
        // the library's to judge).
        let mut canonical = String::with_capacity(512);
        let query = uri.query().unwrap_or_default();
        let names = signature.names();
        canonical_request(method, uri.path(), query, headers, names, payload, Strict(true), &mut canonical).ok()?;
        let (key, cached) = self.key(signature.access_key, signature.date, signature.region, &secret)?;
        let scope = [signature.date, signature.region, SERVICE, "aws4_request"];
        let expected = self::signature(&key, amz_date, &scope, &canonical);
        if !bool::from(expected.as_slice().ct_eq(signature.signature.as_bytes())) {
            return None;
        }
        if !cached {
            // Kept only once a signature made with it verified: nobody without the secret can
            // fill the cache or push the keys in use out of it.
            self.keep(&signature, &secret, key);
        }
        Some(Verified { access_key: signature.access_key.to_owned(), secret, region: signature.region.to_owned() })
    }

    /// The signing key, and whether it came from the cache.
    fn key(&self, access_key: &str, date: &str, region: &str, secret: &str) -> Option<(Arc<KeyedMac>, bool)> {
        let same = |k: &CachedKey| {
            k.access_key == access_key
                && k.date == date
                && k.region == region
                && bool::from(k.secret.as_bytes().ct_eq(secret.as_bytes()))
        };
        if let Some(cached) = self.keys.lock().expect("verification keys poisoned").iter().find(|k| same(k)) {
            return Some((cached.key.clone(), true));
        }
        let day = time::Date::parse(date, time::macros::format_description!("[year][month][day]")).ok()?;
        let at = UNIX_EPOCH + Duration::from_secs(u64::try_from(day.midnight().assume_utc().unix_timestamp()).ok()?);
        Some((Arc::new(keyed(v4::generate_signing_key(secret, at, region, SERVICE).as_ref())?), false))
    }

    fn keep(&self, signature: &HeaderSignature<'_>, secret: &str, key: Arc<KeyedMac>) {
        let mut keys = self.keys.lock().expect("verification keys poisoned");
        if keys.len() >= VERIFY_KEYS_MAX {
            keys.clear();
        }
        keys.push(CachedKey {
            access_key: signature.access_key.to_owned(),
            date: signature.date.to_owned(),
            region: signature.region.to_owned(),
            secret: secret.to_owned(),
            key,
        });
    }
}

/// A signing key of one access key, day and region, and the secret it was derived from.
struct CachedKey {
    access_key: String,
    date: String,
    region: String,
    secret: String,
    key: Arc<KeyedMac>,
}

/// The one value of `name`, as text.
pub fn single<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Option<&'h str> {
    let mut values = headers.get_all(name).iter();
    let value = values.next()?.to_str().ok()?;
    values.next().is_none().then_some(value)
}

/// Whether `YYYYMMDDTHHMMSSZ` is within [`CLOCK_SKEW_MAX`] of `now`; `None` if malformed.
fn within_skew(amz_date: &str, now: SystemTime) -> Option<bool> {
    let b = amz_date.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let number = |range: Range<usize>| -> Option<u32> {
        b[range].iter().try_fold(0u32, |n, d| d.is_ascii_digit().then(|| n * 10 + u32::from(d - b'0')))
    };
    let month = time::Month::try_from(u8::try_from(number(4..6)?).ok()?).ok()?;
    let date =
        time::Date::from_calendar_date(i32::try_from(number(0..4)?).ok()?, month, u8::try_from(number(6..8)?).ok()?)
            .ok()?;
    let hms = (number(9..11)?, number(11..13)?, number(13..15)?);
    let clock =
        time::Time::from_hms(u8::try_from(hms.0).ok()?, u8::try_from(hms.1).ok()?, u8::try_from(hms.2).ok()?).ok()?;
    let at = i128::from(date.with_time(clock).assume_utc().unix_timestamp()) * 1_000_000_000;
    let now = i128::try_from(now.duration_since(UNIX_EPOCH).ok()?.as_nanos()).ok()?;
    Some(now.abs_diff(at) <= CLOCK_SKEW_MAX.as_nanos())
}

fn is_unsigned(name: &HeaderName) -> bool {
    name == AUTHORIZATION || name == USER_AGENT || name == TRANSFER_ENCODING || name.as_str() == X_AMZN_TRACE_ID
}

/// `YYYYMMDDTHHMMSSZ` of a Unix time, in UTC.
fn amz_date(secs: u64) -> Result<String, SignError> {
    let t = i64::try_from(secs)
        .ok()
        .and_then(|secs| time::OffsetDateTime::from_unix_timestamp(secs).ok())
        .ok_or(SignError::Clock)?;
    let year = u32::try_from(t.year()).ok().filter(|y| *y <= 9999).ok_or(SignError::Clock)?;
    let mut out = String::with_capacity(16);
    push_digits(year, 4, &mut out);
    for (i, part) in [u8::from(t.month()), t.day(), t.hour(), t.minute(), t.second()].into_iter().enumerate() {
        if i == 2 {
            out.push('T');
        }
        push_digits(u32::from(part), 2, &mut out);
    }
    out.push('Z');
    Ok(out)
}

/// `value`'s last `width` decimal digits, zero-padded.
fn push_digits(value: u32, width: u32, out: &mut String) {
    for place in (0..width).rev() {
        out.push(char::from(b'0' + (value / 10u32.pow(place) % 10) as u8));
    }
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
    let value = value.trim_matches(' ');
    // A byte loop: a substring search costs more to set up than these values take to scan.
    if !value.as_bytes().windows(2).any(|pair| pair == b"  ") {
        out.push_str(value);
        return;
    }
    let mut previous_space = false;
    for c in value.chars() {
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

/// A SHA-256 digest in lower-case hex.
fn hex(digest: &[u8; 32]) -> [u8; 64] {
    let mut out = [0u8; 64];
    hex::encode_to_slice(digest, &mut out).expect("64 digits for 32 bytes");
    out
}

#[cfg(test)]
mod tests;
