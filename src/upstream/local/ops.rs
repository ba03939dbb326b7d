//! The local store's S3 operations: what S3 answers for everything fencegate forwards, on
//! [`Records`]. Bodies stream to a new data file with no lock held; each write's conditions are
//! judged inside its commit (records.rs). Reads open every data file of the object before
//! answering, so a concurrent overwrite (which removes the old files) cannot cut a body short.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use s3s::dto::*;
use s3s::stream::{ByteStream, RemainingLength};
use s3s::{S3, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, s3_error};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWriteExt, ReadBuf};

use super::records::{
    Attributes, Checksums, ObjectRecord, PartRecord, Precondition, Records, Segment, StoreError, UploadRecord, now_ms,
};

/// S3's limit on a key's length, in bytes.
const KEY_BYTES_MAX: usize = 1024;
/// S3's part numbers.
const PART_NUMBERS: std::ops::RangeInclusive<i32> = 1..=10_000;
/// A listing's page when the client names none, and the most it may ask for.
const LIST_KEYS_DEFAULT: i32 = 1000;
/// Reads of an object retried when a concurrent overwrite removed its files between reading
/// the record and opening them.
const OPEN_ATTEMPTS: usize = 5;
/// The buffer a read streams through.
const READ_CHUNK: usize = 64 * 1024;
/// The one owner the local store knows (every request reaching it was authorised by fencegate).
const OWNER_ID: &str = "fencegate";

pub struct LocalStore {
    records: Records,
}

impl LocalStore {
    pub fn new(records: Records) -> Self {
        Self { records }
    }

    /// Runs a store step on the blocking pool (redb and the file system block).
    async fn run<T: Send + 'static>(
        &self,
        step: impl FnOnce(&Records) -> Result<T, StoreError> + Send + 'static,
    ) -> S3Result<T> {
        let records = self.records.clone();
        tokio::task::spawn_blocking(move || step(&records)).await.map_err(S3Error::internal_error)?.map_err(s3_error_of)
    }

    /// Removes data files no record names any more, off the request's path.
    fn forget(&self, files: Vec<String>) {
        if files.is_empty() {
            return;
        }
        let records = self.records.clone();
        tokio::task::spawn_blocking(move || records.remove_files(files.iter().map(String::as_str)));
    }

    /// The object's record and its data files, opened. Retried when an overwrite removed the
    /// files between the record's read and their opening.
    async fn open(&self, bucket: &str, key: &str) -> S3Result<(ObjectRecord, Vec<tokio::fs::File>)> {
        for _ in 0..OPEN_ATTEMPTS {
            let (b, k) = (bucket.to_owned(), key.to_owned());
            let record = self.run(move |r| r.object(&b, &k)).await?;
            let mut files = Vec::with_capacity(record.segments.len());
            let mut gone = false;
            for segment in &record.segments {
                match tokio::fs::File::open(self.records.data_path(&segment.file)).await {
                    Ok(file) => files.push(file),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        gone = true;
                        break;
                    }
                    Err(e) => return Err(internal("cannot open a data file", e)),
                }
            }
            if !gone {
                return Ok((record, files));
            }
        }
        Err(s3_error!(SlowDown, "the object is being rewritten; retry"))
    }

    /// Streams `body` to a new data file, synced with its directory entry, hashing it as it
    /// goes. On any error the file is removed.
    async fn write_file(
        &self,
        body: impl Stream<Item = Result<Bytes, s3s::StdError>> + Unpin,
        checksums: s3s::checksum::ChecksumHasher,
    ) -> S3Result<Written> {
        let (name, path) = self.records.new_data_file();
        let result = async {
            let mut file =
                tokio::fs::File::create(&path).await.map_err(|e| internal("cannot create a data file", e))?;
            let (size, md5, checksums) = copy_hashing(body, &mut file, checksums).await?;
            file.sync_all().await.map_err(|e| internal("cannot sync a data file", e))?;
            let records = self.records.clone();
            tokio::task::spawn_blocking(move || records.sync_data_dir())
                .await
                .map_err(S3Error::internal_error)?
                .map_err(|e| internal("cannot sync the data directory", e))?;
            Ok(Written { file: name.clone(), size, md5, checksums })
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&path).await;
        }
        result
    }

    /// Writes the bytes `range` of an opened object to a new data file (a copy).
    async fn copy_file(
        &self,
        record: &ObjectRecord,
        files: Vec<tokio::fs::File>,
        range: std::ops::Range<u64>,
    ) -> S3Result<Written> {
        let reader = SegmentReader::open(record, files, range).await?;
        let body = tokio_util::io::ReaderStream::with_capacity(reader, READ_CHUNK)
            .map(|chunk| chunk.map_err(|e| Box::new(e) as s3s::StdError));
        self.write_file(Box::pin(body), s3s::checksum::ChecksumHasher::default()).await
    }

    /// The bucket exists, or `NoSuchBucket` (checked before a body is read).
    async fn bucket(&self, bucket: &str) -> S3Result<()> {
        let b = bucket.to_owned();
        if self.run(move |r| r.bucket_exists(&b)).await? { Ok(()) } else { Err(s3_error_of(StoreError::NoSuchBucket)) }
    }

    /// Commits a written file as the object, removing the file if the commit does not happen.
    async fn commit(
        &self,
        bucket: String,
        key: String,
        condition: Precondition,
        record: ObjectRecord,
    ) -> S3Result<ObjectRecord> {
        let file = record.segments.first().map(|s| s.file.clone());
        let committed = record.clone();
        match self.run(move |r| r.commit_object(&bucket, &key, &condition, &record)).await {
            Ok(replaced) => {
                self.forget(replaced);
                Ok(committed)
            }
            Err(e) => {
                self.forget(file.into_iter().collect());
                Err(e)
            }
        }
    }

    /// A listing of `bucket`: objects and common prefixes in key order after `after`.
    async fn list(&self, bucket: &str, query: Listing) -> S3Result<Listed> {
        let b = bucket.to_owned();
        self.run(move |r| list_keys(r, &b, &query)).await
    }
}

/// A data file just written and synced.
struct Written {
    file: String,
    size: u64,
    md5: String,
    checksums: Checksums,
}

impl Written {
    fn record(self, etag: Option<String>, attributes: Attributes, checksums: Option<Checksums>) -> ObjectRecord {
        ObjectRecord {
            etag: etag.unwrap_or(self.md5),
            size: self.size,
            modified_ms: now_ms(),
            segments: vec![Segment { file: self.file, size: self.size }],
            attributes,
            checksums: checksums.unwrap_or(self.checksums),
        }
    }
}

