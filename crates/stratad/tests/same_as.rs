//! Rolling snapshots of unchanged guests end to end (`service::unchanged`):
//! a real `stratad` (sampling every second), a real TCG guest, rolling
//! snapshots every 2 s.
//! - an idle guest's rolling snapshots after the first real one are
//!   `same_as` records of it (no pause, 0 bytes), journaled with why and
//!   counted in `/metrics`;
//! - after an exec that writes a file the next rolling snapshot is real;
//! - a rewind to a `same_as` record restores its target (a file written
//!   after the target is gone, one written before it is there), and so
//!   does a fork of the record;
//! - with `[snapshots] skip_unchanged = false` every rolling snapshot is real.
//!
//! The decision itself (counters, activity, CPU) is unit-tested in
//! `service::unchanged`; retention's keeping of targets in `retention`.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

/// Idle under TCG is 2-3 % of a vCPU (docs/bench: 2.54 %); KVM hosts keep
/// the 1 % default. The test must see idle guests as idle here.
const TCG_IDLE_PCT: &str = "15.0";

/// A guest process that appends a line to a file and fsyncs it every
/// second, sleeping in between: disk writes with next to no CPU (once
/// Python has started) and no API call.
const TICKER: &str = "setsid python3 -c 'import os, time\n\
f = open(\"/root/tick\", \"a\")\n\
while True:\n    f.write(\"x\\n\"); f.flush(); os.fsync(f.fileno()); time.sleep(1)\n' \
    </dev/null >/dev/null 2>&1 & echo $! > /run/tick.pid";

/// Stops [`TICKER`].
const TICKER_STOP: &str = "kill $(cat /run/tick.pid)";

async fn snapshots(d: &Daemon, id: &str) -> Vec<Value> {
    let v = d
        .ok("GET", &format!("/v1/sandboxes/{id}/snapshots"), None, 200)
        .await;
    v["items"].as_array().cloned().expect("items")
}

