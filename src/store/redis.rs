//! The Redis fence store, shared by several fencegate replicas. Every check-and-advance is one
//! Lua script (EVALSHA, reloaded on NOSCRIPT by the client library); a resource's keys share a
//! hash tag, so they live in one Redis Cluster slot. Tokens are kept as decimal strings and
//! compared by length then bytes, since Lua numbers cannot hold every u64.
//!
//! Keys of resource `r` (with `%` and `}` escaped in the tag):
//! - `fg:{r}:fence`     the fence (string)
//! - `fg:{r}:inflight`  in-flight writes: a sorted set of `replica:id:token` (writes with
//!   that token may be in flight on that replica), scored by deadline (ms, Redis clock); see
//!   `registrations` for how a replica shares and withdraws its member
//! - `fg:{r}:lease`     the lease (hash: holder, lease_id, token, ttl_ms, expires_at_ms)
//! - `fg:{r}:withdrawn` the lease ids of grants taken back after an error (hash, expiring
//!   `WITHDRAWN_GRANT_TTL_MS` after the last): a grant that arrives after its withdrawal does
//!   nothing
//! - `fg:{r}:idem:<d>`  the API gateway's idempotency record of request digest `d` (hash:
//!   claim, record as JSON), expiring by itself (`PEXPIRE`) after the route's retention
//!
//! And of every resource: `fg:uploads`, a hash of the multipart uploads made with a token
//! (`bucket/upload id` → JSON `UploadRecord`), with no time to live, so no eviction policy
//! drops one.
//!
//! Advances are announced on the channel `fg:advances` as `<token> <resource>`, so every
//! replica cancels its older uploads still streaming on that resource.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Script, Value};

use super::epoch::{self, KnownEpochs};
use super::registrations::{Member, Renewal, Withdrawal};
use super::shared::{Announcements, Ask, RegistryCalls, Renewed, Shared};

use crate::fence::millis;
use crate::fence::{
    AdvanceOutcome, FenceStore, FenceToken, IdempotencyBegin, IdempotencyKey, IdempotencyRecord, IdempotencyStore,
    LeaseCommand, LeaseOutcome, LeaseRecord, LeaseStore, ResourceKey, SharedAdmit, SharedRegistry, StoreError,
    UploadPage, UploadRecord, UploadStore,
};
use crate::metrics;

/// The channel advances are announced on.
pub const ANNOUNCE_CHANNEL: &str = "fg:advances";

/// Shared by every script: compares decimal u64 strings without leading zeros; Redis's clock;
/// the slot's epoch mark (`super::epoch`): `epoch_gate` answers nil when the caller knows the
/// slot's mark and no quiet period runs (or `quiet_applies` is false), else {'epoch', mark,
/// quiet ms} (the caller knew another mark, or none yet) or {'quiet', mark, quiet ms}. A slot
/// without its mark lost its data, or is new: the mark is written and the quiet period starts.
/// A mark other than the one a replica knew means the same (the store was marked anew after
/// a loss, by `init-store` run at the wrong time): the quiet period starts too, unless one
/// already runs or ran for this mark. The quiet period's end is a value (`until` on Redis's
/// clock), not a key's time to live: no eviction policy may end it early.
const LUA_LT: &str = include_str!("lua/common.lua");

/// KEYS: fence, epoch, quiet. ARGV: token, channel, resource, known epoch, fresh epoch,
/// quiet ms. Returns {advanced 0|1, previous or ''}, or the epoch gate's {-1, mark, quiet ms}
/// / {-2, mark, quiet ms}.
const LUA_ADVANCE: &str = include_str!("lua/advance.lua");

/// KEYS: fence, inflight, epoch, quiet. ARGV: token, floor or '', member or '', ttl_ms,
/// channel, resource, may advance '1' | '0', known epoch, fresh epoch, then members of this
/// replica to withdraw first. Returns {outcome, advanced 0|1, current fence or '', repaired
/// 0|1, what the store had or ''}: outcome 'ok' | 'stale' | 'unregistered' (a token above the
/// fence that may not raise it; nothing changed but a repair) | 'wait'; or the epoch gate's
/// {'epoch' | 'quiet', quiet ms, mark, 0, ''}. The quiet period is the registrations' time to
/// live (`ttl_ms`).
const LUA_ADMIT: &str = include_str!("lua/admit.lua");

/// KEYS: fence, inflight, epoch, quiet. ARGV: member, ttl_ms, known epoch, fresh epoch. Pushes
/// a registration in use to a full time to live from now, if it is still there. Returns
/// {renewed 0|1, fence or ''}, or {2, mark} when the slot's epoch mark is not the one the
/// replica knew (the store lost its state: the registration is gone).
const LUA_RENEW: &str = include_str!("lua/renew.lua");

/// KEYS: fence, lease, epoch, quiet, withdrawn. ARGV: op ('acquire'|'renew'|'release'|'withdraw'),
/// lease_id, holder, ttl_ms (a withdrawal: its tombstone's), channel, resource, floor or '', and
/// for a grant known epoch, fresh epoch, quiet ms. A grant whose lease id was withdrawn does
/// nothing ('gone').
/// Implements `fence::apply_lease` with Redis's clock; a grant is above the stored fence and
/// the floor, and passes the epoch gate first ({'epoch' | 'quiet', mark, '', '', '', quiet ms}).
/// Returns {outcome, holder, lease_id, token, ttl_ms, expires_at_ms or remaining_ms}, and for
/// a grant {..., fence the store had or '', repaired 0|1}.
const LUA_LEASE: &str = include_str!("lua/lease.lua");

