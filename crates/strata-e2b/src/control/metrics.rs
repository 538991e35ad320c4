//! E2B sandbox metrics over the daemon's sampler (`stratad::service::sampler`):
//! `GET /sandboxes/{id}/metrics?start=&end=` (Unix seconds, both optional)
//! answers the sandbox's `SandboxMetric` series, oldest first;
//! `GET /sandboxes/metrics?sandbox_ids=a,b` answers `SandboxesWithMetrics`,
//! the latest metric of each listed sandbox the caller may see (ids it may
//! not see, or without a sample yet, are left out).
//!
//! Field mapping: `cpuUsedPct` = CPU over the last interval in percent of
//! the sandbox's vCPUs, `memUsed` = guest RAM resident on the host (pages
//! the guest touched), `memCache` = 0 (the host cannot tell the guest's page
//! cache apart), `diskUsed` = bytes allocated to the root disk in the pool.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::{Extension, Json};
use serde_json::{json, Map, Value};
use strata_core::SandboxId;
use stratad::caller::Caller;
use stratad::service::Sample;

use super::{rfc3339, sandbox_err, SandboxPath};
use crate::error::{E2bError, E2bResult};
use crate::E2b;

/// Most ids one `GET /sandboxes/metrics` may list.
pub const MAX_IDS: usize = 100;

/// One `SandboxMetric`.
fn metric_json(s: &Sample) -> Value {
    json!({
        "timestamp": rfc3339(s.at),
        "timestampUnix": s.at.timestamp(),
        "cpuCount": s.cpu_count,
        "cpuUsedPct": s.cpu_pct,
        "memUsed": s.mem_used_bytes,
        "memTotal": s.mem_total_bytes,
        "memCache": 0,
        "diskUsed": s.disk_used_bytes,
        "diskTotal": s.disk_total_bytes,
    })
}

fn unix_param(k: &str, v: &str) -> E2bResult<chrono::DateTime<chrono::Utc>> {
    v.parse::<i64>()
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
        .ok_or_else(|| E2bError::new(400, format!("{k}: expected Unix seconds, got {v:?}")))
}

/// `GET /sandboxes/{id}/metrics` → `[SandboxMetric]` (404 unknown sandbox,
/// 400 a bad `start`/`end` or `start` after `end`).
pub async fn sandbox_metrics(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    RawQuery(q): RawQuery,
) -> E2bResult<Json<Value>> {
    let (mut start, mut end) = (None, None);
    for (k, v) in form_urlencoded::parse(q.as_deref().unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "start" if !v.is_empty() => start = Some(unix_param("start", &v)?),
            "end" if !v.is_empty() => end = Some(unix_param("end", &v)?),
            _ => {}
        }
    }
    let sid: SandboxId = super::parse_sandbox_id(&id)?;
    let m = st
        .svc
        .sandbox_metrics(&caller, &sid, start, end)
        .await
        .map_err(sandbox_err(&id))?;
    Ok(Json(Value::Array(
        m.samples.iter().map(metric_json).collect(),
    )))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b` → `{"sandboxes": {id: SandboxMetric}}`
/// (400 without ids or with more than [`MAX_IDS`]).
pub async fn list_metrics(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    RawQuery(q): RawQuery,
) -> E2bResult<Json<Value>> {
    let mut ids: Vec<String> = Vec::new();
    for (k, v) in form_urlencoded::parse(q.as_deref().unwrap_or("").as_bytes()) {
        if k == "sandbox_ids" {
            for id in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                if ids.len() >= MAX_IDS {
                    return Err(E2bError::new(
                        400,
                        format!("sandbox_ids: at most {MAX_IDS} ids"),
                    ));
                }
                if !ids.iter().any(|i| i == id) {
                    ids.push(id.to_owned());
                }
            }
        }
    }
    if ids.is_empty() {
        return Err(E2bError::new(400, "sandbox_ids: at least one id"));
    }
    let mut out = Map::new();
    for id in ids {
        let Ok(sid) = id.parse::<SandboxId>() else {
            continue;
        };
        if st.svc.get_sandbox(&caller, &sid).await.is_err() {
            continue;
        }
        if let Some(s) = st.svc.sampler().latest(&sid) {
            out.insert(id, metric_json(&s));
        }
    }
    Ok(Json(json!({ "sandboxes": out })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_has_the_sdk_fields() {
        let s = Sample {
            at: chrono::DateTime::from_timestamp(1_796_119_200, 0).unwrap(),
            cpu_pct: 12.5,
            cpu_count: 2,
            mem_used_bytes: 1,
            mem_total_bytes: 2,
            host_rss_bytes: 3,
            disk_used_bytes: 4,
            disk_total_bytes: 5,
            running: true,
        };
        let v = metric_json(&s);
        for k in [
            "timestamp",
            "timestampUnix",
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ] {
            assert!(!v[k].is_null(), "{k}");
        }
        assert_eq!(v["timestamp"], "2026-12-01T10:00:00.000Z");
        assert_eq!(v["timestampUnix"], 1_796_119_200);
        assert!(unix_param("start", "x").is_err());
    }
}
