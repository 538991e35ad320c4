//! Security through the HTTP API: tokens, the role matrix, tenant isolation,
//! policy (deny / approve / timeout / re-submission), approvals, audit,
//! rate limits and the egress proxy. Real store, service, router, policy
//! engine, approval queue, audit log and proxy; the engine is the test double.

use std::collections::HashMap;
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::security::auth::{allowed, Role};

pub(super) struct Sec {
    pub(super) app: App,
    pub(super) dir: tempfile::TempDir,
    pub(super) admin: String,
}

pub(super) fn sec_harness(tune: impl FnOnce(&mut Config)) -> Sec {
    sec_harness_on(tune, Arc::new(Double::default()))
}

/// [`sec_harness`] over a given engine double (to see what it was asked).
pub(super) fn sec_harness_on(tune: impl FnOnce(&mut Config), engine: Arc<Double>) -> Sec {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        // The audit key comes from here (never the host's /etc/strata/keys).
        key_dir: dir.path().join("keys"),
        max_json_body_bytes: 4096,
        ..Config::default()
    };
    cfg.capacity.vcpus = 64;
    cfg.capacity.cpu_overcommit = 1.0;
    cfg.capacity.memory_mib = 1 << 20;
    cfg.security.rate_limit_per_second = 0.0;
    tune(&mut cfg);
    let store = super::store_with_base_template(&cfg);
    let app = App::new(cfg, store, engine, Arc::new(SystemClock));
    let path = dir.path().join("admin.token");
    let admin = std::fs::read_to_string(&path).unwrap().trim().to_owned();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "admin.token must be 0600");
    Sec { app, dir, admin }
}

pub(super) async fn req(
    h: &Sec,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: impl Into<AxBody>,
) -> (StatusCode, Value, HeaderMap) {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let resp = h
        .app
        .router()
        .oneshot(b.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v, headers)
}