/// KEYS: record. ARGV: claim, record JSON, ttl_ms. Claims the key unless a record is there
/// (Redis drops it when its time is up); returns that record's JSON, or nil once claimed.
const LUA_IDEMPOTENCY_BEGIN: &str = include_str!("lua/idempotency_begin.lua");

/// KEYS: record. ARGV: claim, record JSON or '' (remove). Only the claimant's record changes;
/// HSET keeps the key's expiry. Returns 1 if it changed.
const LUA_IDEMPOTENCY_FINISH: &str = include_str!("lua/idempotency_finish.lua");

/// One connection kind or the other; both multiplex requests and reconnect by themselves.
#[derive(Clone)]
enum Link {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Where a call goes: on a serving thread, to that thread's own connection once it is open
/// ([`ThreadLinks`]); anywhere else, and until then, to the shared one.
///
/// Safety relies on no order between calls sent on different connections: each caller awaits
/// an answer before it sends what depends on it, and Redis answers a command only after it
/// ran. The orders that can be lost cost liveness only; docs/design.md ("Redis connections")
/// lists them.
#[derive(Clone)]
struct Connection {
    shared: Link,
    threads: Option<Arc<ThreadLinks>>,
}

impl Connection {
    /// Runs `call` on the thread's own connection or the shared one. A broken connection (an
    /// error on which the client library reconnects), own or shared, most likely means that
    /// Redis restarted or failed over: every thread then forgets its own connection, which is
    /// broken too or soon will be, and takes the shared one (reconnecting) until it opens
    /// another. A call that `may_repeat` (a read, or a change that gives the same end twice)
    /// and found its thread's connection broken is tried again on the shared one at once.
    async fn call<T, F, Fut>(&self, may_repeat: bool, call: F) -> redis::RedisResult<T>
    where
        F: Fn(Link) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        if let (Some(threads), Some(thread)) = (&self.threads, crate::net::threads::current())
            && let Some(own) = threads.get(thread)
        {
            match call(Link::Single(own)).await {
                Err(error) if error.is_unrecoverable_error() => {
                    threads.forget_all(&error);
                    if !may_repeat {
                        return Err(error);
                    }
                }
                result => return result,
            }
        }
        let result = call(self.shared.clone()).await;
        if let (Some(threads), Err(error)) = (&self.threads, &result)
            && error.is_unrecoverable_error()
        {
            threads.forget_all(error);
        }
        result
    }

    /// A script: changes, never sent twice.
    async fn invoke<T: redis::FromRedisValue>(&self, inv: &redis::ScriptInvocation<'_>) -> redis::RedisResult<T> {
        self.call(false, |link| async move {
            match link {
                Link::Single(mut c) => inv.invoke_async(&mut c).await,
                Link::Cluster(mut c) => inv.invoke_async(&mut c).await,
            }
        })
        .await
    }

    /// A command that may run twice: a read, a `ZREM`, a `PING`.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        self.call(true, |link| async move {
            match link {
                Link::Single(mut c) => cmd.query_async(&mut c).await,
                Link::Cluster(mut c) => cmd.query_async(&mut c).await,
            }
        })
        .await
    }

    /// Reads sent together; in a cluster their keys must share a slot.
    async fn pipeline<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> redis::RedisResult<T> {
        self.call(true, |link| async move {
            match link {
                Link::Single(mut c) => pipe.query_async(&mut c).await,
                Link::Cluster(mut c) => pipe.query_async(&mut c).await,
            }
        })
        .await
    }
}

/// At most this many connections of the serving threads; threads beyond share them.
const THREAD_LINKS_MAX: usize = 16;

/// How long a serving thread whose connection failed to open uses the shared one before it
/// tries again.
const THREAD_LINK_RETRY: Duration = Duration::from_secs(1);

/// The serving threads' own connections to one Redis (not a cluster), one per thread.
///
/// A connection's task runs on the runtime that opened it, so each is opened on its thread,
/// in the background, the first time the thread calls Redis: a call never waits for it, and
/// takes the shared connection until it is open. On the shared connection a write's call and
/// its answer crossed to the main runtime and back, waking a second thread each time
/// (docs/perf-log.md, "Redis connections per serving thread").
struct ThreadLinks {
    client: redis::Client,
    config: ConnectionManagerConfig,
    slots: Box<[ThreadLink]>,
    epoch: Instant,
}

struct ThreadLink {
    open: Mutex<Option<ConnectionManager>>,
    /// Milliseconds since `epoch` before which no opening starts (`u64::MAX` while one runs).
    next_attempt_ms: AtomicU64,
}

impl ThreadLinks {
    fn new(client: redis::Client, config: ConnectionManagerConfig, threads: usize) -> Arc<Self> {
        let slots = (0..threads.clamp(1, THREAD_LINKS_MAX))
            .map(|_| ThreadLink { open: Mutex::new(None), next_attempt_ms: AtomicU64::new(0) })
            .collect();
        Arc::new(Self { client, config, slots, epoch: Instant::now() })
    }

