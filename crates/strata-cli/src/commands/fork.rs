//! `strata fork ID|SNAP`: a new sandbox from a sandbox's present state or from
//! a snapshot.

use serde_json::{json, Value};

use super::{key_value, sandbox_line, size_json, Ctx};
use crate::human::duration_arg;

/// `strata fork`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A sandbox id (`sb-…`: its present state) or a snapshot id (`snap-…`).
    pub source: String,
    /// Virtual CPUs [default: the source's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub vcpus: Option<u32>,
    /// Memory in MiB [default: the source's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub memory: Option<u32>,
    /// Disk in GiB [default: the source's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub disk: Option<u32>,
    /// Label of the new sandbox (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Idle timeout of the new sandbox, e.g. 30m.
    #[arg(long, value_parser = duration_arg)]
    pub idle_timeout: Option<String>,
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
    let mut body = json!({
        "size": size_json(a.vcpus, a.memory, a.disk),
        "labels": super::string_map(&a.labels),
    });
    if let Some(t) = &a.idle_timeout {
        body["idle_timeout"] = Value::from(t.clone());
    }
    let v = ctx.client()?.post_call(&route(&a.source), &body).await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
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
