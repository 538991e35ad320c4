//! Moving a hibernated sandbox to another deployment (docs/move.md): the
//! sender's push and the receiver's three steps (offer, receive one
//! snapshot stream, register), over the engine's `btrfs send` / `receive`.
//!
//! Contract:
//! - [`Service::push`] hibernates a running sandbox (memory kept), asks the
//!   remote which of its ready snapshots it holds, streams each missing one
//!   (oldest first, incremental against the newest one before it that the
//!   remote holds) and registers the sandbox there. The source stays here,
//!   hibernated: two independent copies from then on (delete it to finish
//!   a move).
//! - The receiver keeps, per received snapshot, the tenant and sandbox it
//!   was received for ([`Imports`], in memory): only that tenant's later
//!   streams may name it as their parent (a stream may clone data from its
//!   parent), only that tenant sees it held, and only a registration of
//!   that sandbox by that tenant may claim it. A registration whose id is
//!   taken is `409 conflict` and changes nothing.
//! - A pull is the same transfer driven by the receiving side (a laptop
//!   reaches the cloud, not the reverse). The owner's side:
//!   [`Service::export`] hibernates the sandbox (memory kept) and answers
//!   its manifest (record, ready snapshots oldest first with their
//!   identities); [`Service::export_snapshot`] streams one of them,
//!   incremental against a parent named by identity that must be another
//!   of the same sandbox's snapshots. The puller's side, [`Service::pull`]:
//!   the `from` target is checked like a push's `to`; it streams the
//!   snapshots it does not hold (received for the caller's tenant) through
//!   the same receive path as a push, and registers the sandbox hibernated
//!   under the caller's tenant (quota like a create). Pulling again into
//!   the caller's hibernated copy adds the remote's newer snapshots
//!   (incremental), as long as every snapshot of the copy is one of the
//!   remote's (`409 conflict` once the copies diverged).

use super::prelude::*;

/// The largest snapshot stream one receive accepts (the pool's free space
/// less the room kept for snapshots bounds it further).
pub const MAX_SNAPSHOT_STREAM_BYTES: u64 = 64 << 30;

/// The most snapshots one registration (one push) may carry.
pub const MAX_IMPORT_SNAPSHOTS: usize = 10_000;

/// Snapshots received on this daemon since it started: snapshot → (tenant,
/// sandbox). Lost on restart (a push interrupted by a receiver restart
/// is not resumed: docs/move.md).
#[derive(Debug, Default)]
pub(crate) struct Imports {
    received: Mutex<HashMap<SnapshotId, (String, SandboxId)>>,
}

impl Imports {
    fn get(&self, snap: &SnapshotId) -> Option<(String, SandboxId)> {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(snap)
            .cloned()
    }

    fn put(&self, snap: SnapshotId, tenant: String, sandbox: SandboxId) {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(snap, (tenant, sandbox));
    }

    pub(super) fn forget(&self, snap: &SnapshotId) {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(snap);
    }
}

/// `POST /v1/sandboxes/{id}/push`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushSandbox {
    /// The remote deployment's API base URL (`https://host:7070`).
    pub to: String,
    /// A token of the remote deployment; its tenant will own the sandbox
    /// there. Never logged or stored.
    pub token: String,
    /// Wake the copy on the remote once registered (the source stays
    /// hibernated here either way).
    #[serde(default)]
    pub wake: bool,
}

/// One snapshot a push sent.
#[derive(Debug, Clone, Serialize)]
pub struct SentSnapshot {
    /// The snapshot.
    pub snapshot: SnapshotId,
    /// The snapshot it was sent incremental against (`None`: in full).
    pub parent: Option<SnapshotId>,
    /// Stream bytes.
    pub bytes: u64,
}

/// What a push did.
#[derive(Debug, Clone, Serialize)]
pub struct PushReport {
    /// The source sandbox here (hibernated).
    pub sandbox: SandboxRecord,
    /// The sandbox record the remote answered with.
    pub remote: serde_json::Value,
    /// The snapshots streamed, oldest first.
    pub sent: Vec<SentSnapshot>,
    /// Snapshots the remote already held.
    pub held: usize,
    /// Stream bytes, all snapshots.
    pub bytes: u64,
}

/// `POST /v1/pulls`: copy a sandbox of another deployment here.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullSandbox {
    /// The remote deployment's API base URL (`https://host:7070`).
    pub from: String,
    /// A token of the remote deployment that may export the sandbox there
    /// (admin or developer of its tenant). Never logged or stored.
    pub token: String,
    /// The sandbox's id on the remote; the copy here keeps it.
    pub sandbox: String,
    /// Wake the copy here once registered.
    #[serde(default)]
    pub wake: bool,
}

/// What a pull did.
#[derive(Debug, Clone, Serialize)]
pub struct PullReport {
    /// The copy here (hibernated, or running with `wake`).
    pub sandbox: SandboxRecord,
    /// The remote's record of the source (hibernated there).
    pub remote: serde_json::Value,
    /// The snapshots streamed here, oldest first.
    pub received: Vec<SentSnapshot>,
    /// Snapshots this deployment already held.
    pub held: usize,
    /// Stream bytes, all snapshots.
    pub bytes: u64,
    /// Whether a copy pulled before was brought up to date.
    pub updated: bool,
}

/// One snapshot of an export manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportedSnapshot {
    /// Its id.
    pub id: SnapshotId,
    /// Why it was taken.
    pub kind: SnapshotKind,
    /// User label.
    #[serde(default)]
    pub label: Option<String>,
    /// When it was taken.
    pub created_at: DateTime<Utc>,
    /// The identity `btrfs send` gives it (what a puller names as a parent).
    pub identity: String,
}