/// Polls the snapshot list until `enough` says so, or panics after `max`.
async fn wait_snapshots(
    d: &Daemon,
    id: &str,
    max: Duration,
    what: &str,
    enough: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let t = Instant::now();
    loop {
        let list = snapshots(d, id).await;
        if enough(&list) {
            return list;
        }
        assert!(
            t.elapsed() < max,
            "{what}: not within {max:?}: {}\n{}",
            show(&list),
            d.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn same_as(s: &Value) -> Option<&str> {
    s["same_as"].as_str()
}

fn sid(s: &Value) -> &str {
    s["id"].as_str().expect("id")
}

fn at(s: &Value) -> chrono::DateTime<chrono::Utc> {
    s["created_at"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("created_at of {s}"))
}

fn show(list: &[Value]) -> String {
    list.iter()
        .map(|s| {
            format!(
                "{} {} {}",
                sid(s),
                s["kind"].as_str().unwrap_or("?"),
                same_as(s).map(|t| format!("= {t}")).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every `same_as` record names the newest real snapshot before it (never
/// another record), holds 0 bytes and paused nothing.
fn check_records(list: &[Value]) {
    let mut last_real: Option<&str> = None;
    for s in list {
        match same_as(s) {
            None => last_real = Some(sid(s)),
            Some(t) => {
                assert_eq!(Some(t), last_real, "no chains: {}", show(list));
                assert_eq!(s["kind"], "rolling", "{s}");
                assert_eq!(s["status"], "ready", "{s}");
                assert!(s["pause_ms"].is_null(), "no pause: {s}");
                assert_eq!(s["exclusive_bytes"], 0, "{s}");
            }
        }
    }
}

/// `sh -c script`, asserting exit 0; returns stdout.
async fn sh(d: &Daemon, id: &str, script: &str) -> String {
    let e = d.sh(id, script).await;
    assert_eq!(e.code, Some(0), "{script}: {e:?}");
    String::from_utf8_lossy(&e.stdout).into_owned()
}

/// The newest snapshot, once it is a `same_as` record of a real snapshot
/// taken at or after `since` (the guest settled again).
async fn settled_after(
    d: &Daemon,
    id: &str,
    since: chrono::DateTime<chrono::Utc>,
    what: &str,
) -> (Value, Vec<Value>) {
    let list = wait_snapshots(d, id, Duration::from_secs(40), what, |l| {
        let Some(last) = l.last() else { return false };
        let Some(t) = same_as(last) else { return false };
        l.iter().any(|s| sid(s) == t && at(s) >= since)
    })
    .await;
    (list.last().cloned().expect("last"), list)
}

#[test]
fn idle_guests_get_same_as_records_and_rewind_to_one_restores_its_target() {
    let started = Instant::now();
    let d = Daemon::start(&format!(
        "[metrics]\ninterval = \"1s\"\n[snapshots]\nskip_unchanged = true\nunchanged_max_cpu_pct = {TCG_IDLE_PCT}\n"
    ));
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let id = d.create(json!({ "snapshot_interval": "2s" })).await;
        let t_create = chrono::Utc::now();
        eprintln!("{:?}: created {id}", started.elapsed());

        // 1. Idle: after a real one, records that are the same as it.
        let list = wait_snapshots(
            &d,
            &id,
            Duration::from_secs(40),
            "two same_as records",
            |l| l.iter().filter(|s| same_as(s).is_some()).count() >= 2,
        )
        .await;
        eprintln!("{:?}: idle: {}", started.elapsed(), show(&list));
        check_records(&list);
        assert!(
            same_as(&list[0]).is_none(),
            "the first one is real: {}",
            show(&list)
        );
        let first = list
            .iter()
            .find(|s| same_as(s).is_some())
            .expect("a record")
            .clone();
        let target = same_as(&first).expect("same_as").to_owned();
        let t = d
            .ok("GET", &format!("/v1/snapshots/{target}"), None, 200)
            .await;
        assert!(at(&t) >= t_create - chrono::TimeDelta::seconds(5), "{t}");
        assert!(t.get("same_as").is_none(), "a target is real: {t}");
        // The journal says why; /metrics counts them.
        let ev = d
            .ok("GET", &format!("/v1/sandboxes/{id}/events"), None, 200)
            .await;
        let why = ev["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter_map(|e| e["detail"].as_str())
            .find(|x| x.starts_with(sid(&first)))
            .unwrap_or_else(|| panic!("journal of {}: {ev}", sid(&first)))
            .to_owned();
        assert!(
            why.contains(&format!("same_as {target}")) && why.contains("unchanged since"),
            "{why}"
        );
        let (s, body) = d.raw("GET", "/metrics", Vec::new()).await;
        assert_eq!(s, 200);
        let text = String::from_utf8_lossy(&body);
        let skipped: f64 = text
            .lines()
            .find(|l| l.contains("kind=\"snapshot_unchanged_skipped\""))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no skipped count in /metrics:\n{text}"));
        assert!(skipped >= 2.0, "{skipped}");

        // 2. Disk writes alone (a guest process, no API call, next to no
        // CPU: shell builtins only, the kernel's writeback flushing within
        // ~0.3 s): every rolling snapshot while it writes is real.
        sh(&d, &id, TICKER).await;
        // Python's start uses the CPU: from 3 s on, only the writes show.
        let ticking = chrono::Utc::now() + chrono::TimeDelta::seconds(3);
        let list = wait_snapshots(
            &d,
            &id,
            Duration::from_secs(20),
            "three snapshots while the guest writes",
            |l| l.iter().filter(|s| at(s) > ticking).count() >= 3,
        )
        .await;
        let cpu = d
            .ok("GET", &format!("/v1/sandboxes/{id}/metrics"), None, 200)
            .await;
        eprintln!(
            "{:?}: ticking: {} (CPU % of the last samples: {:?})",
            started.elapsed(),
            show(&list),
            cpu["samples"].as_array().map(|v| v
                .iter()
                .rev()
                .take(8)
                .map(|p| p["cpu_pct"].clone())
                .collect::<Vec<_>>())
        );
        assert!(
            list.iter()
                .filter(|s| at(s) > ticking)
                .all(|s| same_as(s).is_none()),
            "a guest writing its disk gets real snapshots: {}",
            show(&list)
        );
        sh(&d, &id, TICKER_STOP).await;

        // 3. An exec that writes: the next rolling snapshot is real.
        let before_f = chrono::Utc::now();
        sh(&d, &id, "echo f > /root/f; sync").await;
        let after_f = chrono::Utc::now();
        let list = wait_snapshots(
            &d,
            &id,
            Duration::from_secs(20),
            "a snapshot after the exec",
            |l| l.iter().any(|s| at(s) > after_f),
        )
        .await;
        // The first one after the exec is real, or (one was taken while the
        // exec ran, after its write) the same as a real one taken since it
        // started: never the same as what came before the write.
        let next = list.iter().find(|s| at(s) > after_f).expect("next");
        let real_since = |t: &str| {
            list.iter()
                .any(|s| sid(s) == t && same_as(s).is_none() && at(s) > before_f)
        };
        assert!(
            same_as(next).is_none_or(real_since),
            "the first snapshot after a write is real: {}",
            show(&list)
        );
        eprintln!("{:?}: after the write: {}", started.elapsed(), show(&list));
        // Idle again: a record of a real snapshot holding /root/f.
        let (rec_f, list) = settled_after(&d, &id, before_f, "idle again after the write").await;
        check_records(&list);
        let target_f = same_as(&rec_f).expect("same_as").to_owned();
        eprintln!(
            "{:?}: idle again: {} = {target_f}",
            started.elapsed(),
            sid(&rec_f)
        );

        // 4. A file written after the target; rewind to the record.
        sh(&d, &id, "echo g > /root/g; sync").await;
        let v = d
            .ok(
                "POST",
                &format!("/v1/sandboxes/{id}/rewind"),
                Some(json!({ "to": sid(&rec_f) })),
                200,
            )
            .await;
        assert_eq!(v["rewound_to"]["id"], sid(&rec_f), "{v}");
        assert_eq!(v["rewound_to"]["same_as"], target_f.as_str(), "{v}");
        let out = sh(
            &d,
            &id,
            "cat /root/f; test -e /root/g && echo g-is-there || echo no-g",
        )
        .await;
        assert_eq!(out, "f\nno-g\n", "the target's state: /root/f, not /root/g");
        let after_rewind = chrono::Utc::now();
        eprintln!("{:?}: rewound", started.elapsed());

        // A fork of the record is its target too.
        let v = d
            .ok(
                "POST",
                &format!("/v1/snapshots/{}/fork", sid(&rec_f)),
                Some(json!({})),
                201,
            )
            .await;
        let child = v["id"].as_str().expect("id").to_owned();
        assert_eq!(v["source_snapshot"], target_f.as_str(), "{v}");
        let out = sh(
            &d,
            &child,
            "cat /root/f; test -e /root/g && echo g-is-there || echo no-g",
        )
        .await;
        assert_eq!(out, "f\nno-g\n");
        d.ok("DELETE", &format!("/v1/sandboxes/{child}"), None, 200)
            .await;

        // After the rewind (a new VM process, the pre-rewind snapshot the
        // latest), the next rolling snapshot is real.
        let list = wait_snapshots(
            &d,
            &id,
            Duration::from_secs(20),
            "a snapshot after the rewind",
            |l| {
                l.iter()
                    .any(|s| s["kind"] == "rolling" && at(s) > after_rewind)
            },
        )
        .await;
        let next = list
            .iter()
            .find(|s| s["kind"] == "rolling" && at(s) > after_rewind)
            .expect("next");
        assert!(
            same_as(next).is_none(),
            "real after a rewind: {}",
            show(&list)
        );
        eprintln!("{:?}: done: {}", started.elapsed(), show(&list));
    });
}

#[test]
fn with_skip_unchanged_off_every_rolling_snapshot_is_real() {
    let started = Instant::now();
    let d = Daemon::start(&format!(
        "[metrics]\ninterval = \"1s\"\n[snapshots]\nskip_unchanged = false\nunchanged_max_cpu_pct = {TCG_IDLE_PCT}\n"
    ));
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let id = d.create(json!({ "snapshot_interval": "2s" })).await;
        let list = wait_snapshots(
            &d,
            &id,
            Duration::from_secs(40),
            "four rolling snapshots",
            |l| l.iter().filter(|s| s["kind"] == "rolling").count() >= 4,
        )
        .await;
        eprintln!("{:?}: {}", started.elapsed(), show(&list));
        // The next rolling snapshot may be in flight (`pending`, no pause
        // yet): judge the ones taken.
        assert!(
            list.iter()
                .filter(|s| s["kind"] == "rolling" && s["status"] == "ready")
                .count()
                >= 3,
            "{}",
            show(&list)
        );
        for s in list.iter().filter(|s| s["status"] == "ready") {
            assert!(same_as(s).is_none(), "all real: {}", show(&list));
            assert!(
                s["pause_ms"].as_f64().is_some(),
                "each paused the guest: {s}"
            );
        }
    });
}
