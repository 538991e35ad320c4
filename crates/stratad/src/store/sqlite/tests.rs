use std::collections::BTreeMap;

use strata_core::SandboxState;

use super::*;
use crate::store::tests::{created, list_all, sandbox, snap};

fn open(dir: &tempfile::TempDir) -> SqliteStore {
    SqliteStore::open(&dir.path().join("strata.db"), 2).unwrap()
}

#[test]
fn listing_uses_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
    let w = s.writer();
    let plan = |sql: &str| -> String {
        let mut stmt = w.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows: Vec<String> = stmt
            .query_map([], |r| r.get::<_, String>(3))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        rows.join(" | ")
    };
    // The listing walks the index of live sandboxes (schema 16), in order:
    // no deleted row is stepped over, no sort.
    let p = plan("SELECT s.id, s.labels FROM sandboxes s WHERE s.tenant_id = 'default' AND s.state != 'deleted' AND (s.created_at, s.id) > (1, 'sb-a') ORDER BY s.created_at, s.id LIMIT 10");
    assert!(p.contains("sandboxes_live_by_tenant"), "{p}");
    assert!(!p.contains("TEMP B-TREE"), "listing needs no sort: {p}");
    let p = plan("SELECT id FROM sandboxes s WHERE tenant_id = 'default' AND state IN ('running') ORDER BY created_at, id LIMIT 10");
    assert!(p.contains("sandboxes_by_state"), "{p}");
    let p = plan("SELECT s.id FROM sandbox_labels l JOIN sandboxes s ON s.id = l.sandbox_id WHERE l.tenant_id = 'default' AND l.key = 'team' AND l.value = 't1' AND s.tenant_id = l.tenant_id AND s.state != 'deleted' AND (l.created_at, l.sandbox_id) > (1, 'sb-a') ORDER BY l.created_at, l.sandbox_id LIMIT 10");
    assert!(p.contains("sandbox_labels_in_order"), "{p}");
    assert!(
        !p.contains("TEMP B-TREE"),
        "label listing needs no sort: {p}"
    );
    let p = plan("SELECT id FROM snapshots WHERE sandbox_id = 'sb-a' AND status = 'ready' AND created_at <= 5 ORDER BY created_at DESC LIMIT 1");
    assert!(p.contains("INDEX"), "{p}");
}

#[test]
fn acknowledged_writes_survive_a_crash_in_wal_with_full_sync() {
    // A "crash": the store is leaked, never closed, never checkpointed. What
    // a call acknowledged (returned Ok for) must be there on reopen.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    let rec = sandbox(1, SandboxState::Running);
    let sn = snap(1, &rec.id, 5, SnapshotStatus::Ready);
    {
        let s = SqliteStore::open(&path, 1).unwrap();
        s.insert_sandbox(&rec, &created(&rec)).unwrap();
        s.put_snapshot(&sn).unwrap();
        std::mem::forget(s);
    }
    assert!(dir.path().join("strata.db-wal").exists(), "WAL mode");
    let s = SqliteStore::open(&path, 1).unwrap();
    assert_eq!(s.get_sandbox(&rec.id).unwrap().unwrap(), rec);
    assert_eq!(s.get_snapshot(&sn.id).unwrap().unwrap(), sn);
    let sync: i64 = s
        .writer()
        .query_row("PRAGMA synchronous", [], |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 2, "synchronous=FULL");
}

