//! E2B's template build API (`Template()…build()` in the SDKs) over
//! strata's recipe builds (`Service::build_template` with a recipe,
//! docs/templates.md).
//!
//! The SDK's sequence and what each call does here:
//! - `POST /v3/templates {name, tags, cpuCount, memoryMB}` → 202
//!   `{templateID, buildID, names, tags, aliases, public}`: reserves a
//!   strata template id (`templateID`) and a build id (a UUID derived from
//!   it, so status calls need no state); nothing is built yet. The request
//!   is held in memory ([`PENDING_PER_OWNER`] per owner, the oldest
//!   dropped) until its build starts. `cpuCount`/`memoryMB` (the SDK sends
//!   2 and 1024 unless told otherwise) are the template's size: a build at
//!   another size than its base's builds on the base's size variant
//!   (`stratad::service::variants`, made once per size).
//! - `GET /templates/{templateID}/files/{hash}` → 201 `{present, url}`:
//!   whether that COPY context (the SDK's files hash) was uploaded, else a
//!   one-time upload URL on this door (`PUT /e2b-template-uploads/{token}`,
//!   the token being the credential, as a presigned URL is).
//! - The upload (a tar, gzipped or not, of the files at context-relative
//!   paths) is kept as a strata template file (per tenant, content-checked,
//!   at most `max_upload_bytes`) wrapped in strata's copy format: a
//!   directory archive holding `context.tar`.
//! - `POST /v2/templates/{templateID}/builds/{buildID}` (the steps) → 202:
//!   the steps become a recipe ([`recipe_of`]) and the daemon's build
//!   starts: `fromImage` `e2bdev/base[:tag]` / `fromTemplate` `base` → the
//!   default template, `e2bdev/code-interpreter` → the `code-interpreter`
//!   template, another template name or id as itself; any other image is
//!   refused (400, the supported list). E2B's defaults apply: steps run as
//!   `user` in `/home/user`, `run_cmd(…, user=)` switches for that step
//!   only; a COPY unpacks its context into a staging directory
//!   (a strata `copy`) and a root `run` installs what its source (a path or
//!   glob) names at its destination, owned by the step's user (or the
//!   COPY's), with its mode ([`COPY_INSTALLER`]).
//! - `GET /templates/{templateID}/builds/{buildID}/status?logsOffset=N`:
//!   `waiting` before the build starts, then `building` / `ready` /
//!   `error` (with `reason.message`), and the build log's lines from line N
//!   (at most 100) as `logEntries` (`{timestamp, level, message}`) and
//!   `logs`.
//! - `GET /templates/aliases/{alias}` (`Template.exists`): 200 for a
//!   template of the caller's or the platform's of that name, 404 otherwise.
//! - Tags (`POST`/`DELETE /templates/tags`, `GET /templates/{id}/tags`):
//!   a build's `name:tag` and `tags` and later assignments, kept in memory
//!   and stored with the tenant (`Service::set_tenant_setting`, key
//!   `e2b.tags/<name>`) before the call is answered, so they survive a
//!   restart.
//! - `DELETE /templates/{id or name}`: one of the caller's templates is
//!   deleted (204); anything else goes on as a snapshot delete.
//!
//! Another tenant's template, build or upload answers exactly like an
//! unknown one (404).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use strata_core::TemplateId;
use stratad::caller::Caller;
use stratad::engine::RuntimeError;
use stratad::service::{BuildTemplate, ServiceError};
use stratad::store::TemplateStatus;

use super::{parse_body, rfc3339, JsonBody, SandboxPath};
use crate::error::{too_large_message, E2bError, E2bResult};
use crate::policy::gate_opts;
use crate::E2b;

/// Build requests held per owner until their build starts.
pub const PENDING_PER_OWNER: usize = 64;
/// Upload links outstanding per build request.
pub const UPLOADS_PER_BUILD: usize = 256;
/// Log entries answered per status call (E2B's limit).
pub const LOG_ENTRIES_PER_CALL: usize = 100;
/// Tags kept per template name.
pub const TAGS_PER_NAME: usize = 64;
/// Names with tags kept per owner.
pub const NAMES_PER_OWNER: usize = 1024;
/// Uploads spooled at once (each at most `max_upload_bytes` on disk);
/// more answer `429`.
pub const UPLOADS_AT_ONCE: usize = 8;
/// Files hashes remembered (all owners); past that the map starts over and
/// the SDK uploads again.
pub const FILES_REMEMBERED: usize = 65536;
/// Largest CA bundle read from `[e2b] template_ca_bundle`.
const MAX_CA_BUNDLE: u64 = 1 << 20;

/// The images and templates a build may start from.
pub const SUPPORTED_BASES: &str =
    "e2bdev/base (from_base_image), template base, e2bdev/code-interpreter, or a template of yours by name or id";

/// A build request whose build has not started.
#[derive(Debug, Clone)]
struct Pending {
    /// The caller that asked; the uploads act as it.
    caller: Caller,
    owner: String,
    build_id: String,
    alias: String,
    tags: Vec<String>,
    /// `cpuCount` and `memoryMB` as asked.
    vcpus: Option<u32>,
    memory_mib: Option<u32>,
    /// Upload tokens handed out: token → the SDK's files hash.
    uploads: HashMap<String, String>,
}

/// One tag of a template name.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
struct Tag {
    template: TemplateId,
    created: DateTime<Utc>,
}

/// Prefix of the tenant settings holding a name's tags.
const TAGS_KEY: &str = "e2b.tags/";

