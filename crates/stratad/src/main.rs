//! `stratad`: the strata daemon binary. See the library crate for the parts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use stratad::config::Config;
use stratad::engine::unavailable::UnavailableEngine;
use stratad::retention::RetentionPolicy;

/// strata daemon: HTTP API, rolling snapshots, retention, recovery.
#[derive(Debug, Parser)]
#[command(name = "stratad", version)]
struct Args {
    /// TOML configuration file (the built-in defaults: `--print-default-config`).
    #[arg(long, env = "STRATAD_CONFIG")]
    config: Option<PathBuf>,
    /// Address of the HTTP API.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// State directory (SQLite db, pool.img, pool mount, run dir).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Accelerator: auto, kvm or tcg.
    #[arg(long)]
    accel: Option<strata_core::Accel>,
    /// Rolling snapshot interval, e.g. 60s ("0s" = off).
    #[arg(long)]
    snapshot_interval: Option<String>,
    /// Idle timeout before hibernation, e.g. 30m ("0s" = never).
    #[arg(long)]
    idle_timeout: Option<String>,
    /// Retention tiers, WITHIN:EVERY pairs, e.g. "1h:0,24h:10m,7d:1h".
    #[arg(long)]
    retention: Option<String>,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Print the built-in configuration and exit.
    #[arg(long)]
    print_default_config: bool,
}

fn config(args: &Args) -> anyhow::Result<Config> {
    let mut cfg = match &args.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    if let Some(v) = args.listen {
        cfg.listen = v;
    }
    if let Some(v) = &args.data_dir {
        cfg.data_dir = v.clone();
    }
    if let Some(v) = args.accel {
        cfg.accel = v;
    }
    if let Some(v) = &args.snapshot_interval {
        cfg.snapshot_interval =
            stratad::duration::parse_duration(v).context("--snapshot-interval")?;
    }
    if let Some(v) = &args.idle_timeout {
        cfg.idle_timeout = stratad::duration::parse_duration(v).context("--idle-timeout")?;
    }
    if let Some(v) = &args.retention {
        cfg.retention = RetentionPolicy::parse(v)
            .map_err(anyhow::Error::msg)
            .context("--retention")?;
    }
    cfg.validate()?;
    Ok(cfg)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
    tracing::info!("shutting down (VMs keep running)");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", stratad::config::DEFAULT_TOML);
        return Ok(());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if args.log_format == "json" {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let cfg = config(&args)?;
    let listen = cfg.listen;
    // The runtime-backed engine plugs in here once strata-runtime lands.
    let engine = Arc::new(UnavailableEngine);
    tracing::warn!("no sandbox runtime linked: VM operations will fail");
    let app = stratad::App::open(cfg, engine).context("opening the metadata store")?;
    let report = app
        .start()
        .await
        .map_err(|e| anyhow::anyhow!(e.message()))
        .context("recovery")?;
    tracing::info!(report = %serde_json::to_string(&report).unwrap_or_default(), "recovered");
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    tracing::info!(%listen, "stratad listening");
    stratad::serve(&app, listener, shutdown_signal())
        .await
        .context("serving")?;
    Ok(())
}
