//! The deployment's key store: one directory outside the data dir (config
//! `key_dir`, default `/etc/strata/keys`, mode 0700) holding one master key
//! (`master.key`, 32 random bytes, mode 0600, owned by the daemon's user).
//! Every purpose gets its own key, derived from the master with HKDF-SHA256
//! (the purpose's name is the HKDF info), so a key never serves two jobs and
//! a purpose added later needs no new file.
//!
//! Purposes: the environment variables kept with a sandbox
//! ([`Purpose::SandboxEnv`], sealed with ChaCha20-Poly1305, the sandbox id as
//! associated data so a row moved to another sandbox does not open), the
//! audit chain's HMAC key ([`Purpose::AuditChain`], [`KeyStore::hmac_key`]),
//! and the Ed25519 seed that signs snapshots and templates
//! ([`Purpose::SnapshotSigning`], [`KeyStore::seed`]; `docs/keys.md`). The
//! egress proxy's TLS interception CA is kept in the same directory as
//! files of its own ([`super::intercept`]); connector secrets are sealed
//! with [`Purpose::ConnectorSecret`] ([`super::secrets`]).
//!
//! What it protects: a copy of the data dir (a backup, a database file, a
//! disk image) without the key dir reveals no sealed value; a sealed value
//! changed or moved is refused. What it does not: anyone who can read the
//! key dir (root on the host, the daemon itself) can open everything; there
//! is no rotation yet (the sealed form carries a version for it) and no
//! external KMS (the store is one type so another backend can replace it).
//!
//! The crypto is `ring`'s (already the TLS provider): HKDF, AEAD and the
//! system random generator.

use std::fmt;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};

/// The master key's file name inside the key dir.
pub const MASTER_FILE: &str = "master.key";
const MASTER_LEN: usize = 32;
/// Prefix of every sealed value; the digit is the format's version.
pub const SEALED_PREFIX: &str = "sealed:v1:";
const HKDF_SALT: &[u8] = b"strata key store v1";

/// What a derived key is for (the HKDF info: never reuse one for another).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// Environment variables kept with a sandbox (the E2B door's `envVars`).
    SandboxEnv,
    /// The audit chain's HMAC-SHA256 links (`strata_policy::audit`).
    AuditChain,
    /// The Ed25519 seed that signs snapshots and templates
    /// (`strata_runtime::signing`).
    SnapshotSigning,
    /// The signing secrets of webhooks (`events::webhooks`), sealed with
    /// the webhook id as associated data.
    WebhookSecret,
    /// Connector secrets the egress proxy injects (`security::secrets`),
    /// sealed with `<tenant>/<name>` as associated data.
    ConnectorSecret,
    /// The HMAC key of the credential one host of a cluster presents to
    /// another for host-to-host calls no user makes (snapshot replicas,
    /// docs/cluster.md "Replicas"): the hosts share `master.key`.
    ClusterHost,
}

impl Purpose {
    fn info(self) -> &'static [u8] {
        match self {
            Purpose::SandboxEnv => b"strata sandbox env v1",
            Purpose::AuditChain => b"strata audit chain v1",
            Purpose::SnapshotSigning => b"strata snapshot signing v1",
            Purpose::WebhookSecret => b"strata webhook secret v1",
            Purpose::ConnectorSecret => b"strata connector secret v1",
            Purpose::ClusterHost => b"strata cluster host v1",
        }
    }
}

/// A 32-byte HKDF output (an Ed25519 seed).
struct Seed32;

impl hkdf::KeyType for Seed32 {
    fn len(&self) -> usize {
        32
    }
}