    /// The connection of serving thread `thread`, if it is open; otherwise starts opening it
    /// (on this thread) unless an opening runs or failed within [`THREAD_LINK_RETRY`].
    fn get(self: &Arc<Self>, thread: usize) -> Option<ConnectionManager> {
        let index = thread % self.slots.len();
        let slot = &self.slots[index];
        if let Some(open) = slot.open.lock().expect("redis thread link lock").as_ref() {
            return Some(open.clone());
        }
        let due = slot.next_attempt_ms.load(Ordering::Relaxed);
        if self.now_ms() >= due
            && slot.next_attempt_ms.compare_exchange(due, u64::MAX, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            let links = self.clone();
            tokio::spawn(async move { links.open(index).await });
        }
        None
    }

    async fn open(&self, index: usize) {
        let slot = &self.slots[index];
        // Dropped unfinished (its runtime stopped), the opening may be tried again at once.
        let pending = RetryOnDrop(&slot.next_attempt_ms);
        match ConnectionManager::new_with_config(self.client.clone(), self.config.clone()).await {
            Ok(open) => {
                *slot.open.lock().expect("redis thread link lock") = Some(open);
            }
            Err(error) => {
                tracing::debug!(%error, thread = index, "Redis: cannot open a serving thread's connection yet");
                slot.next_attempt_ms.store(self.now_ms() + millis(THREAD_LINK_RETRY), Ordering::Relaxed);
            }
        }
        std::mem::forget(pending);
    }

    /// A connection broke: every thread takes the shared one, and opens another after the
    /// retry pause (a dropped connection's reconnection ends with it).
    fn forget_all(&self, error: &redis::RedisError) {
        let retry = self.now_ms() + millis(THREAD_LINK_RETRY);
        let mut forgot = 0;
        for slot in &self.slots {
            if slot.open.lock().expect("redis thread link lock").take().is_some() {
                slot.next_attempt_ms.store(retry, Ordering::Relaxed);
                forgot += 1;
            }
        }
        if forgot > 0 {
            tracing::debug!(%error, forgot, "Redis: a connection broke; the serving threads use the shared one for now");
        }
    }

    fn now_ms(&self) -> u64 {
        millis(self.epoch.elapsed())
    }
}

/// Lets an opening start again if the one under way is dropped before it ends.
struct RetryOnDrop<'a>(&'a AtomicU64);

impl Drop for RetryOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// `store.wait_replicas`: how many Redis replicas must confirm a change before it counts.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub replicas: u32,
    pub timeout: Duration,
}

/// Connections of their own for changes that wait for replicas: a `WAIT` holds up every later
/// call on its connection, so waiting changes never share one with checks, renewals, reads or
/// `/readyz`.
const WAITING_CONNECTIONS: usize = 4;

/// Where the scripts that change something run: on the shared connection, or with
/// `store.wait_replicas` on a few connections of their own, each change followed by a `WAIT`.
struct Changes {
    waiting: Vec<Connection>,
    next: AtomicUsize,
    wait: Option<Wait>,
}

impl Changes {
    async fn open(
        client: &redis::Client,
        config: &ConnectionManagerConfig,
        wait: Option<Wait>,
    ) -> anyhow::Result<Self> {
        let mut waiting = Vec::new();
        if wait.is_some() {
            for _ in 0..WAITING_CONNECTIONS {
                let manager = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
                waiting.push(Connection { shared: Link::Single(manager), threads: None });
            }
        }
        Ok(Self { waiting, next: AtomicUsize::new(0), wait })
    }

    /// Runs `script` as `inv` and, with a wait, `WAIT`s in the same round trip on the same
    /// connection (a `WAIT` counts the writes of its own connection only, so it cannot be sent
    /// apart: after a reconnect it would count nothing). The script is loaded in the same
    /// pipeline, so a Redis that does not know it yet (just promoted) costs no second `WAIT`.
    /// `claims` tells from the answer whether it tells the caller something a failover must
    /// not lose (an admission, a fence, a grant), whether or not this call changed it: a retry
    /// of a change that an earlier call made but fewer replicas confirmed still finds it
    /// unconfirmed. Such an answer that fewer replicas confirmed than asked fails closed.
    async fn run<T: redis::FromRedisValue>(
        &self,
        connection: &Connection,
        script: &Script,
        inv: &redis::ScriptInvocation<'_>,
        claims: impl FnOnce(&T) -> bool,
    ) -> Result<T, StoreError> {
        let Some(wait) = self.wait.filter(|_| !self.waiting.is_empty()) else {
            return connection.invoke(inv).await.map_err(backend);
        };
        let waiting = &self.waiting[self.next.fetch_add(1, Ordering::Relaxed) % self.waiting.len()];
        let mut pipe = redis::pipe();
        pipe.load_script(script).invoke_script(inv).cmd("WAIT").arg(wait.replicas).arg(millis(wait.timeout));
        let (_sha, answer, confirmed): (String, T, u32) = waiting.pipeline(&pipe).await.map_err(backend)?;
        if claims(&answer) && confirmed < wait.replicas {
            metrics::store_wait_failed();
            let detail = format!(
                "{confirmed} of the {} Redis replicas asked for (store.wait_replicas) confirmed a change within {} ms",
                wait.replicas,
                millis(wait.timeout)
            );
            tracing::warn!(confirmed, wanted = wait.replicas, "{detail}; failing closed");
            return Err(StoreError::Backend(detail.into()));
        }
        Ok(answer)
    }
}

