//! Fence stores: where fences live durably.

mod embedded;
mod memory;

pub use embedded::{EmbeddedStore, OpenError};
pub use memory::MemoryStore;
