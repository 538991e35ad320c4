//! An API-only process (docs/cluster.md, "API processes"): one real host
//! (host-a: 4 vCPUs, the template, a TCG guest) and one `stratad` with
//! `[cluster] role = "api"` on the same PostgreSQL. Every call goes to the
//! **API process**:
//!
//! 1. it opened no pool (no `pool.img`, nothing mounted under its root),
//!    runs no QEMU (no child process, no `qemu.pid` in its run dir) and is
//!    not registered as a host;
//! 2. a create through it lands on host-a (`201`, `x-strata-host: host-a`,
//!    the lease is host-a's);
//! 3. exec (with output), a file up and down, snapshot, get of the
//!    snapshot, a fork of it (its own exec and delete), the snapshot's
//!    delete, get and delete of the sandbox are host-a's answers; the list
//!    is its own (from PostgreSQL, the sandbox in it);
//! 4. what it cannot serve is refused clearly: a template build is `421
//!    host_required`; a create no host fits is `507 insufficient_capacity`
//!    naming host-a (the API process is no candidate);
//! 5. a request marked forwarded is `421 host_required` there; a live
//!    sandbox no host holds (its lease row removed) is read there, its
//!    exec is `503 no_owner`;
//! 6. it never held a lease and never ran QEMU.
//!
//! Auth is on: the API process starts with host-a's bootstrap token and
//! master key (the security store is on PostgreSQL); the forwarded
//! `Authorization` is the caller's own, re-checked by host-a.
//!
//! Needs `STRATA_TEST_PG_URL` (scripts/test-pg.sh); without it the test
//! prints a line and passes.

mod common;

use std::time::Instant;

use common::cluster::{api_conf, children, host_conf, host_of, pg_row};
use common::Daemon;
use serde_json::{json, Value};

/// `method path` with `body` through `d`: (status, `x-strata-host`, JSON).
async fn send(d: &Daemon, method: &str, path: &str, body: Option<Value>) -> (u16, String, Value) {
    let mut r = d.request(method, path);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.expect("request");
    let host = host_of(&r);
    let st = r.status().as_u16();
    (st, host, r.json().await.unwrap_or(Value::Null))
}

