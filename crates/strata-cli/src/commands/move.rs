//! `strata move ID --host H [--wake]`: move a sandbox to another host of
//! the same cluster (docs/move.md, "Inside a cluster"). Its owner
//! hibernates it if it runs (memory kept), sends the snapshots the target
//! lacks and hands its lease over; the target wakes it when it was running
//! (or with `--wake`). Same id, same record; any host's API answers.

use super::Ctx;

/// Arguments of `strata move`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// The target host's id (as the cluster registered it).
    #[arg(long)]
    pub host: String,
    /// Wake it on the target even if it was not running.
    #[arg(long)]
    pub wake: bool,
}

/// Runs `strata move`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let mut body = serde_json::json!({ "host": a.host });
    if a.wake {
        body["wake"] = serde_json::Value::Bool(true);
    }
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes", a.id.as_str(), "move"], &body)
        .await?;
    ctx.emit(&v, || {
        let sent = v["sent"].as_array().map(Vec::len).unwrap_or(0);
        Ok(format!(
            "moved {} from {} to {} in {} ms: {} snapshots sent ({} bytes), {} already there; it is {} there",
            a.id,
            v["from"].as_str().unwrap_or("?"),
            v["to"].as_str().unwrap_or("?"),
            v["millis"].as_u64().unwrap_or(0),
            sent,
            v["bytes"].as_u64().unwrap_or(0),
            v["held"].as_u64().unwrap_or(0),
            v["sandbox"]["state"].as_str().unwrap_or("?"),
        ))
    })?;
    Ok(0)
}
