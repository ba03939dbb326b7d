//! No upload left behind (docs/design.md, "Uploads left behind"). Every multipart upload created with a token is
//! recorded in the fence store, with that token and its creator, before the client learns its
//! id; a newer token that sends a part or the completion of it takes it over (the record gets
//! its token before the step is forwarded). The token and signer of the record may abort it
//! whatever became of the token (an abort commits nothing, and the record shows no newer
//! token uses the upload); fencegate aborts the uploads of superseded tokens
//! `fencing.abort_stale_uploads_after_ms` after it saw them superseded, and every upload
//! `fencing.abort_uploads_after_ms` after its creation; a completion or an abort through
//! fencegate forgets the record, and so does the sweep once the upstream no longer has the
//! upload. The records are bounded per caller, per resource and in all (`store.upload_records_*`):
//! a creation past them is aborted and refused (503). Design and crash points: `docs/design.md`, "Uploads left behind".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, Method, StatusCode};
use s3s::{Body, S3Response};

use super::error::FrontError;
use super::forward::{XML_RESPONSE_BYTES_MAX, client_response};
use super::{Admitted, Front, Request, Target};
use crate::feed::Decision;
use crate::fence::{FenceToken, Keep, ResourceKey, StoreError, UploadRecord};
use crate::lease::credentials::Claims;
use crate::metrics;
use crate::refusal::Refusal;

/// Upload records read per page of a sweep.
const SWEEP_PAGE: usize = 256;

/// The sweep runs every quarter of `fencing.abort_stale_uploads_after_ms` or
/// `fencing.abort_uploads_after_ms`, whichever is shorter, within these.
const SWEEP_PERIOD_MIN: Duration = Duration::from_secs(1);
const SWEEP_PERIOD_MAX: Duration = Duration::from_secs(60);

/// How old a record is before the sweep asks the upstream whether its upload still exists, and
/// how often it asks again.
const VERIFY_EVERY: Duration = Duration::from_secs(3600);

