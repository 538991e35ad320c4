//! envd (`E2B_SANDBOX_URL`): the in-sandbox API, served by the daemon for
//! every sandbox. The sandbox is named by the `E2b-Sandbox-Id` header and
//! each call carries that sandbox's `X-Access-Token`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use futures::{Stream, StreamExt, TryStreamExt};
use serde_json::json;
use strata_core::{SandboxId, SandboxState};
use strata_policy::CallKind;
use stratad::engine::{EngineError, FileKind, FileStat};
use stratad::service::{Grant, ServiceError};
use tokio::sync::mpsc;

use crate::connect::{self, Code, ConnectError};
use crate::procs::{self, Proc};
use crate::proto::{self, EntryInfo, FileType, ProcessEvent};
use crate::E2b;

/// Header naming the sandbox.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Header carrying the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// Header with the keepalive interval the client wants, in seconds.
pub const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// The message E2B's proxy uses for a sandbox that is not running; the SDK
/// turns it into `SandboxNotRunningException`.
fn not_running(id: &str) -> String {
    format!("The sandbox {id} was not found")
}

/// A service error as a Connect error.
pub fn service_err(e: ServiceError) -> ConnectError {
    let msg = e.message();
    let code = match &e {
        ServiceError::NotFound {
            kind: "sandbox",
            id,
        } => return ConnectError::new(Code::Unavailable, not_running(id)),
        ServiceError::NotFound { .. } => Code::NotFound,
        ServiceError::InvalidRequest(_) | ServiceError::InvalidSize(_) => Code::InvalidArgument,
        ServiceError::InvalidState(_) | ServiceError::InvalidStateOther(_) => {
            Code::FailedPrecondition
        }
        ServiceError::Conflict(_) => Code::Aborted,
        ServiceError::InsufficientCapacity(_) => Code::ResourceExhausted,
        ServiceError::Engine(EngineError::GuestNotFound(_)) => Code::NotFound,
        ServiceError::Engine(EngineError::SandboxNotFound(id)) => {
            return ConnectError::new(Code::Unavailable, not_running(id))
        }
        ServiceError::Engine(EngineError::Invalid(_)) => Code::InvalidArgument,
        ServiceError::Engine(EngineError::Agent(m)) => {
            let m = m.to_ascii_lowercase();
            if m.contains("exists") {
                Code::AlreadyExists
            } else if m.contains("not a directory") || m.contains("is a directory") {
                Code::InvalidArgument
            } else if m.contains("permission denied") {
                Code::PermissionDenied
            } else {
                Code::Unknown
            }
        }
        ServiceError::Engine(EngineError::NotRunning(id)) => {
            return ConnectError::new(Code::Unavailable, not_running(id))
        }
        ServiceError::Engine(EngineError::AgentTimeout { .. }) => Code::DeadlineExceeded,
        ServiceError::Gate(r) => crate::policy::refusal_code(r),
        ServiceError::Forbidden(_) => Code::PermissionDenied,
        _ => Code::Internal,
    };
    ConnectError::new(code, msg)
}

impl E2b {
    /// The sandbox of an envd request, after checking its access token.
    fn envd_sandbox(&self, headers: &HeaderMap) -> Result<SandboxId, ConnectError> {
        let raw = headers
            .get(SANDBOX_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                ConnectError::new(Code::InvalidArgument, "missing E2b-Sandbox-Id header")
            })?;
        let token = headers
            .get(ACCESS_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !crate::auth::constant_time_eq(token.as_bytes(), self.envd_token(raw).as_bytes()) {
            return Err(ConnectError::new(
                Code::Unauthenticated,
                "invalid or missing X-Access-Token for this sandbox",
            ));
        }
        raw.parse()
            .map_err(|_| ConnectError::new(Code::Unavailable, not_running(raw)))
    }
}

fn read(path: &str) -> CallKind {
    CallKind::FileRead {
        path: path.to_owned(),
    }
}

fn write(path: &str) -> CallKind {
    CallKind::FileWrite {
        path: path.to_owned(),
    }
}

