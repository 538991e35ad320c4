//! envd around its matrix: a gone sandbox's (or an unknown id's) valid
//! token, `/health`, process and watcher handles across sandboxes, envd
//! calls on a paused sandbox, and a revoked token's envd calls.

use serde_json::json;

use crate::common::{door, envd_token, envelope};
use crate::envd::{envd_ok, envd_send, handles, holders, EnvdRoute, Handles, ENVD_ROUTES};
use crate::support::{
    envd_error, render, same_as_unknown, Checks, Proto, ACME, BETA, MALFORMED, UNKNOWN,
};

/// Whether an envd route answers from the door's in-memory handles (the
/// process table, the watchers) before it looks the sandbox up.
fn handle_only(r: &EnvdRoute) -> bool {
    [
        "/Connect",
        "/List",
        "/SendInput",
        "/SendSignal",
        "/CloseStdin",
        "/GetWatcherEvents",
        "/RemoveWatcher",
    ]
    .iter()
    .any(|s| r.path.ends_with(s))
}

/// A sandbox that is gone, or an id that never was, with the token that is
/// valid for it (the SDK keeps a killed sandbox's token): nothing decided,
/// nothing run, and "not running" (`unavailable` with E2B's proxy message;
/// 502 on `/files` and `/health`), exactly as for an unknown id. With
/// `handles_too`, only the routes of [`handle_only`] are checked, fully;
/// without, those get the first two checks only.
async fn gone_sandboxes(handles_too: bool) -> Checks {
    let d = door().await;
    let hs = holders(&d).await;
    let acme_dev = hs[1].key.clone().unwrap();
    // A deleted sandbox per holder, with its handles.
    let mut gone = Vec::new();
    for hold in &hs {
        let id = match &hold.key {
            Some(k) => d.create(k).await,
            None => d.v1_sandbox(hold.tenant).await,
        };
        let h = handles(&d, &id, "fixture").await;
        let key = hold.key.as_deref().unwrap_or(&acme_dev);
        let r = d
            .control("DELETE", &format!("/sandboxes/{id}"), Some(key), "")
            .await;
        assert_eq!(r.status, 204, "{}", r.text());
        gone.push((id, h));
    }
    let mut c = Checks::default();
    let mut n = 0usize;
    for r in ENVD_ROUTES
        .iter()
        .filter(|r| !handles_too || handle_only(r))
    {
        let full = handles_too || !handle_only(r);
        for (hold, (deleted, dh)) in hs.iter().zip(&gone) {
            n += 1;
            let unknown =
                envd_send(&d, r, Some(UNKNOWN), Some(&envd_token(UNKNOWN)), &hold.h, n).await;
            for (what, id, h) in [
                ("an unknown id", UNKNOWN, &hold.h),
                ("a malformed id", MALFORMED, &hold.h),
                ("a deleted sandbox", deleted.as_str(), dh),
            ] {
                c.cases += 1;
                n += 1;
                let ctx = format!("{} {} ({}): {what}", r.method, r.path, hold.name);
                let (n0, ops0) = (d.audit_len(), d.engine.ops());
                let a = envd_send(&d, r, Some(id), Some(&envd_token(id)), h, n).await;
                let audited = d.audit_since(n0);
                let ops = d.engine.ops() - ops0;
                c.check(audited.is_empty(), || {
                    format!("{ctx}: the gate ran: {audited:?}")
                });
                c.check(ops == 0, || format!("{ctx}: {ops} engine operations ran"));
                if !full {
                    continue;
                }
                c.result(&ctx, envd_error(r.proto, &a, "unavailable"));
                let want = format!("The sandbox {id} was not found");
                c.check(a.text().contains(&want), || {
                    format!("{ctx}: not E2B's \"{want}\": {}", a.text())
                });
                c.check(same_as_unknown(&a, &unknown, id, "", ""), || {
                    format!(
                        "{ctx}: {} differs from the unknown id's {}",
                        render(&a),
                        render(&unknown)
                    )
                });
            }
        }
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_gone_sandboxes_answer_not_running() {
    gone_sandboxes(false).await.finish("gone sandboxes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
// Regression (fixed): door bug: Connect, List, SendInput, SendSignal, CloseStdin,
// GetWatcherEvents and RemoveWatcher answer from the in-memory process table / watchers before
// looking the sandbox up: for a killed sandbox (or an unknown id) with its valid token they
// answer not_found (`process not found`, `watcher … not found`) or 200 {"processes":[]} instead
// of `unavailable` "The sandbox … was not found\
async fn envd_gone_sandboxes_answer_not_running_on_the_handle_routes_too() {
    gone_sandboxes(true)
        .await
        .finish("gone sandboxes, handle routes");
}

/// `/health` needs the sandbox's token and a running sandbox: 204, else
/// exactly the unknown sandbox's 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_health_needs_the_token_and_a_running_sandbox() {
    let d = door().await;
    let (dev, _) = d.token("developer", ACME).await;
    let up = d.create(&dev).await;
    let asleep = d.create_paused(&dev).await;
    let health = |id: &str, tok: Option<String>| {
        let mut rq = d
            .http
            .get(format!("{}/health", d.url))
            .header("E2b-Sandbox-Id", id);
        if let Some(t) = tok {
            rq = rq.header("X-Access-Token", t);
        }
        d.send(rq, false)
    };
    let gone = health(UNKNOWN, Some(envd_token(UNKNOWN))).await;
    assert_eq!(
        (gone.status, gone.json()),
        (
            502,
            json!({"code": 502, "message": format!("The sandbox {UNKNOWN} was not found")})
        )
    );
    let mut c = Checks::default();
    for (what, id, tok, want) in [
        ("running, its token", &up, Some(envd_token(&up)), 204),
        ("running, no token", &up, None, 502),
        (
            "running, another's token",
            &up,
            Some(envd_token(&asleep)),
            502,
        ),
        ("running, a made-up token", &up, Some("0".repeat(64)), 502),
        ("paused, its token", &asleep, Some(envd_token(&asleep)), 502),
        ("paused, no token", &asleep, None, 502),
    ] {
        c.cases += 1;
        let ops0 = d.engine.ops();
        let a = health(id, tok).await;
        c.check(a.status == want, || {
            format!("{what}: {} {}", a.status, a.text())
        });
        c.check(d.engine.ops() == ops0, || {
            format!("{what}: the engine was called")
        });
        if want == 502 {
            c.check(
                a.text().replace(id.as_str(), UNKNOWN) == gone.text(),
                || format!("{what}: {} differs from the unknown sandbox's", a.text()),
            );
        }
    }
    c.finish("health");
}

/// A process's pid or tag and a watcher's id name things of one sandbox:
/// from another sandbox (with that one's valid token, same holder, or
/// another tenant's) they are not found, and the originals are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_handles_do_not_reach_across_sandboxes() {
    let d = door().await;
    let (dev, _) = d.token("developer", ACME).await;
    let (beta, _) = d.token("developer", BETA).await;
    let a_id = d.create(&dev).await;
    let a = handles(&d, &a_id, "mine").await;
    let mut c = Checks::default();
    for other in [d.create(&dev).await, d.create(&beta).await] {
        let tok = envd_token(&other);
        for (path, body) in [
            (
                "/process.Process/SendInput",
                json!({"process": {"pid": a.pid}, "input": {"stdin": "aGk="}}),
            ),
            (
                "/process.Process/SendInput",
                json!({"process": {"tag": a.tag}, "input": {"stdin": "aGk="}}),
            ),
            (
                "/process.Process/SendSignal",
                json!({"process": {"pid": a.pid}, "signal": "SIGNAL_SIGKILL"}),
            ),
            (
                "/process.Process/SendSignal",
                json!({"process": {"tag": a.tag}, "signal": "SIGNAL_SIGKILL"}),
            ),
            (
                "/process.Process/CloseStdin",
                json!({"process": {"pid": a.pid}}),
            ),
            (
                "/filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": a.watcher}),
            ),
            (
                "/filesystem.Filesystem/RemoveWatcher",
                json!({"watcherId": a.watcher}),
            ),
        ] {
            c.cases += 1;
            let ctx = format!("{path} {body} on {other}");
            let ops0 = d.engine.ops();
            let r = d
                .send(
                    d.http
                        .post(format!("{}{path}", d.url))
                        .header("E2b-Sandbox-Id", &other)
                        .header("X-Access-Token", &tok)
                        .json(&body),
                    false,
                )
                .await;
            c.result(&ctx, envd_error(Proto::Unary, &r, "not_found"));
            c.check(d.engine.ops() == ops0, || {
                format!("{ctx}: the engine was called")
            });
        }
        for sel in [json!({"pid": a.pid}), json!({"tag": a.tag})] {
            c.cases += 1;
            let r = d
                .send(
                    d.http
                        .post(format!("{}/process.Process/Connect", d.url))
                        .header("E2b-Sandbox-Id", &other)
                        .header("X-Access-Token", &tok)
                        .header("content-type", "application/connect+json")
                        .body(envelope(&json!({ "process": sel }))),
                    true,
                )
                .await;
            c.result(
                &format!("Connect {sel} on {other}"),
                envd_error(Proto::Stream, &r, "not_found"),
            );
        }
        c.cases += 1;
        let r = d
            .send(
                d.http
                    .post(format!("{}/process.Process/List", d.url))
                    .header("E2b-Sandbox-Id", &other)
                    .header("X-Access-Token", &tok)
                    .json(&json!({})),
                false,
            )
            .await;
        c.check(
            r.status == 200 && r.json() == json!({"processes": []}),
            || format!("List on {other}: {} {}", r.status, r.text()),
        );
    }
    // The originals still work.
    let tok = envd_token(&a_id);
    let r = envd_send(&d, &ENVD_ROUTES[15], Some(&a_id), Some(&tok), &a, 0).await;
    c.check(r.status == 200, || {
        format!("A's watcher: {} {}", r.status, r.text())
    });
    let r = envd_send(&d, &ENVD_ROUTES[5], Some(&a_id), Some(&tok), &a, 0).await;
    c.result("A's process", envd_ok(&ENVD_ROUTES[5], &r, &a, 0));
    c.finish("handles");
}

