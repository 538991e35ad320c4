//! The security matrix, generated from the route list (`api::ROUTES`):
//! every `/v1` route (and `HEAD` of every `GET`) × every role × the id in
//! the path spelled as {own, own with its first byte percent-encoded, own
//! with every byte percent-encoded, foreign (the same three ways), unknown,
//! malformed, undecodable}. Each case asserts the status, the error code,
//! whether the tool-call gate ran (an audit entry, with the caller as actor)
//! and, for a foreign id, that the answer is exactly the unknown id's.
//!
//! Real router, service, store, policy engine and audit log; the engine is
//! the test double of `api::tests`.

use std::collections::HashMap;
use std::time::Duration;

use super::security::{req, sec_harness, token, Sec};
use super::*;
use crate::api::Action;
use crate::security::auth::{allowed, Role};

const ROLES: [&str; 5] = ["admin", "developer", "approver", "viewer", "metrics"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Own,
    OwnFirst,
    OwnAll,
    Foreign,
    ForeignFirst,
    ForeignAll,
    Unknown,
    Malformed,
    Undecodable,
}

const VARIANTS: [Variant; 9] = [
    Variant::Own,
    Variant::OwnFirst,
    Variant::OwnAll,
    Variant::Foreign,
    Variant::ForeignFirst,
    Variant::ForeignAll,
    Variant::Unknown,
    Variant::Malformed,
    Variant::Undecodable,
];

fn enc_first(id: &str) -> String {
    format!("%{:02x}{}", id.as_bytes()[0], &id[1..])
}

fn enc_all(id: &str) -> String {
    id.bytes().map(|b| format!("%{b:02X}")).collect()
}

/// What a route's `:id` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Sandbox,
    Snapshot,
    Template,
    Approval,
    Token,
    Webhook,
    Secret,
}

fn kind(path: &str) -> Option<Kind> {
    Some(if path.starts_with("/v1/sandboxes/:id") {
        Kind::Sandbox
    } else if path.starts_with("/v1/snapshots/:id") {
        Kind::Snapshot
    } else if path.starts_with("/v1/templates/:id") {
        Kind::Template
    } else if path.starts_with("/v1/approvals/:id") {
        Kind::Approval
    } else if path.starts_with("/v1/tokens/:id") {
        Kind::Token
    } else if path.starts_with("/v1/webhooks/:id") {
        Kind::Webhook
    } else if path.starts_with("/v1/secrets/:id") {
        Kind::Secret
    } else {
        return None;
    })
}

fn unknown(k: Kind) -> &'static str {
    match k {
        Kind::Sandbox => "sb-0000000000000000zzzz",
        Kind::Snapshot => "snap-0000000000000000zzzz",
        Kind::Template => "tpl-0000000000000000zzzz",
        Kind::Approval => "apr-0000000000000000zzzz",
        Kind::Token => "tok-0000000000000000",
        Kind::Webhook => "wh-0000000000000000",
        Kind::Secret => "sec-0000000000000000zzzz",
    }
}

fn malformed(k: Kind) -> &'static str {
    match k {
        Kind::Sandbox => "sb-NOT_AN_ID",
        Kind::Snapshot => "snap-NOT_AN_ID",
        Kind::Template => "tpl-NOT_AN_ID",
        Kind::Approval => "apr-NOT_AN_ID",
        Kind::Token => "tok-NOT_AN_ID",
        Kind::Webhook => "wh-NOT_AN_ID",
        Kind::Secret => "sec-NOT_AN_ID",
    }
}

/// Whether a successful call of the route writes one audit entry: a tool
/// call (the route table says which), or an answer to a held call.
fn audited(method: &str, path: &str) -> bool {
    let r = crate::api::routes::find(method, path).unwrap();
    r.tool_call || matches!(r.action, Action::Approve | Action::Deny)
}