/// The door's template-build state (in memory).
#[derive(Debug)]
pub struct TemplateState {
    /// Uploads being spooled.
    uploading: tokio::sync::Semaphore,
    /// By template id.
    pending: Mutex<HashMap<String, Pending>>,
    /// Template ids of pending requests per owner, oldest first.
    order: Mutex<HashMap<String, VecDeque<String>>>,
    /// `(owner, files hash)` → sha256 of the stored strata template file.
    files: Mutex<HashMap<(String, String), String>>,
    /// `(owner, name)` → tag → build.
    tags: Mutex<HashMap<(String, String), BTreeMap<String, Tag>>>,
    /// Log cursor per template: (lines seen, byte offset after them).
    cursors: Mutex<HashMap<TemplateId, (usize, u64)>>,
}

impl Default for TemplateState {
    fn default() -> Self {
        TemplateState {
            uploading: tokio::sync::Semaphore::new(UPLOADS_AT_ONCE),
            pending: Mutex::default(),
            order: Mutex::default(),
            files: Mutex::default(),
            tags: Mutex::default(),
            cursors: Mutex::default(),
        }
    }
}

impl TemplateState {
    /// The state with the tags the service keeps (none, with an error in
    /// the log, when they cannot be read).
    pub fn load(svc: &stratad::service::Service) -> Self {
        let mut tags: HashMap<(String, String), BTreeMap<String, Tag>> = HashMap::new();
        match svc.stored_tenant_settings(TAGS_KEY) {
            Ok(rows) => {
                for (owner, key, v) in rows {
                    let name = key[TAGS_KEY.len()..].to_owned();
                    match serde_json::from_value::<BTreeMap<String, Tag>>(v) {
                        Ok(m) => {
                            tags.insert((owner, name), m);
                        }
                        Err(e) => {
                            tracing::error!(owner, name, error = %e, "stored template tags unreadable: left out")
                        }
                    }
                }
            }
            Err(e) => tracing::error!(error = %e, "reading the template tags failed"),
        }
        TemplateState {
            tags: Mutex::new(tags),
            ..TemplateState::default()
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The build id of template `id`: a UUID derived from it.
pub fn build_id_of(id: &TemplateId) -> String {
    let h = Sha256::digest(format!("strata-e2b-build\0{id}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&h[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let x = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..]
    )
}

fn template_not_found(id: &str) -> E2bError {
    E2bError::new(404, format!("template {id} not found"))
}

fn build_not_found(tid: &str, bid: &str) -> E2bError {
    E2bError::new(404, format!("build {bid} of template {tid} not found"))
}

/// A template name or tag part: `[A-Za-z0-9._-]`, `/` in names, 1–128
/// bytes.
fn valid_part(s: &str, slash: bool) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b) || (slash && b == b'/'))
        && !s.starts_with(['.', '-', '/'])
}

/// `name` or `name:tag` → (name, tag).
fn split_name(s: &str) -> E2bResult<(String, Option<String>)> {
    let (n, t) = match s.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (s, None),
    };
    if !valid_part(n, true) {
        return Err(E2bError::new(
            400,
            format!("invalid template name {s:?}: a name is 1-128 of [A-Za-z0-9._-/] (then :tag)"),
        ));
    }
    if let Some(t) = t {
        if !valid_part(t, false) {
            return Err(E2bError::new(
                400,
                format!("invalid tag in {s:?}: a tag is 1-128 of [A-Za-z0-9._-]"),
            ));
        }
    }
    Ok((n.to_owned(), t.map(str::to_owned)))
}

/// A tag of a tags request: `tag` or `name:tag` for the same name.
fn parse_tag(name: &str, s: &str) -> E2bResult<String> {
    match s.split_once(':') {
        None if valid_part(s, false) => Ok(s.to_owned()),
        Some((n, t)) if n == name && valid_part(t, false) => Ok(t.to_owned()),
        _ => Err(E2bError::new(
            400,
            format!("invalid tag {s:?}: a tag is 1-128 of [A-Za-z0-9._-], or {name}:<tag>"),
        )),
    }
}

fn is_hex64(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `TemplateBuildRequestV3`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct RequestBody {
    name: Option<String>,
    alias: Option<String>,
    tags: Option<Vec<String>>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
}

/// `POST /v3/templates` → 202 `TemplateRequestResponseV3`.
pub async fn request_build(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: RequestBody = parse_body(&body)?;
    let full = req
        .name
        .or(req.alias)
        .ok_or_else(|| E2bError::new(400, "name is required"))?;
    let (alias, tag) = split_name(&full)?;
    let mut tags: Vec<String> = tag.into_iter().collect();
    for t in req.tags.unwrap_or_default() {
        let t = parse_tag(&alias, &t)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.len() > TAGS_PER_NAME {
        return Err(E2bError::new(400, format!("at most {TAGS_PER_NAME} tags")));
    }
    if tags.is_empty() {
        tags.push("default".into());
    }
    let id = TemplateId::generate();
    let build_id = build_id_of(&id);
    let owner = caller.owner().to_owned();
    {
        let mut order = lock(&st.templates.order);
        let q = order.entry(owner.clone()).or_default();
        q.push_back(id.to_string());
        let mut pending = lock(&st.templates.pending);
        while q.len() > PENDING_PER_OWNER {
            if let Some(old) = q.pop_front() {
                pending.remove(&old);
            }
        }
        pending.insert(
            id.to_string(),
            Pending {
                caller: caller.clone(),
                owner,
                build_id: build_id.clone(),
                alias: alias.clone(),
                tags: tags.clone(),
                vcpus: req.cpu_count,
                memory_mib: req.memory_mb,
                uploads: HashMap::new(),
            },
        );
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": id.to_string(),
            "buildID": build_id,
            "public": false,
            "names": [full],
            "tags": tags,
            "aliases": [alias],
        })),
    )
        .into_response())
}

