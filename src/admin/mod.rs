//! The admin listener: health, readiness, metrics, the fences themselves (`GET`/`PUT
//! /v1/fences/{resource}`, G7), and the operator's view: the console at `GET /`, the listings
//! (`/v1/status`, `/v1/fences`, `/v1/leases`, `/v1/inflight`) and the live feed of decisions
//! (`/v1/events`). Errors are `application/problem+json`.
//!
//! Who may do what, with `server.admin_token` set: probes and the console page need nothing;
//! the reads take the admin token, the read token (`server.admin_read_token`, for monitoring)
//! or the console's cookie (`POST /v1/session` with either token); raising a fence or running
//! a reconciliation takes the admin bearer token only, so that neither monitoring nor a page of
//! another port of the same host, which the browser sends the `SameSite` cookie from, can.

mod console;
mod events;
pub mod replicas;
mod views;

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;

use crate::feed::Feed;
use crate::fence::{AdmitError, FenceToken, Gate, Registered, ResourceKey};
use crate::jobs::{Job, Reconciliations};
use crate::upstream::health::UpstreamHealth;

/// The cookie the console keeps its session in.
const SESSION_COOKIE: &str = "fencegate_admin";

/// A registration body is `{"token": N}`; anything much larger is not one.
const REGISTRATION_BYTES_MAX: usize = 4096;

pub struct Admin {
    gate: Arc<Gate>,
    feed: Arc<Feed>,
    reconciler: Arc<dyn Reconciliations>,
    metrics: PrometheusHandle,
    /// `Bearer <token>` expected in `Authorization`, when configured.
    bearer: Option<String>,
    /// `server.admin_read_token`: reads only.
    read_bearer: Option<String>,
    /// The console's sessions: random values this process keeps, never derived from a token.
    sessions: Sessions,
    /// Who the listener answers to (`Host`): a page whose name was rebound to this address
    /// (DNS rebinding) gets 421.
    hosts: ServedHosts,
    /// The console page's `Content-Security-Policy`.
    page_policy: http::HeaderValue,
    /// How often a quiet feed says it is alive (`events::keep_alive`).
    keep_alive: std::time::Duration,
    /// Whether the upstream answers fencegate's credentials, as last checked.
    upstream: Arc<UpstreamHealth>,
}

/// What a request may do, by what it presents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Access {
    /// Nothing: probes, the console page and its session only.
    Anyone,
    /// The console's cookie: every read.
    Reader,
    /// The bearer token (or no token configured): everything.
    Operator,
}

/// The `Host` values the admin listener answers to: the address it listens on (any address
/// when that is unspecified), `localhost` on a loopback or unspecified address, and the names
/// configured (`server.admin_host_names`); with the listener's port or none.
pub struct ServedHosts {
    listen: std::net::SocketAddr,
    names: Vec<String>,
}

impl ServedHosts {
    pub fn new(listen: std::net::SocketAddr, names: Vec<String>) -> Self {
        Self { listen, names }
    }

    /// Whether a request naming `authority` (its `Host`, or its URI's authority on HTTP/2) is
    /// for this listener. A request that names none is not a browser's: it is served. The
    /// authority is read by a URL parser, as the browser wrote it: `127.0.0.1:9001.evil.example`
    /// is no address with a port, and is refused.
    fn serves(&self, authority: Option<&str>) -> bool {
        let Some(authority) = authority else { return true };
        if authority.contains(['/', '?', '#', '@', '\\']) {
            return false;
        }
        let Ok(url) = url::Url::parse(&format!("http://{authority}/")) else { return false };
        // The port as written (the URL drops a default one: `:80` is not "no port" here).
        let written = authority.parse::<http::uri::Authority>().ok().and_then(|a| a.port_u16());
        self.serves_url(&url, written)
    }

    /// Whether a page of `origin` (an `Origin` header: scheme, host and port) is this
    /// listener's own.
    fn serves_origin(&self, origin: &str) -> bool {
        url::Url::parse(origin).is_ok_and(|url| {
            matches!(url.scheme(), "http" | "https")
                && url.username().is_empty()
                && url.password().is_none()
                && url.path() == "/"
                && self.serves_url(&url, url.port_or_known_default())
        })
    }

