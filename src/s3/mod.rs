//! The S3 front end. s3s verifies the signature (header or presigned, every
//! `x-amz-content-sha256` mode) and decodes `aws-chunked` bodies; a catch-all route then hands
//! every authenticated request to fencegate, which classifies it, fences writes through the
//! gate, and forwards on raw HTTP to the upstream.

mod auth;
pub(crate) mod body;
mod classify;
mod delete_objects;
mod error;
mod lean;
mod leased;
mod multipart;
mod objects;
mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use s3s::route::S3Route;
use s3s::service::S3ServiceBuilder;
use s3s::{Body, S3Request, S3Response, S3Result};
use tracing::{Instrument, field};

pub use self::auth::Service;
pub use self::classify::{Op, Target, classify, target};
pub use self::error::{CURRENT_TOKEN_HEADER, FrontError};
pub use self::wire::{METADATA_TOKEN_HEADER, WireContract};

use self::body::{BodyFailure, BodyReport, ForwardBody, TrailerCheck};
use self::objects::{ClientCondition, ConditionFailed, EtagCache, ObjectState};
use crate::config::{Config, millis};
use crate::fence::outcome::{Bounded, bounded_call, detached, hold_for};
use crate::fence::{AdmitError, CutOff, FenceToken, Gate, Permit, ResourceKey};
use crate::lease::LeaseService;
use crate::lease::credentials::{ACCESS_KEY_PREFIX, Claims, Issuers};
use crate::metrics;
use crate::server::{REQUEST_HOP_HEADERS, RESPONSE_HOP_HEADERS};
use crate::upstream::{Enforcement, Upstream, UpstreamError, xml_element};

/// S3 request headers about fencegate's own signature and framing (besides the hop-by-hop
/// ones of every listener): never forwarded, the upstream request is signed anew.
const S3_HOP_HEADERS: &[&str] = &[
    "authorization",
    "x-amz-date",
    "x-amz-content-sha256",
    "x-amz-security-token",
    "x-amz-decoded-content-length",
    "x-amz-trailer",
];

/// Query parameters of presigned URLs: fencegate's own signature, not the upstream's.
const PRESIGN_PARAMS: &[&str] = &[
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "AWSAccessKeyId",
    "Signature",
    "Expires",
];

/// The methods of the S3 API; methods compare case-sensitively, so `put` is not among them.
const S3_METHODS: &[Method] = &[Method::GET, Method::HEAD, Method::PUT, Method::POST, Method::DELETE, Method::OPTIONS];

/// Success responses of these operations can still carry an `<Error>` body; they are read
/// (bounded) before the write counts as committed.
const XML_RESPONSE_BYTES_MAX: usize = 1024 * 1024;

/// Object heads read at once for the stamp checks of one DeleteObjects.
const STAMP_CHECKS_CONCURRENT: usize = 16;

/// A file name's limit on the file systems the local upstream runs on.
const LOCAL_FILE_NAME_BYTES_MAX: usize = 255;

/// The longest file name the local upstream (s3s-fs 0.14, pinned) makes for an object: the
/// metadata of a multipart upload, `.bucket-{base64 bucket}.object-{base64 key}.upload-{uuid}
/// .metadata.json`. A key whose name would not fit fails in the file system (500) after
/// fencegate admitted the write; it is refused first.
fn local_metadata_name_bytes(bucket: &str, key: &str) -> usize {
    let base64 = |n: usize| (n * 4).div_ceil(3);
    ".bucket-".len()
        + base64(bucket.len())
        + ".object-".len()
        + base64(key.len())
        + ".upload-".len()
        + 36
        + ".metadata.json".len()
}

/// The longest key the local upstream holds in `bucket`.
fn local_key_bytes_max(bucket: &str) -> usize {
    let mut n = 0;
    while local_metadata_name_bytes(bucket, &"k".repeat(n + 1)) <= LOCAL_FILE_NAME_BYTES_MAX {
        n += 1;
    }
    n
}

/// A CompleteMultipartUpload body lists at most 10,000 parts.
const COMPLETE_REQUEST_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Builds the S3 service: authentication from `[[credentials]]` and lease credentials, virtual
/// hosts from `server.domain`, and fencegate's handler behind it.
pub fn service(
    config: &Config,
    gate: Arc<Gate>,
    upstream: Arc<dyn Upstream>,
    leases: Arc<LeaseService>,
    issuers: Arc<Issuers>,
    enforcement: Option<Enforcement>,
) -> anyhow::Result<Service> {
    let fixed: std::collections::HashMap<String, String> =
        config.credentials.iter().map(|c| (c.access_key_id.clone(), c.secret_access_key.expose().to_owned())).collect();
    let mut front = Front::new(config, gate, upstream)?;
    // Across replicas a copy must be refused per object when it lands late (G4); on an upstream
    // that ignores `If-Match` on copies, it is made as a read and a conditional PUT instead.
    front.copy_by_read_and_put = front.gate.store().shared().is_some() && enforcement.is_some_and(|e| !e.copy_object);
    // Unprobed, a remote upstream is not trusted to tie upload ids to keys.
    front.upload_ids_tied_to_keys =
        enforcement.map_or(front.upstream.ties_upload_ids_to_keys(), |e| e.upload_ids_tied_to_keys);
    let route = FencegateRoute { front: Arc::new(front), leases, issuers: issuers.clone() };
    // Virtual-hosted addressing is the library's to parse: with `server.domain`, no lean path.
    let lean = config.server.domain.is_none().then(|| {
        Arc::new(lean::LeanPath { verifier: crate::sigv4::Verifier::new(fixed.clone()), route: route.clone() })
    });
    let mut builder = S3ServiceBuilder::new(NoOperations);
    builder.set_auth(auth::Credentials { fixed, issuers });
    builder.set_route(route);
    builder.set_validation(BucketNames);
    if let Some(domain) = &config.server.domain {
        builder.set_host(VirtualHosts { domain: domain.to_ascii_lowercase() });
    }
    Ok(auth::Service { inner: builder.build(), lean })
}

/// Virtual-hosted addressing under `server.domain`: `bucket.<domain>[:port]` names the bucket;
/// any other host (the domain itself, an IP, `localhost`) is path-style. The port is not part
/// of the name (s3s's own parser keeps it, and then sees `bucket.domain:9000` as a bucket).
struct VirtualHosts {
    domain: String,
}

impl s3s::host::S3Host for VirtualHosts {
    fn parse_host_header<'a>(&'a self, host: &'a str) -> S3Result<s3s::host::VirtualHost<'a>> {
        let name = match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        };
        let bucket = name
            .len()
            .checked_sub(self.domain.len() + 1)
            .filter(|&end| name[end..].eq_ignore_ascii_case(&format!(".{}", self.domain)))
            .map(|end| &name[..end])
            .filter(|bucket| !bucket.is_empty());
        let host = s3s::host::VirtualHost::new(self.domain.as_str());
        Ok(match bucket {
            Some(bucket) => host.with_bucket(bucket.to_ascii_lowercase()),
            None => host,
        })
    }
}

/// s3s wants an implementation of its typed operations; fencegate's route takes every request
/// before they are reached.
struct NoOperations;

#[async_trait::async_trait]
impl s3s::S3 for NoOperations {}

/// Every authenticated request: lease endpoints to the lease service, the rest to the S3 front.
#[derive(Clone)]
struct FencegateRoute {
    front: Arc<Front>,
    leases: Arc<LeaseService>,
    /// The issuers (`role = "issuer"`), whose secrets make lease credentials.
    issuers: Arc<Issuers>,
}

/// S3's bucket naming rules, plus the pseudo-bucket of the lease endpoints.
struct BucketNames;

impl s3s::validation::NameValidation for BucketNames {
    fn validate_bucket_name(&self, name: &str) -> bool {
        name == crate::lease::PSEUDO_BUCKET || s3s::path::check_bucket_name(name)
    }
}

#[async_trait::async_trait]
impl S3Route for FencegateRoute {
    fn is_match(&self, _: &Method, _: &http::Uri, _: &HeaderMap, _: &mut http::Extensions) -> bool {
        true
    }

