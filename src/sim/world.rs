//! One run of a schedule: a current-thread tokio runtime on paused time (it jumps to the next
//! timer whenever every task waits, so a run of seconds takes microseconds and always goes the
//! same way), the simulated store and upstream, and fencegate's own gate in each process,
//! opened and closed by the code `serve` uses (`app::open_gate`, `app::close_gate`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::check::{Happened, Record};
use super::schedule::{self, Answer, Event, Mode, Schedule, Via, What, Write};
use super::store::{Backend, Link, SimStore};
use super::upstream::{self, Failed};
use crate::fence::outcome::{Bounded, bounded_call};
use crate::fence::{
    AdmitError, BootInstant, Clock, FenceToken, Gate, GateLimits, LeaseCommand, LeaseOutcome, Permit, Registered,
    ResourceKey, Store,
};

/// What happened, in order, stamped with the simulated time.
pub struct Log {
    origin: Instant,
    records: Mutex<Vec<Record>>,
}

impl Log {
    fn new() -> Arc<Self> {
        Arc::new(Self { origin: Instant::now(), records: Mutex::default() })
    }

    pub fn now_ms(&self) -> u64 {
        crate::fence::millis(Instant::now().duration_since(self.origin))
    }

    pub fn record(&self, what: Happened) {
        let at = self.now_ms();
        let mut records = self.records.lock().expect("log");
        let seq = records.len() as u64;
        records.push(Record { at, seq, what });
    }

    /// Now, as a call asks: the ms, and how many records were made before (every one of
    /// them happened before the call was asked).
    pub fn ask(&self) -> (u64, u64) {
        (self.now_ms(), self.records.lock().expect("log").len() as u64)
    }

    fn note(&self, note: String) {
        self.record(Happened::Note(note));
    }

    fn take(&self) -> Vec<Record> {
        std::mem::take(&mut *self.records.lock().expect("log"))
    }
}

/// The wall clock and boot clock the processes read: simulated, with a boot id that a reboot
/// changes.
struct SimClock {
    boot_id: AtomicU64,
    origin: Instant,
}

impl Clock for SimClock {
    fn now_ms(&self) -> u64 {
        1_800_000_000_000 + crate::fence::millis(Instant::now().duration_since(self.origin))
    }

    fn boot(&self) -> Option<(u64, u64)> {
        Some((self.boot_id.load(Ordering::SeqCst), BootInstant::now().as_millis()))
    }
}

/// A running fencegate process.
struct Process {
    gate: Arc<Gate>,
    store: Arc<SimStore>,
    link: Arc<Link>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Process {
    /// SIGKILL: its tasks end where they are, its connection goes dead. What it handed to the
    /// upstream still commits there.
    fn kill(&self) {
        self.link.kill();
        for task in self.tasks.lock().expect("tasks").drain(..) {
            task.abort();
        }
    }

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(task);
        self.tasks.lock().expect("tasks").push(handle.abort_handle());
    }
}

struct Replica {
    id: String,
    process: Option<Process>,
    /// A clean stop under way: a start before it ends kills it (as a supervisor does).
    stopping: Option<(Process, tokio::task::JoinHandle<()>)>,
}

/// The result of one run.
pub struct Run {
    pub records: Vec<Record>,
}

/// Plays `schedule` to its end and `4 D` past it.
pub fn run(schedule: &Schedule) -> Run {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    super::seed_draws(schedule.seed);
    let records = runtime.block_on(async {
        let mut world = World::new(schedule);
        world.play(&schedule.events).await;
        tokio::time::sleep(Duration::from_millis(4 * schedule::D_MS)).await;
        let fence = world.backend.state().fence.map(|fence| fence.0);
        world.log.record(Happened::End { fence });
        world.log.take()
    });
    drop(runtime);
    Run { records }
}

struct World {
    resource: ResourceKey,
    backend: Arc<Backend>,
    log: Arc<Log>,
    clock: Arc<SimClock>,
    replicas: Vec<Replica>,
    /// The newest token handed to a holder so far.
    newest: Arc<AtomicU64>,
    next_write: u64,
    next_lease: u64,
    inits: u64,
    /// Whether every replica lives through a loss of the store's state remembering what it
    /// acknowledged (one replica, not restarted in the schedule).
    remembered_through_loss: bool,
}

