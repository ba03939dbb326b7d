//! A walk of every fence through the admin API, in pages (`GET /v1/fences?limit=N&after=R`):
//! how long listing a large store takes, page by page, on one keep-alive connection.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

/// What a walk saw.
pub struct Walk {
    pub fences: u64,
    pub pages: u64,
    pub took: Duration,
    pub slowest_page: Duration,
}

/// Walks every fence in pages of `limit`, at most `pages_max` pages.
pub async fn walk(admin: SocketAddr, limit: usize, pages_max: u64) -> anyhow::Result<Walk> {
    let stream = tokio::net::TcpStream::connect(admin).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let started = Instant::now();
    let mut walk = Walk { fences: 0, pages: 0, took: Duration::ZERO, slowest_page: Duration::ZERO };
    let mut after: Option<String> = None;
    while walk.pages < pages_max {
        let mut uri = format!("/v1/fences?limit={limit}");
        if let Some(after) = &after {
            uri.push_str("&after=");
            uri.extend(form_escape(after));
        }
        let page_started = Instant::now();
        let req = http::Request::get(uri).header(http::header::HOST, admin.to_string()).body(Empty::<Bytes>::new())?;
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        anyhow::ensure!(resp.status() == http::StatusCode::OK, "GET /v1/fences answered {}", resp.status());
        let body = resp.into_body().collect().await?.to_bytes();
        walk.slowest_page = walk.slowest_page.max(page_started.elapsed());
        let page: serde_json::Value = serde_json::from_slice(&body)?;
        walk.fences += page["fences"].as_array().map_or(0, |f| f.len() as u64);
        walk.pages += 1;
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    walk.took = started.elapsed();
    Ok(walk)
}

/// `value` as a query parameter's value.
fn form_escape(value: &str) -> impl Iterator<Item = String> + '_ {
    value.bytes().map(|b| match b {
        b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
        _ => format!("%{b:02X}"),
    })
}