/// Why the key store or a sealed value could not be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key dir or the master key could not be read or created.
    #[error("key store {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The key dir or key file is reachable by others (or not ours).
    #[error("key store {path}: {why}; refusing to use it")]
    Permissions {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The master key file is not a key.
    #[error("key store {path}: master key is {len} bytes, expected {MASTER_LEN}")]
    BadKey {
        /// The key file.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// The system random generator failed.
    #[error("system random generator failed")]
    Random,
    /// A purpose's key could not be derived.
    #[error("key derivation failed")]
    Derive,
    /// A sealed value that is not in the sealed format, was changed, was
    /// moved from the item it was sealed for, or was sealed by another key.
    #[error("sealed value does not open: {0}")]
    Unseal(&'static str),
}

/// The opened key store: the master key, kept only to derive purposes.
pub struct KeyStore {
    dir: PathBuf,
    master: hkdf::Prk,
    rng: SystemRandom,
}

impl fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyStore")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl KeyStore {
    /// Opens the key store in `dir`, creating the dir (0700) and a new
    /// master key (0600) on first use. Refuses a dir or key file that
    /// others can reach or that another user owns.
    pub fn open(dir: &Path) -> Result<KeyStore, KeyError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| KeyError::Io { path, source }
        };
        if !dir.exists() {
            fs::create_dir_all(dir).map_err(io(dir))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))?;
        }
        check_private(dir, 0o077)?;
        let file = dir.join(MASTER_FILE);
        let rng = SystemRandom::new();
        let key = if file.exists() {
            read_master(&file)?
        } else {
            // Written whole under a name of its own (0600), then moved into
            // place only if no key is there yet: a daemon starting beside
            // this one (or a crash) never sees a master key half written.
            let mut key = [0u8; MASTER_LEN];
            rng.fill(&mut key).map_err(|_| KeyError::Random)?;
            let written = tempfile::NamedTempFile::new_in(dir)
                .and_then(|mut f| {
                    f.write_all(&key)?;
                    f.as_file().sync_all()?;
                    Ok(f)
                })
                .and_then(|f| f.persist_noclobber(&file).map(drop).map_err(|e| e.error));
            match written {
                Ok(()) => key.to_vec(),
                // Another daemon (or a test beside this one) made it first.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read_master(&file)?,
                Err(e) => return Err(io(&file)(e)),
            }
        };
        check_private(&file, 0o077)?;
        if key.len() != MASTER_LEN {
            return Err(KeyError::BadKey {
                path: file,
                len: key.len(),
            });
        }
        let master = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(&key);
        Ok(KeyStore {
            dir: dir.to_path_buf(),
            master,
            rng,
        })
    }

    /// The key dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sealer of one purpose.
    pub fn sealer(&self, purpose: Purpose) -> Result<Sealer, KeyError> {
        let info = [purpose.info()];
        // The output is the AEAD's 32-byte key, well inside HKDF-SHA256's
        // limit (255 × 32 bytes).
        let okm = self
            .master
            .expand(&info, &CHACHA20_POLY1305)
            .map_err(|_| KeyError::Derive)?;
        Ok(Sealer {
            key: LessSafeKey::new(UnboundKey::from(okm)),
            rng: self.rng.clone(),
        })
    }
}

impl KeyStore {
    /// The HMAC-SHA256 key of one purpose.
    pub fn hmac_key(&self, purpose: Purpose) -> Result<ring::hmac::Key, KeyError> {
        let info = [purpose.info()];
        let okm = self
            .master
            .expand(&info, ring::hmac::HMAC_SHA256)
            .map_err(|_| KeyError::Derive)?;
        Ok(ring::hmac::Key::from(okm))
    }

    /// The 32 secret bytes of one purpose (an Ed25519 seed for
    /// [`Purpose::SnapshotSigning`]), derived like every purpose's key.
    pub fn seed(&self, purpose: Purpose) -> Result<[u8; 32], KeyError> {
        let info = [purpose.info()];
        let mut seed = [0u8; 32];
        self.master
            .expand(&info, Seed32)
            .and_then(|okm| okm.fill(&mut seed))
            .map_err(|_| KeyError::Derive)?;
        Ok(seed)
    }
}

/// Seals and opens values of one purpose (ChaCha20-Poly1305, a random
/// 96-bit nonce per value).
pub struct Sealer {
    key: LessSafeKey,
    rng: SystemRandom,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer").finish_non_exhaustive()
    }
}