pub(super) async fn token(h: &Sec, tenant: &str, role: &str) -> String {
    let (s, v, _) = req(
        h,
        "POST",
        "/v1/tokens",
        Some(&h.admin),
        json!({ "role": role, "tenant": tenant, "name": format!("{tenant}-{role}") }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(v.get("hash").is_none(), "the hash is never shown");
    v["token"].as_str().unwrap().to_owned()
}

pub(super) async fn create_sb(h: &Sec, tok: &str) -> String {
    let (s, v, _) = req(
        h,
        "POST",
        "/v1/sandboxes",
        Some(tok),
        r#"{"template":"tpl-base"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_owned()
}

async fn exec(h: &Sec, tok: &str, id: &str, q: &str, cmd: &[&str]) -> (StatusCode, Value) {
    let (s, v, _) = req(
        h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec{q}"),
        Some(tok),
        json!({ "cmd": cmd }).to_string(),
    )
    .await;
    (s, v)
}

#[tokio::test]
async fn missing_malformed_unknown_expired_revoked_tokens_are_401() {
    let h = sec_harness(|_| {});
    let (s, _, _) = req(&h, "GET", "/healthz", None, "").await;
    assert_eq!(s, StatusCode::OK, "/healthz stays open");
    let (s, _, _) = req(&h, "GET", "/livez", None, "").await;
    assert_eq!(s, StatusCode::OK, "/livez stays open");
    let unknown = crate::security::auth::new_token().1;
    for t in [None, Some("nope"), Some(unknown.as_str())] {
        let (s, v, hd) = req(&h, "GET", "/v1/sandboxes", t, "").await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{t:?}: {v}");
        assert_eq!(code(&v), "unauthorized");
        assert!(hd.contains_key("www-authenticate"));
    }
    // Basic auth and garbage schemes.
    let r = Request::builder()
        .uri("/v1/whoami")
        .header("authorization", format!("Basic {}", h.admin))
        .body(AxBody::empty())
        .unwrap();
    assert_eq!(
        h.app.router().oneshot(r).await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
    // Expired.
    let (_, v, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&h.admin),
        r#"{"role":"viewer","expires_in":"1s"}"#,
    )
    .await;
    let short = v["token"].as_str().unwrap().to_owned();
    let (s, v, _) = req(&h, "GET", "/v1/whoami", Some(&short), "").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["role"], "viewer");
    assert_eq!(v["tenant"], "default");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (s, v, _) = req(&h, "GET", "/v1/whoami", Some(&short), "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(v["error"]["message"].as_str().unwrap().contains("expired"));
    // Revoked.
    let (_, v, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&h.admin),
        r#"{"role":"developer"}"#,
    )
    .await;
    let (dev, dev_id) = (
        v["token"].as_str().unwrap().to_owned(),
        v["id"].as_str().unwrap().to_owned(),
    );
    assert_eq!(
        req(&h, "GET", "/v1/whoami", Some(&dev), "").await.0,
        StatusCode::OK
    );
    let (s, v, _) = req(
        &h,
        "DELETE",
        &format!("/v1/tokens/{dev_id}"),
        Some(&h.admin),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["revoked_at"].is_string());
    let (s, v, _) = req(&h, "GET", "/v1/whoami", Some(&dev), "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert!(v["error"]["message"].as_str().unwrap().contains("revoked"));
    // Listing shows no secrets.
    let (_, v, _) = req(&h, "GET", "/v1/tokens", Some(&h.admin), "").await;
    let text = v.to_string();
    assert!(!text.contains(&h.admin) && !text.contains(&dev));
    assert_eq!(v["items"].as_array().unwrap().len(), 3);
    // A restart does not make a second bootstrap token.
    let again = crate::security::Security::open(&Config {
        data_dir: h.dir.path().to_owned(),
        ..Config::default()
    })
    .unwrap();
    assert_eq!(again.store().token_count().unwrap(), 3);
}

#[tokio::test]
async fn role_matrix_over_every_route() {
    let h = sec_harness(|_| {});
    let mut toks = HashMap::new();
    for role in ["admin", "developer", "approver", "viewer"] {
        toks.insert(role, token(&h, "acme", role).await);
    }
    for &crate::api::Route {
        method,
        path,
        access,
        ..
    } in crate::api::ROUTES
    {
        // A ticket route takes no bearer (api::tests::terminal), a host
        // route a host credential (cluster::replicas).
        if !path.starts_with("/v1/")
            || matches!(
                access,
                crate::api::routes::Access::Ticket(_) | crate::api::routes::Access::Host
            )
        {
            continue;
        }
        for (role_name, tok) in &toks {
            let role: Role = role_name.parse().unwrap();
            let mut uri = path.replace(":id", "sb-zzz");
            if path == "/v1/events" {
                // The backlog only: a following stream never ends.
                uri.push_str("?follow=false");
            }
            let (s, v, _) = req(&h, method, &uri, Some(tok), "").await;
            assert_ne!(
                s,
                StatusCode::UNAUTHORIZED,
                "{role_name} {method} {path}: {v}"
            );
            if allowed(method, path, role) {
                assert_ne!(s, StatusCode::FORBIDDEN, "{role_name} {method} {path}: {v}");
            } else {
                assert_eq!(s, StatusCode::FORBIDDEN, "{role_name} {method} {path}: {v}");
                assert_eq!(code(&v), "forbidden");
            }
        }
    }
    // Spot checks of the matrix itself.
    let dev = &toks["developer"];
    let viewer = &toks["viewer"];
    let id = create_sb(&h, dev).await;
    assert_eq!(
        req(
            &h,
            "POST",
            &format!("/v1/sandboxes/{id}/pause"),
            Some(viewer),
            ""
        )
        .await
        .0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        req(&h, "GET", &format!("/v1/sandboxes/{id}"), Some(viewer), "")
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        req(&h, "PUT", "/v1/policy", Some(dev), "default = \"allow\"")
            .await
            .0,
        StatusCode::FORBIDDEN
    );
    // A tenant admin cannot mint tokens for another tenant.
    let (s, _, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&toks["admin"]),
        r#"{"role":"admin","tenant":"default"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn another_tenants_ids_answer_like_unknown_ids() {
    let h = sec_harness(|_| {});
    let a = token(&h, "alpha", "admin").await;
    let b = token(&h, "beta", "admin").await;
    let sb = create_sb(&h, &a).await;
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{sb}/snapshots"),
        Some(&a),
        "{}",
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let snap = v["id"].as_str().unwrap().to_owned();
    // Beta sees nothing of alpha's.
    let (_, v, _) = req(&h, "GET", "/v1/sandboxes", Some(&b), "").await;
    assert_eq!(v["items"].as_array().unwrap().len(), 0);
    let (_, v, _) = req(&h, "GET", "/v1/sandboxes", Some(&a), "").await;
    assert_eq!(v["items"].as_array().unwrap().len(), 1);
    let unknown_sb = "sb-0000000000000000zzzz";
    let unknown_snap = "snap-0000000000000000zzzz";
    for &crate::api::Route {
        method,
        path,
        access,
        ..
    } in crate::api::ROUTES
    {
        if matches!(access, crate::api::routes::Access::Ticket(_)) {
            continue; // no bearer: api::tests::terminal
        }
        let (id, unknown) = if path.starts_with("/v1/sandboxes/:id") {
            (&sb, unknown_sb)
        } else if path.starts_with("/v1/snapshots/:id") {
            (&snap, unknown_snap)
        } else {
            continue;
        };
        let q = if path.contains("/files") {
            "?path=/etc/hosts"
        } else {
            ""
        };
        let body = if path.ends_with("/exec") {
            r#"{"cmd":["ls"]}"#
        } else {
            ""
        };
        let (s1, v1, _) = req(
            &h,
            method,
            &format!("{}{q}", path.replace(":id", id)),
            Some(&b),
            body,
        )
        .await;
        let (s2, v2, _) = req(
            &h,
            method,
            &format!("{}{q}", path.replace(":id", unknown)),
            Some(&b),
            body,
        )
        .await;
        assert!(s1.is_client_error(), "{method} {path}: {v1}");
        assert_eq!(s1, s2, "{method} {path}: {v1} vs {v2}");
        assert_eq!(code(&v1), code(&v2));
        assert_eq!(
            v1["error"]["message"]
                .as_str()
                .unwrap()
                .replace(id.as_str(), "X"),
            v2["error"]["message"]
                .as_str()
                .unwrap()
                .replace(unknown, "X"),
            "{method} {path}"
        );
    }
    // Rewinding one's own sandbox to a foreign snapshot: 404 too.
    let sb_b = create_sb(&h, &b).await;
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{sb_b}/rewind"),
        Some(&b),
        json!({ "to": snap }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    // Templates: beta's own template is invisible to alpha; the platform one is shared.
    let (s, _, _) = req(
        &h,
        "POST",
        "/v1/templates",
        Some(&b),
        r#"{"id":"tpl-beta"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (s, _, _) = req(&h, "GET", "/v1/templates/tpl-beta", Some(&a), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _, _) = req(&h, "GET", "/v1/templates/tpl-beta", Some(&b), "").await;
    assert_eq!(s, StatusCode::OK);
    let (_, v, _) = req(&h, "GET", "/v1/templates", Some(&a), "").await;
    let names: Vec<_> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].clone())
        .collect();
    assert_eq!(names, vec![json!("tpl-base")]);
    let (s, _, _) = req(
        &h,
        "POST",
        "/v1/sandboxes",
        Some(&a),
        r#"{"template":"tpl-beta"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _, _) = req(&h, "DELETE", "/v1/templates/tpl-base", Some(&b), "").await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "the shared template belongs to the platform"
    );
    // Sandboxes record their tenant.
    let (_, v, _) = req(&h, "GET", &format!("/v1/sandboxes/{sb}"), Some(&a), "").await;
    assert_eq!(v["tenant"], "alpha");
}

const POLICY: &str = r#"
default = "allow"

[[rule]]
id = "no-rm"
effect = "deny"
program = "rm"
reason = "no deleting"
hard = true

[[rule]]
id = "curl-needs-human"
effect = "approve"
program = "curl"
reason = "network access"

[[rule]]
id = "etc-read-only"
effect = "deny"
kind = "file_write"
path = "/etc/**"
"#;

async fn pending(h: &Sec, tok: &str) -> Vec<Value> {
    for _ in 0..200 {
        let (_, v, _) = req(h, "GET", "/v1/approvals", Some(tok), "").await;
        let items = v["items"].as_array().unwrap().clone();
        if !items.is_empty() {
            return items;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no pending approval appeared");
}

#[tokio::test]
async fn policy_denies_holds_and_runs_after_approval() {
    let h = Arc::new(sec_harness(|_| {}));
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let approver = token(&h, "acme", "approver").await;
    let viewer = token(&h, "acme", "viewer").await;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), POLICY).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let id = create_sb(&h, &dev).await;

    // allow
    let (s, v) = exec(&h, &dev, &id, "", &["ls", "/"]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v.as_str().unwrap().contains("\"exit\""));
    // deny, with the rule and reason
    let (s, v) = exec(&h, &dev, &id, "", &["/bin/rm", "-rf", "/x"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "policy_denied");
    assert_eq!(v["error"]["rule"], "no-rm");
    assert_eq!(v["error"]["reason"], "no deleting");
    let (s, v, _) = req(
        &h,
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/etc/passwd"),
        Some(&dev),
        "x",
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["rule"], "etc-read-only");
    // A sandbox policy cannot loosen a hard tenant rule.
    let (s, v, _) = req(
        &h,
        "PUT",
        &format!("/v1/sandboxes/{id}/policy"),
        Some(&admin),
        "[[rule]]\nid = \"rm-ok\"\neffect = \"allow\"\nprogram = \"rm\"\n",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _) = exec(&h, &dev, &id, "", &["rm", "x"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // approve → the caller waits; the approver approves; the call runs.
    let h2 = h.clone();
    let (dev2, id2) = (dev.clone(), id.clone());
    let waiting =
        tokio::spawn(async move { exec(&h2, &dev2, &id2, "", &["curl", "example.com"]).await });
    let items = pending(&h, &approver).await;
    assert_eq!(items.len(), 1);
    let ap = items[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(items[0]["rule_id"], "curl-needs-human");
    assert_eq!(items[0]["reason"], "network access");
    // A viewer and a developer may not answer.
    for t in [&viewer, &dev] {
        let (s, _, _) = req(
            &h,
            "POST",
            &format!("/v1/approvals/{ap}/approve"),
            Some(t),
            "",
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN);
    }
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/approvals/{ap}/approve"),
        Some(&approver),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"]["status"], "approved");
    let (s, v) = waiting.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    // The double echoes the argv as base64 stdout: "curl example.com".
    assert!(
        v.as_str().unwrap().contains("Y3VybCBleGFtcGxlLmNvbQ=="),
        "{v}"
    );
    // Answered twice → 409.
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/approvals/{ap}/deny"),
        Some(&approver),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    // Another tenant cannot see it.
    let other = token(&h, "other", "approver").await;
    let (s, _, _) = req(&h, "GET", &format!("/v1/approvals/{ap}"), Some(&other), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // deny → the call does not run.
    let h2 = h.clone();
    let (dev2, id2) = (dev.clone(), id.clone());
    let waiting = tokio::spawn(async move { exec(&h2, &dev2, &id2, "", &["curl", "x"]).await });
    let ap = pending(&h, &approver).await[0]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (s, _, _) = req(
        &h,
        "POST",
        &format!("/v1/approvals/{ap}/deny"),
        Some(&approver),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = waiting.await.unwrap();
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "policy_denied");
    assert_eq!(v["error"]["approval_id"], ap.as_str());

    // Nobody answers → denied after the timeout; answering later is 409.
    let started = std::time::Instant::now();
    let (s, v) = exec(&h, &dev, &id, "?approval_timeout=300ms", &["curl", "y"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not answered"));
    let late = v["error"]["approval_id"].as_str().unwrap().to_owned();
    let (s, _, _) = req(
        &h,
        "POST",
        &format!("/v1/approvals/{late}/approve"),
        Some(&approver),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);

    // wait=false → 202 with the id; approve; re-submit with approval=<id> runs once.
    let (s, v) = exec(&h, &dev, &id, "?wait=false", &["curl", "z"]).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let ap = v["approval"]["id"].as_str().unwrap().to_owned();
    let (s, v) = exec(&h, &dev, &id, &format!("?approval={ap}"), &["curl", "z"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "not approved yet: {v}");
    req(
        &h,
        "POST",
        &format!("/v1/approvals/{ap}/approve"),
        Some(&approver),
        "",
    )
    .await;
    let (s, v) = exec(
        &h,
        &dev,
        &id,
        &format!("?approval={ap}"),
        &["curl", "other"],
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "an approval covers one call: {v}");
    let (s, v) = exec(&h, &dev, &id, &format!("?approval={ap}"), &["curl", "z"]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _) = exec(&h, &dev, &id, &format!("?approval={ap}"), &["curl", "z"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "used once");

    // The audit log has every decision, and who answered.
    let (s, v, _) = req(
        &h,
        "GET",
        &format!("/v1/audit?sandbox={id}"),
        Some(&viewer),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let lines: Vec<Value> = v
        .as_str()
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let outcomes: Vec<&str> = lines
        .iter()
        .map(|l| l["decision"]["outcome"].as_str().unwrap())
        .collect();
    for o in [
        "allowed",
        "denied",
        "held",
        "approved",
        "rejected",
        "timed_out",
    ] {
        assert!(outcomes.contains(&o), "{o} missing from {outcomes:?}");
    }
    assert!(lines.iter().any(|l| l["by"]
        .as_str()
        .is_some_and(|b| b.starts_with("token:tok-"))));
    // Other tenants' audit is not theirs to read.
    let (_, v, _) = req(&h, "GET", "/v1/audit", Some(&other), "").await;
    assert_eq!(v, Value::String(String::new()));

    // Dry evaluation.
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/policy/test",
        Some(&viewer),
        json!({"sandbox": id, "call": {"kind":"exec","argv":["sudo","rm","-rf","/"]}}).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["effect"], "deny");
    assert_eq!(v["rule_id"], "no-rm");
}

#[tokio::test]
async fn policy_test_answers_mcp_calls() {
    let h = sec_harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    let policy = r#"default = "allow"
[[connector]]
name = "slack"
kind = "mcp"
url = "https://mcp.slack.test/mcp"
headers = { Authorization = "Bearer xoxb-1" }
read_only = true
[[connector.tool]]
name = "search"
read_only = true
[[connector]]
name = "crm"
kind = "mcp"
command = ["crm-mcp"]
[[rule]]
id = "general-needs-ok"
effect = "approve"
kind = "mcp"
connector = "crm"
arguments = { channel = "general" }
"#;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), policy).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let viewer = token(&h, "acme", "viewer").await;
    for (connector, tool, args, effect, rule) in [
        ("slack", "search", r#"{"q":"x"}"#, "allow", "default"),
        (
            "slack",
            "post_message",
            r#"{"channel":"general"}"#,
            "deny",
            "connector:slack:read-only",
        ),
        (
            "crm",
            "update",
            r#"{"channel":"general"}"#,
            "approve",
            "general-needs-ok",
        ),
        (
            "crm",
            "update",
            r#"{"channel":"random"}"#,
            "allow",
            "default",
        ),
        ("nope", "x", "{}", "deny", "invalid-call"),
    ] {
        let (s, v, _) = req(
            &h,
            "POST",
            "/v1/policy/test",
            Some(&viewer),
            json!({"call": {"kind": "mcp", "connector": connector, "tool": tool, "arguments": args}})
                .to_string(),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            (v["effect"].as_str(), v["rule_id"].as_str()),
            (Some(effect), Some(rule)),
            "{connector} {tool} {args}: {v}"
        );
    }
}

#[tokio::test]
async fn bad_policy_is_refused_whole_and_the_old_one_stays() {
    let h = sec_harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    let (s, _, _) = req(&h, "PUT", "/v1/policy", Some(&admin), POLICY).await;
    assert_eq!(s, StatusCode::OK);
    for (bad, line) in [
        (
            "default = \"allow\"\n[[rule]]\neffect = \"deny\"\nprogram = \"rm\nx",
            4,
        ),
        (
            "default = \"allow\"\n\n[[rule]]\neffect = \"deny\"\nprogramm = \"rm\"\n",
            5,
        ),
        ("default = \"sometimes\"\n", 1),
    ] {
        let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), bad).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(&format!("line {line}")), "{msg}");
    }
    let (_, v, _) = req(&h, "GET", "/v1/policy", Some(&admin), "").await;
    assert_eq!(v["toml"], POLICY);
    let dev = token(&h, "acme", "developer").await;
    let id = create_sb(&h, &dev).await;
    // A PUT that lost its body (found by schemathesis: it answered 200 and
    // cleared the layer) is refused and changes nothing, at both layers.
    let sb_policy = "default = \"allow\"\n[[rule]]\neffect = \"deny\"\nprogram = \"touch\"\n";
    let path = format!("/v1/sandboxes/{id}/policy");
    let (s, v, _) = req(&h, "PUT", &path, Some(&admin), sb_policy).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    for p in ["/v1/policy", path.as_str()] {
        let (s, v, _) = req(&h, "PUT", p, Some(&admin), "").await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{p}: {v}");
        assert_eq!(v["error"]["code"], "invalid_request", "{v}");
    }
    let (_, v, _) = req(&h, "GET", &path, Some(&admin), "").await;
    assert_eq!(v["toml"], sb_policy);
    let (s, _) = exec(&h, &dev, &id, "", &["touch", "x"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "the sandbox layer is in force");
    let (_, v, _) = req(&h, "GET", "/v1/policy", Some(&admin), "").await;
    assert_eq!(v["toml"], POLICY);
    let (s, _) = exec(&h, &dev, &id, "", &["rm", "x"]).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "the old policy is in force");
}

#[tokio::test]
async fn audit_verification_detects_an_edited_line() {
    let h = sec_harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let id = create_sb(&h, &dev).await;
    for _ in 0..3 {
        assert_eq!(exec(&h, &dev, &id, "", &["true"]).await.0, StatusCode::OK);
    }
    let (s, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&h.admin), "").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["entries"], 4);
    let path = h.dir.path().join("audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replacen("\"argv\":[\"true\"]", "\"argv\":[\"fals\"]", 1);
    assert_ne!(text, edited);
    std::fs::write(&path, edited).unwrap();
    let (_, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&h.admin), "").await;
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("line 2"), "{v}");
    // A cut-off tail is caught by the head kept in the database.
    let lines: Vec<&str> = text.lines().collect();
    std::fs::write(&path, format!("{}\n", lines[..3].join("\n"))).unwrap();
    let (_, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&h.admin), "").await;
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("tail removed"), "{v}");
}

#[tokio::test]
async fn rate_limit_answers_429_with_retry_after() {
    let h = sec_harness(|c| {
        c.security.rate_limit_per_second = 0.5;
        c.security.rate_limit_burst = 3;
    });
    for _ in 0..3 {
        assert_eq!(
            req(&h, "GET", "/v1/whoami", Some(&h.admin), "").await.0,
            StatusCode::OK
        );
    }
    let (s, v, hd) = req(&h, "GET", "/v1/whoami", Some(&h.admin), "").await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(code(&v), "rate_limited");
    let after: u64 = hd["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=2).contains(&after), "{after}");
    // Buckets are per token.
    let other = crate::security::auth::new_token();
    let _ = other;
    let (s, _, _) = req(&h, "GET", "/healthz", None, "").await;
    assert_eq!(s, StatusCode::OK);
}

async fn upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let line = head.lines().next().unwrap_or("").to_owned();
                let body = format!("upstream saw: {line}");
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
            });
        }
    });
    (addr, task)
}

