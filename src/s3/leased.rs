//! Requests signed with lease credentials (`lease::credentials`): whether the lease still
//! stands, and what its credential may write.

use http::{HeaderMap, Method};

use super::error::FrontError;
use super::{Front, Op, Target};
use crate::fence::{FenceToken, ResourceKey};
use crate::lease::credentials::Claims;
use crate::refusal::Refusal;

/// A lease credential's lease, standing: writes carry its token.
pub(super) struct LeaseStanding {
    pub(super) resource: ResourceKey,
    pub(super) token: FenceToken,
}

impl Front {
    /// A request signed with a lease credential: the lease must still stand (else 403
    /// `ExpiredToken`, or 409 for a write whose token a newer grant has passed), and a write
    /// must be to an object of the lease's resource, with no other token or resource.
    pub(super) async fn lease_standing(
        &self,
        claims: &Claims,
        method: &Method,
        op: Op,
        target: &Target,
        headers: &HeaderMap,
    ) -> Result<LeaseStanding, FrontError> {
        let resource = ResourceKey::new(&claims.resource).map_err(Refusal::InvalidResource)?;
        let write = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
        let stored = self.ctx.gate.lease_record(&resource).await.map_err(Refusal::StoreUnavailable)?;
        let now_ms = self.ctx.clock.now_ms();
        let stands = stored.as_ref().is_some_and(|l| claims.names(l) && l.is_live(now_ms));
        let token = FenceToken(claims.token);
        if !stands {
            if write
                && let Some(current) = crate::fence::stale_below(
                    self.ctx.gate.fence(&resource).await.map_err(Refusal::StoreUnavailable)?,
                    token,
                )
            {
                return Err(Refusal::Stale { presented: token, current }.into());
            }
            return Err(FrontError::LeaseExpired);
        }
        if !write {
            return Ok(LeaseStanding { resource, token });
        }
        if !op.is_fenced_write() {
            return Err(FrontError::OutsideLease {
                lease: claims.resource.clone(),
                what: "a bucket or service operation".into(),
            });
        }
        if let Some(presented) = self.ctx.wire.token(headers)?
            && presented != token
        {
            return Err(FrontError::LeaseTokenMismatch { presented, lease: token });
        }
        if let Some(presented) = headers.get(&self.ctx.wire.resource_header)
            && presented.as_bytes() != claims.resource.as_bytes()
        {
            let presented = String::from_utf8_lossy(presented.as_bytes()).into_owned();
            return Err(FrontError::LeaseResourceMismatch { presented, lease: claims.resource.clone() });
        }
        // DeleteObjects: each key on its own (`delete_objects`).
        if op != Op::DeleteObjects {
            let (Some(bucket), Some(key)) = (&target.bucket, &target.key) else {
                return Err(FrontError::OutsideLease { lease: claims.resource.clone(), what: "a bucket".into() });
            };
            self.within_lease(&resource, bucket, key)?;
        }
        Ok(LeaseStanding { resource, token })
    }

    /// Whether `bucket/key` belongs to the lease's resource by the rules (or is it, for a
    /// per-object lease), whatever the request's own `Fencing-Resource` says.
    pub(super) fn within_lease(&self, lease: &ResourceKey, bucket: &str, key: &str) -> Result<(), FrontError> {
        match self.ctx.wire.resource(&HeaderMap::new(), bucket, key) {
            Ok(resource) if resource == *lease => Ok(()),
            _ => Err(FrontError::OutsideLease { lease: lease.as_str().to_owned(), what: format!("{bucket}/{key}") }),
        }
    }
}