fn rfc3339_secs(t: i64) -> String {
    DateTime::<Utc>::from_timestamp(t, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn entry(path: &str, s: &FileStat) -> EntryInfo {
    let kind = match s.kind {
        FileKind::File => FileType::File,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Other => FileType::Unspecified,
    };
    let name = path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_owned();
    EntryInfo {
        name,
        kind,
        path: path.to_owned(),
        size: s.size.to_string(),
        mode: s.mode & 0o7777,
        permissions: proto::permissions(kind, s.mode),
        owner: String::new(),
        group: String::new(),
        modified_time: rfc3339_secs(s.mtime),
    }
}

fn join(dir: &str, name: &str) -> String {
    format!("{}/{}", dir.trim_end_matches('/'), name)
}

fn parent(path: &str) -> Option<&str> {
    match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) => Some("/"),
        Some((p, _)) => Some(p),
        None => None,
    }
}

// ---------------------------------------------------------------- health

/// `GET /health` → 204 while the sandbox runs, 502 (not found) otherwise.
/// Without a valid `X-Access-Token` for the sandbox it answers exactly as
/// for an unknown one (the SDK's `is_running()` reads 502 as not running).
pub async fn health(State(st): State<Arc<E2b>>, headers: HeaderMap) -> Response {
    let raw = headers
        .get(SANDBOX_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let running = match st.envd_sandbox(&headers) {
        Ok(id) => match st.envd_caller(&id).await {
            Ok(caller) => matches!(
                st.svc.get_sandbox(&caller, &id).await.map(|r| r.state),
                Ok(SandboxState::Running)
            ),
            Err(_) => false,
        },
        Err(_) => false,
    };
    if running {
        StatusCode::NO_CONTENT.into_response()
    } else {
        (
            StatusCode::BAD_GATEWAY,
            Json(json!({"code": 502, "message": not_running(raw)})),
        )
            .into_response()
    }
}

// ----------------------------------------------------------------- files

fn files_err(e: ConnectError) -> Response {
    let status = match e.code {
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        c => c.http_status(),
    };
    (
        status,
        Json(json!({"code": status.as_u16(), "message": e.message})),
    )
        .into_response()
}

fn query_path(st: &E2b, raw: Option<&str>) -> Option<String> {
    form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .find(|(k, _)| k == "path")
        .map(|(_, v)| st.guest_path(&v))
}

/// `GET /files?path=` → the file's bytes (404 when missing).
pub async fn download(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let id = match st.envd_sandbox(&headers) {
        Ok(id) => id,
        Err(e) => return files_err(e),
    };
    let Some(path) = query_path(&st, raw.as_deref()) else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    let g = match st.envd_grant(&id, read(&path)).await {
        Ok(g) => g,
        Err(e) => return files_err(e),
    };
    match st.svc.stat(&g, &path).await {
        Ok(s) if s.kind == FileKind::Dir => {
            return files_err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {path} is a directory"),
            ))
        }
        Ok(_) => {}
        Err(e) => return files_err(service_err(e)),
    }
    match st.svc.read_file(&g, &path).await {
        Ok(stream) => {
            let body = Body::from_stream(stream.map_err(std::io::Error::other));
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                body,
            )
                .into_response()
        }
        Err(e) => files_err(service_err(e)),
    }
}

/// One part of a `multipart/form-data` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Form field name.
    pub name: String,
    /// File name, when given.
    pub filename: Option<String>,
    /// Content.
    pub data: Bytes,
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

fn disposition_param(line: &str, key: &str) -> Option<String> {
    for item in line.split(';').skip(1) {
        let item = item.trim();
        if let Some(v) = item
            .strip_prefix(key)
            .and_then(|r| r.trim_start().strip_prefix('='))
        {
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|s| s.strip_suffix('"'))
                .unwrap_or(v);
            return Some(v.replace("\\\"", "\"").replace("%22", "\""));
        }
    }
    None
}

/// Parses a complete `multipart/form-data` body.
pub fn parse_multipart(body: &Bytes, boundary: &str) -> Result<Vec<Part>, String> {
    let delim = format!("--{boundary}");
    let d = delim.as_bytes();
    let mut pos = find(body, d, 0).ok_or("no multipart boundary in the body")? + d.len();
    let mut parts = Vec::new();
    loop {
        if body.get(pos..pos + 2) == Some(b"--") {
            return Ok(parts);
        }
        if body.get(pos..pos + 2) == Some(b"\r\n") {
            pos += 2;
        }
        let hend = find(body, b"\r\n\r\n", pos).ok_or("truncated part headers")?;
        let head = String::from_utf8_lossy(&body[pos..hend]).into_owned();
        let start = hend + 4;
        let next_delim = format!("\r\n{delim}");
        let end = find(body, next_delim.as_bytes(), start).ok_or("unterminated part")?;
        let mut name = String::new();
        let mut filename = None;
        for line in head.split("\r\n") {
            if line
                .to_ascii_lowercase()
                .starts_with("content-disposition:")
            {
                name = disposition_param(line, "name").unwrap_or_default();
                filename = disposition_param(line, "filename");
            }
        }
        parts.push(Part {
            name,
            filename,
            data: body.slice(start..end),
        });
        pos = end + next_delim.len();
    }
}

