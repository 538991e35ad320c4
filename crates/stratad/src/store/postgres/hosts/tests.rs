//! Hosts, heartbeats, owner leases and fencing on a real PostgreSQL
//! (skipped with a line without `STRATA_TEST_PG_URL`).

use std::time::Duration;

use strata_core::SandboxState;

use super::*;
use crate::store::tests::{created, sandbox, TestDb};

fn host(id: &str) -> HostInfo {
    HostInfo {
        id: id.into(),
        address: format!("10.0.0.{}:7070", id.len()),
        accel: "tcg".into(),
        qemu_version: "7.2.0".into(),
        cpu_model: "qemu64".into(),
        capacity: HostLoad {
            vcpus: 8,
            memory_mib: 16384,
            pool_bytes: 1 << 40,
        },
    }
}

fn open(test: &str) -> Option<(TestDb, PgStore)> {
    let db = TestDb::postgres(test)?;
    let s = PgStore::open(&db.pg_options().unwrap()).unwrap();
    Some((db, s))
}

#[test]
fn hosts_register_heartbeat_and_a_newer_registration_fences_the_old_process() {
    let Some((_db, s)) = open("hosts_register_heartbeat") else {
        return;
    };
    let a = s.register_host(&host("host-a"), 60_000).unwrap();
    let b = s.register_host(&host("host-b"), 60_000).unwrap();
    assert_eq!((a.epoch, b.epoch), (1, 1));
    let free = HostLoad {
        vcpus: 6,
        memory_mib: 8000,
        pool_bytes: 1 << 39,
    };
    let beat = s.heartbeat("host-a", a.epoch, &free, 60_000).unwrap();
    assert!(beat.until >= a.until);
    let hs = s.hosts().unwrap();
    assert_eq!(hs.len(), 2);
    assert_eq!(hs[0].info, host("host-a"));
    assert_eq!(hs[0].free, free);
    assert!(hs.iter().all(|h| h.alive));
    // host-a restarts (a new registration); the old process's heartbeat
    // is refused.
    let a2 = s.register_host(&host("host-a"), 60_000).unwrap();
    assert_eq!(a2.epoch, 2);
    assert!(matches!(
        s.heartbeat("host-a", a.epoch, &free, 60_000),
        Err(HostError::NotRegistered { epoch: 1, .. })
    ));
    s.heartbeat("host-a", a2.epoch, &free, 60_000).unwrap();
    assert!(matches!(
        s.heartbeat("host-z", 1, &free, 60_000),
        Err(HostError::NotRegistered { .. })
    ));
    // A host that stops heartbeating is not alive once its lease passes
    // (the database's clock decides).
    s.heartbeat("host-b", b.epoch, &free, 1).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let hs = s.hosts().unwrap();
    assert!(hs.iter().find(|h| h.info.id == "host-a").unwrap().alive);
    assert!(!hs.iter().find(|h| h.info.id == "host-b").unwrap().alive);
}

