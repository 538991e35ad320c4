//! The runtime's side of state signatures ([`crate::signing`]): signing the
//! states it makes, checking them before every restore, and adopting the
//! states made before signing.
//!
//! Contract:
//! - With a signer ([`crate::RuntimeConfig::signing`]), every state this
//!   runtime makes (snapshot, hibernation, wake snapshot, template, import)
//!   carries `state.sig` inside its subvolume, written before it becomes
//!   read-only; a state made from another (a wake snapshot, a template from
//!   a builder's snapshot) is signed only after its source verified and its
//!   copied `device.state` hashed the same.
//! - Every restore (create, fork, rewind, restore, wake, warm guests)
//!   verifies twice: when the state is opened (a refused rewind leaves the
//!   VM running) and on the new subvolume's `device.state` right before
//!   QEMU reads it. A state without a valid signature is
//!   [`RuntimeError::SnapshotUnusable`].
//! - [`Runtime::adopt_unsigned`] signs a state made before signing into a
//!   sidecar outside the read-only subvolume; the daemon calls it once, for
//!   the states it has records of, and records that it did.

use std::path::{Path, PathBuf};

use super::{OpenState, Result, Runtime, StateRef};
use crate::api::Source;
use crate::error::{io_err, RuntimeError};
use crate::meta::{files, StateMeta};
use crate::signing::{SignatureFile, StateHashes, StateSigner};

/// What [`Runtime::adopt_unsigned`] did with one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// It had no signature; it is now signed (a sidecar).
    Signed,
    /// It already carries a valid signature of this deployment.
    AlreadySigned,
    /// No such subvolume.
    Missing,
    /// It carries a signature that does not verify (changed, another
    /// deployment's), or cannot be read: left as it is, refused on restore.
    Refused(String),
}

impl Runtime {
    /// Whether this runtime signs and checks states (it has a signer).
    pub fn signs_states(&self) -> bool {
        self.cfg.signing.is_some()
    }

    fn signer(&self) -> Option<&StateSigner> {
        self.cfg.signing.as_deref()
    }

    /// `<pool>/signatures/{snapshots,templates}/<id>.sig`: where a state
    /// made before signing keeps its signature (its subvolume is read-only).
    pub(super) fn sidecar_path(&self, state: StateRef<'_>) -> Option<PathBuf> {
        let kind = match state {
            StateRef::Sandbox(_) => return None,
            StateRef::Snapshot(_) => "snapshots",
            StateRef::Template(_) => "templates",
        };
        Some(
            self.pool
                .root()
                .join("signatures")
                .join(kind)
                .join(format!("{}.sig", state.name())),
        )
    }

    /// Verifies the signature of the opened state `st`: over the bytes its
    /// meta was parsed from and `files_dir/device.state` (the state's own
    /// directory, or the subvolume a restore just made of it). Returns the
    /// hashes verified (`None` without a signer: nothing is checked).
    pub(super) fn check_signature(
        &self,
        st: &OpenState,
        files_dir: &Path,
    ) -> Result<Option<StateHashes>> {
        let Some(signer) = self.signer() else {
            return Ok(None);
        };
        let unusable = |reason: String| RuntimeError::SnapshotUnusable {
            id: st.name.clone(),
            reason,
        };
        let sig = load_signature(st).map_err(unusable)?.ok_or_else(|| {
            unusable(
                "it carries no signature of this deployment (made before strata signed \
                 snapshots and never adopted, or its signature was removed)"
                    .into(),
            )
        })?;
        let hashes = StateHashes::of(&st.meta_bytes, st.meta.disk_only, files_dir)
            .map_err(|e| unusable(format!("cannot hash device.state: {e}")))?;
        signer.verify(&st.name, &sig, &hashes).map_err(unusable)?;
        Ok(Some(hashes))
    }

    /// Signs a state made before signing (no signature inside its
    /// subvolume or beside it) into a sidecar outside its read-only
    /// subvolume, so it keeps restoring; see [`Adoption`] for the outcomes.
    /// The daemon calls it once per state it has a record of, at its first
    /// start with signing: trust on first use of what the pool holds then.
    pub async fn adopt_unsigned(&self, state: &Source) -> Result<Adoption> {
        let Some(signer) = self.signer() else {
            return Err(RuntimeError::Invalid(
                "this runtime has no signing key".into(),
            ));
        };
        let sref = StateRef::from(state);
        let st = match self.open_state(sref) {
            Ok(st) => st,
            Err(RuntimeError::SnapshotNotFound(_)) => return Ok(Adoption::Missing),
            Err(RuntimeError::SnapshotUnusable { reason, .. }) => {
                return Ok(Adoption::Refused(reason))
            }
            Err(e) => return Err(e),
        };
        let found = match load_signature(&st) {
            Ok(f) => f,
            Err(reason) => return Ok(Adoption::Refused(reason)),
        };
        let hashes = match StateHashes::of(&st.meta_bytes, st.meta.disk_only, &st.dir) {
            Ok(h) => h,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Adoption::Refused("device.state is missing".into()))
            }
            Err(e) => return Err(io_err("hash device.state", e)),
        };
        if let Some(sig) = found {
            return Ok(match signer.verify(&st.name, &sig, &hashes) {
                Ok(()) => Adoption::AlreadySigned,
                Err(reason) => Adoption::Refused(reason),
            });
        }
        let Some(sidecar) = st.sidecar.as_ref() else {
            return Err(RuntimeError::Invalid("a sandbox is not a state".into()));
        };
        if let Some(parent) = sidecar.parent() {
            create_private_dir(parent).map_err(|e| io_err("create signatures dir", e))?;
        }
        signer
            .sign(&st.name, &hashes)
            .write(sidecar)
            .map_err(|e| io_err("write signature", e))?;
        tracing::info!(state = %st.name, "adopted a state made before signing");
        Ok(Adoption::Signed)
    }

    /// Removes the sidecar signature of a deleted state, if any.
    pub(super) fn remove_sidecar(&self, state: StateRef<'_>) {
        if let Some(p) = self.sidecar_path(state) {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove a signature")
                }
            }
        }
    }
}

