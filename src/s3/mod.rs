//! The S3 front end. s3s verifies the signature (header or presigned, every
//! `x-amz-content-sha256` mode) and decodes `aws-chunked` bodies, or the lean path
//! (`lean.rs`) verifies the common request shapes itself; a catch-all route (`service.rs`) then
//! hands every authenticated request to the [`Front`] here.
//!
//! The flow of a request reads top to bottom in this file: authorise (`scopes.rs`,
//! `leased.rs`, `checks.rs`), classify (`classify.rs`), read the token (`wire.rs`), parse the
//! fenced write into a command (`ops::FencedOp`), name its resource, refuse it early when the
//! fence already says stale, admit it through the gate (`crate::fence`), apply it (`ops/`), and
//! answer; every refusal is an [`FrontError`], rendered as S3 XML in `error.rs`. Reads and
//! everything else unfenced go through the bounded hop of `hop.rs`; `objects.rs` is what
//! fencegate knows of an object.

mod auth;
mod checks;
mod classify;
mod error;
mod hop;
mod lean;
mod leased;
mod objects;
mod ops;
mod scopes;
mod service;
mod signed;
mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use http::{HeaderMap, Method};
use s3s::{Body, S3Request, S3Response, S3Result};
use tracing::{Instrument, field};

pub use self::auth::Service;
pub use self::classify::{Op, Target, classify, target};
pub use self::error::FrontError;
pub use self::hop::{Hop, error_of};
pub use self::objects::ObjectState;
pub use self::ops::{abort_upload, forget_upload};
pub use self::service::service;
pub use self::wire::{METADATA_TOKEN_HEADER, WireContract};
pub use crate::refusal::CURRENT_TOKEN_HEADER;

use self::checks::check_headers;
use self::hop::{client_response, forwarded_query, upstream_headers};
use self::ops::{Batch, Ctx, FencedOp, Limits};
use self::scopes::Scopes;
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

/// The S3 front: its policy, and the context its operations run over.
pub struct Front {
    /// What every fenced operation runs over (`ops::Ctx`).
    ctx: Ctx,
    /// Where each request's decision is told (`crate::feed`).
    feed: Arc<Feed>,
    /// `fencing.require_token`.
    require_token: bool,
    /// `server.domain`: virtual-hosted addressing under it.
    domain: Option<String>,
    request_ids: RequestIds,
    /// Whether a write may raise a fence (`fencing.advance`).
    writes_advance: bool,
    /// `fencing.show_stamp`.
    show_stamp: bool,
    /// Access keys restricted to some buckets or prefixes (`[[credentials]] buckets`).
    scopes: std::collections::HashMap<String, Scopes>,
    /// Access keys with `role = "lessee"`: their writes never raise a fence, whatever
    /// `fencing.advance` says (a lease grant moves it by one; a write could move it to 2^64-1).
    lessees: std::collections::HashSet<String>,
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

impl Front {
    /// `clock`: the one leases expire by (the lease service's); `judged`: what the upstream
    /// judges; `copy_by_read_and_put`: CopyObject as a read and a conditional PUT.
    fn new(
        config: &Config,
        gate: Arc<Gate>,
        upstream: Arc<dyn Upstream>,
        feed: Arc<Feed>,
        clock: Arc<dyn crate::fence::Clock>,
        judged: Enforcement,
        copy_by_read_and_put: bool,
    ) -> anyhow::Result<Self> {
        let ctx = Ctx {
            gate,
            hop: Hop::new(upstream, crate::config::ms(config.upstream.request_timeout_ms)),
            wire: WireContract::new(&config.fencing)?,
            etags: objects::EtagCache::new(config.fencing.etag_cache_entries_max),
            limits: Limits {
                body_bytes_max: config.server.body_bytes_max,
                retry_body_bytes_max: config.fencing.retry_body_bytes_max,
                unknown_outcome_hold: crate::config::ms(config.fencing.inflight_deadline_ms),
                uploads_open_for: crate::config::ms(
                    config.fencing.abort_uploads_after_ms.saturating_sub(config.upload_completion_ms()),
                ),
            },
            judged,
            copy_by_read_and_put,
            clock,
        };
        Ok(Self {
            ctx,
            feed,
            require_token: config.fencing.require_token,
            domain: config.server.domain.clone(),
            request_ids: RequestIds::new(),
            writes_advance: config.fencing.advance.writes_advance(),
            show_stamp: config.fencing.show_stamp,
            scopes: config
                .credentials
                .iter()
                .filter(|c| !c.buckets.is_empty())
                .map(|c| (c.access_key_id.clone(), Scopes::new(&c.buckets)))
                .collect(),
            lessees: config
                .credentials
                .iter()
                .filter(|c| c.role == crate::config::Role::Lessee)
                .map(|c| c.access_key_id.clone())
                .collect(),
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
        // Kept for a refusal made before a resource is named (no allocation: shared bytes).
        let named = (req.uri.clone(), req.headers.get(http::header::HOST).cloned());
        // Boxed: the route's state machine is kilobytes, and this future, the library's and
        // hyper's around it would each hold it inline and copy it at every move.
        let result = Box::pin(Arc::clone(&self).route(req, lease, signature, &decision)).instrument(span.clone()).await;
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
                if !decision.names_resource() {
                    decision.object(&self.object_named(&named.0, named.1));
                }
                decision.refused(error.decision(), error.code(), error.fence(), !lease_read, &error);
                // Rendered here rather than returned as an error, which s3s would log again.
                Ok(client_response(error.into_response(request_id.text().as_str())))
            }
        }
    }

