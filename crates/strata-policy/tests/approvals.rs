//! Approval queue: answers, timeouts, double answers, tenant isolation, persistence.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use strata_policy::approval::{
    ApprovalError, ApprovalQueue, ApprovalRequest, ApprovalStatus, ApprovalStore, Outcome,
    StoreError,
};
use strata_policy::{CallKind, Decision, Effect, ToolCall};

fn call(tenant: &str) -> ToolCall {
    ToolCall {
        tenant: tenant.into(),
        sandbox: Some("sb".into()),
        actor: "agent-token".into(),
        kind: CallKind::exec(vec!["curl".into(), "x".into()]),
    }
}

fn decision() -> Decision {
    Decision {
        effect: Effect::Approve,
        layer: None,
        rule_id: "r".into(),
        rule_index: Some(0),
        hard: false,
        reason: "network tools need a human".into(),
    }
}

#[tokio::test]
async fn approve_wakes_the_waiter() {
    let q = Arc::new(ApprovalQueue::new());
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(req.reason, "network tools need a human");
    assert_eq!(req.requested_by, "agent-token");
    let (q2, id) = (q.clone(), req.id.clone());
    let waiter = tokio::spawn(async move { q2.wait("acme", &id, Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(q.list("acme", true).len(), 1);
    q.answer("acme", &req.id, "alice", true)
        .unwrap_or_else(|e| panic!("{e}"));
    let out = waiter
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(&out, Outcome::Approved { by, .. } if by == "alice"),
        "{out:?}"
    );
    assert!(out.is_approved());
    assert!(q.list("acme", true).is_empty());
    assert_eq!(q.list("acme", false).len(), 1);
    // a second answer is a typed error, whatever it says
    for approve in [true, false] {
        match q.answer("acme", &req.id, "bob", approve) {
            Err(ApprovalError::AlreadyAnswered {
                status: ApprovalStatus::Approved { by, .. },
            }) => assert_eq!(by, "alice"),
            other => panic!("{other:?}"),
        }
    }
    // The waiter used the approval: waiting on it again answers at once,
    // refused (an approval runs its call once).
    assert!(q
        .get("acme", &req.id)
        .is_ok_and(|r| r.consumed_at.is_some()));
    assert!(matches!(
        q.wait("acme", &req.id, Duration::from_millis(1)).await,
        Err(ApprovalError::Used)
    ));
}

#[tokio::test]
async fn deny_wakes_the_waiter() {
    let q = Arc::new(ApprovalQueue::new());
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    let (q2, id) = (q.clone(), req.id.clone());
    let waiter = tokio::spawn(async move { q2.wait("acme", &id, Duration::from_secs(10)).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    q.answer("acme", &req.id, "alice", false)
        .unwrap_or_else(|e| panic!("{e}"));
    let out = waiter
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(out, Outcome::Denied { ref by, .. } if by == "alice"),
        "{out:?}"
    );
    assert!(!out.is_approved());
}

#[tokio::test]
async fn timeout_denies_for_good() {
    let q = ApprovalQueue::new();
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    let t0 = std::time::Instant::now();
    let out = q
        .wait("acme", &req.id, Duration::from_millis(100))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out, Outcome::TimedOut);
    assert!(t0.elapsed() >= Duration::from_millis(100));
    assert!(matches!(
        q.get("acme", &req.id).map(|r| r.status),
        Ok(ApprovalStatus::TimedOut { .. })
    ));
    assert!(matches!(
        q.answer("acme", &req.id, "alice", true),
        Err(ApprovalError::AlreadyAnswered {
            status: ApprovalStatus::TimedOut { .. }
        })
    ));
}

#[tokio::test]
async fn foreign_tenant_sees_nothing() {
    let q = ApprovalQueue::new();
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        q.get("evil", &req.id),
        Err(ApprovalError::NotFound)
    ));
    assert!(matches!(
        q.answer("evil", &req.id, "mallory", true),
        Err(ApprovalError::NotFound)
    ));
    assert!(matches!(
        q.wait("evil", &req.id, Duration::from_millis(1)).await,
        Err(ApprovalError::NotFound)
    ));
    assert!(matches!(
        q.get("acme", "no-such-id"),
        Err(ApprovalError::NotFound)
    ));
    assert!(q.list("evil", false).is_empty());
    // the foreign attempts changed nothing
    assert_eq!(
        q.get("acme", &req.id).map(|r| r.status).ok(),
        Some(ApprovalStatus::Pending)
    );
}

