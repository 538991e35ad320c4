//! `strata-server`: the deprecated name of `stratad --e2b`, kept for one
//! release. Takes every `stratad` flag (`--e2b-api-key`,
//! `--e2b-token-secret-file` included) and always serves the E2B door.

use clap::{CommandFactory as _, FromArgMatches as _};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let matches = stratad::cli::Args::command()
        .name("strata-server")
        .bin_name("strata-server")
        .about("Deprecated: use `stratad --e2b` (strata-server is removed in the next release).")
        .get_matches();
    let mut args = stratad::cli::Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.e2b = true;
    if !args.print_default_config {
        eprintln!("strata-server: deprecated, use `stratad --e2b` (this alias is removed in the next release)");
    }
    strata_daemon::main(args).await
}