/// The owner acts; another host is refused while the lease holds and
/// takes over only after expiry plus the margin, with a larger token; the
/// old owner (revived) can neither renew nor write, and its refused write
/// changes nothing.
#[test]
fn a_stale_owners_writes_are_fenced() {
    let Some((db, s)) = open("a_stale_owners_writes_are_fenced") else {
        return;
    };
    // Two hosts: two stores (two processes) on one database.
    let other = PgStore::open(&db.pg_options().unwrap()).unwrap();
    let rec = sandbox(1, SandboxState::Running);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();

    let la = s.acquire_sandbox(&rec.id, "host-a", 400, 300).unwrap();
    let fa = Fence {
        host_id: "host-a".into(),
        token: la.token,
    };
    // Renewal by the holder keeps the token.
    let again = s.acquire_sandbox(&rec.id, "host-a", 400, 300).unwrap();
    assert_eq!(again.token, la.token);
    match other.acquire_sandbox(&rec.id, "host-b", 60_000, 300) {
        Err(HostError::Owned { owner, .. }) => assert_eq!(owner, "host-a"),
        r => panic!("expected Owned, got {r:?}"),
    }
    // The owner writes.
    let mut cur = s.get_sandbox(&rec.id).unwrap().unwrap();
    cur.state = SandboxState::Paused;
    s.commit_fenced(&fa, &[&cur], &[], None).unwrap();

    // host-a goes quiet: its lease expires; within the margin host-b still
    // waits, after it takes over with a larger token.
    std::thread::sleep(Duration::from_millis(500));
    assert!(matches!(
        other.acquire_sandbox(&rec.id, "host-b", 60_000, 300),
        Err(HostError::Owned { .. })
    ));
    std::thread::sleep(Duration::from_millis(300));
    let lb = other
        .acquire_sandbox(&rec.id, "host-b", 60_000, 300)
        .unwrap();
    assert!(lb.token > la.token, "{} !> {}", lb.token, la.token);
    assert_eq!(s.sandbox_owner(&rec.id).unwrap().unwrap().host_id, "host-b");

    // host-a revives with its old copy and its old token: refused.
    let mut stale = s.get_sandbox(&rec.id).unwrap().unwrap();
    stale.state = SandboxState::Running;
    match s.commit_fenced(&fa, &[&stale], &[], None) {
        Err(HostError::Fenced { token, .. }) => assert_eq!(token, la.token),
        r => panic!("expected Fenced, got {r:?}"),
    }
    assert!(matches!(
        s.renew_sandbox(&rec.id, &fa, 60_000),
        Err(HostError::Fenced { .. })
    ));
    assert!(!s.release_sandbox(&rec.id, &fa).unwrap());
    let now = s.get_sandbox(&rec.id).unwrap().unwrap();
    assert_eq!(
        (now.state, now.version),
        (SandboxState::Paused, 1),
        "the refused write changed nothing"
    );
    // The new owner's write lands (and the version compare-and-set still
    // applies under the fence).
    let fb = Fence {
        host_id: "host-b".into(),
        token: lb.token,
    };
    let mut cur = other.get_sandbox(&rec.id).unwrap().unwrap();
    cur.state = SandboxState::Hibernated;
    other.commit_fenced(&fb, &[&cur], &[], None).unwrap();
    assert!(matches!(
        other.commit_fenced(&fb, &[&cur], &[], None),
        Err(HostError::Store(StoreError::Stale { .. }))
    ));
    assert_eq!(
        other.renew_sandbox(&rec.id, &fb, 60_000).unwrap().token,
        lb.token
    );
    assert!(other.release_sandbox(&rec.id, &fb).unwrap());
    assert!(s.sandbox_owner(&rec.id).unwrap().is_none());
    // A write without a lease is fenced too.
    let mut cur = s.get_sandbox(&rec.id).unwrap().unwrap();
    cur.state = SandboxState::Running;
    assert!(matches!(
        s.commit_fenced(&fb, &[&cur], &[], None),
        Err(HostError::Fenced { .. })
    ));
}

/// A fork writes its parent and its child in one commit, each held under
/// its own lease (two tokens): the write lands when both are this host's,
/// and is refused whole when either is not.
#[test]
fn a_write_spanning_two_leases_of_one_host_is_fenced_per_sandbox() {
    let Some((_db, s)) = open("a_write_spanning_two_leases") else {
        return;
    };
    let parent = sandbox(1, SandboxState::Running);
    let child = sandbox(2, SandboxState::Running);
    for r in [&parent, &child] {
        s.insert_sandbox(r, &created(r)).unwrap();
    }
    let lp = s
        .acquire_sandbox(&parent.id, "host-a", 60_000, 300)
        .unwrap();
    let lc = s.acquire_sandbox(&child.id, "host-a", 60_000, 300).unwrap();
    assert_ne!(lp.token, lc.token, "two leases, two tokens");
    let tokens = |p: u64, c: u64| {
        std::collections::BTreeMap::from([(parent.id.to_string(), p), (child.id.to_string(), c)])
    };
    let mut p = s.get_sandbox(&parent.id).unwrap().unwrap();
    let mut c = s.get_sandbox(&child.id).unwrap().unwrap();
    p.state = SandboxState::Paused;
    c.state = SandboxState::Paused;
    // One token for both (what a single fence could say) is refused whole.
    match s.commit_fenced_each("host-a", &tokens(lp.token, lp.token), &[&p, &c], &[], None) {
        Err(HostError::Fenced { sandbox, .. }) => assert_eq!(sandbox, child.id.to_string()),
        r => panic!("expected Fenced, got {r:?}"),
    }
    assert_eq!(
        s.get_sandbox(&parent.id).unwrap().unwrap().state,
        SandboxState::Running,
        "a refused write changes nothing"
    );
    s.commit_fenced_each("host-a", &tokens(lp.token, lc.token), &[&p, &c], &[], None)
        .unwrap();
    assert_eq!(
        s.get_sandbox(&parent.id).unwrap().unwrap().state,
        SandboxState::Paused
    );
    assert_eq!(
        s.get_sandbox(&child.id).unwrap().unwrap().state,
        SandboxState::Paused
    );
    // Another host's name with the right tokens is refused too.
    let mut p2 = s.get_sandbox(&parent.id).unwrap().unwrap();
    p2.state = SandboxState::Running;
    assert!(matches!(
        s.commit_fenced_each("host-b", &tokens(lp.token, lc.token), &[&p2], &[], None),
        Err(HostError::Fenced { .. })
    ));
}

