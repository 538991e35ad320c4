//! Device state to and from a file: QEMU's migration stream with `x-ignore-shared`.
//!
//! Contract: guest RAM is not in the stream. It lives in the shared RAM file
//! (`VmSpec::mem_path`), so a save writes only device state and a restore starts QEMU
//! on the same RAM file with the state file as its incoming migration.
//! - Save ([`QemuVm::save_device_state_with`]): the VM must be paused and stays paused
//!   (`postmigrate`) until `resume`. [`SaveMethod::Fd`] opens the file here and passes
//!   it to QEMU with `getfd` (`SCM_RIGHTS`), then `migrate fd:`; [`SaveMethod::Exec`]
//!   runs `migrate exec:cat > file`, a shell QEMU spawns (refused while
//!   `VmSpec::seccomp` is on: the filter would kill QEMU).
//! - Load (`load_device_state`, run by the driver when `VmSpec::incoming` is set): the
//!   file is passed the same way and `migrate-incoming fd:` waits until QEMU has left
//!   `inmigrate`; the VM is then in the run state the source had (paused).
//!
//! Both directions give up after [`MIGRATION_TIMEOUT`] and report QEMU's `error-desc`.
//!
//! A save runs inside a snapshot's pause, so how soon its end is seen counts: with the
//! `events` migration capability on, QEMU sends `MIGRATION` events, and the save ends
//! on the one that says `completed` (or `failed`). `query-migrate` is still polled
//! beside it, backing off from 5 ms, in case an event is missed (a lagging
//! subscriber). [`set_completion_events`] turns the events off, for a benchmark's
//! before/after: completion then comes from the poll alone, as it used to (from
//! 0.5 ms, doubling to 10 ms).

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::broadcast::error::RecvError;

use serde_json::{json, Value};

use super::vm::QemuVm;
use crate::{SaveMethod, SaveStats, SaveSteps, Vm, VmmError};

/// Upper bound of a device-state save or load.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// Upper bound of the wait from a completed save to its run state settling.
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(10);
const FD_OUT: &str = "strata-state-out";
const FD_IN: &str = "strata-state-in";

/// Whether saves wait for QEMU's `MIGRATION` events (the default) or only
/// poll `query-migrate`.
static COMPLETION_EVENTS: AtomicBool = AtomicBool::new(true);

/// Chooses how a device-state save learns that it ended: `true` (the
/// default) from QEMU's `MIGRATION` event, with a backed-off poll beside it;
/// `false`, from polling `query-migrate` alone (the old way). Process-wide;
/// meant for benchmarks that compare the two in one run.
pub fn set_completion_events(on: bool) {
    COMPLETION_EVENTS.store(on, Ordering::Relaxed);
}

/// Whether saves share QMP round trips (the default; see
/// [`set_shared_round_trips`]).
static SHARED_ROUND_TRIPS: AtomicBool = AtomicBool::new(true);

/// Chooses how many QMP round trips a device-state save costs: `true` (the
/// default) sends the run-state check with the capabilities (set once per
/// VM) and `getfd` with `migrate`; `false`, one command per round trip and
/// the capabilities on every save (the old way). Process-wide; meant for
/// benchmarks that compare the two in one run.
pub fn set_shared_round_trips(on: bool) {
    SHARED_ROUND_TRIPS.store(on, Ordering::Relaxed);
}

fn shared_round_trips() -> bool {
    SHARED_ROUND_TRIPS.load(Ordering::Relaxed)
}

