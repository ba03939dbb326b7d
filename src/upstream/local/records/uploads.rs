//! Multipart uploads in the local store: an upload's record, its parts, and the completion
//! that makes them one object in one transaction.

use super::*;

impl Records {
    pub fn create_upload(&self, upload_id: &str, record: &UploadRecord) -> Result<(), StoreError> {
        let txn = self.db.begin_write()?;
        {
            if txn.open_table(BUCKETS)?.get(record.bucket.as_str())?.is_none() {
                return Err(StoreError::NoSuchBucket);
            }
            txn.open_table(UPLOADS)?.insert(upload_id, serde_json::to_vec(record)?.as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// The upload `upload_id` if it was started on `bucket/key` (an id is only good with its
    /// own key, as in S3).
    pub fn upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<UploadRecord, StoreError> {
        let read = self.db.begin_read()?;
        let uploads = read.open_table(UPLOADS)?;
        let record: UploadRecord = uploads
            .get(upload_id)?
            .map(|v| serde_json::from_slice(v.value()))
            .transpose()?
            .ok_or(StoreError::NoSuchUpload)?;
        if record.bucket != bucket || record.key != key {
            return Err(StoreError::NoSuchUpload);
        }
        Ok(record)
    }

    /// Records a part (replacing one with the same number). Returns the replaced part's file.
    pub fn commit_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        number: u32,
        part: &PartRecord,
    ) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_write()?;
        let replaced = {
            let uploads = txn.open_table(UPLOADS)?;
            let record: Option<UploadRecord> =
                uploads.get(upload_id)?.map(|v| serde_json::from_slice(v.value())).transpose()?;
            if !record.is_some_and(|r| r.bucket == bucket && r.key == key) {
                return Err(StoreError::NoSuchUpload);
            }
            let mut parts = txn.open_table(PARTS)?;
            let old: Option<PartRecord> =
                parts.get((upload_id, number))?.map(|v| serde_json::from_slice(v.value())).transpose()?;
            parts.insert((upload_id, number), serde_json::to_vec(part)?.as_slice())?;
            old
        };
        txn.commit()?;
        Ok(replaced.map(|p| vec![p.file]).unwrap_or_default())
    }

    /// The parts of an upload, by number.
    pub fn parts(&self, upload_id: &str) -> Result<Vec<(u32, PartRecord)>, StoreError> {
        let read = self.db.begin_read()?;
        let parts = read.open_table(PARTS)?;
        let mut out = Vec::new();
        for entry in parts.range((upload_id, 0)..=(upload_id, u32::MAX))? {
            let (k, v) = entry?;
            out.push((k.value().1, serde_json::from_slice(v.value())?));
        }
        Ok(out)
    }

    /// Uploads in progress in `bucket`, by key then initiation.
    pub fn uploads(&self, bucket: &str) -> Result<Vec<(String, UploadRecord)>, StoreError> {
        let read = self.db.begin_read()?;
        if read.open_table(BUCKETS)?.get(bucket)?.is_none() {
            return Err(StoreError::NoSuchBucket);
        }
        let mut out = Vec::new();
        for entry in read.open_table(UPLOADS)?.iter()? {
            let (id, value) = entry?;
            let record: UploadRecord = serde_json::from_slice(value.value())?;
            if record.bucket == bucket {
                out.push((id.value().to_owned(), record));
            }
        }
        out.sort_by(|a, b| (&a.1.key, a.1.initiated_ms, &a.0).cmp(&(&b.1.key, b.1.initiated_ms, &b.0)));
        Ok(out)
    }

    /// Completes an upload: the parts the client lists (ascending, each present with its
    /// ETag, all but the last at least 5 MiB) become the object, if `condition` holds on the
    /// object it replaces; the upload and its other parts go. One transaction. Returns the
    /// new record and the files no longer needed.
    pub fn complete_upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        listed: &[(u32, Option<String>)],
        condition: &Precondition,
    ) -> Result<(ObjectRecord, Vec<String>), StoreError> {
        let txn = self.db.begin_write()?;
        let (record, unneeded_files) = {
            let mut uploads = txn.open_table(UPLOADS)?;
            let upload: Option<UploadRecord> = uploads
                .get(upload_id)?
                .map(|v| serde_json::from_slice(v.value()))
                .transpose()?
                .filter(|r: &UploadRecord| r.bucket == bucket && r.key == key);
            let Some(upload) = upload else {
                return completed_before(&txn, bucket, key, upload_id).map(|current| (current, Vec::new()));
            };
            let mut parts_table = txn.open_table(PARTS)?;
            let mut stored: HashMap<u32, PartRecord> = HashMap::new();
            for entry in parts_table.range((upload_id, 0)..=(upload_id, u32::MAX))? {
                let (k, v) = entry?;
                stored.insert(k.value().1, serde_json::from_slice(v.value())?);
            }
            let chosen = choose_parts(&stored, listed)?;
            let mut objects = txn.open_table(OBJECTS)?;
            let name = object_key(bucket, key);
            let current: Option<ObjectRecord> =
                objects.get(name.as_str())?.map(|v| serde_json::from_slice(v.value())).transpose()?;
            condition.check(current.as_ref())?;
            let record = ObjectRecord {
                etag: multipart_etag(chosen.iter().map(|p| p.etag.as_str())),
                size: chosen.iter().map(|p| p.size).sum(),
                modified_ms: now_ms(),
                segments: chosen.iter().map(|p| Segment { file: p.file.clone(), size: p.size }).collect(),
                attributes: upload.attributes,
                checksums: Checksums::default(),
            };
            objects.insert(name.as_str(), serde_json::to_vec(&record)?.as_slice())?;
            let kept: HashSet<&str> = chosen.iter().map(|p| p.file.as_str()).collect();
            let mut freed: Vec<String> =
                stored.values().filter(|p| !kept.contains(p.file.as_str())).map(|p| p.file.clone()).collect();
            freed.extend(unneeded(current, &record));
            for number in stored.keys() {
                parts_table.remove((upload_id, *number))?;
            }
            uploads.remove(upload_id)?;
            let now = record.modified_ms;
            let mut completed = txn.open_table(COMPLETED)?;
            completed.retain(|_, v| {
                serde_json::from_slice::<Completed>(v).is_ok_and(|c| c.completed_ms + COMPLETED_KEEP_MS > now)
            })?;
            let done = Completed {
                bucket: bucket.to_owned(),
                key: key.to_owned(),
                etag: record.etag.clone(),
                completed_ms: now,
            };
            completed.insert(upload_id, serde_json::to_vec(&done)?.as_slice())?;
            (record, freed)
        };
        txn.commit()?;
        Ok((record, unneeded_files))
    }

