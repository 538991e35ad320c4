//! Webhooks: per-tenant targets of journal entries (by default approval
//! requests), delivered signed and retried (docs/events.md).
//!
//! - A delivery is queued in the store in the same transaction as the
//!   journal entry it carries (`Store::append_journal`), so a restart
//!   resumes it; at most `[webhooks] max_queued_per_tenant` wait per tenant.
//! - Each attempt POSTs the payload with `Strata-Signature:
//!   t=<unix>,v1=<hex>`, the HMAC-SHA256 under the webhook's secret of
//!   `<t>.<body>`; a 2xx answer delivers it, anything else is retried after
//!   `retry_base · 2^(n-1)` (capped at `retry_max`, times a random factor
//!   in [0.5, 1]) up to `max_attempts`.
//! - The target must resolve to public addresses only, checked when the
//!   webhook is made and again at every attempt (the connection goes to the
//!   addresses checked): the egress proxy's filter
//!   (`strata_policy::proxy::upstream::address_guard`) refuses loopback,
//!   private, link-local and the host's own addresses, except the
//!   test-only `[webhooks] allow_private` list. No redirects are followed.
//! - The secret is sealed by the key store (bound to the webhook id) and
//!   returned once, at creation.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use rand::Rng;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::caller::Caller;
use crate::security::keys::Purpose;
use crate::service::{Service, ServiceError, ServiceResult};
use crate::store::{Delivery, DeliveryStatus, Webhook, WebhookFormat};

/// The topics a webhook may subscribe to (`*`: all).
pub const TOPICS: &[&str] = &[
    "approval.requested",
    "approval.answered",
    "snapshot.taken",
    "snapshot.pruned",
    "policy",
    "*",
];

/// Longest webhook URL.
const MAX_URL: usize = 2048;

/// `POST /v1/webhooks` body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateWebhook {
    /// Where deliveries go (`http` or `https`).
    pub url: String,
    /// Topics ([`TOPICS`]); default `["approval.requested"]`.
    #[serde(default)]
    pub events: Option<Vec<String>>,
    /// `json` (default) or `slack`.
    #[serde(default)]
    pub format: Option<WebhookFormat>,
}

/// Why a target is refused.
#[derive(Debug, thiserror::Error)]
#[error("webhook target refused: {0}")]
pub struct TargetRefused(pub String);

/// Checks `url` and resolves its host: every address must pass the egress
/// proxy's public-address filter (or be on `allow_private`). Returns the
/// URL, its host and the addresses to connect to.
pub async fn check_target(
    url: &str,
    allow_private: &[String],
) -> Result<(reqwest::Url, String, Vec<SocketAddr>), TargetRefused> {
    if url.len() > MAX_URL {
        return Err(TargetRefused(format!("url longer than {MAX_URL} bytes")));
    }
    let u = reqwest::Url::parse(url).map_err(|e| TargetRefused(format!("url: {e}")))?;
    if u.scheme() != "http" && u.scheme() != "https" {
        return Err(TargetRefused("url: http or https only".into()));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return Err(TargetRefused("url: no credentials in the url".into()));
    }
    let host = u
        .host_str()
        .ok_or_else(|| TargetRefused("url: no host".into()))?
        .to_owned();
    let port = u
        .port_or_known_default()
        .ok_or_else(|| TargetRefused("url: no port".into()))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::lookup_host((bare, port)),
        )
        .await
        .map_err(|_| TargetRefused(format!("resolving {bare}: timed out")))?
        .map_err(|e| TargetRefused(format!("resolving {bare}: {e}")))?
        .collect(),
    };
    if addrs.is_empty() {
        return Err(TargetRefused(format!("{bare} resolves to no address")));
    }
    for a in &addrs {
        let ip = a.ip();
        if allow_private
            .iter()
            .any(|p| p.parse::<IpAddr>().ok() == Some(ip))
        {
            continue;
        }
        let any = if ip.is_ipv4() { "0.0.0.0/0" } else { "::/0" };
        let range = strata_policy::policy::IpNet::parse(any).map_err(TargetRefused)?;
        strata_policy::proxy::upstream::address_guard(ip, &range)
            .map_err(|e| TargetRefused(format!("{bare}: {e}")))?;
    }
    Ok((u, bare.to_owned(), addrs))
}

