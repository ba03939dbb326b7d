//! Multipart uploads. CompleteMultipartUpload is their commit point, a conditional write like
//! PutObject's. A multipart upload belongs to one key: on an upstream that keeps parts by
//! upload id alone, each fenced multipart step is checked against the upstream's list of
//! uploads first (docs/design.md, "A multipart upload belongs to one key").

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Method};
use http_body_util::BodyExt;
use s3s::{Body, S3Response};

use super::conditional::{Attempt, Cached, ObjectWrite, Resend, set_precondition};
use super::write::WriteBody;
use super::{Admitted, Ctx, Request, Target};
use crate::s3::error::FrontError;
use crate::s3::hop::{XML_RESPONSE_BYTES_MAX, client_response, upstream_headers};
use crate::s3::objects::ObjectState;
use crate::upstream::xml_element;

/// A CompleteMultipartUpload body lists at most 10,000 parts.
pub(super) const COMPLETE_REQUEST_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Pages of ListMultipartUploads read to find one upload (1,000 uploads each).
const UPLOAD_LIST_PAGES_MAX: usize = 10;

impl Ctx {
    /// CompleteMultipartUpload: the gate checked the token again, and the completion is
    /// conditional on the object's last known state. Its parts list was read before admission
    /// (`FencedOp::prepare`), so it can be sent twice.
    pub(super) async fn complete_multipart(
        &self,
        request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        let path = request.path_and_query();
        let parts = request.body.bytes().unwrap_or_default();
        let headers = upstream_headers(&request.headers, &self.wire);
        let write = ObjectWrite::of(&request, &admitted)?;
        let cached = self.cached_unless_ignored(self.judged.complete_multipart_upload, Cached::Any);
        let state = self.starting_state(&write, cached).await?;
        let mut attempts = CompleteAttempts {
            headers: &headers,
            path: &path,
            parts: &parts,
            object: &write.object,
            admitted: &admitted,
        };
        self.conditional_write(&write, state, &mut attempts).await
    }

    /// The ETag of a completed upload is in its XML body, not in a header. Its stamp is the one
    /// CreateMultipartUpload set (the creator's token), which the completion does not name, so
    /// the cache records none rather than the completer's.
    fn remember_completion(&self, object: String, resp: &http::Response<Body>) {
        let etag = resp
            .body()
            .bytes()
            .and_then(|xml| xml_element(&xml, "ETag"))
            .and_then(|e| HeaderValue::from_str(&e.replace("&quot;", "\"")).ok());
        match etag {
            Some(etag) => self.etags.put(object, ObjectState::Present { etag, stamp: None }),
            None => self.etags.forget(&object),
        }
    }

    /// A multipart step names its upload by id and its object by key; the write is fenced on
    /// the key's resource. On an upstream that keeps parts by the id alone, a part or a
    /// completion sent under a key the caller may write would land in another resource's
    /// object: the pair is checked against the upstream's own list of uploads first (404
    /// `NoSuchUpload` otherwise, as S3 answers).
    pub(super) async fn check_upload_key(&self, target: &Target, query: Option<&str>) -> Result<(), FrontError> {
        let upload_id = form_urlencoded::parse(query.unwrap_or("").as_bytes())
            .find(|(name, _)| name == "uploadId")
            .map(|(_, value)| value.into_owned());
        let (Some(bucket), Some(key), Some(upload_id)) = (&target.bucket, &target.key, upload_id) else {
            return Err(FrontError::NoSuchUpload);
        };
        let mut markers: Option<(String, String)> = None;
        for _ in 0..UPLOAD_LIST_PAGES_MAX {
            let listing = {
                let mut listing = form_urlencoded::Serializer::new(String::new());
                listing.append_pair("uploads", "").append_pair("prefix", key);
                if let Some((key_marker, id_marker)) = &markers {
                    listing.append_pair("key-marker", key_marker).append_pair("upload-id-marker", id_marker);
                }
                listing.finish()
            };
            // Bucket names are plain (checked by the S3 library).
            let path = format!("/{bucket}?{listing}");
            let resp = self.hop.send("list_uploads", Method::GET, &path, HeaderMap::new(), Body::empty()).await?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), XML_RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|_| FrontError::UpstreamStatus { step: "listing multipart uploads", status })?
                .to_bytes();
            if !status.is_success() {
                return Err(FrontError::UpstreamStatus { step: "listing multipart uploads", status });
            }
            let page: UploadList = quick_xml::de::from_reader(body.as_ref())
                .map_err(|_| FrontError::UpstreamStatus { step: "listing multipart uploads", status })?;
            if page.uploads.iter().any(|u| u.key == *key && u.upload_id == upload_id) {
                return Ok(());
            }
            match (page.is_truncated, page.next_key_marker, page.next_upload_id_marker) {
                (Some(true), Some(k), Some(u)) => markers = Some((k, u)),
                _ => break,
            }
        }
        Err(FrontError::NoSuchUpload)
    }
}

/// CompleteMultipartUpload's attempts: its parts list, read whole before admission, sent again.
struct CompleteAttempts<'a> {
    headers: &'a HeaderMap,
    path: &'a str,
    parts: &'a Bytes,
    object: &'a str,
    admitted: &'a Admitted,
}

impl Resend for CompleteAttempts<'_> {
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>> {
        Box::pin(async move {
            let Self { headers, path, parts, object, admitted } = *self;
            let mut headers = headers.clone();
            set_precondition(&mut headers, &state);
            let body = WriteBody::InMemory(Body::from(parts.clone()));
            let resp = ctx.send_write("complete_multipart", admitted, Method::POST, path, headers, body).await?;
            let (resp, committed) = ctx.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
            if !committed {
                return Ok(Attempt::NotCommitted(resp));
            }
            ctx.remember_completion(object.to_owned(), &resp);
            Ok(Attempt::Committed(client_response(resp)))
        })
    }
}

/// One page of ListMultipartUploads, as far as the upload-to-key check reads it.
#[derive(Debug, serde::Deserialize)]
pub struct UploadList {
    #[serde(rename = "Upload", default)]
    pub uploads: Vec<UploadEntry>,
    #[serde(rename = "IsTruncated", default)]
    pub is_truncated: Option<bool>,
    #[serde(rename = "NextKeyMarker", default)]
    pub next_key_marker: Option<String>,
    #[serde(rename = "NextUploadIdMarker", default)]
    pub next_upload_id_marker: Option<String>,
}

#[derive(Debug, serde::Deserialize)]
pub struct UploadEntry {
    #[serde(rename = "Key")]
    pub key: String,
    #[serde(rename = "UploadId")]
    pub upload_id: String,
}
