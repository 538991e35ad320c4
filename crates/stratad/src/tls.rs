//! TLS for routed hosts (`[e2b] tls_listen`): a local certificate authority
//! the daemon keeps under its data directory, leaf certificates issued on
//! demand per SNI name (served by [`crate::listener::serve`]).
//!
//! The CA is created once (`<data_dir>/ca/ca.pem`, mode 0644, and
//! `ca.key`, 0600) and reused after restarts; `GET /v1/ca` and `strata ca`
//! print it. A handshake whose SNI is not under an allowed domain (the
//! configured `[e2b] domain`'s host, and `localhost`) gets no certificate:
//! the handshake fails. See docs/ports.md.

use std::collections::HashMap;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// At most this many leaf certificates are kept; past it the oldest goes.
pub const LEAF_CACHE_MAX: usize = 1024;
/// Validity of a leaf certificate.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);
/// A cached leaf is issued again after this long (well inside its validity).
const LEAF_REISSUE: Duration = Duration::from_secs(24 * 3600);

/// Why the CA or the TLS listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Reading or writing the CA files failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Generating, loading or signing a certificate failed.
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// rustls refused the configuration or a key.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// A configured certificate or key file holds no usable PEM.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The daemon's local certificate authority.
pub struct LocalCa {
    pem: String,
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl std::fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCa").finish_non_exhaustive()
    }
}

/// `<data_dir>/ca`: where the CA lives.
pub fn ca_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("ca")
}

/// The CA certificate file, `<data_dir>/ca/ca.pem`.
pub fn ca_pem_path(data_dir: &Path) -> PathBuf {
    ca_dir(data_dir).join("ca.pem")
}

/// The CA's parameters, derived from its key (and `label`) alone (so the
/// issuer of leaves signed after a restart is the certificate on disk).
fn ca_params(key: &KeyPair, label: &str) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let fp = &hex::encode(sha2_digest(&key.public_key_der()))[..12];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "strata");
    dn.push(DnType::CommonName, format!("{label} {fp}"));
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2124, 1, 1);
    Ok(p)
}

fn sha2_digest(b: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    sha2::Sha256::digest(b).to_vec()
}

impl LocalCa {
    /// Loads the CA under `data_dir`, creating it on first use.
    pub fn open(data_dir: &Path) -> Result<LocalCa, TlsError> {
        Self::open_in(&ca_dir(data_dir), "ca", "strata local CA")
    }

    /// Loads the CA kept in `dir` as `<stem>.pem` and `<stem>.key` (0600),
    /// creating it on first use with the common name `<label> <key
    /// fingerprint>`. The certificate on disk is the one given out, so it
    /// stays the same across restarts.
    pub fn open_in(dir: &Path, stem: &str, label: &str) -> Result<LocalCa, TlsError> {
        let pem_path = dir.join(format!("{stem}.pem"));
        let key_path = dir.join(format!("{stem}.key"));
        if key_path.exists() {
            let key_pem = std::fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
            let pem = std::fs::read_to_string(&pem_path).map_err(io_err(&pem_path))?;
            let key = KeyPair::from_pem(&key_pem)?;
            let cert = ca_params(&key, label)?.self_signed(&key)?;
            return Ok(LocalCa { pem, key, cert });
        }
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let cert = ca_params(&key, label)?.self_signed(&key)?;
        let pem = cert.pem();
        // The certificate first: a crash between the two leaves no key
        // without its certificate (a key alone is regenerated next start).
        write_new(&pem_path, pem.as_bytes(), 0o644)?;
        let tmp = dir.join(format!("{stem}.key.tmp"));
        let _ = std::fs::remove_file(&tmp);
        write_new(&tmp, key.serialize_pem().as_bytes(), 0o600)?;
        std::fs::rename(&tmp, &key_path).map_err(io_err(&key_path))?;
        Ok(LocalCa { pem, key, cert })
    }

    /// The CA certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A leaf certificate for `name` signed by the CA.
    fn issue(&self, name: &str) -> Result<CertifiedKey, TlsError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut p = CertificateParams::new(vec![name.to_owned()])?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, name);
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let now = time_now();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + LEAF_VALIDITY;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        let der = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
        let signer = rustls::crypto::ring::sign::any_supported_type(&der)?;
        Ok(CertifiedKey::new(vec![cert.der().clone()], signer))
    }
}

fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Leaves of one CA, issued on demand per host name and cached: at most
/// [`LEAF_CACHE_MAX`] (past it the oldest goes), each issued again after a
/// day (well inside its [`LEAF_VALIDITY`]). It issues for any name it is
/// asked: the caller decides which names get one ([`LeafResolver`] by
/// domain, the egress proxy by the sandbox's connectors).
#[derive(Debug)]
pub struct LeafCache {
    ca: Arc<LocalCa>,
    max: usize,
    cache: Mutex<HashMap<String, (Instant, Arc<CertifiedKey>)>>,
}

impl LeafCache {
    /// An empty cache of `ca`'s leaves, holding at most `max`.
    pub fn new(ca: Arc<LocalCa>, max: usize) -> LeafCache {
        LeafCache {
            ca,
            max: max.max(1),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The CA.
    pub fn ca(&self) -> &LocalCa {
        &self.ca
    }

    /// The leaf for `name` (lower-cased, trailing dot dropped), from the
    /// cache or issued now; `None` when signing fails.
    pub fn leaf(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, k)) = cache.get(&name) {
            if at.elapsed() < LEAF_REISSUE {
                return Some(k.clone());
            }
        }
        let leaf = match self.ca.issue(&name) {
            Ok(k) => Arc::new(k),
            Err(e) => {
                tracing::warn!(name = %name, error = %e, "cannot issue a TLS certificate");
                return None;
            }
        };
        if cache.len() >= self.max && !cache.contains_key(&name) {
            if let Some(oldest) = cache
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(n, _)| n.clone())
            {
                cache.remove(&oldest);
            }
        }
        cache.insert(name, (Instant::now(), leaf.clone()));
        Some(leaf)
    }

    /// Leaves cached now.
    pub fn cached(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl strata_policy::proxy::LeafIssuer for LeafCache {
    fn leaf(&self, host: &str) -> Option<Arc<CertifiedKey>> {
        LeafCache::leaf(self, host)
    }
}

/// Issues (and caches) a leaf per SNI name under the allowed domains; any
/// other name (or none) gets no certificate, so the handshake fails.
#[derive(Debug)]
pub struct LeafResolver {
    domains: Vec<String>,
    leaves: LeafCache,
}

impl LeafResolver {
    /// Leaves for names equal to, or under, one of `domains` (hosts; any
    /// `:port` is dropped; `localhost` is always allowed).
    pub fn new(ca: Arc<LocalCa>, domains: &[String]) -> LeafResolver {
        let mut ds: Vec<String> = domains
            .iter()
            .map(|d| domain_host(d))
            .filter(|d| !d.is_empty())
            .collect();
        ds.push("localhost".into());
        ds.sort();
        ds.dedup();
        LeafResolver {
            domains: ds,
            leaves: LeafCache::new(ca, LEAF_CACHE_MAX),
        }
    }

    /// Whether a leaf may be issued for `name`.
    pub fn allows(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.domains.iter().any(|d| {
            name == *d
                || name
                    .strip_suffix(d.as_str())
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
        })
    }

    /// The leaf for `name` (cached), `None` when it is not allowed.
    pub fn leaf(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        if !self.allows(name) {
            return None;
        }
        self.leaves.leaf(name)
    }

    /// Leaves cached now.
    pub fn cached(&self) -> usize {
        self.leaves.cached()
    }
}

/// The host part of a domain (`localhost:47983` → `localhost`).
fn domain_host(d: &str) -> String {
    let d = d.trim().trim_end_matches('.');
    let host = match d.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => d,
    };
    host.to_ascii_lowercase()
}

impl ResolvesServerCert for LeafResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.leaf(hello.server_name()?)
    }
}

/// The rustls server configuration: HTTP/1.1, certificates from `resolver`
/// (a [`LeafResolver`], or the [`FixedCert`] of `tls_cert`/`tls_key`).
pub fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Largest certificate or key file read (`tls_cert`, `tls_key`).
const MAX_PEM_BYTES: u64 = 1 << 20;

