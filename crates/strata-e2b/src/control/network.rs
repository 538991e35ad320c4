//! E2B network settings (`allowInternetAccess`, `network: {allowOut,
//! denyOut}` at create, `PUT /sandboxes/{id}/network`) on the sandbox's
//! egress policy layer (`Policies::put_sandbox`, the layer `PUT
//! /v1/sandboxes/{id}/policy` writes: the door's settings replace it).
//!
//! strata's egress goes through its policy proxy: a host name belongs to a
//! connector the platform or tenant declared (`hosts`), an IP literal to a
//! connector range (`cidrs`), or it is refused. On that model:
//! - `allowOut` domains (`example.com`, `*.example.com`) → a soft `allow`
//!   egress rule for those hosts (still only hosts of a declared connector;
//!   hard platform/tenant rules still win);
//! - `allowOut` IPs and CIDRs → a soft `allow` rule on those address ranges
//!   (`cidr`), for IP-literal destinations inside a connector's range; the
//!   proxy's address guard stays above it (never loopback, link-local, the
//!   metadata address or the host's own; private ones only where the
//!   operator's range is private);
//! - `allowInternetAccess: false`, or `denyOut` naming `0.0.0.0/0` (E2B:
//!   the same thing) → a soft `deny` of all other egress, after the allow
//!   rule (E2B: allowed entries take precedence over denied ones, so
//!   "deny all, allow these" reads as it does on E2B);
//! - other `denyOut` entries must be IPs or CIDRs (E2B refuses domains
//!   there) → a soft `deny` rule on those ranges, after the allow rules.
//!
//! CIDR rules match the address a destination is given as (an IP literal),
//! not the addresses a host name resolves to: a name is decided by name.
//!
//! Nothing given → no layer is written (the tenant's policy decides). What
//! never gets egress whatever these say: tools that ignore the proxy
//! variables, UDP, raw DNS, loopback/link-local/the host's own addresses
//! (docs: crates/strata-e2b/README.md).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Extension;
use serde::Deserialize;
use strata_core::SandboxId;
use stratad::caller::Caller;

use super::{parse_body, JsonBody, SandboxPath};
use crate::error::{E2bError, E2bResult};
use crate::policy::may_write;
use crate::E2b;
use strata_policy::policy::IpNet;

/// Most `allowOut` / `denyOut` entries one request may give.
pub const MAX_NETWORK_ENTRIES: usize = 256;

/// `SandboxNetworkConfig` / `SandboxNetworkUpdateConfig` (the fields strata
/// maps; `rules`, `dnsServers`, `egressProxy`, `httpsPorts` are ignored;
/// `allowPublicTraffic` and `maskRequestHost` are the door's port settings,
/// [`crate::public`], taken at create).
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub(super) struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    /// Only in the update body; the SDKs send it snake_case.
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
}

impl NetworkBody {
    /// The port settings a create body asks for.
    pub(super) fn port_settings(&self) -> E2bResult<crate::public::PortSettings> {
        crate::public::PortSettings::asked(
            self.allow_public_traffic,
            self.mask_request_host.as_deref(),
        )
    }
}

/// The egress a sandbox's settings ask for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Egress {
    allow_hosts: Vec<String>,
    allow_nets: Vec<IpNet>,
    deny_nets: Vec<IpNet>,
    deny_rest: bool,
}

fn is_ip_or_cidr(s: &str) -> bool {
    let ip = s.split_once('/').map_or(s, |(ip, _)| ip);
    ip.parse::<std::net::IpAddr>().is_ok() || strata_policy::policy::looks_like_ip(ip)
}

fn ip_net(field: &str, s: &str) -> E2bResult<IpNet> {
    IpNet::parse(s).map_err(|e| E2bError::new(400, format!("{field} {s:?}: {e}")))
}

fn is_all(s: &str) -> bool {
    matches!(s, "0.0.0.0/0" | "::/0")
}

