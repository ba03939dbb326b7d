//! Reconciliation: the upstream compared with the fences, for the operator
//! (`fencegate reconcile`, `POST /v1/reconcile` on the admin listener). Where the upstream
//! cannot check tokens, writes that went around fencegate, and advances a store lost, show
//! only here:
//!
//! - an incomplete multipart upload made under a token below its resource's fence (its
//!   record, confirmed at the upstream); `apply` = `stale_upload` aborts it;
//! - an incomplete multipart upload of the resource's current token open longer than the job's
//!   `old_upload_after_ms` (a day unless asked): reported only, it is the current holder's;
//! - an object with no stamp whose resource is fenced (under a rule's prefix, or its own
//!   `bucket/key` with a fence): written around fencegate;
//! - an object stamped above its resource's fence, where a rule binds the key (so the resource
//!   is known): the store lost an advance; `apply` = `raise_fence` raises the fence to the
//!   stamp (never lowers one), as a registration does, but never to 2^64-1, which would lock
//!   the resource for good.
//!
//! - an idempotency record of the API gateway whose outcome is unknown (the call timed out,
//!   its connection broke, or the fencegate that sent it never recorded an answer): the API may
//!   or may not have done it, which only the API can tell, looked up by the record's
//!   `Idempotency-Key`. Live records only (past its retention, a retry is a new request);
//!   `apply` leaves them.
//!
//! A stamped object outside every rule may have been written under a resource its writer
//! named (`Fencing-Resource`), which the object does not record: its stamp is counted as
//! unattributed, never judged. A stamp is not authenticated: whoever can write the upstream
//! directly can forge one, so `raise_fence` is the operator's call on what the report shows, and
//! never implied.
//!
//! The scan streams: one page of the listing at a time, heads read a few at once, findings
//! sent as they are found, so its memory does not grow with the bucket.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;
use s3s::Body;
use serde::Deserialize;
use tokio::sync::mpsc;

use super::Upkeep;
use crate::fence::{
    AmbiguousCause, FenceToken, IdempotencyOutcome, ResourceKey, StoreError, UploadRecord, stale_below,
};
use crate::jobs::{Action, ApplyKind, Event, Finding, Job, Reconciliations, Summary};
use crate::logs::with_causes;
use crate::net::percent::encode_key;
use crate::s3::{FrontError, ObjectState, abort_upload, error_of};
use crate::upstream::UpstreamError;

/// Heads read at once.
const HEADS_AT_ONCE: usize = 8;
/// Keys asked per listing page, and upload records per page.
const PAGE: usize = 1000;
/// Fences remembered during a scan (most objects of a rule share one); beyond, forgotten.
const FENCES_REMEMBERED_MAX: usize = 10_000;
/// Unknown outcomes remembered during a scan, to tell each once.
const TOLD_REMEMBERED_MAX: usize = 100_000;
/// A listing page's body at most.
const LISTING_BYTES_MAX: usize = 16 * 1024 * 1024;

impl Upkeep {
    /// Runs `job`, telling `events` what it finds; stops early when nobody listens any more.
    /// `records`: whether to read the gateway's idempotency records.
    pub async fn reconcile(self: Arc<Self>, job: Job, records: bool, events: mpsc::Sender<Event>) {
        let mut scan = Scan {
            upkeep: &self,
            job: &job,
            records,
            told: std::collections::HashSet::new(),
            events: &events,
            summary: Summary::default(),
            fences: HashMap::new(),
        };
        let result = scan.all().await;
        let last = match result {
            Ok(()) => Event::Done(scan.summary),
            Err(ScanError::Gone) => return,
            Err(ScanError::Failed(error)) => Event::Failed { error },
        };
        let _ = events.send(last).await;
    }
}

enum ScanError {
    /// The listener went away: nothing more to do.
    Gone,
    Failed(String),
}

impl From<StoreError> for ScanError {
    fn from(e: StoreError) -> Self {
        Self::Failed(format!("the fence store: {}", with_causes(&e)))
    }
}

struct Scan<'a> {
    upkeep: &'a Arc<Upkeep>,
    job: &'a Job,
    /// Whether a route keeps idempotency records (else none are read).
    records: bool,
    /// The upstream keys of the unknown outcomes told, so that one a `SCAN` returns twice is
    /// told once (up to [`TOLD_REMEMBERED_MAX`]).
    told: std::collections::HashSet<String>,
    events: &'a mpsc::Sender<Event>,
    summary: Summary,
    fences: HashMap<ResourceKey, Option<FenceToken>>,
}

