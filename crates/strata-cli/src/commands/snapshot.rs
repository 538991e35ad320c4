//! `strata snapshot ID [--label L]`: take a snapshot now.

use serde_json::json;

use super::Ctx;
use crate::human;
use crate::views::{view, Snapshot};

/// `strata snapshot`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// Free-form label.
    #[arg(long)]
    pub label: Option<String>,
}

/// Runs `strata snapshot`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let body = match &a.label {
        Some(l) => json!({ "label": l }),
        None => json!({}),
    };
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes", &a.id, "snapshots"], &body)
        .await?;
    ctx.emit(&v, || {
        let s: Snapshot = view(&v)?;
        let mut line = format!("{}  {}", s.id, s.kind);
        if let Some(ms) = s.pause_ms {
            line.push_str(&format!("  paused {} ms", human::ms(ms)));
        }
        if let Some(l) = &s.label {
            line.push_str(&format!("  {l:?}"));
        }
        Ok(line)
    })?;
    Ok(0)
}
