//! `[cluster]`: this daemon as one host of several sharing a PostgreSQL
//! store (docs/cluster.md).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::duration::serde_human;

/// What this `stratad` is in a cluster (`[cluster] role`, flag `--role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A host: runs VMs in its pool, registers, holds sandbox leases,
    /// serves the API and forwards what other hosts own.
    #[default]
    Host,
    /// An API-only process (docs/cluster.md, "API processes"): no pool, no
    /// QEMU, never registered, never placed on, holds no lease; it serves
    /// the API from PostgreSQL and forwards every VM operation to the
    /// sandbox's owner (a create to the host placement picks).
    Api,
}

impl Role {
    /// `host` or `api`, as configured.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Host => "host",
            Role::Api => "api",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host" => Ok(Role::Host),
            "api" => Ok(Role::Api),
            other => Err(format!("role: `host` or `api`, not `{other}`")),
        }
    }
}

/// `[cluster]` (off by default: one host, nothing registered).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Register this daemon as a host, hold owner leases of its sandboxes
    /// and fence its writes. Needs `[store] url` = PostgreSQL.
    pub enabled: bool,
    /// `host` (the default) or `api`: an API-only process ([`Role::Api`]).
    pub role: Role,
    /// This host's stable id (unset: the machine's host name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_id: Option<String>,
    /// Where other hosts and clients reach this host's API
    /// (`http://10.0.0.2:7070`; unset: `http://<listen>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// How long a host registration and a sandbox lease hold without a
    /// renewal (database clock).
    #[serde(with = "serde_human")]
    pub lease_ttl: Duration,
    /// How often the host heartbeats and renews its leases (at most a
    /// third of `lease_ttl`).
    #[serde(with = "serde_human")]
    pub renew_every: Duration,
    /// Another host takes a sandbox over only this long after its lease
    /// expired (judged by the database's clock).
    #[serde(with = "serde_human")]
    pub takeover_margin: Duration,
    /// A host that could not renew stops its VMs this long before its
    /// leases expire, by its own monotonic clock counted from the start of
    /// its last successful renewal.
    #[serde(with = "serde_human")]
    pub fence_margin: Duration,
    /// How often a host looks for hosts whose lease expired (their
    /// sandboxes are marked lost).
    #[serde(with = "serde_human")]
    pub watch_every: Duration,
    /// Labels of this host (reported in placement errors; free form).
    pub labels: BTreeMap<String, String>,
    /// TEST ONLY, off by default: a move from this host hands the lease
    /// over, then drops its adopt call to the target as if the network had
    /// lost it (the target's take-up pass must finish the move;
    /// docs/move.md). Never set it on a real host.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub test_drop_adopt: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            enabled: false,
            role: Role::Host,
            host_id: None,
            address: None,
            lease_ttl: Duration::from_secs(15),
            renew_every: Duration::from_secs(3),
            takeover_margin: Duration::from_secs(5),
            fence_margin: Duration::from_secs(4),
            watch_every: Duration::from_secs(5),
            labels: BTreeMap::new(),
            test_drop_adopt: false,
        }
    }
}

impl ClusterConfig {
    /// Checks the timers against each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.role == Role::Api && !self.enabled {
            return Err(
                "[cluster] role = \"api\" needs [cluster] enabled = true and [store] url = postgres://… (an API process runs no VMs: it answers from the hosts' PostgreSQL and forwards to them)"
                    .into(),
            );
        }
        if !self.enabled {
            return Ok(());
        }
        let ms = |d: Duration| d.as_millis();
        if ms(self.lease_ttl) < 1000 {
            return Err("[cluster] lease_ttl must be at least 1s".into());
        }
        if ms(self.renew_every) == 0 || ms(self.renew_every) * 3 > ms(self.lease_ttl) {
            return Err("[cluster] renew_every must be above 0 and at most lease_ttl / 3".into());
        }
        if ms(self.fence_margin) == 0
            || ms(self.fence_margin) + ms(self.renew_every) >= ms(self.lease_ttl)
        {
            return Err(
                "[cluster] fence_margin must be above 0 and leave room for a renewal: fence_margin + renew_every < lease_ttl"
                    .into(),
            );
        }
        if ms(self.watch_every) == 0 {
            return Err("[cluster] watch_every must be above 0".into());
        }
        if let Some(id) = &self.host_id {
            if id.is_empty()
                || id.len() > 64
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            {
                return Err("[cluster] host_id: 1 to 64 characters of [A-Za-z0-9._-]".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_timers_are_refused() {
        let mut c = ClusterConfig {
            enabled: true,
            ..ClusterConfig::default()
        };
        c.validate().unwrap();
        c.renew_every = Duration::from_secs(6);
        assert!(c.validate().unwrap_err().contains("renew_every"));
        c.renew_every = Duration::from_secs(3);
        c.fence_margin = Duration::from_secs(12);
        assert!(c.validate().unwrap_err().contains("fence_margin"));
        c.fence_margin = Duration::from_secs(4);
        c.host_id = Some("a b".into());
        assert!(c.validate().unwrap_err().contains("host_id"));
    }

    #[test]
    fn the_api_role_needs_cluster_mode() {
        let mut c = ClusterConfig {
            role: Role::Api,
            ..ClusterConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("enabled = true"));
        c.enabled = true;
        c.validate().unwrap();
        let parsed: ClusterConfig = toml::from_str("enabled = true\nrole = \"api\"").unwrap();
        assert_eq!(parsed.role, Role::Api);
        assert!(toml::from_str::<ClusterConfig>("role = \"apy\"").is_err());
        assert_eq!("api".parse::<Role>(), Ok(Role::Api));
        assert!("hosts"
            .parse::<Role>()
            .unwrap_err()
            .contains("`host` or `api`"));
    }
}
