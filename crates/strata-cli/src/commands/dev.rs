//! `strata dev run -- CMD ARGS…`: cold-boot the guest image in a throwaway
//! microVM, run one command through the guest agent with its output streamed
//! to this terminal, print the timings, shut the VM down and exit with the
//! command's exit code. No daemon involved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Subcommand;
use serde_json::json;
use strata_core::Accel;
use strata_image::BuiltImage;
use strata_proto::{AgentClient, AgentError, ExecEvent, ExecRequest, RemoteErrorKind, Stdin};
use strata_vmm::{QemuDriver, QemuVm, ResolvedAccel, Vm as _, VmSpec};

use super::{read_stdin, CliError, Ctx, ProcessArgs};

/// `strata dev ...`
#[derive(Debug, Subcommand)]
pub enum DevCmd {
    /// Boot the image, run one command in it, shut it down.
    Run(RunArgs),
}

/// `strata dev run`
#[derive(Debug, clap::Args)]
#[command(
    mut_arg("env", |a| a.help("Environment variable for the command (repeatable)")),
    mut_arg("user", |a| a.help("User to run as in the guest (name or uid)"))
)]
pub struct RunArgs {
    /// Image directory (as printed by `strata image build`).
    #[arg(long, conflicts_with = "cache_dir")]
    pub image: Option<PathBuf>,
    /// Use the newest image of this cache [default: $STRATA_IMAGE_CACHE or /var/cache/strata/images].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Accelerator: auto probes KVM and falls back to TCG.
    #[arg(long, default_value = "auto")]
    pub accel: Accel,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(64..=262_144))]
    pub memory: u64,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub vcpus: u32,
    /// Keep the scratch directory (disk copy, console log) after the run.
    #[arg(long)]
    pub keep: bool,
    /// Seconds to wait for the guest agent.
    #[arg(long, default_value_t = 120)]
    pub boot_timeout: u64,
    /// Environment, working directory, user.
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Do not pass this process's stdin to the command (it is passed when not a terminal).
    #[arg(short = 'n', long)]
    pub no_stdin: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// Runs a dev command.
pub async fn run(ctx: &Ctx, cmd: DevCmd) -> anyhow::Result<i32> {
    match cmd {
        DevCmd::Run(a) => dev_run(ctx, a).await,
    }
}

/// The image to boot: `--image`, else the newest complete image of the cache.
fn resolve_image(a: &RunArgs) -> anyhow::Result<BuiltImage> {
    if let Some(dir) = &a.image {
        return strata_image::load(dir)
            .with_context(|| format!("cannot use image {}", dir.display()));
    }
    let cache = super::image::cache_dir(a.cache_dir.clone());
    let images = super::image::list_images(&cache)
        .with_context(|| format!("cannot list {}", cache.display()))?;
    images.into_iter().next_back().ok_or_else(|| {
        CliError::Missing(format!(
            "no guest image in {}: build one with `strata image build` or pass --image DIR",
            cache.display()
        ))
        .into()
    })
}

/// Timings of one run, in seconds.
#[derive(Debug, Default, Clone, Copy)]
struct Timings {
    accel_resolve: f64,
    qemu_start: f64,
    agent_ready: f64,
    exec: f64,
    shutdown: f64,
}

