//! The `savevm` peer: a stock-QEMU guest booted from the same image, root disk
//! converted to qcow2, RAM as plain anonymous memory, driven through its agent.
//! Its QEMU is killed on every path: explicitly, in `Drop`, and on Ctrl-C.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::{json, Value};
use strata_core::Accel;
use strata_proto::client::{AgentClient, ExecRequest};
use strata_vmm::{DiskFormat, QemuDriver, QemuVm, RamBacking, ResolvedAccel, Vm, VmSpec};

use crate::ctx::Ctx;

/// How long a cold boot of the peer may take to agent-ready (TCG on a busy host).
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
/// Upper bound of one `savevm` / `delvm`.
const SAVEVM_TIMEOUT: Duration = Duration::from_secs(300);

/// A running peer VM.
pub struct PeerVm {
    vm: Option<QemuVm>,
    pid: u32,
    /// The agent of the guest.
    pub agent: AgentClient,
    /// The qcow2 root disk.
    pub disk: PathBuf,
    watchdog: tokio::task::JoinHandle<()>,
    _run: tempfile::TempDir,
}

impl PeerVm {
    /// Converts the image's root disk to qcow2 at `disk`, cold-boots it with
    /// `memory_mib` of anonymous RAM and 1 vCPU, and waits for its agent.
    pub async fn boot(ctx: &Ctx, memory_mib: u64, disk: &Path) -> Result<PeerVm> {
        let image = strata_runtime::load_image(&ctx.image).map_err(|e| anyhow!("{e}"))?;
        let o = OsStr::new;
        qemu_img(&[
            o("convert"),
            o("-O"),
            o("qcow2"),
            image.rootfs.as_os_str(),
            disk.as_os_str(),
        ])
        .await?;
        let accel = match ctx.accel {
            Accel::Kvm => ResolvedAccel::Kvm,
            _ => ResolvedAccel::Tcg,
        };
        let kernel = match (accel, &image.kernel_pvh) {
            (ResolvedAccel::Tcg, Some(pvh)) => pvh.clone(),
            _ => image.kernel.clone(),
        };
        let run = tempfile::Builder::new()
            .prefix("stb-peer-")
            .tempdir_in("/tmp")
            .context("peer run dir")?;
        let mut spec = VmSpec::new(
            format!("savevm-peer-{memory_mib}"),
            run.path(),
            kernel,
            run.path().join("unused-mem"),
            disk,
        );
        spec.initrd = Some(image.initrd.clone());
        spec.cmdline = image.cmdline.clone();
        spec.memory_mib = memory_mib;
        spec.vcpus = 1;
        spec.accel = accel;
        spec.ram = RamBacking::Anonymous;
        spec.disk_format = DiskFormat::Qcow2;
        spec.qemu_binary = ctx.qemu.clone();
        let vm = QemuDriver::new()
            .start_vm(&spec)
            .await
            .map_err(|e| anyhow!("start the savevm peer: {e}"))?;
        let pid = vm.pid();
        // Ctrl-C: the harness's own handler tears down the runtimes and exits;
        // this kills the peer (a QEMU in its own session) alongside.
        let watchdog = tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                kill_pid(pid);
            }
        });
        let socket = vm.agent_socket();
        let agent = match AgentClient::connect_unix(&socket, BOOT_TIMEOUT).await {
            Ok(a) => a,
            Err(e) => {
                watchdog.abort();
                let tail = vm.console_tail(600);
                let _ = vm.kill().await;
                bail!("the savevm peer's agent: {e}; console: {tail}");
            }
        };
        Ok(PeerVm {
            vm: Some(vm),
            pid,
            agent,
            disk: disk.to_path_buf(),
            watchdog,
            _run: run,
        })
    }

    /// Runs a shell script in the guest; its stdout (an error if it fails).
    pub async fn sh(&self, script: &str) -> Result<String> {
        sh(&self.agent, script).await
    }

    /// `savevm <tag>`: returns the wall time of the command in ms (the VM is
    /// stopped for all of it).
    pub async fn savevm(&self, tag: &str) -> Result<f64> {
        let t0 = Instant::now();
        self.hmp(&format!("savevm {tag}")).await?;
        Ok(t0.elapsed().as_secs_f64() * 1000.0)
    }

    /// `delvm <tag>`.
    pub async fn delvm(&self, tag: &str) -> Result<()> {
        self.hmp(&format!("delvm {tag}")).await
    }

    /// QEMU's run state (`query-status`).
    pub async fn status(&self) -> Result<String> {
        let v = self.qmp("query-status", None).await?;
        v.get("status")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("query-status: {v}"))
    }

    async fn qmp(&self, cmd: &str, args: Option<Value>) -> Result<Value> {
        let vm = self.vm.as_ref().ok_or_else(|| anyhow!("peer is gone"))?;
        vm.qmp_client()
            .execute_with_timeout(cmd, args, SAVEVM_TIMEOUT)
            .await
            .map_err(|e| anyhow!("peer QMP {cmd}: {e}"))
    }

    async fn hmp(&self, line: &str) -> Result<()> {
        let v = self
            .qmp(
                "human-monitor-command",
                Some(json!({ "command-line": line })),
            )
            .await?;
        // HMP reports failures as text, not as a QMP error.
        match v.as_str() {
            Some(s) if s.trim().is_empty() => Ok(()),
            Some(s) => bail!("{line}: {}", s.trim()),
            None => bail!("{line}: unexpected reply {v}"),
        }
    }

    /// Kills the QEMU and waits for it to be gone.
    pub async fn kill(mut self) {
        if let Some(vm) = self.vm.take() {
            let _ = vm.kill().await;
        }
    }
}

