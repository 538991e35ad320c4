//! `filesystem.Filesystem/*`: stat, list, make, move and remove guest
//! paths, and directory watchers: inotify in the guest (the agent's `watch`
//! op, events as envd's fsnotify reports them) when the sandbox's agent has
//! it, else a poller (a listing kept per watcher and diffed at each
//! `GetWatcherEvents`) for sandboxes of older images.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use futures::StreamExt;
use serde_json::json;
use strata_core::SandboxId;
use strata_policy::CallKind;
use stratad::engine::{
    AgentError, DirEntry, DirWatch, FileKind, GuestErrorKind, RuntimeError, WatchEvent, WatchKind,
};
use stratad::service::watch::watch_unsupported;
use stratad::service::{Grant, ServiceError};

use super::{ancestry, ensure_owned, entry, envd_user, join, read, write, CappedBody};
use crate::auth::{EnvdSandbox, EnvdTarget};
use crate::connect::{Code, ConnectError};
use crate::error::service_err;
use crate::procs;
use crate::proto::{self, EntryInfo};
use crate::E2b;

/// Most bytes of extended attributes one listing or watcher poll keeps
/// (a guest may give every file 8 KiB of them): past it, entries come
/// without their attributes (no `metadata`).
const XATTR_BUDGET: usize = 16 << 20;

/// Charges `s`'s attributes to `left`; once it is spent they are dropped.
fn charge_xattrs(left: &mut usize, s: &mut DirEntry) {
    if let Some(x) = s.ext.as_mut() {
        let n: usize = x.xattrs.iter().map(|(k, v)| k.len() + v.len()).sum();
        if n > *left {
            x.xattrs.clear();
            *left = 0;
        } else {
            *left -= n;
        }
    }
}

async fn stat_entry(st: &Arc<E2b>, g: &Grant, path: &str) -> Result<EntryInfo, ConnectError> {
    let s = st.svc.stat(g, path).await.map_err(service_err)?;
    Ok(entry(path, &s))
}

impl E2b {
    /// The guest path of a request and the grant of `kind` on it (the path
    /// the gate decides on is the path the call uses).
    async fn path_grant(
        &self,
        id: &EnvdTarget,
        headers: &HeaderMap,
        asked: &str,
        kind: fn(&str) -> CallKind,
    ) -> Result<(String, Grant), ConnectError> {
        let path = self.user_path(&envd_user(headers, None)?, asked);
        let g = self.envd_grant(id, kind(&path)).await?;
        Ok((path, g))
    }
}

/// `filesystem.Filesystem/Stat`.
pub async fn stat(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::PathRequest, |id, r| async {
        let (path, g) = st.path_grant(&id, &headers, &r.path, read).await?;
        let e = stat_entry(&st, &g, &path).await?;
        Ok::<_, ConnectError>(json!({ "entry": e }))
    })
}

/// `filesystem.Filesystem/ListDir` (`depth` levels, 1 by default).
pub async fn list_dir(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::ListDirRequest, |id, r| async {
        let root = st.user_path(&envd_user(&headers, None)?, &r.path);
        let g = st.envd_grant(&id, read(&root)).await?;
        let depth = r.depth.max(1);
        let top = st.svc.stat(&g, &root).await.map_err(service_err)?;
        if top.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {root} is not a directory"),
            ));
        }
        // envd walks the tree depth first in name order (`filepath.WalkDir`):
        // a directory's entries come right after it.
        let mut entries = Vec::new();
        let mut budget = XATTR_BUDGET;
        let first = st.svc.list_dir(&g, &root).await.map_err(service_err)?;
        let mut stack: Vec<(String, u32, std::vec::IntoIter<DirEntry>)> =
            vec![(root, 1, first.into_iter())];
        while let Some((dir, level, items)) = stack.last_mut() {
            let Some(mut s) = items.next() else {
                stack.pop();
                continue;
            };
            charge_xattrs(&mut budget, &mut s);
            let (dir, level) = (dir.clone(), *level);
            let p = join(&dir, &s.name);
            entries.push(entry(&p, &s));
            if entries.len() > 100_000 {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    "more than 100000 entries",
                ));
            }
            if s.kind == FileKind::Dir && level < depth {
                let items = match st.svc.list_dir(&g, &p).await {
                    Ok(v) => v,
                    // Removed between two listings.
                    Err(ServiceError::Engine(RuntimeError::Guest {
                        kind: GuestErrorKind::NotFound,
                        ..
                    })) => continue,
                    Err(e) => return Err(service_err(e)),
                };
                stack.push((p, level + 1, items.into_iter()));
            }
        }
        Ok::<_, ConnectError>(json!({ "entries": entries }))
    })
}

