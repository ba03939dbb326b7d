//! The lease endpoints of fencegate (`/_fencegate/v1/leases/{name}`), one call each, signed with
//! SigV4 like an S3 request. No background work here: [`crate::Lease`] builds on these calls.

use std::fmt;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings, UriPathNormalizationMode,
    sign,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use bytes::Bytes;
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

use crate::metrics;

/// Where the lease endpoints live on fencegate's main listener.
const PATH_PREFIX: &str = "/_fencegate/v1/leases/";
/// The suffix of the renewal endpoint.
const RENEW_SUFFIX: &str = "/renew";
/// Answers are small JSON objects; anything larger is not fencegate talking.
const RESPONSE_BYTES_MAX: usize = 64 * 1024;
/// How long one lease call may take unless configured otherwise.
const REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
/// Idle pooled connections to fencegate: one worker rarely needs more than one.
const IDLE_CONNECTIONS_MAX: usize = 4;

/// A fencing token: grows with every new lease on a resource. Attach it to every write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(transparent)]
pub struct FencingToken(pub u64);

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What fencegate answers to an acquire or a renewal.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Grant {
    pub name: String,
    pub holder: String,
    /// Unguessable; only the holder can renew or release with it.
    pub lease_id: String,
    pub token: FencingToken,
    pub ttl_ms: u64,
    /// Lease credentials, when asked for ([`LeaseOptions::with_credentials`]).
    #[serde(default)]
    pub credentials: Option<LeaseCredentials>,
}

/// Temporary S3 credentials bound to a lease: every request signed with them is a write with
/// the lease's token on its resource (docs/leases.md). Hand them to any S3 tool with
/// fencegate as its endpoint; no header needed.
#[derive(Clone, PartialEq, Eq, Deserialize)]
pub struct LeaseCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: String,
    /// When the lease expires unless renewed (RFC 3339), as of the grant.
    pub expiration: String,
}

impl fmt::Debug for LeaseCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("expiration", &self.expiration)
            .finish_non_exhaustive()
    }
}

/// Why a lease call did not succeed. [`LeaseError::is_retryable`] says whether trying again
/// may help; the variants say who was at fault.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Someone else holds a live lease on the name (409 `LeaseHeld`).
    #[error("the lease is held by {holder} for {remaining_ms} more ms")]
    Held { holder: String, remaining_ms: u64 },
    /// The lease expired, was released, or was superseded (410 `LeaseGone`); `fence` is the
    /// resource's fence as fencegate said it: above the lease's token, it was superseded.
    #[error("the lease expired, was released, or was superseded{}", .fence.map(|f| format!(" (the resource's fence is {f})")).unwrap_or_default())]
    Gone { fence: Option<u64> },
    /// fencegate refused the call for another reason (bad request, credentials, store down).
    #[error("fencegate answered {status} {code}: {detail}")]
    Refused { status: u16, code: String, detail: String },
    /// No answer: connection refused or broken. `cause` is the whole chain of causes (the
    /// connection refused, the name that did not resolve, the TLS error).
    #[error("request to fencegate at {endpoint} failed: {cause}")]
    Transport { endpoint: String, cause: String },
    #[error("fencegate did not answer within {after_ms} ms")]
    Timeout { after_ms: u64 },
    /// An answer that is not what the lease API promises.
    #[error("unexpected answer from fencegate: {0}")]
    Protocol(String),
    /// Client-side: the request could not be built or signed, or options are inconsistent.
    #[error("invalid lease request: {0}")]
    Invalid(String),
}

impl LeaseError {
    /// Whether the same call may succeed later: no answer, or fencegate was unavailable.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport { .. } | Self::Timeout { .. } => true,
            Self::Refused { status, .. } => *status >= 500,
            Self::Held { .. } | Self::Gone { .. } | Self::Protocol(_) | Self::Invalid(_) => false,
        }
    }
}

/// A client of fencegate's lease service. Cheap to clone; clones share one connection pool.
#[derive(Clone)]
pub struct LeaseClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `scheme://authority`, no trailing slash.
    base: String,
    authority: String,
    region: String,
    identity: Identity,
    settings: SigningSettings,
    request_timeout: Duration,
}

impl fmt::Debug for LeaseClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseClient").field("base", &self.base).field("region", &self.region).finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Problem {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    detail: String,
    holder: Option<String>,
    remaining_ms: Option<u64>,
    /// A `LeaseGone`'s: the resource's fence.
    fence: Option<u64>,
}

impl LeaseClient {
    /// A client for fencegate at `endpoint` (`http(s)://host:port`), signing with
    /// `credentials` for `region` (any region fencegate accepts, e.g. `us-east-1`).
    pub fn new(endpoint: &str, credentials: Credentials, region: &str) -> Result<Self, LeaseError> {
        let uri: http::Uri =
            endpoint.parse().map_err(|e| LeaseError::Invalid(format!("endpoint {endpoint:?}: {e}")))?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(LeaseError::Invalid(format!("endpoint {endpoint:?} must be http(s)://host:port")));
        };
        if !matches!(scheme, "http" | "https") || !matches!(uri.path(), "" | "/") {
            return Err(LeaseError::Invalid(format!("endpoint {endpoint:?} must be http(s)://host:port")));
        }
        let mut connector = HttpConnector::new();
        connector.enforce_http(false);
        connector.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(IDLE_CONNECTIONS_MAX).build(https);

