//! E2B network settings (`allowInternetAccess`, `network.allowOut/denyOut`
//! at create, `PUT /sandboxes/{id}/network`) through the real egress path:
//! a real stratad `App` (security, platform policy with a connector) behind
//! the door, the sandbox's in-process egress proxy (the one the guest's
//! tunnels reach: `Security::egress_proxy`, `open_stream`), and an upstream
//! HTTP server in its own network namespace (veth pair, `10.77.N.2:80`),
//! pinned by `egress_static_hosts`. The engine is the double of `common`:
//! the guest's side of a tunnel is the duplex stream this test writes
//! `CONNECT` into (a real guest's curl is the Python suite's).
//!
//! Needs root (`ip netns`); skipped with a message when `ip netns` fails.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{door_with, Door, KEY};
use serde_json::json;
use stratad::caller::Caller;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A network namespace with an HTTP server on `10.77.N.2:80` answering
/// `upstream <path>`; removed (server killed by pid, namespace and veth
/// deleted) on drop.
struct Upstream {
    ns: String,
    veth: String,
    ip: String,
    server: Child,
}

impl Upstream {
    fn start() -> Option<Upstream> {
        let n = std::process::id() % 250 + 1;
        let ns = format!("se2b-net-{}", std::process::id());
        let veth = format!("se2bh{}", std::process::id() % 100_000);
        let peer = format!("se2bn{}", std::process::id() % 100_000);
        let (host_ip, ip) = (format!("10.77.{n}.1"), format!("10.77.{n}.2"));
        let run = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        };
        if !run(&["netns", "add", &ns]) {
            eprintln!("skipped: `ip netns add` failed (needs root)");
            return None;
        }
        let ok = run(&["link", "add", &veth, "type", "veth", "peer", "name", &peer])
            && run(&["link", "set", &peer, "netns", &ns])
            && run(&["addr", "add", &format!("{host_ip}/30"), "dev", &veth])
            && run(&["link", "set", &veth, "up"])
            && run(&[
                "netns",
                "exec",
                &ns,
                "ip",
                "addr",
                "add",
                &format!("{ip}/30"),
                "dev",
                &peer,
            ])
            && run(&["netns", "exec", &ns, "ip", "link", "set", &peer, "up"])
            && run(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
        assert!(ok, "setting up the namespace {ns} failed");
        let script = format!(
            r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        b = ("upstream " + self.path).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("{ip}", 80), H).serve_forever()
"#
        );
        let server = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .expect("upstream server");
        let u = Upstream {
            ns,
            veth,
            ip,
            server,
        };
        // Listening once a connection from the host is answered.
        let t = Instant::now();
        while std::net::TcpStream::connect((u.ip.as_str(), 80)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "upstream did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(u)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// A door whose platform policy declares connector `web` (`upstream.test`,
/// `other.test`, both pinned to the upstream) and allows by default.
async fn door(u: &Upstream) -> Door {
    let dir = tempfile::tempdir().unwrap().keep();
    let policy = dir.join("platform.toml");
    std::fs::write(
        &policy,
        "default = \"allow\"\n[[connector]]\nname = \"web\"\nhosts = [\"upstream.test\", \"other.test\"]\n",
    )
    .unwrap();
    let ip: std::net::IpAddr = u.ip.parse().unwrap();
    door_with(move |cfg, e2b| {
        cfg.security.platform_policy = Some(policy);
        cfg.security
            .egress_static_hosts
            .insert("upstream.test".into(), ip);
        cfg.security
            .egress_static_hosts
            .insert("other.test".into(), ip);
        e2b.rate_limit_per_second = 0.0;
        e2b.auth_failures_per_minute = 0;
    })
    .await
}

async fn create(d: &Door, body: serde_json::Value) -> String {
    let r = d
        .control("POST", "/v2/sandboxes", Some(KEY), &body.to_string())
        .await;
    assert_eq!(r.status, 201, "create {body}: {}", r.text());
    r.json()["sandboxID"].as_str().unwrap().to_owned()
}

/// What sandbox `id`'s guest gets for `CONNECT host:80` then `GET /probe`
/// through its egress proxy: `Ok(upstream body)` or `Err(refusal head)`.
async fn fetch(d: &Door, id: &str, host: &str) -> Result<String, String> {
    let rec = d
        .app
        .service()
        .get_sandbox(
            &Caller::system(stratad::caller::SystemReason::Embedder),
            &id.parse().unwrap(),
        )
        .await
        .unwrap();
    let guest = Caller::Guest {
        sandbox: rec.id.clone(),
        tenant: rec.tenant.clone(),
    };
    let proxy = d.app.security().unwrap().egress_proxy(&guest).unwrap();
    let mut s = proxy.open_stream().unwrap();
    s.write_all(format!("CONNECT {host}:80 HTTP/1.1\r\nHost: {host}:80\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut s).await;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head);
    }
    s.write_all(
        format!("GET /probe HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("upstream answer")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    Ok(text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

async fn read_head(s: &mut tokio::io::DuplexStream) -> String {
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(20), s.read(&mut b)).await {
            Ok(Ok(1)) => got.push(b[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn egress_follows_the_e2b_network_settings() {
    let Some(u) = Upstream::start() else { return };
    let d = door(&u).await;

    // No settings: the platform allows the connector's hosts.
    let open = create(&d, json!({"templateID": "base"})).await;
    assert_eq!(
        fetch(&d, &open, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );

    // allowInternetAccess=false: refused.
    let off = create(
        &d,
        json!({"templateID": "base", "allow_internet_access": false}),
    )
    .await;
    let r = fetch(&d, &off, "upstream.test").await;
    assert!(
        r.as_ref().is_err_and(|h| h.starts_with("HTTP/1.1 403")),
        "{r:?}"
    );

    // A fork runs on its parent's memory: it is kept from what the parent
    // is kept from, from its first instruction (the layer is copied before
    // the fork starts), and a fork of an open sandbox stays open.
    let r = d
        .control("POST", &format!("/sandboxes/{off}/fork"), Some(KEY), "{}")
        .await;
    assert_eq!(r.status, 201, "fork: {}", r.text());
    let child = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .expect("fork id")
        .to_owned();
    let r = fetch(&d, &child, "upstream.test").await;
    assert!(
        r.as_ref().is_err_and(|h| h.starts_with("HTTP/1.1 403")),
        "a fork of a sandbox without internet access got out: {r:?}"
    );
    let r = d
        .control("POST", &format!("/sandboxes/{open}/fork"), Some(KEY), "{}")
        .await;
    assert_eq!(r.status, 201, "fork: {}", r.text());
    let open_child = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .expect("fork id")
        .to_owned();
    assert_eq!(
        fetch(&d, &open_child, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );

    // Deny everything, allow one domain: the allowed one is reached (E2B:
    // allowed entries take precedence), the other is refused.
    let some = create(
        &d,
        json!({"templateID": "base",
               "network": {"allowOut": ["upstream.test"], "denyOut": ["0.0.0.0/0"]}}),
    )
    .await;
    assert_eq!(
        fetch(&d, &some, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );
    let r = fetch(&d, &some, "other.test").await;
    assert!(
        r.as_ref().is_err_and(|h| h.starts_with("HTTP/1.1 403")),
        "{r:?}"
    );

    // A wildcard domain allows its subdomains only.
    let wild = create(
        &d,
        json!({"templateID": "base", "allowInternetAccess": false,
               "network": {"allowOut": ["*.test"]}}),
    )
    .await;
    assert_eq!(
        fetch(&d, &wild, "other.test").await.as_deref(),
        Ok("upstream /probe")
    );

    // PUT network changes the running sandbox: off, then on again.
    let put = |id: String, body: &'static str| {
        let d = &d;
        async move {
            d.control("PUT", &format!("/sandboxes/{id}/network"), Some(KEY), body)
                .await
        }
    };
    let r = put(open.clone(), r#"{"allow_internet_access": false}"#).await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = fetch(&d, &open, "upstream.test").await;
    assert!(
        r.as_ref().is_err_and(|h| h.starts_with("HTTP/1.1 403")),
        "{r:?}"
    );
    let r = put(
        open.clone(),
        r#"{"denyOut": ["0.0.0.0/0"], "allowOut": ["upstream.test"]}"#,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        fetch(&d, &open, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );
    let r = fetch(&d, &open, "other.test").await;
    assert!(r.is_err(), "{r:?}");
    let r = put(open.clone(), "{}").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        fetch(&d, &open, "other.test").await.as_deref(),
        Ok("upstream /probe")
    );

    // Bad input: 400, nothing changes (the sandbox stays open).
    for body in [
        r#"{"allowOut": ["10.0.0.0/8"]}"#,
        r#"{"denyOut": ["upstream.test"]}"#,
        r#"{"allowOut": ["not a host"]}"#,
    ] {
        let r = put(open.clone(), body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
    }
    assert_eq!(
        fetch(&d, &open, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );
    // A create with bad network settings creates nothing.
    let before = d
        .control("GET", "/v2/sandboxes", Some(KEY), "")
        .await
        .json();
    let r = d
        .control(
            "POST",
            "/v2/sandboxes",
            Some(KEY),
            r#"{"templateID":"base","network":{"allowOut":["1.2.3.4"]}}"#,
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let after = d
        .control("GET", "/v2/sandboxes", Some(KEY), "")
        .await
        .json();
    assert_eq!(
        before.as_array().map(Vec::len),
        after.as_array().map(Vec::len)
    );
    // An unknown sandbox: 404.
    let r = put("sb-doesnotexist".into(), "{}").await;
    assert_eq!(r.status, 404, "{}", r.text());
    drop(u);
}
