//! Lease client for fencegate: acquire a lease, keep it renewed in the background, know at once
//! when it is lost, and fence every aws-sdk-s3 write with its token.
//!
//! - [`api`]: [`LeaseClient`], one signed HTTP call per lease operation (acquire, renew,
//!   release), and the typed [`LeaseError`].
//! - [`lease`]: [`Lease`], the held lease: background renewal every `ttl / 3`, the local
//!   deadline, and the lost-lease signal (a `CancellationToken` and a `watch` channel).
//! - [`fencing`]: [`FencingInterceptor`], attaching `Fencing-Token` and `Fencing-Resource` to
//!   every request of an aws-sdk-s3 client.
//! - [`metrics`]: `lease_acquired`, `lease_lost`, `heartbeat_latency`.
//! - `cli` (feature `worker`): what the command-line tools share, how they reach fencegate.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use fencegate_client::{Credentials, FencingInterceptor, LeaseClient};
//!
//! let credentials = Credentials::new("fencegate-dev", "fencegate-dev-secret", None, None, "example");
//! let client = LeaseClient::new("http://127.0.0.1:9000", credentials, "us-east-1")?;
//! let lease = client.acquire("job:invoices", "worker-1", Duration::from_secs(10)).await?;
//! let fencing = FencingInterceptor::for_lease(&lease);
//! let lost = lease.lost();
//! tokio::select! {
//!     () = lost.cancelled() => eprintln!("lease lost: stop"),
//!     () = async { /* write through an S3 client carrying `fencing` */ } => {}
//! }
//! lease.release().await?;
//! # Ok(()) }
//! ```

pub mod api;
#[cfg(feature = "worker")]
pub mod cli;
pub mod fencing;
pub mod lease;
pub mod metrics;

pub use api::{FencingToken, Grant, LeaseClient, LeaseCredentials, LeaseError};
pub use aws_credential_types::Credentials;
pub use fencing::{FencingInterceptor, LeaseLostError};
pub use lease::{Lease, LeaseOptions, LeaseStatus, LostReason};
