//! A move whose adopt call was lost (docs/move.md "Inside a cluster",
//! docs/cluster.md "Moving a sandbox: a lost adopt call").
//!
//! A move hands the sandbox's lease over in PostgreSQL (the target's id
//! and a new, larger token), then calls the target's adopt route. When that
//! call never arrives (the source died or the network dropped after the
//! handover committed), the target would never renew the lease, and the
//! host-loss watchers would mark the sandbox `host_lost` at its expiry
//! although the target holds everything it needs.
//!
//! Contract:
//! - Every `renew_every` (a task beside the renewal loop, so a slow pass
//!   never delays a renewal), a host that is not fenced lists the leases
//!   PostgreSQL names it as holder of that are unexpired but expire within
//!   half the TTL ([`crate::store::HostStore::unrenewed_leases`], at most [`PER_ROUND`]):
//!   nobody renewed them for half the TTL, so the source's own adopt call
//!   had that long first.
//! - It takes one up only when [`decide`] allows: this host does not hold
//!   it yet, the record is `hibernated`, and its newest ready snapshot is in
//!   this host's pool (received by the move). Then
//!   `Service::take_up_move` does what the adopt route does (a renewal of
//!   the handed-over token in PostgreSQL, a compare-and-set that fails once
//!   it expired; the lease held; the move journaled), with the reason that
//!   the adopt call was not received; counted as
//!   `cluster_move_adopted_unasked`. It does not wake the sandbox (the
//!   source's `wake` travelled in the lost call): its next exec, file call
//!   or resume does.
//! - Fencing is the handover's: the token is the one the handover granted
//!   (larger than the source's), so the source's writes stay refused; a
//!   late adopt call of the source finds the lease held and answers the
//!   sandbox without a second take-up.
//! - The source, its adopt call lost, tells its caller the truth: it
//!   waits (at most the lease's TTL and a second, [`confirm_within`]) until
//!   PostgreSQL shows the target holding the renewed handed-over lease
//!   ([`confirmation`]), then answers the move done (`adoption:
//!   "taken_up"`); otherwise `202` with `adoption: "unconfirmed"`.

use std::sync::Arc;
use std::time::Duration;

use strata_core::{SandboxState, SnapshotId};
use tokio::sync::watch;
use tracing::warn;

use super::{ms, Cluster};
use crate::service::Service;
use crate::store::OwnerLease;

/// Handed-over leases looked at per round.
pub const PER_ROUND: usize = 16;

/// How long before its expiry an unrenewed lease of this host is taken up:
/// half the TTL (the source's adopt call has the first half).
pub fn take_up_within(lease_ttl: Duration) -> Duration {
    lease_ttl / 2
}

/// What the pass found about one unrenewed lease of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// This host holds the lease already (renews it).
    pub held: bool,
    /// The record's state; `None`: no record, or deleted.
    pub state: Option<SandboxState>,
    /// The snapshot it wakes from (the newest ready one), and whether it
    /// is in this host's pool; `None`: it has no ready snapshot.
    pub newest: Option<(SnapshotId, bool)>,
}

/// Why an unrenewed lease is left alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Leave {
    /// This host holds it: nothing to take up.
    #[error("held already")]
    Held,
    /// No record, or a deleted one.
    #[error("no live record")]
    Gone,
    /// Only a hibernated sandbox is handed over.
    #[error("it is {0}, not hibernated")]
    NotHibernated(SandboxState),
    /// Nothing to wake it from.
    #[error("it has no ready snapshot")]
    NoSnapshot,
    /// Its newest snapshot did not arrive here.
    #[error("its newest snapshot {0} is not in this host's pool")]
    SnapshotNotHere(SnapshotId),
}

/// Whether an unrenewed lease of this host (past half its TTL, unexpired:
/// the query's window) is taken up; see the module docs.
pub fn decide(seen: &Seen) -> Result<(), Leave> {
    if seen.held {
        return Err(Leave::Held);
    }
    match seen.state {
        None => return Err(Leave::Gone),
        Some(SandboxState::Hibernated) => {}
        Some(s) => return Err(Leave::NotHibernated(s)),
    }
    match &seen.newest {
        None => Err(Leave::NoSnapshot),
        Some((s, false)) => Err(Leave::SnapshotNotHere(s.clone())),
        Some((_, true)) => Ok(()),
    }
}

/// What the source of a move whose adopt call was lost reads in
/// PostgreSQL about the lease it handed over (it waits for the target's
/// take-up before it answers its caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmation {
    /// The target holds it: same host, same token, renewed past the
    /// handover's expiry (only the holder renews; its take-up renews).
    TakenUp,
    /// Still as handed over, unrenewed: the target may take it up yet.
    Pending,
    /// No longer the handed-over lease (another token or host, or none):
    /// waiting longer tells nothing.
    Gone,
}

