//! End-to-end through the HTTP API of a real `stratad` process with real
//! guests (QEMU under TCG, btrfs pool on a loop device): the whole
//! lifecycle, rolling snapshots and retention, rewind by time, idle
//! hibernation and wake, a VM killed behind the daemon's back, bad input.
//!
//! One daemon (and its default template, built on its first start) is
//! shared by the tests of this file; the crash tests have their own
//! (`e2e_crash.rs`). All requests run on one static tokio runtime.

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};
use strata_testkit::teardown::{alive, qemu_pids};

/// The tokio runtime every test of this file runs on.
fn rt() -> &'static tokio::runtime::Runtime {
    strata_testkit::tokio_rt()
}

/// Retention of the shared daemon: every snapshot of the last 5 s, one per
/// 5 s bucket for a minute, nothing older (horizon 1 min).
const RETENTION: &str = "5s:0,1m:5s";

fn daemon() -> &'static Daemon {
    static D: OnceLock<Daemon> = OnceLock::new();
    D.get_or_init(|| {
        let d = Daemon::start(&format!("gc_sweep_interval = \"5s\"\n{}", retention_toml()));
        rt().block_on(d.wait_template());
        d
    })
}

fn retention_toml() -> String {
    let mut s = String::new();
    for t in RETENTION.split(',') {
        let (w, e) = t.split_once(':').expect("tier");
        s.push_str(&format!(
            "[[retention.tiers]]\nwithin = \"{w}\"\nevery = \"{e}\"\n"
        ));
    }
    // Tables must come last in the TOML; `[default_size]` follows.
    s
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

async fn snapshots(d: &Daemon, id: &str) -> Vec<Value> {
    let v = d
        .ok("GET", &format!("/v1/sandboxes/{id}/snapshots"), None, 200)
        .await;
    v["items"].as_array().expect("items").clone()
}

async fn delete(d: &Daemon, id: &str) {
    let v = d
        .ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200)
        .await;
    assert_eq!(v["state"], "deleted", "{v}");
    let (s, v) = d.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 404, "{v}");
}

