//! E2B envd access tokens (security review findings 18 and 19): random,
//! stored with the credential that obtained them, re-issued on `connect`,
//! refused as soon as that credential is revoked; a sandbox made before
//! tokens were stored keeps its legacy HMAC token; `/health` tells nobody
//! without a token whether a sandbox exists; an out-of-range `timeout`
//! changes nothing. Over a real stratad `App` (SQLite store, security
//! tables, audit log) with the engine double of `tests/common` (no VM).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{door, legacy_envd_token, Door, Raw, KEY};
use serde_json::{json, Value};

const STAT: &str = "/filesystem.Filesystem/Stat";

impl Door {
    /// An envd unary call on sandbox `id` with access token `token`.
    async fn stat(&self, id: &str, token: &str) -> Raw {
        let rq = self
            .http
            .post(format!("{}{STAT}", self.url))
            .header("E2b-Sandbox-Id", id)
            .header("X-Access-Token", token)
            .header("content-type", "application/json")
            .body(json!({"path": "/etc"}).to_string());
        self.send(rq, false).await
    }

    /// `GET /health` for sandbox `id`, with `token` if any.
    async fn health(&self, id: &str, token: Option<&str>) -> Raw {
        let mut rq = self
            .http
            .get(format!("{}/health", self.url))
            .header("E2b-Sandbox-Id", id);
        if let Some(t) = token {
            rq = rq.header("X-Access-Token", t);
        }
        self.send(rq, false).await
    }

    /// A sandbox created through the door with `key`: its id and the envd
    /// access token the create answered.
    async fn create_with_token(&self, key: &str) -> (String, String) {
        let r = self
            .control(
                "POST",
                "/v2/sandboxes",
                Some(key),
                r#"{"templateID":"base","timeout":300}"#,
            )
            .await;
        assert_eq!(r.status, 201, "create: {}", r.text());
        let v = r.json();
        (
            v["sandboxID"].as_str().unwrap().to_owned(),
            v["envdAccessToken"].as_str().unwrap().to_owned(),
        )
    }

    /// `POST /sandboxes/{id}/connect` with `key`: the envd access token.
    async fn connect(&self, id: &str, key: &str) -> String {
        let r = self
            .control(
                "POST",
                &format!("/sandboxes/{id}/connect"),
                Some(key),
                r#"{"timeout":300}"#,
            )
            .await;
        assert!(r.status == 200 || r.status == 201, "connect: {}", r.text());
        r.json()["envdAccessToken"].as_str().unwrap().to_owned()
    }
}

/// The actor of the last audit entry.
fn last_actor(d: &Door) -> String {
    let n = d.audit_len();
    d.audit_since(n - 1)[0]["actor"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

#[tokio::test]
async fn a_revoked_strata_tokens_envd_tokens_are_refused_at_once() {
    let d = door().await;
    let (dev, dev_id) = d.token("developer", "default").await;
    let (id, token) = d.create_with_token(&dev).await;
    // Random and stored: not the legacy HMAC of the id.
    assert!(token.starts_with("v2.") && token != legacy_envd_token(&id));
    let r = d.stat(&id, &token).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_actor(&d), format!("token:{dev_id}"));
    assert_eq!(d.health(&id, Some(&token)).await.status, 204);

    // A second token (another developer's connect) survives the first's
    // revocation: each token is tied to the credential that obtained it.
    let (other, other_id) = d.token("developer", "default").await;
    let token2 = d.connect(&id, &other).await;
    assert_ne!(token2, token);

    d.v1("DELETE", &format!("/v1/tokens/{dev_id}"), Value::Null)
        .await;
    let r = d.stat(&id, &token).await;
    assert_eq!(
        (r.status, r.json()["code"].as_str()),
        (401, Some("unauthenticated")),
        "{}",
        r.text()
    );
    assert!(r.text().contains("revoked"), "{}", r.text());
    assert_eq!(d.health(&id, Some(&token)).await.status, 502);
    let r = d.stat(&id, &token2).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_actor(&d), format!("token:{other_id}"));
}

