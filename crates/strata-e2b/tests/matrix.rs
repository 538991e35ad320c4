//! The E2B door's security matrix, the counterpart of stratad's `/v1` one
//! (`crates/stratad/src/api/tests/matrix.rs`): every route of
//! [`strata_e2b::router`] (the tables below are checked against its source)
//! × every kind of caller × every spelling of the sandbox id.
//!
//! - Control plane (`X-API-KEY`, the id in the path): strata tokens of tenant
//!   `acme` (admin, developer, approver, viewer, metrics), the configured E2B
//!   key (tenant `default`), no key, a wrong key, a forged strata token; ids
//!   own / foreign (tenant `beta`), each plain, with the first byte and with
//!   every byte percent-encoded, unknown, malformed, undecodable.
//! - envd (`E2b-Sandbox-Id` + `X-Access-Token`): sandboxes whose token was
//!   handed to an acme admin, an acme developer, the E2B key, or never handed
//!   out (the `e2b-envd` fallback); the own sandbox with its token, with
//!   another sandbox's token, without a token; a foreign, an unknown and a
//!   malformed id with the caller's own token; no id at all.
//!
//! Each case asserts the status, the error's shape (E2B's
//! `{"code": <status>, "message": …}` on the control plane, `/files` and
//! `/health`; Connect's `{"code": "<code>", "message": …}` on envd's RPCs),
//! that a foreign id's answer is the unknown id's byte for byte once the id
//! is replaced (a Connect stream's envelopes compared decoded: their length
//! prefixes follow the id's length), and whether the tool-call gate ran: the
//! lines `audit.jsonl` gained (exactly one per own tool call, two for a move,
//! with the caller as actor; none otherwise) and, for refused calls, that the
//! engine was not called at all. All checks of a test are collected and
//! reported together.
//!
//! Around the two matrices: create and list per caller; `/health`; a
//! killed sandbox's (or an unknown id's) valid token; process and watcher
//! handles across sandboxes; and, `#[ignore]`d with the reason, the door
//! bugs this file found (undecodable ids answer axum's plain text; the
//! handle-only envd routes answer a gone sandbox with `not_found`/200; they
//! wake a paused sandbox without a gate decision; a revoked token's envd
//! calls still run).
//!
//! The daemon is real (store, security, policy, audit); the engine is the
//! double of `common` (no VM).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{door, envd_token, envelope, frames, Door, Raw, KEY};
use serde_json::{json, Value};

const ACME: &str = "acme";
const BETA: &str = "beta";
const DEFAULT: &str = "default";
const UNKNOWN: &str = "sb-0000000000000000zzzz";
const MALFORMED: &str = "sb-NOT_AN_ID";
const UNDECODABLE: &str = "%FF%FE";

// ------------------------------------------------------------------ checks

/// The failed checks of a test, reported together at its end.
#[derive(Default)]
struct Checks {
    cases: usize,
    fails: Vec<String>,
}

impl Checks {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fails.push(what());
        }
    }

    fn result(&mut self, ctx: &str, r: Result<(), String>) {
        if let Err(e) = r {
            self.fails.push(format!("{ctx}: {e}"));
        }
    }

    fn finish(self, name: &str) {
        let shown: Vec<&String> = self.fails.iter().take(200).collect();
        assert!(
            self.fails.is_empty(),
            "{name}: {} failed checks in {} cases (first {}):\n{}",
            self.fails.len(),
            self.cases,
            shown.len(),
            shown
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
        eprintln!("{name}: {} cases", self.cases);
    }
}

/// An answer's status, content type and body, a Connect stream's body as
/// its envelopes' flags and JSON (their length prefixes depend on the id).
fn render(r: &Raw) -> String {
    let body = if r.ctype == "application/connect+json" {
        frames(&r.body)
            .iter()
            .map(|(f, v)| format!("[{f}] {v}"))
            .collect::<Vec<_>>()
            .join(" ")
    } else {
        r.text()
    };
    format!("{} {:?} {body}", r.status, r.ctype)
}

/// Whether `a`, with `real` (and its spelling `spelled`) replaced by the
/// unknown id (spelled alike), is exactly the unknown id's answer `u`.
fn same_as_unknown(a: &Raw, u: &Raw, real: &str, spelled: &str, unknown_spelled: &str) -> bool {
    let mut m = render(a);
    if !spelled.is_empty() {
        m = m.replace(spelled, unknown_spelled);
    }
    if !real.is_empty() {
        m = m.replace(real, UNKNOWN);
    }
    m == render(u)
}

