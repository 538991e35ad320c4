//! Moving a sandbox between the hosts of one cluster (docs/move.md, "Inside
//! a cluster"; docs/cluster.md).
//!
//! Contract:
//! - [`Service::move_sandbox`] runs on the sandbox's owner (any other host
//!   forwards the call there). It hibernates the sandbox if it runs (memory
//!   kept), streams the snapshots the target host lacks through the push's
//!   sending half ([`Service::send_missing`]: offer, then each missing one
//!   incremental against the newest one the target holds) to the target's
//!   registered address, then hands the lease over in PostgreSQL
//!   ([`crate::cluster::Cluster::hand_over`]: a fenced compare-and-set; the
//!   target gets a new, larger token). The record stays the one record of
//!   the shared store (same id, same tenant). Only after the handover
//!   committed does the source delete its subvolumes of the sandbox; then
//!   it asks the target to take the lease up (and wake the sandbox).
//! - Anything that fails before the handover leaves the source the owner
//!   (a sandbox that was running is woken here again); what the target
//!   received stays there, held, so a retried move sends only the rest.
//! - [`Service::adopt_move`] is the target's side of the last step: the
//!   lease in the store must name this host already; it is taken up, the
//!   move journaled, and the sandbox woken if asked. When that call is
//!   lost, the target's take-up pass (`crate::cluster::handover`) does the
//!   same (`Service::take_up_move`, one function for both) once the lease
//!   went unrenewed for half its TTL; whichever comes second finds the
//!   lease held and changes nothing.
//! - The caller gets the truth about the last step ([`Adoption`]): the
//!   adopt call is tried three times (a transport error or a `5xx`); when
//!   none is answered, the source waits (at most the lease's TTL and a
//!   second) until PostgreSQL shows the target holding the renewed lease,
//!   then answers `200` with `adoption: "taken_up"` (woken by one more
//!   adopt call when asked and it answers); otherwise `202` with
//!   `adoption: "unconfirmed"`: moved (the lease is the target's), the
//!   target's take-up not seen. A refusal of the target (`4xx`) is the
//!   answer, as before.

use super::prelude::*;
use super::transfer::{Receiver, SentSnapshot, TRANSFER_IDLE};
use crate::cluster::handover::Confirmation;
use crate::cluster::placement;

/// The base URL (ending in `/`) of another cluster host's registered
/// address, and the HTTP client this host talks to it with (no redirects,
/// transfers cut when idle for [`TRANSFER_IDLE`]); `what` names the caller
/// in errors.
pub(super) fn host_channel(
    host: &crate::store::HostInfo,
    what: &str,
) -> ServiceResult<(reqwest::Url, reqwest::Client)> {
    let mut base = reqwest::Url::parse(&host.address).map_err(|e| {
        ServiceError::Conflict(format!(
            "host {}: its registered address {:?}: {e}",
            host.id, host.address
        ))
    })?;
    if !base.path().ends_with('/') {
        let p = format!("{}/", base.path());
        base.set_path(&p);
    }
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(15))
        .read_timeout(TRANSFER_IDLE)
        .build()
        .map_err(|e| {
            ServiceError::Engine(RuntimeError::Unavailable(format!(
                "{what}: HTTP client: {e}"
            )))
        })?;
    Ok((base, http))
}

/// `POST /v1/sandboxes/{id}/move`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoveSandbox {
    /// The id of the target host (as registered in the cluster).
    #[serde(default)]
    pub host: String,
    /// Wake it on the target (default: when it was running).
    #[serde(default)]
    pub wake: Option<bool>,
}

/// `POST /v1/imports/{id}/adopt`: the source asks the target to take up
/// the lease it handed over.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdoptMove {
    /// The host it came from (journaled).
    #[serde(default)]
    pub from: String,
    /// Wake it here.
    #[serde(default)]
    pub wake: bool,
}

/// How the target's taking up of a moved sandbox was learnt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Adoption {
    /// The target answered the adopt call.
    Answered,
    /// The adopt call was lost; PostgreSQL showed the target holding the
    /// renewed lease (its take-up pass) before the answer. Not woken: its
    /// next exec, file call or resume wakes it.
    TakenUp,
    /// Neither within the lease's TTL: the move is committed (the lease
    /// is the target's) but the target has not confirmed. Answered `202`.
    Unconfirmed,
}

