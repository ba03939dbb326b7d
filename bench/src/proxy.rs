//! The bare hyper reverse proxy on the benchmarks' ladder: what the Rust stack costs with none of
//! fencegate's work. Accept, rewrite the URI to the upstream, forward through hyper-util's
//! pooled legacy client, stream both bodies. No authentication, no fence, no re-signing: the
//! upstream fixture accepts any signature, so the client's own `Authorization` goes through.
//!
//! It runs on tokio's multi-threaded runtime like fencegate (`--threads`), so the two rows
//! differ only in what each does per request.
//!
//! With `--sigv4 --reject` it is the **verifying 409 ceiling**: the signature checked, then the
//! 409 ceiling's answer, nothing forwarded (the floor under a stale write's rejection).
//!
//! With `--sigv4` it is the **signing proxy**: the same proxy doing the two things every
//! fenced write must do besides proxying, with fencegate's own code (`fencegate::aws::sigv4`, the
//! lean path's check with its signing keys cached, and the re-signing fencegate does for the
//! upstream): it verifies the client's SigV4 signature (403 when it does not verify) and signs
//! the request anew with the upstream's key. Its row is the floor under fencegate's accepted
//! writes: what the signatures alone cost on top of the bare proxy, with no S3 routing, no
//! fence, no conditional headers and no write held to its outcome. It is a floor, not a twin:
//! it does not check the request's shape as fencegate's lean path does (path, query, payload
//! mode), which the bench's requests all pass.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use fencegate::aws::sigv4::{Signer, Verifier};

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = BoxBody<bytes::Bytes, hyper::Error>;

/// The credentials the load client signs with: the signing proxy verifies them.
const CLIENT_KEY: (&str, &str) = (crate::sign::ACCESS_KEY_ID, crate::sign::SECRET_ACCESS_KEY);
/// The key the signing proxy signs the upstream's requests with (the bench's fencegate uses
/// the same; the in-memory upstream accepts any signature).
const UPSTREAM_KEY: (&str, &str) = ("bench-upstream", "bench-upstream-secret");

/// A verifier that knows one access key and its secret.
fn verifier((access_key_id, secret): (&str, &str)) -> Verifier {
    Verifier::new(HashMap::from([(access_key_id.to_owned(), secret.to_owned())]))
}

/// What the signing proxy adds: the client's signature checked, the upstream's made.
struct Signing {
    verifier: Verifier,
    signer: Signer,
    /// The upstream's `host`, which its signature covers.
    host: HeaderValue,
}

