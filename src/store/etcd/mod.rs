//! The etcd fence store, shared by several fencegate replicas. etcd replicates by Raft: an
//! acknowledged write is on a majority of its members and survives any leader change, so a
//! fence acknowledged here can never roll back (unlike Redis's asynchronous replication).
//!
//! Every change is a compare-and-swap transaction: read the keys (one linearizable read, at
//! revision `R`), decide in Rust, then commit only if what was read is unchanged (the keys'
//! `mod_revision`s, and for a registration no key of the resource's in-flight range newer than
//! `R`); a lost race reads again. Keys of resource `r` (resource names have no control
//! characters, so `\0` ends a name):
//! - `fg/f/<r>`            the fence (decimal)
//! - `fg/l/<r>`            the lease (JSON `LeaseRecord`)
//! - `fg/i/<r>\0<member>`  an in-flight registration `replica:id:token`, attached to an etcd
//!   lease of its own whose TTL is the registration's (`InflightBounds::registration_ttl`,
//!   rounded up to whole seconds): renewing the registration is a
//!   keep-alive of that lease, and a replica that dies or loses etcd loses its registrations
//!   when their leases expire (see `registrations` for when a replica withdraws them)
//! - `fg/k/<r>\0<digest>`  the API gateway's idempotency record (JSON), on an etcd lease that
//!   ends with the route's retention
//! - `fg/u/<bucket>/<upload id>`  a multipart upload made with a token (JSON `UploadRecord`)
//! - `fg/w/<r>\0<lease id>`  a grant withdrawn after an error, on an etcd lease of
//!   `WITHDRAWN_GRANT_TTL_MS`: the grant's own transaction, applied late, finds it and fails
//!
//! Announcements are etcd's own watch on `fg/f/`: every change of a fence is an event, in
//! revision order, resumed from the last revision seen after a reconnect.
//!
//! Lease expiry (`fencegate` leases, not etcd's) is decided with this host's clock, as in the
//! embedded store: etcd has no clock to ask.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};

use super::registrations::{Member, Renewal, Withdrawal};
use super::shared::{Announcements, Ask, RegistryCalls, Renewed, Shared};
use crate::fence::{
    AdvanceOutcome, FenceStore, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord, IdempotencyStore,
    LeaseCommand, LeaseOutcome, LeaseRecord, LeaseStore, LeaseWrite, ResourceKey, SharedAdmit, SharedRegistry,
    StoreError, UploadPage, UploadRecord, UploadStore, WITHDRAWN_GRANT_TTL_MS, apply_lease,
};
use crate::metrics;

mod listing;
mod records;
mod registry;
mod uploads;

const FENCES: &str = "fg/f/";
const LEASES: &str = "fg/l/";
const INFLIGHT: &str = "fg/i/";
const RECORDS: &str = "fg/k/";
/// The end of the range of [`RECORDS`].
const RECORDS_END: &str = "fg/k0";
const UPLOADS: &str = "fg/u/";
const WITHDRAWN: &str = "fg/w/";
/// The counts of the upload records (`uploads.rs`).
const TALLY: &str = "fg/n/";
/// The end of the range of [`UPLOADS`] (`/` + 1 is `0`).
const UPLOADS_END: &str = "fg/u0";

fn withdrawn_key(resource: &ResourceKey, lease_id: &str) -> String {
    format!("{WITHDRAWN}{}\0{lease_id}", resource.as_str())
}

fn upload_key(bucket: &str, upload_id: &str) -> String {
    format!("{UPLOADS}{}", UploadRecord::name(bucket, upload_id))
}

fn fence_key(resource: &ResourceKey) -> String {
    format!("{FENCES}{}", resource.as_str())
}

fn lease_key(resource: &ResourceKey) -> String {
    format!("{LEASES}{}", resource.as_str())
}

/// The prefix of every in-flight registration of `resource`, on every replica.
fn inflight_prefix(resource: &ResourceKey) -> String {
    format!("{INFLIGHT}{}\0", resource.as_str())
}

fn member_key(resource: &ResourceKey, replica_id: &str, member: Member) -> String {
    format!("{}{replica_id}:{}:{}", inflight_prefix(resource), member.id, member.token.0)
}

fn record_key(key: &IdempotencyKey) -> String {
    format!("{RECORDS}{}\0{}", key.resource().as_str(), key.request_digest())
}

/// The token a registration key ends with.
fn member_token(key: &[u8]) -> Option<FenceToken> {
    let tail = key.rsplit(|b| *b == b':').next()?;
    FenceToken::parse(tail).ok()
}