fn limits() -> GateLimits {
    GateLimits { inflight_deadline: schedule::DEADLINE, store_timeout: schedule::STORE_TIMEOUT, ..Default::default() }
}

impl World {
    fn new(schedule: &Schedule) -> Self {
        let resource = ResourceKey::new("jobs/nightly").expect("a resource name");
        let shared = schedule.mode != Mode::Embedded;
        let backend = Backend::new(shared, schedule.store_rate_ppm, schedule.seed, resource.clone());
        if shared {
            // `fencegate init-store` ran once when the store was made.
            backend.state().epoch = Some("init-0".to_owned());
        }
        let replicas = (0..schedule.replicas())
            .map(|i| Replica {
                id: if schedule.same_replica_id { "fencegate".to_owned() } else { format!("replica-{i}") },
                process: None,
                stopping: None,
            })
            .collect();
        let clock = Arc::new(SimClock { boot_id: AtomicU64::new(1), origin: Instant::now() });
        let mut world = Self {
            resource,
            backend,
            log: Log::new(),
            clock,
            replicas,
            newest: Arc::new(AtomicU64::new(1)),
            next_write: 1,
            next_lease: 1,
            inits: 0,
            remembered_through_loss: schedule.replicas() == 1
                && !schedule.events.iter().any(|e| {
                    matches!(e.what, What::Start { .. } | What::Kill { .. } | What::Reboot { .. } | What::Stop { .. })
                }),
        };
        for replica in 0..world.replicas.len() {
            world.start(replica);
        }
        world
    }

    async fn play(&mut self, events: &[Event]) {
        let origin = self.log.origin;
        for event in events {
            tokio::time::sleep_until(origin + Duration::from_millis(event.at_ms)).await;
            self.act(&event.what);
        }
    }

    fn act(&mut self, what: &What) {
        match what {
            What::Write(write) => self.write(*write),
            What::NewToken { replica, via } => self.new_token(*replica, *via),
            What::Kill { replica } => {
                self.log.note(format!("replica {replica} killed"));
                self.kill(*replica);
            }
            What::Stop { replica, budget_ms } => self.stop(*replica, *budget_ms),
            What::Start { replica } => self.start(*replica),
            What::Reboot { replica } => {
                self.log.note(format!("replica {replica}'s host rebooted"));
                self.kill(*replica);
                self.clock.boot_id.fetch_add(1, Ordering::SeqCst);
            }
            What::Pause { replica, ms } => {
                self.log.note(format!("replica {replica} paused for {ms} ms"));
                if let Some(process) = &self.replicas[*replica].process {
                    process.link.freeze(Instant::now() + Duration::from_millis(*ms));
                }
            }
            What::Link { replica, fault, ms } => {
                self.log.note(format!("replica {replica}'s store link: {fault:?} for {ms} ms"));
                if let Some(process) = &self.replicas[*replica].process {
                    process.link.fail(*fault, Instant::now() + Duration::from_millis(*ms));
                }
            }
            What::StoreDown { ms } => {
                self.log.note(format!("store down for {ms} ms (restarts from its append-only file)"));
                self.backend.state().down_until = Some(Instant::now() + Duration::from_millis(*ms));
            }
            What::Flush => {
                self.log.record(Happened::StoreLostState { remembered: self.remembered_through_loss });
                *self.backend.state() = Default::default();
            }
            What::InitStore => {
                // `SET NX`: a mark only where none is.
                self.inits += 1;
                self.log.note("operator ran init-store".to_owned());
                let mut state = self.backend.state();
                state.epoch = state.epoch.take().or_else(|| Some(format!("init-{}", self.inits)));
            }
            What::Reconcile { replica } => self.reconcile(*replica),
        }
    }

