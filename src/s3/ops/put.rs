//! PutObject: stamped with the writer's token and conditional on the object's last known
//! state; a body small enough to keep (`fencing.retry_body_bytes_max`) is retained while it
//! streams, so the write can go once more after a same-or-older token's writer changed the
//! object under it.

use http::Method;
use s3s::{Body, S3Response};

use super::conditional::{Attempt, Cached, ObjectWrite, set_precondition};
use super::write::WriteBody;
use super::{Admitted, Ctx, Request, stamp};
use crate::net::body::ForwardBody;
use crate::s3::error::FrontError;
use crate::s3::hop::{client_response, trailer_check, upstream_headers};

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
        let mut prepared = Some(upstream_headers(&request.headers, &self.wire));
        let check = trailer_check(&request);
        let retain = if retainable { self.limits.retry_body_bytes_max } else { 0 };
        let body = std::mem::take(&mut request.body);
        let (body, report) = ForwardBody::new(body, Some(admitted.permit.clone()), check, retain);
        let mut first = Some(Body::http_body(body));
        let write = ObjectWrite::of(&request, &admitted)?;
        // A body that cannot be sent twice starts from a fresh read: a stale cache would cost
        // the write itself.
        let cached = if retainable { Cached::Any } else { Cached::Never };
        let (client_headers, path, report, object, admitted) =
            (&request.headers, &path, &report, &write.object, &admitted);
        let state = self.starting_state(&write, cached).await?;
        self.conditional_write(&write, state, move |state| {
            let streamed = first.take();
            let headers = prepared.take();
            Box::pin(async move {
                let mut headers = headers.unwrap_or_else(|| upstream_headers(client_headers, &self.wire));
                set_precondition(&mut headers, &state);
                let resp = match streamed {
                    Some(body) => {
                        let body = WriteBody::Streamed(body);
                        let result = self.send_write("put_object", admitted, Method::PUT, path, headers, body).await;
                        self.settle_body(result, report, admitted).await?
                    }
                    None => {
                        let Some(chunks) = report.retained() else { return Ok(Attempt::CannotResend) };
                        let body = Body::http_body(http_body_util::StreamBody::new(futures_util::stream::iter(
                            chunks.into_iter().map(|c| Ok::<_, std::convert::Infallible>(http_body::Frame::data(c))),
                        )));
                        let body = WriteBody::InMemory(body);
                        self.send_write("put_object", admitted, Method::PUT, path, headers, body).await?
                    }
                };
                if !resp.status().is_success() {
                    return Ok(Attempt::NotCommitted(resp));
                }
                self.remember_write(object.clone(), resp.headers(), admitted.token);
                Ok(Attempt::Committed(client_response(resp)))
            })
        })
        .await
    }
}