/// One request into the sandbox's proxy the way a guest tunnel reaches it:
/// a stream handed to it in-process (there is no listener to connect to).
async fn through_proxy(
    proxy: &Arc<strata_policy::proxy::Egress>,
    method: &str,
    url: &str,
    host: &str,
) -> String {
    let mut s = proxy.open_stream().unwrap();
    s.write_all(
        format!("{method} {url} HTTP/1.1\r\nHost: {host}\r\ncontent-length: 0\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn egress_proxy_applies_the_tenant_policy_per_request() {
    let (up, _task) = upstream().await;
    let h = sec_harness(|c| {
        c.security
            .egress_static_hosts
            .insert("api.crm.test".into(), "127.0.0.1".parse().unwrap());
    });
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let policy = format!(
        "default = \"deny\"\n[[connector]]\nname = \"crm\"\nhosts = [\"api.crm.test\"]\nports = [{}]\nread_only = true\n\n[[rule]]\nid = \"crm-read\"\neffect = \"allow\"\nconnector = \"crm\"\naccess = \"read\"\n\n[[rule]]\nid = \"the-rest\"\neffect = \"allow\"\nkind = [\"exec\", \"lifecycle\"]\n",
        up.port()
    );
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), policy).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let id = create_sb(&h, &dev).await;
    let (s, v, _) = req(
        &h,
        "GET",
        &format!("/v1/sandboxes/{id}/egress"),
        Some(&dev),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["guest_proxy"], "http://127.0.0.1:3128");
    assert_eq!(v["proxy"], "in-process", "{v}");
    assert_eq!(v["tunnels"]["limit"], 128, "{v}");
    let guest = crate::caller::Caller::Guest {
        sandbox: id.parse().unwrap(),
        tenant: "acme".into(),
    };
    let proxy = h.app.security().unwrap().egress_proxy(&guest).unwrap();
    let url = format!("http://api.crm.test:{}/records", up.port());
    let host = format!("api.crm.test:{}", up.port());
    let got = through_proxy(&proxy, "GET", &url, &host).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("upstream saw: GET /records"), "{got}");
    let posted = through_proxy(&proxy, "POST", &url, &host).await;
    assert!(posted.starts_with("HTTP/1.1 403"), "{posted}");
    assert!(!posted.contains("upstream saw"), "{posted}");
    let unlisted = through_proxy(&proxy, "GET", "http://evil.test/", "evil.test").await;
    assert!(unlisted.starts_with("HTTP/1.1 403"), "{unlisted}");
    let ip = through_proxy(&proxy, "GET", &format!("http://{up}/"), &up.to_string()).await;
    assert!(ip.starts_with("HTTP/1.1 403"), "{ip}");
    // The same proxy on a second ask; decisions are in the tenant's audit.
    let (_, v, _) = req(
        &h,
        "GET",
        &format!("/v1/sandboxes/{id}/egress"),
        Some(&dev),
        "",
    )
    .await;
    assert_eq!(v["tunnels"]["admitted"], 4, "{v}");
    let (_, v, _) = req(&h, "GET", "/v1/audit", Some(&admin), "").await;
    let text = v.as_str().unwrap();
    assert!(text.contains("\"kind\":\"egress\""), "{text}");
    let (_, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&admin), "").await;
    assert_eq!(v["ok"], true, "{v}");
    // The head in the database follows the egress entries too (the last
    // entries of the log are the proxy's).
    let (seq, hash) = h
        .app
        .security()
        .unwrap()
        .store()
        .audit_head()
        .unwrap()
        .unwrap();
    let log = std::fs::read_to_string(h.dir.path().join("audit.jsonl")).unwrap();
    let last: Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
    assert!(last["call"]["kind"]["kind"] == "egress", "{last}");
    assert_eq!(
        (seq, hash.as_str()),
        (
            last["seq"].as_u64().unwrap(),
            last["hash"].as_str().unwrap()
        )
    );
}