    fn kill(&mut self, replica: usize) {
        let slot = &mut self.replicas[replica];
        if let Some(process) = slot.process.take() {
            process.kill();
        }
        if let Some((process, stop)) = slot.stopping.take() {
            stop.abort();
            process.kill();
        }
    }

    fn start(&mut self, replica: usize) {
        self.kill(replica);
        let link = Arc::new(Link::default());
        let store = Arc::new(SimStore::open(self.backend.clone(), link.clone(), &self.replicas[replica].id));
        let dyn_store: Arc<dyn Store> = store.clone();
        let gate = crate::app::open_gate(dyn_store, limits(), self.clock.as_ref(), schedule::D_MS)
            .expect("the simulated store records a hold");
        let hold = gate.hold_remaining().map_or(0, crate::fence::millis);
        self.log.note(format!("replica {replica} started (holds advances for {hold} ms)"));
        self.replicas[replica].process = Some(Process { gate, store, link, tasks: Arc::default() });
    }

    fn stop(&mut self, replica: usize, budget_ms: u64) {
        let Some(process) = self.replicas[replica].process.take() else { return };
        self.log.note(format!("replica {replica} stopping cleanly (budget {budget_ms} ms)"));
        let (gate, store, log) = (process.gate.clone(), process.store.clone(), self.log.clone());
        let link = process.link.clone();
        let stop = tokio::spawn(async move {
            let stop_by = Instant::now() + Duration::from_millis(budget_ms);
            crate::app::close_gate(&gate, store.as_ref(), schedule::DEADLINE, stop_by).await;
            link.kill();
            log.note(format!("replica {replica} stopped"));
        });
        self.replicas[replica].stopping = Some((process, stop));
    }

    fn token(&self, behind: u64) -> u64 {
        self.newest.load(Ordering::SeqCst).saturating_sub(behind).max(1)
    }

    fn write(&mut self, write: Write) {
        let id = self.next_write;
        self.next_write += 1;
        let token = self.token(write.behind);
        let Some(process) = &self.replicas[write.replica].process else {
            self.log.note(format!("write {id} token {token}: replica {} is down", write.replica));
            return;
        };
        let writer = Writer {
            gate: process.gate.clone(),
            link: process.link.clone(),
            log: self.log.clone(),
            resource: self.resource.clone(),
            backend: self.backend.clone(),
        };
        process.spawn(fenced_write(writer, id, token, write));
    }

    fn new_token(&mut self, replica: usize, via: Via) {
        let (log, resource, newest) = (self.log.clone(), self.resource.clone(), self.newest.clone());
        let lease_id = format!("lease-{}", self.next_lease);
        self.next_lease += 1;
        let now_ms = self.clock.now_ms();
        let Some(process) = &self.replicas[replica].process else { return };
        let gate = process.gate.clone();
        match via {
            Via::Issuer => {
                let token = newest.fetch_add(1, Ordering::SeqCst) + 1;
                log.note(format!("the issuer hands out token {token}"));
            }
            Via::Register => {
                let token = newest.fetch_add(1, Ordering::SeqCst) + 1;
                process.spawn(async move {
                    let (started, asked) = log.ask();
                    let (fence, raised) = match gate.register(&resource, FenceToken(token)).await {
                        Ok(Registered::Raised(fence)) => (fence, true),
                        Ok(Registered::Below(fence)) => (fence, false),
                        Err(error) => return log.note(format!("registration of token {token} failed: {error}")),
                    };
                    let by = format!("replica {replica}");
                    log.record(Happened::Registered { token, fence: fence.0, raised, started, asked, by });
                });
            }
            Via::Lease { ttl_ms } => process.spawn(async move {
                let (started, asked) = log.ask();
                let command = LeaseCommand::Acquire { holder: lease_id.clone(), ttl_ms, lease_id, floor: None };
                match gate.lease(&resource, command, now_ms).await {
                    Ok(LeaseOutcome::Granted(lease)) => {
                        newest.fetch_max(lease.token.0, Ordering::SeqCst);
                        log.record(Happened::Granted { token: lease.token.0, replica, started, asked });
                    }
                    Ok(other) => log.note(format!("lease not granted: {other:?}")),
                    Err(error) => log.note(format!("lease grant failed: {error}")),
                }
            }),
        }
    }

