//! The lease service: `/_fencegate/v1/leases/{name}` on the main listener, authenticated like S3
//! requests. Granting a lease raises its resource's fence in the same atomic store step, so
//! every older token is rejected from the moment of the grant. `/_fencegate/v1/fences/{resource}`
//! registers a token issued elsewhere (G7), like the admin API's. Both move fences, so only a
//! credential with `role = "issuer"` may call them. A grant can come with lease credentials
//! (`credentials`): S3 credentials that carry the lease's token on its resource.

pub mod credentials;

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use s3s::{Body, S3Response};
use serde::Deserialize;

use self::credentials::Issuers;
use crate::fence::{AdmitError, FenceToken, Gate, LeaseCommand, LeaseOutcome, LeaseRecord, Registered, ResourceKey};
use crate::metrics;

/// The path prefix of fencegate's own endpoints on the main listener. No bucket name can start
/// with `_`.
const OWN_PREFIX: &str = "/_fencegate/v1/";
/// The path prefix of the lease endpoints.
pub const PATH_PREFIX: &str = "/_fencegate/v1/leases/";
/// The path prefix of the registration endpoint.
pub const FENCES_PREFIX: &str = "/_fencegate/v1/fences/";
/// The pseudo-bucket s3s must accept so that these paths reach fencegate.
pub const PSEUDO_BUCKET: &str = "_fencegate";

/// A lease request body is a small JSON object.
const BODY_BYTES_MAX: usize = 4096;
/// Holder names are for humans and logs.
const HOLDER_BYTES_MAX: usize = 256;

/// The clock leases expire by: the fence core's (`crate::fence::Clock`).
pub use crate::fence::{Clock, SystemClock};

/// Lease ids: unguessable, so only the holder can renew or release.
pub trait LeaseIds: Send + Sync + 'static {
    fn next(&self) -> String;
}

pub struct RandomLeaseIds;

impl LeaseIds for RandomLeaseIds {
    fn next(&self) -> String {
        uuid::Uuid::new_v4().simple().to_string()
    }
}

/// Who calls fencegate's own endpoints.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The access key id that signed the request.
    pub access_key: String,
    /// Signed by a credential with `role = "issuer"`: it may register tokens.
    pub issuer: bool,
    /// Signed by a credential with `role = "issuer"` or `"lessee"`: it may take leases.
    pub lessee: bool,
    /// Signed by a lease credential: it renews and releases its own lease, nothing else (a
    /// shell that `eval`ed `fencegate-lease acquire --env` releases with what it holds).
    pub held: Option<credentials::Claims>,
    /// Where the caller may move fences: `None` unless its credential is restricted to some
    /// buckets (`[[credentials]] buckets`).
    pub scope: Option<FenceScope>,
    /// Signed in its headers, body included (`x-amz-content-sha256` is the body's SHA-256): not
    /// presigned, not `UNSIGNED-PAYLOAD`. The body names the token or the holder.
    pub signed: bool,
}

/// The fences a credential restricted to some buckets may move: those of resources all of
/// whose objects are inside its buckets. A resource bound by `[[fencing.rules]]` is inside when
/// every rule binding it is; a resource named `bucket/key` (an object's own) when the object is;
/// any other name could be presented by writes anywhere (`Fencing-Resource`), so it is not.
#[derive(Debug, Clone)]
pub struct FenceScope {
    /// `(bucket, key prefix)`; an empty prefix is the whole bucket.
    pub entries: Vec<(String, String)>,
    pub rules: Vec<crate::config::RuleConfig>,
}

impl FenceScope {
    pub fn covers(&self, resource: &ResourceKey) -> bool {
        scope_covers(&self.entries, &self.rules, resource)
    }
}

