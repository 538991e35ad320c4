//! `/files`: `GET /files?path=` (download) and `POST /files?path=`
//! (multipart, field `file`, or octet-stream; streamed, at most the
//! service's `max_upload_bytes`) with errors as
//! `{"code": <http status>, "message": "…"}`. Both take gzip as envd 0.6
//! does ([`encoding`]: `Content-Encoding: gzip` uploads, `Accept-Encoding:
//! gzip` downloads); uploads carry metadata in `X-Metadata-*` headers
//! ([`metadata`]), stored as `user.e2b.*` attributes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::json;
use stratad::engine::{ByteStream, FileKind, RuntimeError};

use super::encoding::{self, DecodeError};
use super::{ancestry, ensure_owned, envd_user, metadata, parent, read, write};
use crate::auth::{EnvdSandbox, EnvdTarget};
use crate::connect::{Code, ConnectError};
use crate::error::service_err;
use crate::E2b;

/// A Connect error in `/files`'s shape (`unavailable` as 502, as E2B's
/// proxy answers for a sandbox that is not running).
pub(crate) fn files_err(e: ConnectError) -> Response {
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

/// The `path` query parameter (raw; resolved with [`E2b::user_path`]).
fn query_param(raw: Option<&str>, name: &str) -> Option<String> {
    form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned())
}

/// The user of a `/files` call (`username`, else the `Authorization`
/// header, else `user`) and the call's `path` resolved for that user.
fn query_user_path(
    st: &E2b,
    headers: &HeaderMap,
    raw: Option<&str>,
) -> Result<(String, Option<String>), ConnectError> {
    let user = envd_user(headers, query_param(raw, "username").as_deref())?;
    let path = query_param(raw, "path").map(|p| st.user_path(&user, &p));
    Ok((user, path))
}

/// `GET /files?path=` → the file's bytes (404 when missing).
pub async fn download(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Extension(EnvdSandbox(id)): Extension<EnvdSandbox>,
    RawQuery(raw): RawQuery,
) -> Response {
    let path = match query_user_path(&st, &headers, raw.as_deref()) {
        Ok((_, p)) => p,
        Err(e) => return files_err(e),
    };
    let Some(path) = path else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    let accept = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok());
    let gzip = match encoding::accept_gzip(accept) {
        Ok(z) => z,
        Err(m) => {
            return (
                StatusCode::NOT_ACCEPTABLE,
                Json(json!({"code": 406, "message": m})),
            )
                .into_response()
        }
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
            let stream = stream.map_err(std::io::Error::other);
            if gzip {
                let body = Body::from_stream(encoding::gzip(stream));
                return (
                    StatusCode::OK,
                    [
                        (header::CONTENT_TYPE, "application/octet-stream"),
                        (header::CONTENT_ENCODING, encoding::GZIP),
                        (header::VARY, "Accept-Encoding"),
                    ],
                    body,
                )
                    .into_response();
            }
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                Body::from_stream(stream),
            )
                .into_response()
        }
        Err(e) => files_err(service_err(e)),
    }
}

/// Why a request body stream failed.
#[derive(Debug)]
enum BodyErr {
    /// Reading it from the client.
    Read(axum::Error),
    /// Its gzip data.
    Gzip(String),
}

impl From<axum::Error> for BodyErr {
    fn from(e: axum::Error) -> Self {
        BodyErr::Read(e)
    }
}

impl std::fmt::Display for BodyErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyErr::Read(e) => e.fmt(f),
            BodyErr::Gzip(e) => write!(f, "error decompressing request body: {e}"),
        }
    }
}

impl std::error::Error for BodyErr {}

/// A request body as it streams in (decoded).
type BodyStream = futures::stream::BoxStream<'static, Result<Bytes, BodyErr>>;

/// Bytes a multipart body may carry besides its files' contents
/// (boundaries, part headers, other fields): the whole body may be
/// `max_upload_bytes` plus this.
pub const MULTIPART_OVERHEAD: u64 = 1 << 20;

