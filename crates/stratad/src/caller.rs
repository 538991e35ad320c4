//! Who asks: the [`Caller`] every service command takes.
//!
//! A caller is built only where it arises:
//! - [`Caller::Api`] by a front door (the `/v1` middleware, the E2B door) from
//!   an authenticated credential;
//! - [`Caller::Guest`] by the daemon for calls that come out of a sandbox
//!   (egress; later MCP and ports);
//! - [`Caller::System`] by the daemon's own background work (scheduler,
//!   retention, recovery, hibernation, the default template).
//!
//! Tenant visibility is decided from the caller in the service's lookups: an
//! `Api` or `Guest` caller sees its own tenant's sandboxes and snapshots, and
//! its own tenant's templates plus the platform's ([`PLATFORM_SCOPE`]); a
//! `System` caller sees everything. Policy and audit see the caller's
//! [`Caller::actor`].
//!
//! A caller is serialisable (hosts forward it, the E2B door stores the one an
//! envd token was handed to), but a `System` caller never comes off the
//! wire: deserialising one fails, so only this process makes them.

use serde::{Deserialize, Serialize};
use strata_core::SandboxId;

use crate::security::auth::Role;

/// The owner recorded on platform templates (the default template): shared
/// by every tenant, deleted or replaced by none (`default` included). Not a
/// valid tenant name (`@` is outside `[a-z0-9-_]`), so no token can carry it.
pub const PLATFORM_SCOPE: &str = "@platform";

/// Why the daemon acts on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SystemReason {
    /// Rolling snapshots.
    Scheduler,
    /// Retention and garbage collection.
    Retention,
    /// Start-up reconciliation and automatic restores.
    Recovery,
    /// Idle hibernation.
    Hibernation,
    /// The default template and other platform resources.
    Platform,
    /// Starting a sandbox's egress proxy for its guest.
    Egress,
    /// Tests and embedders acting with full visibility.
    Embedder,
}

impl SystemReason {
    /// The name used in actors and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            SystemReason::Scheduler => "scheduler",
            SystemReason::Retention => "retention",
            SystemReason::Recovery => "recovery",
            SystemReason::Hibernation => "hibernation",
            SystemReason::Platform => "platform",
            SystemReason::Egress => "egress",
            SystemReason::Embedder => "embedder",
        }
    }
}

/// The caller of a service command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Caller {
    /// An authenticated API client of a front door.
    Api {
        /// Tenant it acts for.
        tenant: String,
        /// Actor recorded in approvals and the audit log (`token:tok-…`).
        actor: String,
        /// Role of its credential.
        role: Role,
        /// Id of its credential (`tok-…`; `anonymous` with authentication
        /// off; `e2b-api-key` for a configured E2B key).
        token: String,
        /// Name of its credential, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// Code inside a sandbox calling out (egress, MCP, ports).
    Guest {
        /// The sandbox.
        sandbox: SandboxId,
        /// Its tenant.
        tenant: String,
    },
    /// The daemon itself.
    System {
        /// Why.
        reason: SystemReason,
    },
}

/// What a caller may come off the wire as (never `System`).
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum WireCaller {
    Api {
        tenant: String,
        actor: String,
        role: Role,
        token: String,
        #[serde(default)]
        name: Option<String>,
    },
    Guest {
        sandbox: SandboxId,
        tenant: String,
    },
}

impl<'de> Deserialize<'de> for Caller {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match WireCaller::deserialize(d)? {
            WireCaller::Api {
                tenant,
                actor,
                role,
                token,
                name,
            } => Caller::Api {
                tenant,
                actor,
                role,
                token,
                name,
            },
            WireCaller::Guest { sandbox, tenant } => Caller::Guest { sandbox, tenant },
        })
    }
}

impl Caller {
    /// The daemon acting for `reason`.
    pub fn system(reason: SystemReason) -> Self {
        Caller::System { reason }
    }

    /// An API caller holding token `token` (`tok-…`) of `tenant`.
    pub fn api(tenant: impl Into<String>, role: Role, token: impl Into<String>) -> Self {
        let token = token.into();
        Caller::Api {
            tenant: tenant.into(),
            actor: format!("token:{token}"),
            role,
            token,
            name: None,
        }
    }

    /// The tenant the caller acts for (`None`: the daemon, which sees all).
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Api { tenant, .. } | Caller::Guest { tenant, .. } => Some(tenant),
            Caller::System { .. } => None,
        }
    }

    /// The tenant new records of this caller belong to (the daemon's own
    /// records belong to the platform).
    pub fn owner(&self) -> &str {
        self.tenant().unwrap_or(PLATFORM_SCOPE)
    }

    /// The actor recorded in approvals, the audit log and the journal.
    pub fn actor(&self) -> String {
        match self {
            Caller::Api { actor, .. } => actor.clone(),
            Caller::Guest { sandbox, .. } => format!("sandbox:{sandbox}"),
            Caller::System { reason } => format!("system:{}", reason.as_str()),
        }
    }

    /// The role of an API caller.
    pub fn role(&self) -> Option<Role> {
        match self {
            Caller::Api { role, .. } => Some(*role),
            _ => None,
        }
    }

    /// The credential id of an API caller.
    pub fn token(&self) -> Option<&str> {
        match self {
            Caller::Api { token, .. } => Some(token),
            _ => None,
        }
    }

    /// Whether this is the daemon itself.
    pub fn is_system(&self) -> bool {
        matches!(self, Caller::System { .. })
    }

    /// Whether the caller sees records of `owner` (sandboxes, snapshots).
    pub fn sees(&self, owner: &str) -> bool {
        self.tenant().is_none_or(|t| t == owner)
    }

    /// Whether the caller may use a template of `owner`: its own tenant's
    /// and the platform's.
    pub fn sees_template(&self, owner: &str) -> bool {
        owner == PLATFORM_SCOPE || self.sees(owner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_and_guest_callers_round_trip_and_system_ones_do_not() {
        let id: SandboxId = "sb-abc".parse().unwrap();
        for c in [
            Caller::api("acme", Role::Developer, "tok-1"),
            Caller::Guest {
                sandbox: id,
                tenant: "acme".into(),
            },
        ] {
            let j = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Caller>(&j).unwrap(), c, "{j}");
        }
        let sys = serde_json::to_string(&Caller::system(SystemReason::Scheduler)).unwrap();
        assert!(serde_json::from_str::<Caller>(&sys).is_err(), "{sys}");
        assert!(
            serde_json::from_str::<Caller>(r#"{"kind":"system","reason":"scheduler"}"#).is_err()
        );
    }

    #[test]
    fn visibility() {
        let a = Caller::api("acme", Role::Viewer, "tok-1");
        assert!(a.sees("acme") && !a.sees("other") && !a.sees(PLATFORM_SCOPE));
        assert!(a.sees_template(PLATFORM_SCOPE) && !a.sees_template("default"));
        let d = Caller::api("default", Role::Admin, "tok-2");
        assert!(!d.sees("acme"), "tenant default is a tenant like any other");
        let s = Caller::system(SystemReason::Recovery);
        assert!(s.sees("acme") && s.sees_template("x"));
        assert_eq!(s.owner(), PLATFORM_SCOPE);
        assert_eq!(a.actor(), "token:tok-1");
        assert_eq!(s.actor(), "system:recovery");
    }
}