impl Sealer {
    /// `plaintext` sealed for the item `bound_to` (e.g. a sandbox id):
    /// `sealed:v1:` + base64url(nonce ‖ ciphertext ‖ tag).
    pub fn seal(&self, bound_to: &str, plaintext: &[u8]) -> Result<String, KeyError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).map_err(|_| KeyError::Random)?;
        let mut buf = plaintext.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(bound_to.as_bytes()),
                &mut buf,
            )
            .map_err(|_| KeyError::Unseal("value too long to seal"))?;
        let mut out = Vec::with_capacity(NONCE_LEN + buf.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&buf);
        Ok(format!("{SEALED_PREFIX}{}", URL_SAFE_NO_PAD.encode(out)))
    }

    /// Opens a value [`seal`](Self::seal)ed for `bound_to`.
    pub fn open(&self, bound_to: &str, sealed: &str) -> Result<Vec<u8>, KeyError> {
        let body = sealed
            .strip_prefix(SEALED_PREFIX)
            .ok_or(KeyError::Unseal("not a sealed value"))?;
        let mut raw = URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| KeyError::Unseal("not base64"))?;
        if raw.len() < NONCE_LEN + CHACHA20_POLY1305.tag_len() {
            return Err(KeyError::Unseal("too short"));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&raw[..NONCE_LEN]);
        let plain = self
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(bound_to.as_bytes()),
                &mut raw[NONCE_LEN..],
            )
            .map_err(|_| KeyError::Unseal("authentication failed"))?;
        Ok(plain.to_vec())
    }
}

/// Whether `s` is in the sealed format (a stored value from before sealing
/// is not).
pub fn is_sealed(s: &str) -> bool {
    s.starts_with(SEALED_PREFIX)
}

fn read_master(file: &Path) -> Result<Vec<u8>, KeyError> {
    let mut f = fs::File::open(file).map_err(|source| KeyError::Io {
        path: file.to_path_buf(),
        source,
    })?;
    let mut key = Vec::with_capacity(MASTER_LEN);
    // One byte more than a key: a longer file is refused, not truncated.
    (&mut f)
        .take(MASTER_LEN as u64 + 1)
        .read_to_end(&mut key)
        .map_err(|source| KeyError::Io {
            path: file.to_path_buf(),
            source,
        })?;
    Ok(key)
}

