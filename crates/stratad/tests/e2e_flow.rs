//! End-to-end flow control of guest output (SECURITY-REVIEW finding 3): a
//! real `stratad` with a real guest. A client that does not read an exec's
//! body stops the command's pipe in the guest; the daemon's memory does not
//! grow with the unread output. Read later, the stream is complete, and the
//! sandbox goes on answering.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use futures::StreamExt;
use serde_json::{json, Value};

/// Resident memory of process `pid`, in bytes (`VmRSS` of /proc/PID/status).
fn rss(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

const MIB: u64 = 1024 * 1024;

/// The byte count of a `{"stdout":"<base64>"}` line whose data are all
/// zero bytes (`None`: another line). Counted from the base64 text, which
/// is all `A`s for zeros: decoding 1 GiB in a debug build takes minutes.
fn zeros_in(line: &[u8]) -> Option<u64> {
    let b64 = line
        .strip_prefix(br#"{"stdout":""#)?
        .strip_suffix(br#""}"#)?;
    let pad = b64.iter().rev().take_while(|&&c| c == b'=').count();
    let body = &b64[..b64.len() - pad];
    assert!(
        b64.len() % 4 == 0 && pad <= 2 && body.iter().all(|&c| c == b'A'),
        "stdout that is not zeros: {}",
        String::from_utf8_lossy(&line[..line.len().min(80)])
    );
    Some((b64.len() / 4 * 3 - pad) as u64)
}

/// Starts `script` through the API and returns the response unread (no
/// overall deadline: the body may take long).
async fn exec_unread(d: &Daemon, id: &str, script: &str) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/sandboxes/{id}/exec", d.url))
        .json(&json!({ "cmd": ["sh", "-c", script] }));
    if let Some(t) = d.token() {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.expect("exec");
    assert_eq!(resp.status(), 200);
    resp
}

/// Reads an exec body of zeros: the byte count and the exit (if it came),
/// stopping after `max` bytes if given.
async fn read_zeros(resp: reqwest::Response, max: Option<u64>) -> (u64, Option<Value>) {
    let t = Instant::now();
    let mut stream = resp.bytes_stream();
    let (mut buf, mut got, mut exit) = (Vec::new(), 0u64, None::<Value>);
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.expect("body"));
        let mut start = 0;
        while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
            let line = &buf[start..start + nl];
            start += nl + 1;
            got += zeros_in(line).unwrap_or_else(|| {
                let v: Value = serde_json::from_slice(line).expect("ndjson");
                assert!(exit.is_none(), "a line after the exit: {v}");
                assert!(v.get("exit").is_some(), "unexpected line {v}");
                exit = Some(v["exit"].clone());
                0
            });
        }
        buf.drain(..start);
        if max.is_some_and(|m| got >= m) {
            break;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "read {} MiB in {secs:.1} s ({:.1} MiB/s)",
        got / MIB,
        got as f64 / MIB as f64 / secs
    );
    (got, exit)
}

#[test]
fn unread_one_gib_exec_stream_keeps_daemon_memory_flat() {
    let d = Daemon::start("");
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let id = d.create(json!({})).await;
        let pid = d.pid();
        // Warm the exec path (first connection, allocator pools) before the baseline.
        let e = d.sh(&id, "echo warm").await;
        assert_eq!(e.out(), "warm");
        let before = rss(pid);

        let total: u64 = 1024 * MIB;
        let resp = exec_unread(&d, &id, &format!("head -c {total} /dev/zero")).await;
        // The body is not read for 15 s. Without flow control the daemon
        // buffers the guest's output as fast as the agent channel carries it.
        let mut peak = before;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(15) {
            peak = peak.max(rss(pid));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let grew = peak.saturating_sub(before);
        eprintln!(
            "daemon VmRSS before {} MiB, peak while unread {} MiB (+{:.1} MiB)",
            before / MIB,
            peak / MIB,
            grew as f64 / MIB as f64
        );
        assert!(
            grew < 64 * MIB,
            "daemon RSS grew by {} MiB under an unread exec stream",
            grew / MIB
        );
        // The command is held in the guest, not finished behind our back.
        let e = d.sh(&id, "pgrep -x head >/dev/null && echo running").await;
        assert_eq!(e.out(), "running", "{:?}", e.error);

        // Reading resumes it: the first 64 MiB arrive, all zeros, in order.
        let (got, exit) = read_zeros(resp, Some(64 * MIB)).await;
        assert!(got >= 64 * MIB && exit.is_none());
        // The client goes away (the agent then drops the rest in the guest;
        // `dropped_handle_lets_the_command_run_on` in the agent tests checks
        // that). End the command rather than wait for a TCG guest to read
        // 960 MiB.
        let e = d.sh(&id, "pkill -x head; true").await;
        assert_eq!(e.code, Some(0), "{:?}", e.error);

        // A stream held back and then read in full is complete, with its exit.
        let total = 32 * MIB;
        let resp = exec_unread(&d, &id, &format!("head -c {total} /dev/zero")).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (got, exit) = read_zeros(resp, None).await;
        assert_eq!(got, total);
        assert_eq!(exit, Some(json!({"code": 0, "signal": null})));
        let e = d.sh(&id, "echo still here").await;
        assert_eq!(e.out(), "still here");
    });
    d.shutdown();
}
