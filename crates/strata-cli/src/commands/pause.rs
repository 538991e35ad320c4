//! `strata pause ID`: stop a sandbox's vCPUs (its RAM stays).

use super::Ctx;
pub use super::SandboxArg as Args;

/// Runs `strata pause`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::sandbox_action(ctx, &a.id, "pause").await
}