impl E2b {
    /// The caller's pending request for template `tid`.
    fn pending(&self, caller: &Caller, tid: &str) -> Option<Pending> {
        lock(&self.templates.pending)
            .get(tid)
            .filter(|p| p.owner == caller.owner())
            .cloned()
    }

    /// The caller's templates (and the platform's) named `name`, newest
    /// last; `base` and its spellings name the default template.
    async fn templates_named(
        &self,
        caller: &Caller,
        name: &str,
    ) -> E2bResult<Vec<stratad::service::TemplateView>> {
        let all = self.svc.list_templates(caller).await?;
        let default = matches!(name, "base" | "default" | "e2bdev/base");
        Ok(all
            .into_iter()
            .filter(|t| {
                matches!(
                    t.record.status,
                    TemplateStatus::Ready | TemplateStatus::Building
                ) && (t.record.name.as_deref() == Some(name)
                    || t.record.id.as_str() == name
                    || (default && t.record.id.as_str() == stratad::service::DEFAULT_TEMPLATE))
            })
            .collect())
    }
}

/// `GET /templates/{templateID}/files/{hash}` → 201 `{present, url?}`.
pub async fn file_upload_link(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    Path((tid, hash)): Path<(String, String)>,
) -> E2bResult<Response> {
    if !is_hex64(&hash) {
        return Err(E2bError::new(
            400,
            format!("invalid files hash {hash:?}: expected 64 lowercase hex digits"),
        ));
    }
    let Some(p) = st.pending(&caller, &tid) else {
        return Err(template_not_found(&tid));
    };
    let known = lock(&st.templates.files)
        .get(&(p.owner.clone(), hash.clone()))
        .cloned();
    if let Some(sha) = known {
        if st.svc.has_template_file(&caller, &sha).await? {
            return Ok((StatusCode::CREATED, Json(json!({"present": true}))).into_response());
        }
    }
    let token = hex::encode(rand::random::<[u8; 16]>());
    {
        let mut pending = lock(&st.templates.pending);
        let Some(p) = pending.get_mut(&tid) else {
            return Err(template_not_found(&tid));
        };
        if p.uploads.len() >= UPLOADS_PER_BUILD {
            return Err(E2bError::new(
                429,
                format!("at most {UPLOADS_PER_BUILD} upload links per build"),
            ));
        }
        p.uploads.insert(token.clone(), hash);
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let url = format!("http://{host}/e2b-template-uploads/{token}");
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": false, "url": url})),
    )
        .into_response())
}

/// A ustar header of one entry (`typeflag` `0` file, `5` directory).
fn ustar_header(name: &str, size: u64, mode: u32, typeflag: u8) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name.as_bytes());
    let put = |h: &mut [u8; 512], at: usize, width: usize, v: u64| {
        let s = format!("{v:0w$o}\0", w = width - 1);
        h[at..at + width].copy_from_slice(s.as_bytes());
    };
    put(&mut h, 100, 8, u64::from(mode));
    put(&mut h, 108, 8, 0);
    put(&mut h, 116, 8, 0);
    put(&mut h, 124, 12, size);
    put(&mut h, 136, 12, 0);
    h[148..156].copy_from_slice(b"        ");
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

fn io_err(e: std::io::Error) -> E2bError {
    E2bError::new(500, format!("template upload: {e}"))
}

/// `PUT /e2b-template-uploads/{token}`: the COPY context of a pending
/// build (the token from `file_upload_link`, used once) → 200. Spooled to
/// disk under `max_upload_bytes` (`413`), wrapped, stored as the owner's
/// template file.
pub async fn upload(
    State(st): State<Arc<E2b>>,
    Path(token): Path<String>,
    req: Request,
) -> E2bResult<Response> {
    let Ok(_slot) = st.templates.uploading.try_acquire() else {
        return Err(E2bError::new(
            429,
            format!("at most {UPLOADS_AT_ONCE} template uploads at once; retry"),
        ));
    };
    let found = {
        let mut pending = lock(&st.templates.pending);
        pending.values_mut().find_map(|p| {
            p.uploads
                .remove(&token)
                .map(|hash| (p.caller.clone(), hash))
        })
    };
    let Some((caller, hash)) = found else {
        return Err(E2bError::new(404, "unknown or used upload link"));
    };
    let limit = st.svc.config().max_upload_bytes;
    if crate::content_length(req.headers()).is_some_and(|n| n > limit) {
        return Err(E2bError::new(413, too_large_message(limit)));
    }
    let dir = st.svc.config().data_dir.join("e2b-uploads");
    tokio::fs::create_dir_all(&dir).await.map_err(io_err)?;
    let path = dir.join(format!("{}.tar", hex::encode(rand::random::<[u8; 8]>())));
    let result = store_upload(&st, &caller, &path, req, limit).await;
    let _ = tokio::fs::remove_file(&path).await;
    let sha = result?;
    {
        let mut files = lock(&st.templates.files);
        if files.len() >= FILES_REMEMBERED {
            files.clear();
        }
        files.insert((caller.owner().to_owned(), hash), sha);
    }
    Ok(StatusCode::OK.into_response())
}

