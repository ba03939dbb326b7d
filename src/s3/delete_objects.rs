//! DeleteObjects: every key is checked against its own resource. Stale keys come back as
//! per-key `<Error>` entries (`FencingTokenStale`); the others are forwarded in a rewritten
//! request body, with a fresh `Content-MD5`, and the two results are merged.

use std::sync::Arc;
use std::time::Instant;

use base64::Engine;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use md5::Digest;
use s3s::{Body, S3Response};
use serde::Deserialize;

use super::conditional::Cached;
use super::error::FrontError;
use super::forward::{client_response, upstream_headers, upstream_request};
use super::objects::ClientCondition;
use super::{Admitted, Front, Request, Target};
use crate::config::millis;
use crate::fence::outcome::{Bounded, bounded_call};
use crate::fence::{AdmitError, FenceToken, Permit, ResourceKey};
use crate::metrics;
use crate::refusal::Refusal;

/// S3 allows 1000 keys per request; the XML for them stays well under this.
pub const REQUEST_BYTES_MAX: usize = 2 * 1024 * 1024;

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
    quick_xml::de::from_str(text).map_err(|e| FrontError::MalformedXml(e.to_string()))
}

/// The body forwarded upstream: only the admitted keys.
pub fn forwarded_body(objects: &[ObjectId], quiet: Option<bool>) -> Bytes {
    let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Delete>");
    for o in objects {
        xml.push_str("<Object><Key>");
        xml.push_str(&escape(&o.key));
        xml.push_str("</Key>");
        if let Some(v) = &o.version_id {
            xml.push_str("<VersionId>");
            xml.push_str(&escape(v));
            xml.push_str("</VersionId>");
        }
        if let Some(e) = &o.etag {
            xml.push_str("<ETag>");
            xml.push_str(&escape(e));
            xml.push_str("</ETag>");
        }
        xml.push_str("</Object>");
    }
    if let Some(q) = quiet {
        xml.push_str(if q { "<Quiet>true</Quiet>" } else { "<Quiet>false</Quiet>" });
    }
    xml.push_str("</Delete>");
    Bytes::from(xml)
}

/// Headers for the rewritten body: its own length and MD5; checksums of the old body dropped.
pub fn rewrite_headers(headers: &mut HeaderMap, body: &Bytes) {
    let stale: Vec<_> = headers.keys().filter(|n| n.as_str().starts_with("x-amz-checksum-")).cloned().collect();
    for name in stale {
        headers.remove(name);
    }
    headers.remove("x-amz-sdk-checksum-algorithm");
    let md5 = base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest(body));
    headers.insert("content-md5", HeaderValue::from_str(&md5).expect("base64 is a valid header value"));
    headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
}

/// One `<Error>` entry for a key refused by the gate.
pub fn error_entry(object: &ObjectId, code: &str, message: &str) -> String {
    let mut xml = String::from("<Error><Key>");
    xml.push_str(&escape(&object.key));
    xml.push_str("</Key>");
    if let Some(v) = &object.version_id {
        xml.push_str("<VersionId>");
        xml.push_str(&escape(v));
        xml.push_str("</VersionId>");
    }
    xml.push_str("<Code>");
    xml.push_str(code);
    xml.push_str("</Code><Message>");
    xml.push_str(&escape(message));
    xml.push_str("</Message></Error>");
    xml
}

/// Adds the refused keys' entries to the upstream's `<DeleteResult>` (or makes one when
/// nothing was forwarded).
pub fn merge(upstream: Option<&[u8]>, refused: &[String]) -> Result<Bytes, FrontError> {
    let entries = refused.concat();
    let Some(upstream) = upstream else {
        return Ok(Bytes::from(format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\
             <DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">{entries}</DeleteResult>"
        )));
    };
    let text = std::str::from_utf8(upstream).map_err(|_| FrontError::UpstreamStatus {
        step: "DeleteObjects (a result that is not UTF-8)",
        status: StatusCode::BAD_GATEWAY,
    })?;
    if let Some(end) = text.rfind("</DeleteResult>") {
        return Ok(Bytes::from(format!("{}{entries}{}", &text[..end], &text[end..])));
    }
    if let Some(empty) = text.rfind("<DeleteResult") {
        // `<DeleteResult .../>` with nothing in it.
        if let Some(close) = text[empty..].find("/>") {
            let open_tag = &text[empty..empty + close];
            return Ok(Bytes::from(format!("{}{open_tag}>{entries}</DeleteResult>", &text[..empty])));
        }
    }
    Err(FrontError::UpstreamStatus {
        step: "DeleteObjects (no DeleteResult in the answer)",
        status: StatusCode::BAD_GATEWAY,
    })
}