/// One certificate (chain and key, from files) for every handshake,
/// whatever its SNI (or none: clients that connect by IP address send none).
#[derive(Debug)]
pub struct FixedCert(Arc<CertifiedKey>);

impl FixedCert {
    /// Loads a PEM certificate chain (leaf first) and its PEM private key
    /// (PKCS#8, PKCS#1 or SEC1), and checks that they belong together.
    pub fn load(cert: &Path, key: &Path) -> Result<FixedCert, TlsError> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let pem_err = |path: &Path, reason: String| TlsError::Pem {
            path: path.to_owned(),
            reason,
        };
        let chain = CertificateDer::pem_slice_iter(&read_small(cert)?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| pem_err(cert, format!("bad PEM certificate: {e}")))?;
        if chain.is_empty() {
            return Err(pem_err(cert, "no certificate in it".into()));
        }
        let der = PrivateKeyDer::from_pem_slice(&read_small(key)?)
            .map_err(|e| pem_err(key, format!("no usable PEM private key: {e}")))?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&der)?;
        let ck = CertifiedKey::new(chain, signer);
        ck.keys_match()
            .map_err(|e| pem_err(key, format!("does not match {}: {e}", cert.display())))?;
        Ok(FixedCert(Arc::new(ck)))
    }
}

impl ResolvesServerCert for FixedCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The server configuration of `tls_listen`: [`server_config`] with the
/// certificate and key of these files ([`FixedCert::load`]).
pub fn file_server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    server_config(Arc::new(FixedCert::load(cert, key)?))
}

fn read_small(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read as _;
    let f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut buf = Vec::new();
    f.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(io_err(path))?;
    if buf.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            reason: format!("larger than {MAX_PEM_BYTES} bytes"),
        });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn the_ca_is_created_once_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let ca = LocalCa::open(d.path()).unwrap();
        let pem = ca.pem().to_owned();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
        let mode = |p: &str| {
            std::fs::metadata(d.path().join("ca").join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("ca.key"), 0o600);
        assert_eq!(mode("ca.pem"), 0o644);
        assert_eq!(LocalCa::open(d.path()).unwrap().pem(), pem);
    }

    #[test]
    fn a_configured_certificate_is_loaded_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (c, k) = (d.path().join("c.pem"), d.path().join("k.pem"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        file_server_config(&c, &k).unwrap();
        // Another key, an empty chain, a missing file: refused with the file named.
        let other = d.path().join("other.pem");
        std::fs::write(
            &other,
            KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
                .unwrap()
                .serialize_pem(),
        )
        .unwrap();
        let e = file_server_config(&c, &other).unwrap_err();
        assert!(e.to_string().contains("other.pem"), "{e}");
        let e = file_server_config(&k, &k).unwrap_err();
        assert!(e.to_string().contains("no certificate"), "{e}");
        assert!(file_server_config(&d.path().join("none"), &k).is_err());
    }

    #[test]
    fn leaves_only_under_the_allowed_domains_and_bounded() {
        let d = tempfile::tempdir().unwrap();
        let ca = Arc::new(LocalCa::open(d.path()).unwrap());
        let r = LeafResolver::new(ca, &["sandboxes.example.com:443".into()]);
        for ok in [
            "8001-sb-1.localhost",
            "localhost",
            "80-x.sandboxes.example.com",
            "X.SANDBOXES.example.com.",
        ] {
            assert!(r.allows(ok), "{ok}");
        }
        for bad in [
            "example.org",
            "evil-localhost",
            "notsandboxes.example.com",
            "x.example.com",
            ".localhost",
        ] {
            assert!(r.leaf(bad).is_none(), "{bad}");
        }
        let a = r.leaf("8001-a.localhost").unwrap();
        let b = r.leaf("8001-a.localhost").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        for i in 0..(LEAF_CACHE_MAX + 5) {
            assert!(r.leaf(&format!("{i}-x.localhost")).is_some());
        }
        assert_eq!(r.cached(), LEAF_CACHE_MAX);
    }
}
