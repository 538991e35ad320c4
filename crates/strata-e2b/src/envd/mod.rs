//! envd (`E2B_SANDBOX_URL`): the in-sandbox API, served by the daemon for
//! every sandbox. The sandbox is named by the `E2b-Sandbox-Id` header and
//! each call carries that sandbox's `X-Access-Token`.
//!
//! Rooms: this file (the headers, the sandbox of a call, the path and entry
//! helpers, `/health`), [`files`] (`GET`/`POST /files`, multipart),
//! [`filesystem`] (`filesystem.Filesystem/*`, the polling watchers) and
//! [`process`] (`process.Process/*` over [`crate::procs`]). Errors map onto
//! Connect codes in [`crate::error`].

use std::sync::Arc;

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::json;
use strata_core::SandboxState;
use strata_policy::CallKind;
use stratad::engine::{DirEntry, FileKind};

use crate::connect::{Code, ConnectError};
pub use crate::error::service_err;
use crate::error::{connect_too_large, not_running};
use crate::proto::{self, EntryInfo, FileType};
use crate::{BodyError, E2b};

/// A unary Connect handler: the sandbox of the call (an
/// `Extension<EnvdSandbox>`: its token was checked by the route layer), the
/// request (a [`CappedBody`]) decoded as `$req`, then `$fut` (a
/// `Result<impl Serialize, ConnectError>`) answered as a Connect unary
/// response or error.
macro_rules! unary {
    ($sbx:expr, $body:expr, $req:ty, |$id:ident, $r:ident| $fut:expr) => {{
        let axum::Extension($crate::auth::EnvdSandbox($id)) = $sbx;
        let run = async {
            let $r: $req = $crate::connect::unary_request(&$body.0)?;
            $fut.await
        };
        match run.await {
            Ok(v) => $crate::connect::unary_response(&v),
            Err(e) => axum::response::IntoResponse::into_response(e),
        }
    }};
}

pub mod encoding;
pub mod files;
pub mod filesystem;
pub mod metadata;
pub mod process;
pub mod signed;

pub use files::{download, upload, MULTIPART_OVERHEAD};
pub use filesystem::{
    create_watcher, diff_listings, get_watcher_events, list_dir, make_dir, move_entry, remove,
    remove_watcher, stat, watch_dir, Watcher,
};
pub use process::{close_stdin, connect, list, send_input, send_signal, start, update};

/// Header naming the sandbox.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Header carrying the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// Header with the keepalive interval the client wants, in seconds.
pub const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

/// The user an envd call acts for when it names none (envd's default, the
/// user of E2B's base template and of strata's image).
pub const DEFAULT_USER: &str = "user";

/// The user an envd call acts for: `username` (the `/files` query), else
/// the user of `Authorization: Basic base64(<user>:)` (how E2B's SDKs name
/// it), else [`DEFAULT_USER`]. A name that is not a plain login name or
/// uid (`[A-Za-z0-9_][A-Za-z0-9_.-]*`, at most 32 bytes) is refused.
pub(crate) fn envd_user(headers: &HeaderMap, query: Option<&str>) -> Result<String, ConnectError> {
    use base64::Engine as _;
    let from_header = || -> Option<String> {
        let v = headers
            .get(axum::http::header::AUTHORIZATION)?
            .to_str()
            .ok()?;
        let (scheme, rest) = v.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("basic") {
            return None;
        }
        let raw = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()?;
        let text = String::from_utf8(raw).ok()?;
        let user = text.split(':').next().unwrap_or("");
        (!user.is_empty()).then(|| user.to_owned())
    };
    let user = match query.filter(|q| !q.is_empty()) {
        Some(q) => q.to_owned(),
        None => from_header().unwrap_or_else(|| DEFAULT_USER.to_owned()),
    };
    let ok = user.len() <= 32
        && user
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !ok {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            format!("invalid user name {user:?}"),
        ));
    }
    Ok(user)
}

/// Whether `user` is root (whose files need no chown).
pub(crate) fn is_root(user: &str) -> bool {
    user == "root" || user == "0"
}

/// The home directory of a named user as the base image lays it out
/// (`/root`, `/home/<name>`); `None` for a numeric uid.
pub(crate) fn user_home(user: &str) -> Option<String> {
    if is_root(user) {
        Some("/root".into())
    } else if user.bytes().all(|b| b.is_ascii_digit()) {
        None
    } else {
        Some(format!("/home/{user}"))
    }
}

