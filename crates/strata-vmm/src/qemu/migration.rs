//! Device state to and from a file: QEMU's migration stream with `x-ignore-shared`.
//!
//! Contract: guest RAM is not in the stream. It lives in the shared RAM file
//! (`VmSpec::mem_path`), so a save writes only device state and a restore starts QEMU
//! on the same RAM file with the state file as its incoming migration.
//! - Save ([`QemuVm::save_device_state_with`]): the VM must be paused and stays paused
//!   (`postmigrate`) until `resume`. [`SaveMethod::Fd`] opens the file here and passes
//!   it to QEMU with `getfd` (`SCM_RIGHTS`), then `migrate fd:`; [`SaveMethod::Exec`]
//!   runs `migrate exec:cat > file`, a shell QEMU spawns (refused while
//!   `VmSpec::seccomp` is on: the filter would kill QEMU).
//! - Direct save ([`SaveMethod::Direct`], a VM's saves after its first while
//!   [`set_direct_save`] is on): no migration. QEMU writes every device's section
//!   synchronously in its main loop (`xen-save-devices-state`, `live: false`, into a
//!   file passed with `add-fd`), and the driver completes the file into the stream
//!   `migrate` would have written minus the RAM module's sections ([`super::stream`]).
//!   The VM stays `paused`; QEMU closes the file's set once it runs again (`resume`
//!   removes the set after `cont`).
//! - Load (`load_device_state`, run by the driver when `VmSpec::incoming` is set): the
//!   file is passed the same way and `migrate-incoming fd:` waits until QEMU has left
//!   `inmigrate`; the VM is then in the run state the source had (paused).
//!
//! Both directions give up after [`MIGRATION_TIMEOUT`] and report QEMU's `error-desc`.
//!
//! A save runs inside a snapshot's pause, so how soon its end is seen counts: with the
//! `events` migration capability on, QEMU sends `MIGRATION` events, and the save ends
//! on the one that says `completed` (or `failed`). `query-migrate` is still polled
//! beside it, backing off from 5 ms, in case an event is missed (a lagging
//! subscriber). [`set_completion_events`] turns the events off, for a benchmark's
//! before/after: completion then comes from the poll alone, as it used to (from
//! 0.5 ms, doubling to 10 ms).