async fn write_one(
    st: &Arc<E2b>,
    id: &SandboxId,
    path: &str,
    body: stratad::engine::ByteStream,
) -> Result<serde_json::Value, ConnectError> {
    let g = st.envd_grant(id, write(path)).await?;
    if let Some(dir) = parent(path) {
        if dir != "/" {
            st.svc.mkdir(&g, dir, true).await.map_err(service_err)?;
        }
    }
    st.svc
        .write_file(&g, path, 0o644, body)
        .await
        .map_err(service_err)?;
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    Ok(json!({"name": name, "type": "file", "path": path}))
}

/// `POST /files?path=`: multipart (field `file`) or octet-stream → `[WriteInfo]`.
pub async fn upload(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Body,
) -> Response {
    let id = match st.envd_sandbox(&headers) {
        Ok(id) => id,
        Err(e) => return files_err(e),
    };
    let path = query_path(&st, raw.as_deref());
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v != "identity")
    {
        return files_err(ConnectError::new(
            Code::Unimplemented,
            "compressed uploads are not supported",
        ));
    }
    if let Some(b) = ctype.strip_prefix("multipart/form-data") {
        let Some(boundary) = disposition_param(b, "boundary") else {
            return files_err(ConnectError::new(
                Code::InvalidArgument,
                "multipart body without boundary",
            ));
        };
        let bytes = match axum::body::to_bytes(body, usize::MAX).await {
            Ok(b) => b,
            Err(e) => return files_err(ConnectError::new(Code::InvalidArgument, e.to_string())),
        };
        let parts = match parse_multipart(&bytes, &boundary) {
            Ok(p) => p,
            Err(e) => return files_err(ConnectError::new(Code::InvalidArgument, e)),
        };
        let files: Vec<Part> = parts.into_iter().filter(|p| p.name == "file").collect();
        let mut out = Vec::new();
        for p in &files {
            let target = match (&path, &p.filename) {
                (Some(q), _) if files.len() == 1 => q.clone(),
                (_, Some(f)) => st.guest_path(f),
                (Some(q), None) => q.clone(),
                (None, None) => {
                    return files_err(ConnectError::new(Code::InvalidArgument, "missing path"))
                }
            };
            let data = p.data.clone();
            let stream = futures::stream::iter([Ok::<_, EngineError>(data)]).boxed();
            match write_one(&st, &id, &target, stream).await {
                Ok(v) => out.push(v),
                Err(e) => return files_err(e),
            }
        }
        return Json(out).into_response();
    }
    let Some(path) = path else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    let stream = body
        .into_data_stream()
        .map_err(|e| EngineError::Other(format!("upload body: {e}")))
        .boxed();
    match write_one(&st, &id, &path, stream).await {
        Ok(v) => Json(vec![v]).into_response(),
        Err(e) => files_err(e),
    }
}

// ------------------------------------------------------------ filesystem

async fn stat_entry(st: &Arc<E2b>, g: &Grant, path: &str) -> Result<EntryInfo, ConnectError> {
    let s = st.svc.stat(g, path).await.map_err(service_err)?;
    Ok(entry(path, &s))
}

macro_rules! unary {
    ($st:expr, $headers:expr, $body:expr, $req:ty, |$id:ident, $r:ident| $fut:expr) => {{
        let run = async {
            let $id = $st.envd_sandbox(&$headers)?;
            let $r: $req = connect::unary_request(&$body)?;
            $fut.await
        };
        match run.await {
            Ok(v) => connect::unary_response(&v),
            Err(e) => e.into_response(),
        }
    }};
}

/// `filesystem.Filesystem/Stat`.
pub async fn stat(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::PathRequest, |id, r| async {
        let path = st.guest_path(&r.path);
        let g = st.envd_grant(&id, read(&path)).await?;
        let e = stat_entry(&st, &g, &path).await?;
        Ok::<_, ConnectError>(json!({ "entry": e }))
    })
}

