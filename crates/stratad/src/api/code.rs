//! `POST /v1/sandboxes/{id}/code`: runs code in the code interpreter of a
//! sandbox made from the `code-interpreter` template
//! (templates/code-interpreter/: a server on guest port
//! [`INTERPRETER_PORT`] speaking E2B's code-interpreter protocol) and
//! streams its NDJSON answer through as the guest writes it.
//!
//! Body: `{code, language?, context_id?, env_vars?, timeout?}` (unknown
//! fields refused). The guest gets `{code, language?, context_id?,
//! env_vars?}` on `POST /execute`; each line of the answer is one message
//! (`number_of_executions`, `stdout`, `stderr`, `result`, `error`,
//! `keepalive`, `end_of_execution`; see the template's README).
//!
//! **Gating.** A code run is a connection to guest port 49999, gated and
//! audited exactly as the port route and the E2B door's `run_code` are
//! ([`Service::open_port`], policy kind `port` with port 49999): one
//! decision for the same effect whichever door asks, and what the gate
//! allowed (that port) is what the request reaches. A policy that should
//! not let a tenant run interpreter code denies port 49999.
//!
//! **Timeout.** `timeout` seconds (default [`DEFAULT_TIMEOUT_S`], at most
//! [`MAX_TIMEOUT_S`]) bounds the whole run: at the deadline the stream ends
//! with an `error` line named `TimeoutError` and the guest connection is
//! closed, which makes the server interrupt the kernel (its state stays as
//! the interrupt left it). A client that goes away closes it the same way.
//!
//! Refusals: a sandbox where nothing listens on 49999 is `409
//! invalid_state` (not an interpreter sandbox, or its server is down); the
//! server's own refusals keep their status class with its code and message
//! in ours (`400 invalid_request` for an unsupported language, `404
//! not_found` for an unknown context, `429 rate_limited` for too many
//! contexts, `503`-class answers as `409 invalid_state`).

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Body as AxumBody;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use strata_core::{ErrorCode, SandboxId};

use super::ports::{forward, Forward, PortProxyError};
use super::{ndjson_headers, ApiError, ApiResult, Body, Call};
use crate::service::is_port_closed;

/// The guest port of the code-interpreter server.
pub const INTERPRETER_PORT: u16 = 49999;
/// A run's deadline when the body names none, in seconds (E2B's default).
pub const DEFAULT_TIMEOUT_S: f64 = 300.0;
/// The longest deadline a body may ask, in seconds.
pub const MAX_TIMEOUT_S: f64 = 3600.0;
/// The most of a guest refusal's body read (its `{code, message}`).
const MAX_REFUSAL_BYTES: usize = 64 * 1024;

/// `POST /v1/sandboxes/{id}/code` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CodeBody {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    timeout: Option<f64>,
}

impl CodeBody {
    /// The guest's `/execute` body and the deadline, or why not.
    fn check(self) -> ApiResult<(Vec<u8>, Duration)> {
        let bad = |m: String| ApiError::new(ErrorCode::InvalidRequest, m);
        let code = self
            .code
            .ok_or_else(|| bad("code: required (the code to run)".into()))?;
        let timeout = self.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
        if !(timeout.is_finite() && timeout > 0.0 && timeout <= MAX_TIMEOUT_S) {
            return Err(bad(format!(
                "timeout: {timeout} is not a number of seconds in (0, {MAX_TIMEOUT_S}]"
            )));
        }
        if self.language.is_some() && self.context_id.is_some() {
            return Err(bad(
                "language and context_id: give one (a context has its language)".into(),
            ));
        }
        let mut guest = json!({ "code": code });
        if let Some(l) = self.language {
            guest["language"] = json!(l);
        }
        if let Some(c) = self.context_id {
            guest["context_id"] = json!(c);
        }
        if let Some(e) = self.env_vars {
            guest["env_vars"] = json!(e);
        }
        let body = serde_json::to_vec(&guest)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("encoding the body: {e}")))?;
        Ok((body, Duration::from_secs_f64(timeout)))
    }
}

pub(super) async fn run_code(c: Call, Body(b): Body<CodeBody>) -> ApiResult<Response> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    let (body, timeout) = b.check()?;
    let req = Request::builder()
        .method("POST")
        .uri("/execute")
        .header(header::HOST, "localhost")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(AxumBody::from(body))
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("request: {e}")))?;
    let resp = match forward(
        &c.svc,
        &c.caller,
        &id,
        INTERPRETER_PORT,
        &opts,
        req,
        Forward::default(),
    )
    .await
    {
        Ok(r) => r,
        Err(PortProxyError::Open(e)) if is_port_closed(&e) => {
            return Err(ApiError::new(
                ErrorCode::InvalidState,
                format!(
                    "sandbox {id} has no code interpreter: nothing listens on port \
                     {INTERPRETER_PORT} (make the sandbox from the code-interpreter template)"
                ),
            ))
        }
        Err(PortProxyError::Open(e)) => return Err(e.into()),
        Err(PortProxyError::Guest(m)) | Err(PortProxyError::BadRequest(m)) => {
            return Err(ApiError::new(
                ErrorCode::InvalidState,
                format!("the code interpreter of sandbox {id}: {m}"),
            ))
        }
    };
    if resp.status() != StatusCode::OK {
        return Err(refusal(resp).await);
    }
    let data = resp.into_body().into_data_stream();
    Ok((
        ndjson_headers(),
        AxumBody::from_stream(with_deadline(data, timeout)),
    )
        .into_response())
}

