//! The tool-call gate: one decision path for every front end (stratad's `/v1`
//! routes and the E2B API). Evaluate the call against the policy layers in
//! force, append the decision to the audit log, and for `approve` hold the
//! call in the approval queue until an approver answers, the wait times out,
//! or (when the client does not wait) answer that it is pending.

use std::sync::Arc;
use std::time::Duration;

use strata_policy::approval::{ApprovalError, ApprovalRequest, BodyDigest, Outcome as WaitOutcome};
use strata_policy::audit::Outcome;
use strata_policy::{Decision, Effect, ToolCall};

use super::Security;

/// The decision point of tool calls the service consults
/// ([`crate::service::Service::authorize`]): the daemon's
/// [`Security`] in production, [`ClosedGate`] when the security subsystem
/// failed to open (fail closed), [`OpenGate`] for embedders and tests that
/// run without one.
#[async_trait::async_trait]
pub trait ToolGate: Send + Sync + std::fmt::Debug {
    /// `Ok` when the call may run now; every decision is audited first.
    async fn check(&self, call: ToolCall, opts: GateOptions) -> Result<(), GateRefusal>;

    /// Whether the policy would hold `call` for an approver now (nothing is
    /// audited): a front door then reads the bytes the call carries first
    /// (an upload's content), so the approval is bound to them
    /// ([`GateOptions::body`]). A gate without approvals holds nothing.
    fn holds(&self, call: &ToolCall) -> bool {
        let _ = call;
        false
    }

    /// Decides a call that is audited once, when it ends ([`ToolGate::close`]:
    /// a port connection, with its byte counts): a refusal is audited at
    /// once; `Ok(Some(decision))` is to be handed to `close`. The default
    /// audits at once, like [`ToolGate::check`] (`Ok(None)`: nothing later).
    async fn open(
        &self,
        call: ToolCall,
        opts: GateOptions,
    ) -> Result<Option<Decision>, GateRefusal> {
        self.check(call, opts).await.map(|()| None)
    }

    /// Appends the one audit entry of a call [`ToolGate::open`] allowed.
    async fn close(&self, call: ToolCall, decision: Decision) -> Result<(), String> {
        let _ = (call, decision);
        Ok(())
    }

    /// Gives fork `to` of tenant `tenant` the sandbox policy layer of `from`
    /// before the fork runs (a gate without layers has nothing to copy).
    async fn inherit_layer(&self, tenant: &str, from: &str, to: &str) -> Result<(), String> {
        let _ = (tenant, from, to);
        Ok(())
    }

    /// Makes `sandbox` a template builder whose egress reaches `hosts`
    /// and nothing else (`Policies::make_builder`); a gate without layers
    /// keeps nothing.
    async fn make_builder(
        &self,
        tenant: &str,
        sandbox: &str,
        hosts: &[String],
    ) -> Result<(), String> {
        let _ = (tenant, sandbox, hosts);
        Ok(())
    }

    /// `sandbox`'s build is over.
    fn end_builder(&self, sandbox: &str) {
        let _ = sandbox;
    }
}

/// The daemon's gate: [`Security::gate`].
#[derive(Debug, Clone)]
pub struct SecurityGate(pub Arc<Security>);

#[async_trait::async_trait]
impl ToolGate for SecurityGate {
    async fn check(&self, call: ToolCall, opts: GateOptions) -> Result<(), GateRefusal> {
        self.0.gate(call, opts).await
    }

    fn holds(&self, call: &ToolCall) -> bool {
        self.0.evaluate(call).effect == Effect::Approve
    }

    async fn inherit_layer(&self, tenant: &str, from: &str, to: &str) -> Result<(), String> {
        let (sec, t, f, to) = (
            self.0.clone(),
            tenant.to_owned(),
            from.to_owned(),
            to.to_owned(),
        );
        tokio::task::spawn_blocking(move || sec.policies().inherit_sandbox(&t, &f, &to))
            .await
            .map_err(|e| format!("copying the policy layer: {e}"))?
    }

    async fn make_builder(
        &self,
        tenant: &str,
        sandbox: &str,
        hosts: &[String],
    ) -> Result<(), String> {
        let (sec, t, s, hosts) = (
            self.0.clone(),
            tenant.to_owned(),
            sandbox.to_owned(),
            hosts.to_vec(),
        );
        tokio::task::spawn_blocking(move || {
            sec.policies()
                .make_builder(&t, &s, &hosts, "strata:template-build")
        })
        .await
        .map_err(|e| format!("writing the builder's policy: {e}"))?
    }

    fn end_builder(&self, sandbox: &str) {
        self.0.policies().end_builder(sandbox);
    }