/// `filesystem.Filesystem/MakeDir` (parents too; `already_exists` if it does).
pub async fn make_dir(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::PathRequest, |id, r| async {
        let (path, g) = st.path_grant(&id, &headers, &r.path, write).await?;
        match st.svc.stat(&g, &path).await {
            Ok(_) => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("{path} already exists"),
                ))
            }
            Err(ServiceError::Engine(RuntimeError::Guest {
                kind: GuestErrorKind::NotFound,
                ..
            })) => {}
            Err(e) => return Err(service_err(e)),
        }
        // envd's EnsureDirs: as root, each directory made given to the user.
        let user = envd_user(&headers, None)?;
        ensure_owned(&st, &g, &user, &ancestry(&path), None).await?;
        let e = stat_entry(&st, &g, &path).await?;
        Ok::<_, ConnectError>(json!({ "entry": e }))
    })
}

/// `filesystem.Filesystem/Move` (a `mv` in the guest).
pub async fn move_entry(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::MoveRequest, |id, r| async {
        let user = envd_user(&headers, None)?;
        let (src, dst) = (
            st.user_path(&user, &r.source),
            st.user_path(&user, &r.destination),
        );
        stratad::service::validate_guest_path(&src).map_err(service_err)?;
        stratad::service::validate_guest_path(&dst).map_err(service_err)?;
        // Both ends are writes: the gate decides each, the `mv` helper
        // runs under the destination's grant.
        let from = st.envd_grant(&id, write(&src)).await?;
        let to = st.envd_grant(&id, write(&dst)).await?;
        st.svc.stat(&from, &src).await.map_err(service_err)?;
        let argv = vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            r#"mkdir -p -- "$(dirname -- "$1")" && mv -- "$0" "$1""#.to_owned(),
            src,
            dst.clone(),
        ];
        let (code, _, err) = procs::run_helper(&st.svc, &to, argv, None, 60).await?;
        if code != Some(0) {
            return Err(ConnectError::new(
                Code::Unknown,
                format!("move failed: {}", String::from_utf8_lossy(&err).trim()),
            ));
        }
        let e = stat_entry(&st, &to, &dst).await?;
        Ok::<_, ConnectError>(json!({ "entry": e }))
    })
}

/// `filesystem.Filesystem/Remove` (recursive; a missing path is no error, as in envd).
pub async fn remove(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, proto::PathRequest, |id, r| async {
        let (path, g) = st.path_grant(&id, &headers, &r.path, write).await?;
        match st.svc.remove(&g, &path, true).await {
            // envd's `os.RemoveAll`: a path that is not there is removed.
            Ok(())
            | Err(ServiceError::Engine(RuntimeError::Guest {
                kind: GuestErrorKind::NotFound,
                ..
            })) => {}
            Err(e) => return Err(service_err(e)),
        }
        Ok::<_, ConnectError>(json!({}))
    })
}

// ---------------------------------------------------------------- watch

/// What a watcher remembers of one entry: kind, size, mtime.
type Seen = (FileKind, u64, i64);

/// A watcher: an inotify watch in the guest (`live`), or, with an agent
/// older than watches, the listing at the last poll, diffed at the next.
/// It reads under the read grant of its root, decided at its creation.
#[derive(Debug)]
pub struct Watcher {
    pub(crate) grant: Grant,
    root: String,
    recursive: bool,
    /// Events carry the entry's info (envd 0.6.3 `include_entry`).
    include_entry: bool,
    /// The poller's last listing (empty for a live watcher).
    seen: BTreeMap<String, Seen>,
    /// The guest's inotify watch; the agent holds its events until polled.
    live: Option<Arc<tokio::sync::Mutex<DirWatch>>>,
}

