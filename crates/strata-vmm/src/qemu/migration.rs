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

use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::vm::QemuVm;
use crate::{SaveMethod, SaveStats, Vm, VmmError};

/// Upper bound of a device-state save or load.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
const FD_OUT: &str = "strata-state-out";
const FD_IN: &str = "strata-state-in";

impl QemuVm {
    async fn migrate_caps(&self) -> Result<(), VmmError> {
        self.exec(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
        )
        .await
        .map(|_| ())
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
        let st = self.status().await?;
        if st.running {
            return Err(VmmError::WrongState {
                status: st.status,
                needed: "paused",
            });
        }
        self.migrate_caps().await?;
        let t0 = Instant::now();
        match method {
            SaveMethod::Fd => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(path)
                    .map_err(|e| VmmError::io(path, e))?;
                self.qmp
                    .execute_with_fd("getfd", Some(json!({"fdname": FD_OUT})), file.as_fd())
                    .await?;
                drop(file);
                self.exec("migrate", Some(json!({"uri": format!("fd:{FD_OUT}")})))
                    .await?;
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
        self.wait_migration("save").await?;
        let elapsed = t0.elapsed();
        let bytes = std::fs::metadata(path)
            .map_err(|e| VmmError::io(path, e))?
            .len();
        Ok(SaveStats {
            bytes,
            elapsed,
            method,
        })
    }

    async fn wait_migration(&self, what: &str) -> Result<(), VmmError> {
        let t0 = Instant::now();
        let mut delay = Duration::from_micros(500);
        loop {
            let info = self
                .exec("query-migrate", None)
                .await
                .map_err(|e| match e {
                    VmmError::ProcessDied { reason } => VmmError::Migration {
                        reason: format!("{what}: QEMU died: {reason}"),
                    },
                    other => other,
                })?;
            match info.get("status").and_then(Value::as_str).unwrap_or("none") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let desc = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no description");
                    return Err(VmmError::Migration {
                        reason: format!("{what}: {desc}"),
                    });
                }
                _ => {}
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
        self.migrate_caps().await?;
        let file = std::fs::File::open(state).map_err(|e| VmmError::io(state, e))?;
        self.qmp
            .execute_with_fd("getfd", Some(json!({"fdname": FD_IN})), file.as_fd())
            .await?;
        drop(file);
        self.exec(
            "migrate-incoming",
            Some(json!({"uri": format!("fd:{FD_IN}")})),
        )
        .await?;
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
