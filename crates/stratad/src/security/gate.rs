//! The tool-call gate: one decision path for every front end (stratad's `/v1`
//! routes and the E2B API). Evaluate the call against the policy layers in
//! force, append the decision to the audit log, and for `approve` hold the
//! call in the approval queue until an approver answers, the wait times out,
//! or (when the client does not wait) answer that it is pending.

use std::sync::Arc;
use std::time::Duration;

use strata_policy::approval::{ApprovalRequest, ApprovalStatus, Outcome as WaitOutcome};
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
    /// runs once if that approval is approved and unused.
    pub approval: Option<String>,
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
            .map_err(GateRefusal::Internal)
    }

    /// Decides `call`: `Ok` when it may run (allowed, or approved). Every
    /// decision is in the audit log before this returns.
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
            Effect::Approve => match opts.approval {
                Some(id) => self.run_approved(call, d, id).await,
                None => self.hold(call, d, opts).await,
            },
        }
    }

    /// A re-sent call with the id of its approval: runs once.
    async fn run_approved(
        self: &Arc<Self>,
        call: ToolCall,
        d: Decision,
        id: String,
    ) -> Result<(), GateRefusal> {
        let same_call = match self.approvals().get(&call.tenant, &id) {
            Ok(r) => {
                matches!(r.status, ApprovalStatus::Approved { .. })
                    && r.call.kind == call.kind
                    && r.call.sandbox == call.sandbox
            }
            Err(_) => false,
        };
        let store = self.store().clone();
        let id2 = id.clone();
        let fresh = same_call
            && tokio::task::spawn_blocking(move || store.consume_approval(&id2))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or(false);
        if !fresh {
            return Err(GateRefusal::denied(
                &d,
                Some(&id),
                format!("approval {id} is not an unused approval of this call"),
            ));
        }
        self.record_blocking(&call, &d, Outcome::Allowed, Some(id))
            .await
    }

    /// Holds the call for an approver.
    async fn hold(
        self: &Arc<Self>,
        call: ToolCall,
        d: Decision,
        opts: GateOptions,
    ) -> Result<(), GateRefusal> {
        let q = self.approvals().clone();
        let (call2, d2) = (call.clone(), d.clone());
        let req = tokio::task::spawn_blocking(move || q.request(&call2, &d2))
            .await
            .map_err(|e| GateRefusal::Internal(e.to_string()))?
            .map_err(|e| GateRefusal::Internal(e.to_string()))?;
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
        match self.approvals().wait(&call.tenant, &req.id, timeout).await {
            Ok(WaitOutcome::Approved { .. }) => {
                let store = self.store().clone();
                let id = req.id.clone();
                let _ = tokio::task::spawn_blocking(move || store.consume_approval(&id)).await;
                Ok(())
            }
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
            Err(e) => Err(GateRefusal::Internal(e.to_string())),
        }
    }
}
