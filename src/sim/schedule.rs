//! A schedule: what happens when, drawn from a seed. Writes, new tokens and faults are all
//! events; the run (`world`) plays them on simulated time. Times are in ms from the start.

use std::time::Duration;

use super::rng::Rng;
use super::store::LinkFault;

/// `D`, the in-flight deadline (`fencing.inflight_deadline_ms`): the smallest a shared store
/// accepts, so that every bound is as tight as fencegate allows.
pub const DEADLINE: Duration = Duration::from_millis(D_MS);
pub const D_MS: u64 = 1_000;
/// `store.timeout_ms`, below `D/4` as `check-config` asks.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(100);
/// `upstream.request_timeout_ms`, below `D` as `check-config` asks.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(800);
/// How long the events of a schedule spread over; the run goes on `4 D` past it.
pub const SPAN_MS: u64 = 8 * D_MS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One process at a time on an embedded store file, restarted by the operator.
    Embedded,
    /// Replicas sharing a Redis store.
    Shared { replicas: usize },
}

#[derive(Debug, Clone)]
pub struct Schedule {
    pub seed: u64,
    pub mode: Mode,
    /// Every replica given one `store.replica_id` (one config file for all).
    pub same_replica_id: bool,
    /// How much faster the store's clock runs than the replicas', ppm (negative: slower).
    pub store_rate_ppm: i64,
    pub events: Vec<Event>,
}

#[derive(Debug, Clone)]
pub struct Event {
    pub at_ms: u64,
    pub what: What,
}

#[derive(Debug, Clone)]
pub enum What {
    Write(Write),
    /// A new holder's token: the issuer's next (its writes raise the fence), registered first
    /// (`PUT /v1/fences`), or granted as a lease by fencegate.
    NewToken {
        replica: usize,
        via: Via,
    },
    Kill {
        replica: usize,
    },
    /// A clean stop (SIGTERM) that waits for writes in flight at most `budget_ms`.
    Stop {
        replica: usize,
        budget_ms: u64,
    },
    Start {
        replica: usize,
    },
    /// The host rebooted: the process dies and the boot clock's id changes.
    Reboot {
        replica: usize,
    },
    /// Stopped or suspended for a while: it sends and reads nothing meanwhile.
    Pause {
        replica: usize,
        ms: u64,
    },
    Link {
        replica: usize,
        fault: LinkFault,
        ms: u64,
    },
    /// The store crashed and restarts from its append-only file, or fails over to a replica
    /// that confirmed every change (`store.wait_replicas`): down for a while, nothing lost.
    StoreDown {
        ms: u64,
    },
    /// The store lost its state (flushed, restarted empty).
    Flush,
    /// The operator runs `fencegate init-store`.
    InitStore,
    /// The operator runs `fencegate reconcile --apply=raise_fence`: the fence goes up to the
    /// highest stamp the upstream holds.
    Reconcile {
        replica: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Issuer,
    Register,
    Lease { ttl_ms: u64 },
}

#[derive(Debug, Clone, Copy)]
pub struct Write {
    pub replica: usize,
    /// How many tokens behind the newest one the writer is (0: the newest holder).
    pub behind: u64,
    pub object: u8,
    /// How long the client takes to send the body.
    pub body_ms: u64,
    pub upstream: Plan,
}

/// What the upstream does with a request it received whole.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub answer: Answer,
    /// When it answers, after receiving the request.
    pub answer_ms: u64,
    /// When it commits, after receiving the request (always before `D`), if it does.
    pub commit_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Ok,
    PreconditionFailed,
    ServerError,
    Accepted,
    /// The connection breaks after the request was sent.
    Reset,
    /// The connection could not be opened: nothing was sent.
    Refused,
}

impl Schedule {
    pub fn replicas(&self) -> usize {
        match self.mode {
            Mode::Embedded => 1,
            Mode::Shared { replicas } => replicas,
        }
    }

    /// The schedule a seed names.
    pub fn generate(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mode =
            if rng.chance(40) { Mode::Embedded } else { Mode::Shared { replicas: *rng.pick(&[1, 2, 2, 2, 3, 3]) } };
        let replicas = match mode {
            Mode::Embedded => 1,
            Mode::Shared { replicas } => replicas,
        };
        let same_replica_id = replicas > 1 && rng.chance(50);
        // Up to the drift the margin is sized for (`fence::CLOCK_RATE_DRIFT_MAX`), and a third of
        // the time exactly at it, the store's clock fast (its registrations expire early).
        let drift_max = (crate::fence::CLOCK_RATE_DRIFT_MAX * 1e6) as i64;
        let store_rate_ppm = match (mode, rng.below(3)) {
            (Mode::Embedded, _) => 0,
            (_, 0) => drift_max,
            _ => rng.within(0, 2 * drift_max as u64) as i64 - drift_max,
        };
        let mut events = Vec::new();
        for _ in 0..rng.within(20, 60) {
            let at_ms = rng.below(SPAN_MS);
            events.push(Event { at_ms, what: What::Write(write(&mut rng, replicas)) });
        }
        for _ in 0..rng.within(2, 8) {
            let via = match rng.below(10) {
                0..=3 => Via::Issuer,
                4..=6 => Via::Register,
                _ => Via::Lease { ttl_ms: rng.within(100, 3 * D_MS) },
            };
            events.push(Event {
                at_ms: rng.below(SPAN_MS),
                what: What::NewToken { replica: pick(&mut rng, replicas), via },
            });
        }
        let flush_only = mode == (Mode::Shared { replicas: 1 }) && rng.chance(40);
        for _ in 0..rng.within(0, 6) {
            faults(&mut rng, mode, flush_only, &mut events);
        }
        events.sort_by_key(|event| event.at_ms);
        Self { seed, mode, same_replica_id, store_rate_ppm, events }
    }
}

