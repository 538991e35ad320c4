//! `strata rewind ID --to SNAP | --ago 10m`: return a sandbox to one of its
//! snapshots, in place (the state before is kept as a pre-rewind snapshot).

use serde_json::{json, Value};

use super::Ctx;
use crate::human::duration_arg;

/// `strata rewind`
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to", "ago"])))]
pub struct Args {
    /// Sandbox id.
    pub id: String,
    /// A snapshot of this sandbox.
    #[arg(long)]
    pub to: Option<String>,
    /// The newest snapshot at or before this long ago, e.g. 10m or 1h30m.
    #[arg(long, value_parser = duration_arg)]
    pub ago: Option<String>,
}

/// Runs `strata rewind`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let body = match (&a.to, &a.ago) {
        (Some(to), _) => json!({ "to": to }),
        (None, Some(ago)) => json!({ "ago": ago }),
        (None, None) => json!({}),
    };
    let v = ctx
        .client()?
        .post_call(&["v1", "sandboxes", &a.id, "rewind"], &body)
        .await?;
    ctx.emit(&v, || {
        // The daemon answers with snapshot records (or ids): show the ids.
        let s = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_str().or_else(|| x.get("id").and_then(Value::as_str)))
                .unwrap_or("-")
                .to_owned()
        };
        // A `same_as` record (a minute where nothing changed) restored
        // the snapshot it names.
        let to = match v
            .get("rewound_to")
            .and_then(|x| x.get("same_as"))
            .and_then(Value::as_str)
        {
            Some(t) => format!("{} (= {t})", s("rewound_to")),
            None => s("rewound_to"),
        };
        Ok(format!(
            "{} rewound to {} (previous state kept as {})\n",
            a.id,
            to,
            s("pre_rewind_snapshot")
        ))
    })?;
    Ok(0)
}
