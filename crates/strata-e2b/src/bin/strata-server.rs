//! `strata-server`: stratad plus the E2B-compatible front door on the same
//! listener. Takes every `stratad` flag, and:
//!
//! - `--e2b-api-key KEY` (repeatable; env `STRATA_E2B_API_KEYS`, comma
//!   separated): accepted `X-API-KEY` values of the E2B control plane
//!   (tenant `default`, role developer), besides strata API tokens
//!   (`strata_…`, their own tenant and role);
//! - `--e2b-token-secret-file PATH` (default `<data-dir>/e2b.secret`, created
//!   with mode 0600 on first start): the secret per-sandbox envd access tokens
//!   are derived from, so they stay valid across restarts.
//!
//! Point the SDK at it with `E2B_API_URL=http://HOST:PORT`,
//! `E2B_SANDBOX_URL=http://HOST:PORT` and `E2B_API_KEY=KEY`.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "strata-server", version)]
struct ServerArgs {
    #[command(flatten)]
    daemon: stratad::cli::Args,
    /// Accepted E2B API keys (X-API-KEY) besides strata API tokens. Empty
    /// with `[security] auth = false`: the E2B control plane is open to
    /// anyone who can reach the listener (local development only).
    #[arg(
        long = "e2b-api-key",
        env = "STRATA_E2B_API_KEYS",
        value_delimiter = ','
    )]
    e2b_api_keys: Vec<String>,
    /// File holding the envd token secret [default: <data-dir>/e2b.secret].
    #[arg(long)]
    e2b_token_secret_file: Option<PathBuf>,
}

/// Reads the secret, creating it (32 random bytes, hex, mode 0600) if absent.
fn token_secret(path: &Path) -> anyhow::Result<Vec<u8>> {
    if let Ok(text) = std::fs::read_to_string(path) {
        let s = text.trim();
        anyhow::ensure!(
            s.len() >= 32,
            "{} holds a secret that is too short",
            path.display()
        );
        return Ok(s.as_bytes().to_vec());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let secret = hex::encode(rand::random::<[u8; 32]>());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    f.write_all(secret.as_bytes())?;
    f.sync_all()?;
    Ok(secret.into_bytes())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ServerArgs::parse();
    let data_dir = match &args.daemon.data_dir {
        Some(d) => d.clone(),
        None => stratad::cli::config(&args.daemon)?.data_dir,
    };
    let secret_path = args
        .e2b_token_secret_file
        .clone()
        .unwrap_or_else(|| data_dir.join("e2b.secret"));
    let cfg = strata_e2b::E2bConfig {
        api_keys: args.e2b_api_keys.clone(),
        token_secret: token_secret(&secret_path)?,
        ..Default::default()
    };
    stratad::cli::main_with(
        args.daemon,
        Some(Box::new(move |svc, sec| {
            let auth = sec.as_ref().is_some_and(|s| s.config().auth);
            if cfg.api_keys.is_empty() && !auth {
                eprintln!("strata-server: no --e2b-api-key and no strata authentication: the E2B control plane accepts any key");
            }
            strata_e2b::router(svc, sec, cfg)
        })),
    )
    .await
}