impl Scan<'_> {
    async fn tell(&mut self, event: Event) -> Result<(), ScanError> {
        if let Event::Finding(finding) = &event {
            self.summary.findings += 1;
            if matches!(finding, Finding::StaleUpload { action: Action::Aborted, .. })
                || matches!(finding, Finding::StampAboveFence { action: Action::Raised, .. })
            {
                self.summary.applied += 1;
            }
        }
        self.events.send(event).await.map_err(|_| ScanError::Gone)
    }

    async fn progress(&mut self) -> Result<(), ScanError> {
        let Summary { records, objects, uploads, .. } = self.summary;
        self.tell(Event::Progress { records, objects, uploads }).await
    }

    async fn all(&mut self) -> Result<(), ScanError> {
        if self.records {
            self.records().await?;
        }
        let Some(bucket) = self.job.bucket.clone() else { return Ok(()) };
        self.uploads(&bucket).await?;
        self.objects(&bucket).await
    }

    /// The gateway's live idempotency records whose outcome is unknown.
    async fn records(&mut self) -> Result<(), ScanError> {
        let listings = self.upkeep.gate.listings();
        let mut cursor = None;
        loop {
            let page = listings.idempotency_records(cursor.take(), PAGE).await?;
            let now_ms = self.upkeep.clock.now_ms();
            for (name, error) in page.unreadable {
                self.tell(Event::Finding(Finding::UnreadableRecord { name, error })).await?;
            }
            for (resource, record) in page.records {
                if record.is_expired(now_ms) {
                    continue;
                }
                self.summary.records += 1;
                let cause = match record.outcome {
                    IdempotencyOutcome::Ambiguous { cause } => cause,
                    IdempotencyOutcome::InFlight { deadline_ms } if deadline_ms <= now_ms => AmbiguousCause::Abandoned,
                    IdempotencyOutcome::InFlight { .. } => {
                        self.summary.in_flight += 1;
                        continue;
                    }
                    IdempotencyOutcome::Completed(_) => continue,
                };
                if self.told.len() < TOLD_REMEMBERED_MAX && !self.told.insert(record.upstream_key.clone()) {
                    continue;
                }
                let fence = self.fence(&resource).await?;
                let finding = Finding::UnknownOutcome {
                    resource: resource.as_str().to_owned(),
                    route: record.route,
                    upstream_key: record.upstream_key,
                    token: record.token.0,
                    fence: fence.map(|f| f.0),
                    cause,
                    claimed_at_ms: record.claimed_at_ms,
                    expires_in_ms: record.expires_at_ms - now_ms,
                };
                self.tell(Event::Finding(finding)).await?;
            }
            self.progress().await?;
            match page.next {
                Some(next) => cursor = Some(next),
                None => return Ok(()),
            }
        }
    }

    async fn fence(&mut self, resource: &ResourceKey) -> Result<Option<FenceToken>, ScanError> {
        if let Some(fence) = self.fences.get(resource) {
            return Ok(*fence);
        }
        let fence = self.upkeep.gate.fence(resource).await?;
        if self.fences.len() >= FENCES_REMEMBERED_MAX {
            self.fences.clear();
        }
        self.fences.insert(resource.clone(), fence);
        Ok(fence)
    }

    /// The upload records of the bucket under the prefix whose token a newer one superseded,
    /// each confirmed at the upstream (a record of an upload ended around fencegate is not).
    async fn uploads(&mut self, bucket: &str) -> Result<(), ScanError> {
        let records = self.upkeep.gate.upload_records();
        let mut cursor = None;
        loop {
            let page = records.page(cursor.take(), PAGE).await?;
            for record in page.records {
                if record.bucket != bucket || !record.key.starts_with(&self.job.prefix) {
                    continue;
                }
                self.summary.uploads += 1;
                let Ok(resource) = ResourceKey::new(&record.resource) else { continue };
                let Some(fence) = stale_below(self.fence(&resource).await?, record.token) else {
                    self.old_upload(record).await?;
                    continue;
                };
                if !self.upkeep.hop.upload_exists(&record).await.map_err(ScanError::Failed)? {
                    continue;
                }
                let action = if self.job.applies(ApplyKind::StaleUpload) {
                    match self.abort(&record).await? {
                        Some(action) => action,
                        None => continue, // a newer token took it over meanwhile: not stale
                    }
                } else {
                    Action::None
                };
                let finding = Finding::StaleUpload {
                    key: record.key,
                    upload_id: record.upload_id,
                    resource: record.resource,
                    token: record.token.0,
                    fence: fence.0,
                    created_at_ms: record.created_at_ms,
                    action,
                };
                self.tell(Event::Finding(finding)).await?;
            }
            self.progress().await?;
            match page.next {
                Some(next) => cursor = Some(next),
                None => return Ok(()),
            }
        }
    }

    /// An upload of the current token open longer than the job says, still at the upstream: a
    /// finding of its own, never applied.
    async fn old_upload(&mut self, record: UploadRecord) -> Result<(), ScanError> {
        let age_ms = self.upkeep.clock.now_ms().saturating_sub(record.created_at_ms);
        if age_ms < self.job.old_upload_after_ms
            || !self.upkeep.hop.upload_exists(&record).await.map_err(ScanError::Failed)?
        {
            return Ok(());
        }
        let finding = Finding::OldUpload {
            key: record.key,
            upload_id: record.upload_id,
            resource: record.resource,
            token: record.token.0,
            created_at_ms: record.created_at_ms,
        };
        self.tell(Event::Finding(finding)).await
    }

    /// Aborts a stale upload, unless a newer token took it over since its record was read
    /// (read again just before, as the sweep does): `None` then.
    async fn abort(&self, record: &UploadRecord) -> Result<Option<Action>, ScanError> {
        let now = self.upkeep.gate.upload_records().get(&record.bucket, &record.upload_id).await?;
        if now.as_ref().is_none_or(|now| now.token != record.token) {
            return Ok(None);
        }
        Ok(Some(match abort_upload(&self.upkeep.hop, &self.upkeep.gate, record, "reconcile").await {
            Ok(resp) if resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND => Action::Aborted,
            Ok(resp) => Action::Failed(format!("the upstream answered {}", resp.status())),
            Err(e) => Action::Failed(e.to_string()),
        }))
    }

    /// Every object of the bucket under the prefix, a listing page at a time.
    async fn objects(&mut self, bucket: &str) -> Result<(), ScanError> {
        let mut continuation: Option<String> = None;
        loop {
            let page = self.upkeep.list_page(bucket, &self.job.prefix, continuation.as_deref()).await?;
            let upkeep = self.upkeep.clone();
            let bucket = bucket.to_owned();
            let mut heads = futures_util::stream::iter(page.keys)
                .map(|(key, modified)| {
                    let (upkeep, bucket) = (upkeep.clone(), bucket.clone());
                    async move {
                        let state = upkeep.object_head(&bucket, &key).await;
                        (key, modified, state)
                    }
                })
                .buffered(HEADS_AT_ONCE);
            while let Some((key, modified, state)) = heads.next().await {
                self.summary.objects += 1;
                match state.map_err(ScanError::Failed)? {
                    ObjectState::Present { stamp, .. } => self.judge_object(&bucket, key, modified, stamp).await?,
                    ObjectState::Absent => {} // deleted since the listing
                }
            }
            self.progress().await?;
            match page.next {
                Some(next) => continuation = Some(next),
                None => return Ok(()),
            }
        }
    }

    async fn judge_object(
        &mut self,
        bucket: &str,
        key: String,
        modified: Option<String>,
        stamp: Option<FenceToken>,
    ) -> Result<(), ScanError> {
        let bound = self.upkeep.wire.rule_resource(bucket, &key);
        let resource = match bound {
            Some(name) => name.to_owned(),
            None => format!("{bucket}/{key}"),
        };
        let Ok(resource_key) = ResourceKey::new(&resource) else { return Ok(()) };
        if bound.is_none() && stamp.is_some() {
            self.summary.unattributed += 1;
            return Ok(());
        }
        let fence = self.fence(&resource_key).await?;
        if bound.is_none() && fence.is_none() {
            return Ok(());
        }
        let finding = match stamp {
            None => Finding::Unstamped { key, resource, fence: fence.map(|f| f.0), modified },
            Some(stamp) if fence.is_none_or(|fence| stamp > fence) => {
                let action = if stamp == FenceToken(u64::MAX) {
                    Action::Failed("not raised: 2^64-1 would lock the resource for good".into())
                } else if self.job.applies(ApplyKind::RaiseFence) {
                    match self.upkeep.gate.advance(&resource_key, stamp).await {
                        Ok(_) => {
                            self.fences.insert(resource_key, Some(stamp));
                            Action::Raised
                        }
                        Err(e) => Action::Failed(e.to_string()),
                    }
                } else {
                    Action::None
                };
                Finding::StampAboveFence { key, resource, stamp: stamp.0, fence: fence.map(|f| f.0), modified, action }
            }
            Some(_) => return Ok(()),
        };
        self.tell(Event::Finding(finding)).await
    }
}

