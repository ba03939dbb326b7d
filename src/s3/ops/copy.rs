//! CopyObject: the destination is written like any object (stamped, conditional, G4). With
//! the `COPY` metadata directive the source's metadata is read and sent with `REPLACE`, so the
//! stamp can be added without losing the rest. On an upstream that ignores `If-Match` on
//! copies, across replicas, the copy is made as a read and a conditional PUT instead.

use std::time::SystemTime;

use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use s3s::{Body, S3Response};

use super::conditional::{Attempt, Cached, ObjectWrite, Resend, set_precondition};
use super::write::WriteBody;
use super::{Admitted, Ctx, Request, Target, stamp};
use crate::net::body::ForwardBody;
use crate::s3::METADATA_TOKEN_HEADER;
use crate::s3::error::FrontError;
use crate::s3::hop::{client_response, upstream_headers};
use crate::s3::objects::{Comparison, ObjectState, etag_listed};

impl Ctx {
    pub(super) async fn copy_object(
        &self,
        request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        if self.copy_by_read_and_put {
            return self.copy_by_read_and_put(request, admitted).await;
        }
        let write = ObjectWrite::of(&request, &admitted)?;
        // The destination first: a stale or refused copy costs no read of its source.
        let state =
            self.starting_state(&write, self.cached_unless_ignored(self.judged.copy_object, Cached::Any)).await?;
        let keeps_metadata = !replaces_metadata(&request.headers);
        let mut headers = request.headers.clone();
        stamp(&mut headers, admitted.token);
        let headers = upstream_headers(&headers, &self.wire);
        let path = request.path_and_query();
        let mut attempts =
            CopyAttempts { base: &headers, keeps_metadata, path: &path, object: &write.object, admitted: &admitted };
        self.conditional_write(&write, state, &mut attempts).await
    }

    /// CopyObject as a read of the source and a stamped, conditional PUT of its bytes to the
    /// destination (streamed through fencegate, cancellable like any upload), for an upstream
    /// that ignores `If-Match` on copies: the write is then refused per object when it lands
    /// late, like any PutObject (G4). The client's copy-source conditions become the read's
    /// conditions; the answer is S3's `CopyObjectResult`. Each attempt reads the source again.
    async fn copy_by_read_and_put(&self, request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let source = request
            .headers
            .get("x-amz-copy-source")
            .and_then(|v| v.to_str().ok())
            .ok_or(FrontError::NotSupported("CopyObject without x-amz-copy-source"))?;
        let source_path = format!("/{}", source.trim_start_matches('/'));
        let replaces = replaces_metadata(&request.headers);
        let mut read_headers = HeaderMap::new();
        for (from, to) in COPY_SOURCE_CONDITIONS {
            if let Some(value) = request.headers.get(*from) {
                read_headers.insert(to.clone(), value.clone());
            }
        }
        let mut put_headers = request.headers.clone();
        for name in ["x-amz-copy-source", "x-amz-metadata-directive", "x-amz-tagging-directive"] {
            put_headers.remove(name);
        }
        let conditions: Vec<HeaderName> =
            put_headers.keys().filter(|name| name.as_str().starts_with("x-amz-copy-source-")).cloned().collect();
        for name in conditions {
            put_headers.remove(name);
        }
        stamp(&mut put_headers, admitted.token);
        let write = ObjectWrite::of(&request, &admitted)?;
        let state = self.starting_state(&write, Cached::Any).await?;
        let mut attempts = ReadAndPutAttempts {
            source_path: &source_path,
            read_headers: &read_headers,
            put_headers: &put_headers,
            replaces,
            raw_path: &request.target.raw_path,
            object: &write.object,
            admitted: &admitted,
        };
        self.conditional_write(&write, state, &mut attempts).await
    }