/// Spools the body to `path` inside a wrapper tar (`./`,
/// `./context.tar`), then stores it as the owner's template file; returns
/// its sha256.
async fn store_upload(
    st: &Arc<E2b>,
    caller: &Caller,
    path: &std::path::Path,
    req: Request,
    limit: u64,
) -> E2bResult<String> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
    let mut f = tokio::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(path)
        .await
        .map_err(io_err)?;
    f.write_all(&[0u8; 1024]).await.map_err(io_err)?;
    let mut n = 0u64;
    let mut body = req.into_body().into_data_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| E2bError::new(400, format!("reading the upload: {e}")))?;
        n += chunk.len() as u64;
        if n > limit {
            return Err(E2bError::new(413, too_large_message(limit)));
        }
        f.write_all(&chunk).await.map_err(io_err)?;
    }
    let pad = (512 - (n % 512)) % 512;
    f.write_all(&vec![0u8; pad as usize + 1024])
        .await
        .map_err(io_err)?;
    f.seek(std::io::SeekFrom::Start(0)).await.map_err(io_err)?;
    f.write_all(&ustar_header("./", 0, 0o755, b'5'))
        .await
        .map_err(io_err)?;
    f.write_all(&ustar_header("./context.tar", n, 0o644, b'0'))
        .await
        .map_err(io_err)?;
    f.flush().await.map_err(io_err)?;
    f.seek(std::io::SeekFrom::Start(0)).await.map_err(io_err)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let k = f.read(&mut buf).await.map_err(io_err)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
    }
    let sha = hex::encode(h.finalize());
    let file = tokio::fs::File::open(path).await.map_err(io_err)?;
    let stream = futures::stream::unfold(file, |mut file| async move {
        let mut buf = vec![0u8; 64 * 1024];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(k) => {
                buf.truncate(k);
                Some((Ok(bytes::Bytes::from(buf)), file))
            }
            Err(e) => Some((Err(RuntimeError::Other(format!("upload: {e}"))), file)),
        }
    })
    .boxed();
    st.svc
        .put_template_file(caller, &sha, stream, &gate_opts())
        .await?;
    Ok(sha)
}

/// One step of `TemplateBuildStartV2`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct StepBody {
    #[serde(rename = "type")]
    kind: String,
    args: Vec<String>,
    files_hash: Option<String>,
}

/// `TemplateBuildStartV2`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct StartBody {
    steps: Vec<StepBody>,
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<Value>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// Installs an E2B COPY from its staging directory `$s` (holding
/// `context.tar`): arguments `src dest owner mode`. A source without glob
/// characters follows Docker: a directory's contents are merged into
/// `dest`, a file is written at `dest` (into it when `dest` ends with `/`);
/// a glob's matches all go into `dest` as a directory (a matched
/// directory's contents merged). Every installed entry gets `owner`, and
/// `mode` when given. Relative `dest` resolves against the step's cwd.
pub const COPY_INSTALLER: &str = r#"set -e
s="$1"; src="$2"; dest="$3"; own="$4"; mode="$5"
mkdir "$s/ctx"
tar -xf "$s/context.tar" -C "$s/ctx" --no-same-owner
case "$dest" in /*) ;; *) dest="$(pwd)/$dest" ;; esac
put() { # put ENTRY TARGET: copy ENTRY to TARGET, own and chmod it
  cp -a -- "$1" "$2"
  chown -hR -- "$own" "$2"
  if [ -n "$mode" ]; then find "$2" ! -type l ! -type d -exec chmod "$mode" {} +; fi
}
merge() { # merge DIR TARGETDIR
  mkdir -p -- "$2"
  for e in "$1"/* "$1"/.[!.]* "$1"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    put "$e" "$2/$(basename -- "$e")"
  done
}
cd "$s/ctx"
case "$src" in
  *[*?[]*)
    set +e; matches=$(for m in $src; do [ -e "$m" ] || [ -L "$m" ] && printf '%s\n' "$m"; done); set -e
    [ -n "$matches" ] || { echo "copy: no file matches $src" >&2; exit 1; }
    printf '%s\n' "$matches" | while IFS= read -r m; do
      if [ -d "$m" ] && [ ! -L "$m" ]; then merge "$m" "$dest"
      else mkdir -p -- "$dest"; put "$m" "$dest/$(basename -- "$m")"; fi
    done ;;
  *)
    src="${src%/}"
    [ -e "$src" ] || [ -L "$src" ] || { echo "copy: $src is not in the uploaded context" >&2; exit 1; }
    if [ -d "$src" ] && [ ! -L "$src" ]; then merge "$src" "$dest"
    else case "$dest" in
      */) mkdir -p -- "$dest"; put "$src" "$dest$(basename -- "$src")" ;;
      *) if [ -d "$dest" ]; then put "$src" "$dest/$(basename -- "$src")"
         else mkdir -p -- "$(dirname -- "$dest")"; put "$src" "$dest"; fi ;;
    esac; fi ;;
esac
cd /
rm -rf -- "$s""#;

