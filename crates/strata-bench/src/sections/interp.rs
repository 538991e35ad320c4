//! Section `interp` (opt-in: `strata-bench --only interp`; it reaches the
//! package registries, or the host's template cache): the code
//! interpreter's first `run_code` in a fork of the `code-interpreter`
//! template (its kernel warm in the snapshot) vs a cold kernel start, side
//! by side in the same sandboxes of one run.
//!
//! The template is built from `templates/code-interpreter/recipe.toml`
//! through the daemon (imported from the host cache, `[templates]
//! cache_dir`, when an identical build is there: a cold build is ~25 min
//! under TCG). Then, per sample: a create from the template, the first
//! `POST /v1/sandboxes/{id}/code {"code": "1+1"}` (the kernel the template
//! snapshot holds), a second one (steady state), and a **cold kernel**: a
//! new context (`POST …/ports/49999/contexts`, a kernel started now, as a
//! platform without a warm snapshot starts one) and its first run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};

use super::sdk::Door;
use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples};

/// Flags of the `interp` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "interp-args")]
pub struct Args {
    /// Sandboxes measured (each: first run in the fork, a second run, a
    /// cold context's first run).
    #[arg(id = "interp-n", long = "interp-n", default_value_t = 5)]
    pub n: usize,
    /// Guest memory of the default template (the interpreter's base), MiB.
    #[arg(
        id = "interp-memory-mib",
        long = "interp-memory-mib",
        default_value_t = 512
    )]
    pub memory_mib: u64,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.n = self.n.min(1);
    }
}

fn recipe_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../templates/code-interpreter/recipe.toml")
}

/// Builds (or imports) the interpreter template; its id.
async fn build_interp(door: &Door) -> Result<(String, Duration)> {
    let path = recipe_path();
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let mut recipe = strata_template::Recipe::from_file_text("recipe.toml", &text)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let dir = path.parent().context("recipe dir")?.to_path_buf();
    let blobs = strata_template::pack_all(&mut recipe, &dir, 1 << 30)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    for (sha, bytes) in blobs {
        let (s, b) = door
            .api
            .raw(Method::PUT, &format!("/v1/template-files/{sha}"), bytes)
            .await
            .map_err(|e| anyhow!("{e}"))?;
        if s >= 300 {
            bail!("upload {sha}: {s} {}", String::from_utf8_lossy(&b));
        }
    }
    let mut body = json!({"name": "code-interpreter", "recipe": serde_json::to_value(&recipe)?});
    if let Ok(ca) = std::fs::read_to_string(strata_testkit::registry::HOST_CA_BUNDLE) {
        body["ca_bundle"] = ca.into();
    }
    super::recipe::build_template(door, body, Duration::from_secs(3600)).await
}