    fn serves_url(&self, url: &url::Url, port: Option<u16>) -> bool {
        if port.is_some_and(|port| port != self.listen.port()) {
            return false;
        }
        let ip = self.listen.ip();
        let host = match url.host() {
            Some(url::Host::Ipv4(asked)) => return ip.is_unspecified() || std::net::IpAddr::V4(asked) == ip,
            Some(url::Host::Ipv6(asked)) => return ip.is_unspecified() || std::net::IpAddr::V6(asked) == ip,
            Some(url::Host::Domain(host)) => host,
            None => return false,
        };
        if host.eq_ignore_ascii_case("localhost") {
            return ip.is_loopback() || ip.is_unspecified();
        }
        self.names.iter().any(|name| name.eq_ignore_ascii_case(host))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Registration {
    token: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Session {
    token: String,
}

type AdminResponse = Response<UnsyncBoxBody<Bytes, Infallible>>;

/// The admin listener's bearer tokens (`server.admin_token`, `server.admin_read_token`).
pub struct Tokens {
    pub admin: Option<String>,
    pub read: Option<String>,
}

/// The token of an `Authorization: Bearer <token>` value (the scheme is case-insensitive).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(token)
}

impl Admin {
    pub fn new(
        gate: Arc<Gate>,
        feed: Arc<Feed>,
        reconciler: Arc<dyn Reconciliations>,
        metrics: PrometheusHandle,
        tokens: Tokens,
        hosts: ServedHosts,
        idle_timeout: std::time::Duration,
    ) -> Self {
        let sessions = Sessions::default();
        let page_policy = console::content_security_policy().parse().expect("a policy is a header value");
        let keep_alive = events::keep_alive(idle_timeout);
        let upstream = Arc::new(UpstreamHealth::in_process());
        Self {
            gate,
            feed,
            reconciler,
            metrics,
            bearer: tokens.admin,
            read_bearer: tokens.read,
            sessions,
            hosts,
            page_policy,
            keep_alive,
            upstream,
        }
    }

    /// `/readyz` and `/v1/status` also say whether `upstream` answers fencegate's credentials
    /// (an upstream in this process always does).
    pub fn watching_upstream(self, upstream: Arc<UpstreamHealth>) -> Self {
        Self { upstream, ..self }
    }

    pub async fn handle(self: Arc<Self>, req: http::Request<Incoming>) -> Result<AdminResponse, Infallible> {
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str())
            .or_else(|| req.headers().get(header::HOST).and_then(|h| h.to_str().ok()));
        if !self.hosts.serves(authority) {
            return Ok(problem(
                StatusCode::MISDIRECTED_REQUEST,
                "MisdirectedRequest",
                "this admin listener answers only to the address it listens on (and server.admin_host_names)",
            ));
        }
        if !matches!(*req.method(), Method::GET | Method::HEAD) && !self.same_origin(req.headers()) {
            // A page of another site may send a "simple" POST without asking first; curl and
            // the tools send no Origin.
            return Ok(problem(
                StatusCode::FORBIDDEN,
                "CrossSiteRequest",
                "a change on the admin listener from a page of another origin is refused",
            ));
        }
        let access = self.access(req.headers());
        let path = req.uri().path().to_owned();
        let needs = match (req.method(), path.as_str()) {
            (&Method::GET, "/" | "/healthz" | "/readyz" | "/errors") | (_, "/v1/session") => Access::Anyone,
            (&Method::GET | &Method::HEAD, _) => Access::Reader,
            _ => Access::Operator,
        };
        if access < needs {
            let detail = match access {
                Access::Reader => {
                    "a change takes the admin bearer token (the read token and the console's session only read)"
                }
                _ => "a valid admin bearer token is required",
            };
            return Ok(problem(StatusCode::UNAUTHORIZED, "Unauthorized", detail));
        }
        Ok(self.route(req, &path, access).await)
    }

    /// 200 only when a request could succeed now: the fence store answers and the upstream
    /// answered fencegate's credentials at its last check. Each cause of "not ready" is named.
    async fn readiness(&self) -> AdminResponse {
        match (self.gate.ping().await, self.upstream.reach().cause()) {
            (Ok(()), None) => text(StatusCode::OK, "ready\n"),
            (Err(store), upstream) => {
                let detail = upstream.map_or_else(|| store.to_string(), |upstream| format!("{store}; {upstream}"));
                problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &detail)
            }
            (Ok(()), Some(upstream)) => problem(StatusCode::SERVICE_UNAVAILABLE, "UpstreamUnavailable", &upstream),
        }
    }

