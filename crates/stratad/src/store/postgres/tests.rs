//! What only PostgreSQL has: journal wake-ups across connections (other
//! processes, other hosts), concurrent migration, and a lost or stuck
//! connection answering a typed error within the bound instead of hanging.
//! Skipped (with a line) without `STRATA_TEST_PG_URL`; failed with it set
//! and PostgreSQL unreachable.

use std::time::{Duration, Instant};

use strata_core::SandboxState;

use super::*;
use crate::store::tests::{created, list_all, pg_admin, sandbox, t0, TestDb};

fn db(test: &str) -> Option<TestDb> {
    TestDb::postgres(test)
}

#[test]
fn a_journal_commit_wakes_readers_of_another_store() {
    let Some(db) = db("a_journal_commit_wakes_readers_of_another_store") else {
        return;
    };
    let writer = db.open();
    let reader = PgStore::open(&db.pg_options().unwrap()).unwrap();
    let mut rx = reader.journal_changes();
    // The listener's first connect wakes once; wait for it, then start clean.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rx.has_changed().unwrap() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    rx.borrow_and_update();
    let rec = sandbox(1, SandboxState::Running);
    writer.insert_sandbox(&rec, &created(&rec)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rx.has_changed().unwrap() {
        assert!(
            Instant::now() < deadline,
            "no wake-up from the other store's commit"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        reader
            .journal_after(DEFAULT_TENANT, None, 0, 10)
            .unwrap()
            .len(),
        1
    );
}

#[test]
fn daemons_starting_together_migrate_once() {
    let Some(db) = db("daemons_starting_together_migrate_once") else {
        return;
    };
    let opts = db.pg_options().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| PgStore::open(&opts).map(|st| st.schema_version())))
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap().unwrap().unwrap(), pg_schema_version());
        }
    });
    assert_eq!(db.count("strata_migrations"), PG_MIGRATIONS.len() as i64);
}

/// A statement stuck behind a lock answers `Unavailable` at the bound; a
/// connection cut mid-statement answers `Unavailable` at once; both leave
/// the store usable once PostgreSQL is back.
#[test]
fn a_stuck_or_lost_connection_is_a_typed_error_not_a_hang() {
    let Some(db) = db("a_stuck_or_lost_connection_is_a_typed_error_not_a_hang") else {
        return;
    };
    let TestDb::Postgres { url, schema } = &db else {
        unreachable!()
    };
    let app = format!("strata_cut_{}", rand::random::<u32>());
    let mut opts = db.pg_options().unwrap();
    opts.url = if url.contains("://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}application_name={app}")
    } else {
        format!("{url} application_name={app}")
    };
    opts.timeout = Duration::from_secs(2);
    let s = PgStore::open(&opts).unwrap();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();

    // Another session holds the table: the read waits, then gives up at
    // the bound with a typed error.
    let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
    let (locked_tx, locked_rx) = std::sync::mpsc::channel::<()>();
    let url2 = url.clone();
    let schema2 = schema.clone();
    let holder = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (mut c, conn) = tokio_postgres::connect(&url2, NoTls).await.unwrap();
            tokio::spawn(conn);
            let tx = c.transaction().await.unwrap();
            tx.batch_execute(&format!(
                "LOCK TABLE {schema2}.sandboxes IN ACCESS EXCLUSIVE MODE"
            ))
            .await
            .unwrap();
            locked_tx.send(()).unwrap();
            let _ = tokio::task::spawn_blocking(move || hold_rx.recv()).await;
            tx.rollback().await.unwrap();
        });
    });
    locked_rx.recv().unwrap();
    let t = Instant::now();
    match s.get_sandbox(&rec.id) {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // The same wait, made from async code on a runtime with one worker (a
    // policy reload on the egress path while the store does not answer):
    // the worker's other tasks run meanwhile (`off_worker`). Before, the
    // worker waited with the call, and with every worker so parked nothing
    // else ran, the self-fencing timer included.
    let s = Arc::new(s);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (r, ticked) = rt.block_on(async {
        let ticks = Arc::new(AtomicUsize::new(0));
        let t2 = ticks.clone();
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                t2.fetch_add(1, Ordering::SeqCst);
            }
        });
        let (s2, id) = (s.clone(), rec.id.clone());
        let before = ticks.load(Ordering::SeqCst);
        let r = tokio::spawn(async move { s2.get_sandbox(&id) })
            .await
            .unwrap();
        let ticked = ticks.load(Ordering::SeqCst) - before;
        ticker.abort();
        (r, ticked)
    });
    drop(rt);
    assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
    assert!(
        ticked >= 10,
        "the runtime's only worker ran {ticked} timer ticks of 50 ms during a 2 s store wait"
    );
    let e = crate::service::ServiceError::Store(StoreError::Unavailable("x".into()));
    assert_eq!(e.code(), strata_core::ErrorCode::StorageFailed);
    let e = crate::service::ServiceError::Store(StoreError::Full("x".into()));
    assert_eq!(e.code(), strata_core::ErrorCode::StoreFull);

    // Cut mid-statement: a read waits on the lock, its backend is killed.
    std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            let t = Instant::now();
            (s.get_sandbox(&rec.id), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        pg_admin(
            url,
            &format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = '{app}' AND state = 'active'"
            ),
        );
        let (r, took) = reader.join().unwrap();
        assert!(
            matches!(r, Err(StoreError::Unavailable(_))),
            "expected Unavailable, got {r:?}"
        );
        assert!(
            took < Duration::from_millis(1500),
            "answered at once: {took:?}"
        );
    });
    hold_tx.send(()).unwrap();
    holder.join().unwrap();
    // PostgreSQL answers again: so does the store (new connections).
    assert_eq!(s.get_sandbox(&rec.id).unwrap().unwrap().id, rec.id);
    // Every pooled connection cut while idle: the next call may fail typed,
    // the one after works.
    pg_admin(
        url,
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{app}'"
        ),
    );
    let first = s.get_sandbox(&rec.id);
    assert!(
        matches!(first, Ok(Some(_)) | Err(StoreError::Unavailable(_))),
        "{first:?}"
    );
    assert!(s.get_sandbox(&rec.id).unwrap().is_some());
}

