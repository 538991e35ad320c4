//! E2B lifecycle (`Sandbox.create(lifecycle=…)`: `autoPause`, `autoResume`)
//! over a real stratad `App` (SQLite store, security, scheduler running)
//! behind the door on a real listener; the engine is the double of
//! `common` (what a real guest does is the Python suite's,
//! `tests/python/test_lifecycle.py`).
//!
//! - `autoPause: false` (`on_timeout: "kill"`): the idle timeout deletes
//!   the sandbox, journaled as a delete with the reason;
//! - `autoPause: true`: the timeout hibernates it;
//! - `autoResume.enabled: false`: an envd call on the paused sandbox answers
//!   `unavailable` "… was not found" and it stays paused; `connect` wakes
//!   it; enabled (or the default) wakes it on the envd call;
//! - the policy survives a daemon restart (store schema 8) and forks
//!   inherit it; `GET /sandboxes/{id}` reports it as `lifecycle`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use common::{envd_token, Door, Double, Raw, KEY, SECRET};
use serde_json::{json, Value};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState};
use stratad::clock::SystemClock;
use stratad::config::Config;
use stratad::store::{SqliteStore, Store, TemplateRecord, TemplateStatus};
use stratad::App;

/// A daemon over `dir` (a second call over the same dir is a restart),
/// its background tasks running, the door on its own listener.
async fn daemon(dir: tempfile::TempDir) -> Door {
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        key_dir: dir.path().join("keys"),
        default_template: false,
        ..Config::default()
    };
    cfg.capacity.vcpus = 1 << 20;
    cfg.capacity.memory_mib = 1 << 40;
    cfg.capacity.admission = stratad::config::AdmissionMode::Nominal;
    cfg.pressure.enabled = false;
    cfg.security.auth = true;
    cfg.security.rate_limit_per_second = 0.0;
    let e2b = strata_e2b::E2bConfig {
        api_keys: vec![strata_e2b::auth::ApiKey::bare(KEY)],
        token_secret: SECRET.to_vec(),
        rate_limit_per_second: 0.0,
        auth_failures_per_minute: 0,
        ..Default::default()
    };
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), 2).unwrap());
    put_template(store.as_ref(), dir.path());
    let engine = Arc::new(Double::default());
    let app = App::new(cfg, store, engine.clone(), Arc::new(SystemClock));
    app.start().await.unwrap();
    let admin = std::fs::read_to_string(dir.path().join("admin.token"))
        .unwrap()
        .trim()
        .to_owned();
    let router = app.router().merge(strata_e2b::router(
        app.service().clone(),
        app.security().cloned(),
        e2b,
    ));
    let url = strata_testkit::serve(router).await.unwrap().detach();
    Door {
        url,
        admin,
        app,
        http: reqwest::Client::new(),
        engine,
        dir,
    }
}

fn put_template(store: &dyn Store, _dir: &Path) {
    store
        .put_template(&TemplateRecord {
            id: "tpl-base".parse().unwrap(),
            tenant: stratad::caller::PLATFORM_SCOPE.into(),
            name: None,
            size: SandboxSize::default(),
            status: TemplateStatus::Ready,
            status_reason: None,
            accel: Some("tcg".into()),
            created_at: Utc::now(),
            updated_at: Utc::now(),
            variant_of: None,
        })
        .unwrap();
}

/// Stops `d`'s background tasks and opens a new daemon over its data dir.
async fn restart(d: Door) -> Door {
    d.app.stop();
    daemon(d.dir).await
}

async fn create(d: &Door, body: Value) -> String {
    let r = d
        .control("POST", "/v2/sandboxes", Some(KEY), &body.to_string())
        .await;
    assert_eq!(r.status, 201, "create {body}: {}", r.text());
    r.json()["sandboxID"].as_str().unwrap().to_owned()
}

async fn info(d: &Door, id: &str) -> Raw {
    d.control("GET", &format!("/sandboxes/{id}"), Some(KEY), "")
        .await
}