    async fn call(&self, req: S3Request<Body>) -> S3Result<S3Response<Body>> {
        auth::routed();
        if LeaseService::handles(req.uri.path()) {
            let issuer = req.credentials.as_ref().is_some_and(|c| self.issuers.is_issuer(&c.access_key));
            let presigned = req.uri.query().is_some_and(|q| matches!(wire::Presign::of(q), Ok(Some(_)) | Err(_)));
            // The body names the token or the holder: it must be signed too (its SHA-256 in
            // `x-amz-content-sha256`, which the signature covers and the library checks the
            // body against), or whoever sees the request could resend it with another body.
            let body_signed = req
                .headers
                .get("x-amz-content-sha256")
                .is_some_and(|v| v.len() == 64 && v.as_bytes().iter().all(u8::is_ascii_hexdigit));
            let access_key = req.credentials.as_ref().map(|c| c.access_key.clone()).unwrap_or_default();
            let scope = self
                .front
                .scopes
                .get(&access_key)
                .map(|s| crate::lease::FenceScope { entries: s.0.clone(), rules: self.front.wire.rules.clone() });
            let caller = crate::lease::Caller { access_key, issuer, scope, signed: body_signed && !presigned };
            return Ok(self.leases.handle(&req.method, req.uri.path(), req.input, caller).await);
        }
        let lease = match req.credentials.as_ref() {
            Some(c) if c.access_key.starts_with(ACCESS_KEY_PREFIX) => {
                // Verified with the secret derived from these claims: they are the signer's.
                match auth::lease_claims() {
                    Some(claims) => Some(claims),
                    None => return Err(s3s::s3_error!(AccessDenied, "a lease credential without its claims")),
                }
            }
            _ => None,
        };
        self.front.clone().handle(req, lease).await
    }
}

/// The S3 front's state.
pub struct Front {
    gate: Arc<Gate>,
    upstream: Arc<dyn Upstream>,
    wire: WireContract,
    require_token: bool,
    domain: Option<String>,
    body_bytes_max: u64,
    retry_body_bytes_max: usize,
    /// Bounds a read, and the whole of an admitted write (`upstream.request_timeout_ms`).
    request_timeout: Duration,
    /// How long a write whose outcome is unknown stays in flight (`fencing.inflight_deadline_ms`).
    unknown_outcome_hold: Duration,
    etags: EtagCache,
    request_ids: RequestIds,
    /// CopyObject as a read of the source and a conditional PUT (see [`service`]).
    copy_by_read_and_put: bool,
    /// Whether a write may raise a fence (`fencing.advance`).
    writes_advance: bool,
    /// `fencing.show_stamp`.
    show_stamp: bool,
    /// Whether the upstream refuses a multipart upload id under another key (the probe); if
    /// not, fencegate checks the pair before each multipart step.
    upload_ids_tied_to_keys: bool,
    /// Access keys restricted to some buckets or prefixes (`[[credentials]] buckets`).
    scopes: std::collections::HashMap<String, Scopes>,
}

/// What the handler knows of a request after classification.
struct Request {
    method: Method,
    target: Target,
    /// The query as forwarded (presign parameters removed), with its `?`, or empty.
    query: String,
    headers: HeaderMap,
    body: Body,
    trailers: Option<s3s::TrailingHeaders>,
    content_length: Option<u64>,
}

impl Request {
    fn path_and_query(&self) -> String {
        format!("{}{}", self.target.raw_path, self.query)
    }
}

/// A write that the gate admitted.
#[derive(Clone)]
struct Admitted {
    token: FenceToken,
    resource: ResourceKey,
    permit: Arc<Permit>,
    /// The whole write's deadline: every upstream call of it ends by then (`fence::outcome`).
    deadline: tokio::time::Instant,
}

/// The body of one upstream call of an admitted write.
enum WriteBody {
    /// A [`ForwardBody`]: it marks the write sent when its last chunk goes.
    Streamed(Body),
    /// Already in memory: the write counts as sent before the call starts.
    InMemory(Body),
}

impl Front {
    fn new(config: &Config, gate: Arc<Gate>, upstream: Arc<dyn Upstream>) -> anyhow::Result<Self> {
        let wire = WireContract {
            token_header: HeaderName::from_bytes(config.fencing.token_header.as_bytes())?,
            resource_header: HeaderName::from_bytes(config.fencing.resource_header.as_bytes())?,
            rules: config.fencing.rules.clone(),
        };
        Ok(Self {
            gate,
            upstream,
            wire,
            require_token: config.fencing.require_token,
            domain: config.server.domain.clone(),
            body_bytes_max: config.server.body_bytes_max,
            retry_body_bytes_max: config.fencing.retry_body_bytes_max,
            request_timeout: crate::config::ms(config.upstream.request_timeout_ms),
            unknown_outcome_hold: crate::config::ms(config.fencing.inflight_deadline_ms),
            etags: EtagCache::new(config.fencing.etag_cache_entries_max),
            request_ids: RequestIds::new(),
            copy_by_read_and_put: false,
            upload_ids_tied_to_keys: false,
            show_stamp: config.fencing.show_stamp,
            writes_advance: config.fencing.advance.writes_advance(),
            scopes: config
                .credentials
                .iter()
                .filter(|c| !c.buckets.is_empty())
                .map(|c| (c.access_key_id.clone(), Scopes::new(&c.buckets)))
                .collect(),
        })
    }

    async fn handle(self: Arc<Self>, req: S3Request<Body>, lease: Option<Claims>) -> S3Result<S3Response<Body>> {
        let request_id = self.request_ids.next();
        let span = tracing::info_span!(
            "s3",
            request_id = %request_id,
            method = %req.method,
            op = field::Empty,
            resource = field::Empty,
            token = field::Empty,
            fence = field::Empty,
            decision = field::Empty,
            error = field::Empty,
            upstream_status = field::Empty,
            duration_ms = field::Empty,
        );
        let started = Instant::now();
        // A field recorded twice shows twice: the decision is recorded once, at admission or
        // at the refusal, and what failed after admission goes to `error`.
        let mut decided = false;
        let result = self.route(req, lease, &mut decided).instrument(span.clone()).await;
        span.record("duration_ms", started.elapsed().as_secs_f64() * 1000.0);
        match result {
            Ok(resp) => {
                span.record("upstream_status", resp.status.map_or(0, |s| s.as_u16()));
                span.in_scope(|| tracing::debug!("done"));
                Ok(resp)
            }
            Err(error) => {
                let decision = error.decision();
                if decision != "error" {
                    metrics::decision(decision);
                }
                if !decided {
                    span.record("decision", decision);
                }
                span.record("error", error.code());
                if let FrontError::Stale { current, .. } | FrontError::StaleWhileStreaming { current, .. } = &error {
                    span.record("fence", current.0);
                }
                span.in_scope(|| tracing::info!(%error, "refused"));
                // Rendered here rather than returned as an error, which s3s would log again.
                Ok(client_response(error.into_response(&request_id)))
            }
        }
    }