/// A key as `encoding-type=url` lists it: `+` for a space, `%XX` for the rest (as S3 and the
/// SDKs, which read it with `unquote_plus`).
fn url_decoded(listed: &str) -> String {
    percent_encoding::percent_decode_str(&listed.replace('+', " ")).decode_utf8_lossy().into_owned()
}

/// One page of a bucket's keys.
struct KeyPage {
    /// Each key, with its `LastModified` as listed.
    keys: Vec<(String, Option<String>)>,
    next: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ListBucketResult {
    #[serde(default)]
    contents: Vec<Contents>,
    #[serde(default)]
    is_truncated: bool,
    next_continuation_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Contents {
    key: String,
    #[serde(default)]
    last_modified: Option<String>,
}

impl Upkeep {
    /// A page of the bucket's keys under `prefix` (ListObjectsV2, keys URL-encoded so that any
    /// key survives the XML).
    async fn list_page(&self, bucket: &str, prefix: &str, continuation: Option<&str>) -> Result<KeyPage, ScanError> {
        let query = {
            let mut query = form_urlencoded::Serializer::new(String::new());
            query.append_pair("list-type", "2").append_pair("encoding-type", "url");
            query.append_pair("max-keys", &PAGE.to_string()).append_pair("prefix", prefix);
            if let Some(token) = continuation {
                query.append_pair("continuation-token", token);
            }
            query.finish()
        };
        let path = format!("/{}?{query}", encode_key(bucket));
        let resp = self
            .hop
            .send("reconcile_list", Method::GET, &path, HeaderMap::new(), Body::empty())
            .await
            .map_err(|e| ScanError::Failed(format!("listing the bucket: {e}")))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), LISTING_BYTES_MAX)
            .collect()
            .await
            .map_err(|e| ScanError::Failed(format!("reading the listing: {e}")))?
            .to_bytes();
        if !status.is_success() {
            // Its code and message only: an S3 error can carry the signature that was sent.
            let (code, message) = error_of(&body);
            return Err(ScanError::Failed(format!(
                "listing the bucket: the upstream answered {status} {code}: {message}"
            )));
        }
        let listed: ListBucketResult = quick_xml::de::from_reader(body.as_ref())
            .map_err(|e| ScanError::Failed(format!("the listing is not S3's: {e}")))?;
        let keys = listed.contents.into_iter().map(|c| (url_decoded(&c.key), c.last_modified)).collect();
        let next = listed.next_continuation_token.filter(|_| listed.is_truncated);
        Ok(KeyPage { keys, next })
    }

