//! The control plane: every route naming a sandbox × every caller × every
//! spelling of the id; undecodable ids; create and list per caller.

use std::collections::{BTreeSet, HashMap};

use serde_json::{json, Value};

use crate::common::{door, envd_token, Door, Raw, KEY};
use crate::support::{
    callers, e2b_error, entry, render, same_as_unknown, Access, Checks, ACME, BETA, DEFAULT,
    MALFORMED, UNDECODABLE, UNKNOWN,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum State {
    Running,
    Paused,
}

/// A control-plane route naming a sandbox.
pub(crate) struct Route {
    pub(crate) method: &'static str,
    pub(crate) path: &'static str,
    /// The state its sandbox is in.
    state: State,
    /// The lifecycle op it gates (`lifecycle:<op>`), if it is a tool call.
    gate: Option<&'static str>,
    /// Whether an own call changes the sandbox (a fresh one per case).
    fresh: bool,
    body: &'static str,
    /// The status of an own call.
    ok: u16,
}

const fn route(
    method: &'static str,
    path: &'static str,
    state: State,
    gate: Option<&'static str>,
    body: &'static str,
    ok: u16,
) -> Route {
    Route {
        method,
        path,
        state,
        gate,
        fresh: gate.is_some(),
        body,
        ok,
    }
}

const T300: &str = r#"{"timeout":300}"#;

pub(crate) const ID_ROUTES: [Route; 14] = [
    route("GET", "/sandboxes/:id", State::Running, None, "", 200),
    route(
        "GET",
        "/sandboxes/:id/metrics",
        State::Running,
        None,
        "",
        200,
    ),
    route("GET", "/sandboxes/:id/logs", State::Running, None, "", 200),
    route(
        "GET",
        "/v2/sandboxes/:id/logs",
        State::Running,
        None,
        "",
        200,
    ),
    route(
        "DELETE",
        "/sandboxes/:id",
        State::Running,
        Some("lifecycle:delete"),
        "",
        204,
    ),
    route(
        "POST",
        "/sandboxes/:id/connect",
        State::Running,
        None,
        T300,
        200,
    ),
    route(
        "POST",
        "/v2/sandboxes/:id/connect",
        State::Running,
        None,
        T300,
        200,
    ),
    route(
        "POST",
        "/sandboxes/:id/connect",
        State::Paused,
        Some("lifecycle:resume"),
        T300,
        201,
    ),
    route(
        "POST",
        "/v2/sandboxes/:id/connect",
        State::Paused,
        Some("lifecycle:resume"),
        "",
        201,
    ),
    route(
        "POST",
        "/sandboxes/:id/resume",
        State::Paused,
        Some("lifecycle:resume"),
        T300,
        201,
    ),
    route(
        "POST",
        "/sandboxes/:id/timeout",
        State::Running,
        None,
        T300,
        204,
    ),
    route(
        "POST",
        "/sandboxes/:id/refreshes",
        State::Running,
        None,
        "",
        204,
    ),
    route(
        "PUT",
        "/sandboxes/:id/network",
        State::Running,
        None,
        "{}",
        204,
    ),
    route(
        "POST",
        "/sandboxes/:id/pause",
        State::Running,
        Some("lifecycle:hibernate"),
        "",
        204,
    ),
];

/// The control-plane routes without an id: (method, path, status of an
/// allowed call, whether it is a tool call).
pub(crate) const LIST_CREATE: [(&str, &str, u16, bool); 5] = [
    ("POST", "/sandboxes", 201, true),
    ("POST", "/v2/sandboxes", 201, true),
    ("GET", "/sandboxes", 200, false),
    ("GET", "/v2/sandboxes", 200, false),
    // Without `sandbox_ids` (the matrix sends none): 400.
    ("GET", "/sandboxes/metrics", 400, false),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Spell {
    Plain,
    First,
    All,
}

const SPELLS: [Spell; 3] = [Spell::Plain, Spell::First, Spell::All];

fn spell(id: &str, s: Spell) -> String {
    match s {
        Spell::Plain => id.to_owned(),
        Spell::First => format!("%{:02x}{}", id.as_bytes()[0], &id[1..]),
        Spell::All => id.bytes().map(|b| format!("%{b:02X}")).collect(),
    }
}

#[derive(Debug, Clone, Copy)]
enum Id {
    Own(Spell),
    Foreign(Spell),
    Unknown,
    Malformed,
    Undecodable,
}

const IDS: [Id; 9] = [
    Id::Own(Spell::Plain),
    Id::Own(Spell::First),
    Id::Own(Spell::All),
    Id::Foreign(Spell::Plain),
    Id::Foreign(Spell::First),
    Id::Foreign(Spell::All),
    Id::Unknown,
    Id::Malformed,
    Id::Undecodable,
];

/// The status a caller is refused with on `method`, if it is.
fn refusal(access: Access, method: &str) -> Option<u16> {
    match access {
        Access::Unauth => Some(401),
        Access::Metrics => Some(403),
        Access::Read if method != "GET" => Some(403),
        _ => None,
    }
}

/// Writers of each tenant, to make fixtures with.
struct Writers {
    acme: String,
    beta: String,
}

impl Writers {
    fn of(&self, tenant: &str) -> &str {
        match tenant {
            ACME => &self.acme,
            BETA => &self.beta,
            _ => KEY,
        }
    }
}

async fn make(d: &Door, key: &str, s: State) -> String {
    match s {
        State::Running => d.create(key).await,
        State::Paused => d.create_paused(key).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_every_route_every_caller_every_spelling_of_the_id() {
    let d = door().await;
    let who = callers(&d).await;
    let w = Writers {
        acme: who[1].key.clone().unwrap(),
        beta: d.token("developer", BETA).await.0,
    };
    // Read-only cases share one sandbox per tenant and state.
    let mut shared: HashMap<(&str, State), String> = HashMap::new();
    for t in [ACME, DEFAULT, BETA] {
        for s in [State::Running, State::Paused] {
            shared.insert((t, s), make(&d, w.of(t), s).await);
        }
    }
    let mut c = Checks::default();
    for r in &ID_ROUTES {
        for caller in &who {
            let key = caller.key.as_deref();
            let mut unknown: HashMap<Spell, Raw> = HashMap::new();
            for s in SPELLS {
                let path = r.path.replace(":id", &spell(UNKNOWN, s));
                unknown.insert(s, d.control(r.method, &path, key, r.body).await);
            }
            for v in IDS {
                c.cases += 1;
                let ctx = format!(
                    "{} {} ({:?}) as {}, {v:?}",
                    r.method, r.path, r.state, caller.name
                );
                let refused = refusal(caller.access, r.method);
                let (real, spelled) = match v {
                    Id::Own(s) => {
                        let id = if refused.is_none() && r.fresh {
                            make(&d, w.of(caller.tenant), r.state).await
                        } else {
                            shared[&(caller.tenant, r.state)].clone()
                        };
                        let sp = spell(&id, s);
                        (id, sp)
                    }
                    Id::Foreign(s) => {
                        let id = shared[&(BETA, r.state)].clone();
                        let sp = spell(&id, s);
                        (id, sp)
                    }
                    Id::Unknown => (UNKNOWN.to_owned(), UNKNOWN.to_owned()),
                    Id::Malformed => (MALFORMED.to_owned(), MALFORMED.to_owned()),
                    Id::Undecodable => (UNDECODABLE.to_owned(), UNDECODABLE.to_owned()),
                };
                let path = r.path.replace(":id", &spelled);
                let (n0, ops0) = (d.audit_len(), d.engine.ops());
                let a = d.control(r.method, &path, key, r.body).await;
                let audited = d.audit_since(n0);
                let ops = d.engine.ops() - ops0;
                let quiet = |c: &mut Checks, audited: &[Value], ops: u64| {
                    c.check(audited.is_empty(), || {
                        format!("{ctx}: the gate ran: {audited:?}")
                    });
                    c.check(ops == 0, || format!("{ctx}: {ops} engine operations ran"));
                };
                if let Some(st) = refused {
                    c.result(&ctx, e2b_error(&a, st));
                    quiet(&mut c, &audited, ops);
                    // A refused caller learns nothing about the id.
                    let u = &unknown[&Spell::Plain];
                    c.check(render(&a) == render(u), || {
                        format!(
                            "{ctx}: {} differs from the unknown id's {}",
                            render(&a),
                            render(u)
                        )
                    });
                    continue;
                }
                match v {
                    Id::Own(_) => {
                        c.check(a.status == r.ok, || {
                            format!("{ctx}: status {} (want {}): {}", a.status, r.ok, a.text())
                        });
                        let body = a.json();
                        match r.ok {
                            204 => c.check(a.body.is_empty(), || {
                                format!("{ctx}: 204 with a body {}", a.text())
                            }),
                            // The metrics series, not the sandbox.
                            _ if r.path.ends_with("/metrics") => c.check(body.is_array(), || {
                                format!("{ctx}: not a metrics list: {body}")
                            }),
                            // The process log, not the sandbox.
                            _ if r.path.ends_with("/logs") => c
                                .check(body["logs"].is_array(), || {
                                    format!("{ctx}: not a log page: {body}")
                                }),
                            _ => {
                                c.check(body["sandboxID"] == real.as_str(), || {
                                    format!("{ctx}: not the sandbox: {body}")
                                });
                                // The envd token only for who may write.
                                let want = (caller.access == Access::Write)
                                    .then(|| json!(envd_token(&real)));
                                c.check(body.get("envdAccessToken") == want.as_ref(), || {
                                    format!("{ctx}: envdAccessToken: {body}")
                                });
                            }
                        }
                        match r.gate {
                            Some(kind) => {
                                let one = audited.len() == 1
                                    && entry(
                                        &audited[0],
                                        &caller.actor,
                                        caller.tenant,
                                        Some(&real),
                                        kind,
                                    );
                                c.check(one, || {
                                    format!(
                                        "{ctx}: want one allowed {kind} of {} on {real}: {audited:?}",
                                        caller.actor
                                    )
                                });
                            }
                            None => c.check(audited.is_empty(), || {
                                format!("{ctx}: not a tool call, audited: {audited:?}")
                            }),
                        }
                        if r.fresh && a.status == r.ok {
                            // The call did what it says.
                            let g = d
                                .control("GET", &format!("/sandboxes/{real}"), key, "")
                                .await;
                            let (st, state) = (g.status, g.json()["state"].clone());
                            let want = match r.gate {
                                Some("lifecycle:delete") => (404, Value::Null),
                                Some("lifecycle:hibernate") => (200, json!("paused")),
                                _ => (200, json!("running")),
                            };
                            c.check((st, state.clone()) == want, || {
                                format!("{ctx}: afterwards {st} {state} (want {want:?})")
                            });
                        }
                    }
                    Id::Foreign(s) => {
                        c.result(&ctx, e2b_error(&a, 404));
                        quiet(&mut c, &audited, ops);
                        let u = &unknown[&s];
                        let same = same_as_unknown(&a, u, &real, &spelled, &spell(UNKNOWN, s));
                        c.check(same, || {
                            format!(
                                "{ctx}: {} differs from the unknown id's {}",
                                render(&a),
                                render(u)
                            )
                        });
                    }
                    Id::Unknown => {
                        c.result(&ctx, e2b_error(&a, 404));
                        quiet(&mut c, &audited, ops);
                        // The message names the id (so the masking above
                        // compares something).
                        c.check(a.text().contains(UNKNOWN), || {
                            format!("{ctx}: the message does not name the id: {}", a.text())
                        });
                    }
                    Id::Malformed => {
                        c.result(&ctx, e2b_error(&a, 404));
                        quiet(&mut c, &audited, ops);
                        let u = &unknown[&Spell::Plain];
                        c.check(same_as_unknown(&a, u, MALFORMED, "", ""), || {
                            format!(
                                "{ctx}: {} differs from the unknown id's {}",
                                render(&a),
                                render(u)
                            )
                        });
                    }
                    Id::Undecodable => {
                        // Refused before any lookup. (Its body is axum's
                        // plain text, not E2B's error: see
                        // `undecodable_ids_answer_in_e2b_shape`.)
                        c.check(a.status == 400, || {
                            format!("{ctx}: status {} (want 400): {}", a.status, a.text())
                        });
                        quiet(&mut c, &audited, ops);
                    }
                }
            }
        }
    }
    c.finish("control plane");
}

/// An id that does not decode (`%FF%FE`) is refused with E2B's error, as
/// every other refusal of the control plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
// Regression (fixed): door bug: an undecodable id in the path (`/sandboxes/%FF%FE…`) answers
// axum's `400 text/plain` `Invalid URL: Invalid UTF-8 in `id`` (the `Path<String>` rejection),
// not E2B's `{"code":400,"message":…}`
async fn control_plane_undecodable_ids_answer_in_e2b_shape() {
    let d = door().await;
    let (dev, _) = d.token("developer", ACME).await;
    let (viewer, _) = d.token("viewer", ACME).await;
    let mut c = Checks::default();
    for r in &ID_ROUTES {
        for (who, key) in [
            ("developer", &dev),
            ("viewer", &viewer),
            ("e2b key", &KEY.to_owned()),
        ] {
            if refusal(
                if who == "viewer" {
                    Access::Read
                } else {
                    Access::Write
                },
                r.method,
            )
            .is_some()
            {
                continue;
            }
            c.cases += 1;
            let path = r.path.replace(":id", UNDECODABLE);
            let a = d.control(r.method, &path, Some(key), r.body).await;
            c.result(&format!("{} {path} as {who}", r.method), e2b_error(&a, 400));
        }
    }
    c.finish("undecodable ids");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_create_and_list_every_caller() {
    let d = door().await;
    let who = callers(&d).await;
    let w = Writers {
        acme: who[1].key.clone().unwrap(),
        beta: d.token("developer", BETA).await.0,
    };
    let mut owned: HashMap<&str, Vec<(String, State)>> = HashMap::new();
    for t in [ACME, DEFAULT, BETA] {
        for s in [State::Running, State::Paused] {
            owned
                .entry(t)
                .or_default()
                .push((make(&d, w.of(t), s).await, s));
        }
    }
    let body = r#"{"templateID":"base","timeout":300}"#;
    let mut c = Checks::default();
    for (method, path, ok, gated) in LIST_CREATE {
        for caller in &who {
            c.cases += 1;
            let ctx = format!("{method} {path} as {}", caller.name);
            let key = caller.key.as_deref();
            let (n0, ops0) = (d.audit_len(), d.engine.ops());
            let a = d.control(method, path, key, body).await;
            let audited = d.audit_since(n0);
            let ops = d.engine.ops() - ops0;
            if let Some(st) = refusal(caller.access, method) {
                c.result(&ctx, e2b_error(&a, st));
                c.check(audited.is_empty() && ops == 0, || {
                    format!("{ctx}: refused, yet audited {audited:?} / {ops} engine ops")
                });
                continue;
            }
            c.check(a.status == ok, || {
                format!("{ctx}: status {} (want {ok}): {}", a.status, a.text())
            });
            let v = a.json();
            if gated {
                let id = v["sandboxID"].as_str().unwrap_or("").to_owned();
                c.check(v["envdAccessToken"] == envd_token(&id).as_str(), || {
                    format!("{ctx}: {v}")
                });
                let one = audited.len() == 1
                    && entry(
                        &audited[0],
                        &caller.actor,
                        caller.tenant,
                        None,
                        "lifecycle:create",
                    );
                c.check(one, || {
                    format!("{ctx}: want one allowed create: {audited:?}")
                });
                // It is the caller's tenant's, and no other's.
                let mine = d.control("GET", &format!("/sandboxes/{id}"), key, "").await;
                c.check(mine.status == 200, || {
                    format!("{ctx}: own GET {}", mine.status)
                });
                let theirs = d
                    .control("GET", &format!("/sandboxes/{id}"), Some(w.of(BETA)), "")
                    .await;
                c.check(theirs.status == 404, || {
                    format!("{ctx}: beta sees it: {}", theirs.status)
                });
                owned
                    .entry(caller.tenant)
                    .or_default()
                    .push((id, State::Running));
            } else if path == "/sandboxes/metrics" {
                // No ids asked: a 400, nothing audited.
                c.check(audited.is_empty(), || format!("{ctx}: audited {audited:?}"));
            } else {
                c.check(audited.is_empty(), || format!("{ctx}: audited {audited:?}"));
                let listed: BTreeSet<String> = v
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x["sandboxID"].as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default();
                let paused_too = path.starts_with("/v2");
                let want: BTreeSet<String> = owned[caller.tenant]
                    .iter()
                    .filter(|(_, s)| paused_too || *s == State::Running)
                    .map(|(id, _)| id.clone())
                    .collect();
                c.check(listed == want, || {
                    format!("{ctx}: listed {listed:?}, want the tenant's {want:?}")
                });
            }
        }
    }
    c.finish("create and list");
}

/// Routes of fork and snapshots (issue 13), tested by
/// [`control_plane_fork_and_snapshots`] rather than the id matrix (their
/// answers are not a `Sandbox`).
pub(crate) const FORK_SNAPSHOT_ROUTES: [(&str, &str); 4] = [
    ("POST", "/sandboxes/:id/fork"),
    ("POST", "/sandboxes/:id/snapshots"),
    ("GET", "/snapshots"),
    ("DELETE", "/templates/:id"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_fork_and_snapshots() {
    let d = door().await;
    let (beta, _) = d.token("developer", BETA).await;
    let (viewer, _) = d.token("viewer", DEFAULT).await;
    let src = d.create(KEY).await;
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x["sandbox"]["sandboxID"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };

    // count forks, each a sandbox of the caller's with its envd token.
    let fork = format!("/sandboxes/{src}/fork");
    let a = d
        .control("POST", &fork, Some(KEY), r#"{"count":2,"timeout":60}"#)
        .await;
    assert_eq!(a.status, 201, "{}", a.text());
    let forks = ids(&a.json());
    assert_eq!(forks.len(), 2, "{}", a.text());
    assert!(!forks.contains(&src) && forks[0] != forks[1]);
    for f in &forks {
        let body = &a.json()[if *f == forks[0] { 0 } else { 1 }]["sandbox"];
        assert_eq!(body["envdAccessToken"], envd_token(f).as_str());
        let g = d
            .control("GET", &format!("/sandboxes/{f}"), Some(KEY), "")
            .await;
        assert_eq!(g.status, 200, "{}", g.text());
        assert_eq!(g.json()["state"], "running");
    }
    // Bad counts, another tenant, a viewer, no key: refused, nothing made.
    for (key, body, want) in [
        (Some(KEY), r#"{"count":0}"#, 400),
        (Some(KEY), r#"{"count":17}"#, 400),
        (Some(beta.as_str()), "", 404),
        (Some(viewer.as_str()), "", 403),
        (None, "", 401),
    ] {
        let ops0 = d.engine.ops();
        let r = d.control("POST", &fork, key, body).await;
        assert_eq!(r.status, want, "{key:?} {body}: {}", r.text());
        assert_eq!(d.engine.ops(), ops0, "{key:?} {body}: engine ran");
    }
    let r = d
        .control("POST", &format!("/sandboxes/{UNKNOWN}/fork"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // A named snapshot: listed by name, sandbox id and id, forked by create.
    let r = d
        .control(
            "POST",
            &format!("/sandboxes/{src}/snapshots"),
            Some(KEY),
            r#"{"name":"snap-one"}"#,
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_owned();
    assert_eq!(r.json()["names"], json!(["snap-one"]));
    for q in [
        "name=snap-one",
        &format!("name={snap}"),
        &format!("sandboxID={src}"),
    ] {
        let l = d
            .control("GET", &format!("/snapshots?{q}"), Some(KEY), "")
            .await;
        assert_eq!(l.status, 200, "{q}: {}", l.text());
        assert_eq!(
            l.json(),
            json!([{"snapshotID": snap, "names": ["snap-one"]}]),
            "{q}"
        );
    }
    let l = d
        .control("GET", "/snapshots?name=other", Some(KEY), "")
        .await;
    assert_eq!(l.json(), json!([]));
    // Another tenant sees none of it.
    let l = d.control("GET", "/snapshots", Some(&beta), "").await;
    assert_eq!(l.json(), json!([]), "{}", l.text());
    let r = d
        .control("DELETE", &format!("/templates/{snap}"), Some(&beta), "")
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    // Pages of one, with the token of the next page.
    let r = d
        .control(
            "POST",
            &format!("/sandboxes/{src}/snapshots"),
            Some(KEY),
            "",
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let second = r.json()["snapshotID"].as_str().unwrap().to_owned();
    let p1 = d.control("GET", "/snapshots?limit=1", Some(KEY), "").await;
    assert_eq!(p1.json()[0]["snapshotID"], snap.as_str(), "{}", p1.text());
    let next = d.next_token("/snapshots?limit=1", KEY).await;
    let next = next.expect("x-next-token on the first page");
    let p2 = d
        .control(
            "GET",
            &format!("/snapshots?limit=1&nextToken={next}"),
            Some(KEY),
            "",
        )
        .await;
    assert_eq!(
        p2.json(),
        json!([{"snapshotID": second, "names": []}]),
        "{}",
        p2.text()
    );
    for name in ["snap-one", snap.as_str()] {
        let c = d
            .control(
                "POST",
                "/v2/sandboxes",
                Some(KEY),
                &format!(r#"{{"templateID":"{name}"}}"#),
            )
            .await;
        assert_eq!(c.status, 201, "{}", c.text());
        let id = c.json()["sandboxID"].as_str().unwrap().to_owned();
        let v = d
            .v1("GET", &format!("/v1/sandboxes/{id}"), Value::Null)
            .await;
        assert_eq!(v["source_snapshot"], snap.as_str(), "{v}");
    }
    let r = d
        .control("DELETE", &format!("/templates/{snap}"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = d
        .control("DELETE", &format!("/templates/{snap}"), Some(KEY), "")
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
}

/// The template build routes (E2B's `Template()…build()`; the door's
/// `control::templates`).
pub(crate) const TEMPLATE_ROUTES: [(&str, &str); 9] = [
    ("POST", "/v3/templates"),
    ("GET", "/templates/:id/files/:hash"),
    ("POST", "/v2/templates/:id/builds/:build"),
    ("GET", "/templates/:id/builds/:build/status"),
    ("GET", "/templates/aliases/:id"),
    ("POST", "/templates/tags"),
    ("DELETE", "/templates/tags"),
    ("GET", "/templates/:id/tags"),
    ("PUT", "/e2b-template-uploads/:token"),
];

/// Edge cases of the template build routes: bad names and hashes answer
/// 400, unknown builds 404, another tenant's build request, upload link,
/// status, alias and tags answer exactly like unknown ones, an upload link
/// works once, a refused image or a COPY without its upload starts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn template_build_routes_edge_cases() {
    let d = door().await;
    let (beta, _) = d.token("developer", BETA).await;
    let beta = beta.as_str();
    let hash = "ab".repeat(32);

    let r = d
        .control(
            "POST",
            "/v3/templates",
            Some(KEY),
            r#"{"name":"edge:v1","tags":["edge:two"],"cpuCount":1,"memoryMB":1024}"#,
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    let tid = v["templateID"].as_str().unwrap().to_owned();
    let bid = v["buildID"].as_str().unwrap().to_owned();
    assert_eq!(bid.len(), 36, "{v}");
    assert_eq!(v["tags"], json!(["v1", "two"]), "{v}");
    assert_eq!(v["aliases"], json!(["edge"]), "{v}");
    for bad in [
        r#"{"name":":x"}"#,
        r#"{"name":"x:"}"#,
        r#"{"name":"a b"}"#,
        "{}",
        r#"{"name":"n","tags":[":t"]}"#,
    ] {
        let r = d.control("POST", "/v3/templates", Some(KEY), bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["code"], 400, "{bad}: {}", r.text());
    }
    let r = d
        .control("POST", "/v3/templates", None, r#"{"name":"n"}"#)
        .await;
    assert_eq!(r.status, 401, "{}", r.text());

    // Bad hashes: 400 before anything else.
    for bad in ["xyz", &"AB".repeat(32), &"a".repeat(63)] {
        let r = d
            .control(
                "GET",
                &format!("/templates/{tid}/files/{bad}"),
                Some(KEY),
                "",
            )
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
    // Another tenant's build request answers like an unknown template.
    let unknown = "tpl-unknownxyz";
    let same = |path: &str| path.replace(&tid, unknown);
    for path in [
        format!("/templates/{tid}/files/{hash}"),
        format!("/templates/{tid}/builds/{bid}/status"),
    ] {
        let u = d.control("GET", &same(&path), Some(KEY), "").await;
        let b = d.control("GET", &path, Some(beta), "").await;
        assert_eq!(u.status, 404, "{path}: {}", u.text());
        assert_eq!(b.status, 404, "{path}: {}", b.text());
        assert_eq!(b.text(), u.text().replace(unknown, &tid), "{path}");
    }
    let start = format!("/v2/templates/{tid}/builds/{bid}");
    let body = r#"{"fromTemplate":"tpl-base","steps":[]}"#;
    let u = d.control("POST", &same(&start), Some(KEY), body).await;
    let b = d.control("POST", &start, Some(beta), body).await;
    assert_eq!(b.status, 404, "{}", b.text());
    assert_eq!(b.text(), u.text().replace(unknown, &tid));
    // An unknown build of the own template.
    let other = "00000000-0000-4000-8000-000000000000";
    let r = d
        .control(
            "GET",
            &format!("/templates/{tid}/builds/{other}/status"),
            Some(KEY),
            "",
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = d
        .control(
            "POST",
            &format!("/v2/templates/{tid}/builds/{other}"),
            Some(KEY),
            body,
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Before its build starts: waiting.
    let status = format!("/templates/{tid}/builds/{bid}/status?logsOffset=0");
    let r = d.control("GET", &status, Some(KEY), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "waiting", "{}", r.text());

    // The upload link: works once, for its owner's files.
    let r = d
        .control(
            "GET",
            &format!("/templates/{tid}/files/{hash}"),
            Some(KEY),
            "",
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["present"], false, "{}", r.text());
    let url = r.json()["url"].as_str().unwrap().to_owned();
    assert!(url.contains("/e2b-template-uploads/"), "{url}");
    let put = |url: String| {
        let http = reqwest::Client::new();
        async move {
            http.put(url)
                .body("a tar.gz would be here")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(put(url.clone()).await, 200);
    assert_eq!(put(url.clone()).await, 404, "a used link");
    assert_eq!(
        put(url.replace("/e2b-template-uploads/", "/e2b-template-uploads/0")).await,
        404
    );
    let r = d
        .control(
            "GET",
            &format!("/templates/{tid}/files/{hash}"),
            Some(KEY),
            "",
        )
        .await;
    assert_eq!(r.json(), json!({"present": true}), "{}", r.text());

    // Refused before anything is built: an image strata does not have, a
    // COPY whose files were not uploaded, an unknown step.
    for (bad, want) in [
        (r#"{"fromImage":"ubuntu:22.04","steps":[]}"#, "e2bdev/base"),
        (
            r#"{"fromImage":"e2bdev/base","steps":[{"type":"COPY","args":["a","b","",""],"filesHash":"cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd"}]}"#,
            "not uploaded",
        ),
        (
            r#"{"fromImage":"e2bdev/base","steps":[{"type":"ADD","args":[]}]}"#,
            "ADD",
        ),
    ] {
        let r = d.control("POST", &start, Some(KEY), bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert!(
            r.json()["message"].as_str().unwrap().contains(want),
            "{bad}: {}",
            r.text()
        );
        let s = d.control("GET", &status, Some(KEY), "").await;
        assert_eq!(s.json()["status"], "waiting", "{bad}: {}", s.text());
    }

    // Started: the template exists for its owner only.
    let steps = format!(
        r#"{{"fromTemplate":"tpl-base","steps":[{{"type":"COPY","args":["f","f","",""],"filesHash":"{hash}"}},{{"type":"RUN","args":["true"]}}]}}"#
    );
    let r = d.control("POST", &start, Some(KEY), &steps).await;
    assert_eq!(r.status, 202, "{}", r.text());
    let r = d.control("POST", &start, Some(KEY), &steps).await;
    assert_eq!(r.status, 404, "a build starts once: {}", r.text());
    let s = d.control("GET", &status, Some(KEY), "").await;
    assert_eq!(s.status, 200, "{}", s.text());
    assert_ne!(s.json()["status"], "waiting", "{}", s.text());
    let u = d.control("GET", &same(&status), Some(KEY), "").await;
    let b = d.control("GET", &status, Some(beta), "").await;
    assert_eq!(b.status, 404, "{}", b.text());
    assert_eq!(b.text(), u.text().replace(unknown, &tid));
    let r = d
        .control("GET", "/templates/aliases/edge", Some(KEY), "")
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["templateID"], tid.as_str());
    let r = d
        .control("GET", "/templates/aliases/edge", Some(beta), "")
        .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Tags: the owner's only; bad tags 400.
    let r = d
        .control(
            "POST",
            "/templates/tags",
            Some(KEY),
            r#"{"target":"edge:v1","tags":["prod","edge:stable"]}"#,
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"buildID": bid, "tags": ["prod", "stable"]})
    );
    for bad in [
        r#"{"target":"edge:v1","tags":[":x"]}"#,
        r#"{"target":"edge:v1","tags":["edge:"]}"#,
    ] {
        let r = d.control("POST", "/templates/tags", Some(KEY), bad).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
    let r = d
        .control(
            "POST",
            "/templates/tags",
            Some(beta),
            r#"{"target":"edge:v1","tags":["prod"]}"#,
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = d
        .control("GET", "/templates/edge/tags", Some(KEY), "")
        .await;
    let tags: BTreeSet<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tag"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        tags,
        ["prod", "stable", "two", "v1"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    let r = d
        .control("GET", "/templates/edge/tags", Some(beta), "")
        .await;
    assert_ne!(r.status, 200, "{}", r.text());
    let r = d
        .control(
            "DELETE",
            "/templates/tags",
            Some(beta),
            r#"{"name":"edge","tags":["prod"]}"#,
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = d
        .control(
            "DELETE",
            "/templates/tags",
            Some(KEY),
            r#"{"name":"edge","tags":["prod"]}"#,
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = d
        .control("GET", "/templates/edge/tags", Some(KEY), "")
        .await;
    assert_eq!(r.json().as_array().unwrap().len(), 3, "{}", r.text());
}
