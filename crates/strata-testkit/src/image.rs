//! The guest agent built for release and the guest image built from it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use strata_image::BuiltImage;

use crate::bin::older_than_sources;
use crate::{error_chain, target_dir, workspace_root};

/// Path to the release guest agent, `target/release/strata-agent`. Runs
/// `cargo build --release -p strata-agent` first if it is missing or older
/// than the sources (`src/`, `Cargo.toml`) of the agent and its protocol crate.
///
/// Panics with cargo's exit status if the build fails: this is test support.
pub fn agent_binary() -> PathBuf {
    static AGENT: OnceLock<PathBuf> = OnceLock::new();
    AGENT
        .get_or_init(|| {
            let root = workspace_root();
            let bin = target_dir().join("release").join("strata-agent");
            // Sources of the agent and its protocol crate. Not Cargo.lock: it
            // changes whenever anyone adds a dependency anywhere.
            let stale = older_than_sources(&bin, &["strata-agent", "strata-proto"]);
            if stale {
                eprintln!("strata-testkit: building the guest agent (cargo build --release -p strata-agent)");
                let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
                let status = Command::new(cargo)
                    .args(["build", "--release", "-p", "strata-agent"])
                    .current_dir(&root)
                    .status()
                    .unwrap_or_else(|e| panic!("strata-testkit: cannot run cargo: {e}"));
                assert!(status.success(), "strata-testkit: cargo build --release -p strata-agent failed: {status}");
            }
            assert!(bin.is_file(), "strata-testkit: {} missing after the build", bin.display());
            bin
        })
        .clone()
}

/// The guest image for tests, built once per process: the default recipe
/// with [`agent_binary`], in `$STRATA_IMAGE_CACHE` or
/// `/var/cache/strata/images` (a cache hit takes about a second). Progress goes
/// to stderr. With `STRATA_TEST_IMAGE=<dir>` that prebuilt image is loaded
/// instead.
///
/// Panics with the whole error chain if the image cannot be built or loaded.
pub fn test_image() -> &'static BuiltImage {
    static IMAGE: OnceLock<BuiltImage> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let result = match std::env::var_os("STRATA_TEST_IMAGE") {
            Some(dir) => strata_image::load(Path::new(&dir)),
            None => {
                let recipe = strata_image::ImageRecipe::new(agent_binary());
                let cache = strata_image::default_cache_dir();
                strata_image::build(&recipe, &cache, &|p| eprintln!("strata-image {p}"))
            }
        };
        match result {
            Ok(img) => img,
            Err(e) => panic!(
                "strata-testkit: guest image unavailable: {}",
                error_chain(&e)
            ),
        }
    })
}