#[tokio::test]
async fn an_exec_setting_a_dangerous_env_variable_is_refused_and_runs_nothing() {
    let engine = Arc::new(Double::default());
    let h = sec_harness_on(|_| {}, engine.clone());
    let dev = token(&h, "acme", "developer").await;
    let id = create_sb(&h, &dev).await;
    // No policy at all (the built-in default allows): the built-in list
    // still refuses a variable that gives bash a function `true`.
    let body = json!({
        "cmd": ["bash", "-c", "true"],
        "env": {"BASH_FUNC_true%%": "() { rm -rf /data; }"},
    });
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&dev),
        body.to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "policy_denied", "{v}");
    assert_eq!(v["error"]["rule"], "dangerous-env", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("BASH_FUNC_true%%")),
        "{v}"
    );
    assert_eq!(engine.execs.load(Ordering::Relaxed), 0, "nothing ran");
    // The audit log has the denial with the variable's name, not its value.
    let admin = token(&h, "acme", "admin").await;
    let (_, audit, _) = req(&h, "GET", "/v1/audit", Some(&admin), "").await;
    let audit = audit.as_str().unwrap_or_default().to_owned();
    assert!(
        audit.contains("dangerous-env") && audit.contains("BASH_FUNC_true%%"),
        "{audit}"
    );
    assert!(!audit.contains("rm -rf /data"), "{audit}");
    // The same command without it runs.
    let (s, v) = exec(&h, &dev, &id, "", &["bash", "-c", "true"]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(engine.execs.load(Ordering::Relaxed), 1);
}

