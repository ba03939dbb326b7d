//! Objects: put, get, head, delete (one or many), copy.

use super::*;

pub(super) async fn put_object(
    store: &LocalStore,
    req: S3Request<PutObjectInput>,
) -> S3Result<S3Response<PutObjectOutput>> {
    let input = req.input;
    check_key(&input.key)?;
    store.bucket(&input.bucket).await?;
    let written = receive_body!(store, req, input);
    let attributes = attributes_of!(input);
    let condition = write_condition(input.if_match.as_ref(), input.if_none_match.as_ref());
    let record = store.commit(input.bucket, input.key, condition, written.record(None, attributes, None)).await?;
    Ok(S3Response::new(written_output!(PutObjectOutput, record)))
}

pub(super) async fn get_object(
    store: &LocalStore,
    req: S3Request<GetObjectInput>,
) -> S3Result<S3Response<GetObjectOutput>> {
    let input = req.input;
    check_version(input.version_id.as_deref())?;
    let (record, files) = store.open(&input.bucket, &input.key).await?;
    read_conditions!(input, if_match, if_unmodified_since, if_none_match, if_modified_since).check(&record, true)?;
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

pub(super) async fn head_object(
    store: &LocalStore,
    req: S3Request<HeadObjectInput>,
) -> S3Result<S3Response<HeadObjectOutput>> {
    let input = req.input;
    check_version(input.version_id.as_deref())?;
    let (b, k) = (input.bucket.clone(), input.key.clone());
    let record = store.run(move |r| r.object(&b, &k)).await?;
    read_conditions!(input, if_match, if_unmodified_since, if_none_match, if_modified_since).check(&record, true)?;
    let read = Read::of(&record, input.range.as_ref(), input.part_number, input.checksum_mode.as_ref())?;
    let output = object_output!(HeadObjectOutput, record, read);
    Ok(read.response(output))
}

pub(super) async fn delete_object(
    store: &LocalStore,
    req: S3Request<DeleteObjectInput>,
) -> S3Result<S3Response<DeleteObjectOutput>> {
    let input = req.input;
    check_version(input.version_id.as_deref())?;
    let condition = write_condition(input.if_match.as_ref(), None);
    let (bucket, key) = (input.bucket, input.key);
    let freed = store.run(move |r| r.delete_object(&bucket, &key, &condition)).await?;
    store.forget(freed);
    let mut response = S3Response::new(DeleteObjectOutput::default());
    response.status = Some(http::StatusCode::NO_CONTENT);
    Ok(response)
}

pub(super) async fn delete_objects(
    store: &LocalStore,
    req: S3Request<DeleteObjectsInput>,
) -> S3Result<S3Response<DeleteObjectsOutput>> {
    let input = req.input;
    store.bucket(&input.bucket).await?;
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
                store.run(move |r| r.delete_object(&bucket, &key, &condition)).await
            }
        };
        match outcome {
            Ok(freed) => {
                store.forget(freed);
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

pub(super) async fn copy_object(
    store: &LocalStore,
    req: S3Request<CopyObjectInput>,
) -> S3Result<S3Response<CopyObjectOutput>> {
    let if_match = header_condition(&req.headers, http::header::IF_MATCH)?;
    let if_none_match = header_condition(&req.headers, http::header::IF_NONE_MATCH)?;
    let input = req.input;
    check_key(&input.key)?;
    let (src_bucket, src_key) = copy_source(&input.copy_source)?;
    store.bucket(&input.bucket).await?;
    let (source, files) = store.open(&src_bucket, &src_key).await?;
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
    let written = store.copy_file(&source, files, 0..source.size).await?;
    let record = written.record(Some(source.etag.clone()), attributes, Some(source.checksums.clone()));
    let condition = write_condition(if_match.as_ref(), if_none_match.as_ref());
    let record = store.commit(input.bucket, input.key, condition, record).await?;
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