/// etcd lease TTLs are whole seconds: rounded up, so a registration never goes before its
/// deadline.
fn ttl_seconds(ms: u64) -> i64 {
    i64::try_from(ms.div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

/// A failed call (a timeout is `bounded`'s own: the client's deadline is the same).
fn backend(e: etcd_client::Error) -> StoreError {
    StoreError::Backend(Box::new(e))
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Backend(format!("etcd holds a malformed {what}").into())
}

/// A key as read: its value (absent: `None`) and the `mod_revision` a commit compares with
/// (0 for an absent key, which is what etcd compares an absent key's revision with).
struct Read {
    value: Option<Vec<u8>>,
    mod_revision: i64,
}

impl Read {
    fn of(kvs: &[KeyValue]) -> Self {
        match kvs.first() {
            Some(kv) => Self { value: Some(kv.value().to_vec()), mod_revision: kv.mod_revision() },
            None => Self { value: None, mod_revision: 0 },
        }
    }

    fn token(&self) -> Result<Option<FenceToken>, StoreError> {
        self.value.as_deref().map(|v| FenceToken::parse(v).map_err(|_| corrupt("fence"))).transpose()
    }

    /// Commits only if the key is still as read.
    fn unchanged(&self, key: &str) -> Compare {
        Compare::mod_revision(key, CompareOp::Equal, self.mod_revision)
    }
}

/// The gets of a read-only transaction, in order.
fn gets(resp: &etcd_client::TxnResponse) -> Vec<Vec<KeyValue>> {
    resp.op_responses()
        .into_iter()
        .map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().to_vec(),
            _ => Vec::new(),
        })
        .collect()
}

/// What an admission decides from what it read; the same rules as the Redis admission script.
#[derive(Debug, PartialEq, Eq)]
struct Admission {
    answer: SharedAdmit,
    /// The fence to write (an advance, or a repair up to the floor).
    fence: Option<FenceToken>,
}

fn decide_admission(
    stored: Option<FenceToken>,
    floor: Option<FenceToken>,
    token: FenceToken,
    may_advance: bool,
    older_inflight: bool,
) -> Admission {
    let (mut current, mut fence, mut repaired_from) = (stored, None, None);
    if let Some(floor) = floor
        && stored.is_none_or(|s| s < floor)
    {
        // The store fell below what this replica has seen (a restore from an old backup).
        (current, fence, repaired_from) = (Some(floor), Some(floor), Some(stored));
    }
    if let Some(c) = current
        && token < c
    {
        return Admission { answer: SharedAdmit::Stale { current: c }, fence };
    }
    let mut advanced = false;
    if current.is_none_or(|c| c < token) {
        if !may_advance {
            return Admission { answer: SharedAdmit::Unregistered { current, repaired_from }, fence };
        }
        (fence, advanced) = (Some(token), true);
    }
    let answer = if older_inflight {
        SharedAdmit::OlderInflight { advanced, repaired_from }
    } else {
        SharedAdmit::Admitted { advanced, repaired_from }
    };
    Admission { answer, fence }
}

pub struct EtcdStore {
    client: Client,
    history: Arc<History>,
    timeout: Duration,
    shared: Shared<EtcdCalls>,
    /// `store.idempotency_records_max`: live records in all, beyond which a claim is refused
    /// (so route traffic cannot fill etcd's quota, which would refuse every write).
    records_max: std::sync::atomic::AtomicU64,
}

/// The registry's calls on etcd.
struct EtcdCalls {
    client: Client,
    history: Arc<History>,
    timeout: Duration,
    replica_id: String,
    /// The etcd lease each registration of this replica is attached to.
    leases: Mutex<HashMap<(ResourceKey, u64), i64>>,
}

