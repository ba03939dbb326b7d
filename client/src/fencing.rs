//! Fencing for aws-sdk-s3: an interceptor that puts the live lease's token and resource on
//! every request of an SDK client, just before it is signed (so both headers are signed, and
//! every retry carries the token of the lease current at that attempt).

use std::sync::{Arc, RwLock};

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::interceptors::context::BeforeTransmitInterceptorContextMut;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;

use crate::lease::{Lease, Shared};

/// fencegate's default header names (`fencing.token_header`, `fencing.resource_header`).
pub const TOKEN_HEADER: &str = "fencing-token";
pub const RESOURCE_HEADER: &str = "fencing-resource";

/// Attaches `Fencing-Token` and `Fencing-Resource` of the current lease to every request.
///
/// ```no_run
/// # async fn example(client: fencegate_client::LeaseClient, s3: aws_sdk_s3::Config) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// let lease = client.acquire("job:invoices", "worker-1", Duration::from_secs(10)).await?;
/// let fencing = fencegate_client::FencingInterceptor::for_lease(&lease);
/// let s3 = aws_sdk_s3::Client::from_conf(s3.to_builder().interceptor(fencing.clone()).build());
/// # Ok(()) }
/// ```
///
/// Clones share the current lease: after acquiring a new lease, [`FencingInterceptor::set`]
/// on any clone switches every client that carries it. Without a lease nothing is attached
/// (fencegate then answers a write with 428 `FencingTokenRequired`).
#[derive(Clone, Debug)]
pub struct FencingInterceptor {
    current: Arc<RwLock<Option<Arc<Shared>>>>,
    token_header: &'static str,
    resource_header: &'static str,
    refuse_when_lost: bool,
}

impl Default for FencingInterceptor {
    fn default() -> Self {
        Self {
            current: Arc::default(),
            token_header: TOKEN_HEADER,
            resource_header: RESOURCE_HEADER,
            refuse_when_lost: false,
        }
    }
}

/// A request was not sent because the lease is known to be lost (with `refuse_when_lost`).
#[derive(Debug, thiserror::Error)]
#[error("lease {name} (token {token}) is no longer held; the request was not sent")]
pub struct LeaseLostError {
    pub name: String,
    pub token: u64,
}

impl FencingInterceptor {
    /// An interceptor without a lease yet; see [`Self::set`].
    pub fn new() -> Self {
        Self::default()
    }

    pub fn for_lease(lease: &Lease) -> Self {
        let interceptor = Self::new();
        interceptor.set(lease);
        interceptor
    }

    /// Fences every later request with `lease`.
    pub fn set(&self, lease: &Lease) {
        *self.current.write().expect("interceptor lock") = Some(lease.shared().clone());
    }

    /// Stops attaching a token.
    pub fn clear(&self) {
        *self.current.write().expect("interceptor lock") = None;
    }

    /// Header names other than fencegate's defaults, when its config changed them.
    pub fn with_headers(mut self, token_header: &'static str, resource_header: &'static str) -> Self {
        self.token_header = token_header;
        self.resource_header = resource_header;
        self
    }

    /// Fail requests locally once the lease is known lost, instead of sending them for
    /// fencegate to judge. Off by default: a write with a superseded token is refused by
    /// fencegate anyway, and one whose lease merely timed out with nobody newer is safe.
    pub fn refuse_when_lost(mut self, refuse: bool) -> Self {
        self.refuse_when_lost = refuse;
        self
    }
}