    /// `decided`: set once the span's `decision` is recorded (admitted or unchecked).
    ///
    /// Everything up to admission runs on the client's connection: a client that goes away
    /// then ends it, and nothing was admitted. Admission and the write after it run detached
    /// (`fence::outcome::detached`): a client that disconnects does not end a write the
    /// upstream may still commit.
    async fn route(
        self: Arc<Self>,
        req: S3Request<Body>,
        lease: Option<Claims>,
        decided: &mut bool,
    ) -> Result<S3Response<Body>, FrontError> {
        if !S3_METHODS.contains(&req.method) {
            // A method S3 does not know (`put`, `Put`, `PATCH`...) is refused, never forwarded
            // unfenced: an upstream may treat `put` as PUT.
            return Err(FrontError::MethodNotAllowed(req.method.to_string()));
        }
        self.wire.check_presigned(req.uri.query(), &req.headers)?;
        let target = target(&req.uri, &req.headers, self.domain.as_deref())?;
        if let Some(key) = target.key.as_deref() {
            self.check_key(target.bucket.as_deref().unwrap_or(""), key)?;
        }
        check_headers(&req.headers)?;
        // A lease credential may do what its issuer may, within its lease.
        let signer = match &lease {
            Some(claims) => Some(claims.parent.as_str()),
            None => req.credentials.as_ref().map(|c| c.access_key.as_str()),
        };
        if let Some(scopes) = signer.and_then(|key| self.scopes.get(key)) {
            scopes.check(&req.method, &target, req.uri.query(), &req.headers)?;
        }
        let op = classify(&req.method, &target, req.uri.query(), &req.headers);
        tracing::Span::current().record("op", op.name());
        let lease = match &lease {
            Some(claims) => Some(self.lease_standing(claims, &req.method, op, &target, &req.headers).await?),
            None => None,
        };
        let content_length = content_length(&req.headers);
        if let Some(bytes) = content_length
            && bytes > self.body_bytes_max
        {
            return Err(FrontError::TooLarge { bytes, max: self.body_bytes_max });
        }
        let request = Request {
            method: req.method,
            query: forwarded_query(req.uri.query()),
            target,
            headers: req.headers,
            body: req.input,
            trailers: req.trailing_headers,
            content_length,
        };
        if !op.is_fenced_write() {
            return self.pass_through(request).await;
        }
        let presented = match &lease {
            Some(lease) => Some(lease.token),
            None => self.wire.token(&request.headers)?,
        };
        let Some(token) = presented else {
            if self.require_token {
                return Err(FrontError::MissingToken);
            }
            metrics::decision("unchecked");
            tracing::Span::current().record("decision", "unchecked");
            *decided = true;
            return self.pass_through(request).await;
        };
        if op == Op::DeleteObjects {
            let front = Arc::clone(&self);
            let resource = lease.map(|l| l.resource);
            let deletes = async move { front.delete_objects(request, token, resource).await };
            return detached(deletes.instrument(tracing::Span::current())).await;
        }
        // A fenced multipart step: its upload must be the key's (an unchecked one, without a
        // token, is fenced on nothing and passes as it is).
        if matches!(op, Op::UploadPart | Op::UploadPartCopy | Op::CompleteMultipartUpload | Op::AbortMultipartUpload)
            && !self.upload_ids_tied_to_keys
        {
            self.check_upload_key(&request.target, Some(request.query.trim_start_matches('?'))).await?;
        }
        if op == Op::PostObject {
            return Err(FrontError::NotSupported("POST Object (a browser form upload)"));
        }
        let (Some(bucket), Some(key)) = (&request.target.bucket, &request.target.key) else {
            return Err(FrontError::NotSupported("a write without an object key"));
        };
        let resource = self.wire.resource(&request.headers, bucket, key)?;
        let mut request = request;
        if op == Op::CompleteMultipartUpload {
            // A stale completion is refused before its body is read.
            if let Some(current) = self.gate.fence(&resource).await.map_err(FrontError::StoreUnavailable)?
                && token < current
            {
                return Err(FrontError::Stale { presented: token, current });
            }
            // The parts list is read before admission: a client that sends it slowly must not
            // hold a write that is past cancelling (its body is complete once read).
            let parts = http_body_util::Limited::new(std::mem::take(&mut request.body), COMPLETE_REQUEST_BYTES_MAX)
                .collect()
                .await
                .map_err(|_| FrontError::IncompleteBody)?
                .to_bytes();
            request.body = Body::from(parts);
        }
        let span = tracing::Span::current();
        span.record("resource", resource.as_str());
        span.record("token", token.0);
        if op == Op::CopyObject && copies_onto_itself_unchanged(&request.target, &request.headers) {
            // fencegate's stamp would make it a change; S3 refuses it, and so does fencegate.
            return Err(FrontError::SelfCopyUnchanged);
        }
        // A token below the fence this replica knows is refused here, without a task.
        self.gate.refuse_known_stale(&resource, token)?;
        let front = Arc::clone(&self);
        let write = async move {
            let mut admitted_now = false;
            let result = front.admit_and_write(op, request, resource, token, &mut admitted_now).await;
            (result, admitted_now)
        };
        let (result, admitted_now) = detached(write.instrument(span)).await;
        *decided |= admitted_now;
        result
    }

    /// Admission and the write it admits (detached: see [`Front::route`]). `admitted` is set
    /// once the span's `decision` is recorded.
    async fn admit_and_write(
        &self,
        op: Op,
        request: Request,
        resource: ResourceKey,
        token: FenceToken,
        admitted: &mut bool,
    ) -> Result<S3Response<Body>, FrontError> {
        let permit = Arc::new(self.gate.admit_write(&resource, token, self.writes_advance).await?);
        metrics::decision("accepted");
        tracing::Span::current().record("decision", "accepted");
        *admitted = true;
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        let admitted = Admitted { token, resource, permit, deadline };
        match op {
            Op::PutObject => self.put_object(request, admitted).await,
            Op::CopyObject => self.copy_object(request, admitted).await,
            Op::DeleteObject => self.delete_object(request, admitted).await,
            Op::CompleteMultipartUpload => self.complete_multipart(request, admitted).await,
            Op::CreateMultipartUpload => {
                let mut request = request;
                stamp(&mut request.headers, token);
                self.forward_admitted(request, admitted).await
            }
            Op::ObjectSubresourceWrite => {
                // Tagging, ACL, retention, legal hold change the object: refused by a newer
                // stamp like any other write (G4).
                let object =
                    request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
                self.object_state(&request.target, &object, true, &admitted).await?;
                self.forward_admitted(request, admitted).await
            }
            _ => self.forward_admitted(request, admitted).await,
        }
    }

