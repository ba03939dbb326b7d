//! The Redis store's listings: a `SCAN` of the keyspace for the resources' keys, keeping only
//! the page asked for (the first `limit` in byte order after `after`), so memory stays bounded
//! by the page whatever the number of fences. Redis keeps no order of its keys: each page is a
//! walk of every key that matches the prefix (`docs/operations.md`, "The console").

use std::collections::BTreeSet;

use async_trait::async_trait;

use super::records::{lease_fields, lease_of_fields};
use super::{RedisStore, key, parse_token};
use crate::fence::{
    FencePage, LeasePage, ListingStore, Page, REPLICAS_LISTED_MAX, RecordPage, ReplicaAge, ReplicaList, ResourceKey,
    StoreError, replica_age,
};

/// Keys asked for per `SCAN` step.
const SCAN_COUNT: usize = 1000;

#[async_trait]
impl ListingStore for RedisStore {
    async fn fences(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<FencePage, StoreError> {
        let limit = limit.max(1);
        let resources = self.scan(prefix, "fence", after, limit + 1).await?;
        if resources.is_empty() {
            return Ok(FencePage::default());
        }
        let mut mget = redis::cmd("MGET");
        for resource in &resources {
            mget.arg(key(resource, "fence"));
        }
        let tokens: Vec<Option<String>> = self.connection.query(&mget).await?;
        let mut fences = Vec::with_capacity(resources.len());
        for (resource, token) in resources.iter().zip(tokens) {
            // A fence is never removed; one gone since the scan went with a store that lost
            // its data, and is not listed.
            if let Some(token) = token.as_deref().map(parse_token).transpose()?.flatten() {
                fences.push((resource.clone(), token));
            }
        }
        Ok(page_of(&resources, fences, limit))
    }

    async fn leases(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<LeasePage, StoreError> {
        let limit = limit.max(1);
        let resources = self.scan(prefix, "lease", after, limit + 1).await?;
        if resources.is_empty() {
            return Ok(LeasePage::default());
        }
        let mut pipe = redis::pipe();
        for resource in &resources {
            pipe.add_command(lease_fields(resource));
        }
        let answers: Vec<Vec<Option<String>>> = self.connection.pipeline(&pipe).await?;
        let mut leases = Vec::with_capacity(resources.len());
        for (resource, fields) in resources.iter().zip(answers) {
            // Released since the scan: not listed.
            if let Some(lease) = lease_of_fields(fields)? {
                leases.push((resource.clone(), lease));
            }
        }
        Ok(page_of(&resources, leases, limit))
    }

    /// A `SCAN` step over the keys: the cursor is Redis's, and a page holds the records among
    /// the `limit` (at least [`SCAN_COUNT`]) keys Redis walked, often none, sometimes more.
    async fn idempotency_records(&self, cursor: Option<String>, limit: usize) -> Result<RecordPage, StoreError> {
        refuse_on_cluster(self)?;
        let cursor = cursor.unwrap_or_else(|| "0".into());
        let count = limit.max(SCAN_COUNT);
        let cmd = redis::cmd("SCAN").arg(&cursor).arg("MATCH").arg("fg:{*}:idem:*").arg("COUNT").arg(count).to_owned();
        let (next, keys): (String, Vec<String>) = self.connection.query(&cmd).await?;
        let mut page = RecordPage { next: (next != "0").then_some(next), ..RecordPage::default() };
        let mut pipe = redis::pipe();
        for key in &keys {
            pipe.cmd("HGET").arg(key).arg("record");
        }
        let jsons: Vec<Result<Option<String>, String>> = match keys.is_empty() {
            true => Vec::new(),
            false => match self.connection.pipeline::<Vec<Option<String>>>(&pipe).await {
                Ok(jsons) => jsons.into_iter().map(Ok).collect(),
                // One key of another type fails them all: each alone, then.
                Err(StoreError::Backend(_)) => self.each_record(&keys).await?,
                Err(e) => return Err(e),
            },
        };
        for (key, json) in keys.iter().zip(jsons) {
            let resource = key
                .rfind(":idem:")
                .and_then(|at| resource_of_key(key, &key[at + 1..]))
                .and_then(|r| ResourceKey::new(&r).ok());
            match json {
                Ok(Some(json)) => page.read(key, resource, json.as_bytes()),
                Ok(None) => {} // gone since the scan: its retention ended
                Err(error) => page.unreadable.push((key.clone(), error)),
            }
        }
        Ok(page)
    }
}

/// Each replica's id and when it last said it was up (its wall clock, ms).
#[async_trait]
impl ReplicaList for RedisStore {
    async fn replica_seen(&self, id: &str, now_ms: u64) -> Result<(), StoreError> {
        let _: i64 = self.connection.query(redis::cmd("HSET").arg(REPLICAS_KEY).arg(id).arg(now_ms)).await?;
        Ok(())
    }

    async fn replicas(&self, since_ms: u64) -> Result<Vec<(String, u64)>, StoreError> {
        // Bytes: one field that is not text (written by hand) must not hide the others.
        let all: Vec<(Vec<u8>, Vec<u8>)> = self.connection.query(redis::cmd("HGETALL").arg(REPLICAS_KEY)).await?;
        let (mut seen, mut forgotten) = (Vec::new(), Vec::new());
        for (id, at) in all {
            let at = std::str::from_utf8(&at).ok().and_then(|at| at.parse::<u64>().ok());
            match (String::from_utf8(id.clone()), at.map(|at| replica_age(at, since_ms))) {
                (Ok(id), Some(ReplicaAge::Seen(at))) => seen.push((id, at)),
                (Ok(_), Some(ReplicaAge::Silent)) => {}
                _ => forgotten.push(id),
            }
        }
        if !forgotten.is_empty()
            && let Err(error) = self.connection.query::<i64>(redis::cmd("HDEL").arg(REPLICAS_KEY).arg(&forgotten)).await
        {
            tracing::debug!(%error, "cannot forget long silent replicas");
        }
        seen.sort();
        seen.truncate(REPLICAS_LISTED_MAX);
        Ok(seen)
    }

    async fn replica_gone(&self, id: &str) -> Result<(), StoreError> {
        let _: i64 = self.connection.query(redis::cmd("HDEL").arg(REPLICAS_KEY).arg(id)).await?;
        Ok(())
    }
}

/// The replicas seen, by id: when each last said it was up (its wall clock, ms). One key: a
/// Redis Cluster keeps it on one node.
const REPLICAS_KEY: &str = "fg:replicas";

impl RedisStore {
    /// The `record` field of each key, read one at a time: a key that is not a record's is
    /// told apart (why it could not be read) from the others.
    async fn each_record(&self, keys: &[String]) -> Result<Vec<Result<Option<String>, String>>, StoreError> {
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            out.push(match self.connection.query::<Option<String>>(redis::cmd("HGET").arg(key).arg("record")).await {
                Ok(json) => Ok(json),
                Err(StoreError::Backend(e)) => Err(e.to_string()),
                Err(e) => return Err(e),
            });
        }
        Ok(out)
    }

    /// The first `keep` resources (byte order) after `after` that start with `prefix` and have
    /// a key ending in `suffix`.
    async fn scan(
        &self,
        prefix: &str,
        suffix: &str,
        after: Option<&str>,
        keep: usize,
    ) -> Result<Vec<ResourceKey>, StoreError> {
        refuse_on_cluster(self)?;
        let pattern = format!("fg:{{{}*}}:{suffix}", glob_escaped(&tag_escaped(prefix)));
        let mut page: BTreeSet<String> = BTreeSet::new();
        let mut cursor = "0".to_owned();
        loop {
            let cmd =
                redis::cmd("SCAN").arg(&cursor).arg("MATCH").arg(&pattern).arg("COUNT").arg(SCAN_COUNT).to_owned();
            let (next, keys): (String, Vec<String>) = self.connection.query(&cmd).await?;
            for key in keys {
                let Some(resource) = resource_of_key(&key, suffix) else { continue };
                if !resource.starts_with(prefix) || after.is_some_and(|after| resource.as_str() <= after) {
                    continue;
                }
                page.insert(resource);
                if page.len() > keep {
                    page.pop_last();
                }
            }
            if next == "0" {
                break;
            }
            cursor = next;
        }
        page.into_iter().map(|r| ResourceKey::new(&r).map_err(|e| StoreError::Backend(Box::new(e)))).collect()
    }
}

/// The page of the `limit` + 1 resources scanned, holding those still there when read: whether
/// more follow is the scan's to say (a lease released between the scan and the read would
/// otherwise end the listing with live leases still unlisted).
fn page_of<T>(scanned: &[ResourceKey], mut items: Vec<(ResourceKey, T)>, limit: usize) -> Page<T> {
    let next = (scanned.len() > limit).then(|| scanned[limit - 1].as_str().to_owned());
    if let Some(last) = &next {
        items.retain(|(resource, _)| resource.as_str() <= last.as_str());
    }
    Page { items, next }
}

/// A `SCAN` reaches one node of a cluster only.
fn refuse_on_cluster(store: &RedisStore) -> Result<(), StoreError> {
    if store.connection.is_cluster() {
        return Err(StoreError::Backend(
            "listing is not supported on a Redis Cluster store: each node would have to be scanned".into(),
        ));
    }
    Ok(())
}

/// A resource name as it sits in a key's hash tag (`key`): `%` and `}` escaped.
fn tag_escaped(raw: &str) -> String {
    raw.replace('%', "%25").replace('}', "%7D")
}

/// `raw` matched literally by a `SCAN` pattern.
fn glob_escaped(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The resource of key `fg:{<tag>}:<suffix>`, its tag unescaped.
fn resource_of_key(key: &str, suffix: &str) -> Option<String> {
    let tag = key.strip_prefix("fg:{")?.strip_suffix(suffix)?.strip_suffix("}:")?;
    let mut out = String::with_capacity(tag.len());
    let mut rest = tag;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        match rest.get(at..at + 3)? {
            "%25" => out.push('%'),
            "%7D" => out.push('}'),
            _ => return None,
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_give_back_their_resources() {
        for name in ["a", "job:1", "x}y%z", "%7D", "50%25}", "a*b?[c]\\"] {
            let resource = ResourceKey::new(name).unwrap();
            let stored = key(&resource, "fence");
            assert_eq!(resource_of_key(&stored, "fence").as_deref(), Some(name), "{stored}");
            assert_eq!(stored, format!("fg:{{{}}}:fence", tag_escaped(name)));
        }
        assert_eq!(resource_of_key("fg:{a}:lease", "fence"), None);
        assert_eq!(resource_of_key("fg:{a%zz}:fence", "fence"), None);
        assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
