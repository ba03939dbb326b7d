//! The HTTP API gateway (README.md, "HTTP API gateway"): third-party APIs behind the same gate as the S3 front.
//!
//! A request whose path starts with a route's prefix is forwarded to the route's upstream with
//! the client's own headers (its `Authorization` included: fencegate does not authenticate route
//! clients, the API does). Reads pass unfenced. A write (any method but GET, HEAD and OPTIONS)
//! presents a token, which the gate judges exactly as for S3 (pure `decide`, durable advance,
//! older in-flight writes drained first: G2, G3); then the route's mode makes the call safe for
//! an API that knows nothing of tokens:
//! - `idempotency-key`: the API is sent an `Idempotency-Key` derived from resource, token and
//!   the client's request id; the outcome is recorded in the fence store and a retry is answered
//!   from the record (`replay`);
//! - `conditional`: the write carries `If-Match` with the resource's last ETag, or
//!   `If-None-Match: *` (`etags`);
//! - `fence-only`: check and forward.
//!
//! Errors are `application/problem+json` (`error`). The upstream client is `client`, the
//! routes and their resource templates `route`.

mod body;
mod client;
mod error;
mod etags;
mod replay;
mod route;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use hyper::body::Incoming;
use s3s::Body;
use tracing::{Instrument, field};

pub use self::error::GatewayError;
pub use self::replay::REPLAYED_HEADER;

use self::client::{ApiClient, SendError};
use self::etags::ResourceEtags;
use self::replay::Collected;
use self::route::Route;
use crate::config::{Config, RouteMode, millis, ms};
use crate::feed::{Decision as FeedDecision, Feed};
use crate::fence::Clock;
use crate::fence::outcome::detached;
use crate::fence::{
    AmbiguousCause, Decision, FenceToken, FencedWrite, Gate, IdempotencyBegin, IdempotencyKey, IdempotencyOutcome,
    IdempotencyRecord, IdempotencyRecords, Permit, ResourceKey, StoreError, WriteFailure, decide, fingerprint,
};
use crate::metrics;
use crate::net::body::{BodyFailure, ForwardBody};
use crate::refusal::{Refusal, single_token};

/// The header carrying the client's request id, and fencegate's key to the API.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// A client's `Idempotency-Key` is at most this long (Stripe's limit; the draft sets none).
const CLIENT_KEY_BYTES_MAX: usize = 255;
/// Slack on top of the longest a live fencegate takes over one call, before its in-flight
/// record counts as abandoned.
const CLAIM_SLACK: Duration = Duration::from_secs(1);

use crate::net::server::{REQUEST_HOP_HEADERS as HOP_HEADERS, RESPONSE_HOP_HEADERS, remove_response_hop_headers};

pub struct Gateway {
    /// Longest prefix first, so the most specific route takes a path.
    routes: Vec<Route>,
    /// Where each request's decision is told (`crate::feed`).
    feed: Arc<Feed>,
    gate: Arc<Gate>,
    /// The idempotency records (`mode = "idempotency-key"`), in the fence store.
    records: IdempotencyRecords,
    token_header: HeaderName,
    resource_header: HeaderName,
    require_token: bool,
    /// Wall-clock time of idempotency records (injectable, like the lease service's).
    clock: Arc<dyn Clock>,
    /// Last ETag per resource, for `conditional` routes.
    etags: ResourceEtags,
    /// A store call slower than this has an unknown outcome.
    store_timeout: Duration,
    /// How long the gate may hold a write before admitting it.
    inflight_deadline: Duration,
}

