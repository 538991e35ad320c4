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
//! 6. it never held a lease and never ran QEMU;
//! 7. the security routes of a sandbox and the terminal work through it:
//!    a sandbox policy written there is in force on host-a at once (a
//!    denied exec is refused by host-a), a call host-a holds for approval
//!    (an exec, an upload) is listed there and released by an approval
//!    sent there (forwarded to host-a: the exec's output, the uploaded
//!    file) or refused by a denial sent there, a tenant policy written
//!    there is in force on host-a within a second, the egress view is
//!    host-a's, and the WebSocket terminal opens
//!    through it (ticket and upgrade forwarded) and echoes a command's
//!    output.
//!
//! Auth is on: the API process starts with host-a's bootstrap token and
//! master key (the security store is on PostgreSQL); the forwarded
//! `Authorization` is the caller's own, re-checked by host-a.
//!
//! Needs `STRATA_TEST_PG_URL` (scripts/test-pg.sh); without it the test
//! prints a line and passes.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{api_conf, assert_ran_no_vm, host_conf, host_of, pg_row};
use common::Daemon;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::{client::IntoClientRequest, Message};

/// The sandbox layer the security part writes through the API process.
const POLICY: &str = r#"
[[rule]]
id = "no-date"
effect = "deny"
kind = "exec"
program = "date"
reason = "no dates here"

[[rule]]
id = "ask-seq"
effect = "approve"
kind = "exec"
program = "seq"
reason = "a human looks"

[[rule]]
id = "ask-held"
effect = "approve"
kind = "file_write"
path = "/tmp/held/**"
reason = "a human looks"
"#;

/// The tenant layer the security part writes through the API process.
const TENANT_POLICY: &str = r#"
[[rule]]
id = "no-uname"
effect = "deny"
kind = "exec"
program = "uname"

[[rule]]
id = "ask-create"
effect = "approve"
kind = "lifecycle"
op = "create"
"#;