/// Writes an audit log in the old unkeyed form (no `v`), as a daemon from
/// before the audit key wrote it: `n` entries, every tenth of `acme`, the
/// rest of the platform tenant.
fn write_legacy_log(path: &std::path::Path, n: u64) {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut prev = strata_policy::audit::GENESIS.to_string();
    for seq in 1..=n {
        let tenant = if seq % 10 == 0 { "acme" } else { "default" };
        let mut v = json!({
            "seq": seq, "time": "2026-11-01T10:00:00Z", "tenant": tenant, "sandbox": "sb-old",
            "actor": "tok-old",
            "call": {"tenant": tenant, "sandbox": "sb-old", "actor": "tok-old",
                     "kind": {"kind": "file_read", "path": format!("/workspace/some/longer/path/{seq}")}},
            "decision": {"outcome": "allowed", "effect": "allow", "rule_id": "default",
                         "layer": null, "reason": "default allow"},
            "by": null, "prev_hash": prev, "hash": ""
        });
        let h = strata_policy::audit::entry_hash(&prev, &v);
        v["hash"] = h.clone().into();
        writeln!(f, "{v}").unwrap();
        prev = h;
    }
    f.flush().unwrap();
}

#[tokio::test]
async fn an_old_log_verifies_per_tenant_and_a_large_export_streams_in_chunks() {
    const N: u64 = 10_000;
    let h = sec_harness(|c| write_legacy_log(&c.data_dir.join("audit.jsonl"), N));
    // New decisions are keyed, after the old entries.
    let dev = token(&h, "acme", "developer").await;
    let id = create_sb(&h, &dev).await;
    assert_eq!(exec(&h, &dev, &id, "", &["true"]).await.0, StatusCode::OK);
    let last = std::fs::read_to_string(h.dir.path().join("audit.jsonl")).unwrap();
    let last: Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(last["v"], 2, "{last}");

    let (s, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&h.admin), "").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["keyed"], true, "{v}");
    assert_eq!(v["unkeyed_entries"], N, "{v}");
    assert_eq!(v["keyed_from"], N + 1, "{v}");
    assert_eq!(v["tenant"], "default");
    assert_eq!(v["tenant_entries"], N - N / 10, "{v}");
    // The decisions made since (create, exec) are acme's.
    let new = v["entries"].as_u64().unwrap() - N;
    assert!(new >= 2, "{v}");
    assert_eq!(v["tenants"]["acme"]["entries"], N / 10 + new, "{v}");
    // A tenant's admin gets its own part and the verdict, not the others'.
    let acme = token(&h, "acme", "admin").await;
    let (_, v, _) = req(&h, "GET", "/v1/audit/verify", Some(&acme), "").await;
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["tenant"], "acme");
    assert_eq!(v["tenant_entries"], N / 10 + new, "{v}");
    assert_eq!(v["tenant_last_seq"], N + new, "{v}");
    assert!(v.get("tenants").is_none(), "{v}");

    // The export (~10 MB) arrives in bounded chunks, not as one buffer.
    let resp = h
        .app
        .router()
        .oneshot(
            Request::builder()
                .uri("/v1/audit")
                .header("authorization", format!("Bearer {}", h.admin))
                .body(AxBody::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let (mut frames, mut biggest, mut total, mut lines) = (0usize, 0usize, 0usize, 0usize);
    while let Some(f) = body.frame().await {
        let data = f.unwrap().into_data().unwrap_or_default();
        frames += 1;
        biggest = biggest.max(data.len());
        total += data.len();
        lines += data.iter().filter(|&&b| b == b'\n').count();
    }
    assert_eq!(
        lines as u64,
        N - N / 10,
        "the platform tenant's entries only"
    );
    assert!(total > 2 << 20, "{total} bytes");
    assert!(
        frames > 20,
        "{frames} frames for {total} bytes: not streamed"
    );
    assert!(biggest <= 64 * 1024 + 1024, "a chunk of {biggest} bytes");
}

#[tokio::test]
async fn a_log_and_head_rewritten_without_the_key_are_refused_at_start() {
    let h = sec_harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let id = create_sb(&h, &dev).await;
    for _ in 0..3 {
        assert_eq!(exec(&h, &dev, &id, "", &["true"]).await.0, StatusCode::OK);
    }
    let Sec { app, dir, .. } = h;
    app.stop();
    drop(app);
    let cfg = Config {
        data_dir: dir.path().to_owned(),
        key_dir: dir.path().join("keys"),
        ..Config::default()
    };
    // Someone who can write the data dir but not the key dir: edits an
    // entry, recomputes every link in the only form they can (the unkeyed
    // one) and records the matching head in the database.
    let path = cfg.data_dir.join("audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut prev = strata_policy::audit::GENESIS.to_string();
    let mut out = String::new();
    let mut seq = 0;
    for l in text.lines() {
        let mut v: Value = serde_json::from_str(l).unwrap();
        v.as_object_mut().unwrap().remove("v");
        v["actor"] = "someone-else".into();
        v["prev_hash"] = prev.clone().into();
        prev = strata_policy::audit::entry_hash(&prev, &v);
        v["hash"] = prev.clone().into();
        seq = v["seq"].as_u64().unwrap();
        out.push_str(&format!("{v}\n"));
    }
    std::fs::write(&path, out).unwrap();
    let db = rusqlite::Connection::open(cfg.db_path()).unwrap();
    db.execute(
        "UPDATE audit_head SET seq = ?1, hash = ?2",
        rusqlite::params![seq as i64, prev],
    )
    .unwrap();
    drop(db);
    // The old (unkeyed) verification accepts it…
    assert!(strata_policy::audit::verify_head(&path, seq, &prev).is_ok());
    // …the daemon, holding the key, does not.
    let err = crate::security::Security::open(&cfg)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("unkeyed entry")),
        "{err:?}"
    );
}