impl EtcdStore {
    /// Connects to the etcd cluster at `endpoints` (any members; the client balances and fails
    /// over between them) and starts watching fence changes.
    pub async fn connect(endpoints: &[String], timeout: Duration, replica_id: String) -> anyhow::Result<Self> {
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout)
            .with_keep_alive(Duration::from_secs(2), timeout)
            // A member cut off from the leader answers "no leader" at once instead of waiting.
            .with_require_leader(true);
        let client = tokio::time::timeout(timeout * 2, Client::connect(endpoints, Some(options)))
            .await
            .map_err(|_| anyhow::anyhow!("no etcd member answered within {} ms", timeout.as_millis() * 2))??;
        let history = Arc::new(History::default());
        let store = Self {
            client: client.clone(),
            history: history.clone(),
            timeout,
            shared: Shared::start(Arc::new(EtcdCalls {
                client: client.clone(),
                history,
                timeout,
                replica_id,
                leases: Mutex::new(HashMap::new()),
            })),
            records_max: std::sync::atomic::AtomicU64::new(crate::store::IDEMPOTENCY_RECORDS_MAX as u64),
        };
        store.ping().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        tokio::spawn(watch_fences(client, store.shared.announcements()));
        Ok(store)
    }

    /// Bounds the idempotency records (`store.idempotency_records_max`): a claim that finds as
    /// many live ones is refused. Counted before the claim, not in its transaction: claims
    /// racing each other may pass it by as many as run at once.
    pub fn set_idempotency_records_max(&self, max: usize) {
        self.records_max.store(max as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `txn` within the store's timeout (`read_only`: see [`txn_on`]).
    async fn txn(&self, txn: Txn, read_only: bool) -> Result<etcd_client::TxnResponse, StoreError> {
        let floor = self.history.floor();
        self.history.check(floor, txn_on(&self.client, self.timeout, txn, read_only).await?)
    }

    /// Reads `keys` in one linearizable transaction.
    async fn read(&self, keys: &[&str]) -> Result<Vec<Read>, StoreError> {
        let ops: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(*k, None)).collect();
        let resp = self.txn(Txn::new().and_then(ops), true).await?;
        Ok(gets(&resp).iter().map(|kvs| Read::of(kvs)).collect())
    }

    /// Runs `ops` if every compare holds; `false` if another writer came first.
    async fn commit(&self, when: Vec<Compare>, ops: Vec<TxnOp>) -> Result<bool, StoreError> {
        Ok(self.txn(Txn::new().when(when).and_then(ops), false).await?.succeeded())
    }

    async fn grant_lease(&self, ttl: i64) -> Result<i64, StoreError> {
        grant_on(&self.client, self.timeout, ttl).await
    }
}

/// Runs `call` within `timeout`, again while it fails without having reached etcd's state
/// machine: no connection to the member the client picked (a killed member, until the client
/// stops choosing it), or a member without a leader (etcd applies nothing then). Anything else
/// is returned: a call whose outcome is unknown is never repeated blindly here.
async fn bounded<T, F, Fut>(timeout: Duration, call: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    retrying(timeout, call, not_applied).await
}

/// A read that changes nothing: sent again after any failure of the connection it went on (a
/// killed member's connection closes under it), within `timeout`.
async fn read_bounded<T, F, Fut>(timeout: Duration, call: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    retrying(timeout, call, |e| not_applied(e) || connection_failed(e)).await
}

async fn retrying<T, F, Fut>(
    timeout: Duration,
    mut call: F,
    again: impl Fn(&etcd_client::Error) -> bool,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let until = tokio::time::Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(until, call()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) if again(&e) && tokio::time::Instant::now() + NOT_APPLIED_PAUSE < until => {
                tracing::debug!(error = %e, "etcd call not applied; trying again");
                tokio::time::sleep(NOT_APPLIED_PAUSE).await;
            }
            Ok(Err(e)) => return Err(backend(e)),
            Err(_) => return Err(StoreError::Timeout { after_ms: crate::fence::millis(timeout) }),
        }
    }
}

/// Whether the connection a call went on failed (closed, cancelled, unreachable).
fn connection_failed(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown)
        }
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// The pause before a call that etcd did not apply is sent again.
const NOT_APPLIED_PAUSE: Duration = Duration::from_millis(25);

/// Whether a failed call certainly changed nothing: the connection could not be made (tonic
/// reports it as `Unavailable` "tcp connect error"), or the member had no leader ("etcdserver:
/// no leader", with `require_leader`).
fn not_applied(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable
                && (status.message().contains("connect error") || status.message().contains("no leader"))
        }
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// A compare-and-swap loop gives up once the store's time budget is spent: under that much
/// contention the outcome is as unknown as a timeout.
struct Attempts {
    until: Instant,
    timeout: Duration,
}

impl Attempts {
    fn new(timeout: Duration) -> Self {
        Self { until: Instant::now() + timeout, timeout }
    }

    fn again(&self) -> Result<(), StoreError> {
        if Instant::now() >= self.until {
            return Err(StoreError::Timeout { after_ms: crate::fence::millis(self.timeout) });
        }
        Ok(())
    }
}

#[async_trait]
impl FenceStore for EtcdStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.read(&[&fence_key(resource)]).await?[0].token()
    }

    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        let key = fence_key(resource);
        let attempts = Attempts::new(self.timeout);
        loop {
            let read = self.read(&[&key]).await?.remove(0);
            let previous = read.token()?;
            if let Some(current) = previous.filter(|c| *c >= token) {
                return Ok(AdvanceOutcome::Unchanged { current });
            }
            let put = TxnOp::put(key.as_str(), token.0.to_string(), None);
            if self.commit(vec![read.unchanged(&key)], vec![put]).await? {
                return Ok(AdvanceOutcome::Advanced { previous });
            }
            attempts.again()?;
        }
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }

    /// A linearizable read: it needs a leader and a majority, like every write.
    async fn ping(&self) -> Result<(), StoreError> {
        let count = || {
            let mut kv = self.client.kv_client();
            async move { kv.get(FENCES, Some(GetOptions::new().with_count_only())).await }
        };
        read_bounded(self.timeout, count).await.map(|_| ())
    }

    fn shared(&self) -> Option<&dyn SharedRegistry> {
        Some(&self.shared)
    }
}

