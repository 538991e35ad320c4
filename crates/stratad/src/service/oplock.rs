//! Per-sandbox operation locks: one user operation at a time, background ones yield.

use super::prelude::*;

/// Who holds an operation lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Who {
    User,
    Background,
}

#[derive(Debug, Default)]
pub(crate) struct OpSlot {
    lock: Arc<tokio::sync::Mutex<()>>,
    holder: Mutex<Option<(Op, Who)>>,
}

/// Held for the duration of an operation on one sandbox.
pub(crate) struct OpGuard {
    _guard: OwnedMutexGuard<()>,
    slot: Arc<OpSlot>,
}

impl Drop for OpGuard {
    fn drop(&mut self) {
        *self.slot.holder.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// How long a user operation waits for a background one to finish.
pub(crate) const BACKGROUND_WAIT: Duration = Duration::from_secs(30);

impl Service {
    /// Whether a background operation holds `id`'s lock now.
    pub(super) fn held_by_background(&self, id: &SandboxId) -> bool {
        let slot = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        slot.is_some_and(|s| {
            matches!(
                *s.holder.lock().unwrap_or_else(|p| p.into_inner()),
                Some((_, Who::Background))
            )
        })
    }

    pub(super) async fn acquire(&self, id: &SandboxId, op: Op, who: Who) -> ServiceResult<OpGuard> {
        let slot = {
            let mut g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            g.entry(id.clone()).or_default().clone()
        };
        let guard = match slot.lock.clone().try_lock_owned() {
            Ok(g) => g,
            Err(_) => {
                let holder = *slot.holder.lock().unwrap_or_else(|p| p.into_inner());
                match (who, holder) {
                    (Who::User, Some((_, Who::Background)) | None) => {
                        tokio::time::timeout(BACKGROUND_WAIT, slot.lock.clone().lock_owned())
                            .await
                            .map_err(|_| {
                                ServiceError::Conflict(format!(
                                    "sandbox {id} is busy with a background operation"
                                ))
                            })?
                    }
                    (_, Some((held, _))) => {
                        return Err(ServiceError::Conflict(format!(
                            "another operation ({held}) is in progress on {id}"
                        )))
                    }
                    (Who::Background, None) => {
                        return Err(ServiceError::Conflict(format!("{id} is busy")))
                    }
                }
            }
        };
        *slot.holder.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, who));
        Ok(OpGuard {
            _guard: guard,
            slot,
        })
    }
}
