//! Replicas of a sandbox's snapshots on another host of its cluster, and
//! recovery from them when its host is lost (docs/cluster.md, "Replicas").
//!
//! Contract:
//! - A sandbox replicates when its setting `replicate` is on (`"replicate":
//!   true` on create or fork, kept in `sandbox_settings`; shown on `GET`).
//!   Without `[cluster]` the setting is kept and does nothing.
//! - After each snapshot of such a sandbox becomes ready on its owner
//!   ([`Service::replicate_later`], a background task: the snapshot's
//!   answer never waits for it), the owner sends its newest ready snapshot
//!   to one other live host: the one that holds its replica already when
//!   it is still live and compatible, else the one placement picks among
//!   the live hosts compatible with this one
//!   ([`placement::move_compatible`]: same accelerator and QEMU series).
//!   The stream is the push's and the move's ([`Service::send_missing`]):
//!   incremental against the replica the target holds when the owner still
//!   has that snapshot, else in full. One replication per sandbox at a
//!   time; snapshots taken meanwhile are folded into one more round (the
//!   newest wins). Failures are logged and counted
//!   (`cluster_replica_failed`), successes too (`cluster_replica_sent`).
//! - The receiving host ([`Service::replica_offer`],
//!   [`Service::replica_receive`]) checks the host credential
//!   ([`crate::cluster::replicas`]) and that PostgreSQL names its sender as
//!   the sandbox's owner, receives through the move's hostile-stream path
//!   (`receive_for`), records the replica in PostgreSQL and removes the
//!   replica it held before (published snapshot and import anchor). It does
//!   not own the sandbox: nothing of it runs there.
//! - [`Service::recover_from_replica`]: the host-loss watcher of the host
//!   holding the replica took the lease as owner; the replica becomes the
//!   sandbox's state: every other ready snapshot (they stayed in the lost
//!   host's pool) is recorded deleted with the reason, and the sandbox
//!   `hibernated` with `state_reason` "recovered from replica S after
//!   host_lost of H" (journaled, `cluster_sandbox_recovered` counted). It
//!   wakes from the replica (memory and disk) at its next use.

use super::prelude::*;
use super::transfer::Receiver;
use crate::cluster::placement;

/// The sandbox setting that turns replication on (`true`).
pub const REPLICATE_SETTING: &str = "replicate";

/// The tenant setting that makes its new sandboxes replicate unless their
/// create or fork says otherwise (`PUT /v1/settings {"replicate": true}`).
pub const TENANT_REPLICATE_SETTING: &str = "defaults.replicate";

/// `PUT /v1/settings`: the caller's tenant's defaults; a field left out is
/// unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantDefaults {
    /// New sandboxes replicate (docs/cluster.md "Replicas") unless their
    /// create or fork says `"replicate": false`.
    #[serde(default)]
    pub replicate: Option<bool>,
}

/// The receiving routes of a replica (`/v1/cluster/replicas/{id}/…`).
const REPLICA_ROUTES: &str = "v1/cluster/replicas";

/// Replications in flight, per sandbox.
#[derive(Debug, Default)]
pub(crate) struct Replication {
    /// Sandbox → whether another snapshot became ready since the round in
    /// flight started (one more round follows).
    inflight: Mutex<HashMap<SandboxId, bool>>,
    /// Sandboxes being moved: no replication round starts for them (the
    /// move and a replication would send the same snapshot to the same
    /// host, and the second stream would be refused).
    quiet: Arc<Mutex<std::collections::HashSet<SandboxId>>>,
}

/// While held, no replication of its sandbox starts
/// ([`Service::replication_quiet`]).
pub(crate) struct QuietGuard {
    set: Arc<Mutex<std::collections::HashSet<SandboxId>>>,
    id: SandboxId,
}

