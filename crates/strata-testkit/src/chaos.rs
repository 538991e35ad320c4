//! The chaos driver: a real `stratad` process with real guests, concurrent
//! clients doing every operation, and kills at random moments — `kill -9`
//! of the daemon (restarted on the same directories), of one QEMU, of the
//! guest agent inside one guest. What the daemon acknowledged (a 2xx answer)
//! is recorded in a ledger; after every kill a judge checks the invariants
//! against it and against the host itself (the process table, `btrfs
//! subvolume list`, `/sys/block/loop*`), never the daemon's own view of its
//! parts. The first violation stops the run with a report.
//!
//! Used by `crates/stratad/tests/chaos.rs` (a few kills) and by
//! `strata-bench --only chaos` (100 kills). See `docs/bench/chaos.md`.
//!
//! # Markers
//!
//! Each marker write runs `echo N > /dev/shm/m; echo N > /root/m; sync` in
//! a guest (`/dev/shm` is RAM, `/root` the disk), N unique in the run. The
//! ledger keeps, for every sandbox and every snapshot, the range of N its
//! state may hold: exact once acknowledged, widened by operations whose
//! outcome the client never heard (the daemon died under them) and by kills
//! of the sandbox's VM or agent (recovery may restore its newest snapshot,
//! acknowledged or not). A read narrows the range again. 0 stands for "no
//! marker yet".
//!
//! # Invariants (after each kill, with the clients held)
//!
//! 1. Every acknowledged, not deleted sandbox is listed, in `running`,
//!    `paused` or `hibernated` (nothing `failed`, `creating` or lost); every
//!    acknowledged delete stays deleted.
//! 2. Each of them answers an exec within `exec_bound` (a paused one after
//!    a resume), and its disk and memory markers are equal and in range.
//! 3. Its stored sandbox policy is one of those the client may have set;
//!    one created through the E2B door with `envVars` still sees them: a
//!    command started through envd (`process.Process/Start`, with its
//!    stored access token) prints the value the create gave.
//! 4. A random sample of acknowledged snapshots are listed `ready`, fork,
//!    and the fork's markers are in the snapshot's range.
//! 5. Parts ⇔ records: every QEMU of the run dir is the pid of a `running`
//!    or `paused` sandbox and each of those has its QEMU; every subvolume
//!    under `sandboxes/` and `snapshots/` has a record and every live record
//!    its subvolume; the only loop device backed under the daemon's root is
//!    its pool image; no other process names the daemon's directories.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};
use tokio::sync::RwLock;

use crate::teardown::{alive, cmdline, qemu_pids, remove_daemon_root, sigkill};
use crate::Api;

/// Settings of one chaos run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// Seed of every random choice (kinds, victims, gaps, operations).
    pub seed: u64,
    /// Kills to do (daemon, QEMU and agent kills together).
    pub kills: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Most acknowledged live sandboxes at once (creates wait beyond).
    pub max_sandboxes: usize,
    /// Time between the end of one check and the next kill: uniform in
    /// `[gap.0, gap.1]`.
    pub gap: (Duration, Duration),
    /// Acknowledged snapshots restored after each kill.
    pub sample: usize,
    /// Restore every acknowledged snapshot at the end.
    pub restore_all_at_end: bool,
    /// How long an exec of a live sandbox may take after a kill.
    pub exec_bound: Duration,
    /// Guest image directory.
    pub image: PathBuf,
    /// `accel` of the daemon's configuration (`tcg`, `kvm`, `auto`).
    pub accel: String,
    /// Weights of daemon / QEMU / agent kills.
    pub weights: (u32, u32, u32),
}

impl ChaosConfig {
    /// Defaults for `image`: 100 kills, 3 clients, at most 6 sandboxes,
    /// 10–30 s between kills, 3 restores per check, all at the end.
    pub fn new(image: PathBuf, seed: u64) -> ChaosConfig {
        ChaosConfig {
            seed,
            kills: 100,
            clients: 3,
            max_sandboxes: 6,
            gap: (Duration::from_secs(10), Duration::from_secs(30)),
            sample: 3,
            restore_all_at_end: true,
            exec_bound: Duration::from_secs(60),
            image,
            accel: "tcg".into(),
            weights: (6, 2, 2),
        }
    }
}

/// The seed of a run: `$STRATA_CHAOS_SEED` when set (to replay a run),
/// else one from the clock.
pub fn seed_from_env() -> u64 {
    std::env::var("STRATA_CHAOS_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        })
}

/// What a run did and found.
#[derive(Debug, Default, Clone)]
pub struct ChaosReport {
    /// The seed.
    pub seed: u64,
    /// `kill -9` of the daemon.
    pub daemon_kills: u64,
    /// `kill -9` of one QEMU.
    pub qemu_kills: u64,
    /// `kill -9` of the guest agent in one guest.
    pub agent_kills: u64,
    /// Acknowledged operations, by kind.
    pub acked: BTreeMap<String, u64>,
    /// Operations the daemon refused or that failed (status ≥ 400 or no
    /// answer), by kind.
    pub unanswered: BTreeMap<String, u64>,
    /// Invariant checks run (one per invariant per object).
    pub checks: u64,
    /// Violations (the run stops at the first).
    pub violations: Vec<String>,
    /// Time from each kill until the daemon serves again and the victim
    /// answers (daemon: listening and listing; QEMU / agent: the victim's
    /// next exec answered).
    pub recovery: Vec<(&'static str, Duration)>,
    /// Snapshots restored (forked) and their markers checked.
    pub restores_checked: u64,
    /// Sandboxes created through the E2B door whose stored `envVars` an
    /// envd command read back after a kill.
    pub envs_checked: u64,
    /// Wall time of the run.
    pub wall: Duration,
    /// The last lines the daemon logged when a violation was found.
    pub log_tail: String,
    /// Where the daemon's logs of every start were copied when a violation
    /// was found (the run's directories are removed at its end).
    pub logs_kept: Option<PathBuf>,
}

impl ChaosReport {
    /// All acknowledged operations.
    pub fn acked_total(&self) -> u64 {
        self.acked.values().sum()
    }

    /// Kills of all kinds.
    pub fn kills(&self) -> u64 {
        self.daemon_kills + self.qemu_kills + self.agent_kills
    }

    /// Recovery times in ms, sorted.
    pub fn recovery_ms(&self, kind: Option<&str>) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .recovery
            .iter()
            .filter(|(k, _)| kind.is_none_or(|want| *k == want))
            .map(|(_, d)| d.as_secs_f64() * 1000.0)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// One paragraph for a log or a test's output.
    pub fn summary(&self) -> String {
        let pct = |v: &[f64], p: f64| -> f64 {
            if v.is_empty() {
                return 0.0;
            }
            let i = ((v.len() as f64 - 1.0) * p).round() as usize;
            v[i.min(v.len() - 1)]
        };
        let r = self.recovery_ms(None);
        format!(
            "seed {} (STRATA_CHAOS_SEED={} to replay): kills {} (daemon {}, qemu {}, agent {}); \
             operations acknowledged {} {:?}; not acknowledged {:?}; invariant checks {}; \
             restores checked {}; E2B envs checked {}; violations {}; recovery p50 {:.0} ms p99 {:.0} ms (n={}); wall {:.0} s{}",
            self.seed,
            self.seed,
            self.kills(),
            self.daemon_kills,
            self.qemu_kills,
            self.agent_kills,
            self.acked_total(),
            self.acked,
            self.unanswered,
            self.checks,
            self.restores_checked,
            self.envs_checked,
            self.violations.len(),
            pct(&r, 0.5),
            pct(&r, 0.99),
            r.len(),
            self.wall.as_secs_f64(),
            self.violations
                .iter()
                .map(|v| format!("\nVIOLATION: {v}"))
                .chain(self.logs_kept.iter().map(|p| format!("\ndaemon logs: {}", p.display())))
                .collect::<String>()
        )
    }
}

// ------------------------------------------------------------------ rng

/// SplitMix64: small, seedable, good enough to pick victims.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
    /// Uniform in `[lo, hi]`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_millis() as u64;
        lo + Duration::from_millis(if span == 0 {
            0
        } else {
            self.next_u64() % (span + 1)
        })
    }
    /// One of `items` (None when empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get(self.below(items.len()))
        }
    }
}

