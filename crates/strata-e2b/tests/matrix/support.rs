//! What every part of the matrix shares: the ids, the checks collected per
//! test, the answers' shapes (E2B's and Connect's errors, audit entries),
//! and the callers of the control plane.

use serde_json::{json, Value};

use crate::common::{frames, Door, Raw, KEY};

pub(crate) const ACME: &str = "acme";
pub(crate) const BETA: &str = "beta";
pub(crate) const DEFAULT: &str = "default";
pub(crate) const UNKNOWN: &str = "sb-0000000000000000zzzz";
pub(crate) const MALFORMED: &str = "sb-NOT_AN_ID";
pub(crate) const UNDECODABLE: &str = "%FF%FE";

// ------------------------------------------------------------------ checks

/// The failed checks of a test, reported together at its end.
#[derive(Default)]
pub(crate) struct Checks {
    pub(crate) cases: usize,
    pub(crate) fails: Vec<String>,
}

impl Checks {
    pub(crate) fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fails.push(what());
        }
    }

    pub(crate) fn result(&mut self, ctx: &str, r: Result<(), String>) {
        if let Err(e) = r {
            self.fails.push(format!("{ctx}: {e}"));
        }
    }

    pub(crate) fn finish(self, name: &str) {
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
pub(crate) fn render(r: &Raw) -> String {
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
pub(crate) fn same_as_unknown(
    a: &Raw,
    u: &Raw,
    real: &str,
    spelled: &str,
    unknown_spelled: &str,
) -> bool {
    let mut m = render(a);
    if !spelled.is_empty() {
        m = m.replace(spelled, unknown_spelled);
    }
    if !real.is_empty() {
        m = m.replace(real, UNKNOWN);
    }
    m == render(u)
}

pub(crate) fn clip(s: &str) -> String {
    s.chars().take(300).collect()
}

/// E2B's error: `status` with `{"code": status, "message": "…"}` (JSON).
pub(crate) fn e2b_error(r: &Raw, status: u16) -> Result<(), String> {
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
pub(crate) fn connect_http(code: &str) -> u16 {
    match code {
        "invalid_argument" | "failed_precondition" => 400,
        "unauthenticated" => 401,
        "permission_denied" => 403,
        "not_found" => 404,
        "unavailable" => 503,
        _ => 500,
    }
}

pub(crate) fn connect_error_object(v: &Value, code: &str) -> bool {
    v.as_object().is_some_and(|o| o.len() == 2)
        && v["code"] == code
        && v["message"].as_str().is_some_and(|m| !m.is_empty())
}

/// envd's error `code` in the protocol of the route.
pub(crate) fn envd_error(proto: Proto, r: &Raw, code: &str) -> Result<(), String> {
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
pub(crate) fn entry(
    e: &Value,
    actor: &str,
    tenant: &str,
    sandbox: Option<&str>,
    kind: &str,
) -> bool {
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

/// How a route answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proto {
    /// Connect unary (JSON).
    Unary,
    /// Connect server stream (envelopes).
    Stream,
    /// `/files`: E2B's HTTP errors.
    Files,
    /// `/health`: 204, or 502 in E2B's shape.
    Health,
}

// ----------------------------------------------------------------- callers

/// What a caller may do on the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Admins, developers, the E2B key.
    Write,
    /// Approvers and viewers: `GET` only.
    Read,
    /// A metrics token: nothing (403).
    Metrics,
    /// No key, a wrong key, a forged token: 401.
    Unauth,
}

pub(crate) struct Who {
    pub(crate) name: String,
    pub(crate) key: Option<String>,
    /// The tenant its own sandboxes belong to (acme for the unauthenticated).
    pub(crate) tenant: &'static str,
    pub(crate) actor: String,
    pub(crate) access: Access,
}

pub(crate) async fn callers(d: &Door) -> Vec<Who> {
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
