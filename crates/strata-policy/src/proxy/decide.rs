//! Stage 3, HTTP policy: the tool call an egress request is (tenant,
//! sandbox, actor, connector, host, port, method, path), evaluated against
//! the policy in force; connectors and ports checked first; `approve`
//! decisions held on the approval queue; every decision in the audit log.
//! Plain requests get method-level policy, `CONNECT` host-level policy.

use super::http::{denied, refuse, Body};
use super::upstream::address_guard;
use super::ProxyConfig;
use crate::approval::Outcome as ApprovalOutcome;
use crate::audit::{AuditDecision, Outcome};
use crate::call::{CallKind, ToolCall};
use crate::policy::{parse_ip_literal, Decision, Effect};
use hyper::{Response, StatusCode};

/// One egress call under evaluation: the tool call and its destination.
pub(super) struct Checked {
    pub(super) call: ToolCall,
    pub(super) host: String,
    pub(super) port: u16,
    /// The connector lists `port` in its `tls_ports`: a tunnel there must
    /// carry TLS (set by [`decide`]).
    pub(super) tls_port: bool,
}

/// What the policy stage decided.
pub(super) enum Verdict {
    /// Go on to the upstream.
    Go,
    /// Answer the guest with this refusal.
    Refuse(Response<Body>),
}

impl Checked {
    /// The call of `cfg`'s sandbox to `host:port`.
    pub(super) fn new(
        cfg: &ProxyConfig,
        host: String,
        port: u16,
        method: &str,
        path: String,
        scheme: &str,
        tls: bool,
    ) -> Self {
        let call = ToolCall {
            tenant: cfg.tenant.clone(),
            sandbox: cfg.sandbox.clone(),
            actor: cfg.actor.clone(),
            kind: CallKind::Egress {
                connector: None,
                host: host.clone(),
                port,
                method: method.to_string(),
                path,
                scheme: scheme.into(),
                tls,
            },
        };
        Checked {
            call,
            host,
            port,
            tls_port: false,
        }
    }
}

/// Records a decision in the audit log (a denial may be aggregated, see
/// `AuditLog::record`). `false` when it could not be written: the caller
/// refuses the request (egress fails closed, like `/v1`).
#[must_use]
pub(super) fn record(
    cfg: &ProxyConfig,
    call: &ToolCall,
    d: &Decision,
    outcome: Outcome,
    approval: Option<String>,
    by: Option<String>,
) -> bool {
    record_secret(cfg, call, d, outcome, approval, by, None)
}

/// [`record`], naming the secret(s) the request hook will inject.
#[must_use]
fn record_secret(
    cfg: &ProxyConfig,
    call: &ToolCall,
    d: &Decision,
    outcome: Outcome,
    approval: Option<String>,
    by: Option<String>,
    secret: Option<String>,
) -> bool {
    let Some(a) = &cfg.audit else { return true };
    // An MCP call's arguments stay out of the log (their digest is kept).
    let call = &ToolCall {
        kind: call.kind.for_audit(),
        ..call.clone()
    };
    let mut ad = AuditDecision::from_decision(d, outcome, approval);
    ad.secret = secret;
    match a.record(call, ad, by) {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(error = %e, sandbox = ?call.sandbox, "audit write failed; egress request refused");
            false
        }
    }
}

/// How a held call ended ([`hold`]).
pub(super) enum Held {
    /// A human approved it: run it (once).
    Approved,
    /// Refused, timed out, or no approval queue; the approval's id when
    /// one was made.
    Refused(Option<String>),
    /// The decision could not be audited: refuse.
    Unaudited,
}

/// Holds `call` (decided `approve` by `d`) on the approval queue until a
/// human answers or the timeout, auditing the hold and its outcome; an
/// approved call's entry names `secret`, the secret(s) the request hook
/// will inject into it.
pub(super) async fn hold(
    cfg: &ProxyConfig,
    call: &ToolCall,
    d: &Decision,
    secret: Option<String>,
) -> Held {
    let Some(q) = &cfg.approvals else {
        let _ = record(cfg, call, d, Outcome::Denied, None, None);
        return Held::Refused(None);
    };
    let req = match q.request(call, d) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "approval request failed");
            let _ = record(cfg, call, d, Outcome::Denied, None, None);
            return Held::Refused(None);
        }
    };
    if !record(cfg, call, d, Outcome::Held, Some(req.id.clone()), None) {
        return Held::Unaudited;
    }
    let out = q.wait(&cfg.tenant, &req.id, cfg.approval_timeout).await;
    let (outcome, by) = match &out {
        Ok(ApprovalOutcome::Approved { by, .. }) => (Outcome::Approved, Some(by.clone())),
        Ok(ApprovalOutcome::Denied { by, .. }) => (Outcome::Rejected, Some(by.clone())),
        Ok(ApprovalOutcome::TimedOut) | Err(_) => (Outcome::TimedOut, None),
    };
    let secret = secret.filter(|_| outcome == Outcome::Approved);
    if !record_secret(cfg, call, d, outcome, Some(req.id.clone()), by, secret) {
        return Held::Unaudited;
    }
    if outcome == Outcome::Approved {
        Held::Approved
    } else {
        Held::Refused(Some(req.id))
    }
}