/// Whether saves currently wait for `MIGRATION` events.
pub fn completion_events() -> bool {
    COMPLETION_EVENTS.load(Ordering::Relaxed)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// What a `MIGRATION` event or a `query-migrate` answer says of the save.
enum Progress {
    Completed,
    Failed,
    Going,
}

/// Reads the `status` of a `MIGRATION` event's data or of a
/// `query-migrate` answer (the same field in both).
fn progress(v: &Value) -> Progress {
    match v.get("status").and_then(Value::as_str).unwrap_or("none") {
        "completed" => Progress::Completed,
        "failed" | "cancelled" => Progress::Failed,
        _ => Progress::Going,
    }
}

impl QemuVm {
    /// Sets the migration capabilities this driver's saves and loads use,
    /// unless this VM already has them: QEMU keeps capabilities across
    /// migrations, so a VM's second save skips the round trip (with
    /// [`set_shared_round_trips`] off, every save sets them). `events` is
    /// always on: a save that polls instead just does not listen.
    async fn migrate_caps(&self) -> Result<(), VmmError> {
        if shared_round_trips() && self.caps_set.load(Ordering::Acquire) {
            return Ok(());
        }
        self.exec(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [
                {"capability": "x-ignore-shared", "state": true},
                {"capability": "events", "state": true},
            ]})),
        )
        .await?;
        self.caps_set.store(true, Ordering::Release);
        Ok(())
    }

    /// Saves device state with an explicit [`SaveMethod`].
    pub async fn save_device_state_with(
        &self,
        path: &Path,
        method: SaveMethod,
    ) -> Result<SaveStats, VmmError> {
        if method == SaveMethod::Exec && self.spec.seccomp {
            // QEMU's seccomp filter (spawn=deny) kills the whole process on fork.
            return Err(VmmError::Migration {
                reason: "exec: migration spawns a process, which this VM's seccomp filter forbids; use SaveMethod::Fd".into(),
            });
        }
        // The run-state check and the capabilities share one round trip:
        // QMP answers a connection's commands in the order they were sent.
        let t_check = Instant::now();
        let (st, caps) = if shared_round_trips() {
            tokio::join!(self.status(), self.migrate_caps())
        } else {
            let st = self.status().await;
            (st, self.migrate_caps().await)
        };
        let st = st?;
        if st.running {
            return Err(VmmError::WrongState {
                status: st.status,
                needed: "paused",
            });
        }
        caps?;
        // Subscribed before `migrate`: a save of a few hundred KiB can end
        // before its reply is read.
        let events = completion_events().then(|| self.qmp.subscribe());
        let t0 = Instant::now();
        let mut steps = SaveSteps {
            check_ms: ms(t_check),
            ..SaveSteps::default()
        };
        match method {
            SaveMethod::Fd => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(path)
                    .map_err(|e| VmmError::io(path, e))?;
                // `getfd` and `migrate` go out together; QEMU runs them in
                // order, so `migrate` finds the descriptor (if `getfd`
                // failed, both answers say so).
                let uri = json!({"uri": format!("fd:{FD_OUT}")});
                let getfd = self.qmp.execute_with_fd(
                    "getfd",
                    Some(json!({"fdname": FD_OUT})),
                    file.as_fd(),
                );
                let (fd, started) = if shared_round_trips() {
                    tokio::join!(getfd, self.exec("migrate", Some(uri)))
                } else {
                    let fd = getfd.await;
                    (fd, self.exec("migrate", Some(uri)).await)
                };
                drop(file);
                fd?;
                started?;
            }
            SaveMethod::Exec => {
                let quoted = shell_quote(&path.to_string_lossy());
                self.exec(
                    "migrate",
                    Some(json!({"uri": format!("exec:cat > {quoted}")})),
                )
                .await?;
            }
        }
        steps.start_ms = ms(t0);
        let t_complete = Instant::now();
        let ended = match events {
            Some(rx) => self.wait_save_events(rx).await,
            None => self.wait_migration("save").await,
        };
        if let Err(e) = ended {
            // A failed save also leaves `finish-migrate` a moment after it
            // says so, and `cont` is refused until then: the caller's
            // resume must find the VM settled (`postmigrate`), or the guest
            // stays stopped and no later save is accepted.
            let _ = self.wait_finalized().await;
            return Err(e);
        }
        steps.complete_ms = ms(t_complete);
        let t_final = Instant::now();
        self.wait_finalized().await?;
        steps.finalize_ms = ms(t_final);
        let elapsed = t0.elapsed();
        let bytes = std::fs::metadata(path)
            .map_err(|e| VmmError::io(path, e))?
            .len();
        Ok(SaveStats {
            bytes,
            elapsed,
            method,
            steps,
        })
    }

    /// Waits for the save's end: the first `MIGRATION` event that says so,
    /// or a `query-migrate` poll (from 5 ms, doubling to 50 ms) that does.
    async fn wait_save_events(
        &self,
        mut rx: tokio::sync::broadcast::Receiver<crate::QmpEvent>,
    ) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut poll = Duration::from_millis(5);
        let mut next_poll = tokio::time::Instant::now() + poll;
        let mut events_open = true;
        loop {
            let p = tokio::select! {
                ev = rx.recv(), if events_open => match ev {
                    Ok(ev) if ev.event == "MIGRATION" => progress(&ev.data),
                    Ok(_) | Err(RecvError::Lagged(_)) => Progress::Going,
                    // The client is gone (QEMU died): the poll says how.
                    Err(RecvError::Closed) => {
                        events_open = false;
                        Progress::Going
                    }
                },
                _ = tokio::time::sleep_until(next_poll) => {
                    poll = (poll * 2).min(Duration::from_millis(50));
                    next_poll = tokio::time::Instant::now() + poll;
                    progress(&self.query_migrate("save").await?)
                }
            };
            match p {
                Progress::Completed => return Ok(()),
                // The event carries no reason: query-migrate has it.
                Progress::Failed => return self.wait_migration("save").await,
                Progress::Going => {}
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "save: not completed after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
        }
    }

    /// Waits until the VM has left `finish-migrate`. QEMU reports a save
    /// `completed` (event and `query-migrate` alike) a moment before its
    /// migration thread moves the run state on to `postmigrate`, and
    /// refuses `cont` in between ("Migration is not finalized yet"): seen
    /// once the `MIGRATION` event made the end visible sooner than a poll.
    async fn wait_finalized(&self) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(200);
        loop {
            let st = self.status().await?;
            if st.status != "finish-migrate" {
                return Ok(());
            }
            if t0.elapsed() > FINALIZE_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "save: completed, but the VM stayed in finish-migrate for {} s",
                        FINALIZE_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(5));
        }
    }

    async fn query_migrate(&self, what: &str) -> Result<Value, VmmError> {
        self.exec("query-migrate", None).await.map_err(|e| match e {
            VmmError::ProcessDied { reason } => VmmError::Migration {
                reason: format!("{what}: QEMU died: {reason}"),
            },
            other => other,
        })
    }

    async fn wait_migration(&self, what: &str) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(500);
        loop {
            let info = self.query_migrate(what).await?;
            match progress(&info) {
                Progress::Completed => return Ok(()),
                Progress::Failed => {
                    let desc = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no description");
                    return Err(VmmError::Migration {
                        reason: format!("{what}: {desc}"),
                    });
                }
                Progress::Going => {}
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "{what}: not completed after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(10));
        }
    }

    pub(super) async fn load_device_state(&self, state: &Path) -> Result<(), VmmError> {
        let file = std::fs::File::open(state).map_err(|e| VmmError::io(state, e))?;
        // Capabilities, descriptor and `migrate-incoming` go out together:
        // QEMU answers them in order, so each finds what the one before set
        // (a failure shows in its own answer and in those after it).
        let uri = json!({"uri": format!("fd:{FD_IN}")});
        let (caps, fd, started) = tokio::join!(
            self.migrate_caps(),
            self.qmp
                .execute_with_fd("getfd", Some(json!({"fdname": FD_IN})), file.as_fd()),
            self.exec("migrate-incoming", Some(uri)),
        );
        drop(file);
        caps?;
        fd?;
        started?;
        // The destination shows the incoming migration in query-migrate; once it is
        // completed the VM is in the run state the source had (paused).
        let t0 = Instant::now();
        loop {
            let st = match self.status().await {
                Ok(s) => s,
                Err(VmmError::ProcessDied { reason }) => {
                    return Err(VmmError::Migration {
                        reason: format!("restore from {state:?}: {reason}"),
                    })
                }
                Err(e) => return Err(e),
            };
            if st.status != "inmigrate" {
                let info = self.exec("query-migrate", None).await?;
                let status = info.get("status").and_then(Value::as_str).unwrap_or("none");
                if status == "failed" {
                    return Err(VmmError::Migration {
                        reason: format!(
                            "restore from {state:?}: {}",
                            info.get("error-desc")
                                .and_then(Value::as_str)
                                .unwrap_or("failed")
                        ),
                    });
                }
                return Ok(());
            }
            if t0.elapsed() > MIGRATION_TIMEOUT {
                return Err(VmmError::Migration {
                    reason: format!(
                        "restore from {state:?}: still loading after {} s",
                        MIGRATION_TIMEOUT.as_secs()
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
