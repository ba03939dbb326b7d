//! SigV4 signing of request heads, done once per distinct request before the timed run.
//!
//! A SigV4 signature stays valid for 15 minutes and carries no nonce, so a signed head can be
//! replayed as long as the run lasts: the client then costs a header-map clone per request,
//! like wrk replaying a fixed request, and the figures are the server's, not the signer's.
//! Payloads are `UNSIGNED-PAYLOAD`, so one signature is good for any body of the same length.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings, UriPathNormalizationMode,
    sign,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// The development credentials of `config/fencegate.toml`.
pub const ACCESS_KEY_ID: &str = "fencegate-dev";
pub const SECRET_ACCESS_KEY: &str = "fencegate-dev-secret";
pub const REGION: &str = "us-east-1";

pub struct Signer {
    identity: Identity,
    region: String,
    settings: SigningSettings,
    /// All heads signed by one signer share one timestamp: cheaper, and equally valid.
    time: SystemTime,
}

impl Signer {
    pub fn new(access_key_id: &str, secret_access_key: &str, region: &str) -> Self {
        Self::with_session_token(access_key_id, secret_access_key, None, region)
    }

    /// Temporary credentials (lease credentials): every head also carries, and signs,
    /// `x-amz-security-token`.
    pub fn with_session_token(
        access_key_id: &str,
        secret_access_key: &str,
        session_token: Option<String>,
        region: &str,
    ) -> Self {
        let credentials = Credentials::new(access_key_id, secret_access_key, session_token, None, "fencegate-bench");
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        Self { identity: credentials.into(), region: region.to_owned(), settings, time: SystemTime::now() }
    }

    /// The headers of a signed request: `headers` plus `host`, `x-amz-date`,
    /// `x-amz-content-sha256: UNSIGNED-PAYLOAD` and `authorization`.
    pub fn sign(
        &self,
        method: &Method,
        authority: &str,
        path: &str,
        headers: &[(HeaderName, HeaderValue)],
    ) -> anyhow::Result<HeaderMap> {
        let mut req =
            http::Request::builder().method(method.clone()).uri(format!("http://{authority}{path}")).body(())?;
        req.headers_mut().insert(http::header::HOST, HeaderValue::from_str(authority)?);
        for (name, value) in headers {
            req.headers_mut().insert(name.clone(), value.clone());
        }
        let params = v4::SigningParams::builder()
            .identity(&self.identity)
            .region(&self.region)
            .name("s3")
            .time(self.time)
            .settings(self.settings.clone())
            .build()?
            .into();
        let pairs: Vec<(&str, &str)> = req
            .headers()
            .iter()
            .map(|(n, v)| Ok((n.as_str(), v.to_str()?)))
            .collect::<Result<_, http::header::ToStrError>>()?;
        let signable = SignableRequest::new(
            method.as_str(),
            req.uri().to_string(),
            pairs.into_iter(),
            SignableBody::UnsignedPayload,
        )?;
        let (instructions, _signature) = sign(signable, &params)?.into_parts();
        instructions.apply_to_request_http1x(&mut req);
        Ok(req.into_parts().0.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signed head carries what S3 (and fencegate's verifier) wants to see.
    #[test]
    fn signed_heads_carry_the_sigv4_headers() {
        let signer = Signer::new(ACCESS_KEY_ID, SECRET_ACCESS_KEY, REGION);
        let headers = signer
            .sign(
                &Method::PUT,
                "127.0.0.1:9000",
                "/bench/k",
                &[(HeaderName::from_static("fencing-token"), HeaderValue::from(7u64))],
            )
            .unwrap();
        assert_eq!(headers["x-amz-content-sha256"], "UNSIGNED-PAYLOAD");
        assert_eq!(headers["host"], "127.0.0.1:9000");
        assert_eq!(headers["fencing-token"], "7");
        let auth = headers["authorization"].to_str().unwrap();
        assert!(auth.starts_with("AWS4-HMAC-SHA256 Credential=fencegate-dev/"));
        assert!(auth.contains("fencing-token"), "{auth}");
    }
}