/// The upload's byte budget (the service's `max_upload_bytes`, over every
/// file of a request): counted as the bytes stream to the guest; past it
/// the stream fails, so the guest never renames its temporary file into
/// place, and [`Budget::exceeded`] says the failure was the limit.
#[derive(Debug, Clone)]
struct Budget {
    limit: u64,
    seen: Arc<AtomicU64>,
    exceeded: Arc<AtomicBool>,
    /// The body's gzip data was bad (a `400`, not the limit).
    bad_gzip: Arc<AtomicBool>,
}

impl Budget {
    fn new(limit: u64) -> Self {
        Budget {
            limit,
            seen: Arc::new(AtomicU64::new(0)),
            exceeded: Arc::new(AtomicBool::new(false)),
            bad_gzip: Arc::new(AtomicBool::new(false)),
        }
    }

    /// `body` gunzipped when `gzip`, a decoding error noted for
    /// [`Budget::bad_gzip_refusal`]; the decoded bytes are what the budget
    /// counts.
    fn decode<S, E>(&self, body: S, gzip: bool) -> BodyStream
    where
        S: futures::Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
        E: Into<BodyErr> + Send + 'static,
    {
        let body = body.map(|r| r.map_err(Into::into));
        if !gzip {
            return body.boxed();
        }
        let flag = self.bad_gzip.clone();
        encoding::gunzip(body)
            .map(move |r| match r {
                Ok(b) => Ok(b),
                Err(DecodeError::Source(e)) => Err(e),
                Err(DecodeError::Gzip(e)) => {
                    flag.store(true, Ordering::Relaxed);
                    Err(BodyErr::Gzip(e.to_string()))
                }
            })
            .boxed()
    }

    /// The answer when the body failed as gzip data, if it did.
    fn bad_gzip_refusal(&self) -> Option<Response> {
        self.bad_gzip.load(Ordering::Relaxed).then(|| {
            files_err(ConnectError::new(
                Code::InvalidArgument,
                "error decompressing request body: invalid gzip data",
            ))
        })
    }

    fn exceeded(&self) -> bool {
        self.exceeded.load(Ordering::Relaxed)
    }

    /// `body` counted against the budget; `too_large` tells which of its
    /// errors are a size limit of the parser.
    fn meter<S, E>(&self, body: S, too_large: fn(&E) -> bool) -> ByteStream
    where
        S: futures::Stream<Item = Result<Bytes, E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        let b = self.clone();
        body.map(move |chunk| {
            let chunk = chunk.map_err(|e| {
                if too_large(&e) {
                    b.exceeded.store(true, Ordering::Relaxed);
                }
                RuntimeError::Other(format!("reading the upload: {e}"))
            })?;
            let n = chunk.len() as u64;
            let total = b.seen.fetch_add(n, Ordering::Relaxed).saturating_add(n);
            if total > b.limit {
                b.exceeded.store(true, Ordering::Relaxed);
                return Err(RuntimeError::Other(format!(
                    "upload larger than {} bytes",
                    b.limit
                )));
            }
            Ok(chunk)
        })
        .boxed()
    }

    /// The refusal of an upload over the budget.
    fn refusal(&self) -> Response {
        upload_too_large(self.limit)
    }
}

fn upload_too_large(limit: u64) -> Response {
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        Json(json!({"code": 413, "message": format!("upload larger than {limit} bytes")})),
    )
        .into_response()
}

fn multer_too_large(e: &multer::Error) -> bool {
    matches!(
        e,
        multer::Error::StreamSizeExceeded { .. } | multer::Error::FieldSizeExceeded { .. }
    )
}

fn never(_: &BodyErr) -> bool {
    false
}

