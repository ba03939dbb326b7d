//! Fence stores: where fences live durably.

mod embedded;
mod memory;
mod redis;
mod registrations;

pub use embedded::{DEFAULT_CACHE_BYTES, EmbeddedStore, OpenError};
pub use memory::MemoryStore;
pub use redis::{ANNOUNCE_CHANNEL, RedisStore};
