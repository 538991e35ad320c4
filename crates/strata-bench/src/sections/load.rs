//! Section `load`: tail latency under load, and what the rolling snapshot
//! schedule does to it.
//!
//! A real stratad ([`BenchDaemon`]: the real runtime, SQLite, HTTP on
//! loopback) runs `--load-sandboxes` sandboxes created from its default
//! template. `--load-clients` closed-loop clients each pick a random sandbox
//! and a random operation per `--load-mix` (exec `true` / PUT a 64 KiB file /
//! POST a manual snapshot) for `--load-secs` seconds, twice: (a) with no
//! rolling schedule, (b) with every sandbox's rolling snapshot interval set to
//! `--load-interval` seconds. Every operation is recorded (phase, op, start,
//! latency, ok or the failure); the rolling snapshots of phase (b) are read
//! back from the store (their vCPU pause and when it happened).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use plotters::prelude::*;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxSize};
use stratad::caller::{Caller, SystemReason};
use stratad::store::{SnapshotKind, SnapshotRecord};

use crate::ctx::{BenchDaemon, Ctx, Http};
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, fmt_num, fmt_ratio, percentile, Summary};

/// Flags of the `load` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "load-args")]
pub struct Args {
    /// Sandboxes under load (1 vCPU each).
    #[arg(long, default_value_t = 20)]
    pub load_sandboxes: usize,
    /// Concurrent closed-loop clients.
    #[arg(long, default_value_t = 50)]
    pub load_clients: usize,
    /// Length of each phase (baseline, rolling), seconds.
    #[arg(long, default_value_t = 45)]
    pub load_secs: u64,
    /// Rolling snapshot interval of every sandbox in phase (b), seconds.
    #[arg(long, default_value_t = 10)]
    pub load_interval: u64,
    /// Guest memory of each sandbox, MiB.
    #[arg(long, default_value_t = 256)]
    pub load_mem: u64,
    /// Operation mix in percent: exec, file write, manual snapshot.
    #[arg(long, default_value = "80,15,5", value_parser = parse_mix)]
    pub load_mix: Mix,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.load_sandboxes = 2;
        self.load_clients = 4;
        self.load_secs = 8;
        self.load_interval = 2;
    }
}

/// Percent of operations that are exec, file write and manual snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Mix {
    /// `exec true`.
    pub exec: u32,
    /// PUT of a 64 KiB file.
    pub write: u32,
    /// POST of a manual snapshot.
    pub snapshot: u32,
}

impl Mix {
    /// The operation a uniform roll in `0..100` stands for.
    fn pick(&self, roll: u32) -> Op {
        if roll < self.exec {
            Op::Exec
        } else if roll < self.exec + self.write {
            Op::Write
        } else {
            Op::Snapshot
        }
    }
}

/// Parses `exec,write,snapshot` percentages summing to 100.
fn parse_mix(s: &str) -> Result<Mix, String> {
    let v: Vec<u32> = s
        .split(',')
        .map(|p| p.trim().parse::<u32>().map_err(|e| format!("{p:?}: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [exec, write, snapshot] if exec + write + snapshot == 100 => Ok(Mix {
            exec,
            write,
            snapshot,
        }),
        [_, _, _] => Err(format!("the mix {s:?} does not sum to 100")),
        _ => Err(format!(
            "expected three percentages exec,write,snapshot, got {s:?}"
        )),
    }
}

/// One kind of client operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
enum Op {
    Exec,
    Write,
    Snapshot,
}

impl Op {
    const ALL: [Op; 3] = [Op::Exec, Op::Write, Op::Snapshot];

    fn name(self) -> &'static str {
        match self {
            Op::Exec => "exec `true`",
            Op::Write => "file write 64 KiB",
            Op::Snapshot => "manual snapshot",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Op::Exec => "exec",
            Op::Write => "write",
            Op::Snapshot => "snapshot",
        }
    }
}

const PHASES: [&str; 2] = ["baseline", "rolling"];
const FILE_BYTES: usize = 64 * 1024;
/// Width of the timeline's windows, seconds.
const WINDOW_S: f64 = 2.0;

/// One operation as a client saw it.
#[derive(Debug, Clone, Serialize)]
struct Rec {
    /// 0 = baseline, 1 = rolling.
    phase: usize,
    op: Op,
    sandbox: usize,
    /// Seconds since the start of phase (a).
    start_s: f64,
    ms: f64,
    /// The failure's class (`429`, `409`, `transport`, `exit 1`, …); None = ok.
    err: Option<String>,
    /// A manual snapshot's vCPU pause, from the API's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pause_ms: Option<f64>,
}