impl Front {
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
        if let Err(abort) = self.abort_upload(&record, "abort_unrecorded_upload").await {
            tracing::warn!(error = %abort, upload_id = %record.upload_id, "the unrecorded upload could not be aborted");
        }
        Err(refusal.into())
    }

    /// AbortMultipartUpload by the upload's owner: the token and signer of its record, on its
    /// resource and key. Allowed whatever became of the token (superseded, or a lease that
    /// lapsed with no successor): the record shows that no newer token uses the upload. `None`:
    /// no such record, and the request goes the usual way (the gate).
    pub(super) async fn abort_own_upload(
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
        let resp = self.abort_upload(&record, "abort_own_upload").await?;
        if stale && resp.status().is_success() {
            metrics::stale_upload_aborted("creator");
        }
        Ok(Some(client_response(resp)))
    }

    /// A part or the completion of an upload, admitted: refused once the upload is about to
    /// expire (none may be in flight when the sweep aborts it). With a token newer than its
    /// record's, the upload is that token's from now on, before the step is forwarded: neither
    /// its former owner nor the sweep may abort it as superseded then.
    pub(super) async fn take_over_upload(&self, request: &Request, admitted: &Admitted) -> Result<(), FrontError> {
        let Some((bucket, upload_id)) = upload_of(request) else { return Ok(()) };
        let records = self.gate.upload_records();
        let record = records.get(&bucket, &upload_id).await.map_err(Refusal::StoreUnavailable)?;
        let Some(record) = record else { return Ok(()) };
        let age_ms = self.clock.now_ms().saturating_sub(record.created_at_ms);
        if u128::from(age_ms) >= self.uploads_open_for.as_millis() {
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

    /// Sends AbortMultipartUpload for `record`'s upload, and forgets the record once the
    /// upstream has no such upload (aborted now, or before: 404).
    pub(super) async fn abort_upload(
        &self,
        record: &UploadRecord,
        op: &'static str,
    ) -> Result<http::Response<Body>, FrontError> {
        let query = form_urlencoded::Serializer::new(String::new()).append_pair("uploadId", &record.upload_id).finish();
        let path = format!("{}?{query}", record.path);
        let resp = self.send(op, Method::DELETE, &path, HeaderMap::new(), Body::empty()).await?;
        if resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND {
            self.forget_upload(&record.bucket, &record.upload_id).await;
        }
        Ok(resp)
    }

    /// Forgets an upload that was completed or aborted. A record that stays (the store did not
    /// answer) costs one abort later, answered 404, once its token is superseded.
    pub(super) async fn forget_upload(&self, bucket: &str, upload_id: &str) {
        if let Err(error) = self.gate.upload_records().remove(bucket, upload_id).await {
            tracing::warn!(%error, %upload_id, "an ended upload's record could not be removed");
        }
    }

    /// For as long as the process runs: aborts the uploads whose token was superseded `after`
    /// ago or more (`None`: never) and those created `expire_after` ago or more, and forgets
    /// the records of uploads the upstream no longer has (completed or aborted around
    /// fencegate, or by a lifecycle rule). Every replica of a shared store sweeps; an upload
    /// aborted twice is answered 404 the second time.
    pub async fn sweep_uploads(self: Arc<Self>, after: Option<Duration>, expire_after: Duration) {
        let soonest = after.map_or(expire_after, |after| after.min(expire_after));
        let period = (soonest / 4).clamp(SWEEP_PERIOD_MIN, SWEEP_PERIOD_MAX);
        let mut sweep = Sweep::default();
        loop {
            tokio::time::sleep(period).await;
            if let Err(error) = self.sweep(after, expire_after, &mut sweep).await {
                tracing::warn!(%error, "sweeping the upload records failed; trying again later");
            }
        }
    }

    /// One walk over the upload records.
    async fn sweep(
        &self,
        after: Option<Duration>,
        expire_after: Duration,
        sweep: &mut Sweep,
    ) -> Result<(), StoreError> {
        let records = self.gate.upload_records();
        let mut walked = HashSet::new();
        let mut cursor = None;
        loop {
            let page = records.page(cursor.take(), SWEEP_PAGE).await?;
            for record in page.records {
                let Ok(resource) = ResourceKey::new(&record.resource) else { continue };
                let name = record.storage_name();
                walked.insert(name.clone());
                let age_ms = self.clock.now_ms().saturating_sub(record.created_at_ms);
                if u128::from(age_ms) >= expire_after.as_millis() {
                    self.abort_swept(&record, Swept::Expired).await?;
                    continue;
                }
                let superseded = crate::fence::stale_below(self.gate.fence(&resource).await?, record.token).is_some();
                if !superseded {
                    sweep.superseded_since.remove(&name);
                } else if let Some(after) = after {
                    let since = *sweep.superseded_since.entry(name.clone()).or_insert_with(Instant::now);
                    if since.elapsed() >= after {
                        self.abort_swept(&record, Swept::Superseded).await?;
                        continue;
                    }
                }
                self.verify_upload(&record, sweep).await;
            }
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        sweep.superseded_since.retain(|name, _| walked.contains(name));
        sweep.verified.retain(|name, _| walked.contains(name));
        Ok(())
    }

    /// Aborts an upload the sweep found superseded or expired, unless a newer token took it
    /// over since the walk read its record (read again just before).
    async fn abort_swept(&self, record: &UploadRecord, why: Swept) -> Result<(), StoreError> {
        let now = self.gate.upload_records().get(&record.bucket, &record.upload_id).await?;
        if now.as_ref().is_none_or(|now| now.token != record.token) {
            return Ok(());
        }
        let (op, what) = match why {
            Swept::Superseded => ("abort_stale_upload", "aborted an upload of a superseded token"),
            Swept::Expired => {
                ("abort_expired_upload", "aborted an upload left incomplete past fencing.abort_uploads_after_ms")
            }
        };
        match self.abort_upload(record, op).await {
            Ok(resp) if resp.status().is_success() => {
                match why {
                    Swept::Superseded => metrics::stale_upload_aborted("fencegate"),
                    Swept::Expired => metrics::upload_expired(),
                }
                tracing::info!(
                    bucket = %record.bucket,
                    key = %record.key,
                    upload_id = %record.upload_id,
                    token = record.token.0,
                    "{what}"
                );
            }
            Ok(resp) if resp.status() == StatusCode::NOT_FOUND => {}
            Ok(resp) => tracing::warn!(status = %resp.status(), upload_id = %record.upload_id, "{op} failed"),
            Err(error) => tracing::warn!(%error, upload_id = %record.upload_id, "{op} failed"),
        }
        Ok(())
    }

    /// Forgets the record of an upload the upstream no longer has: asked for uploads recorded
    /// more than [`VERIFY_EVERY`] ago, at most once per [`VERIFY_EVERY`] each (a ListParts of
    /// one part).
    async fn verify_upload(&self, record: &UploadRecord, sweep: &mut Sweep) {
        let name = record.storage_name();
        let recorded_ms = self.clock.now_ms().saturating_sub(record.created_at_ms);
        let verified_recently = sweep.verified.get(&name).is_some_and(|at| at.elapsed() < VERIFY_EVERY);
        if u128::from(recorded_ms) < VERIFY_EVERY.as_millis() || verified_recently {
            return;
        }
        sweep.verified.insert(name, Instant::now());
        match self.upload_exists(record).await {
            Ok(false) => {
                tracing::info!(upload_id = %record.upload_id, "the upstream no longer has a recorded upload: forgotten");
                self.forget_upload(&record.bucket, &record.upload_id).await;
            }
            Ok(true) => {}
            Err(error) => tracing::debug!(%error, upload_id = %record.upload_id, "checking a recorded upload failed"),
        }
    }

    /// Whether the upstream still has a recorded upload (a ListParts of one part: 404 when it
    /// was completed or aborted).
    pub(super) async fn upload_exists(&self, record: &UploadRecord) -> Result<bool, String> {
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

/// Why the sweep aborts an upload.
#[derive(Clone, Copy)]
enum Swept {
    /// Its token was superseded `fencing.abort_stale_uploads_after_ms` ago.
    Superseded,
    /// It was created `fencing.abort_uploads_after_ms` ago.
    Expired,
}

/// What the sweep remembers between walks (in memory: a restart starts the waits again, so an
/// abort comes later, never sooner).
#[derive(Default)]
struct Sweep {
    /// When this process first saw each upload's token below its fence.
    superseded_since: HashMap<String, Instant>,
    /// When each upload was last looked for at the upstream.
    verified: HashMap<String, Instant>,
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
