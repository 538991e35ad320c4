//! Interactive exec over one HTTP/1.1 request (`strata exec -t`): the
//! request body is NDJSON (`Content-Type: application/x-ndjson`) and stays
//! open while the command runs; the response is exec's NDJSON stream.
//!
//! - line 1: the exec body (`cmd`, `env`, `cwd`, `timeout_s`, `tty
//!   {cols, rows}`); no `stdin` (input comes as lines);
//! - then any of `{"stdin": b64}`, `{"resize": {"cols", "rows"}}`,
//!   `{"signal": n}`, `{"close_stdin": true}`, one per line, each at most
//!   [`MAX_LINE`] bytes;
//! - the end of the request body closes the command's stdin; on a PTY it is
//!   a hangup (`SIGHUP` to the process group), as when a terminal goes away.
//!
//! The command is the same tool call as a plain exec (gated on `cmd`).
//! Input is forwarded through the exec's bounded input queue: a command that
//! does not read its input holds up the request body, not daemon memory. A
//! malformed input line ends the input (as the end of the body does).

use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use serde::Deserialize;
use strata_core::{ErrorCode, SandboxId};

use super::sandboxes::{ndjson_events, ExecBody};
use super::{ndjson_headers, ApiError, ApiResult, Call, NDJSON};
use crate::engine::{ExecInput, ExecInputs, PtySize, Stdin};
use crate::service::MAX_PTY_SIDE;

/// Longest line of an interactive exec's request body.
pub const MAX_LINE: usize = 1024 * 1024;

/// Whether the request body is NDJSON (an interactive exec).
pub(super) fn is_ndjson(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|t| t.trim() == NDJSON))
}

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg)
}

/// The lines of a streamed body, each at most [`MAX_LINE`] bytes.
struct Lines {
    body: axum::body::BodyDataStream,
    buf: BytesMut,
    done: bool,
}

impl Lines {
    /// The next non-blank line (`Ok(None)`: the body ended).
    async fn next(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line = self.buf.split_to(i + 1).freeze();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(line));
            }
            if self.buf.len() > MAX_LINE {
                return Err(format!("a line is longer than {MAX_LINE} bytes"));
            }
            if self.done {
                let rest = self.buf.split().freeze();
                return Ok((!rest.iter().all(u8::is_ascii_whitespace)).then_some(rest));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(format!("request body: {e}")),
                None => self.done = true,
            }
        }
    }
}

/// One input line.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct InputLine {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    resize: Option<PtySize>,
    #[serde(default)]
    signal: Option<i32>,
    #[serde(default)]
    close_stdin: bool,
}

impl InputLine {
    /// The inputs it asks for (checked).
    pub(super) fn inputs(self) -> Result<Vec<ExecInput>, String> {
        let mut v = Vec::new();
        if let Some(s) = self.stdin {
            let b = base64::engine::general_purpose::STANDARD
                .decode(s.as_bytes())
                .map_err(|e| format!("stdin: not base64: {e}"))?;
            v.push(ExecInput::Stdin(Bytes::from(b)));
        }
        if let Some(p) = self.resize {
            let ok = |n: u16| (1..=MAX_PTY_SIDE).contains(&n);
            if !ok(p.cols) || !ok(p.rows) {
                return Err(format!("resize: cols and rows must be 1..={MAX_PTY_SIDE}"));
            }
            v.push(ExecInput::Resize(p));
        }
        if let Some(s) = self.signal {
            if !(1..=64).contains(&s) {
                return Err(format!("signal {s} is not 1..=64"));
            }
            v.push(ExecInput::Signal(s));
        }
        if self.close_stdin {
            v.push(ExecInput::CloseStdin);
        }
        Ok(v)
    }
}

