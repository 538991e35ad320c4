//! The store's behaviour, run against every backend: each test below runs
//! once on SQLite (a fresh file) and once on PostgreSQL (a fresh schema of
//! the database `STRATA_TEST_PG_URL` names; `scripts/test.sh` starts a
//! throwaway cluster and sets it). With the variable set, an unreachable
//! PostgreSQL fails the PostgreSQL variants; unset, they are skipped with
//! a line on stderr. Backend-specific checks (SQLite's file mode, WAL,
//! query plans and old-schema upgrades; PostgreSQL's notifications across
//! connections, connection loss, concurrent migration) live beside their
//! backend.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{Duration as CDuration, TimeZone, Utc};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState, SnapshotId};

use super::*;

/// Every sandbox `filter` lists, page after page through its cursor.
pub(crate) fn list_all<S: Store + ?Sized>(s: &S, mut filter: SandboxFilter) -> Vec<SandboxId> {
    let mut ids = Vec::new();
    loop {
        let page = s.list_sandboxes(&filter).unwrap();
        ids.extend(page.items.into_iter().map(|r| r.id));
        match page.next_cursor {
            Some(c) => filter.cursor = Some(c),
            None => return ids,
        }
    }
}

pub(crate) fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).single().unwrap()
}

pub(crate) fn sandbox(i: i64, state: SandboxState) -> SandboxRecord {
    let at = t0() + CDuration::seconds(i);
    SandboxRecord {
        id: format!("sb-{i:08}").parse().unwrap(),
        tenant: DEFAULT_TENANT.into(),
        template: Some("tpl-base".parse().unwrap()),
        source_snapshot: None,
        size: SandboxSize::default(),
        labels: BTreeMap::from([("team".to_string(), format!("t{}", i % 3))]),
        state,
        state_reason: None,
        pending_op: None,
        idle_timeout_s: None,
        snapshot_interval_s: Some(60),
        created_at: at,
        updated_at: at,
        last_activity_at: at,
        pid: Some(1000 + i as u32),
        accel: Some("tcg".into()),
        deleted_at: None,
        version: 0,
    }
}

pub(crate) fn snap(i: i64, sb: &SandboxId, secs: i64, status: SnapshotStatus) -> SnapshotRecord {
    SnapshotRecord {
        id: format!("snap-{i:06}").parse().unwrap(),
        tenant: DEFAULT_TENANT.into(),
        sandbox_id: sb.clone(),
        kind: SnapshotKind::Rolling,
        label: None,
        status,
        status_reason: None,
        created_at: t0() + CDuration::seconds(secs),
        pause_ms: Some(15.0),
        exclusive_bytes: Some(4096),
        referenced_bytes: Some(1 << 20),
        charge_bytes: None,
        same_as: None,
    }
}

pub(crate) fn created(rec: &SandboxRecord) -> Event {
    Event::new(
        rec,
        Op::Created,
        Some(rec.state),
        EventPhase::Done,
        None,
        rec.created_at,
    )
}

/// A fresh database of one backend; [`TestDb::open`] opens a store on it
/// (again: a reopen is a restart).
pub(crate) enum TestDb {
    /// A SQLite file in a temporary directory.
    Sqlite(tempfile::TempDir),
    /// A schema of its own in the test PostgreSQL, dropped afterwards.
    Postgres {
        /// Connection string.
        url: String,
        /// The schema.
        schema: String,
    },
}

static NEXT: AtomicU64 = AtomicU64::new(0);

/// The test PostgreSQL's connection string; `None` (and a printed line)
/// when `STRATA_TEST_PG_URL` is unset.
pub(crate) fn pg_url(test: &str) -> Option<String> {
    match std::env::var("STRATA_TEST_PG_URL") {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            eprintln!(
                "{test}: skipped on PostgreSQL: STRATA_TEST_PG_URL is not set (scripts/test-pg.sh)"
            );
            None
        }
    }
}

/// Runs `sql` on a plain connection to `url` (outside any store).
pub(crate) fn pg_admin(url: &str, sql: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| {
                panic!("STRATA_TEST_PG_URL is set but PostgreSQL is unreachable: {e}")
            });
        let task = tokio::spawn(conn);
        client.batch_execute(sql).await.unwrap();
        drop(client);
        let _ = task.await;
    });
}

impl TestDb {
    pub(crate) fn sqlite() -> Self {
        TestDb::Sqlite(tempfile::tempdir().unwrap())
    }