    /// Reads, listings, bucket operations, and unchecked writes: forwarded as they are.
    async fn pass_through(&self, request: Request) -> Result<S3Response<Body>, FrontError> {
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.wire);
        let reads_object = matches!(request.method, Method::GET | Method::HEAD);
        let mut resp = self.send("pass_through", request.method, &path, headers, request.body).await?;
        if reads_object && !self.show_stamp {
            resp.headers_mut().remove(METADATA_TOKEN_HEADER);
        }
        Ok(client_response(resp))
    }

    /// One upstream call of an admitted write, bounded by the write's deadline and never
    /// abandoned once its request may have reached the upstream (`fence::outcome`).
    async fn send_write(
        &self,
        op: &'static str,
        admitted: &Admitted,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: WriteBody,
    ) -> Result<http::Response<Body>, FrontError> {
        let body = match body {
            WriteBody::Streamed(body) => body,
            WriteBody::InMemory(body) => {
                if !admitted.permit.mark_body_sent() {
                    return Err(self.cut_off_error(admitted).await);
                }
                body
            }
        };
        let req = upstream_request(method, path_and_query, headers, body)?;
        let upstream = self.upstream.clone();
        let started = Instant::now();
        let call = async move { upstream.send(req).await };
        let permits = std::slice::from_ref(&admitted.permit);
        match bounded_call(permits, admitted.deadline, self.unknown_outcome_hold, call).await {
            Bounded::Done(result) => {
                let status = result.as_ref().ok().map(|r| r.status().as_u16());
                metrics::upstream_call(op, started.elapsed(), status);
                if let Some(status) = status {
                    tracing::Span::current().record("upstream_status", status);
                }
                result.map_err(FrontError::Upstream)
            }
            Bounded::CutOff => Err(self.cut_off_error(admitted).await),
            Bounded::Unknown => Err(FrontError::OutcomeUnknown { after_ms: millis(self.request_timeout) }),
        }
    }

    /// The answer for a write that was cut off before its whole body reached the upstream.
    async fn cut_off_error(&self, admitted: &Admitted) -> FrontError {
        match admitted.permit.cut_off() {
            Some(CutOff::Deadline) => FrontError::WriteDeadline { after_ms: millis(self.request_timeout) },
            Some(CutOff::Revoked) => FrontError::RegistrationLost,
            // Not cancelled, yet not sent: a further call past the write's deadline.
            None if tokio::time::Instant::now() >= admitted.deadline => {
                FrontError::WriteDeadline { after_ms: millis(self.request_timeout) }
            }
            Some(CutOff::Superseded) | None => {
                let current = self.gate.fence(&admitted.resource).await.ok().flatten().unwrap_or(admitted.token);
                FrontError::StaleWhileStreaming { presented: admitted.token, current }
            }
        }
    }

    /// A fenced write without a store-side precondition (multipart steps, sub-resources): the
    /// gate orders it, and its body is cancellable like any other.
    async fn forward_admitted(&self, request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.wire);
        let check = trailer_check(&request);
        let (body, report) = ForwardBody::new(request.body, Some(admitted.permit.clone()), check, 0);
        let body = WriteBody::Streamed(Body::http_body(body));
        let result = self.send_write("fenced_write", &admitted, request.method, &path, headers, body).await;
        let resp = self.settle_body(result, &report, &admitted).await?;
        Ok(client_response(resp))
    }

    /// PutObject: stamped, conditional on the object's last known state, retried once from the
    /// retained body when a same-token writer changed the object meanwhile.
    async fn put_object(&self, mut request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let object = request.target.object_name().expect("object write");
        let retainable = request.content_length.is_some_and(|n| n <= self.retry_body_bytes_max as u64);
        let condition = ClientCondition::of(&request.headers);
        let state = self.object_state(&request.target, &object, retainable, &admitted).await?;
        let state = self.client_condition(&condition, &request.target, &object, state, &admitted).await?;
        let path = request.path_and_query();
        stamp(&mut request.headers, admitted.token);
        let mut headers = upstream_headers(&request.headers, &self.wire);
        set_precondition(&mut headers, &state);

        let check = trailer_check(&request);
        let retain = if retainable { self.retry_body_bytes_max } else { 0 };
        let (body, report) = ForwardBody::new(request.body, Some(admitted.permit.clone()), check, retain);
        let body = WriteBody::Streamed(Body::http_body(body));
        let result = self.send_write("put_object", &admitted, Method::PUT, &path, headers.clone(), body).await;
        let resp = self.settle_body(result, &report, &admitted).await?;
        if resp.status().is_success() {
            self.remember_write(object, resp.headers(), admitted.token);
            return Ok(client_response(resp));
        }
        if !lost_precondition(resp.status(), &state) {
            return Ok(client_response(resp));
        }
        let fresh = self.reread_after_conflict(&request.target, &object, &admitted).await?;
        refuse_client_condition(&condition, &fresh)?;
        if fresh.same_version(&state) {
            // fencegate's precondition named the object as it still is: the refusal was about
            // something else (a missing source or upload, the client's own condition), and
            // the upstream's answer is the client's.
            return Ok(client_response(resp));
        }
        let Some(chunks) = report.retained() else {
            metrics::precondition_conflict("gave_up");
            return Err(FrontError::PreconditionRace);
        };
        set_precondition(&mut headers, &fresh);
        let body = Body::http_body(http_body_util::StreamBody::new(futures_util::stream::iter(
            chunks.into_iter().map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(c))),
        )));
        let resp =
            self.send_write("put_object", &admitted, Method::PUT, &path, headers, WriteBody::InMemory(body)).await?;
        self.finish_retry(object, resp, admitted.token, &fresh)
    }

    /// CopyObject: the destination is stamped and conditional. With the `COPY` metadata
    /// directive the source's metadata is read and re-sent with `REPLACE`, so the stamp can be
    /// added without losing the rest.
    async fn copy_object(&self, mut request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        if self.copy_by_read_and_put {
            return self.copy_by_read_and_put(request, admitted).await;
        }
        let object = request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
        let condition = ClientCondition::of(&request.headers);
        let state = self.object_state(&request.target, &object, true, &admitted).await?;
        let state = self.client_condition(&condition, &request.target, &object, state, &admitted).await?;
        let replaces = request
            .headers
            .get("x-amz-metadata-directive")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"REPLACE"));
        if !replaces {
            self.copy_source_metadata(&mut request.headers).await?;
        }
        stamp(&mut request.headers, admitted.token);
        let path = request.path_and_query();
        let mut headers = upstream_headers(&request.headers, &self.wire);
        set_precondition(&mut headers, &state);
        let empty = || WriteBody::InMemory(Body::empty());
        let resp = self.send_write("copy_object", &admitted, Method::PUT, &path, headers.clone(), empty()).await?;
        let (resp, committed) = self.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
        if committed {
            self.remember_write(object, resp.headers(), admitted.token);
            return Ok(client_response(resp));
        }
        if !lost_precondition(resp.status(), &state) {
            return Ok(client_response(resp));
        }
        let fresh = self.reread_after_conflict(&request.target, &object, &admitted).await?;
        refuse_client_condition(&condition, &fresh)?;
        if fresh.same_version(&state) {
            // fencegate's precondition named the object as it still is: the refusal was about
            // something else (a missing source or upload, the client's own condition), and
            // the upstream's answer is the client's.
            return Ok(client_response(resp));
        }
        set_precondition(&mut headers, &fresh);
        let resp = self.send_write("copy_object", &admitted, Method::PUT, &path, headers, empty()).await?;
        let (resp, _) = self.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
        self.finish_retry(object, resp, admitted.token, &fresh)
    }

    /// CopyObject as a read of the source and a stamped, conditional PUT of its bytes to the
    /// destination (streamed through fencegate, cancellable like any upload), for an upstream
    /// that ignores `If-Match` on copies: the write is then refused per object when it lands
    /// late, like any PutObject (G4). The client's copy-source conditions become the read's
    /// conditions; the answer is S3's `CopyObjectResult`.
    async fn copy_by_read_and_put(&self, request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let object = request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
        let source = request
            .headers
            .get("x-amz-copy-source")
            .and_then(|v| v.to_str().ok())
            .ok_or(FrontError::NotSupported("CopyObject without x-amz-copy-source"))?;
        let source_path = format!("/{}", source.trim_start_matches('/'));
        let replaces = request
            .headers
            .get("x-amz-metadata-directive")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"REPLACE"));
        let condition = ClientCondition::of(&request.headers);
        let state = self.object_state(&request.target, &object, true, &admitted).await?;
        let mut state = self.client_condition(&condition, &request.target, &object, state, &admitted).await?;
        for attempt in 0..2 {
            let mut read_headers = HeaderMap::new();
            for (from, to) in COPY_SOURCE_CONDITIONS {
                if let Some(value) = request.headers.get(*from) {
                    read_headers.insert(to.clone(), value.clone());
                }
            }
            let source = self.send("copy_source_read", Method::GET, &source_path, read_headers, Body::empty()).await?;
            match source.status() {
                StatusCode::PRECONDITION_FAILED | StatusCode::NOT_MODIFIED => {
                    return Err(FrontError::CopySourceCondition);
                }
                status if !status.is_success() => return Ok(client_response(source)),
                _ => {}
            }
            let (source, body) = source.into_parts();
            let mut headers = request.headers.clone();
            for name in ["x-amz-copy-source", "x-amz-metadata-directive", "x-amz-tagging-directive"] {
                headers.remove(name);
            }
            let conditions: Vec<HeaderName> =
                headers.keys().filter(|name| name.as_str().starts_with("x-amz-copy-source-")).cloned().collect();
            for name in conditions {
                headers.remove(name);
            }
            if !replaces {
                copy_metadata(&source.headers, &mut headers);
            }
            match source.headers.get(http::header::CONTENT_LENGTH) {
                Some(length) => headers.insert(http::header::CONTENT_LENGTH, length.clone()),
                None => {
                    return Err(FrontError::UpstreamStatus {
                        step: "the copy source read (no length)",
                        status: source.status,
                    });
                }
            };
            stamp(&mut headers, admitted.token);
            let mut headers = upstream_headers(&headers, &self.wire);
            set_precondition(&mut headers, &state);
            let (body, report) = ForwardBody::new(body, Some(admitted.permit.clone()), None, 0);
            let body = WriteBody::Streamed(Body::http_body(body));
            let path = request.target.raw_path.clone();
            let result = self.send_write("copy_object", &admitted, Method::PUT, &path, headers, body).await;
            let resp = self.settle_body(result, &report, &admitted).await?;
            if resp.status().is_success() {
                if attempt > 0 {
                    metrics::precondition_conflict("retried");
                }
                let etag = resp.headers().get(http::header::ETAG).cloned();
                self.remember_write(object, resp.headers(), admitted.token);
                return Ok(copy_result(etag));
            }
            if !lost_precondition(resp.status(), &state) {
                return Ok(client_response(resp));
            }
            let fresh = self.reread_after_conflict(&request.target, &object, &admitted).await?;
            refuse_client_condition(&condition, &fresh)?;
            if fresh.same_version(&state) {
                // fencegate's precondition named the object as it still is: the refusal was about
                // something else (a missing source or upload, the client's own condition), and
                // the upstream's answer is the client's.
                return Ok(client_response(resp));
            }
            state = fresh;
        }
        metrics::precondition_conflict("gave_up");
        Err(FrontError::PreconditionRace)
    }

    /// DeleteObject: conditional on the ETag of the version the token may delete. A DELETE of
    /// an object that is not there is answered 204 (as S3 does) without forwarding it: sent
    /// without a precondition, it could land after a newer token's write and delete it.
    async fn delete_object(&self, request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let object = request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
        let versioned = classify::query_has(Some(request.query.trim_start_matches('?')), "versionId");
        let path = request.path_and_query();
        let mut headers = upstream_headers(&request.headers, &self.wire);
        // A cached `Absent` is not trusted here: another writer may have created the object.
        let condition = ClientCondition::of(&request.headers);
        let state = match self.etags.get(&object) {
            Some(cached @ ObjectState::Present { .. }) => cached,
            _ => self.head(&request.target).await?,
        };
        self.refuse_newer_stamp(&object, &state, &admitted)?;
        let mut state = self.client_condition(&condition, &request.target, &object, state, &admitted).await?;
        for attempt in 0..2 {
            let ObjectState::Present { .. } = &state else {
                if versioned {
                    // A version id names its own object version; the upstream decides.
                    headers.remove(http::header::IF_MATCH);
                    headers.remove(http::header::IF_NONE_MATCH);
                    let resp =
                        self.send_write("delete_object", &admitted, Method::DELETE, &path, headers, empty()).await?;
                    return Ok(client_response(resp));
                }
                // A missing bucket is the upstream's 404 too: S3 answers NoSuchBucket for it.
                if let Some(missing) = self.missing_bucket(&request.target).await? {
                    return Ok(client_response(missing));
                }
                self.etags.put(object, ObjectState::Absent);
                return Ok(no_content());
            };
            set_precondition(&mut headers, &state);
            let resp =
                self.send_write("delete_object", &admitted, Method::DELETE, &path, headers.clone(), empty()).await?;
            if resp.status().is_success() {
                if attempt > 0 {
                    metrics::precondition_conflict("retried");
                }
                self.etags.put(object, ObjectState::Absent);
                return Ok(client_response(resp));
            }
            if !lost_precondition(resp.status(), &state) {
                return Ok(client_response(resp));
            }
            let fresh = self.reread_after_conflict(&request.target, &object, &admitted).await?;
            refuse_client_condition(&condition, &fresh)?;
            if fresh.same_version(&state) {
                // fencegate's precondition named the object as it still is: the refusal was about
                // something else (a missing source or upload, the client's own condition), and
                // the upstream's answer is the client's.
                return Ok(client_response(resp));
            }
            state = fresh;
        }
        metrics::precondition_conflict("gave_up");
        Err(FrontError::PreconditionRace)
    }

    /// CompleteMultipartUpload, the commit point of a multipart upload: the gate checked the
    /// token again, and the completion is conditional on the object's last known state. Its
    /// parts list was read before admission.
    async fn complete_multipart(&self, request: Request, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        let object = request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
        let condition = ClientCondition::of(&request.headers);
        let state = self.object_state(&request.target, &object, true, &admitted).await?;
        let state = self.client_condition(&condition, &request.target, &object, state, &admitted).await?;
        let path = request.path_and_query();
        let parts = request.body.bytes().unwrap_or_default();
        let mut headers = upstream_headers(&request.headers, &self.wire);
        set_precondition(&mut headers, &state);
        let body = WriteBody::InMemory(Body::from(parts.clone()));
        let resp = self.send_write("complete_multipart", &admitted, Method::POST, &path, headers.clone(), body).await?;
        let (resp, committed) = self.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
        if committed {
            self.remember_completion(object, &resp).await;
            return Ok(client_response(resp));
        }
        if !lost_precondition(resp.status(), &state) {
            return Ok(client_response(resp));
        }
        let fresh = self.reread_after_conflict(&request.target, &object, &admitted).await?;
        refuse_client_condition(&condition, &fresh)?;
        if fresh.same_version(&state) {
            // fencegate's precondition named the object as it still is: the refusal was about
            // something else (a missing source or upload, the client's own condition), and
            // the upstream's answer is the client's.
            return Ok(client_response(resp));
        }
        set_precondition(&mut headers, &fresh);
        let body = WriteBody::InMemory(Body::from(parts));
        let resp = self.send_write("complete_multipart", &admitted, Method::POST, &path, headers, body).await?;
        let (resp, committed) = self.read_write_xml(resp, std::slice::from_ref(&admitted.permit)).await?;
        if committed {
            metrics::precondition_conflict("retried");
            self.remember_completion(object, &resp).await;
            return Ok(client_response(resp));
        }
        if lost_precondition(resp.status(), &fresh) {
            metrics::precondition_conflict("gave_up");
            return Err(FrontError::PreconditionRace);
        }
        Ok(client_response(resp))
    }

    /// The ETag of a completed upload is in its XML body, not in a header. Its stamp is the one
    /// CreateMultipartUpload set (the creator's token), which the completion does not name, so
    /// the cache records none rather than the completer's.
    async fn remember_completion(&self, object: String, resp: &http::Response<Body>) {
        let etag = resp
            .body()
            .bytes()
            .and_then(|xml| xml_element(&xml, "ETag"))
            .and_then(|e| HeaderValue::from_str(&e.replace("&quot;", "\"")).ok());
        match etag {
            Some(etag) => self.etags.put(object, ObjectState::Present { etag, stamp: None }),
            None => self.etags.forget(&object),
        }
    }

    /// DeleteObjects: each key against its own resource; stale keys become per-key errors.
    /// `lease`: signed with a lease credential, whose resource every key must belong to.
    async fn delete_objects(
        &self,
        request: Request,
        token: FenceToken,
        lease: Option<ResourceKey>,
    ) -> Result<S3Response<Body>, FrontError> {
        let bucket = request.target.bucket.clone().ok_or(FrontError::NotSupported("DeleteObjects without a bucket"))?;
        let path = request.path_and_query();
        let parsed = delete_objects::read(request.body).await?;
        let mut by_resource: std::collections::BTreeMap<ResourceKey, Vec<delete_objects::ObjectId>> =
            Default::default();
        let mut refused = Vec::new();
        for object in parsed.objects {
            if let Err(error) = self.check_key(&bucket, &object.key) {
                refused.push(delete_objects::error_entry(&object, error.code(), &error.to_string()));
                continue;
            }
            if let Some(lease) = &lease
                && let Err(error) = self.within_lease(lease, &bucket, &object.key)
            {
                refused.push(delete_objects::error_entry(&object, error.code(), &error.to_string()));
                continue;
            }
            match self.wire.resource(&request.headers, &bucket, &object.key) {
                Ok(resource) => by_resource.entry(resource).or_default().push(object),
                Err(error) => refused.push(delete_objects::error_entry(&object, error.code(), &error.to_string())),
            }
        }
        let mut permits = Vec::with_capacity(by_resource.len());
        let mut checked = Vec::new();
        for (resource, objects) in by_resource {
            match self.gate.admit_write(&resource, token, self.writes_advance).await {
                Ok(permit) => {
                    metrics::decision("accepted");
                    let permit = Arc::new(permit);
                    let deadline = tokio::time::Instant::now() + self.request_timeout;
                    let admitted = Admitted { token, resource: resource.clone(), permit: permit.clone(), deadline };
                    checked.extend(objects.into_iter().map(|object| (admitted.clone(), object)));
                    permits.push((resource, permit));
                }
                Err(refusal @ (AdmitError::Stale { .. } | AdmitError::Unregistered { .. })) => {
                    let error = FrontError::from(refusal);
                    metrics::decision(error.decision());
                    for object in &objects {
                        refused.push(delete_objects::error_entry(object, error.code(), &error.to_string()));
                    }
                }
                Err(other) => return Err(other.into()),
            }
        }
        // Each key against its stamp, as any other object write (G4): a key stamped with a newer
        // token is refused on its own.
        let mut admitted = Vec::with_capacity(checked.len());
        let stamps = futures_util::stream::iter(checked.into_iter().map(|(write, object)| {
            let bucket = &bucket;
            async move {
                let target = Target {
                    raw_path: format!("/{bucket}/{}", crate::percent::encode_key(&object.key)),
                    bucket: Some(bucket.clone()),
                    key: Some(object.key.clone()),
                };
                let name = format!("{bucket}/{}", object.key);
                let mut checked = self.object_state(&target, &name, true, &write).await;
                if let (Ok(state), Some(etag)) = (&checked, &object.etag) {
                    // The client's condition on this key, judged as on a single delete.
                    let mut headers = HeaderMap::new();
                    if let Ok(value) = HeaderValue::from_str(etag) {
                        headers.insert(http::header::IF_MATCH, value);
                    }
                    let condition = ClientCondition::of(&headers);
                    checked = self.client_condition(&condition, &target, &name, state.clone(), &write).await;
                }
                (object, checked)
            }
        }))
        .buffer_unordered(STAMP_CHECKS_CONCURRENT)
        .collect::<Vec<_>>()
        .await;
        for (object, checked) in stamps {
            match checked {
                Ok(_) => admitted.push(object),
                Err(error) => {
                    // Stale, or its head could not be read: that key alone is refused.
                    if matches!(error, FrontError::Stale { .. }) {
                        metrics::decision("stale");
                    }
                    refused.push(delete_objects::error_entry(&object, error.code(), &error.to_string()));
                }
            }
        }
        let (status, mut headers, result) = if admitted.is_empty() {
            (StatusCode::OK, HeaderMap::new(), delete_objects::merge(None, &refused)?)
        } else {
            let body = delete_objects::forwarded_body(&admitted, parsed.quiet);
            let mut headers = upstream_headers(&request.headers, &self.wire);
            delete_objects::rewrite_headers(&mut headers, &body);
            let resp = self.send_batch(&permits, &path, headers, Body::from(body)).await?;
            for object in &admitted {
                self.etags.forget(&format!("{bucket}/{}", object.key));
            }
            let (resp, committed) =
                self.read_write_xml(resp, &permits.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>()).await?;
            if !resp.status().is_success() || !committed {
                return Ok(client_response(resp));
            }
            let (parts, body) = resp.into_parts();
            let merged = delete_objects::merge(body.bytes().as_deref(), &refused)?;
            (parts.status, parts.headers, merged)
        };
        drop(permits);
        for name in ["content-length", "content-md5", "etag"] {
            headers.remove(name);
        }
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        let mut resp = S3Response::with_headers(Body::from(result), headers);
        resp.status = Some(status);
        Ok(resp)
    }

    /// Reads the XML answer of a write (CopyObject, CompleteMultipartUpload, DeleteObjects),
    /// whose `<Error>` body can mean no commit: part of the upstream's answer, so a body that
    /// breaks off or does not come within the request timeout leaves the outcome unknown, and
    /// the write stays in flight for the in-flight deadline (`fence::outcome`).
    async fn read_write_xml(
        &self,
        resp: http::Response<Body>,
        permits: &[Arc<Permit>],
    ) -> Result<(http::Response<Body>, bool), FrontError> {
        match tokio::time::timeout(self.request_timeout, read_xml_response(resp)).await {
            Ok(Ok(read)) => Ok(read),
            failed => {
                metrics::ambiguous_outcome("response_body");
                tracing::warn!(
                    "the upstream's answer to a write broke off: outcome unknown, the write stays in flight"
                );
                hold_for(permits.to_vec(), self.unknown_outcome_hold);
                match failed {
                    Ok(Err(error)) => Err(error),
                    _ => Err(FrontError::OutcomeUnknown { after_ms: millis(self.request_timeout) }),
                }
            }
        }
    }

    /// The upstream call of a DeleteObjects: its keys are not conditional, so the permits of
    /// every resource it touches are held until its outcome is known (`fence::outcome`).
    async fn send_batch(
        &self,
        admitted: &[(ResourceKey, Arc<Permit>)],
        path_and_query: &str,
        headers: HeaderMap,
        body: Body,
    ) -> Result<http::Response<Body>, FrontError> {
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        for (resource, permit) in admitted {
            if !permit.mark_body_sent() {
                // Cut off by a newer token (or a lost registration) since admission.
                let admitted =
                    Admitted { token: permit.token(), resource: resource.clone(), permit: permit.clone(), deadline };
                return Err(self.cut_off_error(&admitted).await);
            }
        }
        let permits: Vec<Arc<Permit>> = admitted.iter().map(|(_, p)| p.clone()).collect();
        let req = upstream_request(Method::POST, path_and_query, headers, body)?;
        let upstream = self.upstream.clone();
        let started = Instant::now();
        let call = async move { upstream.send(req).await };
        match bounded_call(&permits, deadline, self.unknown_outcome_hold, call).await {
            Bounded::Done(result) => {
                metrics::upstream_call(
                    "delete_objects",
                    started.elapsed(),
                    result.as_ref().ok().map(|r| r.status().as_u16()),
                );
                result.map_err(FrontError::Upstream)
            }
            Bounded::CutOff | Bounded::Unknown => {
                Err(FrontError::OutcomeUnknown { after_ms: millis(self.request_timeout) })
            }
        }
    }

    /// The object's state for a precondition: from the cache when allowed, else a head read.
    /// An object stamped with a newer token makes the write stale (G4), whatever the store says.
    async fn object_state(
        &self,
        target: &Target,
        object: &str,
        use_cache: bool,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        let cached = if use_cache { self.etags.get(object) } else { None };
        let state = match cached {
            Some(state) => state,
            None => self.head(target).await?,
        };
        self.refuse_newer_stamp(object, &state, admitted)?;
        Ok(state)
    }

    /// An object stamped with a newer token makes the write stale (G4), whatever the store says.
    /// The stamp does not raise the resource's fence: it was written under whatever resource its
    /// writer named (`Fencing-Resource` is the client's word), so it proves nothing about this one.
    fn refuse_newer_stamp(&self, object: &str, state: &ObjectState, admitted: &Admitted) -> Result<(), FrontError> {
        if let Some(newer) = state.newer_stamp(admitted.token) {
            tracing::warn!(object, stamp = newer.0, "object carries a newer token than the fence store knows");
            return Err(FrontError::Stale { presented: admitted.token, current: newer });
        }
        Ok(())
    }

    /// Keys no upstream may see, wherever they are named (the path, a DeleteObjects body): dot
    /// segments always; on the local upstream, which keeps objects as files, an empty segment
    /// (`a//b`, `/a`, `a/b/`), which would be the same file as another key fenced as another
    /// resource.
    fn check_key(&self, bucket: &str, key: &str) -> Result<(), FrontError> {
        if key.split('/').any(|segment| segment == "." || segment == "..") {
            return Err(FrontError::UnsafeKey);
        }
        if self.upstream.kind() == "local" && key.split('/').any(str::is_empty) {
            return Err(FrontError::EmptySegmentOnLocal);
        }
        if self.upstream.kind() == "local" && local_metadata_name_bytes(bucket, key) > LOCAL_FILE_NAME_BYTES_MAX {
            return Err(FrontError::KeyTooLongOnLocal { max: local_key_bytes_max(bucket) });
        }
        Ok(())
    }

    /// The client's own condition (`If-Match` / `If-None-Match`) judged on `state`. A failure on
    /// a cached state is looked at again on a fresh read before it is answered (fencegate's
    /// cache may be behind). Returns the state the write goes ahead on: fencegate's precondition
    /// then names exactly that state, so the upstream enforces both conditions at once.
    async fn client_condition(
        &self,
        condition: &ClientCondition,
        target: &Target,
        object: &str,
        state: ObjectState,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        if condition.is_none() || condition.failure(&state).is_none() {
            return Ok(state);
        }
        self.etags.forget(object);
        let fresh = self.head(target).await?;
        self.refuse_newer_stamp(object, &fresh, admitted)?;
        refuse_client_condition(condition, &fresh)?;
        Ok(fresh)
    }

    /// The upstream's answer if the target's bucket does not exist (a bounded `HEAD /bucket`).
    async fn missing_bucket(&self, target: &Target) -> Result<Option<http::Response<Body>>, FrontError> {
        let Some(bucket) = &target.bucket else { return Ok(None) };
        let path = format!("/{}", crate::percent::encode_key(bucket));
        let resp = self.send("bucket_head", Method::HEAD, &path, HeaderMap::new(), Body::empty()).await?;
        if resp.status() != StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let error = s3s::S3Error::with_message(s3s::S3ErrorCode::NoSuchBucket, "The specified bucket does not exist");
        let resp = error
            .to_http_response()
            .map_err(|_| FrontError::UpstreamStatus { step: "the bucket head read", status: StatusCode::NOT_FOUND })?;
        Ok(Some(resp.map(Body::from)))
    }

    /// The object's head at the upstream, bounded like any read.
    async fn head(&self, target: &Target) -> Result<ObjectState, FrontError> {
        let read = objects::head(self.upstream.as_ref(), &target.raw_path);
        tokio::time::timeout(self.request_timeout, read)
            .await
            .map_err(|_| FrontError::Upstream(UpstreamError::Timeout { after_ms: millis(self.request_timeout) }))?
    }

    /// After the upstream refused a precondition: re-read the object; a newer stamp means the
    /// write is stale, anything else is a same-or-older writer and the write may retry.
    async fn reread_after_conflict(
        &self,
        target: &Target,
        object: &str,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        self.etags.forget(object);
        let fresh = self.head(target).await?;
        if fresh.newer_stamp(admitted.token).is_some() {
            metrics::precondition_conflict("stale");
        }
        self.refuse_newer_stamp(object, &fresh, admitted)?;
        Ok(fresh)
    }

    fn finish_retry(
        &self,
        object: String,
        resp: http::Response<Body>,
        token: FenceToken,
        sent: &ObjectState,
    ) -> Result<S3Response<Body>, FrontError> {
        if resp.status().is_success() {
            metrics::precondition_conflict("retried");
            self.remember_write(object, resp.headers(), token);
            return Ok(client_response(resp));
        }
        if lost_precondition(resp.status(), sent) {
            metrics::precondition_conflict("gave_up");
            return Err(FrontError::PreconditionRace);
        }
        Ok(client_response(resp))
    }

    fn remember_write(&self, object: String, headers: &HeaderMap, token: FenceToken) {
        match headers.get(http::header::ETAG) {
            Some(etag) => self.etags.put(object, ObjectState::Present { etag: etag.clone(), stamp: Some(token) }),
            None => self.etags.forget(&object),
        }
    }

    /// Replaces a COPY directive by REPLACE with the source's own metadata.
    /// (A copy made by [`Self::copy_by_read_and_put`] takes it from its read instead.)
    async fn copy_source_metadata(&self, headers: &mut HeaderMap) -> Result<(), FrontError> {
        let Some(source) = headers.get("x-amz-copy-source").and_then(|v| v.to_str().ok()) else {
            return Ok(());
        };
        let source_path = format!("/{}", source.trim_start_matches('/'));
        let (path, version) = match source_path.split_once("?versionId=") {
            Some((p, v)) => (p.to_owned(), Some(v.to_owned())),
            None => (source_path.clone(), None),
        };
        let uri = match &version {
            Some(v) => format!("{path}?versionId={v}"),
            None => path,
        };
        let req = http::Request::builder()
            .method(Method::HEAD)
            .uri(uri)
            .body(Body::empty())
            .map_err(|_| FrontError::UnsafeKey)?;
        let resp = tokio::time::timeout(self.request_timeout, self.upstream.send(req))
            .await
            .map_err(|_| FrontError::Upstream(UpstreamError::Timeout { after_ms: millis(self.request_timeout) }))?
            .map_err(FrontError::Upstream)?;
        if !resp.status().is_success() {
            return Ok(()); // the copy itself will fail with the upstream's own error
        }
        copy_metadata(resp.headers(), headers);
        headers.insert("x-amz-metadata-directive", HeaderValue::from_static("REPLACE"));
        Ok(())
    }

    /// Maps what happened to a forwarded body onto the write's outcome.
    async fn settle_body(
        &self,
        result: Result<http::Response<Body>, FrontError>,
        report: &BodyReport,
        admitted: &Admitted,
    ) -> Result<http::Response<Body>, FrontError> {
        match report.failure() {
            Some(BodyFailure::Cancelled) => Err(self.cut_off_error(admitted).await),
            Some(BodyFailure::Checksum(algorithm)) => Err(FrontError::BadDigest { algorithm }),
            Some(BodyFailure::Client) => Err(FrontError::IncompleteBody),
            Some(BodyFailure::TooLarge) => {
                Err(FrontError::TooLarge { bytes: self.body_bytes_max.saturating_add(1), max: self.body_bytes_max })
            }
            None => result,
        }
    }

    async fn send(
        &self,
        op: &'static str,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: Body,
    ) -> Result<http::Response<Body>, FrontError> {
        let req = upstream_request(method, path_and_query, headers, body)?;
        let started = Instant::now();
        let result = match tokio::time::timeout(self.request_timeout, self.upstream.send(req)).await {
            Ok(result) => result,
            Err(_) => Err(UpstreamError::Timeout { after_ms: millis(self.request_timeout) }),
        };
        let status = result.as_ref().ok().map(|r| r.status().as_u16());
        metrics::upstream_call(op, started.elapsed(), status);
        if let Some(status) = status {
            tracing::Span::current().record("upstream_status", status);
        }
        result.map_err(FrontError::Upstream)
    }
}