/// Refuses `path` when any bit of `forbidden` is set in its mode or another
/// user owns it.
fn check_private(path: &Path, forbidden: u32) -> Result<(), KeyError> {
    let md = fs::symlink_metadata(path).map_err(|source| KeyError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let refuse = |why: String| {
        Err(KeyError::Permissions {
            path: path.to_path_buf(),
            why,
        })
    };
    if md.file_type().is_symlink() {
        return refuse("is a symbolic link".into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if md.uid() != euid {
        return refuse(format!("owned by uid {}, not {euid}", md.uid()));
    }
    let mode = md.mode() & 0o777;
    if mode & forbidden != 0 {
        return refuse(format!("mode {mode:o} lets others in (expected 0700/0600)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_open_makes_a_private_key_and_later_opens_reuse_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("keys");
        let a = KeyStore::open(&dir).unwrap();
        let md = fs::metadata(&dir).unwrap();
        assert_eq!(md.mode() & 0o777, 0o700);
        let key = dir.join(MASTER_FILE);
        assert_eq!(fs::metadata(&key).unwrap().mode() & 0o777, 0o600);
        assert_eq!(fs::read(&key).unwrap().len(), MASTER_LEN);
        let sealed = a
            .sealer(Purpose::SandboxEnv)
            .unwrap()
            .seal("sb-1", b"hello")
            .unwrap();
        assert!(is_sealed(&sealed));
        assert!(!sealed.contains("hello"));
        // A second open (a restarted daemon) opens what the first sealed.
        let b = KeyStore::open(&dir).unwrap();
        assert_eq!(
            b.sealer(Purpose::SandboxEnv)
                .unwrap()
                .open("sb-1", &sealed)
                .unwrap(),
            b"hello"
        );
    }

    /// Daemons starting at once on a fresh host (two tests' daemons did, in
    /// CI's first run) all open the same key: none reads a master key the
    /// other is still writing, and no temporary file is left.
    #[test]
    fn daemons_opening_a_new_key_store_at_once_share_one_key() {
        for _ in 0..20 {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("keys");
            fs::create_dir(&dir).unwrap();
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
            let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
            let opened: Vec<_> = (0..8)
                .map(|_| {
                    let (d, b) = (dir.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        let k = KeyStore::open(&d).map_err(|e| e.to_string())?;
                        k.sealer(Purpose::SandboxEnv)
                            .and_then(|s| s.seal("sb-1", b"x"))
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            let sealed: Vec<String> = opened
                .into_iter()
                .map(|t| t.join().unwrap().unwrap())
                .collect();
            let k = KeyStore::open(&dir).unwrap();
            for s in &sealed {
                assert_eq!(
                    k.sealer(Purpose::SandboxEnv)
                        .unwrap()
                        .open("sb-1", s)
                        .unwrap(),
                    b"x"
                );
            }
            assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "only master.key");
        }
    }

    #[test]
    fn a_value_moved_changed_or_from_another_key_does_not_open() {
        let tmp = tempfile::tempdir().unwrap();
        let s = KeyStore::open(&tmp.path().join("a"))
            .unwrap()
            .sealer(Purpose::SandboxEnv)
            .unwrap();
        let other = KeyStore::open(&tmp.path().join("b"))
            .unwrap()
            .sealer(Purpose::SandboxEnv)
            .unwrap();
        let sealed = s.seal("sb-1", b"secret").unwrap();
        // Two seals of one value differ (random nonce).
        assert_ne!(sealed, s.seal("sb-1", b"secret").unwrap());
        assert!(matches!(s.open("sb-2", &sealed), Err(KeyError::Unseal(_))));
        assert!(matches!(
            other.open("sb-1", &sealed),
            Err(KeyError::Unseal(_))
        ));
        let mut flipped = sealed.clone().into_bytes();
        let last = flipped.len() - 3;
        flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(flipped).unwrap();
        assert!(matches!(s.open("sb-1", &flipped), Err(KeyError::Unseal(_))));
        assert!(matches!(
            s.open("sb-1", "{\"A\":\"1\"}"),
            Err(KeyError::Unseal(_))
        ));
        assert!(matches!(
            s.open("sb-1", &format!("{SEALED_PREFIX}AAAA")),
            Err(KeyError::Unseal(_))
        ));
        assert_eq!(s.open("sb-1", &sealed).unwrap(), b"secret");
    }

    #[test]
    fn the_signing_seed_is_stable_per_key_and_differs_by_key_and_purpose() {
        let tmp = tempfile::tempdir().unwrap();
        let a = KeyStore::open(&tmp.path().join("a")).unwrap();
        let seed = a.seed(Purpose::SnapshotSigning).unwrap();
        let again = KeyStore::open(&tmp.path().join("a")).unwrap();
        assert_eq!(again.seed(Purpose::SnapshotSigning).unwrap(), seed);
        let b = KeyStore::open(&tmp.path().join("b")).unwrap();
        assert_ne!(b.seed(Purpose::SnapshotSigning).unwrap(), seed);
        assert_ne!(a.seed(Purpose::SandboxEnv).unwrap(), seed);
    }

    #[test]
    fn a_key_others_can_read_or_of_the_wrong_size_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("keys");
        KeyStore::open(&dir).unwrap();
        let key = dir.join(MASTER_FILE);
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            KeyStore::open(&dir),
            Err(KeyError::Permissions { .. })
        ));
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            KeyStore::open(&dir),
            Err(KeyError::Permissions { .. })
        ));
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        fs::write(&key, b"short").unwrap();
        assert!(matches!(KeyStore::open(&dir), Err(KeyError::BadKey { .. })));
    }
}
