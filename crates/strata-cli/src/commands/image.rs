//! `strata image build` and `strata image ls`: the guest image cache on this host.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Subcommand;
use serde_json::json;
use strata_image::{BuiltImage, ImageRecipe};

use super::{CliError, Ctx};
use crate::human;

/// `strata image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Build the guest image (or find it in the cache).
    Build(BuildArgs),
    /// List the images in the cache.
    Ls(LsArgs),
}

/// `strata image build`
#[derive(Debug, clap::Args)]
pub struct BuildArgs {
    /// Image cache directory [default: $STRATA_IMAGE_CACHE or /var/cache/strata/images].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Guest agent binary [default: `strata-agent` next to `strata`, else target/release/strata-agent].
    #[arg(long)]
    pub agent: Option<PathBuf>,
    /// Size of the root file system in GiB.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub size_gib: Option<u32>,
}

/// `strata image ls`
#[derive(Debug, clap::Args)]
pub struct LsArgs {
    /// Image cache directory [default: $STRATA_IMAGE_CACHE or /var/cache/strata/images].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

/// Runs an image command.
pub async fn run(ctx: &Ctx, cmd: ImageCmd) -> anyhow::Result<i32> {
    match cmd {
        ImageCmd::Build(a) => build(ctx, a).await,
        ImageCmd::Ls(a) => ls(ctx, a),
    }
}

/// The cache directory to use.
pub fn cache_dir(given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(strata_image::default_cache_dir)
}

/// Where the agent binary is looked for, in order.
pub fn agent_candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        c.push(dir.join("strata-agent"));
        // target/debug/strata next to target/release/strata-agent.
        if let Some(target) = dir.parent() {
            c.push(target.join("release").join("strata-agent"));
        }
    }
    c.push(PathBuf::from("target/release/strata-agent"));
    c
}

/// The agent binary: `given`, or the first candidate that exists.
pub fn find_agent(given: Option<PathBuf>) -> Result<PathBuf, CliError> {
    if let Some(p) = given {
        if p.is_file() {
            return Ok(p);
        }
        return Err(CliError::Missing(format!(
            "agent binary {} does not exist",
            p.display()
        )));
    }
    let tried = agent_candidates();
    if let Some(p) = tried.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    Err(CliError::Missing(format!(
        "no guest agent binary found (looked at {}): build it with \
         `cargo build --release -p strata-agent` or pass --agent PATH",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

async fn build(ctx: &Ctx, a: BuildArgs) -> anyhow::Result<i32> {
    let agent = find_agent(a.agent)?;
    let mut recipe = ImageRecipe::new(&agent);
    if let Some(g) = a.size_gib {
        recipe.rootfs_size_gib = g;
    }
    let cache = cache_dir(a.cache_dir);
    eprintln!(
        "strata: building image with agent {} into {}",
        agent.display(),
        cache.display()
    );
    let started = std::time::Instant::now();
    let cache2 = cache.clone();
    let (img, cached) = tokio::task::spawn_blocking(move || {
        let hit = std::cell::Cell::new(false);
        let r = strata_image::build(&recipe, &cache2, &|p| {
            if p.step == strata_image::Step::CacheHit {
                hit.set(true);
            }
            eprintln!("{p}");
        });
        r.map(|img| (img, hit.get()))
    })
    .await
    .context("image build task")?
    .context("image build failed")?;
    let secs = started.elapsed().as_secs_f64();
    if ctx.json {
        println!("{}", image_json(&img, Some((cached, secs))));
    } else {
        eprintln!(
            "strata: image {} in {secs:.1} s",
            if cached { "found in cache" } else { "built" }
        );
        println!("{} {}", img.dir.display(), img.hash);
    }
    Ok(0)
}

fn image_json(img: &BuiltImage, build: Option<(bool, f64)>) -> serde_json::Value {
    let mut v = json!({
        "dir": img.dir,
        "hash": img.hash,
        "kernel": img.kernel,
        "kernel_pvh": img.kernel_pvh,
        "initrd": img.initrd,
        "rootfs": img.rootfs,
        "cmdline": img.cmdline,
        "kernel_version": img.kernel_version,
        "created": img.manifest.created,
        "sizes": img.manifest.sizes,
    });
    if let Some((cached, secs)) = build {
        v["cached"] = cached.into();
        v["seconds"] = secs.into();
    }
    v
}

/// The complete images in `cache`, oldest first.
pub fn list_images(cache: &Path) -> std::io::Result<Vec<BuiltImage>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(cache) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') || !entry.path().is_dir() {
            continue;
        }
        if let Ok(img) = strata_image::load(&entry.path()) {
            out.push(img);
        }
    }
    out.sort_by(|a, b| a.manifest.created.cmp(&b.manifest.created));
    Ok(out)
}

fn ls(ctx: &Ctx, a: LsArgs) -> anyhow::Result<i32> {
    let cache = cache_dir(a.cache_dir);
    let images = list_images(&cache).with_context(|| format!("cannot list {}", cache.display()))?;
    let v = json!({ "items": images.iter().map(|i| image_json(i, None)).collect::<Vec<_>>() });
    ctx.emit(&v, || {
        if images.is_empty() {
            return Ok(format!(
                "no images in {} (build one with `strata image build`)\n",
                cache.display()
            ));
        }
        Ok(human::table_of(
            &["HASH", "CREATED", "KERNEL", ">ROOTFS", "DIR"],
            &images,
            |i| {
                vec![
                    i.hash.chars().take(12).collect(),
                    i.manifest.created.clone(),
                    i.kernel_version.clone(),
                    human::bytes(i.manifest.sizes.rootfs_allocated),
                    i.dir.display().to_string(),
                ]
            },
        ))
    })?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_agent_is_a_clear_error() {
        let e = find_agent(Some("/nonexistent/strata-agent".into())).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/strata-agent"), "{e}");
    }

    #[test]
    fn empty_or_absent_cache_lists_nothing() {
        let d = tempfile::tempdir().unwrap();
        assert!(list_images(d.path()).unwrap().is_empty());
        assert!(list_images(&d.path().join("absent")).unwrap().is_empty());
        std::fs::create_dir(d.path().join("junk")).unwrap();
        assert!(list_images(d.path()).unwrap().is_empty());
    }
}