fn clip(s: &str) -> String {
    s.chars().take(300).collect()
}

/// E2B's error: `status` with `{"code": status, "message": "…"}` (JSON).
fn e2b_error(r: &Raw, status: u16) -> Result<(), String> {
    if r.status != status {
        return Err(format!(
            "status {} (want {status}): {}",
            r.status,
            clip(&r.text())
        ));
    }
    let v = r.json();
    let ok = r.ctype.starts_with("application/json")
        && v.as_object().is_some_and(|o| o.len() == 2)
        && v["code"] == json!(status)
        && v["message"].as_str().is_some_and(|m| !m.is_empty());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "not E2B's {{\"code\": {status}, \"message\": …}}: {:?} {}",
            r.ctype,
            clip(&r.text())
        ))
    }
}

/// The HTTP status of a unary Connect error (connectrpc.com's table).
fn connect_http(code: &str) -> u16 {
    match code {
        "invalid_argument" | "failed_precondition" => 400,
        "unauthenticated" => 401,
        "permission_denied" => 403,
        "not_found" => 404,
        "unavailable" => 503,
        _ => 500,
    }
}

fn connect_error_object(v: &Value, code: &str) -> bool {
    v.as_object().is_some_and(|o| o.len() == 2)
        && v["code"] == code
        && v["message"].as_str().is_some_and(|m| !m.is_empty())
}

/// envd's error `code` in the protocol of the route.
fn envd_error(proto: Proto, r: &Raw, code: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "{why} (want {code}): {} {:?} {}",
            r.status,
            r.ctype,
            clip(&r.text())
        ))
    };
    match proto {
        Proto::Unary => {
            if r.status != connect_http(code) {
                return bad("status");
            }
            if !r.ctype.starts_with("application/json") || !connect_error_object(&r.json(), code) {
                return bad("not a Connect error");
            }
            Ok(())
        }
        Proto::Stream => {
            if r.status != 200 || r.ctype != "application/connect+json" {
                return bad("not a Connect stream");
            }
            let f = frames(&r.body);
            let ok = f.len() == 1
                && f[0].0 == 2
                && f[0].1.as_object().is_some_and(|o| o.len() == 1)
                && connect_error_object(&f[0].1["error"], code);
            if ok {
                Ok(())
            } else {
                bad("not a lone Connect error trailer")
            }
        }
        Proto::Files => e2b_error(
            r,
            if code == "unavailable" {
                502
            } else {
                connect_http(code)
            },
        ),
        Proto::Health => e2b_error(r, 502),
    }
}

/// An audit entry of an allowed call of `actor` (tenant `tenant`) on
/// `sandbox`, of `kind` (`lifecycle:<op>` or a call kind).
fn entry(e: &Value, actor: &str, tenant: &str, sandbox: Option<&str>, kind: &str) -> bool {
    let (k, op) = match kind.split_once(':') {
        Some((k, op)) => (k, Some(op)),
        None => (kind, None),
    };
    e["actor"] == actor
        && e["tenant"] == tenant
        && e["sandbox"] == json!(sandbox)
        && e["call"]["kind"]["kind"] == k
        && op.is_none_or(|op| e["call"]["kind"]["op"] == op)
        && e["decision"]["outcome"] == "allowed"
}

// ----------------------------------------------------------------- callers

/// What a caller may do on the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Admins, developers, the E2B key.
    Write,
    /// Approvers and viewers: `GET` only.
    Read,
    /// A metrics token: nothing (403).
    Metrics,
    /// No key, a wrong key, a forged token: 401.
    Unauth,
}

struct Who {
    name: String,
    key: Option<String>,
    /// The tenant its own sandboxes belong to (acme for the unauthenticated).
    tenant: &'static str,
    actor: String,
    access: Access,
}

