//! Held uploads. An upload the policy holds for an approver (or re-sent
//! with `?approval=<id>`) is read to a bounded, unnamed file first, so its
//! approval is bound to the size and SHA-256 of the very bytes that are
//! then written (`GateOptions::body`), and the approver sees them in the
//! approval record. Uploads the policy allows or denies stream as before.
//!
//! Bounds: each held upload at most `[security] held_upload_max_bytes` (and
//! `max_upload_bytes`), all of them at once at most
//! `held_uploads_total_bytes`. The files live under
//! `<data_dir>/held-uploads` (mode 0700), unlinked from the start (they
//! vanish with the request, or with the process). They are on the host's
//! data disk, not in the pool, but bound for the sandbox's disk: before a
//! held upload is queued its bytes are checked against the pool-bytes
//! quotas of its sandbox and tenant (`quota_exceeded`, no request made).

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::Stream;
use sha2::{Digest, Sha256};
use strata_policy::approval::BodyDigest;
use tokio::io::{AsyncSeekExt, AsyncWriteExt};

use super::prelude::*;

/// Bytes all held uploads take now (shared by their reservations).
#[derive(Debug, Default)]
pub(crate) struct HeldBytes(Arc<AtomicU64>);

/// The directory of held-upload files under the data dir.
pub const HELD_UPLOADS_DIR: &str = "held-uploads";

/// Bytes taken from the held-upload budget, given back on drop.
#[derive(Debug)]
struct Reservation {
    bytes: u64,
    total: Arc<AtomicU64>,
}

impl Reservation {
    /// Takes `more` bytes from a budget of `limit`; `false` (nothing taken)
    /// when that would go over.
    fn grow(&mut self, more: u64, limit: u64) -> bool {
        let ok = self
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|n| *n <= limit)
            })
            .is_ok();
        if ok {
            self.bytes += more;
        }
        ok
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// An upload read to a file, with the digest of its bytes.
#[derive(Debug)]
pub struct HeldUpload {
    file: tokio::fs::File,
    digest: BodyDigest,
    _reserved: Reservation,
}

impl HeldUpload {
    /// Size and SHA-256 of the bytes.
    pub fn digest(&self) -> &BodyDigest {
        &self.digest
    }
}

impl Service {
    /// Whether the upload `kind` of `caller` to sandbox `id` must be read
    /// before it is gated ([`Service::hold_upload`]): it re-sends an
    /// approval, or the policy holds it now. The gate decides again on the
    /// values the write uses; a policy changed in between only makes a held
    /// call's approval miss (refused), never run unbound.
    pub fn upload_is_held(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: &CallKind,
        opts: &GateOptions,
    ) -> bool {
        let Some(tenant) = caller.tenant() else {
            return false;
        };
        opts.approval.is_some()
            || self.gate.holds(&ToolCall {
                tenant: tenant.to_owned(),
                sandbox: Some(id.to_string()),
                actor: caller.actor(),
                kind: kind.clone(),
            })
    }

    /// Reads `body` to a held-upload file, digesting it: `payload_too_large`
    /// past `held_upload_max_bytes`, `insufficient_capacity` when held
    /// uploads take their whole budget; the stream's own error otherwise.
    pub async fn hold_upload<S, E>(&self, body: S) -> ServiceResult<HeldUpload>
    where
        S: Stream<Item = Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let sec = &self.config.security;
        let max = sec.held_upload_max_bytes.min(self.config.max_upload_bytes);
        let total = sec.held_uploads_total_bytes;
        let dir = self.config.data_dir.join(HELD_UPLOADS_DIR);
        let file = tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)?;
            tempfile::tempfile_in(&dir)
        })
        .await
        .map_err(|e| ServiceError::Engine(RuntimeError::Other(format!("held upload: {e}"))))?
        .map_err(|e| ServiceError::Engine(RuntimeError::Other(format!("held upload file: {e}"))))?;
        let mut file = tokio::fs::File::from_std(file);
        let mut reserved = Reservation {
            bytes: 0,
            total: self.held.0.clone(),
        };
        let mut hash = Sha256::new();
        let io = |e: std::io::Error| {
            ServiceError::Engine(RuntimeError::Other(format!("held upload file: {e}")))
        };
        futures::pin_mut!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| {
                ServiceError::Engine(RuntimeError::Other(format!("reading upload: {e}")))
            })?;
            let n = chunk.len() as u64;
            if reserved.bytes + n > max {
                return Err(ServiceError::TooLarge(format!(
                    "an upload held for approval may be at most {max} bytes ([security] held_upload_max_bytes)"
                )));
            }
            if !reserved.grow(n, total) {
                return Err(ServiceError::InsufficientCapacity(format!(
                    "uploads held for approval take all of their {total} bytes ([security] held_uploads_total_bytes); retry later"
                )));
            }
            hash.update(&chunk);
            file.write_all(&chunk).await.map_err(io)?;
        }
        file.flush().await.map_err(io)?;
        file.seek(std::io::SeekFrom::Start(0)).await.map_err(io)?;
        Ok(HeldUpload {
            file,
            digest: BodyDigest {
                bytes: reserved.bytes,
                sha256: hex::encode(hash.finalize()),
            },
            _reserved: reserved,
        })
    }

    /// Gates the upload `kind` carrying `held`'s bytes: the approval (new,
    /// or the re-sent `opts.approval`) is bound to their digest. The bytes
    /// count against the pool-bytes quotas of the sandbox and its tenant
    /// first (they are bound for the sandbox's disk): a tenant at its quota
    /// cannot park uploads in the approval queue (`quota_exceeded`, no
    /// request made).
    pub async fn grant_held(
        &self,
        caller: &Caller,
        id: &SandboxId,
        kind: CallKind,
        opts: &GateOptions,
        held: &HeldUpload,
    ) -> ServiceResult<Grant> {
        let rec = self.get_sandbox(caller, id).await?;
        self.check_pool_quota(&rec, held.digest.bytes, false)
            .await?;
        let opts = GateOptions {
            body: Some(held.digest.clone()),
            ..opts.clone()
        };
        self.grant(caller, id, kind, &opts).await
    }

    /// Writes a held upload under the grant made for its bytes
    /// ([`Service::grant_held`]); another grant is refused.
    pub async fn write_held(
        self: &Arc<Self>,
        g: &Grant,
        path: &str,
        mode: u32,
        held: HeldUpload,
    ) -> ServiceResult<u64> {
        if g.body() != Some(&held.digest) {
            return Err(ServiceError::Forbidden(
                "these bytes are not the ones the gate decided".into(),
            ));
        }
        let HeldUpload {
            file,
            _reserved: reserved,
            ..
        } = held;
        let body = tokio_util::io::ReaderStream::new(file)
            .map(|c| c.map_err(|e| RuntimeError::Other(format!("held upload file: {e}"))))
            .boxed();
        let written = self.write_granted(g, path, mode, body).await;
        // The budget is held until the write is over.
        drop(reserved);
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_budget_and_give_it_back() {
        let total = Arc::new(AtomicU64::new(0));
        let take = || Reservation {
            bytes: 0,
            total: total.clone(),
        };
        let mut a = take();
        assert!(a.grow(6, 10));
        let mut b = take();
        assert!(!b.grow(5, 10), "over the budget: refused");
        assert_eq!(total.load(Ordering::Acquire), 6, "nothing taken");
        assert!(b.grow(4, 10));
        drop(a);
        assert_eq!(total.load(Ordering::Acquire), 4);
        assert!(take().grow(6, 10));
        drop(b);
        assert_eq!(total.load(Ordering::Acquire), 0);
    }
}