/// [`FenceScope::covers`], for `(bucket, key prefix)` entries and the rules binding keys to
/// resources.
pub fn scope_covers(entries: &[(String, String)], rules: &[crate::config::RuleConfig], resource: &ResourceKey) -> bool {
    let inside = |bucket: &str, key: &str| entries.iter().any(|(b, p)| b == bucket && key.starts_with(p.as_str()));
    let mut binding = rules.iter().filter(|r| r.resource == resource.as_str()).peekable();
    if binding.peek().is_some() {
        return binding.all(|r| inside(&r.bucket, &r.prefix));
    }
    resource.as_str().split_once('/').is_some_and(|(bucket, key)| !key.is_empty() && inside(bucket, key))
}

pub struct LeaseService {
    gate: Arc<Gate>,
    clock: Arc<dyn Clock>,
    ids: Arc<dyn LeaseIds>,
    ttl_ms_max: u64,
    issuers: Arc<Issuers>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireBody {
    holder: String,
    ttl_ms: u64,
    /// Also answer with lease credentials (`credentials::Issued`).
    #[serde(default)]
    credentials: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseIdBody {
    lease_id: String,
    /// On a renewal: answer with the lease credentials again, with their new expiration.
    #[serde(default)]
    credentials: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegisterBody {
    token: u64,
}

/// What went wrong with a lease call, mapped to a problem response in one place.
#[derive(Debug, thiserror::Error)]
enum LeaseError {
    #[error("{0}")]
    BadRequest(String),
    #[error("no such lease endpoint")]
    NotFound,
    #[error("lease is held by {holder} for {remaining_ms} more ms")]
    Held { holder: String, remaining_ms: u64 },
    /// With the resource's fence now, when it has one: above the lease's token, a newer token
    /// was registered or granted (the holder can tell it was superseded).
    #[error("the lease expired, was released, or was superseded{}", .fence.map(|f| format!(" (the resource's fence is {f})")).unwrap_or_default())]
    Gone { fence: Option<u64> },
    #[error("the resource's fence is at the largest token; no greater token can be granted")]
    TokensExhausted,
    #[error("fence state unknown: {0}")]
    Unavailable(String),
    #[error("fence state unknown: {message}; retry in {retry_after_s} s")]
    Recovering { message: String, retry_after_s: u64 },
    #[error("registrations need a credential with role = \"issuer\"")]
    NotIssuer,
    #[error(
        "leases need a credential with role = \"issuer\" or \"lessee\"; a lease credential renews and releases its own lease only"
    )]
    NotLessee,
    #[error("this credential is restricted to buckets that do not hold every object of resource {0:?}")]
    OutOfScope(String),
    #[error(
        "leases and registrations are signed in their headers with their body (x-amz-content-sha256: the body's \
         SHA-256); a presigned URL or UNSIGNED-PAYLOAD leaves the body unsigned"
    )]
    UnsignedBody,
    #[error("no token was ever accepted for this resource")]
    NoSuchFence,
}

impl LeaseService {
    pub fn new(
        gate: Arc<Gate>,
        clock: Arc<dyn Clock>,
        ids: Arc<dyn LeaseIds>,
        ttl_ms_max: u64,
        issuers: Arc<Issuers>,
    ) -> Self {
        Self { gate, clock, ids, ttl_ms_max, issuers }
    }

