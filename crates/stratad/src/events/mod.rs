//! Humans in the loop: the event stream and approval notifications
//! (docs/events.md).
//!
//! The store's journal is the source of truth. Besides sandbox transitions
//! (written by `service::journal`) it holds snapshots taken and pruned
//! (written by the store with the snapshot row), approvals requested and
//! answered, and policy decisions that refused or held a call (written by
//! [`JournalSink`], which the security subsystem calls after each audited
//! decision). Every entry has one `seq` in one space.
//!
//! - [`stream`]: `GET /v1/events` and `GET /v1/sandboxes/:id/events` as
//!   server-sent events: the backlog after a cursor read from the store,
//!   then live (woken by the store after each commit, read again from the
//!   store by seq). Bounded: streams per tenant, messages buffered per
//!   stream; a consumer that does not read is disconnected.
//! - [`webhooks`]: per-tenant webhooks, their deliveries queued in the
//!   store in the same transaction as the entry, signed, retried with
//!   backoff, sent only to public addresses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use strata_policy::approval::ApprovalRequest;
use strata_policy::audit::Outcome;
use strata_policy::{CallKind, Decision, ToolCall};

use crate::duration::serde_human;
use crate::store::{JournalKind, JournalNote, Store};

pub mod stream;
pub mod webhooks;

/// `[events]`: the journal's retention and the event streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// Journal entries older than this are deleted by the GC sweep (so are
    /// finished webhook deliveries); `0s`: kept for ever.
    #[serde(with = "serde_human")]
    pub keep: Duration,
    /// Event streams open at once per tenant; more are refused (`429`).
    pub max_streams_per_tenant: usize,
    /// A comment line is sent this often on an idle stream.
    #[serde(with = "serde_human")]
    pub heartbeat: Duration,
    /// Messages buffered per stream for a consumer that reads slowly.
    pub buffer: usize,
    /// A stream whose buffer stays full this long is closed (the
    /// consumer resumes with `Last-Event-ID`).
    #[serde(with = "serde_human")]
    pub slow_consumer_timeout: Duration,
    /// Policy refusals journaled per sandbox at once; beyond, they are
    /// counted into the next one journaled (`count`).
    pub policy_burst: u32,
    /// Policy refusals journaled per sandbox per minute, sustained.
    pub policy_per_minute: u32,
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            keep: Duration::from_secs(7 * 24 * 3600),
            max_streams_per_tenant: 16,
            heartbeat: Duration::from_secs(15),
            buffer: 256,
            slow_consumer_timeout: Duration::from_secs(30),
            policy_burst: 20,
            policy_per_minute: 60,
        }
    }
}

/// `[webhooks]`: approval notifications.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhooksConfig {
    /// FOR TESTS ONLY: addresses (IP literals) a webhook may target even
    /// though they are loopback or private, e.g. `["127.0.0.1"]` for a
    /// receiver in the test. Empty in production.
    pub allow_private: Vec<String>,
    /// Webhooks per tenant.
    pub max_per_tenant: usize,
    /// Deliveries pending per tenant; more events are not queued (logged).
    pub max_queued_per_tenant: usize,
    /// Attempts per delivery before it is marked failed.
    pub max_attempts: u32,
    /// Wait before the second attempt; doubled each time (with jitter).
    #[serde(with = "serde_human")]
    pub retry_base: Duration,
    /// Longest wait between two attempts.
    #[serde(with = "serde_human")]
    pub retry_max: Duration,
    /// One attempt's timeout (connect, send, answer).
    #[serde(with = "serde_human")]
    pub timeout: Duration,
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        WebhooksConfig {
            allow_private: Vec::new(),
            max_per_tenant: 10,
            max_queued_per_tenant: 1000,
            max_attempts: 8,
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(600),
            timeout: Duration::from_secs(10),
        }
    }
}

/// `[console]`: where humans reach the web console.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// The console's base URL as seen by the people a webhook notifies
    /// (`https://strata.example.com`); unset: `http://<listen>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
}

impl crate::config::Config {
    /// The base URL of links to the console (no trailing `/`).
    pub fn console_base_url(&self) -> String {
        match &self.console.base_url {
            Some(u) => u.trim_end_matches('/').to_owned(),
            None => format!("http://{}", self.listen),
        }
    }
}

/// Open streams per tenant (`[events] max_streams_per_tenant`).
#[derive(Debug, Default)]
pub struct Hub {
    streams: Arc<Mutex<HashMap<String, usize>>>,
}

