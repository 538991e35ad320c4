//! E2B sandbox logs over the daemon's process log (`stratad::service::logs`:
//! what the sandbox's commands printed, kept in memory, bounded).
//!
//! - `GET /sandboxes/{id}/logs?start=&limit=` → `SandboxLogs`
//!   `{logs: [{timestamp, line}], logEntries: [SandboxLogEntry]}`: entries at
//!   or after `start` (Unix milliseconds), at most `limit` (default 1000).
//! - `GET /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search=`
//!   → `{logs: [SandboxLogEntry]}`: from `cursor` (Unix milliseconds)
//!   `forward` (default) or `backward`, at least `level`
//!   (debug < info < warn < error), whose message contains `search`.
//!
//! One entry per command start (`info`, "started: argv"), output line
//! (stdout `info`, stderr `error`) and exit (`info`, "exit 0"); `fields`
//! carry `exec` (the command's number in the sandbox) and `stream`.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::{Extension, Json};
use serde_json::{json, Value};
use strata_core::SandboxId;
use stratad::caller::Caller;
use stratad::service::{LogEntry, LogStream, MAX_LOG_PAGE};

use super::{rfc3339, sandbox_err, SandboxPath};
use crate::error::{E2bError, E2bResult};
use crate::E2b;

/// One line of the log as E2B's models give it.
struct Line {
    at: chrono::DateTime<chrono::Utc>,
    level: u8,
    message: String,
    exec: u64,
    stream: LogStream,
}

const LEVELS: [&str; 4] = ["debug", "info", "warn", "error"];

fn level_of(name: &str) -> E2bResult<u8> {
    LEVELS
        .iter()
        .position(|l| *l == name)
        .map(|i| i as u8)
        .ok_or_else(|| {
            E2bError::new(
                400,
                format!("level: expected one of {LEVELS:?}, got {name:?}"),
            )
        })
}

/// The lines of the sandbox's whole kept log, oldest first (output chunks
/// split at newlines; a chunk ending mid-line gives a line of its own).
async fn lines(st: &E2b, caller: &Caller, id: &str) -> E2bResult<Vec<Line>> {
    let sid: SandboxId = super::parse_sandbox_id(id)?;
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = st
            .svc
            .sandbox_logs(caller, &sid, after, MAX_LOG_PAGE)
            .await
            .map_err(sandbox_err(id))?;
        let n = page.entries.len();
        for e in &page.entries {
            push_lines(&mut out, e);
        }
        after = page.next;
        if n < MAX_LOG_PAGE {
            return Ok(out);
        }
    }
}

fn push_lines(out: &mut Vec<Line>, e: &LogEntry) {
    let mk = |level: u8, message: String| Line {
        at: e.at,
        level,
        message,
        exec: e.exec,
        stream: e.stream,
    };
    match e.stream {
        LogStream::Start => out.push(mk(1, format!("started: {}", e.text))),
        LogStream::Exit => out.push(mk(1, e.text.clone())),
        LogStream::Stdout | LogStream::Stderr => {
            let level = if e.stream == LogStream::Stderr { 3 } else { 1 };
            for l in e.text.split_inclusive('\n') {
                out.push(mk(level, l.trim_end_matches(['\n', '\r']).to_owned()));
            }
        }
    }
}

fn entry_json(l: &Line) -> Value {
    let stream = match l.stream {
        LogStream::Start => "start",
        LogStream::Stdout => "stdout",
        LogStream::Stderr => "stderr",
        LogStream::Exit => "exit",
    };
    json!({
        "timestamp": rfc3339(l.at),
        "level": LEVELS[l.level as usize],
        "message": l.message,
        "fields": {"exec": l.exec.to_string(), "stream": stream},
    })
}

fn millis(k: &str, v: &str) -> E2bResult<i64> {
    v.parse::<i64>()
        .map_err(|_| E2bError::new(400, format!("{k}: expected Unix milliseconds, got {v:?}")))
}

fn limit_of(v: &str) -> E2bResult<usize> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n.min(MAX_LOG_PAGE)),
        _ => Err(E2bError::new(
            400,
            format!("limit: expected a positive integer, got {v:?}"),
        )),
    }
}

