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

/// One namespace at a time: the tests of this file share its names and
/// addresses (derived from the pid).
static NETNS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A door whose platform policy declares connector `web` (`upstream.test`,
/// `other.test`, both pinned to the upstream), connector `lab` for the
/// upstream's private range (`10.77.0.0/16`: the operator opens it) and
/// `internet` for every public address (`0.0.0.0/0`), and allows by default.
async fn door(u: &Upstream) -> Door {
    let dir = tempfile::tempdir().unwrap().keep();
    let policy = dir.join("platform.toml");
    std::fs::write(
        &policy,
        "default = \"allow\"\n[[connector]]\nname = \"web\"\nhosts = [\"upstream.test\", \"other.test\"]\n\
         [[connector]]\nname = \"lab\"\ncidrs = [\"10.77.0.0/16\"]\n\
         [[connector]]\nname = \"internet\"\ncidrs = [\"0.0.0.0/0\", \"::/0\"]\n",
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
        // The refusal's JSON body follows (the proxy closes after it).
        let mut body = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut body)).await;
        return Err(head + &String::from_utf8_lossy(&body));
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

/// What sandbox `id`'s guest gets for a plain `GET http://<host>/probe`
/// through its egress proxy (no tunnel): `Ok(body)` or `Err(answer)`.
async fn fetch_plain(d: &Door, id: &str, host: &str) -> Result<String, String> {
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
    s.write_all(
        format!("GET http://{host}/probe HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out))
        .await
        .expect("proxy answer")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    if !(text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200")) {
        return Err(text);
    }
    Ok(text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

/// `r` is the proxy's 403 with machine-readable `rule`.
fn refused_by(r: &Result<String, String>, rule: &str) -> bool {
    r.as_ref().is_err_and(|h| {
        h.starts_with("HTTP/1.1 403") && h.contains(&format!("\"rule\":\"{rule}\""))
    })
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
    let _ns = NETNS.lock().await;
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
        r#"{"allowOut": ["10.0.0.0/33"]}"#,
        r#"{"denyOut": ["127.1"]}"#,
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
            r#"{"templateID":"base","network":{"allowOut":["1.2.3.4/40"]}}"#,
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

/// `allowOut` / `denyOut` IPs and CIDRs on IP-literal destinations: a CIDR
/// allow reaches the upstream by its address (tunnel and plain HTTP), a CIDR
/// deny refuses it, allowed entries win over denied ones, and no rule opens
/// loopback, the metadata address or the host's own address.
#[tokio::test]
async fn cidr_entries_decide_ip_literal_egress() {
    let _ns = NETNS.lock().await;
    let Some(u) = Upstream::start() else { return };
    let d = door(&u).await;
    let ip = u.ip.clone();
    let net24 = format!("{}.0/24", ip.rsplit_once('.').unwrap().0);
    let host_side = format!("{}.1", ip.rsplit_once('.').unwrap().0);

    // No settings: the operator's `lab` range holds the address.
    let open = create(&d, json!({"templateID": "base"})).await;
    assert_eq!(
        fetch(&d, &open, &ip).await.as_deref(),
        Ok("upstream /probe"),
        "CONNECT to an IP literal in an operator range"
    );
    assert_eq!(
        fetch_plain(&d, &open, &ip).await.as_deref(),
        Ok("upstream /probe"),
        "plain HTTP to an IP literal in an operator range"
    );

    // Deny everything, allow the upstream's /24: the address is reached,
    // names are not.
    let only = create(
        &d,
        json!({"templateID": "base",
               "network": {"allowOut": [net24], "denyOut": ["0.0.0.0/0"]}}),
    )
    .await;
    assert_eq!(
        fetch(&d, &only, &ip).await.as_deref(),
        Ok("upstream /probe")
    );
    assert_eq!(
        fetch_plain(&d, &only, &ip).await.as_deref(),
        Ok("upstream /probe")
    );
    let r = fetch(&d, &only, "upstream.test").await;
    assert!(refused_by(&r, "e2b-deny-out"), "{r:?}");

    // A CIDR deny refuses the address (tunnel and plain), nothing else.
    let deny = create(
        &d,
        json!({"templateID": "base", "network": {"denyOut": [net24]}}),
    )
    .await;
    let r = fetch(&d, &deny, &ip).await;
    assert!(refused_by(&r, "e2b-deny-out-ip"), "{r:?}");
    let r = fetch_plain(&d, &deny, &ip).await;
    assert!(refused_by(&r, "e2b-deny-out-ip"), "{r:?}");
    // CIDR rules match address literals; a name is decided by name.
    assert_eq!(
        fetch(&d, &deny, "upstream.test").await.as_deref(),
        Ok("upstream /probe")
    );

    // Allowed wins over denied (E2B): the /32 in a denied /24.
    let both = create(
        &d,
        json!({"templateID": "base",
               "network": {"allowOut": [ip.clone()], "denyOut": [net24]}}),
    )
    .await;
    assert_eq!(
        fetch(&d, &both, &ip).await.as_deref(),
        Ok("upstream /probe")
    );

    // PUT network switches a running sandbox to the deny and back.
    let r = d
        .control(
            "PUT",
            &format!("/sandboxes/{open}/network"),
            Some(KEY),
            &json!({"denyOut": [ip.clone()]}).to_string(),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = fetch(&d, &open, &ip).await;
    assert!(refused_by(&r, "e2b-deny-out-ip"), "{r:?}");

    // No user rule opens loopback, link-local (the metadata address), a
    // private address the operator did not open, or the host's own address
    // (the veth's host side, inside the operator's private range).
    let greedy = create(
        &d,
        json!({"templateID": "base",
               "network": {"allowOut": ["127.0.0.1", "169.254.169.254", "192.168.0.0/16",
                                        host_side.clone(), "::1"],
                           "denyOut": ["0.0.0.0/0"]}}),
    )
    .await;
    for dest in [
        "127.0.0.1",
        "169.254.169.254",
        "192.168.1.1",
        &host_side,
        "[::1]",
    ] {
        let r = fetch(&d, &greedy, dest).await;
        assert!(refused_by(&r, "address-guard"), "{dest}: {r:?}");
        let r = fetch_plain(&d, &greedy, dest).await;
        assert!(refused_by(&r, "address-guard"), "plain {dest}: {r:?}");
    }
    // Numeric forms other than the canonical address stay refused.
    let r = fetch(&d, &open, "2130706433").await;
    assert!(r.as_ref().is_err_and(|h| h.contains("ip_literal")), "{r:?}");
    drop(u);
}
