//! Directory watches: inotify on a guest directory (and, recursive, on every
//! directory below it), events mapped as fsnotify maps them (what envd
//! reports): `IN_CREATE`/`IN_MOVED_TO` create, `IN_MODIFY` write,
//! `IN_ATTRIB` chmod, `IN_DELETE` (and `IN_DELETE_SELF` of the watched
//! directory) remove, `IN_MOVED_FROM` rename. Names are relative to the
//! watched directory.
//!
//! Protocol (see `PROTOCOL.md`, *Directory watches*): `watch {path,
//! recursive}` opens the watch on its id (answered `watch_started`); each
//! `watch_poll {wait_ms}` on that id is answered with one `watch_events`
//! (the kernel's queue is drained first, so a poll sent after a file
//! operation returned sees its events); `watch_stop`, or the session's end,
//! drops the row, which ends the task and closes the inotify instance.
//!
//! The agent's own uploads write beside the destination
//! (`.<name>.strata-upload-<agent pid>-<id>`) and rename into place: the
//! events of such a temporary file are the events of the file it becomes,
//! so its create and writes are reported under the destination's name
//! when it is renamed into place (complete, as an entry shows it); what
//! only the temporary file sees (its mode set while private, the rename
//! itself) is not reported, nor anything of an upload abandoned (its
//! temporary removed). Other programs' files are reported as the kernel
//! names them.
//!
//! Bounds (a hostile guest may create files as fast as it likes): at most
//! [`MAX_WATCHES`] watches per session, [`MAX_WATCH_DIRS`] watched
//! directories per watch (a recursive watch past it refuses to start, or
//! reports one `overflow` for a new directory it cannot add), and
//! [`MAX_BUFFERED`] events held per watch between polls: past it one
//! `overflow` event is queued and later events are dropped until the host
//! polls. An event identical to the one queued just before it (same kind
//! and name, not yet delivered) is merged into it, as the kernel does.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use strata_proto::{
    RemoteErrorKind, Response, WatchEvent, WatchKind, MAX_WATCH_BATCH, MAX_WATCH_WAIT_MS,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::error::Fail;
use crate::outbox::Outbox;
use crate::requests::{lock, Entry, Slot, Table};

/// Most watches one session may have open.
pub const MAX_WATCHES: usize = 64;
/// Most directories (inotify watch descriptors) one watch may use.
pub const MAX_WATCH_DIRS: usize = 8192;
/// Most events one watch holds between two polls (plus one `overflow`).
pub const MAX_BUFFERED: usize = 4096;
/// Bytes of names (JSON-escaped, estimated) one `watch_events` carries at
/// most: far below the frame limit.
const BATCH_BYTES: usize = 384 * 1024;
/// Uploads in progress whose events one watch holds until they are renamed
/// into place.
pub const MAX_HELD_UPLOADS: usize = 256;
/// Entries a recursive watch reported by scanning a new directory that it
/// remembers, so that the kernel's own create of one of them (made between
/// the directory's watch and the scan) is not reported twice.
const MAX_SCANNED: usize = 1024;
/// Polls queued for one watch (the host has one in flight).
pub const POLL_QUEUE: usize = 4;

fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ONLYDIR
}

/// The inotify instance, as tokio's readiness wants it.
struct Fd(Inotify);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// One watch: the directories it watches and the events not yet
/// delivered (its inotify instance is held apart, for readiness, and
/// passed to what adds or removes directories).
struct Watch {
    root: PathBuf,
    recursive: bool,
    root_wd: WatchDescriptor,
    /// Watched directories by descriptor: their path relative to `root`.
    dirs: HashMap<WatchDescriptor, String>,
    buf: VecDeque<WatchEvent>,
    /// Events of upload temporaries not yet renamed into place, by the
    /// temporary's path (at most [`MAX_HELD_UPLOADS`], two events each).
    uploads: HashMap<String, Vec<WatchKind>>,
    /// The last upload temporary moved away (its rename into place): the
    /// cookie of the matching `IN_MOVED_TO` and the events it releases.
    temp_moved: Option<(u32, Option<Vec<WatchKind>>)>,
    /// The upload temporaries' marker of this agent process.
    temp_marker: String,
    /// Entries reported by a scan of a new directory (see [`MAX_SCANNED`]),
    /// oldest first.
    scanned: VecDeque<String>,
    scanned_set: HashSet<String>,
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_owned()
    } else {
        format!("{dir}/{name}")
    }
}