/// A CopyObject of an object onto itself that changes nothing S3 counts (metadata, tags,
/// storage class, website redirect, encryption), from its current version.
fn copies_onto_itself_unchanged(target: &Target, headers: &HeaderMap) -> bool {
    let Some(source) = headers.get("x-amz-copy-source").and_then(|v| v.to_str().ok()) else { return false };
    if source.contains("versionId=") {
        return false;
    }
    let source = source.split('?').next().unwrap_or("");
    let Some(source) = crate::percent::decode(source.trim_start_matches('/')) else { return false };
    let same = target.object_name().is_some_and(|name| name == source);
    let replaces = |name: &str| headers.get(name).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"REPLACE"));
    let changes = replaces("x-amz-metadata-directive")
        || replaces("x-amz-tagging-directive")
        || ["x-amz-storage-class", "x-amz-website-redirect-location", "x-amz-server-side-encryption"]
            .iter()
            .any(|name| headers.contains_key(*name));
    same && !changes
}

/// Headers fencegate cannot pass on as the client meant them, refused before anything is sent:
/// a metadata value that is not US-ASCII (the upstream request is signed anew, and a SigV4
/// signature covers text only; S3 wants such values RFC 2047-encoded), and a copy source with
/// `.` or `..` segments (another object than the one named, once a path is normalised).
fn check_headers(headers: &HeaderMap) -> Result<(), FrontError> {
    for (name, value) in headers {
        if name.as_str().starts_with("x-amz-meta-") && value.to_str().is_err() {
            return Err(FrontError::NonAsciiMetadata(name.as_str().to_owned()));
        }
    }
    if let Some(source) = headers.get("x-amz-copy-source") {
        let source = source.to_str().map_err(|_| FrontError::UnsafeKey)?;
        let path = source.split('?').next().unwrap_or("");
        let decoded = crate::percent::decode(path).ok_or(FrontError::UnsafeKey)?;
        if decoded.split('/').any(|segment| segment == "." || segment == "..") {
            return Err(FrontError::UnsafeKey);
        }
    }
    Ok(())
}