async fn dev_run(ctx: &Ctx, a: RunArgs) -> anyhow::Result<i32> {
    let img = resolve_image(&a)?;
    // Read stdin before booting: a command that reads it gets all of it.
    let stdin = read_stdin(a.no_stdin).map_or(Stdin::Null, Stdin::Bytes);
    let scratch = tempfile::Builder::new()
        .prefix("strata-cli-dev-")
        .tempdir_in("/tmp")
        .context("cannot create a scratch directory in /tmp")?;
    let dir = scratch.path().to_path_buf();
    let disk = dir.join("disk.img");
    copy_disk(&img.rootfs, &disk).await?;

    let mut t = Timings::default();
    let kernel = img.kernel_pvh.clone().unwrap_or_else(|| img.kernel.clone());
    let t0 = Instant::now();
    let accel = resolve_accel(ctx, a.accel, &kernel).await;
    t.accel_resolve = t0.elapsed().as_secs_f64();

    let mut spec = VmSpec::new(
        "strata-dev",
        dir.join("run"),
        &kernel,
        dir.join("mem"),
        &disk,
    );
    spec.initrd = Some(img.initrd.clone());
    spec.cmdline = img.cmdline.clone();
    spec.memory_mib = a.memory;
    spec.vcpus = a.vcpus;
    spec.accel = accel;

    let boot = Instant::now();
    let vm = QemuDriver::new()
        .start_vm(&spec)
        .await
        .context("cannot start the VM")?;
    t.qemu_start = boot.elapsed().as_secs_f64();
    if !ctx.json {
        eprintln!(
            "strata dev: QEMU pid {} started in {:.0} ms ({}, {} vCPU, {} MiB), waiting for the agent",
            vm.pid(),
            t.qemu_start * 1000.0,
            accel,
            a.vcpus,
            a.memory
        );
    }

    let outcome = tokio::select! {
        r = session(ctx, &vm, &a, stdin, boot, &mut t) => r,
        sig = interrupted() => Err(anyhow::Error::new(CliError::Interrupted)
            .context(format!("received {sig}, stopping the VM"))),
    };

    let stop = Instant::now();
    stop_vm(&vm, a.keep).await;
    t.shutdown = stop.elapsed().as_secs_f64();
    if a.keep {
        let kept = scratch.keep();
        eprintln!("strata dev: kept {}", kept.display());
    }
    let result = outcome?;
    match result {
        RunResult::Exited { code, out } => {
            if ctx.json {
                println!(
                    "{}",
                    json!({
                        "image": img.dir,
                        "accel": accel.qemu_name(),
                        "exit": out.exit,
                        "stdout": out.stdout.as_ref().map(|b| String::from_utf8_lossy(b)),
                        "stderr": out.stderr.as_ref().map(|b| String::from_utf8_lossy(b)),
                        "timings_s": {
                            "accel_resolve": t.accel_resolve,
                            "qemu_start": t.qemu_start,
                            "boot_to_agent_ready": t.agent_ready,
                            "exec": t.exec,
                            "shutdown": t.shutdown,
                        },
                    })
                );
            } else {
                eprintln!(
                    "strata dev: exec {:.3} s, exit {}, shutdown {:.2} s",
                    t.exec, out.exit_text, t.shutdown
                );
            }
            Ok(code)
        }
        RunResult::NotRunnable { code, message } => {
            super::print_error(ctx, "command_not_runnable", &message);
            Ok(code)
        }
    }
}

