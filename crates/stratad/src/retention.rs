//! Tiered retention of rolling snapshots (pure: no I/O, no clock).
//!
//! A policy is a list of tiers `(within, every)`: a snapshot younger than
//! `within` falls in the first such tier and is kept if it is the oldest one
//! of its `every`-long bucket, or if `every` is zero (keep all). Snapshots
//! older than the last tier are deleted. Buckets are aligned to the epoch,
//! not to `now`, so the choice is stable from one GC run to the next: a kept
//! snapshot stays kept until it leaves its tier, and at most one snapshot
//! per bucket survives (the oldest, which a later snapshot never displaces).
//!
//! Default: every snapshot of the last hour, one per 10 minutes for a day,
//! one per hour for 7 days.
//!
//! What is never deleted by retention (only by the user):
//! - `manual` and `pre_rewind` snapshots (a user asked for them, or they
//!   are the undo of a rewind), and `template` ones;
//! - the newest snapshot of the sandbox, whatever its kind and age: it is
//!   the restore point for crash recovery and hibernation. The daemon also
//!   names it by id ([`RetentionPolicy::to_delete_keeping`], the snapshot
//!   the store wakes from), so a hibernated sandbox's wake snapshot is kept
//!   even when two snapshots share its timestamp.
//!
//! A `same_as` record (a rolling snapshot of an unchanged guest, recorded
//! without being taken, or the `rewind` record of a rewind's target) is
//! thinned like any rolling snapshot, and the real
//! snapshot it names is kept as long as any record naming it is
//! ([`spare_targets`]): a kept record never names a deleted snapshot.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::store::SnapshotKind;

/// One tier of the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tier {
    /// Snapshots younger than this fall in the tier.
    #[serde(with = "crate::duration::serde_human")]
    pub within: Duration,
    /// Keep one per bucket of this length (zero: keep all).
    #[serde(with = "crate::duration::serde_human")]
    pub every: Duration,
}

/// A tiered retention policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionPolicy {
    /// Tiers, by increasing `within`.
    pub tiers: Vec<Tier>,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        let m = |n: u64| Duration::from_secs(60 * n);
        RetentionPolicy {
            tiers: vec![
                Tier {
                    within: m(60),
                    every: Duration::ZERO,
                },
                Tier {
                    within: m(24 * 60),
                    every: m(10),
                },
                Tier {
                    within: m(7 * 24 * 60),
                    every: m(60),
                },
            ],
        }
    }
}

/// A policy that does not make sense.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// No tiers at all (every snapshot would be deleted).
    #[error("retention needs at least one tier")]
    Empty,
    /// Tiers must cover growing ages.
    #[error("retention tiers must have strictly increasing `within` (tier {0})")]
    NotIncreasing(usize),
    /// A tier of zero age.
    #[error("retention tier {0} has a zero `within`")]
    ZeroWithin(usize),
}

/// The view of a snapshot retention needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Point<Id> {
    /// Snapshot id.
    pub id: Id,
    /// When it was taken.
    pub at: DateTime<Utc>,
    /// Why it was taken.
    pub kind: SnapshotKind,
}

impl RetentionPolicy {
    /// Parses `1h:0,24h:10m,7d:1h` (`within:every` pairs).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut tiers = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (w, e) = part
                .split_once(':')
                .ok_or_else(|| format!("retention tier {part:?}: expected WITHIN:EVERY"))?;
            tiers.push(Tier {
                within: crate::duration::parse_duration(w).map_err(|e| e.to_string())?,
                every: crate::duration::parse_duration(e).map_err(|e| e.to_string())?,
            });
        }
        let p = RetentionPolicy { tiers };
        p.validate().map_err(|e| e.to_string())?;
        Ok(p)
    }

    /// Checks the tiers.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.tiers.is_empty() {
            return Err(PolicyError::Empty);
        }
        for (i, t) in self.tiers.iter().enumerate() {
            if t.within.is_zero() {
                return Err(PolicyError::ZeroWithin(i));
            }
            if i > 0 && t.within <= self.tiers[i - 1].within {
                return Err(PolicyError::NotIncreasing(i));
            }
        }
        Ok(())
    }

    /// The longest age anything rolling is kept: `--ago` beyond it cannot succeed.
    pub fn horizon(&self) -> Duration {
        self.tiers.last().map(|t| t.within).unwrap_or_default()
    }

    /// Like [`RetentionPolicy::to_delete`], never choosing an id in `keep`
    /// (the daemon passes the sandbox's restore point: a hibernated
    /// sandbox's wake snapshot can never be deleted).
    pub fn to_delete_keeping<Id: Clone + PartialEq>(
        &self,
        snaps: &[Point<Id>],
        now: DateTime<Utc>,
        keep: &[Id],
    ) -> Vec<Id> {
        let mut out = self.to_delete(snaps, now);
        out.retain(|id| !keep.contains(id));
        out
    }

    /// Which of one sandbox's snapshots to delete at `now`.
    pub fn to_delete<Id: Clone>(&self, snaps: &[Point<Id>], now: DateTime<Utc>) -> Vec<Id> {
        let newest = snaps.iter().map(|s| s.at).max();
        let mut order: Vec<&Point<Id>> = snaps.iter().collect();
        order.sort_by_key(|s| s.at);
        // (tier index, bucket) already holding a kept snapshot.
        let mut taken = std::collections::HashSet::new();
        let mut out = Vec::new();
        let mut newest_spared = false;
        for s in order {
            if !matches!(
                s.kind,
                SnapshotKind::Rolling
                    | SnapshotKind::Hibernate
                    | SnapshotKind::Fork
                    | SnapshotKind::Rewind
            ) {
                continue;
            }
            if Some(s.at) == newest && !newest_spared {
                newest_spared = true;
                continue;
            }
            let age = (now - s.at).to_std().unwrap_or(Duration::ZERO);
            let Some((ti, tier)) = self.tiers.iter().enumerate().find(|(_, t)| age < t.within)
            else {
                out.push(s.id.clone());
                continue;
            };
            if tier.every.is_zero() {
                continue;
            }
            let every_ms = tier.every.as_millis().max(1) as i64;
            let bucket = s.at.timestamp_millis().div_euclid(every_ms);
            if !taken.insert((ti, bucket)) {
                out.push(s.id.clone());
            }
        }
        out
    }
}