/// The client's conditions on a copy's source, and the read conditions they become.
const COPY_SOURCE_CONDITIONS: &[(&str, HeaderName)] = &[
    ("x-amz-copy-source-if-match", http::header::IF_MATCH),
    ("x-amz-copy-source-if-none-match", http::header::IF_NONE_MATCH),
    ("x-amz-copy-source-if-modified-since", http::header::IF_MODIFIED_SINCE),
    ("x-amz-copy-source-if-unmodified-since", http::header::IF_UNMODIFIED_SINCE),
];

/// The source object's metadata a copy keeps: its user metadata (less the stamp) and the
/// content headers.
fn copy_metadata(source: &HeaderMap, into: &mut HeaderMap) {
    const COPIED: &[HeaderName] = &[
        http::header::CONTENT_TYPE,
        http::header::CONTENT_ENCODING,
        http::header::CONTENT_DISPOSITION,
        http::header::CONTENT_LANGUAGE,
        http::header::CACHE_CONTROL,
        http::header::EXPIRES,
    ];
    for (name, value) in source {
        let user_metadata = name.as_str().starts_with("x-amz-meta-") && name.as_str() != METADATA_TOKEN_HEADER;
        if user_metadata || COPIED.contains(name) {
            into.insert(name.clone(), value.clone());
        }
    }
}