/// `POST /v1/sandboxes/{id}/exec` with an NDJSON body.
pub(super) async fn exec(c: Call, body: axum::body::Body) -> ApiResult<axum::response::Response> {
    let id: SandboxId = c.id()?;
    let opts = c.gate()?;
    let mut lines = Lines {
        body: body.into_data_stream(),
        buf: BytesMut::new(),
        done: false,
    };
    let first = lines
        .next()
        .await
        .map_err(invalid)?
        .ok_or_else(|| invalid("an interactive exec's first line is its exec body"))?;
    let b: ExecBody = serde_json::from_slice(&first)
        .map_err(|e| invalid(format!("invalid exec body (first line): {e}")))?;
    let mut req = b.into_request()?;
    if req.stdin != Stdin::Null {
        return Err(invalid(
            "stdin: an interactive exec takes its input as {\"stdin\": b64} lines",
        ));
    }
    req.stdin = Stdin::Stream;
    let tty = req.pty.is_some();
    let (events, input) = c.svc.exec_interactive(&c.caller, &id, req, &opts).await?;
    tokio::spawn(forward(lines, input, tty, id));
    Ok((ndjson_headers(), ndjson_events(events)).into_response())
}

/// Feeds the body's input lines to the command until the body ends.
async fn forward(mut lines: Lines, input: ExecInputs, tty: bool, id: SandboxId) {
    loop {
        let line = match lines.next().await {
            Ok(Some(l)) => l,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(sandbox = %id, error = %e, "interactive exec: input ended");
                break;
            }
        };
        let parsed = serde_json::from_slice::<InputLine>(&line)
            .map_err(|e| e.to_string())
            .and_then(InputLine::inputs);
        let inputs = match parsed {
            Ok(v) => v,
            Err(e) => {
                tracing::info!(sandbox = %id, error = %e, "interactive exec: bad input line; input ends");
                break;
            }
        };
        for i in inputs {
            if input.send(i).await.is_err() {
                return; // the command ended
            }
        }
    }
    if tty {
        // The terminal went away.
        let _ = input.send(ExecInput::Signal(libc::SIGHUP)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Vec<ExecInput>, String> {
        serde_json::from_str::<InputLine>(s)
            .map_err(|e| e.to_string())
            .and_then(InputLine::inputs)
    }

    #[test]
    fn input_lines_parse_and_are_checked() {
        assert_eq!(
            parse(r#"{"stdin":"aGk="}"#).unwrap(),
            [ExecInput::Stdin(Bytes::from_static(b"hi"))]
        );
        assert_eq!(
            parse(r#"{"resize":{"cols":100,"rows":30}}"#).unwrap(),
            [ExecInput::Resize(PtySize {
                cols: 100,
                rows: 30
            })]
        );
        assert_eq!(parse(r#"{"signal":2}"#).unwrap(), [ExecInput::Signal(2)]);
        assert_eq!(
            parse(r#"{"close_stdin":true}"#).unwrap(),
            [ExecInput::CloseStdin]
        );
        for bad in [
            r#"{"stdin":"***"}"#,
            r#"{"resize":{"cols":0,"rows":30}}"#,
            r#"{"resize":{"cols":5000,"rows":30}}"#,
            r#"{"signal":99}"#,
            r#"{"keys":"x"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn lines_are_split_and_bounded() {
        let body = axum::body::Body::from("{\"a\":1}\n\n{\"b\":2}\n{\"c\":3}");
        let mut l = Lines {
            body: body.into_data_stream(),
            buf: BytesMut::new(),
            done: false,
        };
        assert_eq!(&l.next().await.unwrap().unwrap()[..], b"{\"a\":1}\n");
        assert_eq!(&l.next().await.unwrap().unwrap()[..], b"{\"b\":2}\n");
        assert_eq!(&l.next().await.unwrap().unwrap()[..], b"{\"c\":3}");
        assert_eq!(l.next().await.unwrap(), None);
        let long = vec![b'x'; MAX_LINE + 10];
        let mut l = Lines {
            body: axum::body::Body::from(long).into_data_stream(),
            buf: BytesMut::new(),
            done: false,
        };
        assert!(l.next().await.is_err());
    }
}