/// A failed operation: its class (for counting) and the message.
struct Fail {
    class: String,
    msg: String,
}

fn fail(class: impl Into<String>, msg: impl Into<String>) -> Fail {
    Fail {
        class: class.into(),
        msg: msg.into(),
    }
}

fn transport(e: reqwest::Error) -> Fail {
    fail("transport", e.to_string())
}

/// Sends `rb`; the body when the answer has status `want`, else a failure
/// classed by its status (`what` names the operation in the message).
async fn send(rb: reqwest::RequestBuilder, want: u16, what: &str) -> Result<bytes::Bytes, Fail> {
    let resp = rb.send().await.map_err(transport)?;
    let status = resp.status().as_u16();
    let body = resp.bytes().await.map_err(transport)?;
    if status != want {
        return Err(fail(
            status.to_string(),
            format!("{what}: {status} {}", String::from_utf8_lossy(&body)),
        ));
    }
    Ok(body)
}

/// `exec true` through the API, to its exit line.
async fn op_exec(h: &Http, id: &str) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({ "cmd": ["true"] }));
    let body = send(rb, 200, "exec").await?;
    match exit_code(&body) {
        Some(0) => Ok(None),
        Some(c) => Err(fail(format!("exit {c}"), format!("exec true exited {c}"))),
        None => Err(fail(
            "no exit line",
            format!("exec: no exit line in {}", String::from_utf8_lossy(&body)),
        )),
    }
}

/// The exit code in an exec response (NDJSON, one line `{"exit":{"code":…}}`).
fn exit_code(body: &[u8]) -> Option<i64> {
    body.split(|b| *b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .find_map(|v| v.pointer("/exit/code").and_then(Value::as_i64))
}

/// PUT of a 64 KiB file through the files API.
async fn op_write(h: &Http, id: &str, client: usize, data: &[u8]) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/load-{client}.bin"),
        )
        .body(data.to_vec());
    send(rb, 201, "file write").await?;
    Ok(None)
}

/// POST of a manual snapshot; its vCPU pause from the answer.
async fn op_snapshot(h: &Http, id: &str) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/snapshots"),
        )
        .json(&json!({ "label": "load" }));
    let body = send(rb, 201, "snapshot").await?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(v.get("pause_ms").and_then(Value::as_f64))
}

/// What the clients of one phase did.
struct PhaseOut {
    recs: Vec<Rec>,
    /// First failure message per op.
    first_err: BTreeMap<Op, String>,
}

/// Runs the closed-loop clients for `secs`; times are relative to `t0`.
async fn run_phase(
    h: &Http,
    ids: &Arc<Vec<String>>,
    args: &Args,
    phase: usize,
    t0: Instant,
) -> Result<PhaseOut> {
    let end = Instant::now() + Duration::from_secs(args.load_secs);
    let mut tasks = Vec::new();
    for client in 0..args.load_clients {
        let h = h.clone();
        let ids = ids.clone();
        let mix = args.load_mix;
        let seed = 0x5eed_0000 + (phase as u64) * 10_000 + client as u64;
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let data: Vec<u8> = (0..FILE_BYTES).map(|i| (i * 31 + client) as u8).collect();
            let mut recs = Vec::new();
            let mut first_err: BTreeMap<Op, String> = BTreeMap::new();
            while Instant::now() < end {
                let sandbox = rng.gen_range(0..ids.len());
                let op = mix.pick(rng.gen_range(0..100));
                let id = &ids[sandbox];
                let t = Instant::now();
                let r = match op {
                    Op::Exec => op_exec(&h, id).await,
                    Op::Write => op_write(&h, id, client, &data).await,
                    Op::Snapshot => op_snapshot(&h, id).await,
                };
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                let start_s = t.duration_since(t0).as_secs_f64();
                let (err, pause_ms) = match r {
                    Ok(p) => (None, p),
                    Err(f) => {
                        first_err.entry(op).or_insert(f.msg);
                        (Some(f.class), None)
                    }
                };
                recs.push(Rec {
                    phase,
                    op,
                    sandbox,
                    start_s,
                    ms,
                    err,
                    pause_ms,
                });
            }
            (recs, first_err)
        }));
    }
    let mut out = PhaseOut {
        recs: Vec::new(),
        first_err: BTreeMap::new(),
    };
    for t in tasks {
        let (recs, errs) = t.await.context("a load client panicked")?;
        out.recs.extend(recs);
        for (op, m) in errs {
            out.first_err.entry(op).or_insert(m);
        }
    }
    out.recs.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    Ok(out)
}