/// `POST /v1/sandboxes/{id}/export`: what a puller needs.
#[derive(Debug, Clone, Serialize)]
pub struct ExportManifest {
    /// The sandbox (hibernated).
    pub sandbox: SandboxRecord,
    /// Its ready snapshots, oldest first.
    pub snapshots: Vec<ExportedSnapshot>,
}

/// An export manifest as a puller reads it (the remote's record may carry
/// more than this deployment knows).
#[derive(Debug, Deserialize)]
struct RemoteManifest {
    sandbox: RemoteSandbox,
    snapshots: Vec<ExportedSnapshot>,
}

#[derive(Debug, Deserialize)]
struct RemoteSandbox {
    size: SandboxSize,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// One snapshot record of a registration (the sender's).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportedSnapshot {
    /// Its id (received before with `PUT /v1/imports/{id}/snapshots`).
    pub id: SnapshotId,
    /// Why it was taken.
    pub kind: SnapshotKind,
    /// User label.
    #[serde(default)]
    pub label: Option<String>,
    /// When it was taken.
    pub created_at: DateTime<Utc>,
}

/// `POST /v1/imports/{id}`: register a sandbox whose snapshots were received.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterImport {
    /// Its size.
    #[serde(default)]
    pub size: Option<SandboxSize>,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its ready snapshots, oldest first; it wakes from the newest.
    #[serde(default)]
    pub snapshots: Vec<ImportedSnapshot>,
}

fn remote_err(what: &str, e: reqwest::Error) -> ServiceError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    ServiceError::Engine(RuntimeError::Unavailable(format!("{what}: {msg}")))
}

impl Service {
    /// Whether `tenant` may use received snapshot `snap` (as a parent, as
    /// held): received for it since this daemon started, or registered to
    /// it.
    async fn import_of(&self, tenant: &str, snap: &SnapshotId) -> ServiceResult<bool> {
        if let Some((t, _)) = self.imports.get(snap) {
            return Ok(t == tenant);
        }
        let id = snap.clone();
        Ok(self
            .db(move |s| s.get_snapshot(&id))
            .await?
            .is_some_and(|r| r.tenant == tenant))
    }

    /// A sandbox id that is taken here (any state, deleted included) is a
    /// `409 conflict`.
    async fn id_free(&self, id: &SandboxId) -> ServiceResult<()> {
        let id2 = id.clone();
        if self.db(move |s| s.get_sandbox(&id2)).await?.is_some() {
            return Err(ServiceError::Conflict(format!(
                "sandbox id {id} is taken on this deployment"
            )));
        }
        Ok(())
    }

    /// The tenant snapshots of sandbox `id` are received for here: the
    /// caller's when the id is free on this deployment (a push, a pull),
    /// or, on a cluster host, the tenant of that sandbox when the caller
    /// may act on it and another host owns it (a move to this host,
    /// docs/move.md). Else `409 conflict`.
    async fn receiving_tenant(&self, caller: &Caller, id: &SandboxId) -> ServiceResult<String> {
        if self.cluster().is_some() {
            let id2 = id.clone();
            if let Some(rec) = self.db(move |s| s.get_sandbox(&id2)).await? {
                if caller.sees(&rec.tenant) && self.moving_in(&rec.tenant, id).await? {
                    return Ok(rec.tenant);
                }
            }
        }
        self.id_free(id).await?;
        Ok(caller.owner().to_owned())
    }

    /// On a cluster host: sandbox `id` is `tenant`'s (not deleted) and
    /// another host owns it, so a move may send its snapshots here.
    async fn moving_in(&self, tenant: &str, id: &SandboxId) -> ServiceResult<bool> {
        let Some(cluster) = self.cluster() else {
            return Ok(false);
        };
        let id2 = id.clone();
        let Some(rec) = self.db(move |s| s.get_sandbox(&id2)).await? else {
            return Ok(false);
        };
        if rec.tenant != tenant || rec.state == SandboxState::Deleted {
            return Ok(false);
        }
        cluster.owned_elsewhere(id).await
    }

    /// `POST /v1/imports/{id}/offer`: which of `snaps` this deployment
    /// holds received for the caller's tenant, with their identities.
    pub async fn import_offer(
        &self,
        caller: &Caller,
        id: &SandboxId,
        snaps: Vec<SnapshotId>,
    ) -> ServiceResult<BTreeMap<SnapshotId, String>> {
        if snaps.len() > MAX_IMPORT_SNAPSHOTS {
            return Err(ServiceError::InvalidRequest(format!(
                "at most {MAX_IMPORT_SNAPSHOTS} snapshots"
            )));
        }
        let tenant = self.receiving_tenant(caller, id).await?;
        self.offer_for(&tenant, snaps, true).await
    }

    /// Which of `snaps` this host holds for `tenant`, with their
    /// identities (an offer's answer): received for it, or, with `own`,
    /// made here as one of its own ready snapshots and still in the pool
    /// (a sandbox coming back: docs/move.md "A return move"). A replica
    /// offer leaves `own` out: a replica counts only once received and
    /// recorded (a stale copy of a host that owned the sandbox once is
    /// replaced).
    pub(super) async fn offer_for(
        &self,
        tenant: &str,
        snaps: Vec<SnapshotId>,
        own: bool,
    ) -> ServiceResult<BTreeMap<SnapshotId, String>> {
        let received = self.engine.received_snapshots().await?;
        let mut held = BTreeMap::new();
        for s in snaps {
            let identity = match received.iter().find(|(n, _)| n == s.as_str()) {
                Some((_, identity)) if self.import_of(tenant, &s).await? => Some(identity.clone()),
                Some(_) => None,
                None if own => self.own_identity(tenant, &s).await?,
                None => None,
            };
            if let Some(identity) = identity {
                held.insert(s, identity);
            }
        }
        Ok(held)
    }

