//! The bounds on the upload records a store keeps for callers (`docs/security.md`,
//! "Tenants"): per caller (the access key that signed the creation), per resource and in all,
//! by count, and in all by bytes. A store checks them atomically with the record's write; a
//! full store refuses the new record, never a fence operation (grants, registrations and
//! advances do not pass here).
//!
//! A record that replaces one under the same name (a newer token taking an upload over) is
//! never refused: it adds nothing to the count in all, and refusing it would refuse a part of
//! a write the fence admitted.

use std::collections::HashMap;

/// The configured bounds (`store.upload_records_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordLimits {
    pub per_caller: u64,
    pub per_resource: u64,
    pub count: u64,
    pub bytes: u64,
}

impl Default for RecordLimits {
    fn default() -> Self {
        Self { per_caller: 10_000, per_resource: 10_000, count: 100_000, bytes: 256 << 20 }
    }
}

/// What is kept now against the bounds a new record would count on: its caller's records, its
/// resource's, all of them, and their bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Kept {
    pub caller: u64,
    pub resource: u64,
    pub count: u64,
    pub bytes: u64,
}

impl RecordLimits {
    /// The bound a new record of `bytes` would break on top of `kept`, if any: the caller's,
    /// the resource's, the count in all, the bytes in all, in that order (the Redis script,
    /// `upload_put.lua`, checks them in the same order).
    pub fn refuses(&self, kept: Kept, bytes: u64) -> Option<Full> {
        if kept.caller >= self.per_caller {
            Some(Full::Caller(self.per_caller))
        } else if kept.resource >= self.per_resource {
            Some(Full::Resource(self.per_resource))
        } else if kept.count >= self.count {
            Some(Full::Count(self.count))
        } else if kept.bytes.saturating_add(bytes) > self.bytes {
            Some(Full::Bytes(self.bytes))
        } else {
            None
        }
    }
}

/// Which bound refused a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Full {
    #[error("this caller already has {0} upload records (store.upload_records_per_caller_max)")]
    Caller(u64),
    #[error("the resource already has {0} upload records (store.upload_records_per_resource_max)")]
    Resource(u64),
    #[error("the fence store already keeps {0} upload records (store.upload_records_max)")]
    Count(u64),
    #[error("the upload records already take {0} bytes (store.upload_records_bytes_max)")]
    Bytes(u64),
    /// Redis: records stop at [`MEMORY_FOR_RECORDS`] of `maxmemory`; the rest is kept for the
    /// fences, leases and registrations.
    #[error("Redis's memory is three quarters full: the rest is kept for fences and leases")]
    Memory,
}

/// Of a Redis store's `maxmemory`, the share past which no record is added (numerator,
/// denominator): fences, leases and registrations keep the last quarter.
pub const MEMORY_FOR_RECORDS: (u64, u64) = (3, 4);

impl Full {
    /// The label of `fencegate_records_refused_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Caller(_) => "per_caller",
            Self::Resource(_) => "per_resource",
            Self::Count(_) => "count",
            Self::Bytes(_) => "bytes",
            Self::Memory => "memory",
        }
    }

    /// The bound a store script names (`caller`, `resource`, `count`, `bytes`, `memory`).
    pub fn named(name: &str, limits: &RecordLimits) -> Option<Self> {
        Some(match name {
            "caller" => Self::Caller(limits.per_caller),
            "resource" => Self::Resource(limits.per_resource),
            "count" => Self::Count(limits.count),
            "bytes" => Self::Bytes(limits.bytes),
            "memory" => Self::Memory,
            _ => return None,
        })
    }
}

/// What a store did with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    Kept,
    Full(Full),
}

/// Who a record is counted against, and what it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub caller: String,
    pub resource: String,
    pub bytes: u64,
}

/// The counts of the records kept, for a store with one writer (the embedded and memory
/// stores): rebuilt from the records at open, changed with every record written or removed.
#[derive(Debug, Default)]
pub struct Tally {
    count: u64,
    bytes: u64,
    callers: HashMap<String, u64>,
    resources: HashMap<String, u64>,
}

