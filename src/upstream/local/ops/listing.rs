//! Listings of a bucket's keys: prefixes, delimiters, pages.

use super::*;

/// What a listing asks for.
#[derive(Clone)]
pub(super) struct Listing {
    pub(super) prefix: String,
    pub(super) delimiter: Option<String>,
    pub(super) after: Option<String>,
    pub(super) max_keys: usize,
}

pub(super) enum Entry {
    Object(String, Box<ObjectRecord>),
    Prefix(String),
}

pub(super) struct Listed {
    pub(super) entries: Vec<Entry>,
    pub(super) truncated: bool,
}

impl Listed {
    pub(super) fn last(&self) -> Option<&str> {
        self.entries.last().map(|e| match e {
            Entry::Object(k, _) | Entry::Prefix(k) => k.as_str(),
        })
    }
}

/// The common prefix `key` rolls up into under `prefix` and `delimiter`, if any.
pub(super) fn common_prefix<'a>(key: &'a str, prefix: &str, delimiter: Option<&str>) -> Option<&'a str> {
    let delimiter = delimiter.filter(|d| !d.is_empty())?;
    let rest = key.get(prefix.len()..)?;
    let at = rest.find(delimiter)?;
    Some(&key[..prefix.len() + at + delimiter.len()])
}

pub(super) fn list_keys(records: &Records, bucket: &str, q: &Listing) -> Result<Listed, StoreError> {
    let delimiter = q.delimiter.as_deref();
    let mut entries = Vec::new();
    // A marker inside a common prefix resumes after the whole prefix.
    let mut last_prefix: Option<String> =
        q.after.as_deref().and_then(|a| common_prefix(a, &q.prefix, delimiter)).map(str::to_owned);
    let mut after = q.after.clone();
    if q.max_keys == 0 {
        return Ok(Listed { entries, truncated: false });
    }
    pub(super) const PAGE: usize = 1000;
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

pub(super) fn max_keys(asked: Option<i32>) -> S3Result<usize> {
    match asked {
        None => Ok(LIST_KEYS_DEFAULT as usize),
        Some(n) if n < 0 => Err(s3_error!(InvalidArgument, "max-keys must not be negative")),
        Some(n) => Ok(usize::try_from(n.min(LIST_KEYS_DEFAULT)).unwrap_or(0)),
    }
}

/// Keys as `encoding-type=url` returns them: percent-encoded, `/` kept.
pub(super) fn encoder(encoding: Option<&EncodingType>) -> impl Fn(String) -> String + use<> {
    pub(super) const KEEP: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b'/');
    let url = encoding.is_some_and(|e| e.as_str() == EncodingType::URL);
    move |s: String| if url { percent_encoding::utf8_percent_encode(&s, KEEP).to_string() } else { s }
}

pub(super) fn object_entry(key: String, record: &ObjectRecord, with_owner: bool) -> Object {
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

/// A listing's entries as S3's `Contents` and `CommonPrefixes`.
pub(super) fn split(
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
