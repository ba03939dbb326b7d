//! The embedded upstream: an S3 store on a local directory (s3s-fs), driven in-process through
//! the same HTTP-shaped interface as a remote upstream.
//!
//! Conditional writes are made atomic here: s3s-fs checks `If-Match`/`If-None-Match` and then
//! writes, so two writers could both pass the check; every object write takes a per-object
//! lock (striped) around the call, which closes that gap. s3s-fs checks them on PutObject and
//! CompleteMultipartUpload only; for CopyObject and DeleteObject the check is made here, under
//! the same lock, so every conditional write fencegate relies on is enforced (the start-up
//! probe shows it).

use std::hash::{BuildHasher, RandomState};
use std::path::Path;

use async_trait::async_trait;
use http::Method;
use s3s::Body;
use s3s::service::{S3Service, S3ServiceBuilder};

use super::{Upstream, UpstreamError};

/// Lock stripes for object writes; collisions only serialise unrelated writes.
const OBJECT_LOCK_STRIPES: usize = 1024;

pub struct LocalUpstream {
    root: std::path::PathBuf,
    service: S3Service,
    object_locks: Vec<tokio::sync::Mutex<()>>,
    hasher: RandomState,
}

impl LocalUpstream {
    pub fn open(root: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(root)
            .map_err(|e| anyhow::anyhow!("cannot create the local upstream directory {}: {e}", root.display()))?;
        let fs = s3s_fs::FileSystem::new(root)
            .map_err(|e| anyhow::anyhow!("cannot open the local upstream at {}: {e:?}", root.display()))?;
        let service = S3ServiceBuilder::new(fs).build();
        let object_locks = (0..OBJECT_LOCK_STRIPES).map(|_| tokio::sync::Mutex::new(())).collect();
        Ok(Self { root: root.into(), service, object_locks, hasher: RandomState::new() })
    }

    /// S3 answers 404 `NoSuchBucket` for anything addressed to a missing bucket; s3s-fs would
    /// create the bucket on an object write, and answers `NoSuchKey` on a read.
    async fn bucket_exists(&self, path: &str) -> bool {
        let bucket = path.trim_start_matches('/').split('/').next().unwrap_or("");
        // The S3 front validated bucket names (letters, digits, dots, hyphens); anything else,
        // `..` included, is not a bucket here.
        let plain = bucket.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
        plain
            && !matches!(bucket, "" | "." | "..")
            && tokio::fs::metadata(self.root.join(bucket)).await.is_ok_and(|m| m.is_dir())
    }

    /// The ETag of the object at `path` as s3s-fs has it now, `None` if there is none.
    async fn current_etag(&self, path: &str) -> Result<Option<http::HeaderValue>, UpstreamError> {
        let head = http::Request::builder()
            .method(Method::HEAD)
            .uri(path)
            .body(Body::empty())
            .map_err(|e| UpstreamError::Local(Box::new(e)))?;
        let head = self.service.call(head).await.map_err(|e| UpstreamError::Local(format!("{e:?}").into()))?;
        Ok(head.status().is_success().then(|| head.headers().get(http::header::ETAG).cloned()).flatten())
    }

    /// For a CopyObject or DeleteObject carrying `If-Match` / `If-None-Match`: the 412 answer if
    /// the object (read under the caller's object lock) does not meet it.
    async fn unmet_precondition(
        &self,
        req: &http::Request<Body>,
    ) -> Result<Option<http::Response<Body>>, UpstreamError> {
        let query = req.uri().query().unwrap_or("");
        let copy = *req.method() == Method::PUT && req.headers().contains_key("x-amz-copy-source");
        let delete = *req.method() == Method::DELETE;
        let conditional = req.headers().contains_key(http::header::IF_MATCH)
            || req.headers().contains_key(http::header::IF_NONE_MATCH);
        if !(copy || delete) || !conditional || names_sub_resource(Some(query)) {
            return Ok(None); // part copies, version or upload ids, sub-resources: as s3s-fs does
        }
        let etag = self.current_etag(req.uri().path()).await?;
        let met = match (req.headers().get(http::header::IF_MATCH), req.headers().get(http::header::IF_NONE_MATCH)) {
            (Some(wanted), _) => etag.as_ref().is_some_and(|e| wanted == "*" || wanted == e),
            (None, Some(not_wanted)) => match &etag {
                None => true,
                Some(e) => not_wanted != "*" && not_wanted != e,
            },
            (None, None) => true,
        };
        if met {
            return Ok(None);
        }
        let error = s3s::S3Error::with_message(
            s3s::S3ErrorCode::PreconditionFailed,
            "At least one of the pre-conditions you specified did not hold",
        );
        error.to_http_response().map(Some).map_err(|e| UpstreamError::Local(format!("{e:?}").into()))
    }

