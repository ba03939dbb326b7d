//! Multipart uploads: create, parts (sent or copied), listings, completion, abort.

use super::*;

pub(super) async fn create_multipart_upload(
    store: &LocalStore,
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
    store.run(move |r| r.create_upload(&upload_id, &upload)).await?;
    Ok(S3Response::new(CreateMultipartUploadOutput {
        bucket: Some(input.bucket),
        key: Some(input.key),
        upload_id: Some(id),
        ..Default::default()
    }))
}

pub(super) async fn upload_part(
    store: &LocalStore,
    req: S3Request<UploadPartInput>,
) -> S3Result<S3Response<UploadPartOutput>> {
    let input = req.input;
    if !PART_NUMBERS.contains(&input.part_number) {
        return Err(s3_error!(InvalidArgument, "Part number must be an integer between 1 and 10000, inclusive"));
    }
    let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
    store.run(move |r| r.upload(&b, &k, &u)).await?;
    let written = receive_body!(store, req, input);
    let part = PartRecord {
        etag: written.md5.clone(),
        size: written.size,
        modified_ms: now_ms(),
        file: written.file.clone(),
        checksums: written.checksums.clone(),
    };
    let number = input.part_number.unsigned_abs();
    let (b, k, u, p) = (input.bucket, input.key, input.upload_id, part.clone());
    match store.run(move |r| r.commit_part(&b, &k, &u, number, &p)).await {
        Ok(replaced) => store.forget(replaced),
        Err(e) => {
            store.forget(vec![written.file]);
            return Err(e);
        }
    }
    Ok(S3Response::new(written_output!(UploadPartOutput, part)))
}

pub(super) async fn upload_part_copy(
    store: &LocalStore,
    req: S3Request<UploadPartCopyInput>,
) -> S3Result<S3Response<UploadPartCopyOutput>> {
    let input = req.input;
    if !PART_NUMBERS.contains(&input.part_number) {
        return Err(s3_error!(InvalidArgument, "Part number must be an integer between 1 and 10000, inclusive"));
    }
    let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
    store.run(move |r| r.upload(&b, &k, &u)).await?;
    let (src_bucket, src_key) = copy_source(&input.copy_source)?;
    let (source, files) = store.open(&src_bucket, &src_key).await?;
    copy_source_conditions!(input).check(&source, false)?;
    let range = copy_range(input.copy_source_range.as_deref(), source.size)?;
    let written = store.copy_file(&source, files, range).await?;
    let part = PartRecord {
        etag: written.md5.clone(),
        size: written.size,
        modified_ms: now_ms(),
        file: written.file.clone(),
        checksums: Checksums::default(),
    };
    let number = input.part_number.unsigned_abs();
    let (b, k, u, p) = (input.bucket, input.key, input.upload_id, part.clone());
    match store.run(move |r| r.commit_part(&b, &k, &u, number, &p)).await {
        Ok(replaced) => store.forget(replaced),
        Err(e) => {
            store.forget(vec![written.file]);
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

pub(super) async fn list_parts(
    store: &LocalStore,
    req: S3Request<ListPartsInput>,
) -> S3Result<S3Response<ListPartsOutput>> {
    let input = req.input;
    let (b, k, u) = (input.bucket.clone(), input.key.clone(), input.upload_id.clone());
    store.run(move |r| r.upload(&b, &k, &u)).await?;
    let u = input.upload_id.clone();
    let parts = store.run(move |r| r.parts(&u)).await?;
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

pub(super) async fn list_multipart_uploads(
    store: &LocalStore,
    req: S3Request<ListMultipartUploadsInput>,
) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
    let input = req.input;
    let b = input.bucket.clone();
    let uploads = store.run(move |r| r.uploads(&b)).await?;
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

pub(super) async fn complete_multipart_upload(
    store: &LocalStore,
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
    let (record, freed) = store.run(move |r| r.complete_upload(&b, &k, &u, &listed, &condition)).await?;
    store.forget(freed);
    Ok(S3Response::new(CompleteMultipartUploadOutput {
        bucket: Some(input.bucket.clone()),
        key: Some(input.key.clone()),
        e_tag: Some(ETag::Strong(record.etag)),
        location: Some(format!("/{}/{}", input.bucket, input.key)),
        ..Default::default()
    }))
}

pub(super) async fn abort_multipart_upload(
    store: &LocalStore,
    req: S3Request<AbortMultipartUploadInput>,
) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
    let input = req.input;
    let (b, k, u) = (input.bucket, input.key, input.upload_id);
    let freed = store.run(move |r| r.abort_upload(&b, &k, &u)).await?;
    store.forget(freed);
    let mut response = S3Response::new(AbortMultipartUploadOutput::default());
    response.status = Some(http::StatusCode::NO_CONTENT);
    Ok(response)
}
