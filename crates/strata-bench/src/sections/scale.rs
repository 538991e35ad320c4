//! Section `scale`: the control plane at scale, without VMs.
//!
//! 1. The daemon's SQLite store (WAL, `synchronous=FULL`, the same
//!    `SqliteStore` stratad runs on) holding `--scale-records` sandbox
//!    records (default 1,000,000): create, update, get and list latency at
//!    the store, and get/list through the HTTP API (the daemon's router and
//!    security layer over that store). With `--scale-pg-url` (or
//!    `STRATA_BENCH_PG_URL`), the same records and the same operations on
//!    PostgreSQL with `--scale-hosts` (1,000) registered hosts beside it,
//!    plus placement over those hosts and the owner lookup of forwarding,
//!    and PostgreSQL's own execution time of the queries (issue 17).
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
use rand::Rng;
use serde_json::json;
use strata_core::{Op, SandboxId, SandboxState, SnapshotId};
use strata_testkit::fixtures::{commit_batched, sandbox_record};
use strata_testkit::Api;
use stratad::clock::{Clock, SystemClock};
use stratad::cluster::placement::{place, Candidate, Request};
use stratad::engine::unavailable::UnavailableEngine;
use stratad::scheduler::{self, Actions, DriverConfig, Schedule, SchedulerHandle, Timing};
use stratad::store::{
    Event, EventPhase, HostInfo, HostLoad, HostRecord, HostStore, PgOptions, PgStore,
    SandboxFilter, SandboxRecord, SnapshotKind, SnapshotRecord, SnapshotStatus, SqliteStore, Store,
    DEFAULT_TENANT,
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
    /// PostgreSQL to measure beside SQLite (the same records and
    /// operations, in a schema of the run's own, dropped at the end).
    #[arg(long = "scale-pg-url", env = "STRATA_BENCH_PG_URL")]
    pub pg_url: Option<String>,
    /// Simulated hosts registered in PostgreSQL.
    #[arg(long = "scale-hosts", default_value_t = 1000)]
    pub hosts: usize,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.records = self.records.min(20_000);
        self.ops = self.ops.min(200);
        self.running = self.running.min(1000);
        self.driver_secs = self.driver_secs.min(3);
        self.hosts = self.hosts.min(100);
    }
}

