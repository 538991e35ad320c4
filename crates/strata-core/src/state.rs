//! The sandbox state machine.
//!
//! `creating → running ⇄ paused`, `running|paused → hibernated → running`,
//! `creating|running|paused → failed → running` (recovery from the last
//! snapshot) and any state `→ deleted`. Every operation asks
//! [`SandboxState::apply`] first; a refused operation changes nothing.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Being forked from a template or snapshot.
    Creating,
    /// The VM runs and its agent answers.
    Running,
    /// vCPUs stopped, RAM kept, the VM process alive.
    Paused,
    /// Snapshotted and the VM process ended: no CPU, no RAM.
    Hibernated,
    /// The VM died unexpectedly; recoverable from the last snapshot.
    Failed,
    /// Gone; only the record remains.
    Deleted,
}

impl SandboxState {
    /// All states, for documentation and filters.
    pub const ALL: [SandboxState; 6] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Hibernated,
        SandboxState::Failed,
        SandboxState::Deleted,
    ];

    /// The lowercase name used in the API.
    pub fn as_str(&self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Hibernated => "hibernated",
            SandboxState::Failed => "failed",
            SandboxState::Deleted => "deleted",
        }
    }

    /// Whether a VM process should exist for a sandbox in this state.
    pub fn has_vm(&self) -> bool {
        matches!(
            self,
            SandboxState::Creating | SandboxState::Running | SandboxState::Paused
        )
    }

    /// The state after `op`, or why `op` is not allowed now.
    pub fn apply(self, op: Op) -> Result<SandboxState, TransitionError> {
        use Op::*;
        use SandboxState::*;
        let next = match (self, op) {
            (Creating, Created) => Running,
            (Running, Pause) => Paused,
            (Paused, Resume) | (Hibernated, Resume) => Running,
            (Running | Paused, Hibernate) => Hibernated,
            (Running | Paused, Snapshot) => self,
            (Running | Paused, Fork) => self,
            (Running | Paused | Hibernated | Failed, Rewind) => Running,
            (Running, Exec) => Running,
            (Creating | Running | Paused, Fail) => Failed,
            (Failed, Recover) => Running,
            (Deleted, Configure) => return Err(TransitionError { state: self, op }),
            (_, Configure) => self,
            (Deleted, Delete) => return Err(TransitionError { state: self, op }),
            (_, Delete) => Deleted,
            _ => return Err(TransitionError { state: self, op }),
        };
        Ok(next)
    }
}

/// Where a fork takes a sandbox's present state from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkSource {
    /// Its VM: an implicit snapshot of the running (or paused) guest.
    Live,
    /// It has no VM (hibernated, failed): its present state is its latest
    /// snapshot, forked without waking it.
    LatestSnapshot,
}

impl SandboxState {
    /// Whether `op` is allowed now (what [`SandboxState::apply`] decides).
    pub fn can(self, op: Op) -> bool {
        self.apply(op).is_ok()
    }

    /// How a fork of a sandbox in this state proceeds, decided here once:
    /// a live fork where `Fork` is allowed, the latest snapshot where the
    /// sandbox has no VM but a history (hibernated, failed), else refused.
    pub fn fork_source(self) -> Result<ForkSource, TransitionError> {
        match self {
            SandboxState::Hibernated | SandboxState::Failed => Ok(ForkSource::LatestSnapshot),
            s => s.apply(Op::Fork).map(|_| ForkSource::Live),
        }
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SandboxState::ALL
            .iter()
            .copied()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown state {s:?}"))
    }
}

/// An operation on a sandbox, as far as its state is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// The VM of a new sandbox came up.
    Created,
    /// Stop the vCPUs.
    Pause,
    /// Continue a paused sandbox or wake a hibernated one.
    Resume,
    /// Snapshot and stop the VM process.
    Hibernate,
    /// Take a snapshot.
    Snapshot,
    /// Fork the present state into a new sandbox.
    Fork,
    /// Return to one of its own snapshots.
    Rewind,
    /// Run a command or touch files through the agent.
    Exec,
    /// The VM died.
    Fail,
    /// Restore a failed sandbox from its last snapshot.
    Recover,
    /// Delete it.
    Delete,
    /// Change its settings (idle timeout): any state but deleted, unchanged.
    Configure,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_string(self).unwrap_or_default();
        f.write_str(s.trim_matches('"'))
    }
}

