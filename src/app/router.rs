//! The main listener's one router: it owns the precedence of everything served there.
//!
//! 1. `[[routes]]` prefixes, to third-party APIs (config refuses one under `/_fencegate/`);
//! 2. fencegate's own endpoints under `/_fencegate/v1/` (leases, fence registrations), which
//!    s3s authenticates like any S3 request and `FencegateRoute` (s3/service.rs) takes
//!    before S3;
//! 3. S3.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use hyper::body::Incoming;

use crate::gateway::Gateway;
use crate::net::request_body;

pub struct Router {
    gateway: Arc<Gateway>,
    s3: crate::s3::Service,
}

impl Router {
    pub fn new(gateway: Arc<Gateway>, s3: crate::s3::Service) -> Self {
        Self { gateway, s3 }
    }

    pub async fn handle(
        self: Arc<Self>,
        req: http::Request<Incoming>,
    ) -> Result<http::Response<s3s::Body>, s3s::HttpError> {
        if self.gateway.takes(req.uri().path()) {
            return Ok(self.gateway.clone().handle(req).await);
        }
        let expect_continue =
            req.headers().get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let content_length =
            req.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        let (parts, body) = req.into_parts();
        let (body, polled) = request_body::RequestBody::new(body, expect_continue);
        let req = http::Request::from_parts(parts, s3s::Body::http_body_unsync(body));
        let mut resp = self.s3.call(req).await?;
        // A rejection answered before the body was read leaves the body unread on the
        // connection: it is closed rather than read through.
        if request_body::answered_early(expect_continue, polled.load(Ordering::Relaxed), content_length) {
            resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        Ok(resp)
    }
}
