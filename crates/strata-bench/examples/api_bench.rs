//! API benchmark of stratad: p50/p95/p99 of
//!
//! 1. create-from-template to the first exec answer, through the HTTP API;
//! 2. exec round trip of `true` through the HTTP API, through the service
//!    (no HTTP), and straight to the guest agent (the API's overhead);
//! 3. get / list latency with 100,000 sandbox records in the SQLite store
//!    (records inserted through the `Store` trait, no VMs), at the store and
//!    through the HTTP API.
//!
//! Run as root (loop-mounted btrfs pool, QEMU under TCG):
//!
//! ```text
//! cargo run --release -p strata-bench --example api_bench [-- --iterations 200 --creates 10 --records 100000]
//! ```
//!
//! The guest image is `$STRATA_TEST_IMAGE` or the newest in the image cache.
//! Everything lives under `/tmp/stratad-bench-*`; the VMs are deleted and the
//! pool unmounted at the end. The API client, the server, the teardown and
//! the store records are `strata_testkit`'s; the percentiles are the
//! benchmark's (`strata_bench::stats`, nearest rank).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;
use strata_bench::stats::percentile;
use strata_core::{Op, SandboxId, SandboxSize, SandboxState};
use strata_proto::client::ExecRequest as AgentExec;
use strata_testkit::fixtures::{commit_batched, sandbox_record};
use strata_testkit::{arg, serve, Api};
use stratad::caller::{Caller, SystemReason};
use stratad::clock::SystemClock;
use stratad::config::Config;
use stratad::engine::unavailable::UnavailableEngine;
use stratad::security::gate::GateOptions;
use stratad::store::{
    Event, EventPhase, SandboxFilter, SandboxRecord, SqliteStore, Store, DEFAULT_TENANT,
};
use stratad::App;

/// Result of the benchmarks.
type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `p50 p95 p99 (n)` in milliseconds.
fn summary(name: &str, samples: &[Duration]) {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    println!(
        "{name:<58} p50 {:>9.3} ms  p95 {:>9.3} ms  p99 {:>9.3} ms  (n={})",
        percentile(&ms, 50.0),
        percentile(&ms, 95.0),
        percentile(&ms, 99.0),
        ms.len()
    );
}

/// `exec true` through the API, to its exit line (exit 0 required).
async fn exec_true(h: &Api, id: &str) -> Res<()> {
    match h.exec_output(id, &["true"]).await? {
        (0, _) => Ok(()),
        (code, _) => Err(format!("exec true exited {code}").into()),
    }
}

// ---------------------------------------------------------------- VMs