    /// The identity of `snap` when it is a ready snapshot of `tenant`
    /// (a real one, not a `same_as` record) published in this host's pool.
    async fn own_identity(&self, tenant: &str, snap: &SnapshotId) -> ServiceResult<Option<String>> {
        let s2 = snap.clone();
        let Some(rec) = self.db(move |s| s.get_snapshot(&s2)).await? else {
            return Ok(None);
        };
        if rec.tenant != tenant || rec.status != SnapshotStatus::Ready || rec.same_as.is_some() {
            return Ok(None);
        }
        Ok(self.engine.snapshot_identity(snap).await.ok())
    }

    /// A ready snapshot of sandbox `id` of `tenant` in this host's pool
    /// whose identity is `identity` (a stream coming back names it as its
    /// parent), made a parent streams can be received against
    /// ([`crate::engine::Engine::anchor_snapshot`]). `false`: none.
    async fn anchor_own_parent(
        &self,
        tenant: &str,
        id: &SandboxId,
        identity: &str,
    ) -> ServiceResult<bool> {
        let id2 = id.clone();
        let snaps = self.db(move |s| s.list_snapshots(&id2, false)).await?;
        for s in snaps {
            if s.tenant != tenant || s.status != SnapshotStatus::Ready || s.same_as.is_some() {
                continue;
            }
            let same = self
                .engine
                .snapshot_identity(&s.id)
                .await
                .is_ok_and(|i| i.eq_ignore_ascii_case(identity));
            if same {
                let anchored = self.engine.anchor_snapshot(&s.id).await?;
                info!(sandbox = %id, snapshot = %s.id, identity = %anchored, "own snapshot anchored as a parent");
                return Ok(anchored.eq_ignore_ascii_case(identity));
            }
        }
        Ok(false)
    }

    /// `PUT /v1/imports/{id}/snapshots?snapshot=S&parent=P`: receives one
    /// snapshot stream (hostile, bounded) for sandbox `id` of the caller's
    /// tenant; `parent` is the identity of a snapshot received before for
    /// the same tenant. Returns the stream bytes.
    pub async fn import_snapshot(
        &self,
        caller: &Caller,
        id: &SandboxId,
        snap: &SnapshotId,
        parent: Option<String>,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        let tenant = self.receiving_tenant(caller, id).await?;
        self.receive_for(&tenant, id, snap, parent, body).await
    }

    /// Receives one snapshot stream for sandbox `id` of `tenant` (the
    /// receiving half of a push and of a pull): `snap` must be new here,
    /// `parent` the identity of a snapshot received for the same tenant;
    /// the stream is checked and bounded by the engine. Returns its bytes.
    pub(super) async fn receive_for(
        &self,
        tenant: &str,
        id: &SandboxId,
        snap: &SnapshotId,
        parent: Option<String>,
        body: ByteStream,
    ) -> ServiceResult<u64> {
        let tenant = tenant.to_owned();
        let exists = {
            let s2 = snap.clone();
            self.db(move |s| s.get_snapshot(&s2)).await?
        };
        // A move inside a cluster sends snapshots whose records the shared
        // store holds already: the moving sandbox's own, of its tenant.
        let exists = match exists {
            Some(r) if r.sandbox_id == *id && r.tenant == tenant => {
                !self.moving_in(&tenant, id).await?
            }
            r => r.is_some(),
        };
        if exists || self.imports.get(snap).is_some() {
            return Err(ServiceError::Conflict(format!(
                "snapshot {snap} exists on this deployment"
            )));
        }
        if let Some(p) = &parent {
            let received = self.engine.received_snapshots().await?;
            let name = received
                .iter()
                .find(|(_, u)| u.eq_ignore_ascii_case(p))
                .map(|(n, _)| n.clone());
            let ok = match name.and_then(|n| n.parse::<SnapshotId>().ok()) {
                Some(ps) => self.import_of(&tenant, &ps).await?,
                // One of the sandbox's own snapshots made here (it comes
                // back): anchored in the import directory first.
                None => self.anchor_own_parent(&tenant, id, p).await?,
            };
            if !ok {
                return Err(ServiceError::InvalidRequest(format!(
                    "parent {p}: no snapshot received for this tenant has this identity"
                )));
            }
        }
        let bytes = self
            .engine
            .receive_snapshot(snap, parent, MAX_SNAPSHOT_STREAM_BYTES, body)
            .await?;
        self.imports.put(snap.clone(), tenant, id.clone());
        info!(sandbox = %id, snapshot = %snap, bytes, "snapshot received");
        Ok(bytes)
    }

    /// `POST /v1/imports/{id}`: registers sandbox `id` as `hibernated`,
    /// owned by the caller's tenant, with the snapshots received for it.
    pub async fn import_register(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: RegisterImport,
        opts: &GateOptions,
    ) -> ServiceResult<SandboxRecord> {
        let size = check_register(&cmd)?;
        self.authorize(caller, Some(id), lifecycle("import"), opts)
            .await?;
        let _g = self.acquire(id, Op::Created, Who::User).await?;
        self.register_locked(caller.owner(), id, size, cmd).await
    }

