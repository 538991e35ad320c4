//! Admission: the one place that decides whether an operation may start a
//! VM on this host, for every operation that does — create, fork, wake
//! (resume of a hibernated sandbox, wake-on-access), rewind of a sandbox
//! without a VM, recovery, template builds.
//!
//! A sandbox's reservation is its record: the store counts the size of
//! every sandbox in a state with a VM *and* of every sandbox with a pending
//! operation that starts one (`resume`, `rewind`, `recover`), so a
//! reservation holds from the pending write on. [`Service::admit`] checks
//! the host's capacity and returns the placement lock; the caller writes its
//! pending record while holding it, so two admissions never both take the
//! last room. Template builds have no record: their builder VM is a
//! [`Transient`] reservation held for the build, and at most
//! `[templates] max_concurrent_builds` run at once.
//!
//! Warm guests (`service::warm`) are [`Transient`] reservations too, not
//! counted as builds; when an admission finds the room short it ends warm
//! guests, the oldest of the fullest pool first, before it refuses
//! ([`Service::check_capacity_or_evict`]): a sandbox someone asked for
//! comes before one kept in case. The pool filler takes only room that is
//! free ([`Service::admit_warm`]).
//!
//! Refusals are `insufficient_capacity` (a code never renamed) and name
//! what is short. Later work (placement by use, density) extends this
//! module.
//!
//! Quotas (`[quotas]` of the configuration; everything unset is unlimited)
//! are decided here too, before the host's room, and refused with
//! `quota_exceeded` (403) with nothing changed:
//! - per sandbox: vCPUs and memory of a new sandbox;
//! - per tenant: sandboxes not deleted (a new one, hibernated or not), and
//!   the vCPUs and memory of its sandboxes with a VM — counted like the
//!   host's reservations, so every operation that starts a VM (create, fork,
//!   wake, rewind, recovery) is checked under the same placement lock;
//! - pool bytes, per tenant and per sandbox: the charge of their ready
//!   snapshots ([`Service::pool_charge`]). A manual snapshot over it is
//!   refused, a rolling one skipped with the reason in the journal, a fork
//!   refused while the tenant is over (see `service::snapshots`). strata
//!   never puts a kernel limit on a live subvolume: a qgroup limit would turn
//!   the guest's RAM-file writeback into I/O errors.
//!
//! **The charge.** A snapshot is charged the bytes it holds that the one it
//! descends from does not (`Engine::snapshot_charge`, an extent walk:
//! `strata_storage::written_bytes`): its sandbox's previous ready snapshot,
//! else the snapshot the sandbox was forked from, else its template. So an
//! extent is charged once, to the first snapshot of the lineage that holds
//! it: a fork pays for what it wrote, the template's extents are the
//! platform's. Snapshots never change, so a charge is computed once per base
//! and cached in the store (`snapshot_charges`); deleting a snapshot moves
//! its successor to a new base, which is computed again when next needed.

use super::prelude::*;
use super::sampler::HostPoint;
use crate::config::AdmissionMode;

use super::lifecycle::pressure::Freed;

/// How long an admission short of room waits for room that is on its way
/// (a hibernation under way, an idle sandbox busy with a rolling snapshot)
/// before it is refused.
const ROOM_WAIT: Duration = Duration::from_secs(15);
/// How often it looks again meanwhile.
const ROOM_POLL: Duration = Duration::from_millis(100);

/// Template builds (each boots a builder VM) that may run at once, by
/// default (`[templates] max_concurrent_builds`).
pub const MAX_CONCURRENT_TEMPLATE_BUILDS: u64 = 2;

/// Whether `op` on a sandbox in `state` starts a VM (and so needs room).
pub(crate) fn starts_vm(state: SandboxState, op: Op) -> bool {
    match op {
        Op::Created | Op::Recover => true,
        Op::Resume => state == SandboxState::Hibernated,
        Op::Rewind => !state.has_vm(),
        _ => false,
    }
}

/// Reservations without a record (template builders, warm guests), in memory.
#[derive(Debug, Default)]
pub(crate) struct Transients {
    used: Mutex<TransientUse>,
}

/// What the transient reservations hold.
#[derive(Debug, Default, Clone, Copy)]
struct TransientUse {
    vcpus: u64,
    memory_mib: u64,
    builds: u64,
    build_vcpus: u64,
    warm: u64,
}