/// What `allow_internet` and `net` ask for; `None` when they ask nothing.
pub(super) fn asked(
    allow_internet: Option<bool>,
    net: Option<&NetworkBody>,
) -> E2bResult<Option<Egress>> {
    let allow_internet = allow_internet.or(net.and_then(|n| n.allow_internet_access));
    let allow_out = net.and_then(|n| n.allow_out.clone());
    let deny_out = net.and_then(|n| n.deny_out.clone());
    if allow_internet.is_none() && allow_out.is_none() && deny_out.is_none() {
        return Ok(None);
    }
    let (allow_out, deny_out) = (allow_out.unwrap_or_default(), deny_out.unwrap_or_default());
    if allow_out.len() > MAX_NETWORK_ENTRIES || deny_out.len() > MAX_NETWORK_ENTRIES {
        return Err(E2bError::new(
            400,
            format!("network: at most {MAX_NETWORK_ENTRIES} allowOut and denyOut entries"),
        ));
    }
    let mut e = Egress {
        deny_rest: allow_internet == Some(false),
        ..Egress::default()
    };
    for a in allow_out {
        let h = a.trim().trim_end_matches('.').to_ascii_lowercase();
        if is_ip_or_cidr(&h) {
            let n = ip_net("allowOut", &h)?;
            if !e.allow_nets.contains(&n) {
                e.allow_nets.push(n);
            }
            continue;
        }
        let name = h.strip_prefix("*.").unwrap_or(&h);
        if !strata_policy::policy::is_host_name(name) {
            return Err(E2bError::new(400, format!("allowOut {a:?}: not a domain")));
        }
        if !e.allow_hosts.contains(&h) {
            e.allow_hosts.push(h);
        }
    }
    for d in deny_out {
        let d = d.trim();
        if !is_ip_or_cidr(d) {
            return Err(E2bError::new(
                400,
                format!("denyOut {d:?}: only IPs and CIDR blocks (domains are not supported for deny rules)"),
            ));
        }
        if is_all(d) {
            e.deny_rest = true;
            continue;
        }
        let n = ip_net("denyOut", d)?;
        if !e.deny_nets.contains(&n) {
            e.deny_nets.push(n);
        }
    }
    Ok(Some(e))
}

