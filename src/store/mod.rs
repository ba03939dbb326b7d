//! Fence stores: where fences live durably.

mod embedded;
pub(crate) mod epoch;
#[cfg(feature = "etcd")]
mod etcd;
mod memory;
mod redis;
pub(crate) mod registrations;
pub(crate) mod shared;

pub use embedded::{
    Accepted as AcceptedStore, DEFAULT_CACHE_BYTES, EmbeddedStore, IDEMPOTENCY_RECORDS_MAX, OpenError,
    Options as EmbeddedOptions,
};
#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;
pub use memory::MemoryStore;
pub use redis::durability::{lapses as redis_durability_lapses, without_secrets as redis_url_without_secrets};
pub use redis::{ANNOUNCE_CHANNEL, RedisStore, Wait};