        let mut settings = SigningSettings::default();
        // Signed like S3: the path as sent, `x-amz-content-sha256` the body's SHA-256 (fencegate
        // takes its own endpoints with a signed body only).
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        Ok(Self {
            http,
            base: format!("{scheme}://{authority}"),
            authority: authority.to_string(),
            region: region.to_owned(),
            identity: credentials.into(),
            settings,
            request_timeout: REQUEST_TIMEOUT_DEFAULT,
        })
    }

    /// How long one call may take (default 5 s). Renewals are also bounded by the renewal
    /// interval and the lease's deadline.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// One acquire call, no background renewal: `POST /_fencegate/v1/leases/{name}`.
    pub async fn try_acquire(&self, name: &str, holder: &str, ttl: Duration) -> Result<Grant, LeaseError> {
        self.acquire_call(name, holder, ttl, false).await
    }

    /// [`Self::try_acquire`], answered with lease credentials too ([`Grant::credentials`]).
    pub async fn try_acquire_with_credentials(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Grant, LeaseError> {
        self.acquire_call(name, holder, ttl, true).await
    }

    pub(crate) async fn acquire_call(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
        credentials: bool,
    ) -> Result<Grant, LeaseError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).map_err(|_| LeaseError::Invalid("ttl too large".into()))?;
        let mut body = serde_json::json!({ "holder": holder, "ttl_ms": ttl_ms });
        if credentials {
            body["credentials"] = serde_json::Value::Bool(true);
        }
        let (status, bytes) = self.call(Method::POST, &lease_path(name, "")?, &body).await?;
        let grant = expect_grant(status, StatusCode::CREATED, &bytes)?;
        if credentials && grant.credentials.is_none() {
            return Err(LeaseError::Protocol("the grant came without the credentials asked for".into()));
        }
        metrics::acquired();
        Ok(grant)
    }

    /// One renewal call: `POST /_fencegate/v1/leases/{name}/renew`. [`LeaseError::Gone`]
    /// means the lease is not ours any more.
    pub async fn renew(&self, name: &str, lease_id: &str) -> Result<Grant, LeaseError> {
        let body = serde_json::json!({ "lease_id": lease_id });
        let (status, bytes) = self.call(Method::POST, &lease_path(name, RENEW_SUFFIX)?, &body).await?;
        expect_grant(status, StatusCode::OK, &bytes)
    }

    /// One release call: `DELETE /_fencegate/v1/leases/{name}`, compare-and-delete on the id.
    pub async fn release(&self, name: &str, lease_id: &str) -> Result<(), LeaseError> {
        let body = serde_json::json!({ "lease_id": lease_id });
        let (status, bytes) = self.call(Method::DELETE, &lease_path(name, "")?, &body).await?;
        if status == StatusCode::NO_CONTENT {
            return Ok(());
        }
        Err(refusal(status, &bytes))
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(StatusCode, Bytes), LeaseError> {
        let request = self.signed(method, path, Bytes::from(body.to_string()))?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(|e| self.transport(&e))?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|e| self.transport(&*e))?
                .to_bytes();
            Ok((status, bytes))
        };
        match tokio::time::timeout(self.request_timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(LeaseError::Timeout { after_ms: millis(self.request_timeout) }),
        }
    }

    /// A failed exchange, naming fencegate's address and every cause in the chain.
    fn transport(&self, error: &(dyn std::error::Error + 'static)) -> LeaseError {
        let mut cause = error.to_string();
        let mut source = error.source();
        while let Some(next) = source {
            let text = next.to_string();
            if !cause.contains(&text) {
                cause.push_str(": ");
                cause.push_str(&text);
            }
            source = next.source();
        }
        LeaseError::Transport { endpoint: self.base.clone(), cause }
    }

    fn signed(&self, method: Method, path: &str, body: Bytes) -> Result<http::Request<Full<Bytes>>, LeaseError> {
        let invalid = |e: &dyn fmt::Display| LeaseError::Invalid(e.to_string());
        let mut request = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(header::HOST, &self.authority)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
            .map_err(|e| invalid(&e))?;
        let params = v4::SigningParams::builder()
            .identity(&self.identity)
            .region(&self.region)
            .name("s3")
            .time(SystemTime::now())
            .settings(self.settings.clone())
            .build()
            .map_err(|e| invalid(&e))?
            .into();
        let headers: Vec<(&str, &str)> = request
            .headers()
            .iter()
            .map(|(name, value)| Ok((name.as_str(), value.to_str()?)))
            .collect::<Result<_, http::header::ToStrError>>()
            .map_err(|e| invalid(&e))?;
        let uri = request.uri().to_string();
        let signable =
            SignableRequest::new(request.method().as_str(), &uri, headers.into_iter(), SignableBody::Bytes(&body))
                .map_err(|e| invalid(&e))?;
        let (instructions, _signature) = sign(signable, &params).map_err(|e| invalid(&e))?.into_parts();
        instructions.apply_to_request_http1x(&mut request);
        Ok(request)
    }
}

