//! A real `stratad` on PostgreSQL (`[store] url`): it creates a sandbox,
//! snapshots it, is restarted, and finds both again, in PostgreSQL; its
//! security tables (tokens, audit head) are there too, and it makes no
//! local SQLite file.
//!
//! Needs `STRATA_TEST_PG_URL` (scripts/test.sh starts a throwaway cluster
//! and sets it); without it the test prints a line and passes.

mod common;

use common::Daemon;
use serde_json::json;

/// `sql` on a plain connection to `url`; the first column of the first row.
async fn scalar(url: &str, sql: &str) -> i64 {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("STRATA_TEST_PG_URL is set but PostgreSQL is unreachable: {e}"));
    let task = tokio::spawn(conn);
    let n = match c.query_opt(sql, &[]).await.expect("query") {
        Some(r) => r.get::<_, i64>(0),
        None => 0,
    };
    drop(c);
    let _ = task.await;
    n
}

#[test]
fn stratad_on_postgres_keeps_its_sandbox_and_snapshot_across_a_restart() {
    let Some(url) = std::env::var("STRATA_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        eprintln!("skipped: STRATA_TEST_PG_URL is not set (scripts/test-pg.sh)");
        return;
    };
    let schema = format!("e2e_{}_{}", std::process::id(), rand::random::<u32>());
    let d = Daemon::start(&format!(
        "[store]\nurl = \"{url}\"\nschema = \"{schema}\"\ntimeout = \"20s\"\n"
    ));
    let rt = strata_testkit::tokio_rt();
    rt.block_on(async {
        d.wait_template().await;
        let id = d.create(json!({ "labels": { "store": "pg" } })).await;
        assert_eq!(d.sh(&id, "echo kept > /root/f").await.code, Some(0));
        let snap = d
            .ok("POST", &format!("/v1/sandboxes/{id}/snapshots"), None, 201)
            .await;
        let snap = snap["id"].as_str().expect("snapshot id").to_owned();
        // The records are in PostgreSQL, under the configured schema.
        assert_eq!(
            scalar(
                &url,
                &format!("SELECT count(*) FROM {schema}.sandboxes WHERE id = '{id}'")
            )
            .await,
            1
        );
        assert_eq!(
            scalar(
                &url,
                &format!(
                    "SELECT count(*) FROM {schema}.snapshots WHERE id = '{snap}' AND status = 'ready'"
                )
            )
            .await,
            1
        );

        // A token made through the API is a PostgreSQL row (any daemon on
        // this database takes it) and works after the restart.
        let (dev, _) = d.tenant_token("acme", "developer").await;
        assert!(
            scalar(&url, &format!("SELECT count(*) FROM {schema}.api_tokens")).await >= 2,
            "tokens are not in PostgreSQL"
        );

        d.restart();
        dev.expect(reqwest::Method::GET, "/v1/sandboxes", None, 200)
            .await
            .expect("the developer token made before the restart");
        let v = d
            .ok("GET", &format!("/v1/sandboxes/{id}"), None, 200)
            .await;
        assert_eq!(v["labels"]["store"], "pg", "{v}");
        let snaps = d
            .ok("GET", &format!("/v1/sandboxes/{id}/snapshots"), None, 200)
            .await;
        assert!(
            snaps["items"]
                .as_array()
                .expect("items")
                .iter()
                .any(|s| s["id"] == snap.as_str() && s["status"] == "ready"),
            "{snaps}"
        );
        let listed = d.ok("GET", "/v1/sandboxes?label=store%3Dpg", None, 200).await;
        assert_eq!(listed["items"].as_array().map(Vec::len), Some(1), "{listed}");
        // Its VM was adopted or recovered: the file written before is there.
        let v = d
            .wait_for(&id, std::time::Duration::from_secs(120), |v| {
                v["state"] == "running"
            })
            .await;
        assert_eq!(v["state"], "running");
        let e = d.sh(&id, "cat /root/f").await;
        assert_eq!(e.out(), "kept", "{:?}", e.error);
    });
    // No local SQLite file: PostgreSQL is the store, security tables too;
    // this daemon's audit head is the row of its audit log id.
    assert!(
        !d.root.join("data/strata.db").exists(),
        "a local SQLite file was made"
    );
    let log = std::fs::read_to_string(d.root.join("data/audit-log.id")).expect("audit log id");
    rt.block_on(async {
        let n = scalar(
            &url,
            &format!(
                "SELECT count(*) FROM {schema}.audit_heads WHERE log_id = '{}'",
                log.trim()
            ),
        )
        .await;
        assert_eq!(n, 1, "no audit head of this daemon's log");
    });
    d.shutdown();
    rt.block_on(async {
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        let task = tokio::spawn(conn);
        c.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await
            .expect("drop schema");
        drop(c);
        let _ = task.await;
    });
}