    /// `None` when no test PostgreSQL is configured.
    pub(crate) fn postgres(test: &str) -> Option<Self> {
        let url = pg_url(test)?;
        let schema = format!(
            "t_{}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        Some(TestDb::Postgres { url, schema })
    }

    /// The PostgreSQL options of this database (a 20 s bound).
    pub(crate) fn pg_options(&self) -> Option<postgres::PgOptions> {
        match self {
            TestDb::Postgres { url, schema } => Some(postgres::PgOptions {
                url: url.clone(),
                schema: Some(schema.clone()),
                pool_size: 4,
                timeout: std::time::Duration::from_secs(20),
            }),
            TestDb::Sqlite(_) => None,
        }
    }

    pub(crate) fn try_open(&self) -> StoreResult<Box<dyn Store>> {
        Ok(match self {
            TestDb::Sqlite(dir) => Box::new(SqliteStore::open(&dir.path().join("strata.db"), 2)?),
            TestDb::Postgres { .. } => Box::new(PgStore::open(&self.pg_options().unwrap())?),
        })
    }

    pub(crate) fn open(&self) -> Box<dyn Store> {
        self.try_open().unwrap()
    }

    /// Runs `sql` on a connection of its own (as another program would).
    pub(crate) fn raw(&self, sql: &str) -> Result<(), String> {
        match self {
            TestDb::Sqlite(dir) => rusqlite::Connection::open(dir.path().join("strata.db"))
                .and_then(|c| c.execute_batch(sql))
                .map_err(|e| e.to_string()),
            TestDb::Postgres { .. } => PgStore::open(&self.pg_options().unwrap())
                .and_then(|s| s.execute_raw(sql))
                .map_err(|e| e.to_string()),
        }
    }

    /// `SELECT count(*) FROM table`.
    pub(crate) fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT count(*) FROM {table}");
        match self {
            TestDb::Sqlite(dir) => rusqlite::Connection::open(dir.path().join("strata.db"))
                .unwrap()
                .query_row(&sql, [], |r| r.get(0))
                .unwrap(),
            TestDb::Postgres { url, schema } => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
                        .await
                        .unwrap();
                    let task = tokio::spawn(conn);
                    let sql = format!("SELECT count(*) FROM {schema}.{table}");
                    let n: i64 = c.query_one(&sql, &[]).await.unwrap().get(0);
                    drop(c);
                    let _ = task.await;
                    n
                })
            }
        }
    }

    /// Marks the database as written by a newer stratad (version 99).
    fn bump_version(&self) {
        let sql = match self {
            TestDb::Sqlite(_) => "PRAGMA user_version = 99",
            TestDb::Postgres { .. } => "INSERT INTO strata_migrations (version) VALUES (99)",
        };
        self.raw(sql).unwrap();
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let TestDb::Postgres { url, schema } = self {
            if !std::thread::panicking() {
                pg_admin(url, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
            }
        }
    }
}

/// Each test once per backend: `<backend>::<test>`.
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::TestDb::sqlite());
                }
            )*
        }
        mod postgres_backend {
            $(
                #[test]
                fn $name() {
                    if let Some(db) = super::TestDb::postgres(stringify!($name)) {
                        super::$name(&db);
                    }
                }
            )*
        }
    };
}

on_every_backend!(
    sandbox_round_trip_and_journal,
    journal_is_append_only,
    list_filters_and_paginates,
    snapshots_pending_and_point_in_time,
    acknowledged_writes_survive_a_restart,
    schema_versioning,
    templates_and_counts,
    compare_and_set_refuses_a_stale_copy_across_stores,
    tenant_usage_and_snapshot_charges,
    sandbox_env_survives_reopen_and_goes_with_the_sandbox,
    sandbox_settings_are_per_key_survive_reopen_and_go_with_the_sandbox,
    tenant_settings_by_prefix,
    tenant_setting_reads_one_tenant_and_key,
    lifecycle_policy_round_trips,
    same_as_round_trips,
    the_journal_keeps_every_kind_in_one_order_and_only_retention_prunes_it,
    webhooks_queue_deliveries_and_cancel_them,
    touch_and_reserved,
);

fn sandbox_round_trip_and_journal(db: &TestDb) {
    let s = db.open();
    let mut rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    assert_eq!(s.get_sandbox(&rec.id).unwrap().unwrap(), rec);
    // A second insert of the same id is refused, not merged.
    assert!(s.insert_sandbox(&rec, &created(&rec)).is_err());

    let ev = Event::new(
        &rec,
        Op::Pause,
        Some(SandboxState::Paused),
        EventPhase::Done,
        None,
        t0(),
    );
    rec.state = SandboxState::Paused;
    rec.pending_op = Some(Op::Hibernate);
    s.update_sandbox(&rec, Some(&ev)).unwrap();
    let got = s.get_sandbox(&rec.id).unwrap().unwrap();
    assert_eq!(got.state, SandboxState::Paused);
    assert_eq!(got.pending_op, Some(Op::Hibernate));
    assert_eq!(got.version, 1);
    let evs = s.events(&rec.id, 10).unwrap();
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[1].op, Op::Pause);
    assert_eq!(evs[1].from_state, Some(SandboxState::Running));
    assert!(evs[0].seq < evs[1].seq);
    assert_eq!(
        s.events(&rec.id, 1).unwrap()[0].op,
        Op::Pause,
        "newest last"
    );
}

