//! Lease credentials: temporary S3 credentials bound to one lease, so that an unmodified S3
//! tool is fenced by its endpoint and credentials alone (docs/leases.md, "Lease credentials: unmodified tools").
//!
//! Nothing of a credential is stored. Its session token names the grant: the resource, the
//! token, a tag of the lease id, and the issuer that asked for it. Its access key id is made
//! of the tag, and its secret is an HMAC of the session token under that issuer's own secret,
//! which every replica has in `[[credentials]]`. So:
//! - any replica verifies a signature without asking the store, before and after a restart;
//! - the store holds no secret (only the lease, as for any lease), and nobody can make a
//!   credential without an issuer's secret;
//! - a changed session token is another secret, so a signature never verifies with claims
//!   that were not issued.
//!
//! Whether the lease still stands (not expired, released or superseded) is a separate question,
//! asked of the stored lease on every request: `Claims::names`.

use std::collections::HashMap;
use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{Config, Role};
use crate::fence::{LeaseRecord, ResourceKey};

/// Every lease credential's access key id starts with this (static ones may not).
pub const ACCESS_KEY_PREFIX: &str = crate::config::LEASE_ACCESS_KEY_PREFIX;
/// Versioned, so that the format can change without misreading old tokens.
const SESSION_TOKEN_PREFIX: &str = "fgl1.";
/// Hex digits of the grant tag (128 bits of a SHA-256 of the lease id).
const TAG_HEX: usize = 32;
/// Hex digits of the tag in the access key id: 20 characters in all, like S3's.
const ACCESS_KEY_TAG_HEX: usize = 17;
/// A resource name is at most 1 KiB; its session token stays far below header limits.
const SESSION_TOKEN_BYTES_MAX: usize = 4096;

/// What a session token says: which grant of which lease, asked for by which issuer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claims {
    #[serde(rename = "r")]
    pub resource: String,
    #[serde(rename = "t")]
    pub token: u64,
    /// [`grant_tag`] of the lease id: names the grant without revealing its id.
    #[serde(rename = "g")]
    pub grant: String,
    /// The access key id of the issuer whose secret the credential's secret derives from.
    #[serde(rename = "p")]
    pub parent: String,
}

impl Claims {
    pub fn of_grant(resource: &ResourceKey, lease: &LeaseRecord, parent: &str) -> Self {
        Self {
            resource: resource.as_str().to_owned(),
            token: lease.token.0,
            grant: grant_tag(&lease.lease_id),
            parent: parent.to_owned(),
        }
    }

    /// Reads a session token; `None` for anything fencegate did not issue in this format.
    pub fn parse(session_token: &str) -> Option<Self> {
        if session_token.len() > SESSION_TOKEN_BYTES_MAX {
            return None;
        }
        let encoded = session_token.strip_prefix(SESSION_TOKEN_PREFIX)?;
        let json = URL_SAFE_NO_PAD.decode(encoded).ok()?;
        let claims: Self = serde_json::from_slice(&json).ok()?;
        let tag_ok =
            claims.grant.len() == TAG_HEX && claims.grant.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        tag_ok.then_some(claims)
    }

    pub fn session_token(&self) -> String {
        let json = serde_json::to_vec(self).expect("claims serialise");
        format!("{SESSION_TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(json))
    }

    pub fn access_key_id(&self) -> String {
        format!("{ACCESS_KEY_PREFIX}{}", self.grant[..ACCESS_KEY_TAG_HEX].to_ascii_uppercase())
    }

    /// Whether `lease`, as stored now, is the grant these claims name.
    pub fn names(&self, lease: &LeaseRecord) -> bool {
        lease.token.0 == self.token && grant_tag(&lease.lease_id) == self.grant
    }
}

/// The secret of the credential whose session token is `session_token`.
fn derive_secret(parent_secret: &str, session_token: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(parent_secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(b"fencegate lease credential\n");
    mac.update(session_token.as_bytes());
    let bytes = mac.finalize().into_bytes();
    // 30 bytes: 40 characters, the length of S3's secrets.
    STANDARD.encode(&bytes[..30])
}

/// Names a grant: a new lease id gives a new tag, and the tag does not give the id back.
pub fn grant_tag(lease_id: &str) -> String {
    let digest = Sha256::new().chain_update(b"fencegate lease grant\n").chain_update(lease_id.as_bytes()).finalize();
    hex::encode(&digest[..TAG_HEX / 2])
}

/// A credential as handed to the lease holder.
#[derive(Clone, Serialize)]
pub struct Issued {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: String,
    /// When the lease expires unless renewed (RFC 3339, UTC).
    pub expiration: String,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued").field("access_key_id", &self.access_key_id).finish_non_exhaustive()
    }
}

/// Why a request signed with a lease credential cannot be authenticated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredentialError {
    #[error(
        "a lease credential is used with the session token it was issued with (x-amz-security-token or \
         X-Amz-Security-Token)"
    )]
    MissingSessionToken,
    #[error("the session token was not issued by fencegate, or not with this access key id")]
    InvalidSessionToken,
    #[error("the issuer that asked for this lease credential is no longer an issuer in [[credentials]]")]
    UnknownIssuer,
}

/// The secrets of the credentials that may take leases (`role = "issuer"` or `"lessee"`),
/// from which lease credentials are made and checked, and which of them may also register.
pub struct Issuers {
    secrets: HashMap<String, String>,
    registrars: std::collections::HashSet<String>,
}

