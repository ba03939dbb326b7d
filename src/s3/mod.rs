//! The S3 front end. s3s verifies the signature (header or presigned, every
//! `x-amz-content-sha256` mode) and decodes `aws-chunked` bodies, or the lean path
//! (`lean.rs`) verifies the common request shapes itself; a catch-all route (`service.rs`) then
//! hands every authenticated request to the front here, which classifies it, fences writes
//! through the gate, and forwards on raw HTTP to the upstream (`forward.rs`).
//!
//! The map: `mod.rs` takes a request from classification to admission; `put.rs`, `copy.rs`,
//! `delete.rs` and `multipart.rs` are the fenced writes, each around the one conditional write
//! of `conditional.rs`; `delete_objects.rs` fences each key of a batch on its own resource and
//! stamp; `uploads.rs` keeps no multipart upload of a superseded token behind; `objects.rs` is what fencegate knows of an object; `checks.rs`, `scopes.rs` and `leased.rs` decide what a request may do; `wire.rs`
//! reads the token and resource; `error.rs` is every refusal, rendered as S3 XML.

mod auth;
mod checks;
mod classify;
mod conditional;
mod copy;
mod delete;
mod delete_objects;
mod error;
mod forward;
mod lean;
mod leased;
mod multipart;
mod objects;
mod put;
pub mod reconcile;
mod scopes;
mod service;
mod signed;
mod uploads;
mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use http_body_util::BodyExt;
use s3s::{Body, S3Request, S3Response, S3Result};
use tracing::{Instrument, field};

pub use self::auth::Service;
pub use self::classify::{Op, Target, classify, target};
pub use self::error::FrontError;
pub use self::service::service;
pub use self::wire::{METADATA_TOKEN_HEADER, WireContract};
pub use crate::refusal::CURRENT_TOKEN_HEADER;

use self::checks::check_headers;
use self::conditional::Cached;
use self::copy::copies_onto_itself_unchanged;
use self::forward::{client_response, forwarded_query, upstream_headers};
use self::multipart::COMPLETE_REQUEST_BYTES_MAX;
use self::objects::EtagCache;
use self::scopes::Scopes;
use self::uploads::upload_of;
use crate::config::Config;
use crate::feed::{Decision, Feed};
use crate::fence::outcome::detached;
use crate::fence::{CallerId, FenceToken, FencedWrite, Gate, ResourceKey};
use crate::lease::credentials::Claims;
use crate::metrics;
use crate::refusal::Refusal;
use crate::upstream::{Enforcement, Upstream};

/// The methods of the S3 API; methods compare case-sensitively, so `put` is not among them.
const S3_METHODS: &[Method] = &[Method::GET, Method::HEAD, Method::PUT, Method::POST, Method::DELETE, Method::OPTIONS];

/// The S3 front's state.
pub struct Front {
    gate: Arc<Gate>,
    /// Where each request's decision is told (`crate::feed`).
    feed: Arc<Feed>,
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
    /// What the upstream judges (the probe): a write whose precondition it ignores starts from
    /// a fresh read of the object, never from the ETag cache, since that read is then the only
    /// check of the object's stamp (G4); an upload id it does not tie to its key is checked
    /// against the key before each multipart step.
    judged: Enforcement,
    /// Access keys restricted to some buckets or prefixes (`[[credentials]] buckets`).
    scopes: std::collections::HashMap<String, Scopes>,
    /// Access keys with `role = "lessee"`: their writes never raise a fence, whatever
    /// `fencing.advance` says (a lease grant moves it by one; a write could move it to 2^64-1).
    lessees: std::collections::HashSet<String>,
    /// The clock leases expire by (the lease service's), for requests signed with a lease
    /// credential.
    clock: Arc<dyn crate::fence::Clock>,
    /// How long after its creation an upload takes parts and its completion: then the sweep
    /// aborts it (`fencing.abort_uploads_after_ms`), with none of them in flight.
    uploads_open_for: Duration,
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
    /// Whether this write may raise its fence: `fencing.advance = "write"`, and signed with
    /// SigV4 (SigV2 signs neither the body nor the token header).
    may_advance: bool,
    /// Who signed it, for its share of a resource's writes in flight.
    caller: Option<CallerId>,
    /// The access key that signed it (the issuer's, for a lease credential), on a multipart
    /// step (recorded as an upload's creator); `None` on any other request.
    signer: Option<String>,
    /// Who its upload record counts against, on a multipart step: the access key that signed
    /// it (a lease credential's own), a presigned URL's holders as one apart from the signer.
    counted_as: Option<String>,
    /// The signer's `[[credentials]] buckets`, when it is restricted: the resources it names
    /// must be inside them.
    scoped: Option<String>,
}

