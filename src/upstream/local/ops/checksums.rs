//! The checksums a write asks for and sends, and their check against what was stored.

use super::*;

/// The checksum hashers a write asks for: by the values it sends, or by its algorithm.
pub(super) fn hashers(
    algorithm: Option<&ChecksumAlgorithm>,
    sent: &Checksums,
) -> S3Result<s3s::checksum::ChecksumHasher> {
    let mut h = s3s::checksum::ChecksumHasher::default();
    if sent.crc32.is_some() {
        h.crc32 = Some(Default::default());
    }
    if sent.crc32c.is_some() {
        h.crc32c = Some(Default::default());
    }
    if sent.sha1.is_some() {
        h.sha1 = Some(Default::default());
    }
    if sent.sha256.is_some() {
        h.sha256 = Some(Default::default());
    }
    if sent.crc64nvme.is_some() {
        h.crc64nvme = Some(Default::default());
    }
    match algorithm.map(ChecksumAlgorithm::as_str) {
        None => {}
        Some(ChecksumAlgorithm::CRC32) => h.crc32 = Some(Default::default()),
        Some(ChecksumAlgorithm::CRC32C) => h.crc32c = Some(Default::default()),
        Some(ChecksumAlgorithm::SHA1) => h.sha1 = Some(Default::default()),
        Some(ChecksumAlgorithm::SHA256) => h.sha256 = Some(Default::default()),
        Some(ChecksumAlgorithm::CRC64NVME) => h.crc64nvme = Some(Default::default()),
        Some(other) => return Err(s3_error!(InvalidArgument, "unknown checksum algorithm {other}")),
    }
    Ok(h)
}

/// Checksums the client sent, in headers or (streaming) in trailers.
pub(super) fn sent_checksums(headers: Checksums, trailers: Option<&s3s::TrailingHeaders>) -> S3Result<Checksums> {
    let mut sent = headers;
    let Some(trailers) = trailers.and_then(s3s::TrailingHeaders::take) else { return Ok(sent) };
    let value = |name: &str| -> S3Result<Option<String>> {
        trailers
            .get(name)
            .map(|v| {
                v.to_str().map(str::to_owned).map_err(|_| s3_error!(InvalidArgument, "a checksum trailer is not text"))
            })
            .transpose()
    };
    sent.crc32 = value("x-amz-checksum-crc32")?.or(sent.crc32);
    sent.crc32c = value("x-amz-checksum-crc32c")?.or(sent.crc32c);
    sent.sha1 = value("x-amz-checksum-sha1")?.or(sent.sha1);
    sent.sha256 = value("x-amz-checksum-sha256")?.or(sent.sha256);
    sent.crc64nvme = value("x-amz-checksum-crc64nvme")?.or(sent.crc64nvme);
    Ok(sent)
}

/// Every checksum the client sent matches the bytes; `Content-MD5` too.
pub(super) fn verify(written: &Written, content_md5: Option<&str>, sent: &Checksums) -> S3Result<()> {
    if let Some(content_md5) = content_md5 {
        use base64::Engine;
        let digest = base64::engine::general_purpose::STANDARD
            .decode(content_md5)
            .map_err(|_| s3_error!(InvalidDigest, "The Content-MD5 you specified was not valid"))?;
        if hex::encode(digest) != written.md5 {
            return Err(s3_error!(BadDigest, "The Content-MD5 you specified did not match what we received"));
        }
    }
    let pairs = [
        ("CRC32", &sent.crc32, &written.checksums.crc32),
        ("CRC32C", &sent.crc32c, &written.checksums.crc32c),
        ("SHA1", &sent.sha1, &written.checksums.sha1),
        ("SHA256", &sent.sha256, &written.checksums.sha256),
        ("CRC64NVME", &sent.crc64nvme, &written.checksums.crc64nvme),
    ];
    for (name, sent, computed) in pairs {
        if sent.is_some() && sent != computed {
            return Err(s3_error!(BadDigest, "The {name} you specified did not match the calculated checksum"));
        }
    }
    Ok(())
}
