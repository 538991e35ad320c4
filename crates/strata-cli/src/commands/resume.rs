//! `strata resume ID`: continue a paused sandbox or wake a hibernated one.

use super::{sandbox_line, Ctx};

/// `strata resume`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
}

/// Runs `strata resume`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .post_call(
            &["v1", "sandboxes", &a.id, "resume"],
            &serde_json::json!({}),
        )
        .await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
}