/// What the signer of a request decides about it.
struct Signed {
    may_advance: bool,
    scoped: Option<String>,
    signer: Option<String>,
    /// Signed in its URL: whoever holds the URL sends it, not the signer.
    presigned: bool,
}

impl Request {
    fn path_and_query(&self) -> String {
        [self.target.raw_path.as_str(), self.query.as_str()].concat()
    }
}

/// A write that the gate admitted (`fence::write`).
type Admitted = FencedWrite;

impl Front {
    fn new(config: &Config, gate: Arc<Gate>, upstream: Arc<dyn Upstream>, feed: Arc<Feed>) -> anyhow::Result<Self> {
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
            judged: Enforcement::NONE,
            show_stamp: config.fencing.show_stamp,
            writes_advance: config.fencing.advance.writes_advance(),
            lessees: config
                .credentials
                .iter()
                .filter(|c| c.role == crate::config::Role::Lessee)
                .map(|c| c.access_key_id.clone())
                .collect(),
            scopes: config
                .credentials
                .iter()
                .filter(|c| !c.buckets.is_empty())
                .map(|c| (c.access_key_id.clone(), Scopes::new(&c.buckets)))
                .collect(),
            clock: Arc::new(crate::fence::SystemClock),
            uploads_open_for: crate::config::ms(
                config.fencing.abort_uploads_after_ms.saturating_sub(config.upload_completion_ms()),
            ),
            feed,
        })
    }

    /// A request refused before it reaches the front's route (how it was signed), rendered as
    /// the route renders its refusals.
    fn refuse(&self, error: FrontError) -> S3Response<Body> {
        client_response(self.refuse_http(error))
    }

    fn refuse_http(&self, error: FrontError) -> http::Response<Body> {
        let request_id = self.request_ids.next();
        tracing::info!(request_id = %request_id, code = error.code(), %error, "refused");
        error.into_response(request_id.text().as_str())
    }

    async fn handle(
        self: Arc<Self>,
        req: S3Request<Body>,
        lease: Option<Claims>,
        signature: signed::Signature,
    ) -> S3Result<S3Response<Body>> {
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
        let read = matches!(req.method, Method::GET | Method::HEAD);
        let decision = Decision::new(&self.feed, span.clone());
        // Boxed: the route's state machine is kilobytes, and this future, the library's and
        // hyper's around it would each hold it inline and copy it at every move.
        let result = Box::pin(self.route(req, lease, signature, &decision)).instrument(span.clone()).await;
        span.record("duration_ms", started.elapsed().as_secs_f64() * 1000.0);
        match result {
            Ok(resp) => {
                span.record("upstream_status", resp.status.map_or(0, |s| s.as_u16()));
                span.in_scope(|| tracing::debug!("done"));
                Ok(resp)
            }
            Err(error) => {
                // A read is no write decision: counted apart.
                let lease_read = read && matches!(error, FrontError::LeaseExpired);
                if lease_read {
                    metrics::lease_read_refused();
                }
                span.record("error", error.code());
                decision.refused(error.decision(), error.code(), error.fence(), !lease_read, &error);
                // Rendered here rather than returned as an error, which s3s would log again.
                Ok(client_response(error.into_response(request_id.text().as_str())))
            }
        }
    }

    /// `decision`: the request's, recorded once (`crate::feed`).
    ///
    /// Everything up to admission runs on the client's connection: a client that goes away
    /// then ends it, and nothing was admitted. Admission and the write after it run detached
    /// (`fence::outcome::detached`): a client that disconnects does not end a write the
    /// upstream may still commit.
    async fn route(
        self: Arc<Self>,
        req: S3Request<Body>,
        lease: Option<Claims>,
        signature: signed::Signature,
        decision: &Arc<Decision>,
    ) -> Result<S3Response<Body>, FrontError> {
        if !S3_METHODS.contains(&req.method) {
            // A method S3 does not know (`put`, `Put`, `PATCH`...) is refused, never forwarded
            // unfenced: an upstream may treat `put` as PUT.
            return Err(FrontError::MethodNotAllowed(req.method.to_string()));
        }
        self.wire.check_signed(&signature, &req.headers)?;
        let target = target(&req.uri, &req.headers, self.domain.as_deref())?;
        if let Some(key) = target.key.as_deref() {
            checks::check_key(key)?;
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
        decision.operation(op.name());
        if let Some(credentials) = &req.credentials {
            decision.who(&credentials.access_key);
        }
        if op == Op::AbortMultipartUpload
            && let Some(signer) = signer
            && let Some(resp) =
                self.abort_own_upload(&target, req.uri.query(), lease.as_ref(), signer, &req.headers, decision).await?
        {
            return Ok(resp);
        }
        let lease = match &lease {
            Some(claims) => Some(self.lease_standing(claims, &req.method, op, &target, &req.headers).await?),
            None => None,
        };
        let signed = Signed {
            may_advance: self.writes_advance
                && !signature.is_sigv2()
                && !signer.is_some_and(|key| self.lessees.contains(key)),
            scoped: signer.filter(|key| self.scopes.contains_key(*key)).map(str::to_owned),
            // Kept only where it is recorded: an upload's creator (no allocation per write).
            signer: signer.filter(|_| op.is_multipart_step()).map(str::to_owned),
            presigned: signature.is_presigned(),
        };
        let request = self.request_of(req, target, signed)?;
        if !op.is_fenced_write() {
            return self.pass_through(request).await;
        }
        let presented = match &lease {
            Some(lease) => Some(lease.token),
            None => self.wire.token(&request.headers)?,
        };
        if stamp_in_query_disagrees(&request.query, presented) {
            return Err(FrontError::StampInQuery);
        }
        let Some(token) = presented else {
            if self.require_token {
                return Err(Refusal::MissingToken.into());
            }
            decision.let_through("unchecked");
            return self.pass_through(request).await;
        };
        self.route_write(op, request, token, lease.map(|l| l.resource), decision).await
    }

    /// The request as the front carries it on: its body bounded by `server.body_bytes_max`.
    fn request_of(&self, req: S3Request<Body>, target: Target, signed: Signed) -> Result<Request, FrontError> {
        let content_length = content_length(&req.headers);
        if let Some(bytes) = content_length
            && bytes > self.body_bytes_max
        {
            return Err(FrontError::TooLarge { bytes, max: self.body_bytes_max });
        }
        let body = if announced_exactly(&req.headers) {
            req.input
        } else {
            // A length nobody holds the client to (no `Content-Length`, or a decoded length an
            // aws-chunked body may not keep): the body is cut at the limit as it streams.
            Body::http_body(http_body_util::Limited::new(
                req.input,
                usize::try_from(self.body_bytes_max).unwrap_or(usize::MAX),
            ))
        };
        Ok(Request {
            method: req.method,
            query: forwarded_query(req.uri.query()),
            target,
            headers: req.headers,
            body,
            trailers: req.trailing_headers,
            content_length,
            may_advance: signed.may_advance,
            // A presigned URL's holders count against a share of their own: spending the
            // signer's whole share, they would starve the signing application's own writes.
            caller: req.credentials.as_ref().map(|c| {
                if signed.presigned {
                    CallerId::of(&format!("{}\npresigned", c.access_key))
                } else {
                    CallerId::of(&c.access_key)
                }
            }),
            counted_as: signed.signer.as_ref().and(req.credentials.as_ref()).map(|c| {
                if signed.presigned { format!("{}\npresigned", c.access_key) } else { c.access_key.to_string() }
            }),
            signer: signed.signer,
            scoped: signed.scoped,
        })
    }

    /// A fenced write with its token: checked as far as can be without the gate, then
    /// admitted and written on a task of its own (`detached`). `lease`: the resource of the
    /// lease it was signed under.
    async fn route_write(
        self: Arc<Self>,
        op: Op,
        request: Request,
        token: FenceToken,
        lease: Option<ResourceKey>,
        decision: &Arc<Decision>,
    ) -> Result<S3Response<Body>, FrontError> {
        if op == Op::DeleteObjects {
            let (front, decision) = (Arc::clone(&self), decision.clone());
            let deletes = async move { front.delete_objects(request, token, lease, &decision).await };
            return detached(Box::pin(deletes.instrument(tracing::Span::current()))).await;
        }
        // A fenced multipart step: its upload must be the key's (an unchecked one, without a
        // token, is fenced on nothing and passes as it is).
        if matches!(op, Op::UploadPart | Op::UploadPartCopy | Op::CompleteMultipartUpload | Op::AbortMultipartUpload)
            && !self.judged.upload_ids_tied_to_keys
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
        self.check_resource_scope(request.scoped.as_deref(), &resource)?;
        let mut request = request;
        if op == Op::CompleteMultipartUpload {
            self.read_parts_list(&mut request, &resource, token).await?;
        }
        decision.write(&resource, token);
        if op == Op::CopyObject && copies_onto_itself_unchanged(&request.target, &request.headers) {
            // fencegate's stamp would make it a change; S3 refuses it, and so does fencegate.
            return Err(FrontError::SelfCopyUnchanged);
        }
        // A token below the fence this replica knows is refused here, without a task.
        self.gate.refuse_known_stale(&resource, token)?;
        let (front, decision) = (Arc::clone(&self), decision.clone());
        let span = decision.span().clone();
        let write = async move { front.admit_and_write(op, request, resource, token, &decision).await };
        detached(Box::pin(write.instrument(span))).await
    }

    /// A CompleteMultipartUpload's parts list, read before admission: a client that sends it
    /// slowly must not hold a write that is past cancelling (its body is complete once read).
    /// A stale completion is refused before its body is read.
    async fn read_parts_list(
        &self,
        request: &mut Request,
        resource: &ResourceKey,
        token: FenceToken,
    ) -> Result<(), FrontError> {
        let fence = self.gate.fence(resource).await.map_err(Refusal::StoreUnavailable)?;
        if let Some(current) = crate::fence::stale_below(fence, token) {
            return Err(Refusal::Stale { presented: token, current }.into());
        }
        let parts = http_body_util::Limited::new(std::mem::take(&mut request.body), COMPLETE_REQUEST_BYTES_MAX)
            .collect()
            .await
            .map_err(|_| FrontError::IncompleteBody)?
            .to_bytes();
        request.body = Body::from(parts);
        Ok(())
    }

    /// Admission and the write it admits (detached: see [`Front::route`]).
    async fn admit_and_write(
        &self,
        op: Op,
        request: Request,
        resource: ResourceKey,
        token: FenceToken,
        decision: &Decision,
    ) -> Result<S3Response<Body>, FrontError> {
        let permit = self.gate.admit_write(&resource, token, request.may_advance, request.caller).await?;
        decision.let_through("accepted");
        let admitted = FencedWrite::new(permit, resource, self.request_timeout, self.unknown_outcome_hold);
        if matches!(op, Op::UploadPart | Op::UploadPartCopy | Op::CompleteMultipartUpload) {
            self.take_over_upload(&request, &admitted).await?;
        }
        match op {
            Op::PutObject => self.put_object(request, admitted).await,
            // Boxed: the largest of these futures, which would make every write's as large.
            Op::CopyObject => Box::pin(self.copy_object(request, admitted)).await,
            Op::DeleteObject => self.delete_object(request, admitted).await,
            Op::CompleteMultipartUpload | Op::AbortMultipartUpload => {
                let upload = upload_of(&request);
                let resp = match op {
                    Op::CompleteMultipartUpload => self.complete_multipart(request, admitted).await?,
                    _ => self.forward_admitted(request, admitted).await?,
                };
                // An upload completed or aborted through fencegate is not left behind.
                if resp.status.is_none_or(|s| s.is_success())
                    && let Some((bucket, upload_id)) = upload
                {
                    self.forget_upload(&bucket, &upload_id).await;
                }
                Ok(resp)
            }
            Op::CreateMultipartUpload => {
                let mut request = request;
                stamp(&mut request.headers, token);
                self.create_multipart(request, admitted).await
            }
            Op::ObjectSubresourceWrite => {
                // Tagging, ACL, retention, legal hold change the object: refused by a newer
                // stamp like any other write (G4).
                let object =
                    request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
                // The upstream judges no precondition on them: only a fresh read sees the stamp.
                self.object_state(&request.target, &object, Cached::Never, &admitted).await?;
                self.forward_admitted(request, admitted).await
            }
            _ => self.forward_admitted(request, admitted).await,
        }
    }

    /// A restricted credential names only resources inside its buckets (docs/security.md, "Tenants"): a
    /// `Fencing-Resource` naming another tenant's resource would let it raise that fence.
    fn check_resource_scope(&self, scoped: Option<&str>, resource: &ResourceKey) -> Result<(), FrontError> {
        match scoped.and_then(|key| self.scopes.get(key)) {
            Some(scopes) if !scopes.covers_resource(resource, &self.wire.rules) => {
                Err(FrontError::OutOfScope(format!("resource {}", resource.as_str())))
            }
            _ => Ok(()),
        }
    }

    /// Reads, listings, bucket operations, and unchecked writes: forwarded as they are.
    async fn pass_through(&self, request: Request) -> Result<S3Response<Body>, FrontError> {
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.wire);
        let reads_object = matches!(request.method, Method::GET | Method::HEAD);
        let mut resp = self.send("pass_through", request.method, &path, headers, request.body).await?;
        if reads_object && !self.show_stamp {
            resp.headers_mut().remove(wire::METADATA_TOKEN);
        }
        Ok(client_response(resp))
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    let decoded = headers.get(crate::aws::amz::X_AMZ_DECODED_CONTENT_LENGTH);
    let raw = decoded.or_else(|| headers.get(http::header::CONTENT_LENGTH))?;
    raw.to_str().ok()?.parse().ok()
}

