//! strata: the command-line client of the strata API, plus `strata image
//! build` and `strata dev run` that work on this host without a daemon.
//!
//! One file per verb under `commands/`; [`api::ApiClient`] talks to stratad.

mod api;
mod commands;
mod human;
mod views;

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::commands::{Cli, Ctx};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let ctx = Ctx::new(&cli);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("strata: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(commands::run(&ctx, cli.command));
    // Blocking readers of our stdin may still be parked: don't wait for them.
    rt.shutdown_timeout(Duration::from_millis(100));
    let code = match result {
        Ok(code) => code,
        Err(e) => {
            report_error(&ctx, &e);
            commands::exit_code(&e)
        }
    };
    let _ = std::io::stdout().flush();
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

/// Prints an error: the whole cause chain on one line, or under `--json`
/// `{"error":{"code","message"}}` on stdout.
fn report_error(ctx: &Ctx, e: &anyhow::Error) {
    commands::print_failure(ctx, e, &commands::error_code(e), &chain(e));
}

fn chain(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        // Skip a cause that only repeats what is already said.
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ")
}

/// Logs of the libraries (QEMU driver, agent client) go to stderr when
/// `RUST_LOG` asks for them; silent otherwise.
fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}
