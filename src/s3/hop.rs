//! The hop to the upstream: the request as forwarded (the client's headers less the hop's own,
//! the query less fencegate's presign parameters), one bounded call ([`Hop`]), and the answer as
//! the client gets it. A write's calls are bounded by its deadline and never abandoned once the
//! request may have reached the upstream (`src/fence/outcome.rs`, `ops/write.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use s3s::{Body, S3Response};

use super::error::FrontError;
use super::objects::{self, ObjectState};
use super::{Request, WireContract};
use crate::aws::amz::{X_AMZ_DECODED_CONTENT_LENGTH, X_AMZ_SDK_CHECKSUM_ALGORITHM, X_AMZ_TRAILER};
use crate::config::millis;
use crate::fence::UploadRecord;
use crate::metrics;
use crate::net::body::TrailerCheck;
use crate::net::server::{REQUEST_HOP_HEADERS, remove_response_hop_headers};
use crate::upstream::{Upstream, UpstreamError};

/// S3 request headers about fencegate's own signature and framing (besides the hop-by-hop
/// ones of every listener): never forwarded, the upstream request is signed anew.
const S3_HOP_HEADERS: &[&str] = &[
    "authorization",
    "x-amz-date",
    "x-amz-content-sha256",
    "x-amz-security-token",
    "x-amz-decoded-content-length",
    "x-amz-trailer",
];

/// Query parameters of presigned URLs: fencegate's own signature, not the upstream's.
const PRESIGN_PARAMS: &[&str] = &[
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "AWSAccessKeyId",
    "Signature",
    "Expires",
];

/// Success responses of these operations can still carry an `<Error>` body; they are read
/// (bounded) before the write counts as committed.
pub const XML_RESPONSE_BYTES_MAX: usize = 1024 * 1024;

/// Calls to the upstream outside an admitted write (reads, listings, aborts), each bounded by
/// `upstream.request_timeout_ms`: the front's and the operator's jobs' alike.
#[derive(Clone)]
pub struct Hop {
    upstream: Arc<dyn Upstream>,
    /// `upstream.request_timeout_ms`.
    request_timeout: Duration,
}

impl Hop {
    pub fn new(upstream: Arc<dyn Upstream>, request_timeout: Duration) -> Self {
        Self { upstream, request_timeout }
    }

    pub fn upstream(&self) -> &Arc<dyn Upstream> {
        &self.upstream
    }

    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// One call, bounded; `op` names it in `fencegate_upstream_*`.
    pub async fn send(
        &self,
        op: &'static str,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: Body,
    ) -> Result<http::Response<Body>, FrontError> {
        let req = upstream_request(method, path_and_query, headers, body)?;
        let started = Instant::now();
        let result = match tokio::time::timeout(self.request_timeout, self.upstream.send(req)).await {
            Ok(result) => result,
            Err(_) => Err(UpstreamError::Timeout { after_ms: millis(self.request_timeout) }),
        };
        let status = result.as_ref().ok().map(|r| r.status().as_u16());
        metrics::upstream_call(op, started.elapsed(), status);
        if let Some(status) = status {
            tracing::Span::current().record("upstream_status", status);
        }
        result.map_err(FrontError::Upstream)
    }

    /// An object's head (`raw_path`: `/bucket/key` as sent), bounded like any read.
    pub async fn head(&self, raw_path: &str) -> Result<ObjectState, FrontError> {
        let read = objects::head(self.upstream.as_ref(), raw_path);
        tokio::time::timeout(self.request_timeout, read)
            .await
            .map_err(|_| FrontError::Upstream(UpstreamError::Timeout { after_ms: millis(self.request_timeout) }))?
    }

    /// AbortMultipartUpload for `record`'s upload. Its record is the caller's to forget.
    pub async fn abort_upload(
        &self,
        record: &UploadRecord,
        op: &'static str,
    ) -> Result<http::Response<Body>, FrontError> {
        let query = form_urlencoded::Serializer::new(String::new()).append_pair("uploadId", &record.upload_id).finish();
        let path = format!("{}?{query}", record.path);
        self.send(op, Method::DELETE, &path, HeaderMap::new(), Body::empty()).await
    }

    /// Whether the upstream still has a recorded upload (a ListParts of one part: 404 when it
    /// was completed or aborted).
    pub async fn upload_exists(&self, record: &UploadRecord) -> Result<bool, String> {
        let query = form_urlencoded::Serializer::new(String::new())
            .append_pair("max-parts", "1")
            .append_pair("uploadId", &record.upload_id)
            .finish();
        let path = format!("{}?{query}", record.path);
        match self.send("verify_upload", Method::GET, &path, HeaderMap::new(), Body::empty()).await {
            Ok(resp) if resp.status() == StatusCode::NOT_FOUND => Ok(false),
            Ok(resp) if resp.status().is_success() => Ok(true),
            Ok(resp) => Err(format!("ListParts of upload {} answered {}", record.upload_id, resp.status())),
            Err(error) => Err(format!("ListParts of upload {}: {error}", record.upload_id)),
        }
    }
}

pub(super) fn upstream_request(
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: Body,
) -> Result<http::Request<Body>, FrontError> {
    let mut req =
        http::Request::builder().method(method).uri(path_and_query).body(body).map_err(|_| FrontError::UnsafeKey)?;
    *req.headers_mut() = headers;
    Ok(req)
}

pub(super) fn trailer_check(request: &Request) -> Option<TrailerCheck> {
    let announced = request.headers.get(X_AMZ_TRAILER)?.to_str().ok()?;
    TrailerCheck::new(announced, request.trailers.clone()?)
}