/// Sets every sandbox's own rolling interval (`0` = off) and reschedules it.
///
/// There is no API to change a running sandbox's interval (only at create),
/// so this does what a per-sandbox `snapshot_interval` does: record it in the
/// store, then tell the scheduler.
async fn set_interval(d: &BenchDaemon, ids: &[String], secs: u64) -> Result<()> {
    let svc = d.app.service().clone();
    for id in ids {
        let sid: SandboxId = id.parse().map_err(|e| anyhow!("sandbox id {id}: {e}"))?;
        let mut rec = svc
            .get_sandbox(&Caller::system(SystemReason::Embedder), &sid)
            .await
            .map_err(|e| anyhow!("get {id}: {}", e.message()))?;
        rec.snapshot_interval_s = Some(secs);
        let r = rec.clone();
        svc.db(move |s| s.update_sandbox(&r, None))
            .await
            .map_err(|e| anyhow!("record the interval of {id}: {}", e.message()))?;
        svc.reschedule(&rec);
    }
    Ok(())
}

/// A rolling snapshot of phase (b): when (s since phase (a)'s start), which
/// sandbox, its vCPU pause.
#[derive(Debug, Clone, Serialize)]
struct Rolling {
    at_s: f64,
    sandbox: usize,
    pause_ms: Option<f64>,
}

/// Most events whose times fall in any window of `width` (times ascending).
fn most_in_window(times: &[f64], width: f64) -> usize {
    let mut most = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= width {
            lo += 1;
        }
        most = most.max(hi - lo + 1);
    }
    most
}

/// `(window mid, p50, p99)` of the latencies in consecutive windows of
/// `width` seconds over `[from, to)`; windows without samples are left out.
fn windows(samples: &[(f64, f64)], from: f64, to: f64, width: f64) -> Vec<(f64, f64, f64)> {
    let mut out = Vec::new();
    let mut w0 = from;
    while w0 < to {
        let mut v: Vec<f64> = samples
            .iter()
            .filter(|(t, _)| *t >= w0 && *t < w0 + width)
            .map(|(_, ms)| *ms)
            .collect();
        if !v.is_empty() {
            v.sort_by(f64::total_cmp);
            out.push((w0 + width / 2.0, percentile(&v, 50.0), percentile(&v, 99.0)));
        }
        w0 += width;
    }
    out
}

/// Whether `[a0, a1]` and `[b0, b1]` overlap.
fn overlaps(a0: f64, a1: f64, b0: f64, b1: f64) -> bool {
    a0 <= b1 && b0 <= a1
}