    /// Whether multipart upload `upload_id` was started on `bucket/key` (raw path segments).
    /// s3s-fs keeps an upload's parts by its id alone, so any key with the id would reach them
    /// (a part or a completion under a key the caller may write landing in another's object);
    /// S3 answers `NoSuchUpload`. The upload's own metadata file names its bucket and key
    /// (s3s-fs 0.14's layout, pinned in Cargo.toml; `tests/python/test_local_upstream.py`
    /// fails if it moves).
    fn upload_is_for(&self, bucket: &str, key: &str, upload_id: &str) -> bool {
        use base64::Engine;
        let Some(key) = crate::percent::decode(key) else { return false };
        let encode = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let file = format!(".bucket-{}.object-{}.upload-{upload_id}.metadata.json", encode(bucket), encode(&key));
        self.root.join(file).is_file()
    }

    /// A GET or HEAD with `If-Match` / `If-None-Match` (s3s-fs ignores them on reads): 412, or
    /// 304, as S3 answers, judged on the object's current ETag.
    async fn read_condition(
        &self,
        req: &http::Request<Body>,
        key: &str,
    ) -> Result<Option<http::Response<Body>>, UpstreamError> {
        let read = matches!(*req.method(), Method::GET | Method::HEAD);
        let if_match = req.headers().get(http::header::IF_MATCH).and_then(|v| v.to_str().ok());
        let if_none_match = req.headers().get(http::header::IF_NONE_MATCH).and_then(|v| v.to_str().ok());
        if !read || key.is_empty() || (if_match.is_none() && if_none_match.is_none()) {
            return Ok(None);
        }
        let Some(etag) = self.current_etag(req.uri().path()).await? else {
            return Ok(None); // no object: the read answers 404 itself
        };
        let Ok(etag) = etag.to_str() else { return Ok(None) };
        let listed =
            |header: &str| header.split(',').map(|v| v.trim().trim_start_matches("W/")).any(|v| v == "*" || v == etag);
        if if_match.is_some_and(|h| !listed(h)) {
            let error = s3s::S3Error::with_message(
                s3s::S3ErrorCode::PreconditionFailed,
                "At least one of the pre-conditions you specified did not hold",
            );
            return error.to_http_response().map(Some).map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        if if_none_match.is_some_and(listed) {
            let resp = http::Response::builder()
                .status(http::StatusCode::NOT_MODIFIED)
                .header(http::header::ETAG, etag)
                .body(Body::empty())
                .map_err(|e| UpstreamError::Local(Box::new(e)))?;
            return Ok(Some(resp));
        }
        Ok(None)
    }

    /// Objects are files: `a` and `a/b` cannot both exist (S3 has no such limit). Why the object
    /// `bucket/key` (raw path segments) cannot be created, if it cannot.
    async fn file_conflict(&self, bucket: &str, key: &str) -> Option<String> {
        let key = crate::percent::decode(key)?;
        let mut path = self.root.join(bucket);
        let segments: Vec<&str> = key.split('/').collect();
        for (i, segment) in segments.iter().enumerate() {
            path.push(segment);
            let last = i + 1 == segments.len();
            match tokio::fs::metadata(&path).await {
                Ok(m) if !last && m.is_file() => {
                    let object = segments[..=i].join("/");
                    return Some(format!(
                        "the local upstream stores objects as files: object {object:?} exists, so {key:?} cannot"
                    ));
                }
                Ok(m) if last && m.is_dir() => {
                    return Some(format!(
                        "the local upstream stores objects as files: keys under {key:?}/ exist, so {key:?} cannot"
                    ));
                }
                Ok(_) => {}
                Err(_) => return None,
            }
        }
        None
    }

    /// What s3s-fs leaves behind, set right once the write succeeded (under the object's lock):
    /// a completed multipart upload keeps the checksums of the object it replaced (readers then
    /// fail their checksum check), and a deleted object keeps its metadata files.
    async fn tidy_after(&self, after: AfterWrite, bucket: &str, key: &str) {
        use base64::Engine;
        let encode = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let stem = format!(".bucket-{}.object-{}", encode(bucket), encode(key));
        let internal = self.root.join(format!("{stem}.internal.json"));
        match after {
            AfterWrite::Completed => {
                // Keep the new ETag; drop the old object's checksums (a multipart object has none
                // of its own here).
                let Ok(text) = tokio::fs::read(&internal).await else { return };
                let Ok(mut info) = serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&text) else {
                    return;
                };
                info.retain(|name, _| !name.starts_with("checksum_"));
                let _ = tokio::fs::write(&internal, serde_json::Value::Object(info).to_string()).await;
            }
            AfterWrite::Deleted => {
                let _ = tokio::fs::remove_file(&internal).await;
                let _ = tokio::fs::remove_file(self.root.join(format!("{stem}.metadata.json"))).await;
            }
        }
    }