/// One `POST /v1/sandboxes/{id}/code`: its time, checked to end with the
/// expected result and no error.
async fn run_code(door: &Door, id: &str, body: Value, want: &str) -> Result<Duration> {
    let t = Instant::now();
    let (s, out) = door
        .api
        .raw(
            Method::POST,
            &format!("/v1/sandboxes/{id}/code"),
            serde_json::to_vec(&body)?,
        )
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let d = t.elapsed();
    let text = String::from_utf8_lossy(&out);
    if s != 200 {
        bail!("run_code in {id}: {s} {text}");
    }
    let lines: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if lines.iter().any(|l| l["type"] == "error") {
        bail!("run_code in {id}: {text}");
    }
    if !lines
        .iter()
        .any(|l| l["type"] == "result" && l["text"] == want)
    {
        bail!("run_code in {id}: no result {want:?} in {text}");
    }
    Ok(d)
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    if args.n == 0 {
        bail!("--interp-n must be at least 1");
    }
    let cache = std::env::var("STRATA_TEMPLATE_CACHE")
        .unwrap_or_else(|_| "/var/cache/strata/templates".into());
    let door = Door::start_with(
        ctx,
        args.memory_mib,
        &format!(
            "egress_resolved_ranges = {}",
            strata_testkit::registry::registry_ranges_toml()
        ),
        &format!("[templates]\ncache_dir = \"{cache}\"\n"),
    )
    .await?;
    let (tpl, build) = build_interp(&door).await?;
    eprintln!("interp: template {tpl} in {:.1} s", build.as_secs_f64());
    let (mut create, mut first, mut second, mut cold) = (
        Samples::new(),
        Samples::new(),
        Samples::new(),
        Samples::new(),
    );
    for i in 0..args.n {
        let t = Instant::now();
        let (s, v) = door
            .api
            .json(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": tpl})),
            )
            .await
            .map_err(|e| anyhow!("{e}"))?;
        if s != 201 {
            bail!("create: {s} {v}");
        }
        create.push_dur(t.elapsed());
        let id = v["id"].as_str().context("id")?.to_owned();
        let f = run_code(&door, &id, json!({"code": "1+1"}), "2").await?;
        let s2 = run_code(&door, &id, json!({"code": "2+2"}), "4").await?;
        let t = Instant::now();
        let (s, b) = door
            .api
            .raw(
                Method::POST,
                &format!("/v1/sandboxes/{id}/ports/49999/contexts"),
                serde_json::to_vec(&json!({"language": "python"}))?,
            )
            .await
            .map_err(|e| anyhow!("{e}"))?;
        let ctx_v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        let cid = match ctx_v["id"].as_str() {
            Some(c) if s == 200 || s == 201 => c.to_owned(),
            _ => bail!("new context: {s} {}", String::from_utf8_lossy(&b)),
        };
        run_code(&door, &id, json!({"code": "1+1", "context_id": cid}), "2").await?;
        let c = t.elapsed();
        eprintln!(
            "interp {i}: first run_code in the fork {:.0} ms, second {:.0} ms, cold kernel start + first run {:.0} ms",
            f.as_secs_f64() * 1e3,
            s2.as_secs_f64() * 1e3,
            c.as_secs_f64() * 1e3
        );
        first.push_dur(f);
        second.push_dur(s2);
        cold.push_dur(c);
        let _ = door
            .api
            .json(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
    }
    drop(door);
    let (cs, fs, ss, ks) = (
        create.summary(),
        first.summary(),
        second.summary(),
        cold.summary(),
    );
    let mut t = Table::latency(
        format!(
            "Code interpreter (templates/code-interpreter): run_code(\"1+1\") in a fork of the template vs a cold kernel, same sandboxes (n={}); ratio = cold p50 / row p50",
            args.n
        ),
        &["ratio"],
    );
    let r = |s: &crate::stats::Summary| format!("{:.1}×", ks.p50 / s.p50);
    t.latency_row("create from the template", &cs, vec!["".into()]);
    t.latency_row(
        "first run_code in the fork (warm kernel of the snapshot)",
        &fs,
        vec![r(&fs)],
    );
    t.latency_row("second run_code", &ss, vec![r(&ss)]);
    t.latency_row(
        "cold: new kernel started + its first run_code",
        &ks,
        vec!["1×".into()],
    );
    sec.table(t);
    sec.headline(format!(
        "run_code: first call in a fork of the interpreter template p50 {} p99 {} vs a cold kernel start + first call p50 {} ({:.1}×); {}",
        fmt_ms(fs.p50),
        fmt_ms(fs.p99),
        fmt_ms(ks.p50),
        ks.p50 / fs.p50,
        ctx.accel
    ));
    sec.text(format!(
        "The template was ready in {:.1} s (an import from the host cache when an identical build was there). Guests: 1 vCPU, {} MiB, under {}.",
        build.as_secs_f64(),
        args.memory_mib,
        ctx.accel
    ));
    sec.data = json!({
        "params": {"n": args.n, "memory_mib": args.memory_mib, "accel": ctx.accel.to_string()},
        "template_ready_ms": build.as_secs_f64() * 1e3,
        "create_ms": create.0, "first_run_ms": first.0, "second_run_ms": second.0, "cold_kernel_ms": cold.0,
    });
    Ok(())
}