    async fn open(
        &self,
        call: ToolCall,
        opts: GateOptions,
    ) -> Result<Option<Decision>, GateRefusal> {
        let d = self.0.evaluate(&call);
        if d.effect == Effect::Allow {
            // Audited when it closes.
            return Ok(Some(d));
        }
        // Denied or held: decided (and audited) as any call.
        self.0.gate(call, opts).await.map(|()| Some(d))
    }

    async fn close(&self, call: ToolCall, decision: Decision) -> Result<(), String> {
        let sec = self.0.clone();
        tokio::task::spawn_blocking(move || {
            sec.record(&call, &decision, Outcome::Allowed, None, None)
        })
        .await
        .map_err(|e| format!("audit: {e}"))?
        .map_err(|r| match r {
            GateRefusal::Internal(m) | GateRefusal::Full(m) => m,
            other => format!("{other:?}"),
        })
    }
}

/// Refuses every call (the security subsystem is unavailable).
#[derive(Debug, Clone)]
pub struct ClosedGate(pub String);

#[async_trait::async_trait]
impl ToolGate for ClosedGate {
    async fn check(&self, _: ToolCall, _: GateOptions) -> Result<(), GateRefusal> {
        Err(GateRefusal::Internal(format!(
            "security subsystem unavailable: {}",
            self.0
        )))
    }
}

/// Allows every call without policy or audit: only for embedders that run
/// a service without a security subsystem (tests, benchmarks).
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenGate;

#[async_trait::async_trait]
impl ToolGate for OpenGate {
    async fn check(&self, _: ToolCall, _: GateOptions) -> Result<(), GateRefusal> {
        Ok(())
    }
}

/// How a held call is handled.
#[derive(Debug, Clone, Default)]
pub struct GateOptions {
    /// Wait for an approver (else a held call is refused as
    /// [`GateRefusal::Pending`] at once, to be re-sent with `approval`).
    pub wait: bool,
    /// How long to wait, capped by the configuration's maximum (default: the
    /// configured approval timeout).
    pub timeout: Option<Duration>,
    /// The id of an approval granted earlier for this same call: the call
    /// runs once if that approval is approved, unused, unexpired, was asked
    /// for by the same caller and is bound to the same request (call and
    /// body, [`strata_policy::approval::request_digest`]).
    pub approval: Option<String>,
    /// The bytes the call carries (an upload's content, an exec's stdin),
    /// digested by the service from the bytes the action will use, never
    /// taken from the client: a held call's approval is bound to them and
    /// shows them to the approver.
    pub body: Option<BodyDigest>,
}

impl GateOptions {
    /// Wait for an approver, with the configured timeout.
    pub fn waiting() -> Self {
        GateOptions {
            wait: true,
            ..Default::default()
        }
    }
}

/// Why the gate refused a call.
#[derive(Debug, Clone)]
pub enum GateRefusal {
    /// A malformed call (relative path, `..` above `/`, empty argv).
    Invalid(String),
    /// Denied: by a rule, by an approver, or because nobody answered in time.
    Denied {
        /// The decision that held or denied the call.
        decision: Decision,
        /// The approval request involved, if any.
        approval_id: Option<String>,
        /// Message for the client (names the rule).
        message: String,
    },
    /// Held for approval and the client does not wait.
    Pending(Box<ApprovalRequest>),
    /// The audit log or the approval queue failed: fail closed.
    Internal(String),
    /// The audit log's file system is full (the data dir): fail closed
    /// with `507 store_full`; the call can succeed once space is freed.
    Full(String),
}

/// Rule ids of the gate's own refusals of an approval (with no policy
/// layer): the `rule` of a `policy_denied` answer, except
/// [`APPROVAL_LIMIT`], answered `429 rate_limited`.
pub mod approval_rules {
    /// Too many pending requests on the sandbox: nothing was recorded.
    pub const APPROVAL_LIMIT: &str = "approval-limit";
    /// The approval was granted for another request (call or body).
    pub const MISMATCH: &str = "approval-mismatch";
    /// The approval was asked for by another caller.
    pub const REQUESTER: &str = "approval-requester";
    /// The approval was used already (by a waiter or a re-submission).
    pub const USED: &str = "approval-used";
    /// The approval expired before it was used.
    pub const EXPIRED: &str = "approval-expired";
    /// The request is pending, denied or timed out.
    pub const NOT_APPROVED: &str = "approval-not-approved";
    /// No such approval (or another tenant's).
    pub const UNKNOWN: &str = "approval-unknown";
}

/// Whether `call` creates a sandbox.
fn is_create(call: &ToolCall) -> bool {
    matches!(&call.kind, strata_policy::CallKind::Lifecycle { op } if op == "create")
}