    /// Registers sandbox `id` of `tenant` from the snapshots received for
    /// it (the caller holds its operation lock; `size` is what
    /// [`check_register`] answered for `cmd`): see
    /// [`Service::import_register`].
    async fn register_locked(
        self: &Arc<Self>,
        tenant: &str,
        id: &SandboxId,
        size: SandboxSize,
        cmd: RegisterImport,
    ) -> ServiceResult<SandboxRecord> {
        let tenant = tenant.to_owned();
        for s in &cmd.snapshots {
            match self.imports.get(&s.id) {
                Some((t, sb)) if t == tenant && sb == *id => {}
                _ => {
                    return Err(ServiceError::InvalidRequest(format!(
                        "snapshot {} was not received for sandbox {id} of this tenant",
                        s.id
                    )))
                }
            }
        }
        let spec = SandboxSpec {
            labels: cmd.labels,
            ..Default::default()
        };
        let mut rec = self.new_record(&tenant, &spec, size)?;
        rec.id = id.clone();
        let snaps: Vec<SnapshotRecord> = cmd
            .snapshots
            .iter()
            .map(|s| {
                let mut r = self.new_snapshot(&rec, s.kind, s.label.clone());
                r.id = s.id.clone();
                r.status = SnapshotStatus::Ready;
                r.created_at = s.created_at;
                r
            })
            .collect();
        {
            let _room = self.admit_without_vm(&rec).await?;
            self.id_free(id).await?;
            self.begin_create(&mut rec, None, Some("imported".into()))
                .await?;
        }
        let refs: Vec<&SnapshotRecord> = snaps.iter().collect();
        let newest = snaps
            .iter()
            .max_by_key(|s| s.created_at)
            .map(|s| s.id.clone());
        self.done(
            &mut rec,
            Op::Created,
            SandboxState::Hibernated,
            None,
            &refs,
            Some(format!(
                "imported with {} snapshots, wakes from {}",
                snaps.len(),
                newest.map(|s| s.to_string()).unwrap_or_default()
            )),
        )
        .await?;
        for s in &snaps {
            self.imports.forget(&s.id);
            self.spawn_usage(s.id.clone());
        }
        info!(sandbox = %id, snapshots = snaps.len(), "sandbox imported");
        Ok(rec)
    }