impl Drop for QuietGuard {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

/// Most replicas of deleted sandboxes one periodic pass removes (the rest
/// wait for the next pass).
pub const DELETED_REPLICAS_PER_PASS: usize = 100;

/// How long a move waits for a replication of its sandbox in flight.
const QUIET_WAIT: Duration = Duration::from_secs(60);

/// What one replication sent.
#[derive(Debug, Clone)]
struct ReplicaSent {
    to: String,
    snapshot: SnapshotId,
    incremental: bool,
    bytes: u64,
    millis: u128,
}

impl Service {
    /// Keeps the `replicate` setting asked on a create or fork (not asked:
    /// the tenant's default).
    pub(super) async fn keep_replicate(&self, rec: &SandboxRecord, asked: Option<bool>) {
        let on = match asked {
            Some(on) => on,
            None => match self.tenant_replicates(&rec.tenant).await {
                Ok(on) => on,
                Err(e) => {
                    warn!(sandbox = %rec.id, error = %e.message(), "reading the tenant's replicate default failed: not replicated");
                    false
                }
            },
        };
        if !on {
            return;
        }
        let id = rec.id.clone();
        if let Err(e) = self
            .db(move |s| s.put_sandbox_setting(&id, REPLICATE_SETTING, Some("true")))
            .await
        {
            warn!(sandbox = %rec.id, error = %e.message(), "keeping the replicate setting failed");
        }
    }

    /// `PATCH /v1/sandboxes/{id}` (a gated tool call, lifecycle op
    /// `configure`): `replicate` on replicates the newest snapshot at once
    /// (in the background); off forgets its replicas in PostgreSQL (their
    /// subvolumes stay on their hosts as orphans until `clean_orphans`).
    pub async fn patch_sandbox(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: PatchSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<()> {
        self.authorize_on(caller, id, lifecycle("configure"), opts)
            .await?;
        let Some(on) = cmd.replicate else {
            return Ok(());
        };
        let id2 = id.clone();
        self.db(move |s| s.put_sandbox_setting(&id2, REPLICATE_SETTING, on.then_some("true")))
            .await?;
        if on {
            self.replicate_later(id);
        } else if let Some(c) = self.cluster() {
            for r in c.replicas(id).await? {
                c.remove_replica(id, &r.host_id).await?;
            }
        }
        Ok(())
    }

    /// Whether `tenant`'s new sandboxes replicate by default.
    async fn tenant_replicates(&self, tenant: &str) -> ServiceResult<bool> {
        let t = tenant.to_owned();
        Ok(self
            .db(move |s| s.tenant_setting(&t, TENANT_REPLICATE_SETTING))
            .await?
            .is_some_and(|v| v.trim() == "true"))
    }

    /// `GET /v1/settings`: the caller's tenant's defaults.
    pub async fn tenant_defaults(&self, caller: &Caller) -> ServiceResult<serde_json::Value> {
        Ok(serde_json::json!({
            "tenant": caller.owner(),
            "replicate": self.tenant_replicates(caller.owner()).await?,
        }))
    }

    /// `PUT /v1/settings` (admin): changes the caller's tenant's defaults;
    /// answers them.
    pub async fn set_tenant_defaults(
        &self,
        caller: &Caller,
        cmd: TenantDefaults,
    ) -> ServiceResult<serde_json::Value> {
        if let Some(on) = cmd.replicate {
            let t = caller.owner().to_owned();
            self.db(move |s| {
                s.put_tenant_setting(&t, TENANT_REPLICATE_SETTING, on.then_some("true"))
            })
            .await?;
        }
        self.tenant_defaults(caller).await
    }

    /// Whether sandbox `id` replicates (its setting `replicate`).
    pub async fn replicates(&self, id: &SandboxId) -> ServiceResult<bool> {
        let id = id.clone();
        Ok(self
            .db(move |s| s.sandbox_setting(&id, REPLICATE_SETTING))
            .await?
            .is_some_and(|v| v.trim() == "true"))
    }

    /// What `GET /v1/sandboxes/{id}` adds: `replicate`, and on a cluster
    /// host `host` (the lease holder) and `replicas` (host, snapshot,
    /// since).
    pub async fn replication_view(&self, id: &SandboxId) -> ServiceResult<serde_json::Value> {
        let mut v = serde_json::json!({ "replicate": self.replicates(id).await? });
        if let Some(c) = self.cluster() {
            v["host"] = serde_json::json!(c.owner_of(id).await?.map(|l| l.host_id));
            v["replicas"] = serde_json::json!(c.replicas(id).await?);
        }
        Ok(v)
    }

    /// Keeps replication of `id` quiet (a move): no round starts while the
    /// guard lives, and this waits (up to a minute) for a round in flight
    /// to end.
    pub(crate) async fn replication_quiet(&self, id: &SandboxId) -> QuietGuard {
        self.replication
            .quiet
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone());
        let guard = QuietGuard {
            set: self.replication.quiet.clone(),
            id: id.clone(),
        };
        let t0 = Instant::now();
        while t0.elapsed() < QUIET_WAIT
            && self
                .replication
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(id)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        guard
    }

