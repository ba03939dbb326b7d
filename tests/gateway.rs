//! Proves the HTTP API gateway (README.md, "HTTP API gateway") against a fake third-party API that executes
//! every request it gets, records the `Idempotency-Key` and `If-Match` it was sent, honours
//! preconditions with 412, and can be told to stall or to drop a connection: a retried request
//! executes once and its replay is identical (both stores), stale writes never reach the API,
//! a stalled upstream never lets an older write commit after a newer one, an ambiguous outcome
//! is never executed twice, and https upstreams are verified.
mod common;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Fencegate, RedisServer, redis_store_toml};
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Every wait on a background event is bounded by this, so a broken gateway fails, not hangs.
const WAIT_MAX: Duration = Duration::from_secs(10);
/// The routes' request timeout in these tests: short, so that timeouts are quick to provoke.
const REQUEST_TIMEOUT_MS: u64 = 600;

// ---------------------------------------------------------------------------------------------
// The fake third-party API.

/// What the fake API does with the next write to a path.
#[derive(Debug, Clone, Copy)]
enum Script {
    /// Waits this long after reading the body, then executes and answers. The wait runs in a
    /// task of its own, so the API executes even if the caller hung up (as a real backend does).
    StallThenExecute(Duration),
    /// Executes, then closes the connection without answering.
    ExecuteThenDrop,
    /// Answers this status without executing (an API refusing the caller).
    Refuse(StatusCode),
    /// Answers 202 Accepted at once and executes this long after, whatever happens meanwhile
    /// (an API that queues the call and performs it later).
    AcceptThenExecute(Duration),
}

/// A write the API received complete (and so executed or refused).
#[derive(Debug, Clone)]
struct Received {
    method: Method,
    path: String,
    body: Bytes,
    idempotency_key: Option<String>,
    if_match: Option<String>,
    if_none_match: Option<String>,
    authorization: Option<String>,
    fencing_token: Option<String>,
    /// `None`: refused with 412; else the execution number.
    execution: Option<u64>,
}

#[derive(Default)]
struct ApiState {
    ledger: Vec<Received>,
    /// path → (ETag, body) of what is there now.
    current: HashMap<String, (String, Bytes)>,
    scripts: HashMap<String, VecDeque<Script>>,
    executions: u64,
}

struct FakeApi {
    addr: SocketAddr,
    state: Arc<Mutex<ApiState>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeApi {
    async fn start(tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(ApiState::default()));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (state, tls) = (shared.clone(), tls.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(state.clone(), req));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let _ = match tls {
                        None => builder.serve_connection(TokioIo::new(stream), service).await,
                        Some(acceptor) => match acceptor.accept(stream).await {
                            Ok(stream) => builder.serve_connection(TokioIo::new(stream), service).await,
                            Err(_) => return,
                        },
                    };
                });
            }
        });
        Self { addr, state, task }
    }

    fn url(&self, scheme: &str, base: &str) -> String {
        format!("{scheme}://{}{base}", self.addr)
    }

    fn script(&self, path: &str, script: Script) {
        self.state.lock().unwrap().scripts.entry(path.to_owned()).or_default().push_back(script);
    }

    /// Scripted answers not used yet (a request takes its path's next one as it arrives).
    fn scripts_left(&self) -> usize {
        self.state.lock().unwrap().scripts.values().map(VecDeque::len).sum()
    }

    fn ledger(&self) -> Vec<Received> {
        self.state.lock().unwrap().ledger.clone()
    }

    fn received(&self, path: &str) -> Vec<Received> {
        self.ledger().into_iter().filter(|r| r.path == path).collect()
    }

    fn current_body(&self, path: &str) -> Option<Bytes> {
        self.state.lock().unwrap().current.get(path).map(|(_, b)| b.clone())
    }

    /// Waits until every scripted answer was taken: the requests they were for have reached
    /// the API (and a `StallThenExecute` one is being held there).
    async fn wait_until_scripts_taken(&self) {
        let deadline = Instant::now() + WAIT_MAX;
        while self.scripts_left() > 0 {
            assert!(Instant::now() < deadline, "{} scripted requests never reached the API", self.scripts_left());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `path` received `n` complete writes.
    async fn wait_for(&self, path: &str, n: usize) {
        let deadline = Instant::now() + WAIT_MAX;
        while self.received(path).len() < n {
            assert!(Instant::now() < deadline, "{path} never received {n} writes: {:?}", self.received(path));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    state: Arc<Mutex<ApiState>>,
    req: http::Request<Incoming>,
) -> Result<http::Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    if matches!(parts.method, Method::GET | Method::HEAD) {
        let current = state.lock().unwrap().current.get(&path).cloned();
        return Ok(match current {
            Some((etag, body)) => response(StatusCode::OK, &[("etag", &etag)], body),
            None => response(StatusCode::NOT_FOUND, &[], Bytes::from_static(b"{\"error\":\"not found\"}")),
        });
    }
    // A body that does not arrive whole is never executed.
    let body = body.collect().await.map_err(std::io::Error::other)?.to_bytes();
    let header = |name: &str| parts.headers.get(name).map(|v| v.to_str().unwrap().to_owned());
    let received = Received {
        method: parts.method.clone(),
        path: path.clone(),
        body,
        idempotency_key: header("idempotency-key"),
        if_match: header("if-match"),
        if_none_match: header("if-none-match"),
        authorization: header("authorization"),
        fencing_token: header("fencing-token"),
        execution: None,
    };
    let script = state.lock().unwrap().scripts.get_mut(&path).and_then(VecDeque::pop_front);
    match script {
        None => Ok(execute(&state, received)),
        Some(Script::StallThenExecute(wait)) => {
            let state = state.clone();
            let late = tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                execute(&state, received)
            });
            Ok(late.await.unwrap())
        }
        Some(Script::ExecuteThenDrop) => {
            execute(&state, received);
            Err(std::io::Error::other("connection dropped on purpose"))
        }
        Some(Script::AcceptThenExecute(wait)) => {
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                execute(&state, received);
            });
            Ok(response(StatusCode::ACCEPTED, &[], Bytes::from_static(b"{\"queued\":true}")))
        }
        Some(Script::Refuse(status)) => {
            state.lock().unwrap().ledger.push(received);
            Ok(response(status, &[], Bytes::from_static(b"{\"error\":\"refused\"}")))
        }
    }
}

