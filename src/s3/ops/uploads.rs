//! No upload left behind (docs/design.md, "Uploads left behind"). Every multipart upload created with a token is
//! recorded in the fence store, with that token and its creator, before the client learns its
//! id; a newer token that sends a part or the completion of it takes it over (the record gets
//! its token before the step is forwarded). The token and signer of the record may abort it
//! whatever became of the token (an abort commits nothing, and the record shows no newer
//! token uses the upload); fencegate aborts the uploads of superseded tokens
//! `fencing.abort_stale_uploads_after_ms` after it saw them superseded, and every upload
//! `fencing.abort_uploads_after_ms` after its creation; a completion or an abort through
//! fencegate forgets the record, and so does the sweep once the upstream no longer has the
//! upload (the sweep is `crate::upkeep`'s). The records are bounded per caller, per resource and
//! in all (`store.upload_records_*`): a creation past them is aborted and refused (503). Design
//! and crash points: `docs/design.md`, "Uploads left behind".

use http::{HeaderMap, StatusCode};
use s3s::{Body, S3Response};

use super::{Admitted, Ctx, Request, Target, Upload};
use crate::feed::Decision;
use crate::fence::{FenceToken, Gate, Keep, ResourceKey, UploadRecord};
use crate::lease::credentials::Claims;
use crate::metrics;
use crate::refusal::Refusal;
use crate::s3::error::FrontError;
use crate::s3::hop::{Hop, XML_RESPONSE_BYTES_MAX, client_response};

impl Ctx {
    /// CreateMultipartUpload (admitted, stamped): forwarded, and the upload recorded before
    /// its id is answered. An upload that cannot be recorded is aborted and the creation
    /// answered 503: the client never holds an upload fencegate does not know of.
    pub(super) async fn create_multipart(
        &self,
        request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        let (Some(bucket), Some(key)) = (request.target.bucket.clone(), request.target.key.clone()) else {
            return Err(FrontError::NotSupported("a write without an object key"));
        };
        let (path, creator) = (request.target.raw_path.clone(), request.signer.clone().unwrap_or_default());
        let counted_as = request.counted_as.clone().unwrap_or_default();
        let resp = self.send_admitted(request, &admitted).await?;
        let (resp, created) = self.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
        let upload_id = resp.body().bytes().and_then(|xml| upload_id_in(&xml));
        let (true, Some(upload_id)) = (created, upload_id) else {
            return Ok(client_response(resp));
        };
        let record = UploadRecord {
            bucket,
            key,
            path,
            upload_id,
            resource: admitted.resource.as_str().to_owned(),
            token: admitted.token,
            creator,
            created_at_ms: self.clock.now_ms(),
            counted_as,
        };
        let refusal = match self.gate.upload_records().put(&record).await {
            Ok(Keep::Kept) => return Ok(client_response(resp)),
            Ok(Keep::Full(full)) => {
                tracing::info!(%full, creator = %record.creator, "an upload over its bounds: aborting it");
                Refusal::RecordsFull(full)
            }
            Err(error) => {
                tracing::warn!(%error, upload_id = %record.upload_id, "an upload could not be recorded: aborting it");
                Refusal::StoreUnavailable(error)
            }
        };
        if let Err(abort) = abort_upload(&self.hop, &self.gate, &record, "abort_unrecorded_upload").await {
            tracing::warn!(error = %abort, upload_id = %record.upload_id, "the unrecorded upload could not be aborted");
        }
        Err(refusal.into())
    }

    /// AbortMultipartUpload by the upload's owner: the token and signer of its record, on its
    /// resource and key. Allowed whatever became of the token (superseded, or a lease that
    /// lapsed with no successor): the record shows that no newer token uses the upload. `None`:
    /// no such record, and the request goes the usual way (the gate).
    pub(in crate::s3) async fn abort_own_upload(
        &self,
        target: &Target,
        query: Option<&str>,
        lease: Option<&Claims>,
        signer: &str,
        headers: &HeaderMap,
        decision: &Decision,
    ) -> Result<Option<S3Response<Body>>, FrontError> {
        let (Some(bucket), Some(key), Some(upload_id)) = (&target.bucket, &target.key, upload_id_of(query)) else {
            return Ok(None);
        };
        let (token, resource) = match lease {
            Some(claims) => {
                (FenceToken(claims.token), ResourceKey::new(&claims.resource).map_err(Refusal::InvalidResource)?)
            }
            None => match self.wire.token(headers)? {
                Some(token) => (token, self.wire.resource(headers, bucket, key)?),
                None => return Ok(None),
            },
        };
        let record = self.gate.upload_records().get(bucket, &upload_id).await.map_err(Refusal::StoreUnavailable)?;
        let Some(record) = record
            .filter(|r| r.key == *key && r.token == token && r.creator == signer && r.resource == resource.as_str())
        else {
            return Ok(None);
        };
        let fence = self.gate.fence(&resource).await.map_err(Refusal::StoreUnavailable)?;
        let stale = crate::fence::stale_below(fence, token).is_some();
        decision.write(&resource, token);
        decision.let_through("own_upload_aborted");
        let resp = abort_upload(&self.hop, &self.gate, &record, "abort_own_upload").await?;
        if stale && resp.status().is_success() {
            metrics::stale_upload_aborted("creator");
        }
        Ok(Some(client_response(resp)))
    }

