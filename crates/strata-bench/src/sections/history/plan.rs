//! What the run does when, computed without a guest: the plan (steps on the
//! virtual clock, the retention policy), which steps are agent activity, what
//! the policy alone keeps, which snapshots are rewound, and the thinning of
//! the plotted series.

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use chrono::{DateTime, Utc};
use rand::seq::SliceRandom;
use stratad::retention::{Point, RetentionPolicy};
use stratad::store::SnapshotKind;

use super::{Args, Snap};

/// The run's steps on the virtual clock and the retention it applies.
pub(super) struct Plan {
    /// The retention tiers applied after every snapshot.
    pub(super) policy: RetentionPolicy,
    /// Virtual minutes per step.
    pub(super) every: u64,
    /// Snapshots taken (loop steps).
    pub(super) steps: u64,
    /// Virtual minutes between two bursts of activity.
    pub(super) burst_every: u64,
    /// Seed of the rewind choice.
    pub(super) seed: u64,
}

impl Plan {
    /// The plan of `args`.
    pub(super) fn new(args: &Args) -> Result<Plan> {
        let policy = match &args.history_retention {
            Some(s) => {
                RetentionPolicy::parse(s).map_err(|e| anyhow!("--history-retention: {e}"))?
            }
            None => stratad::config::Config::default().retention,
        };
        if args.history_every == 0 {
            bail!("--history-every must be at least 1 (virtual minute)");
        }
        let every = args.history_every;
        let steps = ((args.history_days * 1440.0) / every as f64)
            .round()
            .max(2.0) as u64;
        Ok(Plan {
            policy,
            every,
            steps,
            burst_every: args.history_burst_every.max(every),
            seed: args.history_seed.unwrap_or_else(rand::random),
        })
    }

    /// Virtual days the steps cover.
    pub(super) fn days(&self) -> f64 {
        (self.steps * self.every) as f64 / 1440.0
    }
}

/// Day number and time of a virtual instant, from the start of the history.
pub(super) fn vtime(t0: DateTime<Utc>, at: DateTime<Utc>) -> String {
    let m = (at - t0).num_minutes();
    format!("day {} {:02}:{:02}", m / 1440, (m % 1440) / 60, m % 60)
}

/// The tier index a snapshot of age `age` falls in (`tiers.len()` past the last).
pub(super) fn tier_of(policy: &RetentionPolicy, age: Duration) -> usize {
    policy
        .tiers
        .iter()
        .position(|t| age < t.within)
        .unwrap_or(policy.tiers.len())
}