/// Applies a write unless its precondition fails (412); either way it is in the ledger.
fn execute(state: &Mutex<ApiState>, mut received: Received) -> http::Response<Full<Bytes>> {
    let mut s = state.lock().unwrap();
    let etag = s.current.get(&received.path).map(|(e, _)| e.clone());
    let refused = match (&received.if_match, &received.if_none_match) {
        (Some(m), _) => etag.as_deref() != Some(m.as_str()) && !(m == "*" && etag.is_some()),
        (None, Some(n)) => n == "*" && etag.is_some(),
        (None, None) => false,
    };
    if refused {
        s.ledger.push(received);
        return response(StatusCode::PRECONDITION_FAILED, &[], Bytes::from_static(b"{\"error\":\"precondition\"}"));
    }
    s.executions += 1;
    let n = s.executions;
    received.execution = Some(n);
    let etag = format!("\"e{n}\"");
    if received.method == Method::DELETE {
        s.current.remove(&received.path);
    } else {
        s.current.insert(received.path.clone(), (etag.clone(), received.body.clone()));
    }
    let status = if received.method == Method::POST { StatusCode::CREATED } else { StatusCode::OK };
    let body = format!("{{\"execution\":{n},\"path\":\"{}\",\"bytes\":{}}}", received.path, received.body.len());
    s.ledger.push(received);
    response(status, &[("etag", &etag), ("x-execution", &n.to_string())], Bytes::from(body))
}

