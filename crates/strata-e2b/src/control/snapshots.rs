//! E2B snapshots over strata's own: `POST /sandboxes/{id}/snapshots` takes
//! a manual snapshot (its `name` is the strata snapshot's label, so `strata
//! snapshots` shows both), `GET /snapshots` lists the tenant's ready
//! snapshots, `DELETE /templates/{snapshotID}` deletes one (the SDK's
//! `delete_snapshot` uses the templates route), and `Sandbox.create(<id or
//! name>)` forks one ([`E2b::resolve_snapshot`]).

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};
use strata_core::{SandboxId, SnapshotId};
use stratad::caller::Caller;
use stratad::service::{ServiceError, TakeSnapshot};
use stratad::store::{SnapshotKind, SnapshotRecord, SnapshotStatus};

use super::{parse_body, sandbox_err, JsonBody, SandboxPath};
use crate::error::{E2bError, E2bResult};
use crate::policy::gate_opts;
use crate::E2b;

/// `SandboxSnapshotRequest`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SnapshotBody {
    name: Option<String>,
}

/// `SnapshotInfo`: the id and the names it answers to (its label).
fn snapshot_json(r: &SnapshotRecord) -> Value {
    json!({
        "snapshotID": r.id.to_string(),
        "names": r.label.iter().collect::<Vec<_>>(),
    })
}

impl E2b {
    /// The ready snapshot a create's `templateID` names, when it names one
    /// of the caller's: by id, else by name (label; the newest of that
    /// name). `None` for anything else.
    pub(crate) async fn resolve_snapshot(
        &self,
        caller: &Caller,
        asked: &str,
    ) -> E2bResult<Option<SnapshotRecord>> {
        if asked.is_empty() {
            return Ok(None);
        }
        if let Ok(id) = asked.parse::<SnapshotId>() {
            if let Ok(r) = self.svc.get_snapshot(caller, &id).await {
                if r.status == SnapshotStatus::Ready {
                    return Ok(Some(r));
                }
            }
        }
        let all = self.svc.tenant_snapshots(caller).await?;
        Ok(all
            .into_iter()
            .rev()
            .find(|r| r.label.as_deref() == Some(asked)))
    }
}

/// `POST /sandboxes/{id}/snapshots` → 201 `SnapshotInfo` (404 unknown
/// sandbox, 400 a name over 255 bytes or with NUL). A paused sandbox is
/// woken first, as for any strata snapshot.
pub async fn create_snapshot(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<Response> {
    let req: SnapshotBody = parse_body(&body)?;
    let sid: SandboxId = super::parse_sandbox_id(&id)?;
    let label = req.name.filter(|n| !n.is_empty());
    let rec = st
        .svc
        .take_snapshot(&caller, &sid, TakeSnapshot { label }, &gate_opts())
        .await
        .map_err(sandbox_err(&id))?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&rec))).into_response())
}

/// Query of `GET /snapshots`.
#[derive(Debug, Default, PartialEq, Eq)]
struct SnapshotQuery {
    sandbox: Option<String>,
    name: Option<String>,
    limit: usize,
    next_token: Option<String>,
}

fn parse_snapshot_query(raw: Option<&str>) -> E2bResult<SnapshotQuery> {
    let mut q = SnapshotQuery {
        limit: 100,
        ..SnapshotQuery::default()
    };
    for (k, v) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        let v = Some(v.into_owned()).filter(|s| !s.is_empty());
        match k.as_ref() {
            "sandboxID" => q.sandbox = v,
            "name" => q.name = v,
            "limit" => {
                if let Some(v) = v {
                    q.limit = v
                        .parse::<usize>()
                        .map_err(|_| E2bError::new(400, format!("invalid limit {v:?}")))?
                        .clamp(1, 1000)
                }
            }
            "nextToken" => q.next_token = v,
            _ => {}
        }
    }
    Ok(q)
}

/// The page of `items` after the snapshot `cursor` names (`None`: from the
/// start), at most `limit` long, and the cursor of the next page.
fn page(
    items: Vec<SnapshotRecord>,
    cursor: Option<&str>,
    limit: usize,
) -> E2bResult<(Vec<SnapshotRecord>, Option<String>)> {
    let start = match cursor {
        None => 0,
        Some(c) => {
            items
                .iter()
                .position(|r| r.id.as_str() == c)
                .ok_or_else(|| E2bError::new(400, format!("invalid nextToken {c:?}")))?
                + 1
        }
    };
    let rest: Vec<SnapshotRecord> = items.into_iter().skip(start).collect();
    let next = (rest.len() > limit).then(|| rest[limit - 1].id.to_string());
    Ok((rest.into_iter().take(limit).collect(), next))
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=` (`name`: a name or
/// an id) → 200 `[SnapshotInfo]`, oldest first, `x-next-token` when more follow. Lists
/// the snapshots users took (strata's automatic ones — interval, fork,
/// hibernation points — are not E2B snapshots).
pub async fn list_snapshots(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = parse_snapshot_query(raw.as_deref())?;
    let mut all = st.svc.tenant_snapshots(&caller).await?;
    all.retain(|r| {
        r.kind == SnapshotKind::Manual
            && q.sandbox
                .as_deref()
                .is_none_or(|s| r.sandbox_id.as_str() == s)
            && q.name
                .as_deref()
                .is_none_or(|n| r.label.as_deref() == Some(n) || r.id.as_str() == n)
    });
    let (items, next) = page(all, q.next_token.as_deref(), q.limit)?;
    let mut headers = HeaderMap::new();
    if let Some(c) = next.and_then(|c| HeaderValue::from_str(&c).ok()) {
        headers.insert("x-next-token", c);
    }
    let body: Vec<Value> = items.iter().map(snapshot_json).collect();
    Ok((StatusCode::OK, headers, Json(body)).into_response())
}

/// `DELETE /templates/{id}` for a snapshot id or name → 204, 404 when it
/// names none of the caller's snapshots (the SDK answers `False`).
/// Templates are not deleted through this door.
pub async fn delete_snapshot(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
) -> E2bResult<StatusCode> {
    let not_found = || E2bError::new(404, format!("snapshot {id} not found"));
    let snap = st
        .resolve_snapshot(&caller, &id)
        .await?
        .ok_or_else(not_found)?;
    match st
        .svc
        .delete_snapshot(&caller, &snap.id, &gate_opts())
        .await
    {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(ServiceError::NotFound { .. }) => Err(not_found()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_query_as_the_sdk_sends_it() {
        let q = parse_snapshot_query(Some("sandboxID=sbx-a&name=n%201&limit=2&nextToken=snap-x"))
            .unwrap();
        assert_eq!(q.sandbox.as_deref(), Some("sbx-a"));
        assert_eq!(q.name.as_deref(), Some("n 1"));
        assert_eq!(q.limit, 2);
        assert_eq!(q.next_token.as_deref(), Some("snap-x"));
        assert!(parse_snapshot_query(Some("limit=x")).is_err());
    }
}