/// envd's `EnsureDirs` + `Chown`: makes the missing directories of `dirs`
/// (outermost first) and gives each one it made, then `file` if given, to
/// `user` (and its primary group), acting as root. One helper command in
/// the guest, under the grant of the call it serves. For root (or a
/// sandbox without that user) nothing changes hands.
pub(crate) async fn ensure_owned(
    st: &E2b,
    g: &stratad::service::Grant,
    user: &str,
    dirs: &[String],
    file: Option<&str>,
) -> Result<(), ConnectError> {
    if is_root(user) {
        for d in dirs {
            st.svc.mkdir(g, d, true).await.map_err(service_err)?;
        }
        return Ok(());
    }
    // $0 = user, $1 = the file or "", the rest: directories outermost first.
    // A user the guest does not know (an image without it) owns nothing.
    let script = r#"u=$0; f=$1; shift
id -u -- "$u" >/dev/null 2>&1 || u=
for d do
  [ -d "$d" ] && continue
  mkdir -- "$d" || exit 1
  [ -z "$u" ] || chown -- "$u:" "$d" 2>/dev/null || chown -- "$u" "$d" || exit 1
done
[ -z "$u" ] || [ -z "$f" ] || chown -- "$u:" "$f" 2>/dev/null || chown -- "$u" "$f""#;
    let mut argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        script.to_owned(),
        user.to_owned(),
        file.unwrap_or("").to_owned(),
    ];
    argv.extend(dirs.iter().cloned());
    let (code, _, err) = crate::procs::run_helper(&st.svc, g, argv, None, 60).await?;
    // The innermost directory through the typed call as well: a no-op when
    // the helper made it, the typed error of what failed when it could not
    // (a file in the way, no space …), and the directory on an engine that
    // runs no shell.
    if let Some(last) = dirs.last() {
        st.svc.mkdir(g, last, true).await.map_err(service_err)?;
    }
    if code == Some(0) {
        return Ok(());
    }
    Err(ConnectError::new(
        Code::Unknown,
        format!(
            "cannot give {} to {user}: {}",
            file.or(dirs.last().map(String::as_str)).unwrap_or(""),
            String::from_utf8_lossy(&err).trim()
        ),
    ))
}

/// `path` and its ancestors below `/`, outermost first (`/a/b` → `/a`, `/a/b`).
pub(crate) fn ancestry(path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        cur.push('/');
        cur.push_str(part);
        out.push(cur.clone());
    }
    out
}

/// A Connect (or JSON) request body of at most
/// [`crate::E2bConfig::max_request_bytes`], read after the route layer
/// checked the caller; a longer one answers `413` (a Connect error
/// `resource_exhausted`) without being read further.
#[derive(Debug, Clone)]
pub struct CappedBody(pub Bytes);

#[axum::async_trait]
impl FromRequest<Arc<E2b>> for CappedBody {
    type Rejection = Response;

    async fn from_request(req: Request, st: &Arc<E2b>) -> Result<Self, Response> {
        match crate::capped_body(req, st.cfg.max_request_bytes).await {
            Ok(b) => Ok(CappedBody(b)),
            Err(BodyError::TooLarge(n)) => Err(connect_too_large(n)),
            Err(BodyError::Read(m)) => {
                Err(ConnectError::new(Code::InvalidArgument, m).into_response())
            }
        }
    }
}