/// The answer to a request whose decision could not be audited.
pub(super) fn unaudited() -> Response<Body> {
    refuse(
        StatusCode::SERVICE_UNAVAILABLE,
        "audit_unavailable",
        serde_json::json!({
            "reason": "the decision could not be written to the audit log; request refused"
        }),
    )
}

/// A hard refusal the proxy makes before (or after) policy: `rule_id` and
/// `reason` go to the audit log and to the guest.
fn refusal(rule_id: &str, reason: String) -> Decision {
    Decision {
        effect: Effect::Deny,
        layer: None,
        rule_id: rule_id.into(),
        rule_index: None,
        hard: true,
        reason,
    }
}

/// Refuses a request the proxy will not put to policy (a method override,
/// a path it will not decode): audited with `rule_id`, answered with
/// `status` and `{error, rule, reason}`.
pub(super) fn refuse_request(
    cfg: &ProxyConfig,
    c: &mut Checked,
    status: StatusCode,
    error: &str,
    rule_id: &str,
    reason: String,
) -> Response<Body> {
    let policy = cfg.policy.current();
    let conn = match parse_ip_literal(&c.host) {
        Some(ip) => policy.connector_for_ip(ip).map(|(c, _)| c),
        None => policy.connector_for_host(&c.host),
    };
    if let CallKind::Egress { connector, .. } = &mut c.call.kind {
        *connector = conn.map(|c| c.name.clone());
    }
    let d = refusal(rule_id, reason);
    // Refused whether or not the entry is written.
    let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
    refuse(
        status,
        error,
        serde_json::json!({ "rule": d.rule_id, "reason": d.reason }),
    )
}

/// Records that an allowed tunnel was cut after its first bytes (no SNI,
/// another name, not TLS on a TLS port).
pub(super) fn record_cut(cfg: &ProxyConfig, call: &ToolCall, rule_id: &str, reason: String) {
    // The tunnel is cut whether or not the entry is written.
    let _ = record(
        cfg,
        call,
        &refusal(rule_id, reason),
        Outcome::Denied,
        None,
        None,
    );
}

/// Policy, connector and approval checks shared by plain requests and tunnels.
pub(super) async fn decide(cfg: &ProxyConfig, c: &mut Checked) -> Verdict {
    let policy = cfg.policy.current();
    let conn = match parse_ip_literal(&c.host) {
        // An address literal: a connector's range must hold it, and the
        // guard (never loopback, link-local, multicast or the host's own
        // addresses; private ones only from a range inside private space)
        // decides before any rule can allow it.
        Some(ip) => {
            let Some((conn, range)) = policy.connector_for_ip(ip) else {
                let d = Decision {
                    effect: Effect::Deny,
                    layer: None,
                    rule_id: "unlisted-address".into(),
                    rule_index: None,
                    hard: true,
                    reason: format!(
                        "`{ip}` is in no connector's `cidrs`; IP literals are refused by default"
                    ),
                };
                let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
                return Verdict::Refuse(refuse(
                    StatusCode::FORBIDDEN,
                    "ip_literal",
                    serde_json::json!({ "rule": d.rule_id, "reason": d.reason }),
                ));
            };
            if let Err(why) = address_guard(ip, &range) {
                let d = Decision {
                    effect: Effect::Deny,
                    layer: None,
                    rule_id: "address-guard".into(),
                    rule_index: None,
                    hard: true,
                    reason: why,
                };
                let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
                return Verdict::Refuse(denied(&d, None));
            }
            conn
        }
        None => match policy.connector_for_host(&c.host) {
            Some(conn) => conn,
            None => {
                let d = Decision {
                    effect: Effect::Deny,
                    layer: None,
                    rule_id: "unlisted-host".into(),
                    rule_index: None,
                    hard: true,
                    reason: format!(
                        "`{}` belongs to no connector; egress is closed by default",
                        c.host
                    ),
                };
                let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
                return Verdict::Refuse(denied(&d, None));
            }
        },
    };
    if let CallKind::Egress { connector, .. } = &mut c.call.kind {
        *connector = Some(conn.name.clone());
    }
    c.tls_port = conn.tls_ports.contains(&c.port);
    if !conn.ports.contains(&c.port) {
        let d = Decision {
            effect: Effect::Deny,
            layer: None,
            rule_id: "connector-port".into(),
            rule_index: None,
            hard: true,
            reason: format!("port {} is not open for connector `{}`", c.port, conn.name),
        };
        let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
        return Verdict::Refuse(denied(&d, None));
    }
    let d = policy.evaluate(&c.call);
    // The secret(s) an allowed request will carry, named in its entries.
    let secret = || {
        cfg.request_hook
            .as_ref()
            .and_then(|h| h.secrets_for(&c.call))
    };
    match d.effect {
        Effect::Allow => {
            if !record_secret(cfg, &c.call, &d, Outcome::Allowed, None, None, secret()) {
                return Verdict::Refuse(unaudited());
            }
            Verdict::Go
        }
        Effect::Deny => {
            let _ = record(cfg, &c.call, &d, Outcome::Denied, None, None);
            Verdict::Refuse(denied(&d, None))
        }
        Effect::Approve => match hold(cfg, &c.call, &d, secret()).await {
            Held::Approved => Verdict::Go,
            Held::Refused(id) => Verdict::Refuse(denied(&d, id.as_deref())),
            Held::Unaudited => Verdict::Refuse(unaudited()),
        },
    }
}
