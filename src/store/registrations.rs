//! This replica's side of the shared in-flight registry: which registrations it holds in the
//! store, how many of its writes use each, and when each must be withdrawn.
//!
//! A registration is per (resource, token), not per write: the member `replica:id:token` says
//! "writes with this token may be in flight here", and newer tokens wait for it to go. `id`
//! is new for every registration this replica makes, so a withdrawal still queued or under
//! way can only remove the registration it was meant for, never a newer one with the same
//! token. Writes
//! with the same token share it, and it outlives its last write by a short linger, so the
//! steady state of a lease holder writing again and again is a read-only check in the store
//! (no append-only-file write, one round trip) instead of a register and a withdraw per write.
//! A registration goes at once when an advance past its token is announced and no write uses
//! it, after the linger otherwise, and at its deadline in the store if this replica dies.
//! Nothing here talks to the store: the Redis store asks for a plan, runs it, and reports.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::fence::{BootInstant as Instant, FenceToken, InflightBounds, ResourceKey};

/// The longest an idle registration is kept for the next write with its token.
pub const LINGER_MAX: Duration = Duration::from_secs(1);

/// One registration of this replica in the store: its member is `replica:id:token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Member {
    pub id: u64,
    pub token: FenceToken,
}

/// A registration to remove from the store, worth trying until `give_up_at` (its deadline:
/// the store drops it by itself then).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withdrawal {
    pub resource: ResourceKey,
    pub member: Member,
    pub give_up_at: Instant,
}

#[derive(Debug)]
struct Registration {
    member: Member,
    /// Admissions in progress and admitted writes not yet finished.
    active: u32,
    /// When the store last set its deadline (the time the call was sent); `None` until an
    /// admission registered it.
    registered_at: Option<Instant>,
    /// How many admissions registered it (answered): a renewal planned before the last of
    /// them may have run before it.
    registrations: u64,
    /// A renewal's "gone" was set aside for a later registration: renew at the next tick.
    recheck: bool,
    /// The hand-over window, the store's time to live and the renewal interval
    /// (`fence::bounds`): ages below are measured on a clock that counts suspension.
    bounds: InflightBounds,
    idle_since: Option<Instant>,
    /// A newer token was announced: withdraw as soon as no write uses it.
    superseded: bool,
    /// Not renewed in time, or found gone from the store: its writes were told to stop, and the
    /// next admission registers it again.
    revoked: bool,
}

impl Registration {
    fn linger(&self) -> Duration {
        LINGER_MAX.min(self.bounds.handover_window())
    }

    fn renew_after(&self) -> Duration {
        self.bounds.renew_every()
    }

    /// Past this age a registration's writes hand nothing over and are cut off: the store keeps
    /// it `D` (plus the drift margin) longer, for the upstream to commit what was handed over.
    fn revoke_after(&self) -> Duration {
        self.bounds.handover_window()
    }

    /// How long the store keeps it after the call that set it.
    fn ttl(&self) -> Duration {
        self.bounds.registration_ttl()
    }
}

/// A registration in use to renew in the store: its expiry is pushed to a full `ttl` from when
/// the call is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Renewal {
    pub resource: ResourceKey,
    pub member: Member,
    pub ttl: Duration,
    /// The registration's count of admissions when the renewal was planned.
    pub registrations: u64,
}

/// What an admission has to ask the store.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// The registration is in place and fresh: check the fence and that the member is still
    /// there, writing nothing.
    Check { member: Member },
    /// Register (or refresh) the member, first withdrawing these idle registrations of older
    /// tokens on the same resource in the same call.
    Register { member: Member, withdraw: Vec<Member> },
}

impl Plan {
    /// The registration the admission uses.
    pub fn member(&self) -> Member {
        match self {
            Plan::Check { member } | Plan::Register { member, .. } => *member,
        }
    }

    /// What the admission withdraws in the same call.
    pub fn withdraw(&self) -> &[Member] {
        match self {
            Plan::Check { .. } => &[],
            Plan::Register { withdraw, .. } => withdraw,
        }
    }
}

pub struct Registrations {
    /// Lock order: `by_resource`, then `urgent`.
    by_resource: Mutex<HashMap<ResourceKey, Vec<Registration>>>,
    /// Registrations to withdraw at the next flush, whatever their linger.
    urgent: Mutex<Vec<Withdrawal>>,
    /// The next registration's id, counted from a random start: two processes given the same
    /// `store.replica_id` (one config file for all, with the key set) must not name a
    /// registration alike, or one's withdrawal removes the other's while its write is in
    /// flight, and a newer token does not wait for that write.
    next_id: AtomicU64,
}

