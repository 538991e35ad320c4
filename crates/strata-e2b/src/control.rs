//! The E2B control plane (`E2B_API_URL`) over strata's service.
//!
//! Mapping:
//! - `templateID`: a strata template id when one exists by that id;
//!   anything else (`base`, aliases strata does not know) → the default
//!   template (the newest ready one).
//! - `metadata` ↔ strata labels (so `strata ls --label` sees them).
//! - `timeout` → the sandbox's idle timeout: after `timeout` seconds
//!   without activity strata *hibernates* it (memory kept), whether or not
//!   `autoPause` was asked; it is never deleted behind the user's back.
//!   `endAt` = last activity + idle timeout.
//! - `pause` → hibernate (snapshot with memory, VM process ends);
//!   `connect` on a hibernated or paused sandbox wakes it (201).
//! - states: creating/running → `running`; paused/hibernated → `paused`;
//!   failed sandboxes are not listed.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxState, TemplateId};
use strata_policy::CallKind;
use stratad::security::{current_tenant, template_visible};
use stratad::service::{CreateSandbox, SandboxSpec, ServiceError};
use stratad::store::{SandboxFilter, SandboxRecord};

use crate::policy::{Caller, Refusal};
use crate::{E2b, ENVD_VERSION};

/// An error in E2B's shape: `{"code": <http status>, "message": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bError {
    /// HTTP status (also the `code` field).
    pub status: u16,
    /// Message.
    pub message: String,
}

impl E2bError {
    /// An error with this status and message.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
        }
    }
}

impl From<Refusal> for E2bError {
    fn from(r: Refusal) -> Self {
        E2bError::new(r.http_status(), r.message())
    }
}

impl From<ServiceError> for E2bError {
    fn from(e: ServiceError) -> Self {
        E2bError::new(e.code().http_status(), e.message())
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            Json(json!({ "code": self.status, "message": self.message })),
        )
            .into_response()
    }
}