/// Record `i` of `n` (0 the oldest, one second apart): a long-lived
/// fleet whose older half was deleted long ago, the newest `running`
/// running, the rest 20 % paused and 80 % hibernated; each with a `team`
/// label (50 values).
fn record(id: SandboxId, i: usize, n: usize, running: usize, now: DateTime<Utc>) -> SandboxRecord {
    let at = now - chrono::Duration::seconds((n - i) as i64);
    let state = if i + running >= n {
        SandboxState::Running
    } else if i < n / 2 {
        SandboxState::Deleted
    } else if i.is_multiple_of(5) {
        SandboxState::Paused
    } else {
        SandboxState::Hibernated
    };
    SandboxRecord {
        id,
        labels: BTreeMap::from([("team".to_owned(), format!("t{}", i % 50))]),
        pid: (state == SandboxState::Running).then_some(1),
        deleted_at: (state == SandboxState::Deleted).then_some(at),
        ..sandbox_record(DEFAULT_TENANT, state, at)
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

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`), as printed.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Writes the `n` records (ids sorted, so the primary key grows at its
/// end: seeding is not what is measured), 5,000 to a transaction.
fn seed(store: &dyn Store, ids: &[SandboxId], running: usize, now: DateTime<Utc>) -> Result<()> {
    let n = ids.len();
    let records = ids
        .iter()
        .enumerate()
        .map(|(i, id)| record(id.clone(), i, n, running, now));
    commit_batched(store, records, 5000)?;
    Ok(())
}

/// The same records as [`seed`] writes, in multi-row `INSERT`s of 5,000
/// (the store's own writes cost several round trips a record: a million
/// of them take longer than the whole measurement). The rows are what
/// `PgStore` writes for them: every column of the record, label rows for
/// the sandboxes not deleted, no journal event (as [`seed`]).
fn pg_seed(store: &PgStore, ids: &[SandboxId], running: usize, now: DateTime<Utc>) -> Result<()> {
    let n = ids.len();
    let ms = |t: DateTime<Utc>| t.timestamp_millis();
    let text = |v: &str| format!("'{}'", v.replace('\'', "''"));
    for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
        let mut rows = Vec::with_capacity(chunk.len());
        let mut labels = Vec::new();
        for &i in chunk {
            let r = record(ids[i].clone(), i, n, running, now);
            rows.push(format!(
                "({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0)",
                text(r.id.as_str()),
                text(&r.tenant),
                r.size.vcpus,
                r.size.memory_mib,
                r.size.disk_gib,
                text(&serde_json::to_string(&r.labels)?),
                text(r.state.as_str()),
                ms(r.created_at),
                ms(r.updated_at),
                ms(r.last_activity_at),
                r.pid.map_or("NULL".into(), |p| p.to_string()),
                r.deleted_at.map_or("NULL".into(), |t| ms(t).to_string()),
            ));
            if r.state != SandboxState::Deleted {
                for (k, v) in &r.labels {
                    labels.push(format!(
                        "({}, {}, {})",
                        text(r.id.as_str()),
                        text(k),
                        text(v)
                    ));
                }
            }
        }
        let mut sql = format!(
            "BEGIN; INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, \
             state, created_at, updated_at, last_activity_at, pid, deleted_at, version) VALUES {};",
            rows.join(",")
        );
        if !labels.is_empty() {
            // Each label row a copy of its sandbox's row (schema version 17).
            sql.push_str(&format!(
                " INSERT INTO sandbox_labels (key, value, {LABEL_COLS}) \
                 SELECT kv.k, kv.v, {SANDBOX_COLS} FROM (VALUES {}) AS kv(id, k, v) \
                 JOIN sandboxes s USING (id);",
                labels.join(",")
            ));
        }
        sql.push_str(" COMMIT;");
        store.execute_raw(&sql)?;
    }
    Ok(())
}

/// The columns of a sandbox row, as `sandboxes` names them.
const SANDBOX_COLS: &str = "s.id, s.tenant_id, s.template_id, s.source_snapshot_id, s.vcpus, \
    s.memory_mib, s.disk_gib, s.labels, s.state, s.state_reason, s.pending_op, s.idle_timeout_s, \
    s.snapshot_interval_s, s.created_at, s.updated_at, s.last_activity_at, s.pid, s.accel, \
    s.deleted_at, s.version";

/// The same columns as a label row names them (schema version 17).
const LABEL_COLS: &str = "sandbox_id, tenant_id, template_id, source_snapshot_id, vcpus, \
    memory_mib, disk_gib, labels, state, state_reason, pending_op, idle_timeout_s, \
    snapshot_interval_s, created_at, updated_at, last_activity_at, pid, accel, deleted_at, version";

/// The timed store operations, in table order.
const OPS: [&str; 12] = [
    "create (insert + journal event, own transaction)",
    "update state (record + event, own transaction)",
    "get by id",
    "list, first page of 100",
    "list, page of 100 half-way through (keyset cursor)",
    "list state=running, page of 100",
    "list label team=tN, page of 100",
    "get by id, reads alone",
    "list, first page of 100, reads alone",
    "list, cursor half-way, reads alone",
    "list state=running, reads alone",
    "list label team=tN, reads alone",
];

/// Where [`OPS`]' rows of reads with no writes between them start: the
/// rows before interleave each round's reads with a create and an update,
/// each an fsync'd commit whose write-back shares this machine's two cores
/// with the reads (a database host of its own does not).
const READS_ALONE: usize = 7;

/// Times [`OPS`] on `store`, `ops` of each, the same lookups on every
/// store (a fixed generator over the same ids).
fn store_ops(store: &dyn Store, ids: &[SandboxId], ops: usize) -> Result<Vec<Samples>> {
    let mut pick = Pick(0x9e37_79b9_7f4a_7c15);
    let mut s: Vec<Samples> = (0..OPS.len()).map(|_| Samples::new()).collect();
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
    let live = ids.len() - ids.len() / 2;
    for _ in 0..(live / 2 / 1000) {
        match store.list_sandboxes(&f)?.next_cursor {
            Some(c) => f.cursor = Some(c),
            None => break,
        }
    }
    let deep_cursor = f.cursor.clone();
    let t_now = Utc::now();
    for k in 0..ops {
        let r = SandboxRecord {
            labels: BTreeMap::from([("team".to_owned(), format!("t{}", k % 50))]),
            ..sandbox_record(DEFAULT_TENANT, SandboxState::Running, t_now)
        };
        let ev = Event::new(&r, Op::Created, None, EventPhase::Pending, None, t_now);
        time(&mut s[0], || Ok(store.insert_sandbox(&r, &ev)?))?;
        let mut r2 = r.clone();
        r2.state = SandboxState::Hibernated;
        r2.updated_at = Utc::now();
        let ev2 = Event::new(&r2, Op::Hibernate, None, EventPhase::Done, None, t_now);
        time(&mut s[1], || Ok(store.update_sandbox(&r2, Some(&ev2))?))?;
        let id = &ids[pick.next(ids.len())];
        let got = time(&mut s[2], || Ok(store.get_sandbox(id)?))?;
        if got.is_none() {
            return Err(anyhow!("record {id} not found"));
        }
        let page = time(&mut s[3], || Ok(store.list_sandboxes(&base)?))?;
        if page.items.len() != 100 {
            return Err(anyhow!("first page: {} items", page.items.len()));
        }
        let dc = SandboxFilter {
            cursor: deep_cursor.clone(),
            ..base.clone()
        };
        time(&mut s[4], || Ok(store.list_sandboxes(&dc)?))?;
        let fs = SandboxFilter {
            states: vec![SandboxState::Running],
            ..base.clone()
        };
        time(&mut s[5], || Ok(store.list_sandboxes(&fs)?))?;
        let fl = SandboxFilter {
            labels: BTreeMap::from([("team".to_owned(), format!("t{}", k % 50))]),
            ..base.clone()
        };
        let page = time(&mut s[6], || Ok(store.list_sandboxes(&fl)?))?;
        if page.items.is_empty() {
            return Err(anyhow!("label filter found nothing"));
        }
    }
    // The same reads again with no writes between them.
    for k in 0..ops {
        let id = &ids[pick.next(ids.len())];
        let got = time(&mut s[READS_ALONE], || Ok(store.get_sandbox(id)?))?;
        if got.is_none() {
            return Err(anyhow!("record {id} not found"));
        }
        let page = time(&mut s[READS_ALONE + 1], || Ok(store.list_sandboxes(&base)?))?;
        if page.items.len() != 100 {
            return Err(anyhow!("first page: {} items", page.items.len()));
        }
        let dc = SandboxFilter {
            cursor: deep_cursor.clone(),
            ..base.clone()
        };
        time(&mut s[READS_ALONE + 2], || Ok(store.list_sandboxes(&dc)?))?;
        let fs = SandboxFilter {
            states: vec![SandboxState::Running],
            ..base.clone()
        };
        time(&mut s[READS_ALONE + 3], || Ok(store.list_sandboxes(&fs)?))?;
        let fl = SandboxFilter {
            labels: BTreeMap::from([("team".to_owned(), format!("t{}", k % 50))]),
            ..base.clone()
        };
        let page = time(&mut s[READS_ALONE + 4], || Ok(store.list_sandboxes(&fl)?))?;
        if page.items.is_empty() {
            return Err(anyhow!("label filter found nothing"));
        }
    }
    Ok(s)
}

/// What a create asks placement for.
const PLACE: Request = Request {
    vcpus: 2,
    memory_mib: 2048,
    pool_bytes: 0,
    anti_affinity: false,
};

fn candidates(hosts: &[HostRecord]) -> Vec<Candidate> {
    hosts
        .iter()
        .map(|h| Candidate {
            id: h.info.id.clone(),
            alive: h.alive,
            free: h.free,
            has_template: false,
            same_group: 0,
        })
        .collect()
}

fn host_info(h: usize) -> HostInfo {
    HostInfo {
        id: format!("host-{h:04}"),
        address: format!("http://10.{}.{}.1:7070", h / 256, h % 256),
        accel: "kvm".into(),
        qemu_version: "7.2.0".into(),
        cpu_model: "EPYC".into(),
        capacity: HostLoad {
            vcpus: 64,
            memory_mib: 262_144,
            pool_bytes: 4 << 40,
        },
    }
}

/// The PostgreSQL half: the same records in a schema of the run's own
/// (dropped at the end), `hosts` hosts registered and heartbeating
/// through `HostStore`, every live record owned by one of them.
struct PgRun {
    store: Arc<PgStore>,
    schema: String,
    seed_s: f64,
    ops: Vec<Samples>,
    /// `sandbox_owner`: the owner lookup of every forwarded request.
    owner: Samples,
    /// `hosts()` and `place()` over them.
    hosts_place: Samples,
    /// `place()` over the cached host view (what a create pays).
    place: Samples,
    /// Database-side execution time of the listing queries (EXPLAIN ANALYZE).
    server: Vec<(String, Samples, String)>,
    db_bytes: u64,
}

impl Drop for PgRun {
    fn drop(&mut self) {
        let _ = self
            .store
            .execute_raw(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema));
    }
}

fn pg_run(
    url: &str,
    nhosts: usize,
    ids: &[SandboxId],
    running: usize,
    ops: usize,
) -> Result<PgRun> {
    let schema = format!("bench_scale_{}", std::process::id());
    let store = Arc::new(PgStore::open(&PgOptions {
        url: url.to_owned(),
        schema: Some(schema.clone()),
        pool_size: 4,
        timeout: Duration::from_secs(600),
    })?);
    let mut run = PgRun {
        store: store.clone(),
        schema: schema.clone(),
        seed_s: 0.0,
        ops: Vec::new(),
        owner: Samples::new(),
        hosts_place: Samples::new(),
        place: Samples::new(),
        server: Vec::new(),
        db_bytes: 0,
    };
    let mut rng = rand::thread_rng();
    for h in 0..nhosts.max(1) {
        let info = host_info(h);
        let l = store.register_host(&info, 3_600_000)?;
        let free = HostLoad {
            vcpus: rng.gen_range(0..64),
            memory_mib: rng.gen_range(0..262_144),
            pool_bytes: rng.gen_range(0..(4u64 << 40)),
        };
        store.heartbeat(&info.id, l.epoch, &free, 3_600_000)?;
    }
    let t = Instant::now();
    pg_seed(&store, ids, running, Utc::now())?;
    // Every live record is owned by a host (leases as the hosts hold them).
    store.execute_raw(&format!(
        "INSERT INTO sandbox_owners (sandbox_id, host_id, token, acquired_at, expires_at)
           SELECT id, 'host-' || lpad(((row_number() OVER ()) % {nhosts})::text, 4, '0'),
                  nextval('strata_fencing_tokens'), 0, 9000000000000
           FROM sandboxes WHERE state != 'deleted';
         ANALYZE;",
        nhosts = nhosts.max(1)
    ))?;
    run.seed_s = t.elapsed().as_secs_f64();
    eprintln!("scale: PostgreSQL seeded in {:.1} s", run.seed_s);
    // Steady state before measuring, as a store that has held these records
    // for a while is: the seed's rows vacuumed (else autovacuum's pass over
    // the 1.5 million inserted rows runs inside the measurement) and its
    // dirty pages checkpointed (else the checkpoint the seed's WAL triggered
    // writes and fsyncs them meanwhile: the run of 2026-12-07 01:49 measured
    // beside one). Each its own statement: VACUUM refuses a transaction block.
    let t = Instant::now();
    store.execute_raw("VACUUM (ANALYZE) sandboxes, sandbox_labels, sandbox_owners")?;
    if let Err(e) = store.execute_raw("CHECKPOINT") {
        eprintln!("scale: CHECKPOINT refused ({e}); measuring without it");
    }
    eprintln!(
        "scale: PostgreSQL vacuumed and checkpointed in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    run.db_bytes = store
        .query_lines(&format!(
            "SELECT sum(pg_total_relation_size(c.oid))::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = '{schema}' AND c.relkind = 'r'"
        ))?
        .first()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    run.ops = store_ops(&*store, ids, ops)?;
    let mut pick = Pick(0x2545_f491_4f6c_dd1d);
    for _ in 0..ops {
        let id = &ids[pick.next(ids.len())];
        time(&mut run.owner, || Ok(store.sandbox_owner(id)?))?;
    }
    let cached = candidates(&store.hosts()?);
    for _ in 0..ops {
        let hs = time(&mut run.hosts_place, || {
            let hs = candidates(&store.hosts()?);
            place(&hs, &PLACE).map_err(|e| anyhow!("{e}"))?;
            Ok(hs.len())
        })?;
        if hs != nhosts.max(1) {
            return Err(anyhow!("{hs} hosts read, {nhosts} registered"));
        }
        time(&mut run.place, || {
            Ok(place(&cached, &PLACE).map_err(|e| anyhow!("{e}"))?.len())
        })?;
    }
    // What the database itself spends on the listing queries (the client's
    // time less the round trip, decoding and this machine's noise).
    let cursor = {
        let mut f = SandboxFilter {
            tenant: DEFAULT_TENANT.into(),
            limit: 1000,
            ..SandboxFilter::default()
        };
        let live = ids.len() - ids.len() / 2;
        let mut last = None;
        for _ in 0..(live / 2 / 1000) {
            let p = store.list_sandboxes(&f)?;
            last = p
                .items
                .last()
                .map(|r| (r.created_at.timestamp_millis(), r.id.clone()));
            match p.next_cursor {
                Some(c) => f.cursor = Some(c),
                None => break,
            }
        }
        last
    };
    let mut queries =
        vec![
        (
            "get by id".to_owned(),
            format!("SELECT * FROM sandboxes WHERE id = '{}'", ids[ids.len() / 2]),
        ),
        (
            "list, first page of 100".to_owned(),
            "SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' AND s.state != 'deleted' \
             ORDER BY s.created_at, s.id LIMIT 101"
                .to_owned(),
        ),
        (
            "list state=running, page of 100".to_owned(),
            "SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' AND s.state IN ('running') \
             ORDER BY s.created_at, s.id LIMIT 101"
                .to_owned(),
        ),
        (
            "list label team=t7, page of 100".to_owned(),
            format!(
                "SELECT {LABEL_COLS} FROM sandbox_labels \
                 WHERE tenant_id = 'default' AND key = 'team' AND value = 't7' \
                 AND state != 'deleted' ORDER BY created_at, sandbox_id LIMIT 101"
            ),
        ),
        (
            "list label team=t7, as before schema 17 (join to sandboxes)".to_owned(),
            "SELECT s.* FROM sandbox_labels l JOIN sandboxes s ON s.id = l.sandbox_id \
             WHERE l.tenant_id = 'default' AND l.key = 'team' AND l.value = 't7' \
             AND s.tenant_id = l.tenant_id AND s.state != 'deleted' \
             ORDER BY l.created_at, l.sandbox_id LIMIT 101"
                .to_owned(),
        ),
    ];
    if let Some((t, id)) = cursor {
        queries.insert(
            2,
            (
                "list, page of 100 half-way through (keyset cursor)".to_owned(),
                format!(
                    "SELECT s.* FROM sandboxes s WHERE s.tenant_id = 'default' \
                     AND s.state != 'deleted' AND (s.created_at, s.id) > ({t}, '{id}') \
                     ORDER BY s.created_at, s.id LIMIT 101"
                ),
            ),
        );
    }
    for (name, q) in queries {
        let mut exec = Samples::new();
        let mut plan = String::new();
        for _ in 0..100 {
            let lines = store.query_lines(&format!("EXPLAIN (ANALYZE, BUFFERS) {q}"))?;
            for l in &lines {
                if let Some(v) = l.trim().strip_prefix("Execution Time: ") {
                    if let Some(ms) = v.strip_suffix(" ms").and_then(|v| v.parse::<f64>().ok()) {
                        exec.push(ms);
                    }
                }
            }
            plan = lines.join("\n");
        }
        run.server.push((name, exec, plan));
    }
    Ok(run)
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    // One client measuring back to back: no per-token rate limit.
    let (_dir, cfg) = crate::ctx::control_plane_config("strata-bench-scale-")?;
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), cfg.db_readers)?);
    let n = args.records.max(args.running).max(1);
    let pg_url = args.pg_url.clone().filter(|u| !u.is_empty());
    sec.text(format!(
        "The daemon's own SQLite store (`SqliteStore`: WAL, `synchronous=FULL`, one fsync'd \
         transaction per write) on this machine's disk, one host, holding {n} sandbox records \
         of one tenant, one second apart: the older half deleted, the newest {} running, the \
         rest 20 % paused and 80 % hibernated, each with a `team` label (50 values). {} \
         No VMs: this measures the control plane alone.",
        args.running,
        if pg_url.is_some() {
            format!(
                "Beside it, the same records and the same operations on PostgreSQL \
                 (`PgStore`, a schema of the run's own) with {} hosts registered and \
                 heartbeating, every live record owned by one of them.",
                args.hosts
            )
        } else {
            "PostgreSQL not measured (no `--scale-pg-url` / `STRATA_BENCH_PG_URL`).".to_owned()
        }
    ));
    let load_before = loadavg();

    // ---------------------------------------------------------------- seed
    let now = Utc::now();
    let t = Instant::now();
    // Random ids, in sorted order (the primary key grows at its end).
    let mut ids: Vec<SandboxId> = (0..n).map(|_| SandboxId::generate()).collect();
    ids.sort();
    let running_ids: Vec<SandboxId> = ids[n - args.running.min(n)..].to_vec();
    {
        let store = store.clone();
        let ids = ids.clone();
        let running = args.running;
        tokio::task::spawn_blocking(move || seed(&*store, &ids, running, now)).await??;
    }
    let seed_s = t.elapsed().as_secs_f64();
    let db_bytes = std::fs::metadata(cfg.db_path())
        .map(|m| m.len())
        .unwrap_or(0);
    eprintln!("scale: seeded {n} records in {seed_s:.1} s");

    // ---------------------------------------------------------------- store ops
    let ops = args.ops.max(1);
    let measured = {
        let store = store.clone();
        let ids = ids.clone();
        tokio::task::spawn_blocking(move || store_ops(&*store, &ids, ops)).await??
    };
    // Placement on one host: the one candidate the daemon knows.
    let one = vec![Candidate {
        id: "host-0000".into(),
        alive: true,
        free: HostLoad {
            vcpus: 64,
            memory_mib: 262_144,
            pool_bytes: 4 << 40,
        },
        has_template: true,
        same_group: 0,
    }];
    let mut place_one = Samples::new();
    for _ in 0..ops {
        time(&mut place_one, || {
            Ok(place(&one, &PLACE).map_err(|e| anyhow!("{e}"))?.len())
        })?;
    }
    let pg = match &pg_url {
        Some(url) => {
            let url = url.clone();
            let ids = ids.clone();
            let (hosts, running) = (args.hosts, args.running);
            Some(
                tokio::task::spawn_blocking(move || pg_run(&url, hosts, &ids, running, ops))
                    .await??,
            )
        }
        None => None,
    };
    let load_after = loadavg();

    let dash = || vec!["—".to_owned(); 3];
    let cells = |s: &Samples| {
        let m = s.summary();
        vec![fmt_ms(m.p50), fmt_ms(m.p95), fmt_ms(m.p99)]
    };
    let mut t_store = Table::new(
        format!(
            "Store operations with {n} records: SQLite, one host ({} on disk incl. indexes) \
             beside PostgreSQL, {} hosts ({}), ms; load average {load_before} before, \
             {load_after} after",
            crate::stats::fmt_bytes(db_bytes as f64),
            args.hosts,
            pg.as_ref()
                .map(|p| format!(
                    "{} incl. indexes",
                    crate::stats::fmt_bytes(p.db_bytes as f64)
                ))
                .unwrap_or_else(|| "not measured".into()),
        ),
        &[
            "case",
            "SQLite p50",
            "p95",
            "p99",
            "PostgreSQL p50",
            "p95",
            "p99",
        ],
    );
    let mut data_store = serde_json::Map::new();
    let mut data_pg = serde_json::Map::new();
    for (i, name) in OPS.iter().enumerate() {
        let mut row = vec![name.to_string()];
        row.extend(cells(&measured[i]));
        data_store.insert(name.to_string(), json!(measured[i].summary()));
        match &pg {
            Some(p) => {
                row.extend(cells(&p.ops[i]));
                data_pg.insert(name.to_string(), json!(p.ops[i].summary()));
            }
            None => row.extend(dash()),
        }
        t_store.row(row);
    }
    let mut row = vec!["placement: place() over the cached host view (what a create pays)".into()];
    row.extend(cells(&place_one));
    row.extend(pg.as_ref().map(|p| cells(&p.place)).unwrap_or_else(dash));
    t_store.row(row);
    if let Some(p) = &pg {
        let mut row = vec!["placement: hosts() read + place()".to_owned()];
        row.extend(dash());
        row.extend(cells(&p.hosts_place));
        t_store.row(row);
        let mut row = vec!["owner lookup (sandbox_owner, each forwarded request)".to_owned()];
        row.extend(dash());
        row.extend(cells(&p.owner));
        t_store.row(row);
        data_pg.insert("place_cached".into(), json!(p.place.summary()));
        data_pg.insert("hosts_place".into(), json!(p.hosts_place.summary()));
        data_pg.insert("owner".into(), json!(p.owner.summary()));
    }
    data_store.insert("place_one_host".into(), json!(place_one.summary()));
    sec.table(t_store);
    if let Some(p) = &pg {
        let mut t_srv = Table::new(
            "PostgreSQL's own execution time of the same queries (EXPLAIN (ANALYZE, BUFFERS), \
             100 runs each, literal arguments), ms: what the machine's noise disturbs least",
            &["query", "p50", "p99", "plan (last run)"],
        );
        let mut srv = serde_json::Map::new();
        for (name, s, plan) in &p.server {
            let m = s.summary();
            let first = plan
                .lines()
                .find(|l| l.contains("Index") || l.contains("Scan"))
                .unwrap_or("")
                .trim()
                .to_owned();
            t_srv.row(vec![name.clone(), fmt_ms(m.p50), fmt_ms(m.p99), first]);
            srv.insert(name.clone(), json!({"exec_ms": m, "plan": plan}));
        }
        data_pg.insert("server".into(), json!(srv));
        data_pg.insert("seed_seconds".into(), json!(p.seed_s));
        data_pg.insert("db_bytes".into(), json!(p.db_bytes));
        data_pg.insert("hosts".into(), json!(args.hosts));
        sec.table(t_srv);
    }
    let create = measured[0].summary();
    let get = measured[2].summary();
    let list = measured[3].summary();

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
    // The plot shows the interleaved rounds (the reads-alone rows are in the table).
    let col = |v: &[Samples], p99: bool| -> Vec<f64> {
        v[..READS_ALONE]
            .iter()
            .map(|s| {
                let m = s.summary();
                if p99 {
                    m.p99
                } else {
                    m.p50
                }
            })
            .collect()
    };
    let mut series: Vec<(String, Vec<f64>)> = vec![
        ("SQLite p50".to_owned(), col(&measured, false)),
        ("SQLite p99".to_owned(), col(&measured, true)),
    ];
    if let Some(p) = &pg {
        series.push(("PostgreSQL p50".to_owned(), col(&p.ops, false)));
        series.push(("PostgreSQL p99".to_owned(), col(&p.ops, true)));
    }
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
        "{n} records on SQLite: create p99 {} (fsync'd), get p99 {} (HTTP {}), list page p99 {}",
        fmt_ms(create.p99),
        fmt_ms(get.p99),
        fmt_ms(hget_s.p99),
        fmt_ms(list.p99)
    ));
    if let Some(p) = &pg {
        let worst = |r: std::ops::Range<usize>| {
            p.ops[r].iter().map(|s| s.summary().p99).fold(0.0, f64::max)
        };
        sec.headline(format!(
            "{n} records, {} hosts on PostgreSQL: get p99 {}, list p99 {} (worst of 4 listings) \
             between fsync'd writes; reads alone: get p99 {}, list p99 {}; \
             placement p99 {} (cached view; {} reading the hosts); load average {load_after}",
            args.hosts,
            fmt_ms(p.ops[2].summary().p99),
            fmt_ms(worst(3..READS_ALONE)),
            fmt_ms(p.ops[READS_ALONE].summary().p99),
            fmt_ms(worst(READS_ALONE + 1..OPS.len())),
            fmt_ms(p.place.summary().p99),
            fmt_ms(p.hosts_place.summary().p99),
        ));
    }
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
        "postgres": data_pg,
        "load_average": {"before": load_before, "after": load_after},
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
pub(crate) fn cpu_seconds() -> f64 {
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
