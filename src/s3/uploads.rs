//! No upload left behind (SPEC section 12). Every multipart upload created with a token is
//! recorded in the fence store, with that token and its creator, before the client learns its
//! id. The creator may abort it after its token went stale (an abort commits nothing, and the
//! record proves the upload is not a newer holder's); fencegate aborts the uploads of
//! superseded tokens `fencing.abort_stale_uploads_after_ms` after it saw them superseded; a
//! completion or an abort through fencegate forgets the record. Design and crash points:
//! `docs/design.md`, "Uploads left behind".

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, Method, StatusCode};
use s3s::{Body, S3Response};

use super::error::FrontError;
use super::forward::{XML_RESPONSE_BYTES_MAX, client_response};
use super::{Admitted, Front, Request, Target};
use crate::fence::{FenceToken, ResourceKey, StoreError, UploadRecord};
use crate::lease::credentials::Claims;
use crate::metrics;
use crate::refusal::Refusal;

/// Upload records read per page of a sweep.
const SWEEP_PAGE: usize = 256;

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
        };
        if let Err(error) = self.gate.upload_records().put(&record).await {
            tracing::warn!(%error, upload_id = %record.upload_id, "an upload could not be recorded: aborting it");
            if let Err(abort) = self.abort_upload(&record, "abort_unrecorded_upload").await {
                tracing::warn!(error = %abort, upload_id = %record.upload_id, "the unrecorded upload could not be aborted");
            }
            return Err(Refusal::StoreUnavailable(error).into());
        }
        Ok(client_response(resp))
    }

    /// AbortMultipartUpload by the upload's creator after its token went stale: allowed when
    /// the record shows that this token, this signer and this resource created it, whatever
    /// the lease it was made under has become. `None`: not such an abort (the token is the
    /// fence, or the upload is not this creator's), and the request goes the usual way.
    pub(super) async fn abort_own_stale_upload(
        &self,
        target: &Target,
        query: Option<&str>,
        lease: Option<&Claims>,
        signer: &str,
        headers: &HeaderMap,
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
        let fence = self.gate.fence(&resource).await.map_err(Refusal::StoreUnavailable)?;
        if fence.is_none_or(|fence| fence <= token) {
            return Ok(None);
        }
        let record = self.gate.upload_records().get(bucket, &upload_id).await.map_err(Refusal::StoreUnavailable)?;
        let Some(record) = record
            .filter(|r| r.key == *key && r.token == token && r.creator == signer && r.resource == resource.as_str())
        else {
            return Ok(None);
        };
        let span = tracing::Span::current();
        span.record("resource", resource.as_str());
        span.record("token", token.0);
        span.record("decision", "stale_upload_aborted");
        let resp = self.abort_upload(&record, "abort_stale_upload").await?;
        if resp.status().is_success() {
            metrics::stale_upload_aborted("creator");
        }
        Ok(Some(client_response(resp)))
    }

    /// Sends AbortMultipartUpload for `record`'s upload, and forgets the record once the
    /// upstream has no such upload (aborted now, or before: 404).
    async fn abort_upload(&self, record: &UploadRecord, op: &'static str) -> Result<http::Response<Body>, FrontError> {
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

    /// Aborts the uploads whose token was superseded `after` ago or more, for as long as the
    /// process runs. Every replica of a shared store sweeps; an upload aborted twice is
    /// answered 404 the second time, and forgotten.
    pub async fn sweep_stale_uploads(self: Arc<Self>, after: Duration) {
        let period = (after / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let mut superseded_since = HashMap::new();
        loop {
            tokio::time::sleep(period).await;
            if let Err(error) = self.sweep(after, &mut superseded_since).await {
                tracing::warn!(%error, "sweeping the uploads of superseded tokens failed; trying again later");
            }
        }
    }

    /// One walk over the upload records. `superseded_since`: when this process first saw each
    /// upload's token below its fence (a restart starts the wait again: later, never sooner).
    async fn sweep(&self, after: Duration, superseded_since: &mut HashMap<String, Instant>) -> Result<(), StoreError> {
        let records = self.gate.upload_records();
        let mut superseded = HashSet::new();
        let mut cursor = None;
        loop {
            let page = records.page(cursor.take(), SWEEP_PAGE).await?;
            for record in page.records {
                let Ok(resource) = ResourceKey::new(&record.resource) else { continue };
                if self.gate.fence(&resource).await?.is_none_or(|fence| fence <= record.token) {
                    continue;
                }
                let name = record.storage_name();
                let since = *superseded_since.entry(name.clone()).or_insert_with(Instant::now);
                superseded.insert(name);
                if since.elapsed() < after {
                    continue;
                }
                match self.abort_upload(&record, "abort_stale_upload").await {
                    Ok(resp) if resp.status().is_success() => {
                        metrics::stale_upload_aborted("fencegate");
                        tracing::info!(
                            bucket = %record.bucket,
                            key = %record.key,
                            upload_id = %record.upload_id,
                            token = record.token.0,
                            "aborted an upload of a superseded token"
                        );
                    }
                    Ok(resp) if resp.status() == StatusCode::NOT_FOUND => {}
                    Ok(resp) => {
                        tracing::warn!(status = %resp.status(), upload_id = %record.upload_id, "aborting an upload of a superseded token failed")
                    }
                    Err(error) => {
                        tracing::warn!(%error, upload_id = %record.upload_id, "aborting an upload of a superseded token failed")
                    }
                }
            }
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        superseded_since.retain(|name, _| superseded.contains(name));
        Ok(())
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