#[test]
fn lifecycle_create_exec_files_snapshot_rewind_fork_pause_hibernate_delete() {
    let d = daemon();
    rt().block_on(async {
        // Create without a template: the default one, its size.
        let t0 = Instant::now();
        let a = d.create(json!({ "labels": { "test": "lifecycle" } })).await;
        let rec = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(rec["template"], "tpl-default");
        assert_eq!(
            rec["size"],
            json!({"vcpus":1,"memory_mib":256,"disk_gib":2})
        );
        let pid_a = rec["pid"].as_u64().expect("pid") as u32;
        assert!(alive(pid_a));
        eprintln!("create: {:?}", t0.elapsed());

        // Exec: output streams as it comes, then the exit code.
        let e = d
            .sh(
                &a,
                "echo first; sleep 1.5; echo second; echo oops >&2; exit 7",
            )
            .await;
        assert_eq!(e.status, 200, "{:?}", e.error);
        assert_eq!(e.code, Some(7));
        assert_eq!(e.out(), "first\nsecond");
        assert_eq!(String::from_utf8_lossy(&e.stderr).trim(), "oops");
        let first = e.stdout_at[0];
        let exit = e.exit_at.expect("exit line");
        assert!(
            exit >= first + Duration::from_millis(1000),
            "first line at {first:?} should come well before the exit at {exit:?}"
        );

        // Files.
        d.ok(
            "POST",
            &format!("/v1/sandboxes/{a}/files/mkdir?path=/work/a/b&parents=true"),
            None,
            201,
        )
        .await;
        let blob: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let (s, body) = d
            .raw(
                "PUT",
                &format!("/v1/sandboxes/{a}/files?path=/work/a/b/blob.bin&mode=600"),
                blob.clone(),
            )
            .await;
        assert!(
            s == 200 || s == 201,
            "{s} {}",
            String::from_utf8_lossy(&body)
        );
        let (s, got) = d
            .raw(
                "GET",
                &format!("/v1/sandboxes/{a}/files?path=/work/a/b/blob.bin"),
                vec![],
            )
            .await;
        assert_eq!(s, 200);
        assert!(got == blob, "download differs ({} bytes)", got.len());
        let st = d
            .ok(
                "GET",
                &format!("/v1/sandboxes/{a}/files/stat?path=/work/a/b/blob.bin"),
                None,
                200,
            )
            .await;
        assert_eq!(st["size"], 200_000, "{st}");
        assert_eq!(st["kind"], "file");
        assert_eq!(st["mode"].as_u64().map(|m| m & 0o777), Some(0o600), "{st}");
        let ls = d
            .ok(
                "GET",
                &format!("/v1/sandboxes/{a}/files/list?path=/work/a/b"),
                None,
                200,
            )
            .await;
        assert!(ls.to_string().contains("blob.bin"), "{ls}");
        d.ok(
            "DELETE",
            &format!("/v1/sandboxes/{a}/files?path=/work/a/b/blob.bin"),
            None,
            200,
        )
        .await;
        let (s, v) = d
            .call(
                "GET",
                &format!("/v1/sandboxes/{a}/files/stat?path=/work/a/b/blob.bin"),
                None,
            )
            .await;
        assert_eq!(s, 404, "{v}");
        let (s, v) = d
            .call(
                "DELETE",
                &format!("/v1/sandboxes/{a}/files?path=/work/a"),
                None,
            )
            .await;
        assert_ne!(s, 200, "non-empty dir without recursive: {v}");
        d.ok(
            "DELETE",
            &format!("/v1/sandboxes/{a}/files?path=/work/a&recursive=true"),
            None,
            200,
        )
        .await;

        // Snapshot, change, rewind by id.
        assert_eq!(d.sh(&a, "echo one > /root/state").await.code, Some(0));
        let s1 = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{a}/snapshots"),
                Some(json!({"label":"v1"})),
                201,
            )
            .await;
        assert_eq!(s1["status"], "ready", "{s1}");
        assert_eq!(s1["kind"], "manual");
        let s1 = s1["id"].as_str().expect("id").to_owned();
        assert_eq!(d.sh(&a, "echo two > /root/state").await.code, Some(0));
        let r = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"to": s1})),
                200,
            )
            .await;
        assert_eq!(r["rewound_to"]["id"], s1.as_str());
        assert_eq!(r["pre_rewind_snapshot"]["kind"], "pre_rewind", "{r}");
        assert_eq!(d.sh(&a, "cat /root/state").await.out(), "one");

        // Rewind by time.
        assert_eq!(d.sh(&a, "echo three > /root/state").await.code, Some(0));
        let s2 = d
            .ok("POST", &format!("/v1/sandboxes/{a}/snapshots"), None, 201)
            .await;
        let s2 = s2["id"].as_str().expect("id").to_owned();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(d.sh(&a, "echo four > /root/state").await.code, Some(0));
        let r = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"ago": "2s"})),
                200,
            )
            .await;
        assert_eq!(r["rewound_to"]["id"], s2.as_str(), "{r}");
        assert_eq!(d.sh(&a, "cat /root/state").await.out(), "three");

        // Fork from a snapshot and from the live sandbox.
        let b = d
            .ok(
                "POST",
                &format!("/v1/snapshots/{s1}/fork"),
                Some(json!({})),
                201,
            )
            .await;
        let b = b["id"].as_str().expect("id").to_owned();
        assert_eq!(d.sh(&b, "cat /root/state").await.out(), "one");
        let c = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{a}/fork"),
                Some(json!({})),
                201,
            )
            .await;
        assert!(c["source_snapshot"].is_string(), "{c}");
        let c = c["id"].as_str().expect("id").to_owned();
        assert_eq!(d.sh(&c, "cat /root/state").await.out(), "three");
        assert_eq!(d.sh(&c, "echo child > /root/state").await.code, Some(0));
        assert_eq!(d.sh(&a, "cat /root/state").await.out(), "three");
        assert_eq!(
            d.sh(&c, "hostname").await.out(),
            c,
            "a fork takes its own identity"
        );
        // Rewind to another sandbox's snapshot: refused, nothing changes.
        let (s, v) = d
            .call(
                "POST",
                &format!("/v1/sandboxes/{c}/rewind"),
                Some(json!({"to": s1})),
            )
            .await;
        assert_eq!((s, code(&v)), (400, "invalid_request"), "{v}");
        assert_eq!(d.sh(&c, "cat /root/state").await.out(), "child");
        delete(d, &b).await;
        delete(d, &c).await;

        // Pause / resume.
        let v = d
            .ok("POST", &format!("/v1/sandboxes/{a}/pause"), None, 200)
            .await;
        assert_eq!(v["state"], "paused");
        let e = d.exec(&a, &["true"]).await;
        assert_eq!(e.status, 409, "exec on a paused sandbox: {:?}", e.error);
        let v = d
            .ok("POST", &format!("/v1/sandboxes/{a}/resume"), None, 200)
            .await;
        assert_eq!(v["state"], "running");
        assert_eq!(d.sh(&a, "cat /root/state").await.out(), "three");

        // Hibernate: the VM ends; exec wakes it with its state.
        let pid_before = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        let v = d
            .ok("POST", &format!("/v1/sandboxes/{a}/hibernate"), None, 200)
            .await;
        assert_eq!(v["state"], "hibernated", "{v}");
        assert!(v["pid"].is_null());
        let t = Instant::now();
        while alive(pid_before) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "QEMU {pid_before} still runs"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let e = d.sh(&a, "cat /root/state").await;
        assert_eq!(
            (e.status, e.out()),
            (200, "three".to_owned()),
            "{:?}",
            e.error
        );
        let v = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(v["state"], "running");
        let new_pid = v["pid"].as_u64().expect("pid") as u32;
        assert_ne!(new_pid, pid_before);

        // The history: kinds as taken.
        let kinds: Vec<String> = snapshots(d, &a)
            .await
            .iter()
            .map(|s| s["kind"].as_str().unwrap_or("").to_owned())
            .collect();
        for k in ["manual", "pre_rewind", "fork", "hibernate"] {
            assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
        }

        // Delete: the VM ends, the snapshots go.
        delete(d, &a).await;
        let t = Instant::now();
        while alive(new_pid) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "QEMU {new_pid} still runs"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (s, _) = d.call("GET", &format!("/v1/snapshots/{s1}"), None).await;
        assert_eq!(s, 404);
    });
}

