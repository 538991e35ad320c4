//! Section `recipe` (opt-in: `strata-bench --only recipe`; it reaches the
//! package registries): template builds from recipes, on one daemon in one
//! run (docs/templates.md).
//!
//! A recipe of a `pip` step (`--recipe-pip`, default a few real packages),
//! a file, a last `run` step, a start command (`python3 -m http.server`)
//! and a ready check. Measured, each from `POST /v1/templates` to `ready`:
//!
//! - **full build**: nothing cached (a unique first step per sample);
//! - **rebuild after changing the last step**: the steps before it come
//!   from the step cache;
//! - **identical recipe from the host cache** (`[templates] cache_dir`):
//!   imported, not built.
//!
//! The headline is the full build's p50 over the rebuild's (the issue's
//! bar: ≥ 5×), measured side by side in this run.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use reqwest::Method;
use serde_json::{json, Value};

use super::sdk::Door;
use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples};

/// Flags of the `recipe` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "recipe-args")]
pub struct Args {
    /// Full builds (nothing cached).
    #[arg(id = "recipe-full", long = "recipe-full", default_value_t = 3)]
    pub full: usize,
    /// Rebuilds after changing the last step, and imports from the host cache.
    #[arg(id = "recipe-n", long = "recipe-n", default_value_t = 5)]
    pub n: usize,
    /// Packages of the recipe's pip step.
    #[arg(
        id = "recipe-pip",
        long = "recipe-pip",
        value_delimiter = ',',
        default_value = "requests==2.32.3,rich==13.9.4,tomli-w==1.0.0"
    )]
    pub pip: Vec<String>,
    /// Guest memory of the base template, MiB.
    #[arg(
        id = "recipe-memory-mib",
        long = "recipe-memory-mib",
        default_value_t = 256
    )]
    pub memory_mib: u64,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.full = self.full.min(1);
        self.n = self.n.min(1);
    }
}

fn recipe(args: &Args, salt: &str, last: &str) -> Value {
    json!({
        "base": "default",
        "step": [
            {"run": format!("echo {salt} > /etc/strata-bench-salt")},
            {"pip": args.pip},
            {"user": "user"},
            {"workdir": "/home/user/site"},
            {"run": "echo hello > index.html"},
            {"run": format!("echo {last} > last.txt")},
        ],
        "start": {"cmd": "python3 -m http.server 8000 --bind 127.0.0.1"},
        "ready": {"http": {"port": 8000, "path": "/index.html"}, "timeout_secs": 300},
    })
}

/// Builds `recipe` as `id`; the time from the request to `ready`.
async fn build(door: &Door, id: &str, recipe: Value, ca: &Option<String>) -> Result<Duration> {
    let mut body = json!({"id": id, "recipe": recipe});
    if let Some(ca) = ca {
        body["ca_bundle"] = ca.clone().into();
    }
    build_template(door, body, Duration::from_secs(1800))
        .await
        .map(|(_, d)| d)
}

