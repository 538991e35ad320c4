//! Moving a sandbox between two real `stratad`s (docs/move.md): two
//! daemons, each with its own data dir, pool, port and deployment key. A
//! running sandbox with a RAM-only marker (`/dev/shm`) and a live `sleep`
//! is pushed with `POST /v1/sandboxes/{id}/push` (`wake`) and a token of
//! the receiver's tenant; on the receiver it is owned by that tenant and
//! woken, with the marker and the process. A second push of the
//! same id (by `strata push` and by the API) is `409 conflict` and
//! changes nothing there.

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