/// `filesystem.Filesystem/ListDir` (`depth` levels, 1 by default).
pub async fn list_dir(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::ListDirRequest, |id, r| async {
        let root = st.guest_path(&r.path);
        let g = st.envd_grant(&id, read(&root)).await?;
        let depth = r.depth.max(1);
        let top = st.svc.stat(&g, &root).await.map_err(service_err)?;
        if top.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {root} is not a directory"),
            ));
        }
        let mut entries = Vec::new();
        let mut level = vec![root];
        for _ in 0..depth {
            let mut next = Vec::new();
            for dir in level {
                let items = st.svc.list_dir(&g, &dir).await.map_err(service_err)?;
                for s in items {
                    let p = join(&dir, &s.name);
                    if s.kind == FileKind::Dir {
                        next.push(p.clone());
                    }
                    entries.push(entry(&p, &s));
                    if entries.len() > 100_000 {
                        return Err(ConnectError::new(
                            Code::ResourceExhausted,
                            "more than 100000 entries",
                        ));
                    }
                }
            }
            level = next;
        }
        Ok::<_, ConnectError>(json!({ "entries": entries }))
    })
}

/// `filesystem.Filesystem/MakeDir` (parents too; `already_exists` if it does).
pub async fn make_dir(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::PathRequest, |id, r| async {
        let path = st.guest_path(&r.path);
        let g = st.envd_grant(&id, write(&path)).await?;
        match st.svc.stat(&g, &path).await {
            Ok(_) => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("{path} already exists"),
                ))
            }
            Err(ServiceError::Engine(EngineError::GuestNotFound(_))) => {}
            Err(e) => return Err(service_err(e)),
        }
        st.svc.mkdir(&g, &path, true).await.map_err(service_err)?;
        let e = stat_entry(&st, &g, &path).await?;
        Ok::<_, ConnectError>(json!({ "entry": e }))
    })
}

