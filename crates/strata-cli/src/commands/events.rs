//! `strata events [--sandbox ID] [--follow] [--after SEQ]`: the tenant's
//! journal (`GET /v1/events`, or one sandbox's), read as server-sent
//! events: the backlog after SEQ, then with `--follow` live until ^C (a
//! dropped connection is resumed with `Last-Event-ID`, docs/events.md).

use std::time::Duration;

use futures::StreamExt;
use reqwest::Method;
use serde_json::Value;

use super::Ctx;

/// `strata events`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only this sandbox's entries.
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Keep printing new entries until interrupted.
    #[arg(short, long)]
    pub follow: bool,
    /// Start after this journal seq (0: the oldest kept).
    #[arg(long, default_value_t = 0)]
    pub after: u64,
}

/// One message of the stream.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Message {
    /// `id:` (the journal seq).
    pub id: Option<u64>,
    /// `event:` (the kind).
    pub event: String,
    /// `data:` lines joined.
    pub data: String,
}

/// Splits complete messages off the front of `buf` (comments skipped).
pub fn parse(buf: &mut String) -> Vec<Message> {
    let mut out = Vec::new();
    while let Some(i) = buf.find("\n\n") {
        let block: String = buf.drain(..i + 2).collect();
        let mut m = Message::default();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("id:") {
                m.id = v.trim().parse().ok();
            } else if let Some(v) = line.strip_prefix("event:") {
                m.event = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                if !m.data.is_empty() {
                    m.data.push('\n');
                }
                m.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if !m.data.is_empty() {
            out.push(m);
        }
    }
    out
}

/// One line: `seq  time  kind  sandbox  what`.
pub fn describe(v: &Value) -> String {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let what = match s("kind").as_str() {
        "sandbox" => format!(
            "{} {} → {} ({}){}",
            s("op"),
            s("from_state"),
            s("to_state"),
            s("phase"),
            match s("detail").as_str() {
                "" => String::new(),
                d => format!(": {d}"),
            }
        ),
        "snapshot" => format!("snapshot {} {}", s("action"), s("snapshot_id")),
        "approval" => match s("action").as_str() {
            "requested" => format!(
                "approval {} requested by {}: {}",
                s("approval_id"),
                s("requested_by"),
                s("summary")
            ),
            _ => format!(
                "approval {} {} by {}",
                s("approval_id"),
                s("decision"),
                s("by")
            ),
        },
        "policy" => format!(
            "policy {} {}{}",
            s("decision"),
            s("summary"),
            match v.get("count").and_then(Value::as_u64) {
                Some(n) if n > 1 => format!(" (×{n})"),
                _ => String::new(),
            }
        ),
        other => other.to_owned(),
    };
    format!(
        "{:>6}  {}  {:<8}  {}  {what}",
        v.get("seq").and_then(Value::as_i64).unwrap_or(0),
        s("at"),
        s("kind"),
        match s("sandbox_id").as_str() {
            "" => "-".to_owned(),
            sb => sb.to_owned(),
        },
    )
}

/// Runs `strata events`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let segments: Vec<&str> = match &a.sandbox {
        Some(id) => vec!["v1", "sandboxes", id, "events"],
        None => vec!["v1", "events"],
    };
    let mut last = a.after;
    loop {
        let after = last.to_string();
        let follow = if a.follow { "true" } else { "false" };
        let url = client.url(&segments, &[("after", &after), ("follow", follow)]);
        let rb = client
            .request(Method::GET, url)
            .header("accept", "text/event-stream");
        let resp = match client.send(rb).await {
            Ok(r) => r,
            Err(e) if a.follow && last > a.after => {
                eprintln!("strata: event stream: {e}; reconnecting");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let mut stream = resp.bytes_stream();
        let mut buf = String::new();
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else { break };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            for m in parse(&mut buf) {
                if let Some(id) = m.id {
                    last = last.max(id);
                }
                let v: Value = serde_json::from_str(&m.data).unwrap_or(Value::Null);
                ctx.emit(&v, || Ok(describe(&v)))?;
            }
        }
        if !a.follow {
            return Ok(0);
        }
        // The daemon closed the stream (a restart, a slow read): resume.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_split_and_comments_skipped() {
        let mut b = String::from(
            ": heartbeat\n\nid: 7\nevent: sandbox\ndata: {\"seq\":7}\n\nid: 8\nevent: pol",
        );
        let m = parse(&mut b);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].id, Some(7));
        assert_eq!(m[0].event, "sandbox");
        assert_eq!(m[0].data, "{\"seq\":7}");
        assert_eq!(b, "id: 8\nevent: pol");
    }

    #[test]
    fn lines_say_what_happened() {
        let v = serde_json::json!({"seq": 3, "at": "t", "kind": "approval", "sandbox_id": "sb-1",
            "action": "requested", "approval_id": "a", "requested_by": "token:tok-1", "summary": "exec curl"});
        let l = describe(&v);
        assert!(
            l.contains("approval a requested by token:tok-1: exec curl"),
            "{l}"
        );
    }
}