/// The highest revision of etcd's history this replica has seen. Transactions are
/// linearizable: one sent after another's answer is ordered after it, so its answer's revision
/// is at least the revision seen before it was sent (calls in flight together may answer in any
/// order). An answer below that means a member answered from a history that lost what this
/// replica saw acknowledged (a member restarted on an empty data directory and let back in
/// against etcd's rules, a restore from an old snapshot): such an answer is never trusted, and
/// the call fails closed, and so does every call after it until the replica is restarted (a
/// lost history that grows past what was seen is no sounder for it).
#[derive(Default)]
struct History {
    seen: std::sync::atomic::AtomicI64,
    /// An answer came from a history that lost what this replica saw.
    lost: std::sync::atomic::AtomicBool,
}

impl History {
    /// The revision a call sent now must not answer below.
    fn floor(&self) -> i64 {
        self.seen.load(std::sync::atomic::Ordering::Acquire)
    }

    fn check(&self, floor: i64, resp: etcd_client::TxnResponse) -> Result<etcd_client::TxnResponse, StoreError> {
        use std::sync::atomic::Ordering;
        if self.lost.load(Ordering::Acquire) {
            return Err(StoreError::Backend("etcd lost acknowledged data earlier; restart this replica".into()));
        }
        let Some(revision) = resp.header().map(|h| h.revision()) else { return Ok(resp) };
        self.seen.fetch_max(revision, Ordering::AcqRel);
        if revision < floor {
            self.lost.store(true, Ordering::Release);
            let seen = floor;
            crate::metrics::store_state_lost();
            tracing::error!(
                revision,
                seen,
                "etcd answered from an older history than this replica saw: a member lost acknowledged data (it must \
                 be removed and added back, never restarted on an empty data directory); failing closed"
            );
            return Err(StoreError::Backend(
                format!("etcd answered at revision {revision}, below {seen} seen before").into(),
            ));
        }
        Ok(resp)
    }
}

/// Runs `txn` within `timeout`. A transaction of reads only (`read_only`: no compare, no put or
/// delete) changes nothing, so it is sent again after any connection failure; one that may
/// change something only when etcd certainly did not apply it.
async fn txn_on(
    client: &Client,
    timeout: Duration,
    txn: Txn,
    read_only: bool,
) -> Result<etcd_client::TxnResponse, StoreError> {
    let call = || {
        let (mut kv, txn) = (client.kv_client(), txn.clone());
        async move { kv.txn(txn).await }
    };
    if read_only { read_bounded(timeout, call).await } else { bounded(timeout, call).await }
}

async fn grant_on(client: &Client, timeout: Duration, ttl: i64) -> Result<i64, StoreError> {
    let grant = bounded(timeout, || {
        let mut leases = client.lease_client();
        async move { leases.grant(ttl, None).await }
    })
    .await?;
    Ok(grant.id())
}

fn revoke_in_background(client: &Client, lease: i64) {
    let mut leases = client.lease_client();
    tokio::spawn(async move {
        // If it fails, the lease expires by itself.
        let _ = leases.revoke(lease).await;
    });
}

/// Watches every fence change, reconnecting after failures and resuming after the last
/// revision seen, until the gate stops listening.
async fn watch_fences(client: Client, announcements: Announcements) {
    let mut backoff = Duration::from_millis(50);
    let mut next_revision: i64 = 0;
    while !announcements.is_closed() {
        let mut options = WatchOptions::new().with_prefix();
        if next_revision > 0 {
            options = options.with_start_revision(next_revision);
        }
        match client.watch_client().watch(FENCES, Some(options)).await {
            Ok(mut stream) => {
                backoff = Duration::from_millis(50);
                while let Ok(Some(resp)) = stream.message().await {
                    if resp.canceled() {
                        // Compacted past where it would resume: start again from now (the
                        // renewals notice a moved fence anyway).
                        next_revision = 0;
                        break;
                    }
                    for event in resp.events() {
                        let Some(kv) = event.kv().filter(|_| event.event_type() == EventType::Put) else { continue };
                        next_revision = next_revision.max(kv.mod_revision() + 1);
                        let Some(name) = kv.key().strip_prefix(FENCES.as_bytes()) else { continue };
                        let (Ok(name), Ok(token)) = (std::str::from_utf8(name), FenceToken::parse(kv.value())) else {
                            continue;
                        };
                        let Ok(resource) = ResourceKey::new(name) else { continue };
                        if !announcements.announced(resource, token) {
                            return;
                        }
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "fence watch: cannot watch yet"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests;
