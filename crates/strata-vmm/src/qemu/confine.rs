//! A VM's cgroup: how QEMU gets into it and how an adopter finds it again.
//!
//! Contract, in the order of a start:
//! 1. [`prepare`], before the spawn: the cgroup is made and its limits written, and its
//!    `cgroup.procs` files are opened.
//! 2. Between fork and exec the child writes itself into those files
//!    (`cgroup::join_self` on [`Pending::procs_fds`]), so every page QEMU touches is
//!    charged to the cgroup.
//! 3. [`Pending::settle`], after the spawn: membership is checked (the pid is moved from
//!    here if the child could not join), and the cgroup is recorded in
//!    `<run>/cgroup.json`.
//!
//! A failure is fatal when `Limits::required`; otherwise the VM runs without limits and
//! [`Confinement::error`] says why. An adopter reads `cgroup.json` ([`recorded`], else it
//! locates the cgroup from the VM's name) and reports what it finds
//! ([`adopt_confinement`]); it never writes limits.

use std::os::fd::AsRawFd;

use super::error_chain;
use crate::cgroup::{self, CgroupError, Limits, VmCgroup};
use crate::spec::VmSpec;
use crate::{Confinement, VmmError};

/// A VM's cgroup between its creation and QEMU's spawn.
pub(super) struct Pending {
    confinement: Confinement,
    cgroup: Option<(VmCgroup, Vec<std::fs::File>)>,
}

/// Makes the cgroup `spec.limits` asks for (step 1); none without limits.
pub(super) fn prepare(spec: &VmSpec) -> Result<Pending, VmmError> {
    let mut confinement = Confinement::asked(spec);
    // The cgroup is made (limits written) before the spawn; the child joins it
    // between fork and exec, so every page QEMU touches is charged to it.
    let mut cgroup: Option<(VmCgroup, Vec<std::fs::File>)> = None;
    if let Some(limits) = &spec.limits {
        match prepare_cgroup(&spec.name, limits) {
            Ok(c) => cgroup = Some(c),
            Err(e) if limits.required => return Err(e.into()),
            Err(e) => {
                let msg = error_chain(&e);
                tracing::warn!(name = %spec.name, error = %msg, "VM starts without cgroup limits");
                confinement.error = Some(msg);
            }
        }
    }
    Ok(Pending {
        confinement,
        cgroup,
    })
}

impl Pending {
    /// The open `cgroup.procs` files, for the child to write itself into (step 2).
    pub(super) fn procs_fds(&self) -> Vec<libc::c_int> {
        self.cgroup
            .as_ref()
            .map(|(_, files)| files.iter().map(|f| f.as_raw_fd()).collect())
            .unwrap_or_default()
    }

    /// Checks that `pid` is in the cgroup and records it in the run dir (step 3).
    /// The cgroup is put in `cleanup` before anything can fail, so that a failed start
    /// removes it with the process.
    pub(super) fn settle(
        self,
        spec: &VmSpec,
        pid: u32,
        cleanup: &mut Option<VmCgroup>,
    ) -> Result<(Confinement, Option<VmCgroup>), VmmError> {
        let mut confinement = self.confinement;
        let cgroup = match self.cgroup {
            Some((cg, files)) => {
                drop(files);
                *cleanup = Some(cg.clone());
                match join_cgroup(&cg, pid) {
                    Ok(()) => confinement.limits_applied = true,
                    Err(e) if spec.limits.is_some_and(|l| l.required) => return Err(e.into()),
                    Err(e) => {
                        let msg = error_chain(&e);
                        tracing::warn!(name = %spec.name, pid, error = %msg, "QEMU runs without cgroup limits");
                        confinement.error = Some(msg);
                    }
                }
                confinement.cgroup_dirs = cg.dirs.clone();
                // Recorded for adopters, which may run in another cgroup than we do.
                let record = spec.cgroup_file();
                if let Ok(json) = serde_json::to_vec(&cg) {
                    std::fs::write(&record, json).map_err(|e| VmmError::io(&record, e))?;
                }
                Some(cg)
            }
            None => None,
        };
        Ok((confinement, cgroup))
    }
}

/// Creates the VM's cgroup with `limits` and opens its `cgroup.procs` files.
fn prepare_cgroup(
    name: &str,
    limits: &Limits,
) -> Result<(VmCgroup, Vec<std::fs::File>), CgroupError> {
    let cg = VmCgroup::locate(&cgroup::detect()?, name);
    cg.create(limits)?;
    let files = cg.open_procs()?;
    Ok((cg, files))
}

/// Checks the child joined its cgroup before exec; moves it from here if not.
fn join_cgroup(cg: &VmCgroup, pid: u32) -> Result<(), CgroupError> {
    if cg.check_member(pid).is_ok() {
        return Ok(());
    }
    cg.attach(pid)?;
    cg.check_member(pid)
}

/// The cgroup recorded in `<run>/cgroup.json` by the process that started the VM.
pub(super) fn recorded(spec: &VmSpec) -> Option<VmCgroup> {
    std::fs::read(spec.cgroup_file())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

/// The confinement of an adopted VM: its cgroup (recorded in `cgroup.json` of the
/// run dir, else located from its name) must already hold the pid.
pub(super) fn adopt_confinement(spec: &VmSpec, pid: u32) -> (Confinement, Option<VmCgroup>) {
    let mut c = Confinement::asked(spec);
    let Some(limits) = spec.limits else {
        return (c, None);
    };
    let cg = match recorded(spec) {
        Some(cg) => cg,
        None => match cgroup::detect() {
            Ok(h) => VmCgroup::locate(&h, &spec.name),
            Err(e) => {
                c.error = Some(error_chain(&e));
                return (c, None);
            }
        },
    };
    if let Err(e) = cg.check_member(pid) {
        c.error = Some(error_chain(&e));
        return (c, None);
    }
    c.cgroup_dirs = cg.dirs.clone();
    match cg.read_limits() {
        Ok((cpu, mem)) if cpu == Some(limits.cpu_millis) && mem == Some(limits.memory_bytes) => {
            c.limits_applied = true;
        }
        Ok((cpu, mem)) => {
            c.error = Some(format!(
                "cgroup holds cpu_millis {cpu:?}, memory_bytes {mem:?}; the spec says {}, {}",
                limits.cpu_millis, limits.memory_bytes
            ));
        }
        Err(e) => c.error = Some(error_chain(&e)),
    }
    (c, Some(cg))
}
