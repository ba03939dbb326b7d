//! A process's connection to the simulated store: the schedule's faults cut it, make it
//! one-way (calls arrive, answers are lost), delay it, or freeze it while the process is
//! paused; a killed process's calls never end.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::store::{Backend, StoreState};
use crate::fence::StoreError;

/// One process's connection to the store.
#[derive(Default)]
pub struct Link {
    dead: AtomicBool,
    faults: Mutex<LinkFaults>,
}

#[derive(Default, Clone, Copy)]
struct LinkFaults {
    /// The process is paused (stopped, suspended) until then: it sends and reads nothing.
    frozen_until: Option<Instant>,
    cut_until: Option<Instant>,
    one_way_until: Option<Instant>,
    delay_until: Option<(Instant, Duration)>,
}

/// How a link fails for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFault {
    /// Nothing gets through either way.
    Cut,
    /// Calls reach the store, answers are lost.
    OneWay,
    /// Every call and answer takes this long more.
    Delay(u64),
}

impl Link {
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    pub fn freeze(&self, until: Instant) {
        let mut faults = self.faults.lock().expect("link");
        faults.frozen_until = faults.frozen_until.max(Some(until));
    }

    pub fn fail(&self, fault: LinkFault, until: Instant) {
        let mut faults = self.faults.lock().expect("link");
        match fault {
            LinkFault::Cut => faults.cut_until = Some(until),
            LinkFault::OneWay => faults.one_way_until = Some(until),
            LinkFault::Delay(ms) => faults.delay_until = Some((until, Duration::from_millis(ms))),
        }
    }

    fn now(&self) -> LinkFaults {
        *self.faults.lock().expect("link")
    }

    /// Waits while the process is paused; `false` if it died meanwhile.
    pub async fn thawed(&self) -> bool {
        loop {
            if self.is_dead() {
                return false;
            }
            match self.now().frozen_until.filter(|until| *until > Instant::now()) {
                Some(until) => tokio::time::sleep_until(until).await,
                None => return true,
            }
        }
    }

    /// Whether a message from the store gets through now, and after what delay.
    pub(super) async fn deliverable(&self) -> Option<Duration> {
        if !self.thawed().await {
            return None;
        }
        let faults = self.now();
        let now = Instant::now();
        if faults.cut_until.is_some_and(|until| until > now) || faults.one_way_until.is_some_and(|until| until > now) {
            return None;
        }
        Some(faults.delay_until.filter(|(until, _)| *until > now).map_or(Duration::ZERO, |(_, delay)| delay))
    }

    /// One call: `op` runs on the store's state (atomically, as a script does) if the call
    /// reaches it; the answer comes back unless the link loses it. A dead process's call never
    /// ends; every other one ends by `timeout` (the client's).
    pub async fn call<T>(
        &self,
        backend: &Backend,
        timeout: Duration,
        op: impl FnOnce(&mut StoreState) -> T,
    ) -> Result<T, StoreError> {
        if self.is_dead() {
            std::future::pending::<()>().await;
        }
        let attempt = async {
            if !self.thawed().await {
                std::future::pending::<()>().await;
            }
            let faults = self.now();
            let now = Instant::now();
            let delay = faults.delay_until.filter(|(until, _)| *until > now).map_or(Duration::ZERO, |(_, d)| d);
            if faults.cut_until.is_some_and(|until| until > now) {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(delay / 2).await;
            let answer = {
                let mut state = backend.state();
                if state.down_until.is_some_and(|until| until > Instant::now()) {
                    return Err(StoreError::Backend("connection refused (simulated store down)".into()));
                }
                op(&mut state)
            };
            if faults.one_way_until.is_some_and(|until| until > Instant::now()) {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(delay - delay / 2).await;
            if !self.thawed().await {
                std::future::pending::<()>().await;
            }
            Ok(answer)
        };
        match tokio::time::timeout(timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout { after_ms: crate::fence::millis(timeout) }),
        }
    }
}