/// `n (k×class, …)` of failures, `0` when none.
fn error_cell(recs: &[&Rec]) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for r in recs {
        if let Some(e) = &r.err {
            *by.entry(e.as_str()).or_default() += 1;
        }
    }
    let n: usize = by.values().sum();
    if n == 0 {
        return "0".into();
    }
    let parts: Vec<String> = by.iter().map(|(k, v)| format!("{v}× {k}")).collect();
    format!("{n} ({})", parts.join(", "))
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let n = args.load_sandboxes.max(1);
    let mix = args.load_mix;
    sec.text(format!(
        "A real stratad (real runtime, SQLite store, HTTP API on loopback) runs {n} sandboxes \
         (1 vCPU, {} MiB, QEMU microvm under {}) created from its default template. {} \
         closed-loop clients each pick a random sandbox and an operation ({}% `exec true`, {}% PUT of \
         a 64 KiB file, {}% POST of a manual snapshot) and time it from sending the request to \
         the end of the answer: for exec, the NDJSON stream up to its exit line (exit 0 required); \
         for the file write the `201`; for the snapshot the `201` with the snapshot record. Phase (a), \
         baseline: {} s with no rolling schedule. Phase (b), rolling: every sandbox's rolling \
         snapshot interval set to {} s (recorded in the store, then rescheduled: the API sets it \
         only at create) and the same clients for {} s. Every failure is counted per operation \
         (HTTP status, transport error or non-zero exit), never dropped; percentiles are over the \
         successful operations. The daemon's per-token rate limit (by default 50 requests/s, burst \
         100, and all clients share the admin token) is raised to 100000/s so that it does not \
         shape the load; the measured request rates are printed below the table. Before the \
         phases, one client alone runs `exec true` {} times round-robin over the sandboxes: the \
         unloaded reference. The rolling snapshots' vCPU pauses and times come from the store's \
         snapshot records.",
        args.load_mem,
        ctx.accel,
        args.load_clients,
        mix.exec,
        mix.write,
        mix.snapshot,
        args.load_secs,
        args.load_interval,
        args.load_secs,
        idle_runs(ctx),
    ));
    let cpus = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    sec.text(format!(
        "Host: {cpus} CPUs for {n} guests (one QEMU each, {} emulated), {} clients, the daemon and \
         this harness, all competing: latencies measure a saturated host, not a quiet one.",
        ctx.accel, args.load_clients
    ));
    let mut data = json!({
        "params": {
            "sandboxes": n, "clients": args.load_clients, "secs": args.load_secs,
            "interval_s": args.load_interval, "mem_mib": args.load_mem, "mix": mix,
            "file_bytes": FILE_BYTES, "window_s": WINDOW_S,
            "rate_limit_per_second": 100000.0, "accel": ctx.accel.to_string(),
        }
    });
    sec.data = data.clone();

    let size = SandboxSize {
        vcpus: 1,
        memory_mib: args.load_mem as u32,
        disk_gib: 2,
    };
    eprintln!("load: starting stratad and building its default template (cold boot)...");
    let t = Instant::now();
    let d = BenchDaemon::start(ctx, "strata-bench-load-", 16, size, |cfg| {
        // `n` 1-vCPU sandboxes whatever the host's CPU count.
        cfg.capacity.vcpus = n as u32;
        // `App::stop` leaves the exit watcher running: with auto-recovery on,
        // the teardown's kill of the VMs would have them restored (and leaked).
        cfg.auto_recover = false;
        cfg.security.rate_limit_per_second = 100_000.0;
        cfg.security.rate_limit_burst = 100_000;
    })
    .await?;
    let template_s = t.elapsed().as_secs_f64();
    eprintln!("load: template ready in {template_s:.1} s; creating {n} sandboxes...");

    // Created two at a time: each is a restore of the template's snapshot.
    let t = Instant::now();
    let creates = futures::stream::iter(0..n)
        .map(|_| {
            let h = d.http.clone();
            async move {
                let t = Instant::now();
                let v = h
                    .expect(
                        reqwest::Method::POST,
                        "/v1/sandboxes",
                        Some(json!({ "snapshot_interval": "0s" })),
                        201,
                    )
                    .await?;
                let id = v["id"]
                    .as_str()
                    .ok_or_else(|| anyhow!("create: no id in {v}"))?
                    .to_owned();
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                let (code, _) = h.exec(&id, &["true"]).await?;
                if code != 0 {
                    return Err(anyhow!("warm-up exec in {id} exited {code}"));
                }
                Ok::<_, anyhow::Error>((id, ms))
            }
        })
        .buffer_unordered(2)
        .collect::<Vec<_>>()
        .await;
    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    for c in creates {
        let (id, ms) = c.context("create a sandbox")?;
        ids.push(id);
        create_ms.push(ms);
    }
    let setup_s = t.elapsed().as_secs_f64();
    let cs = Summary::of(&create_ms);
    eprintln!("load: {n} sandboxes running in {setup_s:.1} s");
    sec.text(format!(
        "Setup: default template built in {template_s:.1} s; {n} sandboxes created and answering \
         in {setup_s:.1} s (create p50 {}, max {}, two at a time).",
        fmt_ms(cs.p50),
        fmt_ms(cs.max)
    ));
    data["setup"] = json!({ "template_s": template_s, "create_ms": create_ms, "setup_s": setup_s });
    sec.data = data.clone();
    let intro_blocks = sec.blocks.len();
    let ids = Arc::new(ids);
    let index: BTreeMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();

    // The unloaded reference: one client, one exec at a time.
    let mut idle = Vec::new();
    for i in 0..idle_runs(ctx) {
        let id = &ids[i % ids.len()];
        let t = Instant::now();
        op_exec(&d.http, id)
            .await
            .map_err(|f| anyhow!("unloaded exec: {}", f.msg))?;
        idle.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    data["idle_exec_ms"] = json!(idle);
    sec.data = data.clone();

    let load_before = loadavg();
    let svc = d.app.service().clone();
    let t0 = Instant::now();
    let t0_utc = svc.now();
    let since_t0 = |at: DateTime<Utc>| (at - t0_utc).num_milliseconds() as f64 / 1000.0;

    eprintln!(
        "load: phase (a) baseline: {} clients for {} s...",
        args.load_clients, args.load_secs
    );
    let a = run_phase(&d.http, &ids, args, 0, t0).await?;
    let a_end = t0.elapsed().as_secs_f64();
    sec.table(ops_table(args, &idle, &[&a]));
    data["records"] = json!(a.recs);
    sec.data = data.clone();

    set_interval(&d, &ids, args.load_interval).await?;
    let b_start_utc = svc.now();
    let b_start = since_t0(b_start_utc);
    eprintln!(
        "load: phase (b) rolling every {} s: {} clients for {} s...",
        args.load_interval, args.load_clients, args.load_secs
    );
    let b = run_phase(&d.http, &ids, args, 1, t0).await?;
    let b_end_utc = svc.now();
    let b_end = since_t0(b_end_utc);
    set_interval(&d, &ids, 0).await?;
    // Let a snapshot already under way finish before reading the records.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut rolling: Vec<Rolling> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let sid: SandboxId = id.parse().map_err(|e| anyhow!("sandbox id {id}: {e}"))?;
        let list: Vec<SnapshotRecord> = svc
            .db(move |s| s.list_snapshots(&sid, true))
            .await
            .map_err(|e| anyhow!("list the snapshots of {id}: {}", e.message()))?;
        rolling.extend(
            list.into_iter()
                .filter(|s| {
                    s.kind == SnapshotKind::Rolling
                        && s.created_at >= b_start_utc
                        && s.created_at <= b_end_utc
                })
                .map(|s| Rolling {
                    at_s: since_t0(s.created_at),
                    sandbox: index.get(s.sandbox_id.as_str()).copied().unwrap_or(i),
                    pause_ms: s.pause_ms,
                }),
        );
    }
    rolling.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));

    sec.blocks.truncate(intro_blocks);
    let bounds = Bounds {
        a_end,
        b_start,
        b_end,
    };
    let stats = svc.metrics().stats();
    let daemon_pause = stats.steps.get("snapshot_pause");
    report_all(
        sec,
        ctx,
        args,
        &idle,
        &a,
        &b,
        &rolling,
        &bounds,
        daemon_pause,
    )?;
    let load_after = loadavg();
    sec.text(format!(
        "Host load average (1 min) when phase (a) started: {}; when phase (b) ended: {} \
         (everything on the machine counts, including other work running beside this benchmark).",
        load_before.map(fmt_num).unwrap_or_else(|| "unknown".into()),
        load_after.map(fmt_num).unwrap_or_else(|| "unknown".into()),
    ));
    data["loadavg"] = json!({ "before": load_before, "after": load_after });
    let expected = (b_end - b_start).max(0.0) / args.load_interval.max(1) as f64 * n as f64;
    if (rolling.len() as f64) < 0.9 * expected {
        sec.text(format!(
            "The schedule asked for about {expected:.0} rolling snapshots in phase (b) and {} were \
             taken: the daemon runs at most {} scheduled snapshots at once and a slot that comes due \
             while the scheduler waits for a free one is not made up for, and a \
             scheduled snapshot that finds its sandbox busy with another operation (here, a \
             manual snapshot) is skipped; with pauses this long the schedule fell behind.",
            rolling.len(),
            svc.config().max_concurrent_tasks
        ));
    }
    let mut all = a.recs.clone();
    all.extend(b.recs.iter().cloned());
    data["records"] = json!(all);
    data["rolling_snapshots"] = json!(rolling);
    data["phase_bounds_s"] = json!({ "a": [0.0, a_end], "b": [b_start, b_end] });
    data["first_errors"] = json!({
        "baseline": a.first_err.iter().map(|(k, v)| (k.key(), v.clone())).collect::<BTreeMap<_, _>>(),
        "rolling": b.first_err.iter().map(|(k, v)| (k.key(), v.clone())).collect::<BTreeMap<_, _>>(),
    });
    if let Some(s) = daemon_pause {
        data["daemon_snapshot_pause_all_kinds"] = json!(s);
    }
    sec.data = data;
    d.stop();
    Ok(())
}

