//! The event stream (`GET /v1/events`, and `GET /v1/sandboxes/:id/events`
//! with `Accept: text/event-stream`) and webhooks (`/v1/webhooks`): see
//! `crate::events` and docs/events.md.

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use strata_core::{ErrorCode, SandboxId};

use super::{ApiError, ApiResult, Body, Call};
use crate::events::webhooks::CreateWebhook;

/// Whether the request asks for `text/event-stream`.
pub(super) fn wants_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"))
}

/// The cursor: `Last-Event-ID` (set by a reconnecting client) over
/// `?after=` (the first connection's).
fn cursor(c: &Call, headers: &HeaderMap) -> ApiResult<(i64, bool)> {
    let params = c.params(&["after", "follow"], &[], false)?;
    let follow = params.flag("follow", true)?;
    let after = cursor_of(&params, headers)?;
    Ok((after, follow))
}

fn cursor_of(params: &super::Params, headers: &HeaderMap) -> ApiResult<i64> {
    let parse = |what: &str, v: &str| {
        v.trim()
            .parse::<i64>()
            .ok()
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("{what}: a journal seq (a non-negative integer)"),
                )
            })
    };
    if let Some(v) = headers.get("last-event-id") {
        let v = v
            .to_str()
            .map_err(|_| ApiError::new(ErrorCode::InvalidRequest, "Last-Event-ID: not text"))?;
        return parse("Last-Event-ID", v);
    }
    match params.one("after") {
        Some(v) => parse("after", v),
        None => Ok(0),
    }
}

/// A stream of `tenant`'s journal (one sandbox's when given).
fn open_stream(
    c: &Call,
    tenant: &str,
    sandbox: Option<String>,
    (after, follow): (i64, bool),
) -> ApiResult<Response> {
    let max = c.svc.config().events.max_streams_per_tenant;
    let slot = c.svc.event_streams().open(tenant, max).ok_or_else(|| {
        ApiError::new(
            ErrorCode::RateLimited,
            format!("at most {max} event streams per tenant ([events] max_streams_per_tenant)"),
        )
    })?;
    Ok(crate::events::stream::respond(
        c.svc.clone(),
        slot,
        tenant.to_owned(),
        sandbox,
        after,
        follow,
    ))
}

/// `GET /v1/events`: the caller's tenant's journal as server-sent events.
pub(super) async fn stream(c: Call, headers: HeaderMap) -> ApiResult<Response> {
    let after = cursor(&c, &headers)?;
    let tenant = c
        .caller
        .tenant()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::new(ErrorCode::Forbidden, "the event stream is a tenant's"))?;
    open_stream(&c, &tenant, None, after)
}

/// `GET /v1/sandboxes/:id/events`: the JSON list, or with `Accept:
/// text/event-stream` one sandbox's journal as server-sent events.
pub(super) async fn sandbox_events(c: Call, headers: HeaderMap) -> ApiResult<Response> {
    let id: SandboxId = c.id()?;
    if !wants_stream(&headers) {
        c.no_query()?;
        return Ok(
            Json(json!({ "items": c.svc.events(&c.caller, &id, 1000).await? })).into_response(),
        );
    }
    let after = cursor(&c, &headers)?;
    // Another tenant's sandbox answers as an unknown one.
    let rec = c.svc.get_sandbox(&c.caller, &id).await?;
    open_stream(&c, &rec.tenant, Some(id.to_string()), after)
}

/// `POST /v1/webhooks`.
pub(super) async fn create_webhook(
    c: Call,
    Body(cmd): Body<CreateWebhook>,
) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let (hook, secret) = c.svc.create_webhook(&c.caller, cmd).await?;
    let mut v = serde_json::to_value(&hook).unwrap_or_default();
    v["secret"] = json!(secret);
    Ok((StatusCode::CREATED, Json(v)))
}

/// `GET /v1/webhooks`.
pub(super) async fn list_webhooks(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    Ok(Json(
        json!({ "items": c.svc.list_webhooks(&c.caller).await? }),
    ))
}

/// `DELETE /v1/webhooks/:id`.
pub(super) async fn delete_webhook(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    c.svc.delete_webhook(&c.caller, c.raw_id()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/webhooks/:id/deliveries`.
pub(super) async fn webhook_deliveries(c: Call) -> ApiResult<impl IntoResponse> {
    c.no_query()?;
    let items = c.svc.webhook_deliveries(&c.caller, c.raw_id()).await?;
    Ok(Json(json!({ "items": items })))
}