/// Polls `GET /v1/approvals` on `d` until a pending request on sandbox
/// `id` (`""`: none, a create) is listed; answers its id and the host
/// that answered the listing.
async fn pending_approval(d: &Daemon, id: &str) -> (String, String) {
    let t = Instant::now();
    loop {
        let (st, host, v) = send(d, "GET", "/v1/approvals", None).await;
        assert_eq!(st, 200, "{v}");
        let found = v["items"].as_array().and_then(|a| {
            a.iter()
                .find(|i| i["sandbox"].as_str().unwrap_or_default() == id)
                .and_then(|i| i["id"].as_str())
                .map(str::to_owned)
        });
        if let Some(a) = found {
            return (a, host);
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no approval listed: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Approves `approval` through `d` with `token`: (status, `x-strata-host`, body).
async fn approve(d: &Daemon, token: &str, approval: &str) -> (u16, String, Value) {
    answer_as(d, token, approval, "approve").await
}

/// `POST /v1/approvals/{approval}/{verb}` through `d` with `token`.
async fn answer_as(d: &Daemon, token: &str, approval: &str, verb: &str) -> (u16, String, Value) {
    let r = d
        .api
        .client()
        .post(format!("{}/v1/approvals/{approval}/{verb}", d.url))
        .bearer_auth(token)
        .json(&json!({ "reason": "looked" }))
        .send()
        .await
        .expect("approve");
    let host = host_of(&r);
    let st = r.status().as_u16();
    (st, host, r.json().await.unwrap_or(Value::Null))
}

/// The security routes of sandbox `id` (host-a's) and its terminal,
/// everything through the API process `api`.
async fn security_and_terminal(api: &Daemon, id: &str) {
    let t0 = Instant::now();
    let e = api.sh(id, "mkdir -p /tmp/held").await;
    assert_eq!(e.code, Some(0), "{}", e.error);
    // A sandbox policy written through the API process (forwarded to the
    // owner) and read back.
    let r = api
        .request("PUT", &format!("/v1/sandboxes/{id}/policy"))
        .body(POLICY)
        .send()
        .await
        .expect("put policy");
    let host = host_of(&r);
    let st = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
    let (st, host, v) = send(api, "GET", &format!("/v1/sandboxes/{id}/policy"), None).await;
    assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
    assert!(
        v["toml"].as_str().is_some_and(|t| t.contains("no-date")),
        "{v}"
    );
    // In force on host-a at once: the next call it denies.
    let e = api.exec(id, &["date"]).await;
    assert_eq!(e.status, 403, "{}", e.error);
    assert_eq!(e.error["error"]["code"], "policy_denied", "{}", e.error);
    assert!(e.error.to_string().contains("no-date"), "{}", e.error);

    // An exec host-a holds for approval: listed by the API process (read
    // from PostgreSQL), approved there by an approver (the requester may
    // not answer its own request), the answer forwarded to host-a, whose
    // waiting exec then runs and streams its output.
    let (_, approver) = api.tenant_token("default", "approver").await;
    let t = Instant::now();
    let answer = async {
        let (aid, host) = pending_approval(api, id).await;
        assert_eq!(host, "api-1");
        let (st, host, v) = approve(api, &approver, &aid).await;
        assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
        assert_eq!(v["status"]["status"], "approved", "{v}");
        aid
    };
    let (e, aid) = tokio::join!(api.exec(id, &["seq", "3"]), answer);
    assert_eq!(e.status, 200, "{}", e.error);
    assert_eq!(e.code, Some(0), "{}", e.error);
    assert_eq!(e.out(), "1\n2\n3");
    eprintln!(
        "held exec approved through the API process: {:?}",
        t.elapsed()
    );
    let (st, _, v) = send(api, "GET", &format!("/v1/approvals/{aid}"), None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["status"]["status"], "approved", "{v}");
    assert!(!v["consumed_at"].is_null(), "the approval was used: {v}");
    // Answered once: a second answer is a conflict.
    let (st, _, v) = approve(api, &approver, &aid).await;
    assert_eq!(st, 409, "{v}");
    // A denial sent to the API process refuses the waiting exec on host-a.
    let deny = async {
        let (aid, _) = pending_approval(api, id).await;
        let (st, host, v) = answer_as(api, &approver, &aid, "deny").await;
        assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
        assert_eq!(v["status"]["status"], "denied", "{v}");
        aid
    };
    let (e, aid) = tokio::join!(api.exec(id, &["seq", "1"]), deny);
    assert_eq!(e.status, 403, "{}", e.error);
    assert!(
        e.error
            .to_string()
            .contains(&format!("approval {aid} denied by")),
        "{}",
        e.error
    );

    // A held upload: its bytes wait in host-a's data dir; the approval sent
    // to the API process releases them into the guest.
    let blob: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    let upload = async {
        let r = api
            .request(
                "PUT",
                &format!("/v1/sandboxes/{id}/files?path=/tmp/held/a.bin"),
            )
            .body(blob.clone())
            .send()
            .await
            .expect("upload");
        let st = r.status().as_u16();
        (st, r.text().await.unwrap_or_default())
    };
    let answer = async {
        let (aid, _) = pending_approval(api, id).await;
        let (st, host, v) = approve(api, &approver, &aid).await;
        assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
    };
    let ((st, body), ()) = tokio::join!(upload, answer);
    assert!(st == 200 || st == 201, "{st} {body}");
    let (st, got) = api
        .raw(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/tmp/held/a.bin"),
            vec![],
        )
        .await;
    assert_eq!(st, 200);
    assert!(got == blob, "the held upload differs ({} bytes)", got.len());

    // The egress view is the owner's memory: host-a's answer.
    let (st, host, v) = send(api, "GET", &format!("/v1/sandboxes/{id}/egress"), None).await;
    assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
    assert!(v.get("tunnels").is_some(), "{v}");

    // The layer cleared through the API process: host-a stops applying it
    // (an interactive shell meets every exec deny rule: it reads its
    // commands from stdin).
    let r = api
        .request("PUT", &format!("/v1/sandboxes/{id}/policy"))
        .body("# no rules")
        .send()
        .await
        .expect("clear policy");
    assert_eq!(r.status().as_u16(), 200);
    let e = api.exec(id, &["date"]).await;
    assert_eq!(e.code, Some(0), "{}", e.error);

    // A tenant policy written through the API process (its own answer: a
    // record in PostgreSQL) is in force on host-a within its cache's
    // lifetime in a cluster (security::SHARED_POLICY_TTL, 1 s), then
    // cleared the same way.
    let tenant = |toml: &'static str| async move {
        let r = api
            .request("PUT", "/v1/policy")
            .body(toml)
            .send()
            .await
            .expect("put tenant policy");
        assert_eq!((r.status().as_u16(), host_of(&r).as_str()), (200, "api-1"));
    };
    tenant(TENANT_POLICY).await;
    let t = Instant::now();
    loop {
        let e = api.exec(id, &["uname"]).await;
        if e.status == 403 {
            assert!(e.error.to_string().contains("no-uname"), "{}", e.error);
            break;
        }
        assert_eq!(e.code, Some(0), "{}", e.error);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the tenant policy is not in force on host-a"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("tenant policy in force on host-a after {:?}", t.elapsed());
    // A create held by it: the API process places it and leaves the hold
    // to host-a (one approval, not one per process); its request has no
    // sandbox, so the approval sent to the API process is answered there,
    // in PostgreSQL, and host-a's waiting create reads it from there.
    let t = Instant::now();
    let create = async {
        let r = api
            .request("POST", "/v1/sandboxes")
            .json(&json!({}))
            .send()
            .await
            .expect("create");
        let host = host_of(&r);
        let st = r.status().as_u16();
        (st, host, r.json::<Value>().await.unwrap_or(Value::Null))
    };
    let answer = async {
        let (aid, _) = pending_approval(api, "").await;
        let (st, host, v) = approve(api, &approver, &aid).await;
        assert_eq!((st, host.as_str()), (200, "api-1"), "{v}");
        aid
    };
    let ((st, host, v), aid) = tokio::join!(create, answer);
    assert_eq!((st, host.as_str()), (201, "host-a"), "{v}");
    let (_, _, list) = send(api, "GET", "/v1/approvals?status=all", None).await;
    let creates: Vec<_> = list["items"]
        .as_array()
        .map(|a| a.iter().filter(|i| i["sandbox"].is_null()).collect())
        .unwrap_or_default();
    assert_eq!(creates.len(), 1, "one approval per create: {list}");
    assert_eq!(creates[0]["id"], aid.as_str());
    eprintln!(
        "held create approved through the API process: {:?}",
        t.elapsed()
    );
    let created = v["id"].as_str().expect("id");
    let (st, _, v) = send(api, "DELETE", &format!("/v1/sandboxes/{created}"), None).await;
    assert!(st == 200 || st == 204, "{st} {v}");
    tenant("# no rules").await;
    let t = Instant::now();
    while api.exec(id, &["uname"]).await.status != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the tenant policy is still in force on host-a"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The terminal: a ticket (host-a's), then the WebSocket through the
    // API process (the upgrade forwarded to host-a, bytes both ways).
    let (st, host, v) = send(
        api,
        "POST",
        &format!("/v1/sandboxes/{id}/terminal"),
        Some(json!({})),
    )
    .await;
    assert_eq!((st, host.as_str()), (200, "host-a"), "{v}");
    let ticket = v["ticket"].as_str().expect("ticket");
    let addr = api.url.trim_start_matches("http://").to_owned();
    let mut r = format!("ws://{addr}/v1/sandboxes/{id}/terminal?ticket={ticket}")
        .into_client_request()
        .expect("request");
    r.headers_mut()
        .insert("origin", format!("http://{addr}").parse().expect("origin"));
    let (mut ws, resp) = tokio_tungstenite::connect_async(r)
        .await
        .expect("the terminal through the API process");
    assert_eq!(
        resp.headers()
            .get("x-strata-host")
            .and_then(|v| v.to_str().ok()),
        Some("host-a")
    );
    ws.send(Message::Binary(b"echo term-$((6*7))\nexit\n".to_vec()))
        .await
        .expect("stdin");
    let mut out = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(m) = ws.next().await {
            match m.expect("frame") {
                Message::Binary(b) => out.extend_from_slice(&b),
                Message::Text(t) => return t,
                _ => {}
            }
        }
        String::new()
    })
    .await
    .expect("the terminal ended");
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("term-42"), "{text:?}");
    assert_eq!(end, r#"{"exit":0}"#, "{text:?}");
    eprintln!(
        "security routes and terminal through the API process: {:?}",
        t0.elapsed()
    );
}

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

        // 7. A sandbox's security routes and its terminal.
        security_and_terminal(&api, &id).await;

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
        assert_ran_no_vm(api.pid(), &api.run_dir);
    });
    eprintln!("whole test: {:?}", t0.elapsed());
}