impl Default for Registrations {
    fn default() -> Self {
        // Below 2^63: as many ids again before the counter could wrap.
        let start = crate::sim::draw().unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0) >> 1;
        let start = if crate::sim::seeded(crate::sim::Bug::RegistrationIdsCollide) { 0 } else { start };
        Self { by_resource: Mutex::default(), urgent: Mutex::default(), next_id: AtomicU64::new(start) }
    }
}

impl Registrations {
    /// An admission of a write with `token` starts; it counts as a user of the registration
    /// until [`Self::admitted`]'s permit is released or [`Self::refused`] is called.
    pub fn begin(&self, resource: &ResourceKey, token: FenceToken, bounds: InflightBounds, now: Instant) -> Plan {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let regs = map.entry(resource.clone()).or_default();
        let mut withdraw = Vec::new();
        regs.retain(|r| {
            let idle_older = r.member.token < token && r.active == 0;
            if idle_older {
                withdraw.push(r.member);
            }
            !idle_older
        });
        if let Some(reg) = regs.iter_mut().find(|r| r.member.token == token) {
            reg.active += 1;
            reg.idle_since = None;
            reg.bounds = bounds;
            // Young enough that no renewal is due: the write can hand over at once.
            let fresh = reg.registered_at.is_some_and(|at| now.saturating_duration_since(at) < reg.renew_after());
            if fresh && !reg.superseded && !reg.revoked && withdraw.is_empty() {
                return Plan::Check { member: reg.member };
            }
            return Plan::Register { member: reg.member, withdraw };
        }
        let member = Member { id: self.next_id.fetch_add(1, Ordering::Relaxed), token };
        regs.push(Registration {
            member,
            active: 1,
            registered_at: None,
            registrations: 0,
            recheck: false,
            bounds,
            idle_since: None,
            superseded: false,
            revoked: false,
        });
        Plan::Register { member, withdraw }
    }

    /// The store admitted the write; `registered_at` is when the call that set the member's
    /// deadline was sent (`None` for a check that wrote nothing).
    pub fn admitted(&self, resource: &ResourceKey, member: Member, registered_at: Option<Instant>) {
        let mut map = self.by_resource.lock().expect("registrations lock");
        if let Some(reg) = map.get_mut(resource).and_then(|regs| regs.iter_mut().find(|r| r.member == member))
            && let Some(at) = registered_at
        {
            reg.registered_at = Some(reg.registered_at.map_or(at, |prev| prev.max(at)));
            reg.registrations += 1;
            reg.revoked = false;
        }
    }

    /// Registrations in use that are due for renewal.
    pub fn renewals_due(&self, now: Instant) -> Vec<Renewal> {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let mut out = Vec::new();
        for (resource, regs) in map.iter_mut() {
            for r in regs.iter_mut() {
                let due = std::mem::take(&mut r.recheck)
                    || r.registered_at.is_some_and(|at| now.saturating_duration_since(at) >= r.renew_after());
                // A revoked registration is renewed too while writes use it: its writes that had
                // handed their body over before the revocation may still commit.
                if r.active > 0 && due {
                    out.push(Renewal {
                        resource: resource.clone(),
                        member: r.member,
                        ttl: r.ttl(),
                        registrations: r.registrations,
                    });
                }
            }
        }
        out
    }

    /// The store set `member`'s deadline anew by a call sent at `sent`. A revoked registration
    /// stays revoked (nothing new is handed over under it; the next admission registers again).
    pub fn renewed(&self, resource: &ResourceKey, member: Member, sent: Instant) {
        let mut map = self.by_resource.lock().expect("registrations lock");
        if let Some(reg) = map.get_mut(resource).and_then(|regs| regs.iter_mut().find(|r| r.member == member)) {
            reg.registered_at = Some(reg.registered_at.map_or(sent, |prev| prev.max(sent)));
        }
    }

    /// The store no longer held `member` (expired, withdrawn, or lost with the store's data)
    /// when `renewal` ran: its writes are unprotected. Returns whether it was in use (then they
    /// must stop). An admission that registered the member again and was answered after the
    /// renewal was planned may have run after it (the two can go on different connections):
    /// the member is then there, and a renewal at the next tick tells.
    pub fn lost(&self, renewal: &Renewal) -> bool {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let (resource, member) = (&renewal.resource, renewal.member);
        match map.get_mut(resource).and_then(|regs| regs.iter_mut().find(|r| r.member == member)) {
            Some(reg) if !reg.revoked && reg.registrations != renewal.registrations => {
                reg.recheck = true;
                false
            }
            Some(reg) if !reg.revoked => {
                reg.revoked = true;
                reg.active > 0
            }
            _ => false,
        }
    }