#[tokio::test]
async fn connect_issues_a_token_that_works_and_the_sandbox_takes_only_its_own() {
    let d = door().await;
    let (id, created) = d.create_with_token(KEY).await;
    let (dev, dev_id) = d.token("developer", "default").await;
    let connected = d.connect(&id, &dev).await;
    assert!(connected.starts_with("v2.") && connected != created);
    let r = d.stat(&id, &connected).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_actor(&d), format!("token:{dev_id}"));
    // The creator's token holds too, as its own caller.
    let r = d.stat(&id, &created).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_actor(&d), "e2b-api-key");
    // The same credential connecting again gets the same token (clients
    // sharing one key keep working side by side).
    assert_eq!(d.connect(&id, &dev).await, connected);
    // Neither the legacy HMAC token of a sandbox with stored tokens, nor a
    // token of another sandbox, nor a forged one is taken.
    let (other, other_token) = d.create_with_token(KEY).await;
    let forged = format!("v2.{}.{}", "1".repeat(64), "0".repeat(64));
    for bad in [legacy_envd_token(&id), other_token.clone(), forged] {
        let r = d.stat(&id, &bad).await;
        assert_eq!(r.status, 401, "{bad}: {}", r.text());
    }
    assert_eq!(d.stat(&other, &other_token).await.status, 200);
    // Deleted with the sandbox: its tokens are gone with it.
    let r = d
        .control("DELETE", &format!("/sandboxes/{id}"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_ne!(d.stat(&id, &created).await.status, 200);
    let store = d.app.security().unwrap().store();
    assert!(store.envd_tokens_of(&id).unwrap().is_empty());
    assert_eq!(store.envd_tokens_of(&other).unwrap().len(), 1);
}

#[tokio::test]
async fn a_legacy_sandbox_keeps_its_hmac_token_until_a_token_is_issued() {
    let d = door().await;
    // Made through /v1: the door never issued a token for it, as for a
    // sandbox made before tokens were stored.
    let id = d.v1_sandbox("default").await;
    let legacy = legacy_envd_token(&id);
    let r = d.stat(&id, &legacy).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(last_actor(&d), "e2b-envd");
    assert_eq!(d.health(&id, Some(&legacy)).await.status, 204);
    // A forged one (another secret, a wrong id) is refused.
    let forged = [
        strata_e2b::auth::envd_token(b"not-the-door-secret-not-the-door", &id),
        legacy_envd_token("sbx-someone-else"),
        "0".repeat(64),
    ];
    for bad in &forged {
        let r = d.stat(&id, bad).await;
        assert_eq!(r.status, 401, "{bad}: {}", r.text());
    }
    // Once a token is issued for it (a connect), the legacy one is done.
    let fresh = d.connect(&id, KEY).await;
    assert_eq!(d.stat(&id, &fresh).await.status, 200);
    assert_eq!(d.stat(&id, &legacy).await.status, 401);
}

#[tokio::test]
async fn health_tells_nothing_without_the_sandbox_token() {
    let d = door().await;
    let (up, token) = d.create_with_token(KEY).await;
    let (gone, gone_token) = d.create_with_token(KEY).await;
    let r = d
        .control("DELETE", &format!("/sandboxes/{gone}"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 204);
    let unknown = "sbx-doesnotexist0000";
    let masked = |r: &Raw, id: &str| (r.status, r.text().replace(id, "ID"));
    let want = masked(&d.health(unknown, None).await, unknown);
    assert_eq!(want.0, 502);
    let (_, other_token) = d.create_with_token(KEY).await;
    // Running, deleted, unknown: without its token (none, a wrong one, the
    // legacy HMAC, another sandbox's) every answer is the same bytes.
    for (id, t) in [
        (up.as_str(), None),
        (up.as_str(), Some("0".repeat(64))),
        (up.as_str(), Some(legacy_envd_token(&up))),
        (up.as_str(), Some(other_token.clone())),
        (gone.as_str(), None),
        (gone.as_str(), Some(gone_token.clone())),
        (unknown, Some(token.clone())),
    ] {
        let r = d.health(id, t.as_deref()).await;
        assert_eq!(masked(&r, id), want, "{id} {t:?}");
    }
    assert_eq!(d.health(&up, Some(&token)).await.status, 204);
}

#[tokio::test]
async fn a_timeout_beyond_the_calendar_is_refused_and_the_sandbox_still_lists() {
    let d = door().await;
    let (id, _) = d.create_with_token(KEY).await;
    for body in [
        r#"{"timeout": 10000000000000}"#,
        r#"{"timeout": 18446744073709551615}"#,
    ] {
        let r = d
            .control("POST", &format!("/sandboxes/{id}/timeout"), Some(KEY), body)
            .await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let r = d
            .control("POST", &format!("/sandboxes/{id}/connect"), Some(KEY), body)
            .await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let r = d
            .control(
                "POST",
                "/v2/sandboxes",
                Some(KEY),
                &body.replace('}', r#","templateID":"base"}"#),
            )
            .await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
    }
    // Nothing changed: it lists and reads with its old end.
    for path in ["/v2/sandboxes", "/sandboxes"] {
        let r = d.control("GET", path, Some(KEY), "").await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.text().contains(&id), "{}", r.text());
    }
    let r = d
        .control("GET", &format!("/sandboxes/{id}"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let end = chrono::DateTime::parse_from_rfc3339(r.json()["endAt"].as_str().unwrap()).unwrap();
    assert!(
        end < chrono::Utc::now() + chrono::TimeDelta::hours(1),
        "{end}"
    );
}