/// Whether `now` (the sandbox's lease as PostgreSQL holds it) shows the
/// lease `handed` over by a move taken up by its new holder.
pub fn confirmation(handed: &OwnerLease, now: Option<&OwnerLease>) -> Confirmation {
    match now {
        Some(l) if l.host_id == handed.host_id && l.token == handed.token => {
            if l.expires_at > handed.expires_at {
                Confirmation::TakenUp
            } else {
                Confirmation::Pending
            }
        }
        _ => Confirmation::Gone,
    }
}

/// How long the source of a move whose adopt call was lost waits for the
/// target's take-up before it answers: the handed-over lease's TTL and a
/// second (the take-up happens after half the TTL, within a `renew_every`;
/// past the expiry it can no longer happen).
pub fn confirm_within(lease_ttl: Duration) -> Duration {
    lease_ttl + Duration::from_secs(1)
}

impl Cluster {
    /// Waits (at most [`confirm_within`] from `since`, the handover) until
    /// PostgreSQL shows the lease `handed` over by a move taken up by its
    /// new holder ([`confirmation`]); answers the last reading
    /// ([`Confirmation::Pending`] when the bound passed). Store errors
    /// meanwhile are logged and read again.
    pub(crate) async fn wait_taken_up(
        &self,
        handed: &OwnerLease,
        since: std::time::Instant,
    ) -> Confirmation {
        let until = since + confirm_within(self.cfg.lease_ttl);
        loop {
            let id = handed.sandbox_id.clone();
            match self.blocking(move |h| h.sandbox_owner(&id)).await {
                Ok(now) => match confirmation(handed, now.as_ref()) {
                    Confirmation::Pending => {}
                    c => return c,
                },
                Err(e) => {
                    warn!(sandbox = %handed.sandbox_id, error = %e, "reading a handed-over lease")
                }
            }
            if std::time::Instant::now() >= until {
                return Confirmation::Pending;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The leases PostgreSQL names this host as holder of that nobody
    /// renewed for half the TTL (see the module docs).
    pub(crate) async fn unrenewed(&self) -> Result<Vec<OwnerLease>, crate::store::HostError> {
        let (me, within) = (self.info.id.clone(), ms(take_up_within(self.cfg.lease_ttl)));
        self.blocking(move |h| h.unrenewed_leases(&me, within, PER_ROUND))
            .await
    }

    /// One pass: takes up what [`decide`] allows. Returns how many.
    pub async fn take_up_round(&self, svc: &Arc<Service>) -> usize {
        if self.fenced.load(std::sync::atomic::Ordering::SeqCst) {
            return 0;
        }
        let leases = match self.unrenewed().await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %e, "cannot list this host's unrenewed leases");
                return 0;
            }
        };
        let mut n = 0;
        for l in leases {
            if self.leases.get(&l.sandbox_id).is_some() {
                continue;
            }
            match svc.take_up_unasked(&l).await {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    warn!(sandbox = %l.sandbox_id, error = %e.message(), "taking up a handed-over lease failed")
                }
            }
        }
        n
    }

    pub(super) async fn take_up_loop(
        self: Arc<Self>,
        svc: Arc<Service>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.renew_every) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            self.take_up_round(&svc).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> SnapshotId {
        "snap-0123456789abcdef".parse().expect("snapshot id")
    }

    fn seen() -> Seen {
        Seen {
            held: false,
            state: Some(SandboxState::Hibernated),
            newest: Some((snap(), true)),
        }
    }

    #[test]
    fn a_hibernated_sandbox_not_held_whose_newest_snapshot_is_here_is_taken_up() {
        assert_eq!(decide(&seen()), Ok(()));
    }

    #[test]
    fn held_gone_awake_or_without_its_snapshot_here_is_left_alone() {
        let held = Seen {
            held: true,
            ..seen()
        };
        assert_eq!(decide(&held), Err(Leave::Held));
        let gone = Seen {
            state: None,
            ..seen()
        };
        assert_eq!(decide(&gone), Err(Leave::Gone));
        for s in [
            SandboxState::Running,
            SandboxState::Paused,
            SandboxState::Failed,
            SandboxState::Creating,
        ] {
            let st = Seen {
                state: Some(s),
                ..seen()
            };
            assert_eq!(decide(&st), Err(Leave::NotHibernated(s)));
        }
        let none = Seen {
            newest: None,
            ..seen()
        };
        assert_eq!(decide(&none), Err(Leave::NoSnapshot));
        let elsewhere = Seen {
            newest: Some((snap(), false)),
            ..seen()
        };
        assert_eq!(decide(&elsewhere), Err(Leave::SnapshotNotHere(snap())));
        // Held wins over everything else (no store read needed).
        let held_awake = Seen {
            held: true,
            state: Some(SandboxState::Running),
            newest: None,
        };
        assert_eq!(decide(&held_awake), Err(Leave::Held));
    }

    /// On a real PostgreSQL (`STRATA_TEST_PG_URL`): only this host's
    /// unexpired leases within the window are listed: a handed-over one
    /// nobody renewed, not a freshly renewed one, not an expired one, not
    /// another host's.
    #[test]
    fn unrenewed_leases_are_this_hosts_unexpired_ones_within_the_window() {
        use crate::store::tests::TestDb;
        use crate::store::{Fence, HostInfo, HostLoad, HostStore, PgStore};
        let Some(db) = TestDb::postgres("cluster_unrenewed_leases") else {
            eprintln!("skipped on PostgreSQL: STRATA_TEST_PG_URL is not set");
            return;
        };
        let pg = PgStore::open(&db.pg_options().expect("pg")).expect("open");
        for h in ["host-a", "host-b"] {
            let info = HostInfo {
                id: h.into(),
                address: format!("http://{h}.test:7070"),
                accel: "tcg".into(),
                qemu_version: "9.2".into(),
                cpu_model: "test".into(),
                capacity: HostLoad::default(),
            };
            pg.register_host(&info, 60_000).expect("register");
        }
        let sb = |i: u32| -> strata_core::SandboxId {
            format!("sb-{i:016x}").parse().expect("sandbox id")
        };
        // host-b: a lease it renews (a full TTL ahead), one expired.
        pg.acquire_sandbox(&sb(1), "host-b", 60_000, 0)
            .expect("acquire");
        pg.acquire_sandbox(&sb(2), "host-b", 1, 0).expect("acquire");
        // host-a: one of its own within the window (not host-b's business).
        pg.acquire_sandbox(&sb(3), "host-a", 20_000, 0)
            .expect("acquire");
        // host-a moves two sandboxes to host-b: the handover grants a lease
        // host-b has not renewed yet.
        let mut handed = Vec::new();
        for i in [4, 5] {
            let l = pg
                .acquire_sandbox(&sb(i), "host-a", 60_000, 0)
                .expect("acquire");
            let f = Fence {
                host_id: "host-a".into(),
                token: l.token,
            };
            let moved = pg
                .hand_over_sandbox(&sb(i), &f, "host-b", 20_000)
                .expect("hand over");
            assert!(moved.token > l.token);
            handed.push(moved);
        }
        std::thread::sleep(Duration::from_millis(20));
        let mut got = pg.unrenewed_leases("host-b", 30_000, 16).expect("list");
        got.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        assert_eq!(got, handed, "only the handed-over ones");
        assert_eq!(
            pg.unrenewed_leases("host-b", 30_000, 1)
                .expect("list")
                .len(),
            1
        );
        // Not yet half-way (a window shorter than what is left): none.
        assert!(pg
            .unrenewed_leases("host-b", 10_000, 16)
            .expect("list")
            .is_empty());
        // Renewed by host-b (taken up): out of the window.
        let f = Fence {
            host_id: "host-b".into(),
            token: handed[0].token,
        };
        pg.renew_sandbox(&sb(4), &f, 60_000).expect("renew");
        let got = pg.unrenewed_leases("host-b", 30_000, 16).expect("list");
        assert_eq!(got, vec![handed[1].clone()]);
        assert_eq!(
            pg.unrenewed_leases("host-a", 30_000, 16)
                .expect("list")
                .len(),
            1,
            "host-a's own unrenewed lease"
        );
    }

    #[test]
    fn a_handed_over_lease_is_confirmed_once_its_holder_renewed_it() {
        let at = |s: i64| chrono::DateTime::from_timestamp(1_700_000_000 + s, 0).expect("time");
        let handed = OwnerLease {
            sandbox_id: "sb-0123456789abcdef".parse().expect("sandbox id"),
            host_id: "host-b".into(),
            token: 42,
            expires_at: at(15),
        };
        let with = |host: &str, token: u64, exp: i64| OwnerLease {
            host_id: host.into(),
            token,
            expires_at: at(exp),
            ..handed.clone()
        };
        assert_eq!(confirmation(&handed, Some(&handed)), Confirmation::Pending);
        assert_eq!(
            confirmation(&handed, Some(&with("host-b", 42, 22))),
            Confirmation::TakenUp
        );
        // Another token (taken over past its expiry), another host, none.
        assert_eq!(
            confirmation(&handed, Some(&with("host-b", 43, 40))),
            Confirmation::Gone
        );
        assert_eq!(
            confirmation(&handed, Some(&with("host-c", 42, 40))),
            Confirmation::Gone
        );
        assert_eq!(confirmation(&handed, None), Confirmation::Gone);
        assert_eq!(
            confirm_within(Duration::from_secs(15)),
            Duration::from_secs(16)
        );
    }

    #[test]
    fn the_source_gets_the_first_half_of_the_ttl() {
        assert_eq!(
            take_up_within(Duration::from_secs(15)),
            Duration::from_millis(7500)
        );
        assert_eq!(
            take_up_within(Duration::from_secs(6)),
            Duration::from_secs(3)
        );
    }
}
