//! Warm pools: sandboxes of a template restored ahead of the creates that
//! will want them (`[pools]`, docs/warm-pools.md).
//!
//! A pool is kept per (template, size): the default template at its size
//! (`default_template` guests) and each `[[pools.templates]]` entry. A warm
//! guest is started by the engine as a create would start it
//! ([`Engine::prewarm`]: a new id and identity), then paused: it holds
//! memory, no CPU. It has no record: no tenant sees it, no quota counts
//! it; its room is a [`Transient`] reservation, so admission counts it,
//! and ends it first when someone's create, fork or wake needs the room
//! ([`Service::evict_one_warm`]).
//!
//! A create of that template at that size ([`Service::create_from_warm`])
//! takes the oldest guest, checks the tenant's quotas, writes the record
//! (pending, under the guest's id) and only then claims it
//! ([`Engine::claim`]): the vCPUs continue, egress is bound to the policy
//! of the record's owner, the guest gets fresh entropy and the clock. A
//! claim that fails deletes the guest and the create goes the usual way,
//! so a pool never makes a create fail or wait for it.
//!
//! The filler ([`Service::spawn_warm_filler`]) tops the pools up one guest
//! at a time, only while no create or fork is in flight nor ended in the
//! last second (they, and the new sandbox's first commands, come first on
//! a small host), into room that is free, at a low CPU weight until
//! claimed. A guest's room is reserved when it is up, not while it starts
//! (a starting guest cannot be ended for a create): if creates took the
//! room meanwhile, the new guest is ended at once. Pools of templates no longer wanted (deleted, replaced by a
//! newer build of the same name, no longer configured) are emptied. A
//! start that fails backs off (1 s doubling to 5 min) for that pool.
//!
//! What it does not do: warm guests are not kept across a daemon restart
//! (the daemon ends them when it stops; after a crash, recovery ends them
//! as VMs no record owns), and a create asking another size than the
//! template's never comes from a pool.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::admission::Transient;
use super::prelude::*;
use crate::engine::VmInfo;

/// The longest a pool waits after a start failed before it tries again.
const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// How often the filler looks at the pools without being woken.
const FILL_TICK: Duration = Duration::from_secs(2);
/// How long the filler waits for creates in flight before it looks again.
const YIELD: Duration = Duration::from_millis(100);
/// How long after a create the filler starts nothing: the new sandbox's
/// first commands come right after it and go first.
const AFTER_CREATE: Duration = Duration::from_secs(1);

/// A pool: a template at a size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct WarmKey {
    pub template: TemplateId,
    pub size: SandboxSize,
}

impl std::fmt::Display for WarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{}x{}",
            self.template, self.size.vcpus, self.size.memory_mib
        )
    }
}

/// A warm guest: started, paused, no owner.
#[derive(Debug)]
pub(crate) struct Warm {
    id: SandboxId,
    vm: VmInfo,
    /// Its room; released when the guest is claimed (its record counts
    /// then) or ended.
    room: Transient,
}

/// What a pool should hold.
#[derive(Debug, Clone)]
struct Target {
    key: WarmKey,
    count: usize,
}

#[derive(Debug, Default)]
struct Pools {
    ready: HashMap<WarmKey, VecDeque<Warm>>,
    /// A start failed: not before this instant again, and the next wait.
    backoff: HashMap<WarmKey, (Instant, Duration)>,
}

impl Pools {
    /// The oldest guest of pool `key` (an emptied pool is dropped).
    fn pop(&mut self, key: &WarmKey) -> Option<Warm> {
        let q = self.ready.get_mut(key)?;
        let w = q.pop_front();
        if q.is_empty() {
            self.ready.remove(key);
        }
        w
    }
}

/// The warm pools of one daemon.
#[derive(Debug, Default)]
pub(crate) struct WarmPools {
    pools: Mutex<Pools>,
    pub(super) wake: tokio::sync::Notify,
    /// Creates and forks in flight: the filler waits for them.
    busy: AtomicUsize,
    /// When the last of them ended.
    last_busy: Mutex<Option<Instant>>,
}

/// Counts a create or fork in flight while held ([`WarmPools::busy`]).
pub(crate) struct Busy<'a>(&'a WarmPools);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        *self.0.last_busy.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
        self.0.wake.notify_one();
    }
}

