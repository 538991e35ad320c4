//! A hostile guest against the egress caps (SECURITY-REVIEW findings 4 and
//! 17), on a real `stratad` and a real guest:
//!
//! - the daemon opens no listener for a sandbox's egress proxy (its
//!   listening TCP sockets are the API's alone, before and after egress);
//! - 2,000 guest connections held open: at most `max_tunnels_per_sandbox`
//!   are admitted, the rest closed; the daemon's descriptors stay flat,
//!   `/healthz` answers throughout, and everything is given back after;
//! - opens faster than the sandbox's bucket are refused.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

const CAP: u64 = 128;
const BURST: u64 = 150;
const RATE: f64 = 5.0;

/// Descriptors the process `pid` has open.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Local addresses of the TCP sockets `pid` has in LISTEN state (its own
/// descriptors matched against the kernel's socket table by inode).
fn listening(pid: u32) -> Vec<String> {
    let mine: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "0A" && mine.contains(f[9]) {
                out.push(format!("{table} {}", f[1]));
            }
        }
    }
    out.sort();
    out
}

async fn stats(d: &Daemon, sb: &str) -> Value {
    let v = d
        .ok("GET", &format!("/v1/sandboxes/{sb}/egress"), None, 200)
        .await;
    assert_eq!(v["proxy"], "in-process", "{v}");
    v["tunnels"].clone()
}

async fn healthz(d: &Daemon) -> bool {
    let r = d
        .api
        .client()
        .get(format!("{}/healthz", d.url))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    matches!(r, Ok(r) if r.status().as_u16() == 200)
}

/// Opens 2,000 connections to the guest's egress listener and holds them;
/// prints how many the host kept open, then (once `/tmp/release` exists)
/// sends a request on one kept connection and prints its status line.
const HOLD: &str = r#"
import os, resource, socket, time
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
except (ValueError, OSError):
    pass
socks = []
for i in range(2000):
    socks.append(socket.create_connection(("127.0.0.1", 3128), timeout=60))
def alive(s):
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
t = time.time()
while True:
    kept = [s for s in socks if alive(s)]
    if len(kept) <= 200 or time.time() - t > 40:
        break
    time.sleep(0.5)
time.sleep(1)
kept = [s for s in socks if alive(s)]
print("kept", len(kept), flush=True)
open("/tmp/held", "w").write(str(len(kept)))
t = time.time()
while not os.path.exists("/tmp/release") and time.time() - t < 60:
    time.sleep(0.1)
s = kept[0]
s.setblocking(True)
s.sendall(b"GET http://unlisted.test/ HTTP/1.1\r\nHost: unlisted.test\r\n\r\n")
print("answer", s.recv(64).split(b"\r\n")[0].decode(), flush=True)
"#;

/// 300 connections one after the other, each with one request: an
/// admitted one answers (403, the host is unlisted), a refused one closes.
const BURSTY: &str = r#"
import socket, time
ok = refused = 0
t = time.time()
for i in range(300):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    data = b""
    try:
        s.sendall(b"GET http://unlisted.test/ HTTP/1.1\r\nHost: unlisted.test\r\n\r\n")
        while True:
            c = s.recv(4096)
            if not c:
                break
            data += c
    except OSError:
        data = b""
    s.close()
    if data.startswith(b"HTTP/1.1 403"):
        ok += 1
    elif data == b"":
        refused += 1
    else:
        print("odd", data[:60])
