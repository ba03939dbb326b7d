//! DeleteObjects: every key is checked against its own resource and deleted as a DeleteObject
//! is, conditional on the version its token may delete (`delete.rs`). Refused keys come back as
//! per-key `<Error>` entries (`FencingTokenStale`); the result is fencegate's own
//! `<DeleteResult>`. One conditional call per key instead of one batch: a batch has no
//! per-key precondition, so a DeleteObjects delivered twice (a retrying hop) could delete an
//! object a newer token wrote in between.

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use s3s::{Body, S3Response};
use serde::Deserialize;

use std::collections::BTreeMap;

use super::conditional::ObjectWrite;
use super::{Admitted, Ctx, Request, Target, WireContract};
use crate::feed::Decision;
use crate::fence::{AdmitError, FenceToken, FencedWrite, ResourceKey};
use crate::metrics;
use crate::refusal::Refusal;
use crate::s3::error::FrontError;
use crate::s3::hop::{error_of, upstream_headers};
use crate::s3::objects::ClientCondition;

/// S3 allows 1000 keys per request; the XML for them stays well under this.
pub const REQUEST_BYTES_MAX: usize = 2 * 1024 * 1024;

/// The most keys S3 takes in one DeleteObjects (more is `MalformedXML`, as from S3): each key is
/// a fence check, possibly an advance made durable, and an upstream call.
pub const KEYS_MAX: usize = 1000;

#[derive(Debug, Deserialize)]
pub struct DeleteRequest {
    #[serde(rename = "Object", default)]
    pub objects: Vec<ObjectId>,
    #[serde(rename = "Quiet", default)]
    pub quiet: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ObjectId {
    #[serde(rename = "Key")]
    pub key: String,
    #[serde(rename = "VersionId", default)]
    pub version_id: Option<String>,
    /// The client's own condition on this key (S3's conditional delete): kept and forwarded.
    #[serde(rename = "ETag", default)]
    pub etag: Option<String>,
    /// S3's other per-key conditions, which fencegate cannot judge: a key that carries one is
    /// refused, never deleted without its condition.
    #[serde(rename = "LastModifiedTime", default)]
    pub last_modified_time: Option<String>,
    #[serde(rename = "Size", default)]
    pub size: Option<String>,
}

/// Reads and parses the request body. A broken body is the client's fault (400), and nothing
/// is deleted.
pub async fn read(body: s3s::Body) -> Result<DeleteRequest, FrontError> {
    let bytes = http_body_util::Limited::new(body, REQUEST_BYTES_MAX)
        .collect()
        .await
        .map_err(|_| FrontError::MalformedXml("the DeleteObjects body is unreadable or too large".into()))?
        .to_bytes();
    let text = std::str::from_utf8(&bytes).map_err(|_| FrontError::MalformedXml("the body is not UTF-8".into()))?;
    let request: DeleteRequest = quick_xml::de::from_str(text).map_err(|e| FrontError::MalformedXml(e.to_string()))?;
    match request.objects.len() {
        0 => Err(FrontError::MalformedXml("a DeleteObjects request names no key".into())),
        n if n > KEYS_MAX => Err(FrontError::MalformedXml(format!(
            "a DeleteObjects request names {n} keys; at most {KEYS_MAX} are allowed"
        ))),
        _ => Ok(request),
    }
}

/// An entry's opening: `<tag>`, the key and the version the request named.
fn entry_start(tag: &str, object: &ObjectId) -> String {
    let mut xml = format!("<{tag}><Key>");
    xml.push_str(&escape(&object.key));
    xml.push_str("</Key>");
    if let Some(v) = &object.version_id {
        xml.push_str("<VersionId>");
        xml.push_str(&escape(v));
        xml.push_str("</VersionId>");
    }
    xml
}

/// One `<Error>` entry for a key that was refused or failed.
pub fn error_entry(object: &ObjectId, code: &str, message: &str) -> String {
    let mut xml = entry_start("Error", object);
    xml.push_str("<Code>");
    xml.push_str(code);
    xml.push_str("</Code><Message>");
    xml.push_str(&escape(message));
    xml.push_str("</Message></Error>");
    xml
}

/// One `<Deleted>` entry: the key, the version the request named, and the delete marker the
/// upstream reported (`x-amz-delete-marker`, `x-amz-version-id`).
pub fn deleted_entry(object: &ObjectId, answer: &HeaderMap) -> String {
    let mut xml = entry_start("Deleted", object);
    let marker = answer.get("x-amz-delete-marker").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    if marker {
        xml.push_str("<DeleteMarker>true</DeleteMarker>");
        if let Some(version) = answer.get("x-amz-version-id").and_then(|v| v.to_str().ok()) {
            xml.push_str("<DeleteMarkerVersionId>");
            xml.push_str(&escape(version));
            xml.push_str("</DeleteMarkerVersionId>");
        }
    }
    xml.push_str("</Deleted>");
    xml
}

/// The `<DeleteResult>` document of the entries, in the order given.
pub fn result_document(entries: &[String]) -> Bytes {
    let mut xml = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">",
    );
    for entry in entries {
        xml.push_str(entry);
    }
    xml.push_str("</DeleteResult>");
    Bytes::from(xml)
}

