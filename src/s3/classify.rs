//! What an S3 request is: its target (bucket, key) and whether it is a fenced write.
//! Pure functions of the request line and headers.

use http::{HeaderMap, Method, Uri};

use super::error::FrontError;

/// The object (or bucket) a request addresses, in path-style form for the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub bucket: Option<String>,
    /// The decoded key.
    pub key: Option<String>,
    /// `/bucket/key` exactly as the client encoded it (virtual-hosted requests rewritten to
    /// path-style): what the upstream receives, so no key is re-encoded differently.
    pub raw_path: String,
}

impl Target {
    /// `bucket/key`, the default resource of an object write.
    pub fn object_name(&self) -> Option<String> {
        // Joined, not formatted: the formatter's machinery cost a write about 600 instructions.
        Some([self.bucket.as_deref()?, "/", self.key.as_deref()?].concat())
    }
}

/// Parses the target; `domain` enables virtual-hosted addressing (`bucket.<domain>`).
pub fn target(uri: &Uri, headers: &HeaderMap, domain: Option<&str>) -> Result<Target, FrontError> {
    let raw = uri.path();
    let host_bucket = domain.and_then(|d| virtual_host_bucket(headers, d));
    let raw_path = match &host_bucket {
        Some(bucket) => format!("/{bucket}{raw}"),
        None => raw.to_owned(),
    };
    let decoded = crate::net::percent::decode(&raw_path).ok_or(FrontError::UnsafeKey)?;
    let rest = decoded.strip_prefix('/').unwrap_or(&*decoded);
    let (bucket, key) = match rest.split_once('/') {
        Some((b, k)) if !k.is_empty() => (Some(b.to_owned()), Some(k.to_owned())),
        Some((b, _)) => (Some(b.to_owned()), None),
        None if rest.is_empty() => (None, None),
        None => (Some(rest.to_owned()), None),
    };
    if let Some(key) = &key
        && has_dot_segment(key)
    {
        return Err(FrontError::UnsafeKey);
    }
    Ok(Target { bucket, key, raw_path })
}

/// Whether a segment of `key` between slashes is `.` or `..` (split by a byte predicate: no
/// `memchr` set up per segment).
fn has_dot_segment(key: &str) -> bool {
    key.as_bytes().split(|&b| b == b'/').any(|segment| matches!(segment, b"." | b".."))
}

fn virtual_host_bucket(headers: &HeaderMap, domain: &str) -> Option<String> {
    let host = headers.get(http::header::HOST)?.to_str().ok()?;
    let host =
        host.rsplit_once(':').map_or(host, |(h, port)| if port.bytes().all(|b| b.is_ascii_digit()) { h } else { host });
    let bucket = host.strip_suffix(domain)?.strip_suffix('.')?;
    (!bucket.is_empty()).then(|| bucket.to_owned())
}

/// The S3 operations fencegate treats differently. Everything else passes through unfenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    PutObject,
    CopyObject,
    DeleteObject,
    DeleteObjects,
    CreateMultipartUpload,
    UploadPart,
    UploadPartCopy,
    CompleteMultipartUpload,
    AbortMultipartUpload,
    /// Tagging, ACL, retention, legal hold.
    ObjectSubresourceWrite,
    /// A browser form upload (`POST /bucket`): an object write fencegate cannot stamp; refused.
    PostObject,
    /// Reads, listings, bucket operations.
    PassThrough,
}

impl Op {
    /// CreateMultipartUpload, UploadPart, UploadPartCopy or CompleteMultipartUpload: the steps
    /// that make or use an upload, whose records name their signer.
    pub fn is_multipart_step(self) -> bool {
        matches!(
            self,
            Self::CreateMultipartUpload | Self::UploadPart | Self::UploadPartCopy | Self::CompleteMultipartUpload
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::PutObject => "PutObject",
            Self::CopyObject => "CopyObject",
            Self::DeleteObject => "DeleteObject",
            Self::DeleteObjects => "DeleteObjects",
            Self::CreateMultipartUpload => "CreateMultipartUpload",
            Self::UploadPart => "UploadPart",
            Self::UploadPartCopy => "UploadPartCopy",
            Self::CompleteMultipartUpload => "CompleteMultipartUpload",
            Self::AbortMultipartUpload => "AbortMultipartUpload",
            Self::ObjectSubresourceWrite => "ObjectSubresourceWrite",
            Self::PostObject => "PostObject",
            Self::PassThrough => "PassThrough",
        }
    }

    pub fn is_fenced_write(self) -> bool {
        self != Self::PassThrough
    }
}

/// Object sub-resources whose PUT/DELETE changes the object.
const OBJECT_SUBRESOURCES: &[&str] = &["tagging", "acl", "retention", "legal-hold"];

