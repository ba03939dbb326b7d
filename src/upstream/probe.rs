//! The start-up probe (G6): which conditional writes does the upstream really judge, and in
//! which form does it read an ETag?
//!
//! fencegate relies on the upstream refusing a failed precondition and accepting a met one
//! (G4). For PutObject both must hold, or the probe fails. For CopyObject,
//! CompleteMultipartUpload and DeleteObject the probe reports whether the upstream enforces
//! them (several S3-compatible stores ignore `If-Match` on some); the caller decides what
//! that costs (`App::probe`, README "Several replicas"). A met precondition refused on any of
//! them fails the probe: fencegate sends its precondition on every such write, so each one
//! would be refused.
//!
//! Some stores compare `If-Match` with the ETag without its quotes (Ceph RGW 16 on writes):
//! the probe tries the right ETag quoted, then bare, and the form that passes is the one the
//! upstream is sent from then on ([`EtagForm`]).

use std::sync::Mutex;
use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use s3s::Body;

use super::{EtagForm, Upstream, UpstreamError};

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no bucket to probe in (set upstream.probe_bucket, or create a bucket)")]
    NoBucket,
    #[error("the probe bucket {bucket:?} does not exist at the upstream (upstream.probe_bucket)")]
    BucketMissing { bucket: String },
    #[error(
        "the upstream refused fencegate's credentials ({status} {code}); check upstream.access_key_id and \
         upstream.secret_access_key"
    )]
    CredentialsRefused { status: StatusCode, code: String },
    #[error("the upstream could not be reached: {0}")]
    Unreachable(#[from] UpstreamError),
    #[error("the upstream ignores `{header}`: a conditional write that must fail answered {status}")]
    IgnoresPrecondition { header: &'static str, status: StatusCode },
    #[error(
        "the upstream refuses a met precondition: {operation} with {condition} answered {status}, so every such \
         write through fencegate would be refused"
    )]
    RefusesMetPrecondition { operation: &'static str, condition: &'static str, status: StatusCode },
    #[error("the upstream answered {status} {code} to the probe's {step}")]
    Unexpected { step: &'static str, status: StatusCode, code: String },
}

impl ProbeError {
    /// Whether the probe could not run at all (nothing is known of the upstream's
    /// preconditions), rather than ran and found them wanting.
    pub fn could_not_run(&self) -> bool {
        matches!(
            self,
            Self::NoBucket | Self::BucketMissing { .. } | Self::CredentialsRefused { .. } | Self::Unreachable(_)
        )
    }
}

/// Which conditional operations the upstream enforces: refuses a failed precondition (412)
/// and accepts a met one. PutObject always does once the probe passed.
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
    /// Nothing known to be judged.
    pub const NONE: Self = Self {
        copy_object: false,
        complete_multipart_upload: false,
        delete_object: false,
        upload_ids_tied_to_keys: false,
    };

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
    /// The form in which this upstream reads an ETag in `If-Match`.
    pub etag_form: EtagForm,
}

/// The keys beside the probe object that a copy and a completion create.
const COPY: &str = "copy";
const UPLOAD: &str = "upload";

/// A wrong ETag: no object has it.
const WRONG_ETAG: &str = "\"00000000000000000000000000000000\"";

