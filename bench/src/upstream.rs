//! The in-memory S3-compatible upstream: the fast fixture that every path of the benchmark
//! writes to, so that what differs between the paths is the proxy in front of it.
//!
//! It is a benchmark fixture, not a store: it accepts ANY SigV4 signature without verifying
//! it (fencegate, nginx and the bench client all sign with different keys or not at all, and
//! verification would only add the fixture's own cost to every figure). Never expose it.
//!
//! What it implements is what fencegate's forwarding relies on: PutObject with `If-Match` /
//! `If-None-Match: *` checked atomically with the commit (412 `PreconditionFailed`), stored
//! `x-amz-meta-*` metadata, unique ETags, HeadObject, GetObject, DeleteObject, CreateBucket
//! and ListBuckets. A body larger than `retain_bytes_max` is counted and discarded, so a 1 GiB
//! upload does not cost 1 GiB of memory here; reading such an object back streams filler bytes
//! of the right length.
//!
//! `Mode::RejectAll` turns it into the rejection ceiling of docs/benchmarks.md: a bare hyper server that
//! answers 409 to everything without reading the body.

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Bodies up to this size are kept; larger ones are counted and dropped.
pub const RETAIN_BYTES_MAX_DEFAULT: usize = 1024 * 1024;
/// Object map shards: writers on different objects rarely share a lock.
const SHARDS: usize = 32;
/// Size of the filler chunks streamed for an object whose body was discarded.
const FILLER_CHUNK_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// An S3-compatible object store in memory.
    Store,
    /// 409 to every request, body never read: the ceiling for a rejection.
    RejectAll,
}

type RespBody = BoxBody<Bytes, Infallible>;

/// One stored object.
#[derive(Clone)]
struct Object {
    etag: HeaderValue,
    /// `x-amz-meta-*` and `content-type`, as sent.
    metadata: Vec<(http::HeaderName, HeaderValue)>,
    content: Content,
}

#[derive(Clone)]
enum Content {
    Kept(Bytes),
    /// Larger than `retain_bytes_max`: only the length is remembered.
    Discarded {
        len: u64,
    },
}

impl Content {
    fn len(&self) -> u64 {
        match self {
            Self::Kept(b) => b.len() as u64,
            Self::Discarded { len } => *len,
        }
    }
}

/// The store's state, shared by every connection.
pub struct Store {
    buckets: Mutex<BTreeSet<String>>,
    shards: Vec<Mutex<HashMap<String, Object>>>,
    hasher: RandomState,
    /// ETags are a boot nonce and a counter: unique, and cheaper than an MD5 of the body
    /// (which would put the fixture's hashing cost into every figure).
    etag_nonce: u64,
    etag_counter: AtomicU64,
    retain_bytes_max: usize,
    filler: Bytes,
}

impl Store {
    pub fn new(retain_bytes_max: usize) -> Self {
        let nonce =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id());
        Self {
            buckets: Mutex::new(BTreeSet::new()),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            etag_nonce: nonce,
            etag_counter: AtomicU64::new(1),
            retain_bytes_max,
            filler: Bytes::from(vec![b'f'; FILLER_CHUNK_BYTES]),
        }
    }

    fn shard(&self, path: &str) -> &Mutex<HashMap<String, Object>> {
        &self.shards[(self.hasher.hash_one(path) as usize) % SHARDS]
    }

    fn next_etag(&self) -> HeaderValue {
        let n = self.etag_counter.fetch_add(1, Ordering::Relaxed);
        HeaderValue::from_str(&format!("\"{:016x}{:016x}\"", self.etag_nonce, n)).expect("hex is a valid header value")
    }

    fn has_bucket(&self, bucket: &str) -> bool {
        self.buckets.lock().expect("bucket lock").contains(bucket)
    }

    fn get(&self, path: &str) -> Option<Object> {
        self.shard(path).lock().expect("shard lock").get(path).cloned()
    }
}