impl E2b {
    /// The guest path of `p` for a call acting as `user`: absolute as it
    /// is, relative against the user's home (envd's rule: `/home/<name>`;
    /// root and a numeric uid use `[e2b] home_dir`, default `/root`).
    pub(crate) fn user_path(&self, user: &str, p: &str) -> String {
        match user_home(user).filter(|_| !is_root(user)) {
            Some(home) if !p.starts_with('/') => {
                if p.is_empty() || p == "." {
                    home
                } else {
                    format!("{home}/{}", p.trim_start_matches("./"))
                }
            }
            _ => self.guest_path(p),
        }
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

/// The xattr namespace of envd's file metadata (`user.e2b.<key>`).
pub const METADATA_XATTR_PREFIX: &str = "user.e2b.";

fn kind_of(k: FileKind) -> FileType {
    match k {
        FileKind::File => FileType::File,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Other => FileType::Unspecified,
    }
}

/// envd's entry info of the entry at `path`: a symlink has the type and
/// permission bits of what it resolves to, its `lstat` size and
/// permission string (`L…`) and `symlinkTarget`; owner and group are
/// names (the numeric id when the guest has no name for it); `metadata`
/// is the `user.e2b.*` attributes, prefix stripped. An agent too old to
/// report owners answers empty owner/group and no target or metadata.
fn entry(path: &str, s: &DirEntry) -> EntryInfo {
    let name = path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_owned();
    let own = kind_of(s.kind);
    let mut permissions = proto::permissions(own, s.mode);
    let (mut kind, mut mode) = (own, s.mode);
    let (mut owner, mut group, mut symlink_target) = (String::new(), String::new(), None);
    let mut metadata = std::collections::BTreeMap::new();
    if let Some(x) = &s.ext {
        owner = x.owner.clone().unwrap_or_else(|| x.uid.to_string());
        group = x.group.clone().unwrap_or_else(|| x.gid.to_string());
        if s.kind == FileKind::Symlink {
            permissions.replace_range(..1, "L");
            symlink_target = x.symlink_target.clone();
            kind = x.target_kind.map(kind_of).unwrap_or(FileType::Unspecified);
            mode = x.target_mode.unwrap_or(0);
        }
        for (k, v) in &x.xattrs {
            if let Some(key) = k.strip_prefix(METADATA_XATTR_PREFIX) {
                metadata.insert(key.to_owned(), v.clone());
            }
        }
    }
    EntryInfo {
        name,
        kind,
        path: path.to_owned(),
        size: s.size.to_string(),
        // envd's `FileMode.Perm()`: the rwx bits only.
        mode: mode & 0o777,
        permissions,
        owner,
        group,
        modified_time: rfc3339_secs(s.mtime),
        symlink_target,
        metadata,
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
    // Any refusal (no token, a wrong, revoked or foreign one, an unknown
    // sandbox) answers exactly as an unknown sandbox.
    let running = match st.envd_target(&headers).await {
        Ok(t) => matches!(
            st.svc.get_sandbox(&t.caller, &t.id).await.map(|r| r.state),
            Ok(SandboxState::Running)
        ),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_of_a_call() {
        use base64::Engine as _;
        let basic = |u: &str| {
            let mut h = HeaderMap::new();
            let v = base64::engine::general_purpose::STANDARD.encode(format!("{u}:"));
            h.insert("authorization", format!("Basic {v}").parse().unwrap());
            h
        };
        let none = HeaderMap::new();
        assert_eq!(envd_user(&none, None).unwrap(), "user");
        assert_eq!(envd_user(&basic("root"), None).unwrap(), "root");
        assert_eq!(envd_user(&basic("root"), Some("alice")).unwrap(), "alice");
        assert_eq!(envd_user(&none, Some("")).unwrap(), "user");
        assert_eq!(envd_user(&basic("1000"), None).unwrap(), "1000");
        for bad in ["-rf", "a b", "a;b", "x/y", &"a".repeat(33)] {
            assert!(envd_user(&basic(bad), None).is_err(), "{bad}");
            assert!(envd_user(&none, Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(user_home("user").as_deref(), Some("/home/user"));
        assert_eq!(user_home("root").as_deref(), Some("/root"));
        assert_eq!(user_home("1000"), None);
        assert_eq!(ancestry("/a/b/c"), ["/a", "/a/b", "/a/b/c"]);
        assert_eq!(ancestry("/"), Vec::<String>::new());
    }

    #[test]
    fn paths() {
        assert_eq!(parent("/a/b"), Some("/a"));
        assert_eq!(parent("/a"), Some("/"));
        assert_eq!(join("/a/", "b"), "/a/b");
        let s = DirEntry {
            name: "b".into(),
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o40755,
            mtime: 0,
            ext: None,
        };
        let e = entry("/a/b", &s);
        assert_eq!(e.name, "b");
        assert_eq!(e.mode, 0o755);
        assert_eq!(e.permissions, "drwxr-xr-x");
        assert_eq!(e.modified_time, "1970-01-01T00:00:00Z");
    }
}
