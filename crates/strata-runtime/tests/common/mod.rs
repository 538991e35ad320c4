//! Shared by the runtime's integration tests: one tokio runtime per test
//! binary (every VM's QMP and agent tasks live on the runtime that started
//! them), a real btrfs pool, a short run dir, a runtime under TCG with one
//! template booted, and a teardown at process exit (after libtest is done,
//! pass or fail) that kills the binary's VMs and unmounts its pool.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_core::{SandboxId, SandboxSize, TemplateId};
use strata_proto::client::{AgentClient, ExecRequest};
use strata_runtime::{PoolSetting, Runtime, RuntimeConfig, Source};
use strata_storage::testing::TestPool;

/// The tokio runtime of this test binary (`strata_testkit::tokio_rt`).
pub fn tokio_rt() -> &'static tokio::runtime::Runtime {
    strata_testkit::tokio_rt()
}

/// What the exit-time teardown must stop.
type Live = (Arc<Runtime>, Arc<Mutex<Option<TestPool>>>);

static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

extern "C" fn teardown_all() {
    let all = std::mem::take(&mut *LIVE.lock().unwrap_or_else(|p| p.into_inner()));
    for (rt, pool) in all {
        rt.kill_all();
        std::thread::sleep(Duration::from_millis(300));
        drop(pool.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// A runtime on its own pool with one template booted.
pub struct TestRuntime {
    /// The runtime.
    pub rt: Arc<Runtime>,
    /// The template every sandbox of the test forks.
    pub template: TemplateId,
    _pool: Arc<Mutex<Option<TestPool>>>,
    _run: tempfile::TempDir,
}

impl TestRuntime {
    /// An 8 GiB pool, a run dir `/tmp/<prefix>…`, accel TCG, `tweak` applied to
    /// the configuration, and a template of `size` (one cold boot).
    pub fn start(prefix: &str, size: SandboxSize, tweak: impl FnOnce(&mut RuntimeConfig)) -> Self {
        Self::start_with_image(prefix, size, &strata_testkit::test_image().dir, tweak)
    }

    /// Like [`TestRuntime::start`], with the guest image in `image_dir`
    /// (e.g. one built around another release's agent).
    pub fn start_with_image(
        prefix: &str,
        size: SandboxSize,
        image_dir: &std::path::Path,
        tweak: impl FnOnce(&mut RuntimeConfig),
    ) -> Self {
        static ATEXIT: std::sync::Once = std::sync::Once::new();
        ATEXIT.call_once(|| {
            // SAFETY: registers a plain extern "C" fn without captures.
            unsafe { libc::atexit(teardown_all) };
        });
        let pool = TestPool::new(8 << 30).expect("test pool");
        let run = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in("/tmp")
            .expect("run dir");
        let mut cfg = RuntimeConfig {
            accel: strata_core::Accel::Tcg,
            ..RuntimeConfig::new(
                PoolSetting::Path(pool.root().to_path_buf()),
                run.path().to_path_buf(),
                image_dir.to_path_buf(),
            )
        };
        tweak(&mut cfg);
        let template = TemplateId::generate();
        let rt = tokio_rt().block_on(async {
            let rt = Runtime::open(cfg).await.expect("runtime");
            let built = rt
                .build_template(&template, size, &|s| eprintln!("template: {s}"))
                .await
                .expect("template build");
            eprintln!(
                "template built: boot {:.0} ms, total {:.0} ms",
                built.boot_ms, built.build_ms
            );
            rt
        });
        let pool = Arc::new(Mutex::new(Some(pool)));
        LIVE.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rt.clone(), pool.clone()));
        TestRuntime {
            rt,
            template,
            _pool: pool,
            _run: run,
        }
    }
}

/// A new sandbox from the test runtime's template.
pub async fn new_sandbox(t: &TestRuntime) -> SandboxId {
    let id = SandboxId::generate();
    t.rt.create(&id, &Source::Template(t.template.clone()), None)
        .await
        .expect("create from template");
    id
}

/// The agent of a new sandbox from the template (for suites that need one guest).
pub fn sandbox_agent(t: &TestRuntime) -> AgentClient {
    tokio_rt().block_on(async {
        let id = new_sandbox(t).await;
        t.rt.agent(&id).await.expect("agent")
    })
}

/// The guests' size in these tests: 1 vCPU, 256 MiB, a 2 GiB disk.
pub fn size() -> SandboxSize {
    SandboxSize {
        vcpus: 1,
        memory_mib: 256,
        disk_gib: 2,
    }
}

/// Runs `script` with `sh -c` in sandbox `id`'s guest; asserts it exits 0
/// and answers its standard output, trimmed.
pub async fn sh(rt: &Runtime, id: &SandboxId, script: &str) -> String {
    let agent = rt.agent(id).await.expect("agent");
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .expect("exec");
    assert_eq!(out.status.code, Some(0), "{script}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