    /// `POST /v1/sandboxes/{id}/push`: see the module docs.
    pub async fn push(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: PushSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<PushReport> {
        let rec = self
            .authorize_on(caller, id, lifecycle("push"), opts)
            .await?;
        let (base, host, addrs) = self.check_remote(&cmd.to, "to", &cmd.token).await?;
        // Held while the snapshots travel: no wake, rewind or delete meanwhile.
        let (_g, rec) = self.hibernated_locked(id, rec).await?;
        let (snaps, idents): (Vec<SnapshotRecord>, Vec<String>) =
            self.movable_snapshots(id).await?.into_iter().unzip();
        let http = remote_client(&host, &addrs, "push")?;
        let url = |tail: &str| -> ServiceResult<reqwest::Url> {
            base.join(tail)
                .map_err(|e| ServiceError::InvalidRequest(format!("to: {e}")))
        };
        let rx = Receiver {
            http: &http,
            base: &base,
            auth: format!("Bearer {}", cmd.token),
            verb: "push",
            routes: IMPORT_ROUTES,
        };
        // 1-2. What the remote holds, then the missing ones, oldest first.
        let (sent, total, n_held) = self.send_missing(&rx, id, &snaps, &idents).await?;
        // 3. The sandbox, registered there.
        let reg = RegisterImport {
            size: Some(rec.size),
            labels: rec.labels.clone(),
            snapshots: snaps
                .iter()
                .map(|s| ImportedSnapshot {
                    id: s.id.clone(),
                    kind: s.kind,
                    label: s.label.clone(),
                    created_at: s.created_at,
                })
                .collect(),
        };
        let resp = http
            .post(url(&format!("v1/imports/{id}"))?)
            .bearer_auth(&cmd.token)
            .timeout(Duration::from_secs(60))
            .json(&reg)
            .send()
            .await
            .map_err(|e| remote_err("push: register", e))?;
        let mut remote = remote_json(resp, "push: register").await?;
        if cmd.wake {
            let resp = http
                .post(url(&format!("v1/sandboxes/{id}/resume"))?)
                .bearer_auth(&cmd.token)
                .timeout(Duration::from_secs(600))
                .json(&serde_json::json!({}))
                .send()
                .await
                .map_err(|e| remote_err("push: wake", e))?;
            remote = remote_json(resp, "push: wake").await?;
        }
        info!(sandbox = %id, to = %base, bytes = total, sent = sent.len(), "sandbox pushed");
        Ok(PushReport {
            sandbox: rec,
            remote,
            sent,
            held: n_held,
            bytes: total,
        })
    }

    /// The remote deployment at `url` (a push's `to`, a pull's `from`),
    /// checked: it passes the public-address filter (or is one of the
    /// operator's `[security] push_allow_private`); the connection goes to
    /// the addresses checked, not to a second resolution. `token` is the
    /// remote's token the caller gave.
    async fn check_remote(
        &self,
        url: &str,
        field: &str,
        token: &str,
    ) -> ServiceResult<(reqwest::Url, String, Vec<std::net::SocketAddr>)> {
        let target =
            crate::events::webhooks::check_target(url, &self.config().security.push_allow_private)
                .await
                .map_err(|e| ServiceError::InvalidRequest(format!("{field} {url:?}: {}", e.0)))?;
        if token.is_empty() || token.len() > 4096 {
            return Err(ServiceError::InvalidRequest(
                "token: the remote deployment's token (1 to 4096 bytes)".into(),
            ));
        }
        Ok(target)
    }

    /// Hibernates sandbox `id` if it runs (memory kept), then takes its
    /// operation lock (no wake, rewind or delete while it is held) and
    /// answers its record, hibernated.
    pub(super) async fn hibernated_locked(
        self: &Arc<Self>,
        id: &SandboxId,
        rec: SandboxRecord,
    ) -> ServiceResult<(OpGuard, SandboxRecord)> {
        if rec.state != SandboxState::Hibernated {
            let g = self.acquire(id, Op::Hibernate, Who::User).await?;
            self.hibernate_locked(id, g, true).await?;
        }
        let g = self.acquire(id, Op::Configure, Who::User).await?;
        let rec = self.record(id).await?;
        if rec.state != SandboxState::Hibernated {
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} is {}, not hibernated",
                rec.state
            )));
        }
        Ok((g, rec))
    }

    /// Sandbox `id`'s ready snapshots that can travel (real ones, not
    /// `same_as` records), oldest first, with their identities.
    pub(super) async fn movable_snapshots(
        &self,
        id: &SandboxId,
    ) -> ServiceResult<Vec<(SnapshotRecord, String)>> {
        let id2 = id.clone();
        let mut snaps: Vec<SnapshotRecord> = self
            .db(move |s| s.list_snapshots(&id2, false))
            .await?
            .into_iter()
            .filter(|s| s.status == SnapshotStatus::Ready && s.same_as.is_none())
            .collect();
        snaps.sort_by(|a, b| (a.created_at, a.id.as_str()).cmp(&(b.created_at, b.id.as_str())));
        if snaps.is_empty() {
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} has no ready snapshot"
            )));
        }
        let mut out = Vec::with_capacity(snaps.len());
        for s in snaps {
            let ident = self.engine.snapshot_identity(&s.id).await?;
            out.push((s, ident));
        }
        Ok(out)
    }

    /// `POST /v1/sandboxes/{id}/export`: the owner's side of a pull. Hibernates
    /// the sandbox if it runs (memory kept) and answers its manifest: its
    /// record and its ready snapshots, oldest first, with their identities.
    pub async fn export(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        opts: &GateOptions,
    ) -> ServiceResult<ExportManifest> {
        let rec = self
            .authorize_on(caller, id, lifecycle("export"), opts)
            .await?;
        let (_g, rec) = self.hibernated_locked(id, rec).await?;
        let snapshots = self
            .movable_snapshots(id)
            .await?
            .into_iter()
            .map(|(s, identity)| ExportedSnapshot {
                id: s.id,
                kind: s.kind,
                label: s.label,
                created_at: s.created_at,
                identity,
            })
            .collect();
        Ok(ExportManifest {
            sandbox: rec,
            snapshots,
        })
    }

    /// `GET /v1/sandboxes/{id}/export?snapshot=S[&parent=IDENTITY]`: one
    /// ready snapshot of the hibernated sandbox `id` as a `btrfs send`
    /// stream, incremental against `parent`, the identity of another of
    /// THIS sandbox's ready snapshots (anything else is `400`). The
    /// sandbox's operation lock is held until the stream ends (no wake,
    /// rewind or delete meanwhile); the stream is never buffered whole.
    pub async fn export_snapshot(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        snapshot: Option<&str>,
        parent: Option<&str>,
        opts: &GateOptions,
    ) -> ServiceResult<ByteStream> {
        self.authorize_on(caller, id, lifecycle("export"), opts)
            .await?;
        let snap: SnapshotId = snapshot
            .ok_or_else(|| ServiceError::InvalidRequest("snapshot: required".into()))?
            .parse()
            .map_err(|e| ServiceError::InvalidRequest(format!("snapshot: {e}")))?;
        let g = self.acquire(id, Op::Configure, Who::User).await?;
        let rec = self.record(id).await?;
        if rec.state != SandboxState::Hibernated {
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} is {}, not hibernated: export it first (POST /v1/sandboxes/{id}/export)",
                rec.state
            )));
        }
        let snaps = self.movable_snapshots(id).await?;
        if !snaps.iter().any(|(s, _)| s.id == snap) {
            return Err(not_found("snapshot", &snap));
        }
        let parent = match parent {
            None => None,
            Some(p) => match snaps
                .iter()
                .find(|(s, ident)| ident.eq_ignore_ascii_case(p) && s.id != snap)
            {
                Some((s, _)) => Some(s.id.clone()),
                None => {
                    return Err(ServiceError::InvalidRequest(format!(
                        "parent {p}: no other ready snapshot of sandbox {id} has this identity"
                    )))
                }
            },
        };
        let stream = self.engine.send_snapshot(&snap, parent.as_ref()).await?;
        info!(sandbox = %id, snapshot = %snap, parent = ?parent, "snapshot export started");
        // The lock travels with the stream: released when it ends or the
        // puller goes away.
        Ok(Box::pin(stream.map(move |r| {
            let _held = &g;
            r
        })))
    }

    /// `POST /v1/pulls`: see the module docs. The local caller's tenant
    /// owns the copy; the remote token only reads the source there.
    pub async fn pull(
        self: &Arc<Self>,
        caller: &Caller,
        cmd: PullSandbox,
        opts: &GateOptions,
    ) -> ServiceResult<PullReport> {
        let id: SandboxId = cmd
            .sandbox
            .parse()
            .map_err(|e| ServiceError::InvalidRequest(format!("sandbox: {e}")))?;
        self.authorize(caller, Some(&id), lifecycle("pull"), opts)
            .await?;
        let (base, host, addrs) = self.check_remote(&cmd.from, "from", &cmd.token).await?;
        let tenant = caller.owner().to_owned();
        // A copy pulled before (the caller's, hibernated) is brought up to
        // date; any other taken id is a conflict.
        let existing = {
            let id2 = id.clone();
            self.db(move |s| s.get_sandbox(&id2)).await?
        };
        let updating = match &existing {
            None => false,
            Some(r) if r.state != SandboxState::Deleted && r.tenant == tenant => true,
            Some(_) => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox id {id} is taken on this deployment"
                )))
            }
        };
        let op = if updating { Op::Configure } else { Op::Created };
        let _g = self.acquire(&id, op, Who::User).await?;
        let local: Option<SandboxRecord> = if updating {
            let r = self.record(&id).await?;
            if r.state != SandboxState::Hibernated {
                return Err(ServiceError::InvalidStateOther(format!(
                    "sandbox {id} is {} here: hibernate it to pull it again",
                    r.state
                )));
            }
            Some(r)
        } else {
            self.id_free(&id).await?;
            None
        };
        let http = remote_client(&host, &addrs, "pull")?;
        let url = |tail: &str| -> ServiceResult<reqwest::Url> {
            base.join(tail)
                .map_err(|e| ServiceError::InvalidRequest(format!("from: {e}")))
        };
        // 1. The remote's manifest (it hibernates the sandbox there).
        let resp = http
            .post(url(&format!("v1/sandboxes/{id}/export"))?)
            .bearer_auth(&cmd.token)
            .timeout(Duration::from_secs(600))
            .json(&serde_json::json!({}))
            .send()
            .await
            .map_err(|e| remote_err("pull: export", e))?;
        let v = remote_json(resp, "pull: export").await?;
        let remote = v.get("sandbox").cloned().unwrap_or_default();
        let manifest: RemoteManifest = serde_json::from_value(v).map_err(|e| {
            ServiceError::Engine(RuntimeError::Unavailable(format!(
                "pull: export: the remote's manifest: {e}"
            )))
        })?;
        let mut snaps = manifest.snapshots;
        snaps.sort_by(|a, b| (a.created_at, a.id.as_str()).cmp(&(b.created_at, b.id.as_str())));
        let reg = RegisterImport {
            size: Some(manifest.sandbox.size),
            labels: manifest.sandbox.labels,
            snapshots: snaps
                .iter()
                .map(|s| ImportedSnapshot {
                    id: s.id.clone(),
                    kind: s.kind,
                    label: s.label.clone(),
                    created_at: s.created_at,
                })
                .collect(),
        };
        // Refused before any byte travels (sizes, counts, kinds).
        let size = check_register(&reg).map_err(|e| {
            ServiceError::InvalidRequest(format!("pull: the remote's manifest: {}", e.message()))
        })?;
        // 2. What this deployment holds of it, received for this tenant
        //    (or, bringing a copy up to date, made here: a sandbox pushed
        //    from here and pulled back).
        let received: HashMap<String, String> = self
            .engine
            .received_snapshots()
            .await?
            .into_iter()
            .collect();
        let mut held = std::collections::HashSet::new();
        for s in &snaps {
            let same = match received.get(s.id.as_str()) {
                Some(i) => {
                    i.eq_ignore_ascii_case(&s.identity) && self.import_of(&tenant, &s.id).await?
                }
                None if local.is_some() => self
                    .own_identity(&tenant, &s.id)
                    .await?
                    .is_some_and(|i| i.eq_ignore_ascii_case(&s.identity)),
                None => false,
            };
            if same {
                held.insert(s.id.clone());
            }
        }
        let mut known = std::collections::HashSet::new();
        if local.is_some() {
            let id2 = id.clone();
            for s in self.db(move |st| st.list_snapshots(&id2, false)).await? {
                if s.status != SnapshotStatus::Ready || s.same_as.is_some() {
                    continue;
                }
                if !held.contains(&s.id) {
                    return Err(ServiceError::Conflict(format!(
                        "sandbox {id} here has snapshot {} that the remote's does not: \
                         the two copies diverged (pull under another deployment's id, or delete this copy)",
                        s.id
                    )));
                }
                known.insert(s.id);
            }
        }
        // 3. The missing ones, oldest first, each incremental against the
        //    newest one before it held here.
        let mut parent: Option<(SnapshotId, String)> = None;
        let (mut got, mut total) = (Vec::new(), 0u64);
        for s in &snaps {
            if held.contains(&s.id) {
                parent = Some((s.id.clone(), s.identity.clone()));
                continue;
            }
            let mut u = url(&format!("v1/sandboxes/{id}/export"))?;
            u.query_pairs_mut().append_pair("snapshot", s.id.as_str());
            if let Some((_, pi)) = &parent {
                u.query_pairs_mut().append_pair("parent", pi);
            }
            let resp = http
                .get(u)
                .bearer_auth(&cmd.token)
                .send()
                .await
                .map_err(|e| remote_err("pull: snapshot stream", e))?;
            if !resp.status().is_success() {
                remote_json(resp, "pull: snapshot stream").await?;
                return Err(ServiceError::Engine(RuntimeError::Unavailable(
                    "pull: snapshot stream: the remote answered no stream".into(),
                )));
            }
            if resp
                .content_length()
                .is_some_and(|n| n > MAX_SNAPSHOT_STREAM_BYTES)
            {
                return Err(ServiceError::TooLarge(format!(
                    "pull: snapshot {}: a snapshot stream is at most {MAX_SNAPSHOT_STREAM_BYTES} bytes",
                    s.id
                )));
            }
            let body: ByteStream = Box::pin(resp.bytes_stream().map(|r| {
                r.map_err(|e| RuntimeError::Unavailable(format!("pull: the remote's stream: {e}")))
            }));
            let bytes = self
                .receive_for(
                    &tenant,
                    &id,
                    &s.id,
                    parent.as_ref().map(|(_, p)| p.clone()),
                    body,
                )
                .await?;
            total += bytes;
            got.push(SentSnapshot {
                snapshot: s.id.clone(),
                parent: parent.as_ref().map(|(p, _)| p.clone()),
                bytes,
            });
            parent = Some((s.id.clone(), s.identity.clone()));
        }
        // 4. Registered here (quota like a create), or the new snapshots
        //    added to the copy pulled before.
        let n_held = held.len();
        let rec = match local {
            None => self.register_locked(&tenant, &id, size, reg).await?,
            Some(mut rec) => {
                let mut new = Vec::new();
                for s in &reg.snapshots {
                    if known.contains(&s.id) {
                        continue;
                    }
                    match self.imports.get(&s.id) {
                        Some((t, sb)) if t == tenant && sb == id => {}
                        _ => {
                            return Err(ServiceError::InvalidRequest(format!(
                                "snapshot {} was not received for sandbox {id} of this tenant",
                                s.id
                            )))
                        }
                    }
                    let mut r = self.new_snapshot(&rec, s.kind, s.label.clone());
                    r.id = s.id.clone();
                    r.status = SnapshotStatus::Ready;
                    r.created_at = s.created_at;
                    new.push(r);
                }
                let refs: Vec<&SnapshotRecord> = new.iter().collect();
                self.done(
                    &mut rec,
                    Op::Configure,
                    SandboxState::Hibernated,
                    None,
                    &refs,
                    Some(format!("pulled {} more snapshots", new.len())),
                )
                .await?;
                for s in &new {
                    self.imports.forget(&s.id);
                    self.spawn_usage(s.id.clone());
                }
                rec
            }
        };
        drop(_g);
        let rec = if cmd.wake {
            self.resume_ungated(&id).await?
        } else {
            rec
        };
        info!(sandbox = %id, from = %base, bytes = total, received = got.len(), "sandbox pulled");
        Ok(PullReport {
            sandbox: rec,
            remote,
            received: got,
            held: n_held,
            bytes: total,
            updated: updating,
        })
    }
}

