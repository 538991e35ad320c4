//! The production engine: [`strata_runtime::Runtime`] (QEMU microvm guests on
//! a btrfs pool) behind the daemon's [`Engine`] trait. The trait speaks the
//! runtime's types, so this is the calls; guest exec and files go through
//! the runtime's agent client, its errors through [`RuntimeError::from_agent`].

use std::sync::Arc;

use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_proto::AgentClient;
use strata_runtime::Runtime;

use super::*;

/// [`Engine`] over a [`Runtime`].
#[derive(Debug)]
pub struct RuntimeEngine {
    rt: Arc<Runtime>,
}

impl RuntimeEngine {
    /// Wraps a runtime.
    pub fn new(rt: Arc<Runtime>) -> Self {
        RuntimeEngine { rt }
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }

    /// The agent of `id` and the conversion of its errors.
    async fn agent(
        &self,
        id: &SandboxId,
    ) -> EngineResult<(
        AgentClient,
        impl Fn(strata_proto::AgentError) -> RuntimeError,
    )> {
        let agent = self.rt.agent(id).await?;
        let sid = id.to_string();
        Ok((agent, move |e| RuntimeError::from_agent(&sid, e)))
    }
}

fn file_name(path: &str) -> String {
    path.rsplit('/')
        .find(|s| !s.is_empty())
        .unwrap_or("/")
        .to_owned()
}

fn guest_not_found(id: &SandboxId, message: String) -> RuntimeError {
    RuntimeError::Guest {
        id: id.to_string(),
        kind: GuestErrorKind::NotFound,
        message,
    }
}

#[async_trait]
impl Engine for RuntimeEngine {
    async fn create(
        &self,
        id: &SandboxId,
        source: &Source,
        size: SandboxSize,
    ) -> EngineResult<VmInfo> {
        self.rt.create(id, source, Some(size)).await
    }

    async fn create_hibernated(
        &self,
        id: &SandboxId,
        source: &Source,
        snap: &SnapshotId,
        size: SandboxSize,
    ) -> EngineResult<SnapshotInfo> {
        self.rt
            .create_hibernated(id, source, snap, Some(size))
            .await
    }

    async fn prewarm(
        &self,
        id: &SandboxId,
        source: &Source,
        size: SandboxSize,
    ) -> EngineResult<VmInfo> {
        self.rt.prewarm(id, source, Some(size)).await
    }

    async fn claim(&self, id: &SandboxId) -> EngineResult<()> {
        self.rt.claim(id).await
    }