/// `cp --reflink=auto --sparse=always`: a metadata copy on btrfs/xfs, a
/// sparse copy elsewhere.
async fn copy_disk(from: &Path, to: &Path) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(from)
        .arg(to)
        .output()
        .await
        .context("cannot run cp")?;
    if !out.status.success() {
        anyhow::bail!(
            "cannot copy {} to {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

async fn resolve_accel(ctx: &Ctx, requested: Accel, kernel: &Path) -> ResolvedAccel {
    match requested {
        Accel::Tcg => ResolvedAccel::Tcg,
        Accel::Kvm => ResolvedAccel::Kvm,
        Accel::Auto => {
            let driver = QemuDriver::new();
            let qemu = Path::new(strata_vmm::DEFAULT_QEMU);
            let probe =
                strata_vmm::probe::probe_kvm_cached(qemu, kernel, driver.probe_timeout).await;
            if !ctx.json {
                eprintln!(
                    "strata dev: accel auto → {} ({}, probe {:.1} s)",
                    probe.accel(),
                    probe.reason,
                    probe.elapsed.as_secs_f64()
                );
            }
            probe.accel()
        }
    }
}

/// Output collected under `--json` (streamed otherwise) and how it ended.
#[derive(Debug)]
struct Collected {
    stdout: Option<Vec<u8>>,
    stderr: Option<Vec<u8>>,
    exit: serde_json::Value,
    exit_text: String,
}

enum RunResult {
    Exited { code: i32, out: Collected },
    NotRunnable { code: i32, message: String },
}

async fn session(
    ctx: &Ctx,
    vm: &QemuVm,
    a: &RunArgs,
    stdin: Stdin,
    boot: Instant,
    t: &mut Timings,
) -> anyhow::Result<RunResult> {
    let timeout = Duration::from_secs(a.boot_timeout.max(1));
    let sock = vm.agent_socket();
    let agent = tokio::select! {
        r = AgentClient::connect_unix(&sock, timeout) => match r {
            Ok(c) => c,
            Err(e) => return Err(anyhow::Error::new(e).context(format!(
                "the guest agent did not answer; last console lines:\n{}",
                console_tail(vm)
            ))),
        },
        exit = vm.wait_exit() => anyhow::bail!(
            "the VM exited before its agent answered: {}; last console lines:\n{}",
            exit.reason,
            console_tail(vm)
        ),
    };
    t.agent_ready = boot.elapsed().as_secs_f64();
    if !ctx.json {
        eprintln!(
            "strata dev: agent ready {:.2} s after QEMU start (agent {})",
            t.agent_ready,
            agent.info().agent_version
        );
    }

    let mut req = ExecRequest::argv(a.cmd.iter().cloned());
    req.env = a.process.env.iter().cloned().collect::<BTreeMap<_, _>>();
    req.cwd = a.process.cwd.clone();
    req.user = a.process.user.clone();
    req.stdin = stdin;
    let started = Instant::now();
    let mut h = match agent.exec(req).await {
        Ok(h) => h,
        Err(e) => return not_runnable(a, e),
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = loop {
        let ev = match h.next_event().await {
            Some(Ok(ev)) => ev,
            Some(Err(e)) => return not_runnable(a, e),
            None => anyhow::bail!("the agent ended the command without an exit status"),
        };
        match ev {
            ExecEvent::Started { .. } => {}
            ExecEvent::Stdout(b) if ctx.json => out.extend_from_slice(&b),
            ExecEvent::Stderr(b) if ctx.json => err.extend_from_slice(&b),
            ExecEvent::Stdout(b) => write_flush(&mut std::io::stdout().lock(), &b),
            ExecEvent::Stderr(b) => write_flush(&mut std::io::stderr().lock(), &b),
            ExecEvent::Exit(s) => break s,
        }
    };
    t.exec = started.elapsed().as_secs_f64();
    let (code, exit_text) = match (status.code, status.signal) {
        (Some(c), _) => (c, format!("code {c}")),
        (None, Some(s)) => (128 + s, format!("signal {s}")),
        (None, None) => (1, "unknown".to_owned()),
    };
    let exit_text = if status.timed_out {
        format!("{exit_text} (timed out)")
    } else {
        exit_text
    };
    Ok(RunResult::Exited {
        code,
        out: Collected {
            stdout: ctx.json.then_some(out),
            stderr: ctx.json.then_some(err),
            exit: json!({
                "code": status.code,
                "signal": status.signal,
                "timed_out": status.timed_out,
            }),
            exit_text,
        },
    })
}

/// A command the agent could not start: 127 for "not found", 126 otherwise
/// (the shell's convention); other agent errors are errors of the run.
fn not_runnable(a: &RunArgs, e: AgentError) -> anyhow::Result<RunResult> {
    let code = match e.remote_kind() {
        Some(RemoteErrorKind::NotFound) => 127,
        Some(
            RemoteErrorKind::SpawnFailed
            | RemoteErrorKind::PermissionDenied
            | RemoteErrorKind::InvalidArgument
            | RemoteErrorKind::IsADirectory
            | RemoteErrorKind::NotADirectory,
        ) => 126,
        _ => return Err(anyhow::Error::new(e).context("running the command in the guest")),
    };
    let message = match &e {
        AgentError::Remote { kind, message } => {
            format!(
                "cannot run {:?} in the guest: {kind}: {message}",
                a.cmd.join(" ")
            )
        }
        other => format!("cannot run {:?} in the guest: {other}", a.cmd.join(" ")),
    };
    Ok(RunResult::NotRunnable { code, message })
}

fn write_flush(w: &mut dyn std::io::Write, b: &[u8]) {
    // A closed terminal or pipe must not stop the VM from being shut down.
    let _ = w.write_all(b);
    let _ = w.flush();
}

fn console_tail(vm: &QemuVm) -> String {
    let tail = vm.console_tail(4096);
    let lines: Vec<&str> = tail.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Quits QEMU (flushing its disk writes), or kills it after 5 s. Only the
/// QEMU this process started is touched.
async fn stop_vm(vm: &QemuVm, keep: bool) {
    if keep {
        // Let the guest flush its page cache so the kept disk is consistent.
        if let Ok(agent) =
            AgentClient::connect_unix(&vm.agent_socket(), Duration::from_secs(2)).await
        {
            let _ = tokio::time::timeout(
                Duration::from_secs(10),
                agent.exec_collect(ExecRequest::argv(["sync"])),
            )
            .await;
        }
    }
    if vm.exited().is_none() {
        let _ = tokio::time::timeout(Duration::from_secs(2), vm.qmp("quit", None)).await;
        if tokio::time::timeout(Duration::from_secs(3), vm.wait_exit())
            .await
            .is_err()
        {
            let _ = vm.kill().await;
        }
    }
}

/// Resolves on SIGINT, SIGTERM or SIGHUP with the signal's name.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).ok();
    let mut term = signal(SignalKind::terminate()).ok();
    let mut hup = signal(SignalKind::hangup()).ok();
    async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
        match s {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    }
    tokio::select! {
        _ = recv(&mut int) => "SIGINT",
        _ = recv(&mut term) => "SIGTERM",
        _ = recv(&mut hup) => "SIGHUP",
    }
}
