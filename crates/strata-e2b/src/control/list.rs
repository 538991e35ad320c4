//! `GET /sandboxes` and `GET /v2/sandboxes`: the caller's sandboxes with
//! E2B's filters (`metadata`, `state`, `template`, `startedAfter`), `order`
//! (`desc`, newest first, by default; `asc`) and pagination (`limit`,
//! `nextToken` ↔ `x-next-token`).
//!
//! The store lists by (created_at, id) with label and state filters; the
//! door reads every matching sandbox (at most [`MAX_LISTED`]), applies the
//! other filters and the order, and pages itself: a `nextToken` is the
//! position (`<created_at ms>.<id>`) of the last item given, so a page never
//! repeats or skips a sandbox when others come or go meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde_json::Value;
use strata_core::SandboxState;
use stratad::caller::Caller;
use stratad::store::{SandboxFilter, SandboxRecord};

use crate::error::{E2bError, E2bResult};
use crate::E2b;

/// Most sandboxes one listing considers (a tenant's sandboxes are bounded
/// by its quota far below this).
pub const MAX_LISTED: usize = 10_000;

/// Query of the list endpoints.
#[derive(Debug, Default, PartialEq, Eq)]
struct ListQuery {
    metadata: BTreeMap<String, String>,
    states: Vec<SandboxState>,
    template: Option<String>,
    started_after: Option<DateTime<Utc>>,
    ascending: bool,
    limit: usize,
    next_token: Option<(i64, String)>,
}

fn percent_decode(s: &str) -> String {
    form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

fn bad(what: &str, v: &str) -> E2bError {
    E2bError::new(400, format!("invalid {what} {v:?}"))
}

/// Parses `metadata` (`k=v&k2=v2`, keys and values URL-quoted once more by
/// the SDK), `state` (comma-separated or repeated), `template`,
/// `startedAfter` (RFC 3339), `order`, `limit`, `nextToken`.
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
                    .map_err(|_| bad("limit", &v))?
                    .clamp(1, 1000)
            }
            "template" => q.template = Some(v.into_owned()).filter(|s| !s.is_empty()),
            "startedAfter" if !v.is_empty() => {
                q.started_after = Some(
                    DateTime::parse_from_rfc3339(&v)
                        .map_err(|_| bad("startedAfter", &v))?
                        .with_timezone(&Utc),
                )
            }
            "order" => match v.as_ref() {
                "asc" => q.ascending = true,
                "desc" | "" => q.ascending = false,
                o => return Err(bad("order", o)),
            },
            "nextToken" if !v.is_empty() => {
                let (t, id) = v.split_once('.').ok_or_else(|| bad("nextToken", &v))?;
                let t = t.parse::<i64>().map_err(|_| bad("nextToken", &v))?;
                q.next_token = Some((t, id.to_owned()));
            }
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

/// A sandbox's place in the listing order.
fn position(r: &SandboxRecord) -> (i64, String) {
    (r.created_at.timestamp_millis(), r.id.to_string())
}

/// The filters the store does not apply, the order, then one page: the
/// items and the `nextToken` of the next page.
fn select(mut all: Vec<SandboxRecord>, q: &ListQuery) -> (Vec<SandboxRecord>, Option<String>) {
    all.retain(|r| {
        q.template
            .as_deref()
            .is_none_or(|t| r.template.as_ref().is_some_and(|x| x.as_str() == t))
            && q.started_after
                .is_none_or(|a| r.created_at.timestamp_millis() >= a.timestamp_millis())
    });
    all.sort_by_key(position);
    if !q.ascending {
        all.reverse();
    }
    if let Some(c) = &q.next_token {
        all.retain(|r| {
            let p = position(r);
            if q.ascending {
                &p > c
            } else {
                &p < c
            }
        });
    }
    let next = (all.len() > q.limit).then(|| {
        let (t, id) = position(&all[q.limit - 1]);
        format!("{t}.{id}")
    });
    all.truncate(q.limit);
    (all, next)
}

async fn list(
    st: Arc<E2b>,
    caller: &Caller,
    raw: Option<String>,
    default_states: &[&str],
) -> E2bResult<Response> {
    let q = parse_list_query(raw.as_deref(), default_states)?;
    let mut all = Vec::new();
    let mut cursor = None;
    loop {
        let page = st
            .svc
            .list_sandboxes(
                caller,
                SandboxFilter {
                    // The service lists the caller's tenant whatever this says.
                    tenant: caller.owner().to_owned(),
                    states: q.states.clone(),
                    labels: q.metadata.clone(),
                    limit: 1000,
                    cursor,
                },
            )
            .await?;
        all.extend(page.items);
        cursor = page.next_cursor;
        if cursor.is_none() || all.len() >= MAX_LISTED {
            break;
        }
    }
    let (items, next) = select(all, &q);
    let items: Vec<Value> = items.iter().map(|r| st.listed_json(r)).collect();
    let mut headers = HeaderMap::new();
    if let Some(v) = next.and_then(|c| HeaderValue::from_str(&c).ok()) {
        headers.insert("x-next-token", v);
    }
    Ok((StatusCode::OK, headers, Json(items)).into_response())
}

/// `GET /v2/sandboxes` (running and paused by default).
pub async fn list_v2(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    list(st, &caller, raw, &["running", "paused"]).await
}

/// `GET /sandboxes` (the v1 listing: running sandboxes).
pub async fn list_v1(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    list(st, &caller, raw, &["running"]).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_query_as_the_sdk_sends_it() {
        // SDK: urlencode({quote(k): quote(v)}) then the query encoding.
        let raw = "metadata=suite%3De2b%26who%3Da%2520b&state=running%2Cpaused&limit=5\
                   &nextToken=17.sb-abc&order=asc&template=tpl-x\
                   &startedAfter=2026-12-01T12%3A00%3A00.5%2B00%3A00";
        let q = parse_list_query(Some(raw), &["running"]).unwrap();
        assert_eq!(q.metadata["suite"], "e2b");
        assert_eq!(q.metadata["who"], "a b");
        assert_eq!(q.limit, 5);
        assert_eq!(q.next_token, Some((17, "sb-abc".to_owned())));
        assert!(q.ascending);
        assert_eq!(q.template.as_deref(), Some("tpl-x"));
        assert_eq!(
            q.started_after.map(|t| t.timestamp_millis()),
            Some(1_796_126_400_500)
        );
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
        assert!(!q.ascending);
        assert!(parse_list_query(Some("state=gone"), &[]).is_err());
        assert!(parse_list_query(Some("limit=x"), &[]).is_err());
        assert!(parse_list_query(Some("order=up"), &[]).is_err());
        assert!(parse_list_query(Some("startedAfter=yesterday"), &[]).is_err());
        assert!(parse_list_query(Some("nextToken=abc"), &[]).is_err());
    }
}
