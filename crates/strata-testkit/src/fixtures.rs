//! Fixtures of stratad's store (feature `stratad`): records to insert where a
//! test or a benchmark needs sandboxes that exist without a VM behind them.
//!
//! This module names stratad's types: use it from integration tests,
//! examples and the benchmark, never from stratad's own unit tests (they
//! would see two copies of stratad, and its types would not match).
//!
//! ```ignore
//! use strata_testkit::fixtures::{created_event, sandbox_record};
//! let rec = SandboxRecord {
//!     labels: [("team".into(), "t1".into())].into(),
//!     ..sandbox_record("default", SandboxState::Hibernated, chrono::Utc::now())
//! };
//! store.insert_sandbox(&rec, &created_event(&rec))?;
//! ```

use chrono::{DateTime, Utc};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState};
use stratad::store::{Event, EventPhase, SandboxRecord, Store, StoreResult};

/// A sandbox record of `tenant` in `state`, created and last changed `at`, with a
/// fresh id and nothing else: no template or source snapshot, the default
/// size, no labels, daemon defaults for the idle timeout and the rolling
/// interval, no VM (no pid, no accelerator), not deleted. Change fields with
/// struct update syntax (`SandboxRecord { pid: Some(1), ..sandbox_record(…) }`).
pub fn sandbox_record(tenant: &str, state: SandboxState, at: DateTime<Utc>) -> SandboxRecord {
    SandboxRecord {
        id: SandboxId::generate(),
        tenant: tenant.into(),
        template: None,
        source_snapshot: None,
        size: SandboxSize::default(),
        labels: Default::default(),
        state,
        state_reason: None,
        pending_op: None,
        idle_timeout_s: None,
        snapshot_interval_s: None,
        created_at: at,
        updated_at: at,
        last_activity_at: at,
        pid: None,
        accel: None,
        deleted_at: None,
        version: 0,
    }
}

/// The journal event of `rec`'s creation, done, straight into its state
/// (what [`stratad::store::Store::insert_sandbox`] takes beside the record).
pub fn created_event(rec: &SandboxRecord) -> Event {
    Event {
        from_state: None,
        ..Event::new(
            rec,
            Op::Created,
            Some(rec.state),
            EventPhase::Done,
            None,
            rec.created_at,
        )
    }
}

/// Writes `records` into `store` in transactions of `batch` records each (a
/// fast seed of many records, not what the service does: it writes one
/// transaction per change).
pub fn commit_batched<S: Store + ?Sized>(
    store: &S,
    records: impl IntoIterator<Item = SandboxRecord>,
    batch: usize,
) -> StoreResult<()> {
    let batch = batch.max(1);
    let mut buf = Vec::with_capacity(batch);
    let flush = |buf: &mut Vec<SandboxRecord>| {
        let refs: Vec<&SandboxRecord> = buf.iter().collect();
        let r = store.commit(&refs, &[], None);
        buf.clear();
        r
    };
    for r in records {
        buf.push(r);
        if buf.len() == batch {
            flush(&mut buf)?;
        }
    }
    if !buf.is_empty() {
        flush(&mut buf)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_and_its_creation() {
        let at = Utc::now();
        let rec = sandbox_record("t1", SandboxState::Paused, at);
        assert_eq!(
            (rec.tenant.as_str(), rec.state),
            ("t1", SandboxState::Paused)
        );
        assert_eq!(
            (rec.created_at, rec.updated_at, rec.last_activity_at),
            (at, at, at)
        );
        assert_ne!(rec.id, sandbox_record("t1", SandboxState::Paused, at).id);
        let ev = created_event(&rec);
        assert_eq!(
            (ev.op, ev.phase, ev.from_state),
            (Op::Created, EventPhase::Done, None)
        );
        assert_eq!((ev.to_state, ev.at), (Some(SandboxState::Paused), at));
        assert_eq!((ev.tenant.as_str(), &ev.sandbox_id), ("t1", &rec.id));
    }

    #[test]
    fn records_are_committed_in_batches() {
        let dir = crate::scratch_dir("tk-store");
        let store = stratad::store::SqliteStore::open(&dir.path().join("s.db"), 1).expect("store");
        let at = Utc::now();
        let recs: Vec<SandboxRecord> = (0..7)
            .map(|_| sandbox_record("t1", SandboxState::Hibernated, at))
            .collect();
        commit_batched(&store, recs.clone(), 3).expect("commit");
        for r in &recs {
            let got = store.get_sandbox(&r.id).expect("get").expect("stored");
            assert_eq!(got.state, SandboxState::Hibernated);
        }
        commit_batched(&store, Vec::new(), 3).expect("nothing to commit");
    }
}