fn journal_is_append_only(db: &TestDb) {
    let s = db.open();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    assert!(db.raw("UPDATE events SET detail = 'x'").is_err());
    assert!(db.raw("DELETE FROM events").is_err());
    assert_eq!(s.events(&rec.id, 10).unwrap().len(), 1);
}

fn list_filters_and_paginates(db: &TestDb) {
    let s = db.open();
    for i in 0..50 {
        let st = if i % 5 == 0 {
            SandboxState::Hibernated
        } else if i == 7 {
            SandboxState::Deleted
        } else {
            SandboxState::Running
        };
        let rec = sandbox(i, st);
        s.insert_sandbox(&rec, &created(&rec)).unwrap();
    }
    let mut f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 7,
        ..Default::default()
    };
    let mut seen = Vec::new();
    loop {
        let page = s.list_sandboxes(&f).unwrap();
        assert!(page.items.len() <= 7);
        seen.extend(page.items.iter().map(|r| r.id.clone()));
        match page.next_cursor {
            Some(c) => f.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len(), 49, "deleted ones are not listed by default");
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen, sorted, "stable order, no duplicates across pages");
    sorted.dedup();
    assert_eq!(sorted.len(), 49);

    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        states: vec![SandboxState::Hibernated],
        labels: BTreeMap::from([("team".into(), "t0".into())]),
        limit: 100,
        cursor: None,
    };
    let page = s.list_sandboxes(&f).unwrap();
    // i % 5 == 0 and i % 3 == 0: 0, 15, 30, 45.
    assert_eq!(page.items.len(), 4);
    assert!(page.next_cursor.is_none());

    // A label filter pages too, in the same order.
    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        labels: BTreeMap::from([("team".into(), "t1".into())]),
        limit: 3,
        ..Default::default()
    };
    let labelled = list_all(&*s, f);
    // i % 3 == 1 below 50, but 7 (deleted): 16 of 17.
    assert_eq!(labelled.len(), 16);
    let mut sorted = labelled.clone();
    sorted.sort();
    assert_eq!(labelled, sorted);

    let other_tenant = SandboxFilter {
        tenant: "other".into(),
        limit: 10,
        ..Default::default()
    };
    assert!(s.list_sandboxes(&other_tenant).unwrap().items.is_empty());

    let bad = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 10,
        cursor: Some("garbage!".into()),
        ..Default::default()
    };
    assert!(matches!(s.list_sandboxes(&bad), Err(StoreError::BadCursor)));
}