/// The HTTP client of a push or a pull: to the checked addresses only, no
/// redirect followed.
/// A transfer with a remote deployment fails after this long without a
/// byte in the direction it waits on (no operation waits forever: a stalled
/// remote would hold the sandbox's lock). A slow stream that moves is never
/// cut.
pub const TRANSFER_IDLE: Duration = Duration::from_secs(60);

/// Resolves once `counter` has not moved for `idle` while `ended` is
/// false; never once `ended` is set (the stream was all handed over).
async fn stalled(
    counter: &std::sync::atomic::AtomicU64,
    ended: &std::sync::atomic::AtomicBool,
    idle: Duration,
) {
    use std::sync::atomic::Ordering;
    let step = (idle / 8).max(Duration::from_millis(10));
    let (mut last, mut since) = (counter.load(Ordering::Relaxed), tokio::time::Instant::now());
    loop {
        tokio::time::sleep(step).await;
        if ended.load(Ordering::SeqCst) {
            return std::future::pending().await;
        }
        let now = counter.load(Ordering::Relaxed);
        if now != last {
            (last, since) = (now, tokio::time::Instant::now());
        } else if since.elapsed() >= idle {
            return;
        }
    }
}

fn remote_client(
    host: &str,
    addrs: &[std::net::SocketAddr],
    verb: &str,
) -> ServiceResult<reqwest::Client> {
    reqwest::Client::builder()
        .resolve_to_addrs(host, addrs)
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(15))
        // Every read of an answer or a pulled stream: a remote silent this
        // long fails the transfer.
        .read_timeout(TRANSFER_IDLE)
        .build()
        .map_err(|e| remote_err(&format!("{verb}: HTTP client"), e))
}

