//! `strata pull ID --from URL --token-file FILE [--wake]`: copy a sandbox
//! of another deployment here (docs/move.md). This daemon is the client of
//! the remote (a laptop reaches the cloud, not the reverse): the remote
//! hibernates the sandbox (memory kept) and streams the snapshots this
//! deployment lacks; the copy is registered here hibernated (running with
//! `--wake`), owned by this CLI's tenant. Pulling again into that copy adds
//! the remote's newer snapshots (incremental). `strata resume` wakes it.

use super::Ctx;

/// Arguments of `strata pull`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The sandbox's id on the remote (the copy here keeps it).
    pub id: String,
    /// The remote deployment's API base URL (`https://host:7070`).
    #[arg(long)]
    pub from: String,
    /// A file holding a token of the remote deployment (its first line)
    /// that may export the sandbox there.
    #[arg(long)]
    pub token_file: std::path::PathBuf,
    /// Wake the copy here once it is pulled.
    #[arg(long)]
    pub wake: bool,
}

/// Runs `strata pull`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let token = super::push::read_token_file(&a.token_file)?;
    let body = serde_json::json!({
        "from": a.from,
        "token": token,
        "sandbox": a.id,
        "wake": a.wake,
    });
    let v = ctx.client()?.post_call(&["v1", "pulls"], &body).await?;
    ctx.emit(&v, || {
        let got = v["received"].as_array().map(Vec::len).unwrap_or(0);
        Ok(format!(
            "{}\t{}\npulled from {}: {} snapshots received ({} bytes), {} already here{}",
            v["sandbox"]["id"].as_str().unwrap_or(&a.id),
            v["sandbox"]["state"].as_str().unwrap_or("?"),
            a.from,
            got,
            v["bytes"].as_u64().unwrap_or(0),
            v["held"].as_u64().unwrap_or(0),
            if v["updated"].as_bool() == Some(true) {
                " (an earlier copy brought up to date)"
            } else {
                ""
            },
        ))
    })?;
    Ok(0)
}
