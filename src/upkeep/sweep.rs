//! The sweep of upload records, for as long as the process runs: no upload of a superseded
//! token, and none past `fencing.abort_uploads_after_ms`, is left behind, and the records of
//! uploads the upstream no longer has are forgotten (docs/design.md, "Uploads left behind").

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;

use super::Upkeep;
use crate::fence::{ResourceKey, StoreError, UploadRecord};
use crate::metrics;
use crate::s3::{abort_upload, forget_upload};

/// Upload records read per page of a sweep.
const SWEEP_PAGE: usize = 256;

/// The sweep runs every quarter of `fencing.abort_stale_uploads_after_ms` or
/// `fencing.abort_uploads_after_ms`, whichever is shorter, within these.
const SWEEP_PERIOD_MIN: Duration = Duration::from_secs(1);
const SWEEP_PERIOD_MAX: Duration = Duration::from_secs(60);

/// How old a record is before the sweep asks the upstream whether its upload still exists, and
/// how often it asks again.
const VERIFY_EVERY: Duration = Duration::from_secs(3600);

impl Upkeep {
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
        match abort_upload(&self.hop, &self.gate, record, op).await {
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
        match self.hop.upload_exists(record).await {
            Ok(false) => {
                tracing::info!(upload_id = %record.upload_id, "the upstream no longer has a recorded upload: forgotten");
                forget_upload(&self.gate, &record.bucket, &record.upload_id).await;
            }
            Ok(true) => {}
            Err(error) => tracing::debug!(%error, upload_id = %record.upload_id, "checking a recorded upload failed"),
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