/// Polls `GET /sandboxes/{id}` until `done` holds of it (status, body), for
/// at most `within`.
async fn wait_for(d: &Door, id: &str, within: Duration, done: impl Fn(&Raw) -> bool) -> Raw {
    let t = Instant::now();
    loop {
        let r = info(d, id).await;
        if done(&r) {
            return r;
        }
        assert!(
            t.elapsed() < within,
            "sandbox {id} after {within:?}: {} {}",
            r.status,
            r.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `process.Process/Start` of `true` on sandbox `id`.
async fn exec(d: &Door, id: &str) -> Raw {
    let rq = d
        .http
        .post(format!("{}/process.Process/Start", d.url))
        .header("E2b-Sandbox-Id", id)
        .header("X-Access-Token", envd_token(id))
        .header("content-type", "application/connect+json")
        .body(common::envelope(&json!({"process": {"cmd": "true"}})));
    d.send(rq, false).await
}

/// The end-of-stream error of a Connect answer, if any.
fn stream_error(r: &Raw) -> Option<Value> {
    common::frames(&r.body)
        .into_iter()
        .find(|(flags, v)| flags & 2 != 0 && !v["error"].is_null())
        .map(|(_, v)| v["error"].clone())
        .or_else(|| {
            let v = r.json();
            (!v["code"].is_null()).then_some(v)
        })
}

async fn pause(d: &Door, id: &str) {
    let r = d
        .control("POST", &format!("/sandboxes/{id}/pause"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 204, "pause: {}", r.text());
}

#[tokio::test]
async fn kill_on_timeout_deletes_and_journals_it() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let id = create(
        &d,
        json!({"templateID": "base", "timeout": 1, "autoPause": false}),
    )
    .await;
    let r = info(&d, &id).await;
    assert_eq!(
        r.json()["lifecycle"],
        json!({"onTimeout": "kill", "autoResume": false}),
        "{}",
        r.text()
    );
    let gone = wait_for(&d, &id, Duration::from_secs(20), |r| r.status == 404).await;
    assert!(gone.text().contains(&id), "{}", gone.text());
    // Deleted, not hibernated: the record says so, and its journal ends
    // with the daemon's delete and the reason.
    let sid: SandboxId = id.parse().unwrap();
    let s2 = sid.clone();
    let rec = d
        .app
        .service()
        .db(move |s| s.get_sandbox(&s2))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.state, SandboxState::Deleted);
    let events = d
        .app
        .service()
        .db(move |s| s.events(&sid, 100))
        .await
        .unwrap();
    let ops: Vec<_> = events.iter().map(|e| e.op).collect();
    assert!(!ops.contains(&Op::Hibernate), "{ops:?}");
    let del = events
        .iter()
        .rfind(|e| e.op == Op::Delete)
        .unwrap_or_else(|| panic!("no delete in {events:?}"));
    assert!(
        del.detail
            .as_deref()
            .unwrap_or("")
            .contains("on_timeout=delete"),
        "{del:?}"
    );
}

#[tokio::test]
async fn pause_on_timeout_hibernates() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let id = create(
        &d,
        json!({"templateID": "base", "timeout": 1, "autoPause": true}),
    )
    .await;
    let r = wait_for(&d, &id, Duration::from_secs(20), |r| {
        r.json()["state"] == "paused"
    })
    .await;
    assert_eq!(
        r.json()["lifecycle"],
        json!({"onTimeout": "pause", "autoResume": true}),
        "{}",
        r.text()
    );
    let rec = d
        .v1("GET", &format!("/v1/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(rec["state"], "hibernated", "{rec}");
}

#[tokio::test]
async fn auto_resume_false_refuses_envd_until_connect() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let id = create(
        &d,
        json!({"templateID": "base", "timeout": 300, "autoPause": true,
               "autoResume": {"enabled": false}}),
    )
    .await;
    pause(&d, &id).await;
    let r = exec(&d, &id).await;
    let err = stream_error(&r).unwrap_or_else(|| panic!("exec ran: {}", r.text()));
    assert_eq!(err["code"], "unavailable", "{}", r.text());
    assert!(
        err["message"]
            .as_str()
            .unwrap_or("")
            .contains("was not found"),
        "{}",
        r.text()
    );
    assert_eq!(info(&d, &id).await.json()["state"], "paused");
    // connect wakes it; then commands run.
    let r = d
        .control("POST", &format!("/sandboxes/{id}/connect"), Some(KEY), "{}")
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = exec(&d, &id).await;
    assert!(stream_error(&r).is_none(), "{}", r.text());
}

#[tokio::test]
async fn auto_resume_true_and_the_default_wake_on_envd() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    for body in [
        json!({"templateID": "base", "timeout": 300, "autoPause": true,
               "autoResume": {"enabled": true}}),
        json!({"templateID": "base", "timeout": 300}),
    ] {
        let id = create(&d, body.clone()).await;
        pause(&d, &id).await;
        let r = exec(&d, &id).await;
        assert!(stream_error(&r).is_none(), "{body}: {}", r.text());
        assert_eq!(info(&d, &id).await.json()["state"], "running", "{body}");
    }
}

#[tokio::test]
async fn kill_with_auto_resume_is_refused() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let r = d
        .control(
            "POST",
            "/v2/sandboxes",
            Some(KEY),
            r#"{"templateID":"base","autoPause":false,"autoResume":{"enabled":true}}"#,
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let list = d.control("GET", "/v2/sandboxes", Some(KEY), "").await;
    assert_eq!(list.json(), json!([]), "{}", list.text());
}

#[tokio::test]
async fn the_policy_survives_a_restart_and_forks_inherit_it() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let asleep = create(
        &d,
        json!({"templateID": "base", "timeout": 300, "autoPause": true,
               "autoResume": {"enabled": false}}),
    )
    .await;
    let kill = create(
        &d,
        json!({"templateID": "base", "timeout": 300, "autoPause": false}),
    )
    .await;
    // A fork (of the running source) inherits the source's policy.
    let r = d
        .control(
            "POST",
            &format!("/sandboxes/{asleep}/fork"),
            Some(KEY),
            "{}",
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let fork = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap_or_else(|| panic!("{}", r.text()))
        .to_owned();
    pause(&d, &asleep).await;
    pause(&d, &fork).await;
    pause(&d, &kill).await;
    let d = restart(d).await;
    // After the restart: auto_resume=false still holds for the source and
    // the fork (an envd call does not wake them), and kill is still kill.
    for id in [&asleep, &fork] {
        let r = exec(&d, id).await;
        assert_eq!(
            stream_error(&r).map(|e| e["code"].clone()),
            Some(json!("unavailable")),
            "{id}: {}",
            r.text()
        );
        let r = info(&d, id).await;
        assert_eq!(r.json()["state"], "paused", "{id}: {}", r.text());
        assert_eq!(
            r.json()["lifecycle"],
            json!({"onTimeout": "pause", "autoResume": false}),
            "{id}: {}",
            r.text()
        );
    }
    assert_eq!(
        info(&d, &kill).await.json()["lifecycle"],
        json!({"onTimeout": "kill", "autoResume": false})
    );
}

#[tokio::test]
async fn v1_create_takes_the_same_policy() {
    let d = daemon(tempfile::tempdir().unwrap()).await;
    let rec = d
        .v1(
            "POST",
            "/v1/sandboxes",
            json!({"template": "tpl-base",
                   "lifecycle": {"on_timeout": "delete", "auto_resume": false}}),
        )
        .await;
    let id = rec["id"].as_str().unwrap();
    let got = d
        .v1("GET", &format!("/v1/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(
        got["lifecycle"],
        json!({"on_timeout": "delete", "auto_resume": false}),
        "{got}"
    );
    // The E2B door reports the same policy in its words.
    assert_eq!(
        info(&d, id).await.json()["lifecycle"],
        json!({"onTimeout": "kill", "autoResume": false})
    );
    // Omitted: the default, shown as such.
    let rec = d
        .v1("POST", "/v1/sandboxes", json!({"template": "tpl-base"}))
        .await;
    let id = rec["id"].as_str().unwrap();
    let got = d
        .v1("GET", &format!("/v1/sandboxes/{id}"), Value::Null)
        .await;
    assert_eq!(
        got["lifecycle"],
        json!({"on_timeout": "hibernate", "auto_resume": true})
    );
    // A bad value is refused and creates nothing.
    let before = d.v1("GET", "/v1/sandboxes", Value::Null).await["items"]
        .as_array()
        .map(Vec::len);
    let r = d
        .http
        .post(format!("{}/v1/sandboxes", d.url))
        .bearer_auth(&d.admin)
        .json(&json!({"template": "tpl-base", "lifecycle": {"on_timeout": "explode"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_request", "{v}");
    let after = d.v1("GET", "/v1/sandboxes", Value::Null).await["items"]
        .as_array()
        .map(Vec::len);
    assert_eq!(before, after);
}
