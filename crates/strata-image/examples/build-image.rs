//! Builds (or finds in the cache) the default image for an agent binary.
//!
//! `cargo run -p strata-image --example build-image -- <agent-binary> [cache-dir]`

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(agent) = args.next() else {
        eprintln!("usage: build-image <agent-binary> [cache-dir]");
        return ExitCode::from(2);
    };
    let cache = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(strata_image::default_cache_dir);
    let recipe = strata_image::ImageRecipe::new(agent);
    match strata_image::build(&recipe, &cache, &|p| eprintln!("{p}")) {
        Ok(img) => {
            println!("{}", img.dir.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
