//! [`FencedStore`]: the store as one host of a cluster sees it. Every write
//! of a sandbox's record or of its snapshots goes through
//! [`HostStore::commit_fenced`] with the owner lease this host holds for
//! that sandbox; a write for a sandbox whose lease this host does not hold
//! is refused at once ([`StoreError::Fenced`], nothing written). The lists
//! that drive local work (recovery, admission, GC, the pressure monitor)
//! see only the sandboxes this host owns; reads for the API see all.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use strata_core::{SandboxId, SandboxState, SnapshotId, TemplateId};

use crate::store::*;

/// One lease this host holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Its fencing token.
    pub token: u64,
    /// Held only to keep a lost host's sandbox from being taken back (its
    /// VM does not run here; it is not this host's to recover).
    pub custody: bool,
}

/// The leases this host holds, shared by the store wrapper and the
/// renewal loop.
#[derive(Debug)]
pub struct Leases {
    host: String,
    held: Mutex<HashMap<SandboxId, Held>>,
    /// Leases a write found lost (taken over): their VMs must stop.
    lost: Mutex<Vec<SandboxId>>,
}

impl Leases {
    /// No leases yet, for host `host`.
    pub fn new(host: &str) -> Self {
        Leases {
            host: host.to_owned(),
            held: Mutex::new(HashMap::new()),
            lost: Mutex::new(Vec::new()),
        }
    }