impl Watch {
    /// Opens the watch of `path` (blocking: adds a watch per directory).
    fn open(path: &str, recursive: bool) -> Result<(Inotify, Watch), Fail> {
        let root = crate::files::check_path(path)?;
        let meta = std::fs::metadata(&root).map_err(|e| Fail::io(&e, path))?;
        if !meta.is_dir() {
            return Err(Fail::new(
                RemoteErrorKind::NotADirectory,
                format!("{path} is not a directory"),
            ));
        }
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| Fail::io(&std::io::Error::from(e), "inotify_init"))?;
        let root_wd = ino
            .add_watch(&root, mask())
            .map_err(|e| Fail::io(&std::io::Error::from(e), path))?;
        let mut w = Watch {
            root,
            recursive,
            root_wd,
            dirs: HashMap::from([(root_wd, String::new())]),
            buf: VecDeque::new(),
            uploads: HashMap::new(),
            temp_moved: None,
            temp_marker: format!(".strata-upload-{}-", std::process::id()),
            scanned: VecDeque::new(),
            scanned_set: HashSet::new(),
        };
        if recursive && !w.add_below(&ino, String::new(), false) {
            return Err(Fail::new(
                RemoteErrorKind::Other,
                format!("more than {MAX_WATCH_DIRS} directories to watch under {path}"),
            ));
        }
        Ok((ino, w))
    }

    /// Watches every directory below `rel` (already watched); `false` when
    /// [`MAX_WATCH_DIRS`] stopped it. With `report` (`rel` is a directory
    /// just made) what is found in it is reported as created: it was made
    /// before its directory was watched (`mkdir -p a/b`, an archive
    /// unpacked), so the kernel gave no event for it.
    fn add_below(&mut self, ino: &Inotify, rel: String, report: bool) -> bool {
        let mut todo = vec![rel];
        while let Some(d) = todo.pop() {
            let Ok(rd) = std::fs::read_dir(self.root.join(&d)) else {
                continue; // gone meanwhile, or unreadable
            };
            for ent in rd.flatten() {
                // Symlinks are not followed: the tree is what is below root.
                let is_dir = ent.file_type().is_ok_and(|t| t.is_dir());
                let name = ent.file_name().to_string_lossy().into_owned();
                let sub = join(&d, &name);
                if report && self.upload_dest(&name).is_none() {
                    self.push(WatchKind::Create, sub.clone(), is_dir);
                    self.remember_scanned(sub.clone());
                }
                if !is_dir {
                    continue;
                }
                match self.add_dir(ino, &sub) {
                    Some(true) => todo.push(sub),
                    Some(false) => {}
                    None => return false,
                }
            }
        }
        true
    }

    /// Watches directory `rel`: `Some(true)` added, `Some(false)` could not
    /// (gone), `None` the cap is reached.
    fn add_dir(&mut self, ino: &Inotify, rel: &str) -> Option<bool> {
        if self.dirs.len() >= MAX_WATCH_DIRS {
            return None;
        }
        let flags = mask() | AddWatchFlags::IN_DONT_FOLLOW;
        match ino.add_watch(&self.root.join(rel), flags) {
            Ok(wd) => {
                // Re-adding a watched inode gives its descriptor again.
                self.dirs.insert(wd, rel.to_owned());
                Some(true)
            }
            Err(Errno::ENOSPC) => None, // the kernel's max_user_watches
            Err(_) => Some(false),
        }
    }

    /// Remembers `rel` as reported by a scan (the oldest is forgotten past
    /// [`MAX_SCANNED`]).
    fn remember_scanned(&mut self, rel: String) {
        if self.scanned.len() >= MAX_SCANNED {
            if let Some(old) = self.scanned.pop_front() {
                self.scanned_set.remove(&old);
            }
        }
        if self.scanned_set.insert(rel.clone()) {
            self.scanned.push_back(rel);
        }
    }

    /// Forgets `rel` as reported by a scan; `true` if it was.
    fn forget_scanned(&mut self, rel: &str) -> bool {
        if !self.scanned_set.remove(rel) {
            return false;
        }
        self.scanned.retain(|s| s != rel);
        true
    }

    /// Stops watching directory `rel` and everything below it (it moved away).
    fn forget_tree(&mut self, ino: &Inotify, rel: &str) {
        let prefix = format!("{rel}/");
        let gone: Vec<WatchDescriptor> = self
            .dirs
            .iter()
            .filter(|(wd, d)| **wd != self.root_wd && (*d == rel || d.starts_with(&prefix)))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            let _ = ino.rm_watch(wd);
            self.dirs.remove(&wd);
        }
    }

    /// The destination of upload temporary `name` of this agent, if it is one.
    fn upload_dest<'a>(&self, name: &'a str) -> Option<&'a str> {
        let (dest, id) = name.strip_prefix('.')?.rsplit_once(&self.temp_marker)?;
        (!dest.is_empty() && !id.is_empty() && id.bytes().all(|c| c.is_ascii_digit()))
            .then_some(dest)
    }

    /// Queues an event, merging it into an identical last one; past
    /// [`MAX_BUFFERED`] one overflow event stands for what is dropped.
    fn push(&mut self, kind: WatchKind, name: String, dir: bool) {
        if let Some(last) = self.buf.back() {
            if last.kind == kind && last.name == name && last.dir == dir {
                return;
            }
            if last.kind == WatchKind::Overflow && self.buf.len() > MAX_BUFFERED {
                return;
            }
        }
        if self.buf.len() >= MAX_BUFFERED {
            self.overflow();
            return;
        }
        self.buf.push_back(WatchEvent { name, kind, dir });
    }

    fn overflow(&mut self) {
        if self.buf.back().map(|e| e.kind) != Some(WatchKind::Overflow) {
            self.buf.push_back(WatchEvent {
                name: String::new(),
                kind: WatchKind::Overflow,
                dir: false,
            });
        }
    }

    fn on_event(&mut self, ino: &Inotify, e: InotifyEvent) {
        let m = e.mask;
        if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            return self.overflow();
        }
        let Some(dir) = self.dirs.get(&e.wd).cloned() else {
            return;
        };
        if m.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&e.wd);
            return;
        }
        let is_dir = m.contains(AddWatchFlags::IN_ISDIR);
        if m.contains(AddWatchFlags::IN_DELETE_SELF) {
            // A subdirectory's removal is its parent's IN_DELETE already.
            if e.wd == self.root_wd {
                self.push(WatchKind::Remove, String::new(), true);
            }
            return;
        }
        let Some(name) = e.name else { return };
        let name = name.to_string_lossy().into_owned();
        if let Some(dest) = self.upload_dest(&name) {
            let dest = join(&dir, dest);
            return self.on_upload_temp(m, e.cookie, join(&dir, &name), dest);
        }
        if m.contains(AddWatchFlags::IN_MOVED_TO) {
            if let Some((cookie, held)) = self.temp_moved.take() {
                if cookie == e.cookie {
                    // The upload's file appears: its events, under its name.
                    let rel = join(&dir, &name);
                    for kind in held.unwrap_or_default() {
                        self.push(kind, rel.clone(), false);
                    }
                    return;
                }
            }
        }
        let rel = join(&dir, &name);
        let kind = if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
            WatchKind::Create
        } else if m.contains(AddWatchFlags::IN_MODIFY) {
            WatchKind::Write
        } else if m.contains(AddWatchFlags::IN_ATTRIB) {
            WatchKind::Chmod
        } else if m.contains(AddWatchFlags::IN_DELETE) {
            WatchKind::Remove
        } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
            WatchKind::Rename
        } else {
            return;
        };
        if !self.scanned_set.is_empty() && self.forget_scanned(&rel) && kind == WatchKind::Create {
            // Made between its directory's watch and the scan that
            // reported it. (A remove or rename forgets it, so a later
            // create of the same name is reported.)
            return;
        }
        self.push(kind, rel.clone(), is_dir);
        if self.recursive && is_dir {
            match kind {
                WatchKind::Create => {
                    // A directory made here may have entries already; one
                    // moved in brings its tree (reported as the kernel
                    // does: the directory alone).
                    let made = m.contains(AddWatchFlags::IN_CREATE);
                    let added = match self.add_dir(ino, &rel) {
                        Some(true) => self.add_below(ino, rel, made),
                        Some(false) => true,
                        None => false,
                    };
                    if !added {
                        self.overflow();
                    }
                }
                WatchKind::Rename => self.forget_tree(ino, &rel),
                _ => {}
            }
        }
    }

    /// An event of one of this agent's upload temporaries (`temp`, which
    /// becomes `dest`): its create and writes are held until it is renamed
    /// into place and then reported under the destination's name (the file
    /// is complete by then, as an entry shows it); an abandoned upload's
    /// (removed) are dropped; its mode change while private is not
    /// reported. Past [`MAX_HELD_UPLOADS`] they are reported at once.
    fn on_upload_temp(&mut self, m: AddWatchFlags, cookie: u32, temp: String, dest: String) {
        if m.contains(AddWatchFlags::IN_CREATE) {
            if self.uploads.len() < MAX_HELD_UPLOADS {
                self.uploads.insert(temp, vec![WatchKind::Create]);
            } else {
                self.push(WatchKind::Create, dest, false);
            }
        } else if m.contains(AddWatchFlags::IN_MODIFY) {
            match self.uploads.get_mut(&temp) {
                Some(held) => {
                    if held.last() != Some(&WatchKind::Write) {
                        held.push(WatchKind::Write);
                    }
                }
                None => self.push(WatchKind::Write, dest, false),
            }
        } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
            // The rename into place: the matching IN_MOVED_TO follows.
            self.temp_moved = Some((cookie, self.uploads.remove(&temp)));
        } else if m.contains(AddWatchFlags::IN_DELETE) && self.uploads.remove(&temp).is_none() {
            self.push(WatchKind::Remove, dest, false);
        }
    }

    /// Takes the next batch: at most [`MAX_WATCH_BATCH`] events and
    /// [`BATCH_BYTES`] of names; whether more are left.
    fn take_batch(&mut self) -> (Vec<WatchEvent>, bool) {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        while let Some(e) = self.buf.front() {
            // A control character takes six bytes in JSON (\u00XX).
            let cost = 48 + e.name.len() + 5 * e.name.bytes().filter(|b| *b < 0x20).count();
            if out.len() >= MAX_WATCH_BATCH || (!out.is_empty() && bytes + cost > BATCH_BYTES) {
                break;
            }
            bytes += cost;
            if let Some(e) = self.buf.pop_front() {
                out.push(e);
            }
        }
        let more = !self.buf.is_empty();
        (out, more)
    }
}