pub struct RedisStore {
    connection: Connection,
    /// The epoch mark this replica last saw per slot, shared with the registry's calls.
    epochs: Arc<KnownEpochs>,
    /// How long a slot that lost its state admits nothing: a registration's time to live.
    quiet_ms: u64,
    advance: Script,
    lease: Script,
    idempotency_begin: Script,
    idempotency_finish: Script,
    changes: Arc<Changes>,
    shared: Shared<RedisCalls>,
}

/// The registry's calls on Redis.
struct RedisCalls {
    connection: Connection,
    epochs: Arc<KnownEpochs>,
    admit: Script,
    renew: Script,
    replica_id: String,
    changes: Arc<Changes>,
}

impl RedisStore {
    /// Connects to one Redis (`urls` has one entry) or a Redis Cluster (several seed nodes),
    /// and starts listening for advance announcements. With `wait`, every change waits for
    /// that many Redis replicas. With one Redis, each of `serving_threads` (if any) opens a
    /// connection of its own when it first calls ([`crate::net::threads`]). `quiet` is how long a
    /// slot found without its epoch mark admits nothing (a registration's time to live,
    /// `InflightBounds::registration_ttl`).
    pub async fn connect(
        urls: &[String],
        response_timeout: Duration,
        replica_id: String,
        wait: Option<Wait>,
        serving_threads: usize,
        quiet: Duration,
    ) -> anyhow::Result<Self> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(response_timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let (connection, changes) = if urls.len() == 1 {
            let client = redis::Client::open(urls[0].as_str())?;
            let changes = Changes::open(&client, &config, wait).await?;
            let shared = Link::Single(ConnectionManager::new_with_config(client.clone(), config.clone()).await?);
            let threads = (serving_threads > 0).then(|| ThreadLinks::new(client, config, serving_threads));
            (Connection { shared, threads }, changes)
        } else {
            anyhow::ensure!(wait.is_none(), "store.wait_replicas is not supported with a Redis Cluster");
            let client = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
                .response_timeout(response_timeout)
                .connection_timeout(response_timeout)
                .build()?;
            let changes = Changes { waiting: Vec::new(), next: AtomicUsize::new(0), wait: None };
            (Connection { shared: Link::Cluster(client.get_async_connection().await?), threads: None }, changes)
        };
        let changes = Arc::new(changes);
        let epochs = Arc::new(KnownEpochs::default());
        let calls = RedisCalls {
            connection: connection.clone(),
            epochs: epochs.clone(),
            admit: script(LUA_ADMIT),
            renew: script(LUA_RENEW),
            replica_id,
            changes: changes.clone(),
        };
        let shared = Shared::start(Arc::new(calls));
        tokio::spawn(listen_for_announcements(urls[0].clone(), shared.announcements()));
        Ok(Self {
            connection,
            epochs,
            quiet_ms: millis(quiet),
            advance: script(LUA_ADVANCE),
            lease: script(LUA_LEASE),
            idempotency_begin: script(LUA_IDEMPOTENCY_BEGIN),
            idempotency_finish: script(LUA_IDEMPOTENCY_FINISH),
            changes,
            shared,
        })
    }

    /// Marks every slot of a new store with one epoch (`fencegate init-store`), so that its
    /// first writes need not wait out the quiet period of a store that lost its state. Slots
    /// already marked keep their mark. Returns how many slots were marked now.
    pub async fn init(&self) -> Result<usize, StoreError> {
        let mark = epoch::new_epoch();
        let mut marked = 0;
        for slots in (0..epoch::SLOTS).collect::<Vec<_>>().chunks(512) {
            let calls = slots.iter().map(|&slot| {
                let (key, _) = epoch::keys_of_slot(u16::try_from(slot).expect("a slot fits u16"));
                let mut cmd = redis::cmd("SET");
                cmd.arg(key).arg(&mark).arg("NX");
                async move { self.connection.query::<Option<String>>(&cmd).await }
            });
            for set in futures_util::future::join_all(calls).await {
                marked += usize::from(set.map_err(backend)?.is_some());
            }
        }
        Ok(marked)
    }
}

