//! Per-sandbox port settings of the E2B door (`network.allowPublicTraffic`
//! and `network.maskRequestHost` at create): whether the sandbox's guest
//! ports answer requests without a credential, and the `Host` header its
//! guest servers see. Kept with the sandbox by the service
//! ([`stratad::service::Service::set_sandbox_setting`], key
//! [`SETTING_KEY`]) so they survive a daemon restart, cached here, copied
//! to forks, dropped with the sandbox.
//!
//! `allowPublicTraffic: false`: a port request needs the sandbox's traffic
//! token (`e2b-traffic-access-token`, the create answer's
//! `trafficAccessToken`), its envd token (`X-Access-Token`) or an API key
//! (`X-API-KEY`); without one it is refused `403` (E2B's answer). Unset:
//! the door's `[e2b] public_ports` decides.
//!
//! `maskRequestHost` (e.g. `custom.example.com:${PORT}`): the `Host` the
//! guest server receives instead of the routed host (`${PORT}` becomes the
//! guest port).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use strata_core::SandboxId;
use stratad::caller::Caller;

use crate::error::{E2bError, E2bResult};
use crate::E2b;

/// The service setting key the door keeps these under.
pub const SETTING_KEY: &str = "e2b.ports";
/// Longest `maskRequestHost` (a host name and port, with `${PORT}`).
pub const MAX_MASK_LEN: usize = 260;

/// A sandbox's port settings; the default is "as the door's config says".
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortSettings {
    /// `allowPublicTraffic`; `None`: `[e2b] public_ports`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public: Option<bool>,
    /// `maskRequestHost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_host: Option<String>,
}

impl PortSettings {
    /// From a create body's `network` fields; `400` for a mask that is not
    /// a host name (with an optional port or `${PORT}`).
    pub fn asked(public: Option<bool>, mask: Option<&str>) -> E2bResult<PortSettings> {
        let mask_host = match mask.map(str::trim).filter(|m| !m.is_empty()) {
            None => None,
            Some(m) => {
                check_mask(m)?;
                Some(m.to_owned())
            }
        };
        Ok(PortSettings { public, mask_host })
    }

    /// Whether nothing is set.
    pub fn is_default(&self) -> bool {
        self == &PortSettings::default()
    }

    /// The `Host` a request to guest port `port` carries in the guest.
    pub fn host_for(&self, port: u16) -> Option<String> {
        self.mask_host
            .as_ref()
            .map(|m| m.replace("${PORT}", &port.to_string()))
    }
}

fn check_mask(m: &str) -> E2bResult<()> {
    let bad = |why: &str| {
        Err(E2bError::new(
            400,
            format!("network.maskRequestHost {m:?}: {why}"),
        ))
    };
    if m.len() > MAX_MASK_LEN {
        return bad("too long");
    }
    let with_port = m.replace("${PORT}", "1");
    let (host, port) = match with_port.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (with_port.as_str(), None),
    };
    if let Some(p) = port {
        if p.parse::<u16>().is_err() {
            return bad("the port must be a number or ${PORT}");
        }
    }
    let ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !ok {
        return bad("expected a host name, optionally with :port or :${PORT}");
    }
    Ok(())
}

/// The settings the service keeps, at the door's start.
pub(crate) fn load(svc: &stratad::service::Service) -> HashMap<SandboxId, PortSettings> {
    match svc.stored_settings(SETTING_KEY) {
        Ok(v) => v
            .into_iter()
            .filter_map(|(id, v)| match serde_json::from_value(v) {
                Ok(s) => Some((id, s)),
                Err(e) => {
                    tracing::error!(sandbox = %id, error = %e, "stored port settings: left out");
                    None
                }
            })
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "reading the sandboxes' port settings failed");
            HashMap::new()
        }
    }
}

impl E2b {
    /// Sandbox `id`'s port settings (the default when none were given).
    pub(crate) fn port_settings(&self, id: &SandboxId) -> PortSettings {
        self.port_settings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    /// Keeps `s` with sandbox `id` (the service's store, then the cache);
    /// nothing to keep for the default.
    pub(crate) async fn keep_port_settings(
        &self,
        caller: &Caller,
        id: &SandboxId,
        s: PortSettings,
    ) -> E2bResult<()> {
        if s.is_default() {
            return Ok(());
        }
        let v = serde_json::to_value(&s)
            .map_err(|e| E2bError::new(500, format!("port settings: {e}")))?;
        self.svc
            .set_sandbox_setting(caller, id, SETTING_KEY, Some(&v))
            .await?;
        self.port_settings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), s);
        Ok(())
    }

    /// Drops the cached settings of a deleted sandbox (the store's go with
    /// the sandbox).
    pub(crate) fn forget_port_settings(&self, id: &SandboxId) {
        self.port_settings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_are_host_names_with_an_optional_port() {
        for ok in [
            "custom-host.example.com:${PORT}",
            "example.com",
            "a.b.c:8080",
            "localhost:${PORT}",
        ] {
            assert!(PortSettings::asked(None, Some(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "exa mple.com",
            "host\r\nX-Evil: 1",
            "a..b",
            "-a.com",
            "a.com:http",
            "a.com:99999",
            &"a".repeat(300),
        ] {
            let e = PortSettings::asked(None, Some(bad)).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
        }
        let s = PortSettings::asked(Some(false), Some("h.example.com:${PORT}")).unwrap();
        assert_eq!(s.host_for(8080).as_deref(), Some("h.example.com:8080"));
        assert!(!s.is_default());
        assert!(PortSettings::asked(None, Some("  ")).unwrap().is_default());
        let back: PortSettings = serde_json::from_value(serde_json::to_value(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