/// Most events one `GetWatcherEvents` answer carries from a live watcher
/// (the agent holds at most 4096 and an overflow marker between polls).
const LIVE_EVENTS_MAX: usize = 8192;
/// How long one poll of a `WatchDir` stream waits in the guest for an event.
const LIVE_STREAM_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Starts the guest's inotify watch of `root`; `None` when this sandbox's
/// agent (or the engine) has none: the caller polls instead.
async fn start_live(
    st: &Arc<E2b>,
    g: &Grant,
    root: &str,
    recursive: bool,
) -> Result<Option<DirWatch>, ConnectError> {
    match st.svc.watch_dir(g, root, recursive).await {
        Ok(w) => Ok(Some(w)),
        Err(e) if watch_unsupported(&e) => Ok(None),
        // The agent's caps (watches per sandbox, directories per watch).
        Err(ServiceError::Engine(RuntimeError::Guest {
            kind: GuestErrorKind::Other,
            message,
            ..
        })) if message.starts_with("too many") || message.starts_with("more than") => Err(
            ConnectError::new(Code::ResourceExhausted, format!("watch {root}: {message}")),
        ),
        Err(e) => Err(service_err(e)),
    }
}

impl E2b {
    /// Forgets the watchers of sandbox `id` whose guest watch is over (its
    /// agent connection went away: a pause, a restart), so the door keeps
    /// no more of them than the agent's cap per connection.
    fn prune_watchers(&self, id: &SandboxId) {
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, w| {
                w.grant.sandbox() != id
                    || !w
                        .live
                        .as_ref()
                        .is_some_and(|l| l.try_lock().is_ok_and(|l| l.is_closed()))
            });
    }
}

/// envd's name of an event kind (`None`: not an event envd reports).
fn live_type(k: WatchKind) -> Option<&'static str> {
    Some(match k {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchKind::Overflow | WatchKind::Other => return None,
    })
}

fn lost_events(what: &str) -> ConnectError {
    ConnectError::new(
        Code::ResourceExhausted,
        format!(
            "{what} lost events: more changed in the guest than it holds between reads (4096); watch again"
        ),
    )
}

/// A failed poll of a live watch: the sandbox paused or stopped (its agent
/// connection went away, which ends every watch), or the agent failed.
fn live_err(what: &str, e: AgentError) -> ConnectError {
    match e {
        AgentError::Closed => ConnectError::new(
            Code::NotFound,
            format!("{what} ended: the sandbox was paused, stopped or restarted"),
        ),
        AgentError::Timeout => ConnectError::new(
            Code::DeadlineExceeded,
            format!("{what}: the guest did not answer"),
        ),
        e => ConnectError::new(Code::Unknown, format!("{what}: {e}")),
    }
}

/// Live events as envd's `FilesystemEvent`s; with `include_entry` the entry
/// of each path still there (best effort, as envd: one stat per name).
async fn live_json(
    st: &Arc<E2b>,
    g: &Grant,
    root: &str,
    include_entry: bool,
    events: Vec<WatchEvent>,
) -> Vec<serde_json::Value> {
    let mut entries: BTreeMap<String, Option<EntryInfo>> = BTreeMap::new();
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        let Some(ty) = live_type(e.kind) else {
            continue;
        };
        let mut v = json!({ "name": e.name, "type": ty });
        if include_entry && e.kind != WatchKind::Remove && e.kind != WatchKind::Rename {
            let path = join(root, &e.name);
            if !entries.contains_key(&e.name) {
                let info = st.svc.stat(g, &path).await.ok().map(|s| entry(&path, &s));
                entries.insert(e.name.clone(), info);
            }
            if let Some(Some(info)) = entries.get(&e.name) {
                v["entry"] = json!(info);
            }
        }
        out.push(v);
    }
    out
}

/// Most entries a watcher tracks.
const WATCH_MAX_ENTRIES: usize = 20_000;

/// Whether `name` is the agent's temporary file of an upload in progress
/// (`.<name>.strata-upload-<pid>-<id>`, renamed into place at its end):
/// not a file of the user's, so watchers leave it out (envd, writing in
/// place, has none).
fn is_upload_temp(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else {
        return false;
    };
    let Some((_, tail)) = rest.rsplit_once(".strata-upload-") else {
        return false;
    };
    let mut parts = tail.split('-');
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(a), Some(b), None)
            if !a.is_empty() && !b.is_empty()
                && a.bytes().chain(b.bytes()).all(|c| c.is_ascii_digit())
    )
}

/// What a watcher remembers of a listing.
fn seen_of(listing: &BTreeMap<String, DirEntry>) -> BTreeMap<String, Seen> {
    listing
        .iter()
        .map(|(k, s)| (k.clone(), (s.kind, s.size, s.mtime)))
        .collect()
}