    fn is_object_write(req: &http::Request<Body>) -> bool {
        let writes = matches!(*req.method(), Method::PUT | Method::POST | Method::DELETE);
        // `/bucket/key...`: something after the bucket's slash means an object path.
        writes && req.uri().path().trim_start_matches('/').split_once('/').is_some_and(|(_, key)| !key.is_empty())
    }
}

/// Whether a query names something other than the object or bucket itself (a version, an
/// upload, a sub-resource such as `?tagging` or `?cors`). SDKs add `x-id=<Operation>`, which
/// names nothing.
fn names_sub_resource(query: Option<&str>) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .filter(|pair| !pair.is_empty())
            .any(|pair| pair.split('=').next().is_some_and(|name| name != "x-id"))
    })
}

/// Bodies up to this size are held in memory before a PutObject commits; larger ones go to a
/// temporary file.
const SPOOL_MEMORY_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Reads `req`'s body whole (in memory, or past `SPOOL_MEMORY_BYTES_MAX` into an unlinked
/// temporary file), so that the object's lock is held only while s3s-fs writes and commits
/// it, not while a client sends it. A body that fails or ends early fails the write, as it
/// would have inside s3s-fs.
async fn spool(req: http::Request<Body>) -> Result<http::Request<Body>, UpstreamError> {
    use http_body_util::BodyExt;
    use tokio::io::{AsyncSeekExt, AsyncWriteExt};
    let (parts, mut body) = req.into_parts();
    let mut held = Vec::new();
    let mut file: Option<tokio::fs::File> = None;
    let failed = |e: std::io::Error| UpstreamError::Local(Box::new(e));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| UpstreamError::Local(format!("request body: {e:?}").into()))?;
        let Ok(data) = frame.into_data() else { continue };
        if file.is_none() && held.len() + data.len() > SPOOL_MEMORY_BYTES_MAX {
            let path = std::env::temp_dir().join(format!("fencegate-spool-{}", uuid::Uuid::new_v4().simple()));
            let mut f = tokio::fs::OpenOptions::new()
                .create_new(true)
                .read(true)
                .write(true)
                .open(&path)
                .await
                .map_err(failed)?;
            // Unlinked at once: nothing is left behind, whatever happens next.
            let _ = tokio::fs::remove_file(&path).await;
            f.write_all(&held).await.map_err(failed)?;
            held = Vec::new();
            file = Some(f);
        }
        match &mut file {
            Some(f) => f.write_all(&data).await.map_err(failed)?,
            None => held.extend_from_slice(&data),
        }
    }
    let body = match file {
        None => Body::from(bytes::Bytes::from(held)),
        Some(mut f) => {
            f.flush().await.map_err(failed)?;
            f.seek(std::io::SeekFrom::Start(0)).await.map_err(failed)?;
            let frames = futures_util::StreamExt::map(tokio_util::io::ReaderStream::new(f), |chunk| {
                chunk.map(http_body::Frame::data)
            });
            Body::http_body_unsync(http_body_util::StreamBody::new(frames))
        }
    };
    Ok(http::Request::from_parts(parts, body))
}

/// A write that makes an object at its path: PutObject, CopyObject, CompleteMultipartUpload
/// (not a part, not a sub-resource such as `?tagging`).
fn creates_object(req: &http::Request<Body>) -> bool {
    let query = req.uri().query();
    let with_upload = query.is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(n, _)| n == "uploadId"));
    match *req.method() {
        Method::PUT => !names_sub_resource(query),
        Method::POST => with_upload,
        _ => false,
    }
}

/// The object writes whose leftovers `tidy_after` sets right.
#[derive(Debug, Clone, Copy)]
enum AfterWrite {
    Completed,
    Deleted,
}

