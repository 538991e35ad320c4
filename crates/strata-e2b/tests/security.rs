//! The E2B front door over a real stratad `App` with authentication on
//! (SQLite store, security tables, audit log in a temp dir; no VMs: the
//! engine is `UnavailableEngine`, so these tests cover what is decided
//! before a guest is needed): strata tokens as `X-API-KEY`, roles, tenant
//! isolation, the policy gate of lifecycle, envd exec and file calls with
//! audit (once per call), the stored envd token bindings, `/health`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::sync::Arc;

use chrono::Utc;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxState};
use strata_testkit::fixtures::{created_event, sandbox_record};
use stratad::config::Config;
use stratad::engine::unavailable::UnavailableEngine;
use stratad::App;

const KEY: &str = "e2b_test_key";
const SECRET: &[u8] = b"e2b-test-secret-e2b-test-secret-";

struct Server {
    url: String,
    admin: String,
    app: App,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

/// A fresh E2B door (empty memory: a daemon restart) over `app`, on its
/// own listener; returns its URL.
async fn door(app: &App) -> String {
    door_keys(app, &[KEY]).await
}

/// [`door`] with these `--e2b-api-key` entries.
async fn door_keys(app: &App, keys: &[&str]) -> String {
    let e2b = strata_e2b::E2bConfig {
        api_keys: strata_e2b::auth::ApiKey::parse_all(keys).unwrap(),
        token_secret: SECRET.to_vec(),
        ..Default::default()
    };
    let router = app.router().merge(strata_e2b::router(
        app.service().clone(),
        app.security().cloned(),
        e2b,
    ));
    // Serves until the test's runtime ends (a door per simulated restart).
    strata_testkit::serve(router).await.unwrap().detach()
}

async fn server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        key_dir: dir.path().join("keys"),
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
    let url = door(&app).await;
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
        self.sandbox_in(tenant, SandboxState::Running).await
    }

    /// A sandbox record of `tenant` in `state` (no VM behind it).
    async fn sandbox_in(&self, tenant: &str, state: SandboxState) -> SandboxId {
        let rec = sandbox_record(tenant, state, Utc::now());
        let ev = created_event(&rec);
        let id = rec.id.clone();
        self.app
            .service()
            .db(move |s| s.insert_sandbox(&rec, &ev))
            .await
            .unwrap();
        id
    }

    /// Puts `policy` as sandbox `id`'s layer (as the platform admin) and
    /// returns the envd access token the door hands out for it.
    async fn sandbox_policy_and_token(&self, id: &SandboxId, policy: &str) -> String {
        let r = self
            .http
            .put(format!("{}/v1/sandboxes/{id}/policy", self.url))
            .bearer_auth(&self.admin)
            .body(policy.to_owned())
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        let (st, d) = self.e2b("GET", &format!("/sandboxes/{id}"), KEY).await;
        assert_eq!(st, 200);
        d["envdAccessToken"].as_str().unwrap().to_owned()
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
        self.e2b_body(method, path, key, "{}").await
    }

    async fn e2b_body(&self, method: &str, path: &str, key: &str, body: &str) -> (u16, Value) {
        let r = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.url))
            .header("X-API-KEY", key)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// The audit log entries of sandbox `id` (of tenant default).
    async fn audit(&self, id: &SandboxId) -> Vec<Value> {
        self.audit_as(&self.admin, id).await
    }

    /// The audit log entries of sandbox `id`, as read by `bearer`.
    async fn audit_as(&self, bearer: &str, id: &SandboxId) -> Vec<Value> {
        let r = self
            .http
            .get(format!("{}/v1/audit?sandbox={id}", self.url))
            .bearer_auth(bearer)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        r.text()
            .await
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// An envd unary call on sandbox `id` with `token` at door `url`.
    async fn envd(
        &self,
        url: &str,
        id: &str,
        token: &str,
        path: &str,
        body: Value,
    ) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{url}{path}"))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn health(&self, id: &str, token: Option<&str>) -> (u16, Value) {
        let mut rq = self
            .http
            .get(format!("{}/health", self.url))
            .header("E2b-Sandbox-Id", id);
        if let Some(t) = token {
            rq = rq.header("X-Access-Token", t);
        }
        let r = rq.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
}

fn envd_token(id: &str) -> String {
    strata_e2b::auth::envd_token(SECRET, id)
}

