//! The guest side of the `history` section: the sandbox and its agent, the
//! few agent calls the loop makes (a shell script, a file read and upload,
//! the RAM counter, the disk-write counter), and the setup of the workload
//! in the guest (the repository and the wheels made on the host, the guest
//! scripts, the long-running counter).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use strata_core::{SandboxId, SandboxSize};
use strata_proto::client::{AgentClient, ExecRequest};
use strata_runtime::{Runtime, Source};

use super::workload::{self, GUEST_RAM_DIR, GUEST_REPO, GUEST_TOOLS, GUEST_WHEELS, GUEST_WORK};
use super::Args;
use crate::ctx::{BenchRuntime, Ctx};
use crate::stats::{fmt_bytes, fmt_ms};

/// Runs `script` with `sh -c` after `set -e`; stdout on success.
pub(super) async fn sh(agent: &AgentClient, script: &str) -> Result<String> {
    let out = agent
        .exec_collect(ExecRequest::shell(format!("set -e\n{script}")))
        .await
        .with_context(|| format!("exec {script:?}"))?;
    if !out.status.success() {
        bail!(
            "guest command failed ({:?}): {script}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(super) async fn read_text(agent: &AgentClient, path: &str) -> Result<String> {
    let mut dl = agent
        .read_file(path)
        .await
        .with_context(|| format!("read {path}"))?;
    let mut v = Vec::new();
    while let Some(c) = dl.next_chunk().await {
        v.extend_from_slice(&c.with_context(|| format!("read {path}"))?);
    }
    Ok(String::from_utf8_lossy(&v).into_owned())
}

pub(super) async fn write_bytes(agent: &AgentClient, path: &str, data: &[u8]) -> Result<()> {
    agent
        .write_file(path, None, data)
        .await
        .with_context(|| format!("upload {path}"))?;
    Ok(())
}

/// The long-running process's counter and its pid.
pub(super) async fn counter(agent: &AgentClient) -> Result<(u64, u32)> {
    workload::parse_counter(&read_text(agent, &format!("{GUEST_RAM_DIR}/counter")).await?)
}

/// Bytes the guest kernel has written to its disk.
pub(super) async fn disk_written(agent: &AgentClient) -> Result<u64> {
    workload::disk_written_bytes(&read_text(agent, "/sys/block/vda/stat").await?)
}

/// The sandbox with the workload set up in it.
pub(super) struct Guest {
    /// The runtime and its pool.
    pub(super) env: BenchRuntime,
    /// `env`'s runtime.
    pub(super) rt: Arc<Runtime>,
    /// The sandbox.
    pub(super) id: SandboxId,
    /// Its agent.
    pub(super) agent: AgentClient,
    /// The guest command printing the workspace checksum.
    pub(super) checksum_cmd: String,
    /// Pid of the long-running counter process.
    pub(super) counter_pid: u32,
    /// Its counter when set up.
    pub(super) first_counter: u64,
    /// Guest disk writes when set up, bytes.
    pub(super) written0: u64,
    /// Source files of the repository (before later additions).
    pub(super) repo_files: usize,
    /// Commits of the repository, as git counted them.
    pub(super) commits: String,
    /// Wheels uploaded.
    pub(super) wheels: usize,
    /// Their bytes.
    pub(super) wheel_bytes: usize,
    _host: tempfile::TempDir,
}

/// Makes the repository and the wheels on the host, starts a runtime, a
/// template of `--history-mem` MiB and the sandbox, and sets the workload up
/// in it.
pub(super) async fn setup(ctx: &Ctx, args: &Args) -> Result<Guest> {
    // ---------------------------------------------------------------- host side
    let host = tempfile::Builder::new()
        .prefix("strata-bench-history-host-")
        .tempdir_in("/tmp")
        .context("host scratch dir")?;
    let repo_dir = host.path().join("repo");
    // Smoke size: a smaller repository (the clone dominates a smoke run's time).
    let (repo_files, repo_commits) = if ctx.smoke { (60, 3) } else { (300, 8) };
    let repo_tar = host.path().join("repo.tar");
    {
        let (d, t) = (repo_dir.clone(), repo_tar.clone());
        tokio::task::spawn_blocking(move || workload::make_repo(&d, &t, repo_files, repo_commits))
            .await
            .context("make the repository")??;
    }
    let wheels = workload::wheels();

    // ---------------------------------------------------------------- guest setup
    let env = BenchRuntime::start(ctx, "strata-bench-history-", 16, |_| {}).await?;
    let rt: Arc<Runtime> = env.rt.clone();
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: args.history_mem,
        disk_gib: 2,
    };
    let (tpl, boot_ms) = env.template(size).await?;
    eprintln!("history: template ready (cold boot {})", fmt_ms(boot_ms));
    let id = SandboxId::generate();
    rt.create(&id, &Source::Template(tpl), None)
        .await
        .context("create the sandbox")?;
    let agent = rt.agent(&id).await.context("agent")?;
    let t_setup = Instant::now();
    let site = sh(
        &agent,
        &format!(
            "mkdir -p {GUEST_WHEELS} {GUEST_TOOLS} {GUEST_WORK} {GUEST_RAM_DIR}\n\
             grep -q ' {GUEST_RAM_DIR} ' /proc/mounts || mount -t tmpfs -o size=8m tmpfs {GUEST_RAM_DIR}\n\
             python3 -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))'"
        ),
    )
    .await?
    .trim()
    .to_owned();
    let tar = tokio::fs::read(&repo_tar).await.context("read repo.tar")?;
    write_bytes(&agent, "/srv/repo.tar", &tar).await?;
    for (name, data) in &wheels {
        write_bytes(&agent, &format!("{GUEST_WHEELS}/{name}"), data).await?;
    }
    for (name, text) in [
        ("install.py", workload::INSTALLER_PY),
        ("counter.py", workload::COUNTER_PY),
        ("edit.py", workload::EDIT_PY),
    ] {
        write_bytes(&agent, &format!("{GUEST_TOOLS}/{name}"), text.as_bytes()).await?;
    }
    let commits = sh(
        &agent,
        &format!(
            "mkdir -p {GUEST_REPO} && tar -xf /srv/repo.tar -C {GUEST_REPO} && rm /srv/repo.tar\n\
             git -C {GUEST_REPO} rev-list --count HEAD\n\
             setsid python3 {GUEST_TOOLS}/counter.py </dev/null >/dev/null 2>&1 &\n\
             sync"
        ),
    )
    .await?;
    let mut first = None;
    for _ in 0..100 {
        if let Ok(c) = counter(&agent).await {
            first = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (first_counter, counter_pid) =
        first.ok_or_else(|| anyhow!("the long-running counter process did not start"))?;
    let written0 = disk_written(&agent).await?;
    let wheel_bytes: usize = wheels.iter().map(|w| w.1.len()).sum();
    eprintln!(
        "history: guest set up in {:.1} s: repo of {repo_files}+ files in {} commits ({}), {} wheels ({}), counter pid {counter_pid}, site-packages {site}",
        t_setup.elapsed().as_secs_f64(),
        commits.trim(),
        fmt_bytes(tar.len() as f64),
        wheels.len(),
        fmt_bytes(wheel_bytes as f64),
    );
    Ok(Guest {
        env,
        rt,
        id,
        agent,
        checksum_cmd: workload::checksum_cmd(&site),
        counter_pid,
        first_counter,
        written0,
        repo_files,
        commits: commits.trim().to_owned(),
        wheels: wheels.len(),
        wheel_bytes,
        _host: host,
    })
}