impl AfterWrite {
    /// The write and its (decoded) bucket and key.
    fn of(req: &http::Request<Body>) -> Option<(Self, String, String)> {
        let (bucket, key) = req.uri().path().trim_start_matches('/').split_once('/')?;
        if key.is_empty() || key.ends_with('/') {
            return None;
        }
        let query = req.uri().query();
        let with_upload = query.is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(n, _)| n == "uploadId"));
        let after = match *req.method() {
            Method::POST if with_upload => Self::Completed,
            Method::DELETE if !names_sub_resource(query) => Self::Deleted,
            _ => return None,
        };
        Some((after, crate::percent::decode(bucket)?, crate::percent::decode(key)?))
    }
}

/// The `uploadId` of a query, if it is a UUID as s3s-fs makes them (anything else s3s-fs
/// refuses on its own).
fn upload_id(query: Option<&str>) -> Option<String> {
    let (_, id) = form_urlencoded::parse(query?.as_bytes()).find(|(name, _)| name == "uploadId")?;
    let uuid = id.len() == 36 && id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    uuid.then(|| id.to_ascii_lowercase())
}

/// Whether a bucket's directory holds any file (an object), at any depth.
async fn holds_objects(dir: std::path::PathBuf) -> bool {
    fn walk(dir: &Path) -> bool {
        let Ok(entries) = std::fs::read_dir(dir) else { return false };
        entries.flatten().any(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => walk(&entry.path()),
            Ok(_) => true,
            Err(_) => true, // unknown: keep the bucket
        })
    }
    tokio::task::spawn_blocking(move || walk(&dir)).await.unwrap_or(true)
}

