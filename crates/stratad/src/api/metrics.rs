//! `GET /v1/sandboxes/{id}/metrics`: a sandbox's usage series from the
//! daemon's sampler (`service::sampler`), optionally limited to
//! `start`/`end` (RFC 3339 or Unix seconds, both inclusive); and
//! `GET /v1/sandboxes/{id}/logs`: its process log (`service::logs`).

use axum::response::IntoResponse;
use axum::Json;
use chrono::{DateTime, Utc};
use strata_core::{ErrorCode, SandboxId};

use super::{ApiError, ApiResult, Call};

/// A time bound of the query: RFC 3339 or Unix seconds.
pub(crate) fn parse_time(key: &str, v: &str) -> ApiResult<DateTime<Utc>> {
    if let Ok(secs) = v.parse::<i64>() {
        return DateTime::from_timestamp(secs, 0).ok_or_else(|| {
            ApiError::new(ErrorCode::InvalidRequest, format!("{key}: out of range"))
        });
    }
    DateTime::parse_from_rfc3339(v)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("{key}: expected RFC 3339 or Unix seconds: {e}"),
            )
        })
}

pub(super) async fn sandbox_metrics(c: Call) -> ApiResult<impl IntoResponse> {
    let p = c.params(&["start", "end"], &[], false)?;
    let start = p.one("start").map(|v| parse_time("start", v)).transpose()?;
    let end = p.one("end").map(|v| parse_time("end", v)).transpose()?;
    let id: SandboxId = c.id()?;
    Ok(Json(
        c.svc.sandbox_metrics(&c.caller, &id, start, end).await?,
    ))
}

/// `GET /v1/sandboxes/{id}/logs?after=&limit=`: a page of the sandbox's
/// process log (`service::logs`), entries after cursor `after` (default 0:
/// the oldest kept), at most `limit` (default 200, at most 1000).
pub(super) async fn sandbox_logs(c: Call) -> ApiResult<impl IntoResponse> {
    let p = c.params(&["after", "limit"], &[], false)?;
    let num = |key: &str, default: u64| -> ApiResult<u64> {
        p.one(key).map_or(Ok(default), |v| {
            v.parse::<u64>().map_err(|_| {
                ApiError::new(
                    ErrorCode::InvalidRequest,
                    format!("{key}: expected a non-negative integer"),
                )
            })
        })
    };
    let after = num("after", 0)?;
    let limit = usize::try_from(num("limit", 200)?).unwrap_or(usize::MAX);
    let id: SandboxId = c.id()?;
    Ok(Json(
        c.svc.sandbox_logs(&c.caller, &id, after, limit).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_bounds() {
        assert_eq!(parse_time("start", "0").unwrap().timestamp(), 0);
        assert_eq!(
            parse_time("end", "2026-12-01T10:00:00Z")
                .unwrap()
                .timestamp(),
            1_796_119_200
        );
        let e = parse_time("start", "yesterday").unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(e.message.starts_with("start:"), "{}", e.message);
    }
}