impl Issuers {
    pub fn from_config(config: &Config) -> Self {
        let leasing = config.credentials.iter().filter(|c| matches!(c.role, Role::Issuer | Role::Lessee));
        Self {
            secrets: leasing
                .clone()
                .map(|c| (c.access_key_id.clone(), c.secret_access_key.expose().to_owned()))
                .collect(),
            registrars: leasing.filter(|c| c.role == Role::Issuer).map(|c| c.access_key_id.clone()).collect(),
        }
    }

    /// Whether `access_key` is an issuer's (`role = "issuer"`): it may grant leases and register
    /// tokens.
    pub fn is_issuer(&self, access_key: &str) -> bool {
        self.registrars.contains(access_key)
    }

    /// Whether `access_key` may acquire, renew and release leases (`role = "issuer"` or
    /// `"lessee"`).
    pub fn may_lease(&self, access_key: &str) -> bool {
        self.secrets.contains_key(access_key)
    }

    /// A credential for the grant `lease` of `resource`, asked for by the issuer `parent`.
    pub fn issue(&self, parent: &str, resource: &ResourceKey, lease: &LeaseRecord) -> Option<Issued> {
        let parent_secret = self.secrets.get(parent)?;
        let claims = Claims::of_grant(resource, lease, parent);
        let session_token = claims.session_token();
        Some(Issued {
            access_key_id: claims.access_key_id(),
            secret_access_key: derive_secret(parent_secret, &session_token),
            session_token,
            expiration: rfc3339(lease.expires_at_ms),
        })
    }

    /// The secret a request signed by `access_key` with `session_token` must have been signed
    /// with, and the claims it carries (to be trusted once the signature is verified).
    pub fn secret(&self, access_key: &str, session_token: Option<&str>) -> Result<(String, Claims), CredentialError> {
        let session_token = session_token.ok_or(CredentialError::MissingSessionToken)?;
        let claims = Claims::parse(session_token).ok_or(CredentialError::InvalidSessionToken)?;
        if claims.access_key_id() != access_key {
            return Err(CredentialError::InvalidSessionToken);
        }
        let parent_secret = self.secrets.get(&claims.parent).ok_or(CredentialError::UnknownIssuer)?;
        Ok((derive_secret(parent_secret, session_token), claims))
    }
}

fn rfc3339(ms: u64) -> String {
    let nanos = i128::from(ms) * 1_000_000;
    time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
        .ok()
        .and_then(|t| t.replace_nanosecond(0).ok())
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| "9999-12-31T23:59:59Z".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::FenceToken;

    fn issuers() -> Issuers {
        Issuers {
            secrets: HashMap::from([("ISSUER".to_owned(), "issuer-secret".to_owned())]),
            registrars: ["ISSUER".to_owned()].into(),
        }
    }

    fn lease(id: &str, token: u64) -> LeaseRecord {
        LeaseRecord {
            holder: "a".into(),
            lease_id: id.into(),
            token: FenceToken(token),
            ttl_ms: 1000,
            expires_at_ms: 0,
        }
    }

    #[test]
    fn an_issued_credential_verifies_and_names_its_grant_only() {
        let resource = ResourceKey::new("job:a").unwrap();
        let grant = lease("0123456789abcdef", 7);
        let issued = issuers().issue("ISSUER", &resource, &grant).unwrap();
        assert!(issued.access_key_id.starts_with(ACCESS_KEY_PREFIX) && issued.access_key_id.len() == 20);
        assert_eq!(issued.secret_access_key.len(), 40);
        assert_eq!(issued.expiration, "1970-01-01T00:00:00Z");
        let (secret, claims) = issuers().secret(&issued.access_key_id, Some(&issued.session_token)).unwrap();
        assert_eq!(secret, issued.secret_access_key);
        assert_eq!((claims.resource.as_str(), claims.token), ("job:a", 7));
        assert!(claims.names(&grant));
        // Another grant of the same lease name (a new id), or the same id with another token.
        assert!(!claims.names(&lease("fedcba9876543210", 7)));
        assert!(!claims.names(&lease("0123456789abcdef", 8)));
        // The lease id itself appears nowhere in what the holder gets.
        assert!(!issued.session_token.contains("0123456789abcdef"));
        assert!(!format!("{issued:?}").contains(&issued.secret_access_key));
    }

    #[test]
    fn changed_claims_are_another_secret_or_refused() {
        let resource = ResourceKey::new("job:a").unwrap();
        let issued = issuers().issue("ISSUER", &resource, &lease("id", 7)).unwrap();
        let mut claims = Claims::parse(&issued.session_token).unwrap();
        claims.token = 8;
        let forged = claims.session_token();
        let (secret, _) = issuers().secret(&issued.access_key_id, Some(&forged)).unwrap();
        assert_ne!(secret, issued.secret_access_key, "a raised token needs a secret nobody has");
        claims.grant = grant_tag("other");
        assert_eq!(
            issuers().secret(&issued.access_key_id, Some(&claims.session_token())),
            Err(CredentialError::InvalidSessionToken),
            "the access key id is the grant's"
        );
        assert_eq!(issuers().secret(&issued.access_key_id, None), Err(CredentialError::MissingSessionToken));
        assert_eq!(issuers().secret(&issued.access_key_id, Some("garbage")), Err(CredentialError::InvalidSessionToken));
        let other =
            Issuers { secrets: HashMap::from([("OTHER".to_owned(), "s".to_owned())]), registrars: Default::default() };
        assert_eq!(
            other.secret(&issued.access_key_id, Some(&issued.session_token)),
            Err(CredentialError::UnknownIssuer)
        );
        assert!(other.issue("ISSUER", &resource, &lease("id", 7)).is_none());
    }
}