/// `message` with `id` replaced by `ID`.
fn masked(v: &Value, id: &str) -> Value {
    let mut v = v.clone();
    if let Some(m) = v["message"].as_str() {
        v["message"] = json!(m.replace(id, "ID"));
    }
    v
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

    // Another tenant's sandbox answers exactly like an unknown id (status
    // and body; the message names the id sent), on every route, and never
    // reaches the gate (nothing audited for it).
    let unknown = SandboxId::generate();
    for (method, prefix, suffix) in [
        ("GET", "/sandboxes", ""),
        ("DELETE", "/sandboxes", ""),
        ("POST", "/sandboxes", "/connect"),
        ("POST", "/v2/sandboxes", "/connect"),
        ("POST", "/sandboxes", "/resume"),
        ("POST", "/sandboxes", "/pause"),
        ("POST", "/sandboxes", "/timeout"),
        ("POST", "/sandboxes", "/refreshes"),
    ] {
        for key in [KEY, dev.as_str()] {
            let (st, body) = s
                .e2b(method, &format!("{prefix}/{theirs}{suffix}"), key)
                .await;
            let (st2, body2) = s
                .e2b(method, &format!("{prefix}/{unknown}{suffix}"), key)
                .await;
            assert_eq!((st, st2), (404, 404), "{method} {suffix}: {body} / {body2}");
            assert!(
                body["message"].as_str().unwrap().contains(theirs.as_str()),
                "{body}"
            );
            assert_eq!(
                masked(&body, theirs.as_str()),
                masked(&body2, unknown.as_str())
            );
        }
    }
    let admin_other = s.token("admin", Some("other")).await;
    assert!(s.audit_as(&admin_other, &theirs).await.is_empty());
    // Its own tenant does see it.
    let other = s.token("developer", Some("other")).await;
    let (st, _) = s.e2b("GET", &format!("/sandboxes/{theirs}"), &other).await;
    assert_eq!(st, 200);
    let (st, _) = s.e2b("GET", &format!("/sandboxes/{mine}"), &other).await;
    assert_eq!(st, 404);

    // A timeout over a year is refused (400), on set_timeout, connect and
    // create, before anything changes.
    let year = 366 * 24 * 3600;
    for (method, path) in [
        ("POST", format!("/sandboxes/{mine}/timeout")),
        ("POST", format!("/sandboxes/{mine}/connect")),
        ("POST", "/v2/sandboxes".to_owned()),
    ] {
        let big = format!(r#"{{"timeout": {}}}"#, year + 1);
        let (st, body) = s.e2b_body(method, &path, &dev, &big).await;
        assert_eq!(st, 400, "{method} {path}: {body}");
        assert!(
            body["message"].as_str().unwrap().contains("a year"),
            "{body}"
        );
        let huge = format!(r#"{{"timeout": {}}}"#, u64::MAX);
        let (st, body) = s.e2b_body(method, &path, &dev, &huge).await;
        assert_eq!(st, 400, "{method} {path}: {body}");
    }
    // A year is fine, and endAt follows it.
    let (st, body) = s
        .e2b_body(
            "POST",
            &format!("/sandboxes/{mine}/timeout"),
            &dev,
            &format!(r#"{{"timeout": {year}}}"#),
        )
        .await;
    assert_eq!(st, 204, "{body}");
    let (st, d) = s.e2b("GET", &format!("/sandboxes/{mine}"), &dev).await;
    assert_eq!(st, 200, "{d}");
    let end = chrono::DateTime::parse_from_rfc3339(d["endAt"].as_str().unwrap()).unwrap();
    assert!(
        end.with_timezone(&Utc) > Utc::now() + chrono::TimeDelta::days(365),
        "{d}"
    );
    let (st, _) = s
        .e2b("POST", &format!("/sandboxes/{mine}/refreshes"), &dev)
        .await;
    assert_eq!(st, 204);

    // A metrics token may not use the E2B API at all (it reads /metrics).
    let metrics = s.token("metrics", None).await;
    let (st, body) = s.e2b("GET", "/v2/sandboxes", &metrics).await;
    assert_eq!(st, 403, "{body}");

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
    let token = s.sandbox_policy_and_token(&id, POLICY).await;
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

#[tokio::test]
async fn envd_tokens_are_bound_to_who_they_were_handed_to() {
    let s = server().await;
    let dev = s.token("developer", None).await;
    let (st, who) = s
        .http
        .get(format!("{}/v1/whoami", s.url))
        .bearer_auth(&dev)
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))
        .unwrap();
    assert_eq!(st, 200);
    let who: Value = who.json().await.unwrap();
    let actor = format!("token:{}", who["token_id"].as_str().unwrap());

    // Handed out by get_info to a developer token: envd calls act as it,
    // also through a fresh door over the same daemon (a restart).
    let id = s.sandbox("default").await;
    let (st, d) = s.e2b("GET", &format!("/sandboxes/{id}"), &dev).await;
    assert_eq!(st, 200);
    let token = d["envdAccessToken"].as_str().unwrap().to_owned();
    // Random and stored, not the legacy HMAC of the id; the same credential
    // asking again gets the same token back.
    assert_ne!(token, envd_token(id.as_str()));
    let (_, d2) = s.e2b("GET", &format!("/sandboxes/{id}"), &dev).await;
    assert_eq!(d2["envdAccessToken"].as_str(), Some(token.as_str()));
    let again = door(&s.app).await;
    for url in [&s.url, &again] {
        let (st, v) = s
            .envd(
                url,
                id.as_str(),
                &token,
                "/filesystem.Filesystem/Stat",
                json!({"path": "/etc"}),
            )
            .await;
        assert_ne!(st, 403, "{v}");
    }
    let audit = s.audit(&id).await;
    assert_eq!(audit.len(), 2, "{audit:?}");
    assert!(
        audit.iter().all(|e| e["actor"] == actor.as_str()),
        "{audit:?}"
    );

    // A token with no stored binding (handed out before bindings were
    // stored): a developer `e2b-envd` of the sandbox's tenant.
    let old = s.sandbox("other").await;
    let (st, v) = s
        .envd(
            &s.url,
            old.as_str(),
            &envd_token(old.as_str()),
            "/filesystem.Filesystem/Stat",
            json!({"path": "/etc"}),
        )
        .await;
    assert_ne!(st, 403, "{v}");
    let admin_other = s.token("admin", Some("other")).await;
    let audit = s.audit_as(&admin_other, &old).await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(
        (audit[0]["actor"].as_str(), audit[0]["tenant"].as_str()),
        (Some("e2b-envd"), Some("other"))
    );

    // envd on an unknown sandbox and on one whose token the caller does not
    // hold answer alike: without the right token, 401 whoever owns it; with
    // a token for an id that does not exist, "not running".
    let unknown = SandboxId::generate();
    let (a, va) = s
        .envd(
            &s.url,
            old.as_str(),
            &token,
            "/filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    let (b, vb) = s
        .envd(
            &s.url,
            unknown.as_str(),
            &token,
            "/filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!((a, b), (401, 401));
    assert_eq!(va, vb);
    let (st, v) = s
        .envd(
            &s.url,
            unknown.as_str(),
            &envd_token(unknown.as_str()),
            "/filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["code"], "unavailable");
    assert_eq!(
        masked(&v, unknown.as_str())["message"],
        "The sandbox ID was not found"
    );
}

#[tokio::test]
async fn a_removed_keys_envd_tokens_stop_working() {
    let s = server().await;
    let key = "e2b_acme_key_0123456789";
    let spec = format!("{key}=acme:ci-bot");
    let with = door_keys(&s.app, &[KEY, &spec]).await;
    let id = s.sandbox("acme").await;
    // Handed out by get_info to the key (its tenant's sandbox).
    let r = s
        .http
        .get(format!("{with}/sandboxes/{id}"))
        .header("X-API-KEY", key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let token = r.json::<Value>().await.unwrap()["envdAccessToken"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = "/filesystem.Filesystem/Stat";
    let body = json!({"path": "/etc"});
    let (st, v) = s.envd(&with, id.as_str(), &token, path, body.clone()).await;
    assert!(st != 401 && st != 403, "{st} {v}");
    let admin = s.token("admin", Some("acme")).await;
    let audit = s.audit_as(&admin, &id).await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0]["actor"], "ci-bot");
    // The daemon restarts without that key: the token it was handed stops.
    let without = door_keys(&s.app, &[KEY]).await;
    let (st, v) = s.envd(&without, id.as_str(), &token, path, body).await;
    assert_eq!(
        (st, v["code"].as_str()),
        (401, Some("unauthenticated")),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("no longer configured"),
        "{v}"
    );
    assert_eq!(s.audit_as(&admin, &id).await.len(), 1);
}

#[tokio::test]
async fn health_needs_the_sandbox_token() {
    let s = server().await;
    let up = s.sandbox("default").await;
    let asleep = s.sandbox_in("default", SandboxState::Hibernated).await;
    let unknown = SandboxId::generate();
    let (st, gone) = s.health(unknown.as_str(), None).await;
    assert_eq!(st, 502);
    let gone = masked(&gone, unknown.as_str());
    assert_eq!(
        gone,
        json!({"code": 502, "message": "The sandbox ID was not found"})
    );
    // Without the token (missing or wrong), a running sandbox answers as an
    // unknown one.
    for token in [
        None,
        Some("0".repeat(64)),
        Some(envd_token(asleep.as_str())),
    ] {
        let (st, v) = s.health(up.as_str(), token.as_deref()).await;
        assert_eq!(
            (st, masked(&v, up.as_str())),
            (502, gone.clone()),
            "{token:?}"
        );
    }
    let (st, _) = s.health(up.as_str(), Some(&envd_token(up.as_str()))).await;
    assert_eq!(st, 204);
    for id in [&asleep, &unknown] {
        let (st, v) = s.health(id.as_str(), Some(&envd_token(id.as_str()))).await;
        assert_eq!((st, masked(&v, id.as_str())), (502, gone.clone()));
    }
}

#[tokio::test]
async fn lifecycle_calls_are_gated_once_by_the_service() {
    let s = server().await;
    let id = s.sandbox("default").await;
    let r = s
        .http
        .put(format!("{}/v1/sandboxes/{id}/policy", s.url))
        .bearer_auth(&s.admin)
        .body(
            r#"
[[rule]]
id = "keep-it"
effect = "deny"
kind = "lifecycle"
op = "delete"
reason = "keep it"
"#,
        )
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    // Denied: 403 naming the rule, audited once.
    let (st, body) = s.e2b("DELETE", &format!("/sandboxes/{id}"), KEY).await;
    assert_eq!(st, 403, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("keep-it"),
        "{body}"
    );
    // Allowed (then the absent engine fails): audited once.
    let (st, body) = s.e2b("POST", &format!("/sandboxes/{id}/pause"), KEY).await;
    assert_ne!(st, 403, "{body}");
    let audit = s.audit(&id).await;
    let ops: Vec<(&str, &str)> = audit
        .iter()
        .map(|e| {
            (
                e["call"]["kind"]["op"].as_str().unwrap_or(""),
                e["decision"]["outcome"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        ops,
        [("delete", "denied"), ("hibernate", "allowed")],
        "{audit:?}"
    );
}

/// Issue 12 (approvals): an upload through envd `/files` that the policy
/// holds is read to a bounded file first, so its approval shows, and is
/// bound to, the size and SHA-256 of the bytes written after it (before,
/// the approver saw the path alone and the bytes streamed after the
/// answer). The approved write then reaches the (absent) engine.
#[tokio::test]
async fn a_held_envd_upload_shows_its_bytes_to_the_approver() {
    let s = server().await;
    let id = s.sandbox("default").await;
    let policy = r#"
[[rule]]
id = "ask-upload"
effect = "approve"
kind = "file_write"
path = "/held/**"
reason = "uploads here need a look"
"#;
    let token = s.sandbox_policy_and_token(&id, policy).await;
    let approver = s.token("approver", None).await;
    let upload = {
        let req = s
            .http
            .post(format!("{}/files?path=/held/up.txt", s.url))
            .header("E2b-Sandbox-Id", id.as_str())
            .header("X-Access-Token", &token)
            .header("content-type", "application/octet-stream")
            .body("hello world\n");
        tokio::spawn(async move { req.send().await.unwrap().status().as_u16() })
    };
    // The held request, as the approver sees it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let held = loop {
        let v: Value = s
            .http
            .get(format!("{}/v1/approvals", s.url))
            .bearer_auth(&approver)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let pending: Vec<Value> = v["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|a| a["status"]["status"] == "pending")
            .collect();
        if let Some(a) = pending.into_iter().next() {
            break a;
        }
        assert!(std::time::Instant::now() < deadline, "no held upload: {v}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(held["body"]["bytes"], 12, "{held}");
    assert_eq!(
        held["body"]["sha256"], "a948904f2f0f479b8f8197694b30184b0d2ed1c1cd2a1ec0fb85d299a192a447",
        "{held}"
    );
    let ap = held["id"].as_str().unwrap();
    let r = s
        .http
        .post(format!("{}/v1/approvals/{ap}/approve", s.url))
        .bearer_auth(&approver)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    // Approved: the write goes on to the engine (none here: unavailable).
    let status = upload.await.unwrap();
    assert_ne!(status, 403, "the approved upload was refused");
}
