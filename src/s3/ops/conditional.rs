//! The conditional object write, once for every operation that replaces or removes an object
//! (PutObject, CopyObject, DeleteObject, CompleteMultipartUpload): fencegate's own precondition
//! names the object's last known state, so a write that lands after a newer token's is refused
//! by the upstream itself (G4, docs/design.md "The commit protocol"). When the upstream refuses
//! that precondition, the object is read again, and the write is sent once more only when a
//! same-or-older token's writer changed it meanwhile.

use futures_util::future::BoxFuture;
use http::{HeaderMap, StatusCode};
use s3s::{Body, S3Response};

use super::{Admitted, Ctx, Request, Target};
use crate::fence::FenceToken;
use crate::metrics;
use crate::refusal::Refusal;
use crate::s3::error::FrontError;
use crate::s3::hop::client_response;
use crate::s3::objects::{ClientCondition, ConditionFailed, ObjectState};
use crate::upstream::EtagForm;

/// Attempts of one conditional write: the first, and one more after a same-or-older token's
/// writer changed the object under it.
const ATTEMPTS: u32 = 2;

/// An admitted write to one object, with the client's own condition on it.
pub(super) struct ObjectWrite<'a> {
    pub(super) target: &'a Target,
    /// `bucket/key`, the ETag cache's name for it.
    pub(super) object: String,
    pub(super) condition: ClientCondition,
    pub(super) admitted: &'a Admitted,
    /// The request's headers, as the client sent them.
    headers: &'a HeaderMap,
}

impl<'a> ObjectWrite<'a> {
    /// The request's object and the client's condition on it.
    pub(super) fn of(request: &'a Request, admitted: &'a Admitted) -> Result<Self, FrontError> {
        let object = request.target.object_name().ok_or(FrontError::NotSupported("a write without an object key"))?;
        Ok(Self::for_key(&request.target, object, ClientCondition::of(&request.headers), admitted, &request.headers))
    }

    /// A write to `object` (`bucket/key`) at `target`, which need not be the request's (each
    /// key of a DeleteObjects), under the client's `condition` on it; `headers` are what the
    /// upstream judges besides the condition.
    pub(super) fn for_key(
        target: &'a Target,
        object: String,
        condition: ClientCondition,
        admitted: &'a Admitted,
        headers: &'a HeaderMap,
    ) -> Self {
        Self { target, object, condition, admitted, headers }
    }

    /// Whether the request carries a condition that the upstream judges and that fencegate's
    /// precondition does not carry (`If-Unmodified-Since`, `x-amz-if-match-size`, ...): a 412
    /// may be that condition's.
    fn other_conditions(&self) -> bool {
        self.headers.keys().any(|name| {
            let name = name.as_str();
            (name.starts_with("if-") && name != "if-match" && name != "if-none-match") || name.starts_with("x-amz-if-")
        })
    }
}

/// Where a conditional write's attempts come from: each operation's own (its headers, its body
/// or how to read it again), made on the state [`Ctx::conditional_write`] gives it.
///
/// An attempt is a boxed future: the write runs detached, so its future must be `Send`, which
/// the compiler cannot yet prove through an `async fn` of a trait.
pub(super) trait Resend: Send {
    /// One attempt on `state`: fencegate's precondition put on that state ([`set_precondition`]:
    /// the client's own condition was judged on it, so the upstream enforces both at once),
    /// what a committed write changed remembered, and what came of it ([`Attempt`]).
    fn attempt<'s>(&'s mut self, ctx: &'s Ctx, state: ObjectState) -> BoxFuture<'s, Result<Attempt, FrontError>>;
}

/// Which cached state a write may start from; any other is read from the upstream.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Cached {
    /// Any cached state.
    Any,
    /// Only a cached `Present`: a cached `Absent` may be stale for a write that would then
    /// not be sent at all (a DELETE of a missing object is answered without one).
    PresentOnly,
    /// None: the write cannot be sent twice, so it starts from a fresh read.
    Never,
}

/// What one attempt of a conditional write came to.
pub(super) enum Attempt {
    /// Committed, and what it changed is remembered in the ETag cache: the client's answer.
    Committed(S3Response<Body>),
    /// The upstream did not commit it: its answer as it came, which may be a refused
    /// precondition.
    NotCommitted(http::Response<Body>),
    /// Not committed, by an upstream that judged more than fencegate's precondition (a copy's
    /// source conditions, a version the request names): a 412 on an object that did not change
    /// may be about that, and is then the client's answer.
    NotCommittedJudgedMore(http::Response<Body>),
    /// The client's answer as it is: no precondition to judge, nothing to count (a DELETE of
    /// an object that is not there, a versioned DELETE, a copy source that cannot be read).
    Final(S3Response<Body>),
    /// A retry is due but the write cannot be sent again (its body was not retained). Only a
    /// second attempt returns it.
    CannotResend,
}