/// `t=<unix>,v1=<hex of HMAC-SHA256(secret, "<unix>.<body>")>`.
pub fn signature(secret: &str, unix: i64, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(unix.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    format!("t={unix},v1={}", hex::encode(ctx.sign().as_ref()))
}

/// Escapes a string for Slack's mrkdwn (`&`, `<`, `>`; backticks would end
/// a code span).
fn slack_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('`', "'")
}

/// The body of delivery `d` to a webhook of `format`; `base` is the
/// console's base URL.
pub fn payload(format: WebhookFormat, d: &Delivery, base: &str) -> Value {
    let ev = &d.event;
    let s = |k: &str| ev.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let sandbox = s("sandbox_id");
    let approval_id = s("approval_id");
    let link = if approval_id.is_empty() {
        format!("{base}/console/#/sandboxes/{sandbox}")
    } else {
        format!("{base}/console/#/approvals/{approval_id}")
    };
    match format {
        WebhookFormat::Json => {
            let mut v = json!({
                "type": d.topic,
                "delivery_id": d.id,
                "webhook_id": d.webhook_id,
                "tenant": d.tenant,
                "event": ev,
                "link": link,
            });
            if !approval_id.is_empty() {
                v["approval"] = json!({
                    "id": approval_id,
                    "sandbox_id": sandbox,
                    "tool": ev.get("tool"),
                    "summary": ev.get("summary"),
                    "call": ev.get("call"),
                    "body_bytes": ev.get("body_bytes"),
                    "requested_by": ev.get("requested_by"),
                    "reason": ev.get("reason"),
                    "expires_at": ev.get("expires_at"),
                    "decision": ev.get("decision"),
                    "by": ev.get("by"),
                    "url": link,
                });
            }
            v
        }
        WebhookFormat::Slack => {
            let summary = slack_escape(&s("summary"));
            let title = match d.topic.as_str() {
                "approval.requested" => "Approval requested".to_owned(),
                "approval.answered" => format!("Approval {}", slack_escape(&s("decision"))),
                "snapshot.taken" => "Snapshot taken".to_owned(),
                "snapshot.pruned" => "Snapshot pruned".to_owned(),
                "policy" => format!("Policy {}", slack_escape(&s("decision"))),
                other => slack_escape(other),
            };
            let mut lines = vec![format!("*{title}* in sandbox `{}`", slack_escape(&sandbox))];
            if !summary.is_empty() {
                lines.push(format!("`{summary}`"));
            }
            let who = s("requested_by");
            if !who.is_empty() {
                lines.push(format!("asked by {}", slack_escape(&who)));
            }
            let exp = s("expires_at");
            if !exp.is_empty() {
                lines.push(format!("expires {}", slack_escape(&exp)));
            }
            let text = format!("{} — <{link}|open in the console>", lines.join(" · "));
            json!({
                "text": text,
                "blocks": [
                    { "type": "section", "text": { "type": "mrkdwn", "text": lines.join("\n") } },
                    { "type": "actions", "elements": [
                        { "type": "button", "text": { "type": "plain_text", "text": "Open in the console" }, "url": link }
                    ]}
                ]
            })
        }
    }
}

/// The wait before attempt `attempts + 1` (after `attempts` failed).
fn backoff(cfg: &super::WebhooksConfig, attempts: u32) -> Duration {
    let exp = cfg
        .retry_base
        .saturating_mul(
            1u32.checked_shl(attempts.saturating_sub(1))
                .unwrap_or(u32::MAX),
        )
        .min(cfg.retry_max);
    exp.mul_f64(rand::thread_rng().gen_range(0.5..=1.0))
}