/// One open stream; dropping it frees its place.
#[derive(Debug)]
pub struct StreamSlot {
    streams: Arc<Mutex<HashMap<String, usize>>>,
    tenant: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut m = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.tenant);
            }
        }
    }
}

impl Hub {
    /// A place for one more stream of `tenant`, unless it has `max`.
    pub fn open(&self, tenant: &str, max: usize) -> Option<StreamSlot> {
        let mut m = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(tenant.to_owned()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(StreamSlot {
            streams: self.streams.clone(),
            tenant: tenant.to_owned(),
        })
    }

    /// Streams of `tenant` open now.
    pub fn open_streams(&self, tenant: &str) -> usize {
        let m = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        m.get(tenant).copied().unwrap_or(0)
    }
}

/// One line describing a tool call (`exec rm -rf /`, `file_write /etc/x`,
/// `egress POST api.x.com:443/path`): guest- or agent-written, to be shown
/// escaped.
pub fn summarize(kind: &CallKind) -> String {
    match kind {
        CallKind::Exec { argv, shell, .. } => match shell {
            Some(sh) => format!("exec sh -c {sh:?}"),
            None => format!("exec {}", argv.join(" ")),
        },
        CallKind::FileRead { path } => format!("file_read {path}"),
        CallKind::FileWrite { path } => format!("file_write {path}"),
        CallKind::Egress {
            host,
            port,
            method,
            path,
            ..
        } => format!("egress {method} {host}:{port}{path}"),
        CallKind::Lifecycle { op } => format!("lifecycle {op}"),
        CallKind::Port { port, .. } => format!("port {port}"),
        CallKind::Mcp {
            connector, tool, ..
        } => format!("mcp {connector} {tool}"),
        other => serde_json::to_value(other)
            .ok()
            .and_then(|v| v.get("kind").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_default(),
    }
}

/// The kind name of a call (`exec`, `file_write`, …).
fn call_kind(kind: &CallKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.get("kind").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_default()
}

/// A token bucket per sandbox: policy refusals journaled at most
/// `burst` at once and `per_minute` sustained; the ones over are counted
/// into the next journaled one.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    suppressed: u64,
}

/// Writes approvals and policy decisions to the journal (called by the
/// security subsystem after each audited decision, on the blocking pool).
pub struct JournalSink {
    store: Arc<dyn Store>,
    burst: f64,
    per_sec: f64,
    buckets: Mutex<HashMap<(String, String), Bucket>>,
}

impl std::fmt::Debug for JournalSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalSink").finish_non_exhaustive()
    }
}

/// Most buckets kept; full ones are forgotten first.
const MAX_BUCKETS: usize = 10_000;

