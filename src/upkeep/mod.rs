//! The operator's jobs, apart from any request: the reconciliation of the upstream with the
//! fences (`reconcile.rs`, asked for through `crate::jobs` by the admin listener and
//! `fencegate reconcile`) and the sweep of upload records (`sweep.rs`). Both run over
//! [`Upkeep`], which holds only what they read and write: the fence store through the gate, the
//! upstream through a bounded hop, the rules that name resources, and the clock.

mod reconcile;
mod sweep;

use std::sync::Arc;

pub use self::reconcile::Reconciler;
use crate::fence::{Clock, Gate};
use crate::s3::{Hop, WireContract};

/// What the operator's jobs work with.
pub struct Upkeep {
    gate: Arc<Gate>,
    hop: Hop,
    /// The rules that bind keys to resources (`[[fencing.rules]]`).
    wire: WireContract,
    /// The clock upload records are dated by (the lease service's).
    clock: Arc<dyn Clock>,
}

impl Upkeep {
    pub fn new(gate: Arc<Gate>, hop: Hop, wire: WireContract, clock: Arc<dyn Clock>) -> Self {
        Self { gate, hop, wire, clock }
    }
}