/// The recipe base of a build's `fromImage` / `fromTemplate`.
fn base_of(b: &StartBody) -> E2bResult<String> {
    if b.from_image_registry.is_some() {
        return Err(E2bError::new(
            400,
            format!("registry images are not supported; use {SUPPORTED_BASES}"),
        ));
    }
    match (&b.from_template, &b.from_image) {
        (Some(t), _) => Ok(t.clone()),
        (None, Some(img)) => {
            let name = img.split('@').next().unwrap_or(img);
            let name = match name.rsplit_once(':') {
                Some((n, _)) if !n.contains('/') || !name[n.len()..].contains('/') => n,
                _ => name,
            };
            let name = name.strip_prefix("docker.io/").unwrap_or(name);
            match name {
                "e2bdev/base" => Ok("default".into()),
                "e2bdev/code-interpreter" => Ok("e2bdev/code-interpreter".into()),
                _ => Err(E2bError::new(
                    400,
                    format!("image {img:?} is not supported: strata builds on {SUPPORTED_BASES}"),
                )),
            }
        }
        (None, None) => Ok("default".into()),
    }
}

/// The strata recipe (JSON) of an E2B build, and the copy contexts it
/// needs: `files` maps the SDK's files hash to the stored template file.
fn recipe_of(b: &StartBody, files: &HashMap<String, String>) -> E2bResult<Value> {
    let bad = |i: usize, m: String| E2bError::new(400, format!("step {}: {m}", i + 1));
    let mut steps: Vec<Value> = vec![
        // E2B's base image lets pip install into the system Python.
        json!({"env": {"PIP_BREAK_SYSTEM_PACKAGES": "1"}}),
        json!({"user": "user"}),
        json!({"workdir": "/home/user"}),
    ];
    let mut user = "user".to_owned();
    for (i, s) in b.steps.iter().enumerate() {
        let arg = |k: usize| s.args.get(k).map(String::as_str).unwrap_or("");
        match s.kind.as_str() {
            "RUN" => {
                let as_user = arg(1);
                if !as_user.is_empty() && as_user != user {
                    steps.push(json!({"user": as_user}));
                    steps.push(json!({"run": arg(0)}));
                    steps.push(json!({"user": user}));
                } else {
                    steps.push(json!({"run": arg(0)}));
                }
            }
            "ENV" => {
                let mut env = serde_json::Map::new();
                for kv in s.args.chunks(2) {
                    let v = kv.get(1).cloned().unwrap_or_default();
                    env.insert(kv[0].clone(), Value::String(v));
                }
                if !env.is_empty() {
                    steps.push(json!({ "env": env }));
                }
            }
            "WORKDIR" => steps.push(json!({"workdir": arg(0)})),
            "USER" => {
                user = arg(0).to_owned();
                steps.push(json!({"user": user}));
            }
            "COPY" => {
                let hash = s
                    .files_hash
                    .as_deref()
                    .ok_or_else(|| bad(i, "COPY without filesHash".into()))?;
                let sha = files.get(hash).ok_or_else(|| {
                    bad(
                        i,
                        format!("the files of {hash} were not uploaded (GET /templates/{{id}}/files/{hash} first)"),
                    )
                })?;
                let stage = format!("/tmp/strata-e2b-copy-{}", &sha[..16]);
                let owner = if arg(2).is_empty() {
                    user.as_str()
                } else {
                    arg(2)
                };
                let q = stratad_quote;
                steps.push(json!({"copy": {"src": "context", "dest": stage, "sha256": sha, "owner": "root"}}));
                if user != "root" {
                    steps.push(json!({"user": "root"}));
                }
                // The first line is what the build log shows of the step.
                steps.push(json!({"run": format!(
                    ": COPY {} {}\nsh -c {} copy {} {} {} {} {}",
                    q(arg(0)),
                    q(arg(1)),
                    q(COPY_INSTALLER),
                    q(&stage),
                    q(arg(0)),
                    q(arg(1)),
                    q(owner),
                    q(arg(3)),
                )}));
                if user != "root" {
                    steps.push(json!({"user": user}));
                }
            }
            other => return Err(bad(i, format!("unknown step type {other:?}"))),
        }
    }
    let mut r = json!({"base": base_of(b)?, "steps": steps});
    if b.start_cmd.is_some() || b.ready_cmd.is_some() {
        let start = b.start_cmd.as_deref().unwrap_or("true");
        r["start"] = json!({ "cmd": start });
        let ready = b.ready_cmd.as_deref().unwrap_or("true");
        r["ready"] = json!({"cmd": ready_probe(ready), "timeout_secs": 600});
    }
    Ok(r)
}

/// The ready check of an E2B `readyCmd`: E2B runs it until it exits 0,
/// however long one run takes (`wait_for_timeout(10_000)` is `sleep 10`),
/// and the daemon's probe gives one run 10 s. So the probe starts the
/// command once in its own session and passes when a run exited 0 (a run
/// that failed is started again by the next probe); its markers are gone
/// from the template.
fn ready_probe(cmd: &str) -> String {
    format!(
        "m=/tmp/.strata-e2b-ready; \
if [ -e $m.ok ]; then rm -f $m.ok $m.run; exit 0; fi; \
if [ ! -e $m.run ]; then touch $m.run; \
setsid sh -c 'if sh -c \"$0\"; then touch /tmp/.strata-e2b-ready.ok; fi; rm -f /tmp/.strata-e2b-ready.run' {} </dev/null >/dev/null 2>&1 & fi; \
exit 1",
        stratad_quote(cmd)
    )
}

