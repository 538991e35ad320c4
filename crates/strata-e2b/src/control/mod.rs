//! The E2B control plane (`E2B_API_URL`) over strata's service.
//!
//! Mapping:
//! - `templateID`: a strata template id when one exists by that id; else
//!   one of the caller's snapshots (below); else a template *name*: the
//!   newest ready template of that name the caller may use (its own before
//!   the platform's), with the aliases `code-interpreter-v1` and
//!   `code-interpreter` → the template named `code-interpreter` (what
//!   `e2b_code_interpreter`'s `Sandbox.create()` asks for); `base` and
//!   anything else → the default template (the newest ready one).
//! - `metadata` ↔ strata labels (so `strata ls --label` sees them).
//! - `timeout` → the sandbox's idle timeout: after `timeout` seconds
//!   without activity strata *hibernates* it (memory kept), or deletes it
//!   when the create asked `autoPause: false` (`on_timeout: "kill"`); an
//!   omitted `autoPause` hibernates. `autoResume` decides whether envd calls
//!   wake it ([`lifecycle`]). `endAt` = last activity + idle timeout.
//! - `pause` → hibernate (snapshot with memory, VM process ends);
//!   `connect` on a hibernated or paused sandbox wakes it (201).
//! - states: creating/running → `running`; paused/hibernated → `paused`;
//!   failed sandboxes are not listed.
//! - `fork` ([`fork`]) → strata forks of the live sandbox; snapshots
//!   ([`snapshots`]) → strata manual snapshots, their name the label;
//!   `templateID` naming one of the caller's snapshots (id or name) → a
//!   fork of that snapshot.
//!
//! Each route group has its own file; `crate::router` registers them.

pub mod fork;
pub mod lifecycle;
pub mod list;
pub mod logs;
pub mod metrics;
pub mod network;
pub mod snapshots;
pub mod templates;

pub use list::{list_v1, list_v2};

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxState, TemplateId};
use stratad::caller::Caller;
use stratad::service::{CreateSandbox, SandboxSpec, ServiceError};
use stratad::store::{SandboxRecord, TemplateRecord, TemplateStatus};

pub use crate::error::E2bError;
use crate::error::{too_large_message, E2bResult};
use crate::policy::{gate_opts, may_write};
use crate::{BodyError, E2b, ENVD_VERSION};

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The answer for an unknown sandbox, another tenant's included, naming the
/// id as the caller sent it.
fn not_found(id: &str) -> E2bError {
    E2bError::new(404, format!("sandbox {id} not found"))
}

fn parse_sandbox_id(s: &str) -> E2bResult<SandboxId> {
    s.parse().map_err(|_| not_found(s))
}

/// A service error of a command on sandbox `id` (as the caller sent it): an
/// unknown sandbox, another tenant's included, answers [`not_found`].
fn sandbox_err(id: &str) -> impl FnOnce(ServiceError) -> E2bError + '_ {
    move |e| match e {
        ServiceError::NotFound {
            kind: "sandbox", ..
        } => not_found(id),
        e => e.into(),
    }
}

/// Longest E2B `timeout`: a year (the service's bound on idle timeouts).
pub const MAX_TIMEOUT_S: u64 = stratad::service::MAX_IDLE_TIMEOUT_S;

fn check_timeout(t: u64) -> E2bResult<u64> {
    if t > MAX_TIMEOUT_S {
        return Err(E2bError::new(
            400,
            format!("timeout {t}s: at most {MAX_TIMEOUT_S}s (a year)"),
        ));
    }
    Ok(t)
}

/// A JSON request body of at most [`crate::E2bConfig::max_request_bytes`]
/// (read after the API key was checked); a longer one answers `413`.
#[derive(Debug, Clone)]
pub struct JsonBody(pub Bytes);

#[axum::async_trait]
impl FromRequest<Arc<E2b>> for JsonBody {
    type Rejection = E2bError;

    async fn from_request(req: Request, st: &Arc<E2b>) -> Result<Self, E2bError> {
        match crate::capped_body(req, st.cfg.max_request_bytes).await {
            Ok(b) => Ok(JsonBody(b)),
            Err(BodyError::TooLarge(n)) => Err(E2bError::new(413, too_large_message(n))),
            Err(BodyError::Read(m)) => Err(E2bError::new(400, m)),
        }
    }
}

