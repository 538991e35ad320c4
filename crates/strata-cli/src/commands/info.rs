//! `strata info ID`: one sandbox in detail.

use chrono::{DateTime, Utc};

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
        let ports = c.url(&["v1", "sandboxes", &s.id, "ports"], &[]);
        Ok(render(&s, ports.as_str(), usage.as_deref(), Utc::now()))
    })?;
    Ok(0)
}

/// The human report of one sandbox: a row per field; `ports` is the URL a
/// guest server on `127.0.0.1:<PORT>` is reached under (`strata port`),
/// `usage` its recent use (`Usage::describe_recent`), `now` what ages are
/// counted from.
pub fn render(s: &Sandbox, ports: &str, usage: Option<&str>, now: DateTime<Utc>) -> String {
    let when = |t: Option<DateTime<Utc>>| {
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
    rows.push(("ports", format!("{ports}/<PORT>")));
    if let Some(u) = usage {
        rows.push(("usage", u.to_owned()));
    }
    if let Some(r) = &s.state_reason {
        rows.insert(2, ("reason", r.clone()));
    }
    if let Some(op) = &s.pending_op {
        rows.insert(2, ("in progress", op.clone()));
    }
    rows.into_iter()
        .map(|(k, v)| format!("{k:<15}{v}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The usage row comes from the sandbox's `/metrics` summary, as
    /// `strata stats ID` describes it; without one there is no row.
    #[test]
    fn renders_the_usage_row() {
        let s: Sandbox = view(&json!({
            "id": "sb-1", "state": "running", "template": "tpl-default",
            "size": {"vcpus": 1, "memory_mib": 256, "disk_gib": 2},
            "labels": {}, "pid": 4242, "accel": "tcg"
        }))
        .unwrap();
        let u: super::super::stats::Usage = view(&json!({"sandbox": "sb-1", "interval_s": 5,
            "samples": [], "recent_window_s": 60,
            "recent": {"cpu_pct_avg": 2.13, "cpu_pct_peak": 4.0, "cpu_cores_peak": 0.04,
                       "host_rss_peak_bytes": 94371840u64}}))
        .unwrap();
        let usage = u.describe_recent();
        let r = render(
            &s,
            "http://d/v1/sandboxes/sb-1/ports",
            usage.as_deref(),
            Utc::now(),
        );
        let rows: Vec<&str> = r.lines().collect();
        assert_eq!(rows[0], "id             sb-1", "{r}");
        assert!(rows.contains(&"pid            4242"), "{r}");
        assert!(
            rows.contains(&"ports          http://d/v1/sandboxes/sb-1/ports/<PORT>"),
            "{r}"
        );
        assert_eq!(
            rows.last().copied(),
            Some("usage          cpu 2.1 % mean, 4.0 % peak (0.04 cores) over 60 s; resident up to 90.0 MiB"),
            "{r}"
        );
        let r = render(&s, "http://d/p", None, Utc::now());
        assert!(!r.contains("usage"), "{r}");
    }
}
