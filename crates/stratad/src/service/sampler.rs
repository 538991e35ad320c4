//! The per-sandbox usage sampler: the daemon's one reader of what each
//! sandbox uses. Every `[metrics] interval` it asks the engine for the
//! counters of every live VM ([`Engine::usage`]: CPU time from the VM's
//! cgroup or `/proc`, resident guest RAM, the root disk's allocation) and
//! folds them into one bounded series per sandbox: CPU as a percentage of
//! the sandbox's vCPUs over the last interval, memory and disk as levels.
//!
//! Bounds (nothing a guest does grows them): at most
//! [`MetricsConfig::max_sandboxes`] series (the least recently sampled is
//! dropped for a new one), each of at most `window / interval` points and
//! never more than [`MAX_POINTS`]; points older than the window go at every
//! round. A series is dropped when its sandbox is deleted (`delete_locked`
//! forgets it; as a fallback, a series whose VM is gone is looked up in the
//! store once and dropped if its sandbox is); a hibernated sandbox keeps its
//! history until it ages out of the window.
//!
//! Readers: `GET /v1/sandboxes/{id}/metrics` ([`Service::sandbox_metrics`],
//! tenancy through the caller like every lookup), the E2B door's metrics
//! routes, `strata stats <id>`; and [`Sampler::peak_cpu_pct`] for
//! admission by use (issue 19), which extends this module rather than
//! sampling again.

use std::collections::VecDeque;

use tokio::sync::watch;

use super::prelude::*;
use crate::config::MetricsConfig;
use crate::engine::VmUsage;
use crate::host::{HostReader, HostSample, PoolSpace};

/// Most points one series holds, whatever the configuration says.
pub const MAX_POINTS: usize = 4096;

/// Step name of one sampling round in the daemon's latency figures
/// (`/v1/stats` `steps`, `/metrics`): the sampler's own cost.
pub const SAMPLE_STEP: &str = "metrics_sample";

/// What one sandbox used over one interval, at its end.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// When it was taken.
    pub at: DateTime<Utc>,
    /// CPU used over the interval before `at`, in percent of all the
    /// sandbox's vCPUs (100 = every vCPU busy; QEMU's own threads count).
    pub cpu_pct: f64,
    /// vCPUs of the sandbox.
    pub cpu_count: u32,
    /// Guest RAM resident on the host (pages the guest has touched), bytes.
    pub mem_used_bytes: u64,
    /// Guest RAM size, bytes.
    pub mem_total_bytes: u64,
    /// QEMU's whole resident set (guest RAM plus its own), bytes.
    pub host_rss_bytes: u64,
    /// Bytes allocated to the sandbox's root disk in the pool.
    pub disk_used_bytes: u64,
    /// Size of the root disk, bytes.
    pub disk_total_bytes: u64,
    /// Whether the vCPUs ran at `at` (false: paused).
    pub running: bool,
}

/// The previous counters of a series (CPU is a rate between two rounds).
#[derive(Debug, Clone, Copy)]
struct Prev {
    pid: u32,
    cpu_usec: u64,
    at: Instant,
}

#[derive(Debug, Default)]
struct Series {
    points: VecDeque<Sample>,
    prev: Option<Prev>,
    /// When it was last seen live (for eviction at the cap).
    seen: Option<DateTime<Utc>>,
    /// Not live, looked up and still a sandbox: kept until it ages out.
    kept: bool,
}

/// What [`Sampler::record`] found in one round.
#[derive(Debug, Default)]
pub struct Recorded {
    /// Sandboxes with a series but no live VM that have not been looked up
    /// yet: the caller drops the deleted ones ([`Sampler::forget`]) and
    /// keeps the others ([`Sampler::keep`]).
    pub unseen: Vec<SandboxId>,
    /// CPU the VMs used since the previous round (a new process: since it
    /// started), microseconds.
    pub vm_cpu_usec: u64,
}

/// The host over one sampler round: [`HostSample`] plus what the
/// sandboxes' VMs used of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostPoint {
    /// The host's figures.
    #[serde(flatten)]
    pub host: HostSample,
    /// CPU the sampled VMs used over the round, in cores.
    pub vm_cores: f64,
    /// VMs sampled.
    pub vms: u32,
}