async fn vm_bench(root: &Path, iterations: usize, creates: usize) -> Res<()> {
    let image = std::env::var_os("STRATA_TEST_IMAGE").map(PathBuf::from);
    let cfg = Config {
        data_dir: root.join("data"),
        run_dir: root.join("run"),
        image_dir: image,
        accel: strata_core::Accel::Tcg,
        pool_size_gib: 8,
        snapshot_interval: Duration::ZERO,
        idle_timeout: Duration::ZERO,
        default_size: SandboxSize {
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 2,
        },
        ..Config::default()
    };
    let engine = stratad::daemon::open_engine(&cfg).await?;
    let rt = engine.runtime().clone();
    let data_dir = cfg.data_dir.clone();
    let app = Arc::new(App::open(cfg, engine.clone())?);
    app.start().await.map_err(|e| e.message())?;
    let served = serve(app.router()).await?;
    let h = Api::new(served.url.clone()).admin_token_of(&data_dir);
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

    // 1. create -> first exec answer.
    let mut create_exec = Vec::new();
    let mut create_only = Vec::new();
    for _ in 0..creates {
        let t = Instant::now();
        let (s, v) = h
            .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
            .await?;
        if s != 201 {
            return Err(format!("create: {s} {v}").into());
        }
        create_only.push(t.elapsed());
        let id = v["id"].as_str().unwrap_or_default().to_owned();
        exec_true(&h, &id).await?;
        create_exec.push(t.elapsed());
        h.json(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await?;
    }

    // 2. exec round trips: API, service, agent.
    let (_, v) = h
        .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
        .await?;
    let id_s = v["id"].as_str().ok_or("no id")?.to_owned();
    let id: SandboxId = id_s.parse()?;
    let agent = rt.agent(&id).await?;
    let (mut api, mut service, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    let caller = Caller::system(SystemReason::Embedder);
    for _ in 0..10 {
        exec_true(&h, &id_s).await?;
        agent.exec_collect(AgentExec::argv(["true"])).await?;
    }
    for _ in 0..iterations {
        let t = Instant::now();
        exec_true(&h, &id_s).await?;
        api.push(t.elapsed());

        let t = Instant::now();
        let mut st = svc
            .exec(
                &caller,
                &id,
                AgentExec::argv(["true"]),
                &GateOptions::waiting(),
            )
            .await
            .map_err(|e| e.message())?;
        while let Some(ev) = st.next().await {
            ev?;
        }
        service.push(t.elapsed());

        let t = Instant::now();
        let out = agent.exec_collect(AgentExec::argv(["true"])).await?;
        if !out.status.success() {
            return Err("true failed in the guest".into());
        }
        direct.push(t.elapsed());
    }
    h.json(
        reqwest::Method::DELETE,
        &format!("/v1/sandboxes/{id_s}"),
        None,
    )
    .await?;

    println!("\n== VMs (QEMU microvm, TCG, 1 vCPU, 256 MiB; HTTP on loopback)");
    summary("create from template (201 answered)", &create_only);
    summary("create from template -> first exec answer", &create_exec);
    summary("exec `true` through the HTTP API", &api);
    summary("exec `true` through the service (no HTTP)", &service);
    summary("exec `true` straight to the agent", &direct);
    let med = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1000.0
    };
    let (a, s, d) = (med(&mut api), med(&mut service), med(&mut direct));
    println!(
        "API overhead at p50: {:.3} ms over the agent ({:.3} ms HTTP, {:.3} ms service)",
        a - d,
        a - s,
        s - d
    );
    app.stop();
    // A benchmark leaves nothing running behind it.
    rt.kill_all();
    Ok(())
}

// ---------------------------------------------------------------- store

fn record(i: usize, now: chrono::DateTime<chrono::Utc>) -> SandboxRecord {
    let state = match i % 10 {
        0 => SandboxState::Running,
        1 => SandboxState::Paused,
        2..=5 => SandboxState::Hibernated,
        _ => SandboxState::Deleted,
    };
    SandboxRecord {
        labels: [("team".to_owned(), format!("t{}", i % 50))].into(),
        ..sandbox_record(DEFAULT_TENANT, state, now)
    }
}

async fn store_bench(root: &Path, n: usize, iterations: usize) -> Res<()> {
    let cfg = Config {
        data_dir: root.join("store"),
        ..Config::default()
    };
    std::fs::create_dir_all(&cfg.data_dir)?;
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), cfg.db_readers)?);
    let now = chrono::Utc::now();
    let t = Instant::now();
    let records: Vec<SandboxRecord> = (0..n).map(|i| record(i, now)).collect();
    let ids: Vec<SandboxId> = records.iter().map(|r| r.id.clone()).collect();
    commit_batched(&*store, records, 1000)?;
    eprintln!(
        "inserted {n} records in {:.1} s (batches of 1000)",
        t.elapsed().as_secs_f64()
    );
    // Single inserts, as the service does them (one fsync'd transaction each).
    let mut inserts = Vec::new();
    for i in 0..200 {
        let r = record(i * 10, now);
        let ev = Event::new(&r, Op::Created, None, EventPhase::Pending, None, now);
        let t = Instant::now();
        store.insert_sandbox(&r, &ev)?;
        inserts.push(t.elapsed());
    }

    let pick = |k: usize| ids[(k * 7919) % ids.len()].clone();
    let (mut get, mut list, mut list_deep, mut list_filtered) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let base = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 100,
        ..SandboxFilter::default()
    };
    // A cursor deep into the table (page 500).
    let mut f = base.clone();
    for _ in 0..500 {
        match store.list_sandboxes(&f)?.next_cursor {
            Some(c) => f.cursor = Some(c),
            None => break,
        }
    }
    let deep_cursor = f.cursor.clone();
    for k in 0..iterations {
        let id = pick(k);
        let t = Instant::now();
        store.get_sandbox(&id)?.ok_or("missing record")?;
        get.push(t.elapsed());
        let t = Instant::now();
        store.list_sandboxes(&base)?;
        list.push(t.elapsed());
        let t = Instant::now();
        store.list_sandboxes(&SandboxFilter {
            cursor: deep_cursor.clone(),
            ..base.clone()
        })?;
        list_deep.push(t.elapsed());
        let t = Instant::now();
        store.list_sandboxes(&SandboxFilter {
            states: vec![SandboxState::Running],
            labels: [("team".to_owned(), format!("t{}", k % 50))].into(),
            ..base.clone()
        })?;
        list_filtered.push(t.elapsed());
    }
    println!("\n== store: SQLite (WAL, synchronous=FULL) with {n} sandbox records");
    summary("insert one sandbox (own transaction, fsync)", &inserts);
    summary("get by id", &get);
    summary("list first page (100)", &list);
    summary("list page 500 (keyset cursor, 100)", &list_deep);
    summary("list state=running&label=team=tN (100)", &list_filtered);

    // Through the HTTP API (an App over this store, no VMs).
    let app = Arc::new(App::new(
        cfg.clone(),
        store.clone(),
        Arc::new(UnavailableEngine),
        Arc::new(SystemClock),
    ));
    let served = serve(app.router()).await?;
    let h = Api::new(served.url.clone()).admin_token_of(&cfg.data_dir);
    let (mut get, mut list, mut list_deep) = (Vec::new(), Vec::new(), Vec::new());
    let deep = deep_cursor.unwrap_or_default();
    for k in 0..iterations {
        let id = pick(k + 13);
        let t = Instant::now();
        let (s, v) = h
            .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        get.push(t.elapsed());
        if s != 200 && s != 404 {
            return Err(format!("GET sandbox: {s} {v}").into());
        }
        let t = Instant::now();
        let (s, v) = h
            .json(reqwest::Method::GET, "/v1/sandboxes?limit=100", None)
            .await?;
        list.push(t.elapsed());
        if s != 200 {
            return Err(format!("list: {s} {v}").into());
        }
        let t = Instant::now();
        h.json(
            reqwest::Method::GET,
            &format!("/v1/sandboxes?limit=100&cursor={deep}"),
            None,
        )
        .await?;
        list_deep.push(t.elapsed());
    }
    println!("\n== HTTP API over that store (loopback, JSON)");
    summary("GET /v1/sandboxes/{id}", &get);
    summary("GET /v1/sandboxes?limit=100", &list);
    summary("GET /v1/sandboxes?limit=100&cursor=<page 500>", &list_deep);
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let iterations = arg("--iterations", 200);
    let creates = arg("--creates", 10);
    let records = arg("--records", 100_000);
    let root = tempfile::Builder::new()
        .prefix("stratad-bench-")
        .tempdir_in("/tmp")?
        .keep();
    let vm = vm_bench(&root, iterations, creates).await;
    let st = store_bench(&root, records, iterations).await;
    strata_testkit::teardown::remove_daemon_root(&root);
    vm?;
    st?;
    Ok(())
}
