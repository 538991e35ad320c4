//! Cluster forwarding (docs/cluster.md, "Forwarding"): two real `stratad`
//! hosts on one PostgreSQL. Host A (4 vCPUs, the template) and host B
//! (1 vCPU, no template); every call goes to **B**:
//!
//! 1. a create through B is placed on A and forwarded there (`201`, the
//!    lease is A's, the answer says `x-strata-host: host-a`);
//! 2. exec (streamed NDJSON), snapshot, list and delete of that sandbox
//!    through B are A's answers; a request already marked forwarded is not
//!    forwarded again (B answers it itself: `409`, not owned here);
//! 3. A killed: an exec through B is `503 owner_unreachable` within the
//!    connect bound.
//!
//! Auth is on: the hosts share the security store on PostgreSQL (B starts
//! with A's bootstrap token and master key); the forwarded `Authorization`
//! is the caller's own, re-checked by the owner.
//!
//! Needs `STRATA_TEST_PG_URL` (scripts/test-pg.sh); without it the test
//! prints a line and passes.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{host_conf, host_of};
use common::Daemon;
use serde_json::{json, Value};

async fn owner(url: &str, schema: &str, id: &str) -> Option<String> {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL unreachable: {e}"));
    let task = tokio::spawn(conn);
    let r = c
        .query_opt(
            &format!("SELECT host_id FROM {schema}.sandbox_owners WHERE sandbox_id = $1"),
            &[&id],
        )
        .await
        .expect("query")
        .map(|r| r.get::<_, String>(0));
    drop(c);
    let _ = task.await;
    r
}

#[test]
fn a_host_forwards_creates_and_operations_to_the_owner_and_says_when_it_is_gone() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let schema = common::cluster::schema("fwd");
    let a = Daemon::start(&host_conf("host-a", &url, &schema, 4, true));
    let rt = strata_testkit::tokio_rt();
    rt.block_on(a.wait_template());
    let b = Daemon::start_sharing(&host_conf("host-b", &url, &schema, 1, false), &a);
    rt.block_on(async {
        tokio::time::sleep(Duration::from_secs(3)).await;

        // 1. Create through B: placed on A (4 free vCPUs against 1), forwarded.
        let r = b
            .request("POST", "/v1/sandboxes")
            .json(&json!({}))
            .send()
            .await
            .expect("create through B");
        assert_eq!(host_of(&r), "host-a", "{:?}", r.headers());
        let st = r.status().as_u16();
        let v: Value = r.json().await.expect("json");
        assert_eq!(st, 201, "{v}\n{}", b.logs());
        let id = v["id"].as_str().expect("id").to_owned();
        assert_eq!(owner(&url, &schema, &id).await.as_deref(), Some("host-a"));

        // 2. Exec through B streams A's answer.
        let e = b.sh(&id, "echo forwarded-$((6*7))").await;
        assert_eq!(e.status, 200, "{}", e.error);
        assert_eq!(e.code, Some(0), "{}", e.error);
        assert_eq!(String::from_utf8_lossy(&e.stdout).trim(), "forwarded-42");

        // Snapshot through B, taken by A.
        let r = b
            .request("POST", &format!("/v1/sandboxes/{id}/snapshots"))
            .json(&json!({}))
            .send()
            .await
            .expect("snapshot through B");
        assert_eq!(host_of(&r), "host-a");
        let st = r.status().as_u16();
        let snap: Value = r.json().await.expect("json");
        assert_eq!(st, 201, "{snap}");
        let snaps = a
            .ok("GET", &format!("/v1/sandboxes/{id}/snapshots"), None, 200)
            .await;
        assert!(
            snaps
                .to_string()
                .contains(snap["id"].as_str().expect("snapshot id")),
            "{snaps}"
        );

        // A request marked forwarded is answered where it lands (no loop):
        // B does not own it.
        let r = b
            .request("POST", &format!("/v1/sandboxes/{id}/pause"))
            .header("x-strata-forwarded-by", "host-x")
            .send()
            .await
            .expect("marked request");
        assert_eq!(host_of(&r), "host-b");
        let st = r.status().as_u16();
        let v: Value = r.json().await.expect("json");
        assert_eq!(st, 409, "{v}");
        assert!(v.to_string().contains("not owned by this host"), "{v}");

        // Delete through B, done by A.
        let (st, v) = b.call("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        let (st, v) = a.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(st == 404 || v["state"] == "deleted", "{st} {v}");

        // 3. A second sandbox, then A dies: B says so, quickly.
        let id2 = b.create(json!({})).await;
        assert_eq!(owner(&url, &schema, &id2).await.as_deref(), Some("host-a"));
        a.kill9();
        strata_testkit::teardown::kill_qemus(&a.run_dir);
        let t = Instant::now();
        let r = b
            .request("POST", &format!("/v1/sandboxes/{id2}/exec"))
            .json(&json!({ "cmd": ["true"] }))
            .send()
            .await
            .expect("exec through B with A dead");
        let took = t.elapsed();
        let st = r.status().as_u16();
        let v: Value = r.json().await.expect("json");
        eprintln!("owner gone: {st} after {took:?}: {v}");
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "owner_unreachable", "{v}");
        assert!(took < Duration::from_secs(3), "{took:?}");
    });
}