fn parse_body<T: serde::de::DeserializeOwned + Default>(body: &Bytes) -> E2bResult<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| E2bError::new(400, format!("invalid JSON body: {e}")))
}

/// `NewSandbox` / `NewSandboxV2` (fields strata uses; others are ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    /// `false`: the timeout's pause keeps no memory (`keep_memory`).
    auto_pause_memory: Option<bool>,
    auto_resume: Option<lifecycle::AutoResume>,
    /// The SDKs send it snake_case (`allow_internet_access`).
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<network::NetworkBody>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
}

/// `{ "timeout": n }` (connect, set_timeout).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TimeoutBody {
    timeout: Option<u64>,
}

impl E2b {
    fn idle_timeout_s(&self, rec: &SandboxRecord) -> u64 {
        rec.idle_timeout_s
            .unwrap_or(self.svc.config().idle_timeout.as_secs())
    }

    fn end_at(&self, rec: &SandboxRecord) -> DateTime<Utc> {
        let t = self.idle_timeout_s(rec);
        let base = rec.last_activity_at.max(rec.updated_at);
        // Never hibernated (0), or more than chrono holds: E2B has no
        // "never"; a far date says it.
        let far = chrono::TimeDelta::days(365 * 100);
        let d = i64::try_from(t)
            .ok()
            .filter(|&t| t > 0)
            .and_then(chrono::TimeDelta::try_seconds)
            .unwrap_or(far);
        base.checked_add_signed(d)
            .or_else(|| base.checked_add_signed(far))
            .unwrap_or(base)
    }

    fn state_name(state: SandboxState) -> &'static str {
        match state {
            SandboxState::Paused | SandboxState::Hibernated => "paused",
            _ => "running",
        }
    }

    /// The create/connect response (`Sandbox`) with the envd access token
    /// issued to its caller.
    pub(crate) fn sandbox_json(&self, rec: &SandboxRecord, envd_token: &str) -> Value {
        json!({
            "templateID": rec.template.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            "sandboxID": rec.id.to_string(),
            "clientID": self.cfg.client_id,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": envd_token,
            "trafficAccessToken": crate::ports::traffic_token(&self.cfg.token_secret, rec.id.as_str()),
            "domain": self.cfg.domain,
        })
    }

    /// `ListedSandbox` (and the common part of `SandboxDetail`).
    fn listed_json(&self, rec: &SandboxRecord) -> Value {
        json!({
            "templateID": rec.template.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            "sandboxID": rec.id.to_string(),
            "clientID": self.cfg.client_id,
            "startedAt": rfc3339(rec.created_at),
            "endAt": rfc3339(self.end_at(rec)),
            "cpuCount": rec.size.vcpus,
            "memoryMB": rec.size.memory_mib,
            "diskSizeMB": u64::from(rec.size.disk_gib) * 1024,
            "state": Self::state_name(rec.state),
            "envdVersion": ENVD_VERSION,
            "metadata": rec.labels,
        })
    }

    /// `SandboxDetail`. The envd access token only for callers who may
    /// write (it lets its holder run commands): the one issued to the
    /// caller's credential (older SDKs' connect reads it here).
    async fn detail_json(&self, rec: &SandboxRecord, caller: &Caller) -> E2bResult<Value> {
        let mut v = self.listed_json(rec);
        if may_write(caller) {
            v["envdAccessToken"] = json!(self.issue(&rec.id, caller).await?);
        }
        let policy = self.svc.lifecycle_policy(caller, &rec.id).await?;
        v["lifecycle"] = lifecycle::to_json(policy);
        v["domain"] = json!(self.cfg.domain);
        Ok(v)
    }

    /// Issues sandbox `id`'s envd access token to `caller`
    /// ([`E2b::issue_envd_token`]).
    pub(crate) async fn issue(&self, id: &SandboxId, caller: &Caller) -> E2bResult<String> {
        self.issue_envd_token(id, caller)
            .await
            .map_err(|e| E2bError::new(500, format!("issuing the envd access token: {e}")))
    }

    /// The record of one of the caller's sandboxes: another tenant's
    /// sandbox answers exactly like an unknown id.
    async fn record(&self, caller: &Caller, id: &str) -> E2bResult<SandboxRecord> {
        let sid = parse_sandbox_id(id)?;
        self.svc
            .get_sandbox(caller, &sid)
            .await
            .map_err(sandbox_err(id))
    }

    /// A template the caller may use (its tenant's or the platform's) by
    /// id; `None` (the default template) for anything else, another
    /// tenant's included.
    async fn resolve_template(&self, caller: &Caller, asked: &str) -> Option<TemplateId> {
        let id: TemplateId = asked.parse().ok()?;
        self.svc
            .get_template(caller, &id)
            .await
            .ok()
            .map(|t| t.record.id)
    }

    /// A template the caller may use by *name* ([`template_name`] maps
    /// E2B's aliases): the newest ready one of that name, the caller's own
    /// before the platform's; `None` (the default template) when there is
    /// none, for `base`, and for an empty name.
    async fn template_by_name(&self, caller: &Caller, asked: &str) -> Option<TemplateId> {
        let name = template_name(asked)?;
        let all = self.svc.list_templates(caller).await.ok()?;
        pick_by_name(all.iter().map(|t| &t.record), name, caller.owner())
    }
}

