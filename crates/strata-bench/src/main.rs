//! `strata-bench`: runs the benchmark sections and writes the report.
//!
//! ```text
//! strata-bench                       # every section, default sizes (< 15 min on 2 cores)
//! strata-bench --only snapshot,scale # some sections
//! strata-bench --smoke               # CI smoke size: completes fast, figures meaningless
//! strata-bench --help                # every flag, per section
//! ```
//!
//! Needs root (loop-mounted btrfs pools, QEMU) and a guest image
//! (`strata image build`). Output: `<out>/report.md`, `report.json`, `*.svg`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use clap::Parser;
use futures::FutureExt;
use strata_bench::ctx::{teardown_all, Ctx};
use strata_bench::report::{commit, Machine, Report, Section};
use strata_bench::sections::{
    self, chaos, density, events, history, interp, load, mcp, packing, pool, recipe, restore,
    scale, sdk, snapshot, soak, tls_proxy, transfer,
};
use strata_core::Accel;
use strata_vmm::VmmDriver;

#[derive(Debug, Parser)]
#[command(
    name = "strata-bench",
    version,
    about = "strata's benchmark harness: strata side by side with the alternatives, written up as a report with plots"
)]
struct Cli {
    /// Output folder of this run [default: results/<UTC date-time>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Sections to run, comma-separated: snapshot, restore, load, density, history, scale;
    /// and sdk (E2B SDK beside /v1), recipe (template builds), pool (warm pools), interp (code
    /// interpreter: first run_code in a fork vs a cold kernel), packing (admission by use vs
    /// nominal, 10 % active), soak (rolling snapshots of 20 sandboxes for two hours), tls_proxy
    /// (TLS interception overhead vs direct TLS), events (approval request → webhook,
    /// event stream and the web console in headless Chromium), chaos (kill -9 at random moments, 100 kills, ~1 h), move (incremental
    /// btrfs send/receive vs a full send, no VMs), run
    /// only when named here.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// CI smoke size: every count at its minimum (completes, figures not meaningful).
    #[arg(long)]
    smoke: bool,
    /// Accelerator: tcg, kvm, or auto (boot probe of KVM with a timeout).
    #[arg(long, default_value = "auto")]
    accel: String,
    /// Guest image directory [default: $STRATA_TEST_IMAGE, else the newest in the image cache].
    #[arg(long)]
    image: Option<PathBuf>,
    /// QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu: PathBuf,
    #[command(flatten, next_help_heading = "1. Snapshot pause")]
    snapshot: snapshot::Args,
    #[command(flatten, next_help_heading = "2. Restore paths")]
    restore: restore::Args,
    #[command(flatten, next_help_heading = "3. Tail latency under load")]
    load: load::Args,
    #[command(flatten, next_help_heading = "4. Density")]
    density: density::Args,
    #[command(flatten, next_help_heading = "5. A week of history")]
    history: history::Args,
    #[command(flatten, next_help_heading = "6. Control plane at scale")]
    scale: scale::Args,
    #[command(
        flatten,
        next_help_heading = "7. E2B SDK beside strata's API (only with --only sdk)"
    )]
    sdk: sdk::Args,
    #[command(
        flatten,
        next_help_heading = "8. Template builds from recipes (only with --only recipe)"
    )]
    recipe: recipe::Args,
    #[command(flatten, next_help_heading = "9. Warm pools (only with --only pool)")]
    pool: pool::Args,
    #[command(
        flatten,
        next_help_heading = "10. Code interpreter (only with --only interp)"
    )]
    interp: interp::Args,
    #[command(
        flatten,
        next_help_heading = "11. Packing by use (only with --only packing)"
    )]
    packing: packing::Args,
    #[command(flatten, next_help_heading = "12. Soak (only with --only soak)")]
    soak: soak::Args,
    #[command(
        flatten,
        next_help_heading = "13. TLS interception overhead (only with --only tls_proxy)"
    )]
    tls_proxy: tls_proxy::Args,
    #[command(
        flatten,
        next_help_heading = "14. Approval notifications (only with --only events)"
    )]
    events: events::Args,
    #[command(
        flatten,
        next_help_heading = "15. Chaos: kills at random moments (only with --only chaos)"
    )]
    chaos: chaos::Args,
    #[command(
        flatten,
        next_help_heading = "16. MCP gateway overhead (only with --only mcp)"
    )]
    mcp: mcp::Args,
    #[command(
        flatten,
        next_help_heading = "17. Moving a sandbox: incremental btrfs send vs full (only with --only move)"
    )]
    transfer: transfer::Args,
}

