//! DeleteObjects: every key is checked against its own resource. Stale keys come back as
//! per-key `<Error>` entries (`FencingTokenStale`); the others are forwarded in a rewritten
//! request body, with a fresh `Content-MD5`, and the two results are merged.

use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use md5::Digest;
use serde::Deserialize;

use super::error::FrontError;

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
