//! The bare hyper reverse proxy of issue 16's ladder: what the Rust stack costs with none of
//! fencegate's work. Accept, rewrite the URI to the upstream, forward through hyper-util's
//! pooled legacy client, stream both bodies. No authentication, no fence, no re-signing: the
//! upstream fixture accepts any signature, so the client's own `Authorization` goes through.
//!
//! It runs on tokio's multi-threaded runtime like fencegate (`--threads`), so the two rows
//! differ only in what each does per request.

use std::convert::Infallible;
use std::net::SocketAddr;

use http::uri::{Authority, Scheme};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = BoxBody<bytes::Bytes, hyper::Error>;

/// Binds `listen`, reports the bound address through `on_bound`, and proxies to `upstream`
/// until the process ends.
pub async fn serve(listen: SocketAddr, upstream: SocketAddr, on_bound: impl FnOnce(SocketAddr)) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    on_bound(listener.local_addr()?);
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build(connector);
    let authority: Authority = upstream.to_string().parse()?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, authority) = (client.clone(), authority.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| forward(client.clone(), authority.clone(), req));
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
    mut req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let mut parts = req.uri().clone().into_parts();
    parts.scheme = Some(Scheme::HTTP);
    parts.authority = Some(authority);
    *req.uri_mut() = Uri::from_parts(parts).expect("a path with a scheme and an authority is a URI");
    Ok(match client.request(req).await {
        Ok(resp) => resp.map(BodyExt::boxed),
        Err(_) => {
            let mut resp = Response::new(http_body_util::Empty::new().map_err(|never| match never {}).boxed());
            *resp.status_mut() = StatusCode::BAD_GATEWAY;
            resp
        }
    })
}