fn escape(text: &str) -> String {
    quick_xml::escape::escape(text).into_owned()
}

/// Object heads read at once for the stamp checks of one DeleteObjects.
const STAMP_CHECKS_CONCURRENT: usize = 16;

impl Front {
    /// DeleteObjects: each key against its own resource; stale keys become per-key errors.
    /// `lease`: signed with a lease credential, whose resource every key must belong to.
    pub(super) async fn delete_objects(
        &self,
        request: Request,
        token: FenceToken,
        lease: Option<ResourceKey>,
    ) -> Result<S3Response<Body>, FrontError> {
        let bucket = request.target.bucket.clone().ok_or(FrontError::NotSupported("DeleteObjects without a bucket"))?;
        let path = request.path_and_query();
        let parsed = read(request.body).await?;
        let mut by_resource: std::collections::BTreeMap<ResourceKey, Vec<ObjectId>> = Default::default();
        let mut refused = Vec::new();
        for object in parsed.objects {
            if let Err(error) = super::checks::check_key(&object.key) {
                refused.push(error_entry(&object, error.code(), &error.to_string()));
                continue;
            }
            if let Some(lease) = &lease
                && let Err(error) = self.within_lease(lease, &bucket, &object.key)
            {
                refused.push(error_entry(&object, error.code(), &error.to_string()));
                continue;
            }
            match self.wire.resource(&request.headers, &bucket, &object.key) {
                Ok(resource) => by_resource.entry(resource).or_default().push(object),
                Err(error) => refused.push(error_entry(&object, error.code(), &error.to_string())),
            }
        }
        let mut permits = Vec::with_capacity(by_resource.len());
        let mut checked = Vec::new();
        for (resource, objects) in by_resource {
            match self.gate.admit_write(&resource, token, self.writes_advance).await {
                Ok(permit) => {
                    metrics::decision("accepted");
                    let permit = Arc::new(permit);
                    let deadline = tokio::time::Instant::now() + self.request_timeout;
                    let admitted = Admitted { token, resource: resource.clone(), permit: permit.clone(), deadline };
                    checked.extend(objects.into_iter().map(|object| (admitted.clone(), object)));
                    permits.push((resource, permit));
                }
                Err(refusal @ (AdmitError::Stale { .. } | AdmitError::Unregistered { .. })) => {
                    let error = FrontError::from(refusal);
                    metrics::decision(error.decision());
                    for object in &objects {
                        refused.push(error_entry(object, error.code(), &error.to_string()));
                    }
                }
                Err(other) => return Err(other.into()),
            }
        }
        // Each key against its stamp, as any other object write (G4): a key stamped with a newer
        // token is refused on its own.
        let mut admitted = Vec::with_capacity(checked.len());
        let stamps = futures_util::stream::iter(checked.into_iter().map(|(write, object)| {
            let bucket = &bucket;
            async move {
                let target = Target {
                    raw_path: format!("/{bucket}/{}", crate::percent::encode_key(&object.key)),
                    bucket: Some(bucket.clone()),
                    key: Some(object.key.clone()),
                };
                let name = format!("{bucket}/{}", object.key);
                let mut checked = self.object_state(&target, &name, Cached::Any, &write).await;
                if let (Ok(state), Some(etag)) = (&checked, &object.etag) {
                    // The client's condition on this key, judged as on a single delete.
                    let mut headers = HeaderMap::new();
                    if let Ok(value) = HeaderValue::from_str(etag) {
                        headers.insert(http::header::IF_MATCH, value);
                    }
                    let condition = ClientCondition::of(&headers);
                    checked = self.client_condition(&condition, &target, &name, state.clone(), &write).await;
                }
                (object, checked)
            }
        }))
        .buffer_unordered(STAMP_CHECKS_CONCURRENT)
        .collect::<Vec<_>>()
        .await;
        for (object, checked) in stamps {
            match checked {
                Ok(_) => admitted.push(object),
                Err(error) => {
                    // Stale, or its head could not be read: that key alone is refused.
                    if matches!(error, FrontError::Refused(Refusal::Stale { .. })) {
                        metrics::decision("stale");
                    }
                    refused.push(error_entry(&object, error.code(), &error.to_string()));
                }
            }
        }
        let (status, mut headers, result) = if admitted.is_empty() {
            (StatusCode::OK, HeaderMap::new(), merge(None, &refused)?)
        } else {
            let body = forwarded_body(&admitted, parsed.quiet);
            let mut headers = upstream_headers(&request.headers, &self.wire);
            rewrite_headers(&mut headers, &body);
            let resp = self.send_batch(&permits, &path, headers, Body::from(body)).await?;
            for object in &admitted {
                self.etags.forget(&format!("{bucket}/{}", object.key));
            }
            let (resp, committed) =
                self.read_write_xml(resp, &permits.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>()).await?;
            if !resp.status().is_success() || !committed {
                return Ok(client_response(resp));
            }
            let (parts, body) = resp.into_parts();
            let merged = merge(body.bytes().as_deref(), &refused)?;
            (parts.status, parts.headers, merged)
        };
        drop(permits);
        for name in ["content-length", "content-md5", "etag"] {
            headers.remove(name);
        }
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        let mut resp = S3Response::with_headers(Body::from(result), headers);
        resp.status = Some(status);
        Ok(resp)
    }

