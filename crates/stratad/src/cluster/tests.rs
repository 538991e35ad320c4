//! The fenced store on a real PostgreSQL: two hosts, one sandbox; only the
//! lease holder writes; after expiry plus the margin another host takes it
//! over and the old owner's writes change nothing. Skipped with a line
//! without `STRATA_TEST_PG_URL`.

use std::sync::Arc;
use std::time::Duration;

use strata_core::SandboxState;

use super::*;
use crate::store::tests::{created, sandbox, snap, TestDb};
use crate::store::SnapshotStatus;

fn host(
    db: &TestDb,
    id: &str,
    ttl_ms: u64,
    margin_ms: u64,
) -> (Arc<PgStore>, FencedStore<PgStore>) {
    let pg = Arc::new(PgStore::open(&db.pg_options().unwrap()).unwrap());
    let leases = Arc::new(Leases::new(id));
    let f = FencedStore::new(pg.clone(), leases, ttl_ms, margin_ms);
    (pg, f)
}

#[test]
fn only_the_lease_holder_writes_and_a_stale_owner_changes_nothing() {
    let Some(db) = TestDb::postgres("cluster_fenced_store") else {
        eprintln!("skipped on PostgreSQL: STRATA_TEST_PG_URL is not set");
        return;
    };
    let (pg, a) = host(&db, "host-a", 1500, 300);
    let (_pgb, b) = host(&db, "host-b", 60_000, 300);
    let mut rec = sandbox(1, SandboxState::Running);
    a.insert_sandbox(&rec, &created(&rec)).unwrap();
    let lease = pg.sandbox_owner(&rec.id).unwrap().unwrap();
    assert_eq!(lease.host_id, "host-a");
    assert_eq!(a.leases().get(&rec.id).map(|h| h.token), Some(lease.token));
    // The owner's lists see it; the other host's do not (recovery, GC,
    // admission act only on their own).
    assert_eq!(a.live_sandboxes().unwrap().len(), 1);
    assert!(b.live_sandboxes().unwrap().is_empty());
    assert_eq!(a.reserved_capacity().unwrap().0, u64::from(rec.size.vcpus));
    assert_eq!(b.reserved_capacity().unwrap(), (0, 0));
    // Host B cannot write it: refused before the database, nothing changed.
    let mut theirs = rec.clone();
    theirs.state = SandboxState::Paused;
    match b.update_sandbox(&theirs, None) {
        Err(StoreError::Fenced { sandbox, host, why }) => {
            assert_eq!(
                (sandbox.as_str(), host.as_str()),
                (rec.id.as_str(), "host-b")
            );
            assert!(why.contains("owned by host host-a"), "{why}");
        }
        other => panic!("expected Fenced, got {other:?}"),
    }
    let s = snap(1, &rec.id, 5, SnapshotStatus::Ready);
    assert!(matches!(b.put_snapshot(&s), Err(StoreError::Fenced { .. })));
    assert!(pg.get_snapshot(&s.id).unwrap().is_none());
    // The owner writes.
    rec.state = SandboxState::Paused;
    a.update_sandbox(&rec, None).unwrap();
    rec.version += 1;
    a.put_snapshot(&s).unwrap();
    // Host A goes quiet: its lease expires; B may not take it before the margin.
    std::thread::sleep(Duration::from_millis(1600));
    assert!(matches!(
        pg.acquire_sandbox(&rec.id, "host-b", 60_000, 60_000),
        Err(HostError::Owned { .. })
    ));
    std::thread::sleep(Duration::from_millis(400));
    let taken = pg.acquire_sandbox(&rec.id, "host-b", 60_000, 300).unwrap();
    assert!(taken.token > lease.token);
    b.leases().hold(rec.id.clone(), taken.token, true);
    // The old owner's write is fenced in the database and changes nothing;
    // its lease is noted lost (its VM must stop).
    let before = pg.get_sandbox(&rec.id).unwrap().unwrap();
    let mut stale = rec.clone();
    stale.state = SandboxState::Running;
    match a.update_sandbox(&stale, None) {
        Err(StoreError::Fenced { why, .. }) => assert!(why.contains("host-b"), "{why}"),
        other => panic!("expected Fenced, got {other:?}"),
    }
    assert_eq!(pg.get_sandbox(&rec.id).unwrap().unwrap(), before);
    assert_eq!(a.leases().take_lost(), vec![rec.id.clone()]);
    assert!(a.leases().get(&rec.id).is_none());
    // Custody: B writes it, but does not list it as its own to run.
    let mut lost = before.clone();
    lost.state = SandboxState::Failed;
    lost.state_reason = Some(format!("{HOST_LOST}: test"));
    b.update_sandbox(&lost, None).unwrap();
    assert!(is_host_lost(&pg.get_sandbox(&rec.id).unwrap().unwrap()));
    assert!(b.live_sandboxes().unwrap().is_empty());
    // A deleted sandbox's lease is released with the write.
    lost.version += 1;
    lost.state = SandboxState::Deleted;
    b.update_sandbox(&lost, None).unwrap();
    assert!(pg.sandbox_owner(&rec.id).unwrap().is_none());
    assert!(b.leases().get(&rec.id).is_none());
}