/// Writes one file as envd does: as root, missing parent directories made
/// and given to `user` (EnsureDirs), then the file given to `user` (Chown).
/// Metadata needs an agent that reports extended attributes: `dir`'s stat
/// (an existing directory) says whether this sandbox's does.
fn metadata_supported(dir: &stratad::engine::DirEntry) -> Result<(), ConnectError> {
    if dir.ext.is_some() {
        return Ok(());
    }
    Err(ConnectError::new(
        Code::InvalidArgument,
        "file metadata needs a newer sandbox image: this sandbox's agent does not support extended attributes",
    ))
}

/// The bytes of one upload: streamed to the guest, or read first because
/// the policy holds the write for an approver.
enum Upload {
    Stream(ByteStream),
    Held(stratad::service::HeldUpload),
}

async fn write_one(
    st: &Arc<E2b>,
    id: &EnvdTarget,
    user: &str,
    path: &str,
    meta: &BTreeMap<String, String>,
    body: ByteStream,
) -> Result<serde_json::Value, ConnectError> {
    // An upload the policy holds for an approver is read to a bounded file
    // first (`stratad::service::held`): the approval is bound to, and shows,
    // the size and SHA-256 of the very bytes written after it.
    let opts = crate::policy::gate_opts();
    let (g, held) = if st
        .svc
        .upload_is_held(&id.caller, &id.id, &write(path), &opts)
    {
        let held = st.svc.hold_upload(body).await.map_err(service_err)?;
        let g = st
            .svc
            .grant_held(&id.caller, &id.id, write(path), &opts, &held)
            .await
            .map_err(service_err)?;
        (g, Upload::Held(held))
    } else {
        (st.envd_grant(id, write(path)).await?, Upload::Stream(body))
    };
    let dirs = parent(path).map(ancestry).unwrap_or_default();
    let parent_dir = match dirs.last() {
        Some(d) => st.svc.stat(&g, d).await.ok(),
        None => st.svc.stat(&g, "/").await.ok(),
    };
    if !meta.is_empty() {
        // Checked before anything is written: refused, nothing changes.
        match &parent_dir {
            Some(d) => metadata_supported(d)?,
            None => metadata_supported(&st.svc.stat(&g, "/").await.map_err(service_err)?)?,
        }
    }
    if !super::is_root(user) && !dirs.is_empty() {
        // Only the missing ones are made (and owned): the stat above saves
        // the helper command when the parent exists.
        if parent_dir.is_none() {
            ensure_owned(st, &g, user, &dirs, None).await?;
        }
    } else if let Some(dir) = parent(path).filter(|d| *d != "/") {
        st.svc.mkdir(&g, dir, true).await.map_err(service_err)?;
    }
    match held {
        Upload::Held(h) => st.svc.write_held(&g, path, 0o644, h).await,
        Upload::Stream(body) => st.svc.write_file(&g, path, 0o644, body).await,
    }
    .map_err(service_err)?;
    if !super::is_root(user) {
        ensure_owned(st, &g, user, &[], Some(path)).await?;
    }
    // The upload is a new inode (written beside and renamed into place):
    // an overwritten file's old metadata went with the old one.
    if !meta.is_empty() {
        st.svc
            .set_xattrs(
                &g,
                path,
                super::METADATA_XATTR_PREFIX,
                metadata::to_xattrs(meta),
            )
            .await
            .map_err(service_err)?;
    }
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    let mut v = json!({"name": name, "type": "file", "path": path});
    if !meta.is_empty() {
        v["metadata"] = json!(meta);
    }
    Ok(v)
}

