//! `stratad`: the strata daemon. Every flag is the `stratad` library's
//! ([`stratad::cli::Args`]); `--e2b` (or `[e2b] enabled = true`) also serves
//! the E2B-compatible API on the same listener.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    strata_daemon::main(stratad::cli::Args::parse()).await
}
