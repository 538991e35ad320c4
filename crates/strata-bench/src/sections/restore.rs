//! Section `restore`: not built yet.

use anyhow::{anyhow, Result};

use crate::ctx::Ctx;
use crate::report::Section;

/// Flags of the `restore` section.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {}
}

/// Measures and fills `sec`.
pub async fn run(_ctx: &Ctx, _args: &Args, _sec: &mut Section) -> Result<()> {
    Err(anyhow!("not built yet"))
}
