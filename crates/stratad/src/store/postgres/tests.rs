//! What only PostgreSQL has: journal wake-ups across connections (other
//! processes, other hosts), concurrent migration, and a lost or stuck
//! connection answering a typed error within the bound instead of hanging.
//! Skipped (with a line) without `STRATA_TEST_PG_URL`; failed with it set
//! and PostgreSQL unreachable.

use std::time::{Duration, Instant};

use strata_core::SandboxState;

use super::*;
use crate::store::tests::{created, pg_admin, sandbox, TestDb};

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
