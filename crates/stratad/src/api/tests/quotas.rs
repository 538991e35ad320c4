//! Quotas through the HTTP API (`[quotas]`, `service::admission`): sandbox
//! count, vCPUs and memory on every operation that starts a VM; pool bytes
//! on manual and rolling snapshots, charged per lineage; the wake snapshot
//! of a hibernated sandbox never deleted. Real store, service, router and
//! security; the engine is the test double, whose snapshots hold what the
//! test says they wrote (`Double::written`). The same charge on a real pool
//! is tested in `strata-storage` (`written_since_…`) and with real guests in
//! `tests/e2e_quotas.rs`.

use super::security::{req, token, Sec};
use super::*;
use crate::config::TenantLimits;
use crate::scheduler::Actions as _;
use crate::service::ScheduledActions;
use crate::store::SnapshotStatus;

const MIB: u64 = 1 << 20;

struct Q {
    sec: Sec,
    engine: Arc<Double>,
    store: Arc<SqliteStore>,
}

fn quota_harness(tune: impl FnOnce(&mut Config)) -> Q {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        ..Config::default()
    };
    cfg.capacity.vcpus = 64;
    cfg.capacity.cpu_overcommit = 1.0;
    cfg.capacity.memory_mib = 1 << 20;
    cfg.security.rate_limit_per_second = 0.0;
    tune(&mut cfg);
    let store = super::store_with_base_template(&cfg);
    let engine = Arc::new(Double::default());
    let app = App::new(cfg, store.clone(), engine.clone(), Arc::new(SystemClock));
    let admin = std::fs::read_to_string(dir.path().join("admin.token"))
        .unwrap()
        .trim()
        .to_owned();
    Q {
        sec: Sec { app, dir, admin },
        engine,
        store,
    }
}

impl Q {
    async fn call(&self, tok: &str, method: &str, uri: &str, body: &str) -> (StatusCode, Value) {
        let (s, v, _) = req(&self.sec, method, uri, Some(tok), body.to_owned()).await;
        (s, v)
    }

    async fn create(&self, tok: &str, body: &str) -> String {
        let (s, v) = self.call(tok, "POST", "/v1/sandboxes", body).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_owned()
    }

    fn writes(&self, id: &str, bytes: u64) {
        self.engine
            .written
            .lock()
            .unwrap()
            .insert(id.parse().unwrap(), bytes);
    }

    async fn snapshot(&self, tok: &str, id: &str) -> (StatusCode, Value) {
        self.call(tok, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "{}")
            .await
    }

    async fn snapshots(&self, tok: &str, id: &str) -> Vec<Value> {
        let (s, v) = self
            .call(tok, "GET", &format!("/v1/sandboxes/{id}/snapshots"), "")
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v["items"].as_array().unwrap().clone()
    }

    async fn list(&self, tok: &str) -> Vec<Value> {
        let (_, v) = self.call(tok, "GET", "/v1/sandboxes", "").await;
        v["items"].as_array().unwrap().clone()
    }
}

fn pool_limit(bytes: u64) -> TenantLimits {
    TenantLimits {
        pool_bytes: Some(bytes),
        ..TenantLimits::default()
    }
}