/// The receiving end of a transfer (a push's remote deployment, a move's
/// target host): an HTTP client, the receiver's API base URL, the
/// `Authorization` header to present (empty: none) and the verb its
/// errors name.
pub(super) struct Receiver<'a> {
    /// The client.
    pub(super) http: &'a reqwest::Client,
    /// The receiver's API base URL.
    pub(super) base: &'a reqwest::Url,
    /// The `Authorization` header value ("" sends none).
    pub(super) auth: String,
    /// `push`, `move`, `replicate`.
    pub(super) verb: &'static str,
    /// The receiver's routes under its base URL, before `/{id}/offer` and
    /// `/{id}/snapshots`: [`IMPORT_ROUTES`] (a push, a move) or the
    /// cluster's replica routes.
    pub(super) routes: &'static str,
}

/// The receiving routes of a push and of a move (`/v1/imports/{id}/…`).
pub(super) const IMPORT_ROUTES: &str = "v1/imports";

impl Receiver<'_> {
    fn url(&self, tail: &str) -> ServiceResult<reqwest::Url> {
        self.base
            .join(tail)
            .map_err(|e| ServiceError::InvalidRequest(format!("{}: {e}", self.verb)))
    }

    /// A POST to `url` with the receiver's `Authorization`.
    pub(super) fn authed_post(&self, url: reqwest::Url) -> reqwest::RequestBuilder {
        self.authed(self.http.post(url))
    }

    fn authed(&self, b: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        if self.auth.is_empty() {
            b
        } else {
            b.header(reqwest::header::AUTHORIZATION, &self.auth)
        }
    }
}

