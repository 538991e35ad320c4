//! This host's route to the package registries, as a daemon's operator
//! configures it.
//!
//! On a network whose DNS answers the registries' names with a non-public
//! address (a TLS-inspecting gateway, an internal mirror; this CI machine's
//! gateway sits in a documentation range), the egress proxy refuses that
//! address unless `[security] egress_resolved_ranges` names it. Tests and
//! benchmarks that build templates from recipes start their daemons with
//! [`registry_ranges`].

use std::net::{IpAddr, ToSocketAddrs};

/// Hosts a recipe build reaches for `pip` (what tests install from).
pub const REGISTRY_HOSTS: &[&str] = &["pypi.org", "files.pythonhosted.org"];

/// `"<ip>/32"` for every non-public address [`REGISTRY_HOSTS`] resolve to
/// here (none on a network with plain public DNS).
pub fn registry_ranges() -> Vec<String> {
    let mut ranges = Vec::new();
    for host in REGISTRY_HOSTS {
        for a in (*host, 443).to_socket_addrs().into_iter().flatten() {
            let public = match a.ip() {
                IpAddr::V4(v4) => {
                    let o = v4.octets();
                    !(v4.is_private()
                        || v4.is_documentation()
                        || (o[0] == 100 && (64..128).contains(&o[1])))
                }
                IpAddr::V6(v6) => (v6.segments()[0] & 0xfe00) != 0xfc00,
            };
            let r = format!("{}/{}", a.ip(), if a.is_ipv4() { 32 } else { 128 });
            if !public && !ranges.contains(&r) {
                ranges.push(r);
            }
        }
    }
    ranges
}

/// [`registry_ranges`] as the TOML value of `egress_resolved_ranges`.
pub fn registry_ranges_toml() -> String {
    let quoted: Vec<String> = registry_ranges()
        .iter()
        .map(|r| format!("\"{r}\""))
        .collect();
    format!("[{}]", quoted.join(", "))
}

/// The host's CA bundle, for `--ca-bundle` / `ca_bundle` (registry TLS
/// re-signed by a local CA is trusted by this store), if present.
pub const HOST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
