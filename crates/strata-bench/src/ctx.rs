//! What every section gets: the run's settings, and environments to measure
//! in — a strata runtime on its own loop-mounted btrfs pool, or a whole
//! stratad daemon served on a loopback port — that are torn down (VMs killed,
//! pool unmounted) when dropped, at process exit, and on Ctrl-C. The API
//! client, the server and the teardown of a daemon's directories are
//! `strata_testkit`'s.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context as _, Result};
use strata_core::{Accel, SandboxSize, TemplateId};
use strata_runtime::{PoolSetting, Runtime, RuntimeConfig, StateSigner};
use strata_storage::testing::TestPool;
use strata_testkit::{Api, Served};
use stratad::App;

/// Settings shared by all sections.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The run's output folder (report, plots).
    pub out: PathBuf,
    /// Guest image directory.
    pub image: PathBuf,
    /// Accelerator the guests run under.
    pub accel: Accel,
    /// QEMU binary.
    pub qemu: PathBuf,
    /// CI smoke size: every count at its minimum.
    pub smoke: bool,
}

impl Ctx {
    /// Path of an output file (plots are `<section key>-<name>.svg`).
    pub fn file(&self, name: &str) -> PathBuf {
        self.out.join(name)
    }
}

// ------------------------------------------------------------ teardown

type Teardown = Box<dyn FnOnce() + Send>;

static TEARDOWN: Mutex<Vec<(u64, Teardown)>> = Mutex::new(Vec::new());
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn register(f: Teardown) -> u64 {
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    TEARDOWN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((k, f));
    k
}

fn run_one(key: u64) {
    let f = {
        let mut v = TEARDOWN.lock().unwrap_or_else(|p| p.into_inner());
        v.iter().position(|(k, _)| *k == key).map(|i| v.remove(i).1)
    };
    if let Some(f) = f {
        f();
    }
}

/// Runs every pending teardown (newest first). Called at exit and on Ctrl-C;
/// safe to call more than once.
pub fn teardown_all() {
    strata_testkit::chaos::teardown_all();
    let all = std::mem::take(&mut *TEARDOWN.lock().unwrap_or_else(|p| p.into_inner()));
    for (_, f) in all.into_iter().rev() {
        f();
    }
}

// ------------------------------------------------------------ runtime env

/// A strata runtime under the run's accelerator on its own pool.
pub struct BenchRuntime {
    /// The runtime.
    pub rt: Arc<Runtime>,
    key: u64,
    pool_dir: PathBuf,
    _run: tempfile::TempDir,
}

impl BenchRuntime {
    /// A runtime with a fresh sparse pool of `pool_gib` GiB under `/tmp` and
    /// a run dir `/tmp/<prefix>…`; `tweak` edits the configuration first.
    pub async fn start(
        ctx: &Ctx,
        prefix: &str,
        pool_gib: u64,
        tweak: impl FnOnce(&mut RuntimeConfig),
    ) -> Result<BenchRuntime> {
        let pool = TestPool::new(pool_gib << 30).context("create the btrfs pool")?;
        let run = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .context("run dir")?;
        let mut cfg = RuntimeConfig {
            accel: ctx.accel,
            qemu_binary: ctx.qemu.clone(),
            ..RuntimeConfig::new(
                PoolSetting::Path(pool.root().to_path_buf()),
                run.path().to_path_buf(),
                ctx.image.clone(),
            )
        };
        // States are signed and checked as the daemon does by default (a key
        // of this run), so pauses and restores include what signing costs.
        let signer = StateSigner::from_seed(&rand::random::<[u8; 32]>())
            .map_err(|e| anyhow!("a signing key for the run: {e:?}"))?;
        cfg.signing = Some(Arc::new(signer));
        tweak(&mut cfg);
        let pool_dir = pool.dir().to_path_buf();
        let rt = Runtime::open(cfg).await.context("open the runtime")?;
        let rt2 = rt.clone();
        let pool = Mutex::new(Some(pool));
        let key = register(Box::new(move || {
            rt2.kill_all();
            std::thread::sleep(Duration::from_millis(300));
            drop(pool.lock().unwrap_or_else(|p| p.into_inner()).take());
        }));
        Ok(BenchRuntime {
            rt,
            key,
            pool_dir,
            _run: run,
        })
    }

    /// Builds a template of `size` (one cold boot); returns it and the boot time in ms.
    pub async fn template(&self, size: SandboxSize) -> Result<(TemplateId, f64)> {
        let tpl = TemplateId::generate();
        let built = self
            .rt
            .build_template(&tpl, size, &|_| {})
            .await
            .with_context(|| format!("build a template of {size:?}"))?;
        Ok((tpl, built.boot_ms))
    }

    /// The directory holding the pool image (`pool.img`) and its mount (`mnt`).
    pub fn pool_dir(&self) -> &Path {
        &self.pool_dir
    }

    /// Kills the VMs and unmounts the pool now.
    pub fn stop(self) {
        run_one(self.key);
    }
}

