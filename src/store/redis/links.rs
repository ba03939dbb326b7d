//! The connections to Redis: a shared one, and each serving thread's own once it is open.

use super::*;

/// One connection kind or the other; both multiplex requests and reconnect by themselves.
#[derive(Clone)]
pub(super) enum Link {
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
pub(super) struct Connection {
    pub(super) shared: Link,
    pub(super) threads: Option<Arc<ThreadLinks>>,
    /// The client's response timeout (`store.timeout_ms`), named when a call runs past it.
    pub(super) timeout_ms: u64,
}

impl Connection {
    /// Whether this is a Redis Cluster's connection (a `SCAN` there sees one node only).
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.shared, Link::Cluster(_))
    }

    /// Runs `call` on the thread's own connection or the shared one. A broken connection (an
    /// error on which the client library reconnects), own or shared, most likely means that
    /// Redis restarted or failed over: every thread then forgets its own connection, which is
    /// broken too or soon will be, and takes the shared one (reconnecting) until it opens
    /// another. A call that `may_repeat` (a read, or a change that gives the same end twice)
    /// and found its thread's connection broken is tried again on the shared one at once.
    pub(super) async fn call<T, F, Fut>(&self, may_repeat: bool, call: F) -> redis::RedisResult<T>
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
    pub(super) async fn invoke<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        self.call(false, |link| async move {
            match link {
                Link::Single(mut c) => inv.invoke_async(&mut c).await,
                Link::Cluster(mut c) => inv.invoke_async(&mut c).await,
            }
        })
        .await
        .map_err(|e| self.failed(e))
    }

    /// A command that may run twice: a read, a `ZREM`, a `PING`.
    pub(super) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        self.call(true, |link| async move {
            match link {
                Link::Single(mut c) => cmd.query_async(&mut c).await,
                Link::Cluster(mut c) => cmd.query_async(&mut c).await,
            }
        })
        .await
        .map_err(|e| self.failed(e))
    }

    /// Reads sent together; in a cluster their keys must share a slot.
    pub(super) async fn pipeline<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> Result<T, StoreError> {
        self.call(true, |link| async move {
            match link {
                Link::Single(mut c) => pipe.query_async(&mut c).await,
                Link::Cluster(mut c) => pipe.query_async(&mut c).await,
            }
        })
        .await
        .map_err(|e| self.failed(e))
    }

    /// A failed call as the store reports it: a timeout names the client's.
    fn failed(&self, e: redis::RedisError) -> StoreError {
        if e.is_timeout() {
            return StoreError::Timeout { after_ms: self.timeout_ms };
        }
        StoreError::Backend(Box::new(e))
    }
}

/// At most this many connections of the serving threads; threads beyond share them.
pub(super) const THREAD_LINKS_MAX: usize = 16;

/// How long a serving thread whose connection failed to open uses the shared one before it
/// tries again.
pub(super) const THREAD_LINK_RETRY: Duration = Duration::from_secs(1);

/// The serving threads' own connections to one Redis (not a cluster), one per thread.
///
/// A connection's task runs on the runtime that opened it, so each is opened on its thread,
/// in the background, the first time the thread calls Redis: a call never waits for it, and
/// takes the shared connection until it is open. On the shared connection a write's call and
/// its answer crossed to the main runtime and back, waking a second thread each time
/// (docs/perf-log.md, "Redis connections per serving thread").
pub(super) struct ThreadLinks {
    client: redis::Client,
    config: ConnectionManagerConfig,
    slots: Box<[ThreadLink]>,
    epoch: Instant,
}

pub(super) struct ThreadLink {
    open: Mutex<Option<ConnectionManager>>,
    /// Milliseconds since `epoch` before which no opening starts (`u64::MAX` while one runs).
    next_attempt_ms: AtomicU64,
}

impl ThreadLinks {
    pub(super) fn new(client: redis::Client, config: ConnectionManagerConfig, threads: usize) -> Arc<Self> {
        let slots = (0..threads.clamp(1, THREAD_LINKS_MAX))
            .map(|_| ThreadLink { open: Mutex::new(None), next_attempt_ms: AtomicU64::new(0) })
            .collect();
        Arc::new(Self { client, config, slots, epoch: Instant::now() })
    }

    /// The connection of serving thread `thread`, if it is open; otherwise starts opening it
    /// (on this thread) unless an opening runs or failed within [`THREAD_LINK_RETRY`].
    pub(super) fn get(self: &Arc<Self>, thread: usize) -> Option<ConnectionManager> {
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

    pub(super) async fn open(&self, index: usize) {
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
    pub(super) fn forget_all(&self, error: &redis::RedisError) {
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

    pub(super) fn now_ms(&self) -> u64 {
        millis(self.epoch.elapsed())
    }
}

/// Lets an opening start again if the one under way is dropped before it ends.
pub(super) struct RetryOnDrop<'a>(&'a AtomicU64);

impl Drop for RetryOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}
