//! Every time bound of the in-flight registry, derived from the one timing assumption
//! (`docs/design.md`, section 3a):
//!
//! > an upstream commits a request it received whole within `D`
//! > (`fencing.inflight_deadline_ms`) of receiving it, or never.
//!
//! A replica on a shared store hands a body over (its last chunk, or a body already in memory)
//! only while its registration was last renewed less than `H` ago, measured from when that
//! renewal was *sent*, on a clock that counts host suspension ([`BootInstant`]). The store drops
//! a registration `E` after it received the call that set it. Whatever happens to the replica
//! or its link after a hand-over at `h`, the store therefore keeps the registration until at
//! least `h + E - H`, and no replica admits a newer token before then. The upstream may commit
//! the handed-over write until `h + D`, so
//!
//! ```text
//!     E  ≥  (1 + ρ) · (D + (1 + ρ) · H)        (G3 across replicas)
//! ```
//!
//! where ρ is the largest rate difference between the replica's clock and the store's. With
//! `H = D/4` and `E = D + H + M`, `M = D/8`, the inequality holds for every ρ up to 8 %
//! (checked below for every `D` the configuration allows). Liveness asks for two more: a live
//! replica renews often enough that a registration in use never reaches the age `H`
//! (`renew_every + store.timeout_ms < H`, which `check-config` enforces), and a dead replica
//! holds newer tokens back for `E` at most.

use std::time::Duration;

/// The rate difference between two hosts' clocks the margin is sized for (checked by
/// [`InflightBounds::holds`]); NTP keeps real clocks within 0.05 %.
pub const CLOCK_RATE_DRIFT_MAX: f64 = 0.08;

/// The longest a registration in use goes without renewal, whatever `D` (a renewal also tells
/// whether the fence moved past its token, so this bounds how long a lost announcement delays
/// a newer token).
pub const RENEW_EVERY_MAX: Duration = Duration::from_secs(1);

/// The smallest `D` a shared store accepts: a hand-over window of 250 ms, renewed every 125 ms
/// by a renewer that looks every 50 ms, leaves a renewal 75 ms for its round trip.
pub const SHARED_INFLIGHT_DEADLINE_MS_MIN: u64 = 1_000;

/// The bounds of one in-flight deadline `D`, in one place: who may hand a body over until
/// when, and how long the store keeps what says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightBounds {
    /// `D`: an upstream commits a request it received whole within this, or never.
    pub inflight_deadline: Duration,
}

impl InflightBounds {
    pub const fn new(inflight_deadline: Duration) -> Self {
        Self { inflight_deadline }
    }

    /// `H`: a replica hands a body over only while its registration's last renewal was sent
    /// less than this long ago; at this age its unsent writes are cut off (revoked).
    pub fn handover_window(&self) -> Duration {
        if crate::sim::seeded(crate::sim::Bug::RegistrationMargin) {
            return self.inflight_deadline * 3 / 4;
        }
        self.inflight_deadline / 4
    }

    /// `M`: the margin for clock-rate drift between a replica and the store.
    pub fn drift_margin(&self) -> Duration {
        self.inflight_deadline / 8
    }

    /// `E = D + H + M`: how long the store keeps a registration after the call that set it.
    pub fn registration_ttl(&self) -> Duration {
        if crate::sim::seeded(crate::sim::Bug::RegistrationMargin) {
            return self.inflight_deadline;
        }
        self.inflight_deadline + self.handover_window() + self.drift_margin()
    }

    /// A registration in use is renewed once its last renewal is this old: half the hand-over
    /// window, so that a renewal that takes up to the other half still keeps it young.
    pub fn renew_every(&self) -> Duration {
        RENEW_EVERY_MAX.min(self.handover_window() / 2)
    }

    /// Whether the store keeps every registration at least `D` past the latest hand-over a
    /// replica allows, when the two clocks' rates differ by `drift` (a share, 0.01 = 1 %).
    pub fn holds(&self, drift: f64) -> bool {
        covers(self.inflight_deadline, self.handover_window(), self.registration_ttl(), drift)
    }
}

