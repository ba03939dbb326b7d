//! Leases whose grant fences their resource: the state machine, pure. Stores apply it inside
//! one atomic step together with the fence, so a grant and its fence can never be seen apart.

use serde::{Deserialize, Serialize};

use super::FenceToken;

/// A granted lease, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub holder: String,
    pub lease_id: String,
    pub token: FenceToken,
    pub ttl_ms: u64,
    /// Wall-clock milliseconds since the Unix epoch: leases outlive restarts.
    pub expires_at_ms: u64,
}

impl LeaseRecord {
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms
    }
}

/// What a lease client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseCommand {
    /// `lease_id` is chosen by the caller (random), so the store stays deterministic. `floor`
    /// is the highest token the asking replica has seen on the resource (the gate fills it in):
    /// the grant is above it even if the store lost what it knew (a Redis failover).
    Acquire {
        holder: String,
        ttl_ms: u64,
        lease_id: String,
        floor: Option<FenceToken>,
    },
    Renew {
        lease_id: String,
    },
    Release {
        lease_id: String,
    },
    /// Takes back a grant that was answered with an error (its outcome unknown): releases the
    /// lease if the grant was applied, live or not, and makes sure it is never applied later.
    /// A shared store keeps a tombstone of `lease_id` that a grant arriving after it (a
    /// connection's late bytes, a transaction applied late) finds, and does nothing; the
    /// embedded store applies its changes in order, so the grant came first or never.
    Withdraw {
        lease_id: String,
    },
}

/// How long a shared store keeps a withdrawn grant's tombstone: far longer than a grant can
/// stay in flight (it is bounded by `store.timeout_ms` on the caller's side, by a stalled
/// store's own recovery on the other).
pub const WITHDRAWN_GRANT_TTL_MS: u64 = 600_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// The lease is granted with a token above every token of the resource, now its fence.
    Granted(LeaseRecord),
    /// Someone holds a live lease.
    Held {
        holder: String,
        remaining_ms: u64,
    },
    Renewed(LeaseRecord),
    Released,
    /// The lease id is not the live lease any more (expired, released or superseded).
    Gone,
    /// The resource's fence is `u64::MAX`: no greater token exists.
    TokensExhausted,
}

/// What a store must write after a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseWrite {
    Keep,
    Put(LeaseRecord),
    Delete,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseTransition {
    pub outcome: LeaseOutcome,
    /// The new fence, when the command raised it.
    pub fence: Option<FenceToken>,
    pub lease: LeaseWrite,
}

