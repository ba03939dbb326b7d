//! Idempotency records of the HTTP API gateway: what became of one client request, kept in the
//! fence store so that a retry is answered from the record instead of reaching the API again.
//! See `docs/design.md` and the README, "HTTP API gateway".

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{FenceToken, ResourceKey};

/// Which request a record is about: its resource and a digest of the client's request id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    resource: ResourceKey,
    /// Hex SHA-256 of the client's request id: fixed length, and no client bytes in store keys.
    request: String,
}

impl IdempotencyKey {
    /// `client_request_id` is the client's own `Idempotency-Key`, or the request's fingerprint.
    pub fn new(resource: ResourceKey, client_request_id: &[u8]) -> Self {
        Self { resource, request: hex::encode(Sha256::digest(client_request_id)) }
    }

    pub fn resource(&self) -> &ResourceKey {
        &self.resource
    }

    /// The request part of the key (64 hex digits).
    pub fn request_digest(&self) -> &str {
        &self.request
    }

    /// One string naming the record in a store's flat key space. Resource names hold no
    /// control characters, so the newline cannot be part of one.
    pub fn storage_name(&self) -> String {
        format!("{}\n{}", self.resource, self.request)
    }

    /// The resource of a record named [`Self::storage_name`], if `name` is one.
    pub fn resource_of_storage_name(name: &str) -> Option<ResourceKey> {
        let (resource, request) = name.rsplit_once('\n')?;
        (request.len() == 64 && request.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| ResourceKey::new(resource).ok())
            .flatten()
    }

    /// The `Idempotency-Key` the API is sent: derived from resource, token and request id, so
    /// the same request with the same token always carries the same key, and a request under a
    /// new lease never collides with one of the old lease at the API.
    pub fn upstream_key(&self, token: FenceToken) -> String {
        let mut h = Sha256::new();
        for part in [self.resource.as_str().as_bytes(), token.0.to_string().as_bytes(), self.request.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        format!("fg-{}", &hex::encode(h.finalize())[..UPSTREAM_KEY_HEX_DIGITS])
    }
}

/// 192 bits of the digest: collision-free in practice, and short enough for every API's limit.
const UPSTREAM_KEY_HEX_DIGITS: usize = 48;

/// What became of one request. Serialised (JSON) into the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    /// Who claimed the key: only that request may finish the record.
    pub claim: String,
    /// Hex SHA-256 of method, path and body: a retry under the same key with another body is
    /// refused (422).
    pub fingerprint: String,
    /// The token the request was first sent with.
    pub token: FenceToken,
    /// The `Idempotency-Key` the API was sent.
    pub upstream_key: String,
    /// Wall-clock ms after which the record counts as absent (and may be swept).
    pub expires_at_ms: u64,
    pub outcome: IdempotencyOutcome,
    /// The route's prefix (`routes[].prefix`), for the operator (`fencegate reconcile`).
    #[serde(default)]
    pub route: String,
    /// Wall-clock ms when the request claimed the record, for the operator.
    #[serde(default)]
    pub claimed_at_ms: u64,
}

impl IdempotencyRecord {
    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at_ms <= now_ms
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum IdempotencyOutcome {
    /// Claimed, being sent or waiting for the API. Past `deadline_ms` no live fencegate is
    /// still working on it (it died, or could not record the outcome): the outcome is unknown.
    InFlight { deadline_ms: u64 },
    /// The API answered.
    Completed(RecordedResponse),
    /// The request may or may not have executed at the API.
    Ambiguous { cause: AmbiguousCause },
}

/// Why an outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmbiguousCause {
    /// No response head within the route's request timeout.
    Timeout,
    /// The connection broke after the request was sent.
    ConnectionLost,
    /// The claim was never finished (the fencegate that sent it died or lost its store).
    Abandoned,
}