#[test]
fn label_index_is_filled_by_the_migration() {
    // A database as schema version 2 left it: label rows without tenant or time.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    let a = sandbox(1, SandboxState::Running);
    let b = sandbox(4, SandboxState::Running);
    {
        let conn = Connection::open(&path).unwrap();
        for m in &MIGRATIONS[..2] {
            conn.execute_batch(m).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 2").unwrap();
        for r in [&a, &b] {
            conn.execute(
                "INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, state, \
                 created_at, updated_at, last_activity_at) VALUES (?1, 'default', 1, 256, 2, ?2, 'running', ?3, ?3, ?3)",
                params![r.id.as_str(), serde_json::to_string(&r.labels).unwrap(), ms(r.created_at)],
            )
            .unwrap();
            for (k, v) in &r.labels {
                conn.execute(
                    "INSERT INTO sandbox_labels (sandbox_id, key, value) VALUES (?1, ?2, ?3)",
                    params![r.id.as_str(), k, v],
                )
                .unwrap();
            }
        }
    }
    let s = SqliteStore::open(&path, 1).unwrap();
    // sandbox(i) is labelled team=t{i % 3}: 1 and 4 both carry t1.
    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        labels: BTreeMap::from([("team".into(), "t1".into())]),
        limit: 1,
        ..Default::default()
    };
    let first = s.list_sandboxes(&f).unwrap();
    assert_eq!(first.items.len(), 1);
    let second = s
        .list_sandboxes(&SandboxFilter {
            cursor: first.next_cursor.clone(),
            ..f.clone()
        })
        .unwrap();
    let mut got = vec![first.items[0].id.clone(), second.items[0].id.clone()];
    got.sort();
    let mut want = vec![a.id.clone(), b.id.clone()];
    want.sort();
    assert_eq!(got, want);
    assert!(second.next_cursor.is_none());
    let other = SandboxFilter {
        tenant: "other".into(),
        ..f
    };
    assert!(s.list_sandboxes(&other).unwrap().items.is_empty());
}

#[test]
fn a_schema_3_database_opens_with_platform_templates_and_versions() {
    // A database as the previous release (schema 3) left it: the default
    // template owned by tenant `default`, a tenant's own template, a sandbox
    // without a version.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    let a = sandbox(1, SandboxState::Running);
    {
        let conn = Connection::open(&path).unwrap();
        for m in &MIGRATIONS[..3] {
            conn.execute_batch(m).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 3").unwrap();
        for (id, tenant) in [
            ("tpl-default", "default"),
            ("tpl-mine", "default"),
            ("tpl-acme", "acme"),
        ] {
            conn.execute(
                "INSERT INTO templates (id, tenant_id, name, vcpus, memory_mib, disk_gib, status, \
                 created_at, updated_at) VALUES (?1, ?2, NULL, 1, 512, 2, 'ready', 0, 0)",
                params![id, tenant],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO sandboxes (id, tenant_id, vcpus, memory_mib, disk_gib, labels, state, \
             created_at, updated_at, last_activity_at) VALUES (?1, 'default', 1, 256, 2, '{}', 'running', ?2, ?2, ?2)",
            params![a.id.as_str(), ms(a.created_at)],
        )
        .unwrap();
    }
    let s = SqliteStore::open(&path, 1).unwrap();
    let owner = |id: &str| {
        s.get_template(&id.parse().unwrap())
            .unwrap()
            .unwrap()
            .tenant
    };
    assert_eq!(owner("tpl-default"), crate::caller::PLATFORM_SCOPE);
    assert_eq!(
        owner("tpl-mine"),
        "default",
        "only the daemon's default template moves"
    );
    assert_eq!(owner("tpl-acme"), "acme");
    // The old sandbox reads as version 0; an update from that copy lands
    // once, and the same stale copy is then refused without a change.
    let mut rec = s.get_sandbox(&a.id).unwrap().unwrap();
    assert_eq!(rec.version, 0);
    let stale = rec.clone();
    rec.state = SandboxState::Paused;
    s.update_sandbox(&rec, None).unwrap();
    let stored = s.get_sandbox(&a.id).unwrap().unwrap();
    assert_eq!((stored.state, stored.version), (SandboxState::Paused, 1));
    let mut again = stale;
    again.state = SandboxState::Hibernated;
    match s.update_sandbox(&again, None) {
        Err(StoreError::Stale {
            expected: 0,
            found: 1,
            ..
        }) => {}
        other => panic!("expected Stale, got {other:?}"),
    }
    assert_eq!(
        s.get_sandbox(&a.id).unwrap().unwrap().state,
        SandboxState::Paused,
        "the refused write changed nothing"
    );
}

#[test]
fn the_database_is_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    // An existing database made with a loose mode is tightened at open.
    std::fs::write(&path, b"").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _s = SqliteStore::open(&path, 1).unwrap();
    for p in [
        path.clone(),
        dir.path().join("strata.db-wal"),
        dir.path().join("strata.db-shm"),
    ] {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", p.display());
    }
}

/// The security store writes the same database from its own connection
/// (audit head, tokens, bindings). A sandbox update reads its version first;
/// begun deferred, that transaction could not be promoted to a writer after
/// the other connection committed (`SQLITE_BUSY_SNAPSHOT`, a 500 under load).
#[test]
fn updates_and_security_writes_interleave_without_busy_errors() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
    let sec = crate::security::store::SecurityStore::open(&dir.path().join("strata.db")).unwrap();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    let n = 400;
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            for i in 0..n {
                sec.set_audit_head(i, &format!("h{i}")).unwrap();
            }
        });
        for i in 0..n {
            let mut cur = s.get_sandbox(&rec.id).unwrap().unwrap();
            cur.labels.insert("i".into(), i.to_string());
            s.update_sandbox(&cur, None)
                .unwrap_or_else(|e| panic!("update {i}: {e}"));
        }
        writer.join().unwrap();
    });
    let got = s.get_sandbox(&rec.id).unwrap().unwrap();
    assert_eq!(got.version, n);
    assert_eq!(sec.audit_head().unwrap().map(|(q, _)| q), Some(n - 1));
}

