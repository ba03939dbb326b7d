//! Who signed an S3 request: the `[[credentials]]`, and lease credentials, whose secret is
//! derived from the request's session token (`lease::credentials`). s3s asks for a secret by
//! access key alone, so the service wrapper hands the session token to authentication on the
//! request's task, and takes back whether fencegate's route saw the request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::StatusCode;
use s3s::service::S3Service;
use s3s::{Body, S3Result};

use crate::lease::credentials::{ACCESS_KEY_PREFIX, Claims, CredentialError, Issuers};
use crate::metrics;

use super::FrontError;
use super::lean::LeanPath;
use super::signed::Signature;

/// The S3 front: the lean path for the common request (`s3::lean`), else s3s, called with
/// what authentication needs of each request besides its access key (s3s asks for a secret by
/// access key alone).
#[derive(Clone)]
pub struct Service {
    pub(super) inner: S3Service,
    pub(super) lean: Option<Arc<LeanPath>>,
    pub(super) front: Arc<super::Front>,
    /// The region named to a client that signed for none (`upstream.region`).
    pub(super) region: String,
}

impl Service {
    pub async fn call(&self, mut req: http::Request<Body>) -> Result<http::Response<Body>, s3s::HttpError> {
        // How the request is signed, told before the library reads anything: it reads a form's
        // fields, and the body of a request signed for `sts`, before it knows who signed, so a
        // body dribbled a byte at a time would hold its connection. fencegate fences no form
        // upload and serves no other service: neither is read.
        let signature = match Signature::of(req.method(), req.uri().query(), req.headers()) {
            Ok(Signature::Form) => Err(FrontError::NotSupported("POST Object (a browser form upload)")),
            Ok(_) if let Some(got) = super::signed::unusable_region(req.uri().query(), req.headers()) => {
                Err(FrontError::WrongRegion { got, expected: self.region.clone() })
            }
            other => other,
        };
        match signature {
            Ok(signature) => drop(req.extensions_mut().insert(signature)),
            Err(error) => {
                metrics::s3_protocol_refusal(error.status().as_u16());
                return Ok(self.front.refuse_http(error));
            }
        }
        let req = match &self.lean {
            Some(lean) => match lean.take(req) {
                Ok(verified) => return Ok(lean.call(verified).await),
                Err(req) => req,
            },
            None => req,
        };
        let signed = Signed {
            session_token: session_token(&req),
            claims: std::sync::Mutex::new(None),
            routed: AtomicBool::new(false),
        };
        // Boxed: the library's future is kilobytes. Inline, it would make this future as large,
        // and with it the slot hyper keeps for the service's future on every open HTTP/1
        // connection, lean or not.
        Box::pin(SIGNED.scope(signed, async {
            let resp = self.inner.call(req).await;
            if !SIGNED.with(|s| s.routed.load(Ordering::Relaxed)) {
                let status = resp.as_ref().map_or(500, |r| r.status().as_u16());
                metrics::s3_protocol_refusal(status);
            }
            resp
        }))
        .await
    }
}

/// What authentication learns of the request being served, on its task.
struct Signed {
    /// `x-amz-security-token` (or `X-Amz-Security-Token` in a presigned URL's query).
    session_token: Option<String>,
    /// The lease credential's claims, set once its secret is known; the signature is verified
    /// before the route reads them.
    claims: std::sync::Mutex<Option<Claims>>,
    /// Set once fencegate's route took the request (after the signature was verified).
    routed: AtomicBool,
}

tokio::task_local! {
    static SIGNED: Signed;
}

fn session_token(req: &http::Request<Body>) -> Option<String> {
    if let Some(value) = req.headers().get(crate::aws::amz::X_AMZ_SECURITY_TOKEN) {
        return value.to_str().ok().map(str::to_owned);
    }
    form_urlencoded::parse(req.uri().query()?.as_bytes())
        .find(|(name, _)| name.eq_ignore_ascii_case("X-Amz-Security-Token"))
        .map(|(_, value)| value.into_owned())
}

/// Marks the request as taken by fencegate's route: its signature was verified.
pub(super) fn routed() {
    let _ = SIGNED.try_with(|s| s.routed.store(true, Ordering::Relaxed));
}

/// The claims of the lease credential that signed the request (verified: the route runs only
/// after the signature check).
pub(super) fn lease_claims() -> Option<Claims> {
    SIGNED.try_with(|s| s.claims.lock().expect("claims lock").take()).ok().flatten()
}

/// The `[[credentials]]` that may sign requests to fencegate, and the lease credentials made
/// from the issuers' secrets.
pub(super) struct Credentials {
    pub(super) fixed: std::collections::HashMap<String, String>,
    pub(super) issuers: Arc<Issuers>,
}

#[async_trait::async_trait]
impl s3s::auth::S3Auth for Credentials {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<s3s::auth::SecretKey> {
        if let Some(secret) = self.fixed.get(access_key) {
            return Ok(secret.clone().into());
        }
        if access_key.starts_with(ACCESS_KEY_PREFIX) {
            let session_token = SIGNED.try_with(|s| s.session_token.clone()).ok().flatten();
            return match self.issuers.secret(access_key, session_token.as_deref()) {
                Ok((secret, claims)) => {
                    let _ = SIGNED.try_with(|s| *s.claims.lock().expect("claims lock") = Some(claims));
                    Ok(secret.into())
                }
                // An issuer that is not (or no longer) configured: a secret nobody has, so the
                // answer is the one of any forged session token and tells nobody which access
                // keys are issuers.
                Err(CredentialError::UnknownIssuer) => Ok(uuid::Uuid::new_v4().simple().to_string().into()),
                Err(error) => {
                    let mut e = s3s::S3Error::with_message(s3s::S3ErrorCode::InvalidToken, error.to_string());
                    e.set_status_code(StatusCode::BAD_REQUEST);
                    Err(e)
                }
            };
        }
        Err(s3s::S3Error::with_message(
            s3s::S3ErrorCode::InvalidAccessKeyId,
            "The AWS access key ID you provided does not exist in fencegate's [[credentials]].",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::future_size;

    #[test]
    fn the_service_future_hyper_keeps_per_connection_stays_small() {
        // hyper keeps a slot for the service's future on every open HTTP/1 connection; inline,
        // the S3 library's path made it 4,280 bytes (docs/perf-log.md, "Futures' sizes").
        let size = future_size(|service: &'static Service, req: http::Request<Body>| service.call(req));
        assert!(size <= 2048, "Service::call's future is {size} bytes");
    }
}