async fn callers(d: &Door) -> Vec<Who> {
    let mut v = Vec::new();
    for (role, access) in [
        ("admin", Access::Write),
        ("developer", Access::Write),
        ("approver", Access::Read),
        ("viewer", Access::Read),
        ("metrics", Access::Metrics),
    ] {
        let (tok, id) = d.token(role, ACME).await;
        v.push(Who {
            name: format!("acme {role}"),
            key: Some(tok),
            tenant: ACME,
            actor: format!("token:{id}"),
            access,
        });
    }
    v.push(Who {
        name: "the e2b api key".into(),
        key: Some(KEY.into()),
        tenant: DEFAULT,
        actor: "e2b-api-key".into(),
        access: Access::Write,
    });
    for (name, key) in [
        ("no key", None),
        ("a wrong key", Some("e2b_not_the_key".to_owned())),
        (
            "a forged strata token",
            Some(format!("strata_{}", "0".repeat(64))),
        ),
    ] {
        v.push(Who {
            name: name.into(),
            key,
            tenant: ACME,
            actor: String::new(),
            access: Access::Unauth,
        });
    }
    v
}

// ----------------------------------------------------------- control plane

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum State {
    Running,
    Paused,
}

/// A control-plane route naming a sandbox.
struct Route {
    method: &'static str,
    path: &'static str,
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

const ID_ROUTES: [Route; 10] = [
    route("GET", "/sandboxes/:id", State::Running, None, "", 200),
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
const LIST_CREATE: [(&str, &str, u16, bool); 4] = [
    ("POST", "/sandboxes", 201, true),
    ("POST", "/v2/sandboxes", 201, true),
    ("GET", "/sandboxes", 200, false),
    ("GET", "/v2/sandboxes", 200, false),
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

// -------------------------------------------------------------------- envd

/// How a route answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    /// Connect unary (JSON).
    Unary,
    /// Connect server stream (envelopes).
    Stream,
    /// `/files`: E2B's HTTP errors.
    Files,
    /// `/health`: 204, or 502 in E2B's shape.
    Health,
}

struct EnvdRoute {
    method: &'static str,
    path: &'static str,
    proto: Proto,
    /// Gate decisions of an own call (a move decides both of its ends).
    gates: usize,
    /// Their call kind.
    kind: &'static str,
}

const fn er(
    method: &'static str,
    path: &'static str,
    proto: Proto,
    gates: usize,
    kind: &'static str,
) -> EnvdRoute {
    EnvdRoute {
        method,
        path,
        proto,
        gates,
        kind,
    }
}

const ENVD_ROUTES: [EnvdRoute; 17] = [
    er("GET", "/health", Proto::Health, 0, ""),
    er("GET", "/files", Proto::Files, 1, "file_read"),
    er("POST", "/files", Proto::Files, 1, "file_write"),
    er("POST", "/process.Process/Start", Proto::Stream, 1, "exec"),
    er("POST", "/process.Process/Connect", Proto::Stream, 0, ""),
    er("POST", "/process.Process/List", Proto::Unary, 0, ""),
    er("POST", "/process.Process/SendInput", Proto::Unary, 0, ""),
    er("POST", "/process.Process/SendSignal", Proto::Unary, 0, ""),
    er("POST", "/process.Process/CloseStdin", Proto::Unary, 0, ""),
    er(
        "POST",
        "/filesystem.Filesystem/Stat",
        Proto::Unary,
        1,
        "file_read",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/ListDir",
        Proto::Unary,
        1,
        "file_read",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/MakeDir",
        Proto::Unary,
        1,
        "file_write",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/Move",
        Proto::Unary,
        2,
        "file_write",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/Remove",
        Proto::Unary,
        1,
        "file_write",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/CreateWatcher",
        Proto::Unary,
        1,
        "file_read",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/GetWatcherEvents",
        Proto::Unary,
        0,
        "",
    ),
    er(
        "POST",
        "/filesystem.Filesystem/RemoveWatcher",
        Proto::Unary,
        0,
        "",
    ),
];

/// Things of a sandbox the envd requests name.
#[derive(Debug, Clone, Default)]
struct Handles {
    /// A watcher of `/tmp`.
    watcher: String,
    /// Tag of a process that runs for ever (with stdin).
    tag: String,
    /// Its pid.
    pid: u64,
}

/// A well-formed request of route `r`; `n` makes paths unique.
fn envd_request(
    d: &Door,
    r: &EnvdRoute,
    id: Option<&str>,
    token: Option<&str>,
    h: &Handles,
    n: usize,
) -> reqwest::RequestBuilder {
    let sel = json!({ "tag": h.tag });
    let (url, body): (String, Option<Value>) = match r.path {
        "/health" => ("/health".into(), None),
        "/files" if r.method == "GET" => ("/files?path=/etc/hostname".into(), None),
        "/files" => ("/files?path=/tmp/up.txt".into(), None),
        p => {
            let name = p.rsplit('/').next().unwrap();
            let b = match name {
                "Start" => {
                    json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {}}})
                }
                "Connect" | "CloseStdin" => json!({ "process": sel }),
                "List" => json!({}),
                "SendInput" => json!({"process": sel, "input": {"stdin": "aGk="}}),
                "SendSignal" => json!({"process": sel, "signal": "SIGNAL_SIGTERM"}),
                "Stat" => json!({"path": "/etc/hostname"}),
                "ListDir" => json!({"path": "/etc"}),
                "MakeDir" => json!({ "path": format!("/tmp/new-{n}") }),
                "Move" => json!({"source": "/tmp/a.txt", "destination": "/tmp/b.txt"}),
                "Remove" => json!({"path": "/tmp/x.txt"}),
                "CreateWatcher" => json!({"path": "/tmp"}),
                "GetWatcherEvents" | "RemoveWatcher" => json!({ "watcherId": h.watcher }),
                other => panic!("no request for {other}"),
            };
            (p.into(), Some(b))
        }
    };
    let mut rq = d
        .http
        .request(r.method.parse().unwrap(), format!("{}{url}", d.url));
    if let Some(id) = id {
        rq = rq.header("E2b-Sandbox-Id", id);
    }
    if let Some(t) = token {
        rq = rq.header("X-Access-Token", t);
    }
    match (r.proto, body) {
        (Proto::Stream, Some(b)) => rq
            .header("content-type", "application/connect+json")
            .body(envelope(&b)),
        (_, Some(b)) => rq
            .header("content-type", "application/json")
            .body(b.to_string()),
        (Proto::Files, None) if r.method == "POST" => rq
            .header("content-type", "application/octet-stream")
            .body("data"),
        _ => rq,
    }
}

