//! Rolling-snapshot benchmark of stratad: what the rolling schedule costs
//! running sandboxes.
//!
//! Embeds the daemon (`App` over the real runtime, as `api_bench` does),
//! builds the default template, creates `--sandboxes` sandboxes (default 20,
//! 1 vCPU / 256 MiB / 2 GiB under TCG), then:
//!
//! 1. baseline: for `--seconds` (default 90) a client loop runs `exec true`
//!    against random sandboxes through the HTTP API, with no rolling
//!    schedule (the daemon's `snapshot_interval` is 0);
//! 2. rolling: every sandbox's interval is set to `--interval` seconds
//!    (default 10; recorded in the store, then rescheduled, exactly what a
//!    per-sandbox `snapshot_interval` does) and the same loop runs again for
//!    `--seconds`.
//!
//! It prints p50/p95/p99/max of the vCPU pause of the rolling snapshots (the
//! engine's `pause_ms` as recorded in the store, plus the daemon's
//! `snapshot_pause` histogram), how many were taken, how they spread over the
//! interval (most started within any 1-second window), and exec latency in
//! both phases.
//!
//! Run as root (loop-mounted btrfs pool, QEMU under TCG):
//!
//! ```text
//! cargo run --release -p stratad --example rolling_bench [-- --sandboxes 20 --interval 10 --seconds 90]
//! ```
//!
//! The guest image is `$STRATA_TEST_IMAGE` or the newest in the image cache.
//! Everything lives under `/tmp/stratad-rolling-*`; the VMs are killed and the
//! pool unmounted at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use strata_core::{SandboxId, SandboxSize};
use stratad::config::{Capacity, Config};
use stratad::store::{SnapshotKind, SnapshotRecord};
use stratad::App;

#[path = "support/mod.rs"]
mod support;

use support::{arg, cleanup, http, serve, Http, Res};