/// The query and body a well-formed call of the route carries.
fn shape(method: &str, path: &str) -> (&'static str, String) {
    let q = match (method, path) {
        (_, "/v1/sandboxes/:id/files") if method == "PUT" || method == "DELETE" => "?path=/tmp/x",
        (_, "/v1/sandboxes/:id/files") => "?path=/etc/hostname",
        (_, "/v1/sandboxes/:id/files/list" | "/v1/sandboxes/:id/files/stat") => "?path=/etc",
        (_, "/v1/sandboxes/:id/files/mkdir") => "?path=/tmp/d",
        _ => "",
    };
    let body = match (method, path) {
        ("POST", "/v1/sandboxes/:id/exec") => r#"{"cmd":["true"]}"#.to_owned(),
        ("POST", "/v1/sandboxes/:id/code") => r#"{"code":"1+1"}"#.to_owned(),
        ("POST", "/v1/sandboxes/:id/rewind") => r#"{"ago":"0s"}"#.to_owned(),
        ("PUT", "/v1/sandboxes/:id/files") => "data".to_owned(),
        ("PUT", "/v1/sandboxes/:id/policy") => "default = \"allow\"\n".to_owned(),
        ("POST", "/v1/templates/:id/replicate") => r#"{"host":"h1"}"#.to_owned(),
        _ => String::new(),
    };
    (q, body)
}

const HELD_POLICY: &str = r#"default = "allow"
[[rule]]
id = "held"
effect = "approve"
program = "approve-me"
reason = "matrix fixture"
[[connector]]
name = "matrix"
hosts = ["matrix.test"]
"#;

/// A tenant's tokens.
struct Tenant {
    name: &'static str,
    toks: HashMap<&'static str, String>,
    ids: HashMap<&'static str, String>,
}