    /// The upstream call of a DeleteObjects: its keys are not conditional, so the permits of
    /// every resource it touches are held until its outcome is known (`fence::outcome`).
    async fn send_batch(
        &self,
        admitted: &[(ResourceKey, Arc<Permit>)],
        path_and_query: &str,
        headers: HeaderMap,
        body: Body,
    ) -> Result<http::Response<Body>, FrontError> {
        let deadline = tokio::time::Instant::now() + self.request_timeout;
        for (resource, permit) in admitted {
            if !permit.mark_body_sent() {
                // Cut off by a newer token (or a lost registration) since admission.
                let admitted =
                    Admitted { token: permit.token(), resource: resource.clone(), permit: permit.clone(), deadline };
                return Err(self.cut_off_error(&admitted).await);
            }
        }
        let permits: Vec<Arc<Permit>> = admitted.iter().map(|(_, p)| p.clone()).collect();
        let req = upstream_request(Method::POST, path_and_query, headers, body)?;
        let upstream = self.upstream.clone();
        let started = Instant::now();
        let call = async move { upstream.send(req).await };
        match bounded_call(&permits, deadline, self.unknown_outcome_hold, call).await {
            Bounded::Done(result) => {
                metrics::upstream_call(
                    "delete_objects",
                    started.elapsed(),
                    result.as_ref().ok().map(|r| r.status().as_u16()),
                );
                result.map_err(FrontError::Upstream)
            }
            Bounded::CutOff | Bounded::Unknown => {
                Err(FrontError::OutcomeUnknown { after_ms: millis(self.request_timeout) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_rewrite() {
        let xml = r#"<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Object><Key>a&amp;b</Key></Object><Object><Key>c</Key><VersionId>v1</VersionId></Object><Quiet>true</Quiet></Delete>"#;
        let req: DeleteRequest = quick_xml::de::from_str(xml).unwrap();
        assert_eq!(req.objects.len(), 2);
        assert_eq!(req.objects[0].key, "a&b");
        assert_eq!(req.quiet, Some(true));
        let body = forwarded_body(&req.objects[1..], req.quiet);
        let again: DeleteRequest = quick_xml::de::from_str(std::str::from_utf8(&body).unwrap()).unwrap();
        assert_eq!(again.objects[0].key, "c");
        assert_eq!(again.objects[0].version_id.as_deref(), Some("v1"));
    }

    #[test]
    fn refused_keys_are_merged_into_the_result() {
        let refused = vec![error_entry(
            &ObjectId { key: "x<y".into(), version_id: None, etag: None },
            "FencingTokenStale",
            "old",
        )];
        let merged = merge(Some(b"<DeleteResult><Deleted><Key>a</Key></Deleted></DeleteResult>"), &refused).unwrap();
        assert_eq!(
            std::str::from_utf8(&merged).unwrap(),
            "<DeleteResult><Deleted><Key>a</Key></Deleted><Error><Key>x&lt;y</Key><Code>FencingTokenStale</Code><Message>old</Message></Error></DeleteResult>"
        );
        let empty = merge(Some(b"<DeleteResult xmlns=\"n\"/>"), &refused).unwrap();
        assert!(std::str::from_utf8(&empty).unwrap().starts_with("<DeleteResult xmlns=\"n\"><Error>"));
        assert!(merge(None, &refused).unwrap().ends_with(b"</Error></DeleteResult>"));
    }
}
