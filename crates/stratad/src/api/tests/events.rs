//! The event stream and webhooks through the HTTP API (issue 16): a
//! create's transitions arrive live; a resume with `Last-Event-ID` gets
//! exactly the missed entries; an approval asked and answered, a policy
//! refusal and a time-out arrive with their documented fields; another
//! tenant sees nothing; an unread stream is cut off with a bounded
//! buffer; webhooks are signed, retried,
//! carry the approval, go only to public addresses and survive a restart.
//! Real router, service, store, policy, queue and audit; the engine is the
//! double. The webhook receiver is a local axum server.

use std::sync::Mutex;
use std::time::Duration;

use axum::body::Body as AxBody;
use axum::http::HeaderMap;
use axum::response::Response;

use super::security::{create_sb, req, sec_harness, token, Sec};
use super::*;
use crate::store::{JournalKind, JournalNote};

const HELD: &str = r#"
default = "allow"

[[rule]]
id = "curl-needs-human"
effect = "approve"
program = "curl"
reason = "network access"
"#;

/// Opens an event stream (`Accept: text/event-stream`).
async fn open(h: &Sec, uri: &str, tok: &str, last: Option<i64>) -> Response {
    let mut b = Request::builder()
        .method("GET")
        .uri(uri)
        .header("authorization", format!("Bearer {tok}"))
        .header("accept", "text/event-stream");
    if let Some(l) = last {
        b = b.header("last-event-id", l.to_string());
    }
    h.app
        .router()
        .oneshot(b.body(AxBody::empty()).unwrap())
        .await
        .unwrap()
}

/// One message of a stream.
#[derive(Debug, Clone)]
struct Msg {
    id: i64,
    event: String,
    data: Value,
}

/// Reads a stream's messages.
struct Reader {
    body: AxBody,
    buf: String,
}

impl Reader {
    fn new(resp: Response) -> Self {
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(
            resp.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        Reader {
            body: resp.into_body(),
            buf: String::new(),
        }
    }

    /// The next message within `t` (`None`: none came, or the stream ended).
    async fn next(&mut self, t: Duration) -> Option<Msg> {
        let deadline = tokio::time::Instant::now() + t;
        loop {
            while let Some(i) = self.buf.find("\n\n") {
                let block: String = self.buf.drain(..i + 2).collect();
                let (mut id, mut event, mut data) = (None, String::new(), None);
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = Some(v.trim().parse().unwrap());
                    } else if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim().to_owned();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        assert!(data.is_none(), "one data line per message: {block}");
                        data = Some(serde_json::from_str(v.trim()).unwrap());
                    }
                }
                if let (Some(id), Some(data)) = (id, data) {
                    return Some(Msg { id, event, data });
                }
                // A heartbeat comment.
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, self.body.frame()).await {
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(std::str::from_utf8(&d).unwrap());
                    }
                }
                _ => return None,
            }
        }
    }

    /// Messages until one satisfies `done` (panics after 10 s).
    async fn until(&mut self, done: impl Fn(&Msg) -> bool) -> Vec<Msg> {
        let mut out = Vec::new();
        loop {
            let m = self
                .next(Duration::from_secs(10))
                .await
                .unwrap_or_else(|| panic!("stream ended or idle; got {out:?}"));
            let stop = done(&m);
            out.push(m);
            if stop {
                return out;
            }
        }
    }
}

fn harness(tune: impl FnOnce(&mut Config)) -> Sec {
    sec_harness(|c| {
        c.webhooks.retry_base = Duration::from_millis(50);
        c.webhooks.retry_max = Duration::from_millis(200);
        tune(c)
    })
}