fn escape(text: &str) -> String {
    quick_xml::escape::escape(text).into_owned()
}

/// Keys of one DeleteObjects deleted at once.
const DELETES_CONCURRENT: usize = 16;

/// Headers of a DeleteObjects that describe its body or condition, not each key's delete.
const BATCH_ONLY_HEADERS: &[&str] = &[
    "content-md5",
    "content-type",
    "content-length",
    "content-encoding",
    "x-amz-sdk-checksum-algorithm",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
];

/// How much of a key's error answer is read for its code and message.
const KEY_ERROR_BYTES_MAX: usize = 64 * 1024;

/// A DeleteObjects parsed: its keys grouped by resource, and the entries of the keys refused
/// before admission.
pub(in crate::s3) struct Batch {
    request: Request,
    bucket: String,
    quiet: bool,
    by_resource: BTreeMap<ResourceKey, Vec<ObjectId>>,
    entries: Vec<String>,
}

impl Batch {
    /// Reads the body; `resource_of` gives a key's resource, or why the front refuses the key
    /// (its lease, its scope, the rules). A broken body is refused whole, and nothing deleted.
    pub(in crate::s3) async fn parse(
        mut request: Request,
        resource_of: impl Fn(&Request, &str, &str) -> Result<ResourceKey, FrontError>,
    ) -> Result<Self, FrontError> {
        let bucket = request.target.bucket.clone().ok_or(FrontError::NotSupported("DeleteObjects without a bucket"))?;
        let parsed = read(std::mem::take(&mut request.body)).await?;
        let mut by_resource: BTreeMap<ResourceKey, Vec<ObjectId>> = BTreeMap::new();
        let mut entries = Vec::new();
        for object in parsed.objects {
            if object.last_modified_time.is_some() || object.size.is_some() {
                let message = "a per-key LastModifiedTime or Size condition is not supported here; nothing was deleted";
                entries.push(error_entry(&object, "NotImplemented", message));
                continue;
            }
            match resource_of(&request, &bucket, &object.key) {
                Ok(resource) => by_resource.entry(resource).or_default().push(object),
                Err(error) => entries.push(error_entry(&object, error.code(), &error.to_string())),
            }
        }
        Ok(Self { request, bucket, quiet: parsed.quiet.unwrap_or(false), by_resource, entries })
    }
}

impl Ctx {
    /// DeleteObjects: each key admitted on its own resource, then deleted as a DeleteObject is
    /// (conditional on the version its token may delete, never forwarded for an absent key), so
    /// that no key's delete can land after a newer token's write of it, even delivered twice.
    /// Refused keys come back as per-key `<Error>` entries.
    pub(in crate::s3) async fn delete_objects(
        &self,
        batch: Batch,
        token: FenceToken,
        decision: &Decision,
    ) -> Result<S3Response<Body>, FrontError> {
        let Batch { request, bucket, quiet, by_resource, mut entries } = batch;
        let mut admitted = Vec::new();
        for (resource, objects) in by_resource {
            match self.gate.admit_write(&resource, token, request.may_advance, request.caller).await {
                Ok(permit) => {
                    if permit.advanced() {
                        decision.key_advanced(&resource, token);
                    }
                    decision.key_decided(&resource, token, "accepted", None, None);
                    let write = FencedWrite::new(
                        permit,
                        resource,
                        self.hop.request_timeout(),
                        self.limits.unknown_outcome_hold,
                    );
                    admitted.extend(objects.into_iter().map(|object| (write.clone(), object)));
                }
                Err(refusal @ (AdmitError::Stale { .. } | AdmitError::Unregistered { .. })) => {
                    let error = FrontError::from(refusal);
                    decision.key_decided(&resource, token, error.decision(), Some(error.code()), error.current_fence());
                    for object in &objects {
                        entries.push(error_entry(object, error.code(), &error.to_string()));
                    }
                }
                Err(other) => return Err(other.into()),
            }
        }
        let headers = batch_headers(&request.headers, &self.wire);
        let headers = &headers;
        let deletes = futures_util::stream::iter(admitted.into_iter().map(|(write, object)| {
            let bucket = &bucket;
            async move {
                let entry = self.delete_one(bucket, &object, &write, headers).await;
                drop(write); // the permit goes with the key's outcome
                entry
            }
        }))
        .buffered(DELETES_CONCURRENT)
        .collect::<Vec<_>>()
        .await;
        for entry in deletes {
            match entry {
                KeyOutcome::Deleted(_) if quiet => {}
                KeyOutcome::Deleted(entry) | KeyOutcome::Error(entry) => entries.push(entry),
            }
        }
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        let mut resp = S3Response::with_headers(Body::from(result_document(&entries)), headers);
        resp.status = Some(StatusCode::OK);
        Ok(resp)
    }

