//! Multipart uploads as the fence store keeps them: the token each was created under, so that
//! an upload of a superseded token is never left behind (`docs/design.md`, "Uploads left
//! behind"). Its creator may still abort it after its token went stale, and fencegate aborts
//! the rest after `fencing.abort_stale_uploads_after_ms`.

use serde::{Deserialize, Serialize};

use super::FenceToken;

/// One incomplete multipart upload created through fencegate with a fencing token.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRecord {
    pub bucket: String,
    pub key: String,
    /// The object's path as it was forwarded (`/bucket/key`, the key percent-encoded): an
    /// abort is sent to the same path.
    pub path: String,
    pub upload_id: String,
    /// The resource whose fence the upload was created under.
    pub resource: String,
    pub token: FenceToken,
    /// The access key that signed the creation (the issuer's, for a lease credential).
    pub creator: String,
    /// Wall clock, for the operator's reports.
    pub created_at_ms: u64,
}

impl UploadRecord {
    /// The name an upload is kept under in the store. Bucket names have no `/`, and an upload
    /// id is unique within its bucket, so the pair names one upload.
    pub fn name(bucket: &str, upload_id: &str) -> String {
        format!("{bucket}/{upload_id}")
    }

    pub fn storage_name(&self) -> String {
        Self::name(&self.bucket, &self.upload_id)
    }
}

/// A page of upload records and where the next one starts (`None`: this was the last).
#[derive(Debug, Default)]
pub struct UploadPage {
    pub records: Vec<UploadRecord>,
    pub next: Option<String>,
}