    /// Replaces a COPY directive by REPLACE with the source's own metadata.
    /// (A copy made by [`Self::copy_by_read_and_put`] takes it from its read instead.)
    /// For a copy that keeps its source's metadata (`COPY`): reads the source and puts its
    /// metadata on the request with `REPLACE` (so that the stamp can be added), pinned to the
    /// version read (`x-amz-copy-source-if-match`), so that bytes and metadata are one version's.
    /// Returns the pinned ETag, `None` when there is no source to read (the copy then fails
    /// with the upstream's own error). The client's copy-source conditions are judged here on
    /// the version read, in S3's order, and one that fails is the client's 412, as from S3;
    /// the pin makes the upstream copy exactly that version, so they are not sent (beside the
    /// pin's `-if-match` S3 would not judge `-if-unmodified-since`, and a refused pin would
    /// not say whose condition failed).
    async fn copy_source_metadata(&self, headers: &mut HeaderMap) -> Result<Option<HeaderValue>, FrontError> {
        let Some(source) = headers_source(headers) else { return Ok(None) };
        let source_path = format!("/{}", source.trim_start_matches('/'));
        let resp =
            self.hop.send("copy_source_head", Method::HEAD, &source_path, HeaderMap::new(), Body::empty()).await?;
        let Some(etag) = resp.status().is_success().then(|| resp.headers().get(http::header::ETAG).cloned()).flatten()
        else {
            return Ok(None);
        };
        if !source_conditions_hold(headers, &etag, resp.headers().get(http::header::LAST_MODIFIED), SystemTime::now()) {
            return Err(FrontError::ClientPrecondition);
        }
        for (name, _) in COPY_SOURCE_CONDITIONS {
            headers.remove(*name);
        }
        copy_metadata(resp.headers(), headers);
        headers.insert("x-amz-metadata-directive", HeaderValue::from_static("REPLACE"));
        headers.insert("x-amz-copy-source-if-match", etag.clone());
        Ok(Some(etag))
    }

    /// The copy source's ETag now, `None` if it cannot be read.
    async fn copy_source_etag(&self, source: Option<&str>) -> Result<Option<HeaderValue>, FrontError> {
        let Some(source) = source else { return Ok(None) };
        let source_path = format!("/{}", source.trim_start_matches('/'));
        let resp =
            self.hop.send("copy_source_head", Method::HEAD, &source_path, HeaderMap::new(), Body::empty()).await?;
        Ok(resp.status().is_success().then(|| resp.headers().get(http::header::ETAG).cloned()).flatten())
    }
}

/// Reads of a copy's source when it keeps changing under the copy (each a HEAD and a copy).
const SOURCE_READS_MAX: u32 = 3;

/// CopyObject's attempts: the upstream copies, pinned to the source version read for its
/// metadata when the copy keeps it.
struct CopyAttempts<'a> {
    base: &'a HeaderMap,
    keeps_metadata: bool,
    path: &'a str,
    object: &'a str,
    admitted: &'a Admitted,
}

impl Resend for CopyAttempts<'_> {
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>> {
        Box::pin(async move {
            let Self { base, keeps_metadata, path, object, admitted } = *self;
            let mut reads = 0;
            loop {
                let mut headers = base.clone();
                let pinned = if keeps_metadata { ctx.copy_source_metadata(&mut headers).await? } else { None };
                set_precondition(&mut headers, &state);
                let body = WriteBody::InMemory(Body::empty());
                let resp = ctx.send_write("copy_object", admitted, Method::PUT, path, headers, body).await?;
                let (resp, committed) = ctx.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
                if committed {
                    ctx.remember_write(object.to_owned(), resp.headers(), admitted.token);
                    return Ok(Attempt::Committed(client_response(resp)));
                }
                let judged_more = client_source_condition(base, pinned.is_some());
                if let Some(pinned) = pinned.filter(|_| resp.status() == StatusCode::PRECONDITION_FAILED) {
                    // The destination changed, or the pinned source changed between its read
                    // and the copy (the client's source conditions were judged on the read). A
                    // source that reads otherwise now is read again at once, so that the copy's
                    // bytes and metadata are one version's.
                    reads += 1;
                    let now = ctx.copy_source_etag(headers_source(base)).await?;
                    if now.as_ref() != Some(&pinned) {
                        if reads < SOURCE_READS_MAX {
                            continue;
                        }
                        // The source never settled: not the client's refusal, and no fault of
                        // the upstream's: writers keep changing it.
                        return Err(FrontError::PreconditionRace);
                    }
                }
                return Ok(if judged_more {
                    Attempt::NotCommittedJudgedMore(resp)
                } else {
                    Attempt::NotCommitted(resp)
                });
            }
        })
    }
}