/// An operation refused in the sandbox's present state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot {op} a sandbox that is {state}")]
pub struct TransitionError {
    /// The state the sandbox is in (and stays in).
    pub state: SandboxState,
    /// The refused operation.
    pub op: Op,
}

#[cfg(test)]
mod tests {
    use super::Op::*;
    use super::SandboxState::*;
    use super::*;

    #[test]
    fn lifecycle() {
        let s = Creating.apply(Created).unwrap();
        assert_eq!(s, Running);
        let s = s.apply(Pause).unwrap();
        assert_eq!(s, Paused);
        assert_eq!(s.apply(Resume).unwrap(), Running);
        assert_eq!(s.apply(Hibernate).unwrap(), Hibernated);
        assert_eq!(Hibernated.apply(Resume).unwrap(), Running);
        assert_eq!(Running.apply(Fail).unwrap(), Failed);
        assert_eq!(Failed.apply(Recover).unwrap(), Running);
        assert_eq!(Hibernated.apply(Delete).unwrap(), Deleted);
    }

    #[test]
    fn refusals_name_state_and_op() {
        let e = Hibernated.apply(Snapshot).unwrap_err();
        assert_eq!(e.state, Hibernated);
        assert_eq!(
            e.to_string(),
            "cannot snapshot a sandbox that is hibernated"
        );
        assert!(Paused.apply(Exec).is_err());
        assert!(Running.apply(Resume).is_err());
        assert!(Deleted.apply(Delete).is_err());
        assert!(Deleted.apply(Resume).is_err());
        assert!(Hibernated.apply(Fork).is_err());
    }

    /// The whole state × operation table, written out: every cell is the
    /// state the operation leads to, or `-` where it is refused. A change
    /// of the state machine changes this table on purpose or fails here.
    #[test]
    fn the_full_state_by_operation_table() {
        let ops = [
            Created, Pause, Resume, Hibernate, Snapshot, Fork, Rewind, Exec, Fail, Recover, Delete,
            Configure,
        ];
        #[rustfmt::skip]
        let table: [(SandboxState, [&str; 12]); 6] = [
            //           created    pause     resume     hibernate     snapshot   fork       rewind     exec       fail      recover    delete     configure
            (Creating,   ["running", "-",      "-",       "-",          "-",       "-",       "-",       "-",       "failed", "-",       "deleted", "creating"]),
            (Running,    ["-",       "paused", "-",       "hibernated", "running", "running", "running", "running", "failed", "-",       "deleted", "running"]),
            (Paused,     ["-",       "-",      "running", "hibernated", "paused",  "paused",  "running", "-",       "failed", "-",       "deleted", "paused"]),
            (Hibernated, ["-",       "-",      "running", "-",          "-",       "-",       "running", "-",       "-",      "-",       "deleted", "hibernated"]),
            (Failed,     ["-",       "-",      "-",       "-",          "-",       "-",       "running", "-",       "-",      "running", "deleted", "failed"]),
            (Deleted,    ["-",       "-",      "-",       "-",          "-",       "-",       "-",       "-",       "-",      "-",       "-",       "-"]),
        ];
        assert_eq!(
            table.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            SandboxState::ALL,
            "one row per state, in order"
        );
        for (st, row) in table {
            for (op, want) in ops.iter().zip(row) {
                let got = match st.apply(*op) {
                    Ok(next) => next.as_str().to_owned(),
                    Err(e) => {
                        assert_eq!((e.state, e.op), (st, *op));
                        "-".to_owned()
                    }
                };
                assert_eq!(got, want, "{st} × {op}");
                assert_eq!(st.can(*op), want != "-", "{st} × {op}");
            }
        }
    }

    #[test]
    fn fork_source_is_decided_by_the_state() {
        assert_eq!(Running.fork_source(), Ok(ForkSource::Live));
        assert_eq!(Paused.fork_source(), Ok(ForkSource::Live));
        assert_eq!(Hibernated.fork_source(), Ok(ForkSource::LatestSnapshot));
        assert_eq!(Failed.fork_source(), Ok(ForkSource::LatestSnapshot));
        for st in [Creating, Deleted] {
            let e = st.fork_source().unwrap_err();
            assert_eq!((e.state, e.op), (st, Fork));
        }
    }

    #[test]
    fn state_names_round_trip() {
        for st in SandboxState::ALL {
            assert_eq!(st.as_str().parse::<SandboxState>().unwrap(), st);
        }
    }
}
