//! Placement and get/list latency with many hosts and many sandbox records
//! on PostgreSQL (issue 17; docs/cluster.md).
//!
//! ```sh
//! STRATA_BENCH_PG_URL=postgresql://… cargo run --release -p stratad --example cluster_bench [RECORDS] [HOSTS]
//! ```
//! `STRATA_TEST_PG_URL` is used when `STRATA_BENCH_PG_URL` is unset.
//! Defaults: 100,000 records, 1,000 hosts. The hosts register and
//! heartbeat through `HostStore`; the records and their owner leases are
//! bulk-inserted with SQL (`generate_series`) into a schema of the
//! benchmark's own, dropped at the end. Printed: p50/p99 in ms of
//! `get_sandbox`, `list_sandboxes` (50 of one tenant), `hosts()` (what
//! placement reads), `place()` over the hosts (pure), and both together.

use std::time::{Duration, Instant};

use rand::Rng;
use strata_core::SandboxId;
use stratad::cluster::placement::{place, Candidate, Request};
use stratad::store::{
    HostInfo, HostLoad, HostStore, PgOptions, PgStore, SandboxFilter, Store, DEFAULT_TENANT,
};

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1000.0
}

fn sql(url: &str, stmts: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        let task = tokio::spawn(conn);
        c.batch_execute(stmts).await.expect("sql");
        drop(c);
        let _ = task.await;
    });
}

fn main() {
    let Some(url) = std::env::var("STRATA_BENCH_PG_URL")
        .or_else(|_| std::env::var("STRATA_TEST_PG_URL"))
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("set STRATA_BENCH_PG_URL (or STRATA_TEST_PG_URL)");
        return;
    };
    let mut args = std::env::args().skip(1);
    let records: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let nhosts: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let schema = format!("bench_cluster_{}", std::process::id());
    let s = PgStore::open(&PgOptions {
        url: url.clone(),
        schema: Some(schema.clone()),
        pool_size: 4,
        timeout: Duration::from_secs(600),
    })
    .expect("open");
    let t = Instant::now();
    let mut rng = rand::thread_rng();
    for h in 0..nhosts {
        let info = HostInfo {
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
        };
        let l = s.register_host(&info, 3_600_000).expect("register");
        let free = HostLoad {
            vcpus: rng.gen_range(0..64),
            memory_mib: rng.gen_range(0..262_144),
            pool_bytes: rng.gen_range(0..(4u64 << 40)),
        };
        s.heartbeat(&info.id, l.epoch, &free, 3_600_000)
            .expect("heartbeat");
    }
    eprintln!("{nhosts} hosts registered in {:?}", t.elapsed());
    let t = Instant::now();
    sql(
        &url,
        &format!(
            "SET search_path TO {schema};
             INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, state,
                 created_at, updated_at, last_activity_at)
               SELECT 'sb-bench' || lpad(g::text, 9, '0'),
                      CASE WHEN g % 100 = 0 THEN '{DEFAULT_TENANT}' ELSE 't' || (g % 1000) END,
                      1, 256, 2, '{{}}', 'running', g, g, g
               FROM generate_series(1, {records}) g;
             INSERT INTO sandbox_owners (sandbox_id, host_id, token, acquired_at, expires_at)
               SELECT 'sb-bench' || lpad(g::text, 9, '0'),
                      'host-' || lpad((g % {nhosts})::text, 4, '0'), g, 0, 9000000000000
               FROM generate_series(1, {records}) g;
             ANALYZE;"
        ),
    );
    eprintln!("{records} records inserted in {:?}", t.elapsed());
    let n = 2000;
    let mut get = Vec::with_capacity(n);
    for _ in 0..n {
        let i = rng.gen_range(1..=records);
        let id: SandboxId = format!("sb-bench{i:09}").parse().expect("id");
        let t = Instant::now();
        let r = s.get_sandbox(&id).expect("get");
        get.push(t.elapsed());
        assert!(r.is_some());
    }
    let mut list = Vec::with_capacity(n);
    for _ in 0..n {
        let f = SandboxFilter {
            tenant: DEFAULT_TENANT.into(),
            limit: 50,
            ..SandboxFilter::default()
        };
        let t = Instant::now();
        let p = s.list_sandboxes(&f).expect("list");
        list.push(t.elapsed());
        assert!(!p.items.is_empty());
    }
    let req = Request {
        vcpus: 2,
        memory_mib: 2048,
        pool_bytes: 0,
        anti_affinity: false,
    };
    let (mut hosts_t, mut place_t, mut both) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..500 {
        let t0 = Instant::now();
        let hs = s.hosts().expect("hosts");
        let t1 = Instant::now();
        let cands: Vec<Candidate> = hs
            .iter()
            .map(|h| Candidate {
                id: h.info.id.clone(),
                alive: h.alive,
                free: h.free,
                has_template: false,
                same_group: 0,
            })
            .collect();
        let chosen = place(&cands, &req).map(str::to_owned);
        let t2 = Instant::now();
        assert!(chosen.is_ok());
        hosts_t.push(t1 - t0);
        place_t.push(t2 - t1);
        both.push(t2 - t0);
    }
    println!("PostgreSQL, {records} sandbox records, {nhosts} hosts (ms):");
    println!("| call | p50 | p99 |");
    println!("|---|---|---|");
    for (name, v) in [
        ("get_sandbox", &mut get),
        ("list_sandboxes (50)", &mut list),
        ("hosts()", &mut hosts_t),
        ("place() (pure)", &mut place_t),
        ("hosts() + place()", &mut both),
    ] {
        println!("| {name} | {:.3} | {:.3} |", pct(v, 0.5), pct(v, 0.99));
    }
    drop(s);
    sql(&url, &format!("DROP SCHEMA {schema} CASCADE;"));
}
