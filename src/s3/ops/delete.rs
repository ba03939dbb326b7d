//! DeleteObject: conditional on the ETag of the version the token may delete. A DELETE of an
//! object that is not there is answered 204 (as S3 does) without forwarding it: sent without a
//! precondition, it could land after a newer token's write and delete it. DeleteObjects
//! deletes each of its keys this way too (`delete_objects.rs`).

use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, StatusCode};
use s3s::{Body, S3Response};

use super::conditional::{Attempt, Cached, ObjectWrite, Resend, set_precondition};
use super::write::WriteBody;
use super::{Admitted, Ctx, Request, Target};
use crate::s3::classify;
use crate::s3::error::FrontError;
use crate::s3::hop::{client_response, upstream_headers};
use crate::s3::objects::ObjectState;

impl Ctx {
    pub(super) async fn delete_object(
        &self,
        request: Request,
        admitted: Admitted,
    ) -> Result<S3Response<Body>, FrontError> {
        let versioned = classify::query_has(Some(request.query.trim_start_matches('?')), "versionId");
        let path = request.path_and_query();
        let headers = upstream_headers(&request.headers, &self.wire);
        let write = ObjectWrite::of(&request, &admitted)?;
        self.delete_key(&write, versioned, &path, &headers).await
    }

    /// Deletes one object, conditional on the version the token may delete: `path` is what the
    /// upstream is sent (with the version, if `versioned`), `headers` the request's less
    /// fencegate's own.
    pub(super) async fn delete_key(
        &self,
        write: &ObjectWrite<'_>,
        versioned: bool,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<S3Response<Body>, FrontError> {
        // A cached `Absent` is not trusted: another writer may have created the object since.
        let state = self
            .starting_state(write, self.cached_unless_ignored(self.judged.delete_object, Cached::PresentOnly))
            .await?;
        let mut attempts = DeleteAttempts {
            headers,
            versioned,
            path,
            object: &write.object,
            target: write.target,
            admitted: write.admitted,
        };
        self.conditional_write(write, state, &mut attempts).await
    }

    /// The upstream's answer if the target's bucket does not exist (a bounded `HEAD /bucket`).
    async fn missing_bucket(&self, target: &Target) -> Result<Option<http::Response<Body>>, FrontError> {
        let Some(bucket) = &target.bucket else { return Ok(None) };
        let path = format!("/{}", crate::net::percent::encode_key(bucket));
        let resp = self.hop.send("bucket_head", Method::HEAD, &path, HeaderMap::new(), Body::empty()).await?;
        if resp.status() != StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let error = s3s::S3Error::with_message(s3s::S3ErrorCode::NoSuchBucket, "The specified bucket does not exist");
        let resp = error
            .to_http_response()
            .map_err(|_| FrontError::UpstreamStatus { step: "the bucket head read", status: StatusCode::NOT_FOUND })?;
        Ok(Some(resp.map(Body::from)))
    }
}

/// DeleteObject's attempts, each conditional on the version the token may delete.
struct DeleteAttempts<'a> {
    headers: &'a HeaderMap,
    /// A version id names its own object version; the upstream decides.
    versioned: bool,
    path: &'a str,
    object: &'a str,
    target: &'a Target,
    admitted: &'a Admitted,
}

impl Resend for DeleteAttempts<'_> {
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>> {
        Box::pin(async move {
            let Self { headers, versioned, path, object, target, admitted } = *self;
            let empty = || WriteBody::InMemory(Body::empty());
            let mut headers = headers.clone();
            let ObjectState::Present { .. } = &state else {
                if versioned {
                    headers.remove(http::header::IF_MATCH);
                    headers.remove(http::header::IF_NONE_MATCH);
                    let resp =
                        ctx.send_write("delete_object", admitted, Method::DELETE, path, headers, empty()).await?;
                    return Ok(Attempt::Final(client_response(resp)));
                }
                // A missing bucket is the upstream's 404 too: S3 answers NoSuchBucket for it.
                if let Some(missing) = ctx.missing_bucket(target).await? {
                    return Ok(Attempt::Final(client_response(missing)));
                }
                ctx.etags.put(object.to_owned(), ObjectState::Absent);
                return Ok(Attempt::Final(no_content()));
            };
            set_precondition(&mut headers, &state);
            let resp = ctx.send_write("delete_object", admitted, Method::DELETE, path, headers, empty()).await?;
            if !resp.status().is_success() {
                // A version the request names is judged by the upstream too.
                return Ok(if versioned { Attempt::NotCommittedJudgedMore(resp) } else { Attempt::NotCommitted(resp) });
            }
            ctx.etags.put(object.to_owned(), ObjectState::Absent);
            Ok(Attempt::Committed(client_response(resp)))
        })
    }
}

/// What S3 answers to a DELETE: 204 with no body.
fn no_content() -> S3Response<Body> {
    let mut resp = S3Response::new(Body::empty());
    resp.status = Some(StatusCode::NO_CONTENT);
    resp
}