/// Describes the policy as `1h: all, 1d: 1 per 10m, …`.
pub(super) fn describe(policy: &RetentionPolicy) -> String {
    use stratad::duration::format_duration as f;
    policy
        .tiers
        .iter()
        .map(|t| {
            if t.every.is_zero() {
                format!("younger than {}: every snapshot", f(t.within))
            } else {
                format!("younger than {}: one per {}", f(t.within), f(t.every))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether the loop step at virtual `minute` runs an activity step (the first
/// three snapshot slots of every burst period).
pub(super) fn is_activity(minute: u64, every: u64, burst_every: u64) -> bool {
    (minute % burst_every) / every < 3
}

/// Runs the policy alone (no snapshots) over `minutes` virtual minutes, one
/// point every `every` minutes, GC after each as the loop does; returns how
/// many points survive.
pub(super) fn simulate_kept(
    policy: &RetentionPolicy,
    every: u64,
    minutes: u64,
    t0: DateTime<Utc>,
) -> usize {
    let mut live: Vec<Point<u64>> = Vec::new();
    let mut m = 0;
    while m < minutes {
        let at = t0 + chrono::Duration::minutes(m as i64);
        live.push(Point {
            id: m,
            at,
            kind: SnapshotKind::Rolling,
        });
        let del = policy.to_delete(&live, at);
        live.retain(|p| !del.contains(&p.id));
        m += every;
    }
    live.len()
}

/// `k` random snapshots of `live`, preferring distinct workspace states (so the
/// rewinds check different disk states, not the same one after a long idle
/// stretch): a random order, the first snapshot of each state taken first,
/// then the rest in that order.
pub(super) fn pick_rewinds(live: &[Snap], k: usize, rng: &mut impl rand::Rng) -> Vec<Snap> {
    let mut order: Vec<&Snap> = live.iter().collect();
    order.shuffle(rng);
    let mut seen = std::collections::HashSet::new();
    let (first, rest): (Vec<&Snap>, Vec<&Snap>) =
        order.into_iter().partition(|s| seen.insert(s.state));
    first.into_iter().chain(rest).take(k).cloned().collect()
}

/// Keeps at most `max` points, evenly spaced, always the last one.
pub(super) fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 2 {
        return points.to_vec();
    }
    let stride = points.len().div_ceil(max - 1);
    let mut v: Vec<(f64, f64)> = points.iter().step_by(stride).copied().collect();
    if let Some(last) = points.last() {
        if v.last() != Some(last) {
            v.push(*last);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use rand::SeedableRng;
    use strata_core::SnapshotId;

    use super::*;

    #[test]
    fn tiers_and_thinning() {
        let p = RetentionPolicy::default();
        assert_eq!(tier_of(&p, Duration::from_secs(30 * 60)), 0);
        assert_eq!(tier_of(&p, Duration::from_secs(2 * 3600)), 1);
        assert_eq!(tier_of(&p, Duration::from_secs(3 * 86400)), 2);
        assert_eq!(tier_of(&p, Duration::from_secs(8 * 86400)), 3);
        assert!(describe(&p).contains("one per 10m"));
        let t0 = Utc.with_ymd_and_hms(2026, 1, 5, 0, 0, 0).unwrap();
        // A week of minutes under the default tiers: 60 + ~139 + ~145.
        let kept = simulate_kept(&p, 1, 7 * 1440, t0);
        assert!((340..=350).contains(&kept), "{kept}");
        assert_eq!(simulate_kept(&p, 1, 30, t0), 30);
        assert!(is_activity(0, 1, 120) && is_activity(2, 1, 120) && !is_activity(3, 1, 120));
        assert!(is_activity(240, 1, 120) && !is_activity(239, 1, 120));
        let snaps: Vec<Snap> = (0..50u64)
            .map(|i| Snap {
                id: SnapshotId::generate(),
                step: i,
                at: t0,
                state: if i < 45 { 0 } else { 1 + (i as usize % 2) },
                counter_lo: 0,
                counter_hi: 0,
            })
            .collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let p3 = pick_rewinds(&snaps, 3, &mut rng);
        let states: std::collections::HashSet<usize> = p3.iter().map(|s| s.state).collect();
        assert_eq!(states.len(), 3, "three distinct states first");
        assert_eq!(pick_rewinds(&snaps, 10, &mut rng).len(), 10);
        assert_eq!(pick_rewinds(&snaps[..2], 5, &mut rng).len(), 2);
        let pts: Vec<(f64, f64)> = (0..1000).map(|i| (i as f64, 0.0)).collect();
        let t = thin(&pts, 100);
        assert!(t.len() <= 101 && t.len() >= 50);
        assert_eq!(t.last(), pts.last());
        assert_eq!(thin(&pts[..10], 100).len(), 10);
        let t0b = Utc.with_ymd_and_hms(2026, 1, 5, 0, 0, 0).unwrap();
        assert_eq!(
            vtime(t0b, t0b + chrono::Duration::minutes(1440 * 2 + 65)),
            "day 2 01:05"
        );
    }

    #[test]
    fn a_plan_from_the_flags() {
        let args = Args {
            history_days: 1.0,
            history_every: 20,
            history_retention: Some("1h:0,24h:1h".into()),
            history_mem: 512,
            history_rewinds: 5,
            history_seed: Some(7),
            history_burst_every: 10,
        };
        let p = Plan::new(&args).expect("plan");
        assert_eq!((p.steps, p.every, p.burst_every, p.seed), (72, 20, 20, 7));
        assert_eq!(p.policy.tiers.len(), 2);
        assert!((p.days() - 1.0).abs() < 1e-9);
        let zero = Args {
            history_every: 0,
            ..args.clone()
        };
        assert!(Plan::new(&zero).is_err());
        let bad = Args {
            history_retention: Some("nonsense".into()),
            ..args
        };
        assert!(Plan::new(&bad).is_err());
    }
}
