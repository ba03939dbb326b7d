//! The default of every key that has one (docs/configuration.md lists them all).

use super::{AdvancePolicy, ProbeMode};

pub fn header_bytes_max() -> usize {
    64 * 1024
}
pub fn body_bytes_max() -> u64 {
    5 * 1024 * 1024 * 1024
}
pub fn shutdown_timeout_ms() -> u64 {
    8_000
}
pub fn header_read_timeout_ms() -> u64 {
    10_000
}
pub fn idle_timeout_ms() -> u64 {
    310_000
}
pub fn route_buffered_bytes_max() -> usize {
    64 * 1024 * 1024
}
pub fn route_caller_header() -> String {
    "authorization".into()
}
pub fn admin_connections_max() -> usize {
    64
}
pub fn connections_max() -> usize {
    4096
}
pub fn store_cache_bytes_max() -> usize {
    crate::store::DEFAULT_CACHE_BYTES
}
pub fn store_timeout_ms() -> u64 {
    2_000
}
pub fn store_idempotency_records_bytes_max() -> u64 {
    1 << 30
}
pub fn store_idempotency_records_max() -> usize {
    crate::store::IDEMPOTENCY_RECORDS_MAX
}
pub fn store_upload_records_per_caller_max() -> u64 {
    crate::fence::RecordLimits::default().per_caller
}
pub fn store_upload_records_per_resource_max() -> u64 {
    crate::fence::RecordLimits::default().per_resource
}
pub fn store_upload_records_max() -> u64 {
    crate::fence::RecordLimits::default().count
}
pub fn store_upload_records_bytes_max() -> u64 {
    crate::fence::RecordLimits::default().bytes
}
pub fn abort_uploads_after_ms() -> u64 {
    7 * 24 * 3600 * 1000
}
pub fn store_wait_timeout_ms() -> u64 {
    500
}
pub fn region() -> String {
    "us-east-1".into()
}
pub fn upstream_connect_timeout_ms() -> u64 {
    5_000
}
pub fn upstream_request_timeout_ms() -> u64 {
    300_000
}
pub fn upstream_health_interval_ms() -> u64 {
    5_000
}
pub fn upstream_idle_connections_max() -> usize {
    256
}
pub fn probe() -> ProbeMode {
    ProbeMode::Warn
}
pub fn require_token() -> bool {
    true
}
pub fn token_header() -> String {
    "Fencing-Token".into()
}
pub fn resource_header() -> String {
    "Fencing-Resource".into()
}
pub fn inflight_deadline_ms() -> u64 {
    30_000
}
pub fn inflight_per_resource_max() -> usize {
    1024
}
/// An hour: a stale worker that wakes from a pause of minutes (a VM suspension, a long
/// GC) still finds its upload to abort itself and sees its own error; an operator has
/// time to look; and parts do not sit at the upstream for the day S3's shortest lifecycle
/// rule would keep them.
pub fn abort_stale_uploads_after_ms() -> u64 {
    3_600_000
}
pub fn cached_resources_max() -> usize {
    100_000
}
pub fn etag_cache_entries_max() -> usize {
    100_000
}
pub fn fencing_advance() -> AdvancePolicy {
    AdvancePolicy::Write
}
pub fn route_advance() -> AdvancePolicy {
    AdvancePolicy::Registration
}
pub fn retry_body_bytes_max() -> usize {
    1024 * 1024
}
pub fn idempotency_retention_ms() -> u64 {
    24 * 3600 * 1000
}
pub fn route_request_timeout_ms() -> u64 {
    30_000
}
pub fn route_body_bytes_max() -> usize {
    8 * 1024 * 1024
}
pub fn route_response_bytes_max() -> usize {
    1024 * 1024
}
pub fn lease_ttl_ms_max() -> u64 {
    3_600_000
}
pub fn log_level() -> String {
    "info".into()
}
