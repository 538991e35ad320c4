//! `strata hibernate ID [--no-memory]`: snapshot a sandbox and stop its VM
//! (`--no-memory`: of its disk alone; the wake cold-boots it).

use super::Ctx;

/// Arguments of `strata hibernate`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// Keep the disk only (file systems synced and frozen first): the wake
    /// cold-boots the sandbox; its processes are gone.
    #[arg(long)]
    pub no_memory: bool,
}

/// Runs `strata hibernate`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let segments = ["v1", "sandboxes", a.id.as_str(), "hibernate"];
    let body = if a.no_memory {
        serde_json::json!({"memory": false})
    } else {
        serde_json::json!({})
    };
    super::post_for_sandbox(ctx, &segments, &body).await
}
