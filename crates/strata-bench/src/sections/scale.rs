//! Section `scale`: the control plane at scale, without VMs.
//!
//! 1. The daemon's SQLite store (WAL, `synchronous=FULL`, the same
//!    `SqliteStore` stratad runs on) holding `--scale-records` sandbox
//!    records (default 1,000,000): create, update, get and list latency at
//!    the store, and get/list through the HTTP API (the daemon's router and
//!    security layer over that store).
//! 2. The scheduler with `--scale-running` running sandboxes (default
//!    10,000) on a 60 s rolling interval: the cost of rebuilding the schedule
//!    at daemon start, the cost of one tick of the pure core, and the real
//!    driver (`stratad::scheduler::run`) over simulated VMs whose "snapshot"
//!    writes a real snapshot record to the store: how late each snapshot
//!    starts against its slot, and the CPU the whole thing costs.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::json;
use strata_core::{Op, SandboxId, SandboxState, SnapshotId};
use strata_testkit::fixtures::{commit_batched, sandbox_record};
use strata_testkit::Api;
use stratad::clock::{Clock, SystemClock};
use stratad::engine::unavailable::UnavailableEngine;
use stratad::scheduler::{self, Actions, DriverConfig, Schedule, SchedulerHandle, Timing};
use stratad::store::{
    Event, EventPhase, SandboxFilter, SandboxRecord, SnapshotKind, SnapshotRecord, SnapshotStatus,
    SqliteStore, Store, DEFAULT_TENANT,
};
use stratad::App;

use crate::ctx::Ctx;
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, fmt_num, Samples};

/// Flags of the `scale` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "scale-args")]
pub struct Args {
    /// Sandbox records in the store.
    #[arg(long = "scale-records", default_value_t = 1_000_000)]
    pub records: usize,
    /// Timed operations of each kind.
    #[arg(long = "scale-ops", default_value_t = 1000)]
    pub ops: usize,
    /// Running sandboxes the scheduler tracks (simulated VMs).
    #[arg(long = "scale-running", default_value_t = 10_000)]
    pub running: usize,
    /// Rolling snapshot interval of the scheduler run, seconds.
    #[arg(long = "scale-interval", default_value_t = 60)]
    pub interval_s: u64,
    /// Wall seconds the real scheduler driver runs over the simulated VMs.
    #[arg(long = "scale-driver-secs", default_value_t = 20)]
    pub driver_secs: u64,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.records = self.records.min(20_000);
        self.ops = self.ops.min(200);
        self.running = self.running.min(1000);
        self.driver_secs = self.driver_secs.min(3);
    }
}

fn record(id: SandboxId, i: usize, running: usize, now: DateTime<Utc>) -> SandboxRecord {
    // The first `running` records run; the rest look like a long-lived
    // fleet: mostly hibernated or deleted, some paused.
    let state = if i < running {
        SandboxState::Running
    } else {
        match i % 10 {
            0 => SandboxState::Paused,
            1..=4 => SandboxState::Hibernated,
            _ => SandboxState::Deleted,
        }
    };
    SandboxRecord {
        id,
        labels: BTreeMap::from([("team".to_owned(), format!("t{}", i % 50))]),
        pid: (state == SandboxState::Running).then_some(1),
        deleted_at: (state == SandboxState::Deleted).then_some(now),
        ..sandbox_record(DEFAULT_TENANT, state, now)
    }
}

/// A small deterministic generator (which record the next lookup hits).
struct Pick(u64);

