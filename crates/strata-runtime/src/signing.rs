//! Signatures of state subvolumes (snapshots and templates): Ed25519 by the
//! deployment's key, checked before every restore.
//!
//! What is signed is what a restore hands to QEMU and takes its command
//! line from: the exact bytes of `meta.json` (size, kernel command line,
//! networking, device layout) and a SHA-256 of `device.state` (the device
//! state QEMU parses on an incoming migration), bound to the state's id.
//! Guest RAM (`mem`), the disk, kernel and initrd are **not** covered: they
//! are guest contents, run inside the VM, and hashing gigabytes would cost
//! seconds where a restore takes milliseconds.
//!
//! Where a signature lives ([`SignatureFile`], JSON):
//! - inside the subvolume as [`crate::meta::files::SIGNATURE`], written
//!   before the read-only snapshot is taken (every state this runtime
//!   makes with a signer);
//! - for a state made before signing (read-only, cannot take a file), a
//!   sidecar outside it: `<pool>/signatures/{snapshots,templates}/<id>.sig`,
//!   written by [`crate::Runtime::adopt_unsigned`].
//!
//! The inside file is read first, then the sidecar. A state with neither,
//! or whose signature does not verify against this deployment's public key
//! (changed files, another deployment's key, another state's signature),
//! is refused as `snapshot_unusable`.
//!
//! A runtime without a signer ([`crate::RuntimeConfig::signing`] `None`:
//! tools and tests that run no daemon) neither signs nor checks: the legacy
//! behaviour, explicit.

use std::io::Read;
use std::path::Path;

use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Version of [`SignatureFile`] this build writes and reads.
pub const SIGNATURE_VERSION: u32 = 1;

/// Domain separation of the signed message: a signature made for anything
/// else with the same key never verifies here.
const CONTEXT: &[u8] = b"strata state signature v1";

/// Largest signature file read (a real one is ~400 bytes).
const MAX_SIGNATURE_BYTES: u64 = 16 << 10;

/// Why a signer could not be made.
#[derive(Debug, thiserror::Error)]
#[error("invalid Ed25519 seed")]
pub struct SignerError;

/// The deployment's signing key for state subvolumes (an Ed25519 key pair
/// from a 32-byte seed the daemon derives from its key store).
pub struct StateSigner {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for StateSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateSigner")
            .field("public_key", &self.public_key())
            .finish_non_exhaustive()
    }
}

impl StateSigner {
    /// The signer of `seed` (the Ed25519 private key seed).
    pub fn from_seed(seed: &[u8; 32]) -> Result<StateSigner, SignerError> {
        let pair = Ed25519KeyPair::from_seed_unchecked(seed).map_err(|_| SignerError)?;
        Ok(StateSigner { pair })
    }

    /// The public key, hex: what a [`SignatureFile`] names as its signer.
    pub fn public_key(&self) -> String {
        hex::encode(self.pair.public_key().as_ref())
    }

    /// Signs the state `name` whose files have `hashes`.
    pub fn sign(&self, name: &str, hashes: &StateHashes) -> SignatureFile {
        let sig = self.pair.sign(&message(name, hashes));
        SignatureFile {
            version: SIGNATURE_VERSION,
            state: name.to_owned(),
            meta_sha256: hex::encode(hashes.meta),
            device_state_sha256: hashes.device_state.map(hex::encode),
            public_key: self.public_key(),
            signature: hex::encode(sig.as_ref()),
        }
    }

    /// Checks that `file` is this key's signature of state `name` whose
    /// files have `hashes`; the error says what differs.
    pub fn verify(
        &self,
        name: &str,
        file: &SignatureFile,
        hashes: &StateHashes,
    ) -> Result<(), String> {
        if file.version != SIGNATURE_VERSION {
            return Err(format!(
                "its signature has format {}, this strata reads {SIGNATURE_VERSION}",
                file.version
            ));
        }
        let ours = self.public_key();
        if file.public_key != ours {
            return Err(format!(
                "it is signed by another deployment's key ({}…), not this one's ({}…)",
                short(&file.public_key),
                short(&ours)
            ));
        }
        if file.state != name {
            return Err(format!(
                "its signature is {}'s, not {name}'s (a state moved or copied under another id)",
                file.state
            ));
        }
        if file.meta_sha256 != hex::encode(hashes.meta) {
            return Err("meta.json was changed after it was signed".into());
        }
        if file.device_state_sha256 != hashes.device_state.map(hex::encode) {
            return Err("device.state was changed after it was signed".into());
        }
        let sig =
            hex::decode(&file.signature).map_err(|_| "its signature is not hex".to_owned())?;
        UnparsedPublicKey::new(&ED25519, self.pair.public_key().as_ref())
            .verify(&message(name, hashes), &sig)
            .map_err(|_| "its signature does not verify".to_owned())
    }
}

fn short(hex_key: &str) -> &str {
    hex_key.get(..16).unwrap_or(hex_key)
}

/// The signed message: context, state id, meta hash, device state hash.
fn message(name: &str, hashes: &StateHashes) -> Vec<u8> {
    let mut m = Vec::with_capacity(CONTEXT.len() + name.len() + 70);
    m.extend_from_slice(CONTEXT);
    m.push(0);
    m.extend_from_slice(name.as_bytes());
    m.push(0);
    m.extend_from_slice(&hashes.meta);
    match hashes.device_state {
        Some(d) => {
            m.push(1);
            m.extend_from_slice(&d);
        }
        None => m.push(0),
    }
    m
}

/// What a signature covers, hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateHashes {
    /// SHA-256 of `meta.json`'s bytes.
    pub meta: [u8; 32],
    /// SHA-256 of `device.state`; `None` for a disk-only state (it has none).
    pub device_state: Option<[u8; 32]>,
}