/// An API response as it is replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedResponse {
    pub status: u16,
    /// End-to-end headers in order (hop-by-hop ones are never recorded).
    pub headers: Vec<(String, String)>,
    /// `None` when the body was larger than `routes.response_bytes_max` or could not be read:
    /// the request executed, but its response cannot be replayed.
    #[serde(with = "base64_bytes")]
    pub body: Option<Vec<u8>>,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyBegin {
    /// No live record existed; the caller's in-flight record is now stored.
    Claimed,
    /// A live record exists (the caller's was not stored).
    Existing(IdempotencyRecord),
    /// No record existed, and there is no room for the caller's (the store's bound on records;
    /// none is dropped before its retention ends): nothing was stored.
    Full,
}

/// Bodies as base64 in the JSON form, not arrays of numbers.
mod base64_bytes {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(bytes) => s.serialize_some(&STANDARD.encode(bytes)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| STANDARD.decode(t).map_err(serde::de::Error::custom)).transpose()
    }
}

/// A hex SHA-256 of `parts`, each length-prefixed so that no two part lists hash alike.
pub fn fingerprint(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for part in parts {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(resource: &str, id: &str) -> IdempotencyKey {
        IdempotencyKey::new(ResourceKey::new(resource).unwrap(), id.as_bytes())
    }

    /// The key sent upstream is stable for one request and token, and differs when any of
    /// resource, token or request id differs.
    #[test]
    fn upstream_keys_are_derived_from_resource_token_and_request() {
        let k = key("payment:42", "abc");
        assert_eq!(k.upstream_key(FenceToken(7)), key("payment:42", "abc").upstream_key(FenceToken(7)));
        assert!(k.upstream_key(FenceToken(7)).starts_with("fg-"));
        assert_eq!(k.upstream_key(FenceToken(7)).len(), 3 + UPSTREAM_KEY_HEX_DIGITS);
        assert_ne!(k.upstream_key(FenceToken(7)), k.upstream_key(FenceToken(8)));
        assert_ne!(k.upstream_key(FenceToken(7)), key("payment:43", "abc").upstream_key(FenceToken(7)));
        assert_ne!(k.upstream_key(FenceToken(7)), key("payment:42", "abd").upstream_key(FenceToken(7)));
    }

    /// A record's storage name gives back its resource, and nothing else parses as one.
    #[test]
    fn storage_names_give_back_their_resource() {
        let k = key("payment:42", "abc");
        assert_eq!(IdempotencyKey::resource_of_storage_name(&k.storage_name()).as_ref(), Some(k.resource()));
        for bad in
            ["payment:42", "payment:42\nabc", "\n0000000000000000000000000000000000000000000000000000000000000000"]
        {
            assert_eq!(IdempotencyKey::resource_of_storage_name(bad), None, "{bad:?}");
        }
    }

    /// Length prefixes keep `("ab", "c")` and `("a", "bc")` apart.
    #[test]
    fn fingerprints_separate_their_parts() {
        assert_ne!(fingerprint(&[b"ab", b"c"]), fingerprint(&[b"a", b"bc"]));
        assert_eq!(fingerprint(&[b"POST", b"/x", b"{}"]), fingerprint(&[b"POST", b"/x", b"{}"]));
    }

    /// A record survives its JSON form unchanged, binary body included.
    #[test]
    fn records_round_trip_through_json() {
        let record = IdempotencyRecord {
            claim: "c1".into(),
            fingerprint: "f".into(),
            token: FenceToken(u64::MAX),
            upstream_key: "fg-1".into(),
            expires_at_ms: 99,
            route: "/api/".into(),
            claimed_at_ms: 0,
            outcome: IdempotencyOutcome::Completed(RecordedResponse {
                status: 201,
                headers: vec![("etag".into(), "\"v1\"".into())],
                body: Some(vec![0, 159, 255, b'{']),
            }),
        };
        let json = serde_json::to_vec(&record).unwrap();
        assert_eq!(serde_json::from_slice::<IdempotencyRecord>(&json).unwrap(), record);
        assert!(record.is_expired(99) && !record.is_expired(98));
    }
}
