//! `strata serve [-- ARGS…]`: runs the daemon by replacing this process with
//! the `stratad` binary (next to `strata`, else on `PATH`; built by
//! `cargo build --release -p strata-daemon`), e.g. `strata serve -- --e2b`
//! for the E2B door too. Exec keeps the CLI free of the daemon's
//! dependencies (the CLI is a client of the API).

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;

use super::{CliError, Ctx};

/// `strata serve`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Path of the stratad binary [default: next to `strata`, else on PATH].
    #[arg(long)]
    pub stratad: Option<PathBuf>,
    /// Arguments passed to stratad unchanged.
    #[arg(last = true, value_name = "ARGS")]
    pub args: Vec<String>,
}

/// Finds the daemon binary.
pub fn find_stratad(given: Option<PathBuf>) -> Result<PathBuf, CliError> {
    if let Some(p) = given {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(CliError::Missing(format!("{} does not exist", p.display())))
        };
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("stratad")));
    if let Some(p) = beside.filter(|p| p.is_file()) {
        return Ok(p);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("stratad"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            CliError::Missing(
                "no stratad binary next to strata or on PATH: build it with \
                 `cargo build --release -p strata-daemon` or pass --stratad PATH"
                    .into(),
            )
        })
}

/// Runs `strata serve`: only returns if the exec fails.
pub async fn run(_ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let bin = find_stratad(a.stratad)?;
    let err = std::process::Command::new(&bin).args(&a.args).exec();
    Err(anyhow::Error::new(err).context(format!("cannot execute {}", bin.display())))
}
