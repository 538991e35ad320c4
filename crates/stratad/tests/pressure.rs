//! Admission by use and pressure-driven hibernation against a real daemon
//! and real guests (docs/capacity.md).
//!
//! - A create that does not fit by use hibernates the least recently used
//!   idle sandbox first (memory kept: its tmpfs marker survives), is refused
//!   with `insufficient_capacity` naming the CPU only while no sandbox is
//!   idle — one with a command in flight never is — and a wake of the
//!   hibernated one makes room the same way.
//! - Real CPU pressure (busy loops on the host, PSI) ends the warm guest
//!   first, then hibernates the idle sandbox, never the one running a
//!   command.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

fn state(v: &Value) -> &str {
    v["state"].as_str().unwrap_or("")
}

async fn events(d: &Daemon, id: &str) -> String {
    let (_, v) = d
        .call("GET", &format!("/v1/sandboxes/{id}/events"), None)
        .await;
    v.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admission_by_use_hibernates_an_idle_sandbox_before_it_refuses() {
    // 64 pretend cores, half kept free: 32 given out. Every sandbox counts
    // at least 20 (the floor) and a new one 20: one fits, two do not — with
    // room for up to 12 cores of other load on this shared host. Pressure
    // thresholds out of reach: only admission hibernates here.
    let d = Daemon::start(
        r#"[capacity]
admission = "use"
vcpus = 64
cpu_headroom = 0.5
new_sandbox_cpu = 20.0
idle_cpu_floor = 20.0
nominal_floor = false

[pressure]
enabled = true
cpu_pct = 101.0
memory_pct = 101.0
min_idle = "3s"

[metrics]
interval = "1s"
"#,
    );
    d.wait_template().await;
    let a = d.create(json!({})).await;
    let out = d
        .sh(&a, "echo kept-in-ram > /dev/shm/marker && echo ok")
        .await;
    assert_eq!(out.code, Some(0), "{out:?}");

    // A command in flight on a: not idle, whatever its last activity.
    let api = d.api.clone();
    let a2 = a.clone();
    let long = tokio::spawn(async move {
        api.exec(&a2, json!({ "cmd": ["sleep", "9"] }))
            .await
            .expect("exec")
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (s, v) = d.call("POST", "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(s, 507, "refused while a's command runs: {v}");
    assert_eq!(v["error"]["code"], "insufficient_capacity", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("CPU is short"), "names what is short: {msg}");
    let (_, av) = d.call("GET", &format!("/v1/sandboxes/{a}"), None).await;
    assert_eq!(state(&av), "running", "{av}");

    // The command ends; after min_idle a is idle: the create hibernates it.
    let done = long.await.expect("join");
    assert_eq!(done.code, Some(0), "{done:?}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t = Instant::now();
    let b = d.create(json!({})).await;
    eprintln!(
        "create that hibernated an idle sandbox first: {:?}",
        t.elapsed()
    );
    let (_, av) = d.call("GET", &format!("/v1/sandboxes/{a}"), None).await;
    assert_eq!(state(&av), "hibernated", "{av}");
    let ev = events(&d, &a).await;
    assert!(ev.contains("admission: this host's CPU is short"), "{ev}");

    // a's next command wakes it with its memory; b, idle by then, makes room.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let out = d.sh(&a, "cat /dev/shm/marker").await;
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept-in-ram");
    let (_, bv) = d.call("GET", &format!("/v1/sandboxes/{b}"), None).await;
    assert_eq!(state(&bv), "hibernated", "{bv}");

    // Visible: the events counter, the admission gauges, the host in stats.
    let (_, text) = d.raw("GET", "/metrics", Vec::new()).await;
    let text = String::from_utf8_lossy(&text).into_owned();
    let hibernations: f64 = text
        .lines()
        .find(|l| l.starts_with("strata_events_total{kind=\"pressure_hibernation\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert!(hibernations >= 2.0, "{text}");
    assert!(
        text.contains("strata_admission_cpu_budget_cores 32"),
        "{text}"
    );
    assert!(
        text.contains(&format!("strata_sandbox_cpu_peak_cores{{sandbox=\"{a}\"}}"))
            || text.contains("strata_sandbox_cpu_percent"),
        "{text}"
    );
    let stats = d.ok("GET", "/v1/stats", None, 200).await;
    assert_eq!(stats["host"]["admission"], "use", "{stats}");
    assert!(
        stats["host"]["budget"]["cpu_budget_cores"].as_f64() == Some(32.0),
        "{stats}"
    );
    assert!(
        stats["host"]["latest"]["cpus"].as_u64().unwrap_or(0) >= 1,
        "{stats}"
    );
}

/// Busy loops on every host CPU (and then some) until dropped.
struct Hog(Vec<std::process::Child>);

impl Hog {
    fn start(n: usize) -> Hog {
        Hog((0..n)
            .map(|_| {
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .expect("busy loop")
            })
            .collect())
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cpu_pressure_ends_warm_guests_then_hibernates_the_idle_sandbox_only() {
    let d = Daemon::start(
        r#"[capacity]
admission = "nominal"
vcpus = 64

[pressure]
enabled = true
cpu_pct = 50.0
memory_pct = 101.0
sustain = 2
min_idle = "2s"
step = "1s"

[pools]
default_template = 1
"#,
    );
    d.wait_template().await;
    d.wait_warm(1, Duration::from_secs(180)).await;
    let idle = d.create(json!({})).await;
    let busy = d.create(json!({})).await;
    d.wait_warm(1, Duration::from_secs(180)).await;
    let api = d.api.clone();
    let b2 = busy.clone();
    let long = tokio::spawn(async move {
        api.exec(&b2, json!({ "cmd": ["sleep", "45"] }))
            .await
            .expect("exec")
    });
    tokio::time::sleep(Duration::from_secs(3)).await;

    let hog = Hog::start(6);
    let started = Instant::now();
    let (mut warm_gone, mut hibernated) = (None, None);
    while started.elapsed() < Duration::from_secs(90) && hibernated.is_none() {
        if warm_gone.is_none() && d.warm_ready().await == 0 {
            warm_gone = Some(started.elapsed());
        }
        let (_, v) = d.call("GET", &format!("/v1/sandboxes/{idle}"), None).await;
        if state(&v) == "hibernated" {
            hibernated = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(hog);
    let hibernated =
        hibernated.unwrap_or_else(|| panic!("idle sandbox never hibernated:\n{}", d.logs()));
    let warm_gone = warm_gone.expect("the warm guest ended");
    eprintln!("pressure -> warm guest ended {warm_gone:?}, idle sandbox hibernated {hibernated:?}");
    assert!(warm_gone <= hibernated, "warm guests go first");
    let ev = events(&d, &idle).await;
    assert!(ev.contains("pressure: cpu pressure"), "{ev}");

    // The busy one kept running its command, and finishes it.
    let (_, bv) = d.call("GET", &format!("/v1/sandboxes/{busy}"), None).await;
    assert_eq!(state(&bv), "running", "{bv}");
    let done = long.await.expect("join");
    assert_eq!(done.code, Some(0), "{done:?}");
    // The hibernated one answers its next call.
    let out = d.sh(&idle, "echo awake").await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "awake");
}

/// The CPU-weight file of sandbox `id`'s QEMU process's cgroup (cgroup v1
/// `cpu.shares`, else v2 `cpu.weight`) and its value, as an operator
/// would read it: the QEMU found by its command line, its cgroup from
/// `/proc/<pid>/cgroup`.
fn qemu_cpu_weight(id: &str) -> Option<(std::path::PathBuf, u64)> {
    let pid = std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        let argv0 = cmd.split('\0').next().unwrap_or("");
        (argv0.contains("qemu") && cmd.contains(id)).then_some(pid)
    })?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let mut v2 = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        if controllers.split(',').any(|c| c == "cpu") {
            for mount in [controllers.to_owned(), "cpu".to_owned()] {
                let f = std::path::Path::new("/sys/fs/cgroup")
                    .join(&mount)
                    .join(path.trim_start_matches('/'))
                    .join("cpu.shares");
                if let Ok(v) = std::fs::read_to_string(&f) {
                    return Some((f, v.trim().parse().ok()?));
                }
            }
        } else if controllers.is_empty() {
            v2 = Some(path.trim_start_matches('/').to_owned());
        }
    }
    let f = std::path::Path::new("/sys/fs/cgroup")
        .join(v2?)
        .join("cpu.weight");
    let v = std::fs::read_to_string(&f).ok()?;
    Some((f, v.trim().parse().ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_in_flight_raises_its_sandboxs_cpu_weight_until_it_ends() {
    let d = Daemon::start("");
    d.wait_template().await;
    let a = d.create(json!({})).await;
    let b = d.create(json!({})).await;
    let (file, before) = qemu_cpu_weight(&a).expect("a's QEMU and its cgroup's CPU weight");
    let v1 = file.ends_with("cpu.shares");
    let (default, boosted) = if v1 { (1024, 10_240) } else { (100, 1000) };
    assert_eq!(before, default, "{} before any call", file.display());

    // A command in flight on a: its weight is raised, b's is not.
    let api = d.api.clone();
    let a2 = a.clone();
    let long = tokio::spawn(async move {
        api.exec(&a2, json!({ "cmd": ["sleep", "4"] }))
            .await
            .expect("exec")
    });
    let t = Instant::now();
    let mut during = before;
    while t.elapsed() < Duration::from_secs(3) {
        during = qemu_cpu_weight(&a).expect("a's weight").1;
        if during == boosted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(during, boosted, "{} while a command runs", file.display());
    assert_eq!(
        qemu_cpu_weight(&b).expect("b's weight").1,
        default,
        "an idle sandbox keeps the default"
    );
    // Two calls at once: the end of the shorter one keeps the weight.
    let out = d.sh(&a, "true").await;
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(qemu_cpu_weight(&a).expect("a's weight").1, boosted);

    // The command ends: back to the default.
    let done = long.await.expect("join");
    assert_eq!(done.code, Some(0), "{done:?}");
    let t = Instant::now();
    let mut after = during;
    while t.elapsed() < Duration::from_secs(2) {
        after = qemu_cpu_weight(&a).expect("a's weight").1;
        if after == default {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(after, default, "{} after the command", file.display());
    // A file write is a call too, and leaves the default behind it.
    let (s, v) = d
        .raw(
            "PUT",
            &format!("/v1/sandboxes/{a}/files?path=/root/f"),
            b"x".to_vec(),
        )
        .await;
    assert!(s < 300, "{s} {}", String::from_utf8_lossy(&v));
    assert_eq!(qemu_cpu_weight(&a).expect("a's weight").1, default);

    // A snapshot's pause is such a call: the weight is raised while the
    // guest is stopped (watched from a thread reading the file as fast as
    // it can: the pause is milliseconds) and the default after it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (f, stop) = (file.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = std::collections::BTreeSet::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(v) = std::fs::read_to_string(&f)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                {
                    seen.insert(v);
                }
            }
            seen
        })
    };
    let snap = d
        .ok(
            "POST",
            &format!("/v1/sandboxes/{a}/snapshots"),
            Some(json!({})),
            201,
        )
        .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = watcher.join().expect("watcher");
    assert!(
        seen.contains(&boosted),
        "{} during the snapshot's pause: seen {seen:?} ({snap})",
        file.display()
    );
    assert_eq!(
        qemu_cpu_weight(&a).expect("a's weight").1,
        default,
        "after the snapshot"
    );
    assert_eq!(
        qemu_cpu_weight(&b).expect("b's weight").1,
        default,
        "b, not snapshotted"
    );
}