    /// Whether the registration of `token` is safely in the store at `now`: registered, not
    /// revoked, and not older than the age at which it would be revoked.
    pub fn still_registered(&self, resource: &ResourceKey, token: FenceToken, now: Instant) -> bool {
        let map = self.by_resource.lock().expect("registrations lock");
        map.get(resource).and_then(|regs| regs.iter().find(|r| r.member.token == token)).is_some_and(|r| {
            !r.revoked && r.registered_at.is_some_and(|at| now.saturating_duration_since(at) < r.revoke_after())
        })
    }

    /// Registrations in use that were not renewed in time: marked revoked and returned once, so
    /// that their writes that have not sent their whole body stop before the store drops them.
    pub fn expiring(&self, now: Instant) -> Vec<(ResourceKey, FenceToken)> {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let mut out = Vec::new();
        for (resource, regs) in map.iter_mut() {
            for r in regs.iter_mut() {
                let late = r.registered_at.is_some_and(|at| now.saturating_duration_since(at) >= r.revoke_after());
                if r.active > 0 && !r.revoked && late {
                    r.revoked = true;
                    out.push((resource.clone(), r.member.token));
                }
            }
        }
        out
    }

    /// The admission ended without a write: stale, told to wait, or failed. `failed`: the call
    /// failed or was abandoned, so the store may hold the member anyway (withdrawn unless other
    /// writes use it) and may not have withdrawn `withdraw` (queued again).
    pub fn refused(&self, resource: &ResourceKey, plan: &Plan, failed: bool, now: Instant) {
        let (member, withdraw) = (plan.member(), plan.withdraw());
        if failed && !withdraw.is_empty() {
            let ttl = self.ttl_of(resource, member.token);
            let mut urgent = self.urgent.lock().expect("registrations lock");
            for old in withdraw {
                urgent.push(Withdrawal { resource: resource.clone(), member: *old, give_up_at: now + ttl });
            }
        }
        self.finish(resource, member.token, failed, now);
    }

    fn ttl_of(&self, resource: &ResourceKey, token: FenceToken) -> Duration {
        let map = self.by_resource.lock().expect("registrations lock");
        map.get(resource)
            .and_then(|regs| regs.iter().find(|r| r.member.token == token))
            .map_or(LINGER_MAX, Registration::ttl)
    }

    /// An admitted write has finished. Returns whether its registration is due now.
    pub fn release(&self, resource: &ResourceKey, token: FenceToken, now: Instant) -> bool {
        self.finish(resource, token, false, now)
    }

    fn finish(&self, resource: &ResourceKey, token: FenceToken, maybe_registered: bool, now: Instant) -> bool {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let Some(regs) = map.get_mut(resource) else { return false };
        let Some(index) = regs.iter().position(|r| r.member.token == token) else { return false };
        let reg = &mut regs[index];
        reg.active = reg.active.saturating_sub(1);
        if reg.active > 0 {
            return false;
        }
        let mut due = false;
        let registered = reg.registered_at.is_some() || maybe_registered;
        if !registered {
            regs.swap_remove(index);
        } else if reg.superseded || maybe_registered {
            let reg = regs.swap_remove(index);
            self.urgent.lock().expect("registrations lock").push(Withdrawal {
                resource: resource.clone(),
                member: reg.member,
                give_up_at: now + reg.ttl(),
            });
            due = true;
        } else {
            reg.idle_since = Some(now);
            return false;
        }
        if regs.is_empty() {
            map.remove(resource);
        }
        due
    }

    /// An advance of `resource` to `fence` was announced: registrations of older tokens go as
    /// soon as no write uses them. Returns whether some are due now.
    pub fn superseded(&self, resource: &ResourceKey, fence: FenceToken, now: Instant) -> bool {
        let mut map = self.by_resource.lock().expect("registrations lock");
        let Some(regs) = map.get_mut(resource) else { return false };
        let mut due = false;
        regs.retain_mut(|r| {
            if r.member.token >= fence {
                return true;
            }
            r.superseded = true;
            if r.active > 0 {
                return true;
            }
            if r.registered_at.is_some() {
                self.urgent.lock().expect("registrations lock").push(Withdrawal {
                    resource: resource.clone(),
                    member: r.member,
                    give_up_at: now + r.ttl(),
                });
                due = true;
            }
            false
        });
        if regs.is_empty() {
            map.remove(resource);
        }
        due
    }

