//! The journal beyond sandbox transitions, and the webhooks that carry
//! parts of it out (store schema 14).
//!
//! Every entry of the journal has one `seq` (the store assigns it, in one
//! space for every kind), so one cursor resumes everything. A transition is
//! kind `sandbox` (the [`super::Event`] columns); the other kinds keep their
//! fields as JSON in `data`. [`JournalEntry::message`] is what the event
//! stream sends: an object with at least `seq`, `at`, `kind` and
//! `sandbox_id` (docs/events.md has the contract).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The kinds of journal entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalKind {
    /// A sandbox transition ([`super::Event`]).
    Sandbox,
    /// A snapshot taken or pruned.
    Snapshot,
    /// An approval requested or answered.
    Approval,
    /// A policy decision that refused or held a call.
    Policy,
}

impl JournalKind {
    /// The stored (and streamed) name.
    pub fn as_str(self) -> &'static str {
        match self {
            JournalKind::Sandbox => "sandbox",
            JournalKind::Snapshot => "snapshot",
            JournalKind::Approval => "approval",
            JournalKind::Policy => "policy",
        }
    }
}

/// A journal entry of a kind other than `sandbox`, to append.
#[derive(Debug, Clone, PartialEq)]
pub struct JournalNote {
    /// When.
    pub at: DateTime<Utc>,
    /// The tenant whose stream shows it.
    pub tenant: String,
    /// The sandbox concerned (empty: none, e.g. a call without one).
    pub sandbox_id: String,
    /// Its kind.
    pub kind: JournalKind,
    /// What webhooks subscribe to: `approval.requested`,
    /// `approval.answered`, `snapshot.taken`, `snapshot.pruned`, `policy`.
    pub topic: String,
    /// Its fields (without `seq`, `at`, `kind`, `sandbox_id`: the store
    /// adds them).
    pub data: Value,
}

/// One journal entry of any kind, as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct JournalEntry {
    /// Position in the journal.
    pub seq: i64,
    /// When.
    pub at: DateTime<Utc>,
    /// Tenant.
    pub tenant: String,
    /// Sandbox concerned (may be empty).
    pub sandbox_id: String,
    /// Kind.
    pub kind: JournalKind,
    /// The fields of the entry (for `sandbox`: op, from_state, to_state,
    /// phase, detail).
    pub data: Value,
}

impl JournalEntry {
    /// The stream's `data:` object: the entry's fields with `seq`, `at`,
    /// `kind` and `sandbox_id`.
    pub fn message(&self) -> Value {
        let mut v = match &self.data {
            Value::Object(m) => Value::Object(m.clone()),
            _ => json!({}),
        };
        v["seq"] = json!(self.seq);
        v["at"] = json!(self.at);
        v["kind"] = json!(self.kind.as_str());
        v["sandbox_id"] = json!(self.sandbox_id);
        v
    }
}

/// How a webhook's deliveries are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookFormat {
    /// `{"type": <topic>, "event": {…}, …}`.
    #[default]
    Json,
    /// A Slack-compatible message: `{"text": …, "blocks": […]}`.
    Slack,
}

impl WebhookFormat {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookFormat::Json => "json",
            WebhookFormat::Slack => "slack",
        }
    }

    /// Parses [`WebhookFormat::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "json" => Some(WebhookFormat::Json),
            "slack" => Some(WebhookFormat::Slack),
            _ => None,
        }
    }
}

/// A webhook of a tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Webhook {
    /// Id (`wh-…`).
    pub id: String,
    /// Owning tenant.
    pub tenant: String,
    /// Where deliveries are POSTed.
    pub url: String,
    /// The topics it gets ([`JournalNote::topic`]).
    pub events: Vec<String>,
    /// Payload format.
    pub format: WebhookFormat,
    /// The signing secret, sealed by the key store (never returned).
    #[serde(skip)]
    pub secret_sealed: String,
    /// Who made it.
    pub created_by: String,
    /// When.
    pub created_at: DateTime<Utc>,
}

/// Where a delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Not delivered yet; tried again at `next_attempt_at`.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Every attempt failed.
    Failed,
    /// Its webhook was deleted first.
    Cancelled,
}

impl DeliveryStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
            DeliveryStatus::Cancelled => "cancelled",
        }
    }

    /// Parses [`DeliveryStatus::as_str`] back.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(DeliveryStatus::Pending),
            "delivered" => Some(DeliveryStatus::Delivered),
            "failed" => Some(DeliveryStatus::Failed),
            "cancelled" => Some(DeliveryStatus::Cancelled),
            _ => None,
        }
    }
}

/// One event on its way to one webhook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    /// Id.
    pub id: i64,
    /// The webhook.
    pub webhook_id: String,
    /// Its tenant.
    pub tenant: String,
    /// The journal entry it carries.
    pub event_seq: i64,
    /// Its topic.
    pub topic: String,
    /// The entry's stream message (kept here: the journal may be pruned
    /// before the last attempt).
    pub event: Value,
    /// Status.
    pub status: DeliveryStatus,
    /// Attempts made.
    pub attempts: u32,
    /// HTTP status of the last attempt, when one answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When it is tried next (pending only).
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// When it was queued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}