/// Reads what the kernel has queued (never waits).
fn read_queued(ino: &Inotify) -> std::io::Result<Vec<InotifyEvent>> {
    match ino.read_events() {
        Ok(v) => Ok(v),
        Err(Errno::EAGAIN) => Err(std::io::ErrorKind::WouldBlock.into()),
        Err(e) => Err(e.into()),
    }
}

/// Whether another watch may open in this session, as row `id` of `t`.
fn check_room(t: &HashMap<u32, (u64, Entry)>, id: u32) -> Result<(), Fail> {
    if id == 0 || t.contains_key(&id) {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            "request id in use",
        ));
    }
    let open = t
        .values()
        .filter(|(_, e)| matches!(e, Entry::Watch { .. }))
        .count();
    if open >= MAX_WATCHES {
        return Err(Fail::new(
            RemoteErrorKind::Other,
            format!("too many directory watches (at most {MAX_WATCHES})"),
        ));
    }
    Ok(())
}

/// Serves `watch {path, recursive}` on `id` of session `epoch` (the current
/// one is in `current`): opens the watch, puts its row in the table,
/// answers `watch_started`, then answers polls until the row is dropped.
pub async fn start(
    table: Table,
    current: Arc<AtomicU64>,
    epoch: u64,
    out: Outbox,
    id: u32,
    path: String,
    recursive: bool,
) {
    let room = check_room(&lock(&table), id);
    if let Err(f) = room {
        return out.error(id, f).await;
    }
    let opened = tokio::task::spawn_blocking(move || Watch::open(&path, recursive))
        .await
        .unwrap_or_else(|e| Err(Fail::new(RemoteErrorKind::Other, e.to_string())));
    let (ino, w) = match opened {
        Ok(x) => x,
        Err(f) => return out.error(id, f).await,
    };
    let (tx, rx) = mpsc::channel(POLL_QUEUE);
    let inserted = {
        let mut t = lock(&table);
        // A session that ended meanwhile has cleared the table: do not put
        // a row of it back.
        if current.load(Ordering::SeqCst) != epoch {
            return;
        }
        // Checked again under the lock: another watch may have taken the
        // last place meanwhile.
        check_room(&t, id).map(|()| {
            t.insert(id, (epoch, Entry::Watch { polls: tx }));
        })
    };
    if let Err(f) = inserted {
        return out.error(id, f).await;
    }
    let slot = Slot::new(&table, id, epoch, out);
    let dirs = w.dirs.len() as u32;
    slot.out.msg(id, &Response::WatchStarted { dirs }).await;
    tracing::debug!(id, dirs, recursive, "watch started");
    run(ino, w, rx, &slot).await;
    tracing::debug!(id, "watch ended");
    slot.release();
}

