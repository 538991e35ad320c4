//! `strata create`: a new sandbox, forked from a template.

use serde_json::Value;

use super::{size_defaults, Ctx, NewSandboxArgs};
use crate::human::duration_arg;

/// `strata create`
#[derive(Debug, clap::Args)]
#[command(mut_args(size_defaults("the template's")))]
pub struct Args {
    /// Template id [default: the newest ready template].
    #[arg(long)]
    pub template: Option<String>,
    /// Size, labels, idle timeout.
    #[command(flatten)]
    pub sandbox: NewSandboxArgs,
    /// Rolling snapshot interval, e.g. 60s (0 = off).
    #[arg(long, value_parser = duration_arg)]
    pub snapshot_interval: Option<String>,
}

/// The `POST /v1/sandboxes` body.
pub fn body(a: &Args) -> Value {
    let mut b = a.sandbox.body();
    if let Some(t) = &a.template {
        b["template"] = t.clone().into();
    }
    if let Some(t) = &a.snapshot_interval {
        b["snapshot_interval"] = t.clone().into();
    }
    b
}

/// Runs `strata create`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    super::post_for_sandbox(ctx, &["v1", "sandboxes"], &body(&a)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::SizeArgs;
    use serde_json::json;

    #[test]
    fn body_has_only_what_was_given() {
        let a = Args {
            template: None,
            sandbox: NewSandboxArgs {
                size: SizeArgs {
                    vcpus: Some(2),
                    memory: None,
                    disk: None,
                },
                labels: vec![("k".into(), "v".into())],
                idle_timeout: Some("30m".into()),
            },
            snapshot_interval: None,
        };
        assert_eq!(
            body(&a),
            json!({"size": {"vcpus": 2}, "labels": {"k": "v"}, "idle_timeout": "30m"})
        );
    }
}