    /// Aborts an upload: its record and parts go. Returns the parts' files.
    pub fn abort_upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<Vec<String>, StoreError> {
        let txn = self.db.begin_write()?;
        let files = {
            let mut uploads = txn.open_table(UPLOADS)?;
            let upload: Option<UploadRecord> =
                uploads.get(upload_id)?.map(|v| serde_json::from_slice(v.value())).transpose()?;
            if !upload.is_some_and(|r| r.bucket == bucket && r.key == key) {
                return Err(StoreError::NoSuchUpload);
            }
            let mut parts = txn.open_table(PARTS)?;
            let mut files = Vec::new();
            let mut numbers = Vec::new();
            for entry in parts.range((upload_id, 0)..=(upload_id, u32::MAX))? {
                let (k, v) = entry?;
                numbers.push(k.value().1);
                files.push(serde_json::from_slice::<PartRecord>(v.value())?.file);
            }
            for number in numbers {
                parts.remove((upload_id, number))?;
            }
            uploads.remove(upload_id)?;
            files
        };
        txn.commit()?;
        Ok(files)
    }
}

/// S3's multipart ETag: the MD5 of the parts' binary MD5s, then `-` and the part count.
pub fn multipart_etag<'a>(part_etags: impl Iterator<Item = &'a str>) -> String {
    use md5::Digest;
    let mut md5 = md5::Md5::new();
    let mut n = 0;
    for etag in part_etags {
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = etag.get(2 * i..2 * i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()).unwrap_or(0);
        }
        md5.update(bytes);
        n += 1;
    }
    format!("{}-{n}", hex::encode(md5.finalize()))
}

/// The object a completion of `upload_id` made, when it is asked again (a client's retry)
/// while that object still stands: the same answer. Otherwise the upload is unknown.
pub(super) fn completed_before(
    txn: &redb::WriteTransaction,
    bucket: &str,
    key: &str,
    upload_id: &str,
) -> Result<ObjectRecord, StoreError> {
    let done: Option<Completed> =
        txn.open_table(COMPLETED)?.get(upload_id)?.map(|v| serde_json::from_slice(v.value())).transpose()?;
    let current: Option<ObjectRecord> = txn
        .open_table(OBJECTS)?
        .get(object_key(bucket, key).as_str())?
        .map(|v| serde_json::from_slice(v.value()))
        .transpose()?;
    match (done, current) {
        (Some(done), Some(current)) if done.bucket == bucket && done.key == key && done.etag == current.etag => {
            Ok(current)
        }
        _ => Err(StoreError::NoSuchUpload),
    }
}

/// The parts a completion lists, judged in S3's order: the list's order, then each part and
/// its ETag, then sizes (all but the last at least 5 MiB).
pub(super) fn choose_parts(
    stored: &HashMap<u32, PartRecord>,
    listed: &[(u32, Option<String>)],
) -> Result<Vec<PartRecord>, StoreError> {
    if listed.is_empty() {
        return Err(StoreError::InvalidPart(0));
    }
    if listed.windows(2).any(|pair| pair[1].0 <= pair[0].0) {
        return Err(StoreError::InvalidPartOrder);
    }
    let mut chosen = Vec::with_capacity(listed.len());
    for (number, etag) in listed {
        let part = stored.get(number).ok_or(StoreError::InvalidPart(*number))?;
        if etag.as_deref().is_some_and(|e| e != part.etag) {
            return Err(StoreError::InvalidPart(*number));
        }
        chosen.push((*number, part.clone()));
    }
    if let Some((number, _)) = chosen[..chosen.len() - 1].iter().find(|(_, p)| p.size < PART_BYTES_MIN) {
        return Err(StoreError::EntityTooSmall(*number));
    }
    Ok(chosen.into_iter().map(|(_, part)| part).collect())
}
