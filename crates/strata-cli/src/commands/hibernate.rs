//! `strata hibernate ID`: snapshot a sandbox and stop its VM.

use super::{sandbox_line, Ctx};

/// `strata hibernate`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
}

/// Runs `strata hibernate`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .post_call(
            &["v1", "sandboxes", &a.id, "hibernate"],
            &serde_json::json!({}),
        )
        .await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
}