impl Service {
    /// The journal's change notifications (see `Store::journal_changes`).
    pub fn journal_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.store_handle().journal_changes()
    }

    fn caller_tenant(caller: &Caller) -> ServiceResult<String> {
        caller
            .tenant()
            .map(str::to_owned)
            .ok_or_else(|| ServiceError::Forbidden("webhooks belong to a tenant".into()))
    }

    /// Makes a webhook of the caller's tenant; returns it and its signing
    /// secret (shown this once).
    pub async fn create_webhook(
        &self,
        caller: &Caller,
        cmd: CreateWebhook,
    ) -> ServiceResult<(Webhook, String)> {
        let tenant = Self::caller_tenant(caller)?;
        let events = cmd
            .events
            .unwrap_or_else(|| vec!["approval.requested".to_owned()]);
        if events.is_empty() || events.len() > TOPICS.len() {
            return Err(ServiceError::InvalidRequest(format!(
                "events: 1 to {} of {TOPICS:?}",
                TOPICS.len()
            )));
        }
        if let Some(e) = events.iter().find(|e| !TOPICS.contains(&e.as_str())) {
            return Err(ServiceError::InvalidRequest(format!(
                "events: unknown topic {e:?} (one of {TOPICS:?})"
            )));
        }
        check_target(&cmd.url, &self.config().webhooks.allow_private)
            .await
            .map_err(|e| ServiceError::InvalidRequest(e.to_string()))?;
        let t = tenant.clone();
        let existing = self.db(move |s| s.webhooks(&t)).await?;
        let max = self.config().webhooks.max_per_tenant;
        if existing.len() >= max {
            return Err(ServiceError::QuotaExceeded(format!(
                "at most {max} webhooks per tenant ([webhooks] max_per_tenant)"
            )));
        }
        let id = format!("wh-{}", hex::encode(rand::random::<[u8; 8]>()));
        let secret = format!("whsec_{}", hex::encode(rand::random::<[u8; 32]>()));
        let sealed = self
            .sealer(Purpose::WebhookSecret)?
            .seal(&id, secret.as_bytes())
            .map_err(|e| ServiceError::Keys(e.to_string()))?;
        let hook = Webhook {
            id,
            tenant,
            url: cmd.url,
            events,
            format: cmd.format.unwrap_or_default(),
            secret_sealed: sealed,
            created_by: caller.actor(),
            created_at: self.now(),
        };
        let h = hook.clone();
        self.db(move |s| s.put_webhook(&h)).await?;
        Ok((hook, secret))
    }

    /// The caller's tenant's webhooks.
    pub async fn list_webhooks(&self, caller: &Caller) -> ServiceResult<Vec<Webhook>> {
        let tenant = Self::caller_tenant(caller)?;
        self.db(move |s| s.webhooks(&tenant)).await
    }

    /// Deletes one of the caller's tenant's webhooks (its pending
    /// deliveries are cancelled).
    pub async fn delete_webhook(&self, caller: &Caller, id: &str) -> ServiceResult<()> {
        let tenant = Self::caller_tenant(caller)?;
        let (i, now) = (id.to_owned(), self.now());
        if self.db(move |s| s.delete_webhook(&tenant, &i, now)).await? {
            Ok(())
        } else {
            Err(ServiceError::NotFound {
                kind: "webhook",
                id: id.to_owned(),
            })
        }
    }

    /// The latest deliveries of one of the caller's tenant's webhooks.
    pub async fn webhook_deliveries(
        &self,
        caller: &Caller,
        id: &str,
    ) -> ServiceResult<Vec<Delivery>> {
        let tenant = Self::caller_tenant(caller)?;
        let i = id.to_owned();
        let found = self.db(move |s| s.get_webhook(&tenant, &i)).await?;
        if found.is_none() {
            return Err(ServiceError::NotFound {
                kind: "webhook",
                id: id.to_owned(),
            });
        }
        let i = id.to_owned();
        self.db(move |s| s.deliveries(&i, 100)).await
    }

    /// Delivers what is due until `stop` turns true: woken by the journal
    /// (a new delivery comes with an entry) and by the next retry's time.
    pub fn spawn_webhook_worker(
        self: &Arc<Self>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut changes = svc.journal_changes();
            loop {
                if *stop.borrow() {
                    return;
                }
                changes.borrow_and_update();
                let now = svc.now();
                let due = svc.db(move |s| s.due_deliveries(now, 32)).await;
                let due = match due {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::warn!(error = %e.message(), "webhooks: reading the queue failed");
                        Vec::new()
                    }
                };
                let full = due.len() == 32;
                futures::future::join_all(due.into_iter().map(|d| svc.attempt(d))).await;
                if full {
                    continue;
                }
                let next = svc.db(|s| s.next_delivery_at()).await.ok().flatten();
                let wait = next
                    .map(|t| (t - svc.now()).to_std().unwrap_or(Duration::ZERO))
                    .unwrap_or(Duration::from_secs(60))
                    .min(Duration::from_secs(60));
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    r = changes.changed() => if r.is_err() { return },
                    _ = stop.changed() => {}
                }
            }
        })
    }

    /// One attempt of delivery `d`; its outcome is recorded.
    async fn attempt(&self, mut d: Delivery) {
        let cfg = self.config().webhooks.clone();
        let (t, w) = (d.tenant.clone(), d.webhook_id.clone());
        let hook = match self.db(move |s| s.get_webhook(&t, &w)).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e.message(), "webhooks: reading a webhook failed");
                return;
            }
        };
        let now = self.now();
        d.updated_at = now;
        let Some(hook) = hook else {
            d.status = DeliveryStatus::Cancelled;
            d.next_attempt_at = None;
            self.record_attempt(d).await;
            return;
        };
        d.attempts += 1;
        match self.send(&hook, &d, &cfg).await {
            Ok(status) => {
                d.status = DeliveryStatus::Delivered;
                d.last_status = Some(status);
                d.last_error = None;
                d.next_attempt_at = None;
                self.metrics().count("webhook_delivered");
            }
            Err((status, why)) => {
                d.last_status = status;
                d.last_error = Some(why);
                if d.attempts >= cfg.max_attempts {
                    d.status = DeliveryStatus::Failed;
                    d.next_attempt_at = None;
                    self.metrics().count("webhook_failed");
                } else {
                    let wait = chrono::TimeDelta::from_std(backoff(&cfg, d.attempts))
                        .unwrap_or(chrono::TimeDelta::MAX);
                    d.next_attempt_at = Some(now.checked_add_signed(wait).unwrap_or(now));
                }
            }
        }
        self.record_attempt(d).await;
    }

    async fn record_attempt(&self, d: Delivery) {
        if let Err(e) = self.db(move |s| s.update_delivery(&d)).await {
            tracing::warn!(error = %e.message(), "webhooks: recording an attempt failed");
        }
    }

    /// POSTs `d` to `hook`: the HTTP status of a 2xx answer, or the status
    /// (when one came) and why it failed.
    async fn send(
        &self,
        hook: &Webhook,
        d: &Delivery,
        cfg: &super::WebhooksConfig,
    ) -> Result<u16, (Option<u16>, String)> {
        let (url, host, addrs) = check_target(&hook.url, &cfg.allow_private)
            .await
            .map_err(|e| (None, e.to_string()))?;
        let secret = self
            .sealer(Purpose::WebhookSecret)
            .map_err(|e| (None, e.message()))?
            .open(&hook.id, &hook.secret_sealed)
            .map_err(|e| (None, format!("secret: {e}")))?;
        let secret = String::from_utf8(secret).map_err(|_| (None, "secret: not text".into()))?;
        let body = serde_json::to_vec(&payload(hook.format, d, &self.config().console_base_url()))
            .map_err(|e| (None, e.to_string()))?;
        let unix = Utc::now().timestamp();
        let client = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .resolve_to_addrs(&host, &addrs)
            .user_agent("strata-webhooks/1")
            .build()
            .map_err(|e| (None, format!("client: {e}")))?;
        let resp = client
            .post(url)
            .header("content-type", "application/json")
            .header("strata-signature", signature(&secret, unix, &body))
            .header("strata-event", d.topic.as_str())
            .header("strata-delivery", d.id.to_string())
            .body(body)
            .send()
            .await
            .map_err(|e| (None, format!("sending: {e}")))?;
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            Ok(status)
        } else {
            Err((Some(status), format!("answered {status}")))
        }
    }
}