impl Gateway {
    /// Compiles the `[[routes]]`; errors name the key at fault.
    pub fn new(config: &Config, gate: Arc<Gate>, clock: Arc<dyn Clock>, feed: Arc<Feed>) -> anyhow::Result<Self> {
        let connect_timeout = ms(config.upstream.connect_timeout_ms);
        let idle_max = config.upstream.idle_connections_max;
        let pools = config.server.serving_threads();
        let mut default_client: Option<Arc<ApiClient>> = None;
        let mut routes = Vec::with_capacity(config.routes.len());
        for rc in &config.routes {
            let client = match &rc.ca_cert_path {
                Some(path) => Arc::new(ApiClient::new(Some(path), connect_timeout, idle_max, pools)?),
                None => match &default_client {
                    Some(client) => client.clone(),
                    None => {
                        default_client.insert(Arc::new(ApiClient::new(None, connect_timeout, idle_max, pools)?)).clone()
                    }
                },
            };
            let route = Route::new(rc, client).map_err(|e| anyhow::anyhow!("routes.resource: {e}"))?;
            routes.push(route);
        }
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        Ok(Self {
            routes,
            feed,
            records: gate.idempotency_records(),
            gate,
            token_header: HeaderName::from_bytes(config.fencing.token_header.as_bytes())?,
            resource_header: HeaderName::from_bytes(config.fencing.resource_header.as_bytes())?,
            require_token: config.fencing.require_token,
            clock,
            etags: ResourceEtags::new(config.fencing.etag_cache_entries_max),
            store_timeout: ms(config.store.timeout_ms),
            inflight_deadline: ms(config.fencing.inflight_deadline_ms),
        })
    }

    /// Whether a route takes `path`.
    pub fn takes(&self, path: &str) -> bool {
        self.route_of(path).is_some()
    }

    fn route_of(&self, path: &str) -> Option<usize> {
        self.routes.iter().position(|r| path.starts_with(r.prefix.as_str()))
    }

    /// Serves one request of a route (see [`Gateway::takes`]).
    pub async fn handle(self: Arc<Self>, req: http::Request<Incoming>) -> http::Response<Body> {
        let Some(ix) = self.route_of(req.uri().path()) else {
            return GatewayError::UnsafePath.into_response();
        };
        let mode = self.routes[ix].mode_name();
        let span = tracing::info_span!(
            "api",
            route = self.routes[ix].prefix.as_str(),
            mode,
            method = %req.method(),
            resource = field::Empty,
            token = field::Empty,
            fence = field::Empty,
            decision = field::Empty,
            upstream_status = field::Empty,
            duration_ms = field::Empty,
        );
        let started = Instant::now();
        // Detached: a client that disconnects does not end a write the API may still execute,
        // nor a claimed idempotency record (`fence::outcome`).
        let decision = FeedDecision::new(&self.feed, span.clone());
        decision.operation(operation(req.method()));
        let dispatched = self.clone().dispatch(ix, req, decision.clone());
        let result = detached(Box::pin(dispatched.instrument(span.clone()))).await;
        span.record("duration_ms", started.elapsed().as_secs_f64() * 1000.0);
        match result {
            Ok(resp) => {
                span.in_scope(|| tracing::debug!(status = resp.status().as_u16(), "done"));
                resp
            }
            Err(error) => {
                let (decision_record, decision) = (&decision, error.decision());
                metrics::gateway_request(mode, error.outcome());
                let code = error.code();
                if !decision_record.names_resource() {
                    // The route, not the path: an API's path can carry a secret.
                    decision_record.object(&self.routes[ix].prefix);
                }
                decision_record.refused(decision, code, error.current_fence(), true, &error);
                error.into_response()
            }
        }
    }