    /// One key of a DeleteObjects, deleted as a DeleteObject with the key's own `<ETag>` as the
    /// client's `If-Match`.
    async fn delete_one(&self, bucket: &str, object: &ObjectId, write: &Admitted, headers: &HeaderMap) -> KeyOutcome {
        let raw_path = format!("/{bucket}/{}", crate::net::percent::encode_key(&object.key));
        let mut path = raw_path.clone();
        if let Some(version) = &object.version_id {
            path.push_str("?versionId=");
            path.extend(form_urlencoded::byte_serialize(version.as_bytes()));
        }
        let target = Target { raw_path, bucket: Some(bucket.to_owned()), key: Some(object.key.clone()) };
        let mut conditions = HeaderMap::new();
        if let Some(value) = object.etag.as_deref().and_then(|etag| HeaderValue::from_str(etag).ok()) {
            conditions.insert(http::header::IF_MATCH, value);
        }
        let name = format!("{bucket}/{}", object.key);
        let key = ObjectWrite::for_key(&target, name, ClientCondition::of(&conditions), write, headers);
        match self.delete_key(&key, object.version_id.is_some(), &path, headers).await {
            Ok(resp) if resp.status.is_none_or(|s| s.is_success()) => {
                KeyOutcome::Deleted(deleted_entry(object, &resp.headers))
            }
            Ok(resp) => {
                let body = http_body_util::Limited::new(resp.output, KEY_ERROR_BYTES_MAX).collect().await;
                let (code, message) =
                    body.map(|b| error_of(&b.to_bytes())).unwrap_or_else(|_| ("InternalError".into(), String::new()));
                KeyOutcome::Error(error_entry(object, &code, &message))
            }
            Err(error) => {
                if matches!(error, FrontError::Refused(Refusal::Stale { .. } | Refusal::StaleByStamp { .. })) {
                    metrics::decision("stale");
                }
                KeyOutcome::Error(error_entry(object, error.code(), &error.to_string()))
            }
        }
    }
}

/// What each key's delete carries of the request's headers (`x-amz-bypass-governance-retention`,
/// `x-amz-mfa`, the bucket owner, the client's own), less those of the batch's body.
fn batch_headers(request: &HeaderMap, wire: &WireContract) -> HeaderMap {
    let mut headers = upstream_headers(request, wire);
    let batch_only: Vec<_> = headers
        .keys()
        .filter(|n| BATCH_ONLY_HEADERS.contains(&n.as_str()) || n.as_str().starts_with("x-amz-checksum-"))
        .cloned()
        .collect();
    for name in batch_only {
        headers.remove(name);
    }
    headers
}

/// What became of one key of a DeleteObjects: its entry in the result.
enum KeyOutcome {
    Deleted(String),
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse() {
        let xml = r#"<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Object><Key>a&amp;b</Key></Object><Object><Key>c</Key><VersionId>v1</VersionId><ETag>"e"</ETag></Object><Quiet>true</Quiet></Delete>"#;
        let req: DeleteRequest = quick_xml::de::from_str(xml).unwrap();
        assert_eq!(req.objects.len(), 2);
        assert_eq!(req.objects[0].key, "a&b");
        assert_eq!(req.objects[1].version_id.as_deref(), Some("v1"));
        assert_eq!(req.objects[1].etag.as_deref(), Some("\"e\""));
        assert_eq!(req.quiet, Some(true));
    }

    #[test]
    fn the_result_lists_each_key_as_s3_does() {
        let object = |key: &str, version: Option<&str>| ObjectId {
            key: key.into(),
            version_id: version.map(Into::into),
            etag: None,
            last_modified_time: None,
            size: None,
        };
        let mut marker = HeaderMap::new();
        marker.insert("x-amz-delete-marker", HeaderValue::from_static("true"));
        marker.insert("x-amz-version-id", HeaderValue::from_static("dm1"));
        let entries = vec![
            deleted_entry(&object("a", None), &HeaderMap::new()),
            deleted_entry(&object("b", Some("v1")), &marker),
            error_entry(&object("x<y", None), "FencingTokenStale", "old"),
        ];
        let doc = result_document(&entries);
        let text = std::str::from_utf8(&doc).unwrap();
        assert!(text.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns="));
        assert!(text.ends_with(
            "<Deleted><Key>a</Key></Deleted><Deleted><Key>b</Key><VersionId>v1</VersionId><DeleteMarker>true</DeleteMarker>\
             <DeleteMarkerVersionId>dm1</DeleteMarkerVersionId></Deleted><Error><Key>x&lt;y</Key>\
             <Code>FencingTokenStale</Code><Message>old</Message></Error></DeleteResult>"
        ));
    }

    #[test]
    fn a_keys_error_answer_gives_its_code_and_message() {
        let body = b"<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code><Message>no &amp; never</Message></Error>";
        assert_eq!(error_of(body), ("AccessDenied".into(), "no & never".into()));
        assert_eq!(error_of(b"garbage"), ("InternalError".into(), String::new()));
    }
}
