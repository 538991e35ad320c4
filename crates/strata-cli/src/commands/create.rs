//! `strata create`: a new sandbox, forked from a template.

use serde_json::{json, Value};

use super::{key_value, sandbox_line, size_json, Ctx};
use crate::human::duration_arg;

/// `strata create`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Template id [default: the newest ready template].
    #[arg(long)]
    pub template: Option<String>,
    /// Virtual CPUs [default: the template's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub vcpus: Option<u32>,
    /// Memory in MiB [default: the template's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub memory: Option<u32>,
    /// Disk in GiB [default: the template's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub disk: Option<u32>,
    /// Label (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Hibernate after this long without activity, e.g. 30m (0 = never).
    #[arg(long, value_parser = duration_arg)]
    pub idle_timeout: Option<String>,
    /// Rolling snapshot interval, e.g. 60s (0 = off).
    #[arg(long, value_parser = duration_arg)]
    pub snapshot_interval: Option<String>,
}

/// The `POST /v1/sandboxes` body.
pub fn body(a: &Args) -> Value {
    let mut b = json!({
        "size": size_json(a.vcpus, a.memory, a.disk),
        "labels": super::string_map(&a.labels),
    });
    if let Some(t) = &a.template {
        b["template"] = t.clone().into();
    }
    if let Some(t) = &a.idle_timeout {
        b["idle_timeout"] = t.clone().into();
    }
    if let Some(t) = &a.snapshot_interval {
        b["snapshot_interval"] = t.clone().into();
    }
    b
}

/// Runs `strata create`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes"], &body(&a))
        .await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_only_what_was_given() {
        let a = Args {
            template: None,
            vcpus: Some(2),
            memory: None,
            disk: None,
            labels: vec![("k".into(), "v".into())],
            idle_timeout: Some("30m".into()),
            snapshot_interval: None,
        };
        assert_eq!(
            body(&a),
            json!({"size": {"vcpus": 2}, "labels": {"k": "v"}, "idle_timeout": "30m"})
        );
    }
}