/// Finding 20: the bootstrap admin token is not kept on disk forever. An
/// admin makes its own token and revokes the bootstrap one: the token stops
/// working and `admin.token` goes with it. Revoking another token leaves
/// the file alone.
#[tokio::test]
async fn revoking_the_bootstrap_token_removes_its_file() {
    let h = sec_harness(|_| {});
    let file = h.dir.path().join("admin.token");
    assert!(file.exists());
    let (_, me, _) = req(&h, "GET", "/v1/whoami", Some(&h.admin), "").await;
    let boot_id = me["token_id"].as_str().unwrap_or_default().to_owned();
    assert!(boot_id.starts_with("tok-"), "{me}");
    let (_, v, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&h.admin),
        r#"{"role":"admin","name":"ops"}"#,
    )
    .await;
    let ops = v["token"].as_str().unwrap().to_owned();
    let (_, v, _) = req(&h, "POST", "/v1/tokens", Some(&ops), r#"{"role":"viewer"}"#).await;
    let viewer_id = v["id"].as_str().unwrap().to_owned();
    let (s, _, _) = req(
        &h,
        "DELETE",
        &format!("/v1/tokens/{viewer_id}"),
        Some(&ops),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(file.exists(), "revoking another token removed admin.token");
    let (s, v, _) = req(
        &h,
        "DELETE",
        &format!("/v1/tokens/{boot_id}"),
        Some(&ops),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(
        !file.exists(),
        "admin.token kept after its token was revoked"
    );
    let (s, _, _) = req(&h, "GET", "/v1/whoami", Some(&h.admin), "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(
        req(&h, "GET", "/v1/whoami", Some(&ops), "").await.0,
        StatusCode::OK
    );
}

/// The API grants no other origin anything (docs/console.md): a
/// cross-origin request carrying a valid token is answered without any
/// `Access-Control-Allow-*` header (so a page of another origin cannot read
/// it), and a CORS preflight is not allowed; the console's files carry no
/// allowance either.
#[tokio::test]
async fn no_origin_gets_a_cors_allowance() {
    let h = sec_harness(|_| {});
    let router = h.app.router();
    let evil = "https://evil.example";
    for (method, uri, with_token) in [
        ("GET", "/v1/whoami", true),
        ("GET", "/v1/sandboxes", true),
        ("GET", "/v1/approvals", true),
        ("POST", "/v1/approvals/ap-x/approve", true),
        ("OPTIONS", "/v1/sandboxes", false),
        ("OPTIONS", "/v1/approvals/ap-x/approve", false),
        ("GET", "/console/", false),
        ("GET", "/console/api.js", false),
    ] {
        let mut b = Request::builder()
            .method(method)
            .uri(uri)
            .header("origin", evil)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization");
        if with_token {
            b = b.header("authorization", format!("Bearer {}", h.admin));
        }
        let resp = router
            .clone()
            .oneshot(b.body(AxBody::empty()).unwrap())
            .await
            .unwrap();
        if method == "GET" {
            assert!(
                resp.status().is_success(),
                "{method} {uri}: {}",
                resp.status()
            );
        }
        if method == "OPTIONS" {
            assert!(
                !resp.status().is_success(),
                "{method} {uri}: preflight allowed"
            );
        }
        for (k, _) in resp.headers() {
            assert!(
                !k.as_str().starts_with("access-control-"),
                "{method} {uri}: {k}"
            );
        }
    }
}
