//! Guest ports through the E2B door, end to end: a real `stratad` process
//! with the door on (`[e2b] enabled`, two keys of two tenants), a real TCG
//! guest of the test image, `python3 -m http.server` (and a small streaming
//! and upgrading server) inside it, reached over the agent channel:
//!
//! - `E2b-Sandbox-Id` + `E2b-Sandbox-Port` (how the SDKs talk to
//!   `E2B_SANDBOX_URL`) and `Host: <port>-<id>.<domain>` (`get_host`), with
//!   the create answer's `domain` (`localhost:<daemon port>`);
//! - a chunked response arrives while the guest writes it; an `Upgrade`
//!   request gets `101` and a raw byte pipe (what WebSocket rides on);
//! - nothing listening answers `502`; another tenant's sandbox answers like
//!   an unknown one (`404`); a wrong traffic token `401`;
//! - a hibernated sandbox wakes on port traffic;
//! - each connection is one audit entry (`port`) with its byte counts.
//!
//! Cleanup as the stratad suite's harness: the daemon and its QEMUs are
//! killed by pid, the pool unmounted (`strata_testkit::teardown`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod guest_door;
use guest_door::GuestDoor as Daemon;

const KEY: &str = "e2b_ports_default_key";
const ACME_KEY: &str = "e2b_ports_acme_key";

/// The door of these tests: keys of two tenants, no TLS.
fn start() -> Daemon {
    Daemon::start("sp-", None, &[KEY, "e2b_ports_acme_key=acme:bot"], false)
}

/// A guest server on 8001: `/stream` writes 4 chunks 700 ms apart;
/// an `Upgrade: echo` request gets `101` and then an echo of raw bytes.
const STREAM_SERVER: &str = r#"
import http.server, socketserver, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101)
            self.send_header("Upgrade", "echo")
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            while True:
                b = self.rfile.read1(4096)
                if not b:
                    return
                self.wfile.write(b)
                self.wfile.flush()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(4):
            data = ("data: tick %d\n\n" % i).encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.7)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
    def log_message(self, *a):
        pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 8001), H).serve_forever()
"#;

/// Imports, says it is ready, sleeps 3 s, then serves `/srv` on 8002.
const LATE_SERVER: &str = r#"
import http.server, os, time
open("/tmp/late.ready", "w").close()
time.sleep(3)
os.chdir("/srv")
http.server.ThreadingHTTPServer(("127.0.0.1", 8002), http.server.SimpleHTTPRequestHandler).serve_forever()
"#;

