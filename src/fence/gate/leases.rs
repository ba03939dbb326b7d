//! Leases through the gate: a grant raises the fence in the same store step (G7), and a
//! grant whose answer was lost is withdrawn.

use super::*;

/// How long the withdrawal of a grant whose outcome is unknown is sent again while the store
/// does not answer (see `Gate::withdraw_grant`): half the time its tombstone is kept, so the
/// tombstone outlives any grant the store can still apply after it.
pub(super) const WITHDRAW_FOR: Duration = Duration::from_millis(crate::fence::WITHDRAWN_GRANT_TTL_MS / 2);

/// Withdrawals in the background at most. One more is sent once, inline, and then left: a
/// grant it misses, if applied, expires with its TTL.
pub(super) const WITHDRAWALS_MAX: usize = 1024;

impl Gate {
    /// Applies a lease command. A grant raises the fence in the same store step: from then on
    /// every older token is rejected (G7), and older uploads still streaming are cancelled.
    pub async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, AdmitError> {
        let slot = self.slot(resource);
        let mut command = command;
        if let LeaseCommand::Acquire { floor, .. } = &mut command {
            // While no fence may advance (after an unclean start), a grant is refused at once
            // with the time to retry: a caller waiting D for it gives up first (5 s, for
            // `fencegate-lease`), and retries anyway.
            let holding = *self.writes_from.lock().expect("gate lock poisoned");
            if let Some(from) = holding.filter(|from| *from > Instant::now()) {
                // A live lease is still answered as held: its holder's rival learns that, not
                // to come back in a moment.
                if let Some(live) = self.store.lease_record(resource).await?.filter(|l| l.is_live(now_ms)) {
                    return Ok(LeaseOutcome::Held { remaining_ms: live.expires_at_ms - now_ms, holder: live.holder });
                }
                let retry_after_ms = millis(from.saturating_duration_since(Instant::now())).max(1);
                return Err(AdmitError::StoreUnavailable(StoreError::UncleanStart { retry_after_ms }));
            }
            // A grant is above every token this replica has seen, whatever the store says.
            *floor = (*floor).max(slot.state().fence.flatten());
        }
        let granting = match &command {
            LeaseCommand::Acquire { lease_id, .. } => Some(lease_id.clone()),
            _ => None,
        };
        let outcome = {
            let _io = slot.io.lock().await;
            let outcome = match self.store.lease(resource, command, now_ms).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    if let (Some(lease_id), StoreError::Timeout { .. } | StoreError::Backend(_)) = (granting, &error) {
                        self.withdraw_grant(resource, lease_id, now_ms);
                    }
                    return Err(error.into());
                }
            };
            if let LeaseOutcome::Granted(lease) = &outcome {
                let mut state = slot.state();
                let fence = state.fence.flatten().max(Some(lease.token));
                state.fence = Some(fence);
                // Older uploads still streaming are cut off now; the new holder's own writes
                // wait for the rest at admission. The grant is answered without waiting, so a
                // slow older write cannot turn a stored grant into an error for its holder.
                state.cancel_unsent_older(lease.token);
                drop(state);
                metrics::advanced();
                slot.changed.notify_waiters();
            }
            outcome
        };
        Ok(outcome)
    }

    /// A grant answered with an error whose outcome is unknown (the store did not answer in
    /// time, or its connection broke after the call was sent) may still be applied: nobody was
    /// told its lease id, so a lease it made would be held by no one for its whole TTL (a ghost
    /// lease, seen when Redis stalled). It is withdrawn ([`LeaseCommand::Withdraw`]), again
    /// until the store answers, for at most [`WITHDRAW_FOR`]: the withdrawal removes the
    /// lease if the grant was applied, and leaves a tombstone that a grant applied after it
    /// finds and does nothing (the grant's bytes may reach a shared store after the withdrawal's,
    /// on a connection that broke).
    pub(super) fn withdraw_grant(&self, resource: &ResourceKey, lease_id: String, now_ms: u64) {
        let (store, resource) = (self.store.clone(), resource.clone());
        metrics::lease_event("grant_withdrawn");
        let pending = self.withdrawals.clone();
        let until = if pending.fetch_add(1, Ordering::AcqRel) < WITHDRAWALS_MAX {
            Instant::now() + WITHDRAW_FOR
        } else {
            metrics::lease_event("grant_withdrawal_capped");
            Instant::now()
        };
        tokio::spawn(async move {
            let _pending = DecrementOnDrop(pending);
            let mut pause = Duration::from_millis(100);
            loop {
                let withdraw = LeaseCommand::Withdraw { lease_id: lease_id.clone() };
                match store.lease(&resource, withdraw, now_ms).await {
                    Ok(_) => return,
                    Err(error) => tracing::debug!(%error, resource = resource.as_str(), "withdrawing a grant"),
                }
                if Instant::now() + pause >= until {
                    break;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            tracing::warn!(
                resource = resource.as_str(),
                "a grant answered with an error could not be withdrawn: if it was applied, its lease expires by itself"
            );
        });
    }
}

/// Counts one pending withdrawal down when its task ends.
struct DecrementOnDrop(Arc<AtomicUsize>);

impl Drop for DecrementOnDrop {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