    async fn route(&self, req: http::Request<Incoming>, path: &str, access: Access) -> AdminResponse {
        let query = req.uri().query().map(str::to_owned);
        let query = query.as_deref();
        match (req.method(), path) {
            (&Method::GET, "/") => self.page(),
            (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => self.readiness().await,
            (&Method::GET, "/metrics") => {
                let mut resp = text(StatusCode::OK, &self.metrics.render());
                resp.headers_mut()
                    .insert(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8".parse().expect("static"));
                resp
            }
            (&Method::POST, "/v1/session") => self.open_session(req).await,
            (&Method::DELETE, "/v1/session") => self.close_session(req.headers()),
            (_, "/v1/session") => problem(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "use POST or DELETE"),
            (&Method::GET, "/v1/status") => {
                views::status(&self.gate, &self.feed, &self.upstream.reach(), self.bearer.is_some()).await
            }
            (&Method::GET, "/errors") => console::errors_page(),
            (&Method::GET, "/v1/fences") => views::fences(&self.gate, &self.feed, query).await,
            (&Method::GET, "/v1/decisions") => json_text(StatusCode::OK, self.feed.recent_json()),
            (&Method::GET, "/v1/leases") => views::leases(&self.gate, query).await,
            (&Method::GET, "/v1/inflight") => views::inflight(&self.gate, &self.feed),
            (&Method::GET, "/v1/events") => {
                let viewer = crate::feed::Viewer {
                    client: req.extensions().get::<crate::net::server::Peer>().map(|p| p.share()).unwrap_or_default(),
                    operator: access == Access::Operator && self.bearer.is_some(),
                };
                events::watch(&self.feed, req.headers(), query, self.keep_alive, viewer)
            }
            (&Method::POST, "/v1/reconcile") => self.reconcile(req).await,
            (method, p) if p.starts_with("/v1/fences/") => {
                let raw = &p["/v1/fences/".len()..];
                match decode_resource(raw) {
                    Err(detail) => problem(StatusCode::BAD_REQUEST, "InvalidFencingResource", &detail),
                    Ok(resource) => match *method {
                        Method::GET => self.get_fence(&resource).await,
                        Method::PUT if access == Access::Operator => self.put_fence(&resource, req.into_body()).await,
                        _ => problem(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "use GET or PUT"),
                    },
                }
            }
            _ => problem(StatusCode::NOT_FOUND, "NotFound", "no such admin endpoint"),
        }
    }

    /// What the request presents: the bearer token, the console's cookie, or nothing. Without
    /// an admin token configured, everyone is the operator (the listener is then on loopback:
    /// config refuses another address without a token).
    fn access(&self, headers: &HeaderMap) -> Access {
        let Some(expected) = &self.bearer else {
            return Access::Operator;
        };
        let presented = headers.get(header::AUTHORIZATION).and_then(|v| bearer_token(v.as_bytes()));
        if presented.is_some_and(|p| constant_time_eq(p, expected.as_bytes())) {
            return Access::Operator;
        }
        let reads = |p: &[u8]| self.read_bearer.as_ref().is_some_and(|read| constant_time_eq(p, read.as_bytes()));
        if presented.is_some_and(reads) {
            return Access::Reader;
        }
        if session_cookies(headers).any(|c| self.sessions.live(c)) {
            return Access::Reader;
        }
        Access::Anyone
    }

    /// Whether a change comes from this listener's own page, or from no page at all: the
    /// browser's `Sec-Fetch-Site` and `Origin` name where it comes from.
    fn same_origin(&self, headers: &HeaderMap) -> bool {
        let site = headers.get("sec-fetch-site").map(|v| v.as_bytes());
        if site.is_some_and(|s| s != b"same-origin" && s != b"none") {
            return false;
        }
        match headers.get(header::ORIGIN).map(|v| v.to_str()) {
            None => true,
            Some(Ok(origin)) => self.hosts.serves_origin(origin),
            Some(Err(_)) => false,
        }
    }

    fn page(&self) -> AdminResponse {
        let mut resp = full(StatusCode::OK, Bytes::from_static(console::PAGE.as_bytes()));
        let headers = resp.headers_mut();
        headers.insert(header::CONTENT_TYPE, "text/html; charset=utf-8".parse().expect("static"));
        headers.insert(header::CONTENT_SECURITY_POLICY, self.page_policy.clone());
        headers.insert(header::X_CONTENT_TYPE_OPTIONS, "nosniff".parse().expect("static"));
        headers.insert(header::X_FRAME_OPTIONS, "DENY".parse().expect("static"));
        headers.insert(header::REFERRER_POLICY, "no-referrer".parse().expect("static"));
        headers.insert(header::CACHE_CONTROL, "no-store".parse().expect("static"));
        resp
    }

    /// `POST /v1/session` `{"token": "..."}`: the console's cookie, for the right token. Only
    /// JSON is taken: a form of another site cannot send it without the browser asking first.
    async fn open_session(&self, req: http::Request<Incoming>) -> AdminResponse {
        let json =
            req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| {
                v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
            });
        if !json {
            return problem(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", "send the token as JSON");
        }
        let Ok(body) = Limited::new(req.into_body(), REGISTRATION_BYTES_MAX).collect().await else {
            return problem(StatusCode::BAD_REQUEST, "InvalidRequest", "the body is not a small JSON object");
        };
        let Ok(Session { token }) = serde_json::from_slice::<Session>(&body.to_bytes()) else {
            return problem(StatusCode::BAD_REQUEST, "InvalidRequest", "expected {\"token\": \"<admin token>\"}");
        };
        if self.bearer.is_none() {
            return full(StatusCode::NO_CONTENT, Bytes::new());
        }
        let known =
            self.bearer.iter().chain(&self.read_bearer).any(|t| constant_time_eq(token.as_bytes(), t.as_bytes()));
        if !known {
            return problem(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "that is neither the admin token nor the read token",
            );
        }
        let session = self.sessions.open();
        let max_age = SESSION_TTL.as_secs();
        with_cookie(format!("{SESSION_COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}"))
    }

    /// `POST /v1/reconcile` `{"bucket", "prefix", "apply"}`: the scan's events as JSON lines,
    /// as they come (`crate::jobs`).
    async fn reconcile(&self, req: http::Request<Incoming>) -> AdminResponse {
        let Ok(body) = Limited::new(req.into_body(), REGISTRATION_BYTES_MAX).collect().await else {
            return problem(StatusCode::BAD_REQUEST, "InvalidRequest", "the body is not a small JSON object");
        };
        let job: Job = match serde_json::from_slice(&body.to_bytes()) {
            Ok(job) => job,
            Err(e) => {
                let detail = format!("expected {{\"bucket\": \"...\", \"prefix\": \"...\", \"apply\": false}}: {e}");
                return problem(StatusCode::BAD_REQUEST, "InvalidRequest", &detail);
            }
        };
        if let Err(detail) = job.check() {
            return problem(StatusCode::BAD_REQUEST, "InvalidRequest", &detail);
        }
        let Some(events) = self.reconciler.start(job) else {
            return problem(StatusCode::CONFLICT, "ReconcileRunning", "a reconciliation is already running");
        };
        let lines = futures_util::stream::unfold(events, |mut events| async move {
            let event = events.recv().await?;
            let mut line = serde_json::to_vec(&event).expect("an event serialises");
            line.push(b'\n');
            Some((Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(line))), events))
        });
        let mut resp = Response::new(http_body_util::StreamBody::new(lines).boxed_unsync());
        resp.headers_mut().insert(header::CONTENT_TYPE, "application/x-ndjson".parse().expect("static"));
        resp
    }