#[async_trait]
impl RegistryCalls for RedisCalls {
    /// `GET` the fence and `ZSCORE` the member in one round trip, writing nothing (so no
    /// append-only-file write, and no script to run).
    ///
    /// Reading the two keys without a script is enough: the member can only go by this
    /// replica's own withdrawal (not while this admission uses it) or at its expiry, which is
    /// more than `D` away when `Registrations` plans a check (it plans one only before a
    /// renewal is due, inside the hand-over window). So the
    /// answer is the one an atomic check at the moment of the `GET` would give.
    async fn check(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        member: Member,
    ) -> Result<Option<SharedAdmit>, StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET")
            .arg(key(resource, "fence"))
            .cmd("ZSCORE")
            .arg(key(resource, "inflight"))
            .arg(member_of(&self.replica_id, member));
        let (fence, deadline): (Option<String>, Option<String>) =
            self.connection.pipeline(&pipe).await.map_err(backend)?;
        let Some(fence) = parse_token(fence.as_deref().unwrap_or(""))? else { return Ok(None) };
        if floor.is_some_and(|floor| fence < floor) {
            return Ok(None); // the store fell below what this replica has seen: repair
        }
        if token < fence {
            return Ok(Some(SharedAdmit::Stale { current: fence }));
        }
        if fence != token || deadline.is_none() {
            return Ok(None);
        }
        Ok(Some(SharedAdmit::Admitted { advanced: false, repaired_from: None }))
    }

    async fn register(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        ask: &Ask,
        member: Option<Member>,
        withdraw: &[Member],
    ) -> Result<SharedAdmit, StoreError> {
        let Ask { floor, may_advance, ttl_ms } = *ask;
        let fence = key(resource, "fence");
        let marked = EpochKeys::of(&fence);
        let fresh = self.epochs.offer();
        let mut gate_answers = 0;
        let (outcome, advanced, value, repaired, had) = loop {
            let mut inv = self.admit.key(&fence);
            inv.key(key(resource, "inflight")).key(&marked.epoch).key(&marked.quiet);
            inv.arg(token.0.to_string())
                .arg(floor.map(|f| f.0.to_string()).unwrap_or_default())
                .arg(member.map(|m| member_of(&self.replica_id, m)).unwrap_or_default())
                .arg(ttl_ms)
                .arg(ANNOUNCE_CHANNEL)
                .arg(resource.as_str())
                .arg(if may_advance { "1" } else { "0" })
                .arg(self.epochs.get(marked.slot))
                .arg(&fresh);
            for old in withdraw {
                inv.arg(member_of(&self.replica_id, *old));
            }
            let answer: (String, i64, String, i64, String) = self
                .changes
                .run(&self.connection, &self.admit, &inv, |(outcome, ..): &(String, i64, String, i64, String)| {
                    outcome == "ok"
                })
                .await?;
            match answer.0.as_str() {
                "epoch" | "quiet" => {
                    marked.gate(
                        &self.epochs,
                        resource,
                        &answer.0,
                        &answer.2,
                        u64::try_from(answer.1).unwrap_or(0),
                        &mut gate_answers,
                    )?;
                }
                _ => break answer,
            }
        };
        let advanced = advanced == 1;
        let repaired_from = if repaired == 1 { Some(parse_token(&had)?) } else { None };
        Ok(match outcome.as_str() {
            "ok" => SharedAdmit::Admitted { advanced, repaired_from },
            "wait" => SharedAdmit::OlderInflight { advanced, repaired_from },
            "unregistered" => SharedAdmit::Unregistered { current: parse_token(&value)?, repaired_from },
            "stale" => SharedAdmit::Stale {
                current: parse_token(&value)?.ok_or_else(|| StoreError::Backend("stale without a fence".into()))?,
            },
            other => return Err(StoreError::Backend(format!("admit script answered {other:?}").into())),
        })
    }

    async fn renew(&self, renewal: &Renewal) -> Result<Renewed, StoreError> {
        let fence = key(&renewal.resource, "fence");
        let marked = EpochKeys::of(&fence);
        let mut inv = self.renew.key(&fence);
        inv.key(key(&renewal.resource, "inflight")).key(&marked.epoch).key(&marked.quiet);
        inv.arg(member_of(&self.replica_id, renewal.member))
            .arg(millis(renewal.ttl))
            .arg(self.epochs.get(marked.slot))
            .arg(self.epochs.offer());
        // A renewal lost in a failover would let the registration expire before this replica
        // revokes it: it waits for replicas like any change.
        let (renewed, value): (i64, String) =
            self.changes.run(&self.connection, &self.renew, &inv, |(renewed, _)| *renewed == 1).await?;
        if renewed == 2 {
            // The slot's mark is not the one this replica registered under: the registration
            // went with the store's state.
            self.epochs.learned(marked.slot, &value, &renewal.resource);
            return Ok(Renewed { still_there: false, fence: None });
        }
        Ok(Renewed { still_there: renewed == 1, fence: parse_token(&value).ok().flatten() })
    }

    async fn withdraw(&self, withdrawal: &Withdrawal) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(key(&withdrawal.resource, "inflight")).arg(member_of(&self.replica_id, withdrawal.member));
        let _removed: i64 = self.connection.query(&cmd).await.map_err(backend)?;
        Ok(())
    }
}

/// A replica's member in a resource's in-flight set: `replica:id:token` (the admission script
/// reads the token after the last colon).
fn member_of(replica_id: &str, member: Member) -> String {
    format!("{replica_id}:{}:{}", member.id, member.token.0)
}

/// A resource's slot and the slot's epoch and quiet keys (`super::epoch`).
struct EpochKeys {
    slot: u16,
    epoch: String,
    quiet: String,
}

impl EpochKeys {
    /// Of the slot of `key`, one of a resource's keys (`fg:{<tag>}:<suffix>`).
    fn of(key: &str) -> Self {
        let tag = key.strip_prefix("fg:{").and_then(|rest| rest.rsplit_once("}:")).map_or(key, |(tag, _)| tag);
        let slot = epoch::slot_of_tag(tag);
        let (epoch, quiet) = epoch::keys_of_slot(slot);
        Self { slot, epoch, quiet }
    }

    /// What a script's epoch gate said: a mark this replica did not know is learned (and a
    /// changed one reported as a lost state), and the script runs again; a quiet period fails
    /// closed. A mark that changes again at once is an error.
    fn gate(
        &self,
        epochs: &KnownEpochs,
        resource: &ResourceKey,
        answer: &str,
        mark: &str,
        quiet_ms: u64,
        answers: &mut u32,
    ) -> Result<(), StoreError> {
        *answers += 1;
        if answer == "quiet" {
            return Err(StoreError::Recovering { retry_after_ms: quiet_ms });
        }
        epochs.learned(self.slot, mark, resource);
        if *answers > 2 {
            return Err(StoreError::Backend("the store's epoch mark kept changing".into()));
        }
        Ok(())
    }
}