/// Writes a probe object in `bucket` (or the first bucket listed) with `If-None-Match: *`,
/// checks PutObject's preconditions both ways (and finds the ETag form), then CopyObject's,
/// CompleteMultipartUpload's and DeleteObject's. Each request is bounded by `timeout`. Every
/// probe object and upload is removed afterwards, whatever the outcome. The upstream is left
/// sending ETags in the form found ([`Upstream::use_etag_form`]).
pub async fn probe_preconditions(
    upstream: &dyn Upstream,
    bucket: Option<&str>,
    timeout: Duration,
) -> Result<Probed, ProbeError> {
    let bucket = match bucket {
        Some(b) => b.to_owned(),
        None => first_bucket(upstream, timeout).await?.ok_or(ProbeError::NoBucket)?,
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let probe =
        Probe { upstream, path: format!("/{bucket}/.fencegate-probe-{nanos}"), timeout, uploads: Mutex::default() };

    let created = probe.send(Method::PUT, &probe.path, &[("if-none-match", "*")], "probe").await?;
    if !created.status.is_success() {
        return Err(could_not_create(created, &bucket));
    }
    let result = probe.run(created.etag).await;
    probe.clean_up().await;
    result.map(|(enforcement, etag_form)| Probed { bucket, enforcement, etag_form })
}

/// Why the first write of the probe failed: the upstream's own reason when it names one that
/// means the probe could not run.
fn could_not_create(answer: Answer, bucket: &str) -> ProbeError {
    match (answer.status, answer.code.as_str()) {
        (StatusCode::FORBIDDEN, _) | (StatusCode::UNAUTHORIZED, _) => {
            ProbeError::CredentialsRefused { status: answer.status, code: answer.code }
        }
        (StatusCode::NOT_FOUND, _) | (_, "NoSuchBucket") => ProbeError::BucketMissing { bucket: bucket.to_owned() },
        (StatusCode::PRECONDITION_FAILED, _) => ProbeError::RefusesMetPrecondition {
            operation: "PutObject",
            condition: "If-None-Match: * on a new key",
            status: answer.status,
        },
        _ => ProbeError::Unexpected {
            step: "write of a new object with If-None-Match: *",
            status: answer.status,
            code: answer.code,
        },
    }
}

/// One upstream answer, reduced to what the probe judges.
struct Answer {
    status: StatusCode,
    /// The `Code` of an S3 `<Error>` body, empty when there is none.
    code: String,
    etag: Option<String>,
    body: bytes::Bytes,
}

impl Answer {
    /// 412, or a 200 whose body is an `<Error>` with `PreconditionFailed` (copies and
    /// completions can answer so).
    fn refused(&self) -> bool {
        self.status == StatusCode::PRECONDITION_FAILED || self.code == "PreconditionFailed"
    }

    fn accepted(&self) -> bool {
        self.status.is_success() && self.code.is_empty()
    }
}

/// The probe object at `path`, and how to reach the upstream.
struct Probe<'a> {
    upstream: &'a dyn Upstream,
    path: String,
    /// Bounds each request.
    timeout: Duration,
    /// Every upload started (its path and `uploadId=` query), aborted at the end.
    uploads: Mutex<Vec<String>>,
}