    /// `reconcile --apply=raise_fence`: the fence goes up to the highest stamp committed.
    fn reconcile(&mut self, replica: usize) {
        let records = self.log.records.lock().expect("log").clone();
        let stamp = records
            .iter()
            .filter_map(|r| match r.what {
                Happened::Committed { token, .. } => Some(token),
                _ => None,
            })
            .max();
        let (Some(stamp), Some(process)) = (stamp, &self.replicas[replica].process) else { return };
        let (gate, log, resource) = (process.gate.clone(), self.log.clone(), self.resource.clone());
        log.note(format!("operator raises the fence to the highest stamp, {stamp}, on replica {replica}"));
        process.spawn(async move {
            let (started, asked) = log.ask();
            match gate.advance(&resource, FenceToken(stamp)).await {
                Ok(fence) => log.record(Happened::Registered {
                    token: stamp,
                    fence: fence.0,
                    raised: fence.0 == stamp,
                    started,
                    asked,
                    by: "reconcile".to_owned(),
                }),
                Err(error) => log.note(format!("reconcile could not raise the fence: {error}")),
            }
        });
    }
}

/// What a write needs of its process and the world.
struct Writer {
    gate: Arc<Gate>,
    link: Arc<Link>,
    log: Arc<Log>,
    resource: ResourceKey,
    backend: Arc<Backend>,
}

/// One fenced write as the S3 front makes it: admitted by the gate, its body streamed (cut
/// off at its next chunk when cancelled), handed over only if the permit still allows it, and
/// its upstream call bounded and held as `fence::outcome` does.
async fn fenced_write(writer: Writer, id: u64, token: u64, write: Write) {
    let Writer { gate, link, log, resource, backend } = writer;
    let (started, asked) = log.ask();
    let permit = match gate.admit(&resource, FenceToken(token)).await {
        Ok(permit) => Arc::new(permit),
        Err(error) => {
            let why = match error {
                AdmitError::Stale { current, .. } => format!("stale (fence {current})"),
                other => other.to_string(),
            };
            log.record(Happened::Refused { write: id, token, replica: write.replica, why });
            return;
        }
    };
    let durable = backend.state().fence.map(|fence| fence.0);
    log.record(Happened::Admitted { write: id, token, replica: write.replica, started, asked, durable });
    let deadline = Instant::now() + schedule::REQUEST_TIMEOUT;
    let call = upstream_call(permit.clone(), link, log.clone(), id, token, write);
    let outcome = match bounded_call(&[permit], deadline, schedule::DEADLINE, call).await {
        Bounded::Done(Ok(answer)) => format!("answered {}", answer.status().as_u16()),
        Bounded::Done(Err(failed)) => format!("failed: {failed}"),
        Bounded::CutOff => "cut off at its deadline".to_owned(),
        Bounded::Unknown => "no answer by its deadline: outcome unknown".to_owned(),
    };
    log.record(Happened::Answered { write: id, token, outcome });
}

async fn upstream_call(
    permit: Arc<Permit>,
    link: Arc<Link>,
    log: Arc<Log>,
    id: u64,
    token: u64,
    write: Write,
) -> Result<http::Response<()>, Failed> {
    if write.upstream.answer == Answer::Refused {
        return Err(Failed { delivered: false });
    }
    let cancelled = tokio::select! {
        biased;
        () = permit.cancellation().cancelled() => true,
        () = tokio::time::sleep(Duration::from_millis(write.body_ms)) => false,
    };
    // A paused process hands nothing over until it runs again; the check and the hand-over
    // are one step (a pause between them is the transit that `D` covers).
    if cancelled || !link.thawed().await || !permit.mark_body_sent() {
        log.record(Happened::CutOff { write: id, token });
        return Err(Failed { delivered: false });
    }
    log.record(Happened::HandedOver { write: id, token });
    upstream::receive(log, id, token, write.object, write.upstream).await
}
