//! `strata hibernate ID`: snapshot a sandbox and stop its VM.

use super::Ctx;
pub use super::SandboxArg as Args;

/// Runs `strata hibernate`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::sandbox_action(ctx, &a.id, "hibernate").await
}
