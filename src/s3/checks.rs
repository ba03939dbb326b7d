//! What a request may name, checked before anything is sent: keys no upstream may see, and
//! headers fencegate cannot pass on as the client meant them.

use http::HeaderMap;

use super::Front;
use super::error::FrontError;

/// A file name's limit on the file systems the local upstream runs on.
const LOCAL_FILE_NAME_BYTES_MAX: usize = 255;

/// The longest file name the local upstream (s3s-fs 0.14, pinned) makes for an object: the
/// metadata of a multipart upload, `.bucket-{base64 bucket}.object-{base64 key}.upload-{uuid}
/// .metadata.json`. A key whose name would not fit fails in the file system (500) after
/// fencegate admitted the write; it is refused first.
fn local_metadata_name_bytes(bucket: &str, key: &str) -> usize {
    let base64 = |n: usize| (n * 4).div_ceil(3);
    ".bucket-".len()
        + base64(bucket.len())
        + ".object-".len()
        + base64(key.len())
        + ".upload-".len()
        + 36
        + ".metadata.json".len()
}

/// The longest key the local upstream holds in `bucket`.
fn local_key_bytes_max(bucket: &str) -> usize {
    let mut n = 0;
    while local_metadata_name_bytes(bucket, &"k".repeat(n + 1)) <= LOCAL_FILE_NAME_BYTES_MAX {
        n += 1;
    }
    n
}

impl Front {
    /// Keys no upstream may see, wherever they are named (the path, a DeleteObjects body): dot
    /// segments always; on the local upstream, which keeps objects as files, an empty segment
    /// (`a//b`, `/a`, `a/b/`), which would be the same file as another key fenced as another
    /// resource.
    pub(super) fn check_key(&self, bucket: &str, key: &str) -> Result<(), FrontError> {
        if key.split('/').any(|segment| segment == "." || segment == "..") {
            return Err(FrontError::UnsafeKey);
        }
        if self.upstream.kind() == "local" && key.split('/').any(str::is_empty) {
            return Err(FrontError::EmptySegmentOnLocal);
        }
        if self.upstream.kind() == "local" && local_metadata_name_bytes(bucket, key) > LOCAL_FILE_NAME_BYTES_MAX {
            return Err(FrontError::KeyTooLongOnLocal { max: local_key_bytes_max(bucket) });
        }
        Ok(())
    }
}

/// Headers fencegate cannot pass on as the client meant them, refused before anything is sent:
/// a metadata value that is not US-ASCII (the upstream request is signed anew, and a SigV4
/// signature covers text only; S3 wants such values RFC 2047-encoded), and a copy source with
/// `.` or `..` segments (another object than the one named, once a path is normalised).
pub(super) fn check_headers(headers: &HeaderMap) -> Result<(), FrontError> {
    for (name, value) in headers {
        if name.as_str().starts_with("x-amz-meta-") && value.to_str().is_err() {
            return Err(FrontError::NonAsciiMetadata(name.as_str().to_owned()));
        }
    }
    if let Some(source) = headers.get("x-amz-copy-source") {
        let source = source.to_str().map_err(|_| FrontError::UnsafeKey)?;
        let path = source.split('?').next().unwrap_or("");
        let decoded = crate::percent::decode(path).ok_or(FrontError::UnsafeKey)?;
        if decoded.split('/').any(|segment| segment == "." || segment == "..") {
            return Err(FrontError::UnsafeKey);
        }
    }
    Ok(())
}
