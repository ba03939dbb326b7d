//! The replicas that share this one's store, as `/v1/status` lists them. Each replica of a
//! shared store notes in it that it is up every [`HEARTBEAT`] and forgets itself when it
//! stops; a replica not seen for [`SEEN_WITHIN`] (killed, cut off) drops out of the list. The
//! times are each replica's wall clock: clocks apart by more than `SEEN_WITHIN` minus
//! `HEARTBEAT` hide a live replica (it is only a view: nothing is decided by it).

use std::sync::Arc;
use std::time::Duration;

use crate::fence::{Clock, SystemClock};
use crate::fence::{Gate, millis};

/// How often a replica says it is up.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// A replica last seen longer ago than this is not listed.
pub const SEEN_WITHIN: Duration = Duration::from_secs(15);

/// Says this replica is up, every [`HEARTBEAT`], for as long as it runs (a shared store only).
pub async fn keep_telling(gate: Arc<Gate>, id: Arc<str>) {
    if !gate.is_shared() {
        return;
    }
    let mut failing = false;
    loop {
        match gate.listings().replica_seen(&id, SystemClock.now_ms()).await {
            Ok(()) => failing = false,
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(%error, "cannot note this replica as up in the store; trying again");
            }
            Err(_) => {}
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

/// Forgets this replica in a shared store (it stops), best effort and within `within` (the
/// stop's budget): otherwise it drops out of the list [`SEEN_WITHIN`] after its last word.
pub async fn forget(gate: &Gate, id: &str, within: Duration) {
    if !gate.is_shared() {
        return;
    }
    match tokio::time::timeout(within, gate.listings().replica_gone(id)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::debug!(%error, "cannot remove this replica from the store's list"),
        Err(_) => tracing::debug!("removing this replica from the store's list took too long"),
    }
}

/// This replica and the others the store saw lately, by id.
pub async fn seen(gate: &Gate, own: &str) -> Vec<String> {
    let since = SystemClock.now_ms().saturating_sub(millis(SEEN_WITHIN));
    let mut ids: Vec<String> = match gate.listings().replicas(since).await {
        Ok(seen) => seen.into_iter().map(|(id, _)| id).collect(),
        Err(_) => Vec::new(), // the store's own health says why
    };
    if !ids.iter().any(|id| id == own) {
        ids.push(own.to_owned());
    }
    ids.sort();
    ids.truncate(crate::fence::REPLICAS_LISTED_MAX);
    ids
}
