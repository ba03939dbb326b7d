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
    AdvanceOutcome, FenceStore, FenceToken, IdempotencyKey, IdempotencyRecord, ResourceKey, SharedAdmit,
    SharedRegistry, StoreError,
};
use crate::metrics;

pub(super) mod durability;
mod links;
use links::*;

mod listing;
mod records;

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
/// KEYS: epoch, quiet (of one slot). ARGV: fresh epoch, quiet ms. The slot's gate as a first
/// use would pass it; returns the quiet period left there (ms, 0 when none).
const LUA_SLOT_GATE: &str = "local g = epoch_gate(KEYS[1], KEYS[2], '', ARGV[1], ARGV[2], true)\n\
                             if g then return g[3] end\nreturn 0\n";

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

/// KEYS: record. ARGV: claim, record JSON, ttl_ms, Redis's memory share for records
/// (numerator, denominator). Claims the key unless a record is there (Redis drops it when its
/// time is up); returns that record's JSON, nil once claimed, or "\nfull" when Redis is past
/// the share (nothing claimed).
const LUA_IDEMPOTENCY_BEGIN: &str = include_str!("lua/idempotency_begin.lua");

/// KEYS: record. ARGV: claim, record JSON or '' (remove). Only the claimant's record changes;
/// HSET keeps the key's expiry. Returns 1 if it changed.
const LUA_IDEMPOTENCY_FINISH: &str = include_str!("lua/idempotency_finish.lua");

/// The helpers of the scripts that keep records for callers (Redis's memory share for
/// records, what an upload record counts against, counting it), before each of them:
/// `idempotency_begin.lua`, `upload_put.lua`, `upload_remove.lua`, `upload_recount.lua`.
const LUA_RECORDS: &str = include_str!("lua/records.lua");

fn records_script(body: &str) -> Script {
    Script::new(&format!("{LUA_RECORDS}{body}"))
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
        timeout_ms: u64,
    ) -> anyhow::Result<Self> {
        let mut waiting = Vec::new();
        if wait.is_some() {
            for _ in 0..WAITING_CONNECTIONS {
                let manager = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
                waiting.push(Connection { shared: Link::Single(manager), threads: None, timeout_ms });
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
            return connection.invoke(inv).await;
        };
        let waiting = &self.waiting[self.next.fetch_add(1, Ordering::Relaxed) % self.waiting.len()];
        let mut pipe = redis::pipe();
        pipe.load_script(script).invoke_script(inv).cmd("WAIT").arg(wait.replicas).arg(millis(wait.timeout));
        let (_sha, answer, confirmed): (String, T, u32) = waiting.pipeline(&pipe).await?;
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
    upload_put: Script,
    upload_remove: Script,
    /// Slot 0's epoch gate alone: readiness (`ping`).
    slot_gate: Script,
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
            let changes = Changes::open(&client, &config, wait, millis(response_timeout)).await?;
            let shared = Link::Single(ConnectionManager::new_with_config(client.clone(), config.clone()).await?);
            let threads = (serving_threads > 0).then(|| ThreadLinks::new(client, config, serving_threads));
            (Connection { shared, threads, timeout_ms: millis(response_timeout) }, changes)
        } else {
            anyhow::ensure!(wait.is_none(), "store.wait_replicas is not supported with a Redis Cluster");
            let client = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
                .response_timeout(response_timeout)
                .connection_timeout(response_timeout)
                .build()?;
            let changes = Changes { waiting: Vec::new(), next: AtomicUsize::new(0), wait: None };
            let shared = Link::Cluster(client.get_async_connection().await?);
            (Connection { shared, threads: None, timeout_ms: millis(response_timeout) }, changes)
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
        let store = Self {
            connection,
            epochs,
            quiet_ms: millis(quiet),
            advance: script(LUA_ADVANCE),
            lease: script(LUA_LEASE),
            idempotency_begin: records_script(LUA_IDEMPOTENCY_BEGIN),
            idempotency_finish: script(LUA_IDEMPOTENCY_FINISH),
            upload_put: records_script(include_str!("lua/upload_put.lua")),
            upload_remove: records_script(include_str!("lua/upload_remove.lua")),
            slot_gate: script(LUA_SLOT_GATE),
            changes,
            shared,
        };
        store.count_uploads().await?;
        Ok(store)
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
                marked += usize::from(set?.is_some());
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
        let (fence, deadline): (Option<String>, Option<String>) = self.connection.pipeline(&pipe).await?;
        let fence = parse_token(fence.as_deref().unwrap_or(""))?;
        Ok(crate::store::shared::checked(fence, token, floor, deadline.is_some()))
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
        let _removed: i64 = self.connection.query(&cmd).await?;
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
        let value: Option<String> = self.connection.query(redis::cmd("GET").arg(key(resource, "fence"))).await?;
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

    /// The store answers, and slot 0 admits: a store with no mark there (a new one never
    /// initialised, or one that lost its state) is not ready. Its gate runs as a first write
    /// there would (writing a mark, starting the quiet period), so that readiness comes back by
    /// itself once the quiet period has passed, with or without `init-store`.
    async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self.connection.query(&redis::cmd("PING")).await?;
        let (epoch, quiet) = epoch::keys_of_slot(0);
        let mut inv = self.slot_gate.prepare_invoke();
        inv.key(&epoch).key(&quiet).arg(epoch::new_epoch()).arg(self.quiet_ms);
        let quiet_ms: u64 = self.connection.invoke(&inv).await?;
        if quiet_ms > 0 {
            return Err(StoreError::Recovering { retry_after_ms: quiet_ms });
        }
        Ok(())
    }

    fn shared(&self) -> Option<&dyn SharedRegistry> {
        Some(&self.shared)
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
mod tests;