/// Whether the body's length is held to what its head announced: a `Content-Length` (which
/// hyper holds the client to) and nothing that makes the body another length (aws-chunked
/// framing, its `x-amz-decoded-content-length`).
fn announced_exactly(headers: &HeaderMap) -> bool {
    headers.contains_key(http::header::CONTENT_LENGTH)
        && !headers.contains_key(crate::aws::amz::X_AMZ_DECODED_CONTENT_LENGTH)
        && !headers.contains_key(http::header::TRANSFER_ENCODING)
        && !headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .any(|v| v.as_bytes().windows(11).any(|w| w.eq_ignore_ascii_case(b"aws-chunked")))
}

/// The stamp every object write carries (G4).
fn stamp(headers: &mut HeaderMap, token: FenceToken) {
    headers.insert(wire::METADATA_TOKEN, HeaderValue::from(token.0));
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

    /// Written out only when shown (a refusal, a log line): most requests never need it.
    fn next(&self) -> RequestId {
        RequestId { prefix: self.prefix, n: self.counter.fetch_add(1, Ordering::Relaxed) }
    }
}

/// A request's id, printed as 20 hex digits.
#[derive(Clone, Copy)]
struct RequestId {
    prefix: u32,
    n: u64,
}

impl RequestId {
    /// `{:08X}{:012X}` of the prefix and the counter (20 hex digits until the counter passes
    /// 2^48, up to 24 after), written from a digit table: the formatter's padding machinery
    /// cost a refusal 1,300 instructions, 2 % of its work.
    fn text(&self) -> RequestIdText {
        const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
        let mut text = [0u8; 24];
        let counter_digits = (16 - self.n.leading_zeros() as usize / 4).max(12);
        let len = 8 + counter_digits;
        let mut put = |end: usize, count: usize, mut value: u64| {
            for digit in text[end - count..end].iter_mut().rev() {
                *digit = DIGITS[(value & 0xF) as usize];
                value >>= 4;
            }
        };
        put(8, 8, u64::from(self.prefix));
        put(len, counter_digits, self.n);
        RequestIdText { text, len }
    }
}