/// The path of a lease endpoint: the name percent-encoded, except `/`, which goes as it is
/// (as in S3 object keys): fencegate's SigV4 check canonicalises `%2F` back to `/`, so an
/// encoded slash would never match the signature.
fn lease_path(name: &str, suffix: &str) -> Result<String, LeaseError> {
    if name.ends_with(RENEW_SUFFIX) {
        return Err(LeaseError::Invalid(format!(
            "lease name {name:?}: fencegate reads a name ending in /renew as a renewal"
        )));
    }
    let mut path = String::with_capacity(PATH_PREFIX.len() + name.len() * 3 + suffix.len());
    path.push_str(PATH_PREFIX);
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b'/') {
            path.push(char::from(byte));
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    path.push_str(suffix);
    Ok(path)
}

fn expect_grant(status: StatusCode, expected: StatusCode, bytes: &[u8]) -> Result<Grant, LeaseError> {
    if status != expected {
        return Err(refusal(status, bytes));
    }
    serde_json::from_slice(bytes).map_err(|e| LeaseError::Protocol(format!("lease JSON: {e}")))
}

/// Maps a problem+json answer to the error it stands for.
fn refusal(status: StatusCode, bytes: &[u8]) -> LeaseError {
    let problem: Option<Problem> = serde_json::from_slice(bytes).ok();
    let code = problem.as_ref().and_then(|p| p.kind.rsplit(':').next()).unwrap_or_default().to_owned();
    match (status, problem) {
        (StatusCode::GONE, problem) => LeaseError::Gone { fence: problem.and_then(|p| p.fence) },
        (StatusCode::CONFLICT, Some(Problem { holder: Some(holder), remaining_ms: Some(remaining_ms), .. }))
            if code == "LeaseHeld" =>
        {
            LeaseError::Held { holder, remaining_ms }
        }
        (status, problem) => LeaseError::Refused {
            status: status.as_u16(),
            code,
            detail: problem.map(|p| p.detail).unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned()),
        },
    }
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_percent_encoded_except_slashes() {
        assert_eq!(lease_path("job:a", "").unwrap(), "/_fencegate/v1/leases/job%3Aa");
        assert_eq!(lease_path("reports/2026 Q1", "/renew").unwrap(), "/_fencegate/v1/leases/reports/2026%20Q1/renew");
        assert_eq!(lease_path("é%", "").unwrap(), "/_fencegate/v1/leases/%C3%A9%25");
        assert!(lease_path("job/renew", "").is_err());
    }

    #[test]
    fn problems_map_to_errors() {
        let held = br#"{"type":"urn:fencegate:problem:LeaseHeld","holder":"a","remaining_ms":12,"detail":"x"}"#;
        assert!(matches!(
            refusal(StatusCode::CONFLICT, held),
            LeaseError::Held { holder, remaining_ms: 12 } if holder == "a"
        ));
        let gone = br#"{"type":"urn:fencegate:problem:LeaseGone"}"#;
        assert!(matches!(refusal(StatusCode::GONE, gone), LeaseError::Gone { fence: None }));
        let superseded = br#"{"type":"urn:fencegate:problem:LeaseGone","fence":9}"#;
        assert!(matches!(refusal(StatusCode::GONE, superseded), LeaseError::Gone { fence: Some(9) }));
        let down = br#"{"type":"urn:fencegate:problem:FenceStoreUnavailable","detail":"timeout"}"#;
        let err = refusal(StatusCode::SERVICE_UNAVAILABLE, down);
        assert!(matches!(&err, LeaseError::Refused { status: 503, code, .. } if code == "FenceStoreUnavailable"));
        assert!(err.is_retryable());
        let exhausted = br#"{"type":"urn:fencegate:problem:FencingTokensExhausted"}"#;
        let err = refusal(StatusCode::CONFLICT, exhausted);
        assert!(matches!(&err, LeaseError::Refused { status: 409, .. }) && !err.is_retryable());
        assert!(matches!(refusal(StatusCode::BAD_GATEWAY, b"<html>"), LeaseError::Refused { status: 502, .. }));
    }

    #[test]
    fn endpoints_are_scheme_and_authority_only() {
        let creds = || Credentials::new("a", "b", None, None, "test");
        assert!(LeaseClient::new("http://127.0.0.1:9000", creds(), "us-east-1").is_ok());
        assert!(LeaseClient::new("http://127.0.0.1:9000/", creds(), "us-east-1").is_ok());
        assert!(LeaseClient::new("127.0.0.1:9000", creds(), "us-east-1").is_err());
        assert!(LeaseClient::new("http://127.0.0.1:9000/prefix", creds(), "us-east-1").is_err());
        assert!(LeaseClient::new("ftp://127.0.0.1:9000", creds(), "us-east-1").is_err());
    }
}