fn response(status: StatusCode, headers: &[(&str, &str)], body: Bytes) -> http::Response<Full<Bytes>> {
    let mut resp = http::Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert("content-type", "application/json".parse().unwrap());
    for (name, value) in headers {
        resp.headers_mut().insert(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
    }
    resp
}

// ---------------------------------------------------------------------------------------------
// Fencegate with routes to the fake API, and a client for it.

/// The three routes, one per mode, in front of `api`.
/// The routes most tests use; a write may raise the fence (`advance = "write"`), so a test can
/// present a new token without registering it first (the default, `registration`, has a test
/// of its own).
fn routes(api: &FakeApi) -> String {
    let mut toml = String::new();
    for (prefix, base, resource, mode) in [
        ("/pay/", "/v1/payments/", "payment:{1}", "idempotency-key"),
        ("/doc/", "/v1/docs/", "doc:{1}", "conditional"),
        ("/hook/", "/v1/hooks/", "hook:{1}", "fence-only"),
    ] {
        toml.push_str(&format!(
            "[[routes]]\nprefix = \"{prefix}\"\nupstream = \"{}\"\nresource = \"{resource}\"\nmode = \"{mode}\"\n\
             request_timeout_ms = {REQUEST_TIMEOUT_MS}\nadvance = \"write\"\n",
            api.url("http", base)
        ));
    }
    toml
}

struct Resp {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    /// The code at the end of a problem's `type`.
    fn code(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json", "status {}: {:?}", self.status, self.body);
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        let kind = json["type"].as_str().unwrap();
        kind.rsplit(':').next().unwrap().to_owned()
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

#[derive(Clone)]
struct Caller {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Caller {
    fn new(fg: &Fencegate) -> Self {
        Self { base: fg.endpoint(), client: Client::builder(TokioExecutor::new()).build_http() }
    }

    /// A caller on another loopback address (`127.0.0.N`): another peer to fencegate.
    fn from_address(fg: &Fencegate, source: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_local_address(Some(source.parse().unwrap()));
        Self { base: fg.endpoint(), client: Client::builder(TokioExecutor::new()).build(connector) }
    }

    async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
        let mut req = http::Request::new(Full::new(Bytes::copy_from_slice(body.as_bytes())));
        *req.method_mut() = method.parse().unwrap();
        *req.uri_mut() = format!("{}{path}", self.base).parse().unwrap();
        for (name, value) in headers {
            req.headers_mut().append(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        }
        let resp = tokio::time::timeout(WAIT_MAX, self.client.request(req)).await.expect("fencegate answers").unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Resp { status: parts.status.as_u16(), headers: parts.headers, body }
    }

    async fn write(&self, method: &str, path: &str, token: u64, key: Option<&str>, body: &str) -> Resp {
        let token = token.to_string();
        let mut headers = vec![("fencing-token", token.as_str()), ("authorization", "Bearer client-secret")];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        self.send(method, path, &headers, body).await
    }
}

/// The same response: status, the API's headers and body byte for byte.
fn assert_same_response(first: &Resp, replay: &Resp) {
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    for name in ["etag", "x-execution", "content-type", "content-length"] {
        assert_eq!(replay.header(name), first.header(name), "header {name}");
    }
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.header("idempotent-replayed"), None);
}

async fn metrics(fg: &Fencegate) -> String {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let uri = format!("http://{}/metrics", fg.admin);
    let resp = client.get(uri.parse().unwrap()).await.unwrap();
    String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// A retried request executes once at the API, and its replay is the first response byte for
/// byte (with and without a client `Idempotency-Key`); a different body under the same key
/// gets 422; a stale-token retry of a request that executed gets its recorded result, while a
/// new stale request never reaches the API. Embedded store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_executes_once_and_its_replay_is_identical() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    retried_requests_execute_once(&api, &Caller::new(&fg)).await;
}

/// The same on the Redis store: records live in Redis, shared by replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_executes_once_on_the_redis_store() {
    let api = FakeApi::start(None).await;
    let redis = RedisServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let fg =
        Fencegate::setup(dir.path()).store(&redis_store_toml(&redis.url(), "r1")).extra(&routes(&api)).start().await;
    retried_requests_execute_once(&api, &Caller::new(&fg)).await;

    // A second replica on the same Redis answers the retry from the same record (the S3
    // upstream plays no part: each replica has its own local one).
    let dir2 = tempfile::tempdir().unwrap();
    let fg2 =
        Fencegate::setup(dir2.path()).store(&redis_store_toml(&redis.url(), "r2")).extra(&routes(&api)).start().await;
    let replica = Caller::new(&fg2);
    let before = api.ledger().len();
    let again = replica.write("POST", "/pay/42/charges", 5, Some("k1"), "{\"amount\":100}").await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(api.ledger().len(), before, "the other replica did not call the API again");
}

async fn retried_requests_execute_once(api: &FakeApi, c: &Caller) {
    // With the client's own key.
    let first = c.write("POST", "/pay/42/charges", 5, Some("k1"), "{\"amount\":100}").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let retry = c.write("POST", "/pay/42/charges", 5, Some("k1"), "{\"amount\":100}").await;
    assert_same_response(&first, &retry);
    let sent = api.received("/v1/payments/42/charges");
    assert_eq!(sent.len(), 1, "executed once");
    let upstream_key = sent[0].idempotency_key.clone().unwrap();
    assert!(upstream_key.starts_with("fg-") && upstream_key != "k1", "{upstream_key}");
    assert_eq!(sent[0].authorization.as_deref(), Some("Bearer client-secret"), "the client's Authorization passes");
    assert_eq!(sent[0].fencing_token, None, "the API is not sent fencing headers");

    // The same key with another body is another request: refused, not executed.
    let reused = c.write("POST", "/pay/42/charges", 5, Some("k1"), "{\"amount\":999}").await;
    assert_eq!((reused.status, reused.code().as_str()), (422, "IdempotencyKeyReused"));

    // Without a key, the request id is a hash of method, path and body.
    let plain = c.write("POST", "/pay/43/charges", 5, None, "{\"amount\":7}").await;
    assert_eq!(plain.status, 201);
    assert_same_response(&plain, &c.write("POST", "/pay/43/charges", 5, None, "{\"amount\":7}").await);
    assert_eq!(api.received("/v1/payments/43/charges").len(), 1);
    let other = c.write("POST", "/pay/43/charges", 5, None, "{\"amount\":8}").await;
    assert_eq!(other.status, 201, "a different body is a different request");
    assert_eq!(api.received("/v1/payments/43/charges").len(), 2);

    // A newer lease writes; the older holder's retry of what already executed gets its result.
    let newer = c.write("POST", "/pay/42/refunds", 6, Some("k2"), "{\"amount\":100}").await;
    assert_eq!(newer.status, 201);
    let stale_retry = c.write("POST", "/pay/42/charges", 5, Some("k1"), "{\"amount\":100}").await;
    assert_same_response(&first, &stale_retry);
    // A new request under the old token is refused and never reaches the API.
    let before = api.ledger().len();
    for key in [Some("k3"), None] {
        let stale = c.write("POST", "/pay/42/charges", 5, key, "{\"amount\":1}").await;
        assert_eq!((stale.status, stale.code().as_str()), (409, "FencingTokenStale"));
        assert_eq!(stale.header("fencing-token-current"), Some("6"));
    }
    assert_eq!(api.ledger().len(), before);
    // The newer holder cannot reuse the old request's key for another request either.
    let reused = c.write("POST", "/pay/42/other", 6, Some("k1"), "{}").await;
    assert_eq!((reused.status, reused.code().as_str()), (422, "IdempotencyKeyReused"));
    assert_eq!(api.ledger().len(), before);
}

/// Idempotency records are kept per caller (a hash of its `Authorization`): another caller that
/// sends the same key and body is its own request, never answered from the first caller's
/// record; and a 401 or 403 from the API is passed on but not recorded, so whoever sends a
/// request first without credentials cannot decide what the real caller's retry gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reaches_only_its_caller_and_a_refused_caller_is_not_recorded() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);
    let as_caller = |auth: &'static str| {
        let c = c.clone();
        async move {
            let headers = [("fencing-token", "5"), ("authorization", auth), ("idempotency-key", "same")];
            c.send("POST", "/pay/7/charges", &headers, "{\"amount\":1}").await
        }
    };
    let alice = as_caller("Bearer alice").await;
    assert_eq!(alice.status, 201);
    let mallory = as_caller("Bearer mallory").await;
    assert_eq!(mallory.status, 201);
    assert_eq!(mallory.header("idempotent-replayed"), None, "not alice's recorded answer");
    assert_eq!(api.received("/v1/payments/7/charges").len(), 2, "each caller's request is its own");
    let again = as_caller("Bearer alice").await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(api.received("/v1/payments/7/charges").len(), 2);

    api.script("/v1/payments/8/charges", Script::Refuse(StatusCode::UNAUTHORIZED));
    let headers = [("fencing-token", "5"), ("authorization", "Bearer alice"), ("idempotency-key", "k8")];
    let refused = c.send("POST", "/pay/8/charges", &headers, "{}").await;
    assert_eq!(refused.status, 401, "the API's refusal is passed on");
    let retried = c.send("POST", "/pay/8/charges", &headers, "{}").await;
    assert_eq!((retried.status, retried.header("idempotent-replayed")), (201, None), "the retry executes");
    assert_eq!(api.received("/v1/payments/8/charges").len(), 2);
}

