//! Admission: the one place that decides whether an operation may start a
//! VM on this host, for every operation that does — create, fork, wake
//! (resume of a hibernated sandbox, wake-on-access), rewind of a sandbox
//! without a VM, recovery, template builds.
//!
//! A sandbox's reservation is its record: the store counts the size of
//! every sandbox in a state with a VM *and* of every sandbox with a pending
//! operation that starts one (`resume`, `rewind`, `recover`), so a
//! reservation holds from the pending write on. [`Service::admit`] checks
//! the host's capacity and returns the placement lock; the caller writes its
//! pending record while holding it, so two admissions never both take the
//! last room. Template builds have no record: their builder VM is a
//! [`Transient`] reservation held for the build, and at most
//! [`MAX_CONCURRENT_TEMPLATE_BUILDS`] run at once.
//!
//! Refusals are `insufficient_capacity` (a code never renamed) and name
//! what is short. Later work (warm pools, placement by use, density)
//! extends this module.

use super::prelude::*;

/// Template builds (each boots a builder VM) that may run at once.
pub const MAX_CONCURRENT_TEMPLATE_BUILDS: u64 = 2;

/// Whether `op` on a sandbox in `state` starts a VM (and so needs room).
pub(crate) fn starts_vm(state: SandboxState, op: Op) -> bool {
    match op {
        Op::Created | Op::Recover => true,
        Op::Resume => state == SandboxState::Hibernated,
        Op::Rewind => !state.has_vm(),
        _ => false,
    }
}

/// Reservations without a record (template builders), in memory.
#[derive(Debug, Default)]
pub(crate) struct Transients {
    used: Mutex<(u64, u64, u64)>,
}

/// A transient reservation; released when dropped.
#[derive(Debug)]
pub(crate) struct Transient {
    owner: Arc<Service>,
    size: SandboxSize,
}

impl Drop for Transient {
    fn drop(&mut self) {
        let mut g = self
            .owner
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(u64::from(self.size.vcpus));
        g.1 = g.1.saturating_sub(u64::from(self.size.memory_mib));
        g.2 = g.2.saturating_sub(1);
    }
}

impl Service {
    /// Admits an operation that starts a VM of `size`: `Ok` with the
    /// placement lock, under which the caller records its pending write;
    /// `insufficient_capacity` when the host lacks the room.
    pub(crate) async fn admit(
        &self,
        size: SandboxSize,
    ) -> ServiceResult<tokio::sync::MutexGuard<'_, ()>> {
        let g = self.placement.lock().await;
        self.check_capacity(size).await?;
        Ok(g)
    }

    /// Checks that `size` more fits next to every reservation.
    pub(crate) async fn check_capacity(&self, size: SandboxSize) -> ServiceResult<()> {
        let (cap_cpu, cap_mem) = self.config.capacity.resolve();
        let (rec_cpu, rec_mem) = self.db(|s| s.reserved_capacity()).await?;
        let (t_cpu, t_mem, _) = *self
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (used_cpu, used_mem) = (rec_cpu + t_cpu, rec_mem + t_mem);
        if used_cpu + u64::from(size.vcpus) > cap_cpu
            || used_mem + u64::from(size.memory_mib) > cap_mem
        {
            return Err(ServiceError::InsufficientCapacity(format!(
                "this host has {} of {cap_cpu} vCPUs and {} of {cap_mem} MiB free; asked for {} vCPUs and {} MiB",
                cap_cpu.saturating_sub(used_cpu),
                cap_mem.saturating_sub(used_mem),
                size.vcpus,
                size.memory_mib
            )));
        }
        Ok(())
    }

    /// Admits a template build of `size`: room for its builder VM and a
    /// free build slot; the reservation lasts as long as the guard.
    pub(crate) async fn admit_build(
        self: &Arc<Self>,
        size: SandboxSize,
    ) -> ServiceResult<Transient> {
        let _g = self.placement.lock().await;
        let running = self
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .2;
        if running >= MAX_CONCURRENT_TEMPLATE_BUILDS {
            return Err(ServiceError::InsufficientCapacity(format!(
                "{running} template builds are running (at most {MAX_CONCURRENT_TEMPLATE_BUILDS} at once); retry when one ends"
            )));
        }
        self.check_capacity(size).await?;
        let mut u = self
            .transients
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        u.0 += u64::from(size.vcpus);
        u.1 += u64::from(size.memory_mib);
        u.2 += 1;
        Ok(Transient {
            owner: self.clone(),
            size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_operations_start_a_vm() {
        use SandboxState::*;
        assert!(starts_vm(Hibernated, Op::Resume));
        assert!(!starts_vm(Paused, Op::Resume), "a paused VM exists");
        assert!(starts_vm(Hibernated, Op::Rewind) && starts_vm(Failed, Op::Rewind));
        assert!(
            !starts_vm(Running, Op::Rewind),
            "rewind replaces the VM it has"
        );
        assert!(starts_vm(Failed, Op::Recover));
        assert!(!starts_vm(Running, Op::Exec) && !starts_vm(Running, Op::Snapshot));
    }
}
