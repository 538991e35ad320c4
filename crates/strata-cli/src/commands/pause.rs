//! `strata pause ID`: stop a sandbox's vCPUs (its RAM stays).

use super::{sandbox_line, Ctx};

/// `strata pause`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
}

/// Runs `strata pause`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes", &a.id, "pause"], &serde_json::json!({}))
        .await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
}