async fn copy_hashing(
    mut body: impl Stream<Item = Result<Bytes, s3s::StdError>> + Unpin,
    file: &mut tokio::fs::File,
    mut checksums: s3s::checksum::ChecksumHasher,
) -> S3Result<(u64, String, Checksums)> {
    use md5::Digest;
    let mut md5 = md5::Md5::new();
    let mut size = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| S3Error::with_source(S3ErrorCode::IncompleteBody, e))?;
        md5.update(&chunk);
        checksums.update(&chunk);
        file.write_all(&chunk).await.map_err(|e| internal("cannot write a data file", e))?;
        size += chunk.len() as u64;
    }
    file.flush().await.map_err(|e| internal("cannot write a data file", e))?;
    let sums = checksums.finalize();
    let checksums = Checksums {
        crc32: sums.checksum_crc32,
        crc32c: sums.checksum_crc32c,
        crc64nvme: sums.checksum_crc64nvme,
        sha1: sums.checksum_sha1,
        sha256: sums.checksum_sha256,
    };
    Ok((size, hex::encode(md5.finalize()), checksums))
}

fn internal(what: &str, e: impl std::fmt::Display) -> S3Error {
    tracing::error!(error = %e, "local store: {what}");
    S3Error::with_message(S3ErrorCode::InternalError, format!("local store: {what}"))
}

fn s3_error_of(e: StoreError) -> S3Error {
    let code = match &e {
        StoreError::NoSuchBucket => S3ErrorCode::NoSuchBucket,
        StoreError::NoSuchKey => S3ErrorCode::NoSuchKey,
        StoreError::NoSuchUpload => S3ErrorCode::NoSuchUpload,
        StoreError::PreconditionFailed => S3ErrorCode::PreconditionFailed,
        StoreError::BucketNotEmpty => S3ErrorCode::BucketNotEmpty,
        StoreError::BucketAlreadyOwnedByYou => S3ErrorCode::BucketAlreadyOwnedByYou,
        StoreError::InvalidPart(_) => S3ErrorCode::InvalidPart,
        StoreError::InvalidPartOrder => S3ErrorCode::InvalidPartOrder,
        StoreError::EntityTooSmall(_) => S3ErrorCode::EntityTooSmall,
        StoreError::Internal(_) => return internal("store failed", e),
    };
    S3Error::with_message(code, e.to_string())
}

fn check_key(key: &str) -> S3Result<()> {
    if key.len() > KEY_BYTES_MAX {
        return Err(s3_error!(KeyTooLongError, "Your key is too long (at most 1024 bytes)"));
    }
    Ok(())
}

/// Only the null version exists in an unversioned bucket.
fn check_version(version_id: Option<&str>) -> S3Result<()> {
    match version_id {
        None | Some("null") => Ok(()),
        Some(_) => Err(s3_error!(InvalidArgument, "Invalid version id specified")),
    }
}

fn condition_value(condition: Option<&ETagCondition>) -> Option<Option<String>> {
    condition.map(|c| c.as_etag().map(|e| e.value().to_owned()))
}

fn write_condition(if_match: Option<&ETagCondition>, if_none_match: Option<&ETagCondition>) -> Precondition {
    Precondition { if_match: condition_value(if_match), if_none_match: condition_value(if_none_match) }
}

/// A header's `If-Match` / `If-None-Match` (CopyObject's input does not carry them).
fn header_condition(headers: &http::HeaderMap, name: http::header::HeaderName) -> S3Result<Option<ETagCondition>> {
    headers
        .get(name)
        .map(|v| ETagCondition::parse_http_header(v.as_bytes()))
        .transpose()
        .map_err(|_| s3_error!(InvalidArgument, "a condition header is not an entity tag or *"))
}

fn timestamp(ms: u64) -> Timestamp {
    Timestamp::from(UNIX_EPOCH + Duration::from_millis(ms))
}

/// Whole seconds since the epoch: HTTP dates have no finer resolution.
fn seconds(t: &Timestamp) -> i64 {
    time::OffsetDateTime::from(t.clone()).unix_timestamp()
}

/// Now, in whole seconds since the epoch, as [`seconds`].
fn now_seconds() -> i64 {
    i64::try_from(now_ms() / 1000).unwrap_or(i64::MAX)
}

fn http_date(expires: Option<&Timestamp>) -> Option<String> {
    let mut out = Vec::new();
    expires?.format(TimestampFormat::HttpDate, &mut out).ok()?;
    String::from_utf8(out).ok()
}

fn expires_of(a: &Attributes) -> Option<Timestamp> {
    Timestamp::parse(TimestampFormat::HttpDate, a.expires.as_deref()?).ok()
}

fn etag_of(record: &ObjectRecord) -> ETag {
    ETag::Strong(record.etag.clone())
}

fn matches(condition: &ETagCondition, etag: &str) -> bool {
    match condition {
        ETagCondition::Any => true,
        ETagCondition::ETag(e) => e.value() == etag,
    }
}

/// A read's conditions, in S3's order: `If-Match` (else `If-Unmodified-Since`) fails with 412;
/// `If-None-Match` (else `If-Modified-Since`) with 304 (`not_modified`), or 412 for a copy's
/// source.
struct ReadConditions<'a> {
    if_match: Option<&'a ETagCondition>,
    if_unmodified_since: Option<&'a Timestamp>,
    if_none_match: Option<&'a ETagCondition>,
    if_modified_since: Option<&'a Timestamp>,
}

/// A read's conditions from an input's four fields (GetObject and HeadObject name them alike,
/// CopyObject and UploadPartCopy with `copy_source_`).
macro_rules! read_conditions {
    ($input:ident, $if_match:ident, $if_unmodified_since:ident, $if_none_match:ident, $if_modified_since:ident) => {
        ReadConditions {
            if_match: $input.$if_match.as_ref(),
            if_unmodified_since: $input.$if_unmodified_since.as_ref(),
            if_none_match: $input.$if_none_match.as_ref(),
            if_modified_since: $input.$if_modified_since.as_ref(),
        }
    };
}

/// A copy's conditions on its source (CopyObject and UploadPartCopy).
macro_rules! copy_source_conditions {
    ($input:ident) => {
        read_conditions!(
            $input,
            copy_source_if_match,
            copy_source_if_unmodified_since,
            copy_source_if_none_match,
            copy_source_if_modified_since
        )
    };
}

