//! Moving a sandbox between two real `stratad`s (docs/move.md): two
//! daemons, each with its own data dir, pool, port and deployment key. A
//! running sandbox with a RAM-only marker (`/dev/shm`) and a live `sleep`
//! is pushed with `POST /v1/sandboxes/{id}/push` (`wake`) and a token of
//! the receiver's tenant; on the receiver it is owned by that tenant and
//! woken, with the marker and the process. A second push of the
//! same id (by `strata push` and by the API) is `409 conflict` and
//! changes nothing there. Then the return move: A pulls the copy back
//! into its source (`POST /v1/pulls`, the copy changed a little on B):
//! one incremental stream of about what changed on B, against the
//! snapshot A made, and the copy wakes on A with its memory.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;
use strata_testkit::error_chain;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_moves_to_another_daemon_with_its_memory() {
    let t0 = Instant::now();
    // The remote is on loopback: the source's operator lists it.
    let a = Daemon::start("[security]\npush_allow_private = [\"127.0.0.1\"]\n");
    let b = Daemon::start("");
    a.wait_template().await;
    let id = a.create(json!({})).await;
    let pid = a
        .sh(
            &id,
            "echo shm-marker-73 > /dev/shm/mark; \
             setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!",
        )
        .await;
    assert_eq!(pid.code, Some(0), "{}", pid.out());
    let pid = pid.out().trim().to_owned();
    assert!(pid.parse::<u32>().is_ok(), "pid {pid:?}");

    // The receiver's tenant: a developer token of it.
    let (remote, token) = b.tenant_token("t-moved", "developer").await;

    let started = Instant::now();
    let v = a
        .ok(
            "POST",
            &format!("/v1/sandboxes/{id}/push"),
            Some(json!({ "to": b.url, "token": token, "wake": true })),
            200,
        )
        .await;
    let took = started.elapsed();
    eprintln!(
        "push: {:?}, {} B in {} streams, {} held",
        took,
        v["bytes"],
        v["sent"].as_array().map(Vec::len).unwrap_or(0),
        v["held"]
    );
    assert_eq!(v["sandbox"]["state"], "hibernated", "{v}");
    // `wake`: the copy runs on the receiver once registered.
    assert_eq!(v["remote"]["state"], "running", "{v}");
    assert_eq!(v["remote"]["tenant"], "t-moved", "{v}");
    assert!(v["bytes"].as_u64().unwrap_or(0) > 1 << 20, "{v}");
    // The source stays, hibernated.
    let (_, src) = a.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(src["state"], "hibernated", "{src}");

    // On the receiver: the tenant's, woken (`wake`) with its memory.
    let (s, rec) = remote
        .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!((s, rec["state"].as_str()), (200, Some("running")), "{rec}");
    let out = remote
        .exec(
            &id,
            json!({ "cmd": ["sh", "-c", format!("cat /dev/shm/mark; test -d /proc/{pid} && tr '\\0' ' ' < /proc/{pid}/cmdline")] }),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(out.code, Some(0), "{} {:?}", out.out(), out.error);
    assert_eq!(out.out(), "shm-marker-73\nsleep 100000", "{:?}", out.error);

    // Another tenant of the receiver does not see it.
    let (other, _) = b.tenant_token("t-other", "developer").await;
    let (s, _) = other
        .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(s, 404);

    // A second push of the same id, through the CLI: refused (409
    // conflict), nothing changes there.
    let scratch = tempfile::Builder::new()
        .prefix("move-e2e-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let token_file = scratch.path().join("remote.token");
    std::fs::write(&token_file, format!("{token}\n")).expect("token file");
    let out = tokio::task::spawn_blocking({
        let (url, to, admin, id) = (a.url.clone(), b.url.clone(), a.token(), id.clone());
        move || {
            strata_testkit::run_strata(
                &strata_testkit::strata_bin(),
                &url,
                admin.as_deref(),
                &[
                    "push",
                    &id,
                    "--to",
                    &to,
                    "--token-file",
                    &token_file.display().to_string(),
                ],
            )
        }
    })
    .await
    .expect("strata push");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "second push succeeded: {stderr}");
    assert!(stderr.contains("conflict"), "{stderr}");
    // And through the API: 409 conflict with its code.
    let (s, e) = a
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/push"),
            Some(json!({ "to": b.url, "token": token })),
        )
        .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (409, Some("conflict")),
        "{e}"
    );
    let (_, rec) = remote
        .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(rec["state"], "running", "{rec}");

    // The return move: the copy on B changes a little in memory, then A
    // pulls it back into its source (hibernated there since the push).
    // A holds the snapshot it made and pushed, B names it by A's identity:
    // only what changed on B travels, received against a parent anchor of
    // A's own snapshot, and the copy wakes on A with both RAM markers and
    // the process.
    let out = remote
        .exec(
            &id,
            json!({ "cmd": ["sh", "-c", "echo back-marker-9 > /dev/shm/back"] }),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(out.code, Some(0), "{:?}", out.error);
    let started = Instant::now();
    let (s, back) = a
        .call(
            "POST",
            "/v1/pulls",
            Some(json!({ "from": b.url, "token": token, "sandbox": id, "wake": true })),
        )
        .await;
    let took = started.elapsed();
    assert!((200..300).contains(&s), "{s} {back}\n{}", a.logs());
    assert_eq!(back["updated"], true, "{back}");
    assert!(back["held"].as_u64().unwrap_or(0) >= 1, "{back}");
    let got = back["received"].as_array().cloned().unwrap_or_default();
    assert_eq!(got.len(), 1, "{back}");
    let (new, parent) = (
        got[0]["snapshot"].as_str().expect("snapshot").to_owned(),
        got[0]["parent"]
            .as_str()
            .expect("an incremental stream")
            .to_owned(),
    );
    let sent = got[0]["bytes"].as_u64().unwrap_or(u64::MAX);
    // What changed on B since the common parent: its new snapshot against
    // its received copy of A's (the bytes A holds).
    let pool_b = b.root.join("data/pool");
    let changed = strata_storage::written_bytes(
        &pool_b.join("snapshots").join(&new),
        Some(&pool_b.join("import").join(&parent)),
    )
    .expect("changed bytes");
    eprintln!(
        "return move (pull back): {took:?} with the wake, {sent} B for {changed} B changed since the common parent ({:.3}x; the push sent {} B)",
        sent as f64 / changed as f64,
        v["bytes"]
    );
    assert!(
        sent as f64 <= 1.2 * changed as f64,
        "{sent} B sent for {changed} B changed"
    );
    assert!(sent < v["bytes"].as_u64().unwrap_or(0) / 10, "{back}");
    assert!(
        a.root.join("data/pool/import").join(&parent).exists(),
        "no parent anchor on A"
    );
    assert_eq!(back["sandbox"]["state"], "running", "{back}");
    let out = a
        .sh(
            &id,
            &format!("cat /dev/shm/mark /dev/shm/back; test -d /proc/{pid} && echo alive"),
        )
        .await;
    assert_eq!(out.code, Some(0), "{}", out.out());
    assert_eq!(out.out(), "shm-marker-73\nback-marker-9\nalive");

    // Bad input is refused with a code: a URL that is not http(s), and a
    // garbage stream straight to the receiver.
    let (s, e) = a
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/push"),
            Some(json!({ "to": "file:///etc", "token": token })),
        )
        .await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("invalid_request")),
        "{e}"
    );
    let (s, body) = remote
        .raw(
            reqwest::Method::PUT,
            "/v1/imports/sb-garbage01/snapshots?snapshot=snap-garbage01",
            vec![0x42; 1 << 16],
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let body = String::from_utf8_lossy(&body);
    assert_eq!(s, 400, "{body}");
    assert!(body.contains("snapshot stream"), "{body}");
    eprintln!("total {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(600));
}