/// `filesystem.Filesystem/Move` (a `mv` in the guest).
pub async fn move_entry(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::MoveRequest, |id, r| async {
        let (src, dst) = (st.guest_path(&r.source), st.guest_path(&r.destination));
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

/// `filesystem.Filesystem/Remove` (recursive).
pub async fn remove(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::PathRequest, |id, r| async {
        let path = st.guest_path(&r.path);
        let g = st.envd_grant(&id, write(&path)).await?;
        st.svc.remove(&g, &path, true).await.map_err(service_err)?;
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
    seen: BTreeMap<String, Seen>,
}

/// Most entries a watcher tracks.
const WATCH_MAX_ENTRIES: usize = 20_000;

async fn snapshot_dir(
    st: &Arc<E2b>,
    g: &Grant,
    root: &str,
    recursive: bool,
) -> Result<BTreeMap<String, Seen>, ConnectError> {
    let mut out = BTreeMap::new();
    let mut level = vec![root.to_owned()];
    while let Some(dir) = level.pop() {
        let items = match st.svc.list_dir(g, &dir).await {
            Ok(v) => v,
            // A subdirectory removed between two listings.
            Err(ServiceError::Engine(EngineError::GuestNotFound(_))) if dir != root => continue,
            Err(e) => return Err(service_err(e)),
        };
        for s in items {
            let p = join(&dir, &s.name);
            if recursive && s.kind == FileKind::Dir {
                level.push(p.clone());
            }
            let rel = p[root.trim_end_matches('/').len()..]
                .trim_start_matches('/')
                .to_owned();
            out.insert(rel, (s.kind, s.size, s.mtime));
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
            None => ev.push((k.clone(), "EVENT_TYPE_CREATE")),
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
    body: Bytes,
) -> Response {
    unary!(st, headers, body, serde_json::Value, |id, r| async {
        let path = st.guest_path(r.get("path").and_then(|v| v.as_str()).unwrap_or(""));
        let recursive = r
            .get("recursive")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let g = st.envd_grant(&id, read(&path)).await?;
        let top = st.svc.stat(&g, &path).await.map_err(service_err)?;
        if top.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {path} is not a directory"),
            ));
        }
        let seen = snapshot_dir(&st, &g, &path, recursive).await?;
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

/// `filesystem.Filesystem/GetWatcherEvents`: lists again and reports the difference.
pub async fn get_watcher_events(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    unary!(st, headers, body, serde_json::Value, |id, r| async {
        let wid = watcher_id(&r);
        let (grant, root, recursive) = {
            let g = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
            match g.get(&wid) {
                Some(w) if w.grant.sandbox() == &id => {
                    (w.grant.clone(), w.root.clone(), w.recursive)
                }
                _ => {
                    return Err(ConnectError::new(
                        Code::NotFound,
                        format!("watcher {wid} not found"),
                    ))
                }
            }
        };
        let new = snapshot_dir(&st, &grant, &root, recursive).await?;
        let events = {
            let mut g = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
            let Some(w) = g.get_mut(&wid) else {
                return Err(ConnectError::new(
                    Code::NotFound,
                    format!("watcher {wid} not found"),
                ));
            };
            let ev = diff_listings(&w.seen, &new);
            w.seen = new;
            ev
        };
        let events: Vec<serde_json::Value> = events
            .into_iter()
            .map(|(name, ty)| json!({ "name": name, "type": ty }))
            .collect();
        Ok::<_, ConnectError>(json!({ "events": events }))
    })
}

/// `filesystem.Filesystem/RemoveWatcher`.
pub async fn remove_watcher(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    unary!(st, headers, body, serde_json::Value, |id, r| async {
        let wid = watcher_id(&r);
        let mut g = st.watchers.lock().unwrap_or_else(|p| p.into_inner());
        match g.get(&wid) {
            Some(w) if w.grant.sandbox() == &id => {
                g.remove(&wid);
                Ok(json!({}))
            }
            _ => Err(ConnectError::new(
                Code::NotFound,
                format!("watcher {wid} not found"),
            )),
        }
    })
}

// --------------------------------------------------------------- process

fn keepalive_interval(headers: &HeaderMap) -> Duration {
    let s = headers
        .get(KEEPALIVE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(30)
        .clamp(1, 3600);
    Duration::from_secs(s)
}

/// The frames of a process stream: `start`, then the events with keepalives,
/// then the trailer. A channel that closes without an `end` (the sandbox
/// was paused) ends with a `canceled` error.
fn event_frames(
    pid: u32,
    rx: mpsc::Receiver<ProcessEvent>,
    keepalive: Duration,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let first = connect::message_frame(&ProcessEvent::Start { pid }.to_response_json());
    let tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    let rest = futures::stream::unfold(Some((rx, tick)), |state| async move {
        let (mut rx, mut tick) = state?;
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev @ ProcessEvent::End { .. }) => {
                    let mut b = connect::message_frame(&ev.to_response_json()).to_vec();
                    b.extend_from_slice(&connect::end_ok_frame());
                    Some((Bytes::from(b), None))
                }
                Some(ev) => Some((connect::message_frame(&ev.to_response_json()), Some((rx, tick)))),
                None => Some((
                    ConnectError::new(
                        Code::Canceled,
                        "the process's output stream ended (the sandbox was paused); reconnect with commands.connect",
                    )
                    .end_frame(),
                    None,
                )),
            },
            _ = tick.tick() => Some((
                connect::message_frame(&ProcessEvent::KeepAlive.to_response_json()),
                Some((rx, tick)),
            )),
        }
    });
    futures::stream::iter([first]).chain(rest)
}

/// A stream for a process whose output is detached: `start`, keepalives
/// while `/proc/<pid>` exists, then an `end` of unknown status.
fn detached_frames(
    st: Arc<E2b>,
    g: Grant,
    pid: u32,
    keepalive: Duration,
) -> impl Stream<Item = Bytes> + Send + 'static {
    let first = connect::message_frame(&ProcessEvent::Start { pid }.to_response_json());
    let rest = futures::stream::unfold(Some(tokio::time::Instant::now()), move |state| {
        let (st, g) = (st.clone(), g.clone());
        async move {
            let mut last = state?;
            loop {
                tokio::time::sleep(procs::DETACHED_POLL).await;
                match procs::alive(&st.svc, &g, &[pid]).await {
                    Ok(v) if v.contains(&pid) => {
                        if last.elapsed() >= keepalive {
                            last = tokio::time::Instant::now();
                            return Some((
                                connect::message_frame(&ProcessEvent::KeepAlive.to_response_json()),
                                Some(last),
                            ));
                        }
                    }
                    Ok(_) => {
                        st.procs.remove(g.sandbox(), pid);
                        let end = ProcessEvent::End {
                            exit_code: -1,
                            exited: false,
                            status: "unknown".into(),
                            error: Some(
                                "the process ended while its output was detached (the sandbox was paused); its exit status is unknown"
                                    .into(),
                            ),
                        };
                        let mut b = connect::message_frame(&end.to_response_json()).to_vec();
                        b.extend_from_slice(&connect::end_ok_frame());
                        return Some((Bytes::from(b), None));
                    }
                    Err(e) => return Some((e.end_frame(), None)),
                }
            }
        }
    });
    futures::stream::iter([first]).chain(rest)
}

/// `process.Process/Start` (server stream).
pub async fn start(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    let run = async {
        let id = st.envd_sandbox(&headers)?;
        let req: proto::StartRequest = connect::stream_request(&body)?;
        if req.pty.is_some() {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "PTY processes are not supported by strata",
            ));
        }
        if req.process.cmd.is_empty() {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process.cmd is empty",
            ));
        }
        // The policy sees the argv the SDK sends (`/bin/bash -l -c CMD`);
        // its shell reading splits CMD into simple commands.
        let argv: Vec<String> = std::iter::once(req.process.cmd.clone())
            .chain(req.process.args.iter().cloned())
            .collect();
        let mut env: BTreeMap<String, String> = st.sandbox_envs(&id);
        env.extend(req.process.envs.clone());
        let mut config = req.process;
        config.cwd = config.cwd.map(|c| st.guest_path(&c));
        // What the wrapper runs with besides the argv: checked as the
        // service's exec checks it (the wrapper runs as a helper).
        if let Some(cwd) = &config.cwd {
            stratad::service::validate_guest_path(cwd).map_err(service_err)?;
        }
        if env
            .iter()
            .any(|(k, v)| k.contains('\0') || v.contains('\0'))
        {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "envs: NUL bytes are not allowed",
            ));
        }
        let g = st
            .envd_grant(&id, CallKind::Exec { argv, shell: None })
            .await?;
        let reg = st.procs.clone();
        procs::start(
            &st.svc,
            &reg,
            &g,
            config,
            env,
            req.tag,
            req.stdin.unwrap_or(false),
        )
        .await
    };
    match run.await {
        Ok((proc, rx)) => {
            connect::stream_response(event_frames(proc.pid, rx, keepalive_interval(&headers)))
        }
        Err(e) => connect::stream_error(e),
    }
}