impl Tally {
    /// Counts `new` in place of `old` (the record under the same name, if any): refused when
    /// it is new and a bound is reached.
    pub fn put(&mut self, old: Option<&Owner>, new: &Owner, limits: &RecordLimits) -> Keep {
        match old {
            Some(old) => self.remove(old),
            None => {
                if let Err(full) = self.room(new, limits) {
                    return Keep::Full(full);
                }
            }
        }
        self.add(new);
        Keep::Kept
    }

    pub fn add(&mut self, owner: &Owner) {
        self.count += 1;
        self.bytes += owner.bytes;
        *self.callers.entry(owner.caller.clone()).or_default() += 1;
        *self.resources.entry(owner.resource.clone()).or_default() += 1;
    }

    pub fn remove(&mut self, owner: &Owner) {
        self.count = self.count.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(owner.bytes);
        for (map, name) in [(&mut self.callers, &owner.caller), (&mut self.resources, &owner.resource)] {
            if let Some(n) = map.get_mut(name) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(name);
                }
            }
        }
    }

    fn room(&self, new: &Owner, limits: &RecordLimits) -> Result<(), Full> {
        let of = |map: &HashMap<String, u64>, name: &str| map.get(name).copied().unwrap_or(0);
        let kept = Kept {
            caller: of(&self.callers, &new.caller),
            resource: of(&self.resources, &new.resource),
            count: self.count,
            bytes: self.bytes,
        };
        limits.refuses(kept, new.bytes).map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(caller: &str, resource: &str) -> Owner {
        Owner { caller: caller.into(), resource: resource.into(), bytes: 100 }
    }

    #[test]
    fn each_bound_refuses_a_new_record_and_a_removal_makes_room() {
        let limits = RecordLimits { per_caller: 2, per_resource: 3, count: 4, bytes: 1_000 };
        let mut tally = Tally::default();
        assert_eq!(tally.put(None, &owner("a", "r1"), &limits), Keep::Kept);
        assert_eq!(tally.put(None, &owner("a", "r1"), &limits), Keep::Kept);
        assert_eq!(tally.put(None, &owner("a", "r2"), &limits), Keep::Full(Full::Caller(2)));
        assert_eq!(tally.put(None, &owner("b", "r1"), &limits), Keep::Kept);
        assert_eq!(tally.put(None, &owner("c", "r1"), &limits), Keep::Full(Full::Resource(3)));
        assert_eq!(tally.put(None, &owner("c", "r2"), &limits), Keep::Kept);
        assert_eq!(tally.put(None, &owner("d", "r3"), &limits), Keep::Full(Full::Count(4)));
        tally.remove(&owner("a", "r1"));
        assert_eq!(tally.put(None, &owner("d", "r3"), &limits), Keep::Kept);
        let big = Owner { bytes: 701, ..owner("e", "r4") };
        tally.remove(&owner("d", "r3"));
        assert_eq!(tally.put(None, &big, &limits), Keep::Full(Full::Bytes(1_000)));
    }

    #[test]
    fn a_replacement_is_never_refused_and_moves_the_counts() {
        let limits = RecordLimits { per_caller: 1, per_resource: 1, count: 1, bytes: 1_000 };
        let mut tally = Tally::default();
        assert_eq!(tally.put(None, &owner("a", "r1"), &limits), Keep::Kept);
        // Taken over by another caller: kept although the store is full.
        assert_eq!(tally.put(Some(&owner("a", "r1")), &owner("b", "r1"), &limits), Keep::Kept);
        assert_eq!(tally.count, 1);
        assert!(!tally.callers.contains_key("a"), "the old caller's count went with the record");
        assert_eq!(tally.callers.get("b"), Some(&1));
        tally.remove(&owner("b", "r1"));
        assert_eq!((tally.count, tally.bytes, tally.callers.len(), tally.resources.len()), (0, 0, 0, 0));
    }
}
