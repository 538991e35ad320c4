//! `GET /v1/sandboxes/{id}/metrics`: a sandbox's usage series from the
//! daemon's sampler (`service::sampler`), optionally limited to
//! `start`/`end` (RFC 3339 or Unix seconds, both inclusive).

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