/// Binds `listen`, reports the bound address through `on_bound`, and proxies to `upstream`
/// until the process ends; with `sigv4`, as the signing proxy (see the module's doc).
pub async fn serve(
    listen: SocketAddr,
    upstream: SocketAddr,
    sigv4: bool,
    reject: bool,
    on_bound: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    on_bound(listener.local_addr()?);
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build(connector);
    let authority: Authority = upstream.to_string().parse()?;
    let signing = sigv4.then(|| {
        Arc::new(Signing {
            verifier: verifier(CLIENT_KEY),
            signer: Signer::new(UPSTREAM_KEY.0.into(), UPSTREAM_KEY.1.into(), crate::sign::REGION.into()),
            host: HeaderValue::from_str(authority.as_str()).expect("an authority is a header value"),
        })
    });
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, authority, signing) = (client.clone(), authority.clone(), signing.clone());
        tokio::spawn(async move {
            let service =
                service_fn(move |req| forward(client.clone(), authority.clone(), signing.clone(), reject, req));
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn forward(
    client: Client<HttpConnector, Incoming>,
    authority: Authority,
    signing: Option<Arc<Signing>>,
    reject: bool,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    if let Some(signing) = &signing {
        // Checked on the request as received (its path and `host` are what the client signed).
        let now = SystemTime::now();
        if signing.verifier.verify(req.method().as_str(), req.uri(), req.headers(), now).is_none() {
            return Ok(empty(StatusCode::FORBIDDEN));
        }
        if reject {
            // The verifying 409 ceiling: the least a rejection that knows who asks costs.
            return Ok(crate::upstream::reject().map(|body| body.map_err(|never| match never {}).boxed()));
        }
        req.headers_mut().insert(http::header::HOST, signing.host.clone());
        if signing.signer.sign(&mut req, now).is_err() {
            return Ok(empty(StatusCode::INTERNAL_SERVER_ERROR));
        }
    }
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = Some(Scheme::HTTP);
    parts.authority = Some(authority);
    *req.uri_mut() = Uri::from_parts(parts).expect("a path with a scheme and an authority is a URI");
    Ok(match client.request(req).await {
        Ok(resp) => resp.map(BodyExt::boxed),
        Err(_) => empty(StatusCode::BAD_GATEWAY),
    })
}

fn empty(status: StatusCode) -> Response<Body> {
    let mut resp = Response::new(http_body_util::Empty::new().map_err(|never| match never {}).boxed());
    *resp.status_mut() = status;
    resp
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use bytes::Bytes;
    use http::{HeaderMap, Method};
    use http_body_util::{BodyExt, Full};

    use super::*;
    use crate::sign;

    /// What the capturing upstream received: each request's head and body.
    type Received = Arc<Mutex<Vec<(http::request::Parts, Bytes)>>>;

    /// An upstream that keeps every request it receives and answers 200 with an empty body.
    async fn capturing_upstream() -> (SocketAddr, Received) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("an address");
        let received = Received::default();
        let kept = received.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let kept = kept.clone();
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await?.to_bytes();
                            kept.lock().expect("not poisoned").push((parts, body));
                            Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (addr, received)
    }

    /// The signing proxy (or, with `reject`, the verifying 409 ceiling) in front of `upstream`.
    async fn signing_proxy(upstream: SocketAddr, reject: bool) -> SocketAddr {
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(serve("127.0.0.1:0".parse().unwrap(), upstream, true, reject, move |a| {
            let _ = tx.send(a);
        }));
        rx.await.expect("the proxy reports its address")
    }

    async fn send(addr: SocketAddr, path: &str, headers: HeaderMap, body: &'static str) -> u16 {
        let mut sender = crate::load::connect::<Full<Bytes>>(addr).await.expect("connects");
        let mut req = Request::new(Full::new(Bytes::from_static(body.as_bytes())));
        *req.method_mut() = Method::PUT;
        *req.uri_mut() = path.parse().expect("a path");
        *req.headers_mut() = headers;
        sender.ready().await.expect("ready");
        sender.send_request(req).await.expect("answered").status().as_u16()
    }

    /// The signing proxy forwards what the bench's client signed, signed anew with the
    /// upstream's key for the upstream's host, and refuses a signature that does not verify
    /// (altered, made with another secret, or missing) without forwarding it: its row measures
    /// both signatures.
    #[tokio::test]
    async fn the_signing_proxy_checks_and_signs_anew() {
        let (upstream, received) = capturing_upstream().await;
        let proxy = signing_proxy(upstream, false).await;
        let authority = proxy.to_string();
        let length = [(http::header::CONTENT_LENGTH, HeaderValue::from(4))];
        let head = |signer: &sign::Signer| signer.sign(&Method::PUT, &authority, "/bench/k", &length).unwrap();
        let client = sign::Signer::new(sign::ACCESS_KEY_ID, sign::SECRET_ACCESS_KEY, sign::REGION);

        assert_eq!(send(proxy, "/bench/k", head(&client), "good").await, 200, "a verified write is forwarded");

        let mut altered = head(&client);
        let value = altered[http::header::AUTHORIZATION].to_str().unwrap().to_owned();
        let last = if value.ends_with('0') { '1' } else { '0' };
        let value = format!("{}{last}", &value[..value.len() - 1]);
        altered.insert(http::header::AUTHORIZATION, HeaderValue::from_str(&value).unwrap());
        assert_eq!(send(proxy, "/bench/k", altered, "bad1").await, 403);
        let stranger = sign::Signer::new(sign::ACCESS_KEY_ID, "another-secret", sign::REGION);
        assert_eq!(send(proxy, "/bench/k", head(&stranger), "bad2").await, 403);
        assert_eq!(send(proxy, "/bench/k", HeaderMap::new(), "bad3").await, 403);

        let received = received.lock().unwrap();
        assert_eq!(received.len(), 1, "only the verified write reached the upstream");
        let (parts, body) = &received[0];
        assert_eq!(&body[..], b"good");
        assert_eq!(parts.headers[http::header::HOST], upstream.to_string().as_str());
        let verified =
            verifier(UPSTREAM_KEY).verify(parts.method.as_str(), &parts.uri, &parts.headers, SystemTime::now());
        assert!(verified.is_some(), "the upstream's request carries a signature by the upstream's key");
        assert!(
            verifier(CLIENT_KEY).verify(parts.method.as_str(), &parts.uri, &parts.headers, SystemTime::now()).is_none()
        );
    }

    /// The verifying 409 ceiling answers a verified write 409 and forwards nothing; a write
    /// that does not verify still gets 403.
    #[tokio::test]
    async fn the_verifying_ceiling_checks_then_refuses_without_forwarding() {
        let (upstream, received) = capturing_upstream().await;
        let proxy = signing_proxy(upstream, true).await;
        let authority = proxy.to_string();
        let length = [(http::header::CONTENT_LENGTH, HeaderValue::from(4))];
        let client = sign::Signer::new(sign::ACCESS_KEY_ID, sign::SECRET_ACCESS_KEY, sign::REGION);
        let head = client.sign(&Method::PUT, &authority, "/bench/k", &length).unwrap();
        assert_eq!(send(proxy, "/bench/k", head, "good").await, 409);
        assert_eq!(send(proxy, "/bench/k", HeaderMap::new(), "bad!").await, 403);
        assert!(received.lock().unwrap().is_empty(), "nothing reached the upstream");
    }
}