/// Single-quotes `s` for `sh`.
fn stratad_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `POST /v2/templates/{templateID}/builds/{buildID}` → 202: starts the
/// build of a pending request.
pub async fn start_build(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path((tid, bid)): Path<(String, String)>,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let Some(p) = st.pending(&caller, &tid) else {
        return Err(template_not_found(&tid));
    };
    if p.build_id != bid {
        return Err(build_not_found(&tid, &bid));
    }
    let req: StartBody = parse_body(&body)?;
    let files: HashMap<String, String> = {
        let f = lock(&st.templates.files);
        req.steps
            .iter()
            .filter_map(|s| s.files_hash.clone())
            .filter_map(|h| f.get(&(p.owner.clone(), h.clone())).map(|s| (h, s.clone())))
            .collect()
    };
    let recipe = recipe_of(&req, &files)?;
    let ca_bundle = match &st.cfg.template_ca_bundle {
        None => None,
        Some(path) => {
            let meta = tokio::fs::metadata(path).await.map_err(|e| {
                E2bError::new(
                    500,
                    format!("[e2b] template_ca_bundle {}: {e}", path.display()),
                )
            })?;
            if meta.len() > MAX_CA_BUNDLE {
                return Err(E2bError::new(
                    500,
                    format!("[e2b] template_ca_bundle {}: over 1 MiB", path.display()),
                ));
            }
            Some(tokio::fs::read_to_string(path).await.map_err(|e| {
                E2bError::new(
                    500,
                    format!("[e2b] template_ca_bundle {}: {e}", path.display()),
                )
            })?)
        }
    };
    let cmd: BuildTemplate = serde_json::from_value(json!({
        "id": tid,
        "name": p.alias,
        "recipe": recipe,
        "ca_bundle": ca_bundle,
        "size": {"vcpus": p.vcpus, "memory_mib": p.memory_mib},
    }))
    .map_err(|e| E2bError::new(400, format!("invalid build: {e}")))?;
    st.svc.build_template(&caller, cmd, &gate_opts()).await?;
    lock(&st.templates.pending).remove(&tid);
    if let Ok(id) = tid.parse::<TemplateId>() {
        st.put_tags(&p.owner, &p.alias, &p.tags, &id);
        st.save_tags(&caller, &p.alias).await?;
    }
    Ok(StatusCode::ACCEPTED.into_response())
}

impl E2b {
    /// Stores the caller's tags of `name` as they are in memory (removes
    /// the row when there are none).
    async fn save_tags(&self, caller: &Caller, name: &str) -> E2bResult<()> {
        let v = lock(&self.templates.tags)
            .get(&(caller.owner().to_owned(), name.to_owned()))
            .filter(|m| !m.is_empty())
            .map(serde_json::to_value)
            .transpose()
            .map_err(|e| E2bError::new(500, format!("tags: {e}")))?;
        self.svc
            .set_tenant_setting(caller, &format!("{TAGS_KEY}{name}"), v.as_ref())
            .await?;
        Ok(())
    }

    /// Points `tags` of `owner`'s `name` at template `id`.
    fn put_tags(&self, owner: &str, name: &str, tags: &[String], id: &TemplateId) {
        let mut all = lock(&self.templates.tags);
        let key = (owner.to_owned(), name.to_owned());
        if !all.contains_key(&key)
            && all.keys().filter(|(o, _)| o == owner).count() >= NAMES_PER_OWNER
        {
            return;
        }
        let m = all.entry(key).or_default();
        for t in tags {
            if m.len() >= TAGS_PER_NAME && !m.contains_key(t) {
                break;
            }
            m.insert(
                t.clone(),
                Tag {
                    template: id.clone(),
                    created: Utc::now(),
                },
            );
        }
    }
}

/// Query of the status call.
fn parse_status_query(raw: Option<&str>) -> E2bResult<(usize, usize)> {
    let mut offset = 0usize;
    let mut limit = LOG_ENTRIES_PER_CALL;
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "logsOffset" => {
                offset = v
                    .parse()
                    .map_err(|_| E2bError::new(400, format!("invalid logsOffset {v:?}")))?
            }
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .map_err(|_| E2bError::new(400, format!("invalid limit {v:?}")))?
                    .clamp(0, LOG_ENTRIES_PER_CALL)
            }
            _ => {}
        }
    }
    Ok((offset, limit))
}

