//! [`QemuVm`]: the handle on one running QEMU.
//!
//! Contract: a handle owns two tasks, the console copier (`console.sock` into the
//! size-capped `console.log`) and the exit monitor (`exit`); dropping the handle stops
//! them and leaves the VM running. Every QMP command goes through `exec`, which turns
//! a closed QMP connection into [`VmmError::ProcessDied`] with the monitor's reason.
//! `shutdown` and `kill` mark the exit as expected before they act.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::exit::{self, Exiter};
use super::port::{self, PortOpens};
use crate::cgroup::VmCgroup;
use crate::console;
use crate::process::{pidfd_send_signal, rss_info, tail_file};
use crate::qmp::{QmpClient, QmpError};
use crate::spec::VmSpec;
use crate::{Confinement, RssInfo, SaveStats, StartTimings, Vm, VmExit, VmStatus, VmmError};

/// A running QEMU VM.
pub struct QemuVm {
    pub(super) spec: VmSpec,
    pid: u32,
    pidfd: Arc<OwnedFd>,
    pub(super) qmp: Arc<QmpClient>,
    expected: Arc<AtomicBool>,
    exit_rx: watch::Receiver<Option<VmExit>>,
    tasks: Vec<JoinHandle<()>>,
    confinement: Confinement,
    cgroup: Option<VmCgroup>,
    /// Openings of the guest's agent port (`VSERPORT_CHANGE`).
    port_opens: watch::Receiver<u64>,
    /// Closings of it.
    port_closes: watch::Receiver<u64>,
    port_opened: Arc<PortOpens>,
    /// Set by the driver's start (not for an adopted VM).
    pub(super) timings: Mutex<Option<StartTimings>>,
    /// Whether this VM's QEMU was given the migration capabilities (through
    /// this handle), so saves do not set them again.
    pub(super) caps_set: AtomicBool,
    /// What direct saves of this VM put in front of QEMU's sections.
    pub(super) stream_config: Mutex<StreamConfig>,
    /// File-descriptor sets of direct saves that QEMU has not closed yet:
    /// it closes a removed set's descriptor only while the VM runs, so
    /// `resume` removes them again after `cont`.
    pub(super) stale_fdsets: Mutex<Vec<u64>>,
}

/// The `configuration` section of this VM's migration stream, as far as
/// direct saves know it.
#[derive(Debug, Clone, Default)]
pub(super) enum StreamConfig {
    /// No `migrate` save of this VM seen yet: the next save is one.
    #[default]
    Unknown,
    /// Captured from a `migrate` save of this VM.
    Known(Arc<[u8]>),
    /// This VM's streams are not what the driver understands: it saves
    /// with `migrate` only.
    Unusable,
}