/// `GET /sandboxes/{id}/logs` → `SandboxLogs`.
pub async fn sandbox_logs_v1(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    RawQuery(q): RawQuery,
) -> E2bResult<Json<Value>> {
    let (mut start, mut limit) = (None, MAX_LOG_PAGE);
    for (k, v) in form_urlencoded::parse(q.as_deref().unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "start" if !v.is_empty() => start = Some(millis("start", &v)?),
            "limit" if !v.is_empty() => limit = limit_of(&v)?,
            _ => {}
        }
    }
    let lines: Vec<Line> = lines(&st, &caller, &id)
        .await?
        .into_iter()
        .filter(|l| start.is_none_or(|s| l.at.timestamp_millis() >= s))
        .take(limit)
        .collect();
    Ok(Json(json!({
        "logs": lines.iter().map(|l| json!({"timestamp": rfc3339(l.at), "line": l.message})).collect::<Vec<_>>(),
        "logEntries": lines.iter().map(entry_json).collect::<Vec<_>>(),
    })))
}

/// `GET /v2/sandboxes/{id}/logs` → `{logs: [SandboxLogEntry]}`.
pub async fn sandbox_logs_v2(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    RawQuery(q): RawQuery,
) -> E2bResult<Json<Value>> {
    let (mut cursor, mut limit, mut backward, mut min, mut search) =
        (None, MAX_LOG_PAGE, false, 0u8, None::<String>);
    for (k, v) in form_urlencoded::parse(q.as_deref().unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "cursor" if !v.is_empty() => cursor = Some(millis("cursor", &v)?),
            "limit" if !v.is_empty() => limit = limit_of(&v)?,
            "direction" => {
                backward = match v.as_ref() {
                    "forward" | "" => false,
                    "backward" => true,
                    other => {
                        return Err(E2bError::new(
                            400,
                            format!("direction: expected forward or backward, got {other:?}"),
                        ))
                    }
                }
            }
            "level" if !v.is_empty() => min = level_of(&v)?,
            "search" if !v.is_empty() => search = Some(v.into_owned()),
            _ => {}
        }
    }
    let mut lines: Vec<Line> = lines(&st, &caller, &id)
        .await?
        .into_iter()
        .filter(|l| l.level >= min)
        .filter(|l| search.as_deref().is_none_or(|s| l.message.contains(s)))
        .filter(|l| {
            cursor.is_none_or(|c| {
                let t = l.at.timestamp_millis();
                if backward {
                    t <= c
                } else {
                    t >= c
                }
            })
        })
        .collect();
    if backward {
        lines.reverse();
    }
    lines.truncate(limit);
    Ok(Json(json!({
        "logs": lines.iter().map(entry_json).collect::<Vec<_>>(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_split_into_lines_with_levels() {
        let at = chrono::Utc::now();
        let e = |stream, text: &str| LogEntry {
            seq: 1,
            at,
            exec: 2,
            stream,
            text: text.into(),
        };
        let mut out = Vec::new();
        push_lines(&mut out, &e(LogStream::Start, "echo a"));
        push_lines(&mut out, &e(LogStream::Stdout, "a\nb\r\npartial"));
        push_lines(&mut out, &e(LogStream::Stderr, "bad\n"));
        push_lines(&mut out, &e(LogStream::Exit, "exit 1"));
        let got: Vec<_> = out
            .iter()
            .map(|l| (LEVELS[l.level as usize], l.message.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("info", "started: echo a"),
                ("info", "a"),
                ("info", "b"),
                ("info", "partial"),
                ("error", "bad"),
                ("info", "exit 1"),
            ]
        );
        assert_eq!(entry_json(&out[4])["fields"]["stream"], "stderr");
        assert_eq!(entry_json(&out[4])["fields"]["exec"], "2");
        assert!(level_of("loud").is_err());
        assert!(limit_of("0").is_err());
        assert_eq!(limit_of("5000").unwrap(), MAX_LOG_PAGE);
    }
}