impl Probe<'_> {
    /// Removes every object and upload the probe made (aborting a completed upload is a
    /// harmless 404).
    async fn clean_up(&self) {
        let uploads = std::mem::take(&mut *self.uploads.lock().expect("probe uploads lock"));
        for upload in uploads {
            let _ = self.send(Method::DELETE, &upload, &[], "").await;
        }
        for path in [self.path.clone(), self.beside(COPY), self.beside(UPLOAD)] {
            let _ = self.send(Method::DELETE, &path, &[], "").await;
        }
    }

    /// Every check after the probe object was created with ETag `etag`.
    async fn run(&self, etag: Option<String>) -> Result<(Enforcement, EtagForm), ProbeError> {
        let etag = etag.ok_or(ProbeError::Unexpected {
            step: "write of a new object (no ETag in the answer)",
            status: StatusCode::OK,
            code: String::new(),
        })?;
        let again = self.send(Method::PUT, &self.path, &[("if-none-match", "*")], "probe").await?;
        if !again.refused() {
            return Err(ProbeError::IgnoresPrecondition { header: "If-None-Match: *", status: again.status });
        }
        let wrong = self.send(Method::PUT, &self.path, &[("if-match", WRONG_ETAG)], "probe").await?;
        if !wrong.refused() {
            return Err(ProbeError::IgnoresPrecondition { header: "If-Match", status: wrong.status });
        }
        let etag_form = self.etag_form(&etag).await?;
        self.upstream.use_etag_form(etag_form);
        let copy_object = self.copy(&etag).await?;
        let (complete_multipart_upload, upload_ids_tied_to_keys) = self.completion().await?;
        let delete_object = self.delete().await?;
        Ok((Enforcement { copy_object, complete_multipart_upload, delete_object, upload_ids_tied_to_keys }, etag_form))
    }

    /// The form of the object's ETag that a PutObject's `If-Match` must carry to be accepted:
    /// quoted as S3 answers it, else bare.
    async fn etag_form(&self, etag: &str) -> Result<EtagForm, ProbeError> {
        let mut last = StatusCode::PRECONDITION_FAILED;
        for form in [EtagForm::Quoted, EtagForm::Bare] {
            let value = form.render(etag);
            let answer = self.send(Method::PUT, &self.path, &[("if-match", &value)], "probe").await?;
            if answer.accepted() {
                return Ok(form);
            }
            if !answer.refused() {
                return Err(unexpected("write with the object's own ETag in If-Match", answer));
            }
            last = answer.status;
        }
        Err(ProbeError::RefusesMetPrecondition { operation: "PutObject", condition: "the object's ETag", status: last })
    }

    /// CopyObject onto the probe object with a wrong `If-Match`, then with its own ETag, and
    /// onto a new key with `If-None-Match: *`: enforced when the first is refused and the
    /// others accepted.
    async fn copy(&self, etag: &str) -> Result<bool, ProbeError> {
        let source = self.path.as_str();
        let wrong = self.send(Method::PUT, source, &copy_onto(source, ("if-match", WRONG_ETAG)), "").await?;
        let own = self.current_etag().await?.unwrap_or_else(|| etag.to_owned());
        let met = self.send(Method::PUT, source, &copy_onto(source, ("if-match", &own)), "").await?;
        if !met.accepted() {
            return Err(met_refused_or_unexpected("CopyObject", "the object's ETag in If-Match", met));
        }
        let new = self.send(Method::PUT, &self.beside(COPY), &copy_onto(source, ("if-none-match", "*")), "").await?;
        if !new.accepted() {
            return Err(met_refused_or_unexpected("CopyObject", "If-None-Match: * on a new key", new));
        }
        Ok(wrong.refused())
    }

    /// Starts a multipart upload to the probe object, uploads one part and completes it with a
    /// wrong `If-Match`, then with the object's own ETag; then one to a new key with
    /// `If-None-Match: *`. Also whether a part sent under another key with the upload's id is
    /// refused. Every upload left open is aborted.
    async fn completion(&self) -> Result<(bool, bool), ProbeError> {
        let Some(upload) = self.start_upload(&self.path).await? else {
            // No multipart support to speak of: nothing to rely on, and nothing to check.
            return Ok((false, true));
        };
        let elsewhere =
            self.send(Method::PUT, &format!("{}-elsewhere?partNumber=2&{}", self.path, upload.query), &[], "p").await?;
        let tied = !elsewhere.status.is_success();
        let wrong = self.complete(&self.path, &upload, ("if-match", WRONG_ETAG.to_owned())).await?;
        let enforced = wrong.refused();
        if enforced {
            let own = self.current_etag().await?.unwrap_or_default();
            let met = self.complete(&self.path, &upload, ("if-match", own)).await?;
            if !met.accepted() {
                self.abort(&self.path, &upload).await;
                return Err(met_refused_or_unexpected("CompleteMultipartUpload", "the object's ETag in If-Match", met));
            }
        }
        let new_key = self.beside(UPLOAD);
        if let Some(upload) = self.start_upload(&new_key).await? {
            let new = self.complete(&new_key, &upload, ("if-none-match", "*".to_owned())).await?;
            if !new.accepted() {
                self.abort(&new_key, &upload).await;
                return Err(met_refused_or_unexpected("CompleteMultipartUpload", "If-None-Match: * on a new key", new));
            }
        }
        Ok((enforced, tied))
    }

    /// DeleteObject with a wrong `If-Match`, then with the object's own ETag: enforced when
    /// the first is refused and the second accepted.
    async fn delete(&self) -> Result<bool, ProbeError> {
        let wrong = self.send(Method::DELETE, &self.path, &[("if-match", WRONG_ETAG)], "").await?;
        if !wrong.refused() {
            return Ok(false);
        }
        let own = self.current_etag().await?.unwrap_or_default();
        let met = self.send(Method::DELETE, &self.path, &[("if-match", &own)], "").await?;
        if !met.accepted() {
            return Err(met_refused_or_unexpected("DeleteObject", "the object's ETag in If-Match", met));
        }
        Ok(true)
    }

    /// A key beside the probe object, for a write that must find no object there.
    fn beside(&self, name: &str) -> String {
        format!("{}-{name}", self.path)
    }

    /// The probe object's ETag now, as the upstream answers a read.
    async fn current_etag(&self) -> Result<Option<String>, ProbeError> {
        Ok(self.send(Method::HEAD, &self.path, &[], "").await?.etag)
    }

    /// A new multipart upload to `path` with one part uploaded, if the upstream has them.
    async fn start_upload(&self, path: &str) -> Result<Option<Upload>, ProbeError> {
        let started = self.send(Method::POST, &format!("{path}?uploads"), &[], "").await?;
        let Some(id) = xml_element(&started.body, "UploadId").filter(|_| started.status.is_success()) else {
            return Ok(None);
        };
        let query = form_urlencoded::Serializer::new(String::new()).append_pair("uploadId", &id).finish();
        self.uploads.lock().expect("probe uploads lock").push(format!("{path}?{query}"));
        let part = self.send(Method::PUT, &format!("{path}?partNumber=1&{query}"), &[], "p").await?;
        match part.etag {
            Some(part_etag) if part.status.is_success() => Ok(Some(Upload { query, part_etag })),
            _ => {
                self.abort(path, &Upload { query, part_etag: String::new() }).await;
                Ok(None)
            }
        }
    }

    async fn complete(
        &self,
        path: &str,
        upload: &Upload,
        condition: (&'static str, String),
    ) -> Result<Answer, ProbeError> {
        let xml = format!(
            "<CompleteMultipartUpload><Part><PartNumber>1</PartNumber><ETag>{}</ETag></Part></CompleteMultipartUpload>",
            upload.part_etag
        );
        let path = format!("{path}?{}", upload.query);
        self.send_owned(Method::POST, &path, &[(condition.0, condition.1.as_str())], xml).await
    }

    async fn abort(&self, path: &str, upload: &Upload) {
        let _ = self.send(Method::DELETE, &format!("{path}?{}", upload.query), &[], "").await;
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&'static str, &str)],
        body: &'static str,
    ) -> Result<Answer, ProbeError> {
        self.send_owned(method, path, headers, body.to_owned()).await
    }

    async fn send_owned(
        &self,
        method: Method,
        path: &str,
        headers: &[(&'static str, &str)],
        body: String,
    ) -> Result<Answer, ProbeError> {
        let mut builder = http::Request::builder().method(method).uri(path).header("content-length", body.len());
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let req = builder.body(Body::from(body)).map_err(|_| ProbeError::Unexpected {
            step: "building a request (the probe bucket's name)",
            status: StatusCode::BAD_REQUEST,
            code: String::new(),
        })?;
        bounded(self.timeout, answer_of(self.upstream, req)).await
    }
}

/// The headers of a copy of `source` (replacing its metadata, so a copy onto itself is
/// allowed) under `condition`.
fn copy_onto<'a>(source: &'a str, condition: (&'static str, &'a str)) -> [(&'static str, &'a str); 3] {
    [condition, ("x-amz-copy-source", source), ("x-amz-metadata-directive", "REPLACE")]
}

/// A multipart upload the probe started: its `uploadId=` query and its one part's ETag.
struct Upload {
    query: String,
    part_etag: String,
}

/// `call`, or the upstream's silence past `timeout` as an error.
async fn bounded<T>(
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, ProbeError>>,
) -> Result<T, ProbeError> {
    let after_ms = crate::config::millis(timeout);
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or(Err(ProbeError::Unreachable(UpstreamError::Timeout { after_ms })))
}

async fn answer_of(upstream: &dyn Upstream, req: http::Request<Body>) -> Result<Answer, ProbeError> {
    answer(upstream.send(req).await?).await
}

async fn answer(resp: http::Response<Body>) -> Result<Answer, ProbeError> {
    let status = resp.status();
    let etag = resp.headers().get(http::header::ETAG).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let body = resp.into_body().collect().await.map_err(UpstreamError::Transport)?.to_bytes();
    let code = xml_element(&body, "Code").unwrap_or_default();
    Ok(Answer { status, code, etag, body })
}

/// A met precondition refused (the upstream judged it and got it wrong), or another answer.
fn met_refused_or_unexpected(operation: &'static str, condition: &'static str, answer: Answer) -> ProbeError {
    if answer.refused() {
        ProbeError::RefusesMetPrecondition { operation, condition, status: answer.status }
    } else {
        unexpected(condition, answer)
    }
}

fn unexpected(step: &'static str, answer: Answer) -> ProbeError {
    ProbeError::Unexpected { step, status: answer.status, code: answer.code }
}

async fn first_bucket(upstream: &dyn Upstream, timeout: Duration) -> Result<Option<String>, ProbeError> {
    let req = http::Request::builder().method(Method::GET).uri("/").body(Body::empty()).expect("static request");
    let listed = bounded(timeout, answer_of(upstream, req)).await?;
    match listed.status {
        status if status.is_success() => Ok(xml_element(&listed.body, "Name")),
        // Valid credentials without the right to list buckets (a credential scoped to its
        // buckets): there is no bucket to take, and upstream.probe_bucket names one.
        StatusCode::FORBIDDEN if !super::health::credentials_refused(&listed.code) => Err(ProbeError::NoBucket),
        StatusCode::FORBIDDEN | StatusCode::UNAUTHORIZED => {
            Err(ProbeError::CredentialsRefused { status: listed.status, code: listed.code })
        }
        _ => Err(unexpected("bucket listing", listed)),
    }
}

/// The text of the first `<name>` element, if any (small, trusted XML from the upstream).
pub(crate) fn xml_element(xml: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(xml).ok()?;
    let start = text.find(&format!("<{name}>"))? + name.len() + 2;
    let end = text[start..].find(&format!("</{name}>"))? + start;
    Some(text[start..end].to_owned())
}
