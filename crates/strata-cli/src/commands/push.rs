//! `strata push ID --to URL --token-file FILE [--wake]`: move a sandbox to
//! another deployment (docs/move.md). The daemon hibernates it if it runs
//! (memory kept), streams the snapshots the remote lacks and registers it
//! there, hibernated (running with `--wake`), owned by the remote token's
//! tenant; the source stays here, hibernated.

use anyhow::Context as _;

use super::Ctx;

/// Arguments of `strata push`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// The remote deployment's API base URL (`https://host:7070`).
    #[arg(long)]
    pub to: String,
    /// A file holding a token of the remote deployment (its first line).
    #[arg(long)]
    pub token_file: std::path::PathBuf,
    /// Wake the copy on the remote once it is there.
    #[arg(long)]
    pub wake: bool,
}

/// The token in the first line of `path` (a remote deployment's).
pub(crate) fn read_token_file(path: &std::path::Path) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim();
    anyhow::ensure!(
        !token.is_empty(),
        "{}: no token in the file",
        path.display()
    );
    Ok(token.to_owned())
}

/// Runs `strata push`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let token = read_token_file(&a.token_file)?;
    let body = serde_json::json!({ "to": a.to, "token": token, "wake": a.wake });
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes", a.id.as_str(), "push"], &body)
        .await?;
    ctx.emit(&v, || {
        let sent = v["sent"].as_array().map(Vec::len).unwrap_or(0);
        Ok(format!(
            "pushed {} to {}: {} snapshots sent ({} bytes), {} already there; there it is {}; here it stays hibernated",
            a.id,
            a.to,
            sent,
            v["bytes"].as_u64().unwrap_or(0),
            v["held"].as_u64().unwrap_or(0),
            v["remote"]["state"].as_str().unwrap_or("?"),
        ))
    })?;
    Ok(0)
}