/// Whether `d` is the gate's refusal of a held call because the sandbox
/// has too many pending requests (answered `429 rate_limited`).
pub fn is_approval_limit(d: &Decision) -> bool {
    d.layer.is_none() && d.effect == Effect::Deny && d.rule_id == approval_rules::APPROVAL_LIMIT
}

/// The gate's refusal of approval `id` for the call `held` held, with the
/// decision it is audited with; `None` for a store failure (fail closed as
/// [`GateRefusal::Internal`]).
fn approval_refusal(
    held: &Decision,
    id: Option<&str>,
    e: &ApprovalError,
) -> Option<(Decision, GateRefusal)> {
    use approval_rules::*;
    let rule = match e {
        ApprovalError::TooManyPending { .. } => APPROVAL_LIMIT,
        ApprovalError::Mismatch { .. } => MISMATCH,
        ApprovalError::OtherRequester => REQUESTER,
        ApprovalError::Used => USED,
        ApprovalError::Expired(_) => EXPIRED,
        ApprovalError::NotApproved { .. } | ApprovalError::AlreadyAnswered { .. } => NOT_APPROVED,
        ApprovalError::NotFound => UNKNOWN,
        ApprovalError::SelfApproval | ApprovalError::Store(_) => return None,
    };
    let what = match id {
        Some(id) => format!("approval {id}"),
        None => "a new approval request".to_owned(),
    };
    let message = format!(
        "policy rule `{}` holds this call: {what} refused: {e}",
        held.rule_id
    );
    let d = Decision {
        effect: Effect::Deny,
        layer: None,
        rule_id: rule.to_owned(),
        rule_index: None,
        hard: true,
        reason: e.to_string(),
    };
    let r = GateRefusal::denied(&d, id, message);
    Some((d, r))
}

impl GateRefusal {
    fn denied(d: &Decision, approval_id: Option<&str>, message: String) -> Self {
        GateRefusal::Denied {
            decision: d.clone(),
            approval_id: approval_id.map(str::to_owned),
            message,
        }
    }
}

impl Security {
    async fn record_blocking(
        self: &Arc<Self>,
        call: &ToolCall,
        d: &Decision,
        outcome: Outcome,
        approval_id: Option<String>,
    ) -> Result<(), GateRefusal> {
        let (sec, call, d) = (self.clone(), call.clone(), d.clone());
        tokio::task::spawn_blocking(move || sec.record(&call, &d, outcome, approval_id, None))
            .await
            .map_err(|e| GateRefusal::Internal(format!("audit: {e}")))?
    }

    /// Decides `call`: `Ok` when it may run (allowed, or approved). Every
    /// decision is in the audit log before this returns, but for a create
    /// an API-only process would hold: it passes, and the host it is sent
    /// to decides and audits it.
    pub async fn gate(
        self: &Arc<Self>,
        call: ToolCall,
        opts: GateOptions,
    ) -> Result<(), GateRefusal> {
        let d = self.evaluate(&call);
        match d.effect {
            Effect::Allow => {
                self.record_blocking(&call, &d, Outcome::Allowed, None)
                    .await
            }
            Effect::Deny if d.rule_id == "invalid-call" && d.layer.is_none() => {
                self.record_blocking(&call, &d, Outcome::Denied, None)
                    .await?;
                Err(GateRefusal::Invalid(format!(
                    "invalid tool call: {}",
                    d.reason
                )))
            }
            Effect::Deny => {
                self.record_blocking(&call, &d, Outcome::Denied, None)
                    .await?;
                Err(GateRefusal::denied(
                    &d,
                    None,
                    format!("denied by policy rule `{}`: {}", d.rule_id, d.reason),
                ))
            }
            // An API-only process never runs a create: it places it and
            // sends it to a host, whose gate decides the same call again
            // (same caller, same query) and holds it there or takes its
            // `approval=`. Holding it here too asked for two approvals of
            // one create (and used the approval a re-submission names
            // before the host could). The host audits the decision.
            Effect::Approve if self.api_only && is_create(&call) => Ok(()),
            Effect::Approve => match opts.approval.clone() {
                Some(id) => self.run_approved(call, d, id, opts.body).await,
                None => self.hold(call, d, opts).await,
            },
        }
    }

