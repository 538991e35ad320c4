//! Many hosts, one PostgreSQL (`[cluster] enabled`, docs/cluster.md).
//!
//! With `[store] url` = PostgreSQL and `[cluster] enabled = true`, each
//! `stratad` is one host:
//! - it **registers** (id, address, accelerator, QEMU version, CPU model,
//!   capacity) and **heartbeats** what it has free (admission's numbers:
//!   `Service::use_budget`, and the pool's free bytes);
//! - it holds an **owner lease** with a fencing token for every sandbox it
//!   creates or adopts, renews them with its heartbeat, and writes every
//!   sandbox record through [`fenced::FencedStore`] (`commit_fenced`): a
//!   host whose lease was lost cannot write;
//! - at start it adopts only sandboxes whose lease it held last (or that
//!   no host holds and whose subvolume is in its pool);
//! - **self-fencing**: when its last successful renewal is older than
//!   `lease_ttl - fence_margin` by its own monotonic clock (a timer on a
//!   thread of its own, whatever the async runtime does), it kills every
//!   VM it owns (their egress ends with them) and forgets the
//!   leases, before any other host may take them over (which PostgreSQL
//!   allows only `takeover_margin` after expiry, by its own clock);
//! - **host loss**: every host watches for leases expired past the margin;
//!   it takes such a lease into custody and records the sandbox `failed`
//!   with the reason `host_lost: …` (never deleted). The custodian keeps
//!   renewing the lease, so the lost host, revived, cannot act on it;
//! - **moves**: the owner of a sandbox hands its lease over to another
//!   live host after sending it its snapshots ([`Cluster::hand_over`], a
//!   fenced compare-and-set; the target [`Cluster::adopt`]s it, by
//!   itself when the source's adopt call is lost: [`handover`]);
//! - **placement** ([`placement::place`]): a create on a host that is not
//!   the best fit is re-sent to the host that is (`api::forward`);
//! - **API processes** (`role = "api"`, [`Cluster::is_api`]): a `Cluster`
//!   that never registers, takes no lease and runs none of the loops
//!   above; it only places creates and finds owners to forward to
//!   (docs/cluster.md, "API processes").

pub mod config;
pub mod fenced;
pub mod handover;
pub mod placement;
pub mod replicas;
pub mod templates;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_core::{Op, SandboxId, SandboxState};
use tokio::sync::watch;
use tracing::{error, info, warn};

pub use config::{ClusterConfig, Role};
pub use fenced::{FencedStore, Held, Leases};

use crate::config::Config;
use crate::service::{Service, ServiceError, ServiceResult};
use crate::store::{
    Fence, HostError, HostInfo, HostLoad, HostRecord, HostStore, OwnerLease, PgStore,
    SandboxFilter, SandboxRecord, Store, StoreError,
};

/// Prefix of the `state_reason` of a sandbox whose host was lost.
pub const HOST_LOST: &str = "host_lost";

