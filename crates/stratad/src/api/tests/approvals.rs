//! Approvals through the HTTP API (security review finding 9): one approval
//! runs its call once however many wait or re-send it; it is bound to the
//! whole request (env, cwd, stdin bytes, an upload's bytes) and to the
//! caller that asked; it expires; pending requests are capped per sandbox;
//! held uploads are spooled within bounds and shown to the approver. Real
//! router, service, policy, queue, store and audit; the engine is the
//! double, which counts what ran.

use std::time::Duration;

use super::security::{create_sb, req, sec_harness_on, token, Sec};
use super::*;

const POLICY: &str = r#"
default = "allow"

[[rule]]
id = "curl-needs-human"
effect = "approve"
program = "curl"
reason = "network access"

[[rule]]
id = "app-writes-need-human"
effect = "approve"
kind = "file_write"
path = "/app/**"
reason = "config changes"
"#;

struct Env {
    h: Arc<Sec>,
    engine: Arc<Double>,
    dev: String,
    approver: String,
    sb: String,
}

async fn env(tune: impl FnOnce(&mut Config)) -> Env {
    let engine = Arc::new(Double::default());
    let h = Arc::new(sec_harness_on(tune, engine.clone()));
    let admin = token(&h, "acme", "admin").await;
    let (s, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), POLICY).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let dev = token(&h, "acme", "developer").await;
    let approver = token(&h, "acme", "approver").await;
    let sb = create_sb(&h, &dev).await;
    Env {
        h,
        engine,
        dev,
        approver,
        sb,
    }
}

impl Env {
    fn runs(&self) -> u32 {
        self.engine.execs.load(Ordering::SeqCst)
    }

    async fn exec(&self, tok: &str, q: &str, body: Value) -> (StatusCode, Value) {
        let (s, v, _) = req(
            &self.h,
            "POST",
            &format!("/v1/sandboxes/{}/exec{q}", self.sb),
            Some(tok),
            body.to_string(),
        )
        .await;
        (s, v)
    }

    async fn put(&self, tok: &str, q: &str, data: &'static [u8]) -> (StatusCode, Value) {
        let (s, v, _) = req(
            &self.h,
            "PUT",
            &format!("/v1/sandboxes/{}/files{q}", self.sb),
            Some(tok),
            data,
        )
        .await;
        (s, v)
    }

    async fn answer(&self, ap: &str, verb: &str) -> (StatusCode, Value) {
        let (s, v, _) = req(
            &self.h,
            "POST",
            &format!("/v1/approvals/{ap}/{verb}"),
            Some(&self.approver),
            "",
        )
        .await;
        (s, v)
    }