/// S3's answer to a CopyObject: the new ETag and the time of the copy.
fn copy_result(etag: Option<HeaderValue>) -> S3Response<Body> {
    let now = time::OffsetDateTime::now_utc();
    let last_modified = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        now.millisecond()
    );
    let etag = etag.and_then(|e| e.to_str().ok().map(|e| e.replace('"', "&quot;"))).unwrap_or_default();
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CopyObjectResult><LastModified>{last_modified}</LastModified><ETag>{etag}</ETag></CopyObjectResult>"
    );
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    let mut resp = S3Response::with_headers(Body::from(xml), headers);
    resp.status = Some(StatusCode::OK);
    resp
}

fn upstream_request(
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: Body,
) -> Result<http::Request<Body>, FrontError> {
    let mut req =
        http::Request::builder().method(method).uri(path_and_query).body(body).map_err(|_| FrontError::UnsafeKey)?;
    *req.headers_mut() = headers;
    Ok(req)
}

fn empty() -> WriteBody {
    WriteBody::InMemory(Body::empty())
}

/// What S3 answers to a DELETE: 204 with no body.
fn no_content() -> S3Response<Body> {
    let mut resp = S3Response::new(Body::empty());
    resp.status = Some(StatusCode::NO_CONTENT);
    resp
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    let decoded = headers.get("x-amz-decoded-content-length");
    let raw = decoded.or_else(|| headers.get(http::header::CONTENT_LENGTH))?;
    raw.to_str().ok()?.parse().ok()
}

fn trailer_check(request: &Request) -> Option<TrailerCheck> {
    let announced = request.headers.get("x-amz-trailer")?.to_str().ok()?;
    TrailerCheck::new(announced, request.trailers.clone()?)
}

