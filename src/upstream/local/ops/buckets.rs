//! Buckets and listings.

use super::*;

pub(super) async fn create_bucket(
    store: &LocalStore,
    req: S3Request<CreateBucketInput>,
) -> S3Result<S3Response<CreateBucketOutput>> {
    // Creating one's own bucket again succeeds, as in S3's default region (us-east-1).
    let bucket = req.input.bucket;
    match store.run(move |r| r.create_bucket(&bucket)).await {
        Ok(()) => Ok(S3Response::new(CreateBucketOutput::default())),
        Err(e) if *e.code() == S3ErrorCode::BucketAlreadyOwnedByYou => {
            Ok(S3Response::new(CreateBucketOutput::default()))
        }
        Err(e) => Err(e),
    }
}

pub(super) async fn delete_bucket(
    store: &LocalStore,
    req: S3Request<DeleteBucketInput>,
) -> S3Result<S3Response<DeleteBucketOutput>> {
    let bucket = req.input.bucket;
    let freed = store.run(move |r| r.delete_bucket(&bucket)).await?;
    store.forget(freed);
    Ok(S3Response::new(DeleteBucketOutput::default()))
}

pub(super) async fn head_bucket(
    store: &LocalStore,
    req: S3Request<HeadBucketInput>,
) -> S3Result<S3Response<HeadBucketOutput>> {
    store.bucket(&req.input.bucket).await?;
    Ok(S3Response::new(HeadBucketOutput::default()))
}

pub(super) async fn get_bucket_location(
    store: &LocalStore,
    req: S3Request<GetBucketLocationInput>,
) -> S3Result<S3Response<GetBucketLocationOutput>> {
    store.bucket(&req.input.bucket).await?;
    Ok(S3Response::new(GetBucketLocationOutput::default()))
}

pub(super) async fn get_bucket_versioning(
    store: &LocalStore,
    req: S3Request<GetBucketVersioningInput>,
) -> S3Result<S3Response<GetBucketVersioningOutput>> {
    // Never versioned: S3 answers with no status. Enabling it is refused (NotImplemented).
    store.bucket(&req.input.bucket).await?;
    Ok(S3Response::new(GetBucketVersioningOutput::default()))
}

pub(super) async fn list_buckets(
    store: &LocalStore,
    _req: S3Request<ListBucketsInput>,
) -> S3Result<S3Response<ListBucketsOutput>> {
    let buckets = store.run(Records::buckets).await?;
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

pub(super) async fn list_objects(
    store: &LocalStore,
    req: S3Request<ListObjectsInput>,
) -> S3Result<S3Response<ListObjectsOutput>> {
    let input = req.input;
    let query = Listing {
        prefix: input.prefix.clone().unwrap_or_default(),
        delimiter: input.delimiter.clone(),
        after: input.marker.clone().filter(|m| !m.is_empty()),
        max_keys: max_keys(input.max_keys)?,
    };
    let listed = store.list(&input.bucket, query).await?;
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

pub(super) async fn list_objects_v2(
    store: &LocalStore,
    req: S3Request<ListObjectsV2Input>,
) -> S3Result<S3Response<ListObjectsV2Output>> {
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
    let listed = store.list(&input.bucket, query).await?;
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

pub(super) async fn list_object_versions(
    store: &LocalStore,
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
    let listed = store.list(&input.bucket, query).await?;
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
