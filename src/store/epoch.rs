//! A shared store's mark of continuity (`docs/design.md`, section 6, "A store that lost its
//! state"): every Redis Cluster slot holds an epoch key, written once when the store is
//! initialised (`fencegate init-store`) or found without it. A store that lost its data (a
//! `FLUSHALL`, a restart without its append-only file) has lost the marks with the in-flight
//! registrations, so the first script that runs on a slot finds no mark: it writes a new one
//! and starts a quiet period of `E` (a registration's time to live, `fence::bounds`) in which
//! the slot admits no write, raises no fence and grants no lease. Whatever the lost
//! registrations covered was handed over before the loss, so by the one timing assumption it
//! has committed or never will once the quiet period ends.
//!
//! The mark is per slot, not per store, so that a slot's scripts (which may only touch keys of
//! their own slot in a Redis Cluster) can read it. A replica remembers the epoch it last saw
//! per slot, so a mark that changed under it (another replica found the slot empty first) is
//! noticed as a loss too.

use std::sync::{Mutex, OnceLock};

use crate::fence::ResourceKey;

/// Redis Cluster's slots.
pub const SLOTS: usize = 16_384;

/// CRC16/XMODEM, Redis Cluster's key hash.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// The slot of a key whose hash tag is `tag`.
pub fn slot_of_tag(tag: &str) -> u16 {
    // Masked to 14 bits: always below SLOTS.
    crc16(tag.as_bytes()) & 0x3fff
}

/// For every slot, a short hash tag that lands on it (the epoch keys' tags).
fn tags() -> &'static [String] {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    TAGS.get_or_init(|| {
        let mut tags = vec![String::new(); SLOTS];
        let mut missing = SLOTS;
        let mut n: u64 = 0;
        while missing > 0 {
            let tag = format!("e{n:x}");
            let slot = usize::from(slot_of_tag(&tag));
            if tags[slot].is_empty() {
                tags[slot] = tag;
                missing -= 1;
            }
            n += 1;
        }
        tags
    })
}

/// The epoch key and the quiet key of `slot`.
pub fn keys_of_slot(slot: u16) -> (String, String) {
    let tag = &tags()[usize::from(slot)];
    (format!("fg:{{{tag}}}:epoch"), format!("fg:{{{tag}}}:quiet"))
}

/// A new epoch's name.
pub fn new_epoch() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The epoch this replica last saw on each slot (`""`: none yet), and the marks it offers a
/// slot found without one.
pub struct KnownEpochs {
    by_slot: Mutex<Vec<String>>,
    /// This process's own prefix of the marks it offers (random, made once: not per call).
    offer_base: String,
    offers: std::sync::atomic::AtomicU64,
}

impl Default for KnownEpochs {
    fn default() -> Self {
        // A simulation names it from its seed (`sim::draw`), so that a run replays exactly.
        let offer_base = crate::sim::draw().map_or_else(new_epoch, |n| format!("{n:032x}"));
        Self { by_slot: Mutex::new(vec![String::new(); SLOTS]), offer_base, offers: Default::default() }
    }
}

impl KnownEpochs {
    /// A mark no other process and no earlier call of this one offered, for a script to write
    /// if it finds its slot without one.
    pub fn offer(&self) -> String {
        let n = self.offers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}.{n}", self.offer_base)
    }

    pub fn get(&self, slot: u16) -> String {
        self.by_slot.lock().expect("epochs lock")[usize::from(slot)].clone()
    }

    /// The store answered with `epoch` for `slot`: remembered. Returns whether this replica
    /// knew another epoch there before (the store lost its state since).
    pub fn learned(&self, slot: u16, epoch: &str, resource: &ResourceKey) -> bool {
        let mut by_slot = self.by_slot.lock().expect("epochs lock");
        let known = &mut by_slot[usize::from(slot)];
        let lost = !known.is_empty() && known != epoch;
        if lost {
            crate::metrics::store_state_lost();
            tracing::error!(
                resource = resource.as_str(),
                slot,
                "the fence store lost its state (its epoch mark changed: flushed, restarted empty, or failed over to a \
                 replica without it); no write is admitted on its slot for the registrations' time to live"
            );
        }
        *known = epoch.to_owned();
        lost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis Cluster's reference values (the cluster specification's CRC16 test vector and
    /// `CLUSTER KEYSLOT` answers).
    #[test]
    fn slots_are_redis_clusters() {
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot_of_tag("foo"), 12182);
        assert_eq!(slot_of_tag("bar"), 5061);
    }

    #[test]
    fn every_slot_has_an_epoch_key_on_it() {
        for slot in [0u16, 1, 5061, 12182, 16_383] {
            let (epoch, quiet) = keys_of_slot(slot);
            let tag = epoch.split_once('{').unwrap().1.split_once('}').unwrap().0;
            assert_eq!(slot_of_tag(tag), slot);
            assert!(quiet.contains(&format!("{{{tag}}}")));
        }
    }

    #[test]
    fn a_changed_epoch_is_a_loss_a_first_one_is_not() {
        let known = KnownEpochs::default();
        let r = ResourceKey::new("job").unwrap();
        assert!(!known.learned(7, "a", &r), "the first epoch seen");
        assert!(!known.learned(7, "a", &r));
        assert!(known.learned(7, "b", &r), "it changed");
        assert_eq!(known.get(7), "b");
        assert_eq!(known.get(8), "");
        assert_ne!(known.offer(), known.offer());
        assert_ne!(known.offer(), KnownEpochs::default().offer());
    }
}