fn script(body: &str) -> Script {
    Script::new(&format!("{LUA_LT}{body}"))
}

/// `fg:{<resource>}:<suffix>`, with the characters that would end the hash tag escaped.
fn key(resource: &ResourceKey, suffix: &str) -> String {
    let raw = resource.as_str();
    let mut key = String::with_capacity(raw.len() + suffix.len() + 8);
    key.push_str("fg:{");
    // Copied in runs between the two ASCII bytes to escape (a character at a time cost more
    // than the rest of the admission's encoding).
    let mut run = 0;
    for (at, b) in raw.bytes().enumerate() {
        let escaped = match b {
            b'%' => "%25",
            b'}' => "%7D",
            _ => continue,
        };
        key.push_str(&raw[run..at]);
        key.push_str(escaped);
        run = at + 1;
    }
    key.push_str(&raw[run..]);
    key.push_str("}:");
    key.push_str(suffix);
    key
}

/// The key of one idempotency record: in its resource's hash slot.
fn idempotency_key(key: &IdempotencyKey) -> String {
    self::key(key.resource(), &format!("idem:{}", key.request_digest()))
}

fn decode_record(json: &str) -> Result<IdempotencyRecord, StoreError> {
    serde_json::from_str(json).map_err(|e| StoreError::Backend(Box::new(e)))
}

fn encode_record(record: &IdempotencyRecord) -> String {
    serde_json::to_string(record).expect("an idempotency record serialises")
}

fn backend(e: redis::RedisError) -> StoreError {
    if e.is_timeout() {
        return StoreError::Timeout { after_ms: 0 };
    }
    StoreError::Backend(Box::new(e))
}

fn parse_token(raw: &str) -> Result<Option<FenceToken>, StoreError> {
    if raw.is_empty() {
        return Ok(None);
    }
    FenceToken::parse(raw.as_bytes()).map(Some).map_err(|e| StoreError::Backend(Box::new(e)))
}

fn as_string(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    }
}

#[async_trait]
impl FenceStore for RedisStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        let value: Option<String> =
            self.connection.query(redis::cmd("GET").arg(key(resource, "fence"))).await.map_err(backend)?;
        parse_token(value.as_deref().unwrap_or(""))
    }

    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        let fence = key(resource, "fence");
        let marked = EpochKeys::of(&fence);
        let fresh = self.epochs.offer();
        let mut gate_answers = 0;
        let (advanced, previous) = loop {
            let mut inv = self.advance.key(&fence);
            inv.key(&marked.epoch).key(&marked.quiet);
            inv.arg(token.0.to_string()).arg(ANNOUNCE_CHANNEL).arg(resource.as_str());
            inv.arg(self.epochs.get(marked.slot)).arg(&fresh).arg(self.quiet_ms);
            let (advanced, previous, quiet_ms): (i64, String, u64) =
                self.changes.run(&self.connection, &self.advance, &inv, |_| true).await?;
            match advanced {
                -1 => marked.gate(&self.epochs, resource, "epoch", &previous, quiet_ms, &mut gate_answers)?,
                -2 => marked.gate(&self.epochs, resource, "quiet", &previous, quiet_ms, &mut gate_answers)?,
                _ => break (advanced, previous),
            }
        };
        let previous = parse_token(&previous)?;
        Ok(match (advanced, previous) {
            (1, previous) => AdvanceOutcome::Advanced { previous },
            (_, Some(current)) => AdvanceOutcome::Unchanged { current },
            (_, None) => return Err(StoreError::Backend("advance script answered without a fence".into())),
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self.connection.query(&redis::cmd("PING")).await.map_err(backend)?;
        Ok(())
    }

    fn shared(&self) -> Option<&dyn SharedRegistry> {
        Some(&self.shared)
    }
}