/// The inequality itself: a store that keeps a registration `e` after a renewal still holds it
/// `d` past a hand-over at the replica's age `h`. The replica's `h` may last `(1 + drift) h` of
/// real time, the store's `e` as little as `e / (1 + drift)`.
fn covers(d: Duration, h: Duration, e: Duration, drift: f64) -> bool {
    e.as_secs_f64() / (1.0 + drift) >= d.as_secs_f64() + (1.0 + drift) * h.as_secs_f64()
}

/// A point on the clock that counts time the host spent suspended (`CLOCK_BOOTTIME` on
/// Linux): every age that guards a hand-over is measured on it. `Instant` (`CLOCK_MONOTONIC`)
/// stops while a VM is suspended or restored from a snapshot, so a registration dropped by the
/// store during the suspension would still look young to the replica that wakes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootInstant(Duration);

impl BootInstant {
    #[cfg(not(feature = "simulation"))]
    pub fn now() -> Self {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        let secs = u64::try_from(t.tv_sec).unwrap_or(0);
        let nanos = u32::try_from(t.tv_nsec).unwrap_or(0);
        Self(Duration::new(secs, nanos))
    }

    /// In a simulation the boot clock is the simulated one: tokio's, paused and advanced by
    /// the runtime, from the process's first reading (`sim`).
    #[cfg(feature = "simulation")]
    pub fn now() -> Self {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let origin = *ORIGIN.get_or_init(std::time::Instant::now);
        Self(tokio::time::Instant::now().into_std().saturating_duration_since(origin) + Duration::from_secs(1))
    }

    /// Milliseconds since the boot.
    pub fn as_millis(&self) -> u64 {
        millis(self.0)
    }

    /// The time since `earlier`, zero if `earlier` is later.
    pub fn saturating_duration_since(&self, earlier: BootInstant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl std::ops::Add<Duration> for BootInstant {
    type Output = BootInstant;

    fn add(self, rhs: Duration) -> BootInstant {
        BootInstant(self.0 + rhs)
    }
}

/// A `Duration` back to whole milliseconds, for messages and store calls (saturating).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inequality holds for every in-flight deadline the configuration accepts (100 ms up),
    /// at the drift the margin is sized for, and would not without the margin.
    #[test]
    fn the_store_keeps_a_registration_d_past_the_latest_hand_over() {
        for ms in [100, 101, 999, 1_000, 2_000, 2_001, 30_000, 86_400_000] {
            let bounds = InflightBounds::new(Duration::from_millis(ms));
            assert!(bounds.holds(CLOCK_RATE_DRIFT_MAX), "D = {ms} ms");
            assert!(bounds.holds(0.0));
            assert!(!bounds.holds(0.2), "D = {ms} ms: a 20 % drift is not covered, and the check says so");
        }
    }

    /// Handing over until 3D/4 of a registration the store keeps D leaves the upstream D/4;
    /// without the drift margin only clocks that agree exactly are covered.
    #[test]
    fn the_check_refuses_what_breaks_the_inequality() {
        let d = Duration::from_secs(30);
        assert!(!covers(d, d * 3 / 4, d, 0.0));
        assert!(covers(d, d / 4, d + d / 4, 0.0));
        assert!(!covers(d, d / 4, d + d / 4, 0.001));
    }

    #[test]
    fn a_live_replica_renews_well_inside_the_window() {
        for ms in [100, 2_000, 30_000, 600_000] {
            let bounds = InflightBounds::new(Duration::from_millis(ms));
            assert!(bounds.renew_every() * 2 <= bounds.handover_window());
            assert!(bounds.renew_every() <= RENEW_EVERY_MAX);
        }
    }

    #[test]
    fn boot_time_moves_forward() {
        let a = BootInstant::now();
        std::thread::sleep(Duration::from_millis(2));
        let b = BootInstant::now();
        assert!(b.saturating_duration_since(a) >= Duration::from_millis(2));
        assert_eq!(a.saturating_duration_since(b), Duration::ZERO);
    }
}
