//! Warm pools against a real `stratad` and real TCG guests (`[pools]`,
//! docs/warm-pools.md): the pool fills to its count; a tenant's create
//! claims a warm guest (the record is the tenant's, the guest's hostname
//! is its id, its clock is the host's though it waited paused, its egress
//! goes through the claimer's policy and is audited under its tenant); the
//! pool refills into free room only; a create that needs the room ends a
//! warm guest instead of being refused; a graceful stop ends the warm
//! guests and keeps the sandboxes; after `kill -9`, the restart ends the
//! warm guests left behind (VMs no record owns).
//!
//! One daemon of its own, one test, sequential steps.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};
use strata_testkit::teardown::{alive, qemu_pids};

/// A one-line HTTP server on 127.0.0.1 standing in for a connector host.
fn upstream() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut r = BufReader::new(conn.try_clone().expect("clone"));
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    if line.trim().is_empty() {
                        break;
                    }
                    line.clear();
                }
                let mut w = conn;
                let _ = write!(
                    w,
                    "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
                );
            });
        }
    });
    port
}

/// `strata_events_total{kind}` from `/metrics`.
async fn events(d: &Daemon, kind: &str) -> u64 {
    d.api.events_total(kind).await.expect("GET /metrics")
}

/// `sh -c script` in `id` as `api`'s caller.
async fn sh(api: &strata_testkit::http::Api, id: &str, script: &str) -> strata_testkit::http::Exec {
    api.exec(id, json!({ "cmd": ["sh", "-c", script] }))
        .await
        .unwrap_or_else(|e| panic!("exec in {id}: {e}"))
}