    /// A part or the completion of an upload, admitted: refused once the upload is about to
    /// expire (none may be in flight when the sweep aborts it). With a token newer than its
    /// record's, the upload is that token's from now on, before the step is forwarded: neither
    /// its former owner nor the sweep may abort it as superseded then.
    pub(super) async fn take_over_upload(
        &self,
        request: &Request,
        upload: Option<&(String, String)>,
        admitted: &Admitted,
    ) -> Result<(), FrontError> {
        let Some((bucket, upload_id)) = upload else { return Ok(()) };
        let records = self.gate.upload_records();
        let record = records.get(bucket, upload_id).await.map_err(Refusal::StoreUnavailable)?;
        let Some(record) = record else { return Ok(()) };
        let age_ms = self.clock.now_ms().saturating_sub(record.created_at_ms);
        if u128::from(age_ms) >= self.limits.uploads_open_for.as_millis() {
            return Err(FrontError::UploadExpiring);
        }
        if record.token >= admitted.token {
            return Ok(());
        }
        let taken = UploadRecord {
            token: admitted.token,
            creator: request.signer.clone().unwrap_or_default(),
            resource: admitted.resource.as_str().to_owned(),
            counted_as: request.counted_as.clone().unwrap_or_default(),
            ..record
        };
        // A replacement: never refused by the bounds (it adds no record).
        let _replaced: Keep = records.put(&taken).await.map_err(Refusal::StoreUnavailable)?;
        Ok(())
    }

    /// An upload that a completion or an abort through fencegate ended is not left behind.
    pub(super) async fn forget_ended(&self, upload: Upload, resp: &S3Response<Body>) {
        if resp.status.is_none_or(|s| s.is_success())
            && let Some((bucket, upload_id)) = upload
        {
            forget_upload(&self.gate, &bucket, &upload_id).await;
        }
    }
}

/// Sends AbortMultipartUpload for `record`'s upload, and forgets the record once the upstream
/// has no such upload (aborted now, or before: 404).
pub async fn abort_upload(
    hop: &Hop,
    gate: &Gate,
    record: &UploadRecord,
    op: &'static str,
) -> Result<http::Response<Body>, FrontError> {
    let resp = hop.abort_upload(record, op).await?;
    if resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND {
        forget_upload(gate, &record.bucket, &record.upload_id).await;
    }
    Ok(resp)
}

/// Forgets an upload that was completed or aborted. A record that stays (the store did not
/// answer) costs one abort later, answered 404, once its token is superseded.
pub async fn forget_upload(gate: &Gate, bucket: &str, upload_id: &str) {
    if let Err(error) = gate.upload_records().remove(bucket, upload_id).await {
        tracing::warn!(%error, %upload_id, "an ended upload's record could not be removed");
    }
}

/// The bucket and upload id a multipart step names.
pub(super) fn upload_of(request: &Request) -> Option<(String, String)> {
    Some((request.target.bucket.clone()?, upload_id_of(Some(request.query.trim_start_matches('?')))?))
}

fn upload_id_of(query: Option<&str>) -> Option<String> {
    form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .find(|(name, _)| name == "uploadId")
        .map(|(_, value)| value.into_owned())
}

/// The `<UploadId>` of an InitiateMultipartUploadResult, unescaped.
fn upload_id_in(xml: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Initiated {
        #[serde(rename = "UploadId")]
        upload_id: String,
    }
    if xml.len() > XML_RESPONSE_BYTES_MAX {
        return None;
    }
    quick_xml::de::from_reader::<_, Initiated>(xml).ok().map(|i| i.upload_id).filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upload_id_is_read_unescaped() {
        let xml = b"<?xml version=\"1.0\"?><InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key>\
                    <UploadId>a&amp;b</UploadId></InitiateMultipartUploadResult>";
        assert_eq!(upload_id_in(xml).as_deref(), Some("a&b"));
        assert_eq!(upload_id_in(b"<Error><Code>x</Code></Error>"), None);
        assert_eq!(upload_id_of(Some("uploadId=a%26b&x=1")).as_deref(), Some("a&b"));
        assert_eq!(upload_id_of(Some("uploads")), None);
    }
}