/// The template name an E2B `templateID` asks for: E2B's code-interpreter
/// aliases name strata's `code-interpreter` template; `base` (and an empty
/// id) name none, i.e. the default template.
fn template_name(asked: &str) -> Option<&str> {
    match asked {
        "" | "base" => None,
        "code-interpreter-v1" | "code-interpreter" => Some("code-interpreter"),
        other => Some(other),
    }
}

/// Of `templates`, the newest ready one named `name`, one owned by `owner`
/// before the platform's (a tenant's own template shadows the platform's
/// of the same name).
fn pick_by_name<'a>(
    templates: impl Iterator<Item = &'a TemplateRecord>,
    name: &str,
    owner: &str,
) -> Option<TemplateId> {
    templates
        .filter(|t| t.status == TemplateStatus::Ready && t.name.as_deref() == Some(name))
        .max_by(|a, b| {
            (a.tenant == owner, a.created_at, &a.id).cmp(&(b.tenant == owner, b.created_at, &b.id))
        })
        .map(|t| t.id.clone())
}

/// The `:id` of a control-plane path as the router decoded it; one that does
/// not decode (invalid UTF-8 in `%FF%FE…`) is a `400` in E2B's error shape.
pub struct SandboxPath(pub String);

#[axum::async_trait]
impl<S: Send + Sync> FromRequestParts<S> for SandboxPath {
    type Rejection = E2bError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, E2bError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(s)| SandboxPath(s))
            .map_err(|e| E2bError::new(400, format!("path: {}", e.body_text())))
    }
}

/// `POST /sandboxes`, `POST /v2/sandboxes` → 201 `Sandbox`.
pub async fn create(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: NewSandbox = parse_body(&body)?;
    let template = st.resolve_template(&caller, &req.template_id).await;
    let timeout = check_timeout(req.timeout.unwrap_or(st.cfg.default_timeout_s))?.max(1);
    let policy = lifecycle::asked(req.auto_pause, req.auto_pause_memory, req.auto_resume)?;
    let egress = network::asked(req.allow_internet_access, req.network.as_ref())?;
    let ports = match &req.network {
        Some(n) => n.port_settings()?,
        None => crate::public::PortSettings::default(),
    };
    let mut cmd = CreateSandbox {
        template,
        wait: false,
        spec: SandboxSpec {
            labels: req.metadata.unwrap_or_default(),
            idle_timeout: Some(format!("{timeout}s")),
            lifecycle: policy,
            ..SandboxSpec::default()
        },
    };
    // A template of that id wins; else a snapshot of that id or name; else
    // a template of that name (or alias); else the default template.
    let snap = match cmd.template {
        Some(_) => None,
        None => st.resolve_snapshot(&caller, &req.template_id).await?,
    };
    if cmd.template.is_none() && snap.is_none() {
        cmd.template = st.template_by_name(&caller, &req.template_id).await;
    }
    let rec = match snap {
        Some(snap) => st
            .svc
            .fork_snapshot(&caller, &snap.id, cmd.spec, &gate_opts())
            .await
            .map_err(|e| match e {
                ServiceError::NotFound { .. } => {
                    E2bError::new(404, format!("snapshot {} not found", req.template_id))
                }
                e => e.into(),
            })?,
        None => st.svc.create(&caller, cmd, &gate_opts()).await?,
    };
    // Without a stored token no envd call could reach it: a sandbox whose
    // token cannot be stored is not left behind.
    let token = match st.issue(&rec.id, &caller).await {
        Ok(t) => t,
        Err(err) => {
            let _ = st.svc.delete(&caller, &rec.id, &gate_opts()).await;
            return Err(err);
        }
    };
    st.keep_envs(&caller, &rec.id, req.env_vars.unwrap_or_default())
        .await;
    if let Some(e) = &egress {
        // Before the sandbox is handed out: its first request already meets
        // the layer. A layer that cannot be written leaves no half-made
        // sandbox behind.
        if let Err(err) = st.put_egress(&caller, &rec.id, &rec.tenant, e).await {
            let _ = st.svc.delete(&caller, &rec.id, &gate_opts()).await;
            return Err(err);
        }
    }
    // Likewise: a sandbox asked to be private is never served public.
    if let Err(err) = st.keep_port_settings(&caller, &rec.id, ports).await {
        let _ = st.svc.delete(&caller, &rec.id, &gate_opts()).await;
        return Err(err);
    }
    Ok((StatusCode::CREATED, Json(st.sandbox_json(&rec, &token))).into_response())
}

