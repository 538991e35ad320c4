//! The `stratad` command line: the flags, the configuration they describe
//! (file, then flags on top) and the daemon's `main`. The `stratad` binary
//! (crate `strata-daemon`, which links the front doors such as the E2B API)
//! calls [`main_with_doors`]; `strata serve` executes that binary.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::Config;
use crate::retention::RetentionPolicy;
use anyhow::Context;

/// strata daemon: HTTP API, rolling snapshots, retention, recovery.
#[derive(Debug, clap::Parser)]
#[command(name = "stratad", version)]
pub struct Args {
    /// TOML configuration file (the built-in defaults: `--print-default-config`).
    #[arg(long, env = "STRATAD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address of the HTTP API.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// State directory (SQLite db, pool.img, pool mount).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Use this existing btrfs directory as the pool instead of `<data-dir>/pool.img`.
    #[arg(long)]
    pub pool_path: Option<PathBuf>,
    /// Size of `<data-dir>/pool.img` (sparse) in GiB.
    #[arg(long)]
    pub pool_size_gib: Option<u64>,
    /// Directory for per-VM sockets and pid files (short: unix socket paths).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Key store directory (master key; keep it outside the data dir)
    /// [default: /etc/strata/keys].
    #[arg(long)]
    pub key_dir: Option<PathBuf>,
    /// Guest image directory [default: newest in the image cache].
    #[arg(long)]
    pub image_dir: Option<PathBuf>,
    /// QEMU binary.
    #[arg(long)]
    pub qemu: Option<PathBuf>,
    /// How long to wait for a guest agent after boot/restore, e.g. 60s.
    #[arg(long)]
    pub agent_timeout: Option<String>,
    /// Do not build the default template on first start.
    #[arg(long)]
    pub no_default_template: bool,
    /// Accelerator: auto, kvm or tcg.
    #[arg(long)]
    pub accel: Option<strata_core::Accel>,
    /// Rolling snapshot interval, e.g. 60s ("0s" = off).
    #[arg(long)]
    pub snapshot_interval: Option<String>,
    /// Idle timeout before hibernation, e.g. 30m ("0s" = never).
    #[arg(long)]
    pub idle_timeout: Option<String>,
    /// Retention tiers, WITHIN:EVERY pairs, e.g. "1h:0,24h:10m,7d:1h".
    #[arg(long)]
    pub retention: Option<String>,
    /// API authentication: `on` (Bearer tokens; default) or `off` (local
    /// development only: every caller is an admin of tenant `default`).
    #[arg(long, env = "STRATAD_AUTH", value_parser = ["on", "off"])]
    pub auth: Option<String>,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Serve the E2B-compatible API (control plane and envd) on the same
    /// listener (config: `[e2b] enabled = true`).
    #[arg(long, help_heading = "E2B front door")]
    pub e2b: bool,
    /// Accepted E2B API keys (X-API-KEY) besides strata API tokens;
    /// repeatable (config: `[e2b] api_keys`). None with `--auth off`: the E2B
    /// control plane is open to anyone who can reach the listener.
    #[arg(
        long = "e2b-api-key",
        env = "STRATA_E2B_API_KEYS",
        value_delimiter = ',',
        help_heading = "E2B front door"
    )]
    pub e2b_api_keys: Vec<String>,
    /// File holding the envd token secret [default: <data-dir>/e2b.secret]
    /// (config: `[e2b] token_secret_file`).
    #[arg(long, help_heading = "E2B front door")]
    pub e2b_token_secret_file: Option<PathBuf>,
    /// Also serve routed hosts (and every route) over TLS on this address,
    /// certificates from the daemon's local CA (`strata ca`) (config:
    /// `[e2b] tls_listen`).
    #[arg(long, help_heading = "E2B front door")]
    pub e2b_tls_listen: Option<std::net::SocketAddr>,
    /// The metadata store (`[store] url`, docs/store.md): `postgresql://…`
    /// or `sqlite:PATH`. Give a URL with a password through the environment
    /// (a Kubernetes Secret, docs/kubernetes.md), never as a flag: a flag is
    /// visible to every local user in the process list.
    #[arg(long, env = "STRATAD_STORE_URL", hide_env_values = true)]
    pub store_url: Option<String>,
    /// This daemon's role in a cluster (`[cluster] role`): `host` runs VMs;
    /// `api` is an API-only process (no pool, no QEMU) that forwards VM
    /// operations to the hosts (docs/cluster.md, "API processes"). Needs
    /// `[cluster] enabled` and a PostgreSQL store.
    #[arg(long, env = "STRATAD_ROLE", value_parser = ["host", "api"], help_heading = "Cluster")]
    pub role: Option<String>,
    /// This daemon's id in the cluster (`[cluster] host_id`; a Kubernetes
    /// pod gives its node's name).
    #[arg(long, env = "STRATAD_HOST_ID", help_heading = "Cluster")]
    pub host_id: Option<String>,
    /// Where other hosts and API processes reach this host
    /// (`[cluster] address`, e.g. `http://10.0.0.2:7070`; a Kubernetes pod
    /// gives its pod IP).
    #[arg(long, env = "STRATAD_ADVERTISE_ADDRESS", help_heading = "Cluster")]
    pub advertise_address: Option<String>,
    /// Print the built-in configuration and exit.
    #[arg(long)]
    pub print_default_config: bool,
}

