//! envd: its routes, well-formed requests and the answers of own calls, the
//! holders of sandbox tokens and their fixtures; and the matrix of every
//! route × every token holder × every id.

use serde_json::{json, Value};

use crate::common::{door, envd_token, envelope, frames, Door, Raw, KEY};
use crate::support::{
    clip, entry, envd_error, render, same_as_unknown, Checks, Proto, ACME, BETA, DEFAULT,
    MALFORMED, UNKNOWN,
};

pub(crate) struct EnvdRoute {
    pub(crate) method: &'static str,
    pub(crate) path: &'static str,
    pub(crate) proto: Proto,
    /// Gate decisions of an own call (a move decides both of its ends).
    pub(crate) gates: usize,
    /// Their call kind.
    pub(crate) kind: &'static str,
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

pub(crate) const ENVD_ROUTES: [EnvdRoute; 19] = [
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
    // Last: the tests below pick routes above by index.
    er("POST", "/process.Process/Update", Proto::Unary, 0, ""),
    er(
        "POST",
        "/filesystem.Filesystem/WatchDir",
        Proto::Stream,
        1,
        "file_read",
    ),
];

/// Things of a sandbox the envd requests name.
#[derive(Debug, Clone, Default)]
pub(crate) struct Handles {
    /// A watcher of `/tmp`.
    pub(crate) watcher: String,
    /// Tag of a process that runs for ever (with stdin).
    pub(crate) tag: String,
    /// Its pid.
    pub(crate) pid: u64,
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
                "Connect" | "CloseStdin" | "Update" => json!({ "process": sel }),
                "List" => json!({}),
                "SendInput" => json!({"process": sel, "input": {"stdin": "aGk="}}),
                "SendSignal" => json!({"process": sel, "signal": "SIGNAL_SIGTERM"}),
                "Stat" => json!({"path": "/etc/hostname"}),
                "ListDir" => json!({"path": "/etc"}),
                "MakeDir" => json!({ "path": format!("/tmp/new-{n}") }),
                "Move" => json!({"source": "/tmp/a.txt", "destination": "/tmp/b.txt"}),
                "Remove" => json!({"path": "/tmp/x.txt"}),
                "CreateWatcher" | "WatchDir" => json!({"path": "/tmp"}),
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

pub(crate) async fn envd_send(
    d: &Door,
    r: &EnvdRoute,
    id: Option<&str>,
    token: Option<&str>,
    h: &Handles,
    n: usize,
) -> Raw {
    // `Connect` to a live process and `WatchDir` stream for ever: their
    // first envelope says enough.
    let first_only = r.path.ends_with("/Connect") || r.path.ends_with("/WatchDir");
    d.send(envd_request(d, r, id, token, h, n), first_only)
        .await
}

/// What an own call of route `r` answers (the double's guest).
pub(crate) fn envd_ok(r: &EnvdRoute, a: &Raw, h: &Handles, n: usize) -> Result<(), String> {
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
        "SendInput" | "SendSignal" | "CloseStdin" | "Update" | "Remove" | "RemoveWatcher" => {
            v == json!({})
        }
        "Stat" => v["entry"]["path"] == "/etc/hostname" && v["entry"]["type"] == "FILE_TYPE_FILE",
        "ListDir" => v["entries"].is_array(),
        "MakeDir" => v["entry"]["path"] == format!("/tmp/new-{n}").as_str(),
        "Move" => v["entry"]["path"] == "/tmp/b.txt",
        "CreateWatcher" => v["watcherId"].as_str().is_some_and(|w| !w.is_empty()),
        "WatchDir" => {
            let f = frames(&a.body);
            !f.is_empty() && f[0].0 == 0 && f[0].1 == json!({"start": {}})
        }
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
pub(crate) struct Holder {
    pub(crate) name: &'static str,
    pub(crate) tenant: &'static str,
    pub(crate) actor: String,
    /// Its control-plane key (`None`: the token was never handed out).
    pub(crate) key: Option<String>,
    pub(crate) id: String,
    pub(crate) h: Handles,
}

/// Starts the never-ending process of a sandbox and a watcher of `/tmp`.
pub(crate) async fn handles(d: &Door, id: &str, tag: &str) -> Handles {
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

pub(crate) async fn holders(d: &Door) -> Vec<Holder> {
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
