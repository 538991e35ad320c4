use std::collections::BTreeMap;

use chrono::{Duration as CDuration, TimeZone, Utc};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState, SnapshotId};

use super::*;

fn t0() -> DateTime<Utc> {
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

fn snap(i: i64, sb: &SandboxId, secs: i64, status: SnapshotStatus) -> SnapshotRecord {
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

fn created(rec: &SandboxRecord) -> Event {
    Event::new(
        rec,
        Op::Created,
        Some(rec.state),
        EventPhase::Done,
        None,
        rec.created_at,
    )
}

fn open(dir: &tempfile::TempDir) -> SqliteStore {
    SqliteStore::open(&dir.path().join("strata.db"), 2).unwrap()
}

#[test]
fn sandbox_round_trip_and_journal() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
    let evs = s.events(&rec.id, 10).unwrap();
    assert_eq!(evs.len(), 2);
    assert_eq!(evs[1].op, Op::Pause);
    assert_eq!(evs[1].from_state, Some(SandboxState::Running));
    assert!(evs[0].seq < evs[1].seq);
}

#[test]
fn journal_is_append_only() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    let w = s.writer();
    assert!(w.execute("UPDATE events SET detail = 'x'", []).is_err());
    assert!(w.execute("DELETE FROM events", []).is_err());
}

#[test]
fn list_filters_and_paginates() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
    let p = plan("SELECT id FROM sandboxes s WHERE tenant_id = 'default' AND state != 'deleted' AND (created_at, id) > (1, 'sb-a') ORDER BY created_at, id LIMIT 10");
    assert!(
        p.contains("USING INDEX sandboxes_by_tenant") || p.contains("USING COVERING INDEX"),
        "{p}"
    );
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
fn snapshots_pending_and_point_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
}

#[test]
fn acknowledged_writes_survive_a_crash() {
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
fn schema_versioning() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strata.db");
    {
        let s = SqliteStore::open(&path, 1).unwrap();
        let v: i64 = s
            .writer()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        s.writer()
            .execute_batch("PRAGMA user_version = 99")
            .unwrap();
    }
    match SqliteStore::open(&path, 1) {
        Err(StoreError::TooNew { found: 99, .. }) => {}
        other => panic!("expected TooNew, got {other:?}"),
    }
}

#[test]
fn templates_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
    assert_eq!(s.list_templates(DEFAULT_TENANT).unwrap().len(), 1);
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    assert_eq!(s.reserved_capacity().unwrap(), (1, 512));
    let c = s.counts(None).unwrap();
    assert_eq!(c.sandboxes_by_state.get("running"), Some(&1));
    assert_eq!(c.templates_ready, 1);
    let own = s.counts(Some(DEFAULT_TENANT)).unwrap();
    assert_eq!(own.sandboxes_by_state.get("running"), Some(&1));
    let other = s.counts(Some("acme")).unwrap();
    assert!(other.sandboxes_by_state.is_empty(), "{other:?}");
    assert_eq!(other.templates_ready, 0, "another tenant's template");
    assert_eq!(s.all_templates().unwrap().len(), 1);
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
fn tenant_usage_and_snapshot_charges() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
    // Writing the snapshot record again keeps its charge.
    s.put_snapshot(&s1).unwrap();
    assert_eq!(
        s.get_snapshot(&s1.id).unwrap().unwrap().charge_bytes,
        Some(7)
    );
}

#[test]
fn sandbox_env_survives_reopen_and_goes_with_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let a = sandbox(1, SandboxState::Running);
    let b = sandbox(2, SandboxState::Running);
    // The store keeps what the service sealed, opaque.
    let env = "sealed:v1:AAAA".to_string();
    {
        let s = open(&dir);
        s.insert_sandbox(&a, &created(&a)).unwrap();
        s.insert_sandbox(&b, &created(&b)).unwrap();
        s.put_sandbox_env(&a.id, Some(&env)).unwrap();
        s.put_sandbox_env(&b.id, Some(&env)).unwrap();
        // An unknown sandbox keeps nothing.
        let ghost: SandboxId = "sb-ghost".parse().unwrap();
        s.put_sandbox_env(&ghost, Some(&env)).unwrap();
    }
    // A restart (a new store on the same file) reads them back.
    let s = open(&dir);
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
    let n: i64 = s
        .reader()
        .query_row("SELECT count(*) FROM sandbox_env", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0);
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
fn sandbox_settings_are_per_key_survive_reopen_and_go_with_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let a = sandbox(1, SandboxState::Running);
    let b = sandbox(2, SandboxState::Running);
    {
        let s = open(&dir);
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
    let s = open(&dir);
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
    let n: i64 = s
        .reader()
        .query_row("SELECT count(*) FROM sandbox_settings", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0);
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
fn the_journal_keeps_every_kind_in_one_order_and_only_retention_prunes_it() {
    use crate::store::{JournalKind, JournalNote};
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir);
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
    // The transition list of the sandbox is unchanged: transitions only.
    assert_eq!(s.events(&rec.id, 10).unwrap().len(), 1);
    assert!(s.journal_after("other", None, 0, 100).unwrap().is_empty());
    // Deletes stay refused outside retention; retention prunes by age.
    assert!(s.writer().execute("DELETE FROM events", []).is_err());
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
}