    async fn dispatch(
        self: Arc<Self>,
        ix: usize,
        req: http::Request<Incoming>,
        decision: Arc<FeedDecision>,
    ) -> Result<http::Response<Body>, GatewayError> {
        let (parts, body) = req.into_parts();
        let route = &self.routes[ix];
        let rest = route.rest(parts.uri.path())?.to_owned();
        let uri = route.upstream_uri(&rest, parts.uri.query())?;
        if matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS) {
            return self.read(route, &parts, &rest, uri, body).await;
        }
        let Some(token) = self.token(&parts.headers)? else {
            if self.require_token {
                return Err(Refusal::MissingToken.into());
            }
            decision.let_through("unchecked");
            metrics::gateway_request(route.mode_name(), "unchecked");
            let req = self.upstream_request(&parts, uri, body::limited(body, route.body_bytes_max));
            return self.send_unfenced(route, req, true).await;
        };
        let resource = self.resource(route, &rest, &parts.headers)?;
        decision.write(&resource, token);
        let fencing = Fencing { resource: &resource, token, decision: &decision };
        if body::content_length(&parts.headers).is_some_and(|n| n > route.body_bytes_max as u64) {
            return Err(GatewayError::BodyTooLarge { max: route.body_bytes_max });
        }
        match route.mode {
            RouteMode::FenceOnly => {
                let req = self.upstream_request(&parts, uri, Body::empty());
                let body = body::limited(body, route.body_bytes_max);
                let (resp, _permit) = self.send_fenced(route, req, body, fencing, false).await?;
                metrics::gateway_request(route.mode_name(), "forwarded");
                Ok(client_response(resp))
            }
            RouteMode::Conditional => self.conditional(route, &parts, uri, body, fencing).await,
            RouteMode::IdempotencyKey => self.clone().idempotent(ix, parts, uri, body, fencing).await,
        }
    }

    /// Reads pass unfenced. A `conditional` route learns the resource's ETag from them.
    async fn read(
        &self,
        route: &Route,
        parts: &http::request::Parts,
        rest: &str,
        uri: http::Uri,
        body: Incoming,
    ) -> Result<http::Response<Body>, GatewayError> {
        metrics::gateway_request(route.mode_name(), "read");
        let req = self.upstream_request(parts, uri, Body::from(body));
        let resp = self.send_unfenced(route, req, false).await?;
        if route.mode == RouteMode::Conditional
            && matches!(parts.method, Method::GET | Method::HEAD)
            && resp.status().is_success()
            && let (Some(etag), Ok(resource)) = (resp.headers().get(header::ETAG), route.resource(rest))
        {
            self.etags.put(resource, etag.clone());
        }
        Ok(resp)
    }

    /// `conditional`: `If-Match` with the resource's last ETag (or `If-None-Match: *`), the
    /// client's own preconditions replaced. A 412 goes back to the client as it is.
    async fn conditional(
        &self,
        route: &Route,
        parts: &http::request::Parts,
        uri: http::Uri,
        body: Incoming,
        fencing: Fencing<'_>,
    ) -> Result<http::Response<Body>, GatewayError> {
        let resource = fencing.resource;
        let req = self.upstream_request(parts, uri, Body::empty());
        let body = body::limited(body, route.body_bytes_max);
        let (resp, permit) = self.send_fenced(route, req, body, fencing, true).await?;
        let status = resp.status();
        if status.is_success() {
            match resp.headers().get(header::ETAG) {
                Some(etag) if parts.method != Method::DELETE => self.etags.put(resource.clone(), etag.clone()),
                _ => self.etags.forget(resource),
            }
            metrics::gateway_request(route.mode_name(), "forwarded");
        } else if status == StatusCode::PRECONDITION_FAILED {
            self.etags.forget(resource);
            metrics::precondition_conflict("api_refused");
            metrics::gateway_request(route.mode_name(), "precondition_failed");
        } else {
            metrics::gateway_request(route.mode_name(), "forwarded");
        }
        drop(permit);
        Ok(client_response(resp))
    }

    /// `idempotency-key`: see the module documentation and the README.
    async fn idempotent(
        self: Arc<Self>,
        ix: usize,
        parts: http::request::Parts,
        uri: http::Uri,
        body: Incoming,
        fencing: Fencing<'_>,
    ) -> Result<http::Response<Body>, GatewayError> {
        let Fencing { resource, token, decision } = fencing;
        let route = &self.routes[ix];
        let client_key = client_idempotency_key(&parts.headers)?;
        let now_ms = self.clock.now_ms();

        // A stale token may still be the retry of a request that executed: its record answers
        // for it. Without a record it is refused, before its body is read when the client
        // named its request.
        let fence = self.gate.fence(resource).await?;
        let stale = match decide(fence, token) {
            Decision::Stale { current } => Some(current),
            _ => None,
        };
        // Records are kept per caller: a replay reaches only the caller that made the request.
        let caller = route.caller(&parts.headers);
        let record_key =
            |request_id: &str| IdempotencyKey::new(resource.clone(), format!("{caller}\n{request_id}").as_bytes());
        if let (Some(current), Some(client_key)) = (stale, &client_key) {
            let key = record_key(client_key);
            if self.records.get(&key, now_ms).await?.is_none() {
                return Err(Refusal::Stale { presented: token, current }.into());
            }
        }
        let (body, _buffered) = body::held(route, &parts, &caller, body).await?;
        let path_and_query = parts.uri.path_and_query().map_or("", |pq| pq.as_str());
        let fingerprint = fingerprint(&[parts.method.as_str().as_bytes(), path_and_query.as_bytes(), &body]);
        let request_id = client_key.as_deref().unwrap_or(fingerprint.as_str());
        let key = record_key(request_id);
        if let Some(current) = stale {
            return match self.records.get(&key, now_ms).await? {
                Some(record) => self.answer_from(route, &record, &fingerprint, now_ms, decision),
                None => Err(Refusal::Stale { presented: token, current }.into()),
            };
        }

        // Kept two claim windows at least, whatever the route's retention: a record gone while
        // its call may still be in flight would let a retry send it again, and one gone just
        // past its window would never be found abandoned (`fencegate reconcile`).
        let window = millis(self.claim_window(route));
        let claim = IdempotencyRecord {
            claim: uuid::Uuid::new_v4().simple().to_string(),
            fingerprint: fingerprint.clone(),
            token,
            upstream_key: key.upstream_key(token),
            expires_at_ms: now_ms.saturating_add(route.retention_ms.max(window.saturating_mul(2))),
            outcome: IdempotencyOutcome::InFlight { deadline_ms: now_ms.saturating_add(window) },
            route: route.prefix.clone(),
            claimed_at_ms: now_ms,
        };
        match self.records.begin(&key, &claim, now_ms).await? {
            IdempotencyBegin::Existing(record) => {
                return self.answer_from(route, &record, &fingerprint, now_ms, decision);
            }
            IdempotencyBegin::Full => return Err(GatewayError::RecordsFull),
            IdempotencyBegin::Claimed => {}
        }
        let sent = Claimed { key: &key, claim: &claim, fencing };
        self.call_claimed(route, &sent, &parts, uri, body).await
    }

    /// Sends a write whose idempotency record this request claimed, and records its answer.
    /// Every path finishes the claim: with an outcome, or by removing it (nothing reached the
    /// API, so a retry may go ahead).
    async fn call_claimed(
        &self,
        route: &Route,
        sent: &Claimed<'_>,
        parts: &http::request::Parts,
        uri: http::Uri,
        body: Bytes,
    ) -> Result<http::Response<Body>, GatewayError> {
        let Claimed { key, claim, fencing } = *sent;
        let write = match self.admit(route, fencing).await {
            Ok(write) => write,
            Err(error) => {
                self.finish(key, claim, None).await;
                return Err(error);
            }
        };
        let mut req = self.upstream_request(parts, uri, Body::from(body.clone()));
        // Hex, so always a header value; were it not, nothing was sent.
        let Ok(upstream_key) = HeaderValue::from_str(&claim.upstream_key) else {
            self.finish(key, claim, None).await;
            return Err(GatewayError::Internal);
        };
        let headers = req.headers_mut();
        headers.insert(IDEMPOTENCY_KEY_HEADER, upstream_key);
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        let resp = match self.send_write(route, &write, req).await {
            Ok(resp) => resp,
            Err(CallFailed::NotSent(error)) => {
                self.finish(key, claim, None).await;
                return Err(error);
            }
            Err(CallFailed::Unknown(e)) => {
                let cause = ambiguous_cause(&e);
                self.finish(key, claim, Some(IdempotencyOutcome::Ambiguous { cause })).await;
                return Err(unknown_outcome(e, Some(claim.upstream_key.clone())));
            }
        };
        // The outcome is known from the head on: newer writes need not wait for the body.
        drop(write);
        self.record_answer(route, key, claim, resp).await
    }

    /// Records the API's answer to a claimed write (a status worth replaying, with its body
    /// when it fits) and hands it to the client.
    async fn record_answer(
        &self,
        route: &Route,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        resp: http::Response<Incoming>,
    ) -> Result<http::Response<Body>, GatewayError> {
        let (head, body) = resp.into_parts();
        if !replay::is_recorded(head.status) {
            self.finish(key, claim, None).await;
            metrics::gateway_request(route.mode_name(), "forwarded");
            return Ok(client_response(http::Response::from_parts(head, body)));
        }
        let (recorded, answer) = match replay::collect(body, route.response_bytes_max, route.request_timeout).await {
            Collected::Whole(bytes) => {
                let recorded = replay::record(&head, Some(&bytes));
                (recorded, Ok(http::Response::from_parts(head, Body::from(bytes))))
            }
            Collected::TooLarge(read, rest) => {
                let recorded = replay::record(&head, None);
                (recorded, Ok(http::Response::from_parts(head, replay::stream_on(read, rest))))
            }
            Collected::Broken => {
                metrics::ambiguous_outcome("api");
                (replay::record(&head, None), Err(GatewayError::ResponseIncomplete { status: head.status.as_u16() }))
            }
        };
        self.finish(key, claim, Some(IdempotencyOutcome::Completed(recorded))).await;
        metrics::gateway_request(route.mode_name(), "forwarded");
        answer.map(client_response)
    }

    /// The answer a record gives a request that finds it.
    fn answer_from(
        &self,
        route: &Route,
        record: &IdempotencyRecord,
        fingerprint: &str,
        now_ms: u64,
        decision: &FeedDecision,
    ) -> Result<http::Response<Body>, GatewayError> {
        let recorded = replay::judge(record, fingerprint, now_ms)?;
        metrics::gateway_request(route.mode_name(), "replayed");
        decision.let_through("replayed");
        Ok(replay::replay(recorded))
    }

    /// Finishes a claim: the outcome, or (`None`) removal. A failure leaves the claim in
    /// flight: retries get 409 until its deadline, then "outcome unknown". Never a second call.
    async fn finish(&self, key: &IdempotencyKey, claim: &IdempotencyRecord, outcome: Option<IdempotencyOutcome>) {
        let record = outcome.map(|outcome| IdempotencyRecord { outcome, ..claim.clone() });
        if let Err(error) = self.records.finish(key, &claim.claim, record.as_ref()).await {
            metrics::idempotency_record_failed();
            tracing::error!(%error, upstream_key = claim.upstream_key, "cannot record the outcome of an API call");
        }
    }

    /// The longest a live fencegate works on one claimed request: the gate's wait, the call,
    /// its response body, and two store calls.
    fn claim_window(&self, route: &Route) -> Duration {
        self.inflight_deadline + route.request_timeout * 2 + self.store_timeout * 2 + CLAIM_SLACK
    }

    /// Admits the write, then sends it with a body that a newer token can still cut off (G3).
    /// With `conditional`, the precondition is chosen once admitted: the gate has drained the
    /// older writes by then, and their ETags are in. The permit comes back with the response
    /// head: keep it while acting on the response.
    async fn send_fenced(
        &self,
        route: &Route,
        mut req: http::Request<Body>,
        body: Body,
        fencing: Fencing<'_>,
        conditional: bool,
    ) -> Result<(http::Response<Incoming>, Arc<Permit>), GatewayError> {
        let write = self.admit(route, fencing).await?;
        if conditional {
            let (name, value) = self.etags.precondition(fencing.resource);
            let headers = req.headers_mut();
            headers.remove(header::IF_MATCH);
            headers.remove(header::IF_NONE_MATCH);
            headers.insert(name, value);
        }
        *req.body_mut() = body;
        match self.send_write(route, &write, req).await {
            Ok(resp) => Ok((resp, write.permit)),
            Err(CallFailed::NotSent(error)) => Err(error),
            Err(CallFailed::Unknown(error)) => Err(unknown_outcome(error, None)),
        }
    }

    /// Admits a write of `token` on `resource`.
    async fn admit(&self, route: &Route, fencing: Fencing<'_>) -> Result<FencedWrite, GatewayError> {
        let Fencing { resource, token, decision } = fencing;
        let permit = self.gate.admit_write(resource, token, route.writes_advance, None).await?;
        if permit.advanced() {
            decision.advanced();
        }
        decision.let_through("accepted");
        Ok(FencedWrite::new(permit, resource.clone(), route.request_timeout, self.inflight_deadline))
    }

    /// Sends an admitted write (`fence::write`), its body cancellable by a newer token.
    async fn send_write(
        &self,
        route: &Route,
        write: &FencedWrite,
        req: http::Request<Body>,
    ) -> Result<http::Response<Incoming>, CallFailed> {
        let (parts, body) = req.into_parts();
        let empty = http_body::Body::size_hint(&body).exact() == Some(0);
        let (forwarded, report) = ForwardBody::new(body, Some(write.permit.clone()), None, 0);
        let req = http::Request::from_parts(parts, Body::http_body(forwarded));
        let result = write.call(&self.gate, "api", empty, route.client.send_unbounded(req)).await;
        if let Some(failure) = write.body_failure(&self.gate, &report).await {
            return Err(CallFailed::NotSent(self.write_error(route, failure)));
        }
        match result {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(SendError::NotSent(e))) => Err(CallFailed::NotSent(GatewayError::UpstreamUnavailable(Box::new(e)))),
            Ok(Err(e)) => Err(CallFailed::Unknown(e)),
            Err(WriteFailure::OutcomeUnknown { after_ms }) => Err(CallFailed::Unknown(SendError::Timeout { after_ms })),
            Err(failure) => Err(CallFailed::NotSent(self.write_error(route, failure))),
        }
    }

    /// A write that did not commit, as the gateway answers it.
    fn write_error(&self, route: &Route, failure: WriteFailure) -> GatewayError {
        match failure {
            WriteFailure::Superseded { presented, current } => Refusal::Stale { presented, current }.into(),
            WriteFailure::Deadline { after_ms } => GatewayError::UpstreamTimeout { after_ms },
            WriteFailure::Revoked => StoreError::Backend("the write's registration could not be kept".into()).into(),
            WriteFailure::OutcomeUnknown { after_ms } => unknown_outcome(SendError::Timeout { after_ms }, None),
            WriteFailure::Body(BodyFailure::TooLarge) => GatewayError::BodyTooLarge { max: route.body_bytes_max },
            WriteFailure::Body(_) => GatewayError::IncompleteBody,
        }
    }

    /// Reads and unfenced writes; a write's broken call is still an unknown outcome.
    async fn send_unfenced(
        &self,
        route: &Route,
        req: http::Request<Body>,
        write: bool,
    ) -> Result<http::Response<Body>, GatewayError> {
        match self.call(route, req).await {
            Ok(resp) => Ok(client_response(resp)),
            Err(SendError::NotSent(e)) => Err(GatewayError::UpstreamUnavailable(Box::new(e))),
            Err(e) if write => Err(unknown_outcome(e, None)),
            Err(SendError::Timeout { after_ms }) => Err(GatewayError::UpstreamTimeout { after_ms }),
            Err(SendError::Broken(e)) => Err(GatewayError::UpstreamUnavailable(Box::new(e))),
        }
    }

    async fn call(&self, route: &Route, req: http::Request<Body>) -> Result<http::Response<Incoming>, SendError> {
        let started = Instant::now();
        let result = route.client.send(req, route.request_timeout).await;
        let status = result.as_ref().ok().map(|r| r.status().as_u16());
        metrics::upstream_call("api", started.elapsed(), status);
        if let Some(status) = status {
            tracing::Span::current().record("upstream_status", status);
        }
        result
    }

    /// The client's request with the client's headers, less the hop and fencing headers.
    fn upstream_request(&self, parts: &http::request::Parts, uri: http::Uri, body: Body) -> http::Request<Body> {
        let mut req = http::Request::new(body);
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        for (name, value) in &parts.headers {
            if HOP_HEADERS.contains(&name.as_str()) || *name == self.token_header || *name == self.resource_header {
                continue;
            }
            headers.append(name.clone(), value.clone());
        }
        req
    }

    /// The presented token: one header, parsed by the same rules as for S3.
    fn token(&self, headers: &HeaderMap) -> Result<Option<FenceToken>, GatewayError> {
        Ok(single_token(headers, &self.token_header, "fencing token")?)
    }

    /// The resource the route's template binds the path to; a `Fencing-Resource` header must
    /// agree with it.
    fn resource(&self, route: &Route, rest: &str, headers: &HeaderMap) -> Result<ResourceKey, GatewayError> {
        let bound = route.resource(rest)?;
        if let Some(presented) = headers.get(&self.resource_header)
            && presented.as_bytes() != bound.as_str().as_bytes()
        {
            return Err(Refusal::ResourceMismatch {
                bound: bound.as_str().to_owned(),
                presented: String::from_utf8_lossy(presented.as_bytes()).into_owned(),
            }
            .into());
        }
        Ok(bound)
    }
}