fn snapshots_pending_and_point_in_time(db: &TestDb) {
    let s = db.open();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    for i in 0..10 {
        s.put_snapshot(&snap(i, &rec.id, i * 60, SnapshotStatus::Ready))
            .unwrap();
    }
    let pending = snap(10, &rec.id, 600, SnapshotStatus::Pending);
    s.put_snapshot(&pending).unwrap();
    let mut deleted = snap(11, &rec.id, 30, SnapshotStatus::Deleted);
    deleted.status_reason = Some("gc".into());
    s.put_snapshot(&deleted).unwrap();

    assert_eq!(s.list_snapshots(&rec.id, false).unwrap().len(), 11);
    assert_eq!(s.list_snapshots(&rec.id, true).unwrap().len(), 12);
    assert_eq!(s.pending_snapshots().unwrap(), vec![pending.clone()]);
    // The newest *ready* one: a pending snapshot is never a restore point.
    let latest = s.latest_ready_snapshot(&rec.id).unwrap().unwrap();
    assert_eq!(latest.id.as_str(), "snap-000009");
    let at = s
        .ready_snapshot_at(&rec.id, t0() + CDuration::seconds(150))
        .unwrap()
        .unwrap();
    assert_eq!(at.id.as_str(), "snap-000002");
    assert!(s
        .ready_snapshot_at(&rec.id, t0() - CDuration::seconds(1))
        .unwrap()
        .is_none());
    assert_eq!(s.ready_snapshot_ids().unwrap().len(), 10);
    assert_eq!(
        s.sandboxes_with_snapshots(None, 10).unwrap(),
        vec![rec.id.clone()]
    );
    assert!(s
        .sandboxes_with_snapshots(Some(&rec.id), 10)
        .unwrap()
        .is_empty());
    let other: SnapshotId = "snap-none".parse().unwrap();
    assert!(s.get_snapshot(&other).unwrap().is_none());
    // Taking a snapshot journals it once (`snapshot.taken`); deleting a
    // ready one journals `snapshot.pruned`.
    let kinds = |s: &dyn Store| {
        s.journal_after(DEFAULT_TENANT, None, 0, 100)
            .unwrap()
            .iter()
            .filter(|e| e.kind == JournalKind::Snapshot)
            .map(|e| e.data["action"].as_str().unwrap_or("").to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(s.as_ref()).len(), 10);
    let mut gone = snap(3, &rec.id, 180, SnapshotStatus::Deleted);
    gone.status_reason = Some("user".into());
    s.put_snapshot(&gone).unwrap();
    assert_eq!(kinds(s.as_ref()).last().map(String::as_str), Some("pruned"));
}

fn acknowledged_writes_survive_a_restart(db: &TestDb) {
    // A "crash": the store is leaked, never closed. What a call
    // acknowledged (returned Ok for) must be there on reopen.
    let rec = sandbox(1, SandboxState::Running);
    let sn = snap(1, &rec.id, 5, SnapshotStatus::Ready);
    {
        let s = db.open();
        s.insert_sandbox(&rec, &created(&rec)).unwrap();
        s.put_snapshot(&sn).unwrap();
        if matches!(db, TestDb::Sqlite(_)) {
            std::mem::forget(s);
        }
    }
    let s = db.open();
    assert_eq!(s.get_sandbox(&rec.id).unwrap().unwrap(), rec);
    assert_eq!(s.get_snapshot(&sn.id).unwrap().unwrap(), sn);
}

fn schema_versioning(db: &TestDb) {
    drop(db.open());
    // Opening again migrates nothing and succeeds.
    drop(db.open());
    db.bump_version();
    match db.try_open() {
        Err(StoreError::TooNew { found: 99, .. }) => {}
        Err(other) => panic!("expected TooNew, got {other:?}"),
        Ok(_) => panic!("expected TooNew, opened"),
    }
}

fn templates_and_counts(db: &TestDb) {
    let s = db.open();
    let tpl = TemplateRecord {
        id: "tpl-base".parse().unwrap(),
        tenant: DEFAULT_TENANT.into(),
        name: Some("base".into()),
        size: SandboxSize::default(),
        status: TemplateStatus::Ready,
        status_reason: None,
        accel: Some("tcg".into()),
        created_at: t0(),
        updated_at: t0(),
        variant_of: None,
    };
    s.put_template(&tpl).unwrap();
    assert_eq!(s.get_template(&tpl.id).unwrap().unwrap(), tpl);
    let mut variant = tpl.clone();
    variant.id = "tpl-var".parse().unwrap();
    variant.variant_of = Some(tpl.id.clone());
    variant.status = TemplateStatus::Building;
    s.put_template(&variant).unwrap();
    variant.status = TemplateStatus::Ready;
    s.put_template(&variant).unwrap();
    assert_eq!(s.get_template(&variant.id).unwrap().unwrap(), variant);
    assert_eq!(s.list_templates(DEFAULT_TENANT).unwrap().len(), 2);
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    assert_eq!(s.reserved_capacity().unwrap(), (1, 512));
    let c = s.counts(None).unwrap();
    assert_eq!(c.sandboxes_by_state.get("running"), Some(&1));
    assert_eq!(c.templates_ready, 2);
    let own = s.counts(Some(DEFAULT_TENANT)).unwrap();
    assert_eq!(own.sandboxes_by_state.get("running"), Some(&1));
    let other = s.counts(Some("acme")).unwrap();
    assert!(other.sandboxes_by_state.is_empty(), "{other:?}");
    assert_eq!(other.templates_ready, 0, "another tenant's template");
    assert_eq!(s.all_templates().unwrap().len(), 2);
}

/// Two stores on one database (two daemons, or two hosts on one
/// PostgreSQL) read the same version; the first update lands, the second
/// is refused as stale and changes nothing.
fn compare_and_set_refuses_a_stale_copy_across_stores(db: &TestDb) {
    let a = db.open();
    let b = db.open();
    let rec = sandbox(1, SandboxState::Running);
    a.insert_sandbox(&rec, &created(&rec)).unwrap();
    let mut from_a = a.get_sandbox(&rec.id).unwrap().unwrap();
    let mut from_b = b.get_sandbox(&rec.id).unwrap().unwrap();
    from_a.state = SandboxState::Paused;
    a.update_sandbox(&from_a, None).unwrap();
    from_b.state = SandboxState::Hibernated;
    match b.update_sandbox(&from_b, None) {
        Err(StoreError::Stale {
            expected: 0,
            found: 1,
            ..
        }) => {}
        other => panic!("expected Stale, got {other:?}"),
    }
    let stored = b.get_sandbox(&rec.id).unwrap().unwrap();
    assert_eq!((stored.state, stored.version), (SandboxState::Paused, 1));
    // Concurrent writers from one version: exactly one wins each round.
    let n = 20;
    let wins = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for s in [&a, &b] {
            let wins = &wins;
            let id = rec.id.clone();
            scope.spawn(move || {
                for i in 0..n {
                    let mut cur = s.get_sandbox(&id).unwrap().unwrap();
                    cur.labels.insert("i".into(), i.to_string());
                    match s.update_sandbox(&cur, None) {
                        Ok(()) => {
                            wins.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(StoreError::Stale { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
    });
    let end = a.get_sandbox(&rec.id).unwrap().unwrap();
    assert_eq!(
        end.version,
        1 + wins.load(Ordering::Relaxed),
        "every accepted write moved the version by one, none was lost"
    );
}

fn tenant_usage_and_snapshot_charges(db: &TestDb) {
    let s = db.open();
    let mut run = sandbox(1, SandboxState::Running);
    run.tenant = "a".into();
    let mut hib = sandbox(2, SandboxState::Hibernated);
    hib.tenant = "a".into();
    let mut waking = sandbox(3, SandboxState::Hibernated);
    waking.tenant = "a".into();
    waking.pending_op = Some(Op::Resume);
    let mut gone = sandbox(4, SandboxState::Deleted);
    gone.tenant = "a".into();
    let other = sandbox(5, SandboxState::Running);
    for r in [&run, &hib, &waking, &gone, &other] {
        s.insert_sandbox(r, &created(r)).unwrap();
    }
    let u = s.tenant_usage("a").unwrap();
    // Deleted ones do not count; hibernated ones count as sandboxes, and
    // their vCPUs only while a wake is pending.
    assert_eq!(u.sandboxes, 3);
    assert_eq!(u.vcpus, 2 * u64::from(SandboxSize::default().vcpus));
    assert_eq!(s.tenant_usage("nobody").unwrap(), TenantUsage::default());

    let mut s1 = snap(1, &run.id, 10, SnapshotStatus::Ready);
    s1.tenant = "a".into();
    let mut s2 = snap(2, &run.id, 20, SnapshotStatus::Ready);
    s2.tenant = "a".into();
    let mut s3 = snap(3, &run.id, 30, SnapshotStatus::Deleted);
    s3.tenant = "a".into();
    for r in [&s1, &s2, &s3] {
        s.put_snapshot(r).unwrap();
    }
    let ready = s.tenant_ready_snapshots("a").unwrap();
    assert_eq!(
        ready.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        vec![s1.id.clone(), s2.id.clone()]
    );
    for (r, base, bytes) in [(&s1, "tpl-base", 7u64), (&s3, "snap-x", 9)] {
        s.put_charge(&SnapshotCharge {
            snapshot_id: r.id.clone(),
            tenant: "a".into(),
            sandbox_id: r.sandbox_id.clone(),
            base: base.into(),
            bytes,
            computed_at: t0(),
        })
        .unwrap();
    }
    // Only ready snapshots' charges; the record shows its charge.
    let c = s.snapshot_charges("a").unwrap();
    assert_eq!(c.len(), 1);
    assert_eq!((c[0].base.as_str(), c[0].bytes), ("tpl-base", 7));
    assert_eq!(
        s.get_snapshot(&s1.id).unwrap().unwrap().charge_bytes,
        Some(7)
    );
    assert_eq!(s.get_snapshot(&s2.id).unwrap().unwrap().charge_bytes, None);
    // Writing the snapshot record again keeps its charge; a new charge
    // replaces the old one.
    s.put_snapshot(&s1).unwrap();
    assert_eq!(
        s.get_snapshot(&s1.id).unwrap().unwrap().charge_bytes,
        Some(7)
    );
    s.put_charge(&SnapshotCharge {
        snapshot_id: s1.id.clone(),
        tenant: "a".into(),
        sandbox_id: s1.sandbox_id.clone(),
        base: "".into(),
        bytes: 11,
        computed_at: t0(),
    })
    .unwrap();
    assert_eq!(s.snapshot_charges("a").unwrap()[0].bytes, 11);
}

fn sandbox_env_survives_reopen_and_goes_with_the_sandbox(db: &TestDb) {
    let a = sandbox(1, SandboxState::Running);
    let b = sandbox(2, SandboxState::Running);
    // The store keeps what the service sealed, opaque.
    let env = "sealed:v1:AAAA".to_string();
    {
        let s = db.open();
        s.insert_sandbox(&a, &created(&a)).unwrap();
        s.insert_sandbox(&b, &created(&b)).unwrap();
        s.put_sandbox_env(&a.id, Some("sealed:v1:old")).unwrap();
        s.put_sandbox_env(&a.id, Some(&env)).unwrap();
        s.put_sandbox_env(&b.id, Some(&env)).unwrap();
        // An unknown sandbox keeps nothing.
        let ghost: SandboxId = "sb-ghost".parse().unwrap();
        s.put_sandbox_env(&ghost, Some(&env)).unwrap();
    }
    // A restart (a new store on the same database) reads them back.
    let s = db.open();
    assert_eq!(
        s.sandbox_envs().unwrap(),
        vec![(a.id.clone(), env.clone()), (b.id.clone(), env.clone())]
    );
    // Emptying drops the row; deleting the sandbox drops its row too.
    s.put_sandbox_env(&a.id, None).unwrap();
    let mut gone = s.get_sandbox(&b.id).unwrap().unwrap();
    gone.state = SandboxState::Deleted;
    gone.deleted_at = Some(t0());
    s.update_sandbox(&gone, None).unwrap();
    assert!(s.sandbox_envs().unwrap().is_empty());
    assert_eq!(db.count("sandbox_env"), 0);
    // A deleted sandbox keeps none.
    s.put_sandbox_env(&b.id, Some(&env)).unwrap();
    assert_eq!(db.count("sandbox_env"), 0);
}

fn sandbox_settings_are_per_key_survive_reopen_and_go_with_the_sandbox(db: &TestDb) {
    let a = sandbox(1, SandboxState::Running);
    let b = sandbox(2, SandboxState::Running);
    {
        let s = db.open();
        s.insert_sandbox(&a, &created(&a)).unwrap();
        s.insert_sandbox(&b, &created(&b)).unwrap();
        s.put_sandbox_setting(&a.id, "e2b.ports", Some(r#"{"public":false}"#))
            .unwrap();
        s.put_sandbox_setting(&a.id, "other", Some("1")).unwrap();
        s.put_sandbox_setting(&b.id, "e2b.ports", Some(r#"{"public":true}"#))
            .unwrap();
        // Replaced, not added.
        s.put_sandbox_setting(&b.id, "e2b.ports", Some(r#"{"mask":"h"}"#))
            .unwrap();
        let ghost: SandboxId = "sb-ghost".parse().unwrap();
        s.put_sandbox_setting(&ghost, "e2b.ports", Some("{}"))
            .unwrap();
    }
    let s = db.open();
    assert_eq!(
        s.sandbox_settings("e2b.ports").unwrap(),
        vec![
            (a.id.clone(), r#"{"public":false}"#.to_string()),
            (b.id.clone(), r#"{"mask":"h"}"#.to_string())
        ]
    );
    s.put_sandbox_setting(&b.id, "e2b.ports", None).unwrap();
    let mut gone = s.get_sandbox(&a.id).unwrap().unwrap();
    gone.state = SandboxState::Deleted;
    gone.deleted_at = Some(t0());
    s.update_sandbox(&gone, None).unwrap();
    assert!(s.sandbox_settings("e2b.ports").unwrap().is_empty());
    assert!(s.sandbox_settings("other").unwrap().is_empty());
    assert_eq!(db.count("sandbox_settings"), 0);
}

fn tenant_settings_by_prefix(db: &TestDb) {
    let s = db.open();
    s.put_tenant_setting("b", "e2b.tags.x", Some("1")).unwrap();
    s.put_tenant_setting("a", "e2b.tags.y", Some("2")).unwrap();
    s.put_tenant_setting("a", "e2b.tags.y", Some("3")).unwrap();
    s.put_tenant_setting("a", "other", Some("4")).unwrap();
    s.put_tenant_setting("a", "e2b.gone", Some("5")).unwrap();
    s.put_tenant_setting("a", "e2b.gone", None).unwrap();
    assert_eq!(
        s.tenant_settings("e2b.").unwrap(),
        vec![
            ("a".into(), "e2b.tags.y".into(), "3".into()),
            ("b".into(), "e2b.tags.x".into(), "1".into()),
        ]
    );
    assert_eq!(s.tenant_settings("").unwrap().len(), 3);
}

/// The point read of one tenant's setting sees only that tenant's row of
/// that exact key (not another tenant's, not a key it is a prefix of).
fn tenant_setting_reads_one_tenant_and_key(db: &TestDb) {
    let s = db.open();
    s.put_tenant_setting("a", "replicate", Some("true"))
        .unwrap();
    s.put_tenant_setting("b", "replicate.x", Some("x")).unwrap();
    s.put_tenant_setting("c", "replicate", Some("false"))
        .unwrap();
    assert_eq!(
        s.tenant_setting("a", "replicate").unwrap().as_deref(),
        Some("true")
    );
    assert_eq!(s.tenant_setting("b", "replicate").unwrap(), None);
    assert_eq!(
        s.tenant_setting("c", "replicate").unwrap().as_deref(),
        Some("false")
    );
    assert_eq!(s.tenant_setting("d", "replicate").unwrap(), None);
    s.put_tenant_setting("a", "replicate", None).unwrap();
    assert_eq!(s.tenant_setting("a", "replicate").unwrap(), None);
}

fn lifecycle_policy_round_trips(db: &TestDb) {
    let s = db.open();
    let a = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&a, &created(&a)).unwrap();
    assert_eq!(s.sandbox_lifecycle(&a.id).unwrap(), None);
    let p = LifecyclePolicy {
        on_timeout: OnTimeout::HibernateDisk,
        auto_resume: false,
    };
    s.put_sandbox_lifecycle(&a.id, &p).unwrap();
    let p2 = LifecyclePolicy {
        on_timeout: OnTimeout::Delete,
        auto_resume: false,
    };
    s.put_sandbox_lifecycle(&a.id, &p2).unwrap();
    assert_eq!(s.sandbox_lifecycle(&a.id).unwrap(), Some(p2));
    let mut gone = s.get_sandbox(&a.id).unwrap().unwrap();
    gone.state = SandboxState::Deleted;
    s.update_sandbox(&gone, None).unwrap();
    assert_eq!(s.sandbox_lifecycle(&a.id).unwrap(), None);
    s.put_sandbox_lifecycle(&a.id, &p).unwrap();
    assert_eq!(
        s.sandbox_lifecycle(&a.id).unwrap(),
        None,
        "deleted: none kept"
    );
}

fn same_as_round_trips(db: &TestDb) {
    let s = db.open();
    let rec = sandbox(1, SandboxState::Running);
    let old = snap(1, &rec.id, 5, SnapshotStatus::Ready);
    s.put_snapshot(&old).unwrap();
    assert_eq!(s.get_snapshot(&old.id).unwrap().unwrap(), old);
    let mut same = snap(2, &rec.id, 65, SnapshotStatus::Ready);
    same.same_as = Some(old.id.clone());
    same.pause_ms = None;
    s.put_snapshot(&same).unwrap();
    assert_eq!(s.get_snapshot(&same.id).unwrap().unwrap(), same);
    assert_eq!(
        s.latest_ready_snapshot(&rec.id).unwrap().unwrap().same_as,
        Some(old.id.clone())
    );
    let listed = s.list_snapshots(&rec.id, false).unwrap();
    assert_eq!(
        listed.iter().map(|r| r.same_as.clone()).collect::<Vec<_>>(),
        vec![None, Some(old.id.clone())]
    );
}

fn the_journal_keeps_every_kind_in_one_order_and_only_retention_prunes_it(db: &TestDb) {
    let s = db.open();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    let mut changes = s.journal_changes();
    changes.borrow_and_update();
    let old = Utc::now() - chrono::TimeDelta::days(30);
    let seq = s
        .append_journal(&JournalNote {
            at: old,
            tenant: rec.tenant.clone(),
            sandbox_id: rec.id.to_string(),
            kind: JournalKind::Approval,
            topic: "approval.requested".into(),
            data: serde_json::json!({ "action": "requested", "approval_id": "a1" }),
        })
        .unwrap();
    assert!(changes.has_changed().unwrap(), "a commit wakes the readers");
    let all = s.journal_after(&rec.tenant, None, 0, 100).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].kind, JournalKind::Sandbox);
    assert_eq!(all[1].seq, seq);
    let m = all[1].message();
    assert_eq!(m["kind"], "approval");
    assert_eq!(m["approval_id"], "a1");
    assert_eq!(m["sandbox_id"], rec.id.as_str());
    assert_eq!(
        s.journal_after(&rec.tenant, Some(rec.id.as_str()), all[0].seq, 100)
            .unwrap()
            .len(),
        1
    );
    // The transition list of the sandbox is unchanged: transitions only.
    assert_eq!(s.events(&rec.id, 10).unwrap().len(), 1);
    assert!(s.journal_after("other", None, 0, 100).unwrap().is_empty());
    // Deletes stay refused outside retention; retention prunes by age.
    assert!(db.raw("DELETE FROM events").is_err());
    let recent = Utc::now() - chrono::TimeDelta::days(7);
    let kept: Vec<i64> = all
        .iter()
        .filter(|e| e.at >= recent)
        .map(|e| e.seq)
        .collect();
    let pruned = s.prune_journal(recent).unwrap();
    assert_eq!(pruned as usize, all.len() - kept.len());
    let left: Vec<i64> = s
        .journal_after(&rec.tenant, None, 0, 100)
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(left, kept);
    assert!(!left.contains(&seq), "the 30-day-old entry is pruned");
    // And deletes are refused again after the pruning transaction.
    s.append_journal(&JournalNote {
        at: Utc::now(),
        tenant: rec.tenant.clone(),
        sandbox_id: rec.id.to_string(),
        kind: JournalKind::Policy,
        topic: "policy".into(),
        data: serde_json::json!({}),
    })
    .unwrap();
    assert!(db.raw("DELETE FROM events").is_err());
}

fn webhooks_queue_deliveries_and_cancel_them(db: &TestDb) {
    let s = db.open();
    s.set_delivery_limit(2);
    let hook = Webhook {
        id: "wh-1".into(),
        tenant: "a".into(),
        url: "https://example.invalid/h".into(),
        events: vec!["approval.requested".into()],
        format: WebhookFormat::Slack,
        secret_sealed: "sealed:v1:x".into(),
        created_by: "tok-1".into(),
        created_at: t0(),
    };
    s.put_webhook(&hook).unwrap();
    assert_eq!(s.webhooks("a").unwrap(), vec![hook.clone()]);
    assert_eq!(s.get_webhook("a", "wh-1").unwrap(), Some(hook.clone()));
    assert_eq!(
        s.get_webhook("b", "wh-1").unwrap(),
        None,
        "another tenant's"
    );
    let note = |topic: &str| JournalNote {
        at: t0(),
        tenant: "a".into(),
        sandbox_id: String::new(),
        kind: JournalKind::Approval,
        topic: topic.into(),
        data: serde_json::json!({ "action": "requested" }),
    };
    let seq = s.append_journal(&note("approval.requested")).unwrap();
    s.append_journal(&note("approval.answered")).unwrap();
    s.append_journal(&note("approval.requested")).unwrap();
    // Beyond the limit (2 pending), none is queued.
    s.append_journal(&note("approval.requested")).unwrap();
    let due = s.due_deliveries(t0(), 10).unwrap();
    assert_eq!(due.len(), 2);
    assert_eq!(due[0].event_seq, seq);
    assert_eq!(due[0].event["seq"], seq);
    assert_eq!(s.next_delivery_at().unwrap(), Some(t0()));
    let mut d = due[0].clone();
    d.status = DeliveryStatus::Delivered;
    d.attempts = 1;
    d.last_status = Some(204);
    d.next_attempt_at = None;
    d.updated_at = t0() + CDuration::seconds(1);
    s.update_delivery(&d).unwrap();
    let all = s.deliveries("wh-1", 10).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1], d, "newest first");
    assert!(s.delete_webhook("a", "wh-1", t0()).unwrap());
    assert!(!s.delete_webhook("a", "wh-1", t0()).unwrap());
    assert!(s.webhooks("a").unwrap().is_empty());
    assert!(s.due_deliveries(t0(), 10).unwrap().is_empty());
    assert_eq!(
        s.deliveries("wh-1", 10).unwrap()[0].status,
        DeliveryStatus::Cancelled
    );
    assert_eq!(s.next_delivery_at().unwrap(), None);
}

fn touch_and_reserved(db: &TestDb) {
    let s = db.open();
    let run = sandbox(1, SandboxState::Running);
    let mut hib = sandbox(2, SandboxState::Hibernated);
    hib.pending_op = Some(Op::Resume);
    let idle = sandbox(3, SandboxState::Hibernated);
    for r in [&run, &hib, &idle] {
        s.insert_sandbox(r, &created(r)).unwrap();
    }
    let later = t0() + CDuration::hours(1);
    s.touch_sandbox(&run.id, later).unwrap();
    // Never backwards.
    s.touch_sandbox(&run.id, t0()).unwrap();
    assert_eq!(
        s.get_sandbox(&run.id).unwrap().unwrap().last_activity_at,
        later
    );
    let r = s.reserved_sandboxes().unwrap();
    assert_eq!(
        r.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        vec![run.id.clone(), hib.id.clone()]
    );
    assert_eq!(r[1].pending_op, Some(Op::Resume));
    assert_eq!(r[0].last_activity_at, later);
    assert_eq!(
        s.live_sandboxes()
            .unwrap()
            .iter()
            .map(|r| r.id.clone())
            .collect::<Vec<_>>(),
        vec![run.id.clone(), hib.id.clone(), idle.id.clone()]
    );
}