/// Where the phases lie, seconds since phase (a)'s start.
struct Bounds {
    a_end: f64,
    b_start: f64,
    b_end: f64,
}

/// Successful latencies of `op` in `p`.
fn ok_ms(p: &PhaseOut, op: Op) -> Vec<f64> {
    p.recs
        .iter()
        .filter(|r| r.op == op && r.err.is_none())
        .map(|r| r.ms)
        .collect()
}

/// The op × phase table: n, percentiles, errors, throughput and, on the
/// rolling rows, the p99 ratio rolling / baseline.
fn ops_table(args: &Args, idle: &[f64], phases: &[&PhaseOut]) -> Table {
    let mut t = Table::latency(
        format!(
            "Client-side latency per operation and phase ({} clients, {} sandboxes, {} s per phase; successful operations)",
            args.load_clients, args.load_sandboxes, args.load_secs
        ),
        &["errors", "ops/s", "p99 rolling / baseline"],
    );
    t.latency_row(
        "exec `true` — unloaded reference (one client)",
        &Summary::of(idle),
        vec!["0".into(), String::new(), String::new()],
    );
    for op in Op::ALL {
        let base_p99 = phases
            .first()
            .map(|p| Summary::of(&ok_ms(p, op)).p99)
            .unwrap_or(f64::NAN);
        for (i, p) in phases.iter().enumerate() {
            let s = Summary::of(&ok_ms(p, op));
            let recs: Vec<&Rec> = p.recs.iter().filter(|r| r.op == op).collect();
            let ratio = if i == 0 {
                String::new()
            } else {
                fmt_ratio(s.p99, base_p99)
            };
            t.latency_row(
                format!("{} — {}", op.name(), PHASES[i]),
                &s,
                vec![
                    error_cell(&recs),
                    fmt_num(s.n as f64 / args.load_secs.max(1) as f64),
                    ratio,
                ],
            );
        }
    }
    t
}

