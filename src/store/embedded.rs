//! The embedded fence store: one redb file, fsync on every advance, advances from many
//! resources group-committed by one writer thread. Layout and crash points: `docs/design.md`,
//! section 5.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use crate::fence::{
    AdvanceOutcome, FenceStore, FenceToken, LeaseCommand, LeaseOutcome, LeaseRecord, LeaseWrite, ResourceKey,
    StoreError, apply_lease,
};

/// resource name → fence token.
const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");
/// resource name → the lease on it, as JSON (a [`LeaseRecord`]).
const LEASES: TableDefinition<&str, &str> = TableDefinition::new("leases");

/// The database file inside `store.path`.
pub const FILE_NAME: &str = "fences.redb";

/// Changes waiting for the writer thread; a full queue makes callers wait (backpressure).
const WRITE_QUEUE_MAX: usize = 4096;
/// Changes applied in one transaction (one fsync) at most.
const WRITES_PER_COMMIT_MAX: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create the fence store directory {path}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the fence store {path} (is another fencegate using it?)")]
    Open { path: PathBuf, source: redb::DatabaseError },
    #[error("cannot initialise the fence store {path}")]
    Init { path: PathBuf, source: Box<dyn std::error::Error + Send + Sync> },
}

/// A change for the writer thread, with the channel its outcome goes back on.
enum WriteRequest {
    Advance {
        resource: ResourceKey,
        token: FenceToken,
        reply: oneshot::Sender<Result<AdvanceOutcome, StoreError>>,
    },
    Lease {
        resource: ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
        reply: oneshot::Sender<Result<LeaseOutcome, StoreError>>,
    },
}

/// The outcome of one request inside a committed batch.
enum WriteOutcome {
    Advance(AdvanceOutcome),
    Lease(LeaseOutcome),
}

impl WriteRequest {
    fn answer(self, outcome: Result<WriteOutcome, StoreError>) {
        match (self, outcome) {
            (Self::Advance { reply, .. }, Ok(WriteOutcome::Advance(o))) => drop(reply.send(Ok(o))),
            (Self::Lease { reply, .. }, Ok(WriteOutcome::Lease(o))) => drop(reply.send(Ok(o))),
            (Self::Advance { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            (Self::Lease { reply, .. }, Err(e)) => drop(reply.send(Err(e))),
            _ => unreachable!("outcomes are produced per request kind"),
        }
    }
}

pub struct EmbeddedStore {
    db: Arc<Database>,
    writes: mpsc::Sender<WriteRequest>,
    /// Set after any failed commit: from then on every call fails until a restart reopens
    /// (and so recovers) the file. A commit that failed half-way is never trusted.
    poisoned: Arc<AtomicBool>,
}

impl EmbeddedStore {
    /// Opens (or creates) the store in directory `dir`, recovering it if the last process
    /// died mid-commit.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir { path: dir.into(), source })?;
        let path = dir.join(FILE_NAME);
        let db = Database::create(&path).map_err(|source| OpenError::Open { path: path.clone(), source })?;
        let init = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let txn = db.begin_write()?;
            txn.open_table(FENCES)?;
            txn.open_table(LEASES)?;
            txn.commit()?;
            Ok(())
        };
        init().map_err(|source| OpenError::Init { path, source })?;

        let db = Arc::new(db);
        let poisoned = Arc::new(AtomicBool::new(false));
        let (writes, queue) = mpsc::channel(WRITE_QUEUE_MAX);
        let writer = Writer { db: db.clone(), poisoned: poisoned.clone() };
        std::thread::Builder::new()
            .name("fence-store-writer".into())
            .spawn(move || writer.run(queue))
            .expect("spawning the fence store writer thread");
        Ok(Self { db, writes, poisoned })
    }

    async fn submit<T>(
        &self,
        request: WriteRequest,
        answer: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.check_poisoned()?;
        self.writes.send(request).await.map_err(|_| StoreError::Closed)?;
        // A dropped reply means the writer thread died: the outcome is unknown.
        answer.await.map_err(|_| StoreError::Closed)?
    }

    fn check_poisoned(&self) -> Result<(), StoreError> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(StoreError::Poisoned);
        }
        Ok(())
    }
}

