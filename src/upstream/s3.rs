//! The S3-compatible upstream: hyper's pooled client, each request re-signed with SigV4 for
//! the upstream's credentials. The body is streamed (`UNSIGNED-PAYLOAD`), never buffered.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings, UriPathNormalizationMode,
    sign,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use s3s::Body;

use super::{Upstream, UpstreamError};
use crate::config::{UpstreamConfig, ms};

pub struct S3Upstream {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    /// `scheme://authority` of the endpoint, without a trailing slash.
    base: String,
    host: http::HeaderValue,
    region: String,
    identity: Identity,
    settings: SigningSettings,
    request_timeout: Duration,
}

impl S3Upstream {
    pub fn new(config: &UpstreamConfig) -> anyhow::Result<Self> {
        let endpoint: http::Uri = config.endpoint.as_deref().expect("validated: upstream.endpoint").parse()?;
        let authority = endpoint.authority().expect("validated: endpoint has an authority").clone();
        let scheme = endpoint.scheme_str().expect("validated: endpoint has a scheme");
        let base = format!("{scheme}://{authority}");

        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(ms(config.connect_timeout_ms)));
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client =
            Client::builder(TokioExecutor::new()).pool_max_idle_per_host(config.idle_connections_max).build(connector);

        let credentials = Credentials::new(
            config.access_key_id.clone().expect("validated: upstream.access_key_id"),
            config.secret_access_key.clone().expect("validated: upstream.secret_access_key"),
            None,
            None,
            "fencegate-config",
        );
        let mut settings = SigningSettings::default();
        // S3 signs the path as sent (single encoding, no dot-segment normalisation).
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;

        Ok(Self {
            client,
            base,
            host: http::HeaderValue::from_str(authority.as_str())?,
            region: config.region.clone(),
            identity: credentials.into(),
            settings,
            request_timeout: ms(config.request_timeout_ms),
        })
    }

    fn sign(&self, req: &mut http::Request<Body>) -> Result<(), UpstreamError> {
        let params = v4::SigningParams::builder()
            .identity(&self.identity)
            .region(&self.region)
            .name("s3")
            .time(SystemTime::now())
            .settings(self.settings.clone())
            .build()
            .map_err(|e| UpstreamError::Sign(Box::new(e)))?
            .into();
        let mut headers = Vec::with_capacity(req.headers().len());
        for (name, value) in req.headers() {
            let value = value.to_str().map_err(|e| UpstreamError::Sign(Box::new(e)))?;
            headers.push((name.as_str(), value));
        }
        let uri = req.uri().to_string();
        let signable =
            SignableRequest::new(req.method().as_str(), uri, headers.into_iter(), SignableBody::UnsignedPayload)
                .map_err(|e| UpstreamError::Sign(Box::new(e)))?;
        let (instructions, _signature) =
            sign(signable, &params).map_err(|e| UpstreamError::Sign(Box::new(e)))?.into_parts();
        instructions.apply_to_request_http1x(req);
        Ok(())
    }
}

#[async_trait]
impl Upstream for S3Upstream {
    async fn send(&self, mut req: http::Request<Body>) -> Result<http::Response<Body>, UpstreamError> {
        let path_and_query = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        *req.uri_mut() =
            format!("{}{}", self.base, path_and_query).parse().map_err(|e| UpstreamError::Sign(Box::new(e)))?;
        req.headers_mut().insert(http::header::HOST, self.host.clone());
        self.sign(&mut req)?;
        let response = tokio::time::timeout(self.request_timeout, self.client.request(req))
            .await
            .map_err(|_| UpstreamError::Timeout { after_ms: self.request_timeout.as_millis() as u64 })?
            .map_err(|e| UpstreamError::Transport(Box::new(e)))?;
        Ok(response.map(Body::from))
    }

    fn kind(&self) -> &'static str {
        "s3"
    }
}
