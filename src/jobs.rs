//! The operator's jobs as the admin listener sees them: what a reconciliation is asked
//! (`Job`), what it tells as it goes (`Event`, `Finding`, `Summary`), and who runs one
//! (`Reconciliations`, the scan in `upkeep::reconcile`). The admin listener and
//! `fencegate reconcile` speak this vocabulary and know nothing of the front.

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::fence::AmbiguousCause;

/// Starts reconciliations.
pub trait Reconciliations: Send + Sync + 'static {
    /// The events of `job`, run on a task of its own; `None` while another runs. Dropping the
    /// receiver stops the scan at its next event.
    fn start(&self, job: Job) -> Option<mpsc::Receiver<Event>>;
}

/// What to reconcile: the gateway's records always, and a bucket when one is named.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    #[serde(default)]
    pub bucket: Option<String>,
    #[serde(default)]
    pub prefix: String,
    /// What to fix, by kind of finding (none: report only). `true` is refused: raising
    /// fences to stamps, which nothing authenticates, must be asked for by name.
    #[serde(default, deserialize_with = "apply_kinds")]
    pub apply: Vec<ApplyKind>,
    /// An upload of its resource's current token open longer than this is a finding of its own
    /// ([`Finding::OldUpload`], never applied: it is the current holder's).
    #[serde(default = "old_upload_after_ms")]
    pub old_upload_after_ms: u64,
}

/// [`Job::old_upload_after_ms`]'s default: a day.
pub const OLD_UPLOAD_AFTER_MS: u64 = 24 * 3600 * 1000;

fn old_upload_after_ms() -> u64 {
    OLD_UPLOAD_AFTER_MS
}

/// A kind of finding `apply` fixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApplyKind {
    /// Abort the incomplete uploads of superseded tokens.
    StaleUpload,
    /// Raise a fence to the stamp of an object stamped above it (the store lost an advance).
    /// A stamp is not authenticated: whoever can write the upstream directly can forge one.
    RaiseFence,
}

impl ApplyKind {
    pub const ALL: [Self; 2] = [Self::StaleUpload, Self::RaiseFence];

    pub fn name(self) -> &'static str {
        match self {
            Self::StaleUpload => "stale_upload",
            Self::RaiseFence => "raise_fence",
        }
    }

    /// The kinds a comma-separated list names (`stale_upload,raise_fence`).
    pub fn parse_list(list: &str) -> Result<Vec<Self>, String> {
        let mut kinds = Vec::new();
        for name in list.split(',').map(str::trim) {
            let Some(kind) = Self::ALL.into_iter().find(|k| k.name() == name) else {
                return Err(format!("{name:?} is no kind of finding to apply: {}", Self::names()));
            };
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        Ok(kinds)
    }

    /// Every kind, for a message.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }
}

/// `apply`: a list of kinds, or `false` or `[]` (none); `true` is refused, naming the kinds.
fn apply_kinds<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Vec<ApplyKind>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Apply {
        Flag(bool),
        Kinds(Vec<String>),
    }
    match Apply::deserialize(de)? {
        Apply::Flag(false) => Ok(Vec::new()),
        Apply::Flag(true) => Err(serde::de::Error::custom(format!(
            "name what to apply ({}): raising fences to stamps, which nothing authenticates, is never implied",
            ApplyKind::names()
        ))),
        Apply::Kinds(names) if names.is_empty() => Ok(Vec::new()),
        Apply::Kinds(names) => ApplyKind::parse_list(&names.join(",")).map_err(serde::de::Error::custom),
    }
}

impl Job {
    pub fn applies(&self, kind: ApplyKind) -> bool {
        self.apply.contains(&kind)
    }

    /// A bucket name as S3 could have one (the rest is the upstream's to refuse): a name with a
    /// `/` or nothing in it would list the buckets, or read an object, as if it were a listing.
    pub fn check(&self) -> Result<(), String> {
        let Some(bucket) = &self.bucket else {
            return match self.prefix.is_empty() {
                true => Ok(()),
                false => Err("a prefix is a key prefix in a bucket: name the bucket".into()),
            };
        };
        let fits = (1..=255).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
        if fits { Ok(()) } else { Err(format!("{bucket:?} is not a bucket name")) }
    }
}

/// What the scan tells, in order: progress now and then, findings as found, then `done` (or
/// `failed`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Progress { records: u64, objects: u64, uploads: u64 },
    Finding(Finding),
    Done(Summary),
    Failed { error: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// An incomplete multipart upload made under a token below its resource's fence, created
    /// at `created_at_ms` (wall clock).
    StaleUpload {
        key: String,
        upload_id: String,
        resource: String,
        token: u64,
        fence: u64,
        /// 0 from a fencegate that did not send it.
        #[serde(default)]
        created_at_ms: u64,
        action: Action,
    },
    /// An incomplete multipart upload of the resource's current token, open longer than the
    /// job's `old_upload_after_ms`: a writer that never completed nor aborted it, or one still
    /// at work. Reported only (it holds storage until `fencing.abort_uploads_after_ms`).
    OldUpload { key: String, upload_id: String, resource: String, token: u64, created_at_ms: u64 },
    /// An object of a fenced resource with no stamp: written around fencegate. `modified`:
    /// its `LastModified` as the listing gives it.
    Unstamped {
        key: String,
        resource: String,
        fence: Option<u64>,
        #[serde(default)]
        modified: Option<String>,
    },
    /// An object stamped above its resource's fence: the store lost an advance.
    StampAboveFence {
        key: String,
        resource: String,
        stamp: u64,
        fence: Option<u64>,
        #[serde(default)]
        modified: Option<String>,
        action: Action,
    },
    /// A gateway request that may or may not have executed at the API: look it up there by
    /// `upstream_key`. A retry with its token gets "outcome unknown" until `expires_in_ms`.
    UnknownOutcome {
        resource: String,
        /// The route's prefix (`routes[].prefix`); empty for a record written before it was kept.
        route: String,
        upstream_key: String,
        token: u64,
        fence: Option<u64>,
        cause: AmbiguousCause,
        /// When the request claimed the record (wall clock, ms); 0 if not kept.
        claimed_at_ms: u64,
        expires_in_ms: u64,
    },
    /// A gateway record the store keeps that cannot be read (written by another version, or
    /// by hand): its outcome is unknown to fencegate too.
    UnreadableRecord { name: String, error: String },
}