impl Pick {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

fn time<T>(s: &mut Samples, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let t = Instant::now();
    let v = f()?;
    s.push_dur(t.elapsed());
    Ok(v)
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    // One client measuring back to back: no per-token rate limit.
    let (_dir, cfg) = crate::ctx::control_plane_config("strata-bench-scale-")?;
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), cfg.db_readers)?);
    let n = args.records.max(args.running).max(1);
    sec.text(format!(
        "The daemon's own SQLite store (`SqliteStore`: WAL, `synchronous=FULL`, one fsync'd \
         transaction per write) on this machine's disk, holding {n} sandbox records: the first \
         {} running, the rest 10 % paused, 40 % hibernated, 50 % deleted, each with a `team` \
         label (50 values). No VMs: this measures the control plane alone.",
        args.running
    ));

    // ---------------------------------------------------------------- seed
    let now = Utc::now();
    let t = Instant::now();
    let (ids, running_ids) = {
        let store = store.clone();
        let running = args.running;
        tokio::task::spawn_blocking(move || -> Result<_> {
            // Random ids, inserted in sorted order: the same records, but the
            // primary key and the listing index grow at their end instead of
            // splitting pages all over (seeding is not what is measured).
            let mut ids: Vec<SandboxId> = (0..n).map(|_| SandboxId::generate()).collect();
            ids.sort();
            let mut run_ids = Vec::with_capacity(running);
            let records = ids.iter().enumerate().map(|(i, id)| {
                let r = record(id.clone(), i, running, now);
                if r.state == SandboxState::Running {
                    run_ids.push(r.id.clone());
                }
                r
            });
            commit_batched(&*store, records, 5000)?;
            Ok((ids, run_ids))
        })
        .await??
    };
    let seed_s = t.elapsed().as_secs_f64();
    let db_bytes = std::fs::metadata(cfg.db_path())
        .map(|m| m.len())
        .unwrap_or(0);
    eprintln!("scale: seeded {n} records in {seed_s:.1} s");

    // ---------------------------------------------------------------- store ops
    let ops = args.ops.max(1);
    let st = store.clone();
    let idv = ids.clone();
    let measured = tokio::task::spawn_blocking(move || -> Result<Vec<(String, Samples)>> {
        let store = st;
        let ids = idv;
        let mut pick = Pick(0x9e37_79b9_7f4a_7c15);
        let mut create = Samples::new();
        let mut update = Samples::new();
        let mut get = Samples::new();
        let mut list = Samples::new();
        let mut deep = Samples::new();
        let mut by_state = Samples::new();
        let mut by_label = Samples::new();
        let base = SandboxFilter {
            tenant: DEFAULT_TENANT.into(),
            limit: 100,
            ..SandboxFilter::default()
        };
        // A cursor half-way through the live records (keyset pagination).
        let mut f = SandboxFilter {
            limit: 1000,
            ..base.clone()
        };
        let live = ids.len() / 2;
        for _ in 0..(live / 2 / 1000) {
            match store.list_sandboxes(&f)?.next_cursor {
                Some(c) => f.cursor = Some(c),
                None => break,
            }
        }
        let deep_cursor = f.cursor.clone();
        let t_now = Utc::now();
        for k in 0..ops {
            let r = record(SandboxId::generate(), k % 10 + 10, 0, t_now);
            let ev = Event::new(&r, Op::Created, None, EventPhase::Pending, None, t_now);
            time(&mut create, || Ok(store.insert_sandbox(&r, &ev)?))?;
            let mut r2 = r.clone();
            r2.state = SandboxState::Hibernated;
            r2.updated_at = Utc::now();
            let ev2 = Event::new(&r2, Op::Hibernate, None, EventPhase::Done, None, t_now);
            time(&mut update, || Ok(store.update_sandbox(&r2, Some(&ev2))?))?;
            let id = &ids[pick.next(ids.len())];
            let got = time(&mut get, || Ok(store.get_sandbox(id)?))?;
            if got.is_none() {
                return Err(anyhow!("record {id} not found"));
            }
            time(&mut list, || Ok(store.list_sandboxes(&base)?))?;
            let dc = SandboxFilter {
                cursor: deep_cursor.clone(),
                ..base.clone()
            };
            time(&mut deep, || Ok(store.list_sandboxes(&dc)?))?;
            let fs = SandboxFilter {
                states: vec![SandboxState::Running],
                ..base.clone()
            };
            time(&mut by_state, || Ok(store.list_sandboxes(&fs)?))?;
            let fl = SandboxFilter {
                labels: BTreeMap::from([("team".to_owned(), format!("t{}", k % 50))]),
                ..base.clone()
            };
            let page = time(&mut by_label, || Ok(store.list_sandboxes(&fl)?))?;
            if page.items.is_empty() {
                return Err(anyhow!("label filter found nothing"));
            }
        }
        Ok(vec![
            (
                "create (insert + journal event, own fsync'd transaction)".into(),
                create,
            ),
            (
                "update state (record + event, own fsync'd transaction)".into(),
                update,
            ),
            ("get by id".into(), get),
            ("list, first page of 100".into(), list),
            (
                "list, page of 100 half-way through (keyset cursor)".into(),
                deep,
            ),
            ("list state=running, page of 100".into(), by_state),
            ("list label team=tN, page of 100".into(), by_label),
        ])
    })
    .await??;
    let mut t_store = Table::latency(
        format!(
            "Store operations with {n} records ({} on disk incl. indexes)",
            crate::stats::fmt_bytes(db_bytes as f64)
        ),
        &[],
    );
    let mut data_store = serde_json::Map::new();
    for (name, s) in &measured {
        t_store.latency_row(name.clone(), &s.summary(), vec![]);
        data_store.insert(name.clone(), json!(s.summary()));
    }
    sec.table(t_store);
    let create = measured[0].1.summary();
    let get = measured[2].1.summary();
    let list = measured[3].1.summary();

    // ---------------------------------------------------------------- HTTP
    let app = Arc::new(App::new(
        cfg.clone(),
        store.clone(),
        Arc::new(UnavailableEngine),
        Arc::new(SystemClock),
    ));
    let served = strata_testkit::serve(app.router()).await?;
    let http = Api::new(served.url.clone()).admin_token_of(&cfg.data_dir);
    let mut hget = Samples::new();
    let mut hlist = Samples::new();
    let mut pick = Pick(0x2545_f491_4f6c_dd1d);
    for _ in 0..(ops / 2).max(1) {
        let id = &ids[pick.next(ids.len())];
        let t = Instant::now();
        let (s, v) = http
            .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        hget.push_dur(t.elapsed());
        // Deleted records answer 404 by design; anything else is a failure.
        if s != 200 && s != 404 {
            return Err(anyhow!("GET /v1/sandboxes/{id}: {s} {v}"));
        }
        let t = Instant::now();
        let (s, v) = http
            .json(reqwest::Method::GET, "/v1/sandboxes?limit=100", None)
            .await?;
        hlist.push_dur(t.elapsed());
        if s != 200 || v["items"].as_array().map_or(0, Vec::len) != 100 {
            return Err(anyhow!("list: {s} {v}"));
        }
    }
    drop(served);
    let mut t_http = Table::latency(
        "Through the HTTP API (loopback, bearer token checked, JSON; rate limit lifted), same store",
        &[],
    );
    t_http.latency_row("GET /v1/sandboxes/{id}", &hget.summary(), vec![]);
    t_http.latency_row("GET /v1/sandboxes?limit=100", &hlist.summary(), vec![]);
    sec.table(t_http);
    let hget_s = hget.summary();

    // ---------------------------------------------------------------- scheduler
    let interval = Duration::from_secs(args.interval_s.max(1));
    let timing = Timing {
        snapshot_interval: interval,
        idle_timeout: Duration::from_secs(3600),
    };
    // Daemon start: load every live record and rebuild the schedule.
    let st = store.clone();
    let t = Instant::now();
    let live = tokio::task::spawn_blocking(move || st.live_sandboxes()).await??;
    let load_ms = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    let mut sched = Schedule::new();
    let start = Utc::now();
    for r in &live {
        sched.set(&r.id, r.state, timing, r.last_activity_at, start);
    }
    let rebuild_ms = t.elapsed().as_secs_f64() * 1000.0;
    let tracked = sched.tracked();
    // Ticks of the pure core, a virtual second apart, for two intervals.
    let mut tick = Samples::new();
    let mut per_tick = Vec::new();
    let virt = 2 * interval.as_secs() as i64;
    for s in 1..=virt {
        let now = start + chrono::Duration::seconds(s);
        let t = Instant::now();
        let due = sched.pop_due(now);
        tick.push(t.elapsed().as_secs_f64() * 1000.0);
        per_tick.push((s as f64, due.len() as f64));
    }
    let tick_s = tick.summary();
    let tasks: f64 = per_tick.iter().map(|p| p.1).sum();

    // The real driver over simulated VMs.
    let handle = SchedulerHandle::new();
    let dstart = Utc::now();
    for id in &running_ids {
        handle.set(id, SandboxState::Running, timing, dstart, dstart);
    }
    let actions = Arc::new(SimVms {
        store: store.clone(),
        interval,
        lag: Mutex::new(Vec::new()),
    });
    let (tx, rx) = tokio::sync::watch::channel(false);
    let ru0 = cpu_seconds();
    let w0 = Instant::now();
    let driver = tokio::spawn(scheduler::run(
        handle,
        actions.clone() as Arc<dyn Actions>,
        Arc::new(SystemClock) as Arc<dyn Clock>,
        DriverConfig {
            max_concurrent: 4,
            sweep_interval: Duration::from_secs(3600),
        },
        rx,
    ));
    tokio::time::sleep(Duration::from_secs(args.driver_secs.max(1))).await;
    let _ = tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), driver).await;
    let wall = w0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - ru0;
    let lag: Samples = actions
        .lag
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default()
        .into();
    let lag_s = lag.summary();
    let expected = running_ids.len() as f64 * wall / interval.as_secs_f64();

    let mut t_sched = Table::new(
        format!(
            "Scheduler with {} running sandboxes, {} s rolling interval, idle timeout 1 h",
            running_ids.len(),
            interval.as_secs()
        ),
        &["figure", "value"],
    );
    t_sched.row(vec![
        format!("daemon start: load {} live records", live.len()),
        fmt_ms(load_ms),
    ]);
    t_sched.row(vec![
        format!("daemon start: rebuild the schedule ({tracked} tracked)"),
        fmt_ms(rebuild_ms),
    ]);
    t_sched.row(vec![
        format!("one tick of the core (pop due), p50 / p99 / max over {virt} ticks"),
        format!(
            "{} / {} / {}",
            fmt_ms(tick_s.p50),
            fmt_ms(tick_s.p99),
            fmt_ms(tick_s.max)
        ),
    ]);
    t_sched.row(vec![
        "snapshots due per tick (mean)".into(),
        fmt_num(tasks / virt as f64),
    ]);
    t_sched.row(vec![
        format!("real driver, {wall:.0} s: snapshots started (expected)"),
        format!("{} ({expected:.0})", lag.len()),
    ]);
    t_sched.row(vec![
        "real driver: start lag behind the slot, p50 / p99 / max".into(),
        format!(
            "{} / {} / {}",
            fmt_ms(lag_s.p50),
            fmt_ms(lag_s.p99),
            fmt_ms(lag_s.max)
        ),
    ]);
    t_sched.row(vec![
        "real driver: CPU of the process (driver + simulated snapshot record writes)".into(),
        format!("{:.1} % of one core", 100.0 * cpu / wall.max(1e-9)),
    ]);
    sec.table(t_sched);
    sec.text(
        "A simulated VM's snapshot writes its snapshot record to the store (a real fsync'd \
         SQLite transaction, as the daemon does) and nothing else; the lag is the time from \
         the sandbox's slot (`t mod interval == phase(id)`) to the action starting, i.e. the \
         scheduler's own delay plus waiting for one of the 4 task permits.",
    );

    let file = "scale-store.svg";
    let cats: Vec<String> = [
        "create",
        "update",
        "get",
        "list",
        "list deep",
        "by state",
        "by label",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let series: Vec<(String, Vec<f64>)> = [("p50", 0usize), ("p99", 1)]
        .iter()
        .map(|(name, k)| {
            (
                name.to_string(),
                measured
                    .iter()
                    .map(|(_, s)| {
                        let m = s.summary();
                        if *k == 0 {
                            m.p50
                        } else {
                            m.p99
                        }
                    })
                    .collect(),
            )
        })
        .collect();
    plot::bars(
        &ctx.file(file),
        &format!("Store latency with {n} records"),
        "ms (log)",
        &cats,
        &series,
        true,
    )?;
    sec.plot(
        file,
        format!("Store operation latency, p50 and p99, {n} records"),
    );

    sec.headline(format!(
        "{n} records: create p99 {} (fsync'd), get p99 {} (HTTP {}), list page p99 {}",
        fmt_ms(create.p99),
        fmt_ms(get.p99),
        fmt_ms(hget_s.p99),
        fmt_ms(list.p99)
    ));
    sec.headline(format!(
        "{} running sandboxes: scheduler tick p99 {}, rebuild at start {}, real driver lag p99 {} at {:.1} % CPU",
        running_ids.len(),
        fmt_ms(tick_s.p99),
        fmt_ms(load_ms + rebuild_ms),
        fmt_ms(lag_s.p99),
        100.0 * cpu / wall.max(1e-9)
    ));
    sec.data = json!({
        "records": n,
        "running": running_ids.len(),
        "seed_seconds": seed_s,
        "db_bytes": db_bytes,
        "store": data_store,
        "http": {"get": hget.summary(), "list": hlist.summary()},
        "scheduler": {
            "load_ms": load_ms, "rebuild_ms": rebuild_ms, "tracked": tracked,
            "tick_ms": tick_s, "tasks_per_tick": tasks / virt as f64,
            "driver_wall_s": wall, "driver_cpu_s": cpu,
            "driver_snapshots": lag.len(), "driver_expected": expected,
            "lag_ms": lag_s,
        },
    });
    Ok(())
}