/// The signature of `st`: inside its subvolume, else its sidecar.
fn load_signature(st: &OpenState) -> std::result::Result<Option<SignatureFile>, String> {
    if let Some(sig) = SignatureFile::read(&st.dir.join(files::SIGNATURE))? {
        return Ok(Some(sig));
    }
    match &st.sidecar {
        Some(p) => SignatureFile::read(p),
        None => Ok(None),
    }
}

/// Writes `dir/state.sig`: `signer`'s signature of the state in `dir` (its
/// `meta.json` as it is now, and its `device.state`) as state `name`. When
/// the state was made from a verified `source`, its `device.state` must hash
/// the same as the source's (the copy is what was verified). Without a
/// signer a stale `state.sig` (copied from the source) is removed instead.
pub(super) fn sign_into(
    signer: Option<&StateSigner>,
    dir: &Path,
    name: &str,
    source: Option<&StateHashes>,
) -> Result<()> {
    let path = dir.join(files::SIGNATURE);
    let Some(signer) = signer else {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io_err("remove a stale signature", e))
            }
            _ => Ok(()),
        };
    };
    let (meta, bytes) =
        StateMeta::read_with_bytes(dir).map_err(|e| RuntimeError::SnapshotUnusable {
            id: name.to_owned(),
            reason: e.0,
        })?;
    let hashes =
        StateHashes::of(&bytes, meta.disk_only, dir).map_err(|e| io_err("hash device.state", e))?;
    if let Some(src) = source {
        if src.device_state != hashes.device_state {
            return Err(RuntimeError::SnapshotUnusable {
                id: name.to_owned(),
                reason: "device.state changed between its source's check and its copy".into(),
            });
        }
    }
    signer
        .sign(name, &hashes)
        .write(&path)
        .map_err(|e| io_err("write signature", e))
}

/// Creates `dir` (and its parents) with mode 0700.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::tests::{meta, populated};

    fn opened(dir: &Path, sidecar: Option<PathBuf>) -> OpenState {
        let snap = strata_core::SnapshotId::generate();
        let mut st = OpenState::open(dir.into(), StateRef::Snapshot(&snap)).unwrap();
        st.sidecar = sidecar;
        st
    }

    #[test]
    fn a_state_signed_into_its_dir_verifies_and_a_flipped_device_state_byte_does_not() {
        let d = populated();
        meta().write(d.path()).unwrap();
        let signer = StateSigner::from_seed(&[3; 32]).unwrap();
        let st = opened(d.path(), None);
        sign_into(Some(&signer), d.path(), &st.name, None).unwrap();
        let sig = load_signature(&st).unwrap().unwrap();
        let h = StateHashes::of(&st.meta_bytes, false, d.path()).unwrap();
        signer.verify(&st.name, &sig, &h).unwrap();
        // One byte of device.state flipped: refused.
        let ds = d.path().join(files::DEVICE_STATE);
        let mut bytes = std::fs::read(&ds).unwrap();
        bytes[0] ^= 0x01;
        std::fs::write(&ds, bytes).unwrap();
        let h = StateHashes::of(&st.meta_bytes, false, d.path()).unwrap();
        let e = signer.verify(&st.name, &sig, &h).unwrap_err();
        assert!(e.contains("device.state"), "{e}");
        // A copy whose device.state differs from its verified source is
        // not signed.
        let src = StateHashes {
            device_state: Some([0; 32]),
            ..h
        };
        let e = sign_into(Some(&signer), d.path(), &st.name, Some(&src)).unwrap_err();
        assert!(matches!(e, RuntimeError::SnapshotUnusable { .. }), "{e}");
    }

    #[test]
    fn the_inside_signature_comes_first_then_the_sidecar() {
        let d = populated();
        meta().write(d.path()).unwrap();
        let side = tempfile::tempdir().unwrap();
        let sidecar = side.path().join("x.sig");
        let st = opened(d.path(), Some(sidecar.clone()));
        assert_eq!(load_signature(&st).unwrap(), None);
        let a = StateSigner::from_seed(&[1; 32]).unwrap();
        let h = StateHashes::of(&st.meta_bytes, false, d.path()).unwrap();
        a.sign(&st.name, &h).write(&sidecar).unwrap();
        assert_eq!(
            load_signature(&st).unwrap().unwrap().public_key,
            a.public_key()
        );
        let b = StateSigner::from_seed(&[2; 32]).unwrap();
        sign_into(Some(&b), d.path(), &st.name, None).unwrap();
        assert_eq!(
            load_signature(&st).unwrap().unwrap().public_key,
            b.public_key()
        );
        // Without a signer, a copied signature is cleared.
        sign_into(None, d.path(), &st.name, None).unwrap();
        assert!(!d.path().join(files::SIGNATURE).exists());
    }
}