#[test]
fn rolling_snapshots_on_schedule_pruned_by_retention_and_rewind_by_time() {
    let d = daemon();
    rt().block_on(async {
        let a = d
            .create(json!({ "snapshot_interval": "2s", "labels": { "test": "rolling" } }))
            .await;
        assert_eq!(d.sh(&a, "echo start > /root/r").await.code, Some(0));
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(16)).await;
        // Every rolling snapshot taken is in the journal; the listing keeps
        // only what retention leaves.
        let ev = d
            .ok("GET", &format!("/v1/sandboxes/{a}/events"), None, 200)
            .await;
        let taken: Vec<&Value> = ev["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter(|e| e["op"] == "snapshot" && e["phase"] == "done")
            .collect();
        // Retention runs after each rolling snapshot that pauses the guest
        // (an unchanged guest's are `same_as` records, which do not) and on
        // the 5 s sweep: what crossed a tier boundary is pruned at the next
        // pass, so the listing is judged once a pass had the time to run.
        let bucketed = |listed: &[Value]| {
            // What is kept follows the tiers: all younger than 5 s, older
            // ones at most one per 5 s bucket (epoch-aligned).
            let now = chrono::Utc::now();
            let mut buckets = std::collections::HashSet::new();
            listed.iter().all(|s| {
                let at: chrono::DateTime<chrono::Utc> = s["created_at"]
                    .as_str()
                    .expect("created_at")
                    .parse()
                    .expect("time");
                (now - at).num_milliseconds() <= 6_000 || buckets.insert(at.timestamp() / 5)
            })
        };
        let t_list = Instant::now();
        let listed: Vec<Value> = loop {
            let listed: Vec<Value> = snapshots(d, &a)
                .await
                .into_iter()
                .filter(|s| s["kind"] == "rolling" && s["status"] == "ready")
                .collect();
            if bucketed(&listed) {
                break listed;
            }
            assert!(
                t_list.elapsed() < Duration::from_secs(12),
                "two rolling snapshots kept in one 5 s bucket past a retention pass: {listed:?}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        eprintln!(
            "rolling: {} taken in {:?}, {} kept",
            taken.len(),
            t0.elapsed(),
            listed.len()
        );
        // One every 2 s: ~8 in 16 s (TCG on a busy host: allow slack).
        assert!(
            (5..=10).contains(&taken.len()),
            "{} rolling snapshots in 16 s at a 2 s interval",
            taken.len()
        );
        // Of those the journal had when it was read (the listing may hold
        // newer ones taken while it waited for a pass).
        let kept_of_taken = taken
            .iter()
            .filter_map(|e| e["detail"].as_str())
            .filter(|id| listed.iter().any(|s| s["id"].as_str() == Some(id)))
            .count();
        assert!(
            kept_of_taken < taken.len(),
            "retention pruned nothing: {kept_of_taken} kept of {}",
            taken.len()
        );
        // A pruned snapshot is gone from the API too.
        let kept: std::collections::HashSet<&str> =
            listed.iter().filter_map(|s| s["id"].as_str()).collect();
        let pruned = taken
            .iter()
            .filter_map(|e| e["detail"].as_str())
            .find(|id| !kept.contains(id))
            .expect("a pruned snapshot");
        let (s, _) = d
            .call("GET", &format!("/v1/snapshots/{pruned}"), None)
            .await;
        assert_eq!(s, 404, "{pruned}");

        // Rewind by time to a rolling snapshot.
        assert_eq!(d.sh(&a, "echo later > /root/r").await.code, Some(0));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"ago": "4s"})),
                200,
            )
            .await;
        assert_eq!(r["rewound_to"]["kind"], "rolling", "{r}");
        assert_eq!(d.sh(&a, "cat /root/r").await.out(), "start");
        // Beyond retention: a clear 404 naming the horizon.
        let (s, v) = d
            .call(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"ago": "2h"})),
            )
            .await;
        assert_eq!((s, code(&v)), (404, "not_found"), "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains("retention") && msg.contains("1m"), "{msg}");
        delete(d, &a).await;
    });
}