/// CPU seconds (user + system) this process has used.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own; no other memory is touched.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to `ru`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Simulated VMs: a rolling snapshot records itself in the store and
/// notes how late it started against its slot.
struct SimVms {
    store: Arc<SqliteStore>,
    interval: Duration,
    lag: Mutex<Vec<f64>>,
}

#[async_trait]
impl Actions for SimVms {
    async fn rolling_snapshot(&self, id: SandboxId) {
        let now = Utc::now();
        let i = self.interval.as_millis().max(1) as i64;
        let ph = scheduler::phase(&id, self.interval).as_millis() as i64;
        let ms = now.timestamp_millis();
        // The slot this call serves: the latest t <= now with t mod i == ph.
        let mut slot = ms - ms.rem_euclid(i) + ph;
        if slot > ms {
            slot -= i;
        }
        if let Ok(mut v) = self.lag.lock() {
            v.push((ms - slot) as f64);
        }
        let rec = SnapshotRecord {
            id: SnapshotId::generate(),
            tenant: DEFAULT_TENANT.into(),
            sandbox_id: id,
            kind: SnapshotKind::Rolling,
            label: None,
            status: SnapshotStatus::Ready,
            status_reason: None,
            created_at: now,
            pause_ms: Some(0.0),
            exclusive_bytes: None,
            referenced_bytes: None,
            charge_bytes: None,
            same_as: None,
        };
        let store = self.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.put_snapshot(&rec)).await;
    }

    async fn idle_hibernate(&self, _id: SandboxId) {}

    async fn gc_sweep(&self) {}
}
