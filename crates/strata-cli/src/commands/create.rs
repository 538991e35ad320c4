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
    /// Replicate its snapshots to another host of the cluster, to recover
    /// it there if its host is lost (docs/cluster.md "Replicas").
    #[arg(long)]
    pub replicate: bool,
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
    if a.replicate {
        b["replicate"] = true.into();
    }
    b
}

/// Runs `strata create`. A size the template has no variant of yet is
/// answered `202 {"status": "building", "variant"}`: the variant's build is
/// followed (its steps on stderr) and the create sent again once it is
/// built (global `--no-wait`: the answer is printed instead).
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let body = body(&a);
    loop {
        let v = client.post_call(&["v1", "sandboxes"], &body).await?;
        if v.get("status").and_then(Value::as_str) != Some("building") {
            ctx.emit(&v, || super::sandbox_line(&v))?;
            return Ok(0);
        }
        if ctx.no_wait {
            ctx.emit(&v, || {
                Ok(format!(
                    "building {}: {}",
                    v["variant"]["id"].as_str().unwrap_or("?"),
                    v["message"].as_str().unwrap_or("")
                ))
            })?;
            return Ok(0);
        }
        let id = v["variant"]["id"].as_str().unwrap_or_default().to_owned();
        if id.is_empty() {
            anyhow::bail!("the daemon answered 202 without the variant it builds: {v}");
        }
        let var = &v["variant"];
        eprintln!(
            "strata: building {id}, the {} vCPU / {} MiB variant of template {} (once: later creates of this size fork it)",
            var["size"]["vcpus"],
            var["size"]["memory_mib"],
            var["variant_of"].as_str().unwrap_or("?")
        );
        let (_, t) = super::template::follow_build(ctx, &client, &id, 3600, true).await?;
        if t.status == "failed" {
            return Err(super::CliError::OperationFailed(format!(
                "the size variant {id} failed to build: {}",
                t.status_reason.as_deref().unwrap_or("no reason given")
            ))
            .into());
        }
    }
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
            replicate: false,
        };
        assert_eq!(
            body(&a),
            json!({"size": {"vcpus": 2}, "labels": {"k": "v"}, "idle_timeout": "30m"})
        );
        let a = Args {
            replicate: true,
            ..a
        };
        assert_eq!(body(&a)["replicate"], json!(true));
    }
}