/// What a move did.
#[derive(Debug, Clone, Serialize)]
pub struct MoveReport {
    /// The sandbox as the target answered (hibernated, or running when
    /// woken); with a lost adopt call, as the shared store holds it.
    pub sandbox: serde_json::Value,
    /// How the target's take-up was learnt.
    pub adoption: Adoption,
    /// The host it left.
    pub from: String,
    /// The host it is on now.
    pub to: String,
    /// The target's fencing token.
    pub token: u64,
    /// The snapshots streamed, oldest first.
    pub sent: Vec<SentSnapshot>,
    /// Snapshots the target already held.
    pub held: usize,
    /// Stream bytes, all snapshots.
    pub bytes: u64,
    /// Milliseconds from the call to the answer (hibernation, transfer,
    /// handover and the wake included).
    pub millis: u64,
}

/// The longest host id a call may name.
const MAX_HOST_ID: usize = 253;

impl Service {
    /// `POST /v1/sandboxes/{id}/move`: see the module docs. `auth` is the
    /// caller's `Authorization` header ("" with authentication off): the
    /// target authenticates and authorizes the caller again with it.
    pub async fn move_sandbox(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: MoveSandbox,
        auth: String,
        opts: &GateOptions,
    ) -> ServiceResult<MoveReport> {
        let t0 = Instant::now();
        let rec = self
            .authorize_on(caller, id, lifecycle("move"), opts)
            .await?;
        let Some(cluster) = self.cluster().cloned() else {
            return Err(ServiceError::Conflict(
                "move: this daemon is not a cluster host ([cluster] enabled); \
                 between deployments, use push or pull"
                    .into(),
            ));
        };
        if cmd.host.is_empty() || cmd.host.len() > MAX_HOST_ID {
            return Err(ServiceError::InvalidRequest(format!(
                "host: the id of the target host (1 to {MAX_HOST_ID} bytes)"
            )));
        }
        let me = cluster.host_id().to_owned();
        if cmd.host == me {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is on host {me} already"
            )));
        }
        if cluster.owns(id).is_none() {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is not owned by this host ({me}): only its owner moves it"
            )));
        }
        let hosts = cluster.hosts_now().await?;
        let target = hosts
            .iter()
            .find(|h| h.info.id == cmd.host)
            .ok_or_else(|| not_found("host", &cmd.host))?
            .clone();
        if !target.alive {
            return Err(ServiceError::Conflict(format!(
                "host {} is not live (its registration expired at {})",
                target.info.id, target.lease_until
            )));
        }
        placement::move_compatible(cluster.info(), &target.info)
            .map_err(|e| ServiceError::Conflict(format!("move of sandbox {id} refused: {e}")))?;
        let was_running = rec.state == SandboxState::Running;
        let wake = cmd.wake.unwrap_or(was_running);
        // Room on the target, by its last heartbeat (its own admission
        // checks again when it wakes it).
        let req = placement::Request {
            vcpus: if wake { u64::from(rec.size.vcpus) } else { 0 },
            memory_mib: if wake {
                u64::from(rec.size.memory_mib)
            } else {
                0
            },
            pool_bytes: 1,
            anti_affinity: false,
        };
        let cand = placement::Candidate {
            id: target.info.id.clone(),
            alive: true,
            free: target.free,
            has_template: true,
            same_group: 0,
        };
        placement::place(&[cand], &req).map_err(|e| {
            ServiceError::InsufficientCapacity(format!("host {}: {e}", target.info.id))
        })?;
        let (base, http) = host_channel(&target.info, "move")?;
        let rx = Receiver {
            http: &http,
            base: &base,
            auth,
            verb: "move",
            routes: super::transfer::IMPORT_ROUTES,
        };
        // No replication of it meanwhile (docs/cluster.md "Replicas"): it
        // would send the same snapshots to the same host.
        let quiet = self.replication_quiet(id).await;
        // Held from the hibernation to the handover: no wake, rewind or
        // delete meanwhile.
        let (g, _rec) = self.hibernated_locked(id, rec).await?;
        let before = async {
            let (snaps, idents): (Vec<SnapshotRecord>, Vec<String>) =
                self.movable_snapshots(id).await?.into_iter().unzip();
            let (sent, total, held) = self.send_missing(&rx, id, &snaps, &idents).await?;
            let lease = cluster.hand_over(id, &target.info.id).await?;
            Ok::<_, ServiceError>((snaps, sent, total, held, lease))
        }
        .await;
        drop(g);
        drop(quiet);
        let handed_at = Instant::now();
        let (snaps, sent, total, held, lease) = match before {
            Ok(v) => v,
            Err(e) => {
                // Still this host's: as it was, as far as it can be.
                if was_running && cluster.owns(id).is_some() {
                    if let Err(w) = self.resume_ungated(id).await {
                        warn!(sandbox = %id, error = %w.message(), "waking a sandbox whose move failed");
                    }
                }
                return Err(e);
            }
        };
        // Committed: the target owns it. This host's copy goes, with what
        // it kept of the sandbox in memory.
        self.sched.remove(id);
        self.sampler.forget(id);
        self.logs.forget(id);
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        if let Err(e) = self.engine.delete(id).await {
            warn!(sandbox = %id, error = %e.message(), "move: removing the source's subvolume");
        }
        for s in &snaps {
            if let Err(e) = self.engine.delete_snapshot(&s.id).await {
                warn!(sandbox = %id, snapshot = %s.id, error = %e.message(), "move: removing the source's snapshot");
            }
        }
        info!(sandbox = %id, to = %target.info.id, bytes = total, sent = sent.len(), "sandbox moved; the target takes it up");
        let body = AdoptMove {
            from: me.clone(),
            wake,
        };
        let url = base
            .join(&format!("v1/imports/{id}/adopt"))
            .map_err(|e| ServiceError::InvalidRequest(format!("move: {e}")))?;
        let adopt = || async {
            if self.config.cluster.test_drop_adopt {
                warn!(sandbox = %id, to = %target.info.id, "[cluster] test_drop_adopt: the adopt call is dropped (a test's fault)");
                return Err("the adopt call was dropped ([cluster] test_drop_adopt)".to_owned());
            }
            let mut last = String::new();
            for attempt in 0..3 {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                let r = rx
                    .authed_post(url.clone())
                    .timeout(Duration::from_secs(600))
                    .json(&body)
                    .send()
                    .await;
                match r {
                    Ok(resp) => match super::transfer::remote_json(resp, "move: adopt").await {
                        Ok(v) => return Ok(Ok(v)),
                        // The target is there but failed (it may have
                        // crashed half-way): tried again, then its own
                        // take-up is waited for.
                        Err(e) if e.code() == ErrorCode::Internal => last = e.message(),
                        // A refusal (the lease expired before it was
                        // taken up, the caller not allowed there): its
                        // answer.
                        Err(e) => return Ok(Err(e)),
                    },
                    Err(e) => last = e.to_string(),
                }
            }
            Err(last)
        };
        let (sandbox, adoption) = match adopt().await {
            Ok(answer) => (answer?, Adoption::Answered),
            Err(why) => {
                // Lost (or dropped): the target takes the lease up by
                // itself once it went unrenewed for half its TTL
                // (docs/cluster.md "A lost adopt call"); what PostgreSQL
                // shows decides the answer.
                warn!(sandbox = %id, to = %target.info.id, error = %why, "move: the adopt call was not answered; waiting for the target to take the lease up");
                let seen = cluster.wait_taken_up(&lease, handed_at).await;
                let id2 = id.clone();
                let rec = self
                    .db(move |s| s.get_sandbox(&id2))
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| serde_json::to_value(r).ok())
                    .unwrap_or(serde_json::Value::Null);
                match seen {
                    Confirmation::TakenUp => {
                        info!(sandbox = %id, to = %target.info.id, "move: the target took the lease up without the adopt call");
                        // Its take-up does not wake it: the adopt call
                        // (a no-op now, but for the wake) once more.
                        let woken = match wake {
                            true => adopt().await.ok().and_then(Result::ok),
                            false => None,
                        };
                        (woken.unwrap_or(rec), Adoption::TakenUp)
                    }
                    Confirmation::Pending | Confirmation::Gone => {
                        warn!(sandbox = %id, to = %target.info.id, reading = ?seen, "move: the target has not confirmed the move");
                        (rec, Adoption::Unconfirmed)
                    }
                }
            }
        };
        Ok(MoveReport {
            sandbox,
            adoption,
            from: me,
            to: target.info.id,
            token: lease.token,
            sent,
            held,
            bytes: total,
            millis: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// `POST /v1/imports/{id}/adopt`: the target's side of a move (module
    /// docs). The caller must be able to act on the sandbox (its tenant's),
    /// the sandbox hibernated, and its lease in the store this host's. A
    /// call for a lease this host took up already (its pass found the call
    /// late, `crate::cluster::handover`) answers the sandbox as it is (and
    /// wakes it when asked and still hibernated).
    pub async fn adopt_move(
        self: &Arc<Self>,
        caller: &Caller,
        id: &SandboxId,
        cmd: AdoptMove,
    ) -> ServiceResult<SandboxRecord> {
        self.get_sandbox(caller, id).await?;
        let from: String = cmd.from.chars().take(MAX_HOST_ID).collect();
        let (rec, _) = self.take_up_move(id, Some(&from), Who::User).await?;
        if cmd.wake && rec.state == SandboxState::Hibernated {
            self.resume_ungated(id).await
        } else {
            Ok(rec)
        }
    }

    /// Takes up the lease of `id` that a move handed over to this host:
    /// what the adopt route does without its caller. `from`: the source
    /// named in the adopt call; `None`: the call never arrived (the
    /// take-up pass of `crate::cluster::handover`). Under the sandbox's
    /// operation lock, so the two never both take it up: the second finds
    /// the lease held and answers the record unchanged (`false`).
    pub(crate) async fn take_up_move(
        self: &Arc<Self>,
        id: &SandboxId,
        from: Option<&str>,
        who: Who,
    ) -> ServiceResult<(SandboxRecord, bool)> {
        let Some(cluster) = self.cluster().cloned() else {
            return Err(ServiceError::Conflict(
                "adopt: this daemon is not a cluster host".into(),
            ));
        };
        let _g = self.acquire(id, Op::Configure, who).await?;
        if cluster.owns(id).is_some() {
            return Ok((self.record(id).await?, false));
        }
        let mut rec = self.record(id).await?;
        if rec.state != SandboxState::Hibernated {
            return Err(ServiceError::InvalidStateOther(format!(
                "sandbox {id} is {}: only a hibernated sandbox is handed over",
                rec.state
            )));
        }
        let lease = cluster.adopt(id).await?;
        let me = cluster.host_id();
        let detail = match from {
            Some(from) => format!("moved here (host {me}) from host {from:?}"),
            None => format!(
                "moved here (host {me}): the move's adopt call was not received; \
                 taken up once the handed-over lease (token {}) went unrenewed for half its TTL",
                lease.token
            ),
        };
        self.done(
            &mut rec,
            Op::Configure,
            SandboxState::Hibernated,
            None,
            &[],
            Some(detail),
        )
        .await?;
        let id2 = id.clone();
        for s in self.db(move |st| st.list_snapshots(&id2, false)).await? {
            self.imports.forget(&s.id);
        }
        Ok((rec, true))
    }

    /// The take-up pass's side for one unrenewed lease of this host
    /// (`crate::cluster::handover`): gathers what
    /// [`crate::cluster::handover::decide`] needs and takes the lease up
    /// when it allows (journaled, counted `cluster_move_adopted_unasked`).
    /// `Ok(false)`: left alone.
    pub(crate) async fn take_up_unasked(
        self: &Arc<Self>,
        lease: &crate::store::OwnerLease,
    ) -> ServiceResult<bool> {
        use crate::cluster::handover::{decide, Seen};
        let Some(cluster) = self.cluster().cloned() else {
            return Ok(false);
        };
        let id = &lease.sandbox_id;
        let id2 = id.clone();
        let rec = self
            .db(move |s| s.get_sandbox(&id2))
            .await?
            .filter(|r| r.state != SandboxState::Deleted);
        let mut seen = Seen {
            held: cluster.leases().get(id).is_some(),
            state: rec.as_ref().map(|r| r.state),
            newest: None,
        };
        if !seen.held && seen.state == Some(SandboxState::Hibernated) {
            let id2 = id.clone();
            if let Some(snap) = self.db(move |s| s.latest_ready_snapshot(&id2)).await? {
                let snap = self.resolve_same_as(snap).await?;
                let here = self.engine.snapshot_identity(&snap.id).await.is_ok();
                seen.newest = Some((snap.id, here));
            }
        }
        if let Err(why) = decide(&seen) {
            info!(sandbox = %id, token = lease.token, %why, "an unrenewed lease of this host left alone");
            return Ok(false);
        }
        let (_, taken) = self.take_up_move(id, None, Who::Background).await?;
        if taken {
            warn!(sandbox = %id, token = lease.token, "a move's adopt call was not received: lease taken up");
            self.metrics.count("cluster_move_adopted_unasked");
        }
        Ok(taken)
    }
}
