//! Per-call latency of a few hot store calls on SQLite and on PostgreSQL,
//! in one run, printed as a table (docs/store.md, docs/bench.md).
//!
//! ```sh
//! STRATA_BENCH_PG_URL=postgresql://… cargo run --release -p stratad --example store_latency [N]
//! ```
//! `STRATA_TEST_PG_URL` is used when `STRATA_BENCH_PG_URL` is unset; with
//! neither only SQLite is measured. The PostgreSQL run uses a schema of its
//! own, dropped at the end. N (default 2000) calls of each kind, after 1000
//! sandboxes are inserted.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use chrono::Utc;
use strata_core::{Op, SandboxSize, SandboxState};
use stratad::store::{
    Event, EventPhase, PgOptions, PgStore, SandboxFilter, SandboxRecord, SqliteStore, Store,
    DEFAULT_TENANT,
};

fn record(i: usize) -> SandboxRecord {
    let at = Utc::now();
    SandboxRecord {
        id: format!("sb-bench{i:08}").parse().expect("id"),
        tenant: DEFAULT_TENANT.into(),
        template: None,
        source_snapshot: None,
        size: SandboxSize::default(),
        labels: BTreeMap::from([("team".to_string(), format!("t{}", i % 10))]),
        state: SandboxState::Running,
        state_reason: None,
        pending_op: None,
        idle_timeout_s: None,
        snapshot_interval_s: None,
        created_at: at,
        updated_at: at,
        last_activity_at: at,
        pid: None,
        accel: None,
        deleted_at: None,
        version: 0,
    }
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

/// (call, p50 ms, p99 ms) of each hot call.
fn measure(s: &dyn Store, n: usize) -> Vec<(&'static str, f64, f64)> {
    let base = 1000;
    let mut out = Vec::new();
    let mut lat = Vec::with_capacity(n);
    for i in 0..base {
        let r = record(i);
        let ev = Event::new(
            &r,
            Op::Created,
            Some(r.state),
            EventPhase::Done,
            None,
            r.created_at,
        );
        s.insert_sandbox(&r, &ev).expect("insert");
    }
    for i in 0..n {
        let r = record(base + i);
        let ev = Event::new(
            &r,
            Op::Created,
            Some(r.state),
            EventPhase::Done,
            None,
            r.created_at,
        );
        let t = Instant::now();
        s.insert_sandbox(&r, &ev).expect("insert");
        lat.push(t.elapsed());
    }
    out.push(("insert_sandbox", pct(&mut lat, 0.5), pct(&mut lat, 0.99)));
    lat.clear();
    for i in 0..n {
        let id = record(i % base).id;
        let t = Instant::now();
        s.get_sandbox(&id).expect("get").expect("found");
        lat.push(t.elapsed());
    }
    out.push(("get_sandbox", pct(&mut lat, 0.5), pct(&mut lat, 0.99)));
    lat.clear();
    for i in 0..n {
        let id = record(i % base).id;
        let mut r = s.get_sandbox(&id).expect("get").expect("found");
        r.state_reason = Some(format!("r{i}"));
        let ev = Event::new(
            &r,
            Op::Pause,
            Some(r.state),
            EventPhase::Done,
            None,
            Utc::now(),
        );
        let t = Instant::now();
        s.update_sandbox(&r, Some(&ev)).expect("update");
        lat.push(t.elapsed());
    }
    out.push((
        "update_sandbox (CAS + event)",
        pct(&mut lat, 0.5),
        pct(&mut lat, 0.99),
    ));
    lat.clear();
    for i in 0..n {
        let id = record(i % base).id;
        let t = Instant::now();
        s.touch_sandbox(&id, Utc::now()).expect("touch");
        lat.push(t.elapsed());
    }
    out.push(("touch_sandbox", pct(&mut lat, 0.5), pct(&mut lat, 0.99)));
    lat.clear();
    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 50,
        ..Default::default()
    };
    for _ in 0..n.min(500) {
        let t = Instant::now();
        s.list_sandboxes(&f).expect("list");
        lat.push(t.elapsed());
    }
    out.push((
        "list_sandboxes (50)",
        pct(&mut lat, 0.5),
        pct(&mut lat, 0.99),
    ));
    lat.clear();
    for _ in 0..n.min(500) {
        let t = Instant::now();
        s.reserved_capacity().expect("reserved");
        lat.push(t.elapsed());
    }
    out.push(("reserved_capacity", pct(&mut lat, 0.5), pct(&mut lat, 0.99)));
    out
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = SqliteStore::open(&dir.path().join("strata.db"), 4).expect("sqlite");
    let sq = measure(&sqlite, n);
    let url = std::env::var("STRATA_BENCH_PG_URL")
        .or_else(|_| std::env::var("STRATA_TEST_PG_URL"))
        .ok()
        .filter(|u| !u.is_empty());
    let pg = url.as_ref().map(|url| {
        let schema = format!("bench_{}", std::process::id());
        let mut opts = PgOptions::new(url.clone());
        opts.schema = Some(schema.clone());
        let store = PgStore::open(&opts).expect("postgres");
        let r = measure(&store, n);
        store
            .execute_raw(&format!("DROP SCHEMA {schema} CASCADE"))
            .expect("drop schema");
        r
    });
    println!("store call latency, n={n} per call, 1000 records (ms)");
    println!(
        "{:<30} {:>11} {:>11} {:>11} {:>11}",
        "call", "sqlite p50", "sqlite p99", "pg p50", "pg p99"
    );
    for (i, (name, p50, p99)) in sq.iter().enumerate() {
        let (g50, g99) = match &pg {
            Some(v) => (format!("{:.3}", v[i].1), format!("{:.3}", v[i].2)),
            None => ("-".into(), "-".into()),
        };
        println!("{name:<30} {p50:>11.3} {p99:>11.3} {g50:>11} {g99:>11}");
    }
}
