//! `strata webhook add|ls|rm|deliveries`: the tenant's webhooks (admin
//! only; docs/events.md). A new webhook's signing secret is printed once.

use clap::Subcommand;
use serde_json::json;

use super::Ctx;

/// Topics a webhook may subscribe to.
pub const TOPICS: [&str; 6] = [
    "approval.requested",
    "approval.answered",
    "snapshot.taken",
    "snapshot.pruned",
    "policy",
    "*",
];

/// `strata webhook ...`
#[derive(Debug, Subcommand)]
pub enum WebhookCmd {
    /// Make a webhook; its signing secret is shown only once.
    Add {
        /// Where deliveries are POSTed (http or https; public addresses only).
        /// (Not named `url`: that is the global `--url` of the daemon, and
        /// clap would take this for it.)
        #[arg(value_name = "URL")]
        target: String,
        /// A topic to deliver (repeat) [default: approval.requested].
        #[arg(long = "event", value_parser = TOPICS)]
        events: Vec<String>,
        /// json, or slack (a Slack-compatible message).
        #[arg(long, default_value = "json", value_parser = ["json", "slack"])]
        format: String,
    },
    /// List the tenant's webhooks.
    Ls,
    /// Delete a webhook (its pending deliveries are cancelled).
    Rm {
        /// Webhook id (`wh-…`).
        id: String,
    },
    /// A webhook's latest deliveries: status, attempts, last error, next attempt.
    Deliveries {
        /// Webhook id (`wh-…`).
        id: String,
    },
}

use crate::views::{field as s, items_or_empty as items};

/// Runs a webhook command.
pub async fn run(ctx: &Ctx, cmd: WebhookCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        WebhookCmd::Add {
            target,
            events,
            format,
        } => {
            let mut body = json!({ "url": target, "format": format });
            if !events.is_empty() {
                body["events"] = json!(events);
            }
            let v = client.post(&["v1", "webhooks"], &body).await?;
            if !ctx.json {
                eprintln!(
                    "strata: this is the only time the signing secret is shown: store it now"
                );
            }
            ctx.emit(&v, || {
                Ok(format!(
                    "{}\n{}  {}  {}  {}\n",
                    s(&v, "secret"),
                    s(&v, "id"),
                    s(&v, "format"),
                    s(&v, "url"),
                    s(&v, "events")
                ))
            })?;
        }
        WebhookCmd::Ls => {
            let v = client.get(&["v1", "webhooks"], &[]).await?;
            ctx.emit(&v, || {
                let mut out = String::from("ID                   FORMAT  EVENTS  URL\n");
                for h in items(&v) {
                    out.push_str(&format!(
                        "{:<20} {:<7} {}  {}\n",
                        s(&h, "id"),
                        s(&h, "format"),
                        s(&h, "events"),
                        s(&h, "url")
                    ));
                }
                Ok(out)
            })?;
        }
        WebhookCmd::Rm { id } => {
            let v = client.delete(&["v1", "webhooks", &id], &[]).await?;
            ctx.emit(&v, || Ok(format!("deleted {id}\n")))?;
        }
        WebhookCmd::Deliveries { id } => {
            let v = client
                .get(&["v1", "webhooks", &id, "deliveries"], &[])
                .await?;
            ctx.emit(&v, || {
                let mut out = String::from(
                    "ID      SEQ     TOPIC               STATUS     ATTEMPTS  LAST  NEXT ATTEMPT  ERROR\n",
                );
                for d in items(&v) {
                    out.push_str(&format!(
                        "{:<7} {:<7} {:<19} {:<10} {:<9} {:<5} {:<13} {}\n",
                        s(&d, "id"),
                        s(&d, "event_seq"),
                        s(&d, "topic"),
                        s(&d, "status"),
                        s(&d, "attempts"),
                        s(&d, "last_status"),
                        s(&d, "next_attempt_at"),
                        s(&d, "last_error")
                    ));
                }
                Ok(out)
            })?;
        }
    }
    Ok(0)
}