    async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        self.rt.snapshot(id, snap).await
    }

    async fn fork_live(
        &self,
        src: &SandboxId,
        snap: &SnapshotId,
        new_id: &SandboxId,
        size: SandboxSize,
    ) -> EngineResult<(SnapshotInfo, VmInfo)> {
        self.rt.fork_live(src, snap, new_id, Some(size)).await
    }

    async fn rewind(
        &self,
        id: &SandboxId,
        to: &SnapshotId,
        pre_rewind: Option<&SnapshotId>,
    ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)> {
        self.rt.rewind(id, to, pre_rewind).await
    }

    async fn restore(&self, id: &SandboxId, from: &SnapshotId) -> EngineResult<VmInfo> {
        self.rt.restore(id, from).await
    }

    async fn pause(&self, id: &SandboxId) -> EngineResult<()> {
        self.rt.pause(id).await
    }

    async fn resume(&self, id: &SandboxId) -> EngineResult<()> {
        self.rt.resume(id).await
    }

    async fn hibernate(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        self.rt.hibernate(id, snap).await
    }

    async fn hibernate_disk(
        &self,
        id: &SandboxId,
        snap: &SnapshotId,
    ) -> EngineResult<SnapshotInfo> {
        self.rt.hibernate_disk(id, snap).await
    }

    async fn wake(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<VmInfo> {
        self.rt.wake(id, snap).await
    }

    async fn delete(&self, id: &SandboxId) -> EngineResult<()> {
        // The runtime also ends a VM that survived a daemon restart and was
        // never adopted (an orphan, or a create interrupted before its spec
        // was written).
        self.rt.delete(id).await
    }

    async fn delete_snapshot(&self, snap: &SnapshotId) -> EngineResult<()> {
        self.rt.delete_snapshot(snap).await
    }

    async fn snapshot_usage(&self, snap: &SnapshotId) -> EngineResult<SpaceUsage> {
        self.rt.snapshot_usage(snap).await
    }

    async fn snapshot_charge(&self, snap: &SnapshotId, base: Option<&Source>) -> EngineResult<u64> {
        let pool = self.rt.pool();
        let dir = pool.snapshots_dir().join(snap.as_str());
        if !dir.exists() {
            return Err(RuntimeError::SnapshotNotFound(snap.to_string()));
        }
        let base = match base {
            Some(Source::Snapshot(b)) => Some(pool.snapshots_dir().join(b.as_str())),
            Some(Source::Template(t)) => Some(pool.templates_dir().join(t.as_str())),
            None => None,
        }
        .filter(|b| b.exists());
        let rt = self.rt.clone();
        tokio::task::spawn_blocking(move || rt.pool().written_since(&dir, base.as_deref()))
            .await
            .map_err(|e| RuntimeError::Other(format!("charge task: {e}")))?
            .map_err(RuntimeError::Storage)
    }

    async fn exec(&self, id: &SandboxId, req: ExecRequest) -> EngineResult<ExecStream> {
        // The VM runs at the call weight until the stream ends or is dropped.
        let boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        let handle = agent.exec(req).await.map_err(&err)?;
        let events = futures::stream::unfold((handle, boost), |(mut h, b)| async move {
            h.next_event().await.map(|ev| (ev, (h, b)))
        });
        Ok(events.map_err(err).boxed())
    }

    async fn exec_interactive(
        &self,
        id: &SandboxId,
        req: ExecRequest,
    ) -> EngineResult<(ExecStream, ExecInputs)> {
        let boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        let (events, input) = agent.exec(req).await.map_err(&err)?.interactive();
        let events = events.map(move |ev| {
            let _held = &boost;
            ev
        });
        Ok((events.map_err(err).boxed(), input))
    }

    async fn read_file(&self, id: &SandboxId, path: &str) -> EngineResult<ByteStream> {
        let boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        let download = agent.read_file(path).await.map_err(&err)?;
        let chunks = download.into_stream().map(move |c| {
            let _held = &boost;
            c
        });
        Ok(chunks.map_err(err).boxed())
    }

    async fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        mode: u32,
        body: ByteStream,
    ) -> EngineResult<u64> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        let reader = tokio_util::io::StreamReader::new(body.map_err(std::io::Error::other));
        agent
            .write_file(path, Some(mode), reader)
            .await
            .map_err(err)
    }

    async fn list_dir(&self, id: &SandboxId, path: &str) -> EngineResult<Vec<DirEntry>> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        agent.list_dir(path).await.map_err(err)
    }

    async fn stat(&self, id: &SandboxId, path: &str) -> EngineResult<DirEntry> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        match agent.stat(path).await.map_err(err)? {
            Some(s) => Ok(DirEntry {
                name: file_name(path),
                kind: s.kind,
                size: s.size,
                mode: s.mode,
                mtime: s.mtime,
                ext: s.ext,
            }),
            None => Err(guest_not_found(id, path.to_owned())),
        }
    }

    async fn mkdir(&self, id: &SandboxId, path: &str, parents: bool) -> EngineResult<()> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        if !parents {
            let parent = match path.trim_end_matches('/').rsplit_once('/') {
                Some(("", _)) | None => "/".to_owned(),
                Some((p, _)) => p.to_owned(),
            };
            if agent.stat(&parent).await.map_err(&err)?.is_none() {
                return Err(guest_not_found(
                    id,
                    format!("parent directory {parent} does not exist (use parents=true)"),
                ));
            }
        }
        agent.mkdir_all(path, None).await.map_err(err)
    }

    async fn remove(&self, id: &SandboxId, path: &str, recursive: bool) -> EngineResult<()> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        agent.remove(path, recursive).await.map_err(err)
    }

    async fn set_xattrs(
        &self,
        id: &SandboxId,
        path: &str,
        prefix: &str,
        set: std::collections::BTreeMap<String, String>,
    ) -> EngineResult<()> {
        let _boost = self.rt.call_boost(id);
        let (agent, err) = self.agent(id).await?;
        agent.set_xattrs(path, prefix, set).await.map_err(err)
    }

    async fn build_template(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
    ) -> EngineResult<TemplateBuilt> {
        self.rt.build_template(tpl, size, &*progress).await
    }

    async fn build_template_trusting(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        progress: ProgressSink,
        trust: Option<String>,
    ) -> EngineResult<TemplateBuilt> {
        self.rt
            .build_template_trusting(tpl, size, &*progress, trust.as_deref())
            .await
    }

    async fn delete_template(&self, tpl: &TemplateId) -> EngineResult<()> {
        self.rt.delete_template(tpl).await
    }

    async fn template_from_snapshot(
        &self,
        snap: &SnapshotId,
        tpl: &TemplateId,
        recipe: Option<String>,
        starts: Option<Vec<strata_runtime::StartCommand>>,
    ) -> EngineResult<()> {
        self.rt
            .template_from_snapshot(snap, tpl, recipe, starts)
            .await
    }

    async fn template_starts(&self, tpl: &TemplateId) -> EngineResult<TemplateStarts> {
        let m = self.rt.template_meta(tpl)?;
        Ok(TemplateStarts {
            recipe: m.recipe,
            starts: m.starts,
        })
    }

    async fn export_template(&self, tpl: &TemplateId, dest: &std::path::Path) -> EngineResult<()> {
        self.rt.export_template(tpl, dest).await
    }

    async fn import_template(&self, src: &std::path::Path, tpl: &TemplateId) -> EngineResult<()> {
        self.rt.import_template(src, tpl).await.map(|_| ())
    }

    async fn template_identity(&self, tpl: &TemplateId) -> EngineResult<String> {
        let m = self.rt.template_meta(tpl)?;
        Ok(match m.recipe {
            Some(r) => format!("recipe:{r}"),
            None => format!(
                "image:{}/{}/{}/{}x{}x{}",
                m.image_hash,
                m.accel,
                m.machine_layout,
                m.size.vcpus,
                m.size.memory_mib,
                m.size.disk_gib
            ),
        })
    }

    fn signs_states(&self) -> bool {
        self.rt.signs_states()
    }

    async fn adopt_unsigned(&self, state: &Source) -> EngineResult<Adoption> {
        self.rt.adopt_unsigned(state).await
    }

    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>> {
        Ok(self.rt.live_vms())
    }

    async fn subvolumes(&self) -> EngineResult<Subvolumes> {
        Ok(self.rt.subvolumes())
    }

    async fn probe_agent(&self, id: &SandboxId, within: std::time::Duration) -> EngineResult<()> {
        self.rt.probe_agent(id, within).await
    }

    async fn end_strays(&self) -> EngineResult<Vec<String>> {
        let mut ended = Vec::new();
        for (name, _) in self.rt.stray_vms() {
            self.rt.end_stray(&name).await;
            ended.push(name);
        }
        Ok(ended)
    }

    async fn adopt(&self, id: &SandboxId) -> EngineResult<VmInfo> {
        // The runtime's adopt continues a VM a restart found stopped (QMP
        // stays below the runtime).
        self.rt.adopt(id).await
    }

    async fn usage(&self) -> EngineResult<Vec<VmUsage>> {
        let rt = self.rt.clone();
        tokio::task::spawn_blocking(move || rt.usage())
            .await
            .map_err(|e| RuntimeError::Other(format!("usage task: {e}")))
    }

    async fn pool_space(&self) -> EngineResult<Option<crate::host::PoolSpace>> {
        let rt = self.rt.clone();
        tokio::task::spawn_blocking(move || rt.pool().usage())
            .await
            .map_err(|e| RuntimeError::Other(format!("pool space task: {e}")))?
            .map(|u| Some(u.into()))
            .map_err(RuntimeError::Storage)
    }

    fn open_calls(&self, id: &SandboxId) -> Option<u32> {
        self.rt.open_calls(id)
    }

    async fn disk_writes(&self, id: &SandboxId) -> EngineResult<Option<DiskWrites>> {
        self.rt.disk_writes(id).await.map(Some)
    }

    async fn connect_port(&self, id: &SandboxId, port: u16) -> Result<PortStream, PortOpenError> {
        self.rt.connect_port(id, port).await
    }

    async fn watch_dir(
        &self,
        id: &SandboxId,
        path: &str,
        recursive: bool,
    ) -> EngineResult<DirWatch> {
        let (agent, err) = self.agent(id).await?;
        agent.watch_dir(path, recursive).await.map_err(err)
    }

    async fn snapshot_identity(&self, snap: &SnapshotId) -> EngineResult<String> {
        let (rt, snap) = (self.rt.clone(), snap.clone());
        tokio::task::spawn_blocking(move || rt.snapshot_identity(&snap))
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))?
            .map(|u| u.to_string())
    }

    async fn anchor_snapshot(&self, snap: &SnapshotId) -> EngineResult<String> {
        // Read-only first, its commit kept out of pauses (a snapshot is
        // sealed when first needed: `Runtime::set_seal_at_snapshot`).
        self.rt.seal_snapshot(snap).await?;
        let (rt, snap) = (self.rt.clone(), snap.clone());
        tokio::task::spawn_blocking(move || rt.anchor_snapshot(&snap))
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))?
            .map_err(move_error)
            .map(|u| u.to_string())
    }

    async fn received_snapshots(&self) -> EngineResult<Vec<(String, String)>> {
        let rt = self.rt.clone();
        let v = tokio::task::spawn_blocking(move || rt.received_snapshots())
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))??;
        Ok(v.into_iter().map(|(n, u)| (n, u.to_string())).collect())
    }

    async fn delete_received_snapshot(&self, snap: &SnapshotId) -> EngineResult<()> {
        let (rt, snap) = (self.rt.clone(), snap.clone());
        tokio::task::spawn_blocking(move || rt.pool().delete_received(snap.as_str()))
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))?
            .map_err(|e| RuntimeError::Other(e.to_string()))
    }

    async fn send_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<&SnapshotId>,
    ) -> EngineResult<ByteStream> {
        // Read-only first, their commits kept out of pauses (a snapshot is
        // sealed when first needed: `Runtime::set_seal_at_snapshot`).
        for s in std::iter::once(snap).chain(parent) {
            self.rt.seal_snapshot(s).await?;
        }
        let (rt, snap2, parent) = (self.rt.clone(), snap.clone(), parent.cloned());
        // Started here so a missing snapshot is the answer, not a cut stream.
        let stream = tokio::task::spawn_blocking(move || rt.send_snapshot(&snap2, parent.as_ref()))
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))?
            .map_err(move_error)?;
        Ok(stream_send(stream, snap.to_string()))
    }

    async fn receive_snapshot(
        &self,
        snap: &SnapshotId,
        parent: Option<String>,
        max_bytes: u64,
        input: ByteStream,
    ) -> EngineResult<u64> {
        let parent = parse_identity(parent)?;
        let (reader, pump) = pump_into_reader(input);
        let r = self
            .rt
            .receive_snapshot_async(snap.clone(), parent, max_bytes, reader)
            .await;
        pump.abort();
        r.map(|got| got.bytes).map_err(move_error)
    }

    async fn has_template(&self, tpl: &TemplateId) -> EngineResult<bool> {
        Ok(self.rt.has_template(tpl))
    }

    async fn received_template_identity(&self, tpl: &TemplateId) -> EngineResult<Option<String>> {
        let (rt, tpl) = (self.rt.clone(), tpl.clone());
        let id = tokio::task::spawn_blocking(move || rt.received_template_identity(&tpl))
            .await
            .map_err(|e| RuntimeError::Other(e.to_string()))?;
        Ok(id.map(|u| u.to_string()))
    }

    async fn send_template(
        &self,
        tpl: &TemplateId,
        parent: Option<(TemplateId, String)>,
    ) -> EngineResult<(ByteStream, Option<String>)> {
        let parent = match parent {
            None => None,
            Some((p, ident)) => parse_identity(Some(ident))?.map(|u| (p, u)),
        };
        let (rt, tpl2) = (self.rt.clone(), tpl.clone());
        let (stream, base) = tokio::task::spawn_blocking(move || {
            rt.send_template(&tpl2, parent.as_ref().map(|(p, u)| (p, *u)))
        })
        .await
        .map_err(|e| RuntimeError::Other(e.to_string()))?
        .map_err(move_error)?;
        Ok((
            stream_send(stream, tpl.to_string()),
            base.map(|u| u.to_string()),
        ))
    }

    async fn receive_template(
        &self,
        tpl: &TemplateId,
        parent: Option<String>,
        max_bytes: u64,
        input: ByteStream,
    ) -> EngineResult<u64> {
        let parent = parse_identity(parent)?;
        let (reader, pump) = pump_into_reader(input);
        let r = self
            .rt
            .receive_template_async(tpl.clone(), parent, max_bytes, reader)
            .await;
        pump.abort();
        r.map(|got| got.bytes).map_err(move_error)
    }

    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied> {
        // The runtime hands its receiver out once; later callers get a
        // stream that is empty and ends.
        self.rt
            .take_died_events()
            .unwrap_or_else(|| tokio::sync::mpsc::unbounded_channel().1)
    }
}

