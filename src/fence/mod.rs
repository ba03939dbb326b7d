//! The fence core: tokens, the pure decision, the store trait and the gate that orders writes,
//! and what else the same store keeps: the API gateway's idempotency records and the multipart
//! uploads made under each token.

mod bounds;
mod budget;
mod clock;
mod decision;
mod gate;
mod idempotency;
mod lease;
pub mod outcome;
mod store;
mod timed;
mod token;
mod uploads;
mod write;

pub use bounds::{BootInstant, CLOCK_RATE_DRIFT_MAX, InflightBounds, SHARED_INFLIGHT_DEADLINE_MS_MIN, millis};
pub use budget::{Full, Keep, Kept, MEMORY_FOR_RECORDS, Owner, RecordLimits, Tally};
pub use clock::{Clock, SystemClock};
pub use decision::{Decision, decide, stale_below};
pub use gate::{AdmitError, CallerId, CutOff, Gate, GateLimits, InflightView, Permit, Registered};
pub use idempotency::{
    AmbiguousCause, IdempotencyBegin, IdempotencyKey, IdempotencyOutcome, IdempotencyRecord, RecordedResponse,
    fingerprint,
};
pub use lease::{
    LeaseCommand, LeaseOutcome, LeaseRecord, LeaseTransition, LeaseWrite, WITHDRAWN_GRANT_TTL_MS, apply_lease,
};
pub use store::{
    AdvanceOutcome, BootHold, FencePage, FenceStore, Hold, IdempotencyStore, LeasePage, LeaseStore, ListingStore, Page,
    REPLICAS_FORGOTTEN_AFTER_MS, REPLICAS_LISTED_MAX, RecordPage, ReplicaAge, ReplicaList, SharedAdmit, SharedRegistry,
    Store, StoreError, StoreEvent, UploadStore, listing_start, replica_age,
};
pub use timed::{IdempotencyRecords, LISTING_TIMEOUT, Listings, TimedStore, UploadRecords};
pub use token::{FenceToken, RESOURCE_BYTES_MAX, ResourceKey, ResourceKeyError, TokenParseError};
pub use uploads::{UploadPage, UploadRecord};
pub use write::{FencedWrite, WriteFailure};
