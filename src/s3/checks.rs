//! What a request may name, checked before anything is sent: keys no upstream may see, and
//! headers fencegate cannot pass on as the client meant them.

use http::HeaderMap;

use super::error::FrontError;

/// S3's limit on a key's length, in bytes.
const KEY_BYTES_MAX: usize = 1024;

/// Keys no upstream may see, wherever they are named (the path, a DeleteObjects body): dot
/// segments (another object than the one named, once a client or a store normalises the path),
/// and keys longer than S3 allows.
pub(super) fn check_key(key: &str) -> Result<(), FrontError> {
    if key.split('/').any(|segment| segment == "." || segment == "..") {
        return Err(FrontError::UnsafeKey);
    }
    if key.len() > KEY_BYTES_MAX {
        return Err(FrontError::KeyTooLong { max: KEY_BYTES_MAX });
    }
    Ok(())
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
    if let Some(source) = headers.get(crate::aws::amz::X_AMZ_COPY_SOURCE) {
        let source = source.to_str().map_err(|_| FrontError::UnsafeKey)?;
        let path = source.split('?').next().unwrap_or("");
        let decoded = crate::net::percent::decode(path).ok_or(FrontError::UnsafeKey)?;
        if decoded.split('/').any(|segment| segment == "." || segment == "..") {
            return Err(FrontError::UnsafeKey);
        }
    }
    Ok(())
}