async fn run(ino: Inotify, mut w: Watch, mut polls: mpsc::Receiver<u64>, slot: &Slot) {
    // SAFETY: `Fd` owns the inotify descriptor, which stays open and the
    // same until the AsyncFd (and the `Fd` in it) is dropped.
    let registered =
        unsafe { AsyncFd::register_with_interest(Fd(ino), tokio::io::Interest::READABLE) };
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            let e = std::io::Error::from(e);
            return slot
                .out
                .error(slot.id, Fail::io(&e, "inotify readiness"))
                .await;
        }
    };
    let mut waiting: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            ready = fd.readable() => {
                let mut g = match ready {
                    Ok(g) => g,
                    Err(e) => {
                        tracing::warn!(error = %e, "inotify readiness failed; ending the watch");
                        break;
                    }
                };
                let mut got = Vec::new();
                // Until the kernel's queue is empty (`WouldBlock` clears
                // the readiness).
                while let Ok(r) = g.try_io(|f| read_queued(&f.get_ref().0)) {
                    match r {
                        Ok(v) => got.extend(v),
                        Err(e) => {
                            tracing::warn!(error = %e, "inotify read failed");
                            break;
                        }
                    }
                }
                drop(g);
                for e in got {
                    w.on_event(&fd.get_ref().0, e);
                }
            }
            poll = polls.recv() => {
                let Some(wait_ms) = poll else { break };
                // What the kernel holds now belongs to this answer.
                while let Ok(v) = read_queued(&fd.get_ref().0) {
                    for e in v {
                        w.on_event(&fd.get_ref().0, e);
                    }
                }
                let wait = Duration::from_millis(wait_ms.min(MAX_WATCH_WAIT_MS));
                if w.buf.is_empty() && !wait.is_zero() {
                    waiting = Some(tokio::time::Instant::now() + wait);
                } else {
                    waiting = None;
                    answer(&mut w, slot).await;
                }
            }
            _ = async {
                match waiting {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                waiting = None;
                answer(&mut w, slot).await;
            }
        }
        if waiting.is_some() && !w.buf.is_empty() {
            waiting = None;
            answer(&mut w, slot).await;
        }
    }
}

async fn answer(w: &mut Watch, slot: &Slot) {
    let (events, more) = w.take_batch();
    slot.out
        .msg(slot.id, &Response::WatchEvents { events, more })
        .await;
}