impl ReadConditions<'_> {
    fn check(&self, record: &ObjectRecord, not_modified: bool) -> S3Result<()> {
        let modified = i64::try_from(record.modified_ms / 1000).unwrap_or(i64::MAX);
        let failed = match self.if_match {
            Some(c) => !matches(c, &record.etag),
            None => self.if_unmodified_since.is_some_and(|t| modified > seconds(t)),
        };
        if failed {
            return Err(s3_error!(PreconditionFailed, "At least one of the pre-conditions you specified did not hold"));
        }
        let unchanged = match self.if_none_match {
            Some(c) => matches(c, &record.etag),
            // A date later than now is ignored (RFC 9110, 13.1.3), as S3 ignores it.
            None => self.if_modified_since.is_some_and(|t| modified <= seconds(t) && seconds(t) <= now_seconds()),
        };
        if !unchanged {
            return Ok(());
        }
        if !not_modified {
            return Err(s3_error!(PreconditionFailed, "At least one of the pre-conditions you specified did not hold"));
        }
        let mut error = S3Error::new(S3ErrorCode::NotModified);
        let mut headers = http::HeaderMap::new();
        if let Ok(value) = http::HeaderValue::from_str(&format!("\"{}\"", record.etag)) {
            headers.insert(http::header::ETAG, value);
        }
        error.set_headers(headers);
        Err(error)
    }
}

/// The bytes of an object a read or a copy asks for: `range`, or part `part_number`.
fn byte_range(
    record: &ObjectRecord,
    range: Option<&Range>,
    part_number: Option<i32>,
) -> S3Result<std::ops::Range<u64>> {
    if let Some(n) = part_number {
        if range.is_some() {
            return Err(s3_error!(InvalidRequest, "Cannot specify both Range header and partNumber query parameter"));
        }
        let index = usize::try_from(n).ok().and_then(|n| n.checked_sub(1));
        let Some(index) = index.filter(|i| *i < record.segments.len().max(1)) else {
            let code = S3ErrorCode::Custom("InvalidPartNumber".into());
            let mut error = S3Error::with_message(code, "The requested partnumber is not satisfiable");
            error.set_status_code(http::StatusCode::RANGE_NOT_SATISFIABLE);
            return Err(error);
        };
        let start: u64 = record.segments[..index.min(record.segments.len())].iter().map(|s| s.size).sum();
        let size = record.segments.get(index).map_or(0, |s| s.size);
        return Ok(start..start + size);
    }
    match range {
        None => Ok(0..record.size),
        Some(range) => Ok(range.check(record.size)?),
    }
}

/// Reads an object's bytes `range` across its segments' (already opened) files.
struct SegmentReader {
    files: VecDeque<tokio::io::Take<tokio::fs::File>>,
}

impl SegmentReader {
    async fn open(record: &ObjectRecord, files: Vec<tokio::fs::File>, range: std::ops::Range<u64>) -> S3Result<Self> {
        let mut out = VecDeque::new();
        let mut offset = 0u64;
        for (segment, mut file) in record.segments.iter().zip(files) {
            let (start, end) = (offset, offset + segment.size);
            offset = end;
            let from = range.start.max(start);
            let to = range.end.min(end);
            if from >= to {
                continue;
            }
            if from > start {
                file.seek(std::io::SeekFrom::Start(from - start))
                    .await
                    .map_err(|e| internal("cannot seek a data file", e))?;
            }
            out.push_back(file.take(to - from));
        }
        Ok(Self { files: out })
    }
}

impl AsyncRead for SegmentReader {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let Some(file) = self.files.front_mut() else { return Poll::Ready(Ok(())) };
            let before = buf.filled().len();
            ready!(Pin::new(file).poll_read(cx, buf))?;
            if buf.filled().len() > before || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            self.files.pop_front();
        }
    }
}

/// An object's body with its exact length, which s3s needs for `Content-Length`.
struct ObjectBody {
    inner: tokio_util::io::ReaderStream<SegmentReader>,
    remaining: u64,
}

impl Stream for ObjectBody {
    type Item = Result<Bytes, s3s::StdError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match ready!(Pin::new(&mut self.inner).poll_next(cx)) {
            Some(Ok(chunk)) => {
                self.remaining = self.remaining.saturating_sub(chunk.len() as u64);
                Poll::Ready(Some(Ok(chunk)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(Box::new(e)))),
            None if self.remaining > 0 => Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "a data file is shorter than its record",
            ))))),
            None => Poll::Ready(None),
        }
    }
}

impl ByteStream for ObjectBody {
    fn remaining_length(&self) -> RemainingLength {
        RemainingLength::new_exact(usize::try_from(self.remaining).unwrap_or(usize::MAX))
    }
}

/// What a GET or HEAD serves of an object: its bytes `range`, and whether that is part of it
/// (206) and the checksums are served (asked for, of the whole object: as S3).
struct Read {
    range: std::ops::Range<u64>,
    partial: bool,
    part_asked: bool,
    checksums: bool,
}

impl Read {
    fn of(
        record: &ObjectRecord,
        range: Option<&Range>,
        part_number: Option<i32>,
        mode: Option<&ChecksumMode>,
    ) -> S3Result<Self> {
        let partial = range.is_some() || part_number.is_some();
        Ok(Self {
            range: byte_range(record, range, part_number)?,
            partial,
            part_asked: part_number.is_some(),
            checksums: !partial && checksums_asked(mode),
        })
    }

    fn content_range(&self, size: u64) -> Option<String> {
        self.partial.then(|| format!("bytes {}-{}/{size}", self.range.start, self.range.end.max(1) - 1))
    }

    fn response<T>(&self, output: T) -> S3Response<T> {
        let mut response = S3Response::new(output);
        if self.partial {
            response.status = Some(http::StatusCode::PARTIAL_CONTENT);
        }
        response
    }
}

/// A GET's or HEAD's output (the two name their fields alike) for `record` as `read` serves it.
macro_rules! object_output {
    ($output:ident, $record:ident, $read:ident) => {{
        let a = &$record.attributes;
        let c = &$record.checksums;
        let sum = |value: &Option<String>| value.clone().filter(|_| $read.checksums);
        $output {
            content_length: Some(i64::try_from($read.range.end - $read.range.start).unwrap_or(i64::MAX)),
            content_range: $read.content_range($record.size),
            accept_ranges: Some("bytes".to_owned()),
            last_modified: Some(timestamp($record.modified_ms)),
            e_tag: Some(etag_of(&$record)),
            metadata: Some(a.metadata.clone().into_iter().collect()),
            content_type: Some(content_type_of(a)),
            content_encoding: a.content_encoding.clone(),
            content_disposition: a.content_disposition.clone(),
            content_language: a.content_language.clone(),
            cache_control: a.cache_control.clone(),
            expires: expires_of(a),
            website_redirect_location: a.website_redirect_location.clone(),
            parts_count: ($read.part_asked && $record.segments.len() > 1)
                .then(|| i32::try_from($record.segments.len()).unwrap_or(i32::MAX)),
            checksum_crc32: sum(&c.crc32),
            checksum_crc32c: sum(&c.crc32c),
            checksum_crc64nvme: sum(&c.crc64nvme),
            checksum_sha1: sum(&c.sha1),
            checksum_sha256: sum(&c.sha256),
            ..Default::default()
        }
    }};
}