/// A route holds at most `routes.buffered_bytes_max` of request bodies at once, and one peer
/// (address) at most a quarter of it (at least one body): beyond, 503. The share is the peer's,
/// not the caller headers': four made-up `Authorization` values from one address are one share,
/// and leave the route to everyone else (before: four shares, and every other caller got 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_buffers_a_bounded_number_of_bodies() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let route = format!(
        "[[routes]]\nprefix = \"/pay/\"\nupstream = \"{}\"\nresource = \"payment:{{1}}\"\nmode = \"idempotency-key\"\n\
         advance = \"write\"\nbody_bytes_max = 1024\nbuffered_bytes_max = 2048\n",
        api.url("http", "/v1/payments/")
    );
    let fg = Fencegate::start_local(dir.path(), &route).await;
    let (alice, bob, carol) = (
        Caller::from_address(&fg, "127.0.0.1"),
        Caller::from_address(&fg, "127.0.0.2"),
        Caller::from_address(&fg, "127.0.0.3"),
    );
    let body = "x".repeat(1000);
    let call = |c: &Caller, who: &'static str, path: &'static str, key: &'static str| {
        let (c, body) = (c.clone(), body.clone());
        async move {
            let headers = [("fencing-token", "5"), ("authorization", who), ("idempotency-key", key)];
            c.send("POST", path, &headers, &body).await
        }
    };
    // Two peers' calls the API holds take the whole budget (2 x 1000 of 2048 bytes).
    api.script("/v1/payments/1/a", Script::StallThenExecute(Duration::from_millis(1500)));
    api.script("/v1/payments/1/b", Script::StallThenExecute(Duration::from_millis(1500)));
    let a = tokio::spawn(call(&alice, "Bearer alice", "/pay/1/a", "a"));
    let b = tokio::spawn(call(&bob, "Bearer bob", "/pay/1/b", "b"));
    let mut refused = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if api.scripts_left() == 0 {
            // A third peer finds the route full; alice's address, its share (1024 bytes) taken,
            // whatever identity it makes up.
            refused = Some((
                call(&carol, "Bearer carol", "/pay/1/c", "c").await,
                call(&alice, "Bearer made-up", "/pay/1/d", "d").await,
            ));
            break;
        }
    }
    let (third, alice_again) = refused.expect("both held calls reached the API");
    assert_eq!((third.status, third.code().as_str()), (503, "SlowDown"));
    assert_eq!((alice_again.status, alice_again.code().as_str()), (503, "SlowDown"));
    assert_eq!((a.await.unwrap().status, b.await.unwrap().status), (201, 201));
    assert_eq!(call(&carol, "Bearer carol", "/pay/1/c", "c").await.status, 201, "room again once they ended");

    // Four made-up identities from one address hold one share, not four: another peer is served.
    for key in ["m1", "m2", "m3", "m4"] {
        api.script(&format!("/v1/payments/2/{key}"), Script::StallThenExecute(Duration::from_millis(1500)));
    }
    let mallory = Caller::from_address(&fg, "127.0.0.4");
    let held = tokio::spawn(call(&mallory, "Bearer m1", "/pay/2/m1", "m1"));
    tokio::time::sleep(Duration::from_millis(200)).await;
    for (who, path, key) in
        [("Bearer m2", "/pay/2/m2", "m2"), ("Bearer m3", "/pay/2/m3", "m3"), ("Bearer m4", "/pay/2/m4", "m4")]
    {
        let more = call(&mallory, who, path, key).await;
        assert_eq!((more.status, more.code().as_str()), (503, "SlowDown"), "{who}: a share of its own");
    }
    assert_eq!(call(&bob, "Bearer bob", "/pay/3/e", "e").await.status, 201, "another peer still gets its share");
    assert_eq!(held.await.unwrap().status, 201);
}

/// While the first request is still in flight a duplicate gets 409 (and does not execute);
/// once the first finished, the duplicate is answered from its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_a_request_in_flight_gets_409_then_the_replay() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);
    api.script("/v1/payments/7/charges", Script::StallThenExecute(Duration::from_millis(400)));
    let first = tokio::spawn({
        let c = c.clone();
        async move { c.write("POST", "/pay/7/charges", 1, Some("dup"), "{\"n\":1}").await }
    });
    api.wait_until_scripts_taken().await;
    let duplicate = c.write("POST", "/pay/7/charges", 1, Some("dup"), "{\"n\":1}").await;
    assert_eq!((duplicate.status, duplicate.code().as_str()), (409, "IdempotentRequestInFlight"));
    assert_eq!(duplicate.header("retry-after"), Some("1"));
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_same_response(&first, &c.write("POST", "/pay/7/charges", 1, Some("dup"), "{\"n\":1}").await);
    assert_eq!(api.received("/v1/payments/7/charges").len(), 1);
}