impl StateHashes {
    /// The hashes of `meta_bytes` and, unless `disk_only`, of
    /// `dir/device.state`.
    pub fn of(meta_bytes: &[u8], disk_only: bool, dir: &Path) -> std::io::Result<StateHashes> {
        let device_state = if disk_only {
            None
        } else {
            Some(sha256_file(&dir.join(crate::meta::files::DEVICE_STATE))?)
        };
        Ok(StateHashes {
            meta: Sha256::digest(meta_bytes).into(),
            device_state,
        })
    }
}

/// SHA-256 of a file's content.
pub fn sha256_file(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// A state's signature as stored (inside the subvolume or as a sidecar).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignatureFile {
    /// [`SIGNATURE_VERSION`].
    pub version: u32,
    /// The id of the state it signs (a snapshot or template id).
    pub state: String,
    /// SHA-256 of `meta.json`, hex.
    pub meta_sha256: String,
    /// SHA-256 of `device.state`, hex; absent for a disk-only state.
    #[serde(default)]
    pub device_state_sha256: Option<String>,
    /// The signer's Ed25519 public key, hex.
    pub public_key: String,
    /// The Ed25519 signature, hex.
    pub signature: String,
}

impl SignatureFile {
    /// Reads a signature file; `Ok(None)` when there is none.
    pub fn read(path: &Path) -> Result<Option<SignatureFile>, String> {
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read its signature: {e}")),
        };
        let mut text = Vec::new();
        f.take(MAX_SIGNATURE_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(|e| format!("cannot read its signature: {e}"))?;
        if text.len() as u64 > MAX_SIGNATURE_BYTES {
            return Err("its signature file is too large".into());
        }
        serde_json::from_slice(&text)
            .map(Some)
            .map_err(|e| format!("its signature file is not valid: {e}"))
    }

    /// Writes it to `path` atomically (temporary file, fsync, rename).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        let tmp = path.with_extension("sig.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer(b: u8) -> StateSigner {
        StateSigner::from_seed(&[b; 32]).unwrap()
    }

    fn state(dir: &Path, device: &[u8]) -> StateHashes {
        std::fs::write(dir.join(crate::meta::files::DEVICE_STATE), device).unwrap();
        StateHashes::of(b"{\"meta\":1}", false, dir).unwrap()
    }

    #[test]
    fn a_signature_verifies_and_survives_a_round_trip_through_its_file() {
        let d = tempfile::tempdir().unwrap();
        let s = signer(7);
        let h = state(d.path(), b"device bytes");
        let sig = s.sign("snap-1", &h);
        let path = d.path().join("state.sig");
        sig.write(&path).unwrap();
        let back = SignatureFile::read(&path).unwrap().unwrap();
        assert_eq!(back, sig);
        s.verify("snap-1", &back, &h).unwrap();
        // The same seed is the same key (a restarted daemon).
        signer(7).verify("snap-1", &back, &h).unwrap();
        assert_eq!(SignatureFile::read(&d.path().join("none")).unwrap(), None);
    }

    #[test]
    fn a_changed_device_state_meta_id_or_key_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = signer(7);
        let h = state(d.path(), b"device bytes");
        let sig = s.sign("snap-1", &h);
        // One byte of device.state flipped.
        let tampered = state(d.path(), b"device bytez");
        let e = s.verify("snap-1", &sig, &tampered).unwrap_err();
        assert!(e.contains("device.state was changed"), "{e}");
        // meta.json changed.
        let m = StateHashes::of(b"{\"meta\":2}", false, d.path()).unwrap();
        let e = s.verify("snap-1", &sig, &m).unwrap_err();
        assert!(e.contains("meta.json was changed"), "{e}");
        // A disk-only claim for a memory state.
        let e = s
            .verify(
                "snap-1",
                &sig,
                &StateHashes {
                    device_state: None,
                    ..h
                },
            )
            .unwrap_err();
        assert!(e.contains("device.state"), "{e}");
        // Moved to another id.
        let e = s.verify("snap-2", &sig, &h).unwrap_err();
        assert!(e.contains("snap-1's, not snap-2's"), "{e}");
        // Another deployment's key: foreign.
        let e = signer(8).verify("snap-1", &sig, &h).unwrap_err();
        assert!(e.contains("another deployment's key"), "{e}");
        // A forged file: the hashes rewritten to the tampered files, the
        // signature kept.
        let forged = SignatureFile {
            device_state_sha256: tampered.device_state.map(hex::encode),
            ..sig.clone()
        };
        let e = s.verify("snap-1", &forged, &tampered).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
        // Another deployment's signature relabelled with this key's name.
        let other = signer(8).sign("snap-1", &tampered);
        let relabelled = SignatureFile {
            public_key: s.public_key(),
            ..other
        };
        let e = s.verify("snap-1", &relabelled, &tampered).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
    }

    #[test]
    fn a_disk_only_state_signs_its_meta_alone() {
        let d = tempfile::tempdir().unwrap();
        let h = StateHashes::of(b"{}", true, d.path()).unwrap();
        assert_eq!(h.device_state, None);
        let s = signer(1);
        s.verify("snap-d", &s.sign("snap-d", &h), &h).unwrap();
        // A memory state needs its device state.
        assert!(StateHashes::of(b"{}", false, d.path()).is_err());
    }

    #[test]
    fn a_garbled_or_huge_signature_file_is_an_error_not_a_missing_one() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.sig");
        std::fs::write(&p, b"{").unwrap();
        assert!(SignatureFile::read(&p).unwrap_err().contains("not valid"));
        std::fs::write(&p, vec![b' '; (MAX_SIGNATURE_BYTES + 1) as usize]).unwrap();
        assert!(SignatureFile::read(&p).unwrap_err().contains("too large"));
    }
}