async fn audit_port_entries(d: &Daemon, id: &str) -> Vec<Value> {
    let r = d
        .api
        .req(reqwest::Method::GET, &format!("/v1/audit?sandbox={id}"))
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["call"]["kind"]["kind"] == "port")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_ports_through_the_e2b_door() {
    let d = start();
    d.wait_template().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();

    // Create through the E2B API: its answer names the domain to route by.
    let r = http
        .post(format!("{}/sandboxes", d.url))
        .header("X-API-KEY", KEY)
        .json(&json!({"templateID": "base", "timeout": 600}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let created: Value = r.json().await.unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(
        created["domain"],
        format!("localhost:{}", d.port),
        "{created}"
    );
    let traffic = created["trafficAccessToken"].as_str().unwrap().to_owned();

    // Servers in the guest.
    d.sh(
        &id,
        "mkdir -p /srv && echo 'hello from the guest' > /srv/hello.txt && \
         cd /srv && (setsid python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/h.log 2>&1 &)",
    )
    .await;
    d.sh(
        &id,
        &format!(
            "cat > /tmp/stream.py <<'EOF'\n{STREAM_SERVER}\nEOF\n\
             (setsid python3 /tmp/stream.py >/tmp/s.log 2>&1 &)"
        ),
    )
    .await;
    let up = d
        .sh(
            &id,
            "for i in $(seq 1 100); do \
               python3 -c 'import socket; [socket.create_connection((\"127.0.0.1\", p)).close() for p in (8000, 8001)]' \
               2>/dev/null && echo up && exit 0; sleep 0.2; done; echo down",
        )
        .await;
    assert_eq!(up.trim(), "up", "guest servers did not start");

    // 1. Headers, as the SDKs send everything to E2B_SANDBOX_URL.
    let r = http
        .get(format!("{}/hello.txt", d.url))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "8000")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "hello from the guest\n");

    // A path the daemon itself serves goes to the guest all the same.
    let r = http
        .get(format!("{}/v1/sandboxes", d.url))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "8000")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404, "http.server's own 404");
    assert!(r.text().await.unwrap().contains("File not found"));

    // 2. Host routing, as get_host(8000) names it (with the traffic token).
    let host = format!("8000-{id}.{}", created["domain"].as_str().unwrap());
    let r = http
        .get(format!("{}/hello.txt", d.url))
        .header("Host", &host)
        .header("e2b-traffic-access-token", &traffic)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "hello from the guest\n");
    let r = http
        .get(format!("{}/hello.txt", d.url))
        .header("Host", &host)
        .header("e2b-traffic-access-token", "0".repeat(64))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);

    // 3. A streamed answer: the first event arrives long before the last.
    let t0 = Instant::now();
    let mut r = http
        .get(format!("{}/stream", d.url))
        .header("Host", format!("8001-{id}.localhost:{}", d.port))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    let first_at = t0.elapsed();
    let mut all = first.to_vec();
    while let Some(c) = r.chunk().await.unwrap() {
        all.extend_from_slice(&c);
    }
    let last_at = t0.elapsed();
    assert!(String::from_utf8_lossy(&first).contains("tick 0"));
    assert_eq!(
        String::from_utf8_lossy(&all).matches("data: tick").count(),
        4
    );
    assert!(
        last_at - first_at >= Duration::from_millis(1500),
        "first chunk at {first_at:?}, last at {last_at:?}: not streamed"
    );

    // 4. Upgrade: 101, then a raw byte pipe both ways.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    s.write_all(
        format!(
            "GET /pipe HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {id}\r\n\
             E2b-Sandbox-Port: 8001\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            n,
            1,
            "closed in the head: {}",
            String::from_utf8_lossy(&head)
        );
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: echo"), "{head}");
    for msg in [&b"ping 1"[..], b"second message"] {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, msg);
    }
    drop(s);

    // 5. Nothing on the port: 502, E2B's "port is not open".
    let r = http
        .get(format!("{}/", d.url))
        .header("E2b-Sandbox-Id", &id)
        .header("E2b-Sandbox-Port", "8999")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["code"].as_u64(), v["port"].as_u64()),
        (Some(502), Some(8999))
    );

    // 6. Another tenant's sandbox answers exactly like an unknown one.
    let unknown = "sb-00000000000000000000000000";
    let ask = |sb: String| {
        http.get(format!("{}/hello.txt", d.url))
            .header("X-API-KEY", ACME_KEY)
            .header("E2b-Sandbox-Id", sb)
            .header("E2b-Sandbox-Port", "8000")
            .send()
    };
    let theirs = ask(id.clone()).await.unwrap();
    let none = ask(unknown.into()).await.unwrap();
    assert_eq!(theirs.status().as_u16(), 404);
    assert_eq!(none.status().as_u16(), 404);
    let (a, b): (Value, Value) = (theirs.json().await.unwrap(), none.json().await.unwrap());
    assert_eq!(
        a["message"].as_str().unwrap().replace(&id, "X"),
        b["message"].as_str().unwrap().replace(unknown, "X")
    );

    // 7. One audit entry per connection, with its byte counts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let entries = audit_port_entries(&d, &id).await;
    let with_bytes: Vec<&Value> = entries
        .iter()
        .filter(|e| {
            e["call"]["kind"]["bytes"]["from_guest"]
                .as_u64()
                .unwrap_or(0)
                > 0
        })
        .collect();
    assert!(
        with_bytes.len() >= 5,
        "audit: {}",
        serde_json::to_string_pretty(&entries).unwrap()
    );
    let upgraded = entries
        .iter()
        .filter(|e| e["call"]["kind"]["port"] == 8001)
        .any(|e| e["call"]["kind"]["bytes"]["to_guest"].as_u64().unwrap_or(0) >= 20);
    assert!(upgraded, "the upgraded connection's bytes are audited");

    // 8. The policy decides each connection (kind `port`).
    let put_policy = |text: &'static str| {
        d.api
            .req(reqwest::Method::PUT, &format!("/v1/sandboxes/{id}/policy"))
            .header("content-type", "application/toml")
            .body(text)
            .send()
    };
    let r = put_policy("[[rule]]\nid = \"no-ports\"\neffect = \"deny\"\nkind = \"port\"\n")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{}", r.text().await.unwrap());
    let r = http
        .get(format!("{}/hello.txt", d.url))
        .header("Host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.text().await.unwrap().contains("no-ports"));
    let denied = audit_port_entries(&d, &id)
        .await
        .into_iter()
        .filter(|e| e["decision"]["outcome"] == "denied")
        .count();
    assert_eq!(denied, 1, "the refusal is audited once");
    let r = put_policy("[[rule]]\nid = \"ports-ok\"\neffect = \"allow\"\nkind = \"port\"\n")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // 9. Hibernated: the next port request wakes it.
    let (s, v) = d
        .v1(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/hibernate"),
            Some(json!({})),
        )
        .await;
    assert!(s < 300, "hibernate: {s} {v}");
    assert_eq!(d.state(&id).await, "hibernated");
    let r = http
        .get(format!("{}/hello.txt", d.url))
        .header("Host", &host)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "hello from the guest\n");
    assert_eq!(d.state(&id).await, "running");
}

