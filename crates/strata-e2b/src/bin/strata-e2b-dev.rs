//! `strata-e2b-dev`: a development daemon for the E2B tests. It builds
//! stratad's `App` over the real runtime (QEMU guests, a btrfs pool in a
//! loop-mounted image file, the test image of `strata-testkit`) and serves
//! stratad's API with the E2B router merged in, until SIGINT/SIGTERM. VMs
//! are left running on exit (as stratad does); the test script kills them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use stratad::config::Config;
use stratad::App;

#[derive(Debug, Parser)]
#[command(name = "strata-e2b-dev")]
struct Args {
    /// Address to serve stratad's API and the E2B API on.
    #[arg(long, default_value = "127.0.0.1:49983")]
    listen: SocketAddr,
    /// State directory (SQLite, pool.img, pool mount).
    #[arg(long)]
    data_dir: PathBuf,
    /// Run directory (VM sockets and pid files; keep it short).
    #[arg(long)]
    run_dir: PathBuf,
    /// Pool image size in GiB.
    #[arg(long, default_value_t = 8)]
    pool_size_gib: u64,
    /// Guest image directory [default: strata-testkit's test image].
    #[arg(long)]
    image_dir: Option<PathBuf>,
    /// Accelerator (tcg on this machine).
    #[arg(long, default_value = "tcg")]
    accel: strata_core::Accel,
    /// Accepted E2B API keys (repeatable; none: open).
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// Hex secret for envd access tokens [default: random].
    #[arg(long)]
    token_secret: Option<String>,
    /// Rolling snapshot interval, e.g. 60s ("0s": off).
    #[arg(long, default_value = "0s")]
    snapshot_interval: String,
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let args = Args::parse();
    let image_dir = match args.image_dir {
        Some(d) => d,
        None => tokio::task::spawn_blocking(|| strata_testkit::test_image().dir.clone())
            .await
            .context("building the test image")?,
    };
    let cfg = Config {
        listen: args.listen,
        data_dir: args.data_dir,
        run_dir: args.run_dir,
        pool_size_gib: args.pool_size_gib,
        image_dir: Some(image_dir),
        accel: args.accel,
        snapshot_interval: stratad::duration::parse_duration(&args.snapshot_interval)
            .context("--snapshot-interval")?,
        agent_timeout: Duration::from_secs(120),
        ..Config::default()
    };
    cfg.validate()?;
    let engine = stratad::daemon::open_engine(&cfg).await?;
    let app = App::open(cfg, engine.clone())?;
    app.start()
        .await
        .map_err(|e| anyhow::anyhow!("recovery failed: {}", e.message()))?;
    if let Err(e) = app.service().ensure_default_template().await {
        tracing::warn!(error = %e.message(), "cannot start the default template build");
    }
    let mut e2b = strata_e2b::E2bConfig {
        api_keys: args.api_keys,
        ..strata_e2b::E2bConfig::default()
    };
    if let Some(s) = args.token_secret {
        e2b.token_secret = hex::decode(s).context("--token-secret: hex")?;
    }
    let router = app.router().merge(strata_e2b::router(
        app.service().clone(),
        app.security().cloned(),
        e2b,
    ));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %args.listen, "strata-e2b-dev listening");
    let result = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    app.stop();
    engine.runtime().detach_all();
    result.context("serving")?;
    Ok(())
}