use std::io::{Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::broadcast::error::RecvError;

use serde_json::{json, Value};

use super::stream::{self, StreamError};
use super::vm::{lock, QemuVm, StreamConfig};
use crate::{SaveMethod, SaveStats, SaveSteps, Vm, VmmError};

/// The most device state a save into memory takes (a microvm's is tens of
/// KiB; QEMU, not the guest, decides its size): more is refused as a stream
/// the driver does not expect, and the save is made to a file.
const MAX_DEVICE_STATE: u64 = 64 << 20;
/// Upper bound of a device-state save or load.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// Upper bound of the wait from a completed save to its run state settling.
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(10);
const FD_OUT: &str = "strata-state-out";
const FD_IN: &str = "strata-state-in";

/// Whether saves wait for QEMU's `MIGRATION` events (the default) or only
/// poll `query-migrate`.
static COMPLETION_EVENTS: AtomicBool = AtomicBool::new(true);

/// Chooses how a device-state save learns that it ended: `true` (the
/// default) from QEMU's `MIGRATION` event, with a backed-off poll beside it;
/// `false`, from polling `query-migrate` alone (the old way). Process-wide;
/// meant for benchmarks that compare the two in one run.
pub fn set_completion_events(on: bool) {
    COMPLETION_EVENTS.store(on, Ordering::Relaxed);
}

/// Whether saves share QMP round trips (the default; see
/// [`set_shared_round_trips`]).
static SHARED_ROUND_TRIPS: AtomicBool = AtomicBool::new(true);

/// Chooses how many QMP round trips a device-state save costs: `true` (the
/// default) sends the run-state check with the capabilities (set once per
/// VM) and `getfd` with `migrate`; `false`, one command per round trip and
/// the capabilities on every save (the old way). Process-wide; meant for
/// benchmarks that compare the two in one run.
pub fn set_shared_round_trips(on: bool) {
    SHARED_ROUND_TRIPS.store(on, Ordering::Relaxed);
}

fn shared_round_trips() -> bool {
    SHARED_ROUND_TRIPS.load(Ordering::Relaxed)
}

/// Whether a VM's saves after its first are direct (see [`set_direct_save`]).
static DIRECT_SAVE: AtomicBool = AtomicBool::new(true);

/// Chooses how `Vm::save_device_state` writes a VM's device state once that
/// VM has had one `migrate` save: `true` (the default) with
/// [`SaveMethod::Direct`] (no migration: QEMU writes the device sections in
/// its main loop), `false` with [`SaveMethod::Fd`] (a migration, as every
/// save was before). Process-wide; meant for benchmarks that compare the
/// two in one run.
pub fn set_direct_save(on: bool) {
    DIRECT_SAVE.store(on, Ordering::Relaxed);
}

/// Whether saves after a VM's first are direct.
pub fn direct_save() -> bool {
    DIRECT_SAVE.load(Ordering::Relaxed)
}

/// Whether `Vm::save_device_state_in_memory` saves (the default) or
/// declines, so callers write the state to a file.
static SAVE_IN_MEMORY: AtomicBool = AtomicBool::new(true);

/// Chooses whether a direct save may go into memory
/// (`Vm::save_device_state_in_memory`; `true`, the default) or callers are
/// told to save to a file (`false`: how it was, for benchmarks that compare
/// the two in one run). Process-wide.
pub fn set_save_in_memory(on: bool) {
    SAVE_IN_MEMORY.store(on, Ordering::Relaxed);
}

/// How many fd-set ids this process has handed out.
static FDSET_SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh fd-set id: the low 14 bits of this process's pid, then a
/// sequence number, so a set another strata process left in a QEMU (it
/// died while the VM was paused) is not reused. QEMU parses the id of
/// `/dev/fdset/N` as an `int`: at most 31 bits.
fn next_fdset_id() -> u64 {
    let pid = u64::from(std::process::id()) & 0x3fff;
    (pid << 17) | (FDSET_SEQ.fetch_add(1, Ordering::Relaxed) & 0x1_ffff)
}

/// Why a direct save did not produce a file.
enum DirectError {
    /// QEMU or the file failed: reported as it is.
    Vmm(VmmError),
    /// QEMU's stream is not laid out as expected: the save is made with
    /// `migrate` instead, and so are this VM's later ones.
    Stream(StreamError),
}

impl From<VmmError> for DirectError {
    fn from(e: VmmError) -> Self {
        DirectError::Vmm(e)
    }
}

/// Whether saves currently wait for `MIGRATION` events.
pub fn completion_events() -> bool {
    COMPLETION_EVENTS.load(Ordering::Relaxed)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// What a `MIGRATION` event or a `query-migrate` answer says of the save.
enum Progress {
    Completed,
    Failed,
    Going,
}

/// Reads the `status` of a `MIGRATION` event's data or of a
/// `query-migrate` answer (the same field in both).
fn progress(v: &Value) -> Progress {
    match v.get("status").and_then(Value::as_str).unwrap_or("none") {
        "completed" => Progress::Completed,
        "failed" | "cancelled" => Progress::Failed,
        _ => Progress::Going,
    }
}

impl QemuVm {
    /// Sets the migration capabilities this driver's saves and loads use,
    /// unless this VM already has them: QEMU keeps capabilities across
    /// migrations, so a VM's second save skips the round trip (with
    /// [`set_shared_round_trips`] off, every save sets them). `events` is
    /// always on: a save that polls instead just does not listen.
    async fn migrate_caps(&self) -> Result<(), VmmError> {
        if shared_round_trips() && self.caps_set.load(Ordering::Acquire) {
            return Ok(());
        }
        self.exec(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [
                {"capability": "x-ignore-shared", "state": true},
                {"capability": "events", "state": true},
            ]})),
        )
        .await?;
        self.caps_set.store(true, Ordering::Release);
        Ok(())
    }

    /// The method `Vm::save_device_state` uses: [`SaveMethod::Direct`] when
    /// [`set_direct_save`] is on and this VM's stream configuration is
    /// known (from its first save, a `migrate`), else [`SaveMethod::Fd`].
    pub(super) fn default_save_method(&self) -> SaveMethod {
        let known = matches!(*lock(&self.stream_config), StreamConfig::Known(_));
        if direct_save() && known {
            SaveMethod::Direct
        } else {
            SaveMethod::Fd
        }
    }

    /// Saves device state with an explicit [`SaveMethod`]. A
    /// [`SaveMethod::Direct`] save whose stream QEMU laid out other than
    /// expected is made with [`SaveMethod::Fd`] instead (the VM is still
    /// paused), and this VM's later saves too; [`SaveStats::method`] says
    /// which one ran.
    pub async fn save_device_state_with(
        &self,
        path: &Path,
        method: SaveMethod,
    ) -> Result<SaveStats, VmmError> {
        let method = match method {
            SaveMethod::Direct => match self.save_direct(path).await {
                Ok(stats) => return Ok(stats),
                Err(DirectError::Vmm(e)) => return Err(e),
                Err(DirectError::Stream(e)) => {
                    tracing::warn!(vm = %self.spec.name, error = %e,
                        "direct device-state save: unexpected stream; this VM saves with migrate from now on");
                    *lock(&self.stream_config) = StreamConfig::Unusable;
                    SaveMethod::Fd
                }
            },
            other => other,
        };
        if method == SaveMethod::Exec && self.spec.seccomp {
            // QEMU's seccomp filter (spawn=deny) kills the whole process on fork.
            return Err(VmmError::Migration {
                reason: "exec: migration spawns a process, which this VM's seccomp filter forbids; use SaveMethod::Fd".into(),
            });
        }
        // The run-state check and the capabilities share one round trip:
        // QMP answers a connection's commands in the order they were sent.
        let t_check = Instant::now();
        let (st, caps) = if shared_round_trips() {
            tokio::join!(self.status(), self.migrate_caps())
        } else {
            let st = self.status().await;
            (st, self.migrate_caps().await)
        };
        let st = st?;
        if st.running {
            return Err(VmmError::WrongState {
                status: st.status,
                needed: "paused",
            });
        }
        caps?;
        // Subscribed before `migrate`: a save of a few hundred KiB can end
        // before its reply is read.
        let events = completion_events().then(|| self.qmp.subscribe());
        let t0 = Instant::now();
        let mut steps = SaveSteps {
            check_ms: ms(t_check),
            ..SaveSteps::default()
        };
        match method {
            // (A direct save that fell back arrives here as `Fd`.)
            SaveMethod::Fd | SaveMethod::Direct => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(path)
                    .map_err(|e| VmmError::io(path, e))?;
                // `getfd` and `migrate` go out together; QEMU runs them in
                // order, so `migrate` finds the descriptor (if `getfd`
                // failed, both answers say so).
                let uri = json!({"uri": format!("fd:{FD_OUT}")});
                let getfd = self.qmp.execute_with_fd(
                    "getfd",
                    Some(json!({"fdname": FD_OUT})),
                    file.as_fd(),
                );
                let (fd, started) = if shared_round_trips() {
                    tokio::join!(getfd, self.exec("migrate", Some(uri)))
                } else {
                    let fd = getfd.await;
                    (fd, self.exec("migrate", Some(uri)).await)
                };
                drop(file);
                fd?;
                started?;
            }
            SaveMethod::Exec => {
                let quoted = shell_quote(&path.to_string_lossy());
                self.exec(
                    "migrate",
                    Some(json!({"uri": format!("exec:cat > {quoted}")})),
                )
                .await?;
            }
        }
        steps.start_ms = ms(t0);
        let t_complete = Instant::now();
        let ended = match events {
            Some(rx) => self.wait_save_events(rx).await,
            None => self.wait_migration("save").await,
        };
        if let Err(e) = ended {
            // A failed save also leaves `finish-migrate` a moment after it
            // says so, and `cont` is refused until then: the caller's
            // resume must find the VM settled (`postmigrate`), or the guest
            // stays stopped and no later save is accepted.
            let _ = self.wait_finalized().await;
            return Err(e);
        }
        steps.complete_ms = ms(t_complete);
        let t_final = Instant::now();
        self.wait_finalized().await?;
        steps.finalize_ms = ms(t_final);
        let elapsed = t0.elapsed();
        let bytes = std::fs::metadata(path)
            .map_err(|e| VmmError::io(path, e))?
            .len();
        if method == SaveMethod::Fd {
            self.capture_config(path);
        }
        Ok(SaveStats {
            bytes,
            elapsed,
            method,
            steps,
        })
    }

    /// Keeps the `configuration` section of a `migrate` file this VM just
    /// wrote, for its direct saves (once per VM).
    fn capture_config(&self, path: &Path) {
        if !matches!(*lock(&self.stream_config), StreamConfig::Unknown) {
            return;
        }
        let mut head = [0u8; 4096];
        let read = std::fs::File::open(path).and_then(|f| f.read_at(&mut head, 0));
        let n = match read {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(vm = %self.spec.name, error = %e, "reading a saved stream's head");
                return;
            }
        };
        *lock(&self.stream_config) = match stream::configuration(&head[..n]) {
            Ok(cfg) => StreamConfig::Known(cfg.into()),
            Err(e) => {
                tracing::warn!(vm = %self.spec.name, error = %e,
                    "migration stream configuration not understood: this VM saves with migrate only");
                StreamConfig::Unusable
            }
        };
    }

    /// This VM's stream configuration, for a direct save.
    fn direct_config(&self) -> Result<Arc<[u8]>, DirectError> {
        match &*lock(&self.stream_config) {
            StreamConfig::Known(c) => Ok(c.clone()),
            StreamConfig::Unknown => Err(DirectError::Vmm(VmmError::Migration {
                reason: "direct save: this VM has had no migrate save to take its stream configuration from".into(),
            })),
            StreamConfig::Unusable => Err(DirectError::Stream(StreamError(
                "this VM's migration stream is not one the driver completes".into(),
            ))),
        }
    }

    /// The QMP part of a direct save: `file` (write-only; its offset where
    /// QEMU's header goes) into a fresh fd set, `xen-save-devices-state`
    /// into it, the set removed again, all in one write answered in order
    /// behind a run-state check. QEMU writes at the shared file offset.
    async fn direct_qmp(&self, file: &std::fs::File) -> Result<SaveSteps, DirectError> {
        let id = next_fdset_id();
        let t_save = Instant::now();
        let (st, added, saved, removed) = tokio::join!(
            self.status(),
            self.qmp
                .execute_with_fd("add-fd", Some(json!({"fdset-id": id})), file.as_fd()),
            self.exec(
                "xen-save-devices-state",
                Some(json!({"filename": format!("/dev/fdset/{id}"), "live": false})),
            ),
            self.exec("remove-fd", Some(json!({"fdset-id": id}))),
        );
        let steps = SaveSteps {
            complete_ms: ms(t_save),
            ..SaveSteps::default()
        };
        if added.is_ok() {
            // Removed, but closed only once the VM runs: `resume` removes
            // it again after `cont`.
            lock(&self.stale_fdsets).push(id);
        }
        let st = st?;
        if st.running {
            return Err(DirectError::Vmm(VmmError::WrongState {
                status: st.status,
                needed: "paused",
            }));
        }
        added.map_err(VmmError::from)?;
        saved?;
        if let Err(e) = removed {
            tracing::debug!(vm = %self.spec.name, fdset = id, error = %e, "remove-fd after a direct save");
        }
        Ok(steps)
    }

    /// A [`SaveMethod::Direct`] save: `xen-save-devices-state` into `path`
    /// (passed with `add-fd`, its offset past where this VM's
    /// configuration goes), then the file completed in place (header and
    /// configuration, `globalstate` saying `paused`, an empty description).
    async fn save_direct(&self, path: &Path) -> Result<SaveStats, DirectError> {
        let cfg = self.direct_config()?;
        let t0 = Instant::now();
        let io = |e| DirectError::Vmm(VmmError::io(path, e));
        // Write-only: QEMU dups a set member whose access mode matches its
        // open (O_WRONLY), sharing this file offset.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(io)?;
        let qemu_header_at = cfg.len() as u64;
        file.seek(SeekFrom::Start(qemu_header_at)).map_err(io)?;
        let mut steps = self.direct_qmp(&file).await?;
        let t_fin = Instant::now();
        let len = file.metadata().map_err(io)?.len();
        let body_at = qemu_header_at + stream::HEADER.len() as u64;
        let reader = std::fs::File::open(path).map_err(io)?;
        let mut qemu_header = [0u8; 8];
        if len <= body_at
            || reader
                .read_exact_at(&mut qemu_header, qemu_header_at)
                .is_err()
            || qemu_header != stream::HEADER
        {
            return Err(DirectError::Stream(StreamError(format!(
                "QEMU wrote {len} bytes, not a stream at byte {qemu_header_at}"
            ))));
        }
        let tail_len = (len - body_at).min(512);
        let mut tail = vec![0u8; tail_len as usize];
        reader
            .read_exact_at(&mut tail, len - tail_len)
            .map_err(io)?;
        let (at, paused) = stream::paused_globalstate(&tail).map_err(DirectError::Stream)?;
        file.write_all_at(&paused, len - tail_len + at as u64)
            .map_err(io)?;
        file.write_all_at(&stream::VMDESC, len).map_err(io)?;
        let mut head = Vec::with_capacity(stream::HEADER.len() + cfg.len());
        head.extend_from_slice(&stream::HEADER);
        head.extend_from_slice(&cfg);
        file.write_all_at(&head, 0).map_err(io)?;
        steps.finalize_ms = ms(t_fin);
        Ok(SaveStats {
            bytes: len + stream::VMDESC.len() as u64,
            elapsed: t0.elapsed(),
            method: SaveMethod::Direct,
            steps,
        })
    }

    /// A direct save into memory: as [`Self::save_direct`], but QEMU writes
    /// into a memfd and the complete stream is returned, so no file system
    /// is touched while the VM is paused (a file in the pool being
    /// snapshotted beside the save waits for btrfs's commit: creating it
    /// and QEMU's first write join the transaction the snapshot commits).
    async fn save_direct_in_memory(&self) -> Result<(Vec<u8>, SaveStats), DirectError> {
        let cfg = self.direct_config()?;
        let t0 = Instant::now();
        let name = Path::new("memfd:strata-device-state");
        let io = |e| DirectError::Vmm(VmmError::io(name, e));
        let mem: std::fs::File = nix::sys::memfd::memfd_create(
            c"strata-device-state",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .map_err(|e| io(std::io::Error::from(e)))?
        .into();
        // A second, write-only open of the same memfd: QEMU dups a set
        // member whose access mode matches its open (O_WRONLY), and writes
        // at this description's offset.
        let mut wr = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", mem.as_raw_fd()))
            .map_err(io)?;
        let qemu_header_at = cfg.len() as u64;
        wr.seek(SeekFrom::Start(qemu_header_at)).map_err(io)?;
        let mut steps = self.direct_qmp(&wr).await?;
        drop(wr);
        let t_fin = Instant::now();
        let len = mem.metadata().map_err(io)?.len();
        let body_at = qemu_header_at + stream::HEADER.len() as u64;
        if len <= body_at || len > MAX_DEVICE_STATE {
            return Err(DirectError::Stream(StreamError(format!(
                "QEMU wrote {len} bytes (at most {MAX_DEVICE_STATE} expected)"
            ))));
        }
        let mut out = vec![0u8; len as usize];
        mem.read_exact_at(&mut out, 0).map_err(io)?;
        let at_header = qemu_header_at as usize;
        if out[at_header..at_header + stream::HEADER.len()] != stream::HEADER {
            return Err(DirectError::Stream(StreamError(format!(
                "QEMU wrote {len} bytes, not a stream at byte {qemu_header_at}"
            ))));
        }
        let tail_at = len as usize - (len - body_at).min(512) as usize;
        let (at, paused) =
            stream::paused_globalstate(&out[tail_at..]).map_err(DirectError::Stream)?;
        out[tail_at + at..tail_at + at + paused.len()].copy_from_slice(&paused);
        out[..stream::HEADER.len()].copy_from_slice(&stream::HEADER);
        out[stream::HEADER.len()..stream::HEADER.len() + cfg.len()].copy_from_slice(&cfg);
        out.extend_from_slice(&stream::VMDESC);
        steps.finalize_ms = ms(t_fin);
        let stats = SaveStats {
            bytes: out.len() as u64,
            elapsed: t0.elapsed(),
            method: SaveMethod::Direct,
            steps,
        };
        Ok((out, stats))
    }

    /// A [`SaveMethod::Direct`] save into memory when this VM saves
    /// directly now (`None`: its first save, direct saves off, or its
    /// stream not one the driver completes: save to a file instead). The
    /// VM must be paused and stays paused.
    pub async fn save_device_state_in_memory_now(
        &self,
    ) -> Result<Option<(Vec<u8>, SaveStats)>, VmmError> {
        if !SAVE_IN_MEMORY.load(Ordering::Relaxed)
            || self.default_save_method() != SaveMethod::Direct
        {
            return Ok(None);
        }
        match self.save_direct_in_memory().await {
            Ok(r) => Ok(Some(r)),
            Err(DirectError::Vmm(e)) => Err(e),
            Err(DirectError::Stream(e)) => {
                tracing::warn!(vm = %self.spec.name, error = %e,
                    "direct device-state save: unexpected stream; this VM saves with migrate from now on");
                *lock(&self.stream_config) = StreamConfig::Unusable;
                Ok(None)
            }
        }
    }

    /// Waits for the save's end: the first `MIGRATION` event that says so,
    /// or a `query-migrate` poll (from 5 ms, doubling to 50 ms) that does.
    async fn wait_save_events(
        &self,
        mut rx: tokio::sync::broadcast::Receiver<crate::QmpEvent>,
    ) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut poll = Duration::from_millis(5);
        let mut next_poll = tokio::time::Instant::now() + poll;
        let mut events_open = true;
        loop {
            let p = tokio::select! {
                ev = rx.recv(), if events_open => match ev {
                    Ok(ev) if ev.event == "MIGRATION" => progress(&ev.data),
                    Ok(_) | Err(RecvError::Lagged(_)) => Progress::Going,
                    // The client is gone (QEMU died): the poll says how.
                    Err(RecvError::Closed) => {
                        events_open = false;
                        Progress::Going
                    }
                },
                _ = tokio::time::sleep_until(next_poll) => {
                    poll = (poll * 2).min(Duration::from_millis(50));
                    next_poll = tokio::time::Instant::now() + poll;
                    progress(&self.query_migrate("save").await?)
                }
            };
            match p {
                Progress::Completed => return Ok(()),
                // The event carries no reason: query-migrate has it.
                Progress::Failed => return self.wait_migration("save").await,
                Progress::Going => {}
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "save: not completed after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
        }
    }

    /// Waits until the VM has left `finish-migrate`. QEMU reports a save
    /// `completed` (event and `query-migrate` alike) a moment before its
    /// migration thread moves the run state on to `postmigrate`, and
    /// refuses `cont` in between ("Migration is not finalized yet"): seen
    /// once the `MIGRATION` event made the end visible sooner than a poll.
    async fn wait_finalized(&self) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(200);
        loop {
            let st = self.status().await?;
            if st.status != "finish-migrate" {
                return Ok(());
            }
            if t0.elapsed() > FINALIZE_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "save: completed, but the VM stayed in finish-migrate for {} s",
                        FINALIZE_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(5));
        }
    }

    async fn query_migrate(&self, what: &str) -> Result<Value, VmmError> {
        self.exec("query-migrate", None).await.map_err(|e| match e {
            VmmError::ProcessDied { reason } => VmmError::Migration {
                reason: format!("{what}: QEMU died: {reason}"),
            },
            other => other,
        })
    }

    async fn wait_migration(&self, what: &str) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(500);
        loop {
            let info = self.query_migrate(what).await?;
            match progress(&info) {
                Progress::Completed => return Ok(()),
                Progress::Failed => {
                    let desc = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no description");
                    return Err(VmmError::Migration {
                        reason: format!("{what}: {desc}"),
                    });
                }
                Progress::Going => {}
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "{what}: not completed after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(10));
        }
    }

    pub(super) async fn load_device_state(&self, state: &Path) -> Result<(), VmmError> {
        let file = std::fs::File::open(state).map_err(|e| VmmError::io(state, e))?;
        // Capabilities, descriptor and `migrate-incoming` go out together:
        // QEMU answers them in order, so each finds what the one before set
        // (a failure shows in its own answer and in those after it).
        let uri = json!({"uri": format!("fd:{FD_IN}")});
        let (caps, fd, started) = tokio::join!(
            self.migrate_caps(),
            self.qmp
                .execute_with_fd("getfd", Some(json!({"fdname": FD_IN})), file.as_fd()),
            self.exec("migrate-incoming", Some(uri)),
        );
        drop(file);
        caps?;
        fd?;
        started?;
        // The destination shows the incoming migration in query-migrate; once it is
        // completed the VM is in the run state the source had (paused).
        let t0 = Instant::now();
        loop {
            let st = match self.status().await {
                Ok(s) => s,
                Err(VmmError::ProcessDied { reason }) => {
                    return Err(VmmError::Migration {
                        reason: format!("restore from {state:?}: {reason}"),
                    })
                }
                Err(e) => return Err(e),
            };
            if st.status != "inmigrate" {
                let info = self.exec("query-migrate", None).await?;
                let status = info.get("status").and_then(Value::as_str).unwrap_or("none");
                if status == "failed" {
                    return Err(VmmError::Migration {
                        reason: format!(
                            "restore from {state:?}: {}",
                            info.get("error-desc")
                                .and_then(Value::as_str)
                                .unwrap_or("failed")
                        ),
                    });
                }
                return Ok(());
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "restore from {state:?}: still loading after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
