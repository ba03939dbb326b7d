//! The fence core: tokens, the pure decision, the store trait and the gate that orders writes.

mod decision;
mod gate;
mod lease;
mod store;
mod token;

pub use decision::{Decision, decide};
pub use gate::{AdmitError, Gate, GateLimits, Permit};
pub use lease::{LeaseCommand, LeaseOutcome, LeaseRecord, LeaseTransition, LeaseWrite, apply_lease};
pub use store::{AdvanceOutcome, FenceStore, SharedAdmit, SharedRegistry, StoreError};
pub use token::{FenceToken, RESOURCE_BYTES_MAX, ResourceKey, ResourceKeyError, TokenParseError};
