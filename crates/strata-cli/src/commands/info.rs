//! `strata info ID`: one sandbox in detail.

use chrono::Utc;

use super::Ctx;
pub use super::SandboxArg as Args;
use crate::human;
use crate::views::{labels, view, Sandbox};

/// Runs `strata info`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let c = ctx.client()?;
    let v = c.get(&["v1", "sandboxes", &a.id], &[]).await?;
    // Its recent use (the sampler's summary); a daemon without it says nothing.
    let usage = if ctx.json {
        None
    } else {
        c.get(&["v1", "sandboxes", &a.id, "metrics"], &[])
            .await
            .ok()
            .and_then(|m| view::<super::stats::Usage>(&m).ok())
            .and_then(|u| u.describe_recent())
    };
    ctx.emit(&v, || {
        let s: Sandbox = view(&v)?;
        let now = Utc::now();
        let when = |t: Option<chrono::DateTime<Utc>>| {
            t.map(|t| format!("{} ({})", human::local_time(t), human::age(t, now)))
                .unwrap_or_else(|| "-".into())
        };
        let secs = |s: Option<u64>| match s {
            None => "daemon default".to_owned(),
            Some(0) => "off".to_owned(),
            Some(n) => human::duration_short(std::time::Duration::from_secs(n)),
        };
        let opt = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
        let mut rows = vec![
            ("id", s.id.clone()),
            ("state", s.state.clone()),
            ("size", s.size.describe()),
            ("template", opt(&s.template)),
            ("forked from", opt(&s.source_snapshot)),
            ("labels", labels(&s.labels)),
            ("created", when(s.created_at)),
            ("last activity", when(s.last_activity_at)),
            ("idle timeout", secs(s.idle_timeout_s)),
            (
                "on timeout",
                s.lifecycle
                    .as_ref()
                    .map(|l| l.describe())
                    .unwrap_or_else(|| "-".into()),
            ),
            ("snapshot every", secs(s.snapshot_interval_s)),
            ("accel", opt(&s.accel)),
            (
                "pid",
                s.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            ),
        ];
        // Where a guest server on 127.0.0.1:<PORT> is reached (`strata port`).
        let ports = c.url(&["v1", "sandboxes", &s.id, "ports"], &[]);
        rows.push(("ports", format!("{ports}/<PORT>")));
        if let Some(u) = &usage {
            rows.push(("usage", u.clone()));
        }
        if let Some(r) = &s.state_reason {
            rows.insert(2, ("reason", r.clone()));
        }
        if let Some(op) = &s.pending_op {
            rows.insert(2, ("in progress", op.clone()));
        }
        Ok(rows
            .into_iter()
            .map(|(k, v)| format!("{k:<15}{v}\n"))
            .collect())
    })?;
    Ok(0)
}
