//! Wall-clock time for everything that expires or is reported (leases, the feed, upload
//! records, the operator's views), injectable so expiry is tested without sleeping.

/// Wall-clock time, injectable so expiry is tested without sleeping.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;

    /// This boot's id and its `CLOCK_BOOTTIME` now (ms), when the clock is the host's: holds
    /// are measured on it within a boot (`fence::Hold`). A test's clock has none.
    fn boot(&self) -> Option<(u64, u64)> {
        None
    }
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
    }

    fn boot(&self) -> Option<(u64, u64)> {
        // A UUID; its first 16 hex digits tell one boot from another.
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let hex: String = id.chars().filter(char::is_ascii_hexdigit).take(16).collect();
        let id = u64::from_str_radix(&hex, 16).ok()?;
        Some((id, super::BootInstant::now().as_millis()))
    }
}