impl Ctx {
    /// Learns the ETag form from a refusal: an upstream sent quoted ETags that refused one
    /// naming an unchanged object twice is sent bare ones (`undo`: back to quoted, when the
    /// bare one was refused too). Whether the form changed.
    fn try_other_etag_form(&self, undo: bool) -> bool {
        let (from, to) = if undo { (EtagForm::Bare, EtagForm::Quoted) } else { (EtagForm::Quoted, EtagForm::Bare) };
        if self.hop.upstream().etag_form() != from {
            return false;
        }
        self.hop.upstream().use_etag_form(to);
        let changed = self.hop.upstream().etag_form() == to;
        if changed && !undo {
            tracing::warn!(
                "the upstream refused a quoted ETag naming an unchanged object twice: sending bare ETags from now on \
                 (the start-up probe finds the form; it did not run)"
            );
        }
        changed
    }

    /// `cached` for an operation whose precondition the upstream judges (`judged`), else none:
    /// the upstream refuses a write that started from a stale cached state only when it judges
    /// the precondition; otherwise the fresh read is the only check of a newer stamp (G4).
    pub(super) fn cached_unless_ignored(&self, judged: bool, cached: Cached) -> Cached {
        if judged { cached } else { Cached::Never }
    }

    /// The state a conditional write starts from (`cached` says which cached state will do),
    /// with its stamp and the client's condition checked on it.
    pub(super) async fn starting_state(
        &self,
        write: &ObjectWrite<'_>,
        cached: Cached,
    ) -> Result<ObjectState, FrontError> {
        let state = self.object_state(write.target, &write.object, cached, write.admitted).await?;
        self.client_condition(&write.condition, write.target, &write.object, state, write.admitted).await
    }

    /// Runs a conditional write from `state` (see [`Self::starting_state`]), its attempts made
    /// by `source` ([`Resend`]). After a refused precondition the object is read again:
    /// a newer stamp makes the write stale (409), a failed client condition is the client's
    /// answer (412 or 404), an unchanged object means the refusal was about something else (a
    /// missing source or upload) and the upstream's answer is the client's, except a 412 that
    /// only fencegate's precondition can have caused (the object changed and changed back: the
    /// attempt goes again on the same state; see [`Attempt::NotCommittedJudgedMore`]);
    /// otherwise it goes once more on the fresh state. A retry that loses again is judged
    /// the same way, and is a 503 `SlowDown` when the object changed once more under a
    /// same-or-older token; a second 412 on an object that still did not change is the
    /// upstream refusing the ETag it answered itself (a form it does not compare), a 502 that
    /// says so and is never taken for a concurrent write.
    ///
    pub(super) async fn conditional_write(
        &self,
        write: &ObjectWrite<'_>,
        mut state: ObjectState,
        source: &mut impl Resend,
    ) -> Result<S3Response<Body>, FrontError> {
        let (mut refused_unchanged, mut other_form_tried) = (false, false);
        let mut attempt = 0;
        while attempt < ATTEMPTS {
            let (resp, judged_more) = match source.attempt(self, state.clone()).await? {
                Attempt::Committed(resp) => {
                    if attempt > 0 {
                        metrics::precondition_conflict("retried");
                    }
                    return Ok(resp);
                }
                Attempt::Final(resp) => return Ok(resp),
                Attempt::NotCommitted(resp) => (resp, false),
                Attempt::NotCommittedJudgedMore(resp) => (resp, true),
                // Refused on an unchanged object, and the body is gone: not a concurrent write.
                Attempt::CannotResend if refused_unchanged => {
                    return Err(FrontError::PreconditionNotHonoured { precondition: state.precondition().1 });
                }
                Attempt::CannotResend => break,
            };
            if !lost_precondition(resp.status(), &state) {
                return Ok(client_response(resp));
            }
            let fresh = self.reread_after_conflict(write.target, &write.object, write.admitted).await?;
            refuse_client_condition(&write.condition, &fresh)?;
            if fresh.same_version(&state) {
                if resp.status() == StatusCode::PRECONDITION_FAILED && !judged_more && !write.other_conditions() {
                    // A 412 that judged only fencegate's precondition (the client's `If-Match`
                    // and `If-None-Match` are folded into it), which names the object as it is
                    // again: it changed and changed back in between (an ETag names bytes, not a
                    // write). Never the client's 412: the write goes again, once. Refused
                    // again, the upstream does not compare the ETag in the form it is sent (the
                    // probe did not run): the same attempt goes once in the other form.
                    if refused_unchanged {
                        if !other_form_tried && self.try_other_etag_form(false) {
                            other_form_tried = true;
                            continue;
                        }
                        if other_form_tried {
                            self.try_other_etag_form(true);
                        }
                        return Err(FrontError::PreconditionNotHonoured { precondition: state.precondition().1 });
                    }
                    refused_unchanged = true;
                    attempt += 1;
                    continue;
                }
                // fencegate's precondition named the object as it still is: the refusal was
                // about something else, and the upstream's answer is the client's.
                return Ok(client_response(resp));
            }
            state = fresh;
            attempt += 1;
        }
        metrics::precondition_conflict("gave_up");
        Err(FrontError::PreconditionRace)
    }