#[async_trait]
impl Upstream for LocalUpstream {
    async fn send(&self, req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        let is_object_write = Self::is_object_write(&req);
        let path = req.uri().path().to_owned();
        let path = path.as_str();
        let (bucket, key) = path.trim_start_matches('/').split_once('/').unwrap_or((path.trim_start_matches('/'), ""));
        // `PUT /bucket` and `PUT /bucket/` (SDKs send either) create the bucket.
        let creates_bucket = *req.method() == Method::PUT && key.is_empty();
        let addresses_bucket = !bucket.is_empty();
        if addresses_bucket && !creates_bucket && !self.bucket_exists(path).await {
            let error =
                s3s::S3Error::with_message(s3s::S3ErrorCode::NoSuchBucket, "The specified bucket does not exist");
            return error.to_http_response().map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        let deletes_bucket =
            *req.method() == Method::DELETE && key.is_empty() && !names_sub_resource(req.uri().query());
        if addresses_bucket && deletes_bucket && holds_objects(self.root.join(bucket)).await {
            // s3s-fs would remove the directory and every object in it; S3 refuses.
            let error = s3s::S3Error::with_message(
                s3s::S3ErrorCode::BucketNotEmpty,
                "The bucket you tried to delete is not empty",
            );
            return error.to_http_response().map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        if !key.is_empty()
            && let Some(upload_id) = upload_id(req.uri().query())
            && !self.upload_is_for(bucket, key, &upload_id)
        {
            let error = s3s::S3Error::with_message(
                s3s::S3ErrorCode::NoSuchUpload,
                "The specified multipart upload does not exist for this key",
            );
            return error.to_http_response().map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        if matches!(*req.method(), Method::GET | Method::HEAD)
            && !key.is_empty()
            && !key.ends_with('/')
            && !names_sub_resource(req.uri().query())
            && let Some(decoded) = crate::percent::decode(key)
            && tokio::fs::metadata(self.root.join(bucket).join(&decoded)).await.is_ok_and(|m| m.is_dir())
        {
            // A directory holding other keys' files is no object (s3s-fs answered 500).
            let error = s3s::S3Error::with_message(s3s::S3ErrorCode::NoSuchKey, "The specified key does not exist.");
            return error.to_http_response().map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        if *req.method() == Method::GET && key.is_empty() && addresses_bucket {
            if let Some(empty) = listing_under_a_slash(bucket, req.uri().query()) {
                return Ok(empty);
            }
            if lists_versions(req.uri().query()) {
                return self.list_versions(req, bucket).await;
            }
        }
        if let Some(answer) = self.read_condition(&req, key).await? {
            return Ok(answer);
        }
        // A PutObject's body is read before the lock: a slow client holds no other writer up.
        let req = if is_object_write && *req.method() == Method::PUT && creates_object(&req) {
            spool(req).await?
        } else {
            req
        };
        let _object_lock = if is_object_write {
            // By the decoded path: `/b/k` and `/b/%6B` are one object.
            let object = crate::percent::decode(req.uri().path()).unwrap_or_else(|| req.uri().path().to_owned());
            let stripe = self.hasher.hash_one(object) as usize % OBJECT_LOCK_STRIPES;
            Some(self.object_locks[stripe].lock().await)
        } else {
            None
        };
        if is_object_write && let Some(refusal) = self.unmet_precondition(&req).await? {
            return Ok(refusal);
        }
        if is_object_write
            && creates_object(&req)
            && let Some(conflict) = self.file_conflict(bucket, key).await
        {
            let error = s3s::S3Error::with_message(s3s::S3ErrorCode::InvalidArgument, conflict);
            return error.to_http_response().map_err(|e| UpstreamError::Local(format!("{e:?}").into()));
        }
        let after = AfterWrite::of(&req);
        let resp = self.service.call(req).await.map_err(|e| UpstreamError::Local(format!("{e:?}").into()))?;
        if resp.status().is_success()
            && let Some((after, bucket, key)) = after
        {
            self.tidy_after(after, &bucket, &key).await;
        }
        Ok(resp)
    }

    fn kind(&self) -> &'static str {
        "local"
    }

    /// Checked in `send` (`upload_is_for`).
    fn ties_upload_ids_to_keys(&self) -> bool {
        true
    }
}

/// A listing whose prefix starts with `/`: no key of the local upstream does (a leading
/// slash is an empty segment), so it lists nothing. s3s-fs trims the slash and lists every
/// key, and a tool that deletes what a prefix lists would delete the wrong objects.
fn listing_under_a_slash(bucket: &str, query: Option<&str>) -> Option<http::Response<Body>> {
    let asked: std::collections::HashMap<String, String> =
        form_urlencoded::parse(query?.as_bytes()).into_owned().collect();
    let prefix = asked.get("prefix").filter(|p| p.starts_with('/'))?;
    if asked.keys().any(|name| !LISTING_PARAMETERS.contains(&name.as_str())) {
        return None; // a sub-resource of the bucket, not a listing
    }
    let esc = |text: &str| quick_xml::escape::escape(text).into_owned();
    let bucket = crate::percent::decode(bucket).unwrap_or_else(|| bucket.to_owned());
    let max_keys = asked.get("max-keys").and_then(|n| n.parse::<u32>().ok()).unwrap_or(1000).min(1000);
    let delimiter = asked.get("delimiter").map(|d| format!("<Delimiter>{}</Delimiter>", esc(d))).unwrap_or_default();
    let (root, extra) = if asked.contains_key("versions") {
        ("ListVersionsResult", "<KeyMarker></KeyMarker><VersionIdMarker></VersionIdMarker>".to_owned())
    } else if asked.get("list-type").is_some_and(|t| t == "2") {
        ("ListBucketResult", "<KeyCount>0</KeyCount>".to_owned())
    } else {
        ("ListBucketResult", "<Marker></Marker>".to_owned())
    };
    let xml = format!(
        r#"<?xml version="1.0" encoding="UTF-8"?><{root} xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>{}</Name><Prefix>{}</Prefix>{extra}<MaxKeys>{max_keys}</MaxKeys>{delimiter}<IsTruncated>false</IsTruncated></{root}>"#,
        esc(&bucket),
        esc(prefix),
    );
    let mut resp = http::Response::new(Body::from(xml));
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/xml"));
    Some(resp)
}

/// The query parameters of ListObjects, ListObjectsV2 and ListObjectVersions.
const LISTING_PARAMETERS: &[&str] = &[
    "prefix",
    "delimiter",
    "max-keys",
    "marker",
    "list-type",
    "continuation-token",
    "start-after",
    "fetch-owner",
    "encoding-type",
    "versions",
    "key-marker",
    "version-id-marker",
    "x-id",
];

/// Whether a bucket GET is ListObjectVersions (`?versions`).
fn lists_versions(query: Option<&str>) -> bool {
    query.is_some_and(|q| form_urlencoded::parse(q.as_bytes()).any(|(name, _)| name == "versions"))
}

/// The part of a ListObjectsV2 answer that ListObjectVersions repeats.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "PascalCase", default)]
struct ListedObjects {
    contents: Vec<ListedObject>,
    common_prefixes: Vec<ListedPrefix>,
    is_truncated: bool,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "PascalCase", default)]
struct ListedObject {
    key: String,
    last_modified: String,
    #[serde(rename = "ETag")]
    e_tag: String,
    size: u64,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "PascalCase", default)]
struct ListedPrefix {
    prefix: String,
}

impl LocalUpstream {
    /// ListObjectVersions. The local upstream keeps no versions: as S3 does for a bucket that
    /// was never versioned, every object is listed once, as its latest version, with version
    /// id `null` (a `DELETE ?versionId=null` removes it). Made from the store's own
    /// ListObjectsV2, `key-marker` as `start-after`.
    async fn list_versions(
        &self,
        req: http::Request<Body>,
        bucket: &str,
    ) -> Result<http::Response<Body>, UpstreamError> {
        let local = |e: &dyn std::fmt::Debug| UpstreamError::Local(format!("{e:?}").into());
        let asked: std::collections::HashMap<String, String> =
            form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()).into_owned().collect();
        let arg = |name: &str| asked.get(name).map(String::as_str).unwrap_or_default();
        let max_keys = arg("max-keys").parse::<u32>().unwrap_or(1000).min(1000);
        let query = {
            let mut query = form_urlencoded::Serializer::new(String::new());
            query.append_pair("list-type", "2").append_pair("max-keys", &max_keys.to_string());
            for (ours, theirs) in [("prefix", "prefix"), ("delimiter", "delimiter"), ("key-marker", "start-after")] {
                if !arg(ours).is_empty() {
                    query.append_pair(theirs, arg(ours));
                }
            }
            query.finish()
        };
        let (parts, _) = req.into_parts();
        let mut list = http::Request::new(Body::empty());
        *list.uri_mut() = format!("/{bucket}?{query}").parse().map_err(|e| local(&e))?;
        *list.headers_mut() = parts.headers;
        list.headers_mut().remove(http::header::CONTENT_LENGTH);
        let resp = self.service.call(list).await.map_err(|e| local(&e))?;
        if !resp.status().is_success() {
            return Ok(resp);
        }
        let (mut head, body) = resp.into_parts();
        let body = http_body_util::BodyExt::collect(body).await.map_err(|e| local(&e))?.to_bytes();
        let listed: ListedObjects =
            quick_xml::de::from_str(std::str::from_utf8(&body).map_err(|e| local(&e))?).map_err(|e| local(&e))?;