/// The guest server's refusal as our error: its status class, its code and
/// message in ours.
async fn refusal(resp: Response) -> ApiError {
    let status = resp.status();
    let mut body = Vec::new();
    let mut s = resp.into_body().into_data_stream();
    while let Some(Ok(chunk)) = s.next().await {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_REFUSAL_BYTES {
            body.truncate(MAX_REFUSAL_BYTES);
            break;
        }
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (gcode, gmsg) = match (&v["code"], &v["message"]) {
        (Value::String(c), Value::String(m)) => (c.clone(), m.clone()),
        _ => (
            status.as_u16().to_string(),
            String::from_utf8_lossy(&body).chars().take(500).collect(),
        ),
    };
    ApiError::new(
        refusal_code(status),
        format!("code interpreter refused ({gcode}): {gmsg}"),
    )
}

fn refusal_code(status: StatusCode) -> ErrorCode {
    match status.as_u16() {
        404 => ErrorCode::NotFound,
        413 => ErrorCode::PayloadTooLarge,
        429 => ErrorCode::RateLimited,
        400..=499 => ErrorCode::InvalidRequest,
        _ => ErrorCode::InvalidState,
    }
}

/// `data` until `timeout` passes; then a `TimeoutError` line ends it (on a
/// line of its own) and `data` (the guest connection) is dropped.
fn with_deadline<S, E>(
    data: S,
    timeout: Duration,
) -> impl futures::Stream<Item = Result<Bytes, E>> + Send
where
    S: futures::Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Send + 'static,
{
    struct St<S> {
        data: Option<S>,
        sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
        at_line_start: bool,
    }
    let st = St {
        data: Some(data),
        sleep: Box::pin(tokio::time::sleep(timeout)),
        at_line_start: true,
    };
    futures::stream::unfold(st, move |mut st| async move {
        let data = st.data.as_mut()?;
        tokio::select! {
            item = data.next() => {
                let item = item?;
                if let Ok(b) = &item {
                    if let Some(last) = b.last() {
                        st.at_line_start = *last == b'\n';
                    }
                }
                Some((item, st))
            }
            _ = &mut st.sleep => {
                st.data = None;
                let line = json!({
                    "type": "error",
                    "name": "TimeoutError",
                    "value": format!("execution timed out after {} s", timeout.as_secs_f64()),
                    "traceback": "",
                });
                let mut out = if st.at_line_start { String::new() } else { "\n".into() };
                out.push_str(&line.to_string());
                out.push('\n');
                Some((Ok(Bytes::from(out)), st))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> CodeBody {
        serde_json::from_value(v).expect("body")
    }

    #[test]
    fn the_guest_gets_the_fields_given_and_bad_bodies_are_refused() {
        let (b, t) = body(json!({"code": "1+1", "env_vars": {"A": "b"}}))
            .check()
            .expect("ok");
        let v: Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(v, json!({"code": "1+1", "env_vars": {"A": "b"}}));
        assert_eq!(t, Duration::from_secs(300));
        let (b, t) = body(json!({"code": "x", "context_id": "c1", "timeout": 2.5}))
            .check()
            .expect("ok");
        let v: Value = serde_json::from_slice(&b).expect("json");
        assert_eq!(v, json!({"code": "x", "context_id": "c1"}));
        assert_eq!(t, Duration::from_millis(2500));
        for bad in [
            json!({}),
            json!({"code": "x", "timeout": 0}),
            json!({"code": "x", "timeout": -1}),
            json!({"code": "x", "timeout": 3601}),
            json!({"code": "x", "language": "python", "context_id": "c"}),
        ] {
            let e = body(bad.clone()).check().expect_err("refused");
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{bad}");
        }
        assert!(serde_json::from_value::<CodeBody>(json!({"code": "x", "nope": 1})).is_err());
    }

    #[tokio::test]
    async fn a_run_past_its_deadline_ends_with_a_timeout_error_line() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
        tx.unbounded_send(Ok(Bytes::from_static(
            b"{\"type\":\"stdout\",\"text\":\"a\"}\n{\"ty",
        )))
        .expect("send");
        let out: Vec<_> = with_deadline(rx, Duration::from_millis(200))
            .collect()
            .await;
        let text: String = out
            .into_iter()
            .map(|b| String::from_utf8(b.expect("chunk").to_vec()).expect("utf8"))
            .collect();
        let last = text.lines().last().expect("line");
        let v: Value = serde_json::from_str(last).expect("json line");
        assert_eq!(v["type"], "error");
        assert_eq!(v["name"], "TimeoutError");
        // The cut line is not glued to ours.
        assert!(text.contains("{\"ty\n{"), "{text}");
        drop(tx);
    }
}
