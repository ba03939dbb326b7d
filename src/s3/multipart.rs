//! A multipart upload belongs to one key: on an upstream that keeps parts by upload id alone,
//! each fenced multipart step is checked against the upstream's list of uploads first
//! (docs/design.md, "A multipart upload belongs to one key").

use http::{HeaderMap, Method};
use http_body_util::BodyExt;
use s3s::Body;

use super::error::FrontError;
use super::{Front, Target, XML_RESPONSE_BYTES_MAX};

/// Pages of ListMultipartUploads read to find one upload (1,000 uploads each).
const UPLOAD_LIST_PAGES_MAX: usize = 10;

impl Front {
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
            let resp = self.send("list_uploads", Method::GET, &path, HeaderMap::new(), Body::empty()).await?;
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