fn title(key: &str) -> &'static str {
    match key {
        "snapshot" => "1. Snapshot pause: strata vs full-memory save vs savevm",
        "restore" => "2. Restore paths vs a cold boot",
        "load" => "3. Tail latency under load",
        "density" => "4. Density",
        "history" => "5. A week of history, compressed",
        "scale" => "6. Control plane at scale",
        "sdk" => "7. E2B SDK beside strata's API: create → first command, fork",
        "recipe" => "8. Template builds from recipes: full, rebuild, host cache",
        "pool" => "9. Warm pools: create from a pool vs without, sequential and 8 concurrent",
        "interp" => "10. Code interpreter: first run_code in a fork vs a cold kernel start",
        "packing" => {
            "11. Packing: admission by use and pressure hibernation vs nominal vCPUs, 10 % active"
        }
        "soak" => "12. Soak: a rolling snapshot a minute for hours, default retention",
        "tls_proxy" => {
            "13. TLS interception of a connector host: per-request overhead vs direct TLS"
        }
        "events" => {
            "14. Approval notifications: request → webhook delivery, → event stream, → the console"
        }
        "chaos" => "15. Chaos: kill -9 of the daemon, a QEMU, an agent at random moments",
        "mcp" => "16. MCP gateway: tools/call through the gateway vs direct to the server",
        "move" => "17. Moving a sandbox: incremental btrfs send/receive vs a full send",
        _ => "unknown section",
    }
}

fn image_dir(cli: &Cli) -> Result<PathBuf> {
    if let Some(d) = &cli.image {
        return Ok(d.clone());
    }
    if let Some(d) = std::env::var_os("STRATA_TEST_IMAGE") {
        return Ok(PathBuf::from(d));
    }
    let cache = strata_image::default_cache_dir();
    stratad::daemon::newest_image(&cache).ok_or_else(|| {
        anyhow!(
            "no guest image in {}: run `strata image build` first, or pass --image",
            cache.display()
        )
    })
}