    /// The clock leases expire by.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    pub fn handles(path: &str) -> bool {
        path.starts_with(OWN_PREFIX)
    }

    pub async fn handle(&self, method: &Method, path: &str, body: Body, caller: Caller) -> S3Response<Body> {
        let registration = path.strip_prefix(FENCES_PREFIX);
        let answer = if registration.is_some() && (!caller.issuer || caller.held.is_some()) {
            Err(LeaseError::NotIssuer)
        } else if !caller.lessee {
            Err(LeaseError::NotLessee)
        } else if !caller.signed {
            Err(LeaseError::UnsignedBody)
        } else if let Some(resource) = registration {
            self.register(method, resource, body, &caller).await
        } else {
            self.dispatch(method, path, body, &caller).await
        };
        answer.unwrap_or_else(|error| problem(&error))
    }

    /// A renewal or release refused as gone says the resource's fence, so that its holder
    /// can tell a superseded lease (a fence above its token) from one that lapsed or was
    /// released: `fencegate-lease` says which. The holder learns no more than a refused write
    /// of its would tell it (`Fencing-Token-Current`).
    async fn with_fence(&self, name: &ResourceKey, error: LeaseError) -> LeaseError {
        match error {
            LeaseError::Gone { fence: None } => {
                LeaseError::Gone { fence: self.gate.fence(name).await.ok().flatten().map(|f| f.0) }
            }
            other => other,
        }
    }

    /// `GET` a fence, or `PUT {"token": N}` to register a token (G7): 200 with the fence, 409
    /// with the current one if the token is lower.
    async fn register(
        &self,
        method: &Method,
        raw: &str,
        body: Body,
        caller: &Caller,
    ) -> Result<S3Response<Body>, LeaseError> {
        let resource = decode(raw)?;
        caller.may_move(&resource)?;
        let fence = |status, token: FenceToken| {
            json_response(
                status,
                "application/json",
                &serde_json::json!({ "resource": resource.as_str(), "token": token.0 }),
            )
        };
        match *method {
            Method::GET => match self.gate.fence(&resource).await {
                Ok(Some(token)) => Ok(fence(StatusCode::OK, token)),
                Ok(None) => Err(LeaseError::NoSuchFence),
                Err(e) => Err(LeaseError::Unavailable(e.to_string())),
            },
            Method::PUT => {
                let req: RegisterBody = read_json(body).await?;
                match self.gate.register(&resource, FenceToken(req.token)).await? {
                    Registered::Raised(token) => Ok(fence(StatusCode::OK, token)),
                    Registered::Below(current) => Ok(fence(StatusCode::CONFLICT, current)),
                }
            }
            _ => Err(LeaseError::NotFound),
        }
    }

    /// A grant of the lease on `name`.
    async fn acquire(
        &self,
        name: &ResourceKey,
        req: AcquireBody,
        caller: &Caller,
        now_ms: u64,
    ) -> Result<S3Response<Body>, LeaseError> {
        if req.holder.is_empty() || req.holder.len() > HOLDER_BYTES_MAX {
            return Err(LeaseError::BadRequest(format!("holder must be 1 to {HOLDER_BYTES_MAX} bytes")));
        }
        if req.ttl_ms == 0 || req.ttl_ms > self.ttl_ms_max {
            return Err(LeaseError::BadRequest(format!("ttl_ms must be 1 to {} (leases.ttl_ms_max)", self.ttl_ms_max)));
        }
        let command =
            LeaseCommand::Acquire { holder: req.holder, ttl_ms: req.ttl_ms, lease_id: self.ids.next(), floor: None };
        match self.apply(name, command, now_ms).await? {
            LeaseOutcome::Granted(lease) => {
                metrics::lease_event("granted");
                tracing::info!(lease = name.as_str(), holder = lease.holder, token = lease.token.0, "lease granted");
                let credentials = self.credentials(req.credentials, caller, name, &lease);
                Ok(lease_json(StatusCode::CREATED, name, &lease, credentials))
            }
            other => Err(refusal(other)),
        }
    }

    async fn dispatch(
        &self,
        method: &Method,
        path: &str,
        body: Body,
        caller: &Caller,
    ) -> Result<S3Response<Body>, LeaseError> {
        let rest = path.strip_prefix(PATH_PREFIX).ok_or(LeaseError::NotFound)?;
        let (name, renew) = match rest.strip_suffix("/renew") {
            Some(name) => (name, true),
            None => (rest, false),
        };
        let name = decode(name)?;
        caller.may_move(&name)?;
        let now_ms = self.clock.now_ms();
        if let Some(claims) = &caller.held
            && (claims.resource != name.as_str() || (method, renew) == (&Method::POST, false))
        {
            return Err(LeaseError::NotLessee);
        }
        match (method, renew) {
            (&Method::POST, false) => self.acquire(&name, read_json(body).await?, caller, now_ms).await,
            (&Method::POST, true) => {
                let req: LeaseIdBody = read_json(body).await?;
                caller.owns(&req.lease_id)?;
                match self.apply(&name, LeaseCommand::Renew { lease_id: req.lease_id }, now_ms).await? {
                    LeaseOutcome::Renewed(lease) => {
                        metrics::lease_event("renewed");
                        let credentials = self.credentials(req.credentials, caller, &name, &lease);
                        Ok(lease_json(StatusCode::OK, &name, &lease, credentials))
                    }
                    other => Err(self.with_fence(&name, refusal(other)).await),
                }
            }
            (&Method::DELETE, false) => {
                let req: LeaseIdBody = read_json(body).await?;
                caller.owns(&req.lease_id)?;
                match self.apply(&name, LeaseCommand::Release { lease_id: req.lease_id }, now_ms).await? {
                    LeaseOutcome::Released => {
                        metrics::lease_event("released");
                        let mut resp = S3Response::new(Body::empty());
                        resp.status = Some(StatusCode::NO_CONTENT);
                        Ok(resp)
                    }
                    other => Err(self.with_fence(&name, refusal(other)).await),
                }
            }
            _ => Err(LeaseError::NotFound),
        }
    }

    /// The lease credentials of `lease`, when asked for. The caller may take leases (checked
    /// first), so its secret is there.
    fn credentials(
        &self,
        asked: bool,
        caller: &Caller,
        name: &ResourceKey,
        lease: &LeaseRecord,
    ) -> Option<credentials::Issued> {
        if !asked {
            return None;
        }
        metrics::lease_event("credentials_issued");
        self.issuers.issue(&caller.access_key, name, lease)
    }

    async fn apply(&self, name: &ResourceKey, command: LeaseCommand, now_ms: u64) -> Result<LeaseOutcome, LeaseError> {
        Ok(self.gate.lease(name, command, now_ms).await?)
    }
}

