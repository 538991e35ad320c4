//! `strata exec ID -- CMD…`: run a command in a sandbox. Output is streamed
//! as the daemon sends it (NDJSON lines `{"stdout"|"stderr": base64}`, then
//! `{"exit":{"code","signal"}}`); the process exits with the command's code.
//!
//! `-t`: the command runs on a pseudo-terminal sized like ours, our
//! terminal in raw mode, keystrokes and window changes streamed in the same
//! request ([`tty`]).

mod tty;

use base64::Engine as _;
use reqwest::Method;
use serde_json::{json, Value};

use super::{read_stdin, CliError, Ctx, ProcessArgs};
use crate::api::{error_from_value, ApiError};
use crate::human::{duration_arg, parse_duration};

/// `strata exec`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// Environment, working directory, user.
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Kill the command after this long, e.g. 30s or 5m.
    #[arg(long, value_parser = duration_arg)]
    pub timeout: Option<String>,
    /// Do not pass stdin to the command (it is passed when not a terminal).
    #[arg(short = 'n', long)]
    pub no_stdin: bool,
    /// Interactive: run the command on a pseudo-terminal, this terminal in
    /// raw mode (keys, ^C and window size go to the command).
    #[arg(short = 't', long, conflicts_with = "no_stdin")]
    pub tty: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// The request body.
pub fn body(a: &Args, stdin: Option<&[u8]>) -> Result<Value, CliError> {
    let mut b = json!({
        "cmd": a.cmd,
        "env": super::string_map(&a.process.env),
    });
    if let Some(c) = &a.process.cwd {
        b["cwd"] = c.clone().into();
    }
    if let Some(u) = &a.process.user {
        b["user"] = u.clone().into();
    }
    if let Some(t) = &a.timeout {
        let d = parse_duration(t).map_err(|e| CliError::InvalidArgument(e.to_string()))?;
        // Whole seconds, rounded up: a timeout never gets shorter.
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        b["timeout_s"] = secs.max(1).into();
    }
    if let Some(data) = stdin {
        b["stdin"] = base64::engine::general_purpose::STANDARD
            .encode(data)
            .into();
    }
    Ok(b)
}

/// One decoded line of the exec stream.
#[derive(Debug, PartialEq)]
pub enum Line {
    /// Bytes for stdout.
    Stdout(Vec<u8>),
    /// Bytes for stderr.
    Stderr(Vec<u8>),
    /// The end: exit code or signal.
    Exit {
        /// Exit code.
        code: Option<i32>,
        /// Signal.
        signal: Option<i32>,
    },
}

/// Decodes one NDJSON line.
pub fn decode_line(line: &[u8]) -> Result<Line, ApiError> {
    let bad = |reason: String| ApiError::Protocol {
        url: "exec stream".into(),
        reason,
    };
    let v: Value =
        serde_json::from_slice(line).map_err(|e| bad(format!("invalid JSON line: {e}")))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let data = |s: &Value| -> Result<Vec<u8>, ApiError> {
        let s = s
            .as_str()
            .ok_or_else(|| bad("output is not a string".into()))?;
        b64.decode(s)
            .map_err(|e| bad(format!("output is not base64: {e}")))
    };
    if let Some(s) = v.get("stdout") {
        return Ok(Line::Stdout(data(s)?));
    }
    if let Some(s) = v.get("stderr") {
        return Ok(Line::Stderr(data(s)?));
    }
    if let Some(e) = v.get("exit") {
        let num = |k: &str| {
            e.get(k)
                .and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
        };
        return Ok(Line::Exit {
            code: num("code"),
            signal: num("signal"),
        });
    }
    if let Some(e) = error_from_value(&v) {
        return Err(e);
    }
    Err(bad(format!(
        "unknown line {}",
        String::from_utf8_lossy(line)
    )))
}

/// Splits a byte stream into lines across chunk boundaries.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    /// Feeds a chunk; returns the complete lines in it (without `\n`, empty ones skipped).
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(chunk);
        let mut lines = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let rest = self.buf.split_off(pos + 1);
            let mut line = std::mem::replace(&mut self.buf, rest);
            line.pop();
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push(line);
            }
        }
        lines
    }

    /// What is left after the stream ended (a last line without `\n`).
    pub fn finish(self) -> Option<Vec<u8>> {
        (!self.buf.iter().all(u8::is_ascii_whitespace)).then_some(self.buf)
    }
}