/// Many hosts race for one free sandbox: exactly one gets it.
#[test]
fn one_owner_when_hosts_race_for_a_free_sandbox() {
    let Some((db, s)) = open("one_owner_when_hosts_race") else {
        return;
    };
    let rec = sandbox(1, SandboxState::Hibernated);
    s.insert_sandbox(&rec, &created(&rec)).unwrap();
    let stores: Vec<PgStore> = (0..4)
        .map(|_| PgStore::open(&db.pg_options().unwrap()).unwrap())
        .collect();
    let won: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, st)| {
                let id = rec.id.clone();
                sc.spawn(move || {
                    st.acquire_sandbox(&id, &format!("host-{i}"), 60_000, 0)
                        .ok()
                        .map(|l| l.host_id)
                })
            })
            .collect();
        hs.into_iter().filter_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(won.len(), 1, "{won:?}");
    assert_eq!(s.sandbox_owner(&rec.id).unwrap().unwrap().host_id, won[0]);
}

#[test]
fn template_holders_are_recorded_per_host_once_and_forgotten() {
    let Some((_db, s)) = open("template_holders") else {
        return;
    };
    assert!(s.template_holders("tpl-web").unwrap().is_empty());
    s.add_template_holder("tpl-web", "host-b").unwrap();
    s.add_template_holder("tpl-web", "host-a").unwrap();
    // Idempotent: a host records a template it holds every round.
    s.add_template_holder("tpl-web", "host-a").unwrap();
    s.add_template_holder("tpl-default", "host-c").unwrap();
    assert_eq!(
        s.template_holders("tpl-web").unwrap(),
        vec!["host-a".to_owned(), "host-b".to_owned()]
    );
    assert_eq!(
        s.template_holders("tpl-default").unwrap(),
        vec!["host-c".to_owned()]
    );
    s.remove_template_holder("tpl-web", "host-a").unwrap();
    s.remove_template_holder("tpl-web", "host-a").unwrap();
    assert_eq!(
        s.template_holders("tpl-web").unwrap(),
        vec!["host-b".to_owned()]
    );
    // Another store on the same database (another host) sees the same rows.
    drop(s);
    let s2 = PgStore::open(&_db.pg_options().unwrap()).unwrap();
    assert_eq!(
        s2.template_holders("tpl-web").unwrap(),
        vec!["host-b".to_owned()]
    );
}

#[test]
fn replicas_are_one_row_per_sandbox_and_host_the_newest_snapshot_replacing_the_last() {
    let Some((_db, s)) = open("replicas") else {
        return;
    };
    let (rec, rec2) = (
        sandbox(1, SandboxState::Running),
        sandbox(2, SandboxState::Hibernated),
    );
    for r in [&rec, &rec2] {
        s.insert_sandbox(r, &created(r)).unwrap();
    }
    let (sb, other) = (rec.id.clone(), rec2.id.clone());
    assert!(s.replicas(&sb).unwrap().is_empty());
    s.put_replica(&sb, "host-b", "snap-1").unwrap();
    s.put_replica(&sb, "host-b", "snap-2").unwrap();
    s.put_replica(&other, "host-c", "snap-9").unwrap();
    let r = s.replicas(&sb).unwrap();
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(
        (r[0].host_id.as_str(), r[0].snapshot_id.as_str()),
        ("host-b", "snap-2")
    );
    assert!(r[0].held_since > 0);
    s.put_replica(&sb, "host-a", "snap-2").unwrap();
    let hosts: Vec<String> = s
        .replicas(&sb)
        .unwrap()
        .into_iter()
        .map(|r| r.host_id)
        .collect();
    assert_eq!(hosts, ["host-a", "host-b"]);
    s.remove_replica(&sb, "host-b").unwrap();
    s.remove_replica(&sb, "host-b").unwrap();
    let hosts: Vec<String> = s
        .replicas(&sb)
        .unwrap()
        .into_iter()
        .map(|r| r.host_id)
        .collect();
    assert_eq!(hosts, ["host-a"]);
    assert_eq!(s.replicas(&other).unwrap()[0].snapshot_id, "snap-9");
    assert_eq!(s.host_replicas("host-a").unwrap(), ["snap-2"]);
    assert_eq!(s.host_replicas("host-c").unwrap(), ["snap-9"]);
    assert!(s.host_replicas("host-b").unwrap().is_empty());
    // A deleted sandbox's replica is no longer one to keep (its host's
    // recovery removes it as an orphan).
    let mut gone = s.get_sandbox(&other).unwrap().unwrap();
    gone.state = SandboxState::Deleted;
    s.update_sandbox(&gone, None).unwrap();
    assert!(s.host_replicas("host-c").unwrap().is_empty());
    assert_eq!(s.replicas(&other).unwrap().len(), 1);
}