/// One pool as `/v1/stats` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct WarmPoolStats {
    /// Template id.
    pub template: TemplateId,
    /// vCPUs of its guests.
    pub vcpus: u32,
    /// Memory of its guests, MiB.
    pub memory_mib: u32,
    /// Guests ready to be claimed.
    pub ready: usize,
}

impl WarmPools {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pools> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a create or fork is in flight or ended less than
    /// [`AFTER_CREATE`] ago.
    fn yielding(&self) -> bool {
        self.busy.load(Ordering::SeqCst) > 0
            || self
                .last_busy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|t| t.elapsed() < AFTER_CREATE)
    }

    /// Marks a create or fork in flight until the guard is dropped.
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self)
    }

    fn take(&self, key: &WarmKey) -> Option<Warm> {
        self.lock().pop(key)
    }

    fn put_back(&self, key: WarmKey, w: Warm) {
        self.lock().ready.entry(key).or_default().push_front(w);
    }

    fn total(&self) -> usize {
        self.lock().ready.values().map(VecDeque::len).sum()
    }

    fn len(&self, key: &WarmKey) -> usize {
        self.lock().ready.get(key).map_or(0, VecDeque::len)
    }

    /// Removes the guest `id` if it is a warm one (its VM died).
    fn forget(&self, id: &SandboxId) -> Option<Warm> {
        let mut g = self.lock();
        for q in g.ready.values_mut() {
            if let Some(i) = q.iter().position(|w| &w.id == id) {
                return q.remove(i);
            }
        }
        None
    }

    /// What every pool holds now.
    pub(crate) fn stats(&self) -> Vec<WarmPoolStats> {
        let g = self.lock();
        let mut v: Vec<WarmPoolStats> = g
            .ready
            .iter()
            .map(|(k, q)| WarmPoolStats {
                template: k.template.clone(),
                vcpus: k.size.vcpus,
                memory_mib: k.size.memory_mib,
                ready: q.len(),
            })
            .collect();
        v.sort_by(|a, b| a.template.as_str().cmp(b.template.as_str()));
        v
    }
}