async fn envd_send(
    d: &Door,
    r: &EnvdRoute,
    id: Option<&str>,
    token: Option<&str>,
    h: &Handles,
    n: usize,
) -> Raw {
    // `Connect` to a live process streams for ever: its first envelope says
    // enough.
    let first_only = r.path.ends_with("/Connect");
    d.send(envd_request(d, r, id, token, h, n), first_only)
        .await
}

/// What an own call of route `r` answers (the double's guest).
fn envd_ok(r: &EnvdRoute, a: &Raw, h: &Handles, n: usize) -> Result<(), String> {
    let v = a.json();
    let bad = |why: &str| Err(format!("{why}: {} {}", a.status, clip(&a.text())));
    if r.proto == Proto::Health {
        return if a.status == 204 && a.body.is_empty() {
            Ok(())
        } else {
            bad("want 204")
        };
    }
    if a.status != 200 {
        return bad("want 200");
    }
    let ok = match r.path.rsplit('/').next().unwrap() {
        "files" if r.method == "GET" => a.body == b"hello",
        "files" => v[0]["path"] == "/tmp/up.txt",
        "Start" => {
            let f = frames(&a.body);
            f.len() >= 3
                && f[0].1["event"]["start"]["pid"].is_u64()
                && f.iter().any(|(_, m)| {
                    m["event"]["end"]["exitCode"] == 0 && m["event"]["end"]["exited"] == true
                })
                && f.last().is_some_and(|(fl, m)| *fl == 2 && *m == json!({}))
        }
        "Connect" => {
            let f = frames(&a.body);
            !f.is_empty() && f[0].0 == 0 && f[0].1["event"]["start"]["pid"] == h.pid
        }
        "List" => v["processes"].as_array().is_some_and(|p| {
            p.iter()
                .any(|p| p["pid"] == h.pid && p["tag"] == h.tag.as_str())
        }),
        "SendInput" | "SendSignal" | "CloseStdin" | "Remove" | "RemoveWatcher" => v == json!({}),
        "Stat" => v["entry"]["path"] == "/etc/hostname" && v["entry"]["type"] == "FILE_TYPE_FILE",
        "ListDir" => v["entries"].is_array(),
        "MakeDir" => v["entry"]["path"] == format!("/tmp/new-{n}").as_str(),
        "Move" => v["entry"]["path"] == "/tmp/b.txt",
        "CreateWatcher" => v["watcherId"].as_str().is_some_and(|w| !w.is_empty()),
        "GetWatcherEvents" => v["events"].is_array(),
        other => panic!("no answer for {other}"),
    };
    if ok {
        Ok(())
    } else {
        bad("unexpected answer")
    }
}

