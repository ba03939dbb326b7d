//! The start-up probe (G6): which conditional writes does the upstream really refuse?
//!
//! fencegate relies on the upstream refusing a failed precondition (G4). PutObject must: without
//! it the probe fails. For CopyObject, CompleteMultipartUpload and DeleteObject the probe only
//! reports what the upstream does (several S3-compatible stores ignore `If-Match` on some of
//! them); the caller decides what that costs (`App::probe`, README "Several replicas").

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use s3s::Body;

use super::{Upstream, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no bucket to probe in (set upstream.probe_bucket, or create a bucket)")]
    NoBucket,
    #[error("the upstream ignores `{header}`: a conditional write that must fail answered {status}")]
    IgnoresPrecondition { header: &'static str, status: StatusCode },
    #[error("the upstream answered {status} to the probe's {step}")]
    Unexpected { step: &'static str, status: StatusCode },
    #[error("the upstream could not be reached")]
    Upstream(#[from] UpstreamError),
}

/// Which conditional operations the upstream enforces (refuses with 412 when the precondition
/// fails). PutObject always does once the probe passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enforcement {
    pub copy_object: bool,
    pub complete_multipart_upload: bool,
    pub delete_object: bool,
    /// A multipart upload's id works only with the key it was started on (a part sent under
    /// another key is `NoSuchUpload`). Some stores keep parts by the id alone; fencegate then
    /// checks the pair itself before a multipart step goes ahead.
    pub upload_ids_tied_to_keys: bool,
}

impl Enforcement {
    /// The operations whose preconditions the upstream ignores, by S3 name.
    pub fn ignored(&self) -> Vec<&'static str> {
        [
            (self.copy_object, "CopyObject"),
            (self.complete_multipart_upload, "CompleteMultipartUpload"),
            (self.delete_object, "DeleteObject"),
        ]
        .into_iter()
        .filter(|(enforced, _)| !enforced)
        .map(|(_, name)| name)
        .collect()
    }
}

/// The result of a probe that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probed {
    pub bucket: String,
    pub enforcement: Enforcement,
}

/// A wrong ETag: no object has it.
const WRONG_ETAG: &str = "\"00000000000000000000000000000000\"";