/// The entries under `root` (one level, or all with `recursive`) by path
/// relative to it.
async fn snapshot_dir(
    st: &Arc<E2b>,
    g: &Grant,
    root: &str,
    recursive: bool,
) -> Result<BTreeMap<String, DirEntry>, ConnectError> {
    let mut out = BTreeMap::new();
    let mut budget = XATTR_BUDGET;
    let mut level = vec![root.to_owned()];
    while let Some(dir) = level.pop() {
        let items = match st.svc.list_dir(g, &dir).await {
            Ok(v) => v,
            // A subdirectory removed between two listings.
            Err(ServiceError::Engine(RuntimeError::Guest {
                kind: GuestErrorKind::NotFound,
                ..
            })) if dir != root => continue,
            Err(e) => return Err(service_err(e)),
        };
        for mut s in items {
            if is_upload_temp(&s.name) {
                continue;
            }
            charge_xattrs(&mut budget, &mut s);
            let p = join(&dir, &s.name);
            if recursive && s.kind == FileKind::Dir {
                level.push(p.clone());
            }
            let rel = p[root.trim_end_matches('/').len()..]
                .trim_start_matches('/')
                .to_owned();
            out.insert(rel, s);
            if out.len() > WATCH_MAX_ENTRIES {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("more than {WATCH_MAX_ENTRIES} entries to watch"),
                ));
            }
        }
    }
    Ok(out)
}

/// The events between two listings: `(relative name, EVENT_TYPE_…)`.
pub fn diff_listings(
    old: &BTreeMap<String, Seen>,
    new: &BTreeMap<String, Seen>,
) -> Vec<(String, &'static str)> {
    let mut ev = Vec::new();
    for (k, v) in new {
        match old.get(k) {
            None => {
                ev.push((k.clone(), "EVENT_TYPE_CREATE"));
                // Created with content: it was also written to (what
                // inotify reports for a file created and written).
                if v.0 == FileKind::File && v.1 > 0 {
                    ev.push((k.clone(), "EVENT_TYPE_WRITE"));
                }
            }
            Some(o) if o.0 != FileKind::Dir && (o.1 != v.1 || o.2 != v.2) => {
                ev.push((k.clone(), "EVENT_TYPE_WRITE"))
            }
            _ => {}
        }
    }
    for k in old.keys() {
        if !new.contains_key(k) {
            ev.push((k.clone(), "EVENT_TYPE_REMOVE"));
        }
    }
    ev
}

/// `filesystem.Filesystem/CreateWatcher`: remembers the directory's listing.
pub async fn create_watcher(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, serde_json::Value, |id, r| async {
        let path = st.user_path(
            &envd_user(&headers, None)?,
            r.get("path").and_then(|v| v.as_str()).unwrap_or(""),
        );
        let recursive = r
            .get("recursive")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let include_entry = r
            .get("includeEntry")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        // `allowNetworkMounts` (envd 0.6.4) is accepted: the poller watches
        // any directory the agent can list, network mount or not.
        let g = st.envd_grant(&id, read(&path)).await?;
        let top = st.svc.stat(&g, &path).await.map_err(service_err)?;
        if top.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {path} is not a directory"),
            ));
        }
        st.prune_watchers(&id);
        let live = start_live(&st, &g, &path, recursive).await?;
        let seen = match live {
            Some(_) => BTreeMap::new(),
            None => seen_of(&snapshot_dir(&st, &g, &path, recursive).await?),
        };
        let live = live.map(|w| Arc::new(tokio::sync::Mutex::new(w)));
        let wid = format!("w-{}", hex::encode(&crate::auth::random_secret()[..8]));
        st.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                wid.clone(),
                Watcher {
                    grant: g,
                    root: path,
                    recursive,
                    include_entry,
                    seen,
                    live,
                },
            );
        Ok::<_, ConnectError>(json!({ "watcherId": wid }))
    })
}

fn watcher_id(r: &serde_json::Value) -> String {
    r.get("watcherId")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_owned()
}