/// `GET /templates/{templateID}/builds/{buildID}/status` → 200
/// `TemplateBuildInfo`.
pub async fn build_status(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path((tid, bid)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let (offset, limit) = parse_status_query(raw.as_deref())?;
    if let Some(p) = st.pending(&caller, &tid) {
        if p.build_id != bid {
            return Err(build_not_found(&tid, &bid));
        }
        return Ok(Json(json!({
            "templateID": tid, "buildID": bid, "status": "waiting",
            "logs": [], "logEntries": [],
        }))
        .into_response());
    }
    let id: TemplateId = tid.parse().map_err(|_| template_not_found(&tid))?;
    let v = match st.svc.get_template(&caller, &id).await {
        Ok(v) => v,
        Err(ServiceError::NotFound { .. }) => return Err(template_not_found(&tid)),
        Err(e) => return Err(e.into()),
    };
    if build_id_of(&id) != bid || v.record.status == TemplateStatus::Deleted {
        return Err(build_not_found(&tid, &bid));
    }
    let lines = st.log_lines(&caller, &id, offset, limit).await?;
    let now = rfc3339(Utc::now());
    let entries: Vec<Value> = lines
        .iter()
        .map(|l| json!({"timestamp": now, "level": "info", "message": l}))
        .collect();
    let (status, reason) = match v.record.status {
        TemplateStatus::Ready => ("ready", None),
        TemplateStatus::Failed => (
            "error",
            Some(
                json!({"message": v.record.status_reason.clone().unwrap_or_else(|| "build failed".into())}),
            ),
        ),
        _ => ("building", None),
    };
    let mut out = json!({
        "templateID": tid, "buildID": bid, "status": status,
        "logs": lines, "logEntries": entries,
    });
    if let Some(r) = reason {
        out["reason"] = r;
    }
    Ok(Json(out).into_response())
}

impl E2b {
    /// Lines `offset..offset+limit` of template `id`'s build log (a last
    /// line without its newline only once the build is over).
    async fn log_lines(
        &self,
        caller: &Caller,
        id: &TemplateId,
        offset: usize,
        limit: usize,
    ) -> E2bResult<Vec<String>> {
        let (mut line, mut at) = lock(&self.templates.cursors)
            .get(id)
            .copied()
            .filter(|(l, _)| *l <= offset)
            .unwrap_or((0, 0));
        let mut out = Vec::new();
        let mut partial: Vec<u8> = Vec::new();
        loop {
            let (data, next, done) = self.svc.template_log(caller, id, at).await?;
            let empty = data.is_empty();
            for &b in &data {
                if b == b'\n' {
                    if line >= offset && out.len() < limit {
                        out.push(String::from_utf8_lossy(&partial).into_owned());
                    }
                    line += 1;
                    partial.clear();
                } else {
                    partial.push(b);
                }
            }
            at = next;
            if out.len() >= limit {
                break;
            }
            if empty {
                if done && !partial.is_empty() && line >= offset && out.len() < limit {
                    out.push(String::from_utf8_lossy(&partial).into_owned());
                    line += 1;
                    partial.clear();
                }
                break;
            }
        }
        // Remember where complete lines end (the bytes of a partial line are
        // read again next time).
        let end = at - partial.len() as u64;
        {
            let mut c = lock(&self.templates.cursors);
            if c.len() > 1024 {
                c.clear();
            }
            c.insert(id.clone(), (line, end));
        }
        Ok(out)
    }
}

/// `GET /templates/aliases/{alias}` → 200 `{templateID, public}` or 404.
pub async fn alias(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(alias): SandboxPath,
) -> E2bResult<Response> {
    let found = st.templates_named(&caller, &alias).await?;
    match found.last() {
        Some(t) => Ok(Json(json!({
            "templateID": t.record.id.to_string(),
            "public": t.record.tenant != caller.owner(),
        }))
        .into_response()),
        None => Err(E2bError::new(404, format!("template {alias} not found"))),
    }
}

/// `AssignTemplateTagsRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct AssignBody {
    target: String,
    tags: Vec<String>,
}

/// `DeleteTemplateTagsRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RemoveBody {
    name: String,
    tags: Vec<String>,
}

impl E2b {
    /// The caller's template a `name[:tag]` names: a tag's build, else the
    /// newest template of that name.
    async fn tagged(&self, caller: &Caller, target: &str) -> E2bResult<(String, TemplateId)> {
        let (name, tag) = split_name(target)?;
        if let Some(tag) = &tag {
            let t = lock(&self.templates.tags)
                .get(&(caller.owner().to_owned(), name.clone()))
                .and_then(|m| m.get(tag))
                .map(|t| t.template.clone());
            return t
                .map(|t| (name, t))
                .ok_or_else(|| template_not_found(target));
        }
        let found = self.templates_named(caller, &name).await?;
        match found
            .into_iter()
            .rev()
            .find(|t| t.record.tenant == caller.owner())
        {
            Some(t) => Ok((name, t.record.id)),
            None => Err(template_not_found(target)),
        }
    }
}

/// `POST /templates/tags` → 201 `{buildID, tags}`.
pub async fn assign_tags(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: AssignBody = parse_body(&body)?;
    if req.tags.is_empty() || req.tags.len() > TAGS_PER_NAME {
        return Err(E2bError::new(400, format!("give 1-{TAGS_PER_NAME} tags")));
    }
    let (name, id) = st.tagged(&caller, &req.target).await?;
    let tags = req
        .tags
        .iter()
        .map(|t| parse_tag(&name, t))
        .collect::<E2bResult<Vec<_>>>()?;
    st.put_tags(caller.owner(), &name, &tags, &id);
    st.save_tags(&caller, &name).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"buildID": build_id_of(&id), "tags": tags})),
    )
        .into_response())
}