fn select(
    st: &E2b,
    id: &SandboxId,
    sel: &proto::ProcessSelector,
) -> Result<Option<Arc<Proc>>, ConnectError> {
    if sel.pid.is_none() && sel.tag.is_none() {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            "process selector needs a pid or a tag",
        ));
    }
    Ok(st.procs.find(id, sel.pid, sel.tag.as_deref()))
}

/// `process.Process/Connect` (server stream): attach to a running process.
pub async fn connect(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    let keepalive = keepalive_interval(&headers);
    let run = async {
        let id = st.envd_sandbox(&headers)?;
        let req: proto::SelectRequest = connect::stream_request(&body)?;
        let found = select(&st, &id, &req.process)?;
        if let Some(p) = &found {
            if let Some(rx) = p.subscribe() {
                return Ok(connect::stream_response(event_frames(p.pid, rx, keepalive)));
            }
        }
        let pid = found
            .as_ref()
            .map(|p| p.pid)
            .or(req.process.pid)
            .ok_or_else(|| ConnectError::new(Code::NotFound, "no process with that tag"))?;
        if found.is_none() {
            return Err(ConnectError::new(
                Code::NotFound,
                format!("process with pid {pid} not found"),
            ));
        }
        let g = st.envd_access(&id).await?;
        if procs::alive(&st.svc, &g, &[pid]).await?.is_empty() {
            st.procs.remove(&id, pid);
            return Err(ConnectError::new(
                Code::NotFound,
                format!("process with pid {pid} not found"),
            ));
        }
        Ok(connect::stream_response(detached_frames(
            st.clone(),
            g,
            pid,
            keepalive,
        )))
    };
    match run.await {
        Ok(r) => r,
        Err(e) => connect::stream_error(e),
    }
}

