//! Pool-bytes quotas end to end: a real `stratad` (auth on, two tenants),
//! real guests writing real data, a real btrfs pool. A manual snapshot over
//! tenant a's quota is refused with `quota_exceeded` and nothing is listed,
//! while tenant b's snapshots keep succeeding; a fork is charged only what
//! it wrote since its source snapshot (the extent walk, not its source's
//! bytes again). The quota logic itself (counts, vCPUs, memory, rolling
//! skips, retention) is covered by the fast tests in `api/tests/quotas.rs`.

mod common;

use std::time::Instant;

use common::Daemon;
use serde_json::{json, Value};
use strata_testkit::Api;

const MIB: u64 = 1 << 20;

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

async fn call(api: &Api, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    api.json(
        reqwest::Method::from_bytes(method.as_bytes()).expect("method"),
        path,
        body,
    )
    .await
    .expect("request")
}

async fn tenant(d: &Daemon, name: &str) -> Api {
    let v = d
        .ok(
            "POST",
            "/v1/tokens",
            Some(json!({ "role": "developer", "tenant": name, "name": name })),
            201,
        )
        .await;
    Api::new(d.url.clone()).bearer(v["token"].as_str().expect("token"))
}

async fn create(api: &Api) -> String {
    let (s, v) = call(api, "POST", "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(s, 201, "{v}");
    v["id"].as_str().expect("id").to_owned()
}

/// 64 MiB of random data into the guest's disk, flushed.
async fn write_64m(api: &Api, id: &str) {
    let t = Instant::now();
    let (code, out) = api
        .exec_output(
            id,
            &[
                "sh",
                "-c",
                "head -c 64M /dev/urandom > /root/f && sync && stat -c %s /root/f",
            ],
        )
        .await
        .expect("exec");
    assert_eq!((code, out.trim()), (0, "67108864"), "{out}");
    eprintln!("{id}: wrote 64 MiB in {:?}", t.elapsed());
}

async fn snapshot(api: &Api, id: &str) -> (u16, Value) {
    let t = Instant::now();
    let r = call(
        api,
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({})),
    )
    .await;
    eprintln!("{id}: snapshot answered {} in {:?}", r.0, t.elapsed());
    r
}

async fn listed(api: &Api, id: &str) -> usize {
    let (s, v) = call(api, "GET", &format!("/v1/sandboxes/{id}/snapshots"), None).await;
    assert_eq!(s, 200, "{v}");
    v["items"].as_array().map(Vec::len).unwrap_or(0)
}

#[test]
fn over_quota_snapshot_is_refused_while_another_tenants_succeed_and_forks_pay_their_writes() {
    let d = Daemon::start(
        "[quotas]\nreserve_bytes = 268435456\n\
         [quotas.tenants.a]\npool_bytes = 50331648\n[quotas.tenants.b]\npool_bytes = 4294967296\n",
    );
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        // The daemon keeps the pool's space reserve (allocated, no data).
        let reserve = d.root.join("data/pool").join(strata_storage::RESERVE_FILE);
        let md = std::fs::metadata(&reserve).expect("the pool reserve exists");
        assert!(
            std::os::unix::fs::MetadataExt::blocks(&md) * 512 >= 256 * MIB,
            "{md:?}"
        );
        let a = tenant(&d, "a").await;
        let b = tenant(&d, "b").await;
        let sa = create(&a).await;
        let sb = create(&b).await;

        // Tenant a (48 MiB of pool) writes 64 MiB: its snapshot is refused.
        write_64m(&a, &sa).await;
        let before = listed(&a, &sa).await;
        let (s, v) = snapshot(&a, &sa).await;
        assert_eq!((s, code(&v)), (403, "quota_exceeded"), "{v}");
        eprintln!("refused: {}", v["error"]["message"]);
        assert_eq!(listed(&a, &sa).await, before, "nothing created");
        // The sandbox runs on, its data intact.
        let (c, out) = a
            .exec_output(&sa, &["stat", "-c", "%s", "/root/f"])
            .await
            .expect("exec");
        assert_eq!((c, out.trim()), (0, "67108864"));

        // Tenant b writes the same and snapshots: fine, charged for it.
        write_64m(&b, &sb).await;
        let (s, v) = snapshot(&b, &sb).await;
        assert_eq!(s, 201, "{v}");
        let b_charge = v["charge_bytes"].as_u64().expect("charged");
        assert!(b_charge >= 64 * MIB, "b's snapshot holds its 64 MiB: {v}");
        let snap = v["id"].as_str().expect("id").to_owned();
        let (s, v) = snapshot(&b, &sb).await;
        assert_eq!(s, 201, "b keeps snapshotting: {v}");

        // A fork of b's snapshot has written (almost) nothing yet: its first
        // snapshot is charged what it wrote since `snap`, not b's bytes again.
        let (s, v) = call(
            &b,
            "POST",
            &format!("/v1/snapshots/{snap}/fork"),
            Some(json!({})),
        )
        .await;
        assert_eq!(s, 201, "{v}");
        let f = v["id"].as_str().expect("id").to_owned();
        let (s, v) = snapshot(&b, &f).await;
        assert_eq!(s, 201, "{v}");
        let f_charge = v["charge_bytes"].as_u64().expect("charged");
        eprintln!("charge: source snapshot {b_charge} B, fresh fork {f_charge} B");
        assert!(
            f_charge * 4 < b_charge,
            "a fresh fork pays for its own writes only: {f_charge} vs {b_charge}"
        );
        // What the fork then writes is its own.
        write_64m(&b, &f).await;
        let (s, v) = snapshot(&b, &f).await;
        assert_eq!(s, 201, "{v}");
        assert!(
            v["charge_bytes"].as_u64().expect("charged") >= 64 * MIB,
            "{v}"
        );
    });
}