#[test]
fn idle_sandbox_hibernates_and_wakes_on_request() {
    let d = daemon();
    rt().block_on(async {
        let a = d
            .create(json!({ "idle_timeout": "3s", "labels": { "test": "idle" } }))
            .await;
        assert_eq!(d.sh(&a, "echo kept > /root/idle").await.code, Some(0));
        let pid = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        // GET does not count as activity, so polling does not keep it awake.
        let v = d
            .wait_for(&a, Duration::from_secs(40), |v| v["state"] == "hibernated")
            .await;
        assert!(v["pid"].is_null(), "{v}");
        let t = Instant::now();
        while alive(pid) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "QEMU {pid} still runs"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Any guest request wakes it, with its state.
        let t = Instant::now();
        let e = d.sh(&a, "cat /root/idle").await;
        eprintln!("wake + exec: {:?}", t.elapsed());
        assert_eq!(
            (e.status, e.out()),
            (200, "kept".to_owned()),
            "{:?}",
            e.error
        );
        let v = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(v["state"], "running");
        delete(d, &a).await;
    });
}

#[test]
fn created_with_start_false_runs_no_vm_until_first_use() {
    let d = daemon();
    rt().block_on(async {
        let tpl = d.ok("GET", "/v1/templates/tpl-default", None, 200).await;
        let disk = tpl["size"]["disk_gib"].as_u64().expect("disk_gib") + 1;
        let t = Instant::now();
        let v = d
            .ok(
                "POST",
                "/v1/sandboxes",
                Some(json!({
                    "start": false,
                    "size": { "disk_gib": disk },
                    "labels": { "test": "start-false" }
                })),
                201,
            )
            .await;
        eprintln!("create hibernated: {:?}", t.elapsed());
        assert_eq!(v["state"], "hibernated", "{v}");
        assert!(v["pid"].is_null(), "{v}");
        let a = v["id"].as_str().expect("id").to_owned();
        assert!(
            !qemu_pids(&d.run_dir).iter().any(|(n, _)| *n == a),
            "a QEMU runs for {a}"
        );
        let snaps = snapshots(d, &a).await;
        assert_eq!(snaps.len(), 1, "{snaps:?}");
        assert_eq!(
            (snaps[0]["kind"].as_str(), snaps[0]["status"].as_str()),
            (Some("hibernate"), Some("ready"))
        );
        let listed = d
            .ok(
                "GET",
                "/v1/sandboxes?state=hibernated&label=test%3Dstart-false",
                None,
                200,
            )
            .await;
        assert_eq!(
            listed["items"].as_array().map(Vec::len),
            Some(1),
            "{listed}"
        );
        // The first use wakes it as a create would have started it: its own
        // identity and the disk it was created with.
        let t = Instant::now();
        let e = d.sh(&a, "hostname; cat /sys/block/vda/size").await;
        eprintln!("first exec (wake): {:?}", t.elapsed());
        assert_eq!(e.code, Some(0), "{:?}", e.error);
        let out = e.out();
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some(a.as_str()), "{out}");
        assert_eq!(
            lines.next().and_then(|l| l.trim().parse::<u64>().ok()),
            Some((disk << 30) / 512),
            "{out}"
        );
        let v = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(v["state"], "running", "{v}");
        assert!(alive(v["pid"].as_u64().expect("pid") as u32), "{v}");
        // It behaves like any sandbox from then on.
        assert_eq!(d.sh(&a, "echo x > /root/x").await.code, Some(0));
        d.ok("POST", &format!("/v1/sandboxes/{a}/hibernate"), None, 200)
            .await;
        assert_eq!(d.sh(&a, "cat /root/x").await.out(), "x");
        delete(d, &a).await;
        // Bad input: clear 4xx, nothing created.
        for (body, status, c) in [
            (json!({"start": "no"}), 400, "invalid_request"),
            (
                json!({"start": false, "colour": "red"}),
                400,
                "invalid_request",
            ),
            (
                json!({"start": false, "size": {"disk_gib": 0}}),
                400,
                "invalid_size",
            ),
            (
                json!({"start": false, "template": "tpl-nope"}),
                404,
                "not_found",
            ),
        ] {
            let (s, v) = d.call("POST", "/v1/sandboxes", Some(body.clone())).await;
            assert_eq!((s, code(&v)), (status, c), "{body}: {v}");
            assert!(!v["error"]["message"].as_str().unwrap_or("").is_empty());
        }
    });
}