    /// A re-sent call with the id of its approval: runs once, when the
    /// approval is this caller's, for this very request (call and body),
    /// approved, unused and unexpired ([`ApprovalQueue::take`], atomic).
    /// A refusal is audited and changes nothing.
    ///
    /// [`ApprovalQueue::take`]: strata_policy::approval::ApprovalQueue::take
    async fn run_approved(
        self: &Arc<Self>,
        call: ToolCall,
        d: Decision,
        id: String,
        body: Option<BodyDigest>,
    ) -> Result<(), GateRefusal> {
        let (q, call2, id2) = (self.approvals().clone(), call.clone(), id.clone());
        let shared = self.shared();
        let taken = tokio::task::spawn_blocking(move || {
            // Answered (or held) through another process sharing the store:
            // learn it first.
            if shared {
                q.sync(&id2)?;
            }
            Ok::<_, ApprovalError>(q.take(&call2.tenant, &id2, &call2, body.as_ref()))
        })
        .await
        .map_err(|e| GateRefusal::Internal(format!("approval: {e}")))?
        .map_err(|e| GateRefusal::Internal(format!("approval: {e}")))?;
        match taken {
            Ok(_) => {
                self.record_blocking(&call, &d, Outcome::Allowed, Some(id))
                    .await
            }
            Err(e) => Err(self.refuse_approval(&call, &d, Some(&id), e).await),
        }
    }

    /// Audits and returns the refusal of approval `id` (or of a new request).
    async fn refuse_approval(
        self: &Arc<Self>,
        call: &ToolCall,
        held: &Decision,
        id: Option<&str>,
        e: ApprovalError,
    ) -> GateRefusal {
        let Some((d, refusal)) = approval_refusal(held, id, &e) else {
            return GateRefusal::Internal(e.to_string());
        };
        match self
            .record_blocking(call, &d, Outcome::Denied, id.map(str::to_owned))
            .await
        {
            Ok(()) => refusal,
            Err(r) => r,
        }
    }

    /// Reads approval `id` from the shared store every
    /// [`super::SHARED_APPROVAL_POLL`] until it is no longer pending here
    /// (an answer written by another process wakes the waiter). The caller
    /// aborts it when the wait ends.
    fn poll_approval(self: &Arc<Self>, id: String) -> tokio::task::JoinHandle<()> {
        let q = self.approvals().clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(super::SHARED_APPROVAL_POLL).await;
                let (q2, id2) = (q.clone(), id.clone());
                match tokio::task::spawn_blocking(move || q2.sync(&id2)).await {
                    Ok(Ok(true)) => {}
                    Ok(Ok(false)) => return,
                    Ok(Err(e)) => {
                        tracing::warn!(approval = %id, error = %e, "reading a held call's approval")
                    }
                    Err(_) => return,
                }
            }
        })
    }

    /// Holds the call for an approver.
    async fn hold(
        self: &Arc<Self>,
        call: ToolCall,
        d: Decision,
        opts: GateOptions,
    ) -> Result<(), GateRefusal> {
        let q = self.approvals().clone();
        let (call2, d2, body) = (call.clone(), d.clone(), opts.body.clone());
        let req = match tokio::task::spawn_blocking(move || q.request_with(&call2, &d2, body))
            .await
            .map_err(|e| GateRefusal::Internal(e.to_string()))?
        {
            Ok(req) => req,
            Err(e) => return Err(self.refuse_approval(&call, &d, None, e).await),
        };
        self.record_blocking(&call, &d, Outcome::Held, Some(req.id.clone()))
            .await?;
        tracing::info!(approval = %req.id, rule = %d.rule_id, "call held for approval");
        if !opts.wait {
            return Err(GateRefusal::Pending(Box::new(req)));
        }
        let cfg = self.config();
        let timeout = opts
            .timeout
            .unwrap_or(cfg.approval_timeout)
            .min(cfg.max_approval_timeout);
        // An answer given through another process (a cluster's API process
        // or host) is written to the shared store: read it from there.
        let poll = self.shared().then(|| self.poll_approval(req.id.clone()));
        // `Approved` only when this waiter used the approval: one that a
        // re-submission (or another waiter) used first is a denial.
        let waited = self.approvals().wait(&call.tenant, &req.id, timeout).await;
        if let Some(p) = poll {
            p.abort();
        }
        match waited {
            Ok(WaitOutcome::Approved { .. }) => Ok(()),
            Ok(WaitOutcome::Denied { by, .. }) => Err(GateRefusal::denied(
                &d,
                Some(&req.id),
                format!(
                    "policy rule `{}` holds this call: approval {} denied by {by}",
                    d.rule_id, req.id
                ),
            )),
            Ok(WaitOutcome::TimedOut) => {
                self.record_blocking(&call, &d, Outcome::TimedOut, Some(req.id.clone()))
                    .await?;
                Err(GateRefusal::denied(
                    &d,
                    Some(&req.id),
                    format!(
                        "policy rule `{}` holds this call: approval {} not answered within {}s: denied",
                        d.rule_id,
                        req.id,
                        timeout.as_secs()
                    ),
                ))
            }
            Err(e) => Err(self.refuse_approval(&call, &d, Some(&req.id), e).await),
        }
    }
}