#[async_trait]
impl LeaseStore for RedisStore {
    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        _now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        // Redis's clock decides expiry, so replicas with skewed clocks agree.
        let (op, lease_id, holder, ttl_ms, floor) = match command {
            LeaseCommand::Acquire { holder, ttl_ms, lease_id, floor } => {
                ("acquire", lease_id, holder, ttl_ms.to_string(), floor)
            }
            LeaseCommand::Renew { lease_id } => ("renew", lease_id, String::new(), String::new(), None),
            LeaseCommand::Release { lease_id } => ("release", lease_id, String::new(), String::new(), None),
            LeaseCommand::Withdraw { lease_id } => {
                ("withdraw", lease_id, String::new(), crate::fence::WITHDRAWN_GRANT_TTL_MS.to_string(), None)
            }
        };
        let fence = key(resource, "fence");
        let marked = EpochKeys::of(&fence);
        let fresh = self.epochs.offer();
        let mut gate_answers = 0;
        let granted =
            |reply: &Vec<Value>| matches!(reply.first().map(as_string).as_deref(), Some("granted" | "renewed"));
        let reply: Vec<Value> = loop {
            let mut inv = self.lease.key(&fence);
            inv.key(key(resource, "lease")).key(&marked.epoch).key(&marked.quiet).key(key(resource, "withdrawn"));
            inv.arg(op).arg(&lease_id).arg(&holder).arg(&ttl_ms).arg(ANNOUNCE_CHANNEL).arg(resource.as_str());
            inv.arg(floor.map(|f| f.0.to_string()).unwrap_or_default());
            inv.arg(self.epochs.get(marked.slot)).arg(&fresh).arg(self.quiet_ms);
            match self.changes.run(&self.connection, &self.lease, &inv, granted).await {
                Ok(reply) => {
                    let field = |i: usize| reply.get(i).map(as_string).unwrap_or_default();
                    match field(0).as_str() {
                        gate @ ("epoch" | "quiet") => {
                            let quiet_ms = field(5).parse().unwrap_or(self.quiet_ms);
                            marked.gate(&self.epochs, resource, gate, &field(1), quiet_ms, &mut gate_answers)?;
                        }
                        _ => break reply,
                    }
                }
                Err(e) => {
                    if op == "acquire" {
                        // A grant answered 503 must not hold the lease until its TTL: nobody
                        // knows its id. Released at once (best effort: it may not replicate
                        // either, and then only expiry frees it).
                        let mut release = self.lease.key(key(resource, "fence"));
                        release.key(key(resource, "lease")).key(&marked.epoch).key(&marked.quiet);
                        release.key(key(resource, "withdrawn"));
                        release
                            .arg("withdraw")
                            .arg(&lease_id)
                            .arg("")
                            .arg(crate::fence::WITHDRAWN_GRANT_TTL_MS)
                            .arg(ANNOUNCE_CHANNEL)
                            .arg(resource.as_str());
                        release.arg("");
                        let _: redis::RedisResult<Vec<Value>> = self.connection.invoke(&release).await;
                    }
                    return Err(e);
                }
            }
        };
        let field = |i: usize| reply.get(i).map(as_string).unwrap_or_default();
        if let Some(had) = reply.get(6).map(as_string).filter(|_| field(0) == "granted" && field(7) == "1") {
            metrics::store_rollback_repaired();
            tracing::error!(
                resource = resource.as_str(),
                store_had = had,
                floor = floor.map(|t| t.0),
                "FENCE STORE ROLLBACK: the store's fence was below this replica's mark at a lease grant; granted above the mark"
            );
        }
        let number = |i: usize| field(i).parse::<u64>().map_err(|e| StoreError::Backend(Box::new(e)));
        let record = || -> Result<LeaseRecord, StoreError> {
            Ok(LeaseRecord {
                holder: field(1),
                lease_id: field(2),
                token: parse_token(&field(3))?.ok_or_else(|| StoreError::Backend("lease without a token".into()))?,
                ttl_ms: number(4)?,
                expires_at_ms: number(5)?,
            })
        };
        Ok(match field(0).as_str() {
            "granted" => LeaseOutcome::Granted(record()?),
            "renewed" => LeaseOutcome::Renewed(record()?),
            "released" => LeaseOutcome::Released,
            "held" => LeaseOutcome::Held { holder: field(1), remaining_ms: number(5)? },
            "exhausted" => LeaseOutcome::TokensExhausted,
            "gone" => LeaseOutcome::Gone,
            other => return Err(StoreError::Backend(format!("lease script answered {other:?}").into())),
        })
    }

    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(key(resource, "lease")).arg(&["holder", "lease_id", "token", "ttl_ms", "expires_at_ms"]);
        let fields: Vec<Option<String>> = self.connection.query(&cmd).await.map_err(backend)?;
        let [Some(holder), Some(lease_id), Some(token), Some(ttl_ms), Some(expires_at_ms)] =
            <[Option<String>; 5]>::try_from(fields).map_err(|_| StoreError::Backend("HMGET answered oddly".into()))?
        else {
            return Ok(None);
        };
        let number = |s: &str| s.parse::<u64>().map_err(|e| StoreError::Backend(Box::new(e)));
        Ok(Some(LeaseRecord {
            holder,
            lease_id,
            token: parse_token(&token)?.ok_or_else(|| StoreError::Backend("lease without a token".into()))?,
            ttl_ms: number(&ttl_ms)?,
            expires_at_ms: number(&expires_at_ms)?,
        }))
    }
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    async fn idempotency_begin(
        &self,
        key: &IdempotencyKey,
        claim: &IdempotencyRecord,
        now_ms: u64,
    ) -> Result<IdempotencyBegin, StoreError> {
        // Redis expires the record on its own clock; the retention is what is left of it.
        let ttl_ms = claim.expires_at_ms.saturating_sub(now_ms).max(1);
        let mut inv = self.idempotency_begin.key(idempotency_key(key));
        inv.arg(&claim.claim).arg(encode_record(claim)).arg(ttl_ms);
        let existing: Option<String> = self.connection.invoke(&inv).await.map_err(backend)?;
        match existing {
            None => Ok(IdempotencyBegin::Claimed),
            Some(json) => Ok(IdempotencyBegin::Existing(decode_record(&json)?)),
        }
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        _now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let json: Option<String> =
            self.connection.query(redis::cmd("HGET").arg(idempotency_key(key)).arg("record")).await.map_err(backend)?;
        json.map(|j| decode_record(&j)).transpose()
    }

    async fn idempotency_finish(
        &self,
        key: &IdempotencyKey,
        claim: &str,
        record: Option<&IdempotencyRecord>,
    ) -> Result<(), StoreError> {
        let mut inv = self.idempotency_finish.key(idempotency_key(key));
        inv.arg(claim).arg(record.map(encode_record).unwrap_or_default());
        let _changed: i64 = self.connection.invoke(&inv).await.map_err(backend)?;
        Ok(())
    }
}

