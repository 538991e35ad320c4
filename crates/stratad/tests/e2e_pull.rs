//! Pulling a sandbox from another real `stratad` (docs/move.md): daemon B
//! owns a running sandbox with a RAM-only marker (`/dev/shm`) and a live
//! `sleep`; daemon A (the laptop: it reaches B, B never reaches it) pulls it
//! with `POST /v1/pulls` under a developer token of its own tenant, given a
//! token of B. The copy is hibernated on A, owned by A's caller's tenant; a
//! second pull after one more snapshot on B is incremental (through `strata
//! pull --wake`), and the copy wakes on A with the marker, a second marker
//! written on B in between, and the process. A wrong remote token is `403`
//! and leaves nothing on A; a `from` on a private address A's operator did
//! not list is `400`; a parent that is not one of the sandbox's own
//! snapshots is `400` on B.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;
use strata_testkit::error_chain;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_is_pulled_from_another_daemon_with_its_memory() {
    let t0 = Instant::now();
    // A pulls from B on loopback: A's operator lists the address.
    let a = Daemon::start("[security]\npush_allow_private = [\"127.0.0.1\"]\n");
    let b = Daemon::start("");
    b.wait_template().await;
    let id = b.create(json!({})).await;
    let pid = b
        .sh(
            &id,
            "echo shm-marker-41 > /dev/shm/mark; \
             setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!",
        )
        .await;
    assert_eq!(pid.code, Some(0), "{}", pid.out());
    let pid = pid.out().trim().to_owned();
    assert!(pid.parse::<u32>().is_ok(), "pid {pid:?}");
    let remote_token = b.token().expect("B's admin token");

    // The local caller: a developer of A's tenant t-here.
    let (here, here_token) = a.tenant_token("t-here", "developer").await;
    let pull = |token: &str, from: &str| json!({ "from": from, "token": token, "sandbox": id });

    // A wrong remote token: 403 (B answered 401), nothing on A, and B's
    // sandbox untouched (still running: the export never ran).
    let (s, e) = here
        .json(
            reqwest::Method::POST,
            "/v1/pulls",
            Some(pull("strata_not-a-token", &b.url)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{e}"
    );
    let (s, _) = a.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 404, "a refused pull left a sandbox on A");
    let (_, src) = b.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(src["state"], "running", "{src}");

    // A `from` on a private address A's operator did not list: 400, before
    // any connection.
    let (s, e) = here
        .json(
            reqwest::Method::POST,
            "/v1/pulls",
            Some(pull(&remote_token, "http://127.0.0.2:9")),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("invalid_request")),
        "{e}"
    );

    // The pull: B hibernates it, A receives and registers it, hibernated,
    // owned by t-here.
    let started = Instant::now();
    let (s, v) = here
        .json(
            reqwest::Method::POST,
            "/v1/pulls",
            Some(pull(&remote_token, &b.url)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    let took = started.elapsed();
    assert_eq!(s, 201, "{v}");
    let first = v["bytes"].as_u64().unwrap_or(0);
    eprintln!(
        "pull 1: {took:?}, {first} B in {} streams, {} held",
        v["received"].as_array().map(Vec::len).unwrap_or(0),
        v["held"]
    );
    assert_eq!(v["sandbox"]["id"], id.as_str(), "{v}");
    assert_eq!(v["sandbox"]["state"], "hibernated", "{v}");
    assert_eq!(v["sandbox"]["tenant"], "t-here", "{v}");
    assert_eq!(v["remote"]["state"], "hibernated", "{v}");
    assert_eq!(v["updated"], false, "{v}");
    assert!(first > 1 << 20, "{v}");
    let snap = v["received"][0]["snapshot"]
        .as_str()
        .expect("a snapshot")
        .to_owned();
    let (_, src) = b.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(src["state"], "hibernated", "{src}");

    // B streams only its own snapshots against its own parents.
    let (s, body) = b
        .raw(
            reqwest::Method::GET.as_str(),
            &format!("/v1/sandboxes/{id}/export?snapshot={snap}&parent=00000000-0000-0000-0000-000000000001"),
            Vec::new(),
        )
        .await;
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&body));
    let (s, _) = b
        .raw(
            reqwest::Method::GET.as_str(),
            &format!("/v1/sandboxes/{id}/export?snapshot=snap-zzzzzzzz"),
            Vec::new(),
        )
        .await;
    assert!(s == 400 || s == 404, "{s}");

    // One more snapshot on B: it wakes there, writes a second marker, and
    // the next pull hibernates it again.
    b.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/resume"),
        Some(json!({})),
        200,
    )
    .await;
    let out = b.sh(&id, "echo shm-marker-42 > /dev/shm/mark2").await;
    assert_eq!(out.code, Some(0), "{}", out.out());

    // The second pull, through `strata pull --wake`: incremental.
    let scratch = tempfile::Builder::new()
        .prefix("pull-e2e-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let token_file = scratch.path().join("remote.token");
    std::fs::write(&token_file, format!("{remote_token}\n")).expect("token file");
    let started = Instant::now();
    let out = tokio::task::spawn_blocking({
        let (url, from, tok, id, tf) = (
            a.url.clone(),
            b.url.clone(),
            here_token.clone(),
            id.clone(),
            token_file.display().to_string(),
        );
        move || {
            strata_testkit::run_strata(
                &strata_testkit::strata_bin(),
                &url,
                Some(&tok),
                &[
                    "--json",
                    "pull",
                    &id,
                    "--from",
                    &from,
                    "--token-file",
                    &tf,
                    "--wake",
                ],
            )
        }
    })
    .await
    .expect("strata pull");
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON");
    let second = v["bytes"].as_u64().unwrap_or(u64::MAX);
    eprintln!(
        "pull 2: {took:?} (with the wake), {second} B in {} streams, {} held (first {first} B)",
        v["received"].as_array().map(Vec::len).unwrap_or(0),
        v["held"]
    );
    assert_eq!(v["updated"], true, "{v}");
    assert_eq!(v["received"].as_array().map(Vec::len), Some(1), "{v}");
    assert!(v["held"].as_u64().unwrap_or(0) >= 1, "{v}");
    assert!(
        second < first / 10,
        "second pull {second} B, first {first} B"
    );
    assert_eq!(v["sandbox"]["state"], "running", "{v}");

    // Awake on A: both markers and the process.
    let out = here
        .exec(
            &id,
            json!({ "cmd": ["sh", "-c", format!("cat /dev/shm/mark /dev/shm/mark2; test -d /proc/{pid} && tr '\\0' ' ' < /proc/{pid}/cmdline")] }),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(out.code, Some(0), "{} {:?}", out.out(), out.error);
    assert_eq!(
        out.out(),
        "shm-marker-41\nshm-marker-42\nsleep 100000",
        "{:?}",
        out.error
    );

    // The copy runs here now: pulling again is refused (409) before B is
    // asked anything.
    let (s, e) = here
        .json(
            reqwest::Method::POST,
            "/v1/pulls",
            Some(pull(&remote_token, &b.url)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (409, Some("invalid_state")),
        "{e}"
    );
    // Another tenant of A: the id is taken (409 conflict), its copy
    // invisible.
    let (other, _) = a.tenant_token("t-other", "developer").await;
    let (s, e) = other
        .json(
            reqwest::Method::POST,
            "/v1/pulls",
            Some(pull(&remote_token, &b.url)),
        )
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (409, Some("conflict")),
        "{e}"
    );
    let (s, _) = other
        .json(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert_eq!(s, 404);
    eprintln!("total {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(900));
}