#[test]
fn expired_leases_are_listed_past_the_margin_but_not_the_watchers_own() {
    let Some(db) = TestDb::postgres("cluster_expired_leases") else {
        eprintln!("skipped on PostgreSQL: STRATA_TEST_PG_URL is not set");
        return;
    };
    let (pg, a) = host(&db, "host-a", 1000, 0);
    let (_p, b) = host(&db, "host-b", 60_000, 0);
    for i in 0..3 {
        let r = sandbox(i, SandboxState::Running);
        a.insert_sandbox(&r, &created(&r)).unwrap();
    }
    let r = sandbox(9, SandboxState::Running);
    b.insert_sandbox(&r, &created(&r)).unwrap();
    assert!(pg.expired_leases("host-b", 0, 100).unwrap().is_empty());
    std::thread::sleep(Duration::from_millis(1100));
    assert!(pg.expired_leases("host-b", 60_000, 100).unwrap().is_empty());
    let e = pg.expired_leases("host-b", 0, 100).unwrap();
    assert_eq!(e.len(), 3);
    assert!(e.iter().all(|l| l.host_id == "host-a"));
    assert!(pg.expired_leases("host-a", 0, 100).unwrap().is_empty());
    assert_eq!(pg.expired_leases("host-b", 0, 2).unwrap().len(), 2);
    assert_eq!(pg.host_leases("host-a").unwrap().len(), 3);
}

fn info(id: &str) -> HostInfo {
    HostInfo {
        id: id.into(),
        address: format!("http://{id}.test:7070"),
        accel: "tcg".into(),
        qemu_version: "9.2".into(),
        cpu_model: "test".into(),
        capacity: HostLoad {
            vcpus: 4,
            memory_mib: 4096,
            pool_bytes: 1 << 30,
        },
    }
}

#[test]
fn a_move_hands_the_lease_over_only_with_the_current_token_and_to_a_live_host() {
    let Some(db) = TestDb::postgres("cluster_hand_over") else {
        eprintln!("skipped on PostgreSQL: STRATA_TEST_PG_URL is not set");
        return;
    };
    let (pg, a) = host(&db, "host-a", 60_000, 300);
    let (_pgb, b) = host(&db, "host-b", 60_000, 300);
    pg.register_host(&info("host-a"), 60_000).unwrap();
    pg.register_host(&info("host-b"), 60_000).unwrap();
    // host-c registered once and went quiet (its registration expired).
    pg.register_host(&info("host-c"), 1).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let mut rec = sandbox(1, SandboxState::Hibernated);
    a.insert_sandbox(&rec, &created(&rec)).unwrap();
    let lease = pg.sandbox_owner(&rec.id).unwrap().unwrap();
    let fence = |token| Fence {
        host_id: "host-a".into(),
        token,
    };
    // A stale token (an older grant), another host's claim, a dead or
    // unknown target: refused, the lease unchanged.
    for (f, to) in [
        (fence(lease.token - 1), "host-b"),
        (
            Fence {
                host_id: "host-b".into(),
                token: lease.token,
            },
            "host-b",
        ),
        (fence(lease.token), "host-c"),
        (fence(lease.token), "host-nowhere"),
    ] {
        match pg.hand_over_sandbox(&rec.id, &f, to, 60_000) {
            Err(HostError::Fenced { .. }) => {}
            other => panic!("{f:?} to {to}: expected Fenced, got {other:?}"),
        }
        assert_eq!(pg.sandbox_owner(&rec.id).unwrap().unwrap(), lease);
    }
    // The owner with its token: host-b holds it now, with a larger token;
    // the shared record is the same one.
    let moved = pg
        .hand_over_sandbox(&rec.id, &fence(lease.token), "host-b", 60_000)
        .unwrap();
    assert_eq!(moved.host_id, "host-b");
    assert!(
        moved.token > lease.token,
        "{} after {}",
        moved.token,
        lease.token
    );
    assert_eq!(pg.sandbox_owner(&rec.id).unwrap().unwrap(), moved);
    // The same handover again (a retry with the old token) is refused.
    assert!(matches!(
        pg.hand_over_sandbox(&rec.id, &fence(lease.token), "host-b", 60_000),
        Err(HostError::Fenced { .. })
    ));
    // The old owner's writes are fenced in the database; the new one's go.
    let before = pg.get_sandbox(&rec.id).unwrap().unwrap();
    let mut stale = rec.clone();
    stale.state = SandboxState::Running;
    assert!(matches!(
        a.update_sandbox(&stale, None),
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(pg.get_sandbox(&rec.id).unwrap().unwrap(), before);
    b.leases().hold(rec.id.clone(), moved.token, false);
    rec.state_reason = Some("moved".into());
    b.update_sandbox(&rec, None).unwrap();
    // The target's recovery lists see it now, the old owner's do not.
    assert_eq!(b.live_sandboxes().unwrap().len(), 1);
    assert!(a.live_sandboxes().unwrap().is_empty());
    assert_eq!(
        pg.list_sandboxes(&SandboxFilter {
            tenant: rec.tenant.clone(),
            states: Vec::new(),
            labels: Default::default(),
            limit: 10,
            cursor: None,
        })
        .unwrap()
        .items
        .len(),
        1,
        "one record, not a second"
    );
}
