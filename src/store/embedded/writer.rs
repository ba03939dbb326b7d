//! The one thread that writes: it takes every queued change, applies them in one transaction,
//! commits (fsync) once, then answers each caller.

use super::*;

/// The one thread that writes: takes every queued change, applies them in one transaction,
/// commits (fsync) once, then answers each caller.
pub(super) struct Writer {
    pub(super) db: Arc<Database>,
    pub(super) place: Arc<Place>,
    pub(super) witness: Arc<Mutex<Witness>>,
    pub(super) poisoned: Arc<AtomicBool>,
    /// `store.idempotency_records_max`.
    pub(super) records_max: Arc<AtomicUsize>,
    /// `store.idempotency_records_bytes_max`.
    pub(super) records_bytes_max: Arc<AtomicU64>,
    /// The bytes the records take now ([`record_bytes`] each), counted at open and kept up
    /// to date by every change (a failed commit poisons the store, so it never drifts).
    pub(super) records_bytes: u64,
    /// The upload records' counts, kept the same way.
    pub(super) uploads: uploads::Counted,
}

impl Writer {
    pub(super) fn run(mut self, mut queue: mpsc::Receiver<WriteRequest>) {
        let mut batch = Vec::with_capacity(WRITES_PER_COMMIT_MAX);
        while let Some(first) = queue.blocking_recv() {
            batch.push(first);
            while batch.len() < WRITES_PER_COMMIT_MAX {
                match queue.try_recv() {
                    Ok(next) => batch.push(next),
                    Err(_) => break,
                }
            }
            if let Err(lost) = self.place.check() {
                // An advance made now would be fsynced into a file no later start reads.
                if !self.poisoned.swap(true, Ordering::AcqRel) {
                    tracing::error!(error = %lost, "fence store file lost");
                }
            }
            let witness = self.witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner).check();
            if let Err(lost) = witness {
                // Its records would go to a file no later start reads: a copy restored then
                // would pass.
                if !self.poisoned.swap(true, Ordering::AcqRel) {
                    tracing::error!(error = %lost, "fence store witness lost");
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

    fn commit(
        &mut self,
        batch: &mut [WriteRequest],
    ) -> Result<Vec<WriteOutcome>, Box<dyn std::error::Error + Send + Sync>> {
        let witness = self.witness.clone();
        let mut witness = witness.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let txn = self.db.begin_write()?; // durability Immediate: commit fsyncs
        let mut outcomes = Vec::with_capacity(batch.len());
        // The latest clock reading of the records added in this commit, and how many.
        let (mut sweep_now_ms, mut added) = (0u64, 0usize);
        {
            let mut fences = txn.open_table(FENCES)?;
            let mut leases = txn.open_table(LEASES)?;
            let mut records = txn.open_table(IDEMPOTENCY)?;
            let mut expiry = txn.open_table(IDEMPOTENCY_EXPIRY)?;
            let mut uploads = txn.open_table(UPLOADS)?;
            for request in batch.iter_mut() {
                let outcome = match request {
                    WriteRequest::Advance { resource, token, .. } => {
                        WriteOutcome::Advance(advance(&mut fences, resource, *token)?)
                    }
                    WriteRequest::Lease { resource, command, now_ms, .. } => {
                        WriteOutcome::Lease(lease(&mut fences, &mut leases, resource, command, *now_ms)?)
                    }
                    WriteRequest::IdempotencyBegin { name, claim, expires_at_ms, json, now_ms, .. } => {
                        sweep_now_ms = sweep_now_ms.max(*now_ms);
                        let claim = Claim { name, claim, expires_at_ms: *expires_at_ms, json, now_ms: *now_ms };
                        let existing = self.begin(&mut records, &mut expiry, &claim)?;
                        added += usize::from(existing.is_none());
                        WriteOutcome::IdempotencyBegin(existing)
                    }
                    WriteRequest::IdempotencyFinish { name, claim, json, .. } => {
                        self.finish(&mut records, &mut expiry, name, claim, json.as_deref())?;
                        WriteOutcome::IdempotencyFinish
                    }
                    WriteRequest::Upload { name, json, limits, .. } => {
                        WriteOutcome::Upload(self.uploads.write(&mut uploads, name, json.as_deref(), limits)?)
                    }
                };
                outcomes.push(outcome);
            }
            if added > 0 {
                let swept =
                    sweep_expired(&mut records, &mut expiry, sweep_now_ms, SWEEP_PER_COMMIT_MIN.max(2 * added))?;
                self.records_bytes = self.records_bytes.saturating_sub(swept);
            }
        }
        let generation = next_generation(&mut txn.open_table(META)?)?.generation;
        txn.commit()?;
        // Before any caller is answered: the witness never trails an acknowledged change.
        witness.record(generation)?;
        Ok(outcomes)
    }

    /// Stores a claim unless a live record is there: `None` when it was stored, else the live
    /// record's JSON (empty when the records are full).
    fn begin(
        &mut self,
        records: &mut redb::Table<&str, (u64, &str, &[u8])>,
        expiry: &mut redb::Table<(u64, &str), ()>,
        claim: &Claim<'_>,
    ) -> Result<Option<Vec<u8>>, redb::Error> {
        use redb::ReadableTableMetadata;
        let Claim { name, claim: owner, expires_at_ms, json, now_ms } = *claim;
        let current = records.get(name.as_str())?.map(|v| {
            let (expires, owner, json) = v.value();
            (expires, json.to_vec(), record_bytes(name, owner, json))
        });
        match current {
            Some((expires, json, _)) if expires > now_ms => return Ok(Some(json)),
            Some((expires, _, bytes)) => {
                expiry.remove((expires, name.as_str()))?;
                records.remove(name.as_str())?;
                self.records_bytes = self.records_bytes.saturating_sub(bytes);
            }
            None => {}
        }
        // Full: room from what has expired first; a live record is never dropped to make room
        // (a retry of its request would execute again): the new claim is refused instead.
        let bytes = record_bytes(name, owner, json);
        let (count_max, bytes_max) =
            (self.records_max.load(Ordering::Relaxed) as u64, self.records_bytes_max.load(Ordering::Relaxed));
        let mut full = records.len()? >= count_max || self.records_bytes + bytes > bytes_max;
        if full {
            let swept = sweep_expired(records, expiry, now_ms, SWEEP_PER_COMMIT_MIN)?;
            self.records_bytes = self.records_bytes.saturating_sub(swept);
            full = records.len()? >= count_max || self.records_bytes + bytes > bytes_max;
        }
        if full {
            crate::metrics::idempotency_records_full();
            return Ok(Some(Vec::new()));
        }
        records.insert(name.as_str(), (expires_at_ms, owner.as_str(), json.as_slice()))?;
        expiry.insert((expires_at_ms, name.as_str()), ())?;
        self.records_bytes += bytes;
        Ok(None)
    }

    /// Replaces (or, with `None`, removes) the record under `name` if it is still `claim`'s.
    fn finish(
        &mut self,
        records: &mut redb::Table<&str, (u64, &str, &[u8])>,
        expiry: &mut redb::Table<(u64, &str), ()>,
        name: &str,
        claim: &str,
        json: Option<&[u8]>,
    ) -> Result<(), redb::Error> {
        let current = records.get(name)?.map(|v| {
            let (expires, owner, old) = v.value();
            (expires, owner == claim, record_bytes(name, owner, old))
        });
        match (current, json) {
            (Some((expires, true, old)), Some(json)) => {
                // The outcome may take the record past the bytes cap, by at most one response
                // per claim in flight: claims are what the cap refuses.
                records.insert(name, (expires, claim, json))?;
                self.records_bytes = self.records_bytes.saturating_sub(old) + record_bytes(name, claim, json);
            }
            (Some((expires, true, old)), None) => {
                records.remove(name)?;
                expiry.remove((expires, name))?;
                self.records_bytes = self.records_bytes.saturating_sub(old);
            }
            _ => {} // not ours any more: it expired and was claimed again
        }
        Ok(())
    }
}

/// An idempotency claim as the writer applies it.
#[derive(Clone, Copy)]
struct Claim<'a> {
    name: &'a String,
    claim: &'a String,
    expires_at_ms: u64,
    json: &'a Vec<u8>,
    now_ms: u64,
}

/// Raises the fence of `resource` to `token` if that is greater.
fn advance(
    fences: &mut redb::Table<&str, u64>,
    resource: &ResourceKey,
    token: FenceToken,
) -> Result<AdvanceOutcome, redb::Error> {
    let previous = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
    Ok(match previous {
        Some(current) if current >= token => AdvanceOutcome::Unchanged { current },
        _ => {
            fences.insert(resource.as_str(), token.0)?;
            AdvanceOutcome::Advanced { previous }
        }
    })
}

/// Applies a lease command and the fence it raises, in the same transaction.
fn lease(
    fences: &mut redb::Table<&str, u64>,
    leases: &mut redb::Table<&str, &str>,
    resource: &ResourceKey,
    command: &LeaseCommand,
    now_ms: u64,
) -> Result<LeaseOutcome, redb::Error> {
    let fence = fences.get(resource.as_str())?.map(|v| FenceToken(v.value()));
    let current: Option<LeaseRecord> = match leases.get(resource.as_str())? {
        Some(json) => Some(serde_json::from_str(json.value()).map_err(|e| redb::Error::Corrupted(e.to_string()))?),
        None => None,
    };
    let t = apply_lease(fence, current.as_ref(), command.clone(), now_ms);
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
    Ok(t.outcome)
}

/// Removes up to `max` records that expired at or before `now_ms`, oldest first; the bytes
/// they took ([`record_bytes`]).
fn sweep_expired(
    records: &mut redb::Table<&str, (u64, &str, &[u8])>,
    expiry: &mut redb::Table<(u64, &str), ()>,
    now_ms: u64,
    max: usize,
) -> Result<u64, redb::Error> {
    let (mut swept, mut bytes) = (0, 0);
    while swept < max {
        let oldest = expiry.first()?.map(|(k, _)| {
            let (expires, name) = k.value();
            (expires, name.to_owned())
        });
        let Some((expires, name)) = oldest.filter(|(expires, _)| *expires <= now_ms) else { break };
        expiry.remove((expires, name.as_str()))?;
        // The index entry of a record claimed again after expiring was replaced; the record
        // is only removed if it is the one this entry is for.
        let same = records.get(name.as_str())?.and_then(|v| {
            let (at, owner, json) = v.value();
            (at == expires).then(|| record_bytes(&name, owner, json))
        });
        if let Some(size) = same {
            records.remove(name.as_str())?;
            bytes += size;
        }
        swept += 1;
    }
    Ok(bytes)
}

/// What one record counts against `store.idempotency_records_bytes_max`: its key, claim and
/// JSON, and its expiry twice (the record's and the index's), as stored.
pub(super) fn record_bytes(name: &str, claim: &str, json: &[u8]) -> u64 {
    (2 * name.len() + claim.len() + json.len() + 16) as u64
}

/// The bytes of every record in the file, counted once at open.
pub(super) fn records_bytes(db: &Database) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    use redb::{ReadableDatabase, ReadableTable};
    let txn = db.begin_read()?;
    let table = txn.open_table(IDEMPOTENCY)?;
    let mut bytes = 0;
    for entry in table.iter()? {
        let (name, value) = entry?;
        let (_, claim, json) = value.value();
        bytes += record_bytes(name.value(), claim, json);
    }
    Ok(bytes)
}

pub(super) fn encode(record: &IdempotencyRecord) -> Vec<u8> {
    serde_json::to_vec(record).expect("an idempotency record serialises")
}

pub(super) fn decode(json: &[u8]) -> Result<IdempotencyRecord, StoreError> {
    serde_json::from_slice(json).map_err(|e| StoreError::Backend(Box::new(e)))
}
