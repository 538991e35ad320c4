//! The strata guest agent: runs inside the microVM, executes commands and moves files for the host over virtio-serial.

mod egress;
mod error;
mod exec;
mod files;
mod init;
mod outbox;
mod ports;
mod requests;
mod session;
mod system;
mod transport;
mod user;
mod watch;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

/// Name of the virtio-serial port the agent serves on.
pub const PORT_NAME: &str = "strata.agent";

/// strata guest agent.
#[derive(Debug, Clone, Parser)]
#[command(version, about)]
struct Args {
    /// Serve on this port device instead of looking up `strata.agent`.
    #[arg(long, conflicts_with = "listen_unix")]
    port: Option<PathBuf>,
    /// Serve on a unix socket (one host connection at a time); for tests.
    #[arg(long)]
    listen_unix: Option<PathBuf>,
    /// Act as PID 1: mount API file systems, reap orphans, supervise the agent.
    #[arg(long)]
    init: bool,
    /// Log system changes (clock, RNG, hostname) instead of making them.
    #[arg(long)]
    dry_system: bool,
    /// Where guest programs reach the egress proxy, once the host enables
    /// egress (`127.0.0.1:0` picks a free port; the host learns it).
    #[arg(long, default_value = "127.0.0.1:3128")]
    egress_listen: std::net::SocketAddr,
    /// Testing only: claim this protocol version in the handshake.
    #[arg(long, hide = true)]
    pretend_protocol_version: Option<u32>,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_AGENT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if args.init {
        // SAFETY: getpid has no preconditions.
        if unsafe { libc::getpid() } == 1 {
            init::setup();
            init::supervise(|| run_agent(&args));
        }
        tracing::warn!("--init given but not PID 1; running as a plain agent");
    }
    std::process::exit(run_agent(&args));
}

fn run_agent(args: &Args) -> i32 {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return 1;
        }
    };
    let sys: Arc<dyn system::System> = if args.dry_system {
        Arc::new(system::DrySystem)
    } else {
        Arc::new(system::RealSystem)
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        protocol = strata_proto::PROTOCOL_VERSION,
        "strata-agent starting"
    );
    let transport = match open_transport(args) {
        Ok(t) => t,
        Err(e) => {
            tracing::error!(error = %e, "cannot open the host channel");
            return 1;
        }
    };
    let version = args
        .pretend_protocol_version
        .unwrap_or(strata_proto::PROTOCOL_VERSION);
    let egress = egress::Egress::new(args.egress_listen);
    rt.block_on(session::Session::new(transport, sys, version, egress).run());
    0
}

fn open_transport(args: &Args) -> std::io::Result<transport::Transport> {
    if let Some(p) = &args.listen_unix {
        tracing::info!(path = %p.display(), "listening on unix socket");
        return transport::listen_unix(p);
    }
    let mut warned = false;
    loop {
        let port = args
            .port
            .clone()
            .or_else(|| transport::find_virtio_port(PORT_NAME));
        if let Some(port) = port {
            match transport::open_port(&port) {
                Ok(t) => {
                    tracing::info!(port = %port.display(), "serving on virtio-serial port");
                    return Ok(t);
                }
                Err(e) if !warned => {
                    tracing::warn!(port = %port.display(), error = %e, "cannot open port; retrying");
                    warned = true;
                }
                Err(_) => {}
            }
        } else if !warned {
            tracing::warn!(
                name = PORT_NAME,
                "virtio-serial port not found yet; retrying"
            );
            warned = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}