impl E2b {
    /// The watcher a call on sandbox `id` names (its id, grant, root and
    /// recursion), once the sandbox is looked up for its envd caller (a gone
    /// sandbox answers `not running` first); a watcher of another sandbox
    /// answers like an unknown one. `remove`: it is also forgotten.
    async fn watcher_call(
        &self,
        id: &EnvdTarget,
        r: &serde_json::Value,
        remove: bool,
    ) -> Result<WatcherCall, ConnectError> {
        self.envd_access(id).await?;
        let wid = watcher_id(r);
        let mut g = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        let call = match g.get(&wid) {
            Some(w) if w.grant.sandbox() == &id.id => WatcherCall {
                wid: wid.clone(),
                grant: w.grant.clone(),
                root: w.root.clone(),
                recursive: w.recursive,
                include_entry: w.include_entry,
                live: w.live.clone(),
            },
            _ => return Err(watcher_gone(&wid)),
        };
        if remove {
            g.remove(&wid);
        }
        Ok(call)
    }

    fn forget_watcher(&self, wid: &str) {
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(wid);
    }
}

/// What a watcher call needs of its watcher.
struct WatcherCall {
    wid: String,
    grant: Grant,
    root: String,
    recursive: bool,
    include_entry: bool,
    live: Option<Arc<tokio::sync::Mutex<DirWatch>>>,
}

impl E2b {}

fn watcher_gone(wid: &str) -> ConnectError {
    ConnectError::new(Code::NotFound, format!("watcher {wid} not found"))
}

/// `filesystem.Filesystem/GetWatcherEvents`: lists again and reports the difference.
pub async fn get_watcher_events(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, serde_json::Value, |id, r| async {
        let WatcherCall {
            wid,
            grant,
            root,
            recursive,
            include_entry,
            live,
        } = st.watcher_call(&id, &r, false).await?;
        // Polling a watcher decided at its creation never wakes the sandbox.
        st.svc
            .require_running(&grant)
            .await
            .map_err(crate::error::service_err)?;
        if let Some(live) = live {
            let what = format!("watcher {wid}");
            let mut events = Vec::new();
            {
                let mut w = live.lock().await;
                loop {
                    match w.poll(std::time::Duration::ZERO).await {
                        Ok(b) => {
                            events.extend(b.events);
                            if !b.more || events.len() >= LIVE_EVENTS_MAX {
                                break;
                            }
                        }
                        Err(e) => {
                            st.forget_watcher(&wid);
                            return Err(live_err(&what, e));
                        }
                    }
                }
            }
            if events.iter().any(|e| e.kind == WatchKind::Overflow) {
                st.forget_watcher(&wid);
                return Err(lost_events(&what));
            }
            let events = live_json(&st, &grant, &root, include_entry, events).await;
            return Ok(json!({ "events": events }));
        }
        let listing = snapshot_dir(&st, &grant, &root, recursive).await?;
        let new = seen_of(&listing);
        let events = {
            let mut g = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
            let Some(w) = g.get_mut(&wid) else {
                return Err(watcher_gone(&wid));
            };
            let ev = diff_listings(&w.seen, &new);
            w.seen = new;
            ev
        };
        let events = event_json(events, &listing, &root, include_entry);
        Ok::<_, ConnectError>(json!({ "events": events }))
    })
}

