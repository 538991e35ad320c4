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
use strata_core::{SandboxId, SandboxState};
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

pub mod files;
pub mod filesystem;
pub mod process;

pub use files::{download, upload, MULTIPART_OVERHEAD};
pub use filesystem::{
    create_watcher, diff_listings, get_watcher_events, list_dir, make_dir, move_entry, remove,
    remove_watcher, stat, Watcher,
};
pub use process::{close_stdin, connect, list, send_input, send_signal, start};

/// Header naming the sandbox.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Header carrying the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// Header with the keepalive interval the client wants, in seconds.
pub const KEEPALIVE_HEADER: &str = "keepalive-ping-interval";

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
    /// The sandbox of an envd request, after checking its access token.
    pub(crate) fn envd_sandbox(&self, headers: &HeaderMap) -> Result<SandboxId, ConnectError> {
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

fn entry(path: &str, s: &DirEntry) -> EntryInfo {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let e = entry("/a/b", &s);
        assert_eq!(e.name, "b");
        assert_eq!(e.mode, 0o755);
        assert_eq!(e.permissions, "drwxr-xr-x");
        assert_eq!(e.modified_time, "1970-01-01T00:00:00Z");
    }
}