/// Applies `command` at `now_ms` to a resource whose fence is `fence` and whose stored lease
/// is `current`.
pub fn apply_lease(
    fence: Option<FenceToken>,
    current: Option<&LeaseRecord>,
    command: LeaseCommand,
    now_ms: u64,
) -> LeaseTransition {
    let live = current.filter(|l| l.is_live(now_ms));
    let keep = |outcome| LeaseTransition { outcome, fence: None, lease: LeaseWrite::Keep };
    match command {
        LeaseCommand::Acquire { holder, ttl_ms, lease_id, floor } => {
            if let Some(l) = live {
                return keep(LeaseOutcome::Held { holder: l.holder.clone(), remaining_ms: l.expires_at_ms - now_ms });
            }
            // Above the fence, which is at least every token ever granted or seen, and above
            // the asking replica's floor.
            let next = match fence.max(floor) {
                None => Some(1),
                Some(f) => f.0.checked_add(1),
            };
            let Some(next) = next else { return keep(LeaseOutcome::TokensExhausted) };
            let record = LeaseRecord {
                holder,
                lease_id,
                token: FenceToken(next),
                ttl_ms,
                expires_at_ms: now_ms.saturating_add(ttl_ms),
            };
            LeaseTransition {
                outcome: LeaseOutcome::Granted(record.clone()),
                fence: Some(FenceToken(next)),
                lease: LeaseWrite::Put(record),
            }
        }
        LeaseCommand::Renew { lease_id } => match live {
            // A newer token was registered or written since the grant: the lease is superseded.
            Some(l) if l.lease_id == lease_id && fence.is_some_and(|f| f > l.token) => {
                LeaseTransition { outcome: LeaseOutcome::Gone, fence: None, lease: LeaseWrite::Delete }
            }
            Some(l) if l.lease_id == lease_id => {
                let record = LeaseRecord { expires_at_ms: now_ms.saturating_add(l.ttl_ms), ..l.clone() };
                LeaseTransition {
                    outcome: LeaseOutcome::Renewed(record.clone()),
                    fence: None,
                    lease: LeaseWrite::Put(record),
                }
            }
            _ => keep(LeaseOutcome::Gone),
        },
        LeaseCommand::Withdraw { lease_id } => match current {
            Some(l) if l.lease_id == lease_id => {
                LeaseTransition { outcome: LeaseOutcome::Released, fence: None, lease: LeaseWrite::Delete }
            }
            _ => keep(LeaseOutcome::Gone),
        },
        LeaseCommand::Release { lease_id } => match live {
            // Superseded: it could not write any more; it is removed, and its holder told so.
            Some(l) if l.lease_id == lease_id && fence.is_some_and(|f| f > l.token) => {
                LeaseTransition { outcome: LeaseOutcome::Gone, fence: None, lease: LeaseWrite::Delete }
            }
            Some(l) if l.lease_id == lease_id => {
                LeaseTransition { outcome: LeaseOutcome::Released, fence: None, lease: LeaseWrite::Delete }
            }
            _ => keep(LeaseOutcome::Gone),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire(holder: &str, id: &str) -> LeaseCommand {
        LeaseCommand::Acquire { holder: holder.into(), ttl_ms: 1000, lease_id: id.into(), floor: None }
    }

    fn granted(t: &LeaseTransition) -> LeaseRecord {
        match &t.outcome {
            LeaseOutcome::Granted(r) => r.clone(),
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    #[test]
    fn a_grant_is_above_the_fence_and_becomes_it() {
        let t = apply_lease(Some(FenceToken(41)), None, acquire("a", "1"), 0);
        assert_eq!(granted(&t).token, FenceToken(42));
        assert_eq!(t.fence, Some(FenceToken(42)));
        assert_eq!(granted(&apply_lease(None, None, acquire("a", "1"), 0)).token, FenceToken(1));
        assert_eq!(
            apply_lease(Some(FenceToken(u64::MAX)), None, acquire("a", "1"), 0).outcome,
            LeaseOutcome::TokensExhausted
        );
    }

    #[test]
    fn a_live_lease_blocks_others_until_it_expires() {
        let first = granted(&apply_lease(None, None, acquire("a", "1"), 0));
        let held = apply_lease(Some(first.token), Some(&first), acquire("b", "2"), 400);
        assert_eq!(held.outcome, LeaseOutcome::Held { holder: "a".into(), remaining_ms: 600 });
        let second = granted(&apply_lease(Some(first.token), Some(&first), acquire("b", "2"), 1000));
        assert_eq!(second.token, FenceToken(2));
    }

    #[test]
    fn renew_and_release_are_compare_and_set_on_the_lease_id() {
        let l = granted(&apply_lease(None, None, acquire("a", "1"), 0));
        let f = Some(l.token);
        assert_eq!(
            apply_lease(f, Some(&l), LeaseCommand::Renew { lease_id: "x".into() }, 10).outcome,
            LeaseOutcome::Gone
        );
        match apply_lease(f, Some(&l), LeaseCommand::Renew { lease_id: "1".into() }, 500).outcome {
            LeaseOutcome::Renewed(r) => assert_eq!(r.expires_at_ms, 1500),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            apply_lease(f, Some(&l), LeaseCommand::Renew { lease_id: "1".into() }, 1000).outcome,
            LeaseOutcome::Gone
        );
        assert_eq!(
            apply_lease(f, Some(&l), LeaseCommand::Release { lease_id: "x".into() }, 10).outcome,
            LeaseOutcome::Gone
        );
        let released = apply_lease(f, Some(&l), LeaseCommand::Release { lease_id: "1".into() }, 10);
        assert_eq!((released.outcome, released.lease), (LeaseOutcome::Released, LeaseWrite::Delete));
        // A newer token registered since the grant: renewing or releasing says it is gone
        // (its holder could not write any more), and the lease is removed either way.
        let above = Some(FenceToken(l.token.0 + 1));
        for command in [LeaseCommand::Renew { lease_id: "1".into() }, LeaseCommand::Release { lease_id: "1".into() }] {
            let t = apply_lease(above, Some(&l), command, 10);
            assert_eq!((t.outcome, t.lease), (LeaseOutcome::Gone, LeaseWrite::Delete));
        }
    }
}