/// The sandbox policy layer (TOML) of `e`.
pub(super) fn layer(e: &Egress) -> String {
    let mut t = String::from(
        "# Written by the E2B door (allowInternetAccess / network); PUT /sandboxes/{id}/network replaces it.\n",
    );
    if !e.allow_hosts.is_empty() {
        let hosts: Vec<String> = e.allow_hosts.iter().map(|h| format!("{h:?}")).collect();
        t.push_str(&format!(
            "\n[[rule]]\nid = \"e2b-allow-out\"\neffect = \"allow\"\nkind = \"egress\"\nhost = [{}]\n",
            hosts.join(", ")
        ));
    }
    let list = |nets: &[IpNet]| {
        nets.iter()
            .map(|n| format!("\"{n}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !e.allow_nets.is_empty() {
        t.push_str(&format!(
            "\n[[rule]]\nid = \"e2b-allow-out-ip\"\neffect = \"allow\"\nkind = \"egress\"\ncidr = [{}]\n",
            list(&e.allow_nets)
        ));
    }
    if !e.deny_nets.is_empty() {
        t.push_str(&format!(
            "\n[[rule]]\nid = \"e2b-deny-out-ip\"\neffect = \"deny\"\nkind = \"egress\"\ncidr = [{}]\nreason = \"the sandbox's denyOut names this address\"\n",
            list(&e.deny_nets)
        ));
    }
    if e.deny_rest {
        t.push_str(
            "\n[[rule]]\nid = \"e2b-deny-out\"\neffect = \"deny\"\nkind = \"egress\"\nreason = \"the sandbox was created without internet access (E2B allowInternetAccess / denyOut)\"\n",
        );
    }
    t
}

impl E2b {
    /// Writes `e` as sandbox `id`'s policy layer, by `caller`.
    pub(super) async fn put_egress(
        &self,
        caller: &Caller,
        id: &SandboxId,
        tenant: &str,
        e: &Egress,
    ) -> E2bResult<()> {
        let Some(sec) = self.sec.clone() else {
            return Err(E2bError::new(
                500,
                "network settings need the security subsystem (the egress policy)",
            ));
        };
        let (t, s, text, by) = (
            tenant.to_owned(),
            id.to_string(),
            layer(e),
            caller.actor().to_string(),
        );
        tokio::task::spawn_blocking(move || sec.policies().put_sandbox(&t, &s, &text, &by))
            .await
            .map_err(|e| E2bError::new(500, format!("network settings: {e}")))?
            .map_err(|m| E2bError::new(400, format!("network settings: {m}")))
    }
}

/// `PUT /sandboxes/{id}/network` → 204: replaces the running sandbox's
/// egress settings (an empty body: no layer rules, the tenant decides).
pub async fn update(
    State(st): State<Arc<E2b>>,
    Extension(caller): Extension<Caller>,
    SandboxPath(id): SandboxPath,
    JsonBody(body): JsonBody,
) -> E2bResult<StatusCode> {
    let req: NetworkBody = parse_body(&body)?;
    let rec = st.record(&caller, &id).await?;
    if !may_write(&caller) {
        return Err(E2bError::new(
            403,
            "changing a sandbox's network needs a developer or admin key",
        ));
    }
    let e = asked(None, Some(&req))?.unwrap_or_default();
    st.put_egress(&caller, &rec.id, &rec.tenant, &e).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_policy::policy::{Effect, Policy, PolicySet};
    use strata_policy::{CallKind, ToolCall};

    fn body(allow: &[&str], deny: &[&str]) -> NetworkBody {
        NetworkBody {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            allow_internet_access: None,
            ..NetworkBody::default()
        }
    }

    /// The effect of an egress CONNECT to `host` under `platform` + the
    /// layer of `e` (the real policy engine).
    fn effect(e: &Egress, host: &str) -> Effect {
        let platform = Policy::parse(
            "default = \"allow\"\n[[connector]]\nname = \"web\"\nhosts = [\"a.test\", \"*.b.test\", \"c.test\"]\ncidrs = [\"0.0.0.0/0\"]\n",
        )
        .unwrap();
        let sandbox = Policy::parse(&layer(e)).unwrap();
        let set = PolicySet::new(Some(Arc::new(platform)), None, Some(Arc::new(sandbox))).unwrap();
        let call = ToolCall {
            tenant: "default".into(),
            sandbox: Some("sb-x".into()),
            actor: "t".into(),
            kind: CallKind::Egress {
                connector: Some("web".into()),
                host: host.into(),
                port: 443,
                method: "CONNECT".into(),
                path: String::new(),
                scheme: "https".into(),
                tls: false,
            },
        };
        set.evaluate(&call).effect
    }

    #[test]
    fn settings_map_onto_the_layer() {
        assert_eq!(asked(None, None).unwrap(), None);
        // No internet: every host denied.
        let off = asked(Some(false), None).unwrap().unwrap();
        assert_eq!(effect(&off, "a.test"), Effect::Deny);
        // Deny all, allow some: the allowed win, the rest is denied.
        let some = asked(None, Some(&body(&["a.test", "*.b.test"], &["0.0.0.0/0"])))
            .unwrap()
            .unwrap();
        assert_eq!(effect(&some, "a.test"), Effect::Allow);
        assert_eq!(effect(&some, "x.b.test"), Effect::Allow);
        assert_eq!(effect(&some, "c.test"), Effect::Deny);
        // allow_internet_access=false with allowOut: the same.
        let off_some = asked(Some(false), Some(&body(&["a.test"], &[])))
            .unwrap()
            .unwrap();
        assert_eq!(effect(&off_some, "a.test"), Effect::Allow);
        assert_eq!(effect(&off_some, "c.test"), Effect::Deny);
        // Only allowOut (internet on): nothing is taken away.
        let open = asked(None, Some(&body(&["a.test"], &[]))).unwrap().unwrap();
        assert_eq!(effect(&open, "c.test"), Effect::Allow);
        // A CIDR deny denies the address literals in it, not names.
        let cidr = asked(None, Some(&body(&[], &["8.8.0.0/16"])))
            .unwrap()
            .unwrap();
        assert_eq!(effect(&cidr, "c.test"), Effect::Allow);
        assert_eq!(effect(&cidr, "8.8.8.8"), Effect::Deny);
        assert_eq!(effect(&cidr, "9.9.9.9"), Effect::Allow);
        // Allowed addresses win over a denied range and over deny-all.
        let ips = asked(
            None,
            Some(&body(
                &["8.8.8.8", "1.1.1.0/24"],
                &["8.8.0.0/16", "0.0.0.0/0"],
            )),
        )
        .unwrap()
        .unwrap();
        assert_eq!(effect(&ips, "8.8.8.8"), Effect::Allow);
        assert_eq!(effect(&ips, "1.1.1.1"), Effect::Allow);
        assert_eq!(effect(&ips, "8.8.4.4"), Effect::Deny);
        assert_eq!(effect(&ips, "9.9.9.9"), Effect::Deny);
        assert_eq!(effect(&ips, "a.test"), Effect::Deny);
    }

    #[test]
    fn bad_entries_are_refused() {
        for (allow, deny) in [
            (&["10.0.0.0/33"][..], &[][..]),
            (&["127.1"][..], &[][..]),
            (&[][..], &["1.2.3.4/-1"][..]),
            (&["not a host"][..], &[][..]),
            (&[][..], &["example.com"][..]),
        ] {
            let e = asked(None, Some(&body(allow, deny))).unwrap_err();
            assert_eq!(e.status, 400, "{allow:?} {deny:?}");
        }
        let many: Vec<String> = (0..=MAX_NETWORK_ENTRIES)
            .map(|i| format!("h{i}.test"))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(
            asked(None, Some(&body(&refs, &[]))).unwrap_err().status,
            400
        );
    }
}