/// Binds `addr` and serves until the process ends. Returns the bound address through
/// `on_bound` before serving.
pub async fn serve(
    addr: SocketAddr,
    mode: Mode,
    retain_bytes_max: usize,
    on_bound: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    on_bound(listener.local_addr()?);
    let store = Arc::new(Store::new(retain_bytes_max));
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let store = store.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let store = store.clone();
                async move {
                    Ok::<_, Infallible>(match mode {
                        Mode::RejectAll => reject(),
                        Mode::Store => handle(&store, req).await,
                    })
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The ceiling's answer: a 409 with an S3 error document.
pub fn reject() -> Response<RespBody> {
    xml_error(StatusCode::CONFLICT, "FencingTokenStale", "the rejection ceiling answers 409 to everything")
}

async fn handle(store: &Store, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_owned();
    let trimmed = path.trim_start_matches('/');
    let (bucket, key) = match trimmed.split_once('/') {
        Some((b, k)) if !k.is_empty() => (b, Some(k)),
        Some((b, _)) => (b, None),
        None => (trimmed, None),
    };
    match (req.method().clone(), bucket.is_empty(), key) {
        (Method::GET, true, _) => list_buckets(store),
        (Method::PUT, false, None) => {
            store.buckets.lock().expect("bucket lock").insert(bucket.to_owned());
            empty(StatusCode::OK)
        }
        (Method::HEAD | Method::GET, false, None) if store.has_bucket(bucket) => {
            // ListObjects is not needed by the benchmark: an empty listing.
            let xml = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>{bucket}</Name>\
                 <KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>"
            );
            xml_response(StatusCode::OK, xml)
        }
        (_, false, Some(_)) if !store.has_bucket(bucket) => {
            xml_error(StatusCode::NOT_FOUND, "NoSuchBucket", "the bucket does not exist")
        }
        (Method::PUT, false, Some(_)) => put_object(store, &path, req).await,
        (Method::HEAD, false, Some(_)) => head_object(store, &path),
        (Method::GET, false, Some(_)) => get_object(store, &path),
        (Method::DELETE, false, Some(_)) => delete_object(store, &path, req.headers()),
        _ => xml_error(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            "the benchmark upstream does not implement this request",
        ),
    }
}

/// The precondition a write carries, checked against the object as it is.
fn precondition_holds(headers: &HeaderMap, current: Option<&Object>) -> bool {
    if let Some(v) = headers.get(header::IF_NONE_MATCH)
        && v.as_bytes() == b"*"
        && current.is_some()
    {
        return false;
    }
    if let Some(wanted) = headers.get(header::IF_MATCH) {
        return match current {
            None => false,
            Some(o) => wanted.as_bytes() == b"*" || wanted == o.etag,
        };
    }
    true
}

async fn put_object(store: &Store, path: &str, req: Request<Incoming>) -> Response<RespBody> {
    let (parts, body) = req.into_parts();
    // Checked once before the body is read (fail fast), and again at the commit (atomic).
    if !precondition_holds(&parts.headers, store.get(path).as_ref()) {
        return precondition_failed();
    }
    let declared: Option<u64> =
        parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let content = match read_body(body, store.retain_bytes_max).await {
        Ok(content) => content,
        // A truncated body commits nothing.
        Err(()) => return empty(StatusCode::BAD_REQUEST),
    };
    if declared.is_some_and(|n| n != content.len()) {
        return empty(StatusCode::BAD_REQUEST);
    }
    let metadata = parts
        .headers
        .iter()
        .filter(|(n, _)| n.as_str().starts_with("x-amz-meta-") || *n == header::CONTENT_TYPE)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    let etag = store.next_etag();
    {
        let mut shard = store.shard(path).lock().expect("shard lock");
        if !precondition_holds(&parts.headers, shard.get(path)) {
            return precondition_failed();
        }
        shard.insert(path.to_owned(), Object { etag: etag.clone(), metadata, content });
    }
    let mut resp = empty(StatusCode::OK);
    resp.headers_mut().insert(header::ETAG, etag);
    resp
}

/// Reads the whole body; keeps it when small, else only counts it.
async fn read_body(mut body: Incoming, retain_bytes_max: usize) -> Result<Content, ()> {
    let mut kept = BytesMut::new();
    let mut len: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ())?;
        if let Ok(data) = frame.into_data() {
            len += data.len() as u64;
            if len <= retain_bytes_max as u64 {
                kept.extend_from_slice(&data);
            } else if !kept.is_empty() {
                kept = BytesMut::new();
            }
        }
    }
    Ok(if len <= retain_bytes_max as u64 { Content::Kept(kept.freeze()) } else { Content::Discarded { len } })
}

