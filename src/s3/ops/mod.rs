//! The fenced S3 writes as commands. A fenced request is parsed once into a [`FencedOp`] that
//! owns its data, with its operation's own checks in the parse; the front admits it
//! (`super::Front::route_write`), then [`FencedOp::apply`] runs it over [`Ctx`], the narrow
//! context every operation shares: the gate, the hop to the upstream, the ETag cache, the wire
//! contract and the limits.
//!
//! One file per operation, each around the one conditional write of `conditional.rs`: `put.rs`,
//! `copy.rs`, `delete.rs`, `multipart.rs` (the completion, and the upload-to-key check),
//! `uploads.rs` (the creation, and the records that leave no upload behind), and
//! `delete_objects.rs`, whose keys are fenced each on its own resource. `write.rs` is an
//! admitted write's calls to the upstream.

mod conditional;
mod copy;
mod delete;
mod delete_objects;
mod multipart;
mod put;
mod uploads;
mod write;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use s3s::{Body, S3Response};

use self::conditional::Cached;
use self::copy::copies_onto_itself_unchanged;
pub(super) use self::delete_objects::Batch;
use self::uploads::upload_of;
pub use self::uploads::{abort_upload, forget_upload};
use super::error::FrontError;
use super::hop::Hop;
use super::objects::EtagCache;
use super::{Op, Request, Target, WireContract, wire};
use crate::fence::{Clock, FenceToken, FencedWrite, Gate, ResourceKey};
use crate::refusal::Refusal;
use crate::upstream::Enforcement;

/// A write that the gate admitted (`fence::write`).
pub(super) type Admitted = FencedWrite;

/// What every fenced operation runs over.
pub(super) struct Ctx {
    pub(super) gate: Arc<Gate>,
    /// Every call to the upstream outside an admitted write's own (`write.rs`).
    pub(super) hop: Hop,
    pub(super) wire: WireContract,
    /// The last known state of recently written objects: a write's precondition without a read.
    pub(super) etags: EtagCache,
    pub(super) limits: Limits,
    /// What the upstream judges (the probe): a write whose precondition it ignores starts from
    /// a fresh read of the object, never from the ETag cache, since that read is then the only
    /// check of the object's stamp (G4); an upload id it does not tie to its key is checked
    /// against the key before each multipart step.
    pub(super) judged: Enforcement,
    /// CopyObject as a read of the source and a conditional PUT (see `super::service`).
    pub(super) copy_by_read_and_put: bool,
    /// The clock upload records are dated by (the lease service's).
    pub(super) clock: Arc<dyn Clock>,
}

/// The bounds an operation works within.
pub(super) struct Limits {
    /// `server.body_bytes_max`.
    pub(super) body_bytes_max: u64,
    /// `fencing.retry_body_bytes_max`: a body this small is kept, so its write can go twice.
    pub(super) retry_body_bytes_max: usize,
    /// How long a write whose outcome is unknown stays in flight (`fencing.inflight_deadline_ms`).
    pub(super) unknown_outcome_hold: Duration,
    /// How long after its creation an upload takes parts and its completion: then the sweep
    /// aborts it (`fencing.abort_uploads_after_ms`), with none of them in flight.
    pub(super) uploads_open_for: Duration,
}

/// An upload a multipart step names: its bucket and id.
type Upload = Option<(String, String)>;

/// A fenced write to one object, parsed.
pub(super) enum FencedOp {
    Put(Request),
    Copy(Request),
    Delete(Request),
    /// CreateMultipartUpload.
    Create(Request),
    /// UploadPart, UploadPartCopy.
    Part {
        request: Request,
        upload: Upload,
    },
    Complete {
        request: Request,
        upload: Upload,
    },
    Abort {
        request: Request,
        upload: Upload,
    },
    /// Tagging, ACL, retention, legal hold of `object` (`bucket/key`).
    Subresource {
        request: Request,
        object: String,
    },
}

impl FencedOp {
    /// The command `op` names, with what S3 refuses of it refused here. Not DeleteObjects,
    /// whose keys are fenced one by one (`delete_objects.rs`).
    pub(super) fn parse(op: Op, request: Request) -> Result<Self, FrontError> {
        if op == Op::PostObject {
            return Err(FrontError::NotSupported("POST Object (a browser form upload)"));
        }
        if request.target.bucket.is_none() || request.target.key.is_none() {
            return Err(FrontError::NotSupported("a write without an object key"));
        }
        Ok(match op {
            Op::PutObject => Self::Put(request),
            Op::CopyObject => Self::Copy(request),
            Op::DeleteObject => Self::Delete(request),
            Op::CreateMultipartUpload => Self::Create(request),
            Op::UploadPart | Op::UploadPartCopy => Self::Part { upload: upload_of(&request), request },
            Op::CompleteMultipartUpload => Self::Complete { upload: upload_of(&request), request },
            Op::AbortMultipartUpload => Self::Abort { upload: upload_of(&request), request },
            Op::ObjectSubresourceWrite => {
                let object =
                    request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
                Self::Subresource { request, object }
            }
            Op::DeleteObjects | Op::PostObject | Op::PassThrough => {
                return Err(FrontError::NotSupported("this operation as a write to one object"));
            }
        })
    }