/// A request id written out.
struct RequestIdText {
    text: [u8; 24],
    len: usize,
}

impl RequestIdText {
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.text[..self.len]).expect("hex digits are ASCII")
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.text().as_str())
    }
}

/// Whether the query of a write names the stamp as metadata to store (a presigned URL carries
/// metadata so, and an upstream that takes it from there stores it over fencegate's own) with
/// another value than the token presented, or without one.
fn stamp_in_query_disagrees(query: &str, presented: Option<FenceToken>) -> bool {
    form_urlencoded::parse(query.trim_start_matches('?').as_bytes())
        .filter(|(name, _)| name.eq_ignore_ascii_case(METADATA_TOKEN_HEADER))
        .any(|(_, value)| presented.is_none_or(|token| FenceToken::parse(value.as_bytes()) != Ok(token)))
}

#[cfg(test)]
mod tests {
    use super::RequestId;

    #[test]
    fn a_request_id_is_written_as_the_formatter_writes_it() {
        let cases = [(0, 0), (1, 1), (7, 255), (0xDEAD_BEEF, 0x1234_5678_9ABC), (u32::MAX, (1 << 48) - 1)];
        let past_48_bits = [(1, 1 << 48), (2, (1 << 52) - 1), (3, 1 << 60), (u32::MAX, u64::MAX)];
        for (prefix, n) in cases.into_iter().chain(past_48_bits) {
            let id = RequestId { prefix, n };
            assert_eq!(id.text().as_str(), format!("{prefix:08X}{n:012X}"));
            assert_eq!(id.to_string(), format!("{prefix:08X}{n:012X}"));
        }
    }
}
