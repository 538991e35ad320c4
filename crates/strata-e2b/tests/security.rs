//! The E2B front door over a real stratad `App` with authentication on
//! (SQLite store, security tables, audit log in a temp dir; no VMs: the
//! engine is `UnavailableEngine`, so these tests cover what is decided
//! before a guest is needed): strata tokens as `X-API-KEY`, roles, tenant
//! isolation, and the policy gate of envd exec and file calls with audit.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use serde_json::{json, Value};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState};
use stratad::config::Config;
use stratad::engine::unavailable::UnavailableEngine;
use stratad::store::{Event, EventPhase, SandboxRecord};
use stratad::App;

const KEY: &str = "e2b_test_key";

struct Server {
    url: String,
    admin: String,
    app: App,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        default_template: false,
        ..Config::default()
    };
    cfg.security.auth = true;
    cfg.security.approval_timeout = std::time::Duration::from_millis(300);
    let app = App::open(cfg, Arc::new(UnavailableEngine)).unwrap();
    let admin = std::fs::read_to_string(dir.path().join("admin.token"))
        .unwrap()
        .trim()
        .to_owned();
    let e2b = strata_e2b::E2bConfig {
        api_keys: vec![KEY.into()],
        ..Default::default()
    };
    let router = app.router().merge(strata_e2b::router(
        app.service().clone(),
        app.security().cloned(),
        e2b,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    Server {
        url,
        admin,
        app,
        http: reqwest::Client::new(),
        _dir: dir,
    }
}

impl Server {
    /// A running sandbox record of `tenant` (no VM behind it).
    async fn sandbox(&self, tenant: &str) -> SandboxId {
        let now = Utc::now();
        let rec = SandboxRecord {
            id: SandboxId::generate(),
            tenant: tenant.into(),
            template: None,
            source_snapshot: None,
            size: SandboxSize::default(),
            labels: BTreeMap::new(),
            state: SandboxState::Running,
            state_reason: None,
            pending_op: None,
            idle_timeout_s: None,
            snapshot_interval_s: None,
            created_at: now,
            updated_at: now,
            last_activity_at: now,
            pid: None,
            accel: None,
            deleted_at: None,
        };
        let ev = Event {
            seq: 0,
            at: now,
            tenant: tenant.into(),
            sandbox_id: rec.id.clone(),
            op: Op::Created,
            from_state: None,
            to_state: Some(SandboxState::Running),
            phase: EventPhase::Done,
            detail: None,
        };
        let id = rec.id.clone();
        self.app
            .service()
            .db(move |s| s.insert_sandbox(&rec, &ev))
            .await
            .unwrap();
        id
    }

    async fn token(&self, role: &str, tenant: Option<&str>) -> String {
        let mut body = json!({ "role": role });
        if let Some(t) = tenant {
            body["tenant"] = json!(t);
        }
        let r = self
            .http
            .post(format!("{}/v1/tokens", self.url))
            .bearer_auth(&self.admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        r.json::<Value>().await.unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn e2b(&self, method: &str, path: &str, key: &str) -> (u16, Value) {
        let r = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.url))
            .header("X-API-KEY", key)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

#[tokio::test]
async fn api_keys_strata_tokens_roles_and_tenants() {
    let s = server().await;
    let mine = s.sandbox("default").await;
    let theirs = s.sandbox("other").await;

    // Wrong and missing keys: 401 in E2B's shape.
    let (st, body) = s.e2b("GET", "/v2/sandboxes", "e2b_wrong").await;
    assert_eq!((st, body["code"].as_u64()), (401, Some(401)));
    let (st, _) = s.e2b("GET", "/v2/sandboxes", "").await;
    assert_eq!(st, 401);
    let fake = format!("strata_{}", "0".repeat(64));
    let (st, body) = s.e2b("GET", "/v2/sandboxes", &fake).await;
    assert_eq!(st, 401, "{body}");

    // The configured key and a developer token of tenant default see only
    // tenant default's sandbox.
    let dev = s.token("developer", None).await;
    for key in [KEY, dev.as_str()] {
        let (st, list) = s.e2b("GET", "/v2/sandboxes", key).await;
        assert_eq!(st, 200);
        let ids: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["sandboxID"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [mine.as_str()]);
        let (st, d) = s.e2b("GET", &format!("/sandboxes/{mine}"), key).await;
        assert_eq!(st, 200);
        assert!(d["envdAccessToken"].is_string());
    }

    // Another tenant's sandbox answers exactly like an unknown id.
    let unknown = SandboxId::generate();
    for (method, suffix) in [
        ("GET", ""),
        ("DELETE", ""),
        ("POST", "/connect"),
        ("POST", "/pause"),
        ("POST", "/timeout"),
    ] {
        let (st, body) = s
            .e2b(method, &format!("/sandboxes/{theirs}{suffix}"), &dev)
            .await;
        let (st2, body2) = s
            .e2b(method, &format!("/sandboxes/{unknown}{suffix}"), &dev)
            .await;
        assert_eq!((st, st2), (404, 404), "{method} {suffix}: {body} / {body2}");
        assert_eq!(
            body["message"]
                .as_str()
                .unwrap()
                .replace(theirs.as_str(), "ID"),
            body2["message"]
                .as_str()
                .unwrap()
                .replace(unknown.as_str(), "ID"),
        );
    }
    // Its own tenant does see it.
    let other = s.token("developer", Some("other")).await;
    let (st, _) = s.e2b("GET", &format!("/sandboxes/{theirs}"), &other).await;
    assert_eq!(st, 200);
    let (st, _) = s.e2b("GET", &format!("/sandboxes/{mine}"), &other).await;
    assert_eq!(st, 404);

    // A viewer reads (without the envd token) and may not change anything.
    let viewer = s.token("viewer", None).await;
    let (st, d) = s.e2b("GET", &format!("/sandboxes/{mine}"), &viewer).await;
    assert_eq!(st, 200);
    assert!(d.get("envdAccessToken").is_none(), "{d}");
    for (method, path) in [
        ("POST", "/v2/sandboxes".to_owned()),
        ("DELETE", format!("/sandboxes/{mine}")),
        ("POST", format!("/sandboxes/{mine}/timeout")),
    ] {
        let (st, body) = s.e2b(method, &path, &viewer).await;
        assert_eq!(st, 403, "{method} {path}: {body}");
    }
}

fn envelope(msg: &Value) -> Vec<u8> {
    let b = serde_json::to_vec(msg).unwrap();
    let mut out = vec![0u8];
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(&b);
    out
}

const POLICY: &str = r#"
[[rule]]
id = "no-rm"
effect = "deny"
kind = "exec"
program = "rm"
reason = "no deleting"

[[rule]]
id = "locked"
effect = "deny"
kind = ["file_write", "file_read"]
path = "/locked/**"
reason = "locked area"

[[rule]]
id = "ask-curl"
effect = "approve"
kind = "exec"
program = "curl"
reason = "network"
"#;

#[tokio::test]
async fn envd_calls_pass_the_policy_gate_and_are_audited() {
    let s = server().await;
    let id = s.sandbox("default").await;
    let r = s
        .http
        .put(format!("{}/v1/sandboxes/{id}/policy", s.url))
        .bearer_auth(&s.admin)
        .body(POLICY)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let (st, d) = s.e2b("GET", &format!("/sandboxes/{id}"), KEY).await;
    assert_eq!(st, 200);
    let token = d["envdAccessToken"].as_str().unwrap().to_owned();
    let envd = |path: &str| {
        s.http
            .post(format!("{}{path}", s.url))
            .header("E2b-Sandbox-Id", id.as_str())
            .header("X-Access-Token", &token)
    };
    let start = |cmd: &str| {
        envelope(&json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}}}))
    };

    // exec: the shell reading of `bash -l -c` sees rm.
    let r = envd("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start("cd /tmp && rm -f x"))
        .send()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&r.bytes().await.unwrap()).into_owned();
    assert!(
        text.contains("permission_denied") && text.contains("no-rm"),
        "{text}"
    );

    // approve: held, nobody answers within the approval timeout → denied.
    let r = envd("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start("curl http://example.com"))
        .send()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&r.bytes().await.unwrap()).into_owned();
    assert!(
        text.contains("permission_denied") && text.contains("not answered"),
        "{text}"
    );

    // Unary filesystem calls and /files.
    for (path, body) in [
        (
            "/filesystem.Filesystem/MakeDir",
            json!({"path": "/locked/d"}),
        ),
        (
            "/filesystem.Filesystem/Remove",
            json!({"path": "/locked/f"}),
        ),
        ("/filesystem.Filesystem/Stat", json!({"path": "/locked/f"})),
        (
            "/filesystem.Filesystem/Move",
            json!({"source": "/tmp/a", "destination": "/locked/a"}),
        ),
    ] {
        let r = envd(path).json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 403, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["code"], "permission_denied", "{path}: {v}");
        assert!(v["message"].as_str().unwrap().contains("locked"), "{v}");
    }
    let r = envd("/files?path=/locked/up.txt")
        .header("content-type", "application/octet-stream")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
    let v: Value = r.json().await.unwrap();
    assert!(v["message"].as_str().unwrap().contains("`locked`"), "{v}");
    let r = s
        .http
        .get(format!("{}/files?path=/locked/f", s.url))
        .header("E2b-Sandbox-Id", id.as_str())
        .header("X-Access-Token", &token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);

    // An allowed exec passes the gate and reaches the (absent) engine.
    let r = envd("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(start("echo hi"))
        .send()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&r.bytes().await.unwrap()).into_owned();
    assert!(!text.contains("permission_denied"), "{text}");

    // The audit log has each decision, for this sandbox and tenant.
    let r = s
        .http
        .get(format!("{}/v1/audit?sandbox={id}", s.url))
        .bearer_auth(&s.admin)
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    let entries: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(String, String, String)> = entries
        .iter()
        .map(|e| {
            (
                e["call"]["kind"]["kind"].as_str().unwrap_or("").to_owned(),
                e["decision"]["rule_id"].as_str().unwrap_or("").to_owned(),
                e["decision"]["outcome"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let has = |k: &str, r: &str, o: &str| seen.iter().any(|(a, b, c)| a == k && b == r && c == o);
    assert!(has("exec", "no-rm", "denied"), "{seen:?}");
    assert!(has("exec", "ask-curl", "held"), "{seen:?}");
    assert!(has("exec", "ask-curl", "timed_out"), "{seen:?}");
    assert!(has("file_write", "locked", "denied"), "{seen:?}");
    assert!(has("file_read", "locked", "denied"), "{seen:?}");
    assert!(has("exec", "default", "allowed"), "{seen:?}");
    assert!(entries
        .iter()
        .all(|e| e["tenant"] == "default" && e["actor"] == "e2b-api-key"));
}