/// The stamp every object write carries (G4).
fn stamp(headers: &mut HeaderMap, token: FenceToken) {
    headers.insert(METADATA_TOKEN_HEADER, HeaderValue::from(token.0));
}

/// Where a restricted credential may go: `(bucket, key prefix)` pairs, an empty prefix for the
/// whole bucket.
struct Scopes(Vec<(String, String)>);

impl Scopes {
    fn new(entries: &[String]) -> Self {
        Self(
            entries
                .iter()
                .map(|e| match e.split_once('/') {
                    Some((bucket, prefix)) => (bucket.to_owned(), prefix.to_owned()),
                    None => (e.clone(), String::new()),
                })
                .collect(),
        )
    }

    fn covers(&self, bucket: &str, key: &str) -> bool {
        self.0.iter().any(|(b, prefix)| b == bucket && key.starts_with(prefix.as_str()))
    }

    /// The object named, a bucket-wide call (allowed on a whole-bucket scope, or a listing
    /// whose `prefix` is inside a scoped prefix), and a copy's source.
    fn check(
        &self,
        method: &Method,
        target: &Target,
        query: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<(), FrontError> {
        let out = |what: String| Err(FrontError::OutOfScope(what));
        let Some(bucket) = &target.bucket else {
            return if *method == Method::GET { Ok(()) } else { out("the service".into()) };
        };
        match &target.key {
            Some(key) if !self.covers(bucket, key) => return out(format!("{bucket}/{key}")),
            Some(_) => {}
            None => {
                let whole = self.0.iter().any(|(b, prefix)| b == bucket && prefix.is_empty());
                let listed_prefix = form_urlencoded::parse(query.unwrap_or("").as_bytes())
                    .find(|(name, _)| name == "prefix")
                    .map(|(_, value)| value.into_owned());
                let listing_inside = *method == Method::GET && listed_prefix.is_some_and(|p| self.covers(bucket, &p));
                if !whole && !listing_inside {
                    return out(format!("bucket {bucket}"));
                }
            }
        }
        if let Some(source) = headers.get("x-amz-copy-source").and_then(|v| v.to_str().ok()) {
            let source = source.split('?').next().unwrap_or("");
            let source = crate::percent::decode(source.trim_start_matches('/')).unwrap_or_default();
            let (b, k) = source.split_once('/').unwrap_or((source.as_str(), ""));
            if !self.covers(b, k) {
                return out(format!("the copy source {source}"));
            }
        }
        Ok(())
    }
}

/// The client's condition failed on a fresh read: answered as S3 would, never retried, never
/// counted as fencegate's own lost race.
fn refuse_client_condition(condition: &ClientCondition, state: &ObjectState) -> Result<(), FrontError> {
    match condition.failure(state) {
        None => Ok(()),
        Some(ConditionFailed::Precondition) => Err(FrontError::ClientPrecondition),
        Some(ConditionFailed::NoSuchKey) => Err(FrontError::ClientNoSuchKey),
    }
}

fn set_precondition(headers: &mut HeaderMap, state: &ObjectState) {
    headers.remove(http::header::IF_MATCH);
    headers.remove(http::header::IF_NONE_MATCH);
    let (name, value) = state.precondition();
    headers.insert(name, value);
}

/// 412, or 409 (S3's `ConditionalRequestConflict` for a concurrent conditional write), or 404
/// to an `If-Match` (S3's answer when the object is gone): the object is not as fencegate last
/// saw it (`sent` is the state the precondition named), so it is read again. A 404 to a write
/// on an object believed absent is the upstream's own answer (no such bucket).
fn lost_precondition(status: StatusCode, sent: &ObjectState) -> bool {
    match status {
        StatusCode::PRECONDITION_FAILED | StatusCode::CONFLICT => true,
        StatusCode::NOT_FOUND => matches!(sent, ObjectState::Present { .. }),
        _ => false,
    }
}

/// The client's headers minus everything about the hop to fencegate.
fn upstream_headers(headers: &HeaderMap, wire: &WireContract) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        let n = name.as_str();
        let hop = REQUEST_HOP_HEADERS.contains(&n) || S3_HOP_HEADERS.contains(&n);
        if hop || *name == wire.token_header || *name == wire.resource_header {
            continue;
        }
        if *name == http::header::CONTENT_ENCODING {
            // aws-chunked is the framing s3s already removed; keep any real encoding.
            let rest: Vec<&str> = value
                .to_str()
                .unwrap_or("")
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("aws-chunked"))
                .collect();
            if !rest.is_empty()
                && let Ok(v) = HeaderValue::from_str(&rest.join(","))
            {
                out.append(name.clone(), v);
            }
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if let Some(decoded) = headers.get("x-amz-decoded-content-length") {
        out.insert(http::header::CONTENT_LENGTH, decoded.clone());
    }
    // The algorithm header goes with a checksum header; a trailing checksum is verified here
    // and not forwarded (the body goes upstream unframed), so its algorithm header goes too.
    if headers.contains_key("x-amz-trailer") {
        out.remove("x-amz-sdk-checksum-algorithm");
    }
    out
}

/// The query to forward: the client's, less fencegate's own presign parameters.
fn forwarded_query(query: Option<&str>) -> String {
    let Some(query) = query.filter(|q| !q.is_empty()) else {
        return String::new();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split('=').next().unwrap_or("");
            !PRESIGN_PARAMS.contains(&name)
        })
        .collect();
    if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) }
}

fn client_response(resp: http::Response<Body>) -> S3Response<Body> {
    let (parts, body) = resp.into_parts();
    let mut headers = parts.headers;
    for name in RESPONSE_HOP_HEADERS {
        headers.remove(*name);
    }
    let mut out = S3Response::with_headers(body, headers);
    out.status = Some(parts.status);
    out
}

/// Reads a small XML response (CopyObject, CompleteMultipartUpload) and says whether it is a
/// real success: S3 can answer 200 with an `<Error>` body.
async fn read_xml_response(resp: http::Response<Body>) -> Result<(http::Response<Body>, bool), FrontError> {
    let (parts, body) = resp.into_parts();
    let limited = http_body_util::Limited::new(body, XML_RESPONSE_BYTES_MAX);
    let bytes: Bytes = limited
        .collect()
        .await
        .map_err(|e| FrontError::Upstream(crate::upstream::UpstreamError::Transport(e)))?
        .to_bytes();
    let committed = parts.status.is_success() && !contains_error_element(&bytes);
    Ok((http::Response::from_parts(parts, Body::from(bytes)), committed))
}

fn contains_error_element(xml: &[u8]) -> bool {
    xml.windows(b"<Error>".len()).any(|w| w == b"<Error>")
}

/// Request ids: unique per process (a random boot prefix and a counter), cheap to make.
struct RequestIds {
    prefix: u32,
    counter: AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        Self { prefix: nanos ^ std::process::id(), counter: AtomicU64::new(1) }
    }

    fn next(&self) -> String {
        format!("{:08X}{:012X}", self.prefix, self.counter.fetch_add(1, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presign_parameters_are_not_forwarded() {
        assert_eq!(forwarded_query(None), "");
        assert_eq!(forwarded_query(Some("X-Amz-Signature=abc&X-Amz-Date=1")), "");
        assert_eq!(forwarded_query(Some("uploadId=7&X-Amz-Signature=abc&partNumber=2")), "?uploadId=7&partNumber=2");
    }

    #[test]
    fn hop_headers_and_fencing_headers_are_not_forwarded() {
        let wire = WireContract {
            token_header: HeaderName::from_static("fencing-token"),
            resource_header: HeaderName::from_static("fencing-resource"),
            rules: vec![],
        };
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "AWS4-HMAC-SHA256 ..."),
            ("fencing-token", "12"),
            ("content-encoding", "aws-chunked,gzip"),
            ("x-amz-decoded-content-length", "5"),
            ("content-length", "90"),
            ("x-amz-meta-a", "b"),
        ] {
            h.insert(k, v.parse().unwrap());
        }
        let out = upstream_headers(&h, &wire);
        assert!(out.get("authorization").is_none() && out.get("fencing-token").is_none());
        assert_eq!(out["content-encoding"], "gzip");
        assert_eq!(out["content-length"], "5");
        assert_eq!(out["x-amz-meta-a"], "b");
    }

    #[test]
    fn error_bodies_in_success_responses_are_seen() {
        assert!(contains_error_element(b"<?xml version=\"1.0\"?><Error><Code>InternalError</Code></Error>"));
        assert!(!contains_error_element(b"<CopyObjectResult><ETag>x</ETag></CopyObjectResult>"));
    }
}