    /// `DELETE /v1/session`: the session the request carries ends here, not only in the browser
    /// (a copy of the cookie is worth nothing after it).
    fn close_session(&self, headers: &HeaderMap) -> AdminResponse {
        for cookie in session_cookies(headers) {
            self.sessions.close(cookie);
        }
        with_cookie(format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"))
    }

    async fn get_fence(&self, resource: &ResourceKey) -> AdminResponse {
        match self.gate.fence(resource).await {
            Ok(Some(token)) => fence_json(StatusCode::OK, resource, token),
            Ok(None) => problem(StatusCode::NOT_FOUND, "NoSuchFence", "no token was ever accepted for this resource"),
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &e.to_string()),
        }
    }

    async fn put_fence(&self, resource: &ResourceKey, body: Incoming) -> AdminResponse {
        let bytes = match Limited::new(body, REGISTRATION_BYTES_MAX).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return problem(StatusCode::BAD_REQUEST, "InvalidRequest", "the body is not a small JSON object");
            }
        };
        let registration: Registration = match serde_json::from_slice(&bytes) {
            Ok(r) => r,
            Err(e) => {
                let detail = format!("expected {{\"token\": <0..18446744073709551615>}}: {e}");
                return problem(StatusCode::BAD_REQUEST, "InvalidFencingToken", &detail);
            }
        };
        match self.gate.register(resource, FenceToken(registration.token)).await {
            Ok(Registered::Raised(token)) => {
                self.feed.note_advance(resource, token, Some("the admin API".into()));
                fence_json(StatusCode::OK, resource, token)
            }
            Ok(Registered::Below(current)) => fence_json(StatusCode::CONFLICT, resource, current),
            Err(AdmitError::StoreUnavailable(e)) => {
                problem(StatusCode::SERVICE_UNAVAILABLE, "FenceStoreUnavailable", &e.to_string())
            }
            Err(e) => problem(StatusCode::SERVICE_UNAVAILABLE, "SlowDown", &e.to_string()),
        }
    }
}

