//! Warm pools through the HTTP API (`service::warm`): the claim, the
//! fallback when a claim fails, a quota refusal that leaves the pool as it
//! was, eviction when a create needs the room, and a pool that never takes
//! room that is not free. Real store, service, router and admission; the
//! engine is the test double (its warm guests are records of calls). The
//! same with real guests: `tests/warm_pool.rs`.

use super::*;
use crate::config::TenantLimits;

fn warm_harness(tune: impl FnOnce(&mut Config)) -> (Harness, tokio::sync::watch::Sender<bool>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        ..Config::default()
    };
    cfg.capacity.vcpus = 4;
    cfg.capacity.cpu_overcommit = 1.0;
    cfg.capacity.memory_mib = 8192;
    cfg.capacity.admission = crate::config::AdmissionMode::Nominal;
    cfg.pressure.enabled = false;
    cfg.security.auth = false;
    cfg.pools.default_template = 1;
    tune(&mut cfg);
    let store = store_with_base_template(&cfg);
    let engine = Arc::new(Double::default());
    let app = App::new(cfg, store, engine.clone(), Arc::new(SystemClock));
    let (stop, rx) = tokio::sync::watch::channel(false);
    app.service().spawn_warm_filler(rx).expect("a filler");
    (
        Harness {
            app,
            engine,
            _dir: dir,
        },
        stop,
    )
}

fn ready(h: &Harness) -> usize {
    h.app
        .service()
        .warm_pool_stats()
        .iter()
        .map(|p| p.ready)
        .sum()
}

/// Waits (≤ 10 s: the filler looks every 2 s and waits 1 s after a create)
/// until the pools hold `n` guests.
async fn wait_ready(h: &Harness, n: usize) {
    for _ in 0..200 {
        if ready(h) == n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{} warm guests ready, want {n}", ready(h));
}

async fn create_body(h: &Harness, body: &str) -> (StatusCode, Value) {
    call(h, "POST", "/v1/sandboxes", body.to_owned()).await
}

#[tokio::test]
async fn a_create_claims_the_warm_guest_and_a_failed_claim_falls_back() {
    let (h, _stop) = warm_harness(|_| {});
    wait_ready(&h, 1).await;
    let warm = h.engine.prewarmed.lock().unwrap()[0].clone();
    let (s, v) = create_body(&h, "{}").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["id"], warm.as_str(), "the create is the warm guest");
    assert_eq!(v["state"], "running");
    assert_eq!(*h.engine.claimed.lock().unwrap(), vec![warm.clone()]);
    assert_eq!(ready(&h), 0);

    // Refilled; its claim fails: the guest is deleted, the create restores.
    wait_ready(&h, 1).await;
    let second = h.engine.prewarmed.lock().unwrap()[1].clone();
    h.engine.fail_claim.store(true, Ordering::Relaxed);
    let (s, v) = create_body(&h, "{}").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_ne!(
        v["id"],
        second.as_str(),
        "a new sandbox, not the failed guest"
    );
    assert!(h.engine.deleted.lock().unwrap().contains(&second));
    // The failed claim's record is not the tenant's sandbox.
    let (_, list) = call(&h, "GET", "/v1/sandboxes", "").await;
    let ids: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] != "deleted")
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids.len(), 2, "{list}");
    assert!(!ids.contains(&second.as_str()), "{list}");
    let text = h.app.service().metrics().render_prometheus();
    assert!(
        text.contains("strata_events_total{kind=\"warm_pool_claim_failed\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_quota_refusal_leaves_the_warm_guest_in_its_pool() {
    let (h, _stop) = warm_harness(|c| {
        c.quotas.tenant = TenantLimits {
            sandboxes: Some(1),
            ..TenantLimits::default()
        };
    });
    wait_ready(&h, 1).await;
    let (s, _) = create_body(&h, "{}").await;
    assert_eq!(s, StatusCode::CREATED);
    wait_ready(&h, 1).await;
    let warm = h.engine.prewarmed.lock().unwrap()[1].clone();
    let (s, v) = create_body(&h, "{}").await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "quota_exceeded");
    assert_eq!(ready(&h), 1, "the guest went back to its pool");
    assert!(!h.engine.claimed.lock().unwrap().contains(&warm));
    assert!(!h.engine.deleted.lock().unwrap().contains(&warm));
}

#[tokio::test]
async fn creates_that_need_the_room_end_warm_guests_and_the_pool_takes_only_free_room() {
    // 4 vCPUs, two warm guests of 1 vCPU. Creates with a bigger disk than
    // the template's are not served by the pool: the first two fit beside
    // the warm guests, the next two each end one; the fifth is refused
    // (nothing warm is left to end), and the filler takes no room back.
    let (h, _stop) = warm_harness(|c| c.pools.default_template = 2);
    wait_ready(&h, 2).await;
    let evicted = || {
        let text = h.app.service().metrics().render_prometheus();
        text.lines()
            .find_map(|l| l.strip_prefix("strata_events_total{kind=\"warm_pool_evicted\"} "))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    for (i, want_evicted) in [(0, 0), (1, 0), (2, 1), (3, 2)] {
        let (s, v) = create_body(&h, r#"{"size":{"disk_gib":20}}"#).await;
        assert_eq!(s, StatusCode::CREATED, "create {i}: {v}");
        assert_eq!(evicted(), want_evicted, "after create {i}");
    }
    assert!(
        h.engine.claimed.lock().unwrap().is_empty(),
        "no create was the pool's size"
    );
    let (s, v) = create_body(&h, r#"{"size":{"disk_gib":20}}"#).await;
    assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{v}");
    assert_eq!(code(&v), "insufficient_capacity");
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    assert_eq!(ready(&h), 0, "a full host keeps no warm guest");
    assert_eq!(
        h.engine.prewarmed.lock().unwrap().len(),
        2,
        "the filler started a guest into no room"
    );
}