/// This daemon as a cluster host (see the module docs).
pub struct Cluster {
    cfg: ClusterConfig,
    info: HostInfo,
    hosts: Arc<dyn HostStore>,
    /// The store without fencing (reads of any sandbox).
    raw: Arc<dyn Store>,
    leases: Arc<Leases>,
    epoch: AtomicU64,
    /// Start of the last round in which the heartbeat and every renewal
    /// succeeded (the self-fencing timer counts from it).
    last_ok: Mutex<Instant>,
    /// The pool's mount point (free bytes for the heartbeat).
    pool: std::path::PathBuf,
    /// Set once the VMs were stopped for want of a renewal, until a round
    /// succeeds again.
    fenced: AtomicBool,
    /// The hosts as last read (each renewal round reads them once):
    /// placement reads them from here while fresh.
    view: Mutex<Option<(Instant, Arc<Vec<HostRecord>>)>>,
    /// Which templates this host recorded as held; one fetch per template.
    templates: templates::TemplateHolding,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("host", &self.info.id)
            .field("address", &self.info.address)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `(total, available)` bytes of the file system at `path`.
fn fs_bytes(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st`
    // points to writable memory of the size statvfs fills.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    let frsize = st.f_frsize;
    Some((
        st.f_blocks.saturating_mul(frsize),
        st.f_bavail.saturating_mul(frsize),
    ))
}

/// Why the cluster could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// `[cluster] enabled` without a PostgreSQL store.
    #[error("[cluster] enabled needs [store] url = postgres://…")]
    NotPostgres,
    /// Registering failed.
    #[error("registering host {host}")]
    Register {
        /// This host.
        host: String,
        /// Cause.
        #[source]
        source: HostError,
    },
}

impl Cluster {
    /// A cluster host over `pg` for `config`; returns it with the store
    /// the service must use (fenced).
    pub fn new(config: &Config, pg: Arc<PgStore>) -> (Arc<Cluster>, Arc<dyn Store>) {
        let cfg = config.cluster.clone();
        let api = cfg.role == Role::Api;
        // An API process is never registered; its id only names it in
        // `x-strata-forwarded-by` and `x-strata-host`.
        let id = cfg.host_id.clone().unwrap_or_else(|| {
            if api {
                format!("api-{}", host_name())
            } else {
                host_name()
            }
        });
        let address = cfg
            .address
            .clone()
            .unwrap_or_else(|| format!("http://{}", config.listen));
        let (vcpus, memory_mib) = config.capacity.resolve();
        let pool = config
            .pool_path
            .clone()
            .unwrap_or_else(|| config.pool_mount());
        let info = HostInfo {
            id: id.clone(),
            address,
            accel: config.accel.to_string(),
            qemu_version: if api {
                "none".into()
            } else {
                strata_runtime::qemu_version(&config.qemu_binary)
                    .unwrap_or_else(|_| "unknown".into())
            },
            cpu_model: cpu_model(),
            capacity: HostLoad {
                vcpus,
                memory_mib,
                pool_bytes: 0,
            },
        };
        let leases = Arc::new(Leases::new(&id));
        let store: Arc<dyn Store> = Arc::new(FencedStore::new(
            pg.clone(),
            leases.clone(),
            ms(cfg.lease_ttl),
            ms(cfg.takeover_margin),
        ));
        let c = Arc::new(Cluster {
            cfg,
            info,
            hosts: pg.clone(),
            raw: pg,
            leases,
            epoch: AtomicU64::new(0),
            last_ok: Mutex::new(Instant::now()),
            pool,
            fenced: AtomicBool::new(false),
            view: Mutex::new(None),
            templates: Default::default(),
        });
        (c, store)
    }

    /// This host's id.
    pub fn host_id(&self) -> &str {
        &self.info.id
    }

    /// This process is an API-only one (`[cluster] role = "api"`): it never
    /// registers, is never placed on and holds no lease; VM operations are
    /// forwarded (docs/cluster.md, "API processes").
    pub fn is_api(&self) -> bool {
        self.cfg.role == Role::Api
    }

    /// What this host registered (accelerator, QEMU version, CPU model...).
    pub fn info(&self) -> &HostInfo {
        &self.info
    }

    /// The leases this host holds.
    pub fn leases(&self) -> &Arc<Leases> {
        &self.leases
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn HostStore) -> Result<T, HostError> + Send + 'static,
    ) -> Result<T, HostError> {
        let h = self.hosts.clone();
        tokio::task::spawn_blocking(move || f(h.as_ref()))
            .await
            .map_err(|e| HostError::Store(StoreError::Task(e.to_string())))?
    }

    /// Before recovery: registers this host, then takes the leases of the
    /// sandboxes it may adopt (those it held last, and those no host holds
    /// whose subvolume is in this pool). Recovery sees only those.
    pub async fn start(&self, svc: &Arc<Service>) -> Result<(), ClusterError> {
        let mut info = self.info.clone();
        if let Some((total, _)) = fs_bytes(&self.pool) {
            info.capacity.pool_bytes = total;
        }
        let ttl = ms(self.cfg.lease_ttl);
        let t0 = Instant::now();
        let lease = self
            .blocking(move |h| h.register_host(&info, ttl))
            .await
            .map_err(|source| ClusterError::Register {
                host: self.info.id.clone(),
                source,
            })?;
        self.epoch.store(lease.epoch, Ordering::SeqCst);
        *self.last_ok.lock().unwrap_or_else(|p| p.into_inner()) = t0;
        info!(host = %self.info.id, epoch = lease.epoch, address = %self.info.address, "registered as a cluster host");
        // Its free resources at once, not only from the first renewal round:
        // a registration alone says 0 free, and placement (a create or a move
        // another host places here) would refuse this host until then.
        let free = self.free_now(svc).await;
        let (id, epoch) = (self.info.id.clone(), lease.epoch);
        if let Err(e) = self
            .blocking(move |h| h.heartbeat(&id, epoch, &free, ttl))
            .await
        {
            warn!(host = %self.info.id, error = %e, "first heartbeat after registering failed; the renewal loop sends the next");
        }
        let me = self.info.id.clone();
        let mut candidates: Vec<SandboxId> = match self.blocking(move |h| h.host_leases(&me)).await
        {
            Ok(ls) => ls.into_iter().map(|l| l.sandbox_id).collect(),
            Err(e) => {
                warn!(error = %e, "cannot list this host's leases; adopting none");
                Vec::new()
            }
        };
        if let Ok(subs) = svc.engine().subvolumes().await {
            for id in subs.sandboxes {
                let id2 = id.clone();
                if matches!(
                    self.blocking(move |h| h.sandbox_owner(&id2)).await,
                    Ok(None)
                ) {
                    candidates.push(id);
                }
            }
        }
        candidates.sort();
        candidates.dedup();
        for id in candidates {
            let rec = {
                let (raw, id) = (self.raw.clone(), id.clone());
                tokio::task::spawn_blocking(move || raw.get_sandbox(&id))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .flatten()
            };
            let (me, id2, margin) = (
                self.info.id.clone(),
                id.clone(),
                ms(self.cfg.takeover_margin),
            );
            match self
                .blocking(move |h| h.acquire_sandbox(&id2, &me, ttl, margin))
                .await
            {
                Ok(l) => match rec {
                    Some(r) if r.state != SandboxState::Deleted => {
                        self.leases.hold(id, l.token, false)
                    }
                    _ => {
                        let f = Fence {
                            host_id: self.info.id.clone(),
                            token: l.token,
                        };
                        let _ = self.blocking(move |h| h.release_sandbox(&id, &f)).await;
                    }
                },
                Err(e) => info!(sandbox = %id, error = %e, "not adopted: another host owns it"),
            }
        }
        info!(owned = self.leases.owned().len(), "leases taken at start");
        Ok(())
    }

    /// Starts the heartbeat and renewal loop, the self-fencing timer, the
    /// take-up of handed-over leases whose adopt call was lost
    /// ([`handover`]) and the host-loss watcher; they stop with `stop`.
    pub fn spawn(self: &Arc<Self>, svc: Arc<Service>, stop: watch::Receiver<bool>) {
        let (c, s, st) = (self.clone(), svc.clone(), stop.clone());
        tokio::spawn(async move { c.renew_loop(s, st).await });
        self.spawn_fence_timer(svc.clone(), stop.clone());
        let (c, s, st) = (self.clone(), svc.clone(), stop.clone());
        tokio::spawn(async move { c.take_up_loop(s, st).await });
        let c = self.clone();
        tokio::spawn(async move { c.watch_loop(svc, stop).await });
    }

    async fn free_now(&self, svc: &Service) -> HostLoad {
        let mut free = HostLoad::default();
        if let Ok(b) = svc.use_budget().await {
            free.vcpus = self.info.capacity.vcpus.saturating_sub(b.vcpus_held);
            free.memory_mib = b
                .mem_available_bytes
                .saturating_sub(b.mem_floor_bytes)
                .saturating_sub(b.mem_unmeasured_bytes)
                >> 20;
        }
        if let Some((_, avail)) = fs_bytes(&self.pool) {
            free.pool_bytes = avail;
        }
        free
    }

    /// One round: heartbeat, then renew every lease held. True when all
    /// succeeded.
    async fn renew_round(&self, svc: &Arc<Service>) -> bool {
        let free = self.free_now(svc).await;
        let (id, epoch, ttl) = (
            self.info.id.clone(),
            self.epoch.load(Ordering::SeqCst),
            ms(self.cfg.lease_ttl),
        );
        let mut ok = match self
            .blocking(move |h| h.heartbeat(&id, epoch, &free, ttl))
            .await
        {
            Ok(_) => true,
            Err(HostError::NotRegistered { .. }) => {
                // A newer process registered this id: this one must not act.
                warn!(host = %self.info.id, epoch, "a newer registration replaced this host; stopping its VMs");
                self.fence(svc, "a newer registration of this host id replaced it");
                false
            }
            Err(e) => {
                warn!(error = %e, "heartbeat failed");
                false
            }
        };
        for (sid, held) in self.leases.all() {
            let f = Fence {
                host_id: self.info.id.clone(),
                token: held.token,
            };
            let id2 = sid.clone();
            match self.blocking(move |h| h.renew_sandbox(&id2, &f, ttl)).await {
                Ok(_) => {}
                Err(HostError::Fenced { .. }) => {
                    // Expired or taken over: not this host's any more.
                    if self.leases.drop_lease(&sid).is_some_and(|h| !h.custody) {
                        warn!(sandbox = %sid, "lease lost; stopping its VM");
                        kill_vms(svc, &[sid]);
                    }
                }
                Err(e) => {
                    warn!(sandbox = %sid, error = %e, "lease renewal failed");
                    ok = false;
                }
            }
        }
        // The templates this host holds, as PostgreSQL records them (a
        // write per change).
        self.sync_held(svc).await;
        // Leases a write found lost.
        let lost = self.leases.take_lost();
        if !lost.is_empty() {
            warn!(
                count = lost.len(),
                "leases found lost by writes; stopping their VMs"
            );
            kill_vms(svc, &lost);
        }
        ok
    }

    async fn renew_loop(self: Arc<Self>, svc: Arc<Service>, mut stop: watch::Receiver<bool>) {
        let every = self.cfg.renew_every;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            let t0 = Instant::now();
            if let Ok(hs) = self.blocking(|h| h.hosts()).await {
                *self.view.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now(), Arc::new(hs)));
            }
            if self.renew_round(&svc).await {
                *self.last_ok.lock().unwrap_or_else(|p| p.into_inner()) = t0;
                if self.fenced.swap(false, Ordering::SeqCst) {
                    info!("renewals succeed again");
                }
            }
        }
    }

    /// When the self-fencing deadline of the last good round passes.
    fn fence_deadline(&self) -> Instant {
        let last = *self.last_ok.lock().unwrap_or_else(|p| p.into_inner());
        last + self.cfg.lease_ttl.saturating_sub(self.cfg.fence_margin)
    }

    /// The self-fencing timer, on a thread of its own: it must fire even
    /// when every async worker waits (a store call that hangs on a cut link
    /// holds its thread for up to `[store] timeout`), so it needs neither
    /// the runtime nor the store. It stops with `stop`.
    fn spawn_fence_timer(self: &Arc<Self>, svc: Arc<Service>, stop: watch::Receiver<bool>) {
        let tick = (self.cfg.fence_margin / 8)
            .clamp(Duration::from_millis(50), Duration::from_millis(500));
        let (c, s) = (self.clone(), svc.clone());
        let spawned = std::thread::Builder::new()
            .name("strata-fence".into())
            .spawn(move || {
                while !*stop.borrow() && stop.has_changed().is_ok() {
                    std::thread::sleep(tick);
                    if Instant::now() >= c.fence_deadline() && !c.leases.owned().is_empty() {
                        c.fence(&s, "no lease renewal within lease_ttl - fence_margin");
                    }
                }
            });
        if let Err(e) = spawned {
            // Without the timer a partitioned host would keep its VMs
            // running past its leases' expiry: refuse to hold any.
            error!(error = %e, "cannot start the self-fencing timer; fencing now");
            self.fence(&svc, "the self-fencing timer could not start");
        }
    }

    /// Self-fencing: forget every owned lease (writes are refused from
    /// here on), then kill their VMs. Synchronous and store-free, so the
    /// fencing timer's thread can run it whatever the runtime is doing.
    fn fence(&self, svc: &Arc<Service>, why: &str) {
        let ids = self.leases.drop_owned();
        self.fenced.store(true, Ordering::SeqCst);
        if ids.is_empty() {
            return;
        }
        warn!(
            count = ids.len(),
            why, "self-fencing: stopping this host's VMs"
        );
        svc.metrics().count("cluster_self_fenced");
        kill_vms(svc, &ids);
    }

    async fn watch_loop(self: Arc<Self>, svc: Arc<Service>, mut stop: watch::Receiver<bool>) {
        let mut last_sweep = Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.watch_every) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            // A host that cannot renew its own leases does not judge others.
            if self.fenced.load(Ordering::SeqCst) {
                continue;
            }
            if let Err(e) = self.watch_round(&svc).await {
                warn!(error = %e, "host-loss watch failed");
            }
            // Replicas a snapshot did not bring up to date (a failure, a
            // replica host gone, a recovered sandbox): docs/cluster.md
            // "Replicas".
            if last_sweep.elapsed() >= self.cfg.watch_every * replicas::SWEEP_EVERY_WATCHES {
                last_sweep = Instant::now();
                svc.replicate_sweep().await;
            }
        }
    }

    /// Takes the leases expired past the margin into custody and records
    /// their sandboxes lost. Returns how many it marked.
    pub async fn watch_round(&self, svc: &Arc<Service>) -> Result<usize, HostError> {
        let (me, margin, ttl) = (
            self.info.id.clone(),
            ms(self.cfg.takeover_margin),
            ms(self.cfg.lease_ttl),
        );
        let expired = self
            .blocking(move |h| h.expired_leases(&me, margin, 100))
            .await?;
        let mut marked = 0;
        for old in expired {
            // Replicas (docs/cluster.md "Replicas"): the host holding one
            // recovers the sandbox; while it is live, the others leave it.
            let replicas = match self.replicas(&old.sandbox_id).await {
                Ok(r) => r,
                Err(e) => {
                    warn!(sandbox = %old.sandbox_id, error = %e.message(), "cannot read the sandbox's replicas");
                    Vec::new()
                }
            };
            let mine = replicas.iter().find(|r| r.host_id == self.info.id).cloned();
            if mine.is_none() && self.replica_elsewhere(&replicas, &old.host_id).await {
                continue;
            }
            let (me, id) = (self.info.id.clone(), old.sandbox_id.clone());
            let lease = match self
                .blocking(move |h| h.acquire_sandbox(&id, &me, ttl, margin))
                .await
            {
                Ok(l) => l,
                // Renewed meanwhile, or another watcher was first.
                Err(HostError::Owned { .. }) => continue,
                Err(e) => return Err(e),
            };
            let id = old.sandbox_id.clone();
            self.leases.hold(id.clone(), lease.token, true);
            let rec = {
                let (raw, id) = (self.raw.clone(), id.clone());
                tokio::task::spawn_blocking(move || raw.get_sandbox(&id))
                    .await
                    .map_err(|e| HostError::Store(StoreError::Task(e.to_string())))??
            };
            let Some(mut rec) = rec.filter(|r| r.state != SandboxState::Deleted) else {
                self.leases.drop_lease(&id);
                let f = Fence {
                    host_id: self.info.id.clone(),
                    token: lease.token,
                };
                let _ = self.blocking(move |h| h.release_sandbox(&id, &f)).await;
                continue;
            };
            if is_host_lost(&rec) {
                continue;
            }
            if let Some(r) = mine {
                // Owner now (not custody): the recovery writes through the
                // fence with this token.
                self.leases.hold(id.clone(), lease.token, false);
                match svc
                    .recover_from_replica(&id, &r.snapshot_id, &old.host_id)
                    .await
                {
                    Ok(()) => {
                        marked += 1;
                        continue;
                    }
                    Err(e) => {
                        warn!(sandbox = %id, snapshot = %r.snapshot_id, error = %e.message(), "recovery from the replica failed; marking the sandbox lost");
                        self.leases.hold(id.clone(), lease.token, true);
                        let raw = self.raw.clone();
                        let id2 = id.clone();
                        match tokio::task::spawn_blocking(move || raw.get_sandbox(&id2)).await {
                            Ok(Ok(Some(r))) => rec = r,
                            _ => continue,
                        }
                    }
                }
            }
            let reason = format!(
                "{HOST_LOST}: host {} stopped renewing; its lease expired at {}",
                old.host_id, old.expires_at
            );
            warn!(sandbox = %id, host = %old.host_id, "host lost: marking its sandbox");
            if let Err(e) = svc
                .settle(
                    &mut rec,
                    Op::Fail,
                    SandboxState::Failed,
                    Some(reason),
                    Some(format!("custody: host {}", self.info.id)),
                )
                .await
            {
                warn!(sandbox = %id, error = %e.message(), "recording a lost host's sandbox failed");
                continue;
            }
            svc.metrics().count("cluster_sandbox_host_lost");
            marked += 1;
        }
        Ok(marked)
    }

    /// The hosts as the last renewal round read them, when at most two
    /// rounds old; else read now.
    pub(crate) async fn hosts_view(&self) -> ServiceResult<Arc<Vec<HostRecord>>> {
        let fresh = self.cfg.renew_every * 2;
        if let Some((at, hs)) = self.view.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            if at.elapsed() <= fresh {
                return Ok(hs.clone());
            }
        }
        let hs = Arc::new(
            self.blocking(|h| h.hosts())
                .await
                .map_err(host_to_service)?,
        );
        *self.view.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), hs.clone()));
        Ok(hs)
    }

    /// The host (id, advertised address) holding `sandbox`'s lease when it
    /// is another one than this host (an API request for it is forwarded
    /// there, docs/cluster.md "Forwarding"); `None` when this host holds
    /// it or no host does (answered here).
    pub async fn owner_elsewhere(
        &self,
        sandbox: &SandboxId,
    ) -> ServiceResult<Option<(String, String)>> {
        let id = sandbox.clone();
        let Some(lease) = self
            .blocking(move |h| h.sandbox_owner(&id))
            .await
            .map_err(host_to_service)?
        else {
            return Ok(None);
        };
        if lease.host_id == self.info.id {
            return Ok(None);
        }
        let hosts = self.hosts_view().await?;
        let find = |hs: &[HostRecord]| {
            hs.iter()
                .find(|h| h.info.id == lease.host_id)
                .map(|h| h.info.address.clone())
        };
        let mut addr = find(&hosts);
        if addr.is_none() {
            // A host registered since the view was read.
            addr = find(&self.hosts_now().await?);
        }
        Ok(addr.map(|a| (lease.host_id, a)))
    }

    /// Placement of a new sandbox (`rec`, not yet written): `Ok` when this
    /// host is the one [`placement::place`] picks; otherwise `409 conflict`
    /// naming the host to create it on, or `507 insufficient_capacity` with
    /// what no host has.
    pub async fn check_placement(&self, svc: &Service, rec: &SandboxRecord) -> ServiceResult<()> {
        if crate::api::forward::is_forwarded() && !self.is_api() {
            // Another host placed it here: this host's admission decides.
            // (An API process is never placed on: it places every create.)
            return Ok(());
        }
        let hosts = self.hosts_view().await?;
        let group = rec.labels.get(placement::ANTI_AFFINITY_LABEL).cloned();
        let mut per_host: std::collections::HashMap<String, u64> = Default::default();
        if let Some(g) = &group {
            let filter = SandboxFilter {
                tenant: rec.tenant.clone(),
                states: Vec::new(),
                labels: [(placement::ANTI_AFFINITY_LABEL.to_owned(), g.clone())]
                    .into_iter()
                    .collect(),
                limit: 1000,
                cursor: None,
            };
            let page = svc.db(move |s| s.list_sandboxes(&filter)).await?;
            for sb in page.items {
                let id = sb.id.clone();
                if let Ok(Some(l)) = self.blocking(move |h| h.sandbox_owner(&id)).await {
                    *per_host.entry(l.host_id).or_default() += 1;
                }
            }
        }
        // Template locality: the hosts PostgreSQL records as holding the
        // template (docs/cluster.md "Templates across hosts"); when that
        // read fails, only this host's own pool is known.
        let holders = match &rec.template {
            Some(t) => match self.template_holders(t).await {
                Ok(h) => h,
                Err(e) => {
                    warn!(template = %t, error = %e, "cannot read the template's holders");
                    if svc.engine().has_template(t).await.unwrap_or(false) {
                        vec![self.info.id.clone()]
                    } else {
                        Vec::new()
                    }
                }
            },
            None => Vec::new(),
        };
        let cands: Vec<placement::Candidate> = hosts
            .iter()
            .map(|h| placement::Candidate {
                id: h.info.id.clone(),
                alive: h.alive,
                free: h.free,
                has_template: holders.contains(&h.info.id),
                same_group: per_host.get(&h.info.id).copied().unwrap_or(0),
            })
            .collect();
        let req = placement::Request {
            vcpus: u64::from(rec.size.vcpus),
            memory_mib: u64::from(rec.size.memory_mib),
            pool_bytes: 0,
            anti_affinity: group.is_some(),
        };
        match placement::place(&cands, &req) {
            Ok(h) if h == self.info.id => Ok(()),
            Ok(h) => {
                let addr = hosts
                    .iter()
                    .find(|x| x.info.id == h)
                    .map(|x| x.info.address.clone())
                    .unwrap_or_default();
                crate::api::forward::placed_on(&addr);
                Err(ServiceError::Conflict(format!(
                    "placed_elsewhere: host {h} ({addr}) is where this sandbox fits best; create it there (this host, {}, could not forward it)",
                    self.info.id
                )))
            }
            Err(e) => Err(ServiceError::InsufficientCapacity(e.to_string())),
        }
    }
}

impl Cluster {
    /// The hosts as registered now (read from the store, not the cached
    /// view: a move names its target by id and must see it live now).
    pub async fn hosts_now(&self) -> ServiceResult<Vec<HostRecord>> {
        self.blocking(|h| h.hosts()).await.map_err(host_to_service)
    }

    /// The lease this host holds to run `id` (not custody), if any.
    pub fn owns(&self, id: &SandboxId) -> Option<u64> {
        self.leases.get(id).filter(|h| !h.custody).map(|h| h.token)
    }

    /// Hands `id`'s lease over to host `to` (a move, docs/move.md): the
    /// fenced compare-and-set of [`HostStore::hand_over_sandbox`] with this
    /// host's token. Once it committed, this host forgets the lease (every
    /// later write of the sandbox here is refused). Answers the new lease.
    pub async fn hand_over(&self, id: &SandboxId, to: &str) -> ServiceResult<OwnerLease> {
        let Some(token) = self.owns(id) else {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is not owned by this host ({})",
                self.info.id
            )));
        };
        let fence = Fence {
            host_id: self.info.id.clone(),
            token,
        };
        let (id2, to2, ttl) = (id.clone(), to.to_owned(), ms(self.cfg.lease_ttl));
        let lease = self
            .blocking(move |h| h.hand_over_sandbox(&id2, &fence, &to2, ttl))
            .await
            .map_err(|e| match e {
                HostError::Fenced { .. } => ServiceError::Conflict(format!(
                    "move of sandbox {id} to host {to} refused: this host's lease (token {token}) is no longer current, or host {to} is not live"
                )),
                e => host_to_service(e),
            })?;
        self.leases.drop_lease(id);
        info!(sandbox = %id, to, token = lease.token, "lease handed over");
        Ok(lease)
    }

    /// Takes up the lease of `id` that another host handed over to this
    /// one (a move): the lease in the store must name this host (which is
    /// not fenced itself), and is renewed with the handed-over token (the
    /// renewal's compare-and-set refuses it once it expired); that token is
    /// then the one this host writes with.
    pub async fn adopt(&self, id: &SandboxId) -> ServiceResult<OwnerLease> {
        let id2 = id.clone();
        let lease = self
            .blocking(move |h| h.sandbox_owner(&id2))
            .await
            .map_err(host_to_service)?;
        match lease {
            Some(l) if l.host_id == self.info.id && !self.fenced.load(Ordering::SeqCst) => {
                let f = Fence {
                    host_id: self.info.id.clone(),
                    token: l.token,
                };
                let (id2, ttl) = (id.clone(), ms(self.cfg.lease_ttl));
                let l = self
                    .blocking(move |h| h.renew_sandbox(&id2, &f, ttl))
                    .await
                    .map_err(|e| match e {
                        HostError::Fenced { .. } => ServiceError::Conflict(format!(
                            "sandbox {id}: the lease handed over to this host ({}, token {}) expired before it was taken up",
                            self.info.id, l.token
                        )),
                        e => host_to_service(e),
                    })?;
                self.leases.hold(id.clone(), l.token, false);
                info!(sandbox = %id, token = l.token, "lease taken up after a move");
                Ok(l)
            }
            Some(l) => Err(ServiceError::Conflict(format!(
                "sandbox {id} was not handed over to this host ({}): its lease is host {}'s",
                self.info.id, l.host_id
            ))),
            None => Err(ServiceError::Conflict(format!(
                "sandbox {id} was not handed over to this host ({}): no host holds its lease",
                self.info.id
            ))),
        }
    }

    /// Whether sandbox `id` is owned by a host other than this one (a
    /// move may send its snapshots here).
    pub async fn owned_elsewhere(&self, id: &SandboxId) -> ServiceResult<bool> {
        let id2 = id.clone();
        let lease = self
            .blocking(move |h| h.sandbox_owner(&id2))
            .await
            .map_err(host_to_service)?;
        Ok(lease.is_some_and(|l| l.host_id != self.info.id))
    }
}

/// The sandbox was recorded lost with its host.
pub fn is_host_lost(rec: &SandboxRecord) -> bool {
    rec.state == SandboxState::Failed
        && rec
            .state_reason
            .as_deref()
            .is_some_and(|r| r.starts_with(HOST_LOST))
}

fn host_to_service(e: HostError) -> ServiceError {
    match e {
        HostError::Store(e) => ServiceError::Store(e),
        e => ServiceError::Conflict(e.to_string()),
    }
}

/// Kills (`SIGKILL`) the QEMU of each of `ids` that runs on this host,
/// without touching their records or subvolumes (they are no longer this
/// host's to write).
/// Synchronous: the engines answer `live_vms` from memory and `/proc`
/// without awaiting anything, so polling it once completes it.
fn kill_vms(svc: &Arc<Service>, ids: &[SandboxId]) {
    let live = match futures::executor::block_on(svc.engine().live_vms()) {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e.message(), "cannot list VMs to stop them");
            return;
        }
    };
    for vm in live.iter().filter(|v| ids.contains(&v.id)) {
        let Ok(pid) = libc::pid_t::try_from(vm.pid) else {
            continue;
        };
        // SAFETY: kill(2) with a pid the runtime reports for this sandbox's
        // QEMU; no memory is shared with the call.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        if rc == 0 {
            warn!(sandbox = %vm.id, pid, "VM killed (self-fencing)");
        }
    }
}

#[cfg(test)]
mod tests;