impl Service {
    /// Creates `rec` (new, of template `tpl` at the template's size) from a
    /// warm guest of that pool: `None` when there is none or claiming it
    /// failed (the create then goes the usual way; `rec` is untouched).
    /// Errors are the create's own (quota, the store).
    pub(super) async fn create_from_warm(
        &self,
        tpl: &TemplateRecord,
        rec: &SandboxRecord,
    ) -> ServiceResult<Option<SandboxRecord>> {
        if rec.size != tpl.size {
            return Ok(None);
        }
        let key = WarmKey {
            template: tpl.id.clone(),
            size: rec.size,
        };
        let Some(w) = self.warm.take(&key) else {
            self.metrics.count("warm_pool_miss");
            return Ok(None);
        };
        self.warm.wake.notify_one();
        let mut rec = rec.clone();
        rec.id = w.id.clone();
        let span = tracing::info_span!("create", sandbox = %rec.id, warm = true);
        async move {
            let started = Instant::now();
            {
                let _g = self.placement.lock().await;
                if let Err(e) = self.check_quota(&rec, true).await {
                    self.warm.put_back(key, w);
                    return Err(e);
                }
                if let Err(e) = self
                    .begin_create(&mut rec, None, Some("from the warm pool".into()))
                    .await
                {
                    self.end_warm(w);
                    return Err(e);
                }
                // The record counts from here: the guest's reservation goes.
                drop(w.room);
            }
            match self.engine.claim(&rec.id).await {
                Ok(()) => {
                    self.metrics.observe_step(step::CLAIM, started.elapsed());
                    self.done(
                        &mut rec,
                        Op::Created,
                        SandboxState::Running,
                        Some(VmNow::of(&w.vm)),
                        &[],
                        Some("claimed from the warm pool".into()),
                    )
                    .await?;
                    self.metrics.count("warm_pool_claim");
                    info!(
                        pid = w.vm.pid,
                        claim_ms = started.elapsed().as_millis() as u64,
                        "sandbox running (warm)"
                    );
                    Ok(Some(rec))
                }
                Err(e) => {
                    let why = e.message();
                    warn!(error = %why, "claiming a warm guest failed; creating one instead");
                    self.metrics.count("warm_pool_claim_failed");
                    let _ = self.engine.delete(&rec.id).await;
                    self.abandon_create(rec, None, format!("claim failed: {why}"), &why)
                        .await;
                    Ok(None)
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Ends one warm guest, the oldest of the fullest pool, if there is one
    /// (its room is free at once; the VM ends in the background).
    pub(super) fn evict_one_warm(&self) -> bool {
        let w = {
            let mut g = self.warm.lock();
            let Some(key) = g
                .ready
                .iter()
                .max_by_key(|(_, q)| q.len())
                .map(|(k, _)| k.clone())
            else {
                return false;
            };
            g.pop(&key)
        };
        match w {
            Some(w) => {
                info!(sandbox = %w.id, "ending a warm guest: the room is wanted");
                self.metrics.count("warm_pool_evicted");
                self.end_warm(w);
                true
            }
            None => false,
        }
    }

    /// Ends a warm guest in the background; its room is free at once.
    fn end_warm(&self, w: Warm) {
        let Warm { id, room, .. } = w;
        drop(room);
        let engine = self.engine.clone();
        tokio::spawn(async move { delete_warm(engine.as_ref(), &id).await });
    }

    /// A VM that died: `true` if it was a warm guest (forgotten; nothing
    /// else to do).
    pub(super) fn warm_died(&self, id: &SandboxId) -> bool {
        match self.warm.forget(id) {
            Some(w) => {
                warn!(sandbox = %id, "a warm guest died");
                self.end_warm(w);
                true
            }
            None => false,
        }
    }

    /// What the pools hold now.
    pub fn warm_pool_stats(&self) -> Vec<WarmPoolStats> {
        self.warm.stats()
    }

    /// Ends every warm guest (the daemon stops: they would be orphans).
    pub async fn drain_warm(&self) {
        let all: Vec<Warm> = {
            let mut g = self.warm.lock();
            g.ready.drain().flat_map(|(_, q)| q).collect()
        };
        for Warm { id, room, .. } in all {
            drop(room);
            delete_warm(self.engine.as_ref(), &id).await;
        }
    }

    /// The pools `[pools]` asks for now, by the templates that exist.
    async fn warm_targets(self: &Arc<Self>) -> Vec<Target> {
        let cfg = &self.config.pools;
        let mut out: Vec<Target> = Vec::new();
        let Ok(platform) = self.db(|s| s.list_templates(PLATFORM_SCOPE)).await else {
            return out;
        };
        let ready = |t: &&TemplateRecord| t.status == TemplateStatus::Ready;
        if cfg.default_template > 0 {
            if let Some(t) = platform.iter().rev().find(ready) {
                out.push(Target {
                    key: WarmKey {
                        template: t.id.clone(),
                        size: t.size,
                    },
                    count: cfg.default_template,
                });
            }
        }
        for p in &cfg.templates {
            let by_name = platform
                .iter()
                .rev()
                .filter(ready)
                .find(|t| t.name.as_deref() == Some(p.template.as_str()))
                .cloned();
            let found = match by_name {
                Some(t) => Some(t),
                None => match p.template.parse::<TemplateId>() {
                    Ok(id) => self
                        .template_record(&id)
                        .await
                        .ok()
                        .filter(|t| t.status == TemplateStatus::Ready),
                    Err(_) => None,
                },
            };
            let Some(mut t) = found else { continue };
            let size = SandboxSize {
                vcpus: p.vcpus.unwrap_or(t.size.vcpus),
                memory_mib: p.memory_mib.unwrap_or(t.size.memory_mib),
                disk_gib: t.size.disk_gib,
            };
            if super::variants::needs_variant(t.size, size) {
                // A pool of the template's size variant, once it is built:
                // asked for, it starts its build; one that failed is not
                // retried for a pool (a create of that size retries it).
                match self.variant_record(&t, size).await {
                    Ok(Some(v)) if v.status == TemplateStatus::Ready => t = v,
                    Ok(Some(_)) => continue,
                    Ok(None) => {
                        if let Err(e) = self.variant(&t, size).await {
                            warn!(template = %t.id, error = %e.message(), "no size variant for a warm pool");
                        }
                        continue;
                    }
                    Err(_) => continue,
                }
            }
            let key = WarmKey {
                template: t.id.clone(),
                size: t.size,
            };
            match out.iter_mut().find(|x| x.key == key) {
                Some(x) => x.count = x.count.max(p.count),
                None => out.push(Target {
                    key,
                    count: p.count,
                }),
            }
        }
        out
    }

    /// Starts the filler: tops the pools up until `stop` is set, then ends
    /// every warm guest. Not started when `[pools]` asks for none.
    pub fn spawn_warm_filler(
        self: &Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let cfg = &self.config.pools;
        if cfg.max_total == 0 || (cfg.default_template == 0 && cfg.templates.is_empty()) {
            return None;
        }
        let this = self.clone();
        Some(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = this.warm.wake.notified() => {}
                    _ = tokio::time::sleep(FILL_TICK) => {}
                    r = stop.changed() => if r.is_err() { break },
                }
                if *stop.borrow() {
                    break;
                }
                this.fill_once(&stop).await;
            }
            this.drain_warm().await;
        }))
    }