pub fn classify(method: &Method, target: &Target, query: Option<&str>, headers: &HeaderMap) -> Op {
    let has = |name: &str| query_has(query, name);
    let copy = headers.contains_key(crate::aws::amz::X_AMZ_COPY_SOURCE);
    if target.key.is_none() {
        return match *method {
            Method::POST if has("delete") => Op::DeleteObjects,
            // The only other POST on a bucket is a browser form upload: an object write.
            Method::POST if target.bucket.is_some() => Op::PostObject,
            _ => Op::PassThrough,
        };
    }
    match *method {
        Method::PUT if has("uploadId") && has("partNumber") => {
            if copy {
                Op::UploadPartCopy
            } else {
                Op::UploadPart
            }
        }
        Method::PUT if OBJECT_SUBRESOURCES.iter().any(|s| has(s)) => Op::ObjectSubresourceWrite,
        Method::PUT if copy => Op::CopyObject,
        Method::PUT => Op::PutObject,
        Method::DELETE if has("uploadId") => Op::AbortMultipartUpload,
        Method::DELETE if has("tagging") => Op::ObjectSubresourceWrite,
        Method::DELETE => Op::DeleteObject,
        // `?uploads&uploadId=U` is a completion to an upstream that reads `uploadId` first:
        // classified as the commit point, so it is checked and conditional either way.
        Method::POST if has("uploadId") => Op::CompleteMultipartUpload,
        Method::POST if has("uploads") => Op::CreateMultipartUpload,
        _ => Op::PassThrough,
    }
}

/// Whether the query has parameter `name` (with or without a value).
pub fn query_has(query: Option<&str>, name: &str) -> bool {
    query.is_some_and(|q| q.split('&').any(|pair| pair.split('=').next() == Some(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(method: Method, uri: &str, copy: bool) -> Op {
        let uri: Uri = uri.parse().unwrap();
        let mut headers = HeaderMap::new();
        if copy {
            headers.insert("x-amz-copy-source", "/src/k".parse().unwrap());
        }
        let t = target(&uri, &headers, None).unwrap();
        classify(&method, &t, uri.query(), &headers)
    }

    #[test]
    fn every_object_write_is_classified() {
        assert_eq!(op(Method::PUT, "/b/k", false), Op::PutObject);
        assert_eq!(op(Method::PUT, "/b/k", true), Op::CopyObject);
        assert_eq!(op(Method::DELETE, "/b/k", false), Op::DeleteObject);
        assert_eq!(op(Method::POST, "/b?delete", false), Op::DeleteObjects);
        assert_eq!(op(Method::POST, "/b/k?uploads", false), Op::CreateMultipartUpload);
        assert_eq!(op(Method::PUT, "/b/k?partNumber=1&uploadId=x", false), Op::UploadPart);
        assert_eq!(op(Method::PUT, "/b/k?partNumber=1&uploadId=x", true), Op::UploadPartCopy);
        assert_eq!(op(Method::POST, "/b/k?uploadId=x", false), Op::CompleteMultipartUpload);
        assert_eq!(op(Method::DELETE, "/b/k?uploadId=x", false), Op::AbortMultipartUpload);
        assert_eq!(op(Method::PUT, "/b/k?tagging", false), Op::ObjectSubresourceWrite);
        assert_eq!(op(Method::PUT, "/b/k?legal-hold", false), Op::ObjectSubresourceWrite);
        assert_eq!(op(Method::DELETE, "/b/k?tagging", false), Op::ObjectSubresourceWrite);
        assert_eq!(op(Method::POST, "/b", false), Op::PostObject);
        assert_eq!(op(Method::POST, "/b/k?uploads&uploadId=x", false), Op::CompleteMultipartUpload);
    }

    #[test]
    fn reads_and_bucket_operations_pass_through() {
        assert_eq!(op(Method::GET, "/b/k", false), Op::PassThrough);
        assert_eq!(op(Method::HEAD, "/b/k", false), Op::PassThrough);
        assert_eq!(op(Method::GET, "/b?list-type=2", false), Op::PassThrough);
        assert_eq!(op(Method::PUT, "/b", false), Op::PassThrough);
        assert_eq!(op(Method::GET, "/", false), Op::PassThrough);
    }

    #[test]
    fn targets_decode_keys_and_refuse_dot_segments() {
        let t = target(&"/b/a%20b/c".parse().unwrap(), &HeaderMap::new(), None).unwrap();
        assert_eq!(t.object_name().as_deref(), Some("b/a b/c"));
        assert_eq!(t.raw_path, "/b/a%20b/c");
        for bad in ["/b/../x", "/b/a/./x", "/b/%2e%2e/x", "/b/%ff", "/b/.", "/b/..", "/b/x/..", "/b/x/.", "/b/./"] {
            assert!(target(&bad.parse().unwrap(), &HeaderMap::new(), None).is_err(), "{bad}");
        }
        for good in ["/b/...", "/b/.x/..y", "/b/x./y..", "/b/a//b", "/b/x/"] {
            assert!(target(&good.parse().unwrap(), &HeaderMap::new(), None).is_ok(), "{good}");
        }
    }

    #[test]
    fn dot_segments_are_found_as_split_finds_them() {
        // Every key of up to five bytes made of `.`, `/` and `a`.
        let mut keys = vec![String::new()];
        for _ in 0..5 {
            let longer: Vec<String> = keys.iter().flat_map(|k| ['.', '/', 'a'].map(|c| format!("{k}{c}"))).collect();
            keys.extend(longer);
        }
        keys.sort();
        keys.dedup();
        for key in &keys {
            let by_split = key.split('/').any(|segment| segment == "." || segment == "..");
            assert_eq!(has_dot_segment(key), by_split, "{key:?}");
        }
    }

    #[test]
    fn virtual_hosted_requests_become_path_style() {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, "photos.s3.example.test:9000".parse().unwrap());
        let t = target(&"/2026/a.jpg".parse().unwrap(), &headers, Some("s3.example.test")).unwrap();
        assert_eq!(t.raw_path, "/photos/2026/a.jpg");
        assert_eq!(t.object_name().as_deref(), Some("photos/2026/a.jpg"));
    }
}