    /// What a request names, `bucket/key` (or its path when it names none), for a refusal's
    /// record.
    fn object_named(&self, uri: &http::Uri, host: Option<http::HeaderValue>) -> String {
        let mut headers = HeaderMap::new();
        if let Some(host) = host {
            headers.insert(http::header::HOST, host);
        }
        match target(uri, &headers, self.domain.as_deref()) {
            Ok(target) => target.object_name().or(target.bucket).unwrap_or_else(|| uri.path().to_owned()),
            Err(_) => uri.path().to_owned(),
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
        self.ctx.wire.check_signed(&signature, &req.headers)?;
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
            && let Some(resp) = self
                .ctx
                .abort_own_upload(&target, req.uri.query(), lease.as_ref(), signer, &req.headers, decision)
                .await?
        {
            return Ok(resp);
        }
        let lease = match &lease {
            Some(claims) => Some(self.lease_standing(claims, &req.method, op, &target, &req.headers).await?),
            None => None,
        };
        let signed = self.signed(signer, &signature, op);
        let request = self.request_of(req, target, signed)?;
        if !op.is_fenced_write() {
            return self.pass_through(request).await;
        }
        let presented = match &lease {
            Some(lease) => Some(lease.token),
            None => self.ctx.wire.token(&request.headers)?,
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

    /// What `signer` (the access key, the issuer's for a lease credential) may do with `op`.
    fn signed(&self, signer: Option<&str>, signature: &signed::Signature, op: Op) -> Signed {
        Signed {
            may_advance: self.writes_advance
                && !signature.is_sigv2()
                && !signer.is_some_and(|key| self.lessees.contains(key)),
            scoped: signer.filter(|key| self.scopes.contains_key(*key)).map(str::to_owned),
            // Kept only where it is recorded: an upload's creator (no allocation per write).
            signer: signer.filter(|_| op.is_multipart_step()).map(str::to_owned),
            presigned: signature.is_presigned(),
        }
    }

    /// The request as the front carries it on: its body bounded by `server.body_bytes_max`.
    fn request_of(&self, req: S3Request<Body>, target: Target, signed: Signed) -> Result<Request, FrontError> {
        let content_length = content_length(&req.headers);
        if let Some(bytes) = content_length
            && bytes > self.ctx.limits.body_bytes_max
        {
            return Err(FrontError::TooLarge { bytes, max: self.ctx.limits.body_bytes_max });
        }
        let body = if announced_exactly(&req.headers) {
            req.input
        } else {
            // A length nobody holds the client to (no `Content-Length`, or a decoded length an
            // aws-chunked body may not keep): the body is cut at the limit as it streams.
            Body::http_body(http_body_util::Limited::new(
                req.input,
                usize::try_from(self.ctx.limits.body_bytes_max).unwrap_or(usize::MAX),
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

    /// A fenced write with its token: parsed into its command, checked as far as can be
    /// without the gate, then admitted and applied on a task of its own (`detached`). `lease`:
    /// the resource of the lease it was signed under.
    async fn route_write(
        self: Arc<Self>,
        op: Op,
        request: Request,
        token: FenceToken,
        lease: Option<ResourceKey>,
        decision: &Arc<Decision>,
    ) -> Result<S3Response<Body>, FrontError> {
        if op == Op::DeleteObjects {
            let lease = lease.as_ref();
            let batch =
                Batch::parse(request, |request, bucket, key| self.key_resource(request, lease, bucket, key)).await?;
            let (front, decision) = (Arc::clone(&self), decision.clone());
            let deletes = async move { front.ctx.delete_objects(batch, token, &decision).await };
            return detached(Box::pin(deletes.instrument(tracing::Span::current()))).await;
        }
        let mut command = FencedOp::parse(op, request)?;
        let target = &command.request().target;
        let (Some(bucket), Some(key)) = (&target.bucket, &target.key) else {
            return Err(FrontError::NotSupported("a write without an object key"));
        };
        let resource = self.ctx.wire.resource(&command.request().headers, bucket, key)?;
        self.check_resource_scope(command.request().scoped.as_deref(), &resource)?;
        decision.write(&resource, token);
        command.check()?;
        if command.uses_an_upload() {
            command.prepare(&self.ctx, &resource, token).await?;
        }
        // A token below the fence this replica knows is refused here, without a task.
        self.ctx.gate.refuse_known_stale(&resource, token)?;
        let (front, decision) = (Arc::clone(&self), decision.clone());
        let span = decision.span().clone();
        let write = async move { front.admit_and_apply(command, resource, token, &decision).await };
        detached(Box::pin(write.instrument(span))).await
    }

    /// Admission and the command it admits (detached: see [`Front::route`]).
    async fn admit_and_apply(
        &self,
        command: FencedOp,
        resource: ResourceKey,
        token: FenceToken,
        decision: &Decision,
    ) -> Result<S3Response<Body>, FrontError> {
        let request = command.request();
        let permit = self.ctx.gate.admit_write(&resource, token, request.may_advance, request.caller).await?;
        if permit.advanced() {
            decision.advanced();
        }
        decision.let_through("accepted");
        let admitted =
            FencedWrite::new(permit, resource, self.ctx.hop.request_timeout(), self.ctx.limits.unknown_outcome_hold);
        command.apply(&self.ctx, admitted).await
    }

    /// The resource of one key of a DeleteObjects, or why it is refused: its name, the lease
    /// the request was signed under, its resource by the rules and the credential's scope.
    fn key_resource(
        &self,
        request: &Request,
        lease: Option<&ResourceKey>,
        bucket: &str,
        key: &str,
    ) -> Result<ResourceKey, FrontError> {
        checks::check_key(key)?;
        if let Some(lease) = lease {
            self.within_lease(lease, bucket, key)?;
        }
        let resource = self.ctx.wire.resource(&request.headers, bucket, key)?;
        self.check_resource_scope(request.scoped.as_deref(), &resource)?;
        Ok(resource)
    }

    /// A restricted credential names only resources inside its buckets (docs/security.md, "Tenants"): a
    /// `Fencing-Resource` naming another tenant's resource would let it raise that fence.
    fn check_resource_scope(&self, scoped: Option<&str>, resource: &ResourceKey) -> Result<(), FrontError> {
        match scoped.and_then(|key| self.scopes.get(key)) {
            Some(scopes) if !scopes.covers_resource(resource, &self.ctx.wire.rules) => {
                Err(FrontError::OutOfScope(format!("resource {}", resource.as_str())))
            }
            _ => Ok(()),
        }
    }

    /// Reads, listings, bucket operations, and unchecked writes: forwarded as they are.
    async fn pass_through(&self, request: Request) -> Result<S3Response<Body>, FrontError> {
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.ctx.wire);
        let reads_object = matches!(request.method, Method::GET | Method::HEAD);
        let mut resp = self.ctx.hop.send("pass_through", request.method, &path, headers, request.body).await?;
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