/// QEMU processes of this daemon but the sandboxes `known`: the warm guests.
fn vms_but(d: &Daemon, known: &[&str]) -> Vec<(String, u32)> {
    qemu_pids(&d.run_dir)
        .into_iter()
        .filter(|(n, _)| !known.contains(&n.as_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pools_fill_claim_yield_and_end_with_the_daemon() {
    let port = upstream();
    let scratch = tempfile::Builder::new()
        .prefix("stratad-warm-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let policy = scratch.path().join("platform.toml");
    std::fs::write(
        &policy,
        format!(
            "default = \"allow\"\n\n[[connector]]\nname = \"upstream\"\nhosts = [\"up.test\"]\nports = [{port}]\n"
        ),
    )
    .expect("policy");
    // Room for three 1-vCPU guests: two warm + one sandbox, then pressure.
    let d = Daemon::start(&format!(
        r#"[capacity]
admission = "nominal"
vcpus = 3
cpu_overcommit = 1.0

[pools]
default_template = 2

[security]
platform_policy = "{}"
[security.egress_static_hosts]
"up.test" = "127.0.0.1"
"#,
        policy.display()
    ));
    d.wait_template().await;
    d.wait_warm(2, Duration::from_secs(180)).await;
    let warm_before = vms_but(&d, &[]);
    assert_eq!(warm_before.len(), 2, "two warm guests run: {warm_before:?}");

    // A tenant's create claims one. It waited paused a while: its clock is
    // set at the claim.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (acme, _) = d.tenant_token("acme", "developer").await;
    let t = Instant::now();
    let (s, v) = acme
        .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
        .await
        .expect("create");
    let create_ms = t.elapsed().as_millis();
    assert_eq!(s, 201, "{v}");
    let a = v["id"].as_str().expect("id").to_owned();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["tenant"], "acme", "{v}");
    assert!(
        warm_before.iter().any(|(n, _)| *n == a),
        "{a} is not one of the warm guests {warm_before:?}"
    );
    assert_eq!(events(&d, "warm_pool_claim").await, 1);
    eprintln!("create from the warm pool: {create_ms} ms");

    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_secs() as i64;
    let e = sh(&acme, &a, "hostname; date +%s").await;
    assert_eq!(e.code, Some(0), "{:?}", e.error);
    let out = e.out();
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some(a.as_str()), "hostname");
    let guest_now: i64 = lines.next().expect("date").trim().parse().expect("secs");
    assert!(
        (guest_now - host_now).abs() <= 2,
        "guest clock {guest_now} vs host {host_now}: not set at the claim"
    );

    // Egress is the claimer's: the platform policy's connector answers,
    // anything else is denied, and the audit names the tenant.
    let ok = sh(
            &acme,
            &a,
            &format!("curl -sS -m 20 http://up.test:{port}/x; echo; curl -s -o /dev/null -w '%{{http_code}}' -m 20 http://unlisted.test:{port}/"),
        )
        .await;
    assert_eq!(
        ok.code,
        Some(0),
        "{:?} {}",
        ok.error,
        String::from_utf8_lossy(&ok.stderr)
    );
    let out = ok.out();
    let mut lines = out.lines();
    assert_eq!(
        lines.next(),
        Some("hello"),
        "allowed connector: {out}\n{}",
        d.logs()
    );
    assert_eq!(
        lines.next(),
        Some("403"),
        "a host no connector names: {out}"
    );
    let (s, body) = acme
        .raw(
            reqwest::Method::GET,
            &format!("/v1/audit?sandbox={a}"),
            Vec::new(),
        )
        .await
        .expect("audit");
    assert_eq!(s, 200);
    let audit = String::from_utf8_lossy(&body);
    assert!(
        audit.lines().any(|l| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|e| e["call"]["sandbox"] == a.as_str() && e["call"]["tenant"] == "acme")
        }),
        "no egress audit of {a} under acme:\n{audit}"
    );

    // The second warm guest: another identity.
    let b = d.create(json!({})).await;
    assert!(warm_before.iter().any(|(n, _)| *n == b), "{b}");
    let ma = sh(&acme, &a, "cat /etc/machine-id").await.out();
    let mb = d.sh(&b, "cat /etc/machine-id").await.out();
    assert_ne!(ma, mb, "two claimed guests share a machine-id");
    assert_eq!(events(&d, "warm_pool_claim").await, 2);

    // Refilled into the free room only: one vCPU is left, so one guest.
    d.wait_warm(1, Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        d.warm_ready().await,
        1,
        "the filler took room that is not free"
    );

    // A create the pool cannot serve (a bigger disk) needs that room: the
    // warm guest goes, the create is not refused.
    let c = d.create(json!({ "size": { "disk_gib": 3 } })).await;
    assert_eq!(events(&d, "warm_pool_evicted").await, 1);
    assert_eq!(d.warm_ready().await, 0);
    // Full: the filler waits for room.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(d.warm_ready().await, 0);
    d.ok("DELETE", &format!("/v1/sandboxes/{c}"), None, 200)
        .await;
    d.wait_warm(1, Duration::from_secs(120)).await;

    // A graceful stop ends the warm guest, not the sandboxes.
    let warm_now = vms_but(&d, &[&a, &b]);
    assert_eq!(warm_now.len(), 1, "{warm_now:?}");
    let sandboxes: Vec<(String, u32)> = qemu_pids(&d.run_dir)
        .into_iter()
        .filter(|(n, _)| *n == a || *n == b)
        .collect();
    assert_eq!(sandboxes.len(), 2, "{sandboxes:?}");
    d.stop();
    let t = Instant::now();
    while warm_now.iter().any(|(_, p)| alive(*p)) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the warm guest outlived the daemon"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        sandboxes.iter().all(|(_, p)| alive(*p)),
        "a sandbox ended with the daemon"
    );

    // Start again: the sandboxes are adopted, the pool refills; after a
    // kill -9 the warm guests left behind are ended by the next start.
    d.start_again();
    d.wait_warm(1, Duration::from_secs(120)).await;
    let orphans = vms_but(&d, &[&a, &b]);
    assert_eq!(orphans.len(), 1, "{orphans:?}");
    d.kill9();
    d.start_again();
    let t = Instant::now();
    while orphans.iter().any(|(_, p)| alive(*p)) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "a warm guest left by kill -9 still runs:\n{}",
            d.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        sh(&acme, &a, "echo alive").await.out(),
        "alive",
        "{a} after the restarts"
    );
    assert_eq!(
        d.sh(&b, "echo alive").await.out(),
        "alive",
        "{b} after the restarts"
    );
    d.shutdown();
}