fn decode_resource(raw: &str) -> Result<ResourceKey, String> {
    let decoded =
        crate::net::percent::decode(raw).ok_or_else(|| "the resource is not valid percent-encoded UTF-8".to_owned())?;
    ResourceKey::new(&decoded).map_err(|e| e.to_string())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How long a console session lasts without a new sign-in.
const SESSION_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// Sessions kept at most: a new one past it ends the oldest.
const SESSIONS_MAX: usize = 256;

/// The console's sessions: each a random value (128 bits, from the OS's generator) handed to
/// one browser, kept here until it signs out or expires. Nothing in it is derived from a
/// token, so no two sessions share a value and a copied cookie dies with its session.
#[derive(Default)]
struct Sessions {
    /// Value → when it expires.
    live: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
}

impl Sessions {
    fn open(&self) -> String {
        let value = uuid::Uuid::new_v4().simple().to_string();
        let now = std::time::Instant::now();
        let mut live = self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        live.retain(|_, expires| *expires > now);
        if live.len() >= SESSIONS_MAX
            && let Some(oldest) = live.iter().min_by_key(|(_, expires)| **expires).map(|(v, _)| v.clone())
        {
            live.remove(&oldest);
        }
        live.insert(value.clone(), now + SESSION_TTL);
        value
    }

    fn live(&self, value: &str) -> bool {
        let live = self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A map lookup by value: its time depends on the value's hash, not on how much of a
        // guess matches, and a guess of 128 random bits is hopeless anyway.
        live.get(value).is_some_and(|expires| *expires > std::time::Instant::now())
    }

    fn close(&self, value: &str) {
        self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(value);
    }
}

/// The values of the console's cookie the request carries (a page of another port of the host
/// may have set one more, with a narrower path, which the browser sends first).
fn session_cookies(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='))
}

fn with_cookie(cookie: String) -> AdminResponse {
    let mut resp = full(StatusCode::NO_CONTENT, Bytes::new());
    if let Ok(value) = cookie.parse() {
        resp.headers_mut().insert(header::SET_COOKIE, value);
    }
    resp.headers_mut().insert(header::CACHE_CONTROL, "no-store".parse().expect("static"));
    resp
}

fn full(status: StatusCode, body: Bytes) -> AdminResponse {
    let mut resp = Response::new(Full::new(body).boxed_unsync());
    *resp.status_mut() = status;
    resp
}

fn text(status: StatusCode, body: &str) -> AdminResponse {
    let mut resp = full(status, Bytes::from(body.to_owned()));
    resp.headers_mut().insert(header::CONTENT_TYPE, "text/plain; charset=utf-8".parse().expect("static"));
    resp
}

fn fence_json(status: StatusCode, resource: &ResourceKey, token: FenceToken) -> AdminResponse {
    let body = serde_json::json!({ "resource": resource.as_str(), "token": token.0 });
    json_response(status, &body)
}

/// An RFC 9457 problem whose `type` ends in `code`.
fn problem(status: StatusCode, code: &str, detail: &str) -> AdminResponse {
    let body = crate::net::problem::document(status, code, detail);
    let mut resp = full(status, Bytes::from(body.to_string()));
    resp.headers_mut().insert(header::CONTENT_TYPE, crate::net::problem::CONTENT_TYPE.parse().expect("static"));
    resp
}

/// JSON already rendered.
fn json_text(status: StatusCode, body: String) -> AdminResponse {
    let mut resp = full(status, Bytes::from(body));
    resp.headers_mut().insert(header::CONTENT_TYPE, "application/json".parse().expect("static"));
    resp.headers_mut().insert(header::CACHE_CONTROL, "no-store".parse().expect("static"));
    resp
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> AdminResponse {
    let mut resp = full(status, Bytes::from(body.to_string()));
    resp.headers_mut().insert(header::CONTENT_TYPE, "application/json".parse().expect("static"));
    resp.headers_mut().insert(header::CACHE_CONTROL, "no-store".parse().expect("static"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DNS-rebinding page names its own host: refused. The listener's own address, with its
    /// port or none, `localhost` on loopback, and configured names are served.
    #[test]
    fn only_the_listeners_own_names_are_served() {
        let on = |listen: &str, names: &[&str]| {
            ServedHosts::new(listen.parse().unwrap(), names.iter().map(|n| (*n).to_owned()).collect())
        };
        let loopback = on("127.0.0.1:9001", &[]);
        for ok in [None, Some("127.0.0.1:9001"), Some("127.0.0.1"), Some("localhost:9001"), Some("LOCALHOST")] {
            assert!(loopback.serves(ok), "{ok:?}");
        }
        for refused in ["evil.example:9001", "evil.example", "127.0.0.1:80", "10.0.0.1:9001", "[::1]:9001", "a b"] {
            assert!(!loopback.serves(Some(refused)), "{refused}");
        }
        let any = on("0.0.0.0:9001", &["admin.internal"]);
        for ok in ["10.1.2.3:9001", "[fd00::1]:9001", "localhost", "Admin.Internal:9001"] {
            assert!(any.serves(Some(ok)), "{ok}");
        }
        assert!(!any.serves(Some("evil.example:9001")));
        // Read as a URL: a port that runs on into a name is no port of ours.
        for refused in ["127.0.0.1:9001.evil.example", "127.0.0.1:9001@evil.example", "127.0.0.1:9001/x"] {
            assert!(!loopback.serves(Some(refused)), "{refused}");
        }
        for (origin, ok) in [
            ("http://127.0.0.1:9001", true),
            ("https://localhost:9001", true),
            ("http://127.0.0.1:9001.evil.example", false),
            ("http://evil.example:9001", false),
            ("http://user@127.0.0.1:9001", false),
            ("ftp://127.0.0.1:9001", false),
            ("null", false),
        ] {
            assert_eq!(loopback.serves_origin(origin), ok, "{origin}");
        }
        let v6 = on("[::1]:9001", &[]);
        assert!(v6.serves(Some("[::1]:9001")) && v6.serves(Some("localhost")) && !v6.serves(Some("127.0.0.1:9001")));
    }

    #[test]
    fn resources_are_percent_decoded() {
        assert_eq!(decode_resource("bkt%2Fkey").unwrap().as_str(), "bkt/key");
        assert_eq!(decode_resource("job:a").unwrap().as_str(), "job:a");
        assert!(decode_resource("%zz").is_err());
        assert!(decode_resource("").is_err());
    }
}