/// Writes a probe object in `bucket` (or the first bucket listed), checks that `If-None-Match: *`
/// on an existing object and a wrong `If-Match` are refused with 412, then tries a wrong
/// `If-Match` on a copy onto it, on the completion of a multipart upload to it and on its
/// delete. The probe object is deleted afterwards.
pub async fn probe_preconditions(upstream: &dyn Upstream, bucket: Option<&str>) -> Result<Probed, ProbeError> {
    let bucket = match bucket {
        Some(b) => b.to_owned(),
        None => first_bucket(upstream).await?.ok_or(ProbeError::NoBucket)?,
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let key = format!(".fencegate-probe-{nanos}");
    let path = format!("/{bucket}/{key}");

    let created = send(upstream, Method::PUT, &path, &[("if-none-match", "*")], "probe").await?.0;
    if !created.is_success() {
        return Err(ProbeError::Unexpected { step: "create", status: created });
    }
    let result = async {
        let again = send(upstream, Method::PUT, &path, &[("if-none-match", "*")], "probe").await?.0;
        if again != StatusCode::PRECONDITION_FAILED {
            return Err(ProbeError::IgnoresPrecondition { header: "If-None-Match: *", status: again });
        }
        let wrong = send(upstream, Method::PUT, &path, &[("if-match", WRONG_ETAG)], "probe").await?.0;
        if wrong != StatusCode::PRECONDITION_FAILED {
            return Err(ProbeError::IgnoresPrecondition { header: "If-Match", status: wrong });
        }
        let copy_headers =
            [("if-match", WRONG_ETAG), ("x-amz-copy-source", path.as_str()), ("x-amz-metadata-directive", "REPLACE")];
        let copy_object = refused(send(upstream, Method::PUT, &path, &copy_headers, "").await?);
        let (complete_multipart_upload, upload_ids_tied_to_keys) = probe_completion(upstream, &path).await?;
        let delete_object = send(upstream, Method::DELETE, &path, &[("if-match", WRONG_ETAG)], "").await?.0
            == StatusCode::PRECONDITION_FAILED;
        Ok(Enforcement { copy_object, complete_multipart_upload, delete_object, upload_ids_tied_to_keys })
    }
    .await;
    let _ = send(upstream, Method::DELETE, &path, &[], "").await;
    result.map(|enforcement| Probed { bucket, enforcement })
}

/// Starts a multipart upload to `path`, uploads one part and completes it with a wrong
/// `If-Match`: whether the completion is refused, and whether a part sent under another key
/// with the same upload id is refused. The upload is aborted either way.
async fn probe_completion(upstream: &dyn Upstream, path: &str) -> Result<(bool, bool), ProbeError> {
    let (status, body) = send(upstream, Method::POST, &format!("{path}?uploads"), &[], "").await?;
    let upload_id = match xml_element(&body, "UploadId") {
        // No multipart support to speak of: nothing to rely on, and nothing to check.
        Some(id) if status.is_success() => id,
        _ => return Ok((false, true)),
    };
    let query = form_urlencoded::Serializer::new(String::new()).append_pair("uploadId", &upload_id).finish();
    let elsewhere = send(upstream, Method::PUT, &format!("{path}-elsewhere?partNumber=2&{query}"), &[], "p").await?.0;
    let tied = !elsewhere.is_success();
    let part_path = format!("{path}?partNumber=1&{query}");
    let (status, etag) = send_for_etag(upstream, &part_path).await?;
    let enforced = match etag {
        Some(etag) if status.is_success() => {
            let xml = format!(
                "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>{etag}</ETag></Part></CompleteMultipartUpload>"
            );
            let complete_path = format!("{path}?{query}");
            let (status, body) =
                send_owned(upstream, Method::POST, &complete_path, &[("if-match", WRONG_ETAG)], xml).await?;
            // A refusal can come as 412, or as 200 with an `<Error>` body.
            status == StatusCode::PRECONDITION_FAILED
                || xml_element(&body, "Code").as_deref() == Some("PreconditionFailed")
        }
        _ => false,
    };
    let _ = send(upstream, Method::DELETE, &format!("{path}?{query}"), &[], "").await;
    Ok((enforced, tied))
}

/// 412, or a 200 whose body is an `<Error>` with `PreconditionFailed` (copies can answer so).
fn refused((status, body): (StatusCode, bytes::Bytes)) -> bool {
    status == StatusCode::PRECONDITION_FAILED || xml_element(&body, "Code").as_deref() == Some("PreconditionFailed")
}

async fn send(
    upstream: &dyn Upstream,
    method: Method,
    path: &str,
    headers: &[(&'static str, &str)],
    body: &'static str,
) -> Result<(StatusCode, bytes::Bytes), ProbeError> {
    send_owned(upstream, method, path, headers, body.to_owned()).await
}

async fn send_owned(
    upstream: &dyn Upstream,
    method: Method,
    path: &str,
    headers: &[(&'static str, &str)],
    body: String,
) -> Result<(StatusCode, bytes::Bytes), ProbeError> {
    let mut builder = http::Request::builder().method(method).uri(path).header("content-length", body.len());
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let req = builder.body(Body::from(body)).map_err(|_| ProbeError::Unexpected {
        step: "building a request (the probe bucket's name)",
        status: StatusCode::BAD_REQUEST,
    })?;
    let resp = upstream.send(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.map_err(UpstreamError::Transport)?.to_bytes();
    Ok((status, bytes))
}

/// Uploads a one-byte part; the status and the part's ETag.
async fn send_for_etag(upstream: &dyn Upstream, path: &str) -> Result<(StatusCode, Option<String>), ProbeError> {
    let req = http::Request::builder()
        .method(Method::PUT)
        .uri(path)
        .header("content-length", 1)
        .body(Body::from("p".to_owned()))
        .map_err(|_| ProbeError::Unexpected { step: "building the part upload", status: StatusCode::BAD_REQUEST })?;
    let resp = upstream.send(req).await?;
    let etag = resp.headers().get(http::header::ETAG).and_then(|v| v.to_str().ok()).map(str::to_owned);
    Ok((resp.status(), etag))
}

async fn first_bucket(upstream: &dyn Upstream) -> Result<Option<String>, ProbeError> {
    let req = http::Request::builder().method(Method::GET).uri("/").body(Body::empty()).expect("static request");
    let resp = upstream.send(req).await?;
    if !resp.status().is_success() {
        return Err(ProbeError::Unexpected { step: "bucket listing", status: resp.status() });
    }
    let bytes = resp.into_body().collect().await.map_err(UpstreamError::Transport)?.to_bytes();
    Ok(xml_element(&bytes, "Name"))
}

/// The text of the first `<name>` element, if any (small, trusted XML from the upstream).
pub(crate) fn xml_element(xml: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(xml).ok()?;
    let start = text.find(&format!("<{name}>"))? + name.len() + 2;
    let end = text[start..].find(&format!("</{name}>"))? + start;
    Some(text[start..end].to_owned())
}
