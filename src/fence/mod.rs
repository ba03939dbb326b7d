//! The fence core: tokens, the pure decision, the store trait and the gate that orders writes,
//! and the idempotency records the API gateway keeps in the same store.

mod bounds;
mod decision;
mod gate;
mod idempotency;
mod lease;
pub mod outcome;
mod store;
mod timed;
mod token;

pub use bounds::{BootInstant, CLOCK_RATE_DRIFT_MAX, InflightBounds, SHARED_INFLIGHT_DEADLINE_MS_MIN};
pub use decision::{Decision, decide};
pub use gate::{AdmitError, CallerId, CutOff, Gate, GateLimits, Permit};
pub use idempotency::{
    AmbiguousCause, IdempotencyBegin, IdempotencyKey, IdempotencyOutcome, IdempotencyRecord, RecordedResponse,
    fingerprint,
};
pub use lease::{LeaseCommand, LeaseOutcome, LeaseRecord, LeaseTransition, LeaseWrite, apply_lease};
pub use store::{
    AdvanceOutcome, FenceStore, IdempotencyStore, LeaseStore, SharedAdmit, SharedRegistry, Store, StoreError,
    StoreEvent,
};
pub use timed::{IdempotencyRecords, TimedStore};
pub use token::{FenceToken, RESOURCE_BYTES_MAX, ResourceKey, ResourceKeyError, TokenParseError};