/// Reads an exec's NDJSON answer `resp` line by line (a line split across
/// chunks is joined, a last line without a newline counted) and hands each
/// decoded line to `f`.
pub(super) async fn pump_lines(
    client: &crate::api::ApiClient,
    resp: reqwest::Response,
    mut f: impl FnMut(Line) -> Result<(), ApiError>,
) -> Result<(), ApiError> {
    let mut splitter = LineSplitter::default();
    client
        .for_each_chunk(resp, |chunk| {
            for line in splitter.push(chunk) {
                f(decode_line(&line)?)?;
            }
            Ok(())
        })
        .await?;
    if let Some(last) = splitter.finish() {
        f(decode_line(&last)?)?;
    }
    Ok(())
}

/// Runs `strata exec`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    if a.tty {
        return tty::run(ctx, a).await;
    }
    let stdin = read_stdin(a.no_stdin).filter(|b| !b.is_empty());
    let client = ctx.client()?;
    let b = body(&a, stdin.as_deref())?;
    let url = client.url(&["v1", "sandboxes", &a.id, "exec"], &[]);
    let resp = client
        .send_call(client.request(Method::POST, url).json(&b))
        .await?;

    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut exit: Option<(Option<i32>, Option<i32>)> = None;
    let json = ctx.json;
    pump_lines(&client, resp, |line| {
        match line {
            Line::Stdout(d) if json => out.extend_from_slice(&d),
            Line::Stderr(d) if json => err.extend_from_slice(&d),
            Line::Stdout(d) => write_flush(&mut std::io::stdout().lock(), &d),
            Line::Stderr(d) => write_flush(&mut std::io::stderr().lock(), &d),
            Line::Exit { code, signal } => exit = Some((code, signal)),
        }
        Ok(())
    })
    .await?;
    let Some((code, signal)) = exit else {
        return Err(ApiError::Protocol {
            url: client.base().to_string(),
            reason: "the exec stream ended without an exit status".into(),
        }
        .into());
    };
    let status = exit_status(code, signal);
    if ctx.json {
        println!(
            "{}",
            json!({
                "stdout": String::from_utf8_lossy(&out),
                "stderr": String::from_utf8_lossy(&err),
                "exit": { "code": code, "signal": signal },
            })
        );
    }
    Ok(status)
}

/// Our exit code for the command's end: its code, or 128 + its signal.
fn exit_status(code: Option<i32>, signal: Option<i32>) -> i32 {
    match (code, signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

fn write_flush(w: &mut dyn std::io::Write, b: &[u8]) {
    let _ = w.write_all(b);
    let _ = w.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks() {
        let mut s = LineSplitter::default();
        assert!(s.push(b"{\"a\":").is_empty());
        assert_eq!(
            s.push(b"1}\n\n{\"b\":2}\n{\"c\""),
            vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec()]
        );
        assert_eq!(s.push(b":3}"), Vec::<Vec<u8>>::new());
        assert_eq!(s.finish(), Some(b"{\"c\":3}".to_vec()));
    }

    #[test]
    fn stream_lines_decode() {
        assert_eq!(
            decode_line(br#"{"stdout":"aGkK"}"#).unwrap(),
            Line::Stdout(b"hi\n".to_vec())
        );
        assert_eq!(
            decode_line(br#"{"stderr":""}"#).unwrap(),
            Line::Stderr(vec![])
        );
        assert_eq!(
            decode_line(br#"{"exit":{"code":7,"signal":null}}"#).unwrap(),
            Line::Exit {
                code: Some(7),
                signal: None
            }
        );
        let e = decode_line(br#"{"error":{"code":"vm_failed","message":"VM died"}}"#).unwrap_err();
        assert_eq!(e.code(), "vm_failed");
        assert_eq!(e.to_string(), "VM died");
        assert_eq!(
            decode_line(b"{\"stdout\":\"***\"}").unwrap_err().code(),
            "protocol_error"
        );
        assert_eq!(
            decode_line(b"garbage").unwrap_err().code(),
            "protocol_error"
        );
    }

    #[test]
    fn body_rounds_timeouts_up_and_encodes_stdin() {
        let a = Args {
            id: "sb-1".into(),
            process: ProcessArgs {
                env: vec![("A".into(), "1".into())],
                cwd: Some("/tmp".into()),
                user: None,
            },
            timeout: Some("1500ms".into()),
            no_stdin: false,
            tty: false,
            cmd: vec!["cat".into()],
        };
        let b = body(&a, Some(b"hi")).unwrap();
        assert_eq!(
            b,
            json!({"cmd": ["cat"], "env": {"A": "1"}, "cwd": "/tmp", "timeout_s": 2, "stdin": "aGk="})
        );
    }
}