// ------------------------------------------------------------------ daemon process

/// A `stratad` process on its own directories under `/tmp`, killed and
/// restarted at will; everything is torn down on drop.
#[derive(Debug)]
pub struct DaemonProc {
    /// `/tmp/chaos-XXXXXX`.
    pub root: PathBuf,
    /// `<root>/run`.
    pub run_dir: PathBuf,
    /// `<root>/data`.
    pub data_dir: PathBuf,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    config: PathBuf,
    child: Mutex<Option<Child>>,
    starts: AtomicU64,
    /// A client with the bootstrap admin token (read at every request).
    pub api: Api,
}

impl DaemonProc {
    /// Writes the configuration and starts the daemon.
    pub fn start(image: &Path, accel: &str) -> std::io::Result<DaemonProc> {
        let root = tempfile::Builder::new()
            .prefix("chaos-")
            .tempdir_in("/tmp")?
            .keep();
        let port = crate::free_port();
        let run_dir = root.join("run");
        let data_dir = root.join("data");
        let config = root.join("config.toml");
        std::fs::write(
            &config,
            format!(
                r#"listen = "127.0.0.1:{port}"
data_dir = "{data}"
key_dir = "{keys}"
run_dir = "{run}"
image_dir = "{img}"
accel = "{accel}"
pool_size_gib = 8
snapshot_interval = "0s"
idle_timeout = "0s"
agent_timeout = "60s"
[default_size]
vcpus = 1
memory_mib = 256
disk_gib = 2
[pools]
default_template = 0
[capacity]
admission = "nominal"
[pressure]
enabled = false
[security]
rate_limit_per_second = 100000.0
rate_limit_burst = 100000
[e2b]
enabled = true
rate_limit_per_second = 100000.0
rate_limit_burst = 100000
"#,
                data = data_dir.display(),
                keys = root.join("keys").display(),
                run = run_dir.display(),
                img = image.display(),
            ),
        )?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(180))
            .pool_max_idle_per_host(0)
            .build()
            .map_err(std::io::Error::other)?;
        let url = format!("http://127.0.0.1:{port}");
        let d = DaemonProc {
            api: Api::with_client(url.clone(), client).token_file(data_dir.join("admin.token")),
            root,
            run_dir,
            data_dir,
            url,
            config,
            child: Mutex::new(None),
            starts: AtomicU64::new(0),
        };
        d.spawn()?;
        Ok(d)
    }

    fn log_path(&self, n: u64) -> PathBuf {
        self.root.join(format!("stratad.{n}.log"))
    }

    /// The log of the current (latest) start.
    pub fn last_log(&self) -> String {
        std::fs::read_to_string(self.log_path(self.starts.load(Ordering::SeqCst)))
            .unwrap_or_default()
    }

    /// Starts the daemon and waits until it listens (60 s at most).
    pub fn spawn(&self) -> std::io::Result<()> {
        let n = self.starts.fetch_add(1, Ordering::SeqCst) + 1;
        let log = std::fs::File::create(self.log_path(n))?;
        let child = Command::new(crate::stratad_bin())
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let pid = child.id();
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        let mut all = running();
        all.retain(|(r, _)| *r != self.root);
        all.push((self.root.clone(), Some(pid)));
        drop(all);
        let t = Instant::now();
        let addr = self.url.trim_start_matches("http://").to_owned();
        loop {
            if std::net::TcpStream::connect(&addr).is_ok() {
                return Ok(());
            }
            if let Some(c) = self
                .child
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
            {
                if let Ok(Some(st)) = c.try_wait() {
                    return Err(std::io::Error::other(format!(
                        "stratad exited ({st}):\n{}",
                        self.last_log()
                    )));
                }
            }
            if t.elapsed() > Duration::from_secs(60) {
                return Err(std::io::Error::other(format!(
                    "stratad did not listen in 60 s:\n{}",
                    self.last_log()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Child::id)
    }

    /// `kill -9` of the daemon, reaped (its VMs keep running).
    pub fn kill9(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            sigkill(c.id());
            let _ = c.wait();
        }
    }
}

/// Roots and daemon pids of the runs in progress, for [`teardown_all`].
static RUNNING: Mutex<Vec<(PathBuf, Option<u32>)>> = Mutex::new(Vec::new());

fn running() -> std::sync::MutexGuard<'static, Vec<(PathBuf, Option<u32>)>> {
    RUNNING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Kills the daemons of the runs in progress, their VMs, unmounts their
/// pools and removes their directories (a bench's Ctrl-C handler).
pub fn teardown_all() {
    for (root, pid) in std::mem::take(&mut *running()) {
        if let Some(pid) = pid.filter(|p| cmdline(*p).contains("stratad")) {
            sigkill(pid);
            crate::teardown::wait_gone(pid, Duration::from_secs(10));
        }
        remove_daemon_root(&root);
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        self.kill9();
        running().retain(|(r, _)| *r != self.root);
        remove_daemon_root(&self.root);
    }
}

// ------------------------------------------------------------------ ledger

/// Range of marker values a state may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    lo: u64,
    hi: u64,
}

impl Range {
    fn exact(n: u64) -> Range {
        Range { lo: n, hi: n }
    }
    fn hull(self, o: Range) -> Range {
        Range {
            lo: self.lo.min(o.lo),
            hi: self.hi.max(o.hi),
        }
    }
    fn holds(self, n: u64) -> bool {
        (self.lo..=self.hi).contains(&n)
    }
}

#[derive(Debug, Clone)]
struct Snap {
    id: String,
    marker: Range,
}

#[derive(Debug, Clone)]
struct Sb {
    id: String,
    marker: Range,
    snaps: Vec<Snap>,
    /// Policies the stored one may be (empty: not checked).
    policies: Vec<Option<String>>,
    /// Created through the E2B door: its envd access token and the value
    /// of [`CHAOS_ENV`] the create stored.
    e2b_env: Option<(String, String)>,
    /// Kills of its QEMU so far: an operation that was in flight across
    /// one widens its range again when its answer arrives (the answer's
    /// state may be gone: recovery may have restored any snapshot, one
    /// the answer itself reports included, e.g. a rewind's pre-rewind).
    vm_kills: u64,
    busy: bool,
    /// Acknowledged deleted.
    deleted: bool,
    /// A delete was sent and not acknowledged.
    maybe_deleted: bool,
}

impl Sb {
    fn new(id: String, marker: Range) -> Sb {
        Sb {
            id,
            marker,
            snaps: Vec::new(),
            policies: vec![None],
            e2b_env: None,
            vm_kills: 0,
            busy: false,
            deleted: false,
            maybe_deleted: false,
        }
    }
    /// A kill hit this sandbox (or its outcome is unknown): it may be back
    /// at any of its snapshots.
    fn widen(&mut self) {
        for s in &self.snaps {
            self.marker = self.marker.hull(s.marker);
        }
    }
}

#[derive(Debug, Default)]
struct Ledger {
    sbs: Vec<Sb>,
    /// Creates and forks in flight (each holds a place under `max_sandboxes`).
    pending: usize,
}

impl Ledger {
    fn live(&self) -> impl Iterator<Item = &Sb> {
        self.sbs.iter().filter(|s| !s.deleted)
    }
    fn get(&mut self, id: &str) -> Option<&mut Sb> {
        self.sbs.iter_mut().find(|s| s.id == id)
    }
    /// Takes a place for a new sandbox when fewer than `max` live or are
    /// on their way (a sandbox being deleted still holds its VM).
    fn reserve(&mut self, max: usize) -> bool {
        let ok = self.live().count() + self.pending < max;
        if ok {
            self.pending += 1;
        }
        ok
    }
}

struct Shared {
    d: DaemonProc,
    cfg: ChaosConfig,
    ledger: Mutex<Ledger>,
    report: Mutex<ChaosReport>,
    /// Clients take it shared for each operation; the judge exclusively.
    gate: RwLock<()>,
    stop: AtomicBool,
    counter: AtomicU64,
}

impl Shared {
    fn ack(&self, op: &str) {
        *self
            .report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acked
            .entry(op.to_owned())
            .or_default() += 1;
    }
    fn miss(&self, op: &str) {
        *self
            .report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .unanswered
            .entry(op.to_owned())
            .or_default() += 1;
    }
    fn checked(&self, n: u64) {
        self.report.lock().unwrap_or_else(|p| p.into_inner()).checks += n;
    }
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// ------------------------------------------------------------------ run

/// Runs the chaos described by `cfg` and returns what happened; the report
/// lists the violation that stopped it, if any. Errors are setup failures
/// (the daemon does not start, the default template does not build).
pub async fn run(cfg: ChaosConfig) -> Result<ChaosReport, String> {
    let t0 = Instant::now();
    let d = DaemonProc::start(&cfg.image, &cfg.accel).map_err(|e| format!("start: {e}"))?;
    wait_template(&d.api).await?;
    let sh = Arc::new(Shared {
        d,
        report: Mutex::new(ChaosReport {
            seed: cfg.seed,
            ..Default::default()
        }),
        cfg,
        ledger: Mutex::new(Ledger::default()),
        gate: RwLock::new(()),
        stop: AtomicBool::new(false),
        counter: AtomicU64::new(0),
    });
    eprintln!(
        "chaos: seed {} (replay with STRATA_CHAOS_SEED={}), {} kills, {} clients, root {}",
        sh.cfg.seed,
        sh.cfg.seed,
        sh.cfg.kills,
        sh.cfg.clients,
        sh.d.root.display()
    );
    let clients: Vec<_> = (0..sh.cfg.clients)
        .map(|i| {
            let sh = sh.clone();
            tokio::spawn(async move { client(sh, i as u64).await })
        })
        .collect();
    let res = killer(&sh).await;
    sh.stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.await;
    }
    if let Err(v) = res {
        violation(&sh, v);
    } else if sh.cfg.restore_all_at_end {
        let _g = sh.gate.write().await;
        if let Err(v) = judge(&sh, true).await {
            violation(&sh, v);
        }
    }
    let mut r = sh.report.lock().unwrap_or_else(|p| p.into_inner()).clone();
    r.wall = t0.elapsed();
    // Teardown (the daemon, its VMs, its pool) when the last handle goes.
    drop(sh);
    Ok(r)
}

fn violation(sh: &Shared, v: String) {
    eprintln!("chaos: VIOLATION: {v}");
    let mut r = sh.report.lock().unwrap_or_else(|p| p.into_inner());
    r.violations.push(v);
    let log = sh.d.last_log();
    let tail: Vec<&str> = log.lines().rev().take(80).collect();
    r.log_tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
    let keep = PathBuf::from(format!("/tmp/chaos-logs-{}", sh.cfg.seed));
    if std::fs::create_dir_all(&keep).is_ok() {
        for n in 1..=sh.d.starts.load(Ordering::SeqCst) {
            let _ = std::fs::copy(sh.d.log_path(n), keep.join(format!("stratad.{n}.log")));
        }
        eprintln!("chaos: the daemon's logs are kept in {}", keep.display());
        r.logs_kept = Some(keep);
    }
}

async fn wait_template(api: &Api) -> Result<(), String> {
    let t = Instant::now();
    loop {
        let (s, v) = api
            .json(Method::GET, "/v1/templates/tpl-default", None)
            .await
            .map_err(|e| crate::error_chain(&e))?;
        if s == 200 && v["status"] == "ready" {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(600) {
            return Err(format!("default template not ready: {s} {v}"));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Kill after kill, each followed by the judge.
async fn killer(sh: &Arc<Shared>) -> Result<(), String> {
    let mut rng = Rng::new(sh.cfg.seed ^ 0x6b69_6c6c);
    // Let the clients make something first.
    tokio::time::sleep(sh.cfg.gap.1).await;
    let (wd, wq, wa) = sh.cfg.weights;
    for n in 1..=sh.cfg.kills {
        let roll = rng.below((wd + wq + wa).max(1) as usize) as u32;
        let kind = if roll < wd {
            "daemon"
        } else if roll < wd + wq {
            "qemu"
        } else {
            "agent"
        };
        let mut done = match kind {
            "daemon" => kill_daemon(sh).await?,
            "qemu" => kill_qemu(sh, &mut rng).await?,
            _ => kill_agent(sh, &mut rng).await?,
        };
        // No victim for a QEMU or agent kill right now: kill the daemon.
        let kind = if done.is_none() {
            done = kill_daemon(sh).await?;
            "daemon"
        } else {
            kind
        };
        if let Some(took) = done {
            let mut r = sh.report.lock().unwrap_or_else(|p| p.into_inner());
            r.recovery.push((kind, took));
            match kind {
                "daemon" => r.daemon_kills += 1,
                "qemu" => r.qemu_kills += 1,
                _ => r.agent_kills += 1,
            }
            eprintln!(
                "chaos: kill {n}/{}: {kind}, recovered in {} ms",
                sh.cfg.kills,
                took.as_millis()
            );
        }
        {
            let _g = sh.gate.write().await;
            judge(sh, false).await?;
        }
        tokio::time::sleep(rng.between(sh.cfg.gap.0, sh.cfg.gap.1)).await;
    }
    Ok(())
}

async fn kill_daemon(sh: &Arc<Shared>) -> Result<Option<Duration>, String> {
    sh.d.kill9();
    // Operations in flight now fail; hold new ones until the restart.
    let _g = sh.gate.write().await;
    let t = Instant::now();
    sh.d.spawn()
        .map_err(|e| format!("restart after kill -9: {e}"))?;
    loop {
        match sh
            .d
            .api
            .json(Method::GET, "/v1/sandboxes?limit=1", None)
            .await
        {
            Ok((200, _)) => break,
            _ if t.elapsed() > Duration::from_secs(120) => {
                return Err(format!(
                    "the daemon does not list sandboxes 120 s after a restart:\n{}",
                    sh.d.last_log()
                ))
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let took = t.elapsed();
    // Every sandbox may have been restored from a snapshot by recovery.
    for s in sh.ledger().sbs.iter_mut() {
        s.widen();
    }
    Ok(Some(took))
}

/// A live sandbox with a snapshot, marked busy for the killer.
fn victim(sh: &Shared, rng: &mut Rng, want_idle: bool) -> Option<String> {
    let mut l = sh.ledger();
    let ids: Vec<String> = l
        .live()
        .filter(|s| !s.maybe_deleted && !s.snaps.is_empty() && (!want_idle || !s.busy))
        .map(|s| s.id.clone())
        .collect();
    let id = rng.pick(&ids)?.clone();
    if want_idle {
        if let Some(s) = l.get(&id) {
            s.busy = true;
        }
    }
    Some(id)
}

async fn kill_qemu(sh: &Arc<Shared>, rng: &mut Rng) -> Result<Option<Duration>, String> {
    let Some(id) = victim(sh, rng, false) else {
        return Ok(None);
    };
    let Some((_, pid)) = qemu_pids(&sh.d.run_dir).into_iter().find(|(n, _)| *n == id) else {
        return Ok(None); // hibernated or stopped right now
    };
    if let Some(s) = sh.ledger().get(&id) {
        s.widen();
        s.vm_kills += 1;
    }
    sigkill(pid);
    let t = Instant::now();
    answers_again(sh, &id, t, None).await.map(Some)
}

async fn kill_agent(sh: &Arc<Shared>, rng: &mut Rng) -> Result<Option<Duration>, String> {
    let Some(id) = victim(sh, rng, true) else {
        return Ok(None);
    };
    let out = {
        let _g = sh.gate.read().await;
        if let Some(s) = sh.ledger().get(&id) {
            s.widen();
        }
        // The agent that runs this exec is the one killed: let it answer
        // first (with its pid, so the probe below can tell its successor).
        sh.d.api
            .exec_output(
                &id,
                &[
                    "sh",
                    "-c",
                    "pgrep -x strata-agent | grep -vx 1; \
                     (sleep 0.3; kill -9 $(pgrep -x strata-agent | grep -vx 1)) >/dev/null 2>&1 &",
                ],
            )
            .await
    };
    // The kill lands 0.3 s after the exec began; probe once it has.
    let t = Instant::now() + Duration::from_millis(300);
    let r = match out {
        Ok((0, old)) => {
            tokio::time::sleep(Duration::from_millis(400)).await;
            let old = old.trim().to_owned();
            answers_again(sh, &id, t, Some(&old)).await.map(Some)
        }
        _ => Ok(None),
    };
    if let Some(s) = sh.ledger().get(&id) {
        s.busy = false;
    }
    r
}

/// Waits until `id` answers an exec (within the exec bound); the time since
/// `t`. With `old_agent` (the pid of a killed agent), only an answer from
/// another agent counts: under load the kill can land after a first probe,
/// which the old agent would still answer.
async fn answers_again(
    sh: &Shared,
    id: &str,
    t: Instant,
    old_agent: Option<&str>,
) -> Result<Duration, String> {
    let bound = sh.cfg.exec_bound;
    let probe: &[&str] = match old_agent {
        Some(_) => &["sh", "-c", "pgrep -x strata-agent | grep -vx 1"],
        None => &["true"],
    };
    loop {
        let r = tokio::time::timeout(bound, sh.d.api.exec_output(id, probe)).await;
        if let Ok(Ok((0, out))) = &r {
            let out = out.trim();
            if old_agent.is_none_or(|old| !out.is_empty() && out != old) {
                return Ok(t.elapsed());
            }
        }
        // A QEMU victim may be in a client's operation, a delete included:
        // gone is fine when the client asked for it.
        if let Ok(Err(crate::ApiError::Status { status: 404, .. })) = &r {
            if sh
                .ledger()
                .get(id)
                .is_some_and(|s| s.deleted || s.maybe_deleted)
            {
                return Ok(t.elapsed());
            }
        }
        if t.elapsed() > bound {
            let (_, v) =
                sh.d.api
                    .json(Method::GET, &format!("/v1/sandboxes/{id}"), None)
                    .await
                    .unwrap_or((0, Value::Null));
            return Err(format!(
                "{id} does not answer an exec {} s after its kill: last {r:?}; record {v}",
                bound.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ------------------------------------------------------------------ clients

const OPS: &[&str] = &[
    "create",
    "write",
    "write",
    "snapshot",
    "snapshot",
    "fork",
    "rewind",
    "hibernate",
    "pause",
    "policy",
    "exec",
    "delete",
];

async fn client(sh: Arc<Shared>, n: u64) {
    let mut rng = Rng::new(sh.cfg.seed.wrapping_add(n.wrapping_mul(0x1000_0001)));
    while !sh.stop.load(Ordering::SeqCst) {
        let op = *rng.pick(OPS).unwrap_or(&"exec");
        let _g = sh.gate.read().await;
        if sh.stop.load(Ordering::SeqCst) {
            break;
        }
        let live = sh.ledger().live().filter(|s| !s.maybe_deleted).count();
        if op == "create" || live == 0 {
            if sh.ledger().reserve(sh.cfg.max_sandboxes) {
                create(&sh).await;
                sh.ledger().pending -= 1;
            }
        } else {
            let id = {
                let mut l = sh.ledger();
                let ids: Vec<String> = l
                    .live()
                    .filter(|s| !s.busy && !s.maybe_deleted)
                    .map(|s| s.id.clone())
                    .collect();
                let id = rng.pick(&ids).cloned();
                if let Some(s) = id.as_ref().and_then(|i| l.get(i)) {
                    s.busy = true;
                }
                id
            };
            if let Some(id) = id {
                let fewer = live <= 2 && op == "delete";
                let op = if fewer { "write" } else { op };
                let kills = sh.ledger().get(&id).map(|s| s.vm_kills);
                one_op(&sh, &mut rng, op, &id).await;
                if let Some(s) = sh.ledger().get(&id) {
                    s.busy = false;
                    if Some(s.vm_kills) != kills {
                        s.widen();
                    }
                }
            }
        }
        drop(_g);
        tokio::time::sleep(Duration::from_millis(50 + rng.below(200) as u64)).await;
    }
}

fn id_of(v: &Value) -> Option<String> {
    v["id"].as_str().map(str::to_owned)
}

/// The environment variable an E2B create stores (invariant 3).
const CHAOS_ENV: &str = "CHAOS_ENV";

async fn create(sh: &Shared) {
    let n = sh.counter.fetch_add(1, Ordering::SeqCst) + 1;
    if n.is_multiple_of(2) {
        return create_e2b(sh, n).await;
    }
    let body = json!({ "labels": { "chaos": "1" } });
    match sh
        .d
        .api
        .json(Method::POST, "/v1/sandboxes", Some(body))
        .await
    {
        Ok((201, v)) => {
            if let Some(id) = id_of(&v) {
                sh.ledger().sbs.push(Sb::new(id, Range::exact(0)));
                sh.ack("create");
            }
        }
        _ => sh.miss("create"),
    }
}

/// A create through the E2B door (`POST /sandboxes`, the admin token as
/// its API key) with `envVars` the judge checks after every kill.
async fn create_e2b(sh: &Shared, n: u64) {
    let value = format!("chaos-env-{n}");
    let body = json!({
        "templateID": "base",
        "timeout": 3600,
        "metadata": { "chaos": "1" },
        "envVars": { CHAOS_ENV: value },
    });
    let mut rq = sh.d.api.client().post(format!("{}/sandboxes", sh.d.url));
    if let Some(t) = sh.d.api.token() {
        rq = rq.header("X-API-Key", t);
    }
    let r = rq.json(&body).send().await;
    let v: Option<Value> = match r {
        Ok(r) if r.status().as_u16() == 201 => r.json().await.ok(),
        _ => None,
    };
    let got = v.as_ref().and_then(|v| {
        Some((
            v["sandboxID"].as_str()?.to_owned(),
            v["envdAccessToken"].as_str()?.to_owned(),
        ))
    });
    match got {
        Some((id, token)) => {
            let mut sb = Sb::new(id, Range::exact(0));
            sb.e2b_env = Some((token, value));
            sh.ledger().sbs.push(sb);
            sh.ack("create_e2b");
        }
        None => sh.miss("create_e2b"),
    }
}

/// What a command started through envd in sandbox `id` prints for
/// `$CHAOS_ENV` (its stdout, trimmed).
async fn envd_env(sh: &Shared, id: &str, token: &str) -> Result<String, String> {
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", format!("echo ${CHAOS_ENV}")], "envs": {}}});
    let b = serde_json::to_vec(&msg).map_err(|e| e.to_string())?;
    let mut body = vec![0u8];
    body.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
    body.extend_from_slice(&b);
    let r =
        sh.d.api
            .client()
            .post(format!("{}/process.Process/Start", sh.d.url))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
            .header("content-type", "application/connect+json")
            .body(body)
            .send()
            .await
            .map_err(|e| crate::error_chain(&e))?;
    let status = r.status().as_u16();
    let bytes = r.bytes().await.map_err(|e| crate::error_chain(&e))?;
    if status != 200 {
        return Err(format!(
            "envd Start: {status} {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    // Connect envelopes: flags (1 byte), length (4, big endian), JSON.
    use base64::Engine as _;
    let mut out = Vec::new();
    let mut rest = &bytes[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let Some(msg) = rest.get(5..5 + len) else {
            break;
        };
        let v: Value = serde_json::from_slice(msg).unwrap_or(Value::Null);
        if rest[0] & 2 != 0 && v.get("error").is_some() {
            return Err(format!("envd Start ended with {v}"));
        }
        if let Some(o) = v["event"]["data"]["stdout"].as_str() {
            if let Ok(d) = base64::engine::general_purpose::STANDARD.decode(o) {
                out.extend_from_slice(&d);
            }
        }
        rest = &rest[5 + len..];
    }
    Ok(String::from_utf8_lossy(&out).trim().to_owned())
}

async fn one_op(sh: &Shared, rng: &mut Rng, op: &str, id: &str) {
    let api = &sh.d.api;
    match op {
        "write" => {
            let n = sh.counter.fetch_add(1, Ordering::SeqCst) + 1;
            let script = format!("echo {n} > /dev/shm/m && echo {n} > /root/m && sync");
            let r = api.exec_output(id, &["sh", "-c", &script]).await;
            let mut l = sh.ledger();
            let Some(s) = l.get(id) else { return };
            match r {
                Ok((0, _)) => {
                    s.marker = Range::exact(n);
                    drop(l);
                    sh.ack("write");
                }
                _ => {
                    s.marker = s.marker.hull(Range::exact(n));
                    drop(l);
                    sh.miss("write");
                }
            }
        }
        "exec" => match api.exec_output(id, &["uname", "-r"]).await {
            Ok((0, _)) => sh.ack("exec"),
            _ => sh.miss("exec"),
        },
        "snapshot" => {
            let before = sh.ledger().get(id).map(|s| s.marker);
            let r = api
                .json(
                    Method::POST,
                    &format!("/v1/sandboxes/{id}/snapshots"),
                    Some(json!({})),
                )
                .await;
            match r {
                Ok((201, v)) => {
                    if let (Some(sid), Some(marker)) = (id_of(&v), before) {
                        if let Some(s) = sh.ledger().get(id) {
                            s.snaps.push(Snap { id: sid, marker });
                        }
                        sh.ack("snapshot");
                    }
                }
                _ => sh.miss("snapshot"),
            }
        }
        "fork" => {
            let (from_snap, marker) = {
                let mut l = sh.ledger();
                let Some(s) = l.get(id) else { return };
                match (rng.below(2), rng.pick(&s.snaps)) {
                    (0, Some(snap)) => (Some(snap.id.clone()), snap.marker),
                    _ => (None, s.marker),
                }
            };
            if !sh.ledger().reserve(sh.cfg.max_sandboxes) {
                return;
            }
            let path = match &from_snap {
                Some(sid) => format!("/v1/snapshots/{sid}/fork"),
                None => format!("/v1/sandboxes/{id}/fork"),
            };
            match api.json(Method::POST, &path, Some(json!({}))).await {
                Ok((201, v)) => {
                    if let Some(child) = id_of(&v) {
                        let mut sb = Sb::new(child, marker);
                        // A fork's policy: not the client's to judge.
                        sb.policies.clear();
                        sh.ledger().sbs.push(sb);
                        sh.ack("fork");
                    }
                }
                _ => sh.miss("fork"),
            }
            sh.ledger().pending -= 1;
        }
        "rewind" => {
            let target = {
                let mut l = sh.ledger();
                let Some(s) = l.get(id) else { return };
                let Some(snap) = rng.pick(&s.snaps).cloned() else {
                    return;
                };
                s.marker = s.marker.hull(snap.marker);
                snap
            };
            let r = api
                .json(
                    Method::POST,
                    &format!("/v1/sandboxes/{id}/rewind"),
                    Some(json!({ "to": target.id })),
                )
                .await;
            match r {
                Ok((200, v)) => {
                    let mut l = sh.ledger();
                    if let Some(s) = l.get(id) {
                        let before = s.marker;
                        s.marker = target.marker;
                        if let Some(pre) = v["pre_rewind_snapshot"].as_str() {
                            s.snaps.push(Snap {
                                id: pre.to_owned(),
                                marker: before,
                            });
                        }
                    }
                    drop(l);
                    sh.ack("rewind");
                }
                _ => sh.miss("rewind"),
            }
        }
        "hibernate" => {
            let r = api
                .json(
                    Method::POST,
                    &format!("/v1/sandboxes/{id}/hibernate"),
                    Some(json!({})),
                )
                .await;
            match r {
                Ok((200, _)) => {
                    sh.ack("hibernate");
                    // The next exec wakes it.
                    match api.exec_output(id, &["true"]).await {
                        Ok((0, _)) => sh.ack("wake"),
                        _ => sh.miss("wake"),
                    }
                }
                _ => sh.miss("hibernate"),
            }
        }
        "pause" => {
            let r = api
                .json(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
                .await;
            if !matches!(r, Ok((200, _))) {
                sh.miss("pause");
                return;
            }
            sh.ack("pause");
            tokio::time::sleep(Duration::from_millis(rng.below(500) as u64)).await;
            match api
                .json(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
                .await
            {
                Ok((200, _)) => sh.ack("resume"),
                _ => sh.miss("resume"),
            }
        }
        "policy" => {
            let n = sh.counter.fetch_add(1, Ordering::SeqCst) + 1;
            let text = policy_text(n);
            if let Some(s) = sh.ledger().get(id) {
                if !s.policies.is_empty() {
                    s.policies.push(Some(text.clone()));
                }
            }
            let r = api
                .raw(
                    Method::PUT,
                    &format!("/v1/sandboxes/{id}/policy"),
                    text.clone().into_bytes(),
                )
                .await;
            match r {
                Ok((200, _)) => {
                    if let Some(s) = sh.ledger().get(id) {
                        s.policies = vec![Some(text)];
                    }
                    sh.ack("policy");
                }
                _ => sh.miss("policy"),
            }
        }
        "delete" => {
            if let Some(s) = sh.ledger().get(id) {
                s.maybe_deleted = true;
            }
            match api
                .json(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                .await
            {
                Ok((200, _)) => {
                    if let Some(s) = sh.ledger().get(id) {
                        s.deleted = true;
                    }
                    sh.ack("delete");
                }
                _ => sh.miss("delete"),
            }
        }
        _ => {}
    }
}

fn policy_text(n: u64) -> String {
    format!("[[rule]]\nid = \"chaos-{n}\"\neffect = \"deny\"\nprogram = \"chaos-never-{n}\"\n")
}

// ------------------------------------------------------------------ judge

/// Checks every invariant (see the module doc); `all` restores every
/// acknowledged snapshot instead of a sample. Clients are held.
async fn judge(sh: &Shared, all: bool) -> Result<(), String> {
    let api = &sh.d.api;
    let mut rng = Rng::new(sh.cfg.seed ^ sh.counter.load(Ordering::SeqCst));
    // 0. Let the daemon finish what recovery started (nothing `creating`).
    let t = Instant::now();
    let listed = loop {
        let (s, v) = api
            .json(Method::GET, "/v1/sandboxes?limit=1000", None)
            .await
            .map_err(|e| format!("list sandboxes: {}", crate::error_chain(&e)))?;
        if s != 200 {
            return Err(format!("list sandboxes: {s} {v}"));
        }
        let items: Vec<Value> = v["items"].as_array().cloned().unwrap_or_default();
        let settling = items.iter().any(|s| s["state"] == "creating");
        if !settling || t.elapsed() > Duration::from_secs(60) {
            break items;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let by_id: BTreeMap<String, Value> = listed
        .iter()
        .filter_map(|s| Some((s["id"].as_str()?.to_owned(), s.clone())))
        .collect();

    // 1. Acknowledged sandboxes listed, in a usable state; deletes stay.
    let ledger: Vec<Sb> = sh.ledger().sbs.clone();
    for s in &ledger {
        let rec = by_id.get(&s.id);
        let state = rec.and_then(|r| r["state"].as_str()).unwrap_or("absent");
        if s.deleted {
            if !matches!(state, "absent" | "deleted") {
                return Err(format!(
                    "{} was deleted (acknowledged) but is {state}",
                    s.id
                ));
            }
        } else if s.maybe_deleted && matches!(state, "absent" | "deleted") {
            if let Some(x) = sh.ledger().get(&s.id) {
                x.deleted = true;
            }
        } else if !matches!(state, "running" | "paused" | "hibernated") {
            return Err(format!(
                "acknowledged sandbox {} is {state} after recovery: {}",
                s.id,
                rec.cloned().unwrap_or(Value::Null)
            ));
        }
        sh.checked(1);
    }

    // Sandboxes of operations never acknowledged (a create or fork the
    // daemon finished or kept after the client lost its answer): they
    // answered, or recovery would have left them failed above; deleted
    // here so the host's room stays bounded. Their parts are judged below
    // once they are gone.
    for (id, r) in &by_id {
        if r["state"] != "deleted" && !ledger.iter().any(|s| &s.id == id) {
            let (st, v) = api
                .json(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                .await
                .map_err(|e| crate::error_chain(&e))?;
            if st != 200 {
                return Err(format!(
                    "unacknowledged sandbox {id} does not delete: {st} {v}"
                ));
            }
        }
    }

    // 2. Each live one answers, with its markers in range; 3. its policy.
    let live: Vec<Sb> = sh.ledger().live().cloned().collect();
    for s in &live {
        if by_id.get(&s.id).is_some_and(|r| r["state"] == "paused") {
            let (st, v) = api
                .json(
                    Method::POST,
                    &format!("/v1/sandboxes/{}/resume", s.id),
                    None,
                )
                .await
                .map_err(|e| crate::error_chain(&e))?;
            if st != 200 {
                return Err(format!("{} paused and does not resume: {st} {v}", s.id));
            }
        }
        let m = markers(sh, &s.id).await?;
        if !s.marker.holds(m.0) || m.0 != m.1 {
            return Err(format!(
                "{}: markers disk {} memory {}, expected equal in {:?}",
                s.id, m.0, m.1, s.marker
            ));
        }
        if let Some(x) = sh.ledger().get(&s.id) {
            x.marker = Range::exact(m.0);
            x.maybe_deleted = false;
        }
        if !s.policies.is_empty() {
            let (st, v) = api
                .json(Method::GET, &format!("/v1/sandboxes/{}/policy", s.id), None)
                .await
                .map_err(|e| crate::error_chain(&e))?;
            let toml = v["toml"].as_str().map(str::to_owned);
            let toml = toml.filter(|t| !t.trim().is_empty());
            if st != 200 || !s.policies.contains(&toml) {
                return Err(format!(
                    "{}: stored policy {st} {toml:?}, expected one of {:?}",
                    s.id, s.policies
                ));
            }
            if let Some(x) = sh.ledger().get(&s.id) {
                x.policies = vec![toml];
            }
            sh.checked(1);
        }
        if let Some((token, want)) = &s.e2b_env {
            let got = envd_env(sh, &s.id, token).await?;
            if &got != want {
                return Err(format!(
                    "{}: ${CHAOS_ENV} through envd is {got:?}, the create stored {want:?}",
                    s.id
                ));
            }
            sh.checked(1);
            sh.report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .envs_checked += 1;
        }
        sh.checked(2);
    }

    // 4. Acknowledged snapshots restore.
    let mut snaps: Vec<(String, Snap)> = live
        .iter()
        .flat_map(|s| s.snaps.iter().map(move |x| (s.id.clone(), x.clone())))
        .collect();
    if !all {
        let mut sample = Vec::new();
        for _ in 0..sh.cfg.sample.min(snaps.len()) {
            let i = rng.below(snaps.len());
            sample.push(snaps.swap_remove(i));
        }
        snaps = sample;
    }
    for (owner, snap) in &snaps {
        let (st, v) = api
            .json(
                Method::POST,
                &format!("/v1/snapshots/{}/fork", snap.id),
                Some(json!({})),
            )
            .await
            .map_err(|e| crate::error_chain(&e))?;
        let child = match (st, id_of(&v)) {
            (201, Some(c)) => c,
            _ => {
                return Err(format!(
                    "acknowledged snapshot {} of {owner} does not restore: {st} {v}",
                    snap.id
                ))
            }
        };
        let m = markers(sh, &child).await;
        let del = api
            .json(Method::DELETE, &format!("/v1/sandboxes/{child}"), None)
            .await;
        let m = m?;
        if !snap.marker.holds(m.0) || m.0 != m.1 {
            return Err(format!(
                "snapshot {} of {owner} restored with markers disk {} memory {}, expected equal in {:?}",
                snap.id, m.0, m.1, snap.marker
            ));
        }
        if !matches!(del, Ok((200, _))) {
            return Err(format!("delete of the restore check {child}: {del:?}"));
        }
        if let Some(x) = sh.ledger().get(owner) {
            if let Some(y) = x.snaps.iter_mut().find(|y| y.id == snap.id) {
                y.marker = Range::exact(m.0);
            }
        }
        sh.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restores_checked += 1;
        sh.checked(1);
    }

    // 5. Parts ⇔ records, from the host's own tables.
    parts(sh).await
}

/// `(disk, memory)` markers of `id` (0: none), answered within the exec
/// bound. A typed error (e.g. `agent_error` while a killed agent's
/// connection is found silent and reopened) is retried until the bound:
/// the invariant is that the sandbox answers, not that no call ever fails.
async fn markers(sh: &Shared, id: &str) -> Result<(u64, u64), String> {
    let script = "cat /root/m 2>/dev/null || echo 0; cat /dev/shm/m 2>/dev/null || echo 0";
    let t = Instant::now();
    loop {
        let left = sh.cfg.exec_bound.saturating_sub(t.elapsed());
        let r = tokio::time::timeout(left, sh.d.api.exec_output(id, &["sh", "-c", script])).await;
        let err = match r {
            Err(_) => "no answer".to_owned(),
            Ok(Err(e)) => format!("exec: {}", crate::error_chain(&e)),
            Ok(Ok((0, out))) => {
                let v: Vec<u64> = out
                    .split_whitespace()
                    .map(|w| w.parse().unwrap_or(u64::MAX))
                    .collect();
                return match v.as_slice() {
                    [d, m] => Ok((*d, *m)),
                    _ => Err(format!("{id}: marker read said {out:?}")),
                };
            }
            Ok(Ok((c, out))) => format!("marker read exited {c}: {out}"),
        };
        if t.elapsed() + Duration::from_millis(250) >= sh.cfg.exec_bound {
            return Err(format!(
                "{id} does not answer an exec within {} s: {err}",
                sh.cfg.exec_bound.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Subvolume paths of the pool, relative to its root (`btrfs subvolume list`).
fn subvolumes(pool: &Path) -> Result<Vec<String>, String> {
    let out = Command::new("btrfs")
        .args(["subvolume", "list"])
        .arg(pool)
        .output()
        .map_err(|e| format!("btrfs subvolume list: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "btrfs subvolume list {}: {}",
            pool.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(" path ").nth(1).map(str::to_owned))
        .collect())
}

/// Backing files of the host's loop devices (`/sys/block/loop*/loop/backing_file`).
fn loop_backings() -> Vec<String> {
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).ok())
        .map(|s| s.trim().to_owned())
        .collect()
}

async fn parts(sh: &Shared) -> Result<(), String> {
    let api = &sh.d.api;
    let (_, v) = api
        .json(Method::GET, "/v1/sandboxes?limit=1000", None)
        .await
        .map_err(|e| crate::error_chain(&e))?;
    let items: Vec<Value> = v["items"].as_array().cloned().unwrap_or_default();
    let mut live_sb: BTreeMap<String, Value> = BTreeMap::new();
    for s in items {
        let st = s["state"].as_str().unwrap_or("");
        if st != "deleted" {
            if let Some(id) = s["id"].as_str() {
                live_sb.insert(id.to_owned(), s.clone());
            }
        }
    }
    // QEMUs ⇔ running/paused records.
    let qemus = qemu_pids(&sh.d.run_dir);
    for (name, pid) in &qemus {
        let ok = live_sb.get(name).is_some_and(|r| {
            matches!(r["state"].as_str(), Some("running" | "paused"))
                && r["pid"].as_u64() == Some(u64::from(*pid))
        });
        if !ok {
            return Err(format!(
                "QEMU {pid} ({name}) runs without a record that owns it: {}",
                live_sb.get(name).cloned().unwrap_or(Value::Null)
            ));
        }
    }
    for (id, r) in &live_sb {
        if matches!(r["state"].as_str(), Some("running" | "paused")) {
            let pid = r["pid"].as_u64().unwrap_or(0);
            if !qemus.iter().any(|(n, p)| n == id && u64::from(*p) == pid) {
                return Err(format!("{id} is {} but has no QEMU: {r}", r["state"]));
            }
        }
    }
    sh.checked(qemus.len() as u64 + live_sb.len() as u64);

    // Subvolumes ⇔ sandbox and snapshot records.
    let pool = sh.d.data_dir.join("pool");
    let subs = subvolumes(&pool)?;
    let mut snap_records: BTreeMap<String, Value> = BTreeMap::new();
    for id in live_sb.keys() {
        let (st, v) = api
            .json(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"), None)
            .await
            .map_err(|e| crate::error_chain(&e))?;
        if st != 200 {
            continue; // deleted between the two listings
        }
        for s in v["items"].as_array().cloned().unwrap_or_default() {
            if let Some(sid) = s["id"].as_str() {
                snap_records.insert(sid.to_owned(), s.clone());
            }
        }
    }
    for s in &subs {
        if let Some(id) = s.strip_prefix("sandboxes/") {
            if !id.contains('/') && !live_sb.contains_key(id) {
                return Err(format!("subvolume {s} without a sandbox record"));
            }
        } else if let Some(id) = s.strip_prefix("snapshots/") {
            if id.contains('/') || snap_records.contains_key(id) {
                continue;
            }
            let (st, v) = api
                .json(Method::GET, &format!("/v1/snapshots/{id}"), None)
                .await
                .map_err(|e| crate::error_chain(&e))?;
            if st != 200 {
                return Err(format!("subvolume {s} without a snapshot record: {st} {v}"));
            }
        }
    }
    for (id, r) in &live_sb {
        if !subs.iter().any(|s| s == &format!("sandboxes/{id}")) {
            return Err(format!("sandbox {id} ({}) has no subvolume", r["state"]));
        }
    }
    for (id, r) in &snap_records {
        if r["status"] == "ready"
            && r["same_as"].is_null()
            && !subs.iter().any(|s| s == &format!("snapshots/{id}"))
        {
            return Err(format!("ready snapshot {id} has no subvolume: {r}"));
        }
    }
    sh.checked((subs.len() + snap_records.len()) as u64);

    // Loop devices under the root: the pool image alone.
    let root = sh.d.root.to_string_lossy().into_owned();
    let image =
        sh.d.data_dir
            .join("pool.img")
            .to_string_lossy()
            .into_owned();
    let loops: Vec<String> = loop_backings()
        .into_iter()
        .filter(|b| b.starts_with(&root))
        .collect();
    if loops.iter().any(|b| *b != image) || loops.len() > 1 {
        return Err(format!("loop devices under {root}: {loops:?}"));
    }
    // No process but the daemon and its QEMUs names its directories
    // (helpers, proxies, tunnels all live in the daemon).
    let daemon = sh.d.pid();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if Some(pid) == daemon || qemus.iter().any(|(_, p)| *p == pid) || !alive(pid) {
            continue;
        }
        let line = cmdline(pid);
        if line.contains(&root) && !line.contains("btrfs subvolume list") {
            return Err(format!(
                "process {pid} names {root} without an owner: {line}"
            ));
        }
    }
    sh.checked(2);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rng_replays_from_its_seed() {
        let a: Vec<u64> = {
            let mut r = Rng::new(42);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(42);
        assert_eq!(a, (0..5).map(|_| r.next_u64()).collect::<Vec<_>>());
        assert!(r.below(3) < 3);
        let d = r.between(Duration::from_secs(1), Duration::from_secs(2));
        assert!(d >= Duration::from_secs(1) && d <= Duration::from_secs(2));
    }

    #[test]
    fn a_kill_widens_a_marker_to_its_snapshots() {
        let mut s = Sb::new("sb".into(), Range::exact(7));
        s.snaps.push(Snap {
            id: "a".into(),
            marker: Range::exact(3),
        });
        s.widen();
        assert!(s.marker.holds(3) && s.marker.holds(7) && !s.marker.holds(8));
    }
}