/// A poisoned lock only means a task panicked while holding it; the data
/// (a list, a small enum) stays usable.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl std::fmt::Debug for QemuVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QemuVm")
            .field("name", &self.spec.name)
            .field("pid", &self.pid)
            .field("run_dir", &self.spec.run_dir)
            .finish_non_exhaustive()
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        // The VM keeps running; only this process's watchers stop.
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl QemuVm {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn assemble(
        spec: VmSpec,
        pid: u32,
        pidfd: Arc<OwnedFd>,
        qmp: Arc<QmpClient>,
        expected: Arc<AtomicBool>,
        exit_rx: watch::Receiver<Option<VmExit>>,
        exiter: Exiter,
        exit_tx: watch::Sender<Option<VmExit>>,
        (confinement, cgroup): (Confinement, Option<VmCgroup>),
    ) -> Result<Self, VmmError> {
        let mut tasks = Vec::new();
        // Subscribed before the vCPUs first run (the driver loads the
        // device state and sends `cont` only after this), so the agent
        // port's first opening is never missed.
        let (opens_tx, port_opens) = watch::channel(0u64);
        let (closes_tx, port_closes) = watch::channel(0u64);
        let port_opened = Arc::new(PortOpens::default());
        tasks.push(tokio::spawn(port::watch_agent_port(
            qmp.subscribe(),
            opens_tx,
            closes_tx,
            port_opened.clone(),
        )));
        let stream = console::connect(&spec.console_socket(), Duration::from_secs(5))
            .await
            .map_err(|e| VmmError::io(spec.console_socket(), e))?;
        tasks.push(tokio::spawn(console::copier(
            stream,
            spec.console_log(),
            spec.console_log_max_bytes,
        )));
        tasks.push(tokio::spawn(exit::monitor(
            spec.clone(),
            pidfd.clone(),
            qmp.clone(),
            expected.clone(),
            exiter,
            exit_tx,
            cgroup.clone(),
        )));
        Ok(QemuVm {
            spec,
            pid,
            pidfd,
            qmp,
            expected,
            exit_rx,
            tasks,
            confinement,
            cgroup,
            port_opens,
            port_closes,
            port_opened,
            timings: Mutex::new(None),
            caps_set: AtomicBool::new(false),
            stream_config: Mutex::new(StreamConfig::Unknown),
            stale_fdsets: Mutex::new(Vec::new()),
        })
    }

    /// The QMP client of this VM.
    pub fn qmp_client(&self) -> &QmpClient {
        &self.qmp
    }

    pub(super) async fn exec(&self, command: &str, args: Option<Value>) -> Result<Value, VmmError> {
        match self.qmp.execute(command, args).await {
            Ok(v) => Ok(v),
            Err(QmpError::Closed) => Err(self.died().await),
            Err(e) => Err(e.into()),
        }
    }

    async fn died(&self) -> VmmError {
        // QMP closed: the process is exiting; give the monitor a moment to say why.
        let exit = tokio::time::timeout(Duration::from_secs(2), self.wait_exit_inner()).await;
        VmmError::ProcessDied {
            reason: match exit {
                Ok(e) => e.reason,
                Err(_) => "QMP connection closed".into(),
            },
        }
    }

    async fn wait_exit_inner(&self) -> VmExit {
        exit::wait(self.exit_rx.clone()).await
    }

    /// Waits until `marker` appears in the console log (BootTimeout otherwise).
    pub async fn wait_console(&self, marker: &str, timeout: Duration) -> Result<(), VmmError> {
        let t0 = Instant::now();
        loop {
            if tail_file(&self.spec.console_log(), 64 * 1024).contains(marker) {
                return Ok(());
            }
            if let Some(exit) = self.exited() {
                return Err(VmmError::ProcessDied {
                    reason: exit.reason,
                });
            }
            if t0.elapsed() > timeout {
                return Err(VmmError::BootTimeout {
                    what: format!("console marker {marker:?}"),
                    secs: timeout.as_secs_f64(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_exit_for(&self, d: Duration) -> Option<VmExit> {
        tokio::time::timeout(d, self.wait_exit_inner()).await.ok()
    }
}

#[async_trait::async_trait]
impl Vm for QemuVm {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn spec(&self) -> &VmSpec {
        &self.spec
    }

    async fn pause(&self) -> Result<(), VmmError> {
        self.exec("stop", None).await.map(|_| ())
    }

    async fn resume(&self) -> Result<(), VmmError> {
        let stale = std::mem::take(&mut *lock(&self.stale_fdsets));
        if stale.is_empty() {
            return self.exec("cont", None).await.map(|_| ());
        }
        // Sent right behind `cont` (answered in order, after it): once the
        // VM runs, removing a direct save's set again closes its file.
        let cleanup = async {
            for id in stale {
                if let Err(e) = self.exec("remove-fd", Some(json!({"fdset-id": id}))).await {
                    tracing::debug!(vm = %self.spec.name, fdset = id, error = %e, "remove-fd after cont");
                }
            }
        };
        let (cont, ()) = tokio::join!(self.exec("cont", None), cleanup);
        cont.map(|_| ())
    }

    async fn status(&self) -> Result<VmStatus, VmmError> {
        let v = self.exec("query-status", None).await?;
        Ok(VmStatus {
            status: v
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_owned(),
            running: v.get("running").and_then(Value::as_bool).unwrap_or(false),
        })
    }

    async fn save_device_state(&self, path: &Path) -> Result<SaveStats, VmmError> {
        self.save_device_state_with(path, self.default_save_method())
            .await
    }

    async fn save_device_state_in_memory(&self) -> Result<Option<(Vec<u8>, SaveStats)>, VmmError> {
        self.save_device_state_in_memory_now().await
    }

    async fn block_resize(&self, bytes: u64) -> Result<(), VmmError> {
        self.exec(
            "block_resize",
            Some(json!({"device": "disk0", "size": bytes})),
        )
        .await
        .map(|_| ())
    }

    async fn shutdown(&self, timeout: Duration) -> Result<VmExit, VmmError> {
        self.expected.store(true, Ordering::SeqCst);
        let step = timeout / 2;
        if self.exited().is_none() {
            let _ = self.qmp.execute("system_powerdown", None).await;
            if let Some(e) = self.wait_exit_for(step).await {
                return Ok(e);
            }
            let _ = self.qmp.execute("quit", None).await;
            if let Some(e) = self.wait_exit_for(step).await {
                return Ok(e);
            }
        }
        self.kill().await
    }

    async fn kill(&self) -> Result<VmExit, VmmError> {
        self.expected.store(true, Ordering::SeqCst);
        if self.exited().is_none() {
            pidfd_send_signal(&self.pidfd, libc::SIGKILL)
                .map_err(|e| VmmError::io(format!("/proc/{}", self.pid), e))?;
        }
        Ok(self.wait_exit_inner().await)
    }

    fn rss_bytes(&self) -> Result<RssInfo, VmmError> {
        rss_info(self.pid, &self.spec.mem_path)
            .map_err(|e| VmmError::io(format!("/proc/{}", self.pid), e))
    }

    fn agent_socket(&self) -> PathBuf {
        self.spec.agent_socket()
    }

    fn console_tail(&self, n: usize) -> String {
        tail_file(&self.spec.console_log(), n)
    }

    async fn wait_exit(&self) -> VmExit {
        self.wait_exit_inner().await
    }

    fn exited(&self) -> Option<VmExit> {
        self.exit_rx.borrow().clone()
    }

    fn confinement(&self) -> Confinement {
        self.confinement.clone()
    }

    fn set_cpu_weight(&self, weight: u32) -> Result<bool, VmmError> {
        let Some(cg) = self
            .cgroup
            .as_ref()
            .filter(|_| self.confinement.limits_applied)
        else {
            return Ok(false);
        };
        cg.set_cpu_weight(weight)
            .map(|()| true)
            .map_err(VmmError::Cgroup)
    }

    async fn qmp(&self, command: &str, arguments: Option<Value>) -> Result<Value, VmmError> {
        // A raw command may change what saves rely on (the snapshot bench's
        // full save turns `x-ignore-shared` off on this very VM): the next
        // save sets the migration capabilities again.
        self.caps_set
            .store(false, std::sync::atomic::Ordering::Release);
        self.exec(command, arguments).await
    }

    fn start_timings(&self) -> Option<StartTimings> {
        *self.timings.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn agent_port_opens(&self) -> Option<watch::Receiver<u64>> {
        Some(self.port_opens.clone())
    }

    fn agent_port_closes(&self) -> Option<watch::Receiver<u64>> {
        Some(self.port_closes.clone())
    }

    fn agent_port_opened_at(&self) -> Option<Instant> {
        *self
            .port_opened
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }
}