    /// One pass of the filler: empties unwanted pools, starts guests while
    /// some pool is short, no create is in flight and the room is free.
    async fn fill_once(self: &Arc<Self>, stop: &tokio::sync::watch::Receiver<bool>) {
        let targets = self.warm_targets().await;
        // Pools nobody wants any more.
        let unwanted: Vec<Warm> = {
            let mut g = self.warm.lock();
            let keys: Vec<WarmKey> = g
                .ready
                .keys()
                .filter(|k| !targets.iter().any(|t| &t.key == *k))
                .cloned()
                .collect();
            for k in &keys {
                self.metrics.set_warm(&k.to_string(), 0);
            }
            keys.iter()
                .filter_map(|k| g.ready.remove(k))
                .flatten()
                .collect()
        };
        for w in unwanted {
            info!(sandbox = %w.id, "ending a warm guest of a pool no longer wanted");
            self.end_warm(w);
        }
        let max_total = self.config.pools.max_total;
        for t in &targets {
            loop {
                if *stop.borrow()
                    || self.warm.total() >= max_total
                    || self.warm.len(&t.key) >= t.count
                {
                    break;
                }
                let waiting = self
                    .warm
                    .lock()
                    .backoff
                    .get(&t.key)
                    .is_some_and(|(until, _)| Instant::now() < *until);
                if waiting {
                    break;
                }
                if self.under_pressure() {
                    // The host is short: pressure empties pools, never fills them.
                    break;
                }
                if self.warm.yielding() {
                    // Creates first (and the new sandboxes' first
                    // commands): look again when they are done.
                    tokio::time::sleep(YIELD).await;
                    continue;
                }
                // Free room now; it is reserved only once the guest is up:
                // a create arriving meanwhile is not refused for a guest
                // that is still starting (and cannot be ended yet).
                if self.has_room(t.key.size).await.is_err() {
                    break; // no free room: nothing is ended for a pool
                }
                let id = SandboxId::generate();
                let started = Instant::now();
                let source = Source::Template(t.key.template.clone());
                match self.engine.prewarm(&id, &source, t.key.size).await {
                    Ok(vm) => {
                        let Ok(room) = self.admit_warm(t.key.size).await else {
                            // Creates took the room meanwhile: they come first.
                            self.metrics.count("warm_pool_fill_discarded");
                            let _ = self.engine.delete(&id).await;
                            break;
                        };
                        self.metrics.observe_step(step::PREWARM, started.elapsed());
                        self.metrics.count("warm_pool_filled");
                        tracing::debug!(sandbox = %id, pool = %t.key, ms = started.elapsed().as_millis() as u64, "warm guest ready");
                        let mut g = self.warm.lock();
                        g.backoff.remove(&t.key);
                        g.ready
                            .entry(t.key.clone())
                            .or_default()
                            .push_back(Warm { id, vm, room });
                    }
                    Err(e) => {
                        self.metrics.count("warm_pool_fill_failed");
                        let mut g = self.warm.lock();
                        let next = g
                            .backoff
                            .get(&t.key)
                            .map_or(Duration::from_secs(1), |(_, d)| (*d * 2).min(MAX_BACKOFF));
                        warn!(pool = %t.key, error = %e.message(), retry_in_s = next.as_secs(), "starting a warm guest failed");
                        g.backoff
                            .insert(t.key.clone(), (Instant::now() + next, next));
                        break;
                    }
                }
            }
        }
        self.publish_warm_gauges(&targets);
    }

    fn publish_warm_gauges(&self, targets: &[Target]) {
        for t in targets {
            self.metrics
                .set_warm(&t.key.to_string(), self.warm.len(&t.key));
        }
    }
}

/// Ends warm guest `id` (its VM and subvolume); a failure is logged.
async fn delete_warm(engine: &dyn Engine, id: &SandboxId) {
    if let Err(e) = engine.delete(id).await {
        warn!(sandbox = %id, error = %e.message(), "ending a warm guest failed");
    }
}
