//! `stratad`: the strata daemon binary. See the library crate for the parts.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    stratad::cli::main_with(stratad::cli::Args::parse(), None).await
}