impl JournalSink {
    /// A sink over `store` with `[events]`'s policy bounds.
    pub fn new(store: Arc<dyn Store>, cfg: &EventsConfig) -> Self {
        JournalSink {
            store,
            burst: f64::from(cfg.policy_burst.max(1)),
            per_sec: f64::from(cfg.policy_per_minute) / 60.0,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a policy refusal of `(tenant, sandbox)` is journaled now;
    /// `Some(n)`: yes, standing for `n` refusals (itself and those not
    /// journaled since).
    fn admit(&self, tenant: &str, sandbox: &str) -> Option<u64> {
        let now = Instant::now();
        let mut m = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= MAX_BUCKETS {
            let (burst, per_sec) = (self.burst, self.per_sec);
            m.retain(|_, b| {
                b.suppressed > 0
                    || b.tokens + now.duration_since(b.at).as_secs_f64() * per_sec < burst
            });
        }
        let b = m
            .entry((tenant.to_owned(), sandbox.to_owned()))
            .or_insert(Bucket {
                tokens: self.burst,
                at: now,
                suppressed: 0,
            });
        b.tokens =
            (b.tokens + now.duration_since(b.at).as_secs_f64() * self.per_sec).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            let n = b.suppressed + 1;
            b.suppressed = 0;
            Some(n)
        } else {
            b.suppressed += 1;
            None
        }
    }

    /// Journals an audited decision: a held call (`approval requested`),
    /// an answer (`approval answered`), a refusal or time-out (`policy`,
    /// bounded per sandbox). `req` is the approval request when there is
    /// one. Failures are logged: the decision stands and is in the audit log.
    pub fn decided(
        &self,
        call: &ToolCall,
        d: &Decision,
        outcome: Outcome,
        req: Option<&ApprovalRequest>,
        by: Option<&str>,
    ) {
        let sandbox = call.sandbox.clone().unwrap_or_default();
        let base = |kind, topic: &str, data: Value| JournalNote {
            at: Utc::now(),
            tenant: call.tenant.clone(),
            sandbox_id: sandbox.clone(),
            kind,
            topic: topic.to_owned(),
            data,
        };
        let note = match (outcome, req) {
            (Outcome::Held, Some(r)) => base(
                JournalKind::Approval,
                "approval.requested",
                json!({
                    "action": "requested",
                    "approval_id": r.id,
                    "tool": call_kind(&call.kind),
                    "summary": summarize(&call.kind),
                    "call": call.kind,
                    "body_bytes": r.body.as_ref().map(|b| b.bytes),
                    "rule": r.rule_id,
                    "reason": r.reason,
                    "requested_by": r.requested_by,
                    "expires_at": r.expires_at,
                }),
            ),
            (Outcome::Approved | Outcome::Rejected, Some(r)) => base(
                JournalKind::Approval,
                "approval.answered",
                json!({
                    "action": "answered",
                    "approval_id": r.id,
                    "decision": if outcome == Outcome::Approved { "approved" } else { "denied" },
                    "by": by,
                    "reason": r.reason,
                    "tool": call_kind(&call.kind),
                    "summary": summarize(&call.kind),
                }),
            ),
            (Outcome::Denied | Outcome::TimedOut, _) => {
                let Some(count) = self.admit(&call.tenant, &sandbox) else {
                    return;
                };
                base(
                    JournalKind::Policy,
                    "policy",
                    json!({
                        "decision": if outcome == Outcome::TimedOut { "timed_out" } else { "denied" },
                        "rule": d.rule_id,
                        "reason": d.reason,
                        "tool": call_kind(&call.kind),
                        "summary": summarize(&call.kind),
                        "approval_id": req.map(|r| r.id.clone()),
                        "count": count,
                    }),
                )
            }
            _ => return,
        };
        if let Err(e) = self.store.append_journal(&note) {
            tracing::warn!(error = %e, topic = %note.topic, "journaling a decision failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;
    use strata_policy::Effect;

    fn denied_call(sandbox: &str) -> (ToolCall, Decision) {
        let call = ToolCall {
            tenant: "acme".into(),
            sandbox: Some(sandbox.into()),
            actor: "sandbox:x".into(),
            kind: CallKind::FileRead {
                path: "/etc/shadow".into(),
            },
        };
        let d = Decision {
            effect: Effect::Deny,
            layer: None,
            rule_id: "no-secrets".into(),
            rule_index: None,
            hard: true,
            reason: "secrets".into(),
        };
        (call, d)
    }

    #[test]
    fn refusals_are_bounded_per_sandbox_and_counted_into_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("db"), 1).unwrap());
        let cfg = EventsConfig {
            policy_burst: 5,
            policy_per_minute: 0,
            ..EventsConfig::default()
        };
        let sink = JournalSink::new(store.clone(), &cfg);
        let (call, d) = denied_call("sb-a");
        for _ in 0..1000 {
            sink.decided(&call, &d, Outcome::Denied, None, None);
        }
        let rows = store.journal_after("acme", None, 0, 10_000).unwrap();
        assert_eq!(rows.len(), 5, "a thousand refusals write the burst only");
        let m = rows[0].message();
        assert_eq!(m["kind"], "policy");
        assert_eq!(m["decision"], "denied");
        assert_eq!(m["summary"], "file_read /etc/shadow");
        // Another sandbox has its own bucket.
        let (other, _) = denied_call("sb-b");
        sink.decided(&other, &d, Outcome::Denied, None, None);
        assert_eq!(
            store.journal_after("acme", None, 0, 10_000).unwrap().len(),
            6
        );

        // Refilled: the next one journaled stands for those not written.
        let cfg = EventsConfig {
            policy_burst: 1,
            policy_per_minute: 600,
            ..EventsConfig::default()
        };
        let sink = JournalSink::new(store.clone(), &cfg);
        let (call, d) = denied_call("sb-c");
        for _ in 0..10 {
            sink.decided(&call, &d, Outcome::Denied, None, None);
        }
        std::thread::sleep(Duration::from_millis(150));
        sink.decided(&call, &d, Outcome::Denied, None, None);
        let c: Vec<Value> = store
            .journal_after("acme", Some("sb-c"), 0, 100)
            .unwrap()
            .iter()
            .map(|e| e.message())
            .collect();
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c[0]["count"], 1);
        assert_eq!(c[1]["count"], 10, "9 unwritten + itself");
    }
}