impl Service {
    /// The sending half of a push and of a move: asks the receiver which
    /// of `snaps` (ready, oldest first, with their identities) it holds
    /// (`POST /v1/imports/{id}/offer`), then streams each missing one,
    /// oldest first, incremental against the newest one before it that the
    /// receiver holds (`PUT /v1/imports/{id}/snapshots`). Answers the
    /// snapshots sent, their stream bytes and how many were held.
    pub(super) async fn send_missing(
        &self,
        rx: &Receiver<'_>,
        id: &SandboxId,
        snaps: &[SnapshotRecord],
        idents: &[String],
    ) -> ServiceResult<(Vec<SentSnapshot>, u64, usize)> {
        let verb = rx.verb;
        let resp = rx
            .authed(rx.http.post(rx.url(&format!("{}/{id}/offer", rx.routes))?))
            .timeout(Duration::from_secs(60))
            .json(&serde_json::json!({ "snapshots": snaps.iter().map(|s| &s.id).collect::<Vec<_>>() }))
            .send()
            .await
            .map_err(|e| remote_err(&format!("{verb}: offer"), e))?;
        let held: BTreeMap<String, String> = remote_json(resp, &format!("{verb}: offer"))
            .await?
            .get("held")
            .cloned()
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default();
        let mut parent: Option<(SnapshotId, String)> = None;
        let (mut sent, mut total, mut n_held) = (Vec::new(), 0u64, 0usize);
        for (s, ident) in snaps.iter().zip(idents) {
            if held.get(s.id.as_str()) == Some(ident) {
                n_held += 1;
                parent = Some((s.id.clone(), ident.clone()));
                continue;
            }
            let stream = self
                .engine
                .send_snapshot(&s.id, parent.as_ref().map(|(p, _)| p))
                .await?;
            let counted = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (c2, e2) = (counted.clone(), ended.clone());
            let body = reqwest::Body::wrap_stream(
                stream
                    .map(move |r| {
                        r.inspect(|b| {
                            c2.fetch_add(b.len() as u64, std::sync::atomic::Ordering::Relaxed);
                        })
                        .map_err(|e| std::io::Error::other(e.message()))
                    })
                    .chain(futures::stream::once(async move {
                        e2.store(true, std::sync::atomic::Ordering::SeqCst);
                        Ok(bytes::Bytes::new())
                    })),
            );
            let mut u = rx.url(&format!("{}/{id}/snapshots", rx.routes))?;
            u.query_pairs_mut().append_pair("snapshot", s.id.as_str());
            if let Some((_, pi)) = &parent {
                u.query_pairs_mut().append_pair("parent", pi);
            }
            let send = rx
                .authed(rx.http.put(u))
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .body(body)
                .send();
            // A receiver that stops taking the stream fails the transfer
            // (the sandbox's lock is held meanwhile); its answer after the
            // stream is bounded by the client's read timeout.
            let resp = tokio::select! {
                r = send => r.map_err(|e| remote_err(&format!("{verb}: snapshot stream"), e))?,
                () = stalled(&counted, &ended, TRANSFER_IDLE) => {
                    return Err(ServiceError::Engine(RuntimeError::Unavailable(format!(
                        "{verb}: the receiver took no byte of snapshot {} for {} s",
                        s.id,
                        TRANSFER_IDLE.as_secs()
                    ))));
                }
            };
            remote_json(resp, &format!("{verb}: snapshot stream")).await?;
            let bytes = counted.load(std::sync::atomic::Ordering::Relaxed);
            total += bytes;
            sent.push(SentSnapshot {
                snapshot: s.id.clone(),
                parent: parent.as_ref().map(|(p, _)| p.clone()),
                bytes,
            });
            parent = Some((s.id.clone(), ident.clone()));
        }
        Ok((sent, total, n_held))
    }
}

/// The checks of a registration that need nothing but its body (a push's
/// registration, a pull's manifest): its size, the number of its
/// snapshots, each given once and none a template's. Answers the size.
fn check_register(cmd: &RegisterImport) -> ServiceResult<SandboxSize> {
    let size = cmd
        .size
        .ok_or_else(|| ServiceError::InvalidRequest("size: required".into()))?;
    size.validate()?;
    if cmd.snapshots.is_empty() || cmd.snapshots.len() > MAX_IMPORT_SNAPSHOTS {
        return Err(ServiceError::InvalidRequest(format!(
            "snapshots: 1 to {MAX_IMPORT_SNAPSHOTS}"
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for s in &cmd.snapshots {
        if !seen.insert(&s.id) {
            return Err(ServiceError::InvalidRequest(format!(
                "snapshot {} given twice",
                s.id
            )));
        }
        if s.kind == SnapshotKind::Template {
            return Err(ServiceError::InvalidRequest(format!(
                "snapshot {}: a template snapshot cannot be imported",
                s.id
            )));
        }
    }
    Ok(size)
}

/// A remote's JSON answer; an error answer keeps its meaning here (a
/// `409` stays `409 conflict`).
pub(super) async fn remote_json(
    resp: reqwest::Response,
    step: &str,
) -> ServiceResult<serde_json::Value> {
    let status = resp.status().as_u16();
    // Bounded: an answer is a small JSON document.
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| remote_err(step, e))?;
        if body.len() + chunk.len() > 1 << 20 {
            return Err(ServiceError::Engine(RuntimeError::Unavailable(format!(
                "{step}: the remote's answer is over 1 MiB"
            ))));
        }
        body.extend_from_slice(&chunk);
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    if (200..300).contains(&status) {
        return Ok(v);
    }
    let msg = format!(
        "{step}: the remote answered {status}: {}",
        v["error"]["message"].as_str().unwrap_or("(no message)")
    );
    Err(match status {
        409 => ServiceError::Conflict(msg),
        401 | 403 => ServiceError::Forbidden(msg),
        413 => ServiceError::TooLarge(msg),
        400..=499 => ServiceError::InvalidRequest(msg),
        _ => ServiceError::Engine(RuntimeError::Unavailable(msg)),
    })
}

#[cfg(test)]
mod stall_tests {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::stalled;

    #[tokio::test]
    async fn a_stream_that_stops_moving_is_stalled_one_that_moves_or_ended_is_not() {
        let idle = Duration::from_millis(400);
        // Never moves: stalled after the idle time, not before.
        let (c, e) = (AtomicU64::new(0), AtomicBool::new(false));
        let t = tokio::time::Instant::now();
        stalled(&c, &e, idle).await;
        assert!(t.elapsed() >= idle, "{:?}", t.elapsed());
        // Moves every 200 ms for 2 s (slow, but moving), then is handed
        // over: never cut.
        let (c, e) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (c2, e2) = (c.clone(), e.clone());
        tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                c2.fetch_add(1, Ordering::Relaxed);
            }
            e2.store(true, Ordering::SeqCst);
        });
        let r = tokio::time::timeout(Duration::from_secs(4), stalled(&c, &e, idle)).await;
        assert!(r.is_err(), "a moving stream, then one handed over, was cut");
    }
}