/// In every mode, a write with a token below the fence (raised by a write or by registration,
/// G7) is refused with 409 `FencingTokenStale` and `Fencing-Token-Current`, a missing token with
/// 428 and a malformed one with 400, all as problem+json; none reaches the API. Reads pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_writes_never_reach_the_api() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);

    for (path, method) in [("/pay/1/x", "POST"), ("/doc/1", "PUT"), ("/hook/1", "POST")] {
        let ok = c.write(method, path, 2, None, "{\"token\":2}").await;
        assert!(ok.status < 300, "{path}: {} {:?}", ok.status, ok.body);
        let stale = c.write(method, path, 1, None, "{\"token\":1}").await;
        assert_eq!((stale.status, stale.code().as_str()), (409, "FencingTokenStale"), "{path}");
        assert_eq!(stale.header("fencing-token-current"), Some("2"));
        assert_eq!(stale.json()["fencing_token_current"], 2);
        let missing = c.send(method, path, &[], "{\"token\":null}").await;
        assert_eq!((missing.status, missing.code().as_str()), (428, "FencingTokenRequired"), "{path}");
        for bad in ["-1", "0x10", "18446744073709551616", ""] {
            let malformed = c.send(method, path, &[("fencing-token", bad)], "{}").await;
            assert_eq!((malformed.status, malformed.code().as_str()), (400, "InvalidFencingToken"), "{bad:?}");
        }
    }
    // Registration fences the resource before the new holder writes.
    let admin: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut register = http::Request::new(Full::new(Bytes::from_static(b"{\"token\": 3}")));
    *register.method_mut() = Method::PUT;
    *register.uri_mut() = format!("http://{}/v1/fences/hook:9", fg.admin).parse().unwrap();
    assert_eq!(admin.request(register).await.unwrap().status(), 200);
    let fenced = c.write("DELETE", "/hook/9", 2, None, "").await;
    assert_eq!((fenced.status, fenced.header("fencing-token-current")), (409, Some("3")));
    // A resource header that disagrees with the route's template is refused.
    let mismatch = c.send("POST", "/hook/1", &[("fencing-token", "2"), ("fencing-resource", "hook:2")], "{}").await;
    assert_eq!((mismatch.status, mismatch.code().as_str()), (400, "FencingResourceMismatch"));
    let escape = c.write("POST", "/hook/%2e%2e/admin", 2, None, "{}").await;
    assert_eq!((escape.status, escape.code().as_str()), (400, "InvalidPath"));

    let ledger = api.ledger();
    assert_eq!(ledger.len(), 3, "only the three token-2 writes reached the API: {ledger:?}");
    assert!(ledger.iter().all(|r| r.body.as_ref() == b"{\"token\":2}"));
    // Reads need no token and pass through.
    assert_eq!(c.send("GET", "/doc/1", &[], "").await.status, 200);
    assert_eq!(c.send("GET", "/doc/404", &[], "").await.status, 404);
}

/// G3 with a stalled upstream: an older write that is stuck at the API when a newer token
/// arrives is awaited, so the newer write reaches the API only after it; meanwhile the fence is
/// already advanced and another old-token write is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_older_write_is_awaited_before_a_newer_one_is_forwarded() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);
    let path = "/v1/hooks/5";
    api.script(path, Script::StallThenExecute(Duration::from_millis(400)));
    let old = tokio::spawn({
        let c = c.clone();
        async move { c.write("POST", "/hook/5", 1, None, "old").await }
    });
    api.wait_until_scripts_taken().await;
    let new = tokio::spawn({
        let c = c.clone();
        async move { c.write("POST", "/hook/5", 2, None, "new").await }
    });
    fg.wait_for_fence("hook:5", 2).await;
    let refused = c.write("POST", "/hook/5", 1, None, "old-again").await;
    assert_eq!((refused.status, refused.header("fencing-token-current")), (409, Some("2")));
    let (old, new) = (old.await.unwrap(), new.await.unwrap());
    assert_eq!((old.status, new.status), (201, 201));
    // The order that matters is the API's: when the clients read their answers is up to the
    // scheduler (a clean-clone run saw the older one read a moment later).
    let order: Vec<Bytes> = api.received(path).into_iter().map(|r| r.body).collect();
    assert_eq!(order, vec![Bytes::from("old"), Bytes::from("new")], "the older write committed first");
}

/// G3 at the bound of an API that answers before it acts: a 202 says the call is accepted, not
/// performed, so the older write stays in flight for `fencing.inflight_deadline_ms` (D) after
/// it. The API performs it at D minus 300 ms; the newer token's write waits and reaches the API
/// after that. Before: the 202 ended the older write's flight, the newer write went at once and
/// was performed first, then overwritten by the older one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_but_unperformed_write_is_held_for_the_deadline() {
    const D_MS: u64 = 1500;
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!("{}[fencing]\ninflight_deadline_ms = {D_MS}\n", routes(&api));
    let fg = Fencegate::start_local(dir.path(), &config).await;
    let c = Caller::new(&fg);
    let path = "/v1/hooks/7";
    api.script(path, Script::AcceptThenExecute(Duration::from_millis(D_MS - 300)));
    let accepted = c.write("POST", "/hook/7", 1, None, "old").await;
    assert_eq!(accepted.status, 202);
    let started = Instant::now();
    let new = c.write("POST", "/hook/7", 2, None, "new").await;
    assert_eq!(new.status, 201);
    assert!(started.elapsed() >= Duration::from_millis(D_MS - 300), "the newer write did not wait for the older");
    api.wait_for(path, 2).await;
    let order: Vec<Bytes> = api.received(path).into_iter().map(|r| r.body).collect();
    assert_eq!(order, vec![Bytes::from("old"), Bytes::from("new")], "the older write was performed last");
    assert_eq!(api.current_body(path), Some(Bytes::from("new")));
}