async fn run_section(key: &str, ctx: &Ctx, cli: &Cli) -> Section {
    let mut sec = Section::new(key, title(key));
    let t0 = Instant::now();
    eprintln!("== {} ==", sec.title);
    let res = {
        let fut = async {
            match key {
                "snapshot" => snapshot::run(ctx, &cli.snapshot, &mut sec).await,
                "restore" => restore::run(ctx, &cli.restore, &mut sec).await,
                "load" => load::run(ctx, &cli.load, &mut sec).await,
                "density" => density::run(ctx, &cli.density, &mut sec).await,
                "history" => history::run(ctx, &cli.history, &mut sec).await,
                "scale" => scale::run(ctx, &cli.scale, &mut sec).await,
                "sdk" => sdk::run(ctx, &cli.sdk, &mut sec).await,
                "recipe" => recipe::run(ctx, &cli.recipe, &mut sec).await,
                "pool" => pool::run(ctx, &cli.pool, &mut sec).await,
                "interp" => interp::run(ctx, &cli.interp, &mut sec).await,
                "packing" => packing::run(ctx, &cli.packing, &mut sec).await,
                "soak" => soak::run(ctx, &cli.soak, &mut sec).await,
                "tls_proxy" => tls_proxy::run(ctx, &cli.tls_proxy, &mut sec).await,
                "events" => events::run(ctx, &cli.events, &mut sec).await,
                "chaos" => chaos::run(ctx, &cli.chaos, &mut sec).await,
                "mcp" => mcp::run(ctx, &cli.mcp, &mut sec).await,
                "move" => transfer::run(ctx, &cli.transfer, &mut sec).await,
                other => Err(anyhow!("unknown section {other:?}")),
            }
        };
        std::panic::AssertUnwindSafe(fut).catch_unwind().await
    };
    sec.seconds = t0.elapsed().as_secs_f64();
    match res {
        Ok(Ok(())) => {}
        Ok(Err(e)) => sec.error = Some(format!("{e:#}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            sec.error = Some(format!("panicked: {msg}"));
        }
    }
    match &sec.error {
        None => eprintln!("== {} done in {:.0} s", key, sec.seconds),
        Some(e) => eprintln!("== {} FAILED after {:.0} s: {e}", key, sec.seconds),
    }
    sec
}

fn main() -> Result<()> {
    use tracing_subscriber::prelude::*;
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        );
    // The soak reads each snapshot's pause phases from the daemon's events.
    let capture = strata_bench::pauses::Capture.with_filter(
        tracing_subscriber::filter::Targets::new()
            .with_target(strata_bench::pauses::TARGET, tracing::Level::INFO),
    );
    tracing_subscriber::registry()
        .with(log)
        .with(capture)
        .init();
    let mut cli = Cli::parse();
    let keys: Vec<String> = if cli.only.is_empty() {
        sections::ALL.iter().map(|s| s.to_string()).collect()
    } else {
        for k in &cli.only {
            if !sections::ALL.contains(&k.as_str()) && !sections::OPT_IN.contains(&k.as_str()) {
                bail!(
                    "unknown section {k:?}: expected one of {}, {}",
                    sections::ALL.join(", "),
                    sections::OPT_IN.join(", ")
                );
            }
        }
        sections::ALL
            .iter()
            .chain(sections::OPT_IN)
            .filter(|s| cli.only.iter().any(|k| k == *s))
            .map(|s| s.to_string())
            .collect()
    };
    if cli.smoke {
        cli.snapshot.smoke();
        cli.restore.smoke();
        cli.load.smoke();
        cli.density.smoke();
        cli.history.smoke();
        cli.scale.smoke();
        cli.sdk.smoke();
        cli.recipe.smoke();
        cli.pool.smoke();
        cli.interp.smoke();
        cli.packing.smoke();
        cli.soak.smoke();
        cli.tls_proxy.smoke();
        cli.events.smoke();
        cli.chaos.smoke();
        cli.mcp.smoke();
        cli.transfer.smoke();
    }
    let requested: Accel = cli.accel.parse().map_err(|e: String| anyhow!(e))?;
    let image = image_dir(&cli)?;
    let started = chrono::Utc::now();
    let out = cli.out.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(started.format("%Y%m%d-%H%M%S").to_string())
    });
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;

    let t0 = Instant::now();
    let report = strata_testkit::tokio_rt().block_on(async {
        tokio::spawn(async {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("interrupted: stopping the benchmark's VMs and unmounting its pools");
                teardown_all();
                std::process::exit(130);
            }
        });
        let accel = match requested {
            Accel::Auto => {
                let img = strata_image::load(&image)
                    .map_err(|e| anyhow!("guest image {}: {e}", image.display()))?;
                strata_vmm::QemuDriver::new()
                    .resolve_accel(Accel::Auto, &img.kernel)
                    .await
                    .as_accel()
            }
            a => a,
        };
        let ctx = Ctx {
            out: out.clone(),
            image: image.clone(),
            accel,
            qemu: cli.qemu.clone(),
            smoke: cli.smoke,
        };
        let mut report = Report {
            format: 1,
            commit: commit(),
            started: started.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            seconds: 0.0,
            machine: Machine::probe(&cli.qemu, &accel.to_string()),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            smoke: cli.smoke,
            sections: Vec::new(),
        };
        eprintln!(
            "strata-bench {}: accel {accel}, image {}, output {}",
            report.commit,
            image.display(),
            out.display()
        );
        for key in &keys {
            let sec = run_section(key, &ctx, &cli).await;
            report.sections.push(sec);
            report.seconds = t0.elapsed().as_secs_f64();
            // Written after every section: an interrupted run keeps what it measured.
            report.write(&out)?;
        }
        Ok::<_, anyhow::Error>(report)
    });
    teardown_all();
    let report = report?;
    let md = report.write(&out)?;
    if cli.out.is_none() {
        let latest = PathBuf::from("results/latest");
        let _ = std::fs::remove_file(&latest);
        if let Some(name) = out.file_name() {
            let _ = std::os::unix::fs::symlink(name, &latest);
        }
    }
    println!();
    for s in &report.sections {
        for h in &s.headline {
            println!("{}: {h}", s.title);
        }
    }
    println!("report: {}", md.display());
    let failed: Vec<&str> = report
        .sections
        .iter()
        .filter(|s| s.error.is_some())
        .map(|s| s.key.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("sections failed: {}", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn flags_of_all_sections_fit_in_one_command() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["strata-bench", "--smoke", "--only", "scale,snapshot"])
            .expect("parse");
        assert!(cli.smoke);
        assert_eq!(cli.only, ["scale", "snapshot"]);
    }
}