/// `GET /sandboxes/{id}` → `SandboxDetail`.
pub async fn get(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
) -> E2bResult<Response> {
    let rec = st.record(&caller, &id).await?;
    if rec.state == SandboxState::Failed {
        return Err(E2bError::new(
            404,
            format!(
                "sandbox {id} failed: {}",
                rec.state_reason.unwrap_or_default()
            ),
        ));
    }
    Ok(Json(st.detail_json(&rec, &caller).await?).into_response())
}

/// `DELETE /sandboxes/{id}` → 204 (404 unknown).
pub async fn kill(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
) -> E2bResult<StatusCode> {
    let sid = parse_sandbox_id(&id)?;
    // The door's memory of it goes with the delete (`E2b::forget_sandbox`).
    st.svc
        .delete(&caller, &sid, &gate_opts())
        .await
        .map_err(sandbox_err(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/timeout` → 204 (400 over a year).
pub async fn set_timeout(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<StatusCode> {
    let req: TimeoutBody = parse_body(&body)?;
    let rec = st.record(&caller, &id).await?;
    let t = req
        .timeout
        .ok_or_else(|| E2bError::new(400, "timeout is required"))?;
    st.svc
        .set_idle_timeout(&caller, &rec.id, check_timeout(t)?)
        .await
        .map_err(sandbox_err(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes` → 204 (counts as activity).
pub async fn refresh(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
) -> E2bResult<StatusCode> {
    let sid = parse_sandbox_id(&id)?;
    st.svc
        .refresh(&caller, &sid)
        .await
        .map_err(sandbox_err(&id))?;
    Ok(StatusCode::NO_CONTENT)
}

/// `SandboxPauseRequest`: `memory: false` is `pause(keep_memory=False)`.
#[derive(Debug, Deserialize)]
#[serde(default)]
struct PauseBody {
    memory: bool,
}

impl Default for PauseBody {
    fn default() -> Self {
        PauseBody { memory: true }
    }
}

/// `POST /sandboxes/{id}/pause` → 204 (409 if paused): hibernate with
/// memory, or of the disk alone with `{"memory": false}` (the resume
/// cold-boots it: same id and envd token, a new boot).
pub async fn pause(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<StatusCode> {
    let req: PauseBody = parse_body(&body)?;
    let rec = st.record(&caller, &id).await?;
    if rec.state == SandboxState::Hibernated {
        return Err(E2bError::new(
            409,
            format!("sandbox {id} is already paused"),
        ));
    }
    st.svc
        .hibernate_with(&caller, &rec.id, &gate_opts(), req.memory)
        .await
        .map_err(sandbox_err(&id))?;
    if req.memory {
        st.procs.detach_sandbox(&rec.id);
    } else {
        // No memory kept: its processes end with the VM.
        st.procs.forget_sandbox(&rec.id);
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn wake(
    st: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &Bytes,
) -> E2bResult<(bool, SandboxRecord, String)> {
    let req: TimeoutBody = parse_body(body)?;
    let timeout = req.timeout.map(check_timeout).transpose()?;
    let rec = st.record(caller, id).await?;
    let resumed = matches!(rec.state, SandboxState::Hibernated | SandboxState::Paused);
    let rec = if resumed {
        st.svc
            .resume(caller, &rec.id, &gate_opts())
            .await
            .map_err(sandbox_err(id))?
    } else if rec.state == SandboxState::Failed {
        return Err(E2bError::new(
            404,
            format!(
                "sandbox {id} failed: {}",
                rec.state_reason.unwrap_or_default()
            ),
        ));
    } else {
        rec
    };
    // A running sandbox's timeout is only ever extended by connect: a
    // shorter one than what is left changes nothing (E2B's semantics).
    let extends = |t: u64| {
        resumed
            || i64::try_from(t)
                .ok()
                .and_then(chrono::TimeDelta::try_seconds)
                .and_then(|d| Utc::now().checked_add_signed(d))
                .is_none_or(|end| end > st.end_at(&rec))
    };
    let rec = match timeout {
        Some(t) if extends(t) => st
            .svc
            .set_idle_timeout(caller, &rec.id, t)
            .await
            .map_err(sandbox_err(id))?,
        Some(_) => rec,
        None => {
            st.svc
                .refresh(caller, &rec.id)
                .await
                .map_err(sandbox_err(id))?;
            rec
        }
    };
    let token = st.issue(&rec.id, caller).await?;
    Ok((resumed, rec, token))
}

/// `POST /sandboxes/{id}/connect`, `/v2/…/connect` → 200 running, 201 resumed.
pub async fn connect(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let (resumed, rec, token) = wake(&st, &caller, &id, &body).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(st.sandbox_json(&rec, &token))).into_response())
}

/// `POST /sandboxes/{id}/resume` (deprecated) → 201, 409 when not paused.
pub async fn resume(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let rec = st.record(&caller, &id).await?;
    if !matches!(rec.state, SandboxState::Hibernated | SandboxState::Paused) {
        return Err(E2bError::new(409, format!("sandbox {id} is not paused")));
    }
    let (_, rec, token) = wake(&st, &caller, &id, &body).await?;
    Ok((StatusCode::CREATED, Json(st.sandbox_json(&rec, &token))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpl(
        id: &str,
        tenant: &str,
        name: &str,
        status: TemplateStatus,
        secs: i64,
    ) -> TemplateRecord {
        let at = DateTime::from_timestamp(1_700_000_000 + secs, 0).expect("time");
        TemplateRecord {
            id: id.parse().expect("id"),
            tenant: tenant.to_owned(),
            name: Some(name.to_owned()),
            size: Default::default(),
            status,
            status_reason: None,
            accel: None,
            created_at: at,
            updated_at: at,
            variant_of: None,
        }
    }

    #[test]
    fn template_names_and_aliases() {
        assert_eq!(
            template_name("code-interpreter-v1"),
            Some("code-interpreter")
        );
        assert_eq!(template_name("code-interpreter"), Some("code-interpreter"));
        assert_eq!(template_name("base"), None);
        assert_eq!(template_name(""), None);
        assert_eq!(template_name("my-env"), Some("my-env"));
    }

    #[test]
    fn a_name_picks_the_newest_ready_template_the_callers_first() {
        use TemplateStatus::*;
        let all = [
            tpl("tpl-old", "@platform", "code-interpreter", Ready, 1),
            tpl("tpl-new", "@platform", "code-interpreter", Ready, 2),
            tpl("tpl-building", "@platform", "code-interpreter", Building, 3),
            tpl("tpl-failed", "@platform", "code-interpreter", Failed, 4),
            tpl("tpl-other", "@platform", "web", Ready, 5),
        ];
        let pick = |n: &str, owner: &str| pick_by_name(all.iter(), n, owner);
        assert_eq!(
            pick("code-interpreter", "acme").map(|t| t.to_string()),
            Some("tpl-new".into())
        );
        assert_eq!(
            pick("web", "acme").map(|t| t.to_string()),
            Some("tpl-other".into())
        );
        assert_eq!(pick("nope", "acme"), None);
        // The caller's own template of that name shadows the platform's,
        // even an older one.
        let mut mine = all.to_vec();
        mine.push(tpl("tpl-mine", "acme", "code-interpreter", Ready, 0));
        assert_eq!(
            pick_by_name(mine.iter(), "code-interpreter", "acme").map(|t| t.to_string()),
            Some("tpl-mine".into())
        );
        assert_eq!(
            pick_by_name(mine.iter(), "code-interpreter", "other").map(|t| t.to_string()),
            Some("tpl-new".into())
        );
    }

    #[test]
    fn error_shape() {
        let r = E2bError::new(401, "invalid API key").into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
}