impl HostPoint {
    /// CPU used by everything but the VMs (the daemon, other programs), in cores.
    pub fn other_cores(&self) -> f64 {
        (self.host.cpu_busy_cores - self.vm_cores).max(0.0)
    }
}

/// What one sandbox used over a window (`strata info`, `/metrics`,
/// admission by use).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct UsageSummary {
    /// Samples in the window.
    pub samples: usize,
    /// Mean CPU, percent of the sandbox's vCPUs.
    pub cpu_pct_avg: f64,
    /// Highest CPU, percent of the sandbox's vCPUs.
    pub cpu_pct_peak: f64,
    /// Highest CPU in cores.
    pub cpu_cores_peak: f64,
    /// Highest guest RAM resident on the host, bytes.
    pub mem_used_peak_bytes: u64,
    /// Highest QEMU resident set, bytes.
    pub host_rss_peak_bytes: u64,
    /// Latest root-disk allocation, bytes.
    pub disk_used_bytes: u64,
}

#[derive(Debug, Default)]
struct HostSeries {
    reader: HostReader,
    points: VecDeque<HostPoint>,
    /// The storage pool's space at the last round.
    pool: Option<PoolSpace>,
}

/// The series of every sampled sandbox. See the module documentation.
#[derive(Debug)]
pub struct Sampler {
    series: Mutex<HashMap<SandboxId, Series>>,
    host: Mutex<HostSeries>,
    interval: Duration,
    window: Duration,
    points: usize,
    max_sandboxes: usize,
}

impl Sampler {
    /// An empty sampler for `cfg`.
    pub fn new(cfg: &MetricsConfig) -> Self {
        let per = cfg.interval.as_millis().max(1);
        let points = (cfg.window.as_millis() / per).clamp(1, MAX_POINTS as u128) as usize;
        Sampler {
            series: Mutex::new(HashMap::new()),
            host: Mutex::new(HostSeries::default()),
            interval: cfg.interval,
            window: cfg.window,
            points,
            max_sandboxes: cfg.max_sandboxes.max(1),
        }
    }

