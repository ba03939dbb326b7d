//! The local store's S3 operations: what S3 answers for everything fencegate forwards, on
//! [`Records`]. Bodies stream to a new data file with no lock held; each write's conditions are
//! judged inside its commit (records/). Reads open every data file of the object before
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

mod body;
#[allow(unused_imports)]
use body::*;

mod checksums;
#[allow(unused_imports)]
use checksums::*;

mod listing;
#[allow(unused_imports)]
use listing::*;

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

// Each operation lives with its kind (buckets.rs, objects.rs, multipart.rs); this is the
// table S3 dispatches through.
#[async_trait::async_trait]
impl S3 for LocalStore {
    async fn create_bucket(&self, req: S3Request<CreateBucketInput>) -> S3Result<S3Response<CreateBucketOutput>> {
        buckets::create_bucket(self, req).await
    }

    async fn delete_bucket(&self, req: S3Request<DeleteBucketInput>) -> S3Result<S3Response<DeleteBucketOutput>> {
        buckets::delete_bucket(self, req).await
    }

    async fn head_bucket(&self, req: S3Request<HeadBucketInput>) -> S3Result<S3Response<HeadBucketOutput>> {
        buckets::head_bucket(self, req).await
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        buckets::get_bucket_location(self, req).await
    }

    async fn get_bucket_versioning(
        &self,
        req: S3Request<GetBucketVersioningInput>,
    ) -> S3Result<S3Response<GetBucketVersioningOutput>> {
        buckets::get_bucket_versioning(self, req).await
    }

    async fn list_buckets(&self, _req: S3Request<ListBucketsInput>) -> S3Result<S3Response<ListBucketsOutput>> {
        buckets::list_buckets(self, _req).await
    }

    async fn put_object(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        objects::put_object(self, req).await
    }

    async fn get_object(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        objects::get_object(self, req).await
    }

    async fn head_object(&self, req: S3Request<HeadObjectInput>) -> S3Result<S3Response<HeadObjectOutput>> {
        objects::head_object(self, req).await
    }

    async fn delete_object(&self, req: S3Request<DeleteObjectInput>) -> S3Result<S3Response<DeleteObjectOutput>> {
        objects::delete_object(self, req).await
    }

    async fn delete_objects(&self, req: S3Request<DeleteObjectsInput>) -> S3Result<S3Response<DeleteObjectsOutput>> {
        objects::delete_objects(self, req).await
    }

    async fn copy_object(&self, req: S3Request<CopyObjectInput>) -> S3Result<S3Response<CopyObjectOutput>> {
        objects::copy_object(self, req).await
    }

    async fn list_objects(&self, req: S3Request<ListObjectsInput>) -> S3Result<S3Response<ListObjectsOutput>> {
        buckets::list_objects(self, req).await
    }

    async fn list_objects_v2(&self, req: S3Request<ListObjectsV2Input>) -> S3Result<S3Response<ListObjectsV2Output>> {
        buckets::list_objects_v2(self, req).await
    }

    async fn list_object_versions(
        &self,
        req: S3Request<ListObjectVersionsInput>,
    ) -> S3Result<S3Response<ListObjectVersionsOutput>> {
        buckets::list_object_versions(self, req).await
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        multipart::create_multipart_upload(self, req).await
    }

    async fn upload_part(&self, req: S3Request<UploadPartInput>) -> S3Result<S3Response<UploadPartOutput>> {
        multipart::upload_part(self, req).await
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        multipart::upload_part_copy(self, req).await
    }

    async fn list_parts(&self, req: S3Request<ListPartsInput>) -> S3Result<S3Response<ListPartsOutput>> {
        multipart::list_parts(self, req).await
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        multipart::list_multipart_uploads(self, req).await
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        multipart::complete_multipart_upload(self, req).await
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        multipart::abort_multipart_upload(self, req).await
    }
}

mod buckets;
mod multipart;
mod objects;