/// Who holds a sandbox's envd token.
struct Holder {
    name: &'static str,
    tenant: &'static str,
    actor: String,
    /// Its control-plane key (`None`: the token was never handed out).
    key: Option<String>,
    id: String,
    h: Handles,
}

/// Starts the never-ending process of a sandbox and a watcher of `/tmp`.
async fn handles(d: &Door, id: &str, tag: &str) -> Handles {
    let tok = envd_token(id);
    let start = &ENVD_ROUTES[3];
    let rq = d
        .http
        .post(format!("{}{}", d.url, start.path))
        .header("E2b-Sandbox-Id", id)
        .header("X-Access-Token", &tok)
        .header("content-type", "application/connect+json")
        .body(envelope(&json!({
            "process": {"cmd": "/bin/sleep", "args": ["100000"]},
            "stdin": true,
            "tag": tag,
        })));
    let a = d.send(rq, true).await;
    let f = frames(&a.body);
    let pid = f
        .first()
        .and_then(|(_, m)| m["event"]["start"]["pid"].as_u64())
        .unwrap_or_else(|| panic!("fixture process of {id}: {}", a.text()));
    let h = Handles {
        watcher: String::new(),
        tag: tag.to_owned(),
        pid,
    };
    let watcher = new_watcher(d, id, &h).await;
    Handles { watcher, ..h }
}

async fn new_watcher(d: &Door, id: &str, h: &Handles) -> String {
    let a = envd_send(d, &ENVD_ROUTES[14], Some(id), Some(&envd_token(id)), h, 0).await;
    assert_eq!(a.status, 200, "watcher of {id}: {}", a.text());
    a.json()["watcherId"].as_str().unwrap().to_owned()
}

