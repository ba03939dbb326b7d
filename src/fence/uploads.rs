//! Multipart uploads as the fence store keeps them: the token each was created under, so that
//! an upload of a superseded token is never left behind (`docs/design.md`, "Uploads left
//! behind"). Its creator may still abort it after its token went stale, and fencegate aborts
//! the rest after `fencing.abort_stale_uploads_after_ms`.

use serde::{Deserialize, Serialize};

use super::FenceToken;
use super::budget::Owner;

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
    /// Wall clock: for the operator's reports, and when the upload expires
    /// (`fencing.abort_uploads_after_ms`).
    pub created_at_ms: u64,
    /// Who the record counts against (`super::budget`): the access key that signed its
    /// creation or last take-over (a lease credential's own), a presigned URL's holders as one;
    /// `creator` when empty (a record written before it was kept).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub counted_as: String,
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

    /// Who the record counts against ([`super::budget`]) and what it takes as stored: its
    /// name and `json`, its JSON.
    pub fn owner(&self, json: &str) -> Owner {
        let bytes = (self.bucket.len() + 1 + self.upload_id.len() + json.len()) as u64;
        let caller = if self.counted_as.is_empty() { &self.creator } else { &self.counted_as };
        Owner { caller: caller.clone(), resource: self.resource.clone(), bytes }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an upload record serialises")
    }
}

/// A page of upload records and where the next one starts (`None`: this was the last).
#[derive(Debug, Default)]
pub struct UploadPage {
    pub records: Vec<UploadRecord>,
    pub next: Option<String>,
}
