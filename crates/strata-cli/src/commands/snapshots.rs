//! `strata snapshots ID`: a sandbox's history as a readable timeline.

use chrono::{DateTime, Utc};

use super::Ctx;
pub use super::SandboxArg as Args;
use crate::human;
use crate::views::{items, Snapshot};

/// Runs `strata snapshots`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .get(&["v1", "sandboxes", &a.id, "snapshots"], &[])
        .await?;
    ctx.emit(&v, || Ok(timeline(&items(&v)?, Utc::now())))?;
    Ok(0)
}

/// The timeline table, oldest first, with a total of exclusive bytes.
pub fn timeline(list: &[Snapshot], now: DateTime<Utc>) -> String {
    if list.is_empty() {
        return "no snapshots\n".into();
    }
    let mut list: Vec<&Snapshot> = list.iter().collect();
    list.sort_by_key(|s| s.created_at);
    let opt_bytes = |b: Option<u64>| b.map(human::bytes).unwrap_or_else(|| "-".into());
    let mut out = human::table_of(
        &[
            "TIME",
            "AGE",
            "ID",
            "KIND",
            "LABEL",
            ">PAUSE MS",
            ">EXCLUSIVE",
            ">SHARED",
        ],
        &list,
        |s| {
            let mut kind = s.kind.replace('_', "-");
            if let Some(t) = &s.same_as {
                // Recorded, not taken: the guest was still at `t`.
                kind.push_str(&format!(" = {t}"));
            }
            if s.status != "ready" && !s.status.is_empty() {
                kind.push_str(&format!(" ({})", s.status));
            }
            vec![
                s.created_at.map(human::local_time).unwrap_or_default(),
                s.created_at.map(|t| human::age(t, now)).unwrap_or_default(),
                s.id.clone(),
                kind,
                s.label.clone().unwrap_or_default(),
                s.pause_ms.map(human::ms).unwrap_or_else(|| "-".into()),
                opt_bytes(s.exclusive_bytes),
                opt_bytes(s.shared_bytes()),
            ]
        },
    );
    let total: u64 = list.iter().filter_map(|s| s.exclusive_bytes).sum();
    out.push_str(&format!(
        "{} snapshots, {} exclusive in total\n",
        list.len(),
        human::bytes(total)
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_is_sorted_and_human() {
        let now = Utc::now();
        let at = |s: i64| Some(now - chrono::TimeDelta::seconds(s));
        let list = vec![
            Snapshot {
                id: "snap-b".into(),
                kind: "pre_rewind".into(),
                status: "ready".into(),
                created_at: at(60),
                pause_ms: Some(14.83),
                exclusive_bytes: Some(3 << 20),
                referenced_bytes: Some(300 << 20),
                ..Default::default()
            },
            Snapshot {
                id: "snap-a".into(),
                kind: "manual".into(),
                label: Some("before pip".into()),
                status: "ready".into(),
                created_at: at(600),
                ..Default::default()
            },
            Snapshot {
                id: "snap-c".into(),
                kind: "rolling".into(),
                status: "ready".into(),
                created_at: at(30),
                exclusive_bytes: Some(0),
                same_as: Some("snap-b".into()),
                ..Default::default()
            },
        ];
        let t = timeline(&list, now);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("TIME"), "{t}");
        assert!(
            lines[1].contains("snap-a") && lines[1].contains("10m ago"),
            "{t}"
        );
        assert!(lines[1].contains("before pip"), "{t}");
        assert!(
            lines[2].contains("pre-rewind") && lines[2].contains("14.8"),
            "{t}"
        );
        assert!(
            lines[2].contains("3.0 MiB") && lines[2].contains("297.0 MiB"),
            "{t}"
        );
        assert!(
            lines[3].contains("snap-c") && lines[3].contains("rolling = snap-b"),
            "{t}"
        );
        assert_eq!(lines[4], "3 snapshots, 3.0 MiB exclusive in total");
        assert_eq!(timeline(&[], now), "no snapshots\n");
    }
}