/// envd calls that are not tool calls (listing, signalling, stdin, attaching
/// to a process) on a paused sandbox: they either leave it paused or, if
/// they wake it, the wake is a decision of the gate (audited).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
// Regression (fixed): door bug: on a paused (hibernated) sandbox, Connect to a detached process,
// List (with detached processes), SendInput, SendSignal, CloseStdin and GetWatcherEvents run
// their helper under `Service::access` / the watcher's old grant, which wakes the sandbox (engine
// `wake`) with no gate decision at all; the same wake through `POST /sandboxes/:id/connect` is
// gated as `lifecycle resume`
async fn envd_calls_that_are_not_tool_calls_do_not_wake_a_paused_sandbox_ungated() {
    let d = door().await;
    let (dev, _) = d.token("developer", ACME).await;
    let mut c = Checks::default();
    for r in ENVD_ROUTES
        .iter()
        .filter(|r| r.gates == 0 && r.proto != Proto::Health)
    {
        c.cases += 1;
        let id = d.create(&dev).await;
        let h = handles(&d, &id, "fixture").await;
        let p = d
            .control("POST", &format!("/sandboxes/{id}/pause"), Some(&dev), "")
            .await;
        assert_eq!(p.status, 204, "{}", p.text());
        let (n0, ops0) = (d.audit_len(), d.engine.ops());
        let a = envd_send(&d, r, Some(&id), Some(&envd_token(&id)), &h, 0).await;
        let audited = d.audit_since(n0);
        let ops = d.engine.ops() - ops0;
        let g = d
            .control("GET", &format!("/sandboxes/{id}"), Some(&dev), "")
            .await;
        let state = g.json()["state"].clone();
        c.check(state == "paused" || !audited.is_empty(), || {
            format!(
                "{} on a paused sandbox: now {state}, {ops} engine operations, no gate decision; answered {}",
                r.path,
                render(&a)
            )
        });
    }
    c.finish("paused sandboxes");
}