#[async_trait]
impl FenceStore for EmbeddedStore {
    async fn load(&self, resource: &ResourceKey) -> Result<Option<FenceToken>, StoreError> {
        self.check_poisoned()?;
        let db = self.db.clone();
        let resource = resource.clone();
        tokio::task::spawn_blocking(move || -> Result<Option<FenceToken>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(FENCES)?;
            Ok(table.get(resource.as_str())?.map(|v| FenceToken(v.value())))
        })
        .await
        .map_err(|e| StoreError::Backend(Box::new(e)))?
        .map_err(|e| StoreError::Backend(Box::new(e)))
    }

    async fn advance(&self, resource: &ResourceKey, token: FenceToken) -> Result<AdvanceOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.submit(WriteRequest::Advance { resource: resource.clone(), token, reply }, answer).await
    }

    async fn lease(
        &self,
        resource: &ResourceKey,
        command: LeaseCommand,
        now_ms: u64,
    ) -> Result<LeaseOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.submit(WriteRequest::Lease { resource: resource.clone(), command, now_ms, reply }, answer).await
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.check_poisoned()
    }
}

/// The one thread that writes: takes every queued change, applies them in one transaction,
/// commits (fsync) once, then answers each caller.
struct Writer {
    db: Arc<Database>,
    poisoned: Arc<AtomicBool>,
}

impl Writer {
    fn run(self, mut queue: mpsc::Receiver<WriteRequest>) {
        let mut batch = Vec::with_capacity(WRITES_PER_COMMIT_MAX);
        while let Some(first) = queue.blocking_recv() {
            batch.push(first);
            while batch.len() < WRITES_PER_COMMIT_MAX {
                match queue.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            if self.poisoned.load(Ordering::Acquire) {
                for request in batch.drain(..) {
                    request.answer(Err(StoreError::Poisoned));
                }
                continue;
            }
            match self.commit(&mut batch) {
                Ok(outcomes) => {
                    for (request, outcome) in batch.drain(..).zip(outcomes) {
                        request.answer(Ok(outcome));
                    }
                }
                Err(error) => {
                    self.poisoned.store(true, Ordering::Release);
                    tracing::error!(%error, "fence store commit failed; refusing all work until restart");
                    for request in batch.drain(..) {
                        request.answer(Err(StoreError::Poisoned));
                    }
                }
            }
        }
    }

    fn commit(&self, batch: &mut [WriteRequest]) -> Result<Vec<WriteOutcome>, redb::Error> {
        let txn = self.db.begin_write()?; // durability Immediate: commit fsyncs
        let mut outcomes = Vec::with_capacity(batch.len());
        {
            let mut fences = txn.open_table(FENCES)?;
            let mut leases = txn.open_table(LEASES)?;
            for request in batch.iter_mut() {
                let outcome = match request {
                    WriteRequest::Advance { resource, token, .. } => {
                        let previous = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
                        WriteOutcome::Advance(match previous {
                            Some(current) if current >= *token => AdvanceOutcome::Unchanged { current },
                            _ => {
                                fences.insert(resource.as_str(), token.0)?;
                                AdvanceOutcome::Advanced { previous }
                            }
                        })
                    }
                    WriteRequest::Lease { resource, command, now_ms, .. } => {
                        let fence = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
                        let current: Option<LeaseRecord> = match leases.get(resource.as_str())? {
                            Some(json) => Some(
                                serde_json::from_str(json.value())
                                    .map_err(|e| redb::Error::Corrupted(e.to_string()))?,
                            ),
                            None => None,
                        };
                        let t = apply_lease(fence, current.as_ref(), command.clone(), *now_ms);
                        if let Some(fence) = t.fence {
                            fences.insert(resource.as_str(), fence.0)?;
                        }
                        match t.lease {
                            LeaseWrite::Keep => {}
                            LeaseWrite::Put(record) => {
                                let json = serde_json::to_string(&record).expect("a lease record serialises");
                                leases.insert(resource.as_str(), json.as_str())?;
                            }
                            LeaseWrite::Delete => {
                                leases.remove(resource.as_str())?;
                            }
                        }
                        WriteOutcome::Lease(t.outcome)
                    }
                };
                outcomes.push(outcome);
            }
        }
        txn.commit()?;
        Ok(outcomes)
    }
}