/// A transient reservation; released when dropped.
#[derive(Debug)]
pub(crate) struct Transient {
    owner: Arc<Service>,
    size: SandboxSize,
    /// A template build's (counted against
    /// `[templates] max_concurrent_builds`); else a warm guest's.
    build: bool,
}

impl Drop for Transient {
    fn drop(&mut self) {
        let mut g = self
            .owner
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let v = u64::from(self.size.vcpus);
        g.vcpus = g.vcpus.saturating_sub(v);
        g.memory_mib = g.memory_mib.saturating_sub(u64::from(self.size.memory_mib));
        if self.build {
            g.builds = g.builds.saturating_sub(1);
            g.build_vcpus = g.build_vcpus.saturating_sub(v);
        } else {
            g.warm = g.warm.saturating_sub(1);
        }
    }
}

/// What one admission asks for, by use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Want {
    vcpus: u32,
    cpu_cores: f64,
    mem_bytes: u64,
}

/// The host's CPU and memory as admission by use counts them
/// ([`Service::use_budget`]; `/v1/stats` `host`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct UseBudget {
    /// Host CPUs given to sandboxes.
    pub cores: f64,
    /// The CPUs less `cpu_headroom`, in cores.
    pub cpu_budget_cores: f64,
    /// What is counted against it: `sandbox_cores + other_counted_cores`.
    pub cpu_demand_cores: f64,
    /// The sandboxes' recent peak together (and builders, warm guests), in cores.
    pub sandbox_cores: f64,
    /// The host's other load (mean over the peak window), in cores.
    pub other_cores: f64,
    /// The part of `other_cores` counted: at most `other_load_share` of
    /// the budget.
    #[serde(default)]
    pub other_counted_cores: f64,
    /// VMs held or about to start.
    pub vms: u64,
    /// Their nominal vCPUs.
    #[serde(default)]
    pub vcpus_held: u64,
    /// Up to this many vCPUs held, CPU is not judged by use
    /// (`nominal_floor`: the CPUs × `cpu_overcommit`; 0: off).
    #[serde(default)]
    pub vcpus_floor: u64,
    /// Sandboxes with a VM that the sampler has not measured yet.
    pub unmeasured: u64,
    /// The host's RAM, bytes.
    pub mem_total_bytes: u64,
    /// `MemAvailable` now, bytes.
    pub mem_available_bytes: u64,
    /// Memory of sandboxes not measured yet (counted as not available), bytes.
    pub mem_unmeasured_bytes: u64,
    /// RAM kept available (`memory_headroom`), bytes.
    pub mem_floor_bytes: u64,
}

fn max_vms_error(vms: u64, max: u64) -> ServiceError {
    ServiceError::InsufficientCapacity(format!(
        "this host runs {vms} VMs, its limit ([capacity] max_vms) is {max}"
    ))
}

impl UseBudget {
    /// Sets `other_counted_cores` (other load up to `other_load_share` of
    /// the budget) and `cpu_demand_cores` from the parts.
    pub(crate) fn total(&mut self, other_load_share: f64) {
        self.other_counted_cores = self
            .other_cores
            .min(self.cpu_budget_cores * other_load_share.clamp(0.0, 1.0));
        self.cpu_demand_cores = self.sandbox_cores + self.other_counted_cores;
    }

    /// `Ok` when `want` fits; else `insufficient_capacity` naming what is short.
    pub(crate) fn check(&self, cap: &crate::config::Capacity, want: &Want) -> ServiceResult<()> {
        let max_vms = u64::from(cap.max_vms);
        if max_vms > 0 && self.vms >= max_vms {
            return Err(max_vms_error(self.vms, max_vms));
        }
        let within_floor =
            self.vcpus_floor > 0 && self.vcpus_held + u64::from(want.vcpus) <= self.vcpus_floor;
        if !within_floor && self.cpu_demand_cores + want.cpu_cores > self.cpu_budget_cores + 1e-9 {
            return Err(ServiceError::InsufficientCapacity(format!(
                "this host's CPU is short: the recent peak of its {} VMs together ({:.2} cores) and its other load ({:.2} counted of {:.2}) take {:.2} of the {:.2} cores admission gives out ({} CPUs less {:.0} % headroom); a {}-vCPU sandbox is counted at {:.2} more{}",
                self.vms,
                self.sandbox_cores,
                self.other_counted_cores,
                self.other_cores,
                self.cpu_demand_cores,
                self.cpu_budget_cores,
                self.cores,
                cap.cpu_headroom * 100.0,
                want.vcpus,
                want.cpu_cores,
                if self.vcpus_floor > 0 {
                    format!(
                        " (past the {} vCPUs admitted without measuring: {} held)",
                        self.vcpus_floor, self.vcpus_held
                    )
                } else {
                    String::new()
                }
            )));
        }
        if self.mem_total_bytes > 0 {
            let left = self
                .mem_available_bytes
                .saturating_sub(self.mem_unmeasured_bytes)
                .saturating_sub(want.mem_bytes);
            if left < self.mem_floor_bytes {
                return Err(ServiceError::InsufficientCapacity(format!(
                    "this host's memory is short: {} available ({} of it promised to sandboxes not measured yet), {} asked, {} kept free ({:.0} % of {})",
                    mib(self.mem_available_bytes),
                    mib(self.mem_unmeasured_bytes),
                    mib(want.mem_bytes),
                    mib(self.mem_floor_bytes),
                    cap.memory_headroom * 100.0,
                    mib(self.mem_total_bytes)
                )));
            }
        }
        Ok(())
    }
}