fn object_headers(resp: &mut Response<RespBody>, object: &Object) {
    let headers = resp.headers_mut();
    headers.insert(header::ETAG, object.etag.clone());
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(object.content.len()));
    for (name, value) in &object.metadata {
        headers.insert(name.clone(), value.clone());
    }
}

fn head_object(store: &Store, path: &str) -> Response<RespBody> {
    match store.get(path) {
        None => empty(StatusCode::NOT_FOUND),
        Some(object) => {
            let mut resp = empty(StatusCode::OK);
            object_headers(&mut resp, &object);
            resp
        }
    }
}

fn get_object(store: &Store, path: &str) -> Response<RespBody> {
    let Some(object) = store.get(path) else {
        return xml_error(StatusCode::NOT_FOUND, "NoSuchKey", "the key does not exist");
    };
    let body = match &object.content {
        Content::Kept(bytes) => Full::new(bytes.clone()).boxed(),
        Content::Discarded { len } => filler_body(store.filler.clone(), *len),
    };
    let mut resp = Response::new(body);
    object_headers(&mut resp, &object);
    resp
}

/// `len` bytes of filler, streamed in shared chunks (no copy, no allocation per chunk).
fn filler_body(chunk: Bytes, len: u64) -> RespBody {
    let full_chunks = len / chunk.len() as u64;
    let rest = (len % chunk.len() as u64) as usize;
    let tail = chunk.slice(..rest);
    let frames = (0..full_chunks)
        .map(move |_| chunk.clone())
        .chain(std::iter::once(tail).filter(|t| !t.is_empty()))
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

fn delete_object(store: &Store, path: &str, headers: &HeaderMap) -> Response<RespBody> {
    let mut shard = store.shard(path).lock().expect("shard lock");
    if headers.contains_key(header::IF_MATCH) && !precondition_holds(headers, shard.get(path)) {
        return precondition_failed();
    }
    shard.remove(path);
    empty(StatusCode::NO_CONTENT)
}

fn list_buckets(store: &Store) -> Response<RespBody> {
    let mut xml = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListAllMyBucketsResult>\
         <Owner><ID>bench</ID><DisplayName>bench</DisplayName></Owner><Buckets>",
    );
    for b in store.buckets.lock().expect("bucket lock").iter() {
        xml.push_str(&format!(
            "<Bucket><Name>{b}</Name><CreationDate>2026-01-01T00:00:00.000Z</CreationDate></Bucket>"
        ));
    }
    xml.push_str("</Buckets></ListAllMyBucketsResult>");
    xml_response(StatusCode::OK, xml)
}

fn precondition_failed() -> Response<RespBody> {
    xml_error(
        StatusCode::PRECONDITION_FAILED,
        "PreconditionFailed",
        "At least one of the pre-conditions you specified did not hold",
    )
}

fn empty(status: StatusCode) -> Response<RespBody> {
    let mut resp = Response::new(Empty::new().boxed());
    *resp.status_mut() = status;
    resp
}

fn xml_response(status: StatusCode, xml: String) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(Bytes::from(xml)).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    resp
}

fn xml_error(status: StatusCode, code: &str, message: &str) -> Response<RespBody> {
    xml_response(
        status,
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
             <Message>{message}</Message><Resource></Resource><RequestId>bench</RequestId></Error>"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(etag: &'static str) -> Object {
        Object { etag: HeaderValue::from_static(etag), metadata: vec![], content: Content::Kept(Bytes::new()) }
    }

    /// The preconditions fencegate relies on (G4) are enforced like S3 does.
    #[test]
    fn preconditions_follow_s3() {
        let mut h = HeaderMap::new();
        assert!(precondition_holds(&h, None));
        h.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        assert!(precondition_holds(&h, None));
        assert!(!precondition_holds(&h, Some(&object("\"a\""))));
        let mut h = HeaderMap::new();
        h.insert(header::IF_MATCH, HeaderValue::from_static("\"a\""));
        assert!(!precondition_holds(&h, None));
        assert!(precondition_holds(&h, Some(&object("\"a\""))));
        assert!(!precondition_holds(&h, Some(&object("\"b\""))));
    }
}