/// Takes out of `doomed` every snapshot that a record kept (not in
/// `doomed`) stands in for: `aliases` are `(record, target)` pairs, a
/// `same_as` record and the real snapshot it names. A target stays while
/// any record naming it stays, so no kept record ever names a deleted
/// snapshot; the target goes with its last record (or later, by its own
/// age). Targets are never records themselves (no chains), so one pass is
/// enough.
pub fn spare_targets<Id: PartialEq>(doomed: &mut Vec<Id>, aliases: &[(Id, Id)]) {
    let needed: Vec<&Id> = aliases
        .iter()
        .filter(|(rec, _)| !doomed.contains(rec))
        .map(|(_, target)| target)
        .collect();
    doomed.retain(|id| !needed.contains(&id));
}

#[cfg(test)]
mod tests {
    use chrono::{Duration as CDuration, TimeZone};

    use super::*;

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).single().unwrap()
    }

    fn rolling_every_minute(minutes: i64) -> Vec<Point<i64>> {
        (0..minutes)
            .map(|i| Point {
                id: i,
                at: t0() + CDuration::minutes(i),
                kind: SnapshotKind::Rolling,
            })
            .collect()
    }

    /// Runs GC each simulated minute for `minutes`, as the daemon would, and
    /// returns the survivors.
    fn simulate(policy: &RetentionPolicy, minutes: i64) -> Vec<Point<i64>> {
        let mut live: Vec<Point<i64>> = Vec::new();
        for i in 0..minutes {
            let now = t0() + CDuration::minutes(i);
            live.push(Point {
                id: i,
                at: now,
                kind: SnapshotKind::Rolling,
            });
            let del = policy.to_delete(&live, now);
            live.retain(|p| !del.contains(&p.id));
        }
        live
    }

    #[test]
    fn keeps_everything_of_the_last_hour() {
        let p = RetentionPolicy::default();
        let snaps = rolling_every_minute(60);
        assert!(p
            .to_delete(&snaps, t0() + CDuration::minutes(59))
            .is_empty());
    }

    #[test]
    fn a_week_of_minutes_thins_to_the_tiers() {
        let p = RetentionPolicy::default();
        let minutes = 8 * 24 * 60;
        let live = simulate(&p, minutes);
        let now = t0() + CDuration::minutes(minutes - 1);
        let age = |pt: &Point<i64>| (now - pt.at).num_minutes();
        let hour: Vec<_> = live.iter().filter(|p| age(p) < 60).collect();
        let day: Vec<_> = live
            .iter()
            .filter(|p| (60..24 * 60).contains(&age(p)))
            .collect();
        let week: Vec<_> = live.iter().filter(|p| age(p) >= 24 * 60).collect();
        assert_eq!(hour.len(), 60);
        // 23 hours at one per 10 minutes (plus a partial bucket at each edge).
        assert!((138..=140).contains(&day.len()), "{}", day.len());
        // 6 days at one per hour.
        assert!((144..=146).contains(&week.len()), "{}", week.len());
        assert!(
            live.iter().all(|p| age(p) < 7 * 24 * 60),
            "nothing older than a week"
        );
        // One per bucket: kept day-tier snapshots are at least ~10 minutes apart.
        for w in day.windows(2) {
            assert!(
                (w[1].at - w[0].at).num_minutes() >= 9,
                "{:?}",
                (w[0].id, w[1].id)
            );
        }
    }

    #[test]
    fn choice_is_stable_between_runs() {
        let p = RetentionPolicy::default();
        let snaps = rolling_every_minute(3 * 60);
        let now = t0() + CDuration::minutes(3 * 60);
        let del = p.to_delete(&snaps, now);
        let kept: Vec<_> = snaps
            .iter()
            .filter(|s| !del.contains(&s.id))
            .cloned()
            .collect();
        assert!(p.to_delete(&kept, now).is_empty());
        assert!(p.to_delete(&kept, now + CDuration::seconds(30)).is_empty());
    }

    #[test]
    fn manual_pre_rewind_and_newest_are_kept() {
        let p = RetentionPolicy::default();
        let now = t0() + CDuration::days(30);
        let snaps = vec![
            Point {
                id: 1,
                at: t0(),
                kind: SnapshotKind::Manual,
            },
            Point {
                id: 2,
                at: t0(),
                kind: SnapshotKind::PreRewind,
            },
            Point {
                id: 3,
                at: t0(),
                kind: SnapshotKind::Rolling,
            },
            Point {
                id: 4,
                at: t0() + CDuration::minutes(1),
                kind: SnapshotKind::Hibernate,
            },
        ];
        // 3 is too old; 4 is too old as well but the newest: the restore point.
        assert_eq!(p.to_delete(&snaps, now), vec![3]);
    }

    #[test]
    fn kept_ids_survive_even_when_timestamps_tie() {
        let p = RetentionPolicy::parse("1m:0").unwrap();
        // Two hibernate snapshots at the same instant, a day old: retention
        // spares one of them as the newest; the one named in `keep` (the wake
        // snapshot as the store picks it) must be the survivor.
        let at = t0();
        let snaps = vec![
            Point {
                id: 1,
                at,
                kind: SnapshotKind::Hibernate,
            },
            Point {
                id: 2,
                at,
                kind: SnapshotKind::Hibernate,
            },
        ];
        let now = at + CDuration::days(1);
        assert_eq!(
            p.to_delete(&snaps, now),
            vec![2],
            "plain retention spares the first"
        );
        assert_eq!(p.to_delete_keeping(&snaps, now, &[2]), Vec::<i64>::new());
        assert!(!p.to_delete_keeping(&snaps, now, &[1]).contains(&1));
    }

    #[test]
    fn a_target_stays_while_a_kept_record_names_it() {
        let p = RetentionPolicy::parse("1h:0,1d:1h").unwrap();
        // 0 is real, 1..=3 are `same_as` 0; 4 is real, 5 `same_as` 4. Two
        // hours later, the hour tier keeps one per hour bucket: 0 (the
        // oldest of its hour) and the newest (5) survive plain retention.
        let at = |m: i64| t0() + CDuration::minutes(m);
        let snaps: Vec<Point<i64>> = [0, 10, 20, 30, 40, 50]
            .iter()
            .enumerate()
            .map(|(i, m)| Point {
                id: i as i64,
                at: at(*m),
                kind: SnapshotKind::Rolling,
            })
            .collect();
        let aliases = [(1, 0), (2, 0), (3, 0), (5, 4)];
        let now = at(120);
        let mut doomed = p.to_delete(&snaps, now);
        assert_eq!(doomed, vec![1, 2, 3, 4], "plain retention");
        spare_targets(&mut doomed, &aliases);
        // 4 is named by the kept 5: it stays; 1..=3 go, 0 stays on its own.
        assert_eq!(doomed, vec![1, 2, 3]);
        // A target whose records all go may go too.
        let mut doomed = vec![0, 1, 2, 3];
        spare_targets(&mut doomed, &[(1, 0), (2, 0), (3, 0)]);
        assert_eq!(doomed, vec![0, 1, 2, 3]);
        // One record left is enough to keep it.
        let mut doomed = vec![0, 1, 2];
        spare_targets(&mut doomed, &[(1, 0), (2, 0), (3, 0)]);
        assert_eq!(doomed, vec![1, 2]);
        // Nothing else is spared: never a record for its target's sake.
        let mut doomed = vec![7, 8];
        spare_targets(&mut doomed, &[(1, 0)]);
        assert_eq!(doomed, vec![7, 8]);
    }

    #[test]
    fn parses_and_validates_tiers() {
        let p = RetentionPolicy::parse("1h:0, 24h:10m,7d:1h").unwrap();
        assert_eq!(p, RetentionPolicy::default());
        assert_eq!(p.horizon(), Duration::from_secs(7 * 86400));
        assert!(RetentionPolicy::parse("").is_err());
        assert!(RetentionPolicy::parse("1h:0,30m:1m").is_err());
        assert!(RetentionPolicy::parse("1h").is_err());
        assert!(RetentionPolicy::parse("0:0").is_err());
    }
}