type E2bResult<T> = Result<T, E2bError>;

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn parse_sandbox_id(s: &str) -> E2bResult<SandboxId> {
    s.parse()
        .map_err(|_| E2bError::new(404, format!("sandbox {s} not found")))
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
        if t == 0 {
            // Never hibernated: E2B has no "never"; a far date says it.
            base + chrono::TimeDelta::days(365 * 100)
        } else {
            base + chrono::TimeDelta::seconds(i64::try_from(t).unwrap_or(i64::MAX / 2))
        }
    }

    fn state_name(state: SandboxState) -> &'static str {
        match state {
            SandboxState::Paused | SandboxState::Hibernated => "paused",
            _ => "running",
        }
    }

    /// The create/connect response (`Sandbox`).
    fn sandbox_json(&self, rec: &SandboxRecord) -> Value {
        json!({
            "templateID": rec.template.as_ref().map(|t| t.to_string()).unwrap_or_default(),
            "sandboxID": rec.id.to_string(),
            "clientID": self.cfg.client_id,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.envd_token(rec.id.as_str()),
            "domain": Value::Null,
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
    /// write (it lets its holder run commands).
    fn detail_json(&self, rec: &SandboxRecord, caller: &Caller) -> Value {
        let mut v = self.listed_json(rec);
        if caller.may_write() {
            self.remember_envd_caller(&rec.id, caller);
            v["envdAccessToken"] = json!(self.envd_token(rec.id.as_str()));
        }
        v["domain"] = Value::Null;
        v
    }

    /// The record of a sandbox of the current tenant: another tenant's
    /// sandbox answers exactly like an unknown id.
    async fn record(&self, id: &str) -> E2bResult<SandboxRecord> {
        let id = parse_sandbox_id(id)?;
        match self.svc.get_sandbox(&id).await {
            Ok(r) if r.tenant != current_tenant() => {
                Err(E2bError::new(404, format!("sandbox {id} not found")))
            }
            Ok(r) => Ok(r),
            Err(ServiceError::NotFound { .. }) => {
                Err(E2bError::new(404, format!("sandbox {id} not found")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Sets a sandbox's idle timeout (E2B `timeout`) and counts as activity.
    ///
    /// The service has no command for this yet: the record is updated
    /// through the store, outside the sandbox's operation lock (an
    /// operation finishing at the same moment may write its older copy back).
    async fn apply_timeout(&self, id: &SandboxId, timeout_s: u64) -> E2bResult<()> {
        let id2 = id.clone();
        let rec = self
            .svc
            .db(move |s| {
                let Some(mut r) = s.get_sandbox(&id2)? else {
                    return Ok(None);
                };
                r.idle_timeout_s = Some(timeout_s.max(1));
                r.last_activity_at = Utc::now();
                s.update_sandbox(&r, None)?;
                Ok(Some(r))
            })
            .await?;
        let Some(rec) = rec.filter(|r| r.state != SandboxState::Deleted) else {
            return Err(E2bError::new(404, format!("sandbox {id} not found")));
        };
        self.svc.reschedule(&rec);
        self.svc.touch(id);
        Ok(())
    }

    /// A template of this tenant or the platform's by id; `None` (the
    /// default template) for anything else, another tenant's included.
    async fn resolve_template(&self, asked: &str) -> Option<TemplateId> {
        let id: TemplateId = asked.parse().ok()?;
        self.svc
            .get_template(&id)
            .await
            .ok()
            .filter(|t| template_visible(&t.record.tenant))
            .map(|t| t.record.id)
    }

    /// The policy gate of a lifecycle operation.
    async fn lifecycle(&self, c: &Caller, sandbox: Option<&SandboxId>, op: &str) -> E2bResult<()> {
        let kind = CallKind::Lifecycle { op: op.to_owned() };
        Ok(self.gate(&c.tenant, sandbox, &c.actor, kind).await?)
    }
}

/// `POST /sandboxes`, `POST /v2/sandboxes` → 201 `Sandbox`.
pub async fn create(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> E2bResult<Response> {
    let req: NewSandbox = parse_body(&body)?;
    st.lifecycle(&caller, None, "create").await?;
    let template = st.resolve_template(&req.template_id).await;
    let timeout = req.timeout.unwrap_or(st.cfg.default_timeout_s).max(1);
    if req.auto_pause == Some(false) {
        tracing::debug!("autoPause=false: strata hibernates on timeout anyway, it never deletes");
    }
    let cmd = CreateSandbox {
        template,
        spec: SandboxSpec {
            labels: req.metadata.unwrap_or_default(),
            idle_timeout: Some(format!("{timeout}s")),
            ..SandboxSpec::default()
        },
    };
    let rec = st.svc.create(cmd).await?;
    st.remember_envd_caller(&rec.id, &caller);
    if let Some(envs) = req.env_vars.filter(|e| !e.is_empty()) {
        st.envs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.id.clone(), envs);
    }
    Ok((StatusCode::CREATED, Json(st.sandbox_json(&rec))).into_response())
}

/// `GET /sandboxes/{id}` → `SandboxDetail`.
pub async fn get(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> E2bResult<Response> {
    let rec = st.record(&id).await?;
    if rec.state == SandboxState::Failed {
        return Err(E2bError::new(
            404,
            format!(
                "sandbox {id} failed: {}",
                rec.state_reason.unwrap_or_default()
            ),
        ));
    }
    Ok(Json(st.detail_json(&rec, &caller)).into_response())
}

/// `DELETE /sandboxes/{id}` → 204 (404 unknown).
pub async fn kill(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let rec = st.record(&id).await?;
    st.lifecycle(&caller, Some(&rec.id), "delete").await?;
    st.svc.delete(&rec.id).await?;
    st.procs.forget_sandbox(&rec.id);
    st.watchers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|_, w| w.sandbox != rec.id);
    st.envs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&rec.id);
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/timeout` → 204.
pub async fn set_timeout(
    State(st): State<Arc<E2b>>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<StatusCode> {
    let req: TimeoutBody = parse_body(&body)?;
    let rec = st.record(&id).await?;
    let t = req
        .timeout
        .ok_or_else(|| E2bError::new(400, "timeout is required"))?;
    st.apply_timeout(&rec.id, t).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes` → 204 (counts as activity).
pub async fn refresh(State(st): State<Arc<E2b>>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    let rec = st.record(&id).await?;
    st.svc.touch(&rec.id);
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/pause` → 204: hibernate with memory (409 if paused).
pub async fn pause(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let rec = st.record(&id).await?;
    if rec.state == SandboxState::Hibernated {
        return Err(E2bError::new(
            409,
            format!("sandbox {id} is already paused"),
        ));
    }
    st.lifecycle(&caller, Some(&rec.id), "hibernate").await?;
    st.svc.hibernate(&rec.id).await?;
    st.procs.detach_sandbox(&rec.id);
    Ok(StatusCode::NO_CONTENT)
}

async fn wake(
    st: &Arc<E2b>,
    caller: &Caller,
    id: &str,
    body: &Bytes,
) -> E2bResult<(bool, SandboxRecord)> {
    let req: TimeoutBody = parse_body(body)?;
    let rec = st.record(id).await?;
    let resumed = matches!(rec.state, SandboxState::Hibernated | SandboxState::Paused);
    let rec = if resumed {
        st.lifecycle(caller, Some(&rec.id), "resume").await?;
        st.svc.resume(&rec.id).await?
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
    if let Some(t) = req.timeout {
        st.apply_timeout(&rec.id, t).await?;
    } else {
        st.svc.touch(&rec.id);
    }
    st.remember_envd_caller(&rec.id, caller);
    Ok((resumed, rec))
}

/// `POST /sandboxes/{id}/connect`, `/v2/…/connect` → 200 running, 201 resumed.
pub async fn connect(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<Response> {
    let (resumed, rec) = wake(&st, &caller, &id, &body).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(st.sandbox_json(&rec))).into_response())
}

/// `POST /sandboxes/{id}/resume` (deprecated) → 201, 409 when not paused.
pub async fn resume(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> E2bResult<Response> {
    let rec = st.record(&id).await?;
    if !matches!(rec.state, SandboxState::Hibernated | SandboxState::Paused) {
        return Err(E2bError::new(409, format!("sandbox {id} is not paused")));
    }
    let (_, rec) = wake(&st, &caller, &id, &body).await?;
    Ok((StatusCode::CREATED, Json(st.sandbox_json(&rec))).into_response())
}

/// Query of the list endpoints.
#[derive(Debug, Default, PartialEq, Eq)]
struct ListQuery {
    metadata: BTreeMap<String, String>,
    states: Vec<SandboxState>,
    limit: usize,
    next_token: Option<String>,
}

fn percent_decode(s: &str) -> String {
    form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// Parses `metadata` (`k=v&k2=v2`, keys and values URL-quoted once more by
/// the SDK), `state` (comma-separated or repeated), `limit`, `nextToken`.
fn parse_list_query(raw: Option<&str>, default_states: &[&str]) -> E2bResult<ListQuery> {
    let mut q = ListQuery {
        limit: 100,
        ..ListQuery::default()
    };
    let mut states: Vec<String> = Vec::new();
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "metadata" => {
                for (mk, mv) in form_urlencoded::parse(v.as_bytes()) {
                    q.metadata.insert(percent_decode(&mk), percent_decode(&mv));
                }
            }
            "state" => states.extend(v.split(',').map(|s| s.trim().to_owned())),
            "limit" => {
                q.limit = v
                    .parse::<usize>()
                    .map_err(|_| E2bError::new(400, format!("invalid limit {v:?}")))?
                    .clamp(1, 1000)
            }
            "nextToken" => q.next_token = Some(v.into_owned()).filter(|s| !s.is_empty()),
            _ => {}
        }
    }
    if states.iter().all(|s| s.is_empty()) {
        states = default_states.iter().map(|s| (*s).to_owned()).collect();
    }
    for s in states.iter().filter(|s| !s.is_empty()) {
        match s.as_str() {
            "running" => q
                .states
                .extend([SandboxState::Creating, SandboxState::Running]),
            "paused" => q
                .states
                .extend([SandboxState::Paused, SandboxState::Hibernated]),
            other => return Err(E2bError::new(400, format!("invalid state {other:?}"))),
        }
    }
    Ok(q)
}

async fn list(st: Arc<E2b>, raw: Option<String>, default_states: &[&str]) -> E2bResult<Response> {
    let q = parse_list_query(raw.as_deref(), default_states)?;
    let page = st
        .svc
        .list_sandboxes(SandboxFilter {
            tenant: current_tenant(),
            states: q.states,
            labels: q.metadata,
            limit: q.limit,
            cursor: q.next_token,
        })
        .await?;
    let items: Vec<Value> = page.items.iter().map(|r| st.listed_json(r)).collect();
    let mut headers = HeaderMap::new();
    if let Some(c) = page.next_cursor {
        if let Ok(v) = HeaderValue::from_str(&c) {
            headers.insert("x-next-token", v);
        }
    }
    Ok((StatusCode::OK, headers, Json(items)).into_response())
}

/// `GET /v2/sandboxes` (running and paused by default).
pub async fn list_v2(State(st): State<Arc<E2b>>, RawQuery(raw): RawQuery) -> E2bResult<Response> {
    list(st, raw, &["running", "paused"]).await
}

/// `GET /sandboxes` (the v1 listing: running sandboxes).
pub async fn list_v1(State(st): State<Arc<E2b>>, RawQuery(raw): RawQuery) -> E2bResult<Response> {
    list(st, raw, &["running"]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query_as_the_sdk_sends_it() {
        // SDK: urlencode({quote(k): quote(v)}) then the query encoding.
        let raw =
            "metadata=suite%3De2b%26who%3Da%2520b&state=running%2Cpaused&limit=5&nextToken=abc";
        let q = parse_list_query(Some(raw), &["running"]).unwrap();
        assert_eq!(q.metadata["suite"], "e2b");
        assert_eq!(q.metadata["who"], "a b");
        assert_eq!(q.limit, 5);
        assert_eq!(q.next_token.as_deref(), Some("abc"));
        assert_eq!(
            q.states,
            [
                SandboxState::Creating,
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Hibernated
            ]
        );
    }

    #[test]
    fn list_query_defaults_and_errors() {
        let q = parse_list_query(None, &["running"]).unwrap();
        assert_eq!(q.states, [SandboxState::Creating, SandboxState::Running]);
        assert_eq!(q.limit, 100);
        assert!(parse_list_query(Some("state=gone"), &[]).is_err());
        assert!(parse_list_query(Some("limit=x"), &[]).is_err());
    }

    #[test]
    fn error_shape() {
        let r = E2bError::new(401, "invalid API key").into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
}
