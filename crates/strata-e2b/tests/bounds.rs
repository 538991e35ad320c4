//! The E2B door's resource bounds and per-key identities (security review
//! findings 7 and 18), over a real stratad `App` (store, security, policy,
//! audit) behind the door on a real listener; the engine is the double of
//! `common` (no VM: what a guest keeps of a refused upload is checked by the
//! SDK suite, `tests/python`, on real guests).
//!
//! - Credentials are checked before any body is read: an anonymous request
//!   announcing 1 GiB is answered at once, and bodies sent to refused
//!   requests do not grow the daemon's memory.
//! - Connect and JSON bodies are capped (`413`, in each protocol's shape).
//! - Uploads (octet-stream and multipart, with and without
//!   `Content-Length`) stream under `max_upload_bytes` (`413`).
//! - `KEY=TENANT:ACTOR` keys act for their tenant as their actor; a bare
//!   key stays a developer of `default` (`e2b-api-key`).
//! - Token buckets per key, per sandbox and per source address (`429`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{door_with, envd_token, Door, Raw, KEY};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const GIB: u64 = 1 << 30;

/// A request's head as a client writes it, with `Content-Length: len`.
fn head(method: &str, path: &str, len: u64, extra: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}Content-Length: {len}\r\n\r\n"
    )
}

