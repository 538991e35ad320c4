//! `strata resume ID`: continue a paused sandbox or wake a hibernated one.

use super::Ctx;
pub use super::SandboxArg as Args;

/// Runs `strata resume`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::sandbox_action(ctx, &a.id, "resume").await
}