    /// The registrations to withdraw now: the urgent ones, and (`idle`) those idle past their
    /// linger, which takes a look at every registration. They are forgotten here; the caller
    /// removes them from the store, and hands back with [`Self::retry`] those it could not.
    pub fn due(&self, now: Instant, idle: bool) -> Vec<Withdrawal> {
        let mut out = std::mem::take(&mut *self.urgent.lock().expect("registrations lock"));
        if !idle {
            return out;
        }
        let mut map = self.by_resource.lock().expect("registrations lock");
        map.retain(|resource, regs| {
            regs.retain(|r| {
                let expired =
                    r.active == 0 && r.idle_since.is_some_and(|at| now.saturating_duration_since(at) >= r.linger());
                if expired {
                    out.push(Withdrawal { resource: resource.clone(), member: r.member, give_up_at: now + r.ttl() });
                }
                !expired
            });
            !regs.is_empty()
        });
        out
    }

    /// Withdrawals that failed, tried again at the next flush until they are pointless.
    pub fn retry(&self, failed: Vec<Withdrawal>, now: Instant) {
        let mut urgent = self.urgent.lock().expect("registrations lock");
        urgent.extend(failed.into_iter().filter(|w| w.give_up_at > now));
    }

    /// Whether withdrawals are waiting for the next flush.
    #[cfg(test)]
    fn has_urgent(&self) -> bool {
        !self.urgent.lock().expect("registrations lock").is_empty()
    }

    /// Registrations this replica holds or is making.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_resource.lock().expect("registrations lock").values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: InflightBounds = InflightBounds::new(Duration::from_secs(30));

    /// The hand-over window of `BOUNDS`.
    fn window() -> Duration {
        BOUNDS.handover_window()
    }

    fn r(name: &str) -> ResourceKey {
        ResourceKey::new(name).unwrap()
    }

    fn register(regs: &Registrations, res: &ResourceKey, token: u64, now: Instant) -> Member {
        let Plan::Register { member, .. } = regs.begin(res, FenceToken(token), BOUNDS, now) else {
            panic!("expected a registration")
        };
        regs.admitted(res, member, Some(now));
        member
    }

    fn withdrawn(due: Vec<Withdrawal>) -> Vec<(ResourceKey, Member)> {
        due.into_iter().map(|w| (w.resource, w.member)).collect()
    }

    /// Two processes (given the same replica id) name their first registrations apart.
    #[test]
    fn each_process_numbers_its_registrations_from_its_own_start() {
        let (res, t0) = (r("a"), Instant::now());
        let one = register(&Registrations::default(), &res, 5, t0);
        let other = register(&Registrations::default(), &res, 5, t0);
        assert_ne!(one.id, other.id);
        assert!(one.id < 1 << 63 && other.id < 1 << 63);
    }

