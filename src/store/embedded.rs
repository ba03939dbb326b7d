//! The embedded fence store: one redb file, fsync on every advance, advances from many
//! resources group-committed by one writer thread. Layout and crash points: `docs/design.md`,
//! section 5.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use crate::fence::{AdvanceOutcome, FenceStore, FenceToken, ResourceKey, StoreError};

/// resource name → fence token.
const FENCES: TableDefinition<&str, u64> = TableDefinition::new("fences");

/// The database file inside `store.path`.
pub const FILE_NAME: &str = "fences.redb";

/// Advances waiting for the writer thread; a full queue makes callers wait (backpressure).
const ADVANCE_QUEUE_MAX: usize = 4096;
/// Advances applied in one transaction (one fsync) at most.
const ADVANCES_PER_COMMIT_MAX: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot create the fence store directory {path}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open the fence store {path} (is another fencegate using it?)")]
    Open {
        path: PathBuf,
        source: redb::DatabaseError,
    },
    #[error("cannot initialise the fence store {path}")]
    Init {
        path: PathBuf,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

struct AdvanceRequest {
    resource: ResourceKey,
    token: FenceToken,
    reply: oneshot::Sender<Result<AdvanceOutcome, StoreError>>,
}

pub struct EmbeddedStore {
    db: Arc<Database>,
    advances: mpsc::Sender<AdvanceRequest>,
    /// Set after any failed commit: from then on every call fails until a restart reopens
    /// (and so recovers) the file. A commit that failed half-way is never trusted.
    poisoned: Arc<AtomicBool>,
}

impl EmbeddedStore {
    /// Opens (or creates) the store in directory `dir`, recovering it if the last process
    /// died mid-commit.
    pub fn open(dir: &Path) -> Result<Self, OpenError> {
        std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir {
            path: dir.into(),
            source,
        })?;
        let path = dir.join(FILE_NAME);
        let db = Database::create(&path).map_err(|source| OpenError::Open {
            path: path.clone(),
            source,
        })?;
        let init = || -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let txn = db.begin_write()?;
            txn.open_table(FENCES)?;
            txn.commit()?;
            Ok(())
        };
        init().map_err(|source| OpenError::Init { path, source })?;

        let db = Arc::new(db);
        let poisoned = Arc::new(AtomicBool::new(false));
        let (advances, queue) = mpsc::channel(ADVANCE_QUEUE_MAX);
        let writer = Writer {
            db: db.clone(),
            poisoned: poisoned.clone(),
        };
        std::thread::Builder::new()
            .name("fence-store-writer".into())
            .spawn(move || writer.run(queue))
            .expect("spawning the fence store writer thread");
        Ok(Self {
            db,
            advances,
            poisoned,
        })
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

    async fn advance(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
    ) -> Result<AdvanceOutcome, StoreError> {
        self.check_poisoned()?;
        let (reply, answer) = oneshot::channel();
        let request = AdvanceRequest {
            resource: resource.clone(),
            token,
            reply,
        };
        self.advances
            .send(request)
            .await
            .map_err(|_| StoreError::Closed)?;
        // A dropped reply means the writer thread died: the outcome is unknown.
        answer.await.map_err(|_| StoreError::Closed)?
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.check_poisoned()
    }
}

/// The one thread that writes: takes every queued advance, applies them in one transaction,
/// commits (fsync) once, then answers each caller.
struct Writer {
    db: Arc<Database>,
    poisoned: Arc<AtomicBool>,
}

impl Writer {
    fn run(self, mut queue: mpsc::Receiver<AdvanceRequest>) {
        let mut batch = Vec::with_capacity(ADVANCES_PER_COMMIT_MAX);
        while let Some(first) = queue.blocking_recv() {
            batch.push(first);
            while batch.len() < ADVANCES_PER_COMMIT_MAX {
                match queue.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            if self.poisoned.load(Ordering::Acquire) {
                for request in batch.drain(..) {
                    let _ = request.reply.send(Err(StoreError::Poisoned));
                }
                continue;
            }
            match self.commit(&batch) {
                Ok(outcomes) => {
                    for (request, outcome) in batch.drain(..).zip(outcomes) {
                        let _ = request.reply.send(Ok(outcome));
                    }
                }
                Err(error) => {
                    self.poisoned.store(true, Ordering::Release);
                    tracing::error!(%error, "fence store commit failed; refusing all work until restart");
                    for request in batch.drain(..) {
                        let _ = request.reply.send(Err(StoreError::Poisoned));
                    }
                }
            }
        }
    }

    fn commit(&self, batch: &[AdvanceRequest]) -> Result<Vec<AdvanceOutcome>, redb::Error> {
        let txn = self.db.begin_write()?; // durability Immediate: commit fsyncs
        let mut outcomes = Vec::with_capacity(batch.len());
        {
            let mut table = txn.open_table(FENCES)?;
            for request in batch {
                let previous = table
                    .get(request.resource.as_str())?
                    .map(|v| FenceToken(v.value()));
                let outcome = match previous {
                    Some(current) if current >= request.token => {
                        AdvanceOutcome::Unchanged { current }
                    }
                    _ => {
                        table.insert(request.resource.as_str(), request.token.0)?;
                        AdvanceOutcome::Advanced { previous }
                    }
                };
                outcomes.push(outcome);
            }
        }
        txn.commit()?;
        Ok(outcomes)
    }
}