/// The attempts of a copy made as a read of its source and a stamped PUT: each reads the
/// source again.
struct ReadAndPutAttempts<'a> {
    source_path: &'a str,
    read_headers: &'a HeaderMap,
    put_headers: &'a HeaderMap,
    /// `x-amz-metadata-directive: REPLACE`: the request's metadata, not the source's.
    replaces: bool,
    raw_path: &'a str,
    object: &'a str,
    admitted: &'a Admitted,
}

impl Resend for ReadAndPutAttempts<'_> {
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>> {
        Box::pin(async move {
            let Self { source_path, read_headers, put_headers, replaces, raw_path, object, admitted } = *self;
            let source =
                ctx.hop.send("copy_source_read", Method::GET, source_path, read_headers.clone(), Body::empty()).await?;
            match source.status() {
                StatusCode::PRECONDITION_FAILED | StatusCode::NOT_MODIFIED => {
                    return Err(FrontError::CopySourceCondition);
                }
                status if !status.is_success() => return Ok(Attempt::Final(client_response(source))),
                _ => {}
            }
            let (source, body) = source.into_parts();
            let mut headers = put_headers.clone();
            if !replaces {
                copy_metadata(&source.headers, &mut headers);
            }
            let Some(length) = source.headers.get(http::header::CONTENT_LENGTH) else {
                return Err(FrontError::UpstreamStatus {
                    step: "the copy source read (no length)",
                    status: source.status,
                });
            };
            headers.insert(http::header::CONTENT_LENGTH, length.clone());
            let mut headers = upstream_headers(&headers, &ctx.wire);
            set_precondition(&mut headers, &state);
            let (body, report) = ForwardBody::new(body, Some(admitted.permit.clone()), None, 0);
            let body = WriteBody::Streamed(Body::http_body(body));
            let result = ctx.send_write("copy_object", admitted, Method::PUT, raw_path, headers, body).await;
            let resp = ctx.settle_body(result, &report, admitted).await?;
            if !resp.status().is_success() {
                return Ok(Attempt::NotCommitted(resp));
            }
            let etag = resp.headers().get(http::header::ETAG).cloned();
            ctx.remember_write(object.to_owned(), resp.headers(), admitted.token);
            Ok(Attempt::Committed(copy_result(etag)))
        })
    }
}

/// Whether the upstream judges a copy-source condition of the client's: not on a pinned copy,
/// whose conditions fencegate judged ([`Ctx::copy_source_metadata`]).
fn client_source_condition(headers: &HeaderMap, pinned: bool) -> bool {
    !pinned && COPY_SOURCE_CONDITIONS.iter().any(|(name, _)| headers.contains_key(*name))
}