    #[test]
    fn the_next_write_with_the_same_token_only_checks() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        regs.release(&res, FenceToken(5), t0);
        assert_eq!(regs.begin(&res, FenceToken(5), BOUNDS, t0 + Duration::from_millis(10)), Plan::Check { member });
        regs.admitted(&res, member, None);
        regs.release(&res, FenceToken(5), t0);
        assert!(regs.due(t0 + Duration::from_millis(20), true).is_empty());
    }

    #[test]
    fn an_idle_registration_goes_after_its_linger() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        assert!(regs.due(t0 + LINGER_MAX * 2, true).is_empty(), "in use: kept");
        regs.release(&res, FenceToken(5), t0);
        assert!(regs.due(t0 + LINGER_MAX / 2, true).is_empty());
        assert_eq!(withdrawn(regs.due(t0 + LINGER_MAX, true)), vec![(res, member)]);
        assert_eq!(regs.len(), 0);
    }

    #[test]
    fn a_registration_due_for_renewal_is_refreshed() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        assert_eq!(
            regs.begin(&res, FenceToken(5), BOUNDS, t0 + BOUNDS.renew_every()),
            Plan::Register { member, withdraw: vec![] }
        );
    }

    #[test]
    fn a_newer_token_withdraws_idle_older_ones_in_its_own_call() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        register(&regs, &res, 5, t0);
        regs.release(&res, FenceToken(5), t0);
        let six = register(&regs, &res, 6, t0); // token 6 still in use
        let Plan::Register { withdraw, .. } = regs.begin(&res, FenceToken(7), BOUNDS, t0) else { panic!() };
        assert!(withdraw.is_empty());
        regs.release(&res, FenceToken(6), t0);
        let Plan::Register { withdraw, .. } = regs.begin(&res, FenceToken(8), BOUNDS, t0) else { panic!() };
        assert_eq!(withdraw, vec![six]);
    }

    #[test]
    fn an_announced_advance_withdraws_at_once_or_at_the_last_release() {
        let regs = Registrations::default();
        let (a, b, t0) = (r("a"), r("b"), Instant::now());
        let on_a = register(&regs, &a, 5, t0);
        regs.release(&a, FenceToken(5), t0);
        let on_b = register(&regs, &b, 5, t0);
        assert!(regs.superseded(&a, FenceToken(6), t0), "idle: due now");
        assert!(!regs.superseded(&b, FenceToken(6), t0), "in use: kept");
        assert_eq!(withdrawn(regs.due(t0, true)), vec![(a.clone(), on_a)]);
        assert!(regs.release(&b, FenceToken(5), t0), "superseded: due at its last release");
        assert_eq!(withdrawn(regs.due(t0, false)), vec![(b.clone(), on_b)]);
        assert!(!regs.superseded(&a, FenceToken(7), t0), "nothing left");
    }

    #[test]
    fn a_refused_admission_leaves_nothing_unless_the_call_failed() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let plan = regs.begin(&res, FenceToken(5), BOUNDS, t0);
        regs.refused(&res, &plan, false, t0);
        assert_eq!(regs.len(), 0);
        assert!(regs.due(t0, true).is_empty());
        let plan = regs.begin(&res, FenceToken(5), BOUNDS, t0);
        let Plan::Register { member, .. } = plan else { panic!() };
        regs.refused(&res, &plan, true, t0);
        assert_eq!(withdrawn(regs.due(t0, true)), vec![(res, member)]);
    }

    #[test]
    fn a_failed_call_queues_again_what_it_was_to_withdraw() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let five = register(&regs, &res, 5, t0);
        regs.release(&res, FenceToken(5), t0);
        let plan = regs.begin(&res, FenceToken(6), BOUNDS, t0);
        let Plan::Register { member: six, withdraw } = &plan else { panic!() };
        assert_eq!(withdraw, &vec![five]);
        let six = *six;
        regs.refused(&res, &plan, true, t0);
        let mut due = withdrawn(regs.due(t0, true));
        due.sort_by_key(|(_, m)| m.token);
        assert_eq!(due, vec![(res.clone(), five), (res, six)]);
    }

    #[test]
    fn a_failed_call_keeps_a_registration_other_writes_use() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        let plan = regs.begin(&res, FenceToken(5), BOUNDS, t0);
        regs.refused(&res, &plan, true, t0);
        assert!(regs.due(t0, true).is_empty());
        assert_eq!(regs.begin(&res, FenceToken(5), BOUNDS, t0), Plan::Check { member });
    }

    #[test]
    fn a_registration_made_again_has_a_new_member() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let first = register(&regs, &res, 5, t0);
        regs.release(&res, FenceToken(5), t0);
        assert!(regs.superseded(&res, FenceToken(6), t0));
        // The withdrawal of `first` may still be under way when token 5 is registered again.
        let again = register(&regs, &res, 5, t0);
        assert_ne!(first, again);
        assert_eq!(withdrawn(regs.due(t0, true)), vec![(res, first)]);
    }

    #[test]
    fn failed_withdrawals_are_retried_until_their_deadline() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        register(&regs, &res, 5, t0);
        regs.release(&res, FenceToken(5), t0);
        regs.superseded(&res, FenceToken(6), t0);
        let due = regs.due(t0, true);
        regs.retry(due.clone(), t0 + Duration::from_secs(1));
        assert!(regs.has_urgent());
        assert_eq!(regs.due(t0 + Duration::from_secs(1), false), due);
        regs.retry(due, t0 + BOUNDS.registration_ttl());
        assert!(!regs.has_urgent());
    }

    /// A registration in use is renewed while writes use it, never an idle one.
    #[test]
    fn a_registration_in_use_is_renewed_an_idle_one_is_not() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        assert!(regs.renewals_due(t0 + Duration::from_millis(10)).is_empty(), "fresh: not yet");
        let later = t0 + BOUNDS.renew_every();
        assert_eq!(
            regs.renewals_due(later),
            vec![Renewal { resource: res.clone(), member, ttl: BOUNDS.registration_ttl(), registrations: 1 }]
        );
        regs.renewed(&res, member, later);
        assert!(regs.renewals_due(later + Duration::from_millis(10)).is_empty());
        // Renewed in time, it is never revoked, however long the write takes.
        for step in 1..100 {
            let now = later + BOUNDS.renew_every() * step;
            assert!(regs.expiring(now).is_empty());
            regs.renewed(&res, member, now);
        }
        regs.release(&res, FenceToken(5), t0);
        assert!(regs.renewals_due(later + BOUNDS.registration_ttl()).is_empty(), "idle: left to its linger");
    }

    /// A registration in use that could not be renewed is revoked once, at the end of its
    /// hand-over window, `D` and the drift margin before the store drops it, and the next
    /// admission registers it again instead of only checking it.
    #[test]
    fn a_registration_not_renewed_in_time_is_revoked_at_the_end_of_its_window() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        let last_moment = t0 + (window() - Duration::from_nanos(1));
        assert!(regs.expiring(last_moment).is_empty());
        assert!(regs.still_registered(&res, FenceToken(5), last_moment), "the latest hand-over allowed");
        let revoke_at = t0 + window();
        assert_eq!(revoke_at + BOUNDS.inflight_deadline + BOUNDS.drift_margin(), t0 + BOUNDS.registration_ttl());
        assert_eq!(regs.expiring(revoke_at), vec![(res.clone(), FenceToken(5))]);
        assert!(regs.expiring(revoke_at + Duration::from_millis(1)).is_empty(), "revoked once");
        assert_eq!(regs.renewals_due(revoke_at).len(), 1, "renewed on: sent writes may still commit");
        assert!(!regs.still_registered(&res, FenceToken(5), revoke_at), "no body is handed over past it");
        assert_eq!(
            regs.begin(&res, FenceToken(5), BOUNDS, revoke_at),
            Plan::Register { member, withdraw: vec![] },
            "registered again, not only checked"
        );
        regs.admitted(&res, member, Some(revoke_at));
        assert!(regs.expiring(revoke_at + window() / 2).is_empty());
    }

    /// A registration the store lost (a restart without persistence, an expiry) is revoked at
    /// once if writes use it.
    #[test]
    fn a_registration_the_store_lost_is_revoked() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        register(&regs, &res, 5, t0);
        let renewal = regs.renewals_due(t0 + BOUNDS.renew_every()).pop().unwrap();
        assert!(regs.lost(&renewal));
        assert!(!regs.lost(&renewal), "reported once");
        assert!(!regs.still_registered(&res, FenceToken(5), t0 + BOUNDS.renew_every()), "nothing handed over");
        assert!(regs.expiring(t0 + BOUNDS.registration_ttl()).is_empty(), "already revoked");
        assert!(matches!(regs.begin(&res, FenceToken(5), BOUNDS, t0), Plan::Register { .. }));
    }

    /// A renewal planned before an admission that registered the member again may have run
    /// before it: its "gone" does not revoke the writes that admission let in. A renewal
    /// planned after it does.
    #[test]
    fn a_renewal_older_than_a_registration_does_not_revoke_it() {
        let regs = Registrations::default();
        let (res, t0) = (r("a"), Instant::now());
        let member = register(&regs, &res, 5, t0);
        let half = t0 + window() / 2;
        let first = regs.renewals_due(half).pop().unwrap();
        assert!(regs.lost(&first), "the store lost it: revoked");
        // The next write registers the same member again, and `first` (planned before that
        // admission was answered) is taken as if it had run before the admission.
        let Plan::Register { member: again, .. } = regs.begin(&res, FenceToken(5), BOUNDS, t0) else { panic!() };
        assert_eq!(again, member);
        regs.admitted(&res, member, Some(half));
        assert!(!regs.lost(&first), "planned before the registration that put it back");
        assert!(regs.still_registered(&res, FenceToken(5), half));
        // Renewed again at once, not a renewal period later; a "gone" then revokes.
        let next = regs.renewals_due(half).pop().expect("a renewal at the next tick");
        assert!(regs.renewals_due(half).is_empty(), "once");
        assert!(regs.lost(&next), "planned after it: revoked");
    }
}