/// `process.Process/List`: the processes started through envd that still run.
pub async fn list(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, serde_json::Value, |id, _r| async {
        let all = st.procs.all(&id);
        let detached: Vec<u32> = all
            .iter()
            .filter(|p| !p.attached())
            .map(|p| p.pid)
            .collect();
        let live = if detached.is_empty() {
            Vec::new()
        } else {
            procs::alive(&st.svc, &st.envd_access(&id).await?, &detached).await?
        };
        let mut out = Vec::new();
        for p in all {
            if p.attached() || live.contains(&p.pid) {
                out.push(p.info());
            } else {
                st.procs.remove(&id, p.pid);
            }
        }
        out.sort_by_key(|p| p.pid);
        Ok::<_, ConnectError>(json!({ "processes": out }))
    })
}

fn require(found: Option<Arc<Proc>>) -> Result<Arc<Proc>, ConnectError> {
    found.ok_or_else(|| ConnectError::new(Code::NotFound, "process not found"))
}

/// `process.Process/SendInput`.
pub async fn send_input(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::SendInputRequest, |id, r| async {
        let p = require(select(&st, &id, &r.process)?)?;
        if r.input.pty.is_some() {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "PTY input is not supported",
            ));
        }
        if !p.stdin {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} was started without stdin", p.pid),
            ));
        }
        let data = r.input.stdin.unwrap_or_default();
        if !data.is_empty() {
            let g = st.envd_access(&id).await?;
            procs::send_input(&st.svc, &g, p.pid, data).await?;
        }
        Ok::<_, ConnectError>(json!({}))
    })
}

/// `process.Process/SendSignal` (to the process group).
pub async fn send_signal(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::SendSignalRequest, |id, r| async {
        let p = require(select(&st, &id, &r.process)?)?;
        let sig = r
            .signal_number()
            .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "unsupported signal"))?;
        let g = st.envd_access(&id).await?;
        procs::signal(&st.svc, &g, p.pid, sig).await?;
        Ok::<_, ConnectError>(json!({}))
    })
}

/// `process.Process/CloseStdin`.
pub async fn close_stdin(State(st): State<Arc<E2b>>, headers: HeaderMap, body: Bytes) -> Response {
    unary!(st, headers, body, proto::SelectRequest, |id, r| async {
        let p = require(select(&st, &id, &r.process)?)?;
        if !p.stdin {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} was started without stdin", p.pid),
            ));
        }
        let g = st.envd_access(&id).await?;
        procs::close_stdin(&st.svc, &g, p.pid).await?;
        Ok::<_, ConnectError>(json!({}))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_as_httpx_sends_it() {
        let body = Bytes::from_static(
            b"--abc\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/root/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\nworld\r\n--abc\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--abc--\r\n",
        );
        let parts = parse_multipart(&body, "abc").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("/root/a.txt"));
        assert_eq!(&parts[0].data[..], b"hello\r\nworld");
        assert_eq!(parts[1].name, "other");
        assert_eq!(&parts[1].data[..], b"x");
        assert!(parse_multipart(&Bytes::from_static(b"--abc\r\nx"), "abc").is_err());
        assert_eq!(
            disposition_param("multipart/form-data; boundary=xyz", "boundary").as_deref(),
            Some("xyz")
        );
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
        let mut ev = diff_listings(&a, &b);
        ev.sort();
        assert_eq!(
            ev,
            [
                ("gone".to_owned(), "EVENT_TYPE_REMOVE"),
                ("new".to_owned(), "EVENT_TYPE_CREATE"),
                ("x".to_owned(), "EVENT_TYPE_WRITE"),
            ]
        );
    }

    #[test]
    fn paths() {
        assert_eq!(parent("/a/b"), Some("/a"));
        assert_eq!(parent("/a"), Some("/"));
        assert_eq!(join("/a/", "b"), "/a/b");
        let s = FileStat {
            name: "b".into(),
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o40755,
            mtime: 0,
        };
        let e = entry("/a/b", &s);
        assert_eq!(e.name, "b");
        assert_eq!(e.mode, 0o755);
        assert_eq!(e.permissions, "drwxr-xr-x");
        assert_eq!(e.modified_time, "1970-01-01T00:00:00Z");
    }

    #[test]
    fn service_errors_map_to_connect_codes() {
        let e = service_err(ServiceError::NotFound {
            kind: "sandbox",
            id: "sbx-x".into(),
        });
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("was not found"));
        let e = service_err(ServiceError::Engine(EngineError::GuestNotFound("x".into())));
        assert_eq!(e.code, Code::NotFound);
    }
}
