//! Whether the upstream answers fencegate's credentials now: `/readyz` is 200 only while it
//! does (a replica whose every write would get 502 is not ready), and `/v1/status` names why
//! not. A watcher asks every `upstream.health_interval_ms` with the cheapest signed request
//! there is (`HEAD` of the probe bucket, else a bucket listing) and keeps the last answer, so
//! `/readyz` itself never waits on the upstream.

use std::sync::Mutex;
use std::time::Duration;

use http::{Method, StatusCode};
use s3s::Body;

use super::{Upstream, UpstreamError};

/// What the last check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Not asked yet.
    Unchecked,
    Ready,
    /// No answer: the connection, or the answer's time (`UpstreamError`'s text).
    Unreachable(String),
    /// 401, or a 403 whose code says the credentials themselves were refused.
    CredentialsRefused(StatusCode),
    /// 403 to a `HEAD` of the bucket: the credentials, or their rights on the bucket.
    BucketRefused(String),
    /// 404 to a `HEAD` of the bucket fencegate was told to use.
    BucketMissing(String),
    /// Any other answer that is not a success (a 5xx).
    Failing(StatusCode),
}

impl Reach {
    /// Why a request could not succeed now, or `None` when it could.
    pub fn cause(&self) -> Option<String> {
        Some(match self {
            Self::Ready => return None,
            Self::Unchecked => "the upstream has not been checked yet".to_owned(),
            Self::Unreachable(why) => format!("the upstream cannot be reached: {why}"),
            Self::CredentialsRefused(status) => format!(
                "the upstream refuses fencegate's credentials ({status}): check upstream.access_key_id and \
                 upstream.secret_access_key"
            ),
            Self::BucketRefused(bucket) => format!(
                "the upstream refuses fencegate access to the bucket {bucket:?} (403): check upstream.access_key_id, \
                 upstream.secret_access_key and their rights on upstream.probe_bucket"
            ),
            Self::BucketMissing(bucket) => format!("the bucket {bucket:?} does not exist at the upstream"),
            Self::Failing(status) => format!("the upstream answers {status}"),
        })
    }
}

/// The upstream's reach as last checked, shared by the watcher and the admin listener.
pub struct UpstreamHealth {
    reach: Mutex<Reach>,
    /// What `check` asks about: a `HEAD` of this bucket, or the bucket listing.
    bucket: Option<String>,
    /// Bounds each check: a slower answer counts as none.
    timeout: Duration,
    /// Whether there is anything to watch: a local store answers as long as fencegate runs.
    remote: bool,
}

impl UpstreamHealth {
    pub fn new(bucket: Option<String>, timeout: Duration) -> Self {
        Self { reach: Mutex::new(Reach::Unchecked), bucket, timeout, remote: true }
    }

    /// An upstream that is part of this process (the local store): always within reach.
    pub fn in_process() -> Self {
        Self { reach: Mutex::new(Reach::Ready), bucket: None, timeout: Duration::ZERO, remote: false }
    }

    /// Whether the upstream is another process, whose reach is worth watching.
    pub fn is_remote(&self) -> bool {
        self.remote
    }

    pub fn reach(&self) -> Reach {
        self.reach.lock().expect("upstream health lock").clone()
    }

    /// Asks the upstream once and keeps what it answered.
    pub async fn check(&self, upstream: &dyn Upstream) {
        if !self.remote {
            return;
        }
        let reach = match tokio::time::timeout(self.timeout, self.ask(upstream)).await {
            Ok(reach) => reach,
            Err(_) => {
                Reach::Unreachable(UpstreamError::Timeout { after_ms: crate::config::millis(self.timeout) }.to_string())
            }
        };
        let mut kept = self.reach.lock().expect("upstream health lock");
        if *kept != reach {
            match reach.cause() {
                None => tracing::info!("the upstream answers fencegate's credentials"),
                Some(cause) => tracing::warn!(cause, "upstream not ready"),
            }
        }
        *kept = reach;
    }

    async fn ask(&self, upstream: &dyn Upstream) -> Reach {
        let (method, path) = match &self.bucket {
            Some(bucket) => (Method::HEAD, format!("/{bucket}")),
            None => (Method::GET, "/".to_owned()),
        };
        let Ok(req) = http::Request::builder().method(method).uri(&path).body(Body::empty()) else {
            return Reach::BucketMissing(self.bucket.clone().unwrap_or_default());
        };
        let resp = match upstream.send(req).await {
            Err(error) => return Reach::Unreachable(crate::logs::with_causes(&error)),
            Ok(resp) => resp,
        };
        let status = resp.status();
        match (status, &self.bucket) {
            (status, _) if status.is_success() => Reach::Ready,
            (StatusCode::UNAUTHORIZED, _) => Reach::CredentialsRefused(status),
            (StatusCode::FORBIDDEN, Some(bucket)) => Reach::BucketRefused(bucket.clone()),
            (StatusCode::NOT_FOUND, Some(bucket)) => Reach::BucketMissing(bucket.clone()),
            (StatusCode::FORBIDDEN, None) => {
                // The listing's code tells refused credentials from valid ones without the
                // right to list buckets (scoped to theirs), which fencegate does not need.
                let body = http_body_util::BodyExt::collect(resp.into_body()).await.map(|b| b.to_bytes());
                let code = body.ok().and_then(|b| super::xml_element(&b, "Code")).unwrap_or_default();
                if credentials_refused(&code) { Reach::CredentialsRefused(status) } else { Reach::Ready }
            }
            (status, _) => Reach::Failing(status),
        }
    }

    /// Checks every `interval` until dropped (the caller aborts the task).
    pub async fn watch(self: std::sync::Arc<Self>, upstream: std::sync::Arc<dyn Upstream>, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.check(upstream.as_ref()).await;
        }
    }
}

/// Whether an S3 error code says the request's credentials themselves were refused (not their
/// rights on what it asked for).
pub(crate) fn credentials_refused(code: &str) -> bool {
    matches!(code, "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "InvalidToken" | "ExpiredToken" | "InvalidSecurity")
}