/// `POST /files?path=`: multipart (field `file`) or octet-stream →
/// `[WriteInfo]`. Both forms stream to the guest (nothing is buffered
/// whole) under the service's `max_upload_bytes`: a `Content-Length` over
/// it is refused before anything is read, a body that grows past it is cut
/// off; either answers `413` and never creates or changes the destination
/// (the guest writes a temporary file and renames it at the end; a cut-off
/// upload's temporary file is removed at once, `write_abort`). An upload
/// the policy holds for an approver is read to a bounded file first and
/// its approval bound to those bytes (`write_one`). With `?path=`, the first
/// `file` part is written there, later parts to their own file names.
pub async fn upload(
    State(st): State<Arc<E2b>>,
    Extension(EnvdSandbox(id)): Extension<EnvdSandbox>,
    RawQuery(raw): RawQuery,
    req: Request,
) -> Response {
    let headers = req.headers();
    let (user, mut path) = match query_user_path(&st, headers, raw.as_deref()) {
        Ok(v) => v,
        Err(e) => return files_err(e),
    };
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let gzip = match encoding::content_is_gzip(
        headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok()),
    ) {
        Ok(z) => z,
        Err(m) => return files_err(ConnectError::new(Code::InvalidArgument, m)),
    };
    let meta = match metadata::from_headers(headers) {
        Ok(m) => m,
        Err(m) => return files_err(ConnectError::new(Code::InvalidArgument, m)),
    };
    let limit = st.svc.config().max_upload_bytes;
    let declared = crate::content_length(headers);
    let budget = Budget::new(limit);
    if ctype.starts_with("multipart/form-data") {
        let boundary = match multer::parse_boundary(&ctype) {
            Ok(b) => b,
            Err(_) => {
                return files_err(ConnectError::new(
                    Code::InvalidArgument,
                    "multipart body without boundary",
                ))
            }
        };
        let whole = limit.saturating_add(MULTIPART_OVERHEAD);
        // A gzip body's length says nothing of what it decodes to: the
        // decoded stream is what the limits count.
        if !gzip && declared.is_some_and(|n| n > whole) {
            return budget.refusal();
        }
        let constraints =
            multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(whole));
        let mut form = multer::Multipart::with_constraints(
            budget.decode(req.into_body().into_data_stream(), gzip),
            boundary,
            constraints,
        );
        let mut out = Vec::new();
        loop {
            let mut field = match form.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) if multer_too_large(&e) => return budget.refusal(),
                Err(e) => {
                    return budget.bad_gzip_refusal().unwrap_or_else(|| {
                        files_err(ConnectError::new(
                            Code::InvalidArgument,
                            format!("multipart body: {e}"),
                        ))
                    })
                }
            };
            if field.name() != Some("file") {
                // Not a file: skipped (bounded by the whole-body limit).
                loop {
                    match field.chunk().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) if multer_too_large(&e) => return budget.refusal(),
                        Err(e) => {
                            return files_err(ConnectError::new(
                                Code::InvalidArgument,
                                format!("multipart body: {e}"),
                            ))
                        }
                    }
                }
                continue;
            }
            let target = match (path.take(), field.file_name()) {
                (Some(q), _) => q,
                (None, Some(f)) => st.user_path(&user, f),
                (None, None) => {
                    return files_err(ConnectError::new(Code::InvalidArgument, "missing path"))
                }
            };
            let stream = budget.meter(field, multer_too_large);
            match write_one(&st, &id, &user, &target, &meta, stream).await {
                Ok(v) => out.push(v),
                Err(_) if budget.exceeded() => return budget.refusal(),
                Err(e) => return budget.bad_gzip_refusal().unwrap_or_else(|| files_err(e)),
            }
        }
        return Json(out).into_response();
    }
    let Some(path) = path else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    if !gzip && declared.is_some_and(|n| n > limit) {
        return budget.refusal();
    }
    let body = budget.decode(req.into_body().into_data_stream(), gzip);
    let stream = budget.meter(body, never);
    match write_one(&st, &id, &user, &path, &meta, stream).await {
        Ok(v) => Json(vec![v]).into_response(),
        Err(_) if budget.exceeded() => budget.refusal(),
        Err(e) => budget.bad_gzip_refusal().unwrap_or_else(|| files_err(e)),
    }
}