/// The client's copy-source conditions on a source whose ETag and `Last-Modified` are given,
/// judged at `now` in S3's order: `-if-match` (else `-if-unmodified-since`) must hold, and
/// `-if-none-match` (else `-if-modified-since`) must not say unchanged. ETags compare as for
/// the client's own `If-Match` / `If-None-Match` (quotes optional). A date that cannot be
/// read is ignored, and so is an `-if-modified-since` later than `now` (RFC 9110, 13.1.3:
/// S3 then copies).
fn source_conditions_hold(
    headers: &HeaderMap,
    etag: &HeaderValue,
    last_modified: Option<&HeaderValue>,
    now: SystemTime,
) -> bool {
    let date =
        |v: Option<&HeaderValue>| v.and_then(|v| v.to_str().ok()).and_then(|v| httpdate::parse_http_date(v).ok());
    let modified = date(last_modified);
    let failed = match headers.get("x-amz-copy-source-if-match") {
        Some(wanted) => !etag_listed(wanted, etag, Comparison::Strong),
        None => date(headers.get("x-amz-copy-source-if-unmodified-since")).zip(modified).is_some_and(|(d, m)| m > d),
    };
    let unchanged = match headers.get("x-amz-copy-source-if-none-match") {
        Some(unwanted) => etag_listed(unwanted, etag, Comparison::Weak),
        None => date(headers.get("x-amz-copy-source-if-modified-since"))
            .filter(|d| *d <= now)
            .zip(modified)
            .is_some_and(|(d, m)| m <= d),
    };
    !failed && !unchanged
}

fn headers_source(headers: &HeaderMap) -> Option<&str> {
    headers.get("x-amz-copy-source").and_then(|v| v.to_str().ok())
}

/// `x-amz-metadata-directive: REPLACE`: the copy takes the request's metadata, not the source's.
fn replaces_metadata(headers: &HeaderMap) -> bool {
    headers.get("x-amz-metadata-directive").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"REPLACE"))
}

/// A CopyObject of an object onto itself that changes nothing S3 counts (metadata, tags,
/// storage class, website redirect, encryption), from its current version.
pub(super) fn copies_onto_itself_unchanged(target: &Target, headers: &HeaderMap) -> bool {
    let Some(source) = headers.get("x-amz-copy-source").and_then(|v| v.to_str().ok()) else { return false };
    if source.contains("versionId=") {
        return false;
    }
    let source = source.split('?').next().unwrap_or("");
    let Some(source) = crate::net::percent::decode(source.trim_start_matches('/')) else { return false };
    let same = target.object_name().is_some_and(|name| name == source);
    let replaces = |name: &str| headers.get(name).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"REPLACE"));
    let changes = replaces("x-amz-metadata-directive")
        || replaces("x-amz-tagging-directive")
        || ["x-amz-storage-class", "x-amz-website-redirect-location", "x-amz-server-side-encryption"]
            .iter()
            .any(|name| headers.contains_key(*name));
    same && !changes
}

/// The client's conditions on a copy's source, and the read conditions they become.
const COPY_SOURCE_CONDITIONS: &[(&str, HeaderName)] = &[
    ("x-amz-copy-source-if-match", http::header::IF_MATCH),
    ("x-amz-copy-source-if-none-match", http::header::IF_NONE_MATCH),
    ("x-amz-copy-source-if-modified-since", http::header::IF_MODIFIED_SINCE),
    ("x-amz-copy-source-if-unmodified-since", http::header::IF_UNMODIFIED_SINCE),
];

/// The source object's metadata a copy keeps: its user metadata (less the stamp) and the
/// content headers.
fn copy_metadata(source: &HeaderMap, into: &mut HeaderMap) {
    const COPIED: &[HeaderName] = &[
        http::header::CONTENT_TYPE,
        http::header::CONTENT_ENCODING,
        http::header::CONTENT_DISPOSITION,
        http::header::CONTENT_LANGUAGE,
        http::header::CACHE_CONTROL,
        http::header::EXPIRES,
    ];
    for (name, value) in source {
        let user_metadata = name.as_str().starts_with("x-amz-meta-") && name.as_str() != METADATA_TOKEN_HEADER;
        if user_metadata || COPIED.contains(name) {
            into.insert(name.clone(), value.clone());
        }
    }
}