    /// Time between two rounds.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// How far back a series reaches.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Most points a series holds.
    pub fn capacity(&self) -> usize {
        self.points
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Series>> {
        self.series.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Folds one round of counters, read at `at` (wall clock, for the
    /// series) and `mono` (for the CPU rate), into the series. The first
    /// round of a VM process only sets its CPU baseline (no rate for its
    /// series), yet what it used since it started counts in the round's
    /// [`Recorded::vm_cpu_usec`]: a VM's boot or restore is the VMs' load,
    /// not the host's other load.
    pub fn record(&self, at: DateTime<Utc>, mono: Instant, usages: &[VmUsage]) -> Recorded {
        let mut vm_cpu_usec = 0u64;
        let mut all = self.lock();
        let oldest =
            at - chrono::TimeDelta::from_std(self.window).unwrap_or(chrono::TimeDelta::MAX);
        for u in usages {
            if !all.contains_key(&u.id) && all.len() >= self.max_sandboxes {
                // At the cap: the series seen longest ago makes room.
                let victim = all
                    .iter()
                    .min_by_key(|(_, s)| s.seen)
                    .map(|(k, _)| k.clone());
                if let Some(v) = victim {
                    all.remove(&v);
                }
            }
            let s = all.entry(u.id.clone()).or_default();
            s.seen = Some(at);
            s.kept = false;
            vm_cpu_usec = vm_cpu_usec.saturating_add(match s.prev {
                Some(p) if p.pid == u.pid => u.cpu_usec.saturating_sub(p.cpu_usec),
                // A process new since the last round: all it used.
                _ => u.cpu_usec,
            });
            let rate = match s.prev {
                Some(p) if p.pid == u.pid && u.cpu_usec >= p.cpu_usec => {
                    let dt = mono.saturating_duration_since(p.at).as_micros() as f64;
                    (dt > 0.0).then(|| {
                        let used = (u.cpu_usec - p.cpu_usec) as f64;
                        (used * 100.0 / (dt * f64::from(u.vcpus.max(1)))).clamp(0.0, 100.0)
                    })
                }
                _ => None,
            };
            s.prev = Some(Prev {
                pid: u.pid,
                cpu_usec: u.cpu_usec,
                at: mono,
            });
            if let Some(cpu_pct) = rate {
                if s.points.len() >= self.points {
                    s.points.pop_front();
                }
                s.points.push_back(Sample {
                    at,
                    cpu_pct: (cpu_pct * 100.0).round() / 100.0,
                    cpu_count: u.vcpus,
                    mem_used_bytes: u.mem_used_bytes,
                    mem_total_bytes: u.mem_total_bytes,
                    host_rss_bytes: u.host_rss_bytes,
                    disk_used_bytes: u.disk_used_bytes,
                    disk_total_bytes: u.disk_total_bytes,
                    running: u.running,
                });
            }
        }
        let live: std::collections::HashSet<&SandboxId> = usages.iter().map(|u| &u.id).collect();
        let mut unseen = Vec::new();
        all.retain(|id, s| {
            while s.points.front().is_some_and(|p| p.at < oldest) {
                s.points.pop_front();
            }
            if live.contains(id) {
                return true;
            }
            // Not live: its counters restart with its next VM.
            s.prev = None;
            if s.kept {
                // Kept while something of its window is left.
                return !s.points.is_empty() && s.seen.is_some_and(|t| t >= oldest);
            }
            unseen.push(id.clone());
            true
        });
        Recorded {
            unseen,
            vm_cpu_usec,
        }
    }

    /// Drops a sandbox's series (it was deleted).
    pub fn forget(&self, id: &SandboxId) {
        self.lock().remove(id);
    }

    /// Keeps the series of a sandbox without a live VM (hibernated, failed)
    /// until it ages out of the window, without looking it up again.
    pub fn keep(&self, id: &SandboxId) {
        if let Some(s) = self.lock().get_mut(id) {
            s.kept = true;
        }
    }

    /// The points of `id` taken in `[start, end]` (either bound open), oldest first.
    pub fn series(
        &self,
        id: &SandboxId,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> Vec<Sample> {
        self.lock()
            .get(id)
            .map(|s| {
                s.points
                    .iter()
                    .filter(|p| start.is_none_or(|t| p.at >= t) && end.is_none_or(|t| p.at <= t))
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The newest point of `id`.
    pub fn latest(&self, id: &SandboxId) -> Option<Sample> {
        self.lock().get(id).and_then(|s| s.points.back().copied())
    }

    /// The highest CPU percentage of `id` in points taken at or after `since`.
    pub fn peak_cpu_pct(&self, id: &SandboxId, since: DateTime<Utc>) -> Option<f64> {
        self.lock().get(id).and_then(|s| {
            s.points
                .iter()
                .filter(|p| p.at >= since)
                .map(|p| p.cpu_pct)
                .reduce(f64::max)
        })
    }

    /// A summary of `id`'s points taken at or after `since` (`None`: none).
    pub fn summary(&self, id: &SandboxId, since: DateTime<Utc>) -> Option<UsageSummary> {
        let all = self.lock();
        let s = all.get(id)?;
        summarize(s.points.iter().filter(|p| p.at >= since))
    }

    /// The highest CPU, in cores, that `ids` used together in one round at
    /// or after `since` (every VM of a round is sampled at the same
    /// instant), and how many of them have a point there. Their peaks
    /// rarely coincide: this is what they took, where the sum of their own
    /// peaks is what they could take at worst.
    pub fn peak_of_sum<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a SandboxId>,
        since: DateTime<Utc>,
    ) -> (f64, usize) {
        let all = self.lock();
        let mut rounds: std::collections::BTreeMap<DateTime<Utc>, f64> = Default::default();
        let mut measured = 0;
        for id in ids {
            let Some(s) = all.get(id) else { continue };
            let mut any = false;
            for p in s.points.iter().filter(|p| p.at >= since) {
                *rounds.entry(p.at).or_default() +=
                    p.cpu_pct / 100.0 * f64::from(p.cpu_count.max(1));
                any = true;
            }
            measured += usize::from(any);
        }
        (rounds.values().copied().fold(0.0, f64::max), measured)
    }

    /// Summaries over points at or after `since` of every sandbox that has
    /// some (bounded by `[metrics] max_sandboxes`).
    pub fn summaries(&self, since: DateTime<Utc>) -> Vec<(SandboxId, UsageSummary)> {
        let all = self.lock();
        let mut out: Vec<(SandboxId, UsageSummary)> = all
            .iter()
            .filter_map(|(id, s)| {
                summarize(s.points.iter().filter(|p| p.at >= since)).map(|u| (id.clone(), u))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Reads the host and keeps the point, with what the VMs used
    /// (`vm_cpu_usec`, [`Recorded`]) and `vms` of the round just recorded.
    /// The first call only sets the baseline.
    pub fn record_host(&self, at: DateTime<Utc>, vm_cpu_usec: u64, vms: u32) -> Option<HostPoint> {
        let mut h = self.host.lock().unwrap_or_else(|p| p.into_inner());
        let (sample, dt) = h.reader.sample_over(at)?;
        let dt = dt.as_micros() as f64;
        let vm_cores = if dt > 0.0 {
            (vm_cpu_usec as f64 / dt).min(sample.cpu_busy_cores)
        } else {
            0.0
        };
        let point = HostPoint {
            host: sample,
            vm_cores,
            vms,
        };
        let oldest =
            at - chrono::TimeDelta::from_std(self.window).unwrap_or(chrono::TimeDelta::MAX);
        while h.points.front().is_some_and(|p| p.host.at < oldest) || h.points.len() >= self.points
        {
            h.points.pop_front();
        }
        h.points.push_back(point);
        Some(point)
    }

    /// The host's points taken at or after `since`, oldest first.
    pub fn host_series(&self, since: DateTime<Utc>) -> Vec<HostPoint> {
        let h = self.host.lock().unwrap_or_else(|p| p.into_inner());
        h.points
            .iter()
            .filter(|p| p.host.at >= since)
            .copied()
            .collect()
    }

    /// The host's newest point.
    pub fn host_latest(&self) -> Option<HostPoint> {
        let h = self.host.lock().unwrap_or_else(|p| p.into_inner());
        h.points.back().copied()
    }

    /// Keeps the storage pool's space read this round (`None`: unknown,
    /// and nothing older is shown in its place).
    pub fn record_pool(&self, pool: Option<PoolSpace>) {
        self.host.lock().unwrap_or_else(|p| p.into_inner()).pool = pool;
    }

    /// The storage pool's space at the last round.
    pub fn pool_latest(&self) -> Option<PoolSpace> {
        self.host.lock().unwrap_or_else(|p| p.into_inner()).pool
    }

    /// Series held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no series is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Points held over all series.
    pub fn total_points(&self) -> usize {
        self.lock().values().map(|s| s.points.len()).sum()
    }
}

/// The rows of `strata_host_pool_bytes`: one per `kind`.
fn pool_rows(p: &PoolSpace) -> Vec<(String, f64)> {
    [
        ("size", p.size_bytes),
        ("used", p.used_bytes),
        ("available", p.available_bytes),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{{kind=\"{k}\"}}"), v as f64))
    .collect()
}

fn summarize<'a>(points: impl Iterator<Item = &'a Sample>) -> Option<UsageSummary> {
    let mut n = 0usize;
    let mut sum = 0.0;
    let mut out = UsageSummary {
        samples: 0,
        cpu_pct_avg: 0.0,
        cpu_pct_peak: 0.0,
        cpu_cores_peak: 0.0,
        mem_used_peak_bytes: 0,
        host_rss_peak_bytes: 0,
        disk_used_bytes: 0,
    };
    for p in points {
        n += 1;
        sum += p.cpu_pct;
        out.cpu_pct_peak = out.cpu_pct_peak.max(p.cpu_pct);
        out.cpu_cores_peak = out
            .cpu_cores_peak
            .max(p.cpu_pct / 100.0 * f64::from(p.cpu_count.max(1)));
        out.mem_used_peak_bytes = out.mem_used_peak_bytes.max(p.mem_used_bytes);
        out.host_rss_peak_bytes = out.host_rss_peak_bytes.max(p.host_rss_bytes);
        out.disk_used_bytes = p.disk_used_bytes;
    }
    if n == 0 {
        return None;
    }
    out.samples = n;
    out.cpu_pct_avg = ((sum / n as f64) * 100.0).round() / 100.0;
    Some(out)
}

/// `GET /v1/sandboxes/{id}/metrics`: one sandbox's series.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxMetrics {
    /// The sandbox.
    pub sandbox: SandboxId,
    /// Seconds between two samples.
    pub interval_s: u64,
    /// Seconds of history kept.
    pub window_s: u64,
    /// The samples in the asked range, oldest first.
    pub samples: Vec<Sample>,
    /// Seconds the `recent` summary covers (`[capacity] peak_window`).
    pub recent_window_s: u64,
    /// What it used over the last `recent_window_s` (what admission by use
    /// counts it at); absent without samples in that window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent: Option<UsageSummary>,
}

impl Service {
    /// The sampler (its series, for the front doors and admission).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The usage series of a sandbox the caller may see, limited to
    /// `[start, end]`. Another tenant's sandbox answers like an unknown one;
    /// `start` after `end` is `invalid_request`. A sandbox that has not
    /// been sampled twice yet has no samples.
    pub async fn sandbox_metrics(
        &self,
        caller: &Caller,
        id: &SandboxId,
        start: Option<DateTime<Utc>>,
        end: Option<DateTime<Utc>>,
    ) -> ServiceResult<SandboxMetrics> {
        if let (Some(s), Some(e)) = (start, end) {
            if s > e {
                return Err(ServiceError::InvalidRequest(
                    "start must not be after end".into(),
                ));
            }
        }
        let rec = self.get_sandbox(caller, id).await?;
        let window = self.config.capacity.peak_window;
        let since = self.peak_since();
        Ok(SandboxMetrics {
            recent_window_s: window.as_secs(),
            recent: self.sampler.summary(&rec.id, since),
            samples: self.sampler.series(&rec.id, start, end),
            sandbox: rec.id,
            interval_s: self.sampler.interval().as_secs(),
            window_s: self.sampler.window().as_secs(),
        })
    }

    /// Prometheus text of the sampler's figures (appended to `/metrics`):
    /// per sandbox its latest CPU, memory and disk and its CPU peak over
    /// `[capacity] peak_window`; the host's CPU, memory, pressure and
    /// storage pool; what admission by use counts. Bounded by `[metrics]
    /// max_sandboxes`.
    pub async fn usage_prometheus(&self) -> String {
        use std::fmt::Write as _;
        let since = self.peak_since();
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, rows: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for (labels, v) in rows {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let sums = self.sampler.summaries(since);
        let latest: Vec<(SandboxId, Sample)> = sums
            .iter()
            .filter_map(|(id, _)| self.sampler.latest(id).map(|p| (id.clone(), p)))
            .collect();
        let by = |f: &dyn Fn(&Sample) -> f64| -> Vec<(String, f64)> {
            latest
                .iter()
                .map(|(id, p)| (format!("{{sandbox=\"{id}\"}}"), f(p)))
                .collect()
        };
        gauge(
            "strata_sandbox_cpu_percent",
            "CPU over the last sample interval, percent of the sandbox's vCPUs.",
            &by(&|p| p.cpu_pct),
        );
        gauge(
            "strata_sandbox_memory_bytes",
            "Guest RAM resident on the host.",
            &by(&|p| p.mem_used_bytes as f64),
        );
        gauge(
            "strata_sandbox_host_rss_bytes",
            "The VM process's whole resident set (guest RAM and QEMU's own).",
            &by(&|p| p.host_rss_bytes as f64),
        );
        gauge(
            "strata_sandbox_disk_bytes",
            "Bytes allocated to the sandbox's root disk in the pool.",
            &by(&|p| p.disk_used_bytes as f64),
        );
        let peaks: Vec<(String, f64)> = sums
            .iter()
            .map(|(id, u)| (format!("{{sandbox=\"{id}\"}}"), u.cpu_cores_peak))
            .collect();
        gauge(
            "strata_sandbox_cpu_peak_cores",
            "Highest CPU over [capacity] peak_window, in cores (what admission by use counts).",
            &peaks,
        );
        if let Some(h) = self.sampler.host_latest() {
            gauge(
                "strata_host_cpus",
                "Online CPUs.",
                &[(String::new(), f64::from(h.host.cpus))],
            );
            gauge(
                "strata_host_cpu_busy_cores",
                "CPU busy over the last sample interval, in cores (everything on the host).",
                &[(String::new(), h.host.cpu_busy_cores)],
            );
            gauge(
                "strata_host_vm_cpu_cores",
                "CPU the VMs used over the last sample interval, in cores.",
                &[(String::new(), h.vm_cores)],
            );
            gauge(
                "strata_host_memory_available_bytes",
                "MemAvailable.",
                &[(String::new(), h.host.mem_available_bytes as f64)],
            );
            gauge(
                "strata_host_memory_total_bytes",
                "MemTotal.",
                &[(String::new(), h.host.mem_total_bytes as f64)],
            );
            let psi: Vec<(String, f64)> = [
                ("cpu", "some", h.host.cpu_pressure_pct),
                ("memory", "some", h.host.mem_pressure_pct),
                ("memory", "full", h.host.mem_full_pressure_pct),
            ]
            .into_iter()
            .filter_map(|(r, k, v)| v.map(|v| (format!("{{resource=\"{r}\",kind=\"{k}\"}}"), v)))
            .collect();
            gauge(
                "strata_host_pressure_percent",
                "Share of the last sample interval tasks stalled (PSI), percent.",
                &psi,
            );
        }
        if let Some(p) = self.sampler.pool_latest() {
            gauge(
                "strata_host_pool_bytes",
                "The storage pool's space (statvfs on its root): size, used, and available for new data (the space reserve not counted).",
                &pool_rows(&p),
            );
        }
        if let Ok(b) = self.use_budget().await {
            gauge(
                "strata_admission_cpu_demand_cores",
                "What admission by use counts against the CPUs: recent peaks and other load, in cores.",
                &[(String::new(), b.cpu_demand_cores)],
            );
            gauge(
                "strata_admission_cpu_budget_cores",
                "The CPUs admission by use gives out (less headroom), in cores.",
                &[(String::new(), b.cpu_budget_cores)],
            );
            gauge(
                "strata_admission_vms",
                "VMs held or starting (sandboxes, builders, warm guests).",
                &[(String::new(), b.vms as f64)],
            );
        }
        gauge(
            "strata_pressure_active",
            "1 while pressure-driven hibernation acts.",
            &[(String::new(), if self.under_pressure() { 1.0 } else { 0.0 })],
        );
        out
    }

    /// One sampling round: the engine's counters of every live VM folded
    /// into the series; series of deleted sandboxes dropped.
    pub async fn sample_usage(&self) {
        let started = Instant::now();
        let usages = match self.engine.usage().await {
            Ok(u) => u,
            Err(e) => {
                warn!(error = %e, "reading VM usage failed");
                return;
            }
        };
        let now = self.now();
        let round = self.sampler.record(now, Instant::now(), &usages);
        let vms = u32::try_from(usages.len()).unwrap_or(u32::MAX);
        self.sampler.record_host(now, round.vm_cpu_usec, vms);
        let pool = match self.engine.pool_space().await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "reading the pool's space failed");
                None
            }
        };
        self.sampler.record_pool(pool);
        for id in round.unseen {
            match self.record(&id).await {
                Ok(_) => self.sampler.keep(&id),
                Err(ServiceError::NotFound { .. }) => self.sampler.forget(&id),
                // The store did not answer: ask again next round.
                Err(_) => {}
            }
        }
        self.metrics.observe_step(SAMPLE_STEP, started.elapsed());
    }

    /// Runs [`Service::sample_usage`] every `[metrics] interval` until
    /// `stop` turns true (`None`: the sampler is off, `interval = "0s"`).
    pub fn spawn_sampler(
        self: &Arc<Self>,
        mut stop: watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let every = self.sampler.interval();
        if every.is_zero() {
            return None;
        }
        let this = self.clone();
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    r = stop.changed() => if r.is_err() { break },
                }
                if *stop.borrow() {
                    break;
                }
                this.sample_usage().await;
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::CpuSource;

    fn cfg(interval_s: u64, window_s: u64, max: usize) -> MetricsConfig {
        MetricsConfig {
            interval: Duration::from_secs(interval_s),
            window: Duration::from_secs(window_s),
            max_sandboxes: max,
        }
    }

    fn usage(id: &SandboxId, pid: u32, cpu_usec: u64) -> VmUsage {
        VmUsage {
            id: id.clone(),
            pid,
            cpu_usec,
            cpu_source: CpuSource::Proc,
            vcpus: 2,
            running: true,
            mem_total_bytes: 512 << 20,
            mem_used_bytes: 100 << 20,
            host_rss_bytes: 200 << 20,
            disk_used_bytes: 1 << 30,
            disk_total_bytes: 2 << 30,
            open_calls: 0,
        }
    }

    #[test]
    fn the_pool_is_one_row_per_kind_and_the_last_round_wins() {
        let s = Sampler::new(&cfg(5, 60, 4));
        assert_eq!(s.pool_latest(), None);
        let p = PoolSpace {
            size_bytes: 100 << 30,
            used_bytes: 40 << 30,
            available_bytes: 59 << 30,
        };
        s.record_pool(Some(p));
        assert_eq!(s.pool_latest(), Some(p));
        assert_eq!(
            pool_rows(&p),
            vec![
                (r#"{kind="size"}"#.to_owned(), (100u64 << 30) as f64),
                (r#"{kind="used"}"#.to_owned(), (40u64 << 30) as f64),
                (r#"{kind="available"}"#.to_owned(), (59u64 << 30) as f64),
            ]
        );
        // A round that could not read it shows nothing rather than an old figure.
        s.record_pool(None);
        assert_eq!(s.pool_latest(), None);
    }

    #[test]
    fn the_peak_of_the_sum_is_the_busiest_round_of_the_given_sandboxes() {
        let s = Sampler::new(&cfg(5, 3600, 16));
        let (a, b, c) = (
            SandboxId::generate(),
            SandboxId::generate(),
            SandboxId::generate(),
        );
        let (t0, m0) = (Utc::now(), Instant::now());
        let at = |i: i64| t0 + chrono::TimeDelta::seconds(5 * i);
        let mono = |i: u64| m0 + Duration::from_secs(5 * i);
        // 2 vCPUs each; CPU seconds per 5-s round: a busy in round 1, b in
        // round 2 (each 1 core), c always idle.
        let cum = [
            (0, 0, 0),
            (5_000_000, 0, 0),
            (5_000_000, 5_000_000, 0),
            (5_000_000, 5_000_000, 0),
        ];
        for (i, (ua, ub, uc)) in cum.into_iter().enumerate() {
            s.record(
                at(i as i64),
                mono(i as u64),
                &[usage(&a, 1, ua), usage(&b, 2, ub), usage(&c, 3, uc)],
            );
        }
        // Their own peaks sum to 2 cores; together they never took more than 1.
        let (peak, n) = s.peak_of_sum([&a, &b, &c], at(0));
        assert_eq!(n, 3);
        assert!((peak - 1.0).abs() < 1e-9, "{peak}");
        // The window and the set count: from round 2 on, a was idle.
        assert!((s.peak_of_sum([&a], at(2)).0).abs() < 1e-9);
        assert_eq!(s.peak_of_sum([&SandboxId::generate()], at(0)), (0.0, 0));
    }

    #[test]
    fn cpu_is_a_rate_over_the_vcpus_and_restarts_with_the_process() {
        let s = Sampler::new(&cfg(5, 3600, 16));
        let id = SandboxId::generate();
        let (t0, m0) = (Utc::now(), Instant::now());
        let at = |i: i64| t0 + chrono::TimeDelta::seconds(5 * i);
        let mono = |i: u64| m0 + Duration::from_secs(5 * i);
        // First round: a baseline only for the series, but what the new
        // process used since it started is the VMs' load of the round.
        let r = s.record(at(0), mono(0), &[usage(&id, 10, 1_000_000)]);
        assert!(s.series(&id, None, None).is_empty());
        assert_eq!(r.vm_cpu_usec, 1_000_000);
        // 5 s later, 5 s of CPU on 2 vCPUs: 50 %.
        let r = s.record(at(1), mono(1), &[usage(&id, 10, 6_000_000)]);
        assert_eq!(r.vm_cpu_usec, 5_000_000);
        let p = s.latest(&id).unwrap();
        assert_eq!(p.cpu_pct, 50.0);
        assert_eq!((p.cpu_count, p.mem_used_bytes), (2, 100 << 20));
        // More than all vCPUs (QEMU's own threads) is capped at 100.
        s.record(at(2), mono(2), &[usage(&id, 10, 20_000_000)]);
        assert_eq!(s.latest(&id).unwrap().cpu_pct, 100.0);
        // A new process (wake, restore): a baseline again, no bogus rate;
        // its own CPU since it started counts for the round.
        let r = s.record(at(3), mono(3), &[usage(&id, 11, 10)]);
        assert_eq!(r.vm_cpu_usec, 10);
        assert_eq!(s.series(&id, None, None).len(), 2);
        s.record(at(4), mono(4), &[usage(&id, 11, 10)]);
        assert_eq!(s.latest(&id).unwrap().cpu_pct, 0.0);
        assert_eq!(s.peak_cpu_pct(&id, at(0)), Some(100.0));
        assert_eq!(s.peak_cpu_pct(&id, at(3)), Some(0.0));
        // Range filters, both ends inclusive.
        assert_eq!(s.series(&id, Some(at(2)), Some(at(2))).len(), 1);
        assert_eq!(s.series(&id, Some(at(3)), None).len(), 1);
    }

    #[test]
    fn the_ring_is_bounded_in_points_age_and_sandboxes() {
        // 60 s window at 5 s: 12 points.
        let s = Sampler::new(&cfg(5, 60, 3));
        assert_eq!(s.capacity(), 12);
        let ids: Vec<SandboxId> = (0..10).map(|_| SandboxId::generate()).collect();
        let (t0, m0) = (Utc::now(), Instant::now());
        for i in 0..1000u64 {
            let at = t0 + chrono::TimeDelta::seconds(5 * i as i64);
            let u: Vec<VmUsage> = ids[..2].iter().map(|id| usage(id, 1, i * 1000)).collect();
            s.record(at, m0 + Duration::from_secs(5 * i), &u);
        }
        assert_eq!(s.series(&ids[0], None, None).len(), 12);
        assert!(s.total_points() <= 2 * 12);
        // More sandboxes than the cap: the least recently seen make room.
        let t = t0 + chrono::TimeDelta::seconds(5 * 1000);
        let u: Vec<VmUsage> = ids.iter().map(|id| usage(id, 1, 0)).collect();
        s.record(t, m0 + Duration::from_secs(5000), &u);
        assert!(s.len() <= 3, "{}", s.len());
        // The configured window never exceeds MAX_POINTS.
        assert_eq!(Sampler::new(&cfg(1, 7 * 86400, 1)).capacity(), MAX_POINTS);
    }

    #[test]
    fn a_series_without_a_vm_is_looked_up_once_then_kept_or_dropped() {
        let s = Sampler::new(&cfg(5, 60, 16));
        let (a, b) = (SandboxId::generate(), SandboxId::generate());
        let (t0, m0) = (Utc::now(), Instant::now());
        let at = |i: i64| t0 + chrono::TimeDelta::seconds(5 * i);
        let mono = |i: u64| m0 + Duration::from_secs(5 * i);
        for i in 0..3 {
            s.record(at(i as i64), mono(i), &[usage(&a, 1, 0), usage(&b, 2, 0)]);
        }
        // Both VMs gone: both are asked about once.
        let mut unseen = s.record(at(3), mono(3), &[]).unseen;
        unseen.sort();
        let mut both = vec![a.clone(), b.clone()];
        both.sort();
        assert_eq!(unseen, both);
        s.forget(&a); // deleted
        s.keep(&b); // hibernated
        assert!(s.record(at(4), mono(4), &[]).unseen.is_empty());
        assert!(s.series(&a, None, None).is_empty());
        assert_eq!(s.series(&b, None, None).len(), 2);
        // b ages out of the 60 s window.
        s.record(at(20), mono(20), &[]);
        assert_eq!(s.len(), 0);
    }
}