/// What `apply` did about a finding.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Reported only.
    None,
    Aborted,
    Raised,
    /// `apply` tried and failed: why.
    Failed(String),
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    /// Live idempotency records read.
    pub records: u64,
    /// Of those, claims still within their window (a live fencegate may still be sending
    /// them): not findings yet, but a scan soon after a crash is not clean for their sake.
    pub in_flight: u64,
    pub objects: u64,
    pub uploads: u64,
    pub findings: u64,
    /// Objects outside every rule whose own name has no fence: their resource is unknown.
    pub unattributed: u64,
    pub applied: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_names_its_kinds_and_never_implies_raising_a_fence() {
        assert_eq!(ApplyKind::parse_list("stale_upload").unwrap(), vec![ApplyKind::StaleUpload]);
        assert_eq!(
            ApplyKind::parse_list("raise_fence, stale_upload,raise_fence").unwrap(),
            vec![ApplyKind::RaiseFence, ApplyKind::StaleUpload]
        );
        for bad in ["", "everything", "stale_upload,", "Stale_Upload"] {
            let error = ApplyKind::parse_list(bad).unwrap_err();
            assert!(error.contains("stale_upload") && error.contains("raise_fence"), "{bad:?}: {error}");
        }
        let job = |json: &str| serde_json::from_str::<Job>(json);
        assert!(job(r#"{"bucket": "b"}"#).unwrap().apply.is_empty());
        assert!(job(r#"{"bucket": "b", "apply": false}"#).unwrap().apply.is_empty());
        let named = job(r#"{"bucket": "b", "apply": ["raise_fence"]}"#).unwrap();
        assert!(named.applies(ApplyKind::RaiseFence) && !named.applies(ApplyKind::StaleUpload));
        let implied = job(r#"{"bucket": "b", "apply": true}"#).unwrap_err().to_string();
        assert!(implied.contains("raise_fence") && implied.contains("never implied"), "{implied}");
        let unknown = job(r#"{"bucket": "b", "apply": ["all"]}"#).unwrap_err().to_string();
        assert!(unknown.contains("\"all\" is no kind") && unknown.contains("stale_upload"), "{unknown}");
        assert!(job(r#"{"bucket": "b", "apply": []}"#).unwrap().apply.is_empty());
    }

    /// What the scan sends, `fencegate reconcile` reads back as the same events.
    #[test]
    fn events_read_back_as_sent() {
        let events = [
            Event::Progress { records: 1, objects: 2, uploads: 3 },
            Event::Finding(Finding::StaleUpload {
                key: "k".into(),
                upload_id: "u".into(),
                resource: "r".into(),
                token: 5,
                fence: 6,
                created_at_ms: 7,
                action: Action::Failed("no".into()),
            }),
            Event::Finding(Finding::OldUpload {
                key: "k".into(),
                upload_id: "u".into(),
                resource: "r".into(),
                token: 5,
                created_at_ms: 7,
            }),
            Event::Finding(Finding::Unstamped { key: "k".into(), resource: "r".into(), fence: None, modified: None }),
            Event::Finding(Finding::StampAboveFence {
                key: "k".into(),
                resource: "r".into(),
                stamp: 9,
                fence: Some(8),
                modified: Some("2026-12-05T00:00:00.000Z".into()),
                action: Action::Raised,
            }),
            Event::Finding(Finding::UnknownOutcome {
                resource: "r".into(),
                route: "/api/".into(),
                upstream_key: "uk".into(),
                token: 3,
                fence: None,
                cause: AmbiguousCause::Timeout,
                claimed_at_ms: 1,
                expires_in_ms: 2,
            }),
            Event::Finding(Finding::UnreadableRecord { name: "n".into(), error: "e".into() }),
            Event::Finding(Finding::StaleUpload {
                key: "k".into(),
                upload_id: "u".into(),
                resource: "r".into(),
                token: 1,
                fence: 2,
                created_at_ms: 0,
                action: Action::Aborted,
            }),
            Event::Done(Summary { findings: 3, ..Summary::default() }),
            Event::Failed { error: "e".into() },
        ];
        for event in events {
            let sent = serde_json::to_string(&event).unwrap();
            let read: Event = serde_json::from_str(&sent).unwrap();
            assert_eq!(serde_json::to_string(&read).unwrap(), sent);
        }
        let older: Event = serde_json::from_str(r#"{"event":"done","findings":0,"objects":3}"#).unwrap();
        assert!(matches!(older, Event::Done(Summary { objects: 3, .. })), "a summary with fields left out reads");
        let before_times = r#"{"event":"finding","kind":"stale_upload","key":"k","upload_id":"u","resource":"r","token":1,"fence":2,"action":"none"}"#;
        assert!(serde_json::from_str::<Event>(before_times).is_ok(), "a finding sent before the times were");
    }
}
