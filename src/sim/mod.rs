//! The deterministic simulator (`scripts/simulate`, `docs/design.md` section 13): fencegate's own
//! gate, shared registry, outcome handling, start and stop logic and lease state machine, run on
//! simulated time in one thread from a seed, against simulated stores, upstream, clients and
//! operator, with faults as events of the schedule and checkers for G1, G3 and leases.
//!
//! Built only with the `simulation` feature (the `simulate` binary); without it this module is
//! [`seeded`] and [`draw`], constants the compiler removes (the request path pays nothing), and
//! the seeded generator [`rng::Rng`].

#[cfg(any(test, feature = "simulation"))]
mod check;
#[cfg(feature = "simulation")]
mod cli;
#[cfg(feature = "simulation")]
mod link;
/// The simulator's generator, also the benchmark's (`fencegate-bench` picks resources with it).
pub mod rng;
#[cfg(feature = "simulation")]
mod schedule;
#[cfg(feature = "simulation")]
mod store;
#[cfg(feature = "simulation")]
mod upstream;
#[cfg(feature = "simulation")]
mod world;

#[cfg(feature = "simulation")]
pub use cli::main;

/// Holes found in fencegate before, put back one at a time by `scripts/simulate --bug NAME` to
/// show that the simulator finds them. Only a simulation build can turn one on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// The hand-over window `3D/4` of a registration the store keeps `D`: the upstream is left
    /// `D/4` after the latest hand-over instead of `D` (`fence::bounds`).
    RegistrationMargin,
    /// A 5xx answer to a write taken as "not performed": its permit ends at once instead of
    /// being held for `D` (`fence::outcome`).
    ServerErrorSettles,
    /// A clean start ignores the hold an unclean start recorded: a crash, a start and a clean
    /// stop within `D`, then a start, admits at once (`app`).
    CleanStopEndsHold,
    /// Every process numbers its registrations from 0: two replicas given one
    /// `store.replica_id` name registrations alike (`store::registrations`).
    RegistrationIdsCollide,
}

impl Bug {
    pub const ALL: [Bug; 4] =
        [Bug::RegistrationMargin, Bug::ServerErrorSettles, Bug::CleanStopEndsHold, Bug::RegistrationIdsCollide];

    pub fn name(self) -> &'static str {
        match self {
            Bug::RegistrationMargin => "registration-margin",
            Bug::ServerErrorSettles => "server-error-settles",
            Bug::CleanStopEndsHold => "clean-stop-ends-hold",
            Bug::RegistrationIdsCollide => "registration-ids-collide",
        }
    }
}

#[cfg(feature = "simulation")]
thread_local! {
    static SEEDED: std::cell::Cell<Option<Bug>> = const { std::cell::Cell::new(None) };
    /// The running schedule's draws for what the code would take at random (registration
    /// ids' start, epoch marks' names), so that a seed names every value of a run.
    static DRAWS: std::cell::RefCell<Option<rng::Rng>> = const { std::cell::RefCell::new(None) };
}

/// In a simulation, a number from the schedule's seed in place of one the code would draw at
/// random; `None` outside one.
#[cfg(not(feature = "simulation"))]
#[inline(always)]
pub(crate) const fn draw() -> Option<u64> {
    None
}

/// In a simulation, a number from the schedule's seed in place of one the code would draw at
/// random.
#[cfg(feature = "simulation")]
pub(crate) fn draw() -> Option<u64> {
    DRAWS.with(|draws| draws.borrow_mut().as_mut().map(rng::Rng::next_u64))
}

/// Seeds [`draw`] for the schedule about to run on this thread.
#[cfg(feature = "simulation")]
pub(crate) fn seed_draws(seed: u64) {
    DRAWS.with(|draws| *draws.borrow_mut() = Some(rng::Rng::new(seed ^ 0xd1ce_5eed)));
}

/// Whether `bug` is put back in this simulation (always `false` outside one).
#[cfg(not(feature = "simulation"))]
#[inline(always)]
pub(crate) const fn seeded(_bug: Bug) -> bool {
    false
}

/// Whether `bug` is put back in this simulation.
#[cfg(feature = "simulation")]
pub(crate) fn seeded(bug: Bug) -> bool {
    SEEDED.with(|seeded| seeded.get() == Some(bug))
}

/// Puts `bug` back (or none) for the schedules run on this thread.
#[cfg(feature = "simulation")]
pub(crate) fn seed_bug(bug: Option<Bug>) {
    SEEDED.with(|seeded| seeded.set(bug));
}
