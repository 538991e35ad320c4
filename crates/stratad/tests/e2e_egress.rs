//! End-to-end egress through the policy proxy from inside a real guest.
//!
//! A real `stratad` (auth on, the bootstrap admin token) with a platform
//! policy naming two connectors: `salesforce` (`api.salesforce.test`,
//! read-only) and `slack` (`slack.test`, a POST needs approval). Both names
//! are pinned to 127.0.0.1 (`egress_static_hosts`), where a small HTTP/1.1
//! server of this test stands in for the connector hosts and records every
//! request that reaches it. Guest programs reach the proxy at
//! `127.0.0.1:3128`, tunnelled over the agent channel to the sandbox's proxy.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

/// One request the stand-in connector server received.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    host: String,
    body: String,
}

/// A tiny HTTP/1.1 server on 127.0.0.1: one request per connection,
/// answers `hello <method> <path>`, records what it saw.
struct Upstream {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    fn start() -> Upstream {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        let port = l.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(conn) = conn else { continue };
                let s3 = s2.clone();
                std::thread::spawn(move || serve(conn, &s3));
            }
        });
        Upstream { port, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

fn serve(conn: TcpStream, seen: &Mutex<Vec<Seen>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let mut r = BufReader::new(conn.try_clone().expect("clone"));
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let (mut host, mut len) = (String::new(), 0usize);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "host" => host = v.trim().to_owned(),
                "content-length" => len = v.trim().parse().unwrap_or(0),
                _ => {}
            }
        }
    }
    let mut body = vec![0u8; len];
    let _ = r.read_exact(&mut body);
    let answer = format!("hello {method} {path}");
    seen.lock().expect("seen").push(Seen {
        method,
        path,
        host,
        body: String::from_utf8_lossy(&body).into_owned(),
    });
    let mut w = conn;
    let _ = write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let _ = w.flush();
}

fn platform_policy(port: u16) -> String {
    format!(
        r#"default = "allow"

[[connector]]
name = "salesforce"
hosts = ["api.salesforce.test"]
ports = [{port}]
read_only = true

[[connector]]
name = "slack"
hosts = ["slack.test"]
write_methods = ["POST"]
ports = [{port}]

[[rule]]
id = "slack-post"
effect = "approve"
connector = "slack"
method = "POST"
reason = "posting to Slack needs a human"
"#
    )
}

async fn audit(d: &Daemon, sandbox: &str) -> Vec<Value> {
    let (s, body) = d
        .raw("GET", &format!("/v1/audit?sandbox={sandbox}"), Vec::new())
        .await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    body.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("audit line"))
        .collect()
}

/// The call's own fields (`{kind, host, method, …}`) of a recorded tool
/// call `{tenant, sandbox, actor, kind: {kind, …}}`.
fn what(call: &Value) -> &Value {
    &call["kind"]
}