/// `POST /v1/templates` with `body`, then polls the template until it is
/// ready (an error if it fails or takes longer than `limit`): its id and
/// the time from the request to `ready`.
pub(super) async fn build_template(
    door: &Door,
    body: Value,
    limit: Duration,
) -> Result<(String, Duration)> {
    let t0 = Instant::now();
    let (s, v) = door
        .api
        .json(Method::POST, "/v1/templates", Some(body))
        .await
        .map_err(|e| anyhow!("{e}"))?;
    if s != 202 {
        bail!("build: {s} {v}");
    }
    let id = v["id"]
        .as_str()
        .ok_or_else(|| anyhow!("build: no id in {v}"))?
        .to_owned();
    loop {
        let (_, v) = door
            .api
            .json(Method::GET, &format!("/v1/templates/{id}"), None)
            .await
            .map_err(|e| anyhow!("{e}"))?;
        match v["status"].as_str() {
            Some("ready") => return Ok((id, t0.elapsed())),
            Some("building") => {}
            _ => bail!("build {id}: {v}"),
        }
        if t0.elapsed() > limit {
            bail!("build {id} still running after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    if args.full == 0 || args.n == 0 {
        bail!("--recipe-full and --recipe-n must be at least 1");
    }
    let cache = tempfile::Builder::new()
        .prefix("sbtplcache")
        .tempdir_in("/tmp")
        .map_err(|e| anyhow!("cache dir: {e}"))?;
    let door = Door::start_with(
        ctx,
        args.memory_mib,
        &format!(
            "egress_resolved_ranges = {}",
            strata_testkit::registry::registry_ranges_toml()
        ),
        &format!("[templates]\ncache_dir = \"{}\"\n", cache.path().display()),
    )
    .await?;
    let ca = std::fs::read_to_string(strata_testkit::registry::HOST_CA_BUNDLE).ok();
    let run_id = std::process::id();
    let (mut full, mut rebuild, mut cached) = (Samples::new(), Samples::new(), Samples::new());
    for i in 0..args.full {
        let d = build(
            &door,
            &format!("tpl-bench-full-{i}"),
            recipe(args, &format!("{run_id}-{i}"), "0"),
            &ca,
        )
        .await?;
        eprintln!("recipe: full build {i}: {:.1} s", d.as_secs_f64());
        full.push_dur(d);
    }
    for k in 0..args.n {
        let d = build(
            &door,
            &format!("tpl-bench-re-{k}"),
            recipe(args, &format!("{run_id}-0"), &format!("changed-{k}")),
            &ca,
        )
        .await?;
        eprintln!("recipe: rebuild {k}: {:.1} s", d.as_secs_f64());
        rebuild.push_dur(d);
    }
    for k in 0..args.n {
        let d = build(
            &door,
            &format!("tpl-bench-hc-{k}"),
            recipe(args, &format!("{run_id}-0"), "0"),
            &ca,
        )
        .await?;
        eprintln!("recipe: from the host cache {k}: {:.1} s", d.as_secs_f64());
        cached.push_dur(d);
    }
    drop(door);

    let (fs, rs, cs) = (full.summary(), rebuild.summary(), cached.summary());
    let mut t = Table::latency(
        format!(
            "Template builds from a recipe (pip {}; start + ready), request → ready; same daemon; ratio = full p50 / row p50",
            args.pip.join(" ")
        ),
        &["ratio"],
    );
    let r = |s: &crate::stats::Summary| format!("{:.1}×", fs.p50 / s.p50);
    t.latency_row(
        format!("full build (n={})", args.full),
        &fs,
        vec!["1×".into()],
    );
    t.latency_row(
        format!("rebuild, last step changed (n={})", args.n),
        &rs,
        vec![r(&rs)],
    );
    t.latency_row(
        format!("identical recipe, host cache (n={})", args.n),
        &cs,
        vec![r(&cs)],
    );
    sec.table(t);
    sec.headline(format!(
        "recipe build: full p50 {} vs rebuild after changing the last step p50 {} p99 {} ({:.1}× faster; the bar is 5×) vs host-cache import p50 {} ({:.1}×); {}",
        fmt_ms(fs.p50),
        fmt_ms(rs.p50),
        fmt_ms(rs.p99),
        fs.p50 / rs.p50,
        fmt_ms(cs.p50),
        fs.p50 / cs.p50,
        ctx.accel
    ));
    sec.text(format!(
        "A full build forks the default template into a builder, runs every step (the pip step through the builder's egress proxy to the registries), caches each step's state, starts the server and waits for it, and publishes the template; a rebuild forks the cached state after the unchanged steps and runs the changed last step, the start and the ready check; a host-cache import copies the files of the built template into the pool. Guests: 1 vCPU, {} MiB, under {}.",
        args.memory_mib, ctx.accel
    ));
    sec.data = json!({
        "params": {"full": args.full, "n": args.n, "pip": args.pip, "memory_mib": args.memory_mib, "accel": ctx.accel.to_string()},
        "full_ms": full.0, "rebuild_ms": rebuild.0, "host_cache_ms": cached.0,
    });
    Ok(())
}
