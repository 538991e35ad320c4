//! `strata logs ID`: what the sandbox's commands printed, from the
//! daemon's process log (`GET /v1/sandboxes/{id}/logs`); `-f` keeps
//! polling for new entries until interrupted.

use serde::Deserialize;
use std::io::Write;

use super::Ctx;

/// `strata logs ID`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The sandbox.
    pub id: String,
    /// Keep printing new entries (polls every 500 ms) until ^C.
    #[arg(short, long)]
    pub follow: bool,
    /// Start after this cursor (an entry's `seq`; 0: the oldest kept).
    #[arg(long, default_value_t = 0)]
    pub after: u64,
}

/// One entry of `GET /v1/sandboxes/{id}/logs`.
#[derive(Debug, Clone, Deserialize)]
pub struct Entry {
    /// When.
    pub at: chrono::DateTime<chrono::Utc>,
    /// Exec number in the sandbox.
    pub exec: u64,
    /// start | stdout | stderr | exit.
    pub stream: String,
    /// Text.
    pub text: String,
}

/// A page of `GET /v1/sandboxes/{id}/logs`.
#[derive(Debug, Clone, Deserialize)]
pub struct Page {
    /// Entries, oldest first.
    pub entries: Vec<Entry>,
    /// Cursor of the next page.
    pub next: u64,
    /// Entries dropped by the daemon's cap so far.
    #[serde(default)]
    pub dropped: u64,
}

/// The human form of entries: command starts and exits as `[#n ...]`
/// lines, output as it came (stderr to stderr).
pub fn render(
    entries: &[Entry],
    out: &mut impl Write,
    err: &mut impl Write,
) -> std::io::Result<()> {
    for e in entries {
        match e.stream.as_str() {
            "stdout" => out.write_all(e.text.as_bytes())?,
            "stderr" => err.write_all(e.text.as_bytes())?,
            "start" => writeln!(
                out,
                "[#{} {} $ {}]",
                e.exec,
                e.at.format("%H:%M:%S"),
                e.text
            )?,
            _ => writeln!(out, "[#{} {}]", e.exec, e.text)?,
        }
    }
    out.flush()?;
    err.flush()
}

/// Runs `strata logs`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let mut after = a.after;
    let mut warned = 0;
    loop {
        let v = client
            .get(
                &["v1", "sandboxes", &a.id, "logs"],
                &[("after", &after.to_string()), ("limit", "1000")],
            )
            .await?;
        if ctx.json && !a.follow {
            ctx.emit(&v, || Ok(String::new()))?;
            return Ok(0);
        }
        let page: Page = serde_json::from_value(v.clone())?;
        if ctx.json {
            for e in v["entries"].as_array().into_iter().flatten() {
                println!("{e}");
            }
        } else {
            if page.dropped > warned && after == 0 {
                eprintln!(
                    "(the {} oldest entries were dropped by the daemon's cap)",
                    page.dropped
                );
                warned = page.dropped;
            }
            render(
                &page.entries,
                &mut std::io::stdout(),
                &mut std::io::stderr(),
            )?;
        }
        let more = page.entries.len() == 1000;
        after = page.next;
        if more {
            continue;
        }
        if !a.follow {
            return Ok(0);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_starts_output_and_exits() {
        let page: Page = serde_json::from_str(
            r#"{"entries":[
              {"at":"2026-12-01T10:00:00Z","exec":1,"stream":"start","text":"echo hi"},
              {"at":"2026-12-01T10:00:00Z","exec":1,"stream":"stdout","text":"hi\n"},
              {"at":"2026-12-01T10:00:00Z","exec":1,"stream":"stderr","text":"oops\n"},
              {"at":"2026-12-01T10:00:01Z","exec":1,"stream":"exit","text":"exit 0"}
            ],"next":4,"dropped":0,"sandbox_id":"sb-x"}"#,
        )
        .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        render(&page.entries, &mut out, &mut err).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[#1 10:00:00 $ echo hi]\nhi\n[#1 exit 0]\n"
        );
        assert_eq!(String::from_utf8(err).unwrap(), "oops\n");
        assert_eq!(page.next, 4);
    }
}