/// Events as envd's `FilesystemEvent`s; with `include_entry` the entry of
/// each path still there (best effort, as envd).
fn event_json(
    events: Vec<(String, &'static str)>,
    listing: &BTreeMap<String, DirEntry>,
    root: &str,
    include_entry: bool,
) -> Vec<serde_json::Value> {
    events
        .into_iter()
        .map(|(name, ty)| {
            let mut e = json!({ "name": name, "type": ty });
            if let Some(s) = listing.get(&name).filter(|_| include_entry) {
                e["entry"] = json!(entry(&join(root, &name), s));
            }
            e
        })
        .collect()
}

/// How often a `WatchDir` stream lists its directory again.
const WATCH_STREAM_POLL: std::time::Duration = std::time::Duration::from_millis(300);
/// How often a `WatchDir` stream sends a keepalive when nothing happens.
const WATCH_STREAM_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(30);

/// `filesystem.Filesystem/WatchDir` (server stream; what the async SDK
/// uses): a `start` message once the directory is listed, then a
/// `filesystem` message per event found by listing again every
/// [`WATCH_STREAM_POLL`], a `keepalive` every [`WATCH_STREAM_KEEPALIVE`].
/// It polls under the read grant decided at its start, never wakes the
/// sandbox (a sandbox that stops running ends it with an error), and
/// ends when the client goes away.
pub async fn watch_dir(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Extension(EnvdSandbox(id)): Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    let setup = async {
        let r: serde_json::Value = crate::connect::stream_request(&body.0)?;
        let flag = |k: &str| r.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
        let (recursive, include_entry) = (flag("recursive"), flag("includeEntry"));
        let path = st.user_path(
            &envd_user(&headers, None)?,
            r.get("path").and_then(|v| v.as_str()).unwrap_or(""),
        );
        let g = st.envd_grant(&id, read(&path)).await?;
        let top = st.svc.stat(&g, &path).await.map_err(service_err)?;
        if top.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {path} is not a directory"),
            ));
        }
        let live = start_live(&st, &g, &path, recursive).await?;
        let seen = match live {
            Some(_) => BTreeMap::new(),
            None => seen_of(&snapshot_dir(&st, &g, &path, recursive).await?),
        };
        Ok::<_, ConnectError>((g, path, recursive, include_entry, seen, live))
    };
    let (g, root, recursive, include_entry, seen, live) = match setup.await {
        Ok(v) => v,
        Err(e) => return crate::connect::stream_error(e),
    };
    let start = crate::connect::message_frame(&json!({ "start": {} }));
    if let Some(w) = live {
        return live_stream(st, g, root, include_entry, w, start);
    }
    struct Poll {
        st: Arc<E2b>,
        g: Grant,
        root: String,
        recursive: bool,
        include_entry: bool,
        seen: BTreeMap<String, Seen>,
        queue: std::collections::VecDeque<bytes::Bytes>,
        quiet_since: tokio::time::Instant,
        done: bool,
    }
    let poll = Poll {
        st,
        g,
        root,
        recursive,
        include_entry,
        seen,
        queue: Default::default(),
        quiet_since: tokio::time::Instant::now(),
        done: false,
    };
    let events = futures::stream::unfold(poll, |mut p| async move {
        loop {
            if let Some(f) = p.queue.pop_front() {
                return Some((f, p));
            }
            if p.done {
                return None;
            }
            tokio::time::sleep(WATCH_STREAM_POLL).await;
            let listed = match p.st.svc.require_running(&p.g).await {
                Ok(()) => snapshot_dir(&p.st, &p.g, &p.root, p.recursive).await,
                Err(e) => Err(service_err(e)),
            };
            let listing = match listed {
                Ok(l) => l,
                Err(e) => {
                    p.queue.push_back(e.end_frame());
                    p.done = true;
                    continue;
                }
            };
            let new = seen_of(&listing);
            let ev = diff_listings(&p.seen, &new);
            p.seen = new;
            for e in event_json(ev, &listing, &p.root, p.include_entry) {
                p.queue
                    .push_back(crate::connect::message_frame(&json!({ "filesystem": e })));
                p.quiet_since = tokio::time::Instant::now();
            }
            if p.quiet_since.elapsed() >= WATCH_STREAM_KEEPALIVE {
                p.queue
                    .push_back(crate::connect::message_frame(&json!({ "keepalive": {} })));
                p.quiet_since = tokio::time::Instant::now();
            }
        }
    });
    crate::connect::stream_response(futures::stream::once(async move { start }).chain(events))
}

