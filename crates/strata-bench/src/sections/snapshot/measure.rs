//! The measurements: strata snapshots with the bytes each one had to write, the
//! full-memory save on the same VM, the pool's write bandwidth, and the guest
//! workloads (memory fill, writer).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use rand::RngCore as _;
use serde_json::{json, Value};
use strata_core::{SandboxId, SnapshotId};
use strata_runtime::meta::files;
use strata_runtime::Runtime;
use strata_storage::{file_extent_map, rewritten_bytes, FileExtent};

/// Name of the writer script in the guest.
pub const WRITER: &str = "/tmp/strata-bench-writer.py";
/// A `pgrep -f`/`pkill -f` pattern matching the writer but not the shell that
/// runs `pkill` (whose command line holds the pattern, not what it matches).
const WRITER_PATTERN: &str = "'strata-bench-write[r]'";

/// Shell script that fills `mib` MiB of guest memory with random bytes and
/// frees it again: the pages keep their contents, so RAM is populated (a full
/// save has to write them; zero pages would be skipped). Prints the MiB filled.
pub fn fill_script(mib: u64) -> String {
    format!(
        "python3 -c 'import os; b = bytearray(os.urandom(1 << 20)) * {mib}; print(len(b) >> 20)'"
    )
}

/// Shell script that starts the writer in the background: it dirties every
/// page of a `mib` MiB working set once per second,
/// spread evenly over the second (a tenth of the pages every 100 ms, so any
/// window between two snapshots sees its share, not all or nothing), then
/// checks it runs.
pub fn writer_start_script(mib: u64) -> String {
    format!(
        "cat > {WRITER} <<'EOF'
import sys, time
n = int(sys.argv[1]) << 20
pages = n // 4096
b = bytearray(n)
t = time.time()
while True:
    for k in range(10):
        for p in range(k * pages // 10, (k + 1) * pages // 10):
            o = p * 4096
            b[o] = (b[o] + 1) & 255
        t += 0.1
        time.sleep(max(0.0, t - time.time()))
EOF
nohup python3 {WRITER} {mib} >/dev/null 2>&1 &
sleep 1; pgrep -f {WRITER_PATTERN} >/dev/null && echo running"
    )
}

/// Shell script that stops the writer.
pub fn writer_stop_script() -> String {
    format!("pkill -f {WRITER_PATTERN}; true")
}

/// One strata snapshot: its pause and what it had to write.
#[derive(Debug, Clone, Copy)]
pub struct StrataSample {
    /// Pause (vCPUs stopped → running again), ms.
    pub pause_ms: f64,
    /// Guest RAM and disk bytes rewritten since the previous snapshot (extent
    /// maps compared) plus the device state written.
    pub dirtied_bytes: u64,
    /// Time the extent walk of the snapshot took (outside the pause), ms.
    pub walk_ms: f64,
    /// Where the pause went.
    pub phases: strata_runtime::PausePhases,
}

/// Extent maps of a snapshot's RAM file and disk.
pub struct Maps {
    mem: Vec<FileExtent>,
    disk: Vec<FileExtent>,
}

fn maps_of(dir: &Path) -> Result<Maps> {
    Ok(Maps {
        mem: file_extent_map(&dir.join(files::MEM)).map_err(|e| anyhow!("{e}"))?,
        disk: file_extent_map(&dir.join(files::DISK)).map_err(|e| anyhow!("{e}"))?,
    })
}

/// Takes a warm-up snapshot, then `runs` measured ones `interval` apart, each
/// compared with the one before it (which is then deleted). `each` gets every
/// sample as it is measured.
pub async fn strata_snapshots(
    rt: &Runtime,
    id: &SandboxId,
    runs: usize,
    interval: Duration,
    mut each: impl FnMut(StrataSample),
) -> Result<()> {
    let snap_dir = |s: &SnapshotId| rt.pool().snapshots_dir().join(s.as_str());
    let first = SnapshotId::generate();
    rt.snapshot(id, &first)
        .await
        .map_err(|e| anyhow!("warm-up snapshot: {e}"))?;
    let mut prev = first;
    let mut prev_maps = blocking_maps(snap_dir(&prev)).await?;
    let result = async {
        for _ in 0..runs {
            tokio::time::sleep(interval).await;
            let s = SnapshotId::generate();
            let info = rt
                .snapshot(id, &s)
                .await
                .map_err(|e| anyhow!("snapshot: {e}"))?;
            let old = std::mem::replace(&mut prev, s);
            let t_walk = Instant::now();
            let maps = blocking_maps(snap_dir(&prev)).await?;
            let walk_ms = t_walk.elapsed().as_secs_f64() * 1000.0;
            let dirtied = rewritten_bytes(&prev_maps.mem, &maps.mem)
                + rewritten_bytes(&prev_maps.disk, &maps.disk)
                + info.device_state_bytes;
            prev_maps = maps;
            rt.delete_snapshot(&old)
                .await
                .map_err(|e| anyhow!("delete snapshot: {e}"))?;
            each(StrataSample {
                pause_ms: info.pause_ms,
                dirtied_bytes: dirtied,
                walk_ms,
                phases: info.phases,
            });
        }
        Ok::<(), anyhow::Error>(())
    }
    .await;
    let _ = rt.delete_snapshot(&prev).await;
    result
}

async fn blocking_maps(dir: PathBuf) -> Result<Maps> {
    tokio::task::spawn_blocking(move || maps_of(&dir))
        .await
        .context("extent walk task")?
}

/// `max-bandwidth` meaning "no cap" (libvirt's `QEMU_DOMAIN_MIG_BANDWIDTH_MAX`
/// is the same order: the largest value QEMU accepts, in bytes/s).
const UNLIMITED_BANDWIDTH: u64 = i64::MAX as u64 / (1 << 20);

/// The classic full-memory save (what `virsh save` does) of a strata sandbox:
/// `stop`, migrate ALL of RAM (`x-ignore-shared` off) over a local socket into
/// `file`, fsync, `cont`. Returns the pause (stop → cont) in ms and the bytes
/// written; the file is removed. The socket is a unix one: QEMU runs in the
/// VMs' empty network namespace (no loopback to the host) as the VM user, so
/// it sits in a directory of its own that user may enter.
pub async fn full_save(rt: &Runtime, id: &SandboxId, file: &Path) -> Result<(f64, u64)> {
    use std::os::unix::fs::PermissionsExt as _;
    let sock_dir = tempfile::Builder::new()
        .prefix("strata-bench-save-")
        .tempdir()
        .context("socket dir")?;
    std::fs::set_permissions(sock_dir.path(), std::fs::Permissions::from_mode(0o711))?;
    let sock = sock_dir.path().join("save.sock");
    let listener = tokio::net::UnixListener::bind(&sock)?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))?;
    let out = file.to_path_buf();
    let sink = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut f = tokio::fs::File::create(&out).await?;
        let n = tokio::io::copy(&mut s, &mut f).await?;
        f.sync_all().await?;
        Ok::<u64, std::io::Error>(n)
    });
    let sink_abort = sink.abort_handle();
    // Set up before the pause, as libvirt does for `virsh save`: RAM included,
    // and no bandwidth cap (QEMU's default caps migration at 128 MiB/s).
    let setup = async {
        rt.qmp(
            id,
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "x-ignore-shared", "state": false}]})),
        )
        .await
        .map_err(|e| anyhow!("migrate-set-capabilities: {e}"))?;
        rt.qmp(
            id,
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": UNLIMITED_BANDWIDTH })),
        )
        .await
        .map_err(|e| anyhow!("migrate-set-parameters: {e}"))
    };
    if let Err(e) = setup.await {
        sink_abort.abort();
        return Err(e);
    }
    let t0 = Instant::now();
    if let Err(e) = rt.qmp(id, "stop", None).await {
        sink_abort.abort();
        bail!("stop: {e}");
    }
    let saved = async {
        rt.qmp(
            id,
            "migrate",
            Some(json!({ "uri": format!("unix:{}", sock.display()) })),
        )
        .await
        .map_err(|e| anyhow!("migrate: {e}"))?;
        loop {
            let st = rt
                .qmp(id, "query-migrate", None)
                .await
                .map_err(|e| anyhow!("query-migrate: {e}"))?;
            match st.get("status").and_then(Value::as_str) {
                Some("completed") => break,
                Some("failed") | Some("cancelled") => bail!("full save failed: {st}"),
                _ => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
        let bytes = sink
            .await
            .context("file sink task")?
            .context("write the saved state")?;
        Ok::<u64, anyhow::Error>(bytes)
    }
    .await;
    // The VM runs on whatever happened (strata's own saves set x-ignore-shared
    // back on before each device-state save).
    let cont = rt.qmp(id, "cont", None).await;
    let pause = t0.elapsed().as_secs_f64() * 1000.0;
    let _ = std::fs::remove_file(file);
    sink_abort.abort();
    let bytes = saved?;
    cont.map_err(|e| anyhow!("cont: {e}"))?;
    Ok((pause, bytes))
}

/// Writeback bandwidth of the file system at `dir` in bytes/s: `bytes` of
/// random data are written into the page cache (untimed), then the fsync that
/// puts them on disk is timed; the file is removed. That is the work a
/// snapshot does with the guest's dirty pages, which are in the page cache
/// already (the guest wrote them through the shared RAM mapping).
pub fn writeback_bandwidth(dir: &Path, bytes: u64) -> Result<f64> {
    let path = dir.join(".strata-bench-bandwidth");
    let mut chunk = vec![0u8; 8 << 20];
    rand::thread_rng().fill_bytes(&mut chunk);
    let res = (|| {
        let mut f = std::fs::File::create(&path)?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            // Vary the data per chunk (no two chunks alike).
            chunk[0] = chunk[0].wrapping_add(1);
            f.write_all(&chunk[..n])?;
            left -= n as u64;
        }
        let t0 = Instant::now();
        f.sync_all()?;
        Ok::<f64, std::io::Error>(t0.elapsed().as_secs_f64())
    })();
    let _ = std::fs::remove_file(&path);
    let secs = res.with_context(|| format!("write {}", path.display()))?;
    Ok(bytes as f64 / secs.max(1e-9))
}
