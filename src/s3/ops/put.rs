//! PutObject: stamped with the writer's token and conditional on the object's last known
//! state; a body small enough to keep (`fencing.retry_body_bytes_max`) is retained while it
//! streams, so the write can go once more after a same-or-older token's writer changed the
//! object under it.

use futures_util::future::BoxFuture;
use http::{HeaderMap, Method};
use s3s::{Body, S3Response};

use super::conditional::{Attempt, Cached, ObjectWrite, Resend, set_precondition};
use super::write::WriteBody;
use super::{Admitted, Ctx, Request, stamp};
use crate::net::body::{BodyReport, ForwardBody};
use crate::s3::error::FrontError;
use crate::s3::hop::{client_response, trailer_check, upstream_headers};
use crate::s3::objects::ObjectState;

impl Ctx {
    pub(super) async fn put_object(
        &self,
        mut request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        let retainable = request.content_length.is_some_and(|n| n <= self.limits.retry_body_bytes_max as u64);
        let path = request.path_and_query();
        stamp(&mut request.headers, admitted.token);
        // The first attempt takes these; a retry makes them again from the request.
        let prepared = Some(upstream_headers(&request.headers, &self.wire));
        let check = trailer_check(&request);
        let retain = if retainable { self.limits.retry_body_bytes_max } else { 0 };
        let body = std::mem::take(&mut request.body);
        let (body, report) = ForwardBody::new(body, Some(admitted.permit.clone()), check, retain);
        let first = Some(Body::http_body(body));
        let write = ObjectWrite::of(&request, &admitted)?;
        // A body that cannot be sent twice starts from a fresh read: a stale cache would cost
        // the write itself.
        let cached = if retainable { Cached::Any } else { Cached::Never };
        let state = self.starting_state(&write, cached).await?;
        let mut attempts = PutAttempts {
            first,
            prepared,
            client_headers: &request.headers,
            path: &path,
            report: &report,
            object: &write.object,
            admitted: &admitted,
        };
        self.conditional_write(&write, state, &mut attempts).await
    }
}

/// PutObject's attempts: the body as it streams the first time, the chunks retained of it after.
struct PutAttempts<'a> {
    /// The first attempt's body and headers; a retry makes its headers again from the request.
    first: Option<Body>,
    prepared: Option<HeaderMap>,
    client_headers: &'a HeaderMap,
    path: &'a str,
    report: &'a BodyReport,
    object: &'a str,
    admitted: &'a Admitted,
}

impl Resend for PutAttempts<'_> {
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>> {
        let streamed = self.first.take();
        let headers = self.prepared.take();
        Box::pin(async move {
            let Self { client_headers, path, report, object, admitted, .. } = *self;
            let mut headers = headers.unwrap_or_else(|| upstream_headers(client_headers, &ctx.wire));
            set_precondition(&mut headers, &state);
            let resp = match streamed {
                Some(body) => {
                    let body = WriteBody::Streamed(body);
                    let result = ctx.send_write("put_object", admitted, Method::PUT, path, headers, body).await;
                    ctx.settle_body(result, report, admitted).await?
                }
                None => {
                    let Some(chunks) = report.retained() else { return Ok(Attempt::CannotResend) };
                    let body = Body::http_body(http_body_util::StreamBody::new(futures_util::stream::iter(
                        chunks.into_iter().map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(c))),
                    )));
                    let body = WriteBody::InMemory(body);
                    ctx.send_write("put_object", admitted, Method::PUT, path, headers, body).await?
                }
            };
            if !resp.status().is_success() {
                return Ok(Attempt::NotCommitted(resp));
            }
            ctx.remember_write(object.to_owned(), resp.headers(), admitted.token);
            Ok(Attempt::Committed(client_response(resp)))
        })
    }
}
