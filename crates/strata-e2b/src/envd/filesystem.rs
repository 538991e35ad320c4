//! `filesystem.Filesystem/*`: stat, list, make, move and remove guest
//! paths, and polling directory watchers (a listing kept per watcher and
//! diffed at each `GetWatcherEvents`).

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
use stratad::engine::{DirEntry, FileKind, GuestErrorKind, RuntimeError};
use stratad::service::{Grant, ServiceError};

use super::{ancestry, ensure_owned, entry, envd_user, join, read, write, CappedBody};
use crate::auth::EnvdSandbox;
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
        id: &SandboxId,
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

/// A polling watcher: the listing at the last poll, diffed at the next.
/// It polls under the read grant of its root, decided at its creation.
#[derive(Debug)]
pub struct Watcher {
    pub(crate) grant: Grant,
    root: String,
    recursive: bool,
    /// Events carry the entry's info (envd 0.6.3 `include_entry`).
    include_entry: bool,
    seen: BTreeMap<String, Seen>,
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
        let seen = seen_of(&snapshot_dir(&st, &g, &path, recursive).await?);
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
        id: &SandboxId,
        r: &serde_json::Value,
        remove: bool,
    ) -> Result<(String, Grant, String, bool, bool), ConnectError> {
        self.envd_access(id).await?;
        let wid = watcher_id(r);
        let mut g = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        let (grant, root, recursive, include_entry) = match g.get(&wid) {
            Some(w) if w.grant.sandbox() == id => (
                w.grant.clone(),
                w.root.clone(),
                w.recursive,
                w.include_entry,
            ),
            _ => return Err(watcher_gone(&wid)),
        };
        if remove {
            g.remove(&wid);
        }
        Ok((wid, grant, root, recursive, include_entry))
    }
}

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
        let (wid, grant, root, recursive, include_entry) = st.watcher_call(&id, &r, false).await?;
        // Polling a watcher decided at its creation never wakes the sandbox.
        st.svc
            .require_running(&grant)
            .await
            .map_err(crate::error::service_err)?;
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
        let seen = seen_of(&snapshot_dir(&st, &g, &path, recursive).await?);
        Ok::<_, ConnectError>((g, path, recursive, include_entry, seen))
    };
    let (g, root, recursive, include_entry, seen) = match setup.await {
        Ok(v) => v,
        Err(e) => return crate::connect::stream_error(e),
    };
    let start = crate::connect::message_frame(&json!({ "start": {} }));
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