/// G3 when the older write's body is still streaming: the newer token cuts it off, the API
/// never gets it whole (so never executes it), its client gets 409, and the newer write goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_body_still_streaming_is_cut_off_by_a_newer_token() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);

    let mut slow = tokio::net::TcpStream::connect(fg.s3).await.unwrap();
    let head = "POST /hook/6 HTTP/1.1\r\nhost: x\r\nfencing-token: 1\r\ncontent-length: 1000\r\n\r\n";
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&[b'a'; 400]).await.unwrap();
    // The older write is admitted (its token is the fence) and streaming before the newer one
    // comes: its 409 below can then only be a cut-off, not a refusal at admission.
    fg.wait_for_fence("hook:6", 1).await;

    let new = c.write("POST", "/hook/6", 2, None, "new").await;
    assert_eq!(new.status, 201);
    let answer = read_head(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 409"), "{answer}");
    assert!(answer.contains("fencing-token-current: 2"), "{answer}");
    let received = api.received("/v1/hooks/6");
    assert_eq!(received.len(), 1, "only the newer write arrived whole: {received:?}");
    assert_eq!(received[0].body, Bytes::from("new"));
}

/// Reads a raw HTTP response until the end of its head (bounded by `WAIT_MAX`).
async fn read_head(stream: &mut tokio::net::TcpStream) -> String {
    let mut answer = Vec::new();
    let deadline = Instant::now() + WAIT_MAX;
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut buf = [0u8; 4096];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => answer.extend_from_slice(&buf[..n]),
            Ok(_) => break,
            Err(_) => panic!("no answer within {WAIT_MAX:?}: {:?}", String::from_utf8_lossy(&answer)),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// A write whose call stalls at the API past fencegate's deadline is answered 504 "outcome
/// unknown" but stays in flight: a newer token is forwarded only after the stalled write
/// executed (G3: nothing older commits after a newer write was forwarded). In `conditional`
/// mode the newer write then carries the ETag fencegate last saw, which the late write changed,
/// so the API refuses it (412) and nothing is lost; a read teaches fencegate the ETag. Also:
/// fencegate's `If-Match`/`If-None-Match` replace the client's, and a 412 goes back to the
/// client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_past_the_deadline_cannot_commit_an_older_conditional_write() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);
    let path = "/v1/docs/d1";

    let created = c.write("PUT", "/doc/d1", 1, None, "v1").await;
    assert_eq!(created.status, 200);
    let e1 = created.header("etag").unwrap().to_owned();
    assert_eq!(api.received(path)[0].if_none_match.as_deref(), Some("*"), "a create is If-None-Match: *");

    api.script(path, Script::StallThenExecute(Duration::from_millis(REQUEST_TIMEOUT_MS + 700)));
    let old = c.write("PUT", "/doc/d1", 1, None, "old").await;
    assert_eq!((old.status, old.code().as_str()), (504, "UpstreamOutcomeUnknown"));
    let new = c.write("PUT", "/doc/d1", 2, None, "new").await;
    assert_eq!(new.status, 412, "{:?}", new.body);

    let received = api.received(path);
    assert_eq!(received.len(), 3);
    let late = received.iter().find(|r| r.body.as_ref() == b"old").unwrap();
    let newer = received.iter().find(|r| r.body.as_ref() == b"new").unwrap();
    assert_eq!((late.if_match.as_deref(), newer.if_match.as_deref()), (Some(e1.as_str()), Some(e1.as_str())));
    assert!(late.execution.is_some(), "the stalled older write executed before the newer one was sent");
    assert_eq!(newer.execution, None, "the newer write was refused by its precondition, not lost");
    assert_eq!(api.current_body(path), Some(Bytes::from("old")));
    // A read teaches fencegate the ETag; the newer holder writes on top.
    assert_eq!(c.send("GET", "/doc/d1", &[], "").await.status, 200);
    assert_eq!(c.write("PUT", "/doc/d1", 2, None, "new").await.status, 200);

    // The ETag of the newer write is known now; a client's own precondition is replaced.
    let next = c.send("PUT", "/doc/d1", &[("fencing-token", "2"), ("if-match", "\"bogus\"")], "next").await;
    assert_eq!(next.status, 200);
    assert_eq!(api.received(path).last().unwrap().if_match.as_deref(), newer_etag(&api, "new").as_deref());
    // A change behind fencegate's back: the next write gets the API's 412, not retried.
    api.state.lock().unwrap().current.insert(path.into(), ("\"elsewhere\"".into(), Bytes::from("x")));
    let refused = c.write("PUT", "/doc/d1", 2, None, "lost").await;
    assert_eq!(refused.status, 412);
    assert_eq!(api.received(path).len(), 6, "one attempt, no retry");
    // A read through fencegate teaches it the current ETag.
    assert_eq!(c.send("GET", "/doc/d1", &[], "").await.status, 200);
    assert_eq!(c.write("PUT", "/doc/d1", 2, None, "after-read").await.status, 200);
    assert!(metrics(&fg).await.contains("fencegate_ambiguous_outcomes_total{op=\"api\"}"));
}

