//! `strata fork ID|SNAP`: a new sandbox from a sandbox's present state or from
//! a snapshot.

use super::{size_defaults, Ctx, NewSandboxArgs};

/// `strata fork`
#[derive(Debug, clap::Args)]
#[command(
    mut_args(size_defaults("the source's")),
    mut_arg("labels", |a| a.help("Label of the new sandbox (repeatable)")),
    mut_arg("idle_timeout", |a| a.help("Idle timeout of the new sandbox, e.g. 30m"))
)]
pub struct Args {
    /// A sandbox id (`sb-…`: its present state) or a snapshot id (`snap-…`).
    pub source: String,
    /// Size, labels, idle timeout.
    #[command(flatten)]
    pub sandbox: NewSandboxArgs,
}

/// The route for a source id: snapshots under `/v1/snapshots`, else sandboxes.
pub fn route(source: &str) -> [&str; 4] {
    if source.starts_with(strata_core::SnapshotId::PREFIX) {
        ["v1", "snapshots", source, "fork"]
    } else {
        ["v1", "sandboxes", source, "fork"]
    }
}

/// Runs `strata fork`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::post_for_sandbox(ctx, &route(&a.source), &a.sandbox.body()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_id_kind() {
        assert_eq!(route("snap-abc")[1], "snapshots");
        assert_eq!(route("sb-abc")[1], "sandboxes");
    }
}