/// `WatchDir` over the guest's inotify watch: each poll waits in the guest
/// up to [`LIVE_STREAM_WAIT`] for an event (so the stream holds at most one
/// answer of the agent), a `keepalive` every [`WATCH_STREAM_KEEPALIVE`] of
/// quiet; a sandbox that stops running, lost events or a failed poll end it
/// with an error. Dropping the stream (the client went away) ends the watch.
fn live_stream(
    st: Arc<E2b>,
    g: Grant,
    root: String,
    include_entry: bool,
    w: DirWatch,
    start: bytes::Bytes,
) -> Response {
    struct Live {
        st: Arc<E2b>,
        g: Grant,
        root: String,
        include_entry: bool,
        w: DirWatch,
        queue: std::collections::VecDeque<bytes::Bytes>,
        quiet_since: tokio::time::Instant,
        done: bool,
    }
    let state = Live {
        st,
        g,
        root,
        include_entry,
        w,
        queue: Default::default(),
        quiet_since: tokio::time::Instant::now(),
        done: false,
    };
    let events = futures::stream::unfold(state, |mut p| async move {
        loop {
            if let Some(f) = p.queue.pop_front() {
                return Some((f, p));
            }
            if p.done {
                return None;
            }
            let polled = match p.st.svc.require_running(&p.g).await {
                Ok(()) => {
                    p.w.poll(LIVE_STREAM_WAIT)
                        .await
                        .map_err(|e| live_err("watch", e))
                }
                Err(e) => Err(service_err(e)),
            };
            let batch = match polled {
                Ok(b) if b.events.iter().any(|e| e.kind == WatchKind::Overflow) => {
                    Err(lost_events("watch"))
                }
                other => other,
            };
            match batch {
                Ok(b) => {
                    for e in live_json(&p.st, &p.g, &p.root, p.include_entry, b.events).await {
                        p.queue
                            .push_back(crate::connect::message_frame(&json!({ "filesystem": e })));
                        p.quiet_since = tokio::time::Instant::now();
                    }
                }
                Err(e) => {
                    p.queue.push_back(e.end_frame());
                    p.done = true;
                    continue;
                }
            }
            if p.quiet_since.elapsed() >= WATCH_STREAM_KEEPALIVE {
                p.queue
                    .push_back(crate::connect::message_frame(&json!({ "keepalive": {} })));
                p.quiet_since = tokio::time::Instant::now();
            }
        }
    });
    crate::connect::stream_response(futures::stream::once(async move { start }).chain(events))
}

/// `filesystem.Filesystem/RemoveWatcher`.
pub async fn remove_watcher(
    State(st): State<Arc<E2b>>,
    sbx: Extension<EnvdSandbox>,
    body: CappedBody,
) -> Response {
    unary!(sbx, body, serde_json::Value, |id, r| async {
        st.watcher_call(&id, &r, true).await?;
        Ok::<_, ConnectError>(json!({}))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xattrs_past_the_budget_are_dropped() {
        let e = |n: usize| -> DirEntry {
            serde_json::from_value(json!({
                "name": "f", "kind": "file", "size": 1, "mode": 0o644, "mtime": 0,
                "ext": {"uid": 0, "gid": 0, "xattrs": {"user.e2b.k": "v".repeat(n)}},
            }))
            .unwrap()
        };
        let mut left = 100;
        let (mut a, mut b, mut c) = (e(50), e(60), e(10));
        charge_xattrs(&mut left, &mut a);
        charge_xattrs(&mut left, &mut b);
        charge_xattrs(&mut left, &mut c);
        assert_eq!(a.ext.unwrap().xattrs.len(), 1);
        assert!(b.ext.unwrap().xattrs.is_empty());
        assert!(c.ext.unwrap().xattrs.is_empty(), "nothing after the budget");
        assert_eq!(left, 0);
    }

    #[test]
    fn upload_temporaries_are_recognised() {
        assert!(is_upload_temp(".f.txt.strata-upload-116-166"));
        assert!(!is_upload_temp("f.txt.strata-upload-116-166"));
        assert!(!is_upload_temp(".f.txt.strata-upload-116"));
        assert!(!is_upload_temp(".f.txt.strata-upload-1a-2"));
        assert!(!is_upload_temp(".hidden"));
    }

    #[test]
    fn watcher_diff() {
        let mut a = BTreeMap::new();
        a.insert("x".to_owned(), (FileKind::File, 1, 10));
        a.insert("gone".to_owned(), (FileKind::File, 1, 10));
        a.insert("d".to_owned(), (FileKind::Dir, 4096, 10));
        let mut b = a.clone();
        b.remove("gone");
        b.insert("x".to_owned(), (FileKind::File, 2, 11));
        b.insert("d".to_owned(), (FileKind::Dir, 4096, 12));
        b.insert("new".to_owned(), (FileKind::File, 0, 12));
        b.insert("full".to_owned(), (FileKind::File, 3, 12));
        let mut ev = diff_listings(&a, &b);
        ev.sort();
        assert_eq!(
            ev,
            [
                ("full".to_owned(), "EVENT_TYPE_CREATE"),
                ("full".to_owned(), "EVENT_TYPE_WRITE"),
                ("gone".to_owned(), "EVENT_TYPE_REMOVE"),
                ("new".to_owned(), "EVENT_TYPE_CREATE"),
                ("x".to_owned(), "EVENT_TYPE_WRITE"),
            ]
        );
    }
}