#[tokio::test]
async fn over_quota_manual_snapshot_is_refused_while_another_tenants_succeed() {
    let q = quota_harness(|c| {
        c.quotas.tenants.insert("a".into(), pool_limit(64 * MIB));
        c.quotas.tenants.insert("b".into(), pool_limit(256 * MIB));
    });
    let a = token(&q.sec, "a", "developer").await;
    let b = token(&q.sec, "b", "developer").await;
    let sa = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    let sb = q.create(&b, r#"{"template":"tpl-base"}"#).await;

    // 10 MiB written: under the quota, taken and charged.
    q.writes(&sa, 10 * MIB);
    let (s, v) = q.snapshot(&a, &sa).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["charge_bytes"], json!(10 * MIB), "{v}");
    // 80 MiB more would hold 90 of 64: refused, and nothing is listed.
    q.writes(&sa, 80 * MIB);
    let taken = q.engine.snaps.lock().unwrap().len();
    let (s, v) = q.snapshot(&a, &sa).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "quota_exceeded", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("tenant a") && msg.contains("80.0 MiB"),
        "{msg}"
    );
    let listed = q.snapshots(&a, &sa).await;
    assert_eq!(
        listed.len(),
        1,
        "the refused snapshot is not listed: {listed:?}"
    );
    let refused = q.engine.snaps.lock().unwrap()[taken].clone();
    assert!(
        q.engine.deleted_snaps.lock().unwrap().contains(&refused),
        "the refused snapshot was removed from the pool"
    );
    // The sandbox runs on; tenant b, with the same writes, is not affected.
    q.writes(&sb, 80 * MIB);
    let (s, v) = q.snapshot(&b, &sb).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, v) = q.call(&a, "GET", &format!("/v1/sandboxes/{sa}"), "").await;
    assert_eq!(v["state"], "running");
    // Exactly at the quota (10 + 54 = 64) is allowed ...
    q.writes(&sa, 54 * MIB);
    let (s, v) = q.snapshot(&a, &sa).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // ... and then the tenant is full: refused before the engine is asked.
    let before = q.engine.snaps.lock().unwrap().len();
    let (s, v) = q.snapshot(&a, &sa).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    assert_eq!(
        q.engine.snaps.lock().unwrap().len(),
        before,
        "no snapshot taken"
    );
    // Freeing space (deleting a snapshot) gives room back.
    let first = listed[0]["id"].as_str().unwrap();
    let (s, v) = q
        .call(&a, "DELETE", &format!("/v1/snapshots/{first}"), "")
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = q.snapshot(&a, &sa).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    // Tenant b's snapshots kept succeeding throughout.
    let (s, _) = q.snapshot(&b, &sb).await;
    assert_eq!(s, StatusCode::CREATED);
}