impl Drop for PeerVm {
    fn drop(&mut self) {
        self.watchdog.abort();
        if self.vm.take().is_some() {
            kill_pid(self.pid);
        }
    }
}

fn kill_pid(pid: u32) {
    // SAFETY: kill(2) on the pid of the peer QEMU this section started (its
    // handle is still held, so the pid has not been reaped and reused).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// Runs `script` with `/bin/sh -c` through `agent`; stdout, or an error with
/// stderr when it exits non-zero.
pub async fn sh(agent: &AgentClient, script: &str) -> Result<String> {
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .map_err(|e| anyhow!("guest exec: {e}"))?;
    if !out.status.success() {
        bail!(
            "guest command failed ({:?}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The `vm-state-size` of internal snapshot `tag` in a qcow2 image (read while
/// the VM runs, with `-U`): the RAM + device state `savevm` wrote.
pub async fn vmstate_bytes(disk: &Path, tag: &str) -> Result<u64> {
    let o = OsStr::new;
    let out = qemu_img(&[o("info"), o("-U"), o("--output=json"), disk.as_os_str()]).await?;
    let v: Value = serde_json::from_slice(&out).context("qemu-img info output")?;
    parse_vmstate(&v, tag)
}

/// Runs `qemu-img ARGS`: its stdout, or an error with its stderr when it
/// fails (both name the subcommand, `ARGS[0]`).
async fn qemu_img(args: &[&OsStr]) -> Result<Vec<u8>> {
    let sub = args
        .first()
        .map(|a| a.to_string_lossy())
        .unwrap_or_default();
    let out = tokio::process::Command::new("qemu-img")
        .args(args)
        .output()
        .await
        .with_context(|| format!("run qemu-img {sub}"))?;
    if !out.status.success() {
        bail!(
            "qemu-img {sub}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// `vm-state-size` of snapshot `tag` in `qemu-img info --output=json` output.
pub fn parse_vmstate(info: &Value, tag: &str) -> Result<u64> {
    info.get("snapshots")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .find(|s| s.get("name").and_then(Value::as_str) == Some(tag))
        })
        .and_then(|s| s.get("vm-state-size"))
        .and_then(Value::as_u64)
        .ok_or_else(|| anyhow!("no snapshot {tag:?} with a vm-state-size in the qcow2"))
}