/// The Content-Type S3 serves an object stored without one.
fn content_type_of(a: &Attributes) -> String {
    a.content_type.clone().unwrap_or_else(|| "binary/octet-stream".to_owned())
}

/// S3 serves an object's checksums only to a read that asks (`x-amz-checksum-mode: ENABLED`).
fn checksums_asked(mode: Option<&ChecksumMode>) -> bool {
    mode.is_some_and(|m| m.as_str() == ChecksumMode::ENABLED)
}

fn owner() -> Owner {
    Owner { display_name: Some(OWNER_ID.to_owned()), id: Some(OWNER_ID.to_owned()) }
}

/// The attributes a write sets, from its input (PutObject, CopyObject with `REPLACE`,
/// CreateMultipartUpload name them alike).
macro_rules! attributes_of {
    ($input:ident) => {
        Attributes {
            metadata: $input.metadata.unwrap_or_default().into_iter().collect(),
            content_type: $input.content_type,
            content_encoding: $input.content_encoding,
            content_disposition: $input.content_disposition,
            content_language: $input.content_language,
            cache_control: $input.cache_control,
            expires: http_date($input.expires.as_ref()),
            website_redirect_location: $input.website_redirect_location,
        }
    };
}

/// The checksum hashers a write asks for: by the values it sends, or by its algorithm.
fn hashers(algorithm: Option<&ChecksumAlgorithm>, sent: &Checksums) -> S3Result<s3s::checksum::ChecksumHasher> {
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
fn sent_checksums(headers: Checksums, trailers: Option<&s3s::TrailingHeaders>) -> S3Result<Checksums> {
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
fn verify(written: &Written, content_md5: Option<&str>, sent: &Checksums) -> S3Result<()> {
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

/// Streams a write's body (PutObject, UploadPart: they name their fields alike) to a new data
/// file and checks it against every checksum the client sent, in headers or trailers, and
/// `Content-MD5`; a body that fails them is removed and the error returned.
macro_rules! receive_body {
    ($store:ident, $req:ident, $input:ident) => {{
        let sent = Checksums {
            crc32: $input.checksum_crc32,
            crc32c: $input.checksum_crc32c,
            crc64nvme: $input.checksum_crc64nvme,
            sha1: $input.checksum_sha1,
            sha256: $input.checksum_sha256,
        };
        let hashers = hashers($input.checksum_algorithm.as_ref(), &sent)?;
        let body = $input.body.ok_or_else(|| s3_error!(IncompleteBody, "the request has no body"))?;
        let written = $store.write_file(body, hashers).await?;
        let checked = sent_checksums(sent, $req.trailing_headers.as_ref())
            .and_then(|sent| verify(&written, $input.content_md5.as_deref(), &sent));
        if let Err(e) = checked {
            $store.forget(vec![written.file]);
            return Err(e);
        }
        written
    }};
}

/// A write's answer: the ETag and checksums of what was stored (PutObject, UploadPart).
macro_rules! written_output {
    ($output:ident, $stored:ident) => {
        $output {
            e_tag: Some(ETag::Strong($stored.etag)),
            checksum_crc32: $stored.checksums.crc32,
            checksum_crc32c: $stored.checksums.crc32c,
            checksum_crc64nvme: $stored.checksums.crc64nvme,
            checksum_sha1: $stored.checksums.sha1,
            checksum_sha256: $stored.checksums.sha256,
            ..Default::default()
        }
    };
}

/// What a listing asks for.
#[derive(Clone)]
struct Listing {
    prefix: String,
    delimiter: Option<String>,
    after: Option<String>,
    max_keys: usize,
}

enum Entry {
    Object(String, Box<ObjectRecord>),
    Prefix(String),
}

struct Listed {
    entries: Vec<Entry>,
    truncated: bool,
}

impl Listed {
    fn last(&self) -> Option<&str> {
        self.entries.last().map(|e| match e {
            Entry::Object(k, _) | Entry::Prefix(k) => k.as_str(),
        })
    }
}

/// The common prefix `key` rolls up into under `prefix` and `delimiter`, if any.
fn common_prefix<'a>(key: &'a str, prefix: &str, delimiter: Option<&str>) -> Option<&'a str> {
    let delimiter = delimiter.filter(|d| !d.is_empty())?;
    let rest = key.get(prefix.len()..)?;
    let at = rest.find(delimiter)?;
    Some(&key[..prefix.len() + at + delimiter.len()])
}

fn list_keys(records: &Records, bucket: &str, q: &Listing) -> Result<Listed, StoreError> {
    let delimiter = q.delimiter.as_deref();
    let mut entries = Vec::new();
    // A marker inside a common prefix resumes after the whole prefix.
    let mut last_prefix: Option<String> =
        q.after.as_deref().and_then(|a| common_prefix(a, &q.prefix, delimiter)).map(str::to_owned);
    let mut after = q.after.clone();
    if q.max_keys == 0 {
        return Ok(Listed { entries, truncated: false });
    }
    const PAGE: usize = 1000;
    loop {
        let page = records.keys(bucket, &q.prefix, after.as_deref(), PAGE)?;
        let exhausted = page.len() < PAGE;
        for (key, record) in page {
            after = Some(key.clone());
            let entry = match common_prefix(&key, &q.prefix, delimiter) {
                Some(cp) if last_prefix.as_deref() == Some(cp) => continue,
                Some(cp) => {
                    last_prefix = Some(cp.to_owned());
                    Entry::Prefix(cp.to_owned())
                }
                None => Entry::Object(key, Box::new(record)),
            };
            if entries.len() == q.max_keys {
                return Ok(Listed { entries, truncated: true });
            }
            entries.push(entry);
        }
        if exhausted {
            return Ok(Listed { entries, truncated: false });
        }
    }
}

fn max_keys(asked: Option<i32>) -> S3Result<usize> {
    match asked {
        None => Ok(LIST_KEYS_DEFAULT as usize),
        Some(n) if n < 0 => Err(s3_error!(InvalidArgument, "max-keys must not be negative")),
        Some(n) => Ok(usize::try_from(n.min(LIST_KEYS_DEFAULT)).unwrap_or(0)),
    }
}

/// Keys as `encoding-type=url` returns them: percent-encoded, `/` kept.
fn encoder(encoding: Option<&EncodingType>) -> impl Fn(String) -> String + use<> {
    const KEEP: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b'/');
    let url = encoding.is_some_and(|e| e.as_str() == EncodingType::URL);
    move |s: String| if url { percent_encoding::utf8_percent_encode(&s, KEEP).to_string() } else { s }
}