fn egress_entry<'a>(
    entries: &'a [Value],
    method: &str,
    host: &str,
    outcome: &str,
) -> Option<&'a Value> {
    entries.iter().find(|e| {
        let c = what(&e["call"]);
        c["kind"] == "egress"
            && c["method"] == method
            && c["host"] == host
            && e["decision"]["outcome"] == outcome
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_egress_through_the_policy_proxy() {
    let up = Upstream::start();
    let port = up.port;
    let scratch = tempfile::Builder::new()
        .prefix("stratad-e2e-egress-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let policy = scratch.path().join("platform.toml");
    std::fs::write(&policy, platform_policy(port)).expect("policy file");
    let d = Daemon::start(&format!(
        r#"[security]
platform_policy = "{}"
approval_timeout = "2m"
[security.egress_static_hosts]
"api.salesforce.test" = "127.0.0.1"
"slack.test" = "127.0.0.1"
"#,
        policy.display()
    ));
    assert!(d.token().is_some(), "auth is on: a bootstrap admin token");
    d.wait_template().await;
    let sb = d.create(json!({})).await;

    // GET to the read-only connector, explicit proxy: the server's answer.
    let sf = format!("http://api.salesforce.test:{port}/accounts");
    let e = d
        .exec(&sb, &["curl", "-sS", "-x", "http://127.0.0.1:3128", &sf])
        .await;
    assert_eq!(e.status, 200, "{:?}", e.error);
    assert_eq!(
        e.code,
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&e.stderr),
        d.logs()
    );
    assert_eq!(e.out(), "hello GET /accounts");
    let seen = up.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].method, "GET");
    assert_eq!(seen[0].path, "/accounts");
    assert_eq!(seen[0].host, format!("api.salesforce.test:{port}"));

    // The agent sets http_proxy for every command: plain curl goes through
    // the proxy too, and a POST to the read-only connector is refused there.
    let e = d
        .sh(
            &sb,
            &format!(
                "echo \"$http_proxy\"; curl -s -o /tmp/body -w '%{{http_code}}\\n' -X POST -d 'name=x' {sf}; cat /tmp/body"
            ),
        )
        .await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    let out = e.out();
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("http://127.0.0.1:3128"), "{out}");
    assert_eq!(lines.next(), Some("403"), "{out}");
    let refusal: Value = serde_json::from_str(lines.next().unwrap_or("")).expect("json refusal");
    assert_eq!(refusal["error"], "policy_denied", "{refusal}");
    assert_eq!(
        refusal["rule"], "connector:salesforce:read-only",
        "{refusal}"
    );
    // PATCH and DELETE too, whatever the guest does.
    for m in ["PATCH", "DELETE", "PUT"] {
        let e = d
            .exec(
                &sb,
                &[
                    "curl",
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "-X",
                    m,
                    &sf,
                ],
            )
            .await;
        assert_eq!(e.out(), "403", "{m}");
    }
    assert!(
        up.seen().iter().all(|s| s.method == "GET"),
        "a write reached the connector: {:?}",
        up.seen()
    );

    // An unlisted host and IP literals are refused by the proxy (no_proxy
    // lists 127.0.0.1, hence `--noproxy ''` to send the literal through it).
    let code = |args: &[&str]| {
        let mut v = vec!["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"];
        v.extend_from_slice(args);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    for args in [
        code(&[&format!("http://unlisted.test:{port}/")]),
        code(&[
            "--noproxy",
            "",
            "-x",
            "http://127.0.0.1:3128",
            &format!("http://127.0.0.1:{port}/"),
        ]),
        code(&[&format!("http://10.0.2.2:{port}/")]),
        code(&["--noproxy", "", &format!("http://2130706433:{port}/")]),
    ] {
        let e = d.exec_body(&sb, json!({ "cmd": args })).await;
        assert_eq!(e.out(), "403", "{args:?}: {:?}", e.stderr);
    }
    assert_eq!(up.seen().len(), 1, "{:?}", up.seen());

    // Direct egress, without the proxy, goes nowhere (restrict=on): not the
    // host's 10.0.2.2 (QEMU's gateway, i.e. the host) nor anything else.
    let e = d
        .exec(
            &sb,
            &[
                "curl",
                "-sS",
                "--noproxy",
                "*",
                "--max-time",
                "10",
                &format!("http://10.0.2.2:{port}/"),
            ],
        )
        .await;
    assert_ne!(e.code, Some(0), "direct egress succeeded: {}", e.out());
    assert_eq!(up.seen().len(), 1, "{:?}", up.seen());

    // A Slack POST is held until an approver answers; then it runs.
    let approver = d
        .ok(
            "POST",
            "/v1/tokens",
            Some(json!({ "role": "approver", "name": "e2e-approver" })),
            201,
        )
        .await;
    let approver_token = approver["token"].as_str().expect("token").to_owned();
    let slack = format!("http://slack.test:{port}/api/chat.postMessage");
    let post_cmd = ["curl", "-sS", "-X", "POST", "-d", "text=hi", slack.as_str()];
    let post = d.exec(&sb, &post_cmd);
    let answer = async {
        let t = Instant::now();
        let item = loop {
            let v = d.ok("GET", "/v1/approvals", None, 200).await;
            let items = v["items"].as_array().cloned().unwrap_or_default();
            if let Some(i) = items.into_iter().find(|i| i["sandbox"] == sb.as_str()) {
                break i;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "no approval appeared: {v}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // Held: nothing reached the server yet.
        assert!(
            up.seen().iter().all(|s| s.method != "POST"),
            "{:?}",
            up.seen()
        );
        let id = item["id"].as_str().expect("approval id").to_owned();
        let r = d
            .api
            .client()
            .post(format!("{}/v1/approvals/{id}/approve", d.url))
            .bearer_auth(&approver_token)
            .send()
            .await
            .expect("approve");
        let st = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(st, 200, "{body}");
        (item, id)
    };
    let (e, (item, approval_id)) = tokio::join!(post, answer);
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));
    assert_eq!(e.out(), "hello POST /api/chat.postMessage");
    assert_eq!(what(&item["call"])["kind"], "egress", "{item}");
    assert_eq!(what(&item["call"])["host"], "slack.test", "{item}");
    assert_eq!(item["requested_by"], format!("sandbox:{sb}"), "{item}");
    assert_eq!(item["rule_id"], "slack-post", "{item}");
    let posts: Vec<Seen> = up
        .seen()
        .into_iter()
        .filter(|s| s.method == "POST")
        .collect();
    assert_eq!(posts.len(), 1, "{posts:?}");
    assert_eq!(posts[0].path, "/api/chat.postMessage");
    assert_eq!(posts[0].body, "text=hi");

    // The audit log of the sandbox: the allowed GET, the denied POST, the
    // held and the approved Slack POST (by the approver), the refusals.
    let entries = audit(&d, &sb).await;
    let dump = || {
        entries
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        egress_entry(&entries, "GET", "api.salesforce.test", "allowed").is_some(),
        "{}",
        dump()
    );
    let denied = egress_entry(&entries, "POST", "api.salesforce.test", "denied")
        .unwrap_or_else(|| panic!("no denied POST:\n{}", dump()));
    assert_eq!(
        denied["decision"]["rule_id"],
        "connector:salesforce:read-only"
    );
    let held = egress_entry(&entries, "POST", "slack.test", "held")
        .unwrap_or_else(|| panic!("no held POST:\n{}", dump()));
    assert_eq!(held["decision"]["approval_id"], approval_id.as_str());
    let approved = egress_entry(&entries, "POST", "slack.test", "approved")
        .unwrap_or_else(|| panic!("no approval:\n{}", dump()));
    assert_eq!(approved["decision"]["approval_id"], approval_id.as_str());
    assert!(
        approved["by"]
            .as_str()
            .is_some_and(|b| b.contains(approver["id"].as_str().unwrap_or("?"))),
        "{approved}\n{approver}"
    );
    assert!(
        egress_entry(&entries, "GET", "unlisted.test", "denied").is_some(),
        "{}",
        dump()
    );
    assert!(entries.iter().all(|e| e["sandbox"] == sb.as_str()));

    d.shutdown();
}