/// envd calls act as the strata token the sandbox's envd token was handed
/// to: once that token is revoked, they are refused (nothing decided, nothing
/// run), as its control-plane calls are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
// Regression (fixed): door bug: the envd binding stores the caller, not a reference re-checked
// against the token store: after `DELETE /v1/tokens/:id` the control plane answers 401 `token
// revoked`, but envd calls with the sandbox's access token still run and are audited as the
// revoked `token:tok-…`
async fn envd_calls_of_a_revoked_token_are_refused() {
    let d = door().await;
    let (dev, dev_id) = d.token("developer", ACME).await;
    let (admin, _) = d.token("admin", ACME).await;
    let id = d.create(&dev).await;
    let r = d
        .http
        .delete(format!("{}/v1/tokens/{dev_id}", d.url))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "revoke: {}", r.status());
    let a = d
        .control("GET", &format!("/sandboxes/{id}"), Some(&dev), "")
        .await;
    assert_eq!(a.status, 401, "control plane after revoking: {}", a.text());
    let mut c = Checks::default();
    let h = Handles::default();
    for r in ENVD_ROUTES.iter().filter(|r| r.gates > 0) {
        c.cases += 1;
        let (n0, ops0) = (d.audit_len(), d.engine.ops());
        let a = envd_send(&d, r, Some(&id), Some(&envd_token(&id)), &h, c.cases).await;
        let audited = d.audit_since(n0);
        let ops = d.engine.ops() - ops0;
        c.check(audited.is_empty() && ops == 0, || {
            format!(
                "{} after revoking token:{dev_id}: {ops} engine operations, audited {audited:?}; answered {}",
                r.path,
                render(&a)
            )
        });
    }
    c.finish("revoked token");
}