/// `DELETE /templates/tags` → 204 (404 for a name without tags).
pub async fn remove_tags(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: RemoveBody = parse_body(&body)?;
    let (name, _) = split_name(&req.name)?;
    {
        let mut all = lock(&st.templates.tags);
        let Some(m) = all.get_mut(&(caller.owner().to_owned(), name.clone())) else {
            return Err(template_not_found(&req.name));
        };
        for t in &req.tags {
            m.remove(&parse_tag(&name, t)?);
        }
    }
    st.save_tags(&caller, &name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id or name}/tags` → 200 `[TemplateTag]`.
pub async fn list_tags(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(name): SandboxPath,
) -> E2bResult<Response> {
    let by_name = lock(&st.templates.tags)
        .get(&(caller.owner().to_owned(), name.clone()))
        .cloned();
    let m = match by_name {
        Some(m) => m,
        None => {
            // A template id: the tags of its name.
            let id: TemplateId = name.parse().map_err(|_| template_not_found(&name))?;
            let v = st
                .svc
                .get_template(&caller, &id)
                .await
                .map_err(|_| template_not_found(&name))?;
            let n = v.record.name.unwrap_or_default();
            lock(&st.templates.tags)
                .get(&(caller.owner().to_owned(), n))
                .cloned()
                .unwrap_or_default()
        }
    };
    let out: Vec<Value> = m
        .iter()
        .map(|(tag, t)| {
            json!({"tag": tag, "buildID": build_id_of(&t.template), "createdAt": rfc3339(t.created)})
        })
        .collect();
    Ok(Json(out).into_response())
}

/// `DELETE /templates/{id or name}`: one of the caller's templates → 204;
/// anything else is a snapshot delete ([`super::snapshots::delete_snapshot`]).
pub async fn delete(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
) -> E2bResult<StatusCode> {
    let own = st
        .templates_named(&caller, &id)
        .await?
        .into_iter()
        .rev()
        .find(|t| t.record.tenant == caller.owner());
    match own {
        Some(t) => {
            st.svc
                .delete_template(&caller, &t.record.id, &gate_opts())
                .await?;
            Ok(StatusCode::NO_CONTENT)
        }
        None => {
            super::snapshots::delete_snapshot(State(st), Extension(caller), SandboxPath(id)).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_ids_are_uuids_of_the_template() {
        let id: TemplateId = "tpl-abc".parse().unwrap();
        let b = build_id_of(&id);
        assert_eq!(b.len(), 36);
        assert_eq!(b.as_bytes()[14], b'4');
        assert_eq!(build_id_of(&id), b);
        assert_ne!(build_id_of(&"tpl-abd".parse().unwrap()), b);
    }

    #[test]
    fn names_and_tags() {
        assert_eq!(
            split_name("e2b-tags-test:v1-ab").unwrap(),
            ("e2b-tags-test".into(), Some("v1-ab".into()))
        );
        assert!(split_name(":x").is_err());
        assert!(split_name("x:").is_err());
        assert!(parse_tag("n", ":bad").is_err());
        assert!(parse_tag("n", "n:").is_err());
        assert_eq!(parse_tag("n", "n:ok").unwrap(), "ok");
        assert_eq!(parse_tag("n", "stable").unwrap(), "stable");
    }

    #[test]
    fn bases() {
        let b = |img: &str| StartBody {
            from_image: Some(img.into()),
            ..StartBody::default()
        };
        assert_eq!(base_of(&b("e2bdev/base")).unwrap(), "default");
        assert_eq!(base_of(&b("e2bdev/base:latest")).unwrap(), "default");
        assert!(base_of(&b("ubuntu:22.04"))
            .unwrap_err()
            .message
            .contains("e2bdev/base"));
    }

    /// Runs the COPY installer here on a context tar made by `tar` (as the
    /// SDK's: entries at context-relative paths), `src` → `dest` relative
    /// to a working directory; returns the files under it.
    fn install(src: &str, dest: &str, mode: &str) -> Vec<String> {
        use std::process::Command;
        let t = std::env::temp_dir().join(format!("e2b-copy-{}", rand::random::<u64>()));
        let ctx = t.join("ctx");
        std::fs::create_dir_all(ctx.join("folder/sub")).unwrap();
        std::fs::write(ctx.join("folder/test.txt"), "t").unwrap();
        std::fs::write(ctx.join("folder/sub/deep.txt"), "d").unwrap();
        std::fs::write(ctx.join("top.txt"), "top").unwrap();
        std::os::unix::fs::symlink("test.txt", ctx.join("folder/link.txt")).unwrap();
        let stage = t.join("stage");
        let work = t.join("work");
        std::fs::create_dir_all(&stage).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let ok = Command::new("tar")
            .arg("-czf")
            .arg(stage.join("context.tar"))
            .arg("-C")
            .arg(&ctx)
            .args(["folder", "top.txt"])
            .status()
            .unwrap();
        assert!(ok.success());
        let out = Command::new("sh")
            .current_dir(&work)
            .arg("-c")
            .arg(COPY_INSTALLER)
            .arg("copy")
            .arg(&stage)
            .args([src, dest, "root", mode])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!stage.exists(), "the staging directory is removed");
        let list = Command::new("sh")
            .current_dir(&work)
            .arg("-c")
            .arg("find . -mindepth 1 | sort | while read -r f; do printf '%s %s\\n' \"$f\" \"$(stat -c %a \"$f\")\"; done")
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&t);
        String::from_utf8_lossy(&list.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_copy_installer_follows_e2b_and_docker() {
        // A glob: every match into dest; a matched directory's contents.
        let v = install("folder/*", "folder", "");
        let names: Vec<&str> = v.iter().map(|l| l.split(' ').next().unwrap()).collect();
        assert_eq!(
            names,
            [
                "./folder",
                "./folder/deep.txt",
                "./folder/link.txt",
                "./folder/test.txt"
            ],
            "{v:?}"
        );
        // A directory: its contents merged into dest.
        let v = install("folder", "app", "");
        assert!(
            v.iter().any(|l| l.starts_with("./app/sub/deep.txt ")),
            "{v:?}"
        );
        assert!(v.iter().any(|l| l.starts_with("./app/test.txt ")), "{v:?}");
        // A file into a directory (dest ending with /), with a mode.
        let v = install("top.txt", "docs/", "0600");
        assert_eq!(v, ["./docs 755", "./docs/top.txt 600"], "{v:?}");
        // A file at dest.
        let v = install("top.txt", "x/renamed.txt", "");
        assert!(v.iter().any(|l| l.starts_with("./x/renamed.txt ")), "{v:?}");
    }

    #[test]
    fn the_wrapper_header_is_ustar() {
        let h = ustar_header("./context.tar", 1234, 0o644, b'0');
        assert_eq!(&h[257..263], b"ustar\0");
        assert_eq!(&h[124..136], b"00000002322\0");
    }
}