/// The host's 1-minute load average.
fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Execs of the unloaded reference (one client, one at a time).
fn idle_runs(ctx: &Ctx) -> usize {
    if ctx.smoke {
        5
    } else {
        40
    }
}

/// The request rate each phase put on the daemon, against its default limit.
fn rate_note(args: &Args, phases: &[&PhaseOut]) -> String {
    let secs = args.load_secs.max(1) as f64;
    let rates: Vec<String> = phases
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "{} {} requests/s",
                PHASES[i],
                fmt_num(p.recs.len() as f64 / secs)
            )
        })
        .collect();
    format!(
        "Request rate on the daemon (all operations, one shared token): {}; the default \
         per-token limit is 50/s with a burst of 100.",
        rates.join(", ")
    )
}

/// Writes the whole section once both phases are measured.
#[allow(clippy::too_many_arguments)]
fn report_all(
    sec: &mut Section,
    ctx: &Ctx,
    args: &Args,
    idle: &[f64],
    a: &PhaseOut,
    b: &PhaseOut,
    rolling: &[Rolling],
    bounds: &Bounds,
    daemon_pause: Option<&stratad::metrics::Summary>,
) -> Result<()> {
    sec.table(ops_table(args, idle, &[a, b]));
    sec.text(rate_note(args, &[a, b]));

    // Execs of phase (b) that overlapped a rolling snapshot's pause of their own sandbox.
    let n = args.load_sandboxes.max(1);
    let mut hit = Vec::new();
    let mut clear = Vec::new();
    for r in b
        .recs
        .iter()
        .filter(|r| r.op == Op::Exec && r.err.is_none())
    {
        let end = r.start_s + r.ms / 1000.0;
        let touched = rolling.iter().any(|s| {
            s.sandbox == r.sandbox
                && overlaps(
                    r.start_s,
                    end,
                    s.at_s,
                    s.at_s + s.pause_ms.unwrap_or(0.0) / 1000.0,
                )
        });
        if touched {
            hit.push(r.ms);
        } else {
            clear.push(r.ms);
        }
    }
    let base_exec = Summary::of(&ok_ms(a, Op::Exec));
    let mut t = Table::latency(
        "Phase (b) execs split by whether a rolling snapshot paused their own sandbox while they ran",
        &["p99 / baseline p99"],
    );
    let hs = Summary::of(&hit);
    let cs = Summary::of(&clear);
    t.latency_row(
        "exec overlapping its sandbox's rolling snapshot pause",
        &hs,
        vec![fmt_ratio(hs.p99, base_exec.p99)],
    );
    t.latency_row(
        "exec with no rolling snapshot of its sandbox meanwhile",
        &cs,
        vec![fmt_ratio(cs.p99, base_exec.p99)],
    );
    sec.table(t);

    // The rolling snapshots themselves.
    let pauses: Vec<f64> = rolling.iter().filter_map(|s| s.pause_ms).collect();
    let span = (bounds.b_end - bounds.b_start).max(0.0);
    let expected = span / args.load_interval.max(1) as f64 * n as f64;
    let times: Vec<f64> = rolling.iter().map(|s| s.at_s).collect();
    let most = most_in_window(&times, 1.0);
    let mut t = Table::latency("vCPU pause of the snapshots", &["notes"]);
    let ps = Summary::of(&pauses);
    t.latency_row(
        "rolling, phase (b) (store `pause_ms`)",
        &ps,
        vec![format!(
            "{} taken in {:.0} s (schedule: ~{:.0}); {} without pause_ms; at most {most} started in any 1 s",
            rolling.len(),
            span,
            expected,
            rolling.len() - pauses.len()
        )],
    );
    for (i, p) in [a, b].iter().enumerate() {
        let m: Vec<f64> = p
            .recs
            .iter()
            .filter(|r| r.op == Op::Snapshot)
            .filter_map(|r| r.pause_ms)
            .collect();
        t.latency_row(
            format!("manual, phase ({}) (API answer `pause_ms`)", ["a", "b"][i]),
            &Summary::of(&m),
            vec![String::new()],
        );
    }
    if let Some(s) = daemon_pause {
        t.row(vec![
            "daemon `snapshot_pause` histogram, whole run, all kinds".into(),
            s.count.to_string(),
            fmt_ms(s.p50_ms),
            fmt_ms(s.p95_ms),
            fmt_ms(s.p99_ms),
            fmt_ms(s.max_ms),
            "cross-check (HDR histogram)".into(),
        ]);
    }
    sec.table(t);

    let errs: Vec<String> = [a, b]
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            p.first_err
                .iter()
                .map(move |(op, m)| format!("- {} / {}: `{}`", PHASES[i], op.key(), m))
        })
        .collect();
    if !errs.is_empty() {
        sec.text(format!(
            "First failure of each kind (all failures are counted in the table):\n\n{}",
            errs.join("\n")
        ));
    }

    // Plots.
    let exec_pts = |p: &PhaseOut| -> Vec<(f64, f64)> {
        p.recs
            .iter()
            .filter(|r| r.op == Op::Exec && r.err.is_none())
            .map(|r| (r.start_s, r.ms))
            .collect()
    };
    let wa = windows(&exec_pts(a), 0.0, bounds.a_end, WINDOW_S);
    let wb = windows(&exec_pts(b), bounds.b_start, bounds.b_end, WINDOW_S);
    let stems: Vec<(f64, f64)> = rolling
        .iter()
        .filter_map(|s| s.pause_ms.map(|p| (s.at_s, p)))
        .collect();
    let file = "load-timeline.svg";
    timeline(&ctx.file(file), &wa, &wb, &stems, bounds)?;
    sec.plot(
        file,
        format!(
            "Exec `true` latency over time, p50 and p99 per {WINDOW_S:.0} s window: baseline, then \
             with every sandbox snapshotted every {} s (shaded); each rolling snapshot is a \
             vertical stem as tall as its vCPU pause",
            args.load_interval
        ),
    );
    let file = "load-cdf.svg";
    plot::cdf(
        &ctx.file(file),
        "exec `true` under load: baseline vs rolling snapshots",
        "ms",
        &[
            ("baseline".into(), ok_ms(a, Op::Exec)),
            ("rolling snapshots on".into(), ok_ms(b, Op::Exec)),
        ],
    )?;
    sec.plot(
        file,
        "CDF of exec `true` latency (client side, through the API) in both phases",
    );

    // Headlines.
    let be = Summary::of(&ok_ms(b, Op::Exec));
    let errors = |p: &PhaseOut| p.recs.iter().filter(|r| r.err.is_some()).count();
    let total = |p: &PhaseOut| p.recs.len();
    sec.headline(format!(
        "{} clients on {n} sandboxes ({} CPUs, {}): exec `true` p50/p99 {} / {} baseline (n={}) vs \
         {} / {} with every sandbox snapshotted every {} s (n={}): p99 ratio {} ({}; unloaded \
         exec p50 {})",
        args.load_clients,
        std::thread::available_parallelism()
            .map(|c| c.get())
            .unwrap_or(1),
        ctx.accel,
        fmt_ms(base_exec.p50),
        fmt_ms(base_exec.p99),
        base_exec.n,
        fmt_ms(be.p50),
        fmt_ms(be.p99),
        args.load_interval,
        be.n,
        fmt_ratio(be.p99, base_exec.p99),
        if be.p99 > base_exec.p99 * 1.5 {
            "target missed: the schedule spikes exec p99 by more than 1.5×"
        } else {
            "target met: no exec p99 spike above 1.5×"
        },
        fmt_ms(Summary::of(idle).p50),
    ));
    sec.headline(format!(
        "Rolling snapshot vCPU pause p50/p99 {} / {} (n={}, {:.0} expected); operations failed: {} of {} baseline, {} of {} rolling",
        fmt_ms(ps.p50),
        fmt_ms(ps.p99),
        ps.n,
        expected,
        errors(a),
        total(a),
        errors(b),
        total(b)
    ));
    Ok(())
}

