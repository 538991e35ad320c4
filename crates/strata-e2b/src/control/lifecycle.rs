//! E2B's sandbox lifecycle (`Sandbox.create(lifecycle=…)`) on strata's
//! per-sandbox [`LifecyclePolicy`].
//!
//! The SDKs resolve `lifecycle` into create-body fields: `autoPause`
//! (`on_timeout` `"pause"` → `true`, `"kill"` → `false`, omitted when the
//! caller chose nothing) and `autoResume: {"enabled": bool}`. Mapping:
//! - `autoPause: false` → `on_timeout: delete`: at its timeout the daemon
//!   deletes the sandbox (a delete in its journal, the reason in the
//!   event's detail);
//! - `autoPause: true` or omitted → `on_timeout: hibernate` (an omitted
//!   one keeps strata's default: E2B's hosted API kills, strata keeps the
//!   sandbox);
//! - `autoResume.enabled: false` → a hibernated sandbox does not wake on an
//!   envd call (it answers as E2B's proxy does for a sandbox that is not
//!   running: `unavailable` / 502 "… was not found"); only `connect` or
//!   `resume` wakes it. Enabled → any envd call wakes it; omitted → as
//!   enabled, except with `autoPause: false` (E2B allows `autoResume` only
//!   with a pausing timeout).
//!
//! `GET /sandboxes/{id}` reports it as `lifecycle: {onTimeout, autoResume}`;
//! forks inherit it from their source.

use serde::Deserialize;
use serde_json::{json, Value};
use stratad::store::{LifecyclePolicy, OnTimeout};

use crate::error::{E2bError, E2bResult};
use crate::E2b;

impl E2b {
    /// Drops everything the door keeps in memory for sandbox `id` (its
    /// processes, watchers, `envVars` cache) and its envd token binding:
    /// called by the service after every delete of it, a user's or its
    /// timeout's ([`stratad::service::Service::on_deleted`]).
    pub(crate) fn forget_sandbox(self: &std::sync::Arc<Self>, id: &strata_core::SandboxId) {
        self.procs.forget_sandbox(id);
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, w| w.grant.sandbox() != id);
        self.envs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.forget_port_settings(id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (st, id) = (self.clone(), id.clone());
            rt.spawn(async move { st.unbind_envd(&id).await });
        }
    }
}

/// `SandboxAutoResumeConfig`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(default)]
pub(super) struct AutoResume {
    enabled: bool,
}

/// The policy a create body asks for: `None` when it names neither field
/// (the default, or a fork's source's).
pub(super) fn asked(
    auto_pause: Option<bool>,
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
) -> E2bResult<Option<LifecyclePolicy>> {
    if auto_pause.is_none() && auto_resume.is_none() && auto_pause_memory.is_none() {
        return Ok(None);
    }
    let on_timeout = match (auto_pause, auto_pause_memory) {
        (Some(false), Some(_)) => {
            return Err(E2bError::new(
                400,
                "autoPauseMemory is only allowed when autoPause is true (on_timeout \"pause\")",
            ))
        }
        (Some(false), None) => OnTimeout::Delete,
        (_, Some(false)) => OnTimeout::HibernateDisk,
        _ => OnTimeout::Hibernate,
    };
    let auto_resume = auto_resume.map(|a| a.enabled);
    if on_timeout == OnTimeout::Delete && auto_resume == Some(true) {
        return Err(E2bError::new(
            400,
            "autoResume can only be enabled when autoPause is true (on_timeout \"pause\")",
        ));
    }
    if on_timeout == OnTimeout::HibernateDisk && auto_resume == Some(true) {
        return Err(E2bError::new(
            400,
            "autoResume cannot be enabled with autoPauseMemory false: a filesystem-only pause is resumed by connect",
        ));
    }
    // Unset: wake on use when the timeout pauses with memory (strata's
    // default); a `kill` sandbox paused by hand, and a filesystem-only
    // pause, wake only by connect (as E2B's).
    Ok(Some(LifecyclePolicy {
        on_timeout,
        auto_resume: auto_resume.unwrap_or(on_timeout == OnTimeout::Hibernate),
    }))
}

/// `SandboxLifecycle` of a sandbox detail.
pub(super) fn to_json(p: LifecyclePolicy) -> Value {
    json!({
        "onTimeout": match p.on_timeout {
            OnTimeout::Hibernate | OnTimeout::HibernateDisk => "pause",
            OnTimeout::Delete => "kill",
        },
        "autoResume": p.auto_resume,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_fields_map_onto_the_policy() {
        assert_eq!(asked(None, None, None).unwrap(), None);
        let on = |p: Option<bool>, r: Option<bool>| {
            asked(p, None, r.map(|enabled| AutoResume { enabled }))
                .unwrap()
                .unwrap()
        };
        assert_eq!(on(Some(false), None).on_timeout, OnTimeout::Delete);
        assert!(!on(Some(false), None).auto_resume);
        assert_eq!(on(Some(true), None), LifecyclePolicy::default());
        assert!(!on(Some(true), Some(false)).auto_resume);
        assert!(!on(None, Some(false)).auto_resume);
        assert_eq!(on(None, Some(false)).on_timeout, OnTimeout::Hibernate);
        let bad = asked(Some(false), None, Some(AutoResume { enabled: true })).unwrap_err();
        assert_eq!(bad.status, 400);
        // keep_memory: false → a disk-only pause, woken only by connect.
        let disk = asked(Some(true), Some(false), None).unwrap().unwrap();
        assert_eq!(disk.on_timeout, OnTimeout::HibernateDisk);
        assert!(!disk.auto_resume);
        assert_eq!(to_json(disk)["onTimeout"], "pause");
        assert_eq!(
            asked(Some(true), Some(true), None)
                .unwrap()
                .unwrap()
                .on_timeout,
            OnTimeout::Hibernate
        );
        for (p, m, r) in [
            (Some(false), Some(false), None),
            (Some(true), Some(false), Some(true)),
        ] {
            let e = asked(p, m, r.map(|enabled| AutoResume { enabled })).unwrap_err();
            assert_eq!(e.status, 400);
        }
        assert_eq!(
            to_json(on(Some(false), Some(false))),
            json!({"onTimeout": "kill", "autoResume": false})
        );
    }
}