#[tokio::test]
async fn requester_cannot_self_approve() {
    let q = ApprovalQueue::new();
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        q.answer("acme", &req.id, "agent-token", true),
        Err(ApprovalError::SelfApproval)
    ));
    assert_eq!(
        q.get("acme", &req.id).map(|r| r.status).ok(),
        Some(ApprovalStatus::Pending)
    );
}

#[tokio::test]
async fn many_waiters_one_answer_race() {
    let q = Arc::new(ApprovalQueue::new());
    let req = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut waiters = Vec::new();
    for _ in 0..8 {
        let (q2, id) = (q.clone(), req.id.clone());
        waiters.push(tokio::spawn(async move {
            q2.wait("acme", &id, Duration::from_secs(10)).await
        }));
    }
    let mut answerers = Vec::new();
    for i in 0..8u32 {
        let (q2, id) = (q.clone(), req.id.clone());
        answerers.push(tokio::spawn(async move {
            q2.answer("acme", &id, &format!("ap{i}"), i.is_multiple_of(2))
        }));
    }
    let mut ok = 0;
    for a in answerers {
        match a.await.unwrap_or_else(|e| panic!("{e}")) {
            Ok(_) => ok += 1,
            Err(ApprovalError::AlreadyAnswered { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(ok, 1, "exactly one answer wins");
    let approved = matches!(
        q.get("acme", &req.id).map(|r| r.status),
        Ok(ApprovalStatus::Approved { .. })
    );
    let (mut runs, mut used, mut denied) = (0, 0, 0);
    for w in waiters {
        match w.await.unwrap_or_else(|e| panic!("{e}")) {
            Ok(o) if o.is_approved() => runs += 1,
            Ok(Outcome::Denied { .. }) => denied += 1,
            Err(ApprovalError::Used) => used += 1,
            other => panic!("{other:?}"),
        }
    }
    if approved {
        // One approval runs one call: one waiter has it, the others are refused.
        assert_eq!((runs, used, denied), (1, 7, 0));
    } else {
        assert_eq!(
            (runs, used, denied),
            (0, 0, 8),
            "all waiters see the denial"
        );
    }
}

#[derive(Default)]
struct MemStore {
    rows: Mutex<Vec<ApprovalRequest>>,
    fail: Mutex<bool>,
}

impl ApprovalStore for MemStore {
    fn insert(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        if *self.fail.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(StoreError("disk full".into()));
        }
        self.rows
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(req.clone());
        Ok(())
    }
    fn update(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        if *self.fail.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(StoreError("disk full".into()));
        }
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = rows.iter_mut().find(|r| r.id == req.id) {
            *r = req.clone();
        }
        Ok(())
    }
    fn load(&self) -> Result<Vec<ApprovalRequest>, StoreError> {
        Ok(self.rows.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

#[tokio::test]
async fn store_is_written_through_and_reloaded() {
    let store = Arc::new(MemStore::default());
    let q = ApprovalQueue::with_store(store.clone()).unwrap_or_else(|e| panic!("{e}"));
    let a = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    let b = q
        .request(&call("acme"), &decision())
        .unwrap_or_else(|e| panic!("{e}"));
    q.answer("acme", &a.id, "alice", false)
        .unwrap_or_else(|e| panic!("{e}"));
    // a failing store refuses the change and leaves the request pending
    *store.fail.lock().unwrap_or_else(|p| p.into_inner()) = true;
    assert!(matches!(
        q.answer("acme", &b.id, "alice", true),
        Err(ApprovalError::Store(_))
    ));
    assert_eq!(
        q.get("acme", &b.id).map(|r| r.status).ok(),
        Some(ApprovalStatus::Pending)
    );
    *store.fail.lock().unwrap_or_else(|p| p.into_inner()) = false;
    // "restart"
    let q2 = ApprovalQueue::with_store(store.clone()).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(
        q2.get("acme", &a.id).map(|r| r.status),
        Ok(ApprovalStatus::Denied { .. })
    ));
    assert_eq!(
        q2.list("acme", true)
            .iter()
            .map(|r| r.id.clone())
            .collect::<Vec<_>>(),
        vec![b.id.clone()]
    );
    q2.answer("acme", &b.id, "alice", true)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(q2
        .wait("acme", &b.id, Duration::from_millis(1))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_approved());
}
