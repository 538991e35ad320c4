//! The production engine: [`strata_runtime::Runtime`] (QEMU microvm guests on
//! a btrfs pool) behind the daemon's [`Engine`] trait.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_proto::client::{AgentError, ExecEvent as AgentEvent, ExecRequest as AgentExec, Stdin};
use strata_proto::msg::{Command, FileKind as AgentKind, RemoteErrorKind};
use strata_runtime::error::GuestErrorKind;
use strata_runtime::{Runtime, RuntimeError};

use super::*;

/// [`Engine`] over a [`Runtime`].
pub struct RuntimeEngine {
    rt: Arc<Runtime>,
    died: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<strata_runtime::VmDied>>>,
}

impl std::fmt::Debug for RuntimeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeEngine")
            .field("rt", &self.rt)
            .finish()
    }
}

impl RuntimeEngine {
    /// Wraps a runtime.
    pub fn new(rt: Arc<Runtime>) -> Self {
        let died = rt.take_died_events();
        RuntimeEngine {
            rt,
            died: Mutex::new(died),
        }
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }
}

fn rt_err(e: RuntimeError) -> EngineError {
    let message = e.message();
    match e {
        RuntimeError::SandboxNotFound(s) => EngineError::SandboxNotFound(s),
        RuntimeError::SnapshotNotFound(s) => EngineError::SnapshotNotFound(s),
        RuntimeError::NotRunning { id } => EngineError::NotRunning(id),
        RuntimeError::SnapshotUnusable { id, reason } => {
            EngineError::SnapshotUnusable { id, reason }
        }
        RuntimeError::PoolFull => EngineError::PoolFull,
        RuntimeError::VmFailed { id, reason } => EngineError::VmFailed { id, reason },
        RuntimeError::AgentTimeout { id, timeout_ms } => {
            EngineError::AgentTimeout { id, timeout_ms }
        }
        RuntimeError::Busy(s) => EngineError::Busy(s),
        RuntimeError::Invalid(s) => EngineError::Invalid(s),
        RuntimeError::Agent { source, .. } => agent_err(source),
        RuntimeError::Other(s) => EngineError::Other(s),
        RuntimeError::Vmm { id, source } => EngineError::VmFailed {
            id,
            reason: strata_runtime::error::chain(&source),
        },
        RuntimeError::Storage(_) | RuntimeError::Io { .. } => EngineError::Other(message),
        RuntimeError::Guest {
            kind: GuestErrorKind::NotFound,
            ..
        } => EngineError::GuestNotFound(message),
        RuntimeError::Guest {
            kind: GuestErrorKind::Invalid,
            ..
        } => EngineError::Invalid(message),
        RuntimeError::Guest { .. } => EngineError::Agent(message),
    }
}

fn agent_err(e: AgentError) -> EngineError {
    match e.remote_kind() {
        Some(RemoteErrorKind::NotFound) => EngineError::GuestNotFound(e.to_string()),
        Some(RemoteErrorKind::NoSpace) => EngineError::Agent(format!("guest disk is full: {e}")),
        Some(RemoteErrorKind::InvalidArgument) => EngineError::Invalid(e.to_string()),
        _ => EngineError::Agent(e.to_string()),
    }
}

fn kind(k: AgentKind) -> FileKind {
    match k {
        AgentKind::File => FileKind::File,
        AgentKind::Dir => FileKind::Dir,
        AgentKind::Symlink => FileKind::Symlink,
        AgentKind::Other => FileKind::Other,
    }
}

fn file_name(path: &str) -> String {
    path.rsplit('/')
        .find(|s| !s.is_empty())
        .unwrap_or("/")
        .to_owned()
}

#[async_trait]
impl Engine for RuntimeEngine {
    async fn create(
        &self,
        id: &SandboxId,
        source: &Source,
        size: SandboxSize,
    ) -> EngineResult<VmInfo> {
        let src = match source {
            Source::Template(t) => strata_runtime::Source::Template(t.clone()),
            Source::Snapshot(s) => strata_runtime::Source::Snapshot(s.clone()),
        };
        let info = self.rt.create(id, &src, Some(size)).await.map_err(rt_err)?;
        Ok(vm_info(info))
    }

    async fn create_hibernated(
        &self,
        id: &SandboxId,
        source: &Source,
        snap: &SnapshotId,
        size: SandboxSize,
    ) -> EngineResult<SnapshotInfo> {
        let src = match source {
            Source::Template(t) => strata_runtime::Source::Template(t.clone()),
            Source::Snapshot(s) => strata_runtime::Source::Snapshot(s.clone()),
        };
        self.rt
            .create_hibernated(id, &src, snap, Some(size))
            .await
            .map(snap_info)
            .map_err(rt_err)
    }