/// The timeline plot: exec p50/p99 per window in both phases, phase (b)
/// shaded, rolling snapshots as stems of their pause.
fn timeline(
    path: &std::path::Path,
    wa: &[(f64, f64, f64)],
    wb: &[(f64, f64, f64)],
    stems: &[(f64, f64)],
    bounds: &Bounds,
) -> Result<()> {
    let e = |x: String| anyhow!("plot {}: {x}", path.display());
    let ymax = wa
        .iter()
        .chain(wb)
        .map(|w| w.2)
        .chain(stems.iter().map(|s| s.1))
        .filter(|v| v.is_finite())
        .fold(1.0_f64, f64::max)
        * 1.4;
    let xmax = bounds.b_end.max(bounds.a_end).max(1.0);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("exec `true` latency over time", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the baseline started")
        .y_desc("ms")
        .x_label_formatter(&|v| fmt_num(*v))
        .y_label_formatter(&|v| fmt_num(*v))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|x| e(x.to_string()))?;
    let shade = RGBColor(255, 240, 220);
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(bounds.b_start, 0.0), (bounds.b_end, ymax)],
            shade.filled(),
        )))
        .map_err(|x| e(x.to_string()))?
        .label("phase (b): rolling schedule on")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 18, y + 5)], shade.filled()));
    let stem = RGBColor(214, 39, 40);
    chart
        .draw_series(
            stems
                .iter()
                .map(|&(t, ms)| PathElement::new(vec![(t, 0.0), (t, ms)], stem.stroke_width(1))),
        )
        .map_err(|x| e(x.to_string()))?
        .label("rolling snapshot (height: its vCPU pause, ms)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], stem.stroke_width(3)));
    type Line = Vec<(f64, f64)>;
    let lines: [(&str, RGBColor, Line); 4] = [
        (
            "exec p99, baseline",
            RGBColor(31, 119, 180),
            wa.iter().map(|w| (w.0, w.2)).collect(),
        ),
        (
            "exec p50, baseline",
            RGBColor(140, 190, 230),
            wa.iter().map(|w| (w.0, w.1)).collect(),
        ),
        (
            "exec p99, rolling",
            RGBColor(255, 127, 14),
            wb.iter().map(|w| (w.0, w.2)).collect(),
        ),
        (
            "exec p50, rolling",
            RGBColor(250, 190, 130),
            wb.iter().map(|w| (w.0, w.1)).collect(),
        ),
    ];
    for (name, c, pts) in lines {
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 2, c.filled())))
            .map_err(|x| e(x.to_string()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_parses_and_picks() {
        let m = parse_mix("80,15,5").expect("mix");
        assert_eq!(
            m,
            Mix {
                exec: 80,
                write: 15,
                snapshot: 5
            }
        );
        assert_eq!(m.pick(0), Op::Exec);
        assert_eq!(m.pick(79), Op::Exec);
        assert_eq!(m.pick(80), Op::Write);
        assert_eq!(m.pick(94), Op::Write);
        assert_eq!(m.pick(95), Op::Snapshot);
        assert_eq!(m.pick(99), Op::Snapshot);
        assert!(parse_mix("80,15").is_err());
        assert!(parse_mix("80,15,6").is_err());
        assert!(parse_mix("a,b,c").is_err());
        let only = parse_mix("100, 0, 0").expect("mix");
        assert!((0..100).all(|r| only.pick(r) == Op::Exec));
    }

    #[test]
    fn windows_and_spread() {
        let s = [(0.1, 1.0), (0.5, 3.0), (1.9, 2.0), (2.5, 10.0), (5.0, 4.0)];
        let w = windows(&s, 0.0, 6.0, 2.0);
        assert_eq!(w, vec![(1.0, 2.0, 3.0), (3.0, 10.0, 10.0), (5.0, 4.0, 4.0)]);
        assert_eq!(most_in_window(&[0.0, 0.5, 0.9, 1.0, 3.0], 1.0), 3);
        assert_eq!(most_in_window(&[], 1.0), 0);
        assert!(overlaps(0.0, 1.0, 1.0, 2.0));
        assert!(!overlaps(0.0, 1.0, 1.1, 2.0));
    }

    #[test]
    fn exit_lines_and_errors() {
        let body = b"{\"stdout\":\"\"}\n{\"exit\":{\"code\":0}}\n";
        assert_eq!(exit_code(body), Some(0));
        assert_eq!(exit_code(b"{\"exit\":{\"code\":3}}"), Some(3));
        assert_eq!(exit_code(b"garbage\n"), None);
        let rec = |err: Option<&str>| Rec {
            phase: 0,
            op: Op::Exec,
            sandbox: 0,
            start_s: 0.0,
            ms: 1.0,
            err: err.map(str::to_owned),
            pause_ms: None,
        };
        let v = [
            rec(None),
            rec(Some("429")),
            rec(Some("429")),
            rec(Some("409")),
        ];
        let refs: Vec<&Rec> = v.iter().collect();
        assert_eq!(error_cell(&refs), "3 (1× 409, 2× 429)");
        assert_eq!(error_cell(&refs[..1]), "0");
    }
}