/// After a daemon restart (its VMs live on and are adopted), a guest port
/// answers over the routed host at once, with and without the traffic token
/// the create answer gave (the token is the same after the restart), also
/// when the daemon died with a port connection mid-upload and another
/// mid-download.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_hosts_answer_after_a_daemon_restart() {
    let d = start();
    d.wait_template().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let r = http
        .post(format!("{}/sandboxes", d.url))
        .header("X-API-KEY", KEY)
        .json(&json!({"templateID": "base", "timeout": 600}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let created: Value = r.json().await.unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    let traffic = created["trafficAccessToken"].as_str().unwrap().to_owned();
    d.sh(
        &id,
        "mkdir -p /srv && echo 'before and after' > /srv/r.txt && \
         cd /srv && (setsid python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/h.log 2>&1 &)",
    )
    .await;
    let get = |url: String, host: String, token: Option<String>| {
        let mut rq = http.get(url).header("Host", host);
        if let Some(t) = token {
            rq = rq.header("e2b-traffic-access-token", t);
        }
        rq.send()
    };
    let t = Instant::now();
    loop {
        let r = get(
            format!("{}/r.txt", d.url),
            format!("8000-{id}.localhost:{}", d.port),
            None,
        )
        .await
        .unwrap();
        if r.status().as_u16() == 200 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "guest server never up"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // A connection is mid-request when the daemon dies (an upload under
    // way: the guest holds the tunnel open waiting for the rest).
    let mut held = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    held.write_all(
        format!(
            "POST /r.txt HTTP/1.1\r\nHost: 8000-{id}.localhost\r\n\
             Content-Length: 100000\r\n\r\npartial"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // And one mid-download: the guest streams 64 MiB nobody reads, so the
    // tunnel's window and the agent channel are full when the daemon dies.
    d.sh(&id, "head -c 67108864 /dev/zero > /srv/big").await;
    let mut stalled = tokio::net::TcpStream::connect(("127.0.0.1", d.port))
        .await
        .unwrap();
    stalled
        .write_all(format!("GET /big HTTP/1.1\r\nHost: 8000-{id}.localhost\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(60), stalled.read_exact(&mut first))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&first);
    assert!(
        head.starts_with("HTTP/1.") && head.ends_with(" 200"),
        "{head}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let root = d.kill_keep_root();
    drop((held, stalled));
    let d = Daemon::start("sp-", Some(root), &[KEY], false);
    let t0 = Instant::now();
    for token in [None, Some(traffic.clone())] {
        let r = get(
            format!("{}/r.txt", d.url),
            format!("8000-{id}.localhost:{}", d.port),
            token.clone(),
        )
        .await;
        let r = match r {
            Ok(r) => r,
            Err(e) => panic!(
                "no answer after the restart ({:?}, token {}): {e}\n{}",
                t0.elapsed(),
                token.is_some(),
                d.logs()
            ),
        };
        let s = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_eq!(
            (s, body.as_str()),
            (200, "before and after\n"),
            "after the restart (token {})\n{}",
            token.is_some(),
            d.logs()
        );
    }
    // envd on the same sandbox answers too (the agent was re-adopted).
    assert_eq!(d.state(&id).await, "running");
}

/// A port request that wakes a hibernated sandbox whose server was still
/// starting when it went to sleep (E2B's `test_auto_resume_wakes_on_http_request`
/// race) waits a short while for the server instead of answering `502`; a
/// port nothing will listen on still answers `502` after that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waking_request_waits_for_the_guest_server() {
    let d = start();
    d.wait_template().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let (s, v) = d
        .v1(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "tpl-default"})),
        )
        .await;
    assert!(s < 300, "create: {s} {v}");
    let id = v["id"].as_str().unwrap().to_owned();
    // A server that is started (imports done, `/tmp/late.ready`) but binds
    // only 3 s (guest time) later; the sandbox sleeps as soon as it is ready.
    d.sh(
        &id,
        &format!(
            "mkdir -p /srv && echo late > /srv/late.txt && cat > /tmp/late.py <<'EOF'\n{LATE_SERVER}\nEOF\n\
             (setsid python3 /tmp/late.py >/tmp/l.log 2>&1 &)"
        ),
    )
    .await;
    let ready = d
        .sh(
            &id,
            "for i in $(seq 1 300); do [ -e /tmp/late.ready ] && echo ready && exit 0; sleep 0.1; done; echo no",
        )
        .await;
    assert_eq!(ready.trim(), "ready", "the late server did not start");
    let hibernate = || async {
        let (s, v) = d
            .v1(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/hibernate"),
                Some(json!({})),
            )
            .await;
        assert!(s < 300, "hibernate: {s} {v}");
        assert_eq!(d.state(&id).await, "hibernated");
    };
    hibernate().await;
    let t0 = Instant::now();
    let r = http
        .get(format!("{}/late.txt", d.url))
        .header("Host", format!("8002-{id}.localhost:{}", d.port))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    let body = r.text().await.unwrap();
    assert_eq!(
        (s, body.as_str()),
        (200, "late\n"),
        "the waking request ({:?})",
        t0.elapsed()
    );
    eprintln!("wake + late server: {:?}", t0.elapsed());

    // Nothing ever listens on 8999: after the window, 502.
    hibernate().await;
    let t0 = Instant::now();
    let r = http
        .get(format!("{}/", d.url))
        .header("Host", format!("8999-{id}.localhost:{}", d.port))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_secs(30),
        "a closed port after a wake answers within the window: {waited:?}"
    );
    // Running and closed: 502 after the (shorter) connect grace, 3 s by
    // default, not the wake's window.
    let t0 = Instant::now();
    let r = http
        .get(format!("{}/", d.url))
        .header("Host", format!("8999-{id}.localhost:{}", d.port))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(2500) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
}