#[tokio::test]
async fn per_sandbox_pool_quota() {
    let q = quota_harness(|c| c.quotas.sandbox.pool_bytes = Some(32 * MIB));
    let a = token(&q.sec, "a", "developer").await;
    let s1 = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    let s2 = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    q.writes(&s1, 40 * MIB);
    let (s, v) = q.snapshot(&a, &s1).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    assert!(v["error"]["message"].as_str().unwrap().contains(&s1), "{v}");
    // The other sandbox of the same tenant has its own budget.
    q.writes(&s2, 30 * MIB);
    let (s, v) = q.snapshot(&a, &s2).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn per_sandbox_size_quota_refuses_create() {
    let q = quota_harness(|c| c.quotas.sandbox.memory_mib = Some(256));
    let a = token(&q.sec, "a", "developer").await;
    // The template's 512 MiB is over the per-sandbox 256 MiB.
    let (s, v) = q
        .call(&a, "POST", "/v1/sandboxes", r#"{"template":"tpl-base"}"#)
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    assert!(q.list(&a).await.is_empty(), "nothing created");
}

#[tokio::test]
async fn tenant_count_vcpu_memory_quotas() {
    let q = quota_harness(|c| {
        c.quotas.tenant = TenantLimits {
            sandboxes: Some(2),
            vcpus: Some(1),
            memory_mib: None,
            pool_bytes: None,
        };
        c.quotas.tenants.insert(
            "big".into(),
            TenantLimits {
                vcpus: Some(8),
                ..TenantLimits::default()
            },
        );
    });
    let a = token(&q.sec, "a", "developer").await;
    let big = token(&q.sec, "big", "developer").await;
    let s1 = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    // A second running sandbox would use 2 of 1 vCPUs.
    let (s, v) = q
        .call(&a, "POST", "/v1/sandboxes", r#"{"template":"tpl-base"}"#)
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("vCPUs"),
        "{v}"
    );
    let (s, v) = q
        .call(&a, "POST", &format!("/v1/sandboxes/{s1}/fork"), "{}")
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    // start:false runs no VM: allowed (2 of 2 sandboxes) ...
    let s2 = q
        .create(&a, r#"{"template":"tpl-base","start":false}"#)
        .await;
    // ... a third is over the sandbox count, hibernated or not.
    let (s, v) = q
        .call(
            &a,
            "POST",
            "/v1/sandboxes",
            r#"{"template":"tpl-base","start":false}"#,
        )
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sandboxes"),
        "{v}"
    );
    assert_eq!(q.list(&a).await.len(), 2, "nothing created");
    // Waking the hibernated one would run 2 vCPUs: refused, still hibernated.
    for (path, body) in [
        (format!("/v1/sandboxes/{s2}/resume"), ""),
        (format!("/v1/sandboxes/{s2}/exec"), r#"{"cmd":["true"]}"#),
    ] {
        let (s, v) = q.call(&a, "POST", &path, body).await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::FORBIDDEN, "quota_exceeded"),
            "{path}: {v}"
        );
        let (_, r) = q.call(&a, "GET", &format!("/v1/sandboxes/{s2}"), "").await;
        assert_eq!(r["state"], "hibernated", "{r}");
    }
    // Hibernating the first makes room for the wake.
    let (s, v) = q
        .call(&a, "POST", &format!("/v1/sandboxes/{s1}/hibernate"), "")
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = q
        .call(&a, "POST", &format!("/v1/sandboxes/{s2}/resume"), "")
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running");
    // Another tenant's override: 8 vCPUs, the default's 2 sandboxes.
    q.create(&big, r#"{"template":"tpl-base"}"#).await;
    q.create(&big, r#"{"template":"tpl-base"}"#).await;
    let (s, v) = q
        .call(&big, "POST", "/v1/sandboxes", r#"{"template":"tpl-base"}"#)
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
}

#[tokio::test]
async fn a_fork_is_charged_against_its_source_and_a_first_snapshot_against_its_template() {
    let q = quota_harness(|c| {
        c.quotas.tenant = pool_limit(100 * MIB);
    });
    let a = token(&q.sec, "a", "developer").await;
    let src = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    q.writes(&src, 64 * MIB);
    let (s, v) = q.snapshot(&a, &src).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let s1 = v["id"].as_str().unwrap().to_owned();
    assert_eq!(v["charge_bytes"], json!(64 * MIB));
    let (s, v) = q
        .call(&a, "POST", &format!("/v1/snapshots/{s1}/fork"), "{}")
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let fork = v["id"].as_str().unwrap().to_owned();
    // A fresh fork wrote nothing: its snapshot is charged ~0 against s1,
    // so the tenant (64 of 100 MiB) may take it.
    let (s, v) = q.snapshot(&a, &fork).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let f1 = v["id"].as_str().unwrap().to_owned();
    assert_eq!(v["charge_bytes"], json!(0));
    let bases = q.engine.charged.lock().unwrap().clone();
    let base_of = |id: &str| {
        bases
            .iter()
            .rev()
            .find(|(s, _)| s.as_str() == id)
            .map(|(_, b)| b.clone())
            .unwrap()
    };
    assert_eq!(
        base_of(&s1),
        Some(Source::Template("tpl-base".parse().unwrap())),
        "a first snapshot descends from the template (the platform's extents)"
    );
    assert_eq!(base_of(&f1), Some(Source::Snapshot(s1.parse().unwrap())));
    // What the fork writes is its own: 40 more is over 100.
    q.writes(&fork, 40 * MIB);
    let (s, v) = q.snapshot(&a, &fork).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::FORBIDDEN, "quota_exceeded"),
        "{v}"
    );
    // The next snapshot of the source is charged against s1, not the template.
    q.writes(&src, 5 * MIB);
    let (s, v) = q.snapshot(&a, &src).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let s2 = v["id"].as_str().unwrap().to_owned();
    let bases = q.engine.charged.lock().unwrap().clone();
    let last = bases.iter().rev().find(|(s, _)| s.as_str() == s2).unwrap();
    assert_eq!(last.1, Some(Source::Snapshot(s1.parse().unwrap())));
    // Deleting s1 moves s2 (and the fork's f1) to new bases: computed again.
    let (s, _) = q
        .call(&a, "DELETE", &format!("/v1/snapshots/{s1}"), "")
        .await;
    assert_eq!(s, StatusCode::OK);
    let charge = q.sec.app.service().pool_charge("a").await.unwrap();
    let bases = q.engine.charged.lock().unwrap().clone();
    let last = bases.iter().rev().find(|(s, _)| s.as_str() == s2).unwrap();
    assert_eq!(last.1, Some(Source::Template("tpl-base".parse().unwrap())));
    assert_eq!(charge.by_sandbox.len(), 2, "{charge:?}");
}

#[tokio::test]
async fn rolling_snapshot_of_an_over_quota_sandbox_is_skipped_with_the_reason_journaled() {
    let q = quota_harness(|c| {
        c.quotas.tenants.insert("a".into(), pool_limit(16 * MIB));
    });
    let a = token(&q.sec, "a", "developer").await;
    let b = token(&q.sec, "b", "developer").await;
    let sa = q.create(&a, r#"{"template":"tpl-base"}"#).await;
    let sb = q.create(&b, r#"{"template":"tpl-base"}"#).await;
    let svc = q.sec.app.service().clone();
    let act = ScheduledActions(svc);
    // The first rolling snapshot takes a over its quota (rolling ones are
    // only refused when the tenant is already at it) ...
    q.writes(&sa, 20 * MIB);
    act.rolling_snapshot(sa.parse().unwrap()).await;
    assert_eq!(q.snapshots(&a, &sa).await.len(), 1);
    // ... so the next ones are skipped, with the reason in the journal once.
    for _ in 0..3 {
        act.rolling_snapshot(sa.parse().unwrap()).await;
    }
    assert_eq!(q.snapshots(&a, &sa).await.len(), 1, "skipped");
    let (_, ev) = q
        .call(&a, "GET", &format!("/v1/sandboxes/{sa}/events"), "")
        .await;
    let items = ev["items"].as_array().unwrap();
    let skips: Vec<&Value> = items
        .iter()
        .filter(|e| {
            e["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("rolling snapshot skipped: quota_exceeded"))
        })
        .collect();
    assert_eq!(skips.len(), 1, "one entry per run of skips: {items:?}");
    assert_eq!(skips[0]["phase"], "failed");
    // Tenant b's rolling snapshots go on.
    for _ in 0..2 {
        q.writes(&sb, 20 * MIB);
        act.rolling_snapshot(sb.parse().unwrap()).await;
    }
    assert_eq!(q.snapshots(&b, &sb).await.len(), 2);
}

#[tokio::test]
async fn a_hibernated_sandboxs_wake_snapshot_survives_retention_and_user_delete() {
    let q = quota_harness(|c| {
        c.retention = crate::retention::RetentionPolicy::parse("1m:0").unwrap();
    });
    let a = token(&q.sec, "a", "developer").await;
    let id = q
        .create(&a, r#"{"template":"tpl-base","start":false}"#)
        .await;
    let snaps = q.snapshots(&a, &id).await;
    assert_eq!(snaps.len(), 1);
    let wake: SnapshotId = snaps[0]["id"].as_str().unwrap().parse().unwrap();
    // A day old, and a second hibernate snapshot of the very same instant
    // whose id sorts first: the store wakes from `wake` (newest, highest id),
    // plain retention would spare the other one and delete `wake`.
    let mut w = q.store.get_snapshot(&wake).unwrap().unwrap();
    w.created_at = Utc::now() - chrono::Duration::days(1);
    q.store.put_snapshot(&w).unwrap();
    let mut twin = w.clone();
    twin.id = "snap-0".parse().unwrap();
    q.store.put_snapshot(&twin).unwrap();
    let sid: SandboxId = id.parse().unwrap();
    assert_eq!(
        q.store.latest_ready_snapshot(&sid).unwrap().unwrap().id,
        wake
    );
    let svc = q.sec.app.service().clone();
    svc.gc(&sid).await.unwrap();
    let after = q.store.get_snapshot(&wake).unwrap().unwrap();
    assert_eq!(
        after.status,
        SnapshotStatus::Ready,
        "the wake snapshot is kept"
    );
    // A user cannot delete it either.
    let (s, v) = q
        .call(&a, "DELETE", &format!("/v1/snapshots/{wake}"), "")
        .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::CONFLICT, "invalid_state"),
        "{v}"
    );
    assert_eq!(
        q.store.get_snapshot(&wake).unwrap().unwrap().status,
        SnapshotStatus::Ready
    );
    // It still wakes; once running, the snapshot is an ordinary one.
    let (s, v) = q
        .call(&a, "POST", &format!("/v1/sandboxes/{id}/resume"), "")
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = q
        .call(&a, "DELETE", &format!("/v1/snapshots/{wake}"), "")
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// Template builds run at most `[templates] max_concurrent_builds` at once
/// (each boots a builder VM): one more is refused `insufficient_capacity`,
/// naming the setting, until a running build ends.
#[tokio::test]
async fn template_builds_beyond_the_configured_slots_wait_for_one_to_end() {
    let q = quota_harness(|c| c.templates.max_concurrent_builds = 1);
    let svc = q.sec.app.service();
    let size = strata_core::SandboxSize::default();
    let first = svc.admit_build(size).await.unwrap();
    let err = svc.admit_build(size).await.err().unwrap();
    assert_eq!(err.code(), strata_core::ErrorCode::InsufficientCapacity);
    assert!(err.to_string().contains("max_concurrent_builds"), "{err}");
    drop(first);
    let again = svc.admit_build(size).await;
    assert!(again.is_ok(), "the slot was not given back");
    // Two slots: two builds at once.
    let q = quota_harness(|c| c.templates.max_concurrent_builds = 2);
    let svc = q.sec.app.service();
    let _a = svc.admit_build(size).await.unwrap();
    let _b = svc.admit_build(size).await.unwrap();
    assert!(svc.admit_build(size).await.is_err());
}