/// A grant or a registration the gate could not make: the store's state is unknown (503),
/// with when to retry when the store said.
impl From<AdmitError> for LeaseError {
    fn from(e: AdmitError) -> Self {
        match e {
            AdmitError::StoreUnavailable(e) if e.retry_after_ms().is_some() => LeaseError::Recovering {
                message: e.to_string(),
                retry_after_s: e.retry_after_ms().unwrap_or(1000).div_ceil(1000),
            },
            AdmitError::StoreUnavailable(e) => LeaseError::Unavailable(e.to_string()),
            other => LeaseError::Unavailable(other.to_string()),
        }
    }
}

impl Caller {
    /// A lease credential names only its own grant.
    fn owns(&self, lease_id: &str) -> Result<(), LeaseError> {
        match &self.held {
            Some(claims) if claims.grant != credentials::grant_tag(lease_id) => Err(LeaseError::NotLessee),
            _ => Ok(()),
        }
    }

    fn may_move(&self, resource: &ResourceKey) -> Result<(), LeaseError> {
        match &self.scope {
            Some(scope) if !scope.covers(resource) => Err(LeaseError::OutOfScope(resource.as_str().to_owned())),
            _ => Ok(()),
        }
    }
}

fn refusal(outcome: LeaseOutcome) -> LeaseError {
    match outcome {
        LeaseOutcome::Held { holder, remaining_ms } => LeaseError::Held { holder, remaining_ms },
        LeaseOutcome::TokensExhausted => LeaseError::TokensExhausted,
        _ => {
            metrics::lease_event("gone");
            LeaseError::Gone { fence: None }
        }
    }
}

fn decode(raw: &str) -> Result<ResourceKey, LeaseError> {
    let name = crate::net::percent::decode(raw)
        .ok_or_else(|| LeaseError::BadRequest("the lease name is not valid percent-encoded UTF-8".into()))?;
    ResourceKey::new(&name).map_err(|e| LeaseError::BadRequest(e.to_string()))
}