    async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        self.rt
            .snapshot(id, snap)
            .await
            .map(snap_info)
            .map_err(rt_err)
    }

    async fn fork_live(
        &self,
        src: &SandboxId,
        snap: &SnapshotId,
        new_id: &SandboxId,
        size: SandboxSize,
    ) -> EngineResult<(SnapshotInfo, VmInfo)> {
        let (s, v) = self
            .rt
            .fork_live(src, snap, new_id, Some(size))
            .await
            .map_err(rt_err)?;
        Ok((snap_info(s), vm_info(v)))
    }

    async fn rewind(
        &self,
        id: &SandboxId,
        to: &SnapshotId,
        pre_rewind: Option<&SnapshotId>,
    ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)> {
        let (s, v) = self.rt.rewind(id, to, pre_rewind).await.map_err(rt_err)?;
        Ok((s.map(snap_info), vm_info(v)))
    }

    async fn restore(&self, id: &SandboxId, from: &SnapshotId) -> EngineResult<VmInfo> {
        self.rt.restore(id, from).await.map(vm_info).map_err(rt_err)
    }

    async fn pause(&self, id: &SandboxId) -> EngineResult<()> {
        self.rt.pause(id).await.map_err(rt_err)
    }

    async fn resume(&self, id: &SandboxId) -> EngineResult<()> {
        self.rt.resume(id).await.map_err(rt_err)
    }

    async fn hibernate(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        self.rt
            .hibernate(id, snap)
            .await
            .map(snap_info)
            .map_err(rt_err)
    }

    async fn wake(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<VmInfo> {
        self.rt.wake(id, snap).await.map(vm_info).map_err(rt_err)
    }

    async fn delete(&self, id: &SandboxId) -> EngineResult<()> {
        // The runtime also ends a VM that survived a daemon restart and was
        // never adopted (an orphan, or a create interrupted before its spec
        // was written).
        self.rt.delete(id).await.map_err(rt_err)
    }

    async fn delete_snapshot(&self, snap: &SnapshotId) -> EngineResult<()> {
        self.rt.delete_snapshot(snap).await.map_err(rt_err)
    }

    async fn snapshot_usage(&self, snap: &SnapshotId) -> EngineResult<SpaceUsage> {
        let u = self.rt.snapshot_usage(snap).await.map_err(rt_err)?;
        Ok(SpaceUsage {
            exclusive_bytes: u.exclusive_bytes,
            referenced_bytes: u.referenced_bytes,
        })
    }

    async fn exec(&self, id: &SandboxId, req: ExecRequest) -> EngineResult<ExecStream> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        let areq = AgentExec {
            command: Command::Argv(req.cmd),
            env: req.env,
            cwd: req.cwd,
            user: None,
            stdin: match req.stdin {
                Some(b) => Stdin::Bytes(b),
                None => Stdin::Null,
            },
            timeout: req.timeout_s.map(Duration::from_secs),
        };
        let handle = agent
            .exec(areq)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))?;
        let sid = id.to_string();
        let stream = futures::stream::unfold(Some(handle), move |state| {
            let sid = sid.clone();
            async move {
                let mut h = state?;
                loop {
                    match h.next_event().await {
                        None => return None,
                        Some(Err(e)) => {
                            return Some((Err(rt_err(RuntimeError::from_agent(&sid, e))), None))
                        }
                        Some(Ok(AgentEvent::Started { .. })) => continue,
                        Some(Ok(AgentEvent::Stdout(b))) => {
                            return Some((Ok(ExecEvent::Stdout(b)), Some(h)))
                        }
                        Some(Ok(AgentEvent::Stderr(b))) => {
                            return Some((Ok(ExecEvent::Stderr(b)), Some(h)))
                        }
                        Some(Ok(AgentEvent::Exit(s))) => {
                            return Some((
                                Ok(ExecEvent::Exit {
                                    code: s.code,
                                    signal: s.signal,
                                }),
                                None,
                            ))
                        }
                    }
                }
            }
        });
        Ok(stream.boxed())
    }

    async fn read_file(&self, id: &SandboxId, path: &str) -> EngineResult<ByteStream> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        let dl = agent
            .read_file(path)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))?;
        let sid = id.to_string();
        Ok(dl
            .into_stream()
            .map_err(move |e| rt_err(RuntimeError::from_agent(&sid, e)))
            .boxed())
    }

    async fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> EngineResult<u64> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        let reader = tokio_util::io::StreamReader::new(
            body.map_err(|e| std::io::Error::other(e.to_string())),
        );
        agent
            .write_file(path, Some(mode), reader)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))
    }

    async fn list_dir(&self, id: &SandboxId, path: &str) -> EngineResult<Vec<FileStat>> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        let entries = agent
            .list_dir(path)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))?;
        Ok(entries
            .into_iter()
            .map(|e| FileStat {
                name: e.name,
                kind: kind(e.kind),
                size: e.size,
                mode: e.mode,
                mtime: e.mtime,
            })
            .collect())
    }

    async fn stat(&self, id: &SandboxId, path: &str) -> EngineResult<FileStat> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        match agent
            .stat(path)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))?
        {
            Some(s) => Ok(FileStat {
                name: file_name(path),
                kind: kind(s.kind),
                size: s.size,
                mode: s.mode,
                mtime: s.mtime,
            }),
            None => Err(EngineError::GuestNotFound(format!(
                "no such file or directory in the guest: {path}"
            ))),
        }
    }

    async fn mkdir(&self, id: &SandboxId, path: &str, parents: bool) -> EngineResult<()> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        if !parents {
            let parent = match path.trim_end_matches('/').rsplit_once('/') {
                Some(("", _)) | None => "/".to_owned(),
                Some((p, _)) => p.to_owned(),
            };
            if agent
                .stat(&parent)
                .await
                .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))?
                .is_none()
            {
                return Err(EngineError::GuestNotFound(format!(
                    "parent directory {parent} does not exist (use parents=true)"
                )));
            }
        }
        agent
            .mkdir_all(path, None)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))
    }

    async fn remove(&self, id: &SandboxId, path: &str, recursive: bool) -> EngineResult<()> {
        let agent = self.rt.agent(id).await.map_err(rt_err)?;
        agent
            .remove(path, recursive)
            .await
            .map_err(|e| rt_err(RuntimeError::from_agent(id.as_str(), e)))
    }

    async fn build_template(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
    ) -> EngineResult<TemplateInfo> {
        let p = progress.clone();
        let built = self
            .rt
            .build_template(tpl, size, &move |s: &str| p(s, None))
            .await
            .map_err(rt_err)?;
        Ok(TemplateInfo {
            id: built.id,
            size: built.size,
            accel: built.accel,
            build_ms: built.build_ms,
        })
    }

    async fn delete_template(&self, tpl: &TemplateId) -> EngineResult<()> {
        self.rt.delete_template(tpl).await.map_err(rt_err)
    }

    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>> {
        Ok(self
            .rt
            .find_vms()
            .into_iter()
            .map(|(id, pid)| LiveVm {
                id,
                pid,
                paused: false,
            })
            .collect())
    }

    async fn subvolumes(&self) -> EngineResult<Subvolumes> {
        let (sb, snaps, tpls) = self.rt.list_state_dirs();
        Ok(Subvolumes {
            sandboxes: sb.iter().filter_map(|s| s.parse().ok()).collect(),
            snapshots: snaps.iter().filter_map(|s| s.parse().ok()).collect(),
            templates: tpls.iter().filter_map(|s| s.parse().ok()).collect(),
        })
    }

    async fn adopt(&self, id: &SandboxId) -> EngineResult<VmInfo> {
        // The runtime's adopt continues a VM a restart found stopped (QMP
        // stays below the runtime).
        self.rt.adopt(id).await.map(vm_info).map_err(rt_err)
    }

    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<ExitEvent> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let taken = self.died.lock().ok().and_then(|mut g| g.take());
        if let Some(mut died) = taken {
            tokio::spawn(async move {
                while let Some(d) = died.recv().await {
                    if tx
                        .send(ExitEvent {
                            id: d.id,
                            reason: d.reason,
                        })
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
        rx
    }
}

fn vm_info(v: strata_runtime::VmInfo) -> VmInfo {
    VmInfo {
        pid: v.pid,
        accel: v.accel,
        size: v.size,
        ready_ms: v.ready_ms,
    }
}

fn snap_info(s: strata_runtime::SnapshotInfo) -> SnapshotInfo {
    SnapshotInfo {
        id: s.id,
        pause_ms: s.pause_ms,
        device_state_bytes: s.device_state_bytes,
        created_at: s.created_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names() {
        assert_eq!(file_name("/a/b/c.txt"), "c.txt");
        assert_eq!(file_name("/a/b/"), "b");
        assert_eq!(file_name("/"), "/");
    }
}