#[test]
fn an_unreachable_server_fails_open_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = PgOptions::new(format!(
        "host={} port=1 user=nobody dbname=none",
        dir.path().display()
    ));
    opts.timeout = Duration::from_secs(1);
    let t = Instant::now();
    match PgStore::open(&opts) {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3));
}

/// The first column of each row of `sql`, as text, run in `schema`.
fn pg_lines(url: &str, schema: &str, sql: &str) -> Vec<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        let task = tokio::spawn(conn);
        c.batch_execute(&format!("SET search_path TO {schema}"))
            .await
            .unwrap();
        let rows = c.query(sql, &[]).await.unwrap();
        let out = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        drop(c);
        let _ = task.await;
        out
    })
}

/// A database at schema 15 migrates to the index of live sandboxes, and a
/// tenant whose history is mostly deleted lists its live sandboxes through
/// it (no step over the deleted ones, no sort).
#[test]
fn a_schema_15_database_lists_through_the_live_index_after_migrating() {
    let Some(db) = db("a_schema_15_database_lists_through_the_live_index_after_migrating") else {
        return;
    };
    let TestDb::Postgres { url, schema } = &db else {
        unreachable!()
    };
    {
        let s = db.open();
        for i in 0..30 {
            let st = if i < 20 {
                SandboxState::Deleted
            } else {
                SandboxState::Hibernated
            };
            let rec = sandbox(i, st);
            s.insert_sandbox(&rec, &created(&rec)).unwrap();
        }
    }
    // Back to what version 15 had (migration 16 changes indexes only;
    // migration 17 rebuilds the label rows from what they name, so it
    // runs again over its own table).
    db.raw(
        "DROP INDEX sandboxes_live_by_tenant;
         CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant_id, created_at, id);
         DELETE FROM strata_migrations WHERE version >= 16;",
    )
    .unwrap();
    let s = db.open();
    assert_eq!(db.count("strata_migrations WHERE version = 16"), 1);
    let idx = pg_lines(
        url,
        schema,
        "SELECT indexname::text FROM pg_indexes \
         WHERE schemaname = current_schema() AND tablename = 'sandboxes' ORDER BY 1",
    );
    assert!(
        idx.iter().any(|n| n == "sandboxes_live_by_tenant"),
        "{idx:?}"
    );
    assert!(!idx.iter().any(|n| n == "sandboxes_by_tenant"), "{idx:?}");
    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 4,
        ..Default::default()
    };
    let seen: Vec<String> = list_all(&*s, f).iter().map(ToString::to_string).collect();
    let want: Vec<String> = (20..30).map(|i| format!("sb-{i:08}")).collect();
    assert_eq!(seen, want);

    // A long history: 20,000 deleted sandboxes older than the live ones.
    db.raw(
        "INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, state,
             created_at, updated_at, last_activity_at, deleted_at)
           SELECT 'sb-old' || lpad(g::text, 9, '0'), 'default', 1, 256, 2, '{}', 'deleted',
                  g, g, g, g
           FROM generate_series(1, 20000) g;
         ANALYZE sandboxes;",
    )
    .unwrap();
    let plan = pg_lines(
        url,
        schema,
        "EXPLAIN SELECT s.id, s.labels FROM sandboxes s WHERE s.tenant_id = 'default' \
         AND s.state != 'deleted' ORDER BY s.created_at, s.id LIMIT 101",
    )
    .join("\n");
    assert!(plan.contains("sandboxes_live_by_tenant"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
    let page = s
        .list_sandboxes(&SandboxFilter {
            tenant: DEFAULT_TENANT.into(),
            limit: 100,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(page.items.len(), 10);
}

/// A database at schema 16 (label rows of five columns) migrates in place:
/// every label row of a live sandbox then carries its record, the listing
/// by label answers what `get` does (also after a touch) and reads the
/// label rows alone, in index order (no join, no sort).
#[test]
fn a_schema_16_databases_label_rows_carry_the_record_after_migrating() {
    let Some(db) = db("a_schema_16_databases_label_rows_carry_the_record_after_migrating") else {
        return;
    };
    let TestDb::Postgres { url, schema } = &db else {
        unreachable!()
    };
    {
        let s = db.open();
        for i in 0..30 {
            let st = match i % 10 {
                0 => SandboxState::Deleted,
                1 => SandboxState::Paused,
                _ => SandboxState::Running,
            };
            let rec = sandbox(i, st);
            s.insert_sandbox(&rec, &created(&rec)).unwrap();
        }
    }
    // Back to what version 16 had: the label rows of V14, of sandboxes
    // not deleted.
    db.raw(
        "DROP TABLE sandbox_labels;
         CREATE TABLE sandbox_labels (
             sandbox_id TEXT COLLATE \"C\" NOT NULL,
             key TEXT COLLATE \"C\" NOT NULL,
             value TEXT COLLATE \"C\" NOT NULL,
             tenant_id TEXT COLLATE \"C\" NOT NULL DEFAULT '',
             created_at BIGINT NOT NULL DEFAULT 0,
             PRIMARY KEY (sandbox_id, key)
         );
         CREATE INDEX sandbox_labels_by_kv ON sandbox_labels (key, value, sandbox_id);
         CREATE INDEX sandbox_labels_in_order ON sandbox_labels
             (tenant_id, key, value, created_at, sandbox_id);
         INSERT INTO sandbox_labels (sandbox_id, key, value, tenant_id, created_at)
             SELECT id, 'team', labels::json->>'team', tenant_id, created_at
             FROM sandboxes WHERE state != 'deleted';
         DELETE FROM strata_migrations WHERE version = 17;",
    )
    .unwrap();
    let s = db.open();
    assert_eq!(db.count("strata_migrations WHERE version = 17"), 1);
    assert_eq!(db.count("sandbox_labels"), 27);
    // A touch reaches the label rows too.
    let touched = sandbox(3, SandboxState::Running).id;
    s.touch_sandbox(&touched, t0() + chrono::Duration::hours(2))
        .unwrap();
    for team in ["t0", "t1", "t2"] {
        let f = SandboxFilter {
            tenant: DEFAULT_TENANT.into(),
            labels: [("team".to_owned(), team.to_owned())].into(),
            limit: 4,
            ..Default::default()
        };
        let ids = list_all(&*s, f.clone());
        assert_eq!(ids.len(), 9, "{team}: {ids:?}");
        let page = s.list_sandboxes(&f).unwrap();
        for r in &page.items {
            assert_eq!(Some(r), s.get_sandbox(&r.id).unwrap().as_ref());
        }
    }
    // Another tenant's 20,000 labelled sandboxes, so the plan is the one
    // of a table of size.
    db.raw(
        "INSERT INTO sandbox_labels (key, value, sandbox_id, tenant_id, vcpus, memory_mib,
             disk_gib, labels, state, created_at, updated_at, last_activity_at, version)
           SELECT 'team', 't' || (g % 50), 'sb-bulk' || lpad(g::text, 9, '0'), 'bulk',
                  1, 256, 2, '{}', 'running', g, g, g, 0
           FROM generate_series(1, 20000) g;
         ANALYZE sandbox_labels;",
    )
    .unwrap();
    let plan = pg_lines(
        url,
        schema,
        "EXPLAIN SELECT sandbox_id FROM sandbox_labels WHERE tenant_id = 'default' \
         AND key = 'team' AND value = 't1' AND state != 'deleted' \
         ORDER BY created_at, sandbox_id LIMIT 101",
    )
    .join("\n");
    assert!(plan.contains("sandbox_labels_in_order"), "{plan}");
    assert!(!plan.contains("Sort"), "{plan}");
}