/// Whether a `Content-Encoding` names the aws-chunked framing.
fn aws_chunked(value: &HeaderValue) -> bool {
    value.to_str().is_ok_and(|v| v.split(',').any(|e| e.trim().eq_ignore_ascii_case("aws-chunked")))
}

/// The client's headers minus everything about the hop to fencegate.
pub(super) fn upstream_headers(headers: &HeaderMap, wire: &WireContract) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        let hop = REQUEST_HOP_HEADERS.contains(&n) || S3_HOP_HEADERS.contains(&n);
        if hop || *name == wire.token_header || *name == wire.resource_header {
            continue;
        }
        if *name == http::header::CONTENT_ENCODING && aws_chunked(value) {
            // aws-chunked is the framing s3s already removed; keep any real encoding, and an
            // encoding without it as the client sent it.
            let rest: Vec<&str> = value
                .to_str()
                .unwrap_or("")
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("aws-chunked"))
                .collect();
            if !rest.is_empty()
                && let Ok(v) = HeaderValue::from_str(&rest.join(", "))
            {
                out.append(name.clone(), v);
            }
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if let Some(decoded) = headers.get(X_AMZ_DECODED_CONTENT_LENGTH) {
        out.insert(http::header::CONTENT_LENGTH, decoded.clone());
    }
    // The algorithm header goes with a checksum header; a trailing checksum is verified here
    // and not forwarded (the body goes upstream unframed), so its algorithm header goes too.
    if headers.contains_key(X_AMZ_TRAILER) {
        out.remove(X_AMZ_SDK_CHECKSUM_ALGORITHM);
    }
    out
}

/// The query to forward: the client's, less fencegate's own presign parameters.
pub(super) fn forwarded_query(query: Option<&str>) -> String {
    let Some(query) = query.filter(|q| !q.is_empty()) else {
        return String::new();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or("");
            !PRESIGN_PARAMS.contains(&name)
        })
        .collect();
    if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) }
}

pub(super) fn client_response(resp: http::Response<Body>) -> S3Response<Body> {
    let (parts, body) = resp.into_parts();
    let mut headers = parts.headers;
    remove_response_hop_headers(&mut headers);
    let mut out = S3Response::with_headers(body, headers);
    out.status = Some(parts.status);
    out
}

/// Reads a small XML response (CopyObject, CompleteMultipartUpload) and says whether it is a
/// real success: S3 can answer 200 with an `<Error>` body.
pub(super) async fn read_xml_response(resp: http::Response<Body>) -> Result<(http::Response<Body>, bool), FrontError> {
    let (parts, body) = resp.into_parts();
    let limited = http_body_util::Limited::new(body, XML_RESPONSE_BYTES_MAX);
    let bytes: Bytes = limited
        .collect()
        .await
        .map_err(|e| FrontError::Upstream(crate::upstream::UpstreamError::Transport(e)))?
        .to_bytes();
    let committed = parts.status.is_success() && !contains_error_element(&bytes);
    Ok((http::Response::from_parts(parts, Body::from(bytes)), committed))
}

/// An S3 error document's `<Code>` and `<Message>` (a key's failed delete, a failed listing).
pub fn error_of(body: &[u8]) -> (String, String) {
    let text = String::from_utf8_lossy(body);
    let field = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find(&format!("</{name}>"))? + start;
        quick_xml::escape::unescape(&text[start..end]).ok().map(|s| s.into_owned())
    };
    (field("Code").unwrap_or_else(|| "InternalError".into()), field("Message").unwrap_or_default())
}

fn contains_error_element(xml: &[u8]) -> bool {
    xml.windows(b"<Error>".len()).any(|w| w == b"<Error>")
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderName;

    #[test]
    fn presign_parameters_are_not_forwarded() {
        assert_eq!(forwarded_query(None), "");
        assert_eq!(forwarded_query(Some("X-Amz-Signature=abc&X-Amz-Date=1")), "");
        assert_eq!(forwarded_query(Some("uploadId=7&X-Amz-Signature=abc&partNumber=2")), "?uploadId=7&partNumber=2");
    }

    #[test]
    fn hop_headers_and_fencing_headers_are_not_forwarded() {
        let wire = WireContract {
            token_header: HeaderName::from_static("fencing-token"),
            resource_header: HeaderName::from_static("fencing-resource"),
            rules: vec![],
        };
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "AWS4-HMAC-SHA256 ..."),
            ("fencing-token", "12"),
            ("content-encoding", "aws-chunked,gzip"),
            ("x-amz-decoded-content-length", "5"),
            ("content-length", "90"),
            ("x-amz-meta-a", "b"),
        ] {
            h.insert(k, v.parse().unwrap());
        }
        let out = upstream_headers(&h, &wire);
        assert!(out.get("authorization").is_none() && out.get("fencing-token").is_none());
        assert_eq!(out["content-encoding"], "gzip");
        h.insert("content-encoding", "deflate,  gzip".parse().unwrap());
        assert_eq!(upstream_headers(&h, &wire)["content-encoding"], "deflate,  gzip", "no framing: as sent");
        assert_eq!(out["content-length"], "5");
        assert_eq!(out["x-amz-meta-a"], "b");
    }

    #[test]
    fn error_bodies_in_success_responses_are_seen() {
        assert!(contains_error_element(b"<?xml version=\"1.0\"?><Error><Code>InternalError</Code></Error>"));
        assert!(!contains_error_element(b"<CopyObjectResult><ETag>x</ETag></CopyObjectResult>"));
    }
}