        let esc = |text: &str| quick_xml::escape::escape(text).into_owned();
        let mut xml = String::from(
            r#"<?xml version="1.0" encoding="UTF-8"?><ListVersionsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">"#,
        );
        let bucket_name = crate::percent::decode(bucket).unwrap_or_else(|| bucket.to_owned());
        xml += &format!("<Name>{}</Name><Prefix>{}</Prefix>", esc(&bucket_name), esc(arg("prefix")));
        xml += &format!("<KeyMarker>{}</KeyMarker><VersionIdMarker></VersionIdMarker>", esc(arg("key-marker")));
        xml += &format!("<MaxKeys>{max_keys}</MaxKeys>");
        if !arg("delimiter").is_empty() {
            xml += &format!("<Delimiter>{}</Delimiter>", esc(arg("delimiter")));
        }
        xml += &format!("<IsTruncated>{}</IsTruncated>", listed.is_truncated);
        if listed.is_truncated {
            // The greater of the last key and the last common prefix: where the next page starts.
            let last_key = listed.contents.last().map(|o| o.key.as_str()).unwrap_or_default();
            let last_prefix = listed.common_prefixes.last().map(|p| p.prefix.as_str()).unwrap_or_default();
            let next = last_key.max(last_prefix);
            xml +=
                &format!("<NextKeyMarker>{}</NextKeyMarker><NextVersionIdMarker>null</NextVersionIdMarker>", esc(next));
        }
        for object in &listed.contents {
            // An ETag where the store's own listing has one.
            let etag =
                if object.e_tag.is_empty() { String::new() } else { format!("<ETag>{}</ETag>", esc(&object.e_tag)) };
            xml += &format!(
                "<Version><Key>{}</Key><VersionId>null</VersionId><IsLatest>true</IsLatest>\
                 <LastModified>{}</LastModified>{etag}<Size>{}</Size><StorageClass>STANDARD</StorageClass></Version>",
                esc(&object.key),
                esc(&object.last_modified),
                object.size
            );
        }
        for prefix in &listed.common_prefixes {
            xml += &format!("<CommonPrefixes><Prefix>{}</Prefix></CommonPrefixes>", esc(&prefix.prefix));
        }
        xml += "</ListVersionsResult>";
        head.headers.remove(http::header::CONTENT_LENGTH);
        head.headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/xml"));
        Ok(http::Response::from_parts(head, Body::from(xml)))
    }
}