async fn read_json<T: serde::de::DeserializeOwned>(body: Body) -> Result<T, LeaseError> {
    let bytes = Limited::new(body, BODY_BYTES_MAX)
        .collect()
        .await
        .map_err(|e| {
            LeaseError::BadRequest(if e.is::<http_body_util::LengthLimitError>() {
                format!("the body must be a JSON object under {BODY_BYTES_MAX} bytes")
            } else {
                "the body does not match its signed SHA-256 (x-amz-content-sha256), or ended early".into()
            })
        })?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| LeaseError::BadRequest(format!("invalid JSON body: {e}")))
}

fn lease_json(
    status: StatusCode,
    name: &ResourceKey,
    lease: &LeaseRecord,
    credentials: Option<credentials::Issued>,
) -> S3Response<Body> {
    let mut body = serde_json::json!({
        "name": name.as_str(),
        "holder": lease.holder,
        "lease_id": lease.lease_id,
        "token": lease.token.0,
        "ttl_ms": lease.ttl_ms,
    });
    if let Some(credentials) = credentials {
        body["credentials"] = serde_json::to_value(credentials).expect("credentials serialise");
    }
    json_response(status, "application/json", &body)
}

/// RFC 9457 problem details; `type` ends in the code.
fn problem(error: &LeaseError) -> S3Response<Body> {
    let (status, code) = match error {
        LeaseError::BadRequest(_) => (StatusCode::BAD_REQUEST, "InvalidLeaseRequest"),
        LeaseError::NotIssuer | LeaseError::NotLessee | LeaseError::UnsignedBody | LeaseError::OutOfScope(_) => {
            (StatusCode::FORBIDDEN, "AccessDenied")
        }
        LeaseError::NoSuchFence => (StatusCode::NOT_FOUND, "NoSuchFence"),
        LeaseError::NotFound => (StatusCode::NOT_FOUND, "NotFound"),
        LeaseError::Held { .. } => (StatusCode::CONFLICT, "LeaseHeld"),
        LeaseError::Gone { .. } => (StatusCode::GONE, "LeaseGone"),
        LeaseError::TokensExhausted => (StatusCode::CONFLICT, "FencingTokensExhausted"),
        LeaseError::Unavailable(_) | LeaseError::Recovering { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable")
        }
    };
    let mut body = crate::net::problem::document(status, code, &error.to_string());
    if let LeaseError::Held { holder, remaining_ms } = error {
        body["holder"] = serde_json::json!(holder);
        body["remaining_ms"] = serde_json::json!(remaining_ms);
    }
    if let LeaseError::Gone { fence: Some(fence) } = error {
        body["fence"] = serde_json::json!(fence);
    }
    let mut resp = json_response(status, crate::net::problem::CONTENT_TYPE, &body);
    if let LeaseError::Recovering { retry_after_s, .. } = error {
        resp.headers.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
    }
    resp
}

fn json_response(status: StatusCode, content_type: &'static str, body: &serde_json::Value) -> S3Response<Body> {
    let mut resp = S3Response::new(Body::from(Bytes::from(body.to_string())));
    resp.status = Some(status);
    resp.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RuleConfig;

    #[test]
    fn a_scoped_credential_moves_only_resources_whose_objects_are_all_inside() {
        let rule = |bucket: &str, prefix: &str, resource: &str| RuleConfig {
            bucket: bucket.into(),
            prefix: prefix.into(),
            resource: resource.into(),
        };
        let scope = FenceScope {
            entries: vec![("a".into(), String::new()), ("b".into(), "team/".into())],
            rules: vec![
                rule("a", "jobs/", "job:in"),
                rule("b", "team/x/", "job:in-b"),
                rule("b", "other/", "job:out"),
                rule("a", "", "job:split"),
                rule("c", "", "job:split"),
            ],
        };
        let covers = |r: &str| scope.covers(&ResourceKey::new(r).unwrap());
        assert!(covers("job:in") && covers("job:in-b"));
        assert!(!covers("job:out"), "bound outside");
        assert!(!covers("job:split"), "one of its rules is outside");
        assert!(covers("a/anything") && covers("b/team/k"));
        assert!(!covers("b/elsewhere") && !covers("c/k") && !covers("a/"));
        assert!(!covers("job:free"), "a free name can be presented by writes anywhere");
    }
}
