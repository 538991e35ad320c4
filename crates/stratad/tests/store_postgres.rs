//! A real `stratad` on PostgreSQL (`[store] url`): it creates a sandbox,
//! snapshots it, is restarted, and finds both again, in PostgreSQL and not
//! in its local SQLite file (which keeps only the security tables).
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

        d.restart();
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
    // The local SQLite file holds no sandbox: PostgreSQL is the store.
    let local = rusqlite::Connection::open(d.root.join("data/strata.db")).expect("local db");
    let n: i64 = local
        .query_row("SELECT count(*) FROM sandboxes", [], |r| r.get(0))
        .expect("count");
    assert_eq!(n, 0, "sandbox rows went to the local SQLite file");
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
