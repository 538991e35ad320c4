//! Connector secrets over the API (`docs/secrets.md`): write-only values,
//! admin only, tenant-scoped, stable refusals for bad rules, sealed at rest,
//! and the policy dry-run naming the secret an allowed request would carry.

use super::security::{req, sec_harness, token};
use super::*;

const POLICY: &str = r#"
default = "allow"

[[connector]]
name = "salesforce"
hosts = ["api.salesforce.test"]

[[connector]]
name = "pinned"
hosts = ["pinned.test"]
secrets = ["only-this"]
"#;

const VALUE: &str = "sk-live-0123456789abcdef-NEVER-SHOWN";

#[tokio::test]
async fn secrets_are_write_only_admin_only_tenant_scoped_and_sealed() {
    let h = sec_harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let other = token(&h, "globex", "admin").await;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), POLICY).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let body = json!({
        "name": "sf-token", "connector": "salesforce",
        "rule": { "type": "bearer" }, "value": VALUE,
    })
    .to_string();
    // A developer may not write one.
    let (s, v, _) = req(&h, "POST", "/v1/secrets", Some(&dev), body.clone()).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let (s, v, _) = req(&h, "POST", "/v1/secrets", Some(&admin), body.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(!v.to_string().contains(VALUE), "{v}");
    assert_eq!(v["kind"], "static");
    assert_eq!(v["rule"]["type"], "bearer");
    let created = v["created_at"].clone();
    // Rotation by writing again keeps the creation time.
    let (s, v, _) = req(&h, "POST", "/v1/secrets", Some(&admin), body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["created_at"], created);
    let (s, list, _) = req(&h, "GET", "/v1/secrets", Some(&admin), "").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list["items"][0]["name"], "sf-token");
    assert_eq!(list["items"][0]["connector"], "salesforce");
    assert!(!list.to_string().contains(VALUE));
    let (s, _, _) = req(&h, "GET", "/v1/secrets", Some(&dev), "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // Another tenant sees none and cannot delete it.
    let (_, list, _) = req(&h, "GET", "/v1/secrets", Some(&other), "").await;
    assert_eq!(list["items"], json!([]));
    let (s, v, _) = req(&h, "DELETE", "/v1/secrets/sf-token", Some(&other), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "not_found");
    // The value is sealed in the database file (and its WAL).
    for f in ["strata.db", "strata.db-wal"] {
        let db = std::fs::read(h.dir.path().join(f)).unwrap_or_default();
        assert!(
            !db.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
            "{f} holds the value"
        );
    }
    // The dry run names the secret an allowed request would carry.
    let (s, d, _) = req(
        &h,
        "POST",
        "/v1/policy/test",
        Some(&admin),
        json!({ "call": { "kind": "egress", "host": "api.salesforce.test", "port": 443,
            "method": "GET", "path": "/x", "scheme": "https", "tls": true } })
        .to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{d}");
    assert_eq!(d["secret"], "sf-token", "{d}");
    // A connector listing only other names gets none of this one.
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/secrets",
        Some(&admin),
        json!({ "name": "not-listed", "connector": "pinned", "rule": { "type": "bearer" }, "value": "v" })
            .to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (_, c, _) = req(&h, "GET", "/v1/connectors", Some(&dev), "").await;
    let items = c["items"].as_array().cloned().unwrap_or_default();
    let sf = items.iter().find(|i| i["name"] == "salesforce").unwrap();
    assert_eq!(sf["secrets"], json!(["sf-token"]), "{c}");
    assert_eq!(sf["hosts"], json!(["api.salesforce.test"]));
    let pinned = items.iter().find(|i| i["name"] == "pinned").unwrap();
    assert_eq!(pinned["secrets"], json!([]), "{c}");
    assert_eq!(pinned["secrets_allowed"], json!(["only-this"]), "{c}");

    let (s, _, _) = req(&h, "DELETE", "/v1/secrets/sf-token", Some(&admin), "").await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, _) = req(&h, "DELETE", "/v1/secrets/sf-token", Some(&admin), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_secrets_are_refused_with_a_stable_code_and_change_nothing() {
    let h = sec_harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    let (s, _, _) = req(&h, "PUT", "/v1/policy", Some(&admin), POLICY).await;
    assert_eq!(s, StatusCode::OK);
    for bad in [
        json!({ "name": "x", "connector": "nope", "rule": { "type": "bearer" }, "value": "v" }),
        json!({ "name": "bad/name", "connector": "salesforce", "rule": { "type": "bearer" }, "value": "v" }),
        json!({ "name": "x", "connector": "salesforce", "rule": { "type": "header", "name": "Host" }, "value": "v" }),
        json!({ "name": "x", "connector": "salesforce", "rule": { "type": "header", "name": "X-K", "template": "no placeholder" }, "value": "v" }),
        json!({ "name": "x", "connector": "salesforce", "rule": { "type": "query", "param": "a&b" }, "value": "v" }),
        json!({ "name": "x", "connector": "salesforce", "rule": { "type": "bearer" } }),
        json!({ "name": "x", "connector": "salesforce", "rule": { "type": "bearer" }, "value": "a\nb" }),
        json!({ "name": "x", "connector": "salesforce", "value": "v" }),
        json!({ "name": "x", "connector": "salesforce", "kind": "oauth2", "oauth2": {
            "token_url": "http://login.example.com/token", "client_id": "c", "refresh_token": "r" } }),
        json!({ "name": "x", "connector": "salesforce", "kind": "oauth2", "oauth2": {
            "token_url": "https://127.0.0.1/token", "client_id": "c", "refresh_token": "r" } }),
    ] {
        let (s, v, _) = req(&h, "POST", "/v1/secrets", Some(&admin), bad.to_string()).await;
        assert!(
            s == StatusCode::BAD_REQUEST || s == StatusCode::UNPROCESSABLE_ENTITY,
            "{bad}: {s} {v}"
        );
        if s == StatusCode::BAD_REQUEST {
            assert_eq!(v["error"]["code"], "invalid_request", "{bad}: {v}");
        }
    }
    let (_, list, _) = req(&h, "GET", "/v1/secrets", Some(&admin), "").await;
    assert_eq!(list["items"], json!([]));
}