/// The ETag the API gave the write with `body`.
fn newer_etag(api: &FakeApi, body: &str) -> Option<String> {
    let execution =
        api.ledger().into_iter().filter(|r| r.body.as_ref() == body.as_bytes()).find_map(|r| r.execution)?;
    Some(format!("\"e{execution}\""))
}

/// An ambiguous outcome (the connection dropped after the API executed; or no answer before
/// the deadline) is reported with 502/504 `UpstreamOutcomeUnknown`, recorded, and answered
/// from the record on every retry: the API executes it exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_outcome_is_never_executed_twice() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let fg = Fencegate::start_local(dir.path(), &routes(&api)).await;
    let c = Caller::new(&fg);

    api.script("/v1/payments/9/charges", Script::ExecuteThenDrop);
    let dropped = c.write("POST", "/pay/9/charges", 1, Some("amb-1"), "{\"amount\":5}").await;
    assert_eq!((dropped.status, dropped.code().as_str()), (502, "UpstreamOutcomeUnknown"));
    let upstream_key = api.received("/v1/payments/9/charges")[0].idempotency_key.clone().unwrap();
    assert_eq!(dropped.json()["upstream_idempotency_key"], upstream_key.as_str(), "reported for reconciliation");
    for _ in 0..3 {
        let retry = c.write("POST", "/pay/9/charges", 1, Some("amb-1"), "{\"amount\":5}").await;
        assert_eq!((retry.status, retry.code().as_str()), (502, "UpstreamOutcomeUnknown"));
    }
    assert_eq!(api.received("/v1/payments/9/charges").len(), 1);

    api.script("/v1/payments/10/charges", Script::StallThenExecute(Duration::from_millis(REQUEST_TIMEOUT_MS + 400)));
    let timed_out = c.write("POST", "/pay/10/charges", 1, None, "{\"amount\":6}").await;
    assert_eq!((timed_out.status, timed_out.code().as_str()), (504, "UpstreamOutcomeUnknown"));
    api.wait_for("/v1/payments/10/charges", 1).await;
    for _ in 0..3 {
        let retry = c.write("POST", "/pay/10/charges", 1, None, "{\"amount\":6}").await;
        assert_eq!((retry.status, retry.code().as_str()), (504, "UpstreamOutcomeUnknown"));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(api.received("/v1/payments/10/charges").len(), 1, "executed once, never re-sent");
    let m = metrics(&fg).await;
    assert!(m.contains("fencegate_ambiguous_outcomes_total{op=\"api\"}"), "{m}");
}

/// https upstreams: certificates are verified, against the route's own CA when
/// `ca_cert_path` is set; an upstream with an unknown CA is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstreams_are_verified() {
    let certs = tempfile::tempdir().unwrap();
    let tls = common::make_test_tls(certs.path());
    let api = FakeApi::start(Some(fencegate::net::server::tls_acceptor(&tls.cert, &tls.key).unwrap())).await;
    let dir = tempfile::tempdir().unwrap();
    let routes = format!(
        "[[routes]]\nprefix = \"/private/\"\nupstream = \"{}\"\nresource = \"p:{{1}}\"\nmode = \"fence-only\"\n\
         ca_cert_path = \"{}\"\nadvance = \"write\"\n\
         [[routes]]\nprefix = \"/public/\"\nupstream = \"{}\"\nresource = \"p:{{1}}\"\nmode = \"fence-only\"\n\
         advance = \"write\"\n",
        api.url("https", "/v1/"),
        tls.ca_path.display(),
        api.url("https", "/v1/"),
    );
    let fg = Fencegate::start_local(dir.path(), &routes).await;
    let c = Caller::new(&fg);
    let trusted = c.write("POST", "/private/1", 1, None, "over tls").await;
    assert_eq!(trusted.status, 201, "{:?}", trusted.body);
    let untrusted = c.write("POST", "/public/1", 1, None, "over tls").await;
    assert_eq!((untrusted.status, untrusted.code().as_str()), (502, "UpstreamUnavailable"));
    assert_eq!(api.ledger().len(), 1);
}

