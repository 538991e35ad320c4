//! `strata rm ID…`: delete sandboxes.

use super::{sandbox_line, Ctx};

/// `strata rm`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox ids.
    #[arg(required = true)]
    pub ids: Vec<String>,
}

/// Runs `strata rm`; stops at the first failure.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::delete_each(ctx, "sandboxes", &a.ids, |id, v| {
        sandbox_line(v).unwrap_or_else(|_| id.to_owned())
    })
    .await
}