/// Sends only `head` and reads the answer until `expect` shows in it (or
/// `within` passes): the status, and the text read.
async fn answer_to_head(
    addr: &str,
    head: &str,
    expect: &str,
    within: Duration,
) -> Result<(u16, String), String> {
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((h, body)) = text.split_once("\r\n\r\n") {
            if body.contains(expect) {
                let status = h
                    .split(' ')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("no status line in {h:?}"))?;
                return Ok((status, body.to_owned()));
            }
        }
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, c.read(&mut buf))
            .await
            .map_err(|_| format!("no answer within {within:?} (read so far: {text:?})"))?
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err(format!("connection closed after {text:?}"));
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// The peak resident set of this process (the daemon runs in it), in KiB;
/// `reset` first lowers the peak to the current size.
fn peak_rss_kib(reset: bool) -> u64 {
    if reset {
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

impl Door {
    fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_owned()
    }

    /// An envd request on sandbox `id` with its access token.
    fn envd(&self, path: &str, id: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", envd_token(id))
    }

    /// Whether `/v1` shows sandbox `id` to a viewer of `tenant`.
    async fn visible_to(&self, tenant: &str, id: &str) -> bool {
        let (tok, _) = self.token("viewer", tenant).await;
        let r = self
            .http
            .get(format!("{}/v1/sandboxes/{id}", self.url))
            .bearer_auth(tok)
            .send()
            .await
            .unwrap();
        r.status().is_success()
    }

    /// `POST /files?path=…` of `body` with `content_type`.
    async fn upload(&self, id: &str, path: &str, ctype: &str, body: reqwest::Body) -> Raw {
        let rq = self
            .envd(&format!("/files?path={path}"), id)
            .header("content-type", ctype)
            .body(body);
        self.send(rq, false).await
    }
}

/// A body without `Content-Length` (chunked), `n` bytes in 64 KiB chunks.
fn chunked(prefix: Vec<u8>, n: usize, suffix: Vec<u8>) -> reqwest::Body {
    let mut chunks: Vec<Result<Vec<u8>, std::io::Error>> = vec![Ok(prefix)];
    let mut left = n;
    while left > 0 {
        let k = left.min(64 << 10);
        chunks.push(Ok(vec![b'x'; k]));
        left -= k;
    }
    chunks.push(Ok(suffix));
    reqwest::Body::wrap_stream(futures::stream::iter(chunks))
}

fn multipart(n: usize, chunked_body: bool) -> (String, reqwest::Body) {
    let head = b"--BOUND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"upload\"\r\nContent-Type: application/octet-stream\r\n\r\n".to_vec();
    let tail = b"\r\n--BOUND--\r\n".to_vec();
    let ctype = "multipart/form-data; boundary=BOUND".to_owned();
    if chunked_body {
        return (ctype, chunked(head, n, tail));
    }
    let mut b = head;
    b.extend(std::iter::repeat_n(b'x', n));
    b.extend(tail);
    (ctype, reqwest::Body::from(b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_bodies_are_refused_before_they_are_read() {
    let d = door_with(|_, e2b| e2b.auth_failures_per_minute = 0).await;
    let id = d.create(KEY).await;
    let addr = d.addr();
    // Headers only, announcing 1 GiB: each route answers at once (the old
    // door waited for the whole body before looking at the token).
    let wrong = format!(
        "E2b-Sandbox-Id: {id}\r\nX-Access-Token: {}\r\n",
        "0".repeat(64)
    );
    let cases = [
        (
            "/process.Process/List",
            wrong.clone(),
            401,
            "unauthenticated",
        ),
        (
            "/filesystem.Filesystem/Stat",
            String::new(),
            400,
            "invalid_argument",
        ),
        (
            "/process.Process/Start",
            wrong.clone(),
            200,
            "unauthenticated",
        ),
        ("/files?path=/tmp/big", wrong.clone(), 401, "401"),
        ("/v2/sandboxes", "X-API-KEY: nope\r\n".into(), 401, "401"),
        ("/v2/sandboxes", String::new(), 401, "401"),
    ];
    for (path, extra, status, code) in cases {
        let t0 = Instant::now();
        let (got, body) = answer_to_head(
            &addr,
            &head("POST", path, GIB, &extra),
            code,
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        assert_eq!(got, status, "POST {path}: {body}");
        eprintln!("POST {path}: {got} after {:?}", t0.elapsed());
    }

    // Bodies sent anyway do not pile up: 8 connections each push up to
    // 16 MiB of a 1 GiB body at envd and the control plane with bad
    // credentials; the old door held every byte (>= 128 MiB) in memory.
    let before = peak_rss_kib(true);
    let chunk = vec![b' '; 1 << 20];
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (addr, chunk) = (addr.clone(), chunk.clone());
        let h = if i % 2 == 0 {
            head("POST", "/process.Process/List", GIB, &wrong)
        } else {
            head("POST", "/v2/sandboxes", GIB, "X-API-KEY: nope\r\n")
        };
        tasks.push(tokio::spawn(async move {
            let mut c = TcpStream::connect(&addr).await.unwrap();
            c.write_all(h.as_bytes()).await.unwrap();
            let mut sent = 0usize;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
            while sent < 16 << 20 {
                match tokio::time::timeout_at(deadline, c.write_all(&chunk)).await {
                    Ok(Ok(())) => sent += chunk.len(),
                    _ => break,
                }
            }
            sent
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await.unwrap();
    }
    let grown_mib = peak_rss_kib(false).saturating_sub(before) / 1024;
    eprintln!(
        "refused bodies: {} MiB sent, peak RSS +{grown_mib} MiB",
        sent >> 20
    );
    assert!(
        grown_mib < 48,
        "the daemon's peak RSS grew by {grown_mib} MiB for refused bodies"
    );
    // The door still answers.
    let r = d
        .send(d.envd("/process.Process/List", &id).body("{}"), false)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn connect_and_json_bodies_are_capped() {
    let d = door_with(|_, e2b| e2b.max_request_bytes = 64 << 10).await;
    let id = d.create(KEY).await;
    let filler = |n: usize| format!(r#"{{"pad":"{}"}}"#, "a".repeat(n));
    // Under the cap: answered as before.
    let r = d
        .send(
            d.envd("/process.Process/List", &id).body(filler(60 << 10)),
            false,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Over it, with a Content-Length and chunked: 413 in Connect's shape.
    for body in [
        reqwest::Body::from(filler(100 << 10)),
        chunked(br#"{"pad":""#.to_vec(), 100 << 10, br#""}"#.to_vec()),
    ] {
        let r = d
            .send(d.envd("/process.Process/List", &id).body(body), false)
            .await;
        assert_eq!(r.status, 413, "{}", r.text());
        assert_eq!(r.json()["code"], "resource_exhausted", "{}", r.text());
        assert!(r.text().contains("65536 bytes"), "{}", r.text());
    }
    let start =
        common::envelope(&json!({"process": {"cmd": "true"}, "pad": "a".repeat(100 << 10)}));
    let r = d
        .send(d.envd("/process.Process/Start", &id).body(start), false)
        .await;
    assert_eq!(r.status, 413, "{}", r.text());
    // The control plane: E2B's `{"code": 413, …}`; nothing was created.
    let before = d
        .control("GET", "/v2/sandboxes", Some(KEY), "")
        .await
        .json();
    let big = format!(
        r#"{{"templateID":"base","metadata":{{"pad":"{}"}}}}"#,
        "a".repeat(100 << 10)
    );
    let r = d.control("POST", "/v2/sandboxes", Some(KEY), &big).await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["code"], 413, "{}", r.text());
    let after = d
        .control("GET", "/v2/sandboxes", Some(KEY), "")
        .await
        .json();
    assert_eq!(
        before.as_array().map(Vec::len),
        after.as_array().map(Vec::len)
    );
}

#[tokio::test]
async fn uploads_stream_under_max_upload_bytes() {
    let limit = 1usize << 20;
    let d = door_with(|cfg, _| cfg.max_upload_bytes = limit as u64).await;
    let id = d.create(KEY).await;
    let octet = "application/octet-stream";
    // At the limit: written, in both forms.
    let r = d
        .upload(&id, "/tmp/a.bin", octet, vec![7u8; limit].into())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let (ct, body) = multipart(limit, true);
    let r = d.upload(&id, "/tmp/m.bin", &ct, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()[0]["path"], "/tmp/m.bin", "{}", r.text());
    // Over it: 413 in E2B's shape, declared or not, in both forms. A
    // declared length over the limit is refused before the guest is asked.
    let over = limit + 1;
    let cases: Vec<(&str, String, reqwest::Body, bool)> = vec![
        (
            "octet, Content-Length",
            octet.into(),
            vec![7u8; over].into(),
            true,
        ),
        (
            "octet, chunked",
            octet.into(),
            chunked(Vec::new(), over, Vec::new()),
            false,
        ),
        {
            let (ct, b) = multipart(over + (2 << 20), false);
            ("multipart, Content-Length", ct, b, true)
        },
        {
            let (ct, b) = multipart(over, false);
            (
                "multipart, Content-Length within the overhead",
                ct,
                b,
                false,
            )
        },
        {
            let (ct, b) = multipart(over, true);
            ("multipart, chunked", ct, b, false)
        },
    ];
    for (what, ct, body, declared) in cases {
        let ops = d.engine.ops();
        let r = d.upload(&id, "/tmp/big.bin", &ct, body).await;
        assert_eq!(r.status, 413, "{what}: {}", r.text());
        assert_eq!(r.json()["code"], 413, "{what}: {}", r.text());
        assert!(r.text().contains("1048576 bytes"), "{what}: {}", r.text());
        if declared {
            assert_eq!(d.engine.ops(), ops, "{what}: the engine was called");
        }
    }
}

#[tokio::test]
async fn configured_keys_act_as_their_own_tenant_and_actor() {
    let acme = "e2b_acme_key_0123456789";
    let beta = "e2b_beta_key_0123456789";
    let d = door_with(|_, e2b| {
        e2b.api_keys = strata_e2b::auth::ApiKey::parse_all(&[
            KEY.to_owned(),
            format!("{acme}=acme:ci-bot"),
            format!("{beta}=beta"),
        ])
        .unwrap();
    })
    .await;
    let n = d.audit_len();
    let a = d.create(acme).await;
    assert!(d.visible_to("acme", &a).await && !d.visible_to("default", &a).await);
    // Another key's tenant does not see it.
    let r = d
        .control("GET", &format!("/sandboxes/{a}"), Some(beta), "")
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let listed = d
        .control("GET", "/v2/sandboxes", Some(beta), "")
        .await
        .json();
    assert_eq!(listed, json!([]), "beta lists acme's sandbox");
    let listed = d
        .control("GET", "/v2/sandboxes", Some(acme), "")
        .await
        .json();
    assert_eq!(listed[0]["sandboxID"], a.as_str());
    // envd calls act as the key's actor too.
    let r = d
        .send(
            d.envd("/filesystem.Filesystem/Stat", &a)
                .body(r#"{"path":"/etc/hostname"}"#),
            false,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let audit = d.audit_since(n);
    assert!(!audit.is_empty());
    for e in &audit {
        assert_eq!(
            (e["tenant"].as_str(), e["actor"].as_str()),
            (Some("acme"), Some("ci-bot")),
            "{e}"
        );
    }
    // Without an actor: the key's id; a bare key: `default`, `e2b-api-key`.
    let n = d.audit_len();
    let b = d.create(beta).await;
    assert!(d.visible_to("beta", &b).await && !d.visible_to("acme", &b).await);
    let e = &d.audit_since(n)[0];
    assert_eq!(e["actor"], strata_e2b::auth::key_id(beta).as_str(), "{e}");
    let n = d.audit_len();
    let c = d.create(KEY).await;
    assert!(d.visible_to("default", &c).await && !d.visible_to("acme", &c).await);
    let e = &d.audit_since(n)[0];
    assert_eq!(
        (e["tenant"].as_str(), e["actor"].as_str()),
        (Some("default"), Some("e2b-api-key"))
    );
}

#[tokio::test]
async fn keys_sandboxes_and_failing_addresses_are_rate_limited() {
    let other = "e2b_other_key_0123456789";
    let d = door_with(|_, e2b| {
        e2b.api_keys
            .push(strata_e2b::auth::ApiKey::parse(&format!("{other}=acme")).unwrap());
        e2b.rate_limit_per_second = 0.05;
        e2b.rate_limit_burst = 4;
        e2b.auth_failures_per_minute = 3;
    })
    .await;
    // Per key: the create and 3 lists empty KEY's bucket; the 5th is 429.
    let id = d.create(KEY).await;
    for _ in 0..3 {
        let r = d.control("GET", "/v2/sandboxes", Some(KEY), "").await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = d.control("GET", "/v2/sandboxes", Some(KEY), "").await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["code"], 429, "{}", r.text());
    let r = d.control("GET", "/v2/sandboxes", Some(other), "").await;
    assert_eq!(
        r.status,
        200,
        "another key has its own bucket: {}",
        r.text()
    );
    let id2 = d.create(other).await;
    // Per sandbox on envd.
    for _ in 0..4 {
        let r = d
            .send(d.envd("/process.Process/List", &id).body("{}"), false)
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let r = d
        .send(d.envd("/process.Process/List", &id).body("{}"), false)
        .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["code"], "resource_exhausted", "{}", r.text());
    let r = d
        .send(d.envd("/process.Process/List", &id2).body("{}"), false)
        .await;
    assert_eq!(
        r.status,
        200,
        "another sandbox has its own bucket: {}",
        r.text()
    );
    // Per source address: 3 failed logins, then this address is refused
    // whatever it sends (a valid key included) until its bucket refills.
    for _ in 0..3 {
        let r = d.control("GET", "/v2/sandboxes", Some("wrong"), "").await;
        assert_eq!(r.status, 401, "{}", r.text());
    }
    let r = d.control("GET", "/v2/sandboxes", Some("wrong"), "").await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.text().contains("failed authentications"), "{}", r.text());
    let r = d.control("GET", "/v2/sandboxes", Some(other), "").await;
    assert_eq!(r.status, 429, "{}", r.text());
    let r = d
        .send(
            d.http
                .post(format!("{}/process.Process/List", d.url))
                .header("E2b-Sandbox-Id", id2.as_str())
                .header("X-Access-Token", "0".repeat(64))
                .body("{}"),
            false,
        )
        .await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["code"], "resource_exhausted", "{}", r.text());
}