/// A [`strata_runtime::MoveError`] as the engine's error: a refused or
/// broken stream is the caller's (`invalid_request`), the runtime's own
/// errors keep their codes.
/// A subvolume identity (hyphenated hex) from a request.
fn parse_identity(p: Option<String>) -> EngineResult<Option<strata_storage::Uuid>> {
    match p {
        None => Ok(None),
        Some(p) => Ok(Some(strata_storage::Uuid::parse(&p).ok_or_else(|| {
            RuntimeError::Invalid(format!("parent {p:?}: not a subvolume identity"))
        })?)),
    }
}

/// A started `btrfs send` (of `what`) as a stream of chunks, read on a
/// blocking thread; a failed send ends the stream with an error, and a
/// reader that goes away kills `btrfs send` (the stream is dropped).
fn stream_send(stream: strata_storage::SendStream, what: String) -> ByteStream {
    use std::io::Read;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, RuntimeError>>(4);
    tokio::task::spawn_blocking(move || {
        let mut stream = stream;
        loop {
            let mut buf = vec![0u8; 256 * 1024];
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(RuntimeError::Other(format!(
                        "reading btrfs send of {what}: {e}"
                    ))));
                    return;
                }
            }
        }
        if let Err(e) = stream.finish() {
            let _ = tx.blocking_send(Err(move_error(e.into())));
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}