    pub(super) fn request(&self) -> &Request {
        match self {
            Self::Put(request) | Self::Copy(request) | Self::Delete(request) | Self::Create(request) => request,
            Self::Part { request, .. }
            | Self::Complete { request, .. }
            | Self::Abort { request, .. }
            | Self::Subresource { request, .. } => request,
        }
    }

    /// What S3 refuses of this request once its resource is named: a copy onto itself that
    /// changes nothing (fencegate's stamp would make it a change; S3 refuses it, and so does
    /// fencegate).
    pub(super) fn check(&self) -> Result<(), FrontError> {
        match self {
            Self::Copy(request) if copies_onto_itself_unchanged(&request.target, &request.headers) => {
                Err(FrontError::SelfCopyUnchanged)
            }
            _ => Ok(()),
        }
    }

    /// A step of an existing upload (a part, the completion, the abort): [`Self::prepare`] has
    /// checks to make before admission.
    pub(super) fn uses_an_upload(&self) -> bool {
        matches!(self, Self::Part { .. } | Self::Complete { .. } | Self::Abort { .. })
    }

    /// What is checked of an upload's step before admission on `resource`, at the upstream and
    /// in the store. Its upload must be its key's (unless the upstream ties ids to keys
    /// itself). A completion's parts list is read now: a client that sends it slowly must not
    /// hold a write that is past cancelling; a stale completion is refused before it is read.
    pub(super) async fn prepare(
        &mut self,
        ctx: &Ctx,
        resource: &ResourceKey,
        token: FenceToken,
    ) -> Result<(), FrontError> {
        let (Self::Part { request, .. } | Self::Complete { request, .. } | Self::Abort { request, .. }) = self else {
            return Ok(());
        };
        if !ctx.judged.upload_ids_tied_to_keys {
            ctx.check_upload_key(&request.target, Some(request.query.trim_start_matches('?'))).await?;
        }
        if let Self::Complete { request, .. } = self {
            let fence = ctx.gate.fence(resource).await.map_err(Refusal::StoreUnavailable)?;
            if let Some(current) = crate::fence::stale_below(fence, token) {
                return Err(Refusal::Stale { presented: token, current }.into());
            }
            let parts =
                http_body_util::Limited::new(std::mem::take(&mut request.body), multipart::COMPLETE_REQUEST_BYTES_MAX)
                    .collect()
                    .await
                    .map_err(|_| FrontError::IncompleteBody)?
                    .to_bytes();
            request.body = Body::from(parts);
        }
        Ok(())
    }

    /// Runs the admitted command.
    pub(super) async fn apply(self, ctx: &Ctx, admitted: Admitted) -> Result<S3Response<Body>, FrontError> {
        match self {
            Self::Put(request) => ctx.put_object(request, admitted).await,
            // Boxed: the largest of these futures, which would make every write's as large.
            Self::Copy(request) => Box::pin(ctx.copy_object(request, admitted)).await,
            Self::Delete(request) => ctx.delete_object(request, admitted).await,
            Self::Create(mut request) => {
                stamp(&mut request.headers, admitted.token);
                ctx.create_multipart(request, admitted).await
            }
            Self::Part { request, upload } => {
                ctx.take_over_upload(&request, upload.as_ref(), &admitted).await?;
                ctx.forward_admitted(request, admitted).await
            }
            Self::Complete { request, upload } => {
                ctx.take_over_upload(&request, upload.as_ref(), &admitted).await?;
                let resp = ctx.complete_multipart(request, admitted).await?;
                ctx.forget_ended(upload, &resp).await;
                Ok(resp)
            }
            Self::Abort { request, upload } => {
                let resp = ctx.forward_admitted(request, admitted).await?;
                ctx.forget_ended(upload, &resp).await;
                Ok(resp)
            }
            Self::Subresource { request, object } => {
                // They change the object: refused by a newer stamp like any other write (G4).
                // The upstream judges no precondition on them: only a fresh read sees the stamp.
                ctx.object_state(&request.target, &object, Cached::Never, &admitted).await?;
                ctx.forward_admitted(request, admitted).await
            }
        }
    }
}

/// The stamp every object write carries (G4).
pub(super) fn stamp(headers: &mut HeaderMap, token: FenceToken) {
    headers.insert(wire::METADATA_TOKEN, HeaderValue::from(token.0));
}
