//! What the Redis store keeps beside the fences: leases, the API gateway's idempotency
//! records and the records of multipart uploads made with a token.

use super::*;
use crate::fence::{
    Full, IdempotencyBegin, IdempotencyStore, Keep, LeaseCommand, LeaseOutcome, LeaseRecord, LeaseStore,
    MEMORY_FOR_RECORDS, RecordLimits, UploadPage, UploadRecord, UploadStore,
};

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
                        self.release_unanswered_grant(resource, &marked, &lease_id).await;
                    }
                    return Err(e);
                }
            }
        };
        lease_outcome(&reply, resource, floor)
    }

    async fn lease_record(&self, resource: &ResourceKey) -> Result<Option<LeaseRecord>, StoreError> {
        let fields: Vec<Option<String>> = self.connection.query(&lease_fields(resource)).await?;
        lease_of_fields(fields)
    }
}

impl RedisStore {
    /// A grant answered 503 must not hold the lease until its TTL: nobody knows its id. Released
    /// at once (best effort: it may not replicate either, and then only expiry frees it).
    async fn release_unanswered_grant(&self, resource: &ResourceKey, marked: &EpochKeys, lease_id: &str) {
        let mut release = self.lease.key(key(resource, "fence"));
        release.key(key(resource, "lease")).key(&marked.epoch).key(&marked.quiet);
        release.key(key(resource, "withdrawn"));
        release
            .arg("withdraw")
            .arg(lease_id)
            .arg("")
            .arg(crate::fence::WITHDRAWN_GRANT_TTL_MS)
            .arg(ANNOUNCE_CHANNEL)
            .arg(resource.as_str());
        release.arg("");
        let _: Result<Vec<Value>, StoreError> = self.connection.invoke(&release).await;
    }
}

/// What the lease script's `reply` says; a grant above a mark the store had lost is told loudly.
fn lease_outcome(
    reply: &[Value],
    resource: &ResourceKey,
    floor: Option<FenceToken>,
) -> Result<LeaseOutcome, StoreError> {
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

/// The `HMGET` of a lease's fields, which [`lease_of_fields`] reads.
pub(super) fn lease_fields(resource: &ResourceKey) -> redis::Cmd {
    let mut cmd = redis::cmd("HMGET");
    cmd.arg(key(resource, "lease")).arg(&["holder", "lease_id", "token", "ttl_ms", "expires_at_ms"]);
    cmd
}

/// The lease in the answer to [`lease_fields`]; `None` when there is none (or only part of one).
pub(super) fn lease_of_fields(fields: Vec<Option<String>>) -> Result<Option<LeaseRecord>, StoreError> {
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
        inv.arg(MEMORY_FOR_RECORDS.0).arg(MEMORY_FOR_RECORDS.1);
        let existing: Option<String> = self.connection.invoke(&inv).await?;
        match existing {
            None => Ok(IdempotencyBegin::Claimed),
            Some(full) if full == "\nfull" => {
                crate::metrics::idempotency_records_full();
                crate::metrics::records_refused("idempotency", Full::Memory.label());
                Ok(IdempotencyBegin::Full)
            }
            Some(json) => Ok(IdempotencyBegin::Existing(decode_record(&json)?)),
        }
    }

    async fn idempotency_get(
        &self,
        key: &IdempotencyKey,
        _now_ms: u64,
    ) -> Result<Option<IdempotencyRecord>, StoreError> {
        let json: Option<String> =
            self.connection.query(redis::cmd("HGET").arg(idempotency_key(key)).arg("record")).await?;
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
        let _changed: i64 = self.connection.invoke(&inv).await?;
        Ok(())
    }
}

/// The hash of multipart uploads made with a token.
pub(super) const UPLOADS_KEY: &str = "fg:uploads";

impl RedisStore {
    /// Counts the upload records of a store written before fencegate counted them (once: the
    /// script blocks Redis for as long as it reads them, about 10 µs a record).
    pub(super) async fn count_uploads(&self) -> Result<(), StoreError> {
        let script = records_script(include_str!("lua/upload_recount.lua"));
        let counted: i64 = self.connection.invoke(&script.key(UPLOADS_KEY)).await?;
        if counted > 0 {
            tracing::info!(counted, "counted the upload records kept before");
        }
        Ok(())
    }
}

#[async_trait]
impl UploadStore for RedisStore {
    async fn upload_put(&self, record: &UploadRecord, limits: &RecordLimits) -> Result<Keep, StoreError> {
        let mut inv = self.upload_put.key(UPLOADS_KEY);
        inv.arg(record.storage_name()).arg(record.to_json());
        inv.arg(limits.per_caller).arg(limits.per_resource).arg(limits.count).arg(limits.bytes);
        inv.arg(MEMORY_FOR_RECORDS.0).arg(MEMORY_FOR_RECORDS.1);
        let answer: String = self.connection.invoke(&inv).await?;
        match answer.as_str() {
            "kept" => Ok(Keep::Kept),
            bound => Full::named(bound, limits)
                .map(Keep::Full)
                .ok_or_else(|| StoreError::Backend(format!("upload_put.lua answered {bound:?}").into())),
        }
    }

    async fn upload_get(&self, bucket: &str, upload_id: &str) -> Result<Option<UploadRecord>, StoreError> {
        let cmd = redis::cmd("HGET").arg(UPLOADS_KEY).arg(UploadRecord::name(bucket, upload_id)).to_owned();
        let json: Option<String> = self.connection.query(&cmd).await?;
        json.map(|j| serde_json::from_str(&j).map_err(|e| StoreError::Backend(Box::new(e)))).transpose()
    }

    async fn upload_remove(&self, bucket: &str, upload_id: &str) -> Result<(), StoreError> {
        let mut inv = self.upload_remove.key(UPLOADS_KEY);
        inv.arg(UploadRecord::name(bucket, upload_id));
        let _removed: i64 = self.connection.invoke(&inv).await?;
        Ok(())
    }

    /// HSCAN: its cursor is Redis's, and a walk may see a record twice, never miss one. The
    /// counts kept in the same hash (fields that start with a newline) are no records.
    async fn uploads(&self, cursor: Option<String>, limit: usize) -> Result<UploadPage, StoreError> {
        let cursor = cursor.unwrap_or_else(|| "0".into());
        let cmd = redis::cmd("HSCAN").arg(UPLOADS_KEY).arg(&cursor).arg("COUNT").arg(limit.max(1)).to_owned();
        let (next, fields): (String, Vec<String>) = self.connection.query(&cmd).await?;
        let records = fields
            .chunks_exact(2)
            .filter(|pair| !pair[0].starts_with('\n'))
            .map(|pair| serde_json::from_str(&pair[1]).map_err(|e| StoreError::Backend(Box::new(e))))
            .collect::<Result<Vec<UploadRecord>, _>>()?;
        Ok(UploadPage { records, next: (next != "0").then_some(next) })
    }
}