    async fn approval(&self, ap: &str) -> Value {
        let (s, v, _) = req(
            &self.h,
            "GET",
            &format!("/v1/approvals/{ap}"),
            Some(&self.approver),
            "",
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        v
    }

    async fn pending(&self) -> Vec<Value> {
        let (_, v, _) = req(&self.h, "GET", "/v1/approvals", Some(&self.approver), "").await;
        v["items"].as_array().cloned().unwrap_or_default()
    }

    /// A held call re-sent with `wait=false`: its approval id (202).
    async fn held(&self, tok: &str, body: Value) -> String {
        let (s, v) = self.exec(tok, "?wait=false", body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        v["approval"]["id"].as_str().unwrap().to_owned()
    }
}

fn rule(v: &Value) -> &str {
    v["error"]["rule"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_approval_runs_its_call_once_however_many_wait_or_resubmit() {
    let e = Arc::new(env(|_| {}).await);
    let call = json!({ "cmd": ["curl", "https://example.com"] });
    for round in 0..4 {
        let before = e.runs();
        // The requester waits for the answer …
        let (e2, c2) = (e.clone(), call.clone());
        let waiter = tokio::spawn(async move {
            let tok = e2.dev.clone();
            e2.exec(&tok, "", c2).await
        });
        let mut ap = String::new();
        for _ in 0..500 {
            if let Some(p) = e.pending().await.first() {
                ap = p["id"].as_str().unwrap().to_owned();
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!ap.is_empty(), "round {round}: nothing held");
        // … and re-sends it with the approval's id from several places, as
        // fast as it can, while an approver answers.
        let mut resenders = Vec::new();
        for _ in 0..6 {
            let (e2, c2, ap2) = (e.clone(), call.clone(), ap.clone());
            resenders.push(tokio::spawn(async move {
                let tok = e2.dev.clone();
                loop {
                    let (s, v) = e2.exec(&tok, &format!("?approval={ap2}"), c2.clone()).await;
                    if s == StatusCode::OK {
                        return (s, v);
                    }
                    if e2.approval(&ap2).await["status"]["status"] != "pending" {
                        return (s, v);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (s, v) = e.answer(&ap, "approve").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let mut outcomes = vec![waiter.await.unwrap()];
        for r in resenders {
            outcomes.push(r.await.unwrap());
        }
        let ran = outcomes
            .iter()
            .filter(|(s, _)| *s == StatusCode::OK)
            .count();
        assert_eq!(ran, 1, "round {round}: one approval, one run: {outcomes:?}");
        assert_eq!(
            e.runs() - before,
            1,
            "round {round}: the engine ran it once"
        );
        for (s, v) in outcomes.iter().filter(|(s, _)| *s != StatusCode::OK) {
            assert_eq!(*s, StatusCode::FORBIDDEN, "{v}");
            assert_eq!(code(v), "policy_denied", "{v}");
        }
        let a = e.approval(&ap).await;
        assert!(a["consumed_at"].is_string(), "recorded as used: {a}");
    }
}

#[tokio::test]
async fn an_approval_is_bound_to_the_whole_request_and_its_requester() {
    let e = env(|_| {}).await;
    let other_dev = token(&e.h, "acme", "developer").await;
    // "hello" and "HELLO": the same length, other bytes.
    let approved = json!({
        "cmd": ["curl", "-d", "@-", "https://x.example"],
        "env": {"API_TOKEN": "secret-1"},
        "cwd": "/work",
        "stdin": "aGVsbG8=",
    });
    let ap = e.held(&e.dev, approved.clone()).await;
    // The approver sees what the call carries: env names and value digests,
    // cwd, the stdin's size and SHA-256, and the request digest.
    let a = e.approval(&ap).await;
    let kind = &a["call"]["kind"];
    assert_eq!(kind["cwd"], "/work", "{a}");
    assert!(kind["env"]["API_TOKEN"]
        .as_str()
        .unwrap()
        .starts_with("sha256:"));
    assert_eq!(a["body"]["bytes"], 5, "{a}");
    assert_eq!(
        a["body"]["sha256"], "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        "{a}"
    );
    assert!(a["request_sha256"].as_str().unwrap().starts_with("sha256:"));
    assert!(a["expires_at"].is_string(), "{a}");
    let (s, v) = e.answer(&ap, "approve").await;
    assert_eq!(s, StatusCode::OK, "{v}");

    let changed = |k: &str, val: Value| {
        let mut b = approved.clone();
        b[k] = val;
        b
    };
    for (what, body) in [
        (
            "env value",
            changed("env", json!({"API_TOKEN": "secret-2"})),
        ),
        (
            "extra env",
            changed("env", json!({"API_TOKEN": "secret-1", "X": "1"})),
        ),
        ("cwd", changed("cwd", json!("/"))),
        ("stdin bytes", changed("stdin", json!("SEVMTE8="))),
        ("no stdin", changed("stdin", Value::Null)),
        (
            "argv",
            changed("cmd", json!(["curl", "-d", "@-", "https://y.example"])),
        ),
    ] {
        let (s, v) = e.exec(&e.dev, &format!("?approval={ap}"), body).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{what}: {v}");
        assert_eq!(code(&v), "policy_denied", "{what}: {v}");
        assert_eq!(rule(&v), "approval-mismatch", "{what}: {v}");
        assert_eq!(v["error"]["approval_id"], ap.as_str(), "{what}: {v}");
    }
    // Another developer of the same tenant cannot use it.
    let (s, v) = e
        .exec(&other_dev, &format!("?approval={ap}"), approved.clone())
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(rule(&v), "approval-requester", "{v}");
    assert_eq!(e.runs(), 0, "nothing ran");
    assert!(
        e.approval(&ap).await["consumed_at"].is_null(),
        "nothing used"
    );
    // The very request, by its requester: runs, once.
    let (s, v) = e
        .exec(&e.dev, &format!("?approval={ap}"), approved.clone())
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(e.runs(), 1);
    let (s, v) = e.exec(&e.dev, &format!("?approval={ap}"), approved).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(rule(&v), "approval-used", "{v}");
    assert_eq!(e.runs(), 1);
}

#[tokio::test]
async fn a_held_upload_is_shown_to_the_approver_and_only_its_bytes_are_written() {
    let e = env(|_| {}).await;
    let q = "?path=/app/config.yml&wait=false";
    let (s, v) = e.put(&e.dev, q, b"debug: false\n").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let ap = v["approval"]["id"].as_str().unwrap().to_owned();
    let a = e.approval(&ap).await;
    assert_eq!(a["call"]["kind"]["path"], "/app/config.yml");
    assert_eq!(a["body"]["bytes"], 13, "{a}");
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"debug: false\n"));
    assert_eq!(a["body"]["sha256"], sha.as_str(), "{a}");
    e.answer(&ap, "approve").await;
    // Other bytes under the same approval: refused, nothing written.
    let resend = format!("?path=/app/config.yml&approval={ap}");
    let (s, v) = e.put(&e.dev, &resend, b"debug: true!\n").await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(rule(&v), "approval-mismatch", "{v}");
    // Another path under the same approval: refused.
    let (s, v) = e
        .put(
            &e.dev,
            &format!("?path=/app/other.yml&approval={ap}"),
            b"debug: false\n",
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert!(
        e.engine.uploads.lock().unwrap().is_empty(),
        "nothing written"
    );
    // The approved bytes: written, once.
    let (s, v) = e.put(&e.dev, &resend, b"debug: false\n").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["bytes"], 13);
    assert_eq!(
        *e.engine.uploads.lock().unwrap(),
        vec![("/app/config.yml".to_owned(), b"debug: false\n".to_vec())]
    );
    let (s, _) = e.put(&e.dev, &resend, b"debug: false\n").await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // A waiting upload gets the approval bound to its bytes and writes them.
    let e = Arc::new(e);
    let e2 = e.clone();
    let waiter = tokio::spawn(async move {
        let tok = e2.dev.clone();
        e2.put(&tok, "?path=/app/b.bin", b"0123456789").await
    });
    let mut held = Vec::new();
    for _ in 0..500 {
        held = e.pending().await;
        if !held.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(held[0]["body"]["bytes"], 10, "{held:?}");
    let ap = held[0]["id"].as_str().unwrap().to_owned();
    e.answer(&ap, "approve").await;
    let (s, v) = waiter.await.unwrap();
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(
        e.engine.uploads.lock().unwrap().last().unwrap().1,
        b"0123456789"
    );
    // Nothing is left spooled.
    let spool = e.h.dir.path().join(crate::service::HELD_UPLOADS_DIR);
    assert_eq!(std::fs::read_dir(spool).unwrap().count(), 0);
}

#[tokio::test]
async fn a_held_upload_over_its_bound_is_refused_without_a_request() {
    let e = env(|c| {
        c.security.held_upload_max_bytes = 8;
        c.security.held_uploads_total_bytes = 8;
    })
    .await;
    let (s, v) = e
        .put(&e.dev, "?path=/app/big&wait=false", b"123456789")
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(code(&v), "payload_too_large");
    assert!(e.pending().await.is_empty(), "no approval request was made");
    // Within the bound: held as usual. Uploads the policy allows stream
    // under max_upload_bytes, not this bound.
    let (s, v) = e.put(&e.dev, "?path=/app/ok&wait=false", b"12345678").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let (s, v) = e.put(&e.dev, "?path=/tmp/free", b"123456789").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn approvals_expire_unused_and_pending_requests_time_out_unwatched() {
    let e = env(|c| {
        c.security.approval_ttl = Duration::from_millis(300);
        c.security.approval_pending_ttl = Duration::from_millis(300);
    })
    .await;
    let call = json!({ "cmd": ["curl", "x"] });
    let used_late = e.held(&e.dev, call.clone()).await;
    e.answer(&used_late, "approve").await;
    // Nobody waits for this one (wait=false) and nobody answers it.
    let unanswered = e.held(&e.dev, call.clone()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, v) = e
        .exec(&e.dev, &format!("?approval={used_late}"), call.clone())
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(rule(&v), "approval-expired", "{v}");
    assert_eq!(e.runs(), 0);
    assert!(e.pending().await.is_empty(), "the pending one timed out");
    assert_eq!(
        e.approval(&unanswered).await["status"]["status"],
        "timed_out"
    );
    let (s, v) = e.answer(&unanswered, "approve").await;
    assert_eq!(s, StatusCode::CONFLICT, "too late to answer: {v}");
}

#[tokio::test]
async fn pending_requests_are_capped_per_sandbox() {
    let e = env(|c| c.security.max_pending_approvals_per_sandbox = 2).await;
    let call = json!({ "cmd": ["curl", "x"] });
    let first = e.held(&e.dev, call.clone()).await;
    e.held(&e.dev, call.clone()).await;
    let (s, v) = e.exec(&e.dev, "?wait=false", call.clone()).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(code(&v), "rate_limited", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("at most 2")),
        "{v}"
    );
    // A waiting caller is refused at once too, without a request.
    let (s, _) = e.exec(&e.dev, "", call.clone()).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(e.pending().await.len(), 2, "no row was made");
    // Another sandbox has its own count; an answer makes room.
    let sb2 = create_sb(&e.h, &e.dev).await;
    let (s, v, _) = req(
        &e.h,
        "POST",
        &format!("/v1/sandboxes/{sb2}/exec?wait=false"),
        Some(&e.dev),
        call.to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    e.answer(&first, "deny").await;
    e.held(&e.dev, call).await;
    assert_eq!(e.runs(), 0);
}

/// A held upload counts against the pool-bytes quotas: a tenant whose quota
/// its bytes would pass gets `quota_exceeded` and no approval request.
#[tokio::test]
async fn a_held_upload_over_the_pool_quota_is_refused_without_a_request() {
    let e = env(|c| c.quotas.tenant.pool_bytes = Some(10)).await;
    let (s, v) = e
        .put(&e.dev, "?path=/app/big&wait=false", b"123456789012")
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(code(&v), "quota_exceeded", "{v}");
    assert!(e.pending().await.is_empty(), "no approval request was made");
    let (s, v) = e.put(&e.dev, "?path=/app/ok&wait=false", b"12345678").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
}

/// The console's approvals page: an answer carries the approver's reason,
/// kept in the request's status; a viewer's forged answer is refused and
/// changes nothing; a reason too long or a field unknown is `400` and
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_keeps_its_reason_and_a_viewer_cannot_answer() {
    let e = env(|_| {}).await;
    let ap = e
        .held(&e.dev, json!({ "cmd": ["curl", "https://example.com"] }))
        .await;
    let viewer = token(&e.h, "acme", "viewer").await;
    let post = |tok: String, verb: &'static str, body: Value| {
        let (h, ap) = (e.h.clone(), ap.clone());
        async move {
            let (s, v, _) = req(
                &h,
                "POST",
                &format!("/v1/approvals/{ap}/{verb}"),
                Some(&tok),
                body.to_string(),
            )
            .await;
            (s, v)
        }
    };
    let (s, v) = post(viewer.clone(), "approve", json!({ "reason": "forged" })).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["code"], "forbidden");
    let (s, _) = post(viewer, "deny", json!({})).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let long = "x".repeat(1001);
    let (s, v) = post(e.approver.clone(), "approve", json!({ "reason": long })).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = post(e.approver.clone(), "approve", json!({ "why": "x" })).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(e.approval(&ap).await["status"]["status"], "pending");
    let (s, v) = post(
        e.approver.clone(),
        "approve",
        json!({ "reason": "  checked the URL  " }),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let got = e.approval(&ap).await;
    assert_eq!(got["status"]["status"], "approved", "{got}");
    assert_eq!(got["status"]["reason"], "checked the URL", "{got}");
    // An answer without a body still works (the CLI's) and has no reason.
    let other = e
        .held(&e.dev, json!({ "cmd": ["curl", "https://example.org"] }))
        .await;
    let (s, v) = e.answer(&other, "deny").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let got = e.approval(&other).await;
    assert_eq!(got["status"]["status"], "denied");
    assert!(got["status"].get("reason").is_none(), "{got}");
}
