//! `strata stats`: latency percentiles of the daemon (`GET /v1/stats`).

use super::Ctx;
use crate::human;
use crate::views::{view, Stats, Summary};

/// `strata stats`
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `strata stats`.
pub async fn run(ctx: &Ctx, _a: Args) -> anyhow::Result<i32> {
    let v = ctx.client()?.get(&["v1", "stats"], &[]).await?;
    ctx.emit(&v, || Ok(render(&view(&v)?)))?;
    Ok(0)
}

fn rows(m: &std::collections::BTreeMap<String, Summary>) -> Vec<Vec<String>> {
    m.iter()
        .map(|(k, s)| {
            vec![
                k.clone(),
                s.count.to_string(),
                human::ms(s.p50_ms),
                human::ms(s.p95_ms),
                human::ms(s.p99_ms),
                human::ms(s.max_ms),
            ]
        })
        .collect()
}

/// The human report.
pub fn render(s: &Stats) -> String {
    let head = ["", ">COUNT", ">P50 MS", ">P95 MS", ">P99 MS", ">MAX MS"];
    let mut out = String::new();
    let states: Vec<String> = s
        .sandboxes
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    out.push_str(&format!(
        "sandboxes: {}; snapshots: {}\n\n",
        if states.is_empty() {
            "none".into()
        } else {
            states.join(", ")
        },
        s.snapshots
    ));
    for (title, m) in [("API OPERATION", &s.api), ("VM STEP", &s.steps)] {
        if m.is_empty() {
            out.push_str(&format!("{title}: no observations yet\n\n"));
            continue;
        }
        let mut h = head;
        h[0] = title;
        out.push_str(&human::table(&h, &rows(m)));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_both_tables() {
        let s: Stats = view(&json!({
            "api": {"POST /v1/sandboxes": {"count": 3, "p50_ms": 210.0, "p95_ms": 376.2, "p99_ms": 376.2, "max_ms": 376.2}},
            "steps": {"snapshot_pause": {"count": 10, "p50_ms": 14.2, "p95_ms": 19.0, "p99_ms": 19.0, "max_ms": 19.0}},
            "sandboxes": {"running": 2},
            "snapshots": 10
        }))
        .unwrap();
        let r = render(&s);
        assert!(r.starts_with("sandboxes: 2 running; snapshots: 10"), "{r}");
        assert!(
            r.contains("POST /v1/sandboxes      3     210     376"),
            "{r}"
        );
        assert!(r.contains("snapshot_pause     10    14.2    19.0"), "{r}");
    }
}