#[test]
fn same_as_round_trips_and_schema_11_rows_read_as_none() {
    // A database as schema 11 left it, with one ready snapshot.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    let rec = sandbox(1, SandboxState::Running);
    let old = snap(1, &rec.id, 5, SnapshotStatus::Ready);
    {
        let conn = Connection::open(&path).unwrap();
        for m in &MIGRATIONS[..11] {
            conn.execute_batch(m).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 11").unwrap();
        conn.execute(
            "INSERT INTO snapshots (id, tenant_id, sandbox_id, kind, label, status, status_reason, \
             created_at, pause_ms, exclusive_bytes, referenced_bytes) \
             VALUES (?1, 'default', ?2, 'rolling', NULL, 'ready', NULL, ?3, 15.0, 4096, 1048576)",
            params![old.id.as_str(), rec.id.as_str(), ms(old.created_at)],
        )
        .unwrap();
    }
    let s = SqliteStore::open(&path, 1).unwrap();
    let read = s.get_snapshot(&old.id).unwrap().unwrap();
    assert_eq!(read, old, "an old row has no same_as");
    // A record of an unchanged guest names its target, and keeps it.
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
    // Serialized only when set: old API clients see the same document.
    let j = serde_json::to_value(&old).unwrap();
    assert!(j.get("same_as").is_none(), "{j}");
    let j = serde_json::to_value(&same).unwrap();
    assert_eq!(j["same_as"], old.id.as_str());
}

#[test]
fn a_schema_15_database_lists_through_the_live_index_after_migrating() {
    // A database as schema 15 left it, with live and deleted sandboxes:
    // written by this build, then its index put back as 15 had it
    // (migration 16 changes indexes only).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    {
        let s = SqliteStore::open(&path, 1).unwrap();
        for i in 0..30 {
            let st = if i < 20 {
                SandboxState::Deleted
            } else {
                SandboxState::Hibernated
            };
            let rec = sandbox(i, st);
            s.insert_sandbox(&rec, &created(&rec)).unwrap();
        }
        s.writer()
            .execute_batch(
                "DROP INDEX sandboxes_live_by_tenant;
                 CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant_id, created_at, id);
                 PRAGMA user_version = 15;",
            )
            .unwrap();
    }
    let s = SqliteStore::open(&path, 1).unwrap();
    let version: i64 = s
        .writer()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let indexes: Vec<String> = s
        .writer()
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'sandboxes'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(|r| r.unwrap())
        .collect();
    assert!(
        indexes.iter().any(|n| n == "sandboxes_live_by_tenant"),
        "{indexes:?}"
    );
    assert!(
        !indexes.iter().any(|n| n == "sandboxes_by_tenant"),
        "{indexes:?}"
    );
    // The oldest live ones first, in pages, none deleted.
    let f = SandboxFilter {
        tenant: DEFAULT_TENANT.into(),
        limit: 4,
        ..Default::default()
    };
    let seen: Vec<String> = list_all(&s, f).iter().map(ToString::to_string).collect();
    let want: Vec<String> = (20..30).map(|i| format!("sb-{i:08}")).collect();
    assert_eq!(seen, want);
    assert_eq!(s.tenant_usage(DEFAULT_TENANT).unwrap().sandboxes, 10);
}
