//! The S3 header names fencegate looks up, as constants. A lookup by a `&str` parses and
//! checks the name on every call before hashing it; a constant is parsed once, at compile
//! time (a tenth of a rejected write's instructions went to parsing names).

use http::HeaderName;

pub const X_AMZ_DATE: HeaderName = HeaderName::from_static("x-amz-date");
pub const X_AMZ_CONTENT_SHA256: HeaderName = HeaderName::from_static("x-amz-content-sha256");
pub const X_AMZ_DECODED_CONTENT_LENGTH: HeaderName = HeaderName::from_static("x-amz-decoded-content-length");
pub const X_AMZ_TRAILER: HeaderName = HeaderName::from_static("x-amz-trailer");
pub const X_AMZ_SDK_CHECKSUM_ALGORITHM: HeaderName = HeaderName::from_static("x-amz-sdk-checksum-algorithm");
pub const X_AMZ_COPY_SOURCE: HeaderName = HeaderName::from_static("x-amz-copy-source");
pub const X_AMZ_SECURITY_TOKEN: HeaderName = HeaderName::from_static("x-amz-security-token");
pub const X_AMZ_REQUEST_ID: HeaderName = HeaderName::from_static("x-amz-request-id");
