//! `strata ls`: the sandboxes, as a table.

use chrono::Utc;
use serde_json::{json, Value};

use super::{key_value, Ctx};
use crate::human;
use crate::views::{items, labels, Sandbox};

/// `strata ls`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only these states (repeatable or comma-separated: running,paused,hibernated,...).
    #[arg(long, value_delimiter = ',')]
    pub state: Vec<String>,
    /// Only sandboxes with this label (repeatable; all must match).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Follow every page (default: the first page only).
    #[arg(long)]
    pub all: bool,
    /// Page size.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: u32,
}

/// Runs `strata ls`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let mut all: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    let limit = a.limit.to_string();
    let states = a.state.join(",");
    let label_pairs: Vec<String> = a.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    loop {
        let mut q: Vec<(&str, &str)> = vec![("limit", &limit)];
        if !states.is_empty() {
            q.push(("state", &states));
        }
        for l in &label_pairs {
            q.push(("label", l));
        }
        if let Some(c) = &cursor {
            q.push(("cursor", c));
        }
        let page = client.get(&["v1", "sandboxes"], &q).await?;
        if let Some(list) = page.get("items").and_then(Value::as_array) {
            all.extend(list.iter().cloned());
        }
        cursor = page
            .get("next_cursor")
            .and_then(Value::as_str)
            .map(str::to_owned);
        if !a.all || cursor.is_none() {
            break;
        }
    }
    let v = json!({ "items": all, "next_cursor": cursor });
    ctx.emit(&v, || {
        let list: Vec<Sandbox> = items(&v)?;
        if list.is_empty() {
            return Ok("no sandboxes\n".into());
        }
        let now = Utc::now();
        let mut out = human::table_of(
            &[
                "ID", "STATE", ">VCPU", ">MEMORY", ">DISK", "CREATED", "ACTIVE", "LABELS",
            ],
            &list,
            |s| {
                vec![
                    s.id.clone(),
                    s.state.clone(),
                    s.size.vcpus.to_string(),
                    format!("{} MiB", s.size.memory_mib),
                    format!("{} GiB", s.size.disk_gib),
                    s.created_at.map(|t| human::age(t, now)).unwrap_or_default(),
                    s.last_activity_at
                        .map(|t| human::age(t, now))
                        .unwrap_or_default(),
                    labels(&s.labels),
                ]
            },
        );
        if cursor.is_some() {
            out.push_str("(more sandboxes: use --all)\n");
        }
        Ok(out)
    })?;
    Ok(0)
}