    fn is_quiet(&self, id: &SandboxId) -> bool {
        self.replication
            .quiet
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// The owner's periodic pass ([`crate::cluster::replicas::SWEEP_EVERY_WATCHES`]):
    /// every replicated sandbox this host owns gets a replication round (a
    /// no-op when its replica is current), so a replication that failed, a
    /// replica host that went away and a sandbox recovered here are
    /// brought up to date without waiting for the next snapshot.
    pub(crate) async fn replicate_sweep(self: &Arc<Self>) {
        let Some(cluster) = self.cluster() else {
            return;
        };
        self.drop_deleted_replicas().await;
        let owned = cluster.leases().owned();
        if owned.is_empty() {
            return;
        }
        match self.db(|s| s.sandbox_settings(REPLICATE_SETTING)).await {
            Ok(on) => {
                for (id, v) in on {
                    if v.trim() == "true" && owned.contains(&id) {
                        self.replicate_later(&id);
                    }
                }
            }
            Err(e) => {
                warn!(error = %e.message(), "replica sweep: cannot list replicated sandboxes")
            }
        }
    }

    /// The replica host's half of a delete (every periodic pass): the
    /// replicas this host holds of sandboxes deleted since (at most
    /// [`DELETED_REPLICAS_PER_PASS`]) are removed from its pool (published
    /// snapshot and import anchor), then their rows. A removal that fails
    /// keeps its row, so the next pass retries it; the delete itself never
    /// waits for this. Answers how many were removed.
    pub(crate) async fn drop_deleted_replicas(&self) -> usize {
        let Some(cluster) = self.cluster().cloned() else {
            return 0;
        };
        let rows = match cluster.deleted_replicas(DELETED_REPLICAS_PER_PASS).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e.message(), "replica sweep: cannot list replicas of deleted sandboxes");
                return 0;
            }
        };
        let mut removed = 0;
        for (sandbox, snap) in rows {
            let Ok(id) = sandbox.parse::<SandboxId>() else {
                warn!(sandbox = %sandbox, "replica sweep: a replica row names no sandbox id");
                continue;
            };
            if let Ok(snap) = snap.parse::<SnapshotId>() {
                if let Err(e) = self.remove_replica_copy(&snap).await {
                    warn!(sandbox = %id, snapshot = %snap, error = %e.message(), "removing the replica of a deleted sandbox failed; the next pass retries");
                    continue;
                }
            }
            match cluster.remove_replica(&id, cluster.host_id()).await {
                Ok(()) => {
                    removed += 1;
                    info!(sandbox = %id, snapshot = %snap, "replica of a deleted sandbox removed");
                }
                Err(e) => {
                    warn!(sandbox = %id, error = %e.message(), "forgetting the replica of a deleted sandbox failed; the next pass retries")
                }
            }
        }
        removed
    }

    /// A snapshot of `id` became ready: replicate it in the background
    /// when `id` replicates and this host owns it (see the module docs).
    pub(super) fn replicate_later(self: &Arc<Self>, id: &SandboxId) {
        let Some(cluster) = self.cluster() else {
            return;
        };
        if cluster.owns(id).is_none() {
            return;
        }
        {
            let mut m = self
                .replication
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(again) = m.get_mut(id) {
                *again = true;
                return;
            }
            m.insert(id.clone(), false);
        }
        let (this, id) = (self.clone(), id.clone());
        tokio::spawn(async move {
            loop {
                match this.replicate_once(&id).await {
                    Ok(Some(r)) => {
                        this.metrics.count("cluster_replica_sent");
                        info!(sandbox = %id, to = %r.to, snapshot = %r.snapshot, incremental = r.incremental, bytes = r.bytes, ms = r.millis as u64, "snapshot replicated");
                    }
                    Ok(None) => {}
                    Err(e) => {
                        this.metrics.count("cluster_replica_failed");
                        warn!(sandbox = %id, error = %e.message(), "replication failed");
                    }
                }
                let mut m = this
                    .replication
                    .inflight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                match m.get_mut(&id) {
                    Some(again) if *again => *again = false,
                    _ => {
                        m.remove(&id);
                        return;
                    }
                }
            }
        });
    }

    /// One replication of `id`'s newest ready snapshot; `None` when there
    /// is nothing to do (not replicated, not owned here, held already).
    async fn replicate_once(
        self: &Arc<Self>,
        id: &SandboxId,
    ) -> ServiceResult<Option<ReplicaSent>> {
        let t0 = Instant::now();
        let Some(cluster) = self.cluster().cloned() else {
            return Ok(None);
        };
        if cluster.owns(id).is_none() || self.is_quiet(id) || !self.replicates(id).await? {
            return Ok(None);
        }
        let id2 = id.clone();
        let Some(newest) = self.db(move |s| s.latest_ready_snapshot(&id2)).await? else {
            return Ok(None);
        };
        let newest = self.resolve_same_as(newest).await?;
        let existing = cluster.replicas(id).await?;
        let hosts = cluster.hosts_view().await?;
        let me = cluster.host_id().to_owned();
        let usable = |h: &&HostRecord| {
            h.alive
                && h.info.id != me
                && placement::move_compatible(cluster.info(), &h.info).is_ok()
        };
        let kept = existing
            .iter()
            .find_map(|r| hosts.iter().filter(usable).find(|h| h.info.id == r.host_id));
        let target = match kept {
            Some(h) => h.clone(),
            None => {
                let cands: Vec<placement::Candidate> = hosts
                    .iter()
                    .filter(usable)
                    .map(|h| placement::Candidate {
                        id: h.info.id.clone(),
                        alive: true,
                        free: h.free,
                        has_template: true,
                        same_group: 0,
                    })
                    .collect();
                let req = placement::Request {
                    vcpus: 0,
                    memory_mib: 0,
                    pool_bytes: 1,
                    anti_affinity: false,
                };
                let chosen = placement::place(&cands, &req).map_err(|e| {
                    ServiceError::Conflict(format!(
                        "replicate: no live host compatible with {me} to hold a replica: {e}"
                    ))
                })?;
                hosts
                    .iter()
                    .find(|h| h.info.id == chosen)
                    .cloned()
                    .ok_or_else(|| not_found("host", chosen))?
            }
        };
        let prev = existing.iter().find(|r| r.host_id == target.info.id);
        if prev.is_some_and(|p| p.snapshot_id == newest.id.as_str()) {
            return Ok(None);
        }
        // The replica the target holds, as the parent, while this host
        // still has that snapshot.
        let (mut snaps, mut idents) = (Vec::new(), Vec::new());
        if let Some(p) = prev.and_then(|p| p.snapshot_id.parse::<SnapshotId>().ok()) {
            let p2 = p.clone();
            let rec = self.db(move |s| s.get_snapshot(&p2)).await?;
            if let Some(r) = rec.filter(|r| {
                r.status == SnapshotStatus::Ready && r.same_as.is_none() && r.sandbox_id == *id
            }) {
                if let Ok(ident) = self.engine.snapshot_identity(&p).await {
                    snaps.push(r);
                    idents.push(ident);
                }
            }
        }
        let incremental = !snaps.is_empty();
        idents.push(self.engine.snapshot_identity(&newest.id).await?);
        snaps.push(newest.clone());
        let (base, http) = super::moving::host_channel(&target.info, "replicate")?;
        let key = self.cluster_host_key()?;
        let rx = Receiver {
            http: &http,
            base: &base,
            auth: crate::cluster::replicas::credential_now(&key, &me, id),
            verb: "replicate",
            routes: REPLICA_ROUTES,
        };
        let (sent, bytes, _held) = self.send_missing(&rx, id, &snaps, &idents).await?;
        // One replica per sandbox: forget those on other hosts (a host
        // that went away, or one this host no longer picks).
        for r in existing.iter().filter(|r| r.host_id != target.info.id) {
            if let Err(e) = cluster.remove_replica(id, &r.host_id).await {
                warn!(sandbox = %id, host = %r.host_id, error = %e.message(), "forgetting an old replica failed");
            }
        }
        Ok(Some(ReplicaSent {
            to: target.info.id,
            snapshot: newest.id,
            incremental: incremental && sent.iter().all(|s| s.parent.is_some()),
            bytes,
            millis: t0.elapsed().as_millis(),
        }))
    }

    /// The cluster's host-credential key (derived from `master.key`).
    fn cluster_host_key(&self) -> ServiceResult<ring::hmac::Key> {
        use crate::security::keys::KeyStore;
        let store = self
            .keys
            .get_or_init(|| {
                KeyStore::open(&self.config.key_dir)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| ServiceError::Keys(e.clone()))?;
        store
            .hmac_key(crate::security::keys::Purpose::ClusterHost)
            .map_err(|e| ServiceError::Keys(e.to_string()))
    }

    /// The receiving side's checks: a cluster host, the credential valid
    /// for `id`, the sandbox live and owned (PostgreSQL) by the host the
    /// credential names, which is not this one. Answers the record.
    async fn replica_sender(&self, auth: &str, id: &SandboxId) -> ServiceResult<SandboxRecord> {
        let host = crate::cluster::replicas::verify_now(&self.cluster_host_key()?, auth, id)?;
        let Some(cluster) = self.cluster().cloned() else {
            return Err(ServiceError::Conflict(
                "replicas: this daemon is not a cluster host".into(),
            ));
        };
        let rec = self.record(id).await?;
        match cluster.owner_of(id).await? {
            Some(l) if l.host_id == host && host != cluster.host_id() => Ok(rec),
            other => Err(ServiceError::Conflict(format!(
                "replica of sandbox {id} from host {host} refused: its lease is {}",
                other.map_or_else(
                    || "no host's".to_owned(),
                    |l| format!("host {}'s", l.host_id)
                )
            ))),
        }
    }

    /// `POST /v1/cluster/replicas/{id}/offer`: which of `snaps` this host
    /// holds received for the sandbox's tenant.
    pub async fn replica_offer(
        &self,
        auth: &str,
        id: &SandboxId,
        snaps: Vec<SnapshotId>,
    ) -> ServiceResult<BTreeMap<SnapshotId, String>> {
        if snaps.len() > 2 {
            return Err(ServiceError::InvalidRequest(
                "a replica offer names at most 2 snapshots".into(),
            ));
        }
        let rec = self.replica_sender(auth, id).await?;
        self.offer_for(&rec.tenant, snaps, false).await
    }

    /// `PUT /v1/cluster/replicas/{id}/snapshots?snapshot=S[&parent=I]`:
    /// receives the replica, records it, drops the one held before.
    pub async fn replica_receive(
        &self,
        auth: &str,
        id: &SandboxId,
        snap: &SnapshotId,
        parent: Option<String>,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        let rec = self.replica_sender(auth, id).await?;
        let Some(cluster) = self.cluster().cloned() else {
            return Err(ServiceError::Conflict("not a cluster host".into()));
        };
        let before = cluster
            .replicas(id)
            .await?
            .into_iter()
            .find(|r| r.host_id == cluster.host_id());
        // A subvolume of this snapshot left in this pool from before (this
        // host owned the sandbox once, e.g. before its loss and recovery
        // elsewhere) is stale: this host does not own the sandbox and
        // PostgreSQL names no replica of it here.
        if before
            .as_ref()
            .is_none_or(|r| r.snapshot_id != snap.as_str())
            && self.engine.subvolumes().await?.snapshots.contains(snap)
        {
            info!(sandbox = %id, snapshot = %snap, "replacing a stale copy of the snapshot with the replica");
            self.drop_replica(snap).await;
        }
        let bytes = self
            .receive_for(&rec.tenant, id, snap, parent, body)
            .await?;
        cluster.put_replica(id, snap.as_str()).await?;
        if let Some(old) = before.filter(|r| r.snapshot_id != snap.as_str()) {
            if let Ok(old) = old.snapshot_id.parse::<SnapshotId>() {
                self.drop_replica(&old).await;
            }
        }
        Ok(bytes)
    }

    /// Removes a replica this host holds (published snapshot and import
    /// anchor; idempotent).
    async fn remove_replica_copy(&self, snap: &SnapshotId) -> ServiceResult<()> {
        self.engine.delete_snapshot(snap).await?;
        self.engine.delete_received_snapshot(snap).await?;
        self.imports.forget(snap);
        Ok(())
    }

    /// Removes a replica this host held (published snapshot and import
    /// anchor): a newer one replaced it.
    async fn drop_replica(&self, snap: &SnapshotId) {
        if let Err(e) = self.engine.delete_snapshot(snap).await {
            warn!(snapshot = %snap, error = %e.message(), "removing an old replica failed");
        }
        if let Err(e) = self.engine.delete_received_snapshot(snap).await {
            warn!(snapshot = %snap, error = %e.message(), "removing an old replica's import anchor failed");
        }
        self.imports.forget(snap);
    }

    /// Installs this host's replica `snap` as the state of sandbox `id`,
    /// whose host `lost` was lost; this host holds its lease as owner
    /// already (the host-loss watcher took it). See the module docs.
    pub(crate) async fn recover_from_replica(
        self: &Arc<Self>,
        id: &SandboxId,
        snap: &str,
        lost: &str,
    ) -> ServiceResult<()> {
        let snap: SnapshotId = snap
            .parse()
            .map_err(|_| ServiceError::InvalidRequest(format!("replica {snap:?}: not an id")))?;
        let subs = self.engine.subvolumes().await?;
        if !subs.snapshots.contains(&snap) {
            return Err(ServiceError::Engine(RuntimeError::SnapshotNotFound(
                format!("replica {snap} is not in this host's pool"),
            )));
        }
        let me = self
            .cluster()
            .map(|c| c.host_id().to_owned())
            .unwrap_or_default();
        let _g = self.acquire(id, Op::Recover, Who::Background).await?;
        let mut rec = self.record(id).await?;
        let id2 = id.clone();
        let all = self.db(move |s| s.list_snapshots(&id2, false)).await?;
        if !all
            .iter()
            .any(|s| s.id == snap && s.status == SnapshotStatus::Ready)
        {
            return Err(ServiceError::InvalidStateOther(format!(
                "replica {snap} is not a ready snapshot of {id}"
            )));
        }
        for mut s in all.into_iter().filter(|s| {
            s.status == SnapshotStatus::Ready && s.id != snap && s.same_as.as_ref() != Some(&snap)
        }) {
            s.status = SnapshotStatus::Deleted;
            s.status_reason = Some(format!(
                "{}: held only by host {lost}; the sandbox was recovered from replica {snap}",
                crate::cluster::HOST_LOST
            ));
            self.db(move |st| st.put_snapshot(&s)).await?;
        }
        let reason = format!("recovered from replica {snap} after host_lost of {lost}");
        warn!(sandbox = %id, host = %lost, snapshot = %snap, "host lost: sandbox recovered from its replica here");
        self.settle(
            &mut rec,
            Op::Recover,
            SandboxState::Hibernated,
            Some(reason),
            Some(format!("recovered on host {me} from replica {snap}")),
        )
        .await?;
        self.imports.forget(&snap);
        if let Some(c) = self.cluster() {
            if let Err(e) = c.remove_replica(id, &me).await {
                warn!(sandbox = %id, error = %e.message(), "forgetting the installed replica failed");
            }
        }
        self.metrics.count("cluster_sandbox_recovered");
        Ok(())
    }
}
