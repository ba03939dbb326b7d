//! An admitted write's calls to the upstream: bounded by the write's deadline, never abandoned
//! once the request may have reached it, and an answer that breaks off leaves the write in
//! flight for the in-flight deadline (`src/fence/outcome.rs`).

use std::sync::Arc;

use http::{HeaderMap, Method};
use s3s::{Body, S3Response};

use super::{Admitted, Ctx};
use crate::config::millis;
use crate::fence::outcome::hold_for;
use crate::fence::{Permit, WriteFailure};
use crate::metrics;
use crate::net::body::{BodyFailure, BodyReport, ForwardBody};
use crate::s3::Request;
use crate::s3::error::FrontError;
use crate::s3::hop::{client_response, read_xml_response, trailer_check, upstream_headers, upstream_request};

/// The body of one upstream call of an admitted write.
pub(super) enum WriteBody {
    /// A [`ForwardBody`]: it marks the write sent when its last chunk goes.
    Streamed(Body),
    /// Already in memory: the write counts as sent before the call starts.
    InMemory(Body),
}

impl Ctx {
    /// One upstream call of an admitted write (`fence::write`).
    pub(super) async fn send_write(
        &self,
        op: &'static str,
        admitted: &Admitted,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: WriteBody,
    ) -> Result<http::Response<Body>, FrontError> {
        let (body, in_hand) = match body {
            WriteBody::Streamed(body) => {
                let empty = http_body::Body::size_hint(&body).exact() == Some(0);
                (body, empty)
            }
            WriteBody::InMemory(body) => (body, true),
        };
        let req = upstream_request(method, path_and_query, headers, body)?;
        let upstream = self.hop.upstream().clone();
        match admitted.call(&self.gate, op, in_hand, async move { upstream.send(req).await }).await {
            Ok(result) => result.map_err(FrontError::Upstream),
            Err(failure) => Err(self.write_error(failure)),
        }
    }

    /// A write that did not commit (or may have, unknown to fencegate), as S3 answers it.
    pub(super) fn write_error(&self, failure: WriteFailure) -> FrontError {
        match failure {
            WriteFailure::Superseded { presented, current } => FrontError::StaleWhileStreaming { presented, current },
            WriteFailure::Deadline { after_ms } => FrontError::WriteDeadline { after_ms },
            WriteFailure::Revoked => FrontError::RegistrationLost,
            WriteFailure::OutcomeUnknown { after_ms } => FrontError::OutcomeUnknown { after_ms },
            WriteFailure::Body(BodyFailure::Checksum(algorithm)) => FrontError::BadDigest { algorithm },
            WriteFailure::Body(BodyFailure::TooLarge) => FrontError::TooLarge {
                bytes: self.limits.body_bytes_max.saturating_add(1),
                max: self.limits.body_bytes_max,
            },
            WriteFailure::Body(BodyFailure::Client | BodyFailure::Cancelled) => FrontError::IncompleteBody,
        }
    }

    /// A fenced write without a store-side precondition (multipart steps, sub-resources): the
    /// gate orders it, and its body is cancellable like any other.
    pub(super) async fn forward_admitted(
        &self,
        request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        Ok(client_response(self.send_admitted(request, &admitted).await?))
    }

    /// [`Self::forward_admitted`], the upstream's answer as it came.
    pub(super) async fn send_admitted(
        &self,
        request: Request,
        admitted: &Admitted,
    ) -> Result<http::Response<Body>, FrontError> {
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.wire);
        let check = trailer_check(&request);
        let (body, report) = ForwardBody::new(request.body, Some(admitted.permit.clone()), check, 0);
        let body = WriteBody::Streamed(Body::http_body(body));
        let result = self.send_write("fenced_write", admitted, request.method, &path, headers, body).await;
        self.settle_body(result, &report, admitted).await
    }

    /// Reads the XML answer of a write (CopyObject, CompleteMultipartUpload, DeleteObjects),
    /// whose `<Error>` body can mean no commit: part of the upstream's answer, so a body that
    /// breaks off or does not come within the request timeout leaves the outcome unknown, and
    /// the write stays in flight for the in-flight deadline (`fence::outcome`).
    pub(super) async fn read_write_xml(
        &self,
        resp: http::Response<Body>,
        permits: &[Arc<Permit>],
    ) -> Result<(http::Response<Body>, bool), FrontError> {
        match tokio::time::timeout(self.hop.request_timeout(), read_xml_response(resp)).await {
            Ok(Ok(read)) => Ok(read),
            failed => {
                metrics::ambiguous_outcome("response_body");
                tracing::warn!(
                    "the upstream's answer to a write broke off: outcome unknown, the write stays in flight"
                );
                hold_for(permits.to_vec(), self.limits.unknown_outcome_hold);
                match failed {
                    Ok(Err(error)) => Err(error),
                    _ => Err(FrontError::OutcomeUnknown { after_ms: millis(self.hop.request_timeout()) }),
                }
            }
        }
    }

    /// Maps what happened to a forwarded body onto the write's outcome.
    pub(super) async fn settle_body(
        &self,
        result: Result<http::Response<Body>, FrontError>,
        report: &BodyReport,
        admitted: &Admitted,
    ) -> Result<http::Response<Body>, FrontError> {
        match admitted.body_failure(&self.gate, report).await {
            Some(failure) => Err(self.write_error(failure)),
            None => result,
        }
    }
}