#[tokio::test]
async fn the_stream_shows_a_create_live_and_a_resume_gets_exactly_the_missed_entries() {
    let h = harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let viewer = token(&h, "acme", "viewer").await;
    let mut s = Reader::new(open(&h, "/v1/events", &viewer, None).await);
    let sb = create_sb(&h, &dev).await;
    let got = s
        .until(|m| {
            m.event == "sandbox" && m.data["to_state"] == "running" && m.data["phase"] == "done"
        })
        .await;
    let last = got.last().unwrap();
    for k in [
        "seq",
        "at",
        "kind",
        "sandbox_id",
        "op",
        "from_state",
        "to_state",
        "phase",
    ] {
        assert!(last.data.get(k).is_some(), "{k} missing: {}", last.data);
    }
    assert_eq!(last.data["sandbox_id"], sb);
    assert_eq!(last.data["seq"], last.id);
    assert_eq!(last.data["kind"], "sandbox");
    let seen = last.id;
    drop(s);
    // Missed while away: a snapshot (its transition and `taken`).
    let (st, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{sb}/snapshots"),
        Some(&dev),
        "",
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let snap = v["id"].as_str().unwrap().to_owned();
    let want: Vec<i64> = h
        .app
        .service()
        .store_handle()
        .journal_after("acme", None, seen, 100)
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert!(want.len() >= 3, "{want:?}");
    let mut r = Reader::new(open(&h, "/v1/events?after=0", &viewer, Some(seen)).await);
    let mut ids = Vec::new();
    while let Some(m) = r.next(Duration::from_millis(500)).await {
        if m.event == "snapshot" {
            assert_eq!(m.data["action"], "taken");
            assert_eq!(m.data["snapshot_id"], snap.as_str());
            assert_eq!(m.data["sandbox_id"], sb);
        }
        ids.push(m.id);
    }
    assert_eq!(ids, want, "exactly the missed entries, in order, once");
    // One sandbox's stream: the same entries of that sandbox.
    let mut one = Reader::new(
        open(
            &h,
            &format!("/v1/sandboxes/{sb}/events?after={seen}"),
            &viewer,
            None,
        )
        .await,
    );
    let first = one.next(Duration::from_secs(5)).await.unwrap();
    assert_eq!(first.id, want[0]);
    // Without the Accept header the sandbox's events stay a JSON list.
    let (st, v, _) = req(
        &h,
        "GET",
        &format!("/v1/sandboxes/{sb}/events"),
        Some(&viewer),
        "",
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert!(v["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e.get("op").is_some()));
}

#[tokio::test]
async fn another_tenant_sees_nothing_of_a_tenants_journal() {
    let h = harness(|_| {});
    let dev = token(&h, "acme", "developer").await;
    let beta = token(&h, "beta", "admin").await;
    let mut theirs = Reader::new(open(&h, "/v1/events", &beta, None).await);
    let sb = create_sb(&h, &dev).await;
    // Acme's sandbox is in acme's journal…
    assert!(!h
        .app
        .service()
        .store_handle()
        .journal_after("acme", None, 0, 100)
        .unwrap()
        .is_empty());
    // …and nowhere in beta's stream.
    let saw = theirs.next(Duration::from_millis(500)).await;
    assert!(saw.is_none(), "beta saw {saw:?}");
    // Beta's token on acme's sandbox stream: as an unknown sandbox.
    let resp = open(&h, &format!("/v1/sandboxes/{sb}/events"), &beta, None).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let unknown = open(
        &h,
        "/v1/sandboxes/sb-0000000000000000zzzz/events",
        &beta,
        None,
    )
    .await;
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn an_unread_stream_is_disconnected_with_a_bounded_buffer_and_streams_are_capped() {
    let h = harness(|c| {
        c.events.buffer = 4;
        c.events.slow_consumer_timeout = Duration::from_millis(200);
        c.events.max_streams_per_tenant = 1;
    });
    let viewer = token(&h, "acme", "viewer").await;
    let resp = open(&h, "/v1/events", &viewer, None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    // One stream per tenant here: a second is refused.
    let second = open(&h, "/v1/events", &viewer, None).await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let store = h.app.service().store_handle().clone();
    tokio::task::spawn_blocking(move || {
        for i in 0..500 {
            store
                .append_journal(&JournalNote {
                    at: Utc::now(),
                    tenant: "acme".into(),
                    sandbox_id: format!("sb-{i}"),
                    kind: JournalKind::Policy,
                    topic: "policy".into(),
                    data: json!({ "decision": "denied", "summary": "x".repeat(1000) }),
                })
                .unwrap();
        }
    })
    .await
    .unwrap();
    // Nobody reads: the producer gives up and frees the tenant's place.
    let svc = h.app.service().clone();
    let mut freed = false;
    for _ in 0..100 {
        if svc.event_streams().open_streams("acme") == 0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "an unread stream must be disconnected");
    // What was held for it is the buffer, then the stream ends.
    let mut r = Reader::new(resp);
    let mut n = 0;
    while r.next(Duration::from_secs(2)).await.is_some() {
        n += 1;
    }
    assert!(n <= 5, "{n} messages were buffered for an unread stream");
    let again = open(&h, "/v1/events", &viewer, None).await;
    assert_eq!(again.status(), StatusCode::OK);
}

/// What the local receiver got: headers and body of each request.
#[derive(Default)]
struct Got {
    reqs: Mutex<Vec<(HeaderMap, Vec<u8>)>>,
}

/// A local webhook receiver answering 500 to the first `fail` requests.
async fn receiver(fail: usize) -> (std::net::SocketAddr, Arc<Got>) {
    let got = Arc::new(Got::default());
    let g = got.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: bytes::Bytes| {
            let g = g.clone();
            async move {
                let mut v = g.reqs.lock().unwrap();
                v.push((headers, body.to_vec()));
                if v.len() <= fail {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::OK
                }
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, got)
}

/// Checks `Strata-Signature` over `body` with `secret` (as docs/events.md says).
fn verify(secret: &str, headers: &HeaderMap, body: &[u8]) {
    let sig = headers["strata-signature"].to_str().unwrap();
    let (t, v1) = sig.split_once(',').unwrap();
    let t = t.strip_prefix("t=").unwrap();
    let v1 = v1.strip_prefix("v1=").unwrap();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(body);
    ring::hmac::verify(&key, &msg, &hex::decode(v1).unwrap()).expect("signature verifies");
    let age = Utc::now().timestamp() - t.parse::<i64>().unwrap();
    assert!((0..60).contains(&age), "timestamp {t}");
}

async fn wait_for(got: &Got, n: usize) {
    for _ in 0..200 {
        if got.reqs.lock().unwrap().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "the receiver got {} requests, not {n}",
        got.reqs.lock().unwrap().len()
    );
}

async fn add_hook(h: &Sec, tok: &str, body: Value) -> (StatusCode, Value) {
    let (s, v, _) = req(h, "POST", "/v1/webhooks", Some(tok), body.to_string()).await;
    (s, v)
}

/// A held exec of `argv` in a new sandbox of acme: the approval id.
async fn held(h: &Sec, dev: &str, argv: &[&str]) -> (String, String) {
    let sb = create_sb(h, dev).await;
    let (s, v, _) = req(
        h,
        "POST",
        &format!("/v1/sandboxes/{sb}/exec?wait=false"),
        Some(dev),
        json!({ "cmd": argv }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    (sb, v["approval"]["id"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_webhook_is_signed_retried_and_carries_the_approval() {
    let h = harness(|c| {
        c.webhooks.allow_private = vec!["127.0.0.1".into()];
        c.console.base_url = Some("https://console.example/".into());
    });
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    h.app.service().spawn_webhook_worker(stop);
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let (st, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), HELD).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (addr, got) = receiver(2).await;
    let (s, hook) = add_hook(&h, &admin, json!({ "url": format!("http://{addr}/hook") })).await;
    assert_eq!(s, StatusCode::CREATED, "{hook}");
    let secret = hook["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("whsec_"));
    assert_eq!(hook["events"], json!(["approval.requested"]));
    // The secret is shown once: never listed, and stored sealed.
    let (_, list, _) = req(&h, "GET", "/v1/webhooks", Some(&admin), "").await;
    assert!(!list.to_string().contains(&secret));
    let db = std::fs::read(h.dir.path().join("strata.db")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&db).contains(&secret));
    // A developer may not make one.
    let (s, _) = add_hook(&h, &dev, json!({ "url": format!("http://{addr}/hook") })).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    let (sb, apr) = held(&h, &dev, &["curl", "https://x.example/?a=\"<b>\""]).await;
    wait_for(&got, 3).await;
    let reqs = got.reqs.lock().unwrap().clone();
    for (headers, body) in &reqs {
        verify(&secret, headers, body);
        assert_eq!(headers["strata-event"], "approval.requested");
    }
    // The same delivery each time, the third one answered 200.
    assert_eq!(reqs[0].1, reqs[2].1);
    let p: Value = serde_json::from_slice(&reqs[2].1).unwrap();
    assert_eq!(p["type"], "approval.requested");
    let a = &p["approval"];
    assert_eq!(a["id"], apr.as_str());
    assert_eq!(a["sandbox_id"], sb.as_str());
    assert_eq!(a["tool"], "exec");
    assert_eq!(a["summary"], "exec curl https://x.example/?a=\"<b>\"");
    assert_eq!(a["call"]["argv"][1], "https://x.example/?a=\"<b>\"");
    assert!(a["requested_by"]
        .as_str()
        .unwrap()
        .starts_with("token:tok-"));
    assert!(a["expires_at"].is_string());
    assert_eq!(
        a["url"],
        format!("https://console.example/console/#/approvals/{apr}")
    );
    let id = hook["id"].as_str().unwrap();
    let mut delivered = Value::Null;
    for _ in 0..100 {
        let (_, d, _) = req(
            &h,
            "GET",
            &format!("/v1/webhooks/{id}/deliveries"),
            Some(&admin),
            "",
        )
        .await;
        if d["items"][0]["status"] == "delivered" {
            delivered = d["items"][0].clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(delivered["attempts"], 3, "{delivered}");
    assert_eq!(delivered["last_status"], 200);

    // The Slack format: `text` and `blocks`, guest strings escaped.
    let (addr2, got2) = receiver(0).await;
    let (s, slack) = add_hook(
        &h,
        &admin,
        json!({ "url": format!("http://{addr2}/hook"), "format": "slack" }),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{slack}");
    let (_, apr2) = held(&h, &dev, &["curl", "<img src=x onerror=alert(1)>"]).await;
    wait_for(&got2, 1).await;
    let (headers, body) = got2.reqs.lock().unwrap()[0].clone();
    verify(slack["secret"].as_str().unwrap(), &headers, &body);
    let m: Value = serde_json::from_slice(&body).unwrap();
    let text = m["text"].as_str().unwrap();
    assert!(
        text.contains("&lt;img src=x onerror=alert(1)&gt;"),
        "{text}"
    );
    assert!(!text.contains("<img"), "{text}");
    assert!(
        text.contains(&format!("/console/#/approvals/{apr2}")),
        "{text}"
    );
    assert_eq!(m["blocks"][0]["type"], "section");
    assert_eq!(
        m["blocks"][1]["elements"][0]["url"],
        format!("https://console.example/console/#/approvals/{apr2}")
    );
    // Deleted: no more deliveries.
    let (s, _, _) = req(
        &h,
        "DELETE",
        &format!("/v1/webhooks/{id}"),
        Some(&admin),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, _) = req(
        &h,
        "GET",
        &format!("/v1/webhooks/{id}/deliveries"),
        Some(&admin),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let _ = stop_tx.send(true);
}

#[tokio::test]
async fn a_webhook_to_a_private_address_is_refused_at_creation_and_at_delivery() {
    let h = harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    for url in [
        "http://10.0.0.1/hook",
        "http://127.0.0.1:9/hook",
        "http://169.254.169.254/latest",
        "http://[::1]/hook",
        "http://localhost:9/hook",
        "ftp://example.com/x",
    ] {
        let (s, v) = add_hook(&h, &admin, json!({ "url": url })).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{url}: {v}");
        assert_eq!(v["error"]["code"], "invalid_request", "{url}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("webhook target refused"),
            "{v}"
        );
    }
    let (_, list, _) = req(&h, "GET", "/v1/webhooks", Some(&admin), "").await;
    assert_eq!(list["items"], json!([]));

    // Made while the address passed; the address no longer passes when it
    // is delivered (DNS changed; here the allowlist is gone): refused then.
    let (addr, got) = receiver(0).await;
    let cfg = {
        let mut c = (**h.app.service().config()).clone();
        c.webhooks.allow_private = vec!["127.0.0.1".into()];
        c
    };
    let allowed = App::new(
        cfg.clone(),
        Arc::new(SqliteStore::open(&cfg.db_path(), 2).unwrap()),
        Arc::new(Double::default()),
        Arc::new(SystemClock),
    );
    let (s, hook, _) = req_on(
        &allowed,
        "POST",
        "/v1/webhooks",
        &admin,
        json!({ "url": format!("http://{addr}/hook"), "events": ["*"] }).to_string(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{hook}");
    drop(allowed);
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    h.app.service().spawn_webhook_worker(stop);
    let dev = token(&h, "acme", "developer").await;
    create_sb(&h, &dev).await;
    let (st, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), HELD).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    held(&h, &dev, &["curl", "x"]).await;
    let id = hook["id"].as_str().unwrap();
    let mut last = Value::Null;
    for _ in 0..100 {
        let (_, d, _) = req(
            &h,
            "GET",
            &format!("/v1/webhooks/{id}/deliveries"),
            Some(&admin),
            "",
        )
        .await;
        if d["items"][0]["attempts"].as_u64().unwrap_or(0) >= 1 {
            last = d["items"][0].clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        last["last_error"]
            .as_str()
            .unwrap_or("")
            .contains("webhook target refused"),
        "{last}"
    );
    assert_ne!(last["status"], "delivered");
    assert!(
        got.reqs.lock().unwrap().is_empty(),
        "nothing reached the private address"
    );
    let _ = stop_tx.send(true);
}

async fn req_on(
    app: &App,
    method: &str,
    uri: &str,
    tok: &str,
    body: String,
) -> (StatusCode, Value, HeaderMap) {
    let resp = app
        .router()
        .oneshot(
            Request::builder()
                .method(method)
                .uri(uri)
                .header("authorization", format!("Bearer {tok}"))
                .body(AxBody::from(body))
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        headers,
    )
}

#[tokio::test]
async fn a_queued_delivery_survives_a_daemon_restart() {
    let h = harness(|c| c.webhooks.allow_private = vec!["127.0.0.1".into()]);
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let (st, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), HELD).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (addr, got) = receiver(0).await;
    let (s, hook) = add_hook(&h, &admin, json!({ "url": format!("http://{addr}/hook") })).await;
    assert_eq!(s, StatusCode::CREATED, "{hook}");
    // No worker runs in this daemon: the delivery waits in the store.
    let (_, apr) = held(&h, &dev, &["curl", "x"]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(got.reqs.lock().unwrap().is_empty());
    let cfg = (**h.app.service().config()).clone();
    let Sec { app, dir, .. } = h;
    drop(app);
    // The next daemon over the same data dir delivers it.
    let next = App::new(
        cfg.clone(),
        Arc::new(SqliteStore::open(&cfg.db_path(), 2).unwrap()),
        Arc::new(Double::default()),
        Arc::new(SystemClock),
    );
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    next.service().spawn_webhook_worker(stop);
    wait_for(&got, 1).await;
    let (headers, body) = got.reqs.lock().unwrap()[0].clone();
    verify(hook["secret"].as_str().unwrap(), &headers, &body);
    let p: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(p["approval"]["id"], apr.as_str());
    let _ = stop_tx.send(true);
    drop(dir);
}

#[tokio::test]
async fn approvals_asked_and_answered_refusals_and_time_outs_are_on_the_stream() {
    let h = harness(|_| {});
    let admin = token(&h, "acme", "admin").await;
    let dev = token(&h, "acme", "developer").await;
    let approver = token(&h, "acme", "approver").await;
    let viewer = token(&h, "acme", "viewer").await;
    let policy = format!(
        "{HELD}\n[[rule]]\nid = \"no-wget\"\neffect = \"deny\"\nprogram = \"wget\"\nreason = \"no downloads\"\n"
    );
    let (st, v, _) = req(&h, "PUT", "/v1/policy", Some(&admin), policy).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let mut s = Reader::new(open(&h, "/v1/events", &viewer, None).await);

    // Held: `approval` `requested`, with what is asked and who asked.
    let (sb, apr) = held(&h, &dev, &["curl", "https://x.example/<b>"]).await;
    let got = s
        .until(|m| m.event == "approval" && m.data["approval_id"] == apr.as_str())
        .await;
    let m = &got.last().unwrap().data;
    assert_eq!(m["kind"], "approval");
    assert_eq!(m["action"], "requested");
    assert_eq!(m["sandbox_id"], sb.as_str());
    assert_eq!(m["tool"], "exec");
    assert_eq!(m["summary"], "exec curl https://x.example/<b>");
    assert_eq!(m["call"]["argv"], json!(["curl", "https://x.example/<b>"]));
    assert_eq!(m["rule"], "curl-needs-human");
    assert_eq!(m["reason"], "network access");
    assert!(
        m["requested_by"]
            .as_str()
            .unwrap()
            .starts_with("token:tok-"),
        "{m}"
    );
    assert!(m["expires_at"].is_string(), "{m}");

    // Answered by an approver: `approval` `answered`, the decision and by whom.
    let (st, v, _) = req(
        &h,
        "POST",
        &format!("/v1/approvals/{apr}/approve"),
        Some(&approver),
        json!({ "reason": "fine" }).to_string(),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let got = s
        .until(|m| m.event == "approval" && m.data["action"] == "answered")
        .await;
    let m = &got.last().unwrap().data;
    assert_eq!(m["approval_id"], apr.as_str());
    assert_eq!(m["decision"], "approved");
    assert!(m["by"].as_str().is_some_and(|b| !b.is_empty()), "{m}");
    assert_eq!(m["sandbox_id"], sb.as_str());

    // Refused by the policy: `policy` `denied`.
    let (st, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{sb}/exec"),
        Some(&dev),
        json!({ "cmd": ["wget", "x"] }).to_string(),
    )
    .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    let got = s.until(|m| m.event == "policy").await;
    let m = &got.last().unwrap().data;
    assert_eq!(m["decision"], "denied");
    assert_eq!(m["rule"], "no-wget");
    assert_eq!(m["tool"], "exec");
    assert_eq!(m["summary"], "exec wget x");
    assert_eq!(m["count"], 1);
    assert_eq!(m["sandbox_id"], sb.as_str());

    // Held, waited for and not answered in time: `policy` `timed_out`.
    let (st, v, _) = req(
        &h,
        "POST",
        &format!("/v1/sandboxes/{sb}/exec?approval_timeout=1s"),
        Some(&dev),
        json!({ "cmd": ["curl", "late"] }).to_string(),
    )
    .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    let got = s
        .until(|m| m.event == "policy" && m.data["decision"] == "timed_out")
        .await;
    let held_late = got
        .iter()
        .find(|m| m.event == "approval" && m.data["action"] == "requested")
        .expect("the late call was journaled as requested first");
    let m = &got.last().unwrap().data;
    assert_eq!(m["approval_id"], held_late.data["approval_id"]);
    assert_eq!(m["rule"], "curl-needs-human");
    assert_eq!(m["summary"], "exec curl late");
    // Every entry carries the common fields, and ids grow.
    for w in got.windows(2) {
        assert!(w[0].id < w[1].id);
    }
    for m in &got {
        for k in ["seq", "at", "kind", "sandbox_id"] {
            assert!(m.data.get(k).is_some(), "{k} missing: {}", m.data);
        }
    }
}