/// The client's `Idempotency-Key`, if it sent one.
fn client_idempotency_key(headers: &HeaderMap) -> Result<Option<String>, GatewayError> {
    let invalid = GatewayError::InvalidIdempotencyKey { max: CLIENT_KEY_BYTES_MAX };
    let mut values = headers.get_all(IDEMPOTENCY_KEY_HEADER).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() || value.is_empty() || value.len() > CLIENT_KEY_BYTES_MAX {
        return Err(invalid);
    }
    match value.to_str() {
        // Visible characters only, as docs/gateway.md says (a space is not one).
        Ok(key) if key.bytes().all(|b| b.is_ascii_graphic()) => Ok(Some(key.to_owned())),
        _ => Err(invalid),
    }
}

/// What fences a write: the resource, the token presented, and where the decision is told.
#[derive(Clone, Copy)]
struct Fencing<'a> {
    resource: &'a ResourceKey,
    token: FenceToken,
    decision: &'a FeedDecision,
}

/// A write whose idempotency record a request claimed.
#[derive(Clone, Copy)]
struct Claimed<'a> {
    key: &'a IdempotencyKey,
    claim: &'a IdempotencyRecord,
    fencing: Fencing<'a>,
}

/// How an admitted write's call failed.
enum CallFailed {
    /// Nothing of it reached the API whole: it commits nothing, and is answered as this.
    NotSent(GatewayError),
    /// It may have reached the API: its outcome is unknown.
    Unknown(SendError),
}

fn ambiguous_cause(e: &SendError) -> AmbiguousCause {
    match e {
        SendError::Timeout { .. } => AmbiguousCause::Timeout,
        _ => AmbiguousCause::ConnectionLost,
    }
}

/// A write that may have executed: counted, logged, reported; never sent again by fencegate.
fn unknown_outcome(e: SendError, upstream_key: Option<String>) -> GatewayError {
    let cause = ambiguous_cause(&e);
    metrics::ambiguous_outcome("api");
    tracing::warn!(error = %e, ?cause, upstream_key, "API call outcome unknown");
    GatewayError::OutcomeUnknown { cause, upstream_key }
}

/// A route request's operation, as the feed names it: its method.
fn operation(method: &Method) -> &'static str {
    match *method {
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        _ => "other",
    }
}

/// The upstream's response without its hop headers.
fn client_response<B: Into<Body>>(resp: http::Response<B>) -> http::Response<Body> {
    let (mut parts, body) = resp.into_parts();
    remove_response_hop_headers(&mut parts.headers);
    http::Response::from_parts(parts, body.into())
}