    /// The object's state for a precondition: from the cache when `cached` allows, else a head
    /// read. An object stamped with a newer token makes the write stale (G4), whatever the
    /// fence store says.
    pub(super) async fn object_state(
        &self,
        target: &Target,
        object: &str,
        cached: Cached,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        let state = match (cached, self.etags.get(object)) {
            (Cached::Any, Some(state)) | (Cached::PresentOnly, Some(state @ ObjectState::Present { .. })) => state,
            _ => self.head(target).await?,
        };
        self.refuse_newer_stamp(object, &state, admitted)?;
        Ok(state)
    }

    /// An object stamped with a newer token makes the write stale (G4), whatever the store says.
    /// The stamp does not raise the resource's fence: it was written under whatever resource its
    /// writer named (`Fencing-Resource` is the client's word), so it proves nothing about this one.
    pub(super) fn refuse_newer_stamp(
        &self,
        object: &str,
        state: &ObjectState,
        admitted: &Admitted,
    ) -> Result<(), FrontError> {
        if let Some(newer) = state.newer_stamp(admitted.token) {
            tracing::warn!(object, stamp = newer.0, "object carries a newer token than the fence store knows");
            return Err(Refusal::StaleByStamp { presented: admitted.token, stamp: newer }.into());
        }
        Ok(())
    }

    /// The client's own condition (`If-Match` / `If-None-Match`) judged on `state`. A failure on
    /// a cached state is looked at again on a fresh read before it is answered (fencegate's
    /// cache may be behind). Returns the state the write goes ahead on: fencegate's precondition
    /// then names exactly that state, so the upstream enforces both conditions at once.
    pub(super) async fn client_condition(
        &self,
        condition: &ClientCondition,
        target: &Target,
        object: &str,
        state: ObjectState,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        if condition.is_none() || condition.failure(&state).is_none() {
            return Ok(state);
        }
        self.etags.forget(object);
        let fresh = self.head(target).await?;
        self.refuse_newer_stamp(object, &fresh, admitted)?;
        refuse_client_condition(condition, &fresh)?;
        Ok(fresh)
    }

    /// The object's head at the upstream, bounded like any read.
    pub(super) async fn head(&self, target: &Target) -> Result<ObjectState, FrontError> {
        self.hop.head(&target.raw_path).await
    }

    /// After the upstream refused a precondition: re-read the object; a newer stamp means the
    /// write is stale, anything else is a same-or-older writer and the write may retry.
    async fn reread_after_conflict(
        &self,
        target: &Target,
        object: &str,
        admitted: &Admitted,
    ) -> Result<ObjectState, FrontError> {
        self.etags.forget(object);
        let fresh = self.head(target).await?;
        if fresh.newer_stamp(admitted.token).is_some() {
            metrics::precondition_conflict("stale");
        }
        self.refuse_newer_stamp(object, &fresh, admitted)?;
        Ok(fresh)
    }

    pub(super) fn remember_write(&self, object: String, headers: &HeaderMap, token: FenceToken) {
        match headers.get(http::header::ETAG) {
            Some(etag) => self.etags.put(object, ObjectState::Present { etag: etag.clone(), stamp: Some(token) }),
            None => self.etags.forget(&object),
        }
    }
}

/// The client's condition failed on a fresh read: answered as S3 would, never retried, never
/// counted as fencegate's own lost race.
fn refuse_client_condition(condition: &ClientCondition, state: &ObjectState) -> Result<(), FrontError> {
    match condition.failure(state) {
        None => Ok(()),
        Some(ConditionFailed::Precondition) => Err(FrontError::ClientPrecondition),
        Some(ConditionFailed::NoSuchKey) => Err(FrontError::ClientNoSuchKey),
    }
}

/// fencegate's precondition, in place of the client's (which was judged on the same state).
pub(super) fn set_precondition(headers: &mut HeaderMap, state: &ObjectState) {
    headers.remove(http::header::IF_MATCH);
    headers.remove(http::header::IF_NONE_MATCH);
    let (name, value) = state.precondition();
    headers.insert(name, value);
}

/// 412, or 409 (S3's `ConditionalRequestConflict` for a concurrent conditional write), or 404
/// to an `If-Match` (S3's answer when the object is gone): the object is not as fencegate last
/// saw it (`sent` is the state the precondition named), so it is read again. A 404 to a write
/// on an object believed absent is the upstream's own answer (no such bucket).
fn lost_precondition(status: StatusCode, sent: &ObjectState) -> bool {
    match status {
        StatusCode::PRECONDITION_FAILED | StatusCode::CONFLICT => true,
        StatusCode::NOT_FOUND => matches!(sent, ObjectState::Present { .. }),
        _ => false,
    }
}