/// An HTTP body's chunks as a blocking reader (for `btrfs receive` on a
/// blocking thread), pumped by a task through a bounded channel so a fast
/// sender waits for the disk. Abort the task once the receive returns.
fn pump_into_reader(input: ByteStream) -> (ChannelReader, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    let pump = tokio::spawn(async move {
        let mut input = input;
        while let Some(item) = input.next().await {
            let item = item.map_err(|e| std::io::Error::other(e.message()));
            let stop = item.is_err();
            if tx.send(item).await.is_err() || stop {
                break;
            }
        }
    });
    (ChannelReader::new(rx), pump)
}

fn move_error(e: strata_runtime::MoveError) -> RuntimeError {
    match e {
        strata_runtime::MoveError::Runtime(e) => e,
        strata_runtime::MoveError::Transfer(e) => {
            RuntimeError::Invalid(format!("snapshot stream: {e}"))
        }
    }
}

/// A blocking [`std::io::Read`] over a channel of byte chunks (an HTTP
/// body pumped by an async task), for `btrfs receive` on a blocking thread.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl ChannelReader {
    fn new(rx: tokio::sync::mpsc::Receiver<std::io::Result<Bytes>>) -> Self {
        ChannelReader {
            rx,
            cur: Bytes::new(),
        }
    }
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len());
        buf[..n].copy_from_slice(&self.cur[..n]);
        bytes::Buf::advance(&mut self.cur, n);
        Ok(n)
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