fn object_entry(key: String, record: &ObjectRecord, with_owner: bool) -> Object {
    Object {
        key: Some(key),
        e_tag: Some(etag_of(record)),
        last_modified: Some(timestamp(record.modified_ms)),
        size: Some(i64::try_from(record.size).unwrap_or(i64::MAX)),
        storage_class: Some(ObjectStorageClass::from_static(ObjectStorageClass::STANDARD)),
        owner: with_owner.then(owner),
        ..Default::default()
    }
}

/// A copy's source: bucket and key, only the null version.
fn copy_source(source: &CopySource) -> S3Result<(String, String)> {
    match source {
        CopySource::Bucket { bucket, key, version_id } => {
            check_version(version_id.as_deref())?;
            Ok((bucket.to_string(), key.to_string()))
        }
        _ => Err(s3_error!(NotImplemented, "access point and outpost sources are not supported")),
    }
}

/// `bytes=first-last` of a part copy.
fn copy_range(range: Option<&str>, size: u64) -> S3Result<std::ops::Range<u64>> {
    let Some(range) = range else { return Ok(0..size) };
    let invalid =
        || s3_error!(InvalidArgument, "The x-amz-copy-source-range value must be of the form bytes=first-last");
    let (first, last) = range.strip_prefix("bytes=").and_then(|r| r.split_once('-')).ok_or_else(invalid)?;
    let first: u64 = first.parse().map_err(|_| invalid())?;
    let last: u64 = last.parse().map_err(|_| invalid())?;
    if first > last || last >= size {
        return Err(s3_error!(InvalidRange, "The requested range is not satisfiable"));
    }
    Ok(first..last + 1)
}

#[async_trait::async_trait]
impl S3 for LocalStore {
    async fn create_bucket(&self, req: S3Request<CreateBucketInput>) -> S3Result<S3Response<CreateBucketOutput>> {
        // Creating one's own bucket again succeeds, as in S3's default region (us-east-1).
        let bucket = req.input.bucket;
        match self.run(move |r| r.create_bucket(&bucket)).await {
            Ok(()) => Ok(S3Response::new(CreateBucketOutput::default())),
            Err(e) if *e.code() == S3ErrorCode::BucketAlreadyOwnedByYou => {
                Ok(S3Response::new(CreateBucketOutput::default()))
            }
            Err(e) => Err(e),
        }
    }

    async fn delete_bucket(&self, req: S3Request<DeleteBucketInput>) -> S3Result<S3Response<DeleteBucketOutput>> {
        let bucket = req.input.bucket;
        let freed = self.run(move |r| r.delete_bucket(&bucket)).await?;
        self.forget(freed);
        Ok(S3Response::new(DeleteBucketOutput::default()))
    }

    async fn head_bucket(&self, req: S3Request<HeadBucketInput>) -> S3Result<S3Response<HeadBucketOutput>> {
        self.bucket(&req.input.bucket).await?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.bucket(&req.input.bucket).await?;
        Ok(S3Response::new(GetBucketLocationOutput::default()))
    }

    async fn get_bucket_versioning(
        &self,
        req: S3Request<GetBucketVersioningInput>,
    ) -> S3Result<S3Response<GetBucketVersioningOutput>> {
        // Never versioned: S3 answers with no status. Enabling it is refused (NotImplemented).
        self.bucket(&req.input.bucket).await?;
        Ok(S3Response::new(GetBucketVersioningOutput::default()))
    }

    async fn list_buckets(&self, _req: S3Request<ListBucketsInput>) -> S3Result<S3Response<ListBucketsOutput>> {
        let buckets = self.run(Records::buckets).await?;
        let buckets = buckets
            .into_iter()
            .map(|(name, created)| Bucket {
                name: Some(name),
                creation_date: Some(timestamp(created)),
                bucket_region: None,
            })
            .collect();
        Ok(S3Response::new(ListBucketsOutput { buckets: Some(buckets), owner: Some(owner()), ..Default::default() }))
    }

    async fn put_object(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        self.bucket(&input.bucket).await?;
        let written = receive_body!(self, req, input);
        let attributes = attributes_of!(input);
        let condition = write_condition(input.if_match.as_ref(), input.if_none_match.as_ref());
        let record = self.commit(input.bucket, input.key, condition, written.record(None, attributes, None)).await?;
        Ok(S3Response::new(written_output!(PutObjectOutput, record)))
    }

    async fn get_object(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        let input = req.input;
        check_version(input.version_id.as_deref())?;
        let (record, files) = self.open(&input.bucket, &input.key).await?;
        read_conditions!(input, if_match, if_unmodified_since, if_none_match, if_modified_since)
            .check(&record, true)?;
        let read = Read::of(&record, input.range.as_ref(), input.part_number, input.checksum_mode.as_ref())?;
        let reader = SegmentReader::open(&record, files, read.range.clone()).await?;
        let remaining = read.range.end - read.range.start;
        let body = ObjectBody { inner: tokio_util::io::ReaderStream::with_capacity(reader, READ_CHUNK), remaining };
        let mut output = object_output!(GetObjectOutput, record, read);
        output.body = Some(StreamingBlob::new(body));
        // The client's response-* overrides (a presigned download's file name, for one).
        output.content_type = input.response_content_type.or(output.content_type);
        output.content_encoding = input.response_content_encoding.or(output.content_encoding);
        output.content_disposition = input.response_content_disposition.or(output.content_disposition);
        output.content_language = input.response_content_language.or(output.content_language);
        output.cache_control = input.response_cache_control.or(output.cache_control);
        output.expires = input.response_expires.or(output.expires);
        Ok(read.response(output))
    }

