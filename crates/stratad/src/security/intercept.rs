//! The deployment's TLS interception CA and the egress proxy's interception
//! set-up (`[security] egress_tls_intercept`, `docs/tls-interception.md`).
//!
//! One CA per deployment, kept in the key store's directory (`key_dir`,
//! 0700) as `intercept-ca.key` (0600) and `intercept-ca.pem`: made on first
//! use, the same certificate after every restart (it is baked into images
//! and templates, so it must not change under them). Leaves for connector
//! hosts are issued from it by a bounded cache ([`crate::tls::LeafCache`],
//! [`LEAF_CACHE_MAX`] names). Upstreams are verified against the system
//! roots plus `egress_upstream_ca_bundle`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_policy::proxy::{intercept::load_bundle, Interception};

use super::keys::KeyStore;
use super::SecurityError;
use crate::config::Config;
use crate::tls::{LeafCache, LocalCa};

/// File stem of the interception CA in the key dir.
pub const CA_STEM: &str = "intercept-ca";
/// Leaves kept at most (one per intercepted host name).
pub const LEAF_CACHE_MAX: usize = 4096;

/// The interception CA's certificate file (`<key_dir>/intercept-ca.pem`).
pub fn ca_pem_path(key_dir: &Path) -> PathBuf {
    key_dir.join(format!("{CA_STEM}.pem"))
}

/// Opens the deployment's interception CA, creating it (and the key store
/// directory, private) on first use.
pub fn open_ca(key_dir: &Path) -> Result<LocalCa, SecurityError> {
    // The key store checks (and on first use makes) a private directory.
    KeyStore::open(key_dir).map_err(|e| SecurityError::Intercept(e.to_string()))?;
    LocalCa::open_in(key_dir, CA_STEM, "strata egress interception CA")
        .map_err(|e| SecurityError::Intercept(e.to_string()))
}

/// The interception of this deployment, or `None` when
/// `egress_tls_intercept` is off.
pub fn interception(config: &Config) -> Result<Option<Arc<Interception>>, SecurityError> {
    let sec = &config.security;
    if !sec.egress_tls_intercept {
        return Ok(None);
    }
    let ca = Arc::new(open_ca(&config.key_dir)?);
    let extra = match &sec.egress_upstream_ca_bundle {
        Some(p) => load_bundle(p).map_err(|e| SecurityError::Intercept(e.to_string()))?,
        None => Vec::new(),
    };
    let leaves = Arc::new(LeafCache::new(ca, LEAF_CACHE_MAX));
    let ic = Interception::new(leaves, true, extra)
        .map_err(|e| SecurityError::Intercept(e.to_string()))?;
    tracing::info!(
        ca = %ca_pem_path(&config.key_dir).display(),
        "egress TLS interception of connector hosts is on"
    );
    Ok(Some(Arc::new(ic)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CA lives in the key dir, is made once and given out the same
    /// after a reopen (images bake it in).
    #[test]
    fn the_interception_ca_is_kept_in_the_key_dir() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let keys = d.path().join("keys");
        let a = open_ca(&keys).unwrap_or_else(|e| panic!("{e}"));
        let b = open_ca(&keys).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.pem(), b.pem());
        assert!(ca_pem_path(&keys).exists());
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(keys.join("intercept-ca.key"))
                .unwrap_or_else(|e| panic!("{e}"))
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
    }

    /// Leaves are minted per name, cached, and the cache is bounded.
    #[test]
    fn leaves_are_cached_and_bounded() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let ca = Arc::new(open_ca(&d.path().join("keys")).unwrap_or_else(|e| panic!("{e}")));
        let c = LeafCache::new(ca, 3);
        let a = c
            .leaf("api.salesforce.test")
            .unwrap_or_else(|| panic!("no leaf"));
        let b = c
            .leaf("API.salesforce.test.")
            .unwrap_or_else(|| panic!("no leaf"));
        assert!(Arc::ptr_eq(&a, &b));
        for h in ["a.test", "b.test", "c.test", "d.test"] {
            assert!(c.leaf(h).is_some());
        }
        assert_eq!(c.cached(), 3);
        // The leaf names the host and chains to the CA.
        let der = a.cert.first().unwrap_or_else(|| panic!("empty chain"));
        let text = String::from_utf8_lossy(der.as_ref()).to_string();
        assert!(text.contains("api.salesforce.test"));
    }
}