print(ok, refused, time.time() - t, flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_exhaust_the_daemon_through_egress() {
    let d = Daemon::start(&format!(
        "[egress]\nmax_tunnels_per_sandbox = {CAP}\nopen_rate_per_second = {RATE}\nopen_burst = {BURST}\n\
         head_timeout = \"5m\"\n"
    ));
    d.wait_template().await;
    let pid = d.pid();
    let before = listening(pid);
    assert_eq!(before.len(), 1, "the API listener only: {before:?}");
    let sb = d.create(json!({})).await;

    // Egress works (the agent enabled it on connect) and opened no listener.
    let e = d
        .sh(
            &sb,
            "curl -s -o /dev/null -w '%{http_code}' http://unlisted.test/",
        )
        .await;
    assert_eq!(e.out(), "403", "{:?}", String::from_utf8_lossy(&e.stderr));
    let after = listening(pid);
    assert_eq!(
        after, before,
        "a listener appeared for the sandbox's egress proxy"
    );

    // 2,000 held connections.
    let base = fd_count(pid);
    let max_fd = Arc::new(AtomicUsize::new(base));
    let health_failures = Arc::new(AtomicUsize::new(0));
    let health_checks = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watch = {
        let (max_fd, fails, checks, done) = (
            max_fd.clone(),
            health_failures.clone(),
            health_checks.clone(),
            done.clone(),
        );
        let d = &d;
        async move {
            while !done.load(Ordering::SeqCst) {
                max_fd.fetch_max(fd_count(pid), Ordering::SeqCst);
                if !healthz(d).await {
                    fails.fetch_add(1, Ordering::SeqCst);
                }
                checks.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let t0 = Instant::now();
    let hold = d.exec(&sb, &["python3", "-c", HOLD]);
    let drive = async {
        // Wait until the guest counted its kept connections.
        let t = Instant::now();
        loop {
            let e = d.sh(&sb, "cat /tmp/held 2>/dev/null").await;
            if !e.out().is_empty() {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "the guest never held"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let held = stats(&d, &sb).await;
        let _ = d.sh(&sb, "touch /tmp/release").await;
        held
    };
    let (e, held) = {
        let all = async {
            let r = tokio::join!(hold, drive);
            done.store(true, Ordering::SeqCst);
            r
        };
        let (r, ()) = tokio::join!(all, watch);
        r
    };
    let took = t0.elapsed();
    let out = e.out();
    assert_eq!(
        e.code,
        Some(0),
        "{out}\n{}",
        String::from_utf8_lossy(&e.stderr)
    );
    let max_fd = max_fd.load(Ordering::SeqCst);
    eprintln!(
        "2000 connections: {out:?} in {took:?}; daemon fds {base} -> max {max_fd}; stats {held}; \
         healthz {} checks, {} failed",
        health_checks.load(Ordering::SeqCst),
        health_failures.load(Ordering::SeqCst)
    );
    assert!(out.contains(&format!("kept {CAP}\n")), "{out}");
    assert!(
        out.contains("answer HTTP/1.1 403"),
        "a kept connection is a live proxy: {out}"
    );
    assert_eq!(held["open"], CAP, "{held}");
    assert_eq!(held["refused_sandbox_cap"], 2000 - CAP, "{held}");
    assert!(
        max_fd <= base + 32,
        "daemon descriptors grew with the guest's connections: {base} -> {max_fd}"
    );
    assert!(health_checks.load(Ordering::SeqCst) > 5);
    assert_eq!(
        health_failures.load(Ordering::SeqCst),
        0,
        "/healthz failed under load"
    );

    // Everything is given back once the guest's connections close.
    let t = Instant::now();
    loop {
        let s = stats(&d, &sb).await;
        if s["open"] == 0 && s["upstream"] == 0 && fd_count(pid) <= base + 4 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "not given back: {s}, fds {} (base {base})",
            fd_count(pid)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Opens faster than the bucket refills are refused.
    let before = stats(&d, &sb).await;
    let e = d.exec(&sb, &["python3", "-c", BURSTY]).await;
    let out = e.out();
    let after = stats(&d, &sb).await;
    eprintln!("300 quick connections: {out:?}; stats {after}");
    let f: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(f.len(), 3, "{out}");
    let (ok, refused, secs) = (f[0], f[1], f[2]);
    assert_eq!(ok + refused, 300.0, "{out}");
    assert!(refused > 0.0, "no open was refused: {out}");
    assert!(
        ok <= BURST as f64 + RATE * secs + 2.0,
        "more opens than the bucket allows: {out}"
    );
    let rate_refusals =
        after["refused_rate"].as_u64().unwrap_or(0) - before["refused_rate"].as_u64().unwrap_or(0);
    assert_eq!(rate_refusals as f64, refused, "{before} -> {after}");
    assert!(healthz(&d).await);
    d.shutdown();
}
