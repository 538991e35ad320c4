//! Pause without memory (E2B `sandbox.pause(keep_memory=False)`), end to
//! end: a real `stratad` with the E2B door, a real TCG guest.
//!
//! - `POST /sandboxes/{id}/pause {"memory": false}`: the sandbox is
//!   hibernated; its hibernation snapshot (listed by `/v1`) is a disk-only
//!   state: `meta.json` says `disk_only`, no `mem`, no `device.state`;
//! - `connect` cold-boots it: same id, same envd token, the file written
//!   before the pause is there, `/proc/sys/kernel/random/boot_id` changed,
//!   the hostname is the sandbox id again;
//! - the cold-booted sandbox hibernates with memory and wakes as before
//!   (same boot id after that wake); `/v1` `hibernate {"memory": false}`
//!   does the same as the E2B call; an unknown field is `400`.
//!
//! Cleanup: the daemon and its QEMUs are killed by pid, the pool unmounted
//! (`strata_testkit::teardown`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod guest_door;
use guest_door::GuestDoor as Daemon;

const KEY: &str = "e2b_pause_default_key";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_without_memory_cold_boots_from_the_disk() {
    let d = Daemon::start("spz-", None, &[KEY], false);
    d.wait_template().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()
        .unwrap();
    let e2b = |m: reqwest::Method, path: String| {
        http.request(m, format!("{}{path}", d.url))
            .header("X-API-KEY", KEY)
    };
    let r = e2b(reqwest::Method::POST, "/sandboxes".into())
        .json(&json!({"templateID": "base", "timeout": 900}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let created: Value = r.json().await.unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    let token = created["envdAccessToken"].clone();

    let boot_before = d
        .sh(
            &id,
            "echo persisted > /root/fs-only-marker.txt && cat /proc/sys/kernel/random/boot_id",
        )
        .await;
    assert_eq!(boot_before.trim().len(), 36, "{boot_before:?}");

    // An unknown field of the /v1 body: 400, nothing changes.
    let (s, v) = d
        .v1(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/hibernate"),
            Some(json!({"memroy": false})),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(d.state(&id).await, "running");

    // E2B's filesystem-only pause.
    let t0 = Instant::now();
    let r = e2b(reqwest::Method::POST, format!("/sandboxes/{id}/pause"))
        .json(&json!({"memory": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204, "{}", r.text().await.unwrap());
    eprintln!("pause without memory: {:?}", t0.elapsed());
    assert_eq!(d.state(&id).await, "hibernated");

    // Its hibernation snapshot: strata's own, a disk-only state.
    let (s, v) = d
        .v1(
            reqwest::Method::GET,
            &format!("/v1/sandboxes/{id}/snapshots"),
            None,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let snap = v["items"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .find(|s| s["kind"] == "hibernate")
        .unwrap_or_else(|| panic!("no hibernate snapshot: {v}"));
    let dir = d
        .root
        .join("data/pool/snapshots")
        .join(snap["id"].as_str().unwrap());
    let meta: Value =
        serde_json::from_slice(&std::fs::read(dir.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["disk_only"], true, "{meta}");
    assert_eq!(meta["format_version"], 2, "{meta}");
    assert!(!dir.join("mem").exists(), "a disk-only state keeps no RAM");
    assert!(!dir.join("device.state").exists());
    assert!(dir.join("disk.img").exists());

    // connect cold-boots it: same id, same token, the file, a new boot.
    let t0 = Instant::now();
    let r = e2b(reqwest::Method::POST, format!("/sandboxes/{id}/connect"))
        .json(&json!({"timeout": 900}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let resumed: Value = r.json().await.unwrap();
    assert_eq!(status, 201, "{resumed}\n{}", d.logs());
    eprintln!("connect (cold boot): {:?}", t0.elapsed());
    assert_eq!(resumed["sandboxID"], id.as_str());
    assert_eq!(resumed["envdAccessToken"], token);
    assert_eq!(d.state(&id).await, "running");
    let after = d
        .sh(
            &id,
            "cat /root/fs-only-marker.txt; cat /proc/sys/kernel/random/boot_id; hostname",
        )
        .await;
    let lines: Vec<&str> = after.lines().collect();
    assert_eq!(lines.len(), 3, "{after:?}");
    assert_eq!(lines[0], "persisted");
    assert_ne!(lines[1], boot_before.trim(), "the guest did not reboot");
    assert_eq!(lines[2], id, "hostname after the cold boot");
    let boot_cold = lines[1].to_owned();

    // The cold-booted sandbox hibernates with memory and wakes in place.
    let (s, v) = d
        .v1(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/hibernate"),
            Some(json!({})),
        )
        .await;
    assert!(s < 300, "hibernate: {s} {v}");
    let boot = d.sh(&id, "cat /proc/sys/kernel/random/boot_id").await;
    assert_eq!(boot.trim(), boot_cold, "a memory wake keeps the boot");

    // /v1 without memory: the same cold boot.
    let (s, v) = d
        .v1(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/hibernate"),
            Some(json!({"memory": false})),
        )
        .await;
    assert!(s < 300, "hibernate without memory: {s} {v}");
    assert_eq!(d.state(&id).await, "hibernated");
    let out = d
        .sh(
            &id,
            "cat /root/fs-only-marker.txt; cat /proc/sys/kernel/random/boot_id",
        )
        .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first().copied(), Some("persisted"), "{out:?}");
    assert_ne!(lines.get(1).copied(), Some(boot_cold.as_str()), "{out:?}");
}