async fn tenant(h: &Sec, name: &'static str) -> Tenant {
    let mut toks = HashMap::new();
    let mut ids = HashMap::new();
    for role in ROLES {
        let (s, v, _) = req(
            h,
            "POST",
            "/v1/tokens",
            Some(&h.admin),
            json!({ "role": role, "tenant": name }).to_string(),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        toks.insert(role, v["token"].as_str().unwrap().to_owned());
        ids.insert(role, v["id"].as_str().unwrap().to_owned());
    }
    let (s, v, _) = req(h, "PUT", "/v1/policy", Some(&toks["admin"]), HELD_POLICY).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    Tenant { name, toks, ids }
}

/// A fresh resource of `k` owned by tenant `t`.
async fn fixture(h: &Sec, t: &Tenant, k: Kind) -> String {
    let dev = &t.toks["developer"];
    let sandbox = || async {
        let (s, v, _) = req(
            h,
            "POST",
            "/v1/sandboxes",
            Some(dev),
            r#"{"template":"tpl-base"}"#,
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_owned()
    };
    match k {
        Kind::Sandbox | Kind::Snapshot => {
            let sb = sandbox().await;
            let (s, v, _) = req(
                h,
                "POST",
                &format!("/v1/sandboxes/{sb}/snapshots"),
                Some(dev),
                "",
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            if k == Kind::Sandbox {
                sb
            } else {
                v["id"].as_str().unwrap().to_owned()
            }
        }
        Kind::Template => {
            let (s, v, _) = req(h, "POST", "/v1/templates", Some(dev), "{}").await;
            assert_eq!(s, StatusCode::ACCEPTED, "{v}");
            let id = v["id"].as_str().unwrap().to_owned();
            for _ in 0..200 {
                let (_, v, _) = req(h, "GET", &format!("/v1/templates/{id}"), Some(dev), "").await;
                if v["status"] == "ready" {
                    return id;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            panic!("template {id} never became ready");
        }
        Kind::Approval => {
            let sb = sandbox().await;
            let (s, v, _) = req(
                h,
                "POST",
                &format!("/v1/sandboxes/{sb}/exec?wait=false"),
                Some(dev),
                r#"{"cmd":["approve-me"]}"#,
            )
            .await;
            assert_eq!(s, StatusCode::ACCEPTED, "{v}");
            v["approval"]["id"].as_str().unwrap().to_owned()
        }
        Kind::Webhook => {
            let (s, v, _) = req(
                h,
                "POST",
                "/v1/webhooks",
                Some(&t.toks["admin"]),
                r#"{"url":"http://127.0.0.1:9/hook"}"#,
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            v["id"].as_str().unwrap().to_owned()
        }
        Kind::Secret => {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (s, v, _) = req(
                h,
                "POST",
                "/v1/secrets",
                Some(&t.toks["admin"]),
                json!({ "name": format!("sec-{}-{n}", t.name), "connector": "matrix",
                    "rule": { "type": "bearer" }, "value": "v" })
                .to_string(),
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            v["name"].as_str().unwrap().to_owned()
        }
        Kind::Token => {
            let (s, v, _) = req(
                h,
                "POST",
                "/v1/tokens",
                Some(&h.admin),
                json!({ "role": "viewer", "tenant": t.name }).to_string(),
            )
            .await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            v["id"].as_str().unwrap().to_owned()
        }
    }
}

fn audit_lines(h: &Sec) -> Vec<Value> {
    std::fs::read_to_string(h.dir.path().join("audit.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

struct Answer {
    status: StatusCode,
    body: Value,
    audited: Vec<Value>,
}

async fn send(h: &Sec, method: &str, uri: &str, tok: &str, body: &str) -> Answer {
    let before = audit_lines(h).len();
    let (status, body, _) = req(h, method, uri, Some(tok), body.to_owned()).await;
    let audited = audit_lines(h).split_off(before);
    Answer {
        status,
        body,
        audited,
    }
}

fn err_code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test]
async fn every_route_every_role_every_spelling_of_the_id() {
    let h = sec_harness(|c| {
        c.security.approval_timeout = Duration::from_millis(50);
        c.capacity.vcpus = 1 << 20;
        c.capacity.memory_mib = 1 << 40;
        c.capacity.admission = crate::config::AdmissionMode::Nominal;
        c.pressure.enabled = false;
        // The webhook fixtures' target (a closed local port).
        c.webhooks.allow_private = vec!["127.0.0.1".into()];
    });
    let acme = tenant(&h, "acme").await;
    let beta = tenant(&h, "beta").await;
    // Read-only routes share one fixture per tenant and kind.
    let mut shared: HashMap<(bool, Kind), String> = HashMap::new();
    let mut cases = 0usize;
    let mut routes: Vec<(&str, &str)> = crate::api::ROUTES
        .iter()
        // Template files are content-addressed per tenant: a PUT of another
        // tenant's hash stores the caller's own copy (there is no foreign
        // one to hide). Their tenancy is `api::tests::template_files`.
        // A ticket route takes no bearer: its ticket, tenancy and roles
        // are `api::tests::terminal`. A host route takes a host
        // credential, not a token (`cluster::replicas`, tests/cluster_replica.rs).
        .filter(|r| {
            !matches!(
                r.access,
                crate::api::routes::Access::Ticket(_) | crate::api::routes::Access::Host
            )
        })
        .filter(|r| {
            r.path.starts_with("/v1/")
                && r.path.contains(":id")
                && !r.path.starts_with("/v1/template-files/")
                // An import's id names a sandbox that does not exist here
                // yet (any taken id is `409 conflict`, whoever owns it);
                // their tenancy is `stratad/tests/e2e_move.rs`.
                && !r.path.starts_with("/v1/imports/")
        })
        .map(|r| (r.method, r.path))
        .collect();
    let heads: Vec<(&str, &str)> = routes
        .iter()
        .filter(|(m, _)| *m == "GET")
        .map(|(_, p)| ("HEAD", *p))
        .collect();
    routes.extend(heads);
    for (method, path) in routes {
        let k = kind(path).unwrap_or_else(|| panic!("no id kind for {path}"));
        let reads = method == "GET" || method == "HEAD";
        let (q, body) = shape(method, path);
        for role_name in ROLES {
            let role: Role = role_name.parse().unwrap();
            let tok = &acme.toks[role_name];
            let mut own_status: Option<StatusCode> = None;
            let unknown_answer = {
                let uri = format!(
                    "{}{q}",
                    path.replace(":id", unknown(k))
                        .replace(":port", "8000")
                        .replace("*rest", "x")
                );
                send(&h, method, &uri, tok, &body).await
            };
            for v in VARIANTS {
                cases += 1;
                let ctx = format!("{role_name} {method} {path} {v:?}");
                let (owner, enc): (Option<&Tenant>, fn(&str) -> String) = match v {
                    Variant::Own => (Some(&acme), |s| s.to_owned()),
                    Variant::OwnFirst => (Some(&acme), enc_first),
                    Variant::OwnAll => (Some(&acme), enc_all),
                    Variant::Foreign => (Some(&beta), |s| s.to_owned()),
                    Variant::ForeignFirst => (Some(&beta), enc_first),
                    Variant::ForeignAll => (Some(&beta), enc_all),
                    _ => (None, |s| s.to_owned()),
                };
                let (real, spelled) = match (owner, v) {
                    (Some(t), _) => {
                        let key = (std::ptr::eq(t, &acme), k);
                        let id = if reads {
                            match shared.get(&key) {
                                Some(id) => id.clone(),
                                None => {
                                    let id = fixture(&h, t, k).await;
                                    shared.insert(key, id.clone());
                                    id
                                }
                            }
                        } else if allowed(method, path, role) {
                            fixture(&h, t, k).await
                        } else {
                            unknown(k).to_owned()
                        };
                        let spelled = enc(&id);
                        (id, spelled)
                    }
                    (None, Variant::Unknown) => (unknown(k).to_owned(), unknown(k).to_owned()),
                    (None, Variant::Malformed) => {
                        (malformed(k).to_owned(), malformed(k).to_owned())
                    }
                    (None, _) => ("%FF%FE".to_owned(), "%FF%FE".to_owned()),
                };
                let uri = format!(
                    "{}{q}",
                    path.replace(":id", &spelled)
                        .replace(":port", "8000")
                        .replace("*rest", "x")
                );
                let a = send(&h, method, &uri, tok, &body).await;
                let head = method == "HEAD";
                if !allowed(method, path, role) {
                    assert_eq!(a.status, StatusCode::FORBIDDEN, "{ctx}: {}", a.body);
                    if !head {
                        assert_eq!(err_code(&a.body), "forbidden", "{ctx}");
                    }
                    assert!(a.audited.is_empty(), "{ctx}: gate ran for a refused role");
                    continue;
                }
                match v {
                    Variant::Own | Variant::OwnFirst | Variant::OwnAll => {
                        assert_ne!(a.status, StatusCode::NOT_FOUND, "{ctx}: {}", a.body);
                        assert_ne!(a.status, StatusCode::FORBIDDEN, "{ctx}: {}", a.body);
                        match own_status {
                            None => own_status = Some(a.status),
                            Some(s) => assert_eq!(a.status, s, "{ctx}: {}", a.body),
                        }
                        let port = crate::api::routes::find(method, path)
                            .is_some_and(|r| matches!(r.action, Action::Port | Action::RunCode));
                        if port {
                            // A port connection is audited when it closes,
                            // from a task of its own (stratad/tests/ports_v1.rs):
                            // let it land before the next case reads the log.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        } else if audited(method, path) {
                            assert_eq!(a.audited.len(), 1, "{ctx}: {:?}", a.audited);
                            let entry = &a.audited[0];
                            let want = format!("token:{}", acme.ids[role_name]);
                            let actor = if path.starts_with("/v1/approvals") {
                                entry["by"].as_str().unwrap_or("")
                            } else {
                                entry["actor"].as_str().unwrap_or("")
                            };
                            assert_eq!(actor, want, "{ctx}: {entry}");
                            assert_eq!(entry["tenant"], "acme", "{ctx}");
                        } else {
                            assert!(a.audited.is_empty(), "{ctx}: {:?}", a.audited);
                        }
                    }
                    Variant::Foreign
                    | Variant::ForeignFirst
                    | Variant::ForeignAll
                    | Variant::Unknown => {
                        assert_eq!(a.status, unknown_answer.status, "{ctx}: {}", a.body);
                        assert_eq!(a.status, StatusCode::NOT_FOUND, "{ctx}: {}", a.body);
                        if !head {
                            let text = a.body.to_string().replace(&real, unknown(k));
                            assert_eq!(text, unknown_answer.body.to_string(), "{ctx}");
                            assert_eq!(err_code(&a.body), "not_found", "{ctx}");
                        }
                        assert!(a.audited.is_empty(), "{ctx}: {:?}", a.audited);
                    }
                    Variant::Malformed => {
                        // Typed ids are parsed (400); approval and token ids are
                        // opaque strings looked up in the caller's tenant (404).
                        let want = match k {
                            Kind::Approval | Kind::Token | Kind::Webhook | Kind::Secret => {
                                StatusCode::NOT_FOUND
                            }
                            _ => StatusCode::BAD_REQUEST,
                        };
                        assert_eq!(a.status, want, "{ctx}: {}", a.body);
                        assert!(a.audited.is_empty(), "{ctx}");
                    }
                    Variant::Undecodable => {
                        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{ctx}: {}", a.body);
                        if !head {
                            assert_eq!(err_code(&a.body), "invalid_request", "{ctx}");
                        }
                        assert!(a.audited.is_empty(), "{ctx}");
                    }
                }
            }
        }
    }
    assert!(cases > 1000, "{cases} cases");
}

#[tokio::test]
async fn one_parse_of_the_query_and_head_is_gated_like_get() {
    let h = sec_harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let admin = token(&h, "acme", "admin").await;
    let policy = r#"default = "allow"
[[rule]]
id = "no-etc"
effect = "deny"
kind = "file_read"
path = "/etc/**"
reason = "no /etc"
"#;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), policy).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let sb = super::security::create_sb(&h, &dev).await;
    // A repeated parameter, and a boolean that is not true/1 or false/0
    // (the stateful API fuzz found `pause?wait=` answered 200), are
    // refused before anything runs.
    let (twice, not_bool) = ("more than once", "expected true or false");
    for (m, q, why) in [
        ("GET", "files?path=/tmp/decoy&path=/etc/shadow", twice),
        ("HEAD", "files?path=/tmp/decoy&path=/etc/shadow", twice),
        ("PUT", "files?path=/tmp/decoy&path=/etc/cron.d/x", twice),
        ("GET", "files/stat?path=/tmp&path=/etc", twice),
        ("POST", "exec?wait=true&wait=false", twice),
        ("POST", "pause?approval=a&approval=b", twice),
        ("POST", "pause?wait=", not_bool),
        ("POST", "pause?wait", not_bool),
        ("POST", "exec?wait=yes", not_bool),
        ("DELETE", "files?path=/tmp/x&recursive=", not_bool),
        ("POST", "files/mkdir?path=/tmp/y&parents", not_bool),
    ] {
        let a = send(
            &h,
            m,
            &format!("/v1/sandboxes/{sb}/{q}"),
            &dev,
            r#"{"cmd":["true"]}"#,
        )
        .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{m} {q}: {}", a.body);
        if m != "HEAD" {
            assert_eq!(err_code(&a.body), "invalid_request", "{q}");
            assert!(a.body.to_string().contains(why), "{q}: {}", a.body);
        }
        assert!(a.audited.is_empty(), "{q}: {:?}", a.audited);
    }
    let (s, v, _) = req(&h, "GET", "/v1/events?follow=", Some(&dev), "").await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // Listing filters that repeat by design still do.
    let (s, v, _) = req(
        &h,
        "GET",
        "/v1/sandboxes?state=running&state=paused&label=a=b&label=c=d",
        Some(&dev),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _, _) = req(&h, "GET", "/v1/sandboxes?limit=1&limit=2", Some(&dev), "").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // HEAD is decided like GET: denied, and audited as a denial.
    for m in ["GET", "HEAD"] {
        let a = send(
            &h,
            m,
            &format!("/v1/sandboxes/{sb}/files?path=/etc/shadow"),
            &dev,
            "",
        )
        .await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{m}");
        assert_eq!(a.audited.len(), 1, "{m}");
        assert_eq!(
            a.audited[0]["decision"]["outcome"], "denied",
            "{m}: {:?}",
            a.audited
        );
        assert_eq!(a.audited[0]["call"]["kind"]["path"], "/etc/shadow");
    }
    // The path decided on is the path used, whatever its spelling.
    let a = send(
        &h,
        "GET",
        &format!("/v1/sandboxes/{sb}/files?path=%2Fetc%2Fshadow"),
        &dev,
        "",
    )
    .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert_eq!(a.audited[0]["call"]["kind"]["path"], "/etc/shadow");
}

#[tokio::test]
async fn platform_templates_are_shared_and_owned_by_no_tenant() {
    let h = sec_harness(|_| {});
    let acme = token(&h, "acme", "admin").await;
    let beta_dev = token(&h, "beta", "developer").await;
    // The platform's template is every tenant's to use and list…
    for t in [&acme, &h.admin, &beta_dev] {
        let (s, v, _) = req(&h, "GET", "/v1/templates/tpl-base", Some(t), "").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let (_, v, _) = req(&h, "GET", "/v1/templates", Some(t), "").await;
        assert!(
            v["items"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["id"] == "tpl-base"),
            "{v}"
        );
    }
    // …and no tenant's to delete, the platform tenant `default` included.
    for t in [&acme, &h.admin] {
        let (s, v, _) = req(&h, "DELETE", "/v1/templates/tpl-base", Some(t), "").await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
        assert_eq!(err_code(&v), "forbidden");
    }
    // The default template's id cannot be taken.
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/templates",
        Some(&acme),
        r#"{"id":"tpl-default"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    // A tenant's template is its own: another tenant neither sees nor uses it,
    // and cannot take its id over, even once it is deleted.
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/templates",
        Some(&beta_dev),
        r#"{"id":"tpl-mine"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    for _ in 0..200 {
        let (_, v, _) = req(&h, "GET", "/v1/templates/tpl-mine", Some(&beta_dev), "").await;
        if v["status"] == "ready" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (s, _, _) = req(&h, "GET", "/v1/templates/tpl-mine", Some(&acme), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/sandboxes",
        Some(&acme),
        r#"{"template":"tpl-mine"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (s, v2, _) = req(
        &h,
        "POST",
        "/v1/sandboxes",
        Some(&acme),
        r#"{"template":"tpl-0000000000000000zzzz"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(
        v.to_string()
            .replace("tpl-mine", "tpl-0000000000000000zzzz"),
        v2.to_string()
    );
    let (s, _, _) = req(&h, "DELETE", "/v1/templates/tpl-mine", Some(&beta_dev), "").await;
    assert_eq!(s, StatusCode::OK);
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/templates",
        Some(&acme),
        r#"{"id":"tpl-mine"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
}

#[tokio::test]
async fn rewind_to_another_tenants_snapshot_names_nothing() {
    let h = sec_harness(|_| {});
    let a = token(&h, "acme", "developer").await;
    let b = token(&h, "beta", "developer").await;
    let mine = super::security::create_sb(&h, &a).await;
    let theirs = super::security::create_sb(&h, &b).await;
    let (_, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{theirs}/snapshots"),
        Some(&b),
        "",
    )
    .await;
    let snap = v["id"].as_str().unwrap().to_owned();
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{mine}/rewind"),
        Some(&a),
        json!({ "to": snap }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(!v.to_string().contains(&theirs), "{v}");
    let (s2, v2, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{mine}/rewind"),
        Some(&a),
        r#"{"to":"snap-0000000000000000zzzz"}"#,
    )
    .await;
    assert_eq!(s2, s);
    assert_eq!(
        v.to_string().replace(&snap, "snap-0000000000000000zzzz"),
        v2.to_string()
    );
    // Own snapshot of another own sandbox: refused without naming either owner's other ids.
    let other = super::security::create_sb(&h, &a).await;
    let (_, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{other}/snapshots"),
        Some(&a),
        "",
    )
    .await;
    let own_snap = v["id"].as_str().unwrap().to_owned();
    let (s, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{mine}/rewind"),
        Some(&a),
        json!({ "to": own_snap }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(!v.to_string().contains(&other), "{v}");
}

#[tokio::test]
async fn stats_are_the_tenants_and_metrics_need_a_metrics_token() {
    let h = sec_harness(|_| {});
    let a = token(&h, "acme", "developer").await;
    let b = token(&h, "beta", "developer").await;
    let a_admin = token(&h, "acme", "admin").await;
    super::security::create_sb(&h, &a).await;
    super::security::create_sb(&h, &a).await;
    super::security::create_sb(&h, &b).await;
    let (_, v, _) = req(&h, "GET", "/v1/stats", Some(&a), "").await;
    assert_eq!(v["sandboxes"]["running"], 2, "{v}");
    let (_, v, _) = req(&h, "GET", "/v1/stats", Some(&b), "").await;
    assert_eq!(v["sandboxes"]["running"], 1, "{v}");
    assert_eq!(
        v["api"]["POST /v1/sandboxes"]["count"], 1,
        "only beta's own calls: {v}"
    );
    // /metrics covers every tenant: no token, a tenant's token, a tenant admin → refused.
    let (s, _, _) = req(&h, "GET", "/metrics", None, "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    for t in [&a, &a_admin] {
        let (s, v, _) = req(&h, "GET", "/metrics", Some(t), "").await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    }
    // A metrics token (made by a platform admin only) and the platform admin read it.
    let (s, _, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&a_admin),
        r#"{"role":"metrics"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let m = token(&h, "default", "metrics").await;
    for t in [&m, &h.admin] {
        let (s, v, _) = req(&h, "GET", "/metrics", Some(t), "").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert!(v.as_str().unwrap().contains("strata_sandboxes"), "{v}");
    }
    // …and nothing else.
    let (s, _, _) = req(&h, "GET", "/v1/sandboxes", Some(&m), "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _, _) = req(&h, "GET", "/healthz", None, "").await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn the_ca_route_needs_a_token_and_answers_only_with_tls_on() {
    // TLS off: every role gets 404 not_found, no token 401.
    let h = sec_harness(|_| {});
    for role in ROLES {
        let t = token(&h, "acme", role).await;
        let (s, v, _) = req(&h, "GET", "/v1/ca", Some(&t), "").await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{role}: {v}");
        assert_eq!(err_code(&v), "not_found", "{role}: {v}");
    }
    let (s, _, _) = req(&h, "GET", "/v1/ca", None, "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // TLS on: the CA the daemon keeps, to every role.
    let h = sec_harness(|c| {
        c.e2b.tls_listen = Some("127.0.0.1:1".parse().unwrap());
        crate::tls::LocalCa::open(&c.data_dir).unwrap();
    });
    let want = std::fs::read_to_string(crate::tls::ca_pem_path(h.dir.path())).unwrap();
    for role in ROLES {
        let t = token(&h, "acme", role).await;
        let (s, v, hd) = req(&h, "GET", "/v1/ca", Some(&t), "").await;
        assert_eq!(s, StatusCode::OK, "{role}: {v}");
        assert_eq!(v, Value::String(want.clone()), "{role}");
        assert_eq!(hd["content-type"], "application/x-pem-file");
    }
    let (s, _, _) = req(&h, "GET", "/v1/ca", None, "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}