/// Every mode serves a bounded concurrent load with every write answered 2xx, against the real
/// binary; the latency each mode adds over calling the fake API directly is printed. In CI it
/// runs small on the debug build; the figures in the closing notes come from a release build:
///
/// ```sh
/// cargo build --release -p fencegate
/// FENCEGATE_BIN=target/release/fencegate FENCEGATE_LATENCY_REQUESTS=2000 FENCEGATE_LATENCY_ROUNDS=3 \
///     cargo test -p fencegate --test gateway -- --nocapture latency
/// ```
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_serves_a_concurrent_load_and_reports_its_latency() {
    let setting = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let requests: usize = setting("FENCEGATE_LATENCY_REQUESTS", 200);
    let rounds: usize = setting("FENCEGATE_LATENCY_ROUNDS", 1);
    const CONCURRENCY: usize = 8;
    let bin = std::env::var("FENCEGATE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_fencegate").into());
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [store]\nkind = \"embedded\"\npath = \"{}\"\n[upstream]\nkind = \"local\"\npath = \"{}\"\nprobe = \"off\"\n\
         [[credentials]]\naccess_key_id = \"k\"\nsecret_access_key = \"s\"\n[log]\nlevel = \"warn\"\n{}",
        dir.path().join("fences").display(),
        dir.path().join("objects").display(),
        routes(&api),
    );
    let config_path = dir.path().join("fencegate.toml");
    std::fs::write(&config_path, config).unwrap();
    let (mut child, s3) = tokio::task::block_in_place(|| common::spawn_fencegate(&bin, &config_path, WAIT_MAX));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).pool_max_idle_per_host(CONCURRENCY).build_http();
    let direct = format!("http://{}/v1", api.addr);
    let via = format!("http://{s3}");
    let paths: [(&str, String, &str); 4] = [
        ("direct", format!("{direct}/hooks"), "PUT"),
        ("fence-only", format!("{via}/hook"), "PUT"),
        ("conditional", format!("{via}/doc"), "PUT"),
        ("idempotency-key", format!("{via}/pay"), "POST"),
    ];
    // Paths interleaved in rounds, so a burst of other work on the machine hits all of them;
    // each figure is the median over the rounds.
    let mut figures: Vec<Vec<[f64; 3]>> = vec![Vec::new(); paths.len()];
    for _round in 0..rounds {
        for (i, (_, base, method)) in paths.iter().enumerate() {
            // Warm-up: connections, first advances, first ETags.
            run_load(&client, base, method, CONCURRENCY * 4, CONCURRENCY).await;
            let mut lat = run_load(&client, base, method, requests, CONCURRENCY).await;
            lat.sort();
            let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1000.0;
            let mean = lat.iter().map(Duration::as_secs_f64).sum::<f64>() / lat.len() as f64 * 1000.0;
            figures[i].push([mean, pct(0.50), pct(0.99)]);
        }
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let summary: Vec<[f64; 3]> = figures
        .iter()
        .map(|rounds| std::array::from_fn(|k| median(&mut rounds.iter().map(|f| f[k]).collect())))
        .collect();
    println!("{requests} writes per run, {CONCURRENCY} concurrent, median of {rounds} rounds (ms):");
    println!("| path | mean | p50 | p99 | added mean | added p50 | added p99 |");
    println!("|---|---|---|---|---|---|---|");
    for (i, (name, _, _)) in paths.iter().enumerate() {
        let [mean, p50, p99] = summary[i];
        let [d_mean, d50, d99] = summary[0];
        println!(
            "| {name} | {mean:.2} | {p50:.2} | {p99:.2} | {:+.2} | {:+.2} | {:+.2} |",
            mean - d_mean,
            p50 - d50,
            p99 - d99
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `total` writes, `concurrency` at a time; worker `w` writes resource `w` with token 1, every
/// request its own (a fresh body, so a fresh request id). Returns each latency.
async fn run_load(
    client: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    method: &str,
    total: usize,
    concurrency: usize,
) -> Vec<Duration> {
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut workers = Vec::new();
    for w in 0..concurrency {
        let (client, uri, method) = (client.clone(), format!("{base}/w{w}"), method.parse::<Method>().unwrap());
        let n = total / concurrency + usize::from(w < total % concurrency);
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(n);
            for _ in 0..n {
                let seq = SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let mut req = http::Request::new(Full::new(Bytes::from(format!(
                    "{{\"seq\":{seq},\"pad\":\"{}\"}}",
                    "x".repeat(200)
                ))));
                *req.method_mut() = method.clone();
                *req.uri_mut() = uri.parse().unwrap();
                req.headers_mut().insert("fencing-token", "1".parse().unwrap());
                req.headers_mut().insert("content-type", "application/json".parse().unwrap());
                let started = Instant::now();
                let resp = client.request(req).await.unwrap();
                let status = resp.status();
                resp.into_body().collect().await.unwrap();
                latencies.push(started.elapsed());
                assert!(status.is_success(), "{uri}: {status}");
            }
            latencies
        }));
    }
    let mut all = Vec::with_capacity(total);
    for w in workers {
        all.extend(w.await.unwrap());
    }
    all
}

/// A route's callers are not authenticated by fencegate, so by default a write through a route
/// cannot raise a fence (whoever could would lock the resource for good): a token above the
/// fence gets 409 `FencingTokenUnregistered` and nothing reaches the API; once the token is
/// registered (or granted), writes with it go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_route_write_cannot_raise_a_fence() {
    let api = FakeApi::start(None).await;
    let dir = tempfile::tempdir().unwrap();
    let route = format!(
        "[[routes]]\nprefix = \"/hook/\"\nupstream = \"{}\"\nresource = \"hook:{{1}}\"\nmode = \"fence-only\"\n",
        api.url("http", "/v1/hooks/")
    );
    let fg = Fencegate::start_local(dir.path(), &route).await;
    let c = Caller::new(&fg);
    let refused = c.write("POST", "/hook/1", 18_446_744_073_709_551_615, None, "{}").await;
    assert_eq!((refused.status, refused.code().as_str()), (409, "FencingTokenUnregistered"));
    assert!(api.ledger().is_empty(), "nothing reached the API");

    let admin: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut register = http::Request::new(Full::new(Bytes::from_static(b"{\"token\": 4}")));
    *register.method_mut() = Method::PUT;
    *register.uri_mut() = format!("http://{}/v1/fences/hook:1", fg.admin).parse().unwrap();
    assert_eq!(admin.request(register).await.unwrap().status(), 200);
    assert_eq!(c.write("POST", "/hook/1", 4, None, "{}").await.status, 201);
    let above = c.write("POST", "/hook/1", 5, None, "{}").await;
    assert_eq!((above.status, above.header("fencing-token-current")), (409, Some("4")));
    assert_eq!(c.write("POST", "/hook/1", 3, None, "{}").await.code(), "FencingTokenStale");
    assert_eq!(api.ledger().len(), 1);
}