    async fn head_object(&self, req: S3Request<HeadObjectInput>) -> S3Result<S3Response<HeadObjectOutput>> {
        let input = req.input;
        check_version(input.version_id.as_deref())?;
        let (b, k) = (input.bucket.clone(), input.key.clone());
        let record = self.run(move |r| r.object(&b, &k)).await?;
        read_conditions!(input, if_match, if_unmodified_since, if_none_match, if_modified_since)
            .check(&record, true)?;
        let read = Read::of(&record, input.range.as_ref(), input.part_number, input.checksum_mode.as_ref())?;
        let output = object_output!(HeadObjectOutput, record, read);
        Ok(read.response(output))
    }

    async fn delete_object(&self, req: S3Request<DeleteObjectInput>) -> S3Result<S3Response<DeleteObjectOutput>> {
        let input = req.input;
        check_version(input.version_id.as_deref())?;
        let condition = write_condition(input.if_match.as_ref(), None);
        let (bucket, key) = (input.bucket, input.key);
        let freed = self.run(move |r| r.delete_object(&bucket, &key, &condition)).await?;
        self.forget(freed);
        let mut response = S3Response::new(DeleteObjectOutput::default());
        response.status = Some(http::StatusCode::NO_CONTENT);
        Ok(response)
    }

    async fn delete_objects(&self, req: S3Request<DeleteObjectsInput>) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let input = req.input;
        self.bucket(&input.bucket).await?;
        let quiet = input.delete.quiet.unwrap_or(false);
        let mut deleted = Vec::new();
        let mut errors = Vec::new();
        for object in input.delete.objects {
            let outcome = match check_version(object.version_id.as_deref()) {
                Err(e) => Err(e),
                Ok(()) => {
                    let condition = Precondition {
                        if_match: object.e_tag.as_ref().map(|e| Some(e.value().to_owned())),
                        ..Default::default()
                    };
                    let (bucket, key) = (input.bucket.clone(), object.key.clone());
                    self.run(move |r| r.delete_object(&bucket, &key, &condition)).await
                }
            };
            match outcome {
                Ok(freed) => {
                    self.forget(freed);
                    if !quiet {
                        deleted.push(DeletedObject {
                            key: Some(object.key),
                            version_id: object.version_id,
                            ..Default::default()
                        });
                    }
                }
                Err(e) => errors.push(Error {
                    code: Some(e.code().as_str().to_owned()),
                    message: e.message().map(str::to_owned),
                    key: Some(object.key),
                    version_id: object.version_id,
                }),
            }
        }
        Ok(S3Response::new(DeleteObjectsOutput {
            deleted: Some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        }))
    }

    async fn copy_object(&self, req: S3Request<CopyObjectInput>) -> S3Result<S3Response<CopyObjectOutput>> {
        let if_match = header_condition(&req.headers, http::header::IF_MATCH)?;
        let if_none_match = header_condition(&req.headers, http::header::IF_NONE_MATCH)?;
        let input = req.input;
        check_key(&input.key)?;
        let (src_bucket, src_key) = copy_source(&input.copy_source)?;
        self.bucket(&input.bucket).await?;
        let (source, files) = self.open(&src_bucket, &src_key).await?;
        copy_source_conditions!(input).check(&source, false)?;
        let replace = input.metadata_directive.as_ref().is_some_and(|d| d.as_str() == MetadataDirective::REPLACE);
        if src_bucket == input.bucket
            && src_key == input.key
            && !replace
            && input.storage_class.is_none()
            && input.website_redirect_location.is_none()
            && input.server_side_encryption.is_none()
        {
            return Err(s3_error!(
                InvalidRequest,
                "This copy request is illegal because it is trying to copy an object to itself without changing the \
                 object's metadata, storage class, website redirect location or encryption attributes."
            ));
        }
        let attributes = if replace { attributes_of!(input) } else { source.attributes.clone() };
        let written = self.copy_file(&source, files, 0..source.size).await?;
        let record = written.record(Some(source.etag.clone()), attributes, Some(source.checksums.clone()));
        let condition = write_condition(if_match.as_ref(), if_none_match.as_ref());
        let record = self.commit(input.bucket, input.key, condition, record).await?;
        let c = record.checksums;
        Ok(S3Response::new(CopyObjectOutput {
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(ETag::Strong(record.etag)),
                last_modified: Some(timestamp(record.modified_ms)),
                checksum_crc32: c.crc32,
                checksum_crc32c: c.crc32c,
                checksum_crc64nvme: c.crc64nvme,
                checksum_sha1: c.sha1,
                checksum_sha256: c.sha256,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn list_objects(&self, req: S3Request<ListObjectsInput>) -> S3Result<S3Response<ListObjectsOutput>> {
        let input = req.input;
        let query = Listing {
            prefix: input.prefix.clone().unwrap_or_default(),
            delimiter: input.delimiter.clone(),
            after: input.marker.clone().filter(|m| !m.is_empty()),
            max_keys: max_keys(input.max_keys)?,
        };
        let listed = self.list(&input.bucket, query).await?;
        let encode = encoder(input.encoding_type.as_ref());
        // S3 names the next marker only with a delimiter (else the last key is the marker).
        let next_marker =
            (listed.truncated && input.delimiter.is_some()).then(|| listed.last().map(str::to_owned)).flatten();
        let (contents, prefixes) = split(listed.entries, &encode, true);
        Ok(S3Response::new(ListObjectsOutput {
            name: Some(input.bucket),
            // ListObjects (v1) encodes keys, markers and the delimiter, not its prefix (as S3).
            prefix: Some(input.prefix.unwrap_or_default()),
            marker: Some(encode(input.marker.unwrap_or_default())),
            max_keys: Some(input.max_keys.unwrap_or(LIST_KEYS_DEFAULT)),
            is_truncated: Some(listed.truncated),
            contents,
            common_prefixes: prefixes,
            // An empty delimiter is no delimiter, and not echoed.
            delimiter: input.delimiter.filter(|d| !d.is_empty()).map(&encode),
            next_marker: next_marker.map(&encode),
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn list_objects_v2(&self, req: S3Request<ListObjectsV2Input>) -> S3Result<S3Response<ListObjectsV2Output>> {
        use base64::Engine;
        let input = req.input;
        let token = match input.continuation_token.as_deref() {
            None => None,
            Some(t) => Some(
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(t)
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| s3_error!(InvalidArgument, "The continuation token provided is incorrect"))?,
            ),
        };
        let after = token.or_else(|| input.start_after.clone().filter(|s| !s.is_empty()));
        let query = Listing {
            prefix: input.prefix.clone().unwrap_or_default(),
            delimiter: input.delimiter.clone(),
            after,
            max_keys: max_keys(input.max_keys)?,
        };
        let listed = self.list(&input.bucket, query).await?;
        let encode = encoder(input.encoding_type.as_ref());
        let next = listed
            .truncated
            .then(|| listed.last().map(|k| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(k)))
            .flatten();
        let count = listed.entries.len();
        let (contents, prefixes) = split(listed.entries, &encode, input.fetch_owner.unwrap_or(false));
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(input.bucket),
            prefix: Some(encode(input.prefix.unwrap_or_default())),
            max_keys: Some(input.max_keys.unwrap_or(LIST_KEYS_DEFAULT)),
            key_count: Some(i32::try_from(count).unwrap_or(i32::MAX)),
            continuation_token: input.continuation_token,
            is_truncated: Some(listed.truncated),
            next_continuation_token: next,
            contents,
            common_prefixes: prefixes,
            // An empty delimiter is no delimiter, and not echoed.
            delimiter: input.delimiter.filter(|d| !d.is_empty()).map(&encode),
            encoding_type: input.encoding_type,
            start_after: input.start_after.map(&encode),
            ..Default::default()
        }))
    }

    async fn list_object_versions(
        &self,
        req: S3Request<ListObjectVersionsInput>,
    ) -> S3Result<S3Response<ListObjectVersionsOutput>> {
        // An unversioned bucket: each object is its one version, `null`, the latest.
        let input = req.input;
        let query = Listing {
            prefix: input.prefix.clone().unwrap_or_default(),
            delimiter: input.delimiter.clone(),
            after: input.key_marker.clone().filter(|m| !m.is_empty()),
            max_keys: max_keys(input.max_keys)?,
        };
        let listed = self.list(&input.bucket, query).await?;
        let encode = encoder(input.encoding_type.as_ref());
        let next_key = listed.truncated.then(|| listed.last().map(str::to_owned)).flatten();
        let mut versions = Vec::new();
        let mut prefixes = Vec::new();
        for entry in listed.entries {
            match entry {
                Entry::Object(key, record) => versions.push(ObjectVersion {
                    key: Some(encode(key)),
                    version_id: Some("null".to_owned()),
                    is_latest: Some(true),
                    e_tag: Some(etag_of(&record)),
                    last_modified: Some(timestamp(record.modified_ms)),
                    size: Some(i64::try_from(record.size).unwrap_or(i64::MAX)),
                    storage_class: Some(ObjectVersionStorageClass::from_static(ObjectVersionStorageClass::STANDARD)),
                    owner: Some(owner()),
                    ..Default::default()
                }),
                Entry::Prefix(p) => prefixes.push(CommonPrefix { prefix: Some(encode(p)) }),
            }
        }
        Ok(S3Response::new(ListObjectVersionsOutput {
            name: Some(input.bucket),
            prefix: Some(encode(input.prefix.unwrap_or_default())),
            key_marker: Some(encode(input.key_marker.unwrap_or_default())),
            version_id_marker: Some(input.version_id_marker.unwrap_or_default()),
            max_keys: Some(input.max_keys.unwrap_or(LIST_KEYS_DEFAULT)),
            is_truncated: Some(listed.truncated),
            next_version_id_marker: next_key.as_ref().map(|_| "null".to_owned()),
            next_key_marker: next_key.map(&encode),
            versions: Some(versions),
            common_prefixes: (!prefixes.is_empty()).then_some(prefixes),
            // An empty delimiter is no delimiter, and not echoed.
            delimiter: input.delimiter.filter(|d| !d.is_empty()).map(&encode),
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let input = req.input;
        check_key(&input.key)?;
        let upload = UploadRecord {
            bucket: input.bucket.clone(),
            key: input.key.clone(),
            initiated_ms: now_ms(),
            attributes: attributes_of!(input),
        };
        let id = uuid::Uuid::new_v4().simple().to_string();
        let upload_id = id.clone();
        self.run(move |r| r.create_upload(&upload_id, &upload)).await?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(id),
            ..Default::default()
        }))
    }

    async fn upload_part(&self, req: S3Request<UploadPartInput>) -> S3Result<S3Response<UploadPartOutput>> {
        let input = req.input;
        if !PART_NUMBERS.contains(&input.part_number) {
            return Err(s3_error!(InvalidArgument, "Part number must be an integer between 1 and 10000, inclusive"));
        }
        let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
        self.run(move |r| r.upload(&b, &k, &u)).await?;
        let written = receive_body!(self, req, input);
        let part = PartRecord {
            etag: written.md5.clone(),
            size: written.size,
            modified_ms: now_ms(),
            file: written.file.clone(),
            checksums: written.checksums.clone(),
        };
        let number = input.part_number.unsigned_abs();
        let (b, k, u, p) = (input.bucket, input.key, input.upload_id, part.clone());
        match self.run(move |r| r.commit_part(&b, &k, &u, number, &p)).await {
            Ok(replaced) => self.forget(replaced),
            Err(e) => {
                self.forget(vec![written.file]);
                return Err(e);
            }
        }
        Ok(S3Response::new(written_output!(UploadPartOutput, part)))
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        let input = req.input;
        if !PART_NUMBERS.contains(&input.part_number) {
            return Err(s3_error!(InvalidArgument, "Part number must be an integer between 1 and 10000, inclusive"));
        }
        let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
        self.run(move |r| r.upload(&b, &k, &u)).await?;
        let (src_bucket, src_key) = copy_source(&input.copy_source)?;
        let (source, files) = self.open(&src_bucket, &src_key).await?;
        copy_source_conditions!(input).check(&source, false)?;
        let range = copy_range(input.copy_source_range.as_deref(), source.size)?;
        let written = self.copy_file(&source, files, range).await?;
        let part = PartRecord {
            etag: written.md5.clone(),
            size: written.size,
            modified_ms: now_ms(),
            file: written.file.clone(),
            checksums: Checksums::default(),
        };
        let number = input.part_number.unsigned_abs();
        let (b, k, u, p) = (input.bucket, input.key, input.upload_id, part.clone());
        match self.run(move |r| r.commit_part(&b, &k, &u, number, &p)).await {
            Ok(replaced) => self.forget(replaced),
            Err(e) => {
                self.forget(vec![written.file]);
                return Err(e);
            }
        }
        Ok(S3Response::new(UploadPartCopyOutput {
            copy_part_result: Some(CopyPartResult {
                e_tag: Some(ETag::Strong(part.etag)),
                last_modified: Some(timestamp(part.modified_ms)),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn list_parts(&self, req: S3Request<ListPartsInput>) -> S3Result<S3Response<ListPartsOutput>> {
        let input = req.input;
        let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
        self.run(move |r| r.upload(&b, &k, &u)).await?;
        let u = input.upload_id.clone();
        let parts = self.run(move |r| r.parts(&u)).await?;
        let marker = input.part_number_marker.unwrap_or(0);
        let max = usize::try_from(input.max_parts.unwrap_or(1000).clamp(0, 1000)).unwrap_or(1000);
        let mut after: Vec<(u32, PartRecord)> =
            parts.into_iter().filter(|(n, _)| i64::from(*n) > i64::from(marker)).collect();
        let truncated = after.len() > max;
        after.truncate(max);
        let next = after.last().map(|(n, _)| i32::try_from(*n).unwrap_or(i32::MAX));
        let parts = after
            .into_iter()
            .map(|(n, p)| Part {
                part_number: Some(i32::try_from(n).unwrap_or(i32::MAX)),
                e_tag: Some(ETag::Strong(p.etag)),
                size: Some(i64::try_from(p.size).unwrap_or(i64::MAX)),
                last_modified: Some(timestamp(p.modified_ms)),
                checksum_crc32: p.checksums.crc32,
                checksum_crc32c: p.checksums.crc32c,
                checksum_crc64nvme: p.checksums.crc64nvme,
                checksum_sha1: p.checksums.sha1,
                checksum_sha256: p.checksums.sha256,
            })
            .collect();
        Ok(S3Response::new(ListPartsOutput {
            bucket: Some(input.bucket),
            key: Some(input.key),
            upload_id: Some(input.upload_id),
            part_number_marker: input.part_number_marker,
            next_part_number_marker: next,
            max_parts: Some(i32::try_from(max).unwrap_or(1000)),
            is_truncated: Some(truncated),
            parts: Some(parts),
            owner: Some(owner()),
            storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
            ..Default::default()
        }))
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        let input = req.input;
        let b = input.bucket.clone();
        let uploads = self.run(move |r| r.uploads(&b)).await?;
        let prefix = input.prefix.clone().unwrap_or_default();
        let key_marker = input.key_marker.clone().unwrap_or_default();
        let id_marker = input.upload_id_marker.clone().unwrap_or_default();
        let max = usize::try_from(input.max_uploads.unwrap_or(1000).clamp(0, 1000)).unwrap_or(1000);
        // In listing order (key, then initiation): after the key marker's uploads, or after the
        // one the upload id marker names within them.
        let start = if key_marker.is_empty() {
            0
        } else {
            let after_key = uploads.iter().position(|(_, u)| u.key > key_marker).unwrap_or(uploads.len());
            let named = uploads.iter().position(|(id, u)| u.key == key_marker && *id == id_marker);
            match named {
                Some(at) if !id_marker.is_empty() => at + 1,
                _ => after_key,
            }
        };
        let mut chosen: Vec<(String, UploadRecord)> =
            uploads.into_iter().skip(start).filter(|(_, u)| u.key.starts_with(&prefix)).collect();
        let truncated = chosen.len() > max;
        chosen.truncate(max);
        let next = chosen.last().map(|(id, u)| (u.key.clone(), id.clone()));
        let encode = encoder(input.encoding_type.as_ref());
        let uploads = chosen
            .into_iter()
            .map(|(id, u)| MultipartUpload {
                key: Some(encode(u.key)),
                upload_id: Some(id),
                initiated: Some(timestamp(u.initiated_ms)),
                owner: Some(owner()),
                initiator: Some(Initiator { display_name: Some(OWNER_ID.to_owned()), id: Some(OWNER_ID.to_owned()) }),
                storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
                ..Default::default()
            })
            .collect();
        Ok(S3Response::new(ListMultipartUploadsOutput {
            bucket: Some(input.bucket),
            prefix: input.prefix.map(&encode),
            key_marker: input.key_marker.map(&encode),
            upload_id_marker: input.upload_id_marker,
            max_uploads: Some(i32::try_from(max).unwrap_or(1000)),
            is_truncated: Some(truncated),
            next_key_marker: next.as_ref().map(|(k, _)| encode(k.clone())),
            next_upload_id_marker: next.map(|(_, id)| id),
            uploads: Some(uploads),
            encoding_type: input.encoding_type,
            ..Default::default()
        }))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let input = req.input;
        let parts = input.multipart_upload.and_then(|m| m.parts).unwrap_or_default();
        let mut listed = Vec::with_capacity(parts.len());
        for part in parts {
            let number = part
                .part_number
                .filter(|n| PART_NUMBERS.contains(n))
                .ok_or_else(|| s3_error!(InvalidPart, "a listed part has no valid part number"))?;
            listed.push((number.unsigned_abs(), part.e_tag.map(|e| e.value().to_owned())));
        }
        if listed.is_empty() {
            return Err(s3_error!(MalformedXML, "You must specify at least one part"));
        }
        let condition = write_condition(input.if_match.as_ref(), input.if_none_match.as_ref());
        let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
        let (record, freed) = self.run(move |r| r.complete_upload(&b, &k, &u, &listed, &condition)).await?;
        self.forget(freed);
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(input.bucket.clone()),
            key: Some(input.key.clone()),
            e_tag: Some(ETag::Strong(record.etag)),
            location: Some(format!("/{}/{}", input.bucket, input.key)),
            ..Default::default()
        }))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let input = req.input;
        let (b, k, u) = (input.bucket, input.key, input.upload_id);
        let freed = self.run(move |r| r.abort_upload(&b, &k, &u)).await?;
        self.forget(freed);
        let mut response = S3Response::new(AbortMultipartUploadOutput::default());
        response.status = Some(http::StatusCode::NO_CONTENT);
        Ok(response)
    }
}

/// A listing's entries as S3's `Contents` and `CommonPrefixes`.
fn split(
    entries: Vec<Entry>,
    encode: &impl Fn(String) -> String,
    with_owner: bool,
) -> (Option<Vec<Object>>, Option<Vec<CommonPrefix>>) {
    let mut contents = Vec::new();
    let mut prefixes = Vec::new();
    for entry in entries {
        match entry {
            Entry::Object(key, record) => contents.push(object_entry(encode(key), &record, with_owner)),
            Entry::Prefix(p) => prefixes.push(CommonPrefix { prefix: Some(encode(p)) }),
        }
    }
    ((!contents.is_empty()).then_some(contents), (!prefixes.is_empty()).then_some(prefixes))
}
