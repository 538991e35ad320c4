//! The per-sandbox sampler end to end: a real `stratad` (sampling every
//! second), a real TCG guest. A busy loop in the guest shows in its CPU
//! series (> 50 % of its vCPU within a few samples) and an idle guest
//! shows low; writing 200 MiB in the guest raises its memory or disk use;
//! another tenant's sandbox answers 404 like an unknown one; bad bounds are
//! `400 invalid_request`; the sampler's own cost is in `/v1/stats`, and
//! so is the host's storage pool (also in `/metrics`).
//! The ring's bounds are unit tests (`service::sampler`).

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};
use strata_testkit::Api;

const MIB: u64 = 1 << 20;

async fn metrics(api: &Api, id: &str, query: &str) -> (u16, Value) {
    api.json(
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}/metrics{query}"),
        None,
    )
    .await
    .expect("request")
}

/// The samples of `id` taken after `after`, waiting until `enough` says so
/// (or `within` passes; then whatever there is).
async fn samples_after(
    api: &Api,
    id: &str,
    after: chrono::DateTime<chrono::Utc>,
    within: Duration,
    enough: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let t = Instant::now();
    loop {
        let (s, v) = metrics(api, id, &format!("?start={}", after.timestamp() + 1)).await;
        assert_eq!(s, 200, "{v}");
        let got = v["samples"].as_array().cloned().unwrap_or_default();
        if enough(&got) || t.elapsed() > within {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn cpu(s: &Value) -> f64 {
    s["cpu_pct"].as_f64().expect("cpu_pct")
}

fn field(s: &Value, k: &str) -> u64 {
    s[k].as_u64().unwrap_or_else(|| panic!("{k} in {s}"))
}

/// CPU time this thread spends in `f`.
fn thread_cpu(f: impl FnOnce()) -> Duration {
    let now = || {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec into the valid `ts`.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    };
    let t = now();
    f();
    now() - t
}

#[test]
fn busy_guest_shows_cpu_writes_show_memory_or_disk_and_other_tenants_see_nothing() {
    let d = Daemon::start("[metrics]\ninterval = \"1s\"\nwindow = \"10m\"\n");
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let (a, a_token) = d.tenant_token("a", "developer").await;
        let (b, _) = d.tenant_token("b", "developer").await;
        let (s, v) = a
            .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
            .await
            .expect("create");
        assert_eq!(s, 201, "{v}");
        let id = v["id"].as_str().expect("id").to_owned();

        // Idle: a few samples, low CPU, sane totals.
        let t0 = chrono::Utc::now();
        let idle = samples_after(&a, &id, t0, Duration::from_secs(30), |s| s.len() >= 4).await;
        assert!(idle.len() >= 4, "samples every second: {idle:?}");
        let last = idle.last().expect("sample");
        eprintln!("idle: {:?}", idle.iter().map(cpu).collect::<Vec<_>>());
        assert!(
            idle.iter().map(cpu).fold(f64::MAX, f64::min) < 25.0,
            "an idle guest is not busy: {idle:?}"
        );
        assert_eq!(field(last, "cpu_count"), 1);
        assert_eq!(field(last, "mem_total_bytes"), 256 * MIB);
        assert!(field(last, "mem_used_bytes") <= 256 * MIB, "{last}");
        assert!(field(last, "mem_used_bytes") > 0, "{last}");
        assert_eq!(field(last, "disk_total_bytes"), 2 << 30);
        assert!(field(last, "disk_used_bytes") > 0, "{last}");
        assert!(field(last, "host_rss_bytes") >= field(last, "mem_used_bytes"));

        // What the sampler's reads cost (printed, not asserted): the same
        // files, timed by this thread's CPU clock.
        let pid: u32 = std::fs::read_to_string(d.run_dir.join(&id).join("qemu.pid"))
            .expect("qemu.pid")
            .trim()
            .parse()
            .expect("pid");
        let disk = d.root.join("data/pool/sandboxes").join(&id).join("disk.img");
        let cheap = thread_cpu(|| {
            for _ in 0..1000 {
                let _ = std::fs::read_to_string(format!("/proc/{pid}/status"));
                let _ = std::fs::read_to_string(format!("/proc/{pid}/stat"));
                let _ = std::fs::metadata(&disk);
            }
        }) / 1000;
        let smaps = thread_cpu(|| {
            for _ in 0..20 {
                let _ = std::fs::read_to_string(format!("/proc/{pid}/smaps"));
            }
        }) / 20;
        eprintln!(
            "sampler CPU per sandbox per round: {:?} (+ smaps walk {:?} every 60 rounds = {:?} average)",
            cheap,
            smaps,
            cheap + smaps / 60
        );

        // Busy: a 15 s busy loop; CPU > 50 % within a few samples.
        let busy_from = chrono::Utc::now();
        let spin = {
            let a = a.clone();
            let id = id.clone();
            tokio::spawn(async move {
                a.exec_output(&id, &["timeout", "15", "sh", "-c", "while :; do :; done"])
                    .await
            })
        };
        let busy = samples_after(&a, &id, busy_from, Duration::from_secs(14), |s| {
            s.iter().any(|p| cpu(p) > 50.0)
        })
        .await;
        eprintln!("busy: {:?}", busy.iter().map(cpu).collect::<Vec<_>>());
        assert!(
            busy.iter().any(|p| cpu(p) > 50.0),
            "a busy loop shows as > 50 % of the vCPU: {busy:?}"
        );
        let _ = spin.await;

        // 200 MiB written and synced: memory (guest page cache, resident on
        // the host) or disk (allocated in the pool) rises by most of it.
        let before = samples_after(&a, &id, chrono::Utc::now(), Duration::from_secs(10), |s| {
            !s.is_empty()
        })
        .await;
        let before = before.last().expect("a sample").clone();
        let (code, out) = a
            .exec_output(
                &id,
                &[
                    "sh",
                    "-c",
                    "head -c 200M /dev/urandom > /root/big && sync && stat -c %s /root/big",
                ],
            )
            .await
            .expect("exec");
        assert_eq!((code, out.trim()), (0, "209715200"), "{out}");
        let wrote = chrono::Utc::now();
        let rose = |s: &Value| {
            let mem = field(s, "mem_used_bytes").saturating_sub(field(&before, "mem_used_bytes"));
            let disk =
                field(s, "disk_used_bytes").saturating_sub(field(&before, "disk_used_bytes"));
            (mem, disk)
        };
        let after = samples_after(&a, &id, wrote, Duration::from_secs(15), |s| {
            s.iter().any(|p| {
                let (m, dk) = rose(p);
                m >= 100 * MIB || dk >= 150 * MIB
            })
        })
        .await;
        let (m, dk) = after.last().map(rose).unwrap_or((0, 0));
        eprintln!(
            "after 200 MiB: memory +{} MiB, disk +{} MiB",
            m / MIB,
            dk / MIB
        );
        assert!(
            after.iter().any(|p| {
                let (m, dk) = rose(p);
                m >= 100 * MIB || dk >= 150 * MIB
            }),
            "writing 200 MiB shows: before {before}, after {after:?}"
        );

        // Another tenant: exactly like an unknown sandbox.
        let (s, v) = metrics(&b, &id, "").await;
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (404, Some("not_found")),
            "{v}"
        );
        let (s2, v2) = metrics(&b, "sb-00000000000000000000000000", "").await;
        assert_eq!(s2, s, "{v2}");

        // Bad bounds and parameters change nothing and say why.
        for q in ["?start=20&end=10", "?start=soon", "?since=1"] {
            let (s, v) = metrics(&a, &id, q).await;
            assert_eq!(
                (s, v["error"]["code"].as_str()),
                (400, Some("invalid_request")),
                "{q}: {v}"
            );
        }
        // `end` before every sample: none.
        let (s, v) = metrics(&a, &id, "?end=1").await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["samples"], json!([]));

        // The sampler's own cost, one round over one sandbox.
        let stats = d.ok("GET", "/v1/stats", None, 200).await;
        let step = &stats["steps"][stratad::service::SAMPLE_STEP];
        eprintln!("sampler round (1 sandbox): {step}");
        assert!(step["count"].as_u64().unwrap_or(0) >= 10, "{stats}");

        // The host's storage pool (statvfs on the real btrfs pool), read on
        // the sampler's tick: in `/v1/stats` `host` and in `/metrics`.
        let pool = &stats["host"]["pool"];
        let size = pool["size_bytes"].as_u64().unwrap_or(0);
        let used = pool["used_bytes"].as_u64().unwrap_or(0);
        let avail = pool["available_bytes"].as_u64().unwrap_or(u64::MAX);
        assert!(size > 0 && used > 0 && used <= size && avail <= size, "{stats}");
        let (s, text) = d.raw("GET", "/metrics", Vec::new()).await;
        let text = String::from_utf8_lossy(&text);
        assert_eq!(s, 200);
        for kind in ["size", "used", "available"] {
            assert!(
                text.contains(&format!("strata_host_pool_bytes{{kind=\"{kind}\"}} ")),
                "{kind}: {text}"
            );
        }

        // `strata stats ID`: the latest sample and a short history.
        let out = strata_testkit::run_strata(
            &strata_testkit::strata_bin(),
            &d.url,
            Some(&a_token),
            &["stats", &id, "--last", "3"],
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(text.starts_with(&format!("{id}: cpu ")), "{text}");
        assert!(text.contains("of 1 vCPU, memory "), "{text}");
        // Three history rows (local times), under the header.
        assert_eq!(text.lines().filter(|l| l.starts_with("20")).count(), 3, "{text}");

        // Deleted: gone, for its owner too.
        let (s, v) = a
            .json(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                None,
            )
            .await
            .expect("delete");
        assert_eq!(s, 200, "{v}");
        let (s, _) = metrics(&a, &id, "").await;
        assert_eq!(s, 404);
    });
}