fn pick(rng: &mut Rng, replicas: usize) -> usize {
    usize::try_from(rng.below(replicas as u64)).unwrap_or(0)
}

/// A duration that sits on one of the bounds (`H`, `H/2`, `3D/4`, `D`, `E`, the store's and the
/// write's timeouts) a few ms either side, or anywhere up to `2 D`.
fn around_bounds(rng: &mut Rng) -> u64 {
    let h = D_MS / 4;
    let e = D_MS + h + D_MS / 8;
    if rng.chance(50) {
        let request_timeout = REQUEST_TIMEOUT.as_millis() as u64;
        let bound = *rng.pick(&[h, h / 2, D_MS, e, 3 * D_MS / 4, 100, request_timeout]);
        (bound + rng.below(40)).saturating_sub(20)
    } else {
        rng.below(2 * D_MS)
    }
}

fn write(rng: &mut Rng, replicas: usize) -> Write {
    let behind = if rng.chance(70) { 0 } else { rng.within(1, 3) };
    let body_ms = match rng.below(10) {
        0..=3 => rng.below(20),
        4..=6 => rng.below(D_MS),
        _ => around_bounds(rng),
    };
    let commit = |rng: &mut Rng| match rng.below(10) {
        0..=3 => D_MS - rng.within(1, 5),
        4..=6 => rng.below(D_MS),
        _ => rng.below(50),
    };
    let answer = *rng.pick(&[
        Answer::Ok,
        Answer::Ok,
        Answer::Ok,
        Answer::PreconditionFailed,
        Answer::ServerError,
        Answer::ServerError,
        Answer::Accepted,
        Answer::Reset,
        Answer::Refused,
    ]);
    let upstream = match answer {
        Answer::Ok => {
            let commit_ms = commit(rng);
            Plan { answer, answer_ms: commit_ms + rng.below(20), commit_ms: Some(commit_ms) }
        }
        Answer::PreconditionFailed | Answer::Refused => Plan { answer, answer_ms: rng.below(50), commit_ms: None },
        Answer::ServerError | Answer::Accepted | Answer::Reset => {
            // A third answer at once: the hold then starts as early as it can, and a commit at
            // `D` minus a few ms is at its edge.
            let commit_ms = rng.chance(60).then(|| commit(rng));
            let answer_ms = if rng.chance(33) { rng.below(5) } else { rng.below(2 * D_MS) };
            Plan { answer, answer_ms, commit_ms }
        }
    };
    Write { replica: pick(rng, replicas), behind, object: u8::try_from(rng.below(3)).unwrap_or(0), body_ms, upstream }
}

/// One fault (or one routine of the operator's) into `events`.
fn faults(rng: &mut Rng, mode: Mode, flush_only: bool, events: &mut Vec<Event>) {
    let replicas = match mode {
        Mode::Embedded => 1,
        Mode::Shared { replicas } => replicas,
    };
    let replica = pick(rng, replicas);
    let at_ms = rng.below(SPAN_MS);
    let mut at = |offset: u64, what: What| events.push(Event { at_ms: at_ms + offset, what });
    let restart_after = |rng: &mut Rng| if rng.chance(60) { rng.below(D_MS) } else { rng.within(D_MS, 3 * D_MS) };
    let kind = if flush_only { 5 + rng.below(5) } else { rng.below(10) };
    match kind {
        0 => {
            let later = restart_after(rng);
            at(0, What::Kill { replica });
            at(later, What::Start { replica });
        }
        1 => {
            let budget_ms = around_bounds(rng);
            let later = restart_after(rng);
            at(0, What::Stop { replica, budget_ms });
            at(later.max(budget_ms) + rng.below(50), What::Start { replica });
        }
        2 => {
            // The operator's routine within D: a crash, a start, a clean stop, a start.
            let (a, b, c) = (rng.below(D_MS / 4), rng.within(D_MS / 4, D_MS / 2), rng.within(D_MS / 2, D_MS));
            at(0, What::Kill { replica });
            at(a, What::Start { replica });
            at(b, What::Stop { replica, budget_ms: rng.below(200) });
            at(c, What::Start { replica });
        }
        3 => {
            at(0, What::Reboot { replica });
            at(restart_after(rng), What::Start { replica });
        }
        4 => at(0, What::Reconcile { replica }),
        5 => at(0, What::Pause { replica, ms: around_bounds(rng) }),
        6 | 7 if mode != Mode::Embedded => {
            let fault = match rng.below(3) {
                0 => LinkFault::Cut,
                1 => LinkFault::OneWay,
                _ => LinkFault::Delay(rng.within(1, 200)),
            };
            at(0, What::Link { replica, fault, ms: around_bounds(rng) });
        }
        8 if mode != Mode::Embedded => at(0, What::StoreDown { ms: around_bounds(rng) }),
        // With several replicas, or restarts, `init-store` after a loss is the misuse its
        // message warns of (a replica that knew no mark cannot tell): only the flush.
        9 if mode != Mode::Embedded && !flush_only => at(0, What::Flush),
        9 if flush_only => {
            at(0, What::Flush);
            if rng.chance(50) {
                at(rng.below(D_MS), What::InitStore);
            }
        }
        _ => at(0, What::Pause { replica, ms: around_bounds(rng) }),
    }
}