#[test]
fn an_api_process_serves_the_api_and_forwards_every_vm_operation_to_the_host() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let t0 = Instant::now();
    let schema = common::cluster::schema("api");
    let a = Daemon::start(&host_conf("host-a", &url, &schema, 4, true));
    let rt = strata_testkit::tokio_rt();
    rt.block_on(a.wait_template());
    eprintln!("host-a up, template ready: {:?}", t0.elapsed());
    let api = Daemon::start_sharing(&api_conf("api-1", &url, &schema), &a);
    eprintln!("API process listening: {:?}", t0.elapsed());
    rt.block_on(async {
        // 1. No pool, no QEMU, not a host.
        assert!(
            !api.root.join("data/pool.img").exists(),
            "the API process made a pool image"
        );
        let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
        let root = api.root.display().to_string();
        assert!(
            !mounts.lines().any(|l| l.contains(&root)),
            "something is mounted under the API process's root:\n{mounts}"
        );
        let logs = api.logs();
        assert!(logs.contains("API-only process"), "{logs}");
        assert!(!logs.contains("opening the sandbox runtime"), "{logs}");
        let (st, host, v) = send(&api, "GET", "/healthz", None).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(host, "api-1");
        let hosts = pg_row(
            &url,
            &format!("SELECT string_agg(id, ',' ORDER BY id) FROM {schema}.hosts"),
        )
        .await
        .and_then(|r| r.get::<_, Option<String>>(0));
        assert_eq!(hosts.as_deref(), Some("host-a"), "registered hosts");

        // 2. A create through the API process lands on host-a.
        let t = Instant::now();
        let (st, host, v) = send(&api, "POST", "/v1/sandboxes", Some(json!({}))).await;
        assert_eq!(st, 201, "{v}\n{}", api.logs());
        assert_eq!(host, "host-a", "{v}");
        assert_eq!(v["state"], "running", "{v}");
        let id = v["id"].as_str().expect("id").to_owned();
        eprintln!("create through the API process: {:?}", t.elapsed());
        let owner = pg_row(
            &url,
            &format!("SELECT host_id FROM {schema}.sandbox_owners WHERE sandbox_id = '{id}'"),
        )
        .await
        .map(|r| r.get::<_, String>(0));
        assert_eq!(owner.as_deref(), Some("host-a"));

        // 3. Exec streams host-a's answer.
        let e = api.sh(&id, "echo api-$((6*7)); uname -n").await;
        assert_eq!(e.status, 200, "{}", e.error);
        assert_eq!(e.code, Some(0), "{}", e.error);
        let out = String::from_utf8_lossy(&e.stdout);
        assert!(out.starts_with("api-42\n"), "{out:?}");

        // A file up and down (bodies streamed through both hops).
        let blob: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let (st, body) = api
            .raw(
                "PUT",
                &format!("/v1/sandboxes/{id}/files?path=/tmp/blob.bin"),
                blob.clone(),
            )
            .await;
        assert!(
            st == 200 || st == 201,
            "{st} {}",
            String::from_utf8_lossy(&body)
        );
        let (st, got) = api
            .raw(
                "GET",
                &format!("/v1/sandboxes/{id}/files?path=/tmp/blob.bin"),
                vec![],
            )
            .await;
        assert_eq!(st, 200);
        assert!(got == blob, "download differs ({} bytes)", got.len());

        // Snapshot, taken by host-a; read and deleted through the
        // snapshot's own routes (forwarded by its sandbox's owner).
        let (st, host, snap) = send(
            &api,
            "POST",
            &format!("/v1/sandboxes/{id}/snapshots"),
            Some(json!({})),
        )
        .await;
        assert_eq!((st, host.as_str()), (201, "host-a"), "{snap}");
        let snap_id = snap["id"].as_str().expect("snapshot id").to_owned();
        let snaps = a
            .ok("GET", &format!("/v1/sandboxes/{id}/snapshots"), None, 200)
            .await;
        assert!(snaps.to_string().contains(&snap_id), "{snaps}");
        let (st, host, v) = send(&api, "GET", &format!("/v1/snapshots/{snap_id}"), None).await;
        assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
        assert_eq!(v["id"], snap_id.as_str(), "{v}");
        // A fork of the snapshot, made by host-a (it holds the snapshot),
        // with the file in it.
        let (st, host, fork) = send(
            &api,
            "POST",
            &format!("/v1/snapshots/{snap_id}/fork"),
            Some(json!({})),
        )
        .await;
        assert_eq!((st, host.as_str()), (201, "host-a"), "{fork}");
        let fork = fork["id"].as_str().expect("fork id").to_owned();
        let e = api.sh(&fork, "wc -c < /tmp/blob.bin").await;
        assert_eq!(
            String::from_utf8_lossy(&e.stdout).trim(),
            "300000",
            "{}",
            e.error
        );
        let (st, host, v) = send(&api, "DELETE", &format!("/v1/sandboxes/{fork}"), None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        assert_eq!(host, "host-a");
        // A live fork: its one write spans the parent's and the child's
        // leases, both host-a's (answered 500 "one write spans sandboxes of
        // different owner leases" before the fence took a token per sandbox).
        let (st, host, live) = send(
            &api,
            "POST",
            &format!("/v1/sandboxes/{id}/fork"),
            Some(json!({})),
        )
        .await;
        assert_eq!((st, host.as_str()), (201, "host-a"), "{live}");
        let live = live["id"].as_str().expect("live fork id").to_owned();
        let e = api.sh(&live, "wc -c < /tmp/blob.bin").await;
        assert_eq!(
            String::from_utf8_lossy(&e.stdout).trim(),
            "300000",
            "{}",
            e.error
        );
        let (st, _, v) = send(&api, "DELETE", &format!("/v1/sandboxes/{live}"), None).await;
        assert!(st == 200 || st == 204, "{st} {v}");

        // List: answered by the API process itself, from PostgreSQL.
        let (st, host, list) = send(&api, "GET", "/v1/sandboxes", None).await;
        assert_eq!((st, host.as_str()), (200, "api-1"), "{list}");
        assert!(list.to_string().contains(&id), "{list}");
        // Get: host-a's answer.
        let (st, host, v) = send(&api, "GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
        assert_eq!(v["state"], "running", "{v}");

        // 4. What it cannot serve: a template build needs a host.
        let (st, host, v) = send(&api, "POST", "/v1/templates", Some(json!({}))).await;
        assert_eq!(st, 421, "{v}");
        assert_eq!(host, "api-1");
        assert_eq!(v["error"]["code"], "host_required", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("API-only process")),
            "{v}"
        );
        // A create no host fits: host-a has 3 of its 4 vCPUs free, and the
        // API process is no candidate.
        let (st, _, v) = send(
            &api,
            "POST",
            "/v1/sandboxes",
            Some(json!({ "size": { "vcpus": 8 } })),
        )
        .await;
        assert_eq!(st, 507, "{v}");
        assert_eq!(v["error"]["code"], "insufficient_capacity", "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("host-a") && !msg.contains("api-1"), "{v}");

        // Delete of the snapshot, then of the sandbox, done by host-a.
        let (st, host, v) = send(&api, "DELETE", &format!("/v1/snapshots/{snap_id}"), None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        assert_eq!(host, "host-a");
        let (st, host, v) = send(&api, "DELETE", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(st == 200 || st == 204, "{st} {v}");
        assert_eq!(host, "host-a");
        let (st, v) = a.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(st == 404 || v["state"] == "deleted", "{st} {v}");

        // A request marked forwarded is not forwarded again, and the API
        // process does not run it: 421.
        let id2 = {
            let (st, host, v) = send(
                &api,
                "POST",
                "/v1/sandboxes",
                Some(json!({ "start": false })),
            )
            .await;
            assert_eq!((st, host.as_str()), (201, "host-a"), "{v}");
            assert_eq!(v["state"], "hibernated", "{v}");
            v["id"].as_str().expect("id").to_owned()
        };
        let r = api
            .request("POST", &format!("/v1/sandboxes/{id2}/exec"))
            .header("x-strata-forwarded-by", "host-x")
            .json(&json!({ "cmd": ["true"] }))
            .send()
            .await
            .expect("marked request");
        let st = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(st, 421, "{v}");
        assert_eq!(v["error"]["code"], "host_required", "{v}");
        // A live sandbox no host holds (its lease row removed: as after a
        // host loss, before another host takes it into custody): its
        // record is still read, a VM operation is 503 no_owner.
        pg_row(
            &url,
            &format!(
                "DELETE FROM {schema}.sandbox_owners WHERE sandbox_id = '{id2}' RETURNING host_id"
            ),
        )
        .await
        .expect("the lease row");
        let (st, host, v) = send(&api, "GET", &format!("/v1/sandboxes/{id2}"), None).await;
        assert_eq!((st, host.as_str()), (200, "api-1"), "{v}");
        let (st, _, v) = send(
            &api,
            "POST",
            &format!("/v1/sandboxes/{id2}/exec"),
            Some(json!({ "cmd": ["true"] })),
        )
        .await;
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "no_owner", "{v}");

        // 6. The API process never held a lease, and never ran QEMU.
        let held = pg_row(
            &url,
            &format!("SELECT count(*) FROM {schema}.sandbox_owners WHERE host_id = 'api-1'"),
        )
        .await
        .map(|r| r.get::<_, i64>(0));
        assert_eq!(held, Some(0));
        let kids = children(api.pid());
        assert!(kids.is_empty(), "the API process has children: {kids:?}");
        let pids: Vec<_> = std::fs::read_dir(&api.run_dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().join("qemu.pid").exists())
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        assert!(pids.is_empty(), "{pids:?}");
    });
    eprintln!("whole test: {:?}", t0.elapsed());
}