/// Nearest-rank quantile of sorted milliseconds.
fn q(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// `p50 p95 p99 max (n)` in milliseconds.
fn summary(name: &str, ms: &mut [f64]) {
    ms.sort_by(f64::total_cmp);
    println!(
        "{name:<52} p50 {:>9.3} ms  p95 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms  (n={})",
        q(ms, 0.50),
        q(ms, 0.95),
        q(ms, 0.99),
        ms.last().copied().unwrap_or(f64::NAN),
        ms.len()
    );
}

/// A small xorshift: which sandbox the next exec goes to.
struct Pick(u64);

impl Pick {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// Exec latencies (ms) of one phase, and the failures seen.
struct Phase {
    ms: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
}

/// Runs `exec true` against random sandboxes for `secs`, one at a time.
async fn exec_loop(h: &Http, ids: &[String], secs: u64, rng: &mut Pick) -> Phase {
    let mut p = Phase {
        ms: Vec::new(),
        errors: 0,
        first_error: None,
    };
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let id = &ids[rng.next(ids.len())];
        let t = Instant::now();
        match h.exec_true(id).await {
            Ok(()) => p.ms.push(t.elapsed().as_secs_f64() * 1000.0),
            Err(e) => {
                p.errors += 1;
                p.first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    p
}

async fn bench(root: &Path, n: usize, interval_s: u64, secs: u64) -> Res<()> {
    let image = std::env::var_os("STRATA_TEST_IMAGE").map(PathBuf::from);
    let cfg = Config {
        data_dir: root.join("data"),
        run_dir: root.join("run"),
        image_dir: image,
        accel: strata_core::Accel::Tcg,
        pool_size_gib: 16,
        // Off for the baseline; the rolling phase sets it per sandbox.
        snapshot_interval: Duration::ZERO,
        idle_timeout: Duration::ZERO,
        default_size: SandboxSize {
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 2,
        },
        // `n` 1-vCPU sandboxes on this host whatever its CPU count.
        capacity: Capacity {
            vcpus: n.max(1) as u32,
            ..Capacity::default()
        },
        ..Config::default()
    };
    let max_tasks = cfg.max_concurrent_tasks;
    let engine = stratad::daemon::open_engine(&cfg).await?;
    let rt = engine.runtime().clone();
    let data_dir = cfg.data_dir.clone();
    let app = Arc::new(App::open(cfg, engine.clone())?);
    let result = async {
        app.start().await.map_err(|e| e.message())?;
        let h = http(serve(&app).await?, &data_dir)?;
        let svc = app.service().clone();
        eprintln!("building the default template (cold boot under TCG)...");
        let t = Instant::now();
        svc.ensure_default_template()
            .await
            .map_err(|e| e.message())?;
        loop {
            let (_, v) = h
                .json(reqwest::Method::GET, "/v1/templates/tpl-default", None)
                .await?;
            match v["status"].as_str() {
                Some("ready") => break,
                Some("building") => tokio::time::sleep(Duration::from_millis(200)).await,
                _ => return Err(format!("template: {v}").into()),
            }
        }
        eprintln!("template ready in {:.1} s", t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let (s, v) = h
                .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
                .await?;
            if s != 201 {
                return Err(format!("create: {s} {v}").into());
            }
            let id = v["id"].as_str().ok_or("no id")?.to_owned();
            h.exec_true(&id).await?;
            ids.push(id);
        }
        eprintln!(
            "{n} sandboxes running in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let mut rng = Pick(0x9e37_79b9_7f4a_7c15);

        eprintln!("baseline: {secs} s of exec, no rolling schedule...");
        let mut base = exec_loop(&h, &ids, secs, &mut rng).await;

        // Turn the rolling schedule on: the sandbox's own interval, recorded
        // first (the scheduler re-reads records after each snapshot).
        let enabled_at = svc.now();
        for id in &ids {
            let sid: SandboxId = id.parse()?;
            let mut rec = svc.get_sandbox(&sid).await.map_err(|e| e.message())?;
            rec.snapshot_interval_s = Some(interval_s);
            let r = rec.clone();
            svc.db(move |s| s.update_sandbox(&r, None))
                .await
                .map_err(|e| e.message())?;
            svc.reschedule(&rec);
        }
        eprintln!("rolling: {secs} s of exec, every sandbox snapshotted every {interval_s} s...");
        let mut roll = exec_loop(&h, &ids, secs, &mut rng).await;
        let ended_at = svc.now();
        // Stop the schedule before reading the results.
        for id in &ids {
            let sid: SandboxId = id.parse()?;
            let mut rec = svc.get_sandbox(&sid).await.map_err(|e| e.message())?;
            rec.snapshot_interval_s = Some(0);
            svc.reschedule(&rec);
        }
        // Let snapshots already started finish.
        tokio::time::sleep(Duration::from_secs(3)).await;

        let mut snaps: Vec<SnapshotRecord> = Vec::new();
        for id in &ids {
            let sid: SandboxId = id.parse()?;
            let list = svc
                .db(move |s| s.list_snapshots(&sid, true))
                .await
                .map_err(|e| e.message())?;
            snaps.extend(list.into_iter().filter(|s| {
                s.kind == SnapshotKind::Rolling
                    && s.created_at >= enabled_at
                    && s.created_at <= ended_at
            }));
        }
        let mut pause: Vec<f64> = snaps.iter().filter_map(|s| s.pause_ms).collect();
        let mut starts: Vec<i64> = snaps
            .iter()
            .map(|s| s.created_at.timestamp_millis())
            .collect();
        starts.sort();
        // Most snapshots whose start falls in any 1-second window.
        let mut most = 0;
        let mut lo = 0;
        for hi in 0..starts.len() {
            while starts[hi] - starts[lo] >= 1000 {
                lo += 1;
            }
            most = most.max(hi - lo + 1);
        }
        let span_s = (ended_at - enabled_at).num_milliseconds() as f64 / 1000.0;
        let expected = (span_s / interval_s.max(1) as f64) * n as f64;
        let stats = app.service().metrics().stats();

        println!(
            "\n== rolling snapshots: {n} sandboxes (QEMU microvm, TCG, 1 vCPU, 256 MiB, 2 GiB), \
             interval {interval_s} s, {secs} s per phase, max_concurrent_tasks {max_tasks}"
        );
        summary("snapshot pause, rolling (store pause_ms)", &mut pause);
        if let Some(s) = stats.steps.get("snapshot_pause") {
            println!(
                "{:<52} p50 {:>9.3} ms  p95 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms  (n={})",
                "snapshot pause, daemon /v1/stats (all kinds)",
                s.p50_ms,
                s.p95_ms,
                s.p99_ms,
                s.max_ms,
                s.count
            );
        }
        if let Some(s) = stats.steps.get("snapshot") {
            println!(
                "{:<52} p50 {:>9.3} ms  p95 {:>9.3} ms  p99 {:>9.3} ms  max {:>9.3} ms  (n={})",
                "whole snapshot call, daemon /v1/stats (all kinds)",
                s.p50_ms,
                s.p95_ms,
                s.p99_ms,
                s.max_ms,
                s.count
            );
        }
        println!(
            "rolling snapshots taken: {} in {span_s:.1} s (schedule alone: ~{expected:.0}); \
             {} without pause_ms",
            snaps.len(),
            snaps.len() - pause.len()
        );
        println!(
            "spread: at most {most} snapshot(s) started within any 1-second window \
             (even spread: {:.1}/s)",
            n as f64 / interval_s.max(1) as f64
        );
        summary(
            "exec `true` via HTTP API, baseline (no schedule)",
            &mut base.ms,
        );
        summary(
            "exec `true` via HTTP API, rolling schedule on",
            &mut roll.ms,
        );
        let p99 = |v: &[f64]| q(v, 0.99);
        println!(
            "exec p99 rolling / baseline: {:.2}x; exec errors: baseline {}, rolling {}",
            p99(&roll.ms) / p99(&base.ms),
            base.errors,
            roll.errors
        );
        for (name, p) in [("baseline", &base), ("rolling", &roll)] {
            if let Some(e) = &p.first_error {
                println!("first {name} exec error: {e}");
            }
        }
        Ok(())
    }
    .await;
    app.stop();
    // A benchmark leaves nothing running behind it.
    rt.kill_all();
    result
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let n = arg("--sandboxes", 20);
    let interval = arg("--interval", 10) as u64;
    let secs = arg("--seconds", 90) as u64;
    let root = tempfile::Builder::new()
        .prefix("stratad-rolling-")
        .tempdir_in("/tmp")?
        .keep();
    let r = bench(&root, n, interval, secs).await;
    cleanup(&root);
    r
}
