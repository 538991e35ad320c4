//! The door's errors, in one place so the modules that raise them do not
//! import from each other: [`E2bError`], the control plane's (and `/files`'s)
//! `{"code": <http status>, "message": "…"}`; and the mapping of the
//! service's errors onto Connect codes for envd ([`service_err`]), the gate's
//! refusals included ([`refusal_code`]).
//!
//! Depends on [`crate::connect`] (the Connect codes) and stratad's error
//! types only.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use stratad::engine::{GuestErrorKind, RuntimeError};
use stratad::security::gate::GateRefusal;
use stratad::service::ServiceError;

use crate::connect::{Code, ConnectError};

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

impl From<ServiceError> for E2bError {
    /// The service's status and message: the gate's refusal is 403 (denied,
    /// the message naming the rule), 400 (invalid call) or 500 (fail closed).
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

/// A result of the control plane.
pub type E2bResult<T> = Result<T, E2bError>;

/// `413` for a Connect request body over `limit` bytes: Connect's JSON
/// error (`resource_exhausted`) with the status of the refusal.
pub fn connect_too_large(limit: usize) -> Response {
    let e = ConnectError::new(Code::ResourceExhausted, too_large_message(limit));
    let mut r = e.into_response();
    *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    r
}

/// The message of a body over `limit` bytes.
pub fn too_large_message(limit: impl std::fmt::Display) -> String {
    format!("request body larger than {limit} bytes")
}

/// The message E2B's proxy uses for a sandbox that is not running; the SDK
/// turns it into `SandboxNotRunningException`.
pub(crate) fn not_running(id: &str) -> String {
    format!("The sandbox {id} was not found")
}

/// The Connect code of a gate refusal (`permission_denied` for a policy
/// refusal, as the HTTP 403 of the control plane and `/files`).
pub fn refusal_code(r: &GateRefusal) -> Code {
    match r {
        GateRefusal::Denied { .. } | GateRefusal::Pending(_) => Code::PermissionDenied,
        GateRefusal::Invalid(_) => Code::InvalidArgument,
        GateRefusal::Internal(_) => Code::Internal,
        GateRefusal::Full(_) => Code::ResourceExhausted,
    }
}

/// A service error as a Connect error (envd). An unknown sandbox, another
/// tenant's included, and a sandbox that is not running answer
/// `unavailable` with E2B's "not found" message; a failure the guest
/// reports answers by its kind ([`guest_code`]).
pub fn service_err(e: ServiceError) -> ConnectError {
    let msg = e.message();
    let code = match &e {
        ServiceError::NotFound {
            kind: "sandbox",
            id,
        } => return ConnectError::new(Code::Unavailable, not_running(id)),
        ServiceError::NotFound { .. } => Code::NotFound,
        ServiceError::InvalidRequest(_) | ServiceError::InvalidSize(_) => Code::InvalidArgument,
        ServiceError::InvalidState(_) | ServiceError::InvalidStateOther(_) => {
            Code::FailedPrecondition
        }
        ServiceError::Conflict(_) => Code::Aborted,
        ServiceError::InsufficientCapacity(_) | ServiceError::QuotaExceeded(_) => {
            Code::ResourceExhausted
        }
        ServiceError::Engine(
            RuntimeError::SandboxNotFound(id) | RuntimeError::NotRunning { id },
        ) => return ConnectError::new(Code::Unavailable, not_running(id)),
        ServiceError::Engine(RuntimeError::Guest { kind, .. }) => guest_code(*kind),
        ServiceError::Engine(RuntimeError::Invalid(_)) => Code::InvalidArgument,
        // The channel to the agent failed: nothing known about the request.
        ServiceError::Engine(RuntimeError::Agent { .. }) => Code::Unknown,
        ServiceError::Engine(RuntimeError::AgentTimeout { .. }) => Code::DeadlineExceeded,
        ServiceError::Gate(r) => refusal_code(r),
        ServiceError::Forbidden(_) => Code::PermissionDenied,
        _ => Code::Internal,
    };
    ConnectError::new(code, msg)
}

/// The Connect code of a failure the guest agent reports, by its kind.
pub fn guest_code(kind: GuestErrorKind) -> Code {
    match kind {
        GuestErrorKind::NotFound => Code::NotFound,
        GuestErrorKind::Exists => Code::AlreadyExists,
        GuestErrorKind::Invalid | GuestErrorKind::NotADirectory | GuestErrorKind::IsADirectory => {
            Code::InvalidArgument
        }
        GuestErrorKind::PermissionDenied => Code::PermissionDenied,
        GuestErrorKind::NoSpace | GuestErrorKind::Other => Code::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_policy::{Decision, Effect};

    fn denied() -> ServiceError {
        ServiceError::Gate(GateRefusal::Denied {
            decision: Decision {
                effect: Effect::Deny,
                layer: None,
                rule_id: "no-rm".into(),
                rule_index: Some(0),
                hard: false,
                reason: "x".into(),
            },
            approval_id: None,
            message: "denied by policy rule `no-rm`: x".into(),
        })
    }

    #[test]
    fn refusals_map_to_connect_and_http() {
        let d = service_err(denied());
        assert_eq!(d.code, Code::PermissionDenied);
        assert!(d.message.contains("no-rm"), "{}", d.message);
        let h = E2bError::from(denied());
        assert_eq!(h.status, 403);
        assert!(h.message.contains("`no-rm`"), "{}", h.message);
        let inv = ServiceError::Gate(GateRefusal::Invalid("x".into()));
        assert_eq!(E2bError::from(inv).status, 400);
        let int = ServiceError::Gate(GateRefusal::Internal("x".into()));
        assert_eq!(service_err(int).code, Code::Internal);
        let f = ServiceError::Forbidden("platform template".into());
        assert_eq!(service_err(f).code, Code::PermissionDenied);
    }

    #[test]
    fn service_errors_map_to_connect_codes() {
        let e = service_err(ServiceError::NotFound {
            kind: "sandbox",
            id: "sbx-x".into(),
        });
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("was not found"));
        let guest = |kind, message: &str| {
            service_err(ServiceError::Engine(RuntimeError::Guest {
                id: "sbx-x".into(),
                kind,
                message: message.into(),
            }))
        };
        assert_eq!(guest(GuestErrorKind::NotFound, "x").code, Code::NotFound);
        let e = guest(GuestErrorKind::Exists, "/tmp/a");
        assert_eq!(e.code, Code::AlreadyExists);
        assert_eq!(e.message, "guest of sbx-x: already exists: /tmp/a");
        for k in [
            GuestErrorKind::Invalid,
            GuestErrorKind::NotADirectory,
            GuestErrorKind::IsADirectory,
        ] {
            assert_eq!(guest(k, "x").code, Code::InvalidArgument, "{k:?}");
        }
        assert_eq!(
            guest(GuestErrorKind::PermissionDenied, "x").code,
            Code::PermissionDenied
        );
        // The kind decides, never the text.
        assert_eq!(
            guest(GuestErrorKind::Other, "File exists").code,
            Code::Unknown
        );
        assert_eq!(
            guest(GuestErrorKind::NotFound, "permission denied").code,
            Code::NotFound
        );
        let e = service_err(ServiceError::Engine(RuntimeError::NotRunning {
            id: "sbx-x".into(),
        }));
        assert_eq!(e.code, Code::Unavailable);
        let e = service_err(ServiceError::Engine(RuntimeError::AgentTimeout {
            id: "sbx-x".into(),
            timeout_ms: 1,
        }));
        assert_eq!(e.code, Code::DeadlineExceeded);
    }
}