impl Intercept for FencingInterceptor {
    fn name(&self) -> &'static str {
        "FencingInterceptor"
    }

    fn modify_before_signing(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _runtime_components: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(lease) = self.current.read().expect("interceptor lock").clone() else {
            return Ok(());
        };
        // Raises the lost signal now if the deadline passed while nobody looked.
        let held = lease.check();
        if !held && self.refuse_when_lost {
            return Err(Box::new(LeaseLostError { name: lease.name.clone(), token: lease.token.0 }));
        }
        let headers = context.request_mut().headers_mut();
        headers.try_insert(self.token_header, lease.token.0.to_string())?;
        headers.try_insert(self.resource_header, lease.name.clone())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
    use aws_smithy_runtime_api::client::http::{
        HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpConnector,
    };
    use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
    use aws_smithy_types::body::SdkBody;
    use tokio::time::Instant;

    use super::*;
    use crate::api::{FencingToken, Grant, LeaseError};
    use crate::lease::{BoxFuture, LeaseOptions, Transport};

    /// The headers of each request sent, in order.
    type Requests = Arc<Mutex<Vec<Vec<(String, String)>>>>;

    /// Answers every request with 200 and keeps the headers it saw.
    #[derive(Debug, Clone, Default)]
    struct Capture(Requests);

    impl HttpConnector for Capture {
        fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
            let headers = request.headers().iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
            self.0.lock().unwrap().push(headers);
            HttpConnectorFuture::ready(Ok(HttpResponse::new(200.try_into().unwrap(), SdkBody::empty())))
        }
    }

    impl HttpClient for Capture {
        fn http_connector(&self, _: &HttpConnectorSettings, _: &RuntimeComponents) -> SharedHttpConnector {
            SharedHttpConnector::new(self.clone())
        }
    }

    impl Capture {
        fn header(&self, request: usize, name: &str) -> Option<String> {
            self.0.lock().unwrap()[request].iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
        }

        fn signed_headers(&self, request: usize) -> String {
            self.header(request, "authorization").unwrap_or_default()
        }
    }

    /// Renewals always succeed.
    struct AlwaysRenews;

    impl Transport for AlwaysRenews {
        fn renew<'a>(&'a self, name: &'a str, lease_id: &'a str) -> BoxFuture<'a, Result<Grant, LeaseError>> {
            Box::pin(async move { Ok(grant(name, lease_id, 7)) })
        }
        fn release<'a>(&'a self, _: &'a str, _: &'a str) -> BoxFuture<'a, Result<(), LeaseError>> {
            Box::pin(async { Ok(()) })
        }
    }

    fn grant(name: &str, lease_id: &str, token: u64) -> Grant {
        Grant {
            name: name.into(),
            holder: "w".into(),
            lease_id: lease_id.into(),
            token: FencingToken(token),
            ttl_ms: 900,
            credentials: None,
        }
    }

    fn lease(name: &str, token: u64) -> Lease {
        let timing = LeaseOptions::default().timing(Duration::from_millis(900)).unwrap();
        Lease::start(Arc::new(AlwaysRenews), grant(name, "id", token), Instant::now(), timing)
    }

    fn s3(capture: &Capture, fencing: FencingInterceptor) -> aws_sdk_s3::Client {
        let config = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .endpoint_url("http://127.0.0.1:1")
            .force_path_style(true)
            .credentials_provider(Credentials::new("a", "b", None, None, "test"))
            .http_client(capture.clone())
            .interceptor(fencing)
            .build();
        aws_sdk_s3::Client::from_conf(config)
    }

    /// Every request carries the current lease's token and resource, signed; switching the
    /// lease switches the headers; without a lease nothing is attached.
    #[tokio::test]
    async fn every_request_carries_the_current_lease() {
        let capture = Capture::default();
        let fencing = FencingInterceptor::new();
        let s3 = s3(&capture, fencing.clone());

        s3.put_object().bucket("b").key("k").send().await.unwrap();
        assert_eq!(capture.header(0, TOKEN_HEADER), None);

        let first = lease("job:a", 7);
        fencing.set(&first);
        s3.put_object().bucket("b").key("k").send().await.unwrap();
        s3.get_object().bucket("b").key("k").send().await.unwrap();
        for request in [1, 2] {
            assert_eq!(capture.header(request, TOKEN_HEADER).as_deref(), Some("7"));
            assert_eq!(capture.header(request, RESOURCE_HEADER).as_deref(), Some("job:a"));
            let signed = capture.signed_headers(request);
            assert!(signed.contains("fencing-resource;fencing-token"), "headers are signed: {signed}");
        }

        let second = lease("job:a", 9);
        fencing.set(&second);
        s3.put_object().bucket("b").key("k").send().await.unwrap();
        assert_eq!(capture.header(3, TOKEN_HEADER).as_deref(), Some("9"));

        fencing.clear();
        s3.put_object().bucket("b").key("k").send().await.unwrap();
        assert_eq!(capture.header(4, TOKEN_HEADER), None);
    }

    /// A lost lease still fences by default (fencegate judges), or fails locally when asked.
    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_is_sent_for_judgement_or_refused_locally() {
        let capture = Capture::default();
        let held = lease("job:b", 3);
        let lost = held.lost();
        // Freeze the heartbeat's view: only the interceptor's check can notice the deadline.
        tokio::time::advance(Duration::from_millis(1000)).await;

        let judged = s3(&capture, FencingInterceptor::for_lease(&held));
        judged.put_object().bucket("b").key("k").send().await.unwrap();
        assert_eq!(capture.header(0, TOKEN_HEADER).as_deref(), Some("3"));
        assert!(lost.is_cancelled(), "the interceptor's check raised the loss");

        let refusing = s3(&capture, FencingInterceptor::for_lease(&held).refuse_when_lost(true));
        let err = refusing.put_object().bucket("b").key("k").send().await.unwrap_err();
        assert!(format!("{:?}", err).contains("LeaseLostError"), "{err:?}");
        assert_eq!(capture.0.lock().unwrap().len(), 1, "the refused request was not sent");
    }
}