/// The hash of multipart uploads made with a token.
const UPLOADS_KEY: &str = "fg:uploads";

#[async_trait]
impl UploadStore for RedisStore {
    async fn upload_put(&self, record: &UploadRecord) -> Result<(), StoreError> {
        let json = serde_json::to_string(record).expect("an upload record serialises");
        let cmd = redis::cmd("HSET").arg(UPLOADS_KEY).arg(record.storage_name()).arg(json).to_owned();
        let _added: i64 = self.connection.query(&cmd).await.map_err(backend)?;
        Ok(())
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        let cmd = redis::cmd("HGET").arg(UPLOADS_KEY).arg(UploadRecord::name(bucket, upload_id)).to_owned();
        let json: Option<String> = self.connection.query(&cmd).await.map_err(backend)?;
        json.map(|j| serde_json::from_str(&j).map_err(|e| StoreError::Backend(Box::new(e)))).transpose()
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        let cmd = redis::cmd("HDEL").arg(UPLOADS_KEY).arg(UploadRecord::name(bucket, upload_id)).to_owned();
        let _removed: i64 = self.connection.query(&cmd).await.map_err(backend)?;
        Ok(())
    }

    /// HSCAN: its cursor is Redis's, and a walk may see a record twice, never miss one.
    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        let cursor = cursor.unwrap_or_else(|| "0".into());
        let cmd = redis::cmd("HSCAN").arg(UPLOADS_KEY).arg(&cursor).arg("COUNT").arg(limit.max(1)).to_owned();
        let (next, fields): (String, Vec<String>) = self.connection.query(&cmd).await.map_err(backend)?;
        let records = fields
            .chunks_exact(2)
            .map(|pair| serde_json::from_str(&pair[1]).map_err(|e| StoreError::Backend(Box::new(e))))
            .collect::<Result<Vec<UploadRecord>, _>>()?;
        Ok(UploadPage { records, next: (next != "0").then_some(next) })
    }
}

/// Subscribes to advance announcements, reconnecting after failures, until the gate stops
/// listening.
async fn listen_for_announcements(url: String, announcements: Announcements) {
    let mut backoff = Duration::from_millis(50);
    while !announcements.is_closed() {
        let subscribed = async {
            let client = redis::Client::open(url.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(ANNOUNCE_CHANNEL).await?;
            Ok::<_, redis::RedisError>(pubsub)
        }
        .await;
        match subscribed {
            Ok(pubsub) => {
                backoff = Duration::from_millis(50);
                let mut messages = pubsub.into_on_message();
                while let Some(message) = messages.next().await {
                    let Ok(payload) = message.get_payload::<String>() else { continue };
                    let Some((token, resource)) = payload.split_once(' ') else { continue };
                    let (Ok(token), Ok(resource)) = (FenceToken::parse(token.as_bytes()), ResourceKey::new(resource))
                    else {
                        continue;
                    };
                    if !announcements.announced(resource, token) {
                        return;
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "advance announcements: cannot subscribe yet"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_one_resource_share_a_hash_tag() {
        let r = ResourceKey::new("job:{a}}%").unwrap();
        assert_eq!(key(&r, "fence"), "fg:{job:{a%7D%7D%25}:fence");
        assert_eq!(key(&r, "inflight"), "fg:{job:{a%7D%7D%25}:inflight");
        let k = IdempotencyKey::new(r, b"request");
        assert_eq!(idempotency_key(&k), format!("fg:{{job:{{a%7D%7D%25}}:idem:{}", k.request_digest()));
    }

    /// The slot's epoch keys are on the slot Redis Cluster puts the resource's keys on: the
    /// hash tag is the text between the key's first `{` and the next `}`.
    #[test]
    fn a_resources_epoch_keys_share_its_slot() {
        let r = ResourceKey::new("job:{a}}%").unwrap();
        let marked = EpochKeys::of(&key(&r, "fence"));
        assert_eq!(marked.slot, epoch::slot_of_tag("job:{a%7D%7D%25"));
        let tag = |k: &str| k.split_once('{').unwrap().1.split_once('}').unwrap().0.to_owned();
        assert_eq!(epoch::slot_of_tag(&tag(&marked.epoch)), marked.slot);
        assert_eq!(epoch::slot_of_tag(&tag(&marked.quiet)), marked.slot);
    }

    /// Copying in runs escapes exactly what escaping each character does.
    #[test]
    fn keys_escape_as_character_by_character() {
        let by_character = |raw: &str| {
            let escaped: String = raw
                .chars()
                .map(|c| match c {
                    '%' => "%25".to_owned(),
                    '}' => "%7D".to_owned(),
                    c => c.to_string(),
                })
                .collect();
            format!("fg:{{{escaped}}}:fence")
        };
        for raw in ["a", "%", "}", "%}", "job-1", "}}x%%", "é}ü%ß", "a}b%c}d", "日本}%語", "x%"] {
            let r = ResourceKey::new(raw).unwrap();
            assert_eq!(key(&r, "fence"), by_character(raw), "{raw}");
        }
    }
}