#[test]
fn vm_killed_behind_the_daemons_back_is_restored_from_its_last_snapshot() {
    let d = daemon();
    rt().block_on(async {
        let a = d.create(json!({ "labels": { "test": "vm-kill" } })).await;
        assert_eq!(d.sh(&a, "echo saved > /root/k").await.code, Some(0));
        d.ok("POST", &format!("/v1/sandboxes/{a}/snapshots"), None, 201)
            .await;
        assert_eq!(d.sh(&a, "echo lost > /root/k").await.code, Some(0));
        let pid = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        // SAFETY: the QEMU of a sandbox this test created.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let v = d
            .wait_for(&a, Duration::from_secs(60), |v| {
                v["state"] == "running" && v["pid"].as_u64().is_some_and(|p| p as u32 != pid)
            })
            .await;
        let ev = d
            .ok("GET", &format!("/v1/sandboxes/{a}/events"), None, 200)
            .await;
        let items = ev["items"].as_array().expect("items");
        assert!(
            items
                .iter()
                .any(|e| e["op"] == "fail" && e["to_state"] == "failed"),
            "{ev}"
        );
        assert!(
            items.iter().any(|e| e["op"] == "recover"
                && e["phase"] == "done"
                && e["to_state"] == "running"),
            "{ev}"
        );
        assert!(alive(v["pid"].as_u64().expect("pid") as u32));
        assert_eq!(d.sh(&a, "cat /root/k").await.out(), "saved");
        delete(d, &a).await;
    });
}