/// The configuration the arguments describe (file, then flags on top).
pub fn config(args: &Args) -> anyhow::Result<Config> {
    let mut cfg = match &args.config {
        // Validated once the flags are applied (below).
        Some(p) => Config::read_file(p)?,
        None => Config::default(),
    };
    if let Some(v) = args.listen {
        cfg.listen = v;
    }
    if let Some(v) = &args.data_dir {
        cfg.data_dir = v.clone();
    }
    if let Some(v) = &args.key_dir {
        cfg.key_dir = v.clone();
    }
    if let Some(v) = args.accel {
        cfg.accel = v;
    }
    if let Some(v) = &args.pool_path {
        cfg.pool_path = Some(v.clone());
    }
    if let Some(v) = args.pool_size_gib {
        cfg.pool_size_gib = v;
    }
    if let Some(v) = &args.run_dir {
        cfg.run_dir = v.clone();
    }
    if let Some(v) = &args.image_dir {
        cfg.image_dir = Some(v.clone());
    }
    if let Some(v) = &args.qemu {
        cfg.qemu_binary = v.clone();
    }
    if let Some(v) = &args.agent_timeout {
        cfg.agent_timeout = crate::duration::parse_duration(v).context("--agent-timeout")?;
    }
    if args.no_default_template {
        cfg.default_template = false;
    }
    if let Some(v) = &args.snapshot_interval {
        cfg.snapshot_interval =
            crate::duration::parse_duration(v).context("--snapshot-interval")?;
    }
    if let Some(v) = &args.idle_timeout {
        cfg.idle_timeout = crate::duration::parse_duration(v).context("--idle-timeout")?;
    }
    if let Some(v) = &args.retention {
        cfg.retention = RetentionPolicy::parse(v)
            .map_err(anyhow::Error::msg)
            .context("--retention")?;
    }
    if let Some(v) = &args.auth {
        cfg.security.auth = v == "on";
    }
    if args.e2b {
        cfg.e2b.enabled = true;
    }
    if !args.e2b_api_keys.is_empty() {
        cfg.e2b.api_keys = args.e2b_api_keys.clone();
    }
    if let Some(v) = &args.e2b_token_secret_file {
        cfg.e2b.token_secret_file = Some(v.clone());
    }
    if let Some(v) = args.e2b_tls_listen {
        cfg.e2b.tls_listen = Some(v);
    }
    if let Some(v) = &args.store_url {
        cfg.store.url = Some(v.clone());
    }
    if let Some(v) = &args.role {
        cfg.cluster.role = v.parse().map_err(anyhow::Error::msg)?;
    }
    if let Some(v) = &args.host_id {
        cfg.cluster.host_id = Some(v.clone());
    }
    if let Some(v) = &args.advertise_address {
        cfg.cluster.address = Some(v.clone());
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
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

/// Sets up logging as `--log-format` says (`RUST_LOG` filters; default `info`).
pub fn init_logging(log_format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if log_format == "json" {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .try_init()
            .ok();
    } else {
        let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
    }
}

/// Runs the daemon with `mount`'s routes (see [`main_with_doors`]).
pub async fn main_with(args: Args, mount: Option<crate::daemon::Mount>) -> anyhow::Result<()> {
    main_with_doors(args, |_| Ok(mount)).await
}

/// Runs the daemon as the `stratad` binary does: `--print-default-config`,
/// logging, the configuration, then the daemon until SIGTERM or SIGINT.
/// `doors` is given the configuration and returns the extra routes to serve
/// (on the same listener, outside the `/v1` authentication layer), e.g. the
/// E2B door when `[e2b] enabled`.
pub async fn main_with_doors(
    args: Args,
    doors: impl FnOnce(&Config) -> anyhow::Result<Option<crate::daemon::Mount>>,
) -> anyhow::Result<()> {
    if args.print_default_config {
        print!("{}", crate::config::DEFAULT_TOML);
        return Ok(());
    }
    init_logging(&args.log_format);
    let cfg = config(&args)?;
    let mount = doors(&cfg)?;
    if let Err(e) = crate::daemon::run_with(cfg, shutdown_signal(), mount).await {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(c) = src {
            msg.push_str(": ");
            msg.push_str(&c.to_string());
            src = c.source();
        }
        tracing::error!(error = %msg, "stratad failed");
        anyhow::bail!(msg);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn parse(argv: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("stratad").chain(argv.iter().copied()))
            .expect("arguments")
    }

    #[test]
    fn e2b_flags_land_under_e2b() {
        let cfg = config(&parse(&[])).unwrap();
        assert!(!cfg.e2b.enabled);
        assert_eq!(cfg.e2b, crate::config::E2bSettings::default());
        let cfg = config(&parse(&[
            "--e2b",
            "--e2b-api-key",
            "k1",
            "--e2b-api-key=k2,k3",
            "--e2b-token-secret-file",
            "/etc/strata/e2b.secret",
            "--data-dir",
            "/srv/strata",
        ]))
        .unwrap();
        assert!(cfg.e2b.enabled);
        assert_eq!(cfg.e2b.api_keys, ["k1", "k2", "k3"]);
        assert_eq!(
            cfg.e2b.token_secret_path(&cfg.data_dir),
            PathBuf::from("/etc/strata/e2b.secret")
        );
        let cfg = config(&parse(&["--data-dir", "/srv/strata"])).unwrap();
        assert_eq!(
            cfg.e2b.token_secret_path(&cfg.data_dir),
            PathBuf::from("/srv/strata/e2b.secret")
        );
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("stratad.toml");
        std::fs::write(
            &file,
            "[e2b]\nenabled = true\napi_keys = [\"from-file\"]\nhome_dir = \"/home/user\"\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let cfg = config(&parse(&["--config", path])).unwrap();
        assert!(cfg.e2b.enabled);
        assert_eq!(cfg.e2b.api_keys, ["from-file"]);
        assert_eq!(cfg.e2b.home_dir, "/home/user");
        let cfg = config(&parse(&["--config", path, "--e2b-api-key", "flag"])).unwrap();
        assert_eq!(cfg.e2b.api_keys, ["flag"]);
    }

    #[test]
    fn store_url_comes_from_the_environment_and_overrides_the_file() {
        // The Kubernetes manifests give the URL (a Secret) as this variable.
        let cmd = <Args as clap::CommandFactory>::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "store_url")
            .expect("--store-url");
        assert_eq!(
            arg.get_env(),
            Some(std::ffi::OsStr::new("STRATAD_STORE_URL"))
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("stratad.toml");
        std::fs::write(
            &file,
            "[store]\nurl = \"sqlite:/srv/a.db\"\nschema = \"strata\"\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let url = "postgresql://strata:pw@db:5432/strata";
        let cfg = config(&parse(&["--config", path, "--store-url", url])).unwrap();
        assert_eq!(cfg.store.url.as_deref(), Some(url));
        assert_eq!(cfg.store.schema.as_deref(), Some("strata"));
        assert_eq!(
            cfg.store_location().unwrap(),
            crate::config::StoreLocation::Postgres(url.into())
        );
        // Validated like the file's: another scheme is refused at start.
        let err = config(&parse(&["--store-url", "mysql://db/strata"])).unwrap_err();
        assert!(format!("{err:#}").contains("[store] url"), "{err:#}");
    }

    #[test]
    fn the_api_role_is_refused_without_cluster_mode_and_takes_the_e2b_door() {
        let url = "postgresql://strata@db:5432/strata";
        let err = config(&parse(&["--role", "api", "--store-url", url])).unwrap_err();
        assert!(
            format!("{err:#}").contains("[cluster] enabled = true"),
            "{err:#}"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("stratad.toml");
        std::fs::write(&file, "[cluster]\nenabled = true\n").unwrap();
        let path = file.to_str().unwrap();
        // Cluster mode on SQLite: refused whatever the role.
        let err = config(&parse(&["--config", path, "--role", "api"])).unwrap_err();
        assert!(format!("{err:#}").contains("postgres"), "{err:#}");
        let cfg = config(&parse(&[
            "--config",
            path,
            "--role",
            "api",
            "--store-url",
            url,
            "--host-id",
            "api-1",
            "--advertise-address",
            "http://10.0.0.9:7070",
        ]))
        .unwrap();
        assert_eq!(cfg.cluster.role, crate::cluster::Role::Api);
        assert_eq!(cfg.cluster.host_id.as_deref(), Some("api-1"));
        assert_eq!(cfg.cluster.address.as_deref(), Some("http://10.0.0.9:7070"));
        let cfg = config(&parse(&[
            "--config",
            path,
            "--role",
            "api",
            "--store-url",
            url,
            "--e2b",
        ]))
        .unwrap();
        // The E2B door on an API process forwards to the hosts.
        assert!(cfg.e2b.enabled && cfg.cluster.role == crate::cluster::Role::Api);
    }

    #[test]
    fn the_kubernetes_configmaps_load() {
        // Every stratad.toml under deploy/kubernetes is a ConfigMap the
        // daemon reads at start: it must parse (unknown keys are errors)
        // and agree with the manifests (scripts/k8s-validate.sh checks the
        // mounts against the same values).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
        let mut seen = 0;
        let mut dirs = vec![root.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.file_name().is_some_and(|n| n == "stratad.toml") {
                    let path = p.to_str().unwrap();
                    let cfg = config(&parse(&[
                        "--config",
                        path,
                        "--store-url",
                        "postgresql://strata@db:5432/strata",
                    ]))
                    .unwrap_or_else(|e| panic!("{path}: {e:#}"));
                    assert_eq!(cfg.listen.port(), 7070, "{path}: the containerPort");
                    assert_eq!(cfg.data_dir, PathBuf::from("/var/lib/strata"), "{path}");
                    assert_eq!(cfg.key_dir, PathBuf::from("/var/lib/strata-keys"), "{path}");
                    let body = Config::read_file(&p).unwrap_or_else(|e| panic!("{path}: {e}"));
                    assert!(
                        cfg.cluster.enabled,
                        "{path}: the hosts and the API pods form one cluster"
                    );
                    assert!(
                        body.store.url.is_none(),
                        "{path}: the URL is a Secret, not in the ConfigMap"
                    );
                    seen += 1;
                }
            }
        }
        assert!(seen >= 2, "found {seen} stratad.toml under {root:?}");
    }
}
