//! TLS for routed hosts, end to end: a real `stratad` with the E2B door and
//! `--e2b-tls-listen`, a real TCG guest running `python3 -m http.server`:
//!
//! - the create answer's `domain` is `localhost:<TLS port>`;
//! - `https://8001-<id>.localhost:<TLS port>/` answers the guest's
//!   directory listing to a client that trusts only the daemon's CA
//!   (`GET /v1/ca`); a client without it fails certificate verification;
//! - an SNI outside the domain (`…example.org`) fails the handshake;
//! - the plain listener still routes the same host;
//! - after a daemon restart the CA is the same and the guest's port
//!   answers over TLS at once.
//!
//! Cleanup: the daemon and its QEMUs are killed by pid, the pool unmounted
//! (`strata_testkit::teardown`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod guest_door;
use guest_door::GuestDoor as Daemon;

const KEY: &str = "e2b_tls_default_key";

/// The door of these tests, on `root` (new when `None`), TLS on a second port.
fn start(root: Option<PathBuf>) -> Daemon {
    Daemon::start("st-", root, &[KEY], true)
}

/// `GET /v1/ca`: the daemon's CA certificate (PEM).
async fn fetch_ca(d: &Daemon) -> String {
    let r = d
        .api
        .req(reqwest::Method::GET, "/v1/ca")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    r.text().await.unwrap()
}

/// The daemon's TLS listener.
fn tls_addr(d: &Daemon) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], tls_port(d)))
}

fn tls_port(d: &Daemon) -> u16 {
    d.tls_port.expect("started with TLS")
}

/// A rustls client that trusts `ca` only (none: no root at all), `name`
/// resolved to the daemon's TLS port.
fn client(ca: Option<&str>, name: &str, addr: SocketAddr) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .resolve(name, addr)
        .timeout(Duration::from_secs(60));
    if let Some(pem) = ca {
        b = b.add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap());
    }
    b.build().unwrap()
}

/// GETs `url` until the guest server answers (it may still be starting).
async fn get_listing(c: &reqwest::Client, url: &str) -> (u16, String) {
    let t = Instant::now();
    loop {
        let r = c.get(url).send().await.unwrap();
        let s = r.status().as_u16();
        let body = r.text().await.unwrap_or_default();
        if s != 502 || t.elapsed() > Duration::from_secs(60) {
            return (s, body);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_hosts_over_tls_with_the_daemons_ca() {
    let d = start(None);
    d.wait_template().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let r = http
        .post(format!("{}/sandboxes", d.url))
        .header("X-API-KEY", KEY)
        .json(&json!({"templateID": "base", "timeout": 900}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let created: Value = r.json().await.unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_owned();
    // get_host(port) lands on the TLS listener.
    assert_eq!(
        created["domain"],
        format!("localhost:{}", tls_port(&d)),
        "{created}"
    );
    let e = d
        .api
        .exec(
            &id,
            json!({"cmd": ["sh", "-c", "mkdir -p /srv && echo hi > /srv/tls-hello.txt && \
                cd /srv && (setsid python3 -m http.server 8001 --bind 127.0.0.1 >/tmp/h.log 2>&1 &)"]}),
        )
        .await
        .unwrap();
    assert_eq!(e.code, Some(0), "{:?}", e);

    // The CA: served by /v1/ca, kept on disk with the key 0600.
    let ca = fetch_ca(&d).await;
    assert!(ca.starts_with("-----BEGIN CERTIFICATE-----"), "{ca}");
    let on_disk = std::fs::read_to_string(d.root.join("data/ca/ca.pem")).unwrap();
    assert_eq!(ca, on_disk);
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(d.root.join("data/ca/ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // Trusting only the daemon's CA: the guest's directory listing.
    let name = format!("8001-{id}.localhost");
    let url = format!("https://{name}:{}/", tls_port(&d));
    let trusting = client(Some(&ca), &name, tls_addr(&d));
    let (s, body) = get_listing(&trusting, &url).await;
    assert_eq!(s, 200, "{body}\n{}", d.logs());
    assert!(body.contains("tls-hello.txt"), "{body}");

    // Without the CA: certificate verification fails.
    let e = client(None, &name, tls_addr(&d))
        .get(&url)
        .send()
        .await
        .expect_err("a client that does not trust the CA must fail");
    let text = chain(&e);
    assert!(
        text.to_lowercase().contains("certificate"),
        "not a verification error: {text}"
    );

    // An SNI outside the domain: no certificate, the handshake fails.
    let foreign = format!("8001-{id}.example.org");
    let e = client(Some(&ca), &foreign, tls_addr(&d))
        .get(format!("https://{foreign}:{}/", tls_port(&d)))
        .send()
        .await
        .expect_err("a foreign SNI must fail the handshake");
    let text = chain(&e);
    assert!(
        text.contains("AccessDenied") || text.contains("HandshakeFailure"),
        "not a handshake failure: {text}"
    );

    // The plain listener routes the same host (the domain's port is not compared).
    let r = http
        .get(format!("{}/", d.url))
        .header("Host", format!("8001-{id}.localhost:{}", d.port))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().await.unwrap().contains("tls-hello.txt"));

    // A restart keeps the CA: the same PEM.
    let root = d.kill_keep_root();
    let d = start(Some(root));
    assert_eq!(fetch_ca(&d).await, ca, "the CA changed across a restart");

    // The restarted daemon adopted the guest: its port answers over TLS at
    // once (no 502 retries here), to a client trusting the same CA.
    let url = format!("https://{name}:{}/tls-hello.txt", tls_port(&d));
    let t0 = Instant::now();
    let r = client(Some(&ca), &name, tls_addr(&d))
        .get(&url)
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no TLS answer after the restart: {}\n{}",
                chain(&e),
                d.logs()
            )
        });
    let s = r.status().as_u16();
    let body = r.text().await.unwrap_or_default();
    assert_eq!(
        (s, body.as_str()),
        (200, "hi\n"),
        "after {:?}\n{}",
        t0.elapsed(),
        d.logs()
    );
}