async fn holders(d: &Door) -> Vec<Holder> {
    let mut v = Vec::new();
    for role in ["admin", "developer"] {
        let (tok, tid) = d.token(role, ACME).await;
        v.push((role, ACME, format!("token:{tid}"), Some(tok)));
    }
    v.push((
        "the e2b api key",
        DEFAULT,
        "e2b-api-key".into(),
        Some(KEY.into()),
    ));
    v.push(("nobody (never handed out)", ACME, "e2b-envd".into(), None));
    let mut out = Vec::new();
    for (name, tenant, actor, key) in v {
        let id = match &key {
            Some(k) => d.create(k).await,
            None => d.v1_sandbox(tenant).await,
        };
        let h = handles(d, &id, "fixture").await;
        out.push(Holder {
            name,
            tenant,
            actor,
            key,
            id,
            h,
        });
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EnvdId {
    /// The own sandbox with its token.
    Own,
    /// The own sandbox with another (real) sandbox's token.
    OtherToken,
    /// The own sandbox without a token.
    NoToken,
    /// Another tenant's sandbox with the own sandbox's token.
    Foreign,
    /// An unknown id with the own sandbox's token.
    Unknown,
    /// A malformed id with the own sandbox's token.
    Malformed,
    /// No `E2b-Sandbox-Id` header.
    NoId,
}

const ENVD_IDS: [EnvdId; 7] = [
    EnvdId::Own,
    EnvdId::OtherToken,
    EnvdId::NoToken,
    EnvdId::Foreign,
    EnvdId::Unknown,
    EnvdId::Malformed,
    EnvdId::NoId,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envd_every_route_every_token_holder_every_id() {
    let d = door().await;
    let hs = holders(&d).await;
    let beta = d.token("developer", BETA).await.0;
    let foreign = d.create(&beta).await;
    let mut c = Checks::default();
    let mut n = 0usize;
    for r in &ENVD_ROUTES {
        for hold in &hs {
            let own_tok = envd_token(&hold.id);
            n += 1;
            let unknown = envd_send(&d, r, Some(UNKNOWN), Some(&own_tok), &hold.h, n).await;
            for v in ENVD_IDS {
                c.cases += 1;
                n += 1;
                let ctx = format!("{} {} held by {}, {v:?}", r.method, r.path, hold.name);
                let foreign_tok = envd_token(&foreign);
                let (id, token): (Option<&str>, Option<&str>) = match v {
                    EnvdId::Own => (Some(&hold.id), Some(&own_tok)),
                    EnvdId::OtherToken => (Some(&hold.id), Some(&foreign_tok)),
                    EnvdId::NoToken => (Some(&hold.id), None),
                    EnvdId::Foreign => (Some(&foreign), Some(&own_tok)),
                    EnvdId::Unknown => (Some(UNKNOWN), Some(&own_tok)),
                    EnvdId::Malformed => (Some(MALFORMED), Some(&own_tok)),
                    EnvdId::NoId => (None, Some(&own_tok)),
                };
                let mut h = hold.h.clone();
                if v == EnvdId::Own && r.path.ends_with("/RemoveWatcher") {
                    h.watcher = new_watcher(&d, &hold.id, &h).await;
                }
                let (n0, ops0) = (d.audit_len(), d.engine.ops());
                let a = envd_send(&d, r, id, token, &h, n).await;
                let audited = d.audit_since(n0);
                let ops = d.engine.ops() - ops0;
                if v == EnvdId::Own {
                    c.result(&ctx, envd_ok(r, &a, &h, n));
                    let all = audited.len() == r.gates
                        && audited
                            .iter()
                            .all(|e| entry(e, &hold.actor, hold.tenant, Some(&hold.id), r.kind));
                    c.check(all, || {
                        format!(
                            "{ctx}: want {} allowed {} of {} on {}: {audited:?}",
                            r.gates, r.kind, hold.actor, hold.id
                        )
                    });
                    continue;
                }
                // Refused: nothing decided, nothing run.
                c.check(audited.is_empty(), || {
                    format!("{ctx}: the gate ran: {audited:?}")
                });
                c.check(ops == 0, || format!("{ctx}: {ops} engine operations ran"));
                let code = if v == EnvdId::NoId {
                    "invalid_argument"
                } else {
                    "unauthenticated"
                };
                c.result(&ctx, envd_error(r.proto, &a, code));
                if v != EnvdId::NoId {
                    // Exactly the unknown id's answer (`/health` names the id).
                    let sent = id.unwrap_or("");
                    c.check(same_as_unknown(&a, &unknown, sent, "", ""), || {
                        format!(
                            "{ctx}: {} differs from the unknown id's {}",
                            render(&a),
                            render(&unknown)
                        )
                    });
                }
            }
        }
    }
    c.finish("envd");
}

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

// ------------------------------------------------------------------ routes

/// `(METHOD, path)` of every route `strata_e2b::router` serves, read from
/// its source.
fn door_routes() -> BTreeSet<(String, String)> {
    let src = include_str!("../src/lib.rs");
    let body = src
        .split("pub fn router(")
        .nth(1)
        .expect("router in lib.rs");
    let mut out = BTreeSet::new();
    for seg in body.split(".route(").skip(1) {
        let seg = seg.split(".layer(").next().unwrap();
        let start = seg.find('"').expect("a path") + 1;
        let end = start + seg[start..].find('"').unwrap();
        let path = seg[start..end]
            .replace("{p}", "/process.Process")
            .replace("{f}", "/filesystem.Filesystem");
        for m in ["get", "post", "put", "patch", "delete"] {
            let pat = format!("{m}(");
            let called = seg.match_indices(&pat).any(|(i, _)| {
                i == 0
                    || !seg.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && seg.as_bytes()[i - 1] != b'_'
            });
            if called {
                out.insert((m.to_ascii_uppercase(), path.clone()));
            }
        }
    }
    out
}

#[test]
fn the_tables_cover_every_route_of_the_door() {
    let served = door_routes();
    assert!(served.len() > 20, "{served:?}");
    let mut tested: BTreeSet<(String, String)> = BTreeSet::new();
    for r in &ID_ROUTES {
        tested.insert((r.method.into(), r.path.into()));
    }
    for (m, p, _, _) in LIST_CREATE {
        tested.insert((m.into(), p.into()));
    }
    for r in &ENVD_ROUTES {
        tested.insert((r.method.into(), r.path.into()));
    }
    let untested: Vec<_> = served.difference(&tested).collect();
    let unknown: Vec<_> = tested.difference(&served).collect();
    assert!(
        untested.is_empty() && unknown.is_empty(),
        "routes the matrix does not test: {untested:?}; tested routes the door does not serve: {unknown:?}"
    );
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