    /// This host's id.
    pub fn host(&self) -> &str {
        &self.host
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The lease held for `id`.
    pub fn get(&self, id: &SandboxId) -> Option<Held> {
        self.map().get(id).copied()
    }

    /// Records a lease granted (or renewed with a new token).
    pub fn hold(&self, id: SandboxId, token: u64, custody: bool) {
        self.map().insert(id, Held { token, custody });
    }

    /// Forgets a lease (released or lost).
    pub fn drop_lease(&self, id: &SandboxId) -> Option<Held> {
        self.map().remove(id)
    }

    /// Every lease held.
    pub fn all(&self) -> Vec<(SandboxId, Held)> {
        self.map().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// The sandboxes this host runs (not custody).
    pub fn owned(&self) -> BTreeSet<SandboxId> {
        self.map()
            .iter()
            .filter(|(_, h)| !h.custody)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Forgets every lease that is not custody, returning them (self-fencing).
    pub fn drop_owned(&self) -> Vec<SandboxId> {
        let mut m = self.map();
        let ids: Vec<SandboxId> = m
            .iter()
            .filter(|(_, h)| !h.custody)
            .map(|(k, _)| k.clone())
            .collect();
        for id in &ids {
            m.remove(id);
        }
        ids
    }

    /// Notes a lease found lost by a write (the renewal loop stops its VM).
    pub fn mark_lost(&self, id: &SandboxId) {
        if self.drop_lease(id).is_some_and(|h| !h.custody) {
            self.lost
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(id.clone());
        }
    }

    /// Takes the leases found lost since the last call.
    pub fn take_lost(&self) -> Vec<SandboxId> {
        std::mem::take(&mut *self.lost.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The metadata store of a cluster host (see the module docs).
pub struct FencedStore<S: Store + HostStore> {
    inner: Arc<S>,
    leases: Arc<Leases>,
    ttl_ms: u64,
    margin_ms: u64,
}

impl<S: Store + HostStore> std::fmt::Debug for FencedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedStore")
            .field("host", &self.leases.host)
            .finish_non_exhaustive()
    }
}

impl<S: Store + HostStore> FencedStore<S> {
    /// `inner` fenced with `leases`; new sandboxes' leases last `ttl_ms`,
    /// taken over `margin_ms` after expiry.
    pub fn new(inner: Arc<S>, leases: Arc<Leases>, ttl_ms: u64, margin_ms: u64) -> Self {
        FencedStore {
            inner,
            leases,
            ttl_ms,
            margin_ms,
        }
    }

    /// The leases it writes with.
    pub fn leases(&self) -> &Arc<Leases> {
        &self.leases
    }

    fn refused(&self, id: &str, why: String) -> StoreError {
        StoreError::Fenced {
            sandbox: id.to_owned(),
            host: self.leases.host.clone(),
            why,
        }
    }

    /// Why this host may not write `id`: who holds it instead.
    fn not_ours(&self, id: &str) -> StoreError {
        let why = match id.parse::<SandboxId>() {
            Ok(sid) => match self.inner.sandbox_owner(&sid) {
                Ok(Some(l)) if l.host_id != self.leases.host => {
                    format!("owned by host {} (lease until {})", l.host_id, l.expires_at)
                }
                Ok(Some(l)) => format!(
                    "this host's lease (token {}) was lost: it expired or was taken over",
                    l.token
                ),
                Ok(None) => "no host holds its lease".into(),
                Err(e) => format!("its owner could not be read: {e}"),
            },
            Err(_) => "not a sandbox id".into(),
        };
        self.refused(id, why)
    }

    /// The lease token of each sandbox a write touches: every one must be
    /// held by this host (a fork writes its parent and its child, each under
    /// its own lease).
    fn fence(&self, ids: &BTreeSet<String>) -> StoreResult<BTreeMap<String, u64>> {
        let mut tokens = BTreeMap::new();
        for id in ids {
            let held = id
                .parse::<SandboxId>()
                .ok()
                .and_then(|sid| self.leases.get(&sid));
            let Some(h) = held else {
                return Err(self.not_ours(id));
            };
            tokens.insert(id.clone(), h.token);
        }
        Ok(tokens)
    }

    fn fenced_commit(
        &self,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> StoreResult<()> {
        let ids: BTreeSet<String> = sandboxes
            .iter()
            .map(|s| s.id.to_string())
            .chain(snapshots.iter().map(|s| s.sandbox_id.to_string()))
            .chain(event.map(|e| e.sandbox_id.to_string()))
            .collect();
        if ids.is_empty() {
            return self.inner.commit(sandboxes, snapshots, event);
        }
        let tokens = self.fence(&ids)?;
        match self
            .inner
            .commit_fenced_each(&self.leases.host, &tokens, sandboxes, snapshots, event)
        {
            Ok(()) => {}
            Err(HostError::Store(e)) => return Err(e),
            Err(HostError::Fenced { sandbox, .. }) => {
                if let Ok(sid) = sandbox.parse::<SandboxId>() {
                    self.leases.mark_lost(&sid);
                }
                return Err(self.not_ours(&sandbox));
            }
            Err(e) => return Err(self.refused(&sandbox_of(&ids), e.to_string())),
        }
        // A deleted sandbox's lease goes with it.
        for s in sandboxes
            .iter()
            .filter(|s| s.state == SandboxState::Deleted)
        {
            if let Some(h) = self.leases.drop_lease(&s.id) {
                let f = Fence {
                    host_id: self.leases.host.clone(),
                    token: h.token,
                };
                if let Err(e) = self.inner.release_sandbox(&s.id, &f) {
                    tracing::warn!(sandbox = %s.id, error = %e, "releasing a deleted sandbox's lease failed; it expires");
                }
            }
        }
        Ok(())
    }
}

fn sandbox_of(ids: &BTreeSet<String>) -> String {
    ids.iter().next().cloned().unwrap_or_default()
}

impl<S: Store + HostStore> Store for FencedStore<S> {
    fn insert_sandbox(&self, rec: &SandboxRecord, event: &Event) -> StoreResult<()> {
        let lease = self
            .inner
            .acquire_sandbox(&rec.id, &self.leases.host, self.ttl_ms, self.margin_ms)
            .map_err(|e| match e {
                HostError::Store(e) => e,
                e => self.refused(rec.id.as_str(), e.to_string()),
            })?;
        self.leases.hold(rec.id.clone(), lease.token, false);
        let fence = Fence {
            host_id: self.leases.host.clone(),
            token: lease.token,
        };
        if let Err(e) = self.inner.insert_sandbox(rec, event) {
            self.leases.drop_lease(&rec.id);
            let _ = self.inner.release_sandbox(&rec.id, &fence);
            return Err(e);
        }
        Ok(())
    }

    fn update_sandbox(&self, rec: &SandboxRecord, event: Option<&Event>) -> StoreResult<()> {
        self.fenced_commit(&[rec], &[], event)
    }

    fn touch_sandbox(&self, id: &SandboxId, at: DateTime<Utc>) -> StoreResult<()> {
        // Activity of a sandbox this host does not own is not its to write.
        if self.leases.get(id).is_none() {
            return Ok(());
        }
        self.inner.touch_sandbox(id, at)
    }

    fn get_sandbox(&self, id: &SandboxId) -> StoreResult<Option<SandboxRecord>> {
        self.inner.get_sandbox(id)
    }

    fn list_sandboxes(&self, filter: &SandboxFilter) -> StoreResult<Page<SandboxRecord>> {
        self.inner.list_sandboxes(filter)
    }

    fn reserved_capacity(&self) -> StoreResult<(u64, u64)> {
        let r = self.reserved_sandboxes()?;
        Ok((
            r.iter().map(|s| u64::from(s.size.vcpus)).sum(),
            r.iter().map(|s| u64::from(s.size.memory_mib)).sum(),
        ))
    }

    fn reserved_sandboxes(&self) -> StoreResult<Vec<ReservedSandbox>> {
        let owned = self.leases.owned();
        Ok(self
            .inner
            .reserved_sandboxes()?
            .into_iter()
            .filter(|s| owned.contains(&s.id))
            .collect())
    }

    fn live_sandboxes(&self) -> StoreResult<Vec<SandboxRecord>> {
        let owned = self.leases.owned();
        Ok(self
            .inner
            .live_sandboxes()?
            .into_iter()
            .filter(|s| owned.contains(&s.id))
            .collect())
    }

    fn put_sandbox_env(&self, id: &SandboxId, sealed: Option<&str>) -> StoreResult<()> {
        self.inner.put_sandbox_env(id, sealed)
    }

    fn sandbox_envs(&self) -> StoreResult<Vec<(SandboxId, String)>> {
        self.inner.sandbox_envs()
    }

    fn put_sandbox_lifecycle(&self, id: &SandboxId, policy: &LifecyclePolicy) -> StoreResult<()> {
        self.inner.put_sandbox_lifecycle(id, policy)
    }

    fn sandbox_lifecycle(&self, id: &SandboxId) -> StoreResult<Option<LifecyclePolicy>> {
        self.inner.sandbox_lifecycle(id)
    }

    fn put_sandbox_setting(
        &self,
        id: &SandboxId,
        key: &str,
        value: Option<&str>,
    ) -> StoreResult<()> {
        self.inner.put_sandbox_setting(id, key, value)
    }

    fn sandbox_settings(&self, key: &str) -> StoreResult<Vec<(SandboxId, String)>> {
        self.inner.sandbox_settings(key)
    }

    fn sandbox_setting(&self, id: &SandboxId, key: &str) -> StoreResult<Option<String>> {
        self.inner.sandbox_setting(id, key)
    }

    fn put_tenant_setting(&self, tenant: &str, key: &str, value: Option<&str>) -> StoreResult<()> {
        self.inner.put_tenant_setting(tenant, key, value)
    }

    fn tenant_settings(&self, prefix: &str) -> StoreResult<Vec<(String, String, String)>> {
        self.inner.tenant_settings(prefix)
    }

    fn tenant_setting(&self, tenant: &str, key: &str) -> StoreResult<Option<String>> {
        self.inner.tenant_setting(tenant, key)
    }

    fn put_snapshot(&self, rec: &SnapshotRecord) -> StoreResult<()> {
        self.fenced_commit(&[], &[rec], None)
    }

    fn commit(
        &self,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> StoreResult<()> {
        self.fenced_commit(sandboxes, snapshots, event)
    }

    fn get_snapshot(&self, id: &SnapshotId) -> StoreResult<Option<SnapshotRecord>> {
        self.inner.get_snapshot(id)
    }

    fn list_snapshots(
        &self,
        sandbox: &SandboxId,
        include_deleted: bool,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        self.inner.list_snapshots(sandbox, include_deleted)
    }

    fn pending_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        let owned = self.leases.owned();
        Ok(self
            .inner
            .pending_snapshots()?
            .into_iter()
            .filter(|s| owned.contains(&s.sandbox_id))
            .collect())
    }

    fn latest_ready_snapshot(&self, sandbox: &SandboxId) -> StoreResult<Option<SnapshotRecord>> {
        self.inner.latest_ready_snapshot(sandbox)
    }

    fn ready_snapshot_at(
        &self,
        sandbox: &SandboxId,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<SnapshotRecord>> {
        self.inner.ready_snapshot_at(sandbox, at)
    }

    fn ready_snapshot_ids(&self) -> StoreResult<Vec<SnapshotId>> {
        // Recovery compares them with this host's pool: only its own.
        let mut out = Vec::new();
        for id in self.leases.owned() {
            out.extend(
                self.inner
                    .list_snapshots(&id, false)?
                    .into_iter()
                    .filter(|s| s.status == SnapshotStatus::Ready)
                    .map(|s| s.id),
            );
        }
        Ok(out)
    }

    fn sandboxes_with_snapshots(
        &self,
        after: Option<&SandboxId>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxId>> {
        // GC removes subvolumes: only this host's sandboxes.
        Ok(self
            .leases
            .owned()
            .into_iter()
            .filter(|id| after.is_none_or(|a| id > a))
            .take(limit.max(1))
            .collect())
    }

    fn put_template(&self, rec: &TemplateRecord) -> StoreResult<()> {
        self.inner.put_template(rec)
    }

    fn get_template(&self, id: &TemplateId) -> StoreResult<Option<TemplateRecord>> {
        self.inner.get_template(id)
    }

    fn list_templates(&self, tenant: &str) -> StoreResult<Vec<TemplateRecord>> {
        self.inner.list_templates(tenant)
    }

    fn all_templates(&self) -> StoreResult<Vec<TemplateRecord>> {
        self.inner.all_templates()
    }

    fn events(&self, sandbox: &SandboxId, limit: usize) -> StoreResult<Vec<Event>> {
        self.inner.events(sandbox, limit)
    }

    fn counts(&self, tenant: Option<&str>) -> StoreResult<StoreCounts> {
        self.inner.counts(tenant)
    }

    fn tenant_usage(&self, tenant: &str) -> StoreResult<TenantUsage> {
        self.inner.tenant_usage(tenant)
    }

    fn tenant_ready_snapshots(&self, tenant: &str) -> StoreResult<Vec<SnapshotRecord>> {
        self.inner.tenant_ready_snapshots(tenant)
    }

    fn snapshot_charges(&self, tenant: &str) -> StoreResult<Vec<SnapshotCharge>> {
        self.inner.snapshot_charges(tenant)
    }

    fn put_charge(&self, charge: &SnapshotCharge) -> StoreResult<()> {
        self.inner.put_charge(charge)
    }

    fn append_journal(&self, note: &JournalNote) -> StoreResult<i64> {
        self.inner.append_journal(note)
    }

    fn journal_after(
        &self,
        tenant: &str,
        sandbox: Option<&str>,
        after: i64,
        limit: usize,
    ) -> StoreResult<Vec<JournalEntry>> {
        self.inner.journal_after(tenant, sandbox, after, limit)
    }

    fn journal_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.journal_changes()
    }

    fn prune_journal(&self, before: DateTime<Utc>) -> StoreResult<u64> {
        self.inner.prune_journal(before)
    }

    fn set_delivery_limit(&self, limit: usize) {
        self.inner.set_delivery_limit(limit)
    }

    fn put_webhook(&self, hook: &Webhook) -> StoreResult<()> {
        self.inner.put_webhook(hook)
    }

    fn webhooks(&self, tenant: &str) -> StoreResult<Vec<Webhook>> {
        self.inner.webhooks(tenant)
    }

    fn get_webhook(&self, tenant: &str, id: &str) -> StoreResult<Option<Webhook>> {
        self.inner.get_webhook(tenant, id)
    }

    fn delete_webhook(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> StoreResult<bool> {
        self.inner.delete_webhook(tenant, id, at)
    }

    fn due_deliveries(&self, now: DateTime<Utc>, limit: usize) -> StoreResult<Vec<Delivery>> {
        self.inner.due_deliveries(now, limit)
    }

    fn next_delivery_at(&self) -> StoreResult<Option<DateTime<Utc>>> {
        self.inner.next_delivery_at()
    }

    fn update_delivery(&self, d: &Delivery) -> StoreResult<()> {
        self.inner.update_delivery(d)
    }

    fn deliveries(&self, webhook: &str, limit: usize) -> StoreResult<Vec<Delivery>> {
        self.inner.deliveries(webhook, limit)
    }
}
