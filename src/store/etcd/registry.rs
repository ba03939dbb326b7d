//! The cross-replica registry of writes in flight on etcd: each admission reads the fence and
//! the resource's registrations, decides, and writes in one transaction; a registration lives
//! on an etcd lease of its own, renewed while its write is in flight.

use super::*;

impl EtcdCalls {
    async fn txn(&self, txn: Txn, read_only: bool) -> Result<etcd_client::TxnResponse, StoreError> {
        let floor = self.history.floor();
        self.history.check(floor, txn_on(&self.client, self.timeout, txn, read_only).await?)
    }

    fn lease_of(&self, resource: &ResourceKey, member: Member) -> Option<i64> {
        self.leases.lock().expect("leases lock").get(&(resource.clone(), member.id)).copied()
    }

    /// The fence and this replica's registration `member` in one linearizable read.
    async fn read_member(&self, resource: &ResourceKey, member: Member) -> Result<(Read, Read), StoreError> {
        let (fkey, mkey) = (fence_key(resource), member_key(resource, &self.replica_id, member));
        let ops = vec![TxnOp::get(fkey, None), TxnOp::get(mkey, None)];
        let resp = self.txn(Txn::new().and_then(ops), true).await?;
        let mut reads = gets(&resp).iter().map(|kvs| Read::of(kvs)).collect::<Vec<_>>();
        let registration = reads.pop().ok_or_else(|| corrupt("transaction answer"))?;
        let fence = reads.pop().ok_or_else(|| corrupt("transaction answer"))?;
        Ok((fence, registration))
    }
}

impl EtcdCalls {
    /// The etcd leases after an admission: those of the registrations it withdrew go, and the
    /// one `granted` for it is kept for its registration, or goes when none was made.
    fn settle_leases(
        &self,
        resource: &ResourceKey,
        answer: &SharedAdmit,
        member: Option<Member>,
        withdraw: &[Member],
        granted: Option<i64>,
    ) {
        // The registrations withdrawn in this admission's transaction: their etcd leases go too.
        for old in withdraw {
            if let Some(id) = self.leases.lock().expect("leases lock").remove(&(resource.clone(), old.id)) {
                revoke_in_background(&self.client, id);
            }
        }
        if let Some(lease) = granted {
            let registered = matches!(answer, SharedAdmit::Admitted { .. });
            let previous = member.filter(|_| registered).and_then(|member| {
                self.leases.lock().expect("leases lock").insert((resource.clone(), member.id), lease)
            });
            // The registration moved to the new lease (or was not made): the old one goes.
            for id in previous.into_iter().chain((!registered).then_some(lease)) {
                revoke_in_background(&self.client, id);
            }
        }
    }
}

#[async_trait]
impl RegistryCalls for EtcdCalls {
    /// Reads the fence and the member's key, writing nothing. As with Redis, the key can only
    /// go by this replica's own withdrawal or when its etcd lease expires, which is more than
    /// `D` away when `Registrations` plans a check.
    async fn check(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        floor: Option<FenceToken>,
        member: Member,
    ) -> Result<Option<SharedAdmit>, StoreError> {
        let (fence, registration) = self.read_member(resource, member).await?;
        Ok(crate::store::shared::checked(fence.token()?, token, floor, registration.value.is_some()))
    }

    async fn register(
        &self,
        resource: &ResourceKey,
        token: FenceToken,
        ask: &Ask,
        member: Option<Member>,
        withdraw: &[Member],
    ) -> Result<SharedAdmit, StoreError> {
        let (fkey, prefix) = (fence_key(resource), inflight_prefix(resource));
        let withdrawn: Vec<String> = withdraw.iter().map(|m| member_key(resource, &self.replica_id, *m)).collect();
        let attempts = Attempts::new(self.timeout);
        // A fresh etcd lease for the registration, granted once the admission needs it.
        let mut granted: Option<i64> = None;
        let answer = loop {
            let reads = vec![
                TxnOp::get(fkey.as_str(), None),
                TxnOp::get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_keys_only())),
            ];
            let resp = self.txn(Txn::new().and_then(reads), true).await?;
            let revision = resp.header().map(|h| h.revision()).ok_or_else(|| corrupt("transaction answer"))?;
            let got = gets(&resp);
            let fence = Read::of(got.first().map_or(&[][..], Vec::as_slice));
            let older_inflight = got.get(1).is_some_and(|kvs| {
                kvs.iter().any(|kv| {
                    !withdrawn.iter().any(|w| w.as_bytes() == kv.key())
                        && member_token(kv.key()).is_none_or(|t| t < token)
                })
            });
            let Admission { answer, fence: new_fence } =
                decide_admission(fence.token()?, ask.floor, token, ask.may_advance, older_inflight);
            let mut when = vec![fence.unchanged(&fkey)];
            let mut ops: Vec<TxnOp> = withdrawn.iter().map(|k| TxnOp::delete(k.as_str(), None)).collect();
            if let Some(new) = new_fence {
                ops.push(TxnOp::put(fkey.as_str(), new.0.to_string(), None));
            }
            if let (SharedAdmit::Admitted { .. }, Some(member)) = (&answer, member) {
                let lease = match granted {
                    Some(id) => id,
                    None => {
                        let ttl = ttl_seconds(ask.ttl_ms);
                        let id = grant_on(&self.client, self.timeout, ttl).await?;
                        *granted.insert(id)
                    }
                };
                let mkey = member_key(resource, &self.replica_id, member);
                ops.push(TxnOp::put(mkey, "", Some(PutOptions::new().with_lease(lease))));
                // No registration of any replica appeared since the read.
                when.push(Compare::mod_revision(prefix.as_str(), CompareOp::Less, revision + 1).with_prefix());
            }
            if ops.is_empty() {
                break answer;
            }
            let resp = self.txn(Txn::new().when(when).and_then(ops), false).await?;
            if resp.succeeded() {
                break answer;
            }
            attempts.again()?;
        };
        self.settle_leases(resource, &answer, member, withdraw, granted);
        Ok(answer)
    }

    async fn renew(&self, renewal: &Renewal) -> Result<Renewed, StoreError> {
        let Some(lease) = self.lease_of(&renewal.resource, renewal.member) else {
            return Ok(Renewed { still_there: false, fence: None });
        };
        let keep_alive = || {
            let mut leases = self.client.lease_client();
            async move { leases.keep_alive(lease).await }
        };
        let alive = match bounded(self.timeout, keep_alive).await {
            Ok(_) => true,
            // The lease expired or was revoked: the registration is gone.
            Err(StoreError::Backend(e))
                if matches!(
                    e.downcast_ref::<etcd_client::Error>(),
                    Some(etcd_client::Error::LeaseKeepAliveError(_))
                ) =>
            {
                false
            }
            Err(e) => return Err(e),
        };
        let (fence, registration) = self.read_member(&renewal.resource, renewal.member).await?;
        Ok(Renewed { still_there: alive && registration.value.is_some(), fence: fence.token()? })
    }

    async fn withdraw(&self, withdrawal: &Withdrawal) -> Result<(), StoreError> {
        let lease =
            self.leases.lock().expect("leases lock").remove(&(withdrawal.resource.clone(), withdrawal.member.id));
        let key = member_key(&withdrawal.resource, &self.replica_id, withdrawal.member);
        let delete = || {
            let (mut kv, key) = (self.client.kv_client(), key.clone());
            async move { kv.delete(key, None).await }
        };
        let deleted = bounded(self.timeout, delete).await;
        if let Some(id) = lease {
            revoke_in_background(&self.client, id);
        }
        deleted.map(|_| ())
    }
}