    /// An object's head at the upstream, with its stamp.
    async fn object_head(&self, bucket: &str, key: &str) -> Result<ObjectState, String> {
        let path = format!("/{}/{}", encode_key(bucket), encode_key(key));
        self.hop.head(&path).await.map_err(|e| match e {
            FrontError::Upstream(UpstreamError::Timeout { .. }) => {
                format!("reading the head of {key:?}: no answer in time")
            }
            e => format!("reading the head of {key:?}: {}", with_causes(&e)),
        })
    }
}

/// Starts reconciliations, one at a time (a scan reads the whole bucket).
#[derive(Clone)]
pub struct Reconciler {
    upkeep: Arc<Upkeep>,
    /// Whether a route keeps idempotency records.
    records: bool,
    one: Arc<tokio::sync::Semaphore>,
}

impl Reconciler {
    pub fn new(upkeep: Arc<Upkeep>, records: bool) -> Self {
        Self { upkeep, records, one: Arc::new(tokio::sync::Semaphore::new(1)) }
    }
}

impl Reconciliations for Reconciler {
    fn start(&self, job: Job) -> Option<mpsc::Receiver<Event>> {
        let permit = self.one.clone().try_acquire_owned().ok()?;
        let (events, received) = mpsc::channel(64);
        let (upkeep, records) = (self.upkeep.clone(), self.records);
        tokio::spawn(async move {
            let _one = permit;
            upkeep.reconcile(job, records, events).await;
        });
        Some(received)
    }
}