impl Drop for BenchRuntime {
    fn drop(&mut self) {
        run_one(self.key);
    }
}

// ------------------------------------------------------ control plane env

/// The configuration of an in-process daemon without VMs (the control-plane
/// sections): data and keys in a scratch dir `/tmp/<prefix>…` (removed when
/// the returned dir drops), no per-token rate limit (one client measuring
/// back to back would measure the limiter), its data dir created.
pub fn control_plane_config(prefix: &str) -> Result<(tempfile::TempDir, stratad::config::Config)> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .context("scratch dir")?;
    let mut cfg = stratad::config::Config {
        data_dir: dir.path().join("data"),
        key_dir: dir.path().join("keys"),
        ..stratad::config::Config::default()
    };
    cfg.security.rate_limit_per_second = 1e9;
    cfg.security.rate_limit_burst = u32::MAX;
    std::fs::create_dir_all(&cfg.data_dir).context("data dir")?;
    Ok((dir, cfg))
}

// ------------------------------------------------------------ daemon env

/// A stratad daemon (the real runtime underneath) served on a loopback port,
/// with the bootstrap admin token.
pub struct BenchDaemon {
    /// The daemon.
    pub app: Arc<App>,
    /// Its runtime (for A/B switches such as
    /// [`Runtime::set_call_cpu_weight`]).
    pub rt: Arc<Runtime>,
    /// A client of its HTTP API.
    pub http: Api,
    /// Its data dir, run dir and pool live under here.
    pub root: PathBuf,
    key: u64,
    _served: Served,
}

impl BenchDaemon {
    /// Starts a daemon under `/tmp/<prefix>…`: pool of `pool_gib` GiB, no
    /// rolling snapshots, no idle hibernation and no rate limit unless `tweak` sets them,
    /// default sandbox size `size`. Builds the default template and waits
    /// for it.
    pub async fn start(
        ctx: &Ctx,
        prefix: &str,
        pool_gib: u64,
        size: SandboxSize,
        tweak: impl FnOnce(&mut stratad::config::Config),
    ) -> Result<BenchDaemon> {
        let root = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .context("daemon root")?
            .keep();
        let r2 = root.clone();
        let key = register(Box::new(move || {
            strata_testkit::teardown::remove_daemon_root(&r2)
        }));
        let mut cfg = stratad::config::Config {
            data_dir: root.join("data"),
            key_dir: root.join("keys"),
            run_dir: root.join("run"),
            image_dir: Some(ctx.image.clone()),
            accel: ctx.accel,
            qemu_binary: ctx.qemu.clone(),
            pool_size_gib: pool_gib,
            snapshot_interval: Duration::ZERO,
            idle_timeout: Duration::ZERO,
            default_size: size,
            // No warm guests unless a section asks (`tweak`): they change
            // what a create measures.
            pools: stratad::config::PoolsConfig {
                default_template: 0,
                ..Default::default()
            },
            ..stratad::config::Config::default()
        };
        // A benchmark measures the daemon, not its per-token rate limiter (50/s
        // by default, which a quiet machine's hibernated creates exceed).
        cfg.security.rate_limit_per_second = 1e9;
        cfg.security.rate_limit_burst = u32::MAX;
        // Nominal admission and no pressure-driven hibernation unless a
        // section asks (`density`'s load): they would move other sections'
        // figures with the host's load.
        cfg.capacity.admission = stratad::config::AdmissionMode::Nominal;
        cfg.pressure.enabled = false;
        tweak(&mut cfg);
        let data_dir = cfg.data_dir.clone();
        let engine = stratad::daemon::open_engine(&cfg)
            .await
            .map_err(|e| anyhow!("open the engine: {e}"))?;
        let rt = engine.runtime().clone();
        let app = Arc::new(App::open(cfg, engine).map_err(|e| anyhow!("open the store: {e}"))?);
        app.start()
            .await
            .map_err(|e| anyhow!("start: {}", e.message()))?;
        let served = strata_testkit::serve(app.router()).await?;
        let http = Api::new(served.url.clone()).admin_token_of(&data_dir);
        let d = BenchDaemon {
            app,
            rt,
            http,
            root,
            key,
            _served: served,
        };
        d.app
            .service()
            .ensure_default_template()
            .await
            .map_err(|e| anyhow!("default template: {}", e.message()))?;
        loop {
            let (_, v) = d
                .http
                .json(reqwest::Method::GET, "/v1/templates/tpl-default", None)
                .await?;
            match v["status"].as_str() {
                Some("ready") => break,
                Some("building") => tokio::time::sleep(Duration::from_millis(200)).await,
                _ => return Err(anyhow!("default template: {v}")),
            }
        }
        Ok(d)
    }

    /// Stops the daemon's tasks, kills its VMs, unmounts its pool, removes its root.
    pub fn stop(self) {
        self.app.stop();
        run_one(self.key);
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        self.app.stop();
        run_one(self.key);
    }
}