/// S3's answer to a CopyObject: the new ETag and the time of the copy.
fn copy_result(etag: Option<HeaderValue>) -> S3Response<Body> {
    let now = time::OffsetDateTime::now_utc();
    let last_modified = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        now.millisecond()
    );
    let etag = etag.and_then(|e| e.to_str().ok().map(|e| e.replace('"', "&quot;"))).unwrap_or_default();
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CopyObjectResult><LastModified>{last_modified}</LastModified><ETag>{etag}</ETag></CopyObjectResult>"
    );
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    let mut resp = S3Response::with_headers(Body::from(xml), headers);
    resp.status = Some(StatusCode::OK);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    const ETAG: &str = "\"abc\"";
    const MODIFIED: &str = "Wed, 02 Dec 2026 12:00:00 GMT";
    const BEFORE: &str = "Wed, 02 Dec 2026 11:59:59 GMT";
    const AFTER: &str = "Wed, 02 Dec 2026 12:00:01 GMT";
    const NOW: &str = "Wed, 02 Dec 2026 13:00:00 GMT";
    const FUTURE: &str = "Wed, 02 Dec 2026 13:00:01 GMT";

    fn holds(conditions: &[(&'static str, &str)]) -> bool {
        let mut headers = HeaderMap::new();
        for (name, value) in conditions {
            headers.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        let now = httpdate::parse_http_date(NOW).unwrap();
        source_conditions_hold(
            &headers,
            &HeaderValue::from_static(ETAG),
            Some(&HeaderValue::from_static(MODIFIED)),
            now,
        )
    }

    /// S3's order (and the local upstream's, `ReadConditions::check`): `-if-match` decides
    /// over `-if-unmodified-since`, `-if-none-match` over `-if-modified-since`.
    #[test]
    fn the_clients_source_conditions_are_judged_in_s3s_order() {
        const IF_MATCH: &str = "x-amz-copy-source-if-match";
        const IF_NONE_MATCH: &str = "x-amz-copy-source-if-none-match";
        const IF_MODIFIED: &str = "x-amz-copy-source-if-modified-since";
        const IF_UNMODIFIED: &str = "x-amz-copy-source-if-unmodified-since";
        assert!(holds(&[]));
        assert!(holds(&[(IF_MATCH, ETAG)]));
        assert!(holds(&[(IF_MATCH, "\"x\", \"abc\"")]));
        assert!(holds(&[(IF_MATCH, "*")]));
        assert!(!holds(&[(IF_MATCH, "\"x\"")]));
        assert!(holds(&[(IF_UNMODIFIED, MODIFIED)]));
        assert!(holds(&[(IF_UNMODIFIED, AFTER)]));
        assert!(!holds(&[(IF_UNMODIFIED, BEFORE)]));
        assert!(holds(&[(IF_MATCH, ETAG), (IF_UNMODIFIED, BEFORE)]), "if-match decides");
        assert!(holds(&[(IF_UNMODIFIED, "not a date")]), "a date that cannot be read is ignored");
        assert!(!holds(&[(IF_NONE_MATCH, ETAG)]));
        assert!(!holds(&[(IF_NONE_MATCH, "*")]));
        assert!(holds(&[(IF_NONE_MATCH, "\"x\"")]));
        assert!(holds(&[(IF_MODIFIED, BEFORE)]));
        assert!(!holds(&[(IF_MODIFIED, MODIFIED)]));
        assert!(!holds(&[(IF_MODIFIED, AFTER)]));
        assert!(holds(&[(IF_NONE_MATCH, "\"x\""), (IF_MODIFIED, AFTER)]), "if-none-match decides");
        assert!(!holds(&[(IF_MATCH, ETAG), (IF_NONE_MATCH, ETAG)]));
        assert!(holds(&[(IF_MATCH, "abc")]), "quotes are optional");
        assert!(!holds(&[(IF_NONE_MATCH, "abc")]), "quotes are optional");
        assert!(!holds(&[(IF_MATCH, "W/\"abc\"")]), "if-match compares strongly");
        assert!(!holds(&[(IF_NONE_MATCH, "W/\"abc\"")]), "if-none-match compares weakly");
        assert!(!holds(&[(IF_MODIFIED, NOW)]));
        assert!(holds(&[(IF_MODIFIED, FUTURE)]), "a date later than now is ignored");
    }
}