/// What a tenant's ready snapshots are charged (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PoolCharge {
    /// The tenant's total.
    pub tenant: u64,
    /// Per sandbox.
    pub by_sandbox: HashMap<SandboxId, u64>,
}

/// The id a charge row records for its base.
fn base_key(base: Option<&Source>) -> String {
    match base {
        Some(Source::Snapshot(s)) => s.to_string(),
        Some(Source::Template(t)) => t.to_string(),
        None => String::new(),
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / f64::from(1u32 << 20))
}

impl Service {
    /// Admits an operation on `rec` that starts a VM (a new sandbox's first,
    /// a wake, a rewind without a VM, a recovery): `Ok` with the placement
    /// lock, under which the caller records its pending write;
    /// `quota_exceeded` when a quota of its tenant or of sandboxes would be
    /// exceeded, `insufficient_capacity` when the host lacks the room.
    pub(crate) async fn admit(
        &self,
        rec: &SandboxRecord,
    ) -> ServiceResult<tokio::sync::MutexGuard<'_, ()>> {
        let g = self.placement.lock().await;
        self.check_quota(rec, true).await?;
        self.check_capacity_or_evict(rec.size, Some(&rec.id))
            .await?;
        Ok(g)
    }

    /// [`Service::check_capacity`], making room while it is short: warm
    /// guests end first (the oldest of the fullest pool), then, with
    /// `[pressure] enabled`, idle sandboxes hibernate, the least recently
    /// active first (`lifecycle::pressure`): a sandbox someone asked for
    /// comes before one kept in case, and nothing is refused while an idle
    /// sandbox could make the room: when the room is on its way (a
    /// hibernation under way, an idle sandbox busy with a rolling snapshot
    /// for a moment) it waits for it, up to `ROOM_WAIT`. `id` is the
    /// sandbox admitted (never one of those hibernated). Called under the
    /// placement lock.
    pub(crate) async fn check_capacity_or_evict(
        &self,
        size: SandboxSize,
        id: Option<&SandboxId>,
    ) -> ServiceResult<()> {
        let mut tried: Vec<SandboxId> = id.into_iter().cloned().collect();
        let started = Instant::now();
        loop {
            match self.check_capacity(size, id).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    if self.evict_one_warm() {
                        continue;
                    }
                    if !self.config.pressure.enabled {
                        return Err(e);
                    }
                    let why = format!("admission: {}", e.message());
                    match self.hibernate_one_idle(&why, &mut tried).await {
                        Freed::Hibernated(_) => continue,
                        // Room is on its way (a hibernation under way, an
                        // idle sandbox in a rolling snapshot): wait for it
                        // rather than refuse while an idle sandbox runs.
                        Freed::Pending if started.elapsed() < ROOM_WAIT => {
                            tokio::time::sleep(ROOM_POLL).await;
                            continue;
                        }
                        Freed::Pending | Freed::Nothing => return Err(e),
                    }
                }
            }
        }
    }

    /// Whether the host has the room of `size` free now (nothing reserved).
    pub(crate) async fn has_room(&self, size: SandboxSize) -> ServiceResult<()> {
        let _g = self.placement.lock().await;
        self.check_capacity(size, None).await
    }

    /// Reserves the room of a warm guest of `size`, if the host has it
    /// without ending anything. Called by the pool filler.
    pub(crate) async fn admit_warm(
        self: &Arc<Self>,
        size: SandboxSize,
    ) -> ServiceResult<Transient> {
        let _g = self.placement.lock().await;
        self.check_capacity(size, None).await?;
        Ok(self.reserve_transient(size, false))
    }

    fn transient_use(&self) -> TransientUse {
        *self
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn reserve_transient(self: &Arc<Self>, size: SandboxSize, build: bool) -> Transient {
        let mut u = self
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        u.vcpus += u64::from(size.vcpus);
        u.memory_mib += u64::from(size.memory_mib);
        if build {
            u.builds += 1;
            u.build_vcpus += u64::from(size.vcpus);
        } else {
            u.warm += 1;
        }
        Transient {
            owner: self.clone(),
            size,
            build,
        }
    }

    /// Admits a new sandbox that starts no VM (created hibernated): the
    /// tenant's sandbox count, under the placement lock.
    pub(crate) async fn admit_without_vm(
        &self,
        rec: &SandboxRecord,
    ) -> ServiceResult<tokio::sync::MutexGuard<'_, ()>> {
        let g = self.placement.lock().await;
        self.check_quota(rec, false).await?;
        Ok(g)
    }

    /// The `[quotas]` checks of [`Service::admit`]. `rec` is new (not yet
    /// stored: a create or fork) or an existing sandbox without a VM that is
    /// about to start one.
    pub(super) async fn check_quota(
        &self,
        rec: &SandboxRecord,
        starts_vm: bool,
    ) -> ServiceResult<()> {
        let q = &self.config.quotas;
        let is_new = rec.pending_op == Some(Op::Created);
        let (vcpus, mem) = (u64::from(rec.size.vcpus), u64::from(rec.size.memory_mib));
        if is_new {
            if let Some(max) = q.sandbox.vcpus.filter(|m| vcpus > *m) {
                return Err(ServiceError::QuotaExceeded(format!(
                    "a sandbox may have at most {max} vCPUs; asked for {vcpus}"
                )));
            }
            if let Some(max) = q.sandbox.memory_mib.filter(|m| mem > *m) {
                return Err(ServiceError::QuotaExceeded(format!(
                    "a sandbox may have at most {max} MiB of memory; asked for {mem}"
                )));
            }
        }
        let limits = q.for_tenant(&rec.tenant);
        let t = rec.tenant.clone();
        if limits.sandboxes.is_some() || limits.vcpus.is_some() || limits.memory_mib.is_some() {
            let t2 = t.clone();
            let used = self.db(move |s| s.tenant_usage(&t2)).await?;
            if let Some(max) = limits.sandboxes.filter(|m| is_new && used.sandboxes >= *m) {
                return Err(ServiceError::QuotaExceeded(format!(
                    "tenant {t} has {} of its {max} sandboxes; delete one first",
                    used.sandboxes
                )));
            }
            if starts_vm {
                if let Some(max) = limits.vcpus.filter(|m| used.vcpus + vcpus > *m) {
                    return Err(ServiceError::QuotaExceeded(format!(
                        "tenant {t} runs {} of its {max} vCPUs; asked for {vcpus} more (hibernate or delete a sandbox first)",
                        used.vcpus
                    )));
                }
                if let Some(max) = limits.memory_mib.filter(|m| used.memory_mib + mem > *m) {
                    return Err(ServiceError::QuotaExceeded(format!(
                        "tenant {t} runs {} of its {max} MiB of memory; asked for {mem} more (hibernate or delete a sandbox first)",
                        used.memory_mib
                    )));
                }
            }
        }
        // A fork pins its source's state (a live fork snapshots it): not
        // while the tenant is over its pool-bytes quota.
        if is_new && rec.source_snapshot.is_some() && limits.pool_bytes.is_some() {
            self.check_pool_quota(rec, 0, true).await?;
        }
        Ok(())
    }

    /// The snapshot `snap` of `sandbox` descends from: the sandbox's ready
    /// snapshot before it (`prev`), else the snapshot it was forked from
    /// (while that is ready), else its template.
    async fn charge_base(
        &self,
        sandbox: Option<&SandboxRecord>,
        prev: Option<&SnapshotId>,
    ) -> ServiceResult<Option<Source>> {
        if let Some(p) = prev {
            return Ok(Some(Source::Snapshot(p.clone())));
        }
        let Some(sb) = sandbox else {
            return Ok(None);
        };
        if let Some(src) = sb.source_snapshot.clone() {
            let s2 = src.clone();
            let ready = self
                .db(move |s| s.get_snapshot(&s2))
                .await?
                .is_some_and(|r| r.status == SnapshotStatus::Ready);
            if ready {
                return Ok(Some(Source::Snapshot(src)));
            }
        }
        Ok(sb.template.clone().map(Source::Template))
    }

    /// Computes (and caches) the charge of `snap` against `base`.
    async fn compute_charge(
        &self,
        snap: &SnapshotRecord,
        base: Option<&Source>,
    ) -> ServiceResult<u64> {
        let bytes = self.engine.snapshot_charge(&snap.id, base).await?;
        let c = SnapshotCharge {
            snapshot_id: snap.id.clone(),
            tenant: snap.tenant.clone(),
            sandbox_id: snap.sandbox_id.clone(),
            base: base_key(base),
            bytes,
            computed_at: self.now(),
        };
        self.db(move |s| s.put_charge(&c)).await?;
        Ok(bytes)
    }

    /// What the ready snapshots of `tenant` are charged, in total and per
    /// sandbox. Cached charges whose base is still the right one are used as
    /// they are; the others are computed (an extent walk each) and cached.
    pub(crate) async fn pool_charge(&self, tenant: &str) -> ServiceResult<PoolCharge> {
        let t = tenant.to_owned();
        let (snaps, cached) = self
            .db(move |s| Ok((s.tenant_ready_snapshots(&t)?, s.snapshot_charges(&t)?)))
            .await?;
        let cached: HashMap<SnapshotId, SnapshotCharge> = cached
            .into_iter()
            .map(|c| (c.snapshot_id.clone(), c))
            .collect();
        let mut out = PoolCharge::default();
        let mut prev: Option<&SnapshotRecord> = None;
        let mut sandbox: Option<SandboxRecord> = None;
        // A `same_as` record holds nothing (0 bytes) and is no base.
        for snap in snaps.iter().filter(|s| s.same_as.is_none()) {
            if prev.is_some_and(|p| p.sandbox_id != snap.sandbox_id) {
                prev = None;
            }
            if sandbox.as_ref().map(|r| &r.id) != Some(&snap.sandbox_id) {
                let id = snap.sandbox_id.clone();
                sandbox = self.db(move |s| s.get_sandbox(&id)).await?;
            }
            let base = self
                .charge_base(sandbox.as_ref(), prev.map(|p| &p.id))
                .await?;
            let bytes = match cached.get(&snap.id) {
                Some(c) if c.base == base_key(base.as_ref()) => c.bytes,
                _ => match self.compute_charge(snap, base.as_ref()).await {
                    Ok(b) => b,
                    // Gone from the pool meanwhile (being deleted): nothing held.
                    Err(ServiceError::Engine(RuntimeError::SnapshotNotFound(_))) => 0,
                    Err(e) => return Err(e),
                },
            };
            out.tenant = out.tenant.saturating_add(bytes);
            *out.by_sandbox.entry(snap.sandbox_id.clone()).or_default() += bytes;
            prev = Some(snap);
        }
        Ok(out)
    }

    /// Charges the ready snapshot `snap` (unless its charge is cached
    /// against the right base): against the ready snapshot of its sandbox
    /// before it, else its fork source, else its template.
    pub(crate) async fn charge_ready_snapshot(&self, snap: &SnapshotRecord) -> ServiceResult<u64> {
        let (sb, at) = (snap.sandbox_id.clone(), snap.created_at);
        let id = snap.id.clone();
        let (rec, prev) = self
            .db(move |s| {
                let prev = s
                    .list_snapshots(&sb, false)?
                    .into_iter()
                    .filter(|p| {
                        p.status == SnapshotStatus::Ready && p.id != id && p.same_as.is_none()
                    })
                    .rfind(|p| p.created_at <= at);
                Ok((s.get_sandbox(&sb)?, prev))
            })
            .await?;
        let base = self
            .charge_base(rec.as_ref(), prev.as_ref().map(|p| &p.id))
            .await?;
        self.compute_charge(snap, base.as_ref()).await
    }

    /// Charges a new (not yet ready) snapshot `snap` of `rec` against the
    /// sandbox's latest ready one (or its fork source, or template).
    pub(crate) async fn charge_new_snapshot(
        &self,
        rec: &SandboxRecord,
        snap: &SnapshotRecord,
    ) -> ServiceResult<u64> {
        let id = rec.id.clone();
        let prev = self.db(move |s| s.latest_ready_snapshot(&id)).await?;
        let base = self
            .charge_base(
                Some(rec),
                prev.as_ref().map(|p| p.same_as.as_ref().unwrap_or(&p.id)),
            )
            .await?;
        self.compute_charge(snap, base.as_ref()).await
    }

    /// Checks the pool-bytes quotas of `rec`'s tenant and of `rec` with
    /// `extra` more bytes charged: `at_limit` refuses when the charge already
    /// reaches a limit (no room left), otherwise only when it goes over.
    pub(crate) async fn check_pool_quota(
        &self,
        rec: &SandboxRecord,
        extra: u64,
        at_limit: bool,
    ) -> ServiceResult<()> {
        let q = &self.config.quotas;
        let tenant_max = q.for_tenant(&rec.tenant).pool_bytes;
        let sandbox_max = q.sandbox.pool_bytes;
        if tenant_max.is_none() && sandbox_max.is_none() {
            return Ok(());
        }
        let charge = self.pool_charge(&rec.tenant).await?;
        let over = |held: u64, max: u64| {
            let total = held.saturating_add(extra);
            if at_limit {
                total >= max
            } else {
                total > max
            }
        };
        if let Some(max) = tenant_max.filter(|m| over(charge.tenant, *m)) {
            return Err(ServiceError::QuotaExceeded(format!(
                "tenant {} holds {} of pool space in snapshots{}, its quota is {}; delete snapshots or sandboxes first",
                rec.tenant,
                mib(charge.tenant),
                if extra > 0 { format!(" and this one would add {}", mib(extra)) } else { String::new() },
                mib(max)
            )));
        }
        let mine = charge.by_sandbox.get(&rec.id).copied().unwrap_or(0);
        if let Some(max) = sandbox_max.filter(|m| over(mine, *m)) {
            return Err(ServiceError::QuotaExceeded(format!(
                "sandbox {} holds {} of pool space in snapshots{}, the quota of a sandbox is {}; delete some of its snapshots first",
                rec.id,
                mib(mine),
                if extra > 0 { format!(" and this one would add {}", mib(extra)) } else { String::new() },
                mib(max)
            )));
        }
        Ok(())
    }

    /// Checks that `size` more fits on this host: `[capacity] admission`
    /// by use ([`Service::use_budget`]) or by nominal sizes; `id` is the
    /// sandbox admitted, when there is one (a wake is counted at its own
    /// recent peak). Both modes keep `max_vms`.
    pub(crate) async fn check_capacity(
        &self,
        size: SandboxSize,
        id: Option<&SandboxId>,
    ) -> ServiceResult<()> {
        match self.config.capacity.admission {
            AdmissionMode::Nominal => self.check_nominal(size).await,
            AdmissionMode::Use => {
                let b = self.use_budget().await?;
                b.check(&self.config.capacity, &self.want(size, id))
            }
        }
    }

    /// What admitting `size` (sandbox `id`, if known) adds, by use: its own
    /// recent peak when the sampler has one, else the configured estimate
    /// of a new sandbox; memory likewise (its peak resident set, else its
    /// size).
    fn want(&self, size: SandboxSize, id: Option<&SandboxId>) -> Want {
        let cap = &self.config.capacity;
        let since = self.peak_since();
        let known = id.and_then(|i| self.sampler.summary(i, since));
        Want {
            vcpus: size.vcpus,
            cpu_cores: match known {
                Some(u) => u.cpu_cores_peak.max(cap.idle_cpu_floor),
                None => cap.new_sandbox_cpu * f64::from(size.vcpus.max(1)),
            },
            mem_bytes: match known {
                Some(u) if u.host_rss_peak_bytes > 0 => u.host_rss_peak_bytes,
                _ => u64::from(size.memory_mib) << 20,
            },
        }
    }

    /// The start of `[capacity] peak_window`, back from now.
    pub(super) fn peak_since(&self) -> DateTime<Utc> {
        self.now()
            - chrono::TimeDelta::from_std(self.config.capacity.peak_window)
                .unwrap_or(chrono::TimeDelta::MAX)
    }

    /// What the host's CPU and memory hold by use, as admission counts it:
    /// the sandboxes with a VM (or about to start one) at the most they
    /// used together in one sampler round of `[capacity] peak_window` (at
    /// least `idle_cpu_floor` each; one not measured yet at
    /// `new_sandbox_cpu` per vCPU and its whole memory),
    /// template builders at their vCPUs, warm guests (paused) at the floor,
    /// plus the host's other load (its mean over the window: the daemon,
    /// other programs), against the CPUs less `cpu_headroom` and the RAM
    /// available now less `memory_headroom`.
    pub async fn use_budget(&self) -> ServiceResult<UseBudget> {
        let cap = &self.config.capacity;
        let reserved = self.db(|s| s.reserved_sandboxes()).await?;
        let since = self.peak_since();
        let t = self.transient_use();
        let mut b = UseBudget {
            cores: cap.cores() as f64,
            cpu_budget_cores: cap.cores() as f64 * (1.0 - cap.cpu_headroom),
            cpu_demand_cores: 0.0,
            sandbox_cores: 0.0,
            other_cores: 0.0,
            other_counted_cores: 0.0,
            vms: reserved.len() as u64 + t.builds + t.warm,
            vcpus_held: reserved
                .iter()
                .map(|r| u64::from(r.size.vcpus))
                .sum::<u64>()
                + t.vcpus,
            vcpus_floor: if cap.nominal_floor {
                cap.nominal_vcpus()
            } else {
                0
            },
            unmeasured: 0,
            mem_total_bytes: 0,
            mem_available_bytes: 0,
            mem_unmeasured_bytes: 0,
            mem_floor_bytes: 0,
        };
        let mut measured = Vec::with_capacity(reserved.len());
        for r in &reserved {
            if self.sampler.summary(&r.id, since).is_some() {
                measured.push(&r.id);
            } else {
                b.unmeasured += 1;
                b.sandbox_cores += cap.new_sandbox_cpu * f64::from(r.size.vcpus.max(1));
                b.mem_unmeasured_bytes += u64::from(r.size.memory_mib) << 20;
            }
        }
        // The measured ones at what they took together at their busiest
        // round of the window (not the sum of their own peaks, which
        // rarely coincide), each at least at the floor.
        let (peak, n) = self.sampler.peak_of_sum(measured.iter().copied(), since);
        b.sandbox_cores += peak.max(n as f64 * cap.idle_cpu_floor);
        b.sandbox_cores += t.build_vcpus as f64 + t.warm as f64 * cap.idle_cpu_floor;
        let host = self.sampler.host_series(since);
        if !host.is_empty() {
            b.other_cores =
                host.iter().map(HostPoint::other_cores).sum::<f64>() / host.len() as f64;
        }
        b.total(cap.other_load_share);
        if let Some((_, _, total, avail)) = crate::host::HostReader::counters() {
            b.mem_total_bytes = total;
            b.mem_available_bytes = avail;
            b.mem_floor_bytes = (total as f64 * cap.memory_headroom) as u64;
        }
        Ok(b)
    }

    /// Nominal admission: `size` more next to every reservation.
    async fn check_nominal(&self, size: SandboxSize) -> ServiceResult<()> {
        let (cap_cpu, cap_mem) = self.config.capacity.resolve();
        let (rec_cpu, rec_mem) = self.db(|s| s.reserved_capacity()).await?;
        let t = self.transient_use();
        let (t_cpu, t_mem) = (t.vcpus, t.memory_mib);
        let max_vms = u64::from(self.config.capacity.max_vms);
        if max_vms > 0 {
            let vms = self.db(|s| s.reserved_sandboxes()).await?.len() as u64 + t.builds + t.warm;
            if vms >= max_vms {
                return Err(max_vms_error(vms, max_vms));
            }
        }
        let (used_cpu, used_mem) = (rec_cpu + t_cpu, rec_mem + t_mem);
        if used_cpu + u64::from(size.vcpus) > cap_cpu
            || used_mem + u64::from(size.memory_mib) > cap_mem
        {
            return Err(ServiceError::InsufficientCapacity(format!(
                "this host has {} of {cap_cpu} vCPUs and {} of {cap_mem} MiB free; asked for {} vCPUs and {} MiB",
                cap_cpu.saturating_sub(used_cpu),
                cap_mem.saturating_sub(used_mem),
                size.vcpus,
                size.memory_mib
            )));
        }
        Ok(())
    }

    /// Admits a template build of `size`: room for its builder VM and a
    /// free build slot; the reservation lasts as long as the guard.
    pub(crate) async fn admit_build(
        self: &Arc<Self>,
        size: SandboxSize,
    ) -> ServiceResult<Transient> {
        let _g = self.placement.lock().await;
        let running = self.transient_use().builds;
        let max = self.config.templates.max_concurrent_builds;
        if running >= max {
            return Err(ServiceError::InsufficientCapacity(format!(
                "{running} template builds are running (at most {max} at once, [templates] max_concurrent_builds); retry when one ends"
            )));
        }
        self.check_capacity_or_evict(size, None).await?;
        Ok(self.reserve_transient(size, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(demand: f64, avail_mib: u64, unmeasured_mib: u64) -> UseBudget {
        UseBudget {
            cores: 2.0,
            cpu_budget_cores: 1.5,
            cpu_demand_cores: demand,
            sandbox_cores: demand,
            other_cores: 0.0,
            other_counted_cores: 0.0,
            vms: 10,
            vcpus_held: 10,
            vcpus_floor: 0,
            unmeasured: 0,
            mem_total_bytes: 10_240 << 20,
            mem_available_bytes: avail_mib << 20,
            mem_unmeasured_bytes: unmeasured_mib << 20,
            mem_floor_bytes: 1024 << 20,
        }
    }

    fn want(cores: f64, mib: u64) -> Want {
        Want {
            vcpus: 1,
            cpu_cores: cores,
            mem_bytes: mib << 20,
        }
    }

    #[test]
    fn use_budget_admits_within_the_cpu_budget_and_memory_floor() {
        let cap = crate::config::Capacity::default();
        assert!(budget(1.0, 8000, 0).check(&cap, &want(0.5, 256)).is_ok());
        let e = budget(1.3, 8000, 0)
            .check(&cap, &want(0.25, 256))
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InsufficientCapacity);
        let m = e.message();
        assert!(
            m.contains("CPU is short") && m.contains("1.30 of the 1.50 cores"),
            "{m}"
        );
        // Other load takes at most other_load_share (0.5) of the budget: a
        // host saturated by other programs still admits what fits in the
        // rest, and refuses what does not.
        let mut busy = budget(0.0, 8000, 0);
        busy.other_cores = 2.2;
        busy.total(cap.other_load_share);
        assert!((busy.other_counted_cores - 0.75).abs() < 1e-9, "{busy:?}");
        assert!(busy.check(&cap, &want(0.25, 256)).is_ok());
        busy.sandbox_cores = 0.6;
        busy.total(cap.other_load_share);
        let m = busy.check(&cap, &want(0.25, 256)).unwrap_err().message();
        assert!(m.contains("0.75 counted of 2.20"), "{m}");
        // Within the nominal floor CPU is not judged by use; past it, it is.
        let mut small = budget(1.4, 8000, 0);
        (small.vcpus_held, small.vcpus_floor) = (3, 8);
        assert!(small.check(&cap, &want(0.25, 256)).is_ok());
        small.vcpus_held = 8;
        let m = small.check(&cap, &want(0.25, 256)).unwrap_err().message();
        assert!(
            m.contains("past the 8 vCPUs admitted without measuring"),
            "{m}"
        );
        // ...but memory still is.
        let mut tight = budget(0.0, 1100, 0);
        (tight.vcpus_held, tight.vcpus_floor) = (0, 8);
        assert!(tight
            .check(&cap, &want(0.1, 512))
            .unwrap_err()
            .message()
            .contains("memory is short"));
        // Below the share, all of it counts.
        let mut some = budget(0.5, 8000, 0);
        some.other_cores = 0.4;
        some.total(cap.other_load_share);
        assert!((some.cpu_demand_cores - 0.9).abs() < 1e-9, "{some:?}");
        // Memory: available less unmeasured less asked must stay over the floor.
        assert!(budget(0.0, 2000, 0).check(&cap, &want(0.1, 512)).is_ok());
        let e = budget(0.0, 2000, 600)
            .check(&cap, &want(0.1, 512))
            .unwrap_err();
        assert!(e.message().contains("memory is short"), "{}", e.message());
        // max_vms in any case.
        let mut full = budget(0.0, 8000, 0);
        full.vms = u64::from(cap.max_vms);
        assert!(full
            .check(&cap, &want(0.0, 1))
            .unwrap_err()
            .message()
            .contains("max_vms"));
    }

    #[test]
    fn which_operations_start_a_vm() {
        use SandboxState::*;
        assert!(starts_vm(Hibernated, Op::Resume));
        assert!(!starts_vm(Paused, Op::Resume), "a paused VM exists");
        assert!(starts_vm(Hibernated, Op::Rewind) && starts_vm(Failed, Op::Rewind));
        assert!(
            !starts_vm(Running, Op::Rewind),
            "rewind replaces the VM it has"
        );
        assert!(starts_vm(Failed, Op::Recover));
        assert!(!starts_vm(Running, Op::Exec) && !starts_vm(Running, Op::Snapshot));
    }
}
