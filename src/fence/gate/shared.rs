//! The gate over a store shared by several replicas: admissions the store checks and
//! registers in one step, the store's events (advances announced, registrations lost), and
//! the repair of a store found below this replica's mark.

use super::*;

impl Gate {
    /// `settle` for a store shared by several replicas: the store checks the token and
    /// registers the write in its cross-replica in-flight registry in one step, and answers
    /// "wait" while an older write is in flight on any replica. The slot's fence is this
    /// replica's high-water mark: a token below it is refused whatever the store says, and a
    /// store found below it is raised back (rollback defence).
    pub(super) async fn settle_shared(
        &self,
        shared: &dyn SharedRegistry,
        slot: &Arc<Slot>,
        resource: &ResourceKey,
        token: FenceToken,
        register: Option<Option<CallerId>>,
        may_advance: bool,
    ) -> Result<Option<Permit>, AdmitError> {
        let started = Instant::now();
        let deadline = started + self.limits.inflight_deadline;
        let deadline_ms = millis(self.limits.inflight_deadline);
        self.refuse_below_mark(slot, resource, token)?;
        // Registered locally first, so that an announced advance can cancel it while the
        // store is being asked.
        let permit = register.map(|caller| self.register_locally(slot, token, caller)).transpose()?;
        let mut backoff = Duration::from_millis(1);
        let mut waiting = None;
        // Whether the store raised the fence to this token for this write (while it waited, too).
        let mut raised = false;
        loop {
            let floor = slot.state().fence.flatten();
            // On an error the store withdraws what the call may have registered.
            let call = shared.admit(resource, token, floor, register.is_some(), may_advance, deadline_ms);
            let answer = self.store.call(call).await?;
            match answer {
                SharedAdmit::Unregistered { current, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    if let Some(current) = current {
                        slot.raise_fence(current);
                    }
                    return Err(AdmitError::Unregistered { presented: token, current });
                }
                SharedAdmit::Stale { current } => {
                    slot.raise_fence(current);
                    return Err(AdmitError::Stale { presented: token, current });
                }
                SharedAdmit::OlderInflight { advanced, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    if advanced {
                        raised = true;
                        advanced_while_older_inflight(slot, token);
                    }
                    if Instant::now() >= deadline {
                        return Err(AdmitError::DrainTimeout { waited_ms: millis(started.elapsed()) });
                    }
                    waiting.get_or_insert_with(|| Waiting::on(slot));
                    tokio::time::sleep(backoff.min(deadline - Instant::now())).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                    metrics::drain_wait(started.elapsed());
                }
                SharedAdmit::Admitted { advanced, repaired_from } => {
                    if let Some(had) = repaired_from {
                        rollback_repaired(resource, had, floor);
                    }
                    return Ok(self.admitted_shared(slot, permit, resource, token, raised || advanced, advanced));
                }
            }
        }
    }

    /// The store admitted the write (and advanced the fence for it now, `advanced_now`, or
    /// while it waited: `raised`): its permit holds the registration the store made.
    fn admitted_shared(
        &self,
        slot: &Slot,
        mut permit: Option<Permit>,
        resource: &ResourceKey,
        token: FenceToken,
        raised: bool,
        advanced_now: bool,
    ) -> Option<Permit> {
        if advanced_now {
            metrics::advanced();
        }
        slot.raise_fence(token);
        if let Some(p) = permit.as_mut() {
            p.remote = Some(RemoteTicket { store: self.store.clone(), resource: resource.clone(), token });
            p.advanced = raised;
        }
        permit
    }

    /// A write registered on this replica's slot before the store is asked, within its caller's
    /// budget.
    fn register_locally(
        &self,
        slot: &Arc<Slot>,
        token: FenceToken,
        caller: Option<CallerId>,
    ) -> Result<Permit, AdmitError> {
        let mut state = slot.state();
        self.check_budget(&state, caller)?;
        self.track_inflight(slot, &mut state, token, caller)
    }

    /// Acts on what a shared store reports by itself: an advance announced by another replica
    /// (or seen at a renewal) cuts off older uploads still streaming here at once, without
    /// waiting for their next store call; a registration this replica could not keep stops its
    /// writes that have not sent their whole body (`docs/design.md`, section 6).
    pub fn listen_for_store_events(self: &Arc<Self>) {
        let Some(mut events) = self.store.shared().and_then(|s| s.take_events()) else { return };
        let gate = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(event) = events.recv().await {
                let Some(gate) = gate.upgrade() else { return };
                let resource = match &event {
                    StoreEvent::Advanced { resource, .. } | StoreEvent::Revoked { resource, .. } => resource,
                };
                let slot = gate.slots.lock().expect("gate map lock poisoned").get(resource).cloned();
                let Some(slot) = slot else { continue };
                match event {
                    StoreEvent::Advanced { fence, .. } => {
                        let mark = slot.state().fence.flatten(); // not held into the repair
                        if let Some(mark) = mark
                            && fence < mark
                        {
                            // Some replica set the store below what this one has seen.
                            gate.repair_in_background(&slot, resource, mark);
                        }
                        slot.raise_fence(fence);
                        slot.state().cancel_unsent_older(fence);
                    }
                    StoreEvent::Revoked { token, .. } => {
                        tracing::warn!(
                            resource = resource.as_str(),
                            token = token.0,
                            "in-flight registration lost or not renewed in time: stopping this replica's unsent writes"
                        );
                        slot.state().cancel_unsent(CutOff::Revoked, |t| t <= token);
                    }
                }
                slot.changed.notify_waiters();
            }
        });
    }

    /// Asks a shared store, without waiting, to come back up to `mark` (at most once per
    /// [`REPAIR_EVERY`] per resource); a store found below it is counted and logged.
    pub(super) fn repair_in_background(&self, slot: &Arc<Slot>, resource: &ResourceKey, mark: FenceToken) {
        if self.store.shared().is_none() {
            return;
        }
        {
            let mut state = slot.state();
            let now = Instant::now();
            if state.repair_asked.is_some_and(|at| now.duration_since(at) < REPAIR_EVERY) {
                return;
            }
            state.repair_asked = Some(now);
        }
        let (store, resource) = (self.store.clone(), resource.clone());
        let slot = slot.clone();
        tokio::spawn(async move {
            match store.advance(&resource, mark).await {
                Ok(AdvanceOutcome::Advanced { previous }) => rollback_repaired(&resource, previous, Some(mark)),
                Ok(AdvanceOutcome::Unchanged { .. }) => {}
                Err(error) => {
                    tracing::warn!(%error, resource = resource.as_str(), "could not check the store against this replica's mark");
                    slot.state().repair_asked = None; // the next refusal asks again
                }
            }
        });
    }
}

/// The store advanced the fence to `token` while an older write is still in flight: older
/// writes not yet sent here are cut off at once.
fn advanced_while_older_inflight(slot: &Slot, token: FenceToken) {
    metrics::advanced();
    slot.raise_fence(token);
    slot.state().cancel_unsent_older(token);
}