#[test]
fn bad_input_gets_clear_errors_and_changes_nothing() {
    let d = daemon();
    rt().block_on(async {
        // Unknown and malformed ids.
        let (s, v) = d.call("GET", "/v1/sandboxes/sb-doesnotexist", None).await;
        assert_eq!((s, code(&v)), (404, "not_found"), "{v}");
        let (s, v) = d.call("GET", "/v1/sandboxes/..%2Fetc", None).await;
        assert_eq!(s, 400, "{v}");
        let (s, v) = d
            .call("POST", "/v1/snapshots/snap-nope/fork", Some(json!({})))
            .await;
        assert_eq!((s, code(&v)), (404, "not_found"), "{v}");
        let e = d.exec("sb-doesnotexist", &["true"]).await;
        assert_eq!(e.status, 404);
        // Malformed JSON, wrong types.
        let (s, body) = d.raw("POST", "/v1/sandboxes", b"{not json".to_vec()).await;
        assert_eq!(s, 400, "{}", String::from_utf8_lossy(&body));
        let (s, v) = d
            .call(
                "POST",
                "/v1/sandboxes",
                Some(json!({"size": {"vcpus": "two"}})),
            )
            .await;
        assert_eq!((s, code(&v)), (400, "invalid_request"), "{v}");
        // Absurd sizes; a disk smaller than the template's (another vCPU
        // count or memory is a size variant: tests/variants.rs).
        for (size, c) in [
            (json!({"vcpus": 0}), "invalid_size"),
            (json!({"memory_mib": 1_048_576}), "invalid_size"),
            (json!({"disk_gib": 0}), "invalid_size"),
            (json!({"disk_gib": 1}), "invalid_request"),
        ] {
            let (s, v) = d
                .call("POST", "/v1/sandboxes", Some(json!({ "size": size })))
                .await;
            assert_eq!((s, code(&v)), (400, c), "{size}: {v}");
            assert!(!v["error"]["message"].as_str().unwrap_or("").is_empty());
        }
        let (s, v) = d
            .call(
                "POST",
                "/v1/sandboxes",
                Some(json!({"template": "tpl-nope"})),
            )
            .await;
        assert_eq!((s, code(&v)), (404, "not_found"), "{v}");

        let a = d.create(json!({ "labels": { "test": "bad-input" } })).await;
        // Paths with `..`, relative, NUL.
        for p in ["/root/../etc/passwd", "etc/passwd", "/root/a%00b"] {
            let (s, v) = d
                .call(
                    "GET",
                    &format!("/v1/sandboxes/{a}/files/stat?path={p}"),
                    None,
                )
                .await;
            assert_eq!((s, code(&v)), (400, "invalid_request"), "{p}: {v}");
        }
        let (s, _) = d
            .raw(
                "PUT",
                &format!("/v1/sandboxes/{a}/files?path=/tmp/../x"),
                b"x".to_vec(),
            )
            .await;
        assert_eq!(s, 400);
        // Rewind: neither / both fields, unknown snapshot, `ago` nonsense or beyond retention.
        for body in [
            json!({}),
            json!({"to": "snap-nope", "ago": "1m"}),
            json!({"ago": "soon"}),
        ] {
            let (s, v) = d
                .call(
                    "POST",
                    &format!("/v1/sandboxes/{a}/rewind"),
                    Some(body.clone()),
                )
                .await;
            assert_eq!(s, 400, "{body}: {v}");
        }
        let (s, v) = d
            .call(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"ago": "30d"})),
            )
            .await;
        assert_eq!(s, 404, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("retention"),
            "{v}"
        );
        // Two rewinds at once: one runs, the other gets 409 conflict.
        let snap = d
            .ok("POST", &format!("/v1/sandboxes/{a}/snapshots"), None, 201)
            .await;
        let snap = snap["id"].as_str().expect("id").to_owned();
        let path = format!("/v1/sandboxes/{a}/rewind");
        let body = json!({"to": snap});
        let (r1, r2) = tokio::join!(
            d.call("POST", &path, Some(body.clone())),
            d.call("POST", &path, Some(body.clone()))
        );
        let mut statuses = [r1.0, r2.0];
        statuses.sort();
        assert_eq!(statuses, [200, 409], "{} / {}", r1.1, r2.1);
        let loser = if r1.0 == 409 { &r1.1 } else { &r2.1 };
        assert_eq!(code(loser), "conflict", "{loser}");
        // The daemon keeps serving and the sandbox is fine.
        d.ok("GET", "/healthz", None, 200).await;
        let v = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(v["state"], "running", "{v}");
        assert_eq!(d.exec(&a, &["true"]).await.code, Some(0));
        delete(d, &a).await;
    });
}
