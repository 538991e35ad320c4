//! Replicas of sandboxes across the hosts of a cluster (docs/cluster.md,
//! "Replicas"): the PostgreSQL side (which host holds which snapshot of
//! which sandbox, [`HostStore::replicas`]) and the host credential the
//! owner presents to the receiving host.
//!
//! Contract:
//! - A replica is pushed by a background task of the owner, not by a user:
//!   no caller's token travels. The owner presents a **host credential**
//!   instead, `Authorization: StrataHost <host> <sandbox> <unix ms> <mac>`,
//!   the MAC an HMAC-SHA256 with a key derived from the cluster's shared
//!   `master.key` ([`crate::security::keys::Purpose::ClusterHost`]) over
//!   the host, the sandbox and the time. The receiver accepts it for that
//!   sandbox only, within [`CREDENTIAL_SKEW_MS`] of its own clock, and only
//!   when PostgreSQL names the host in it as the sandbox's current owner.
//! - The receiving host records the replica (`put_replica`) once the
//!   snapshot is published in its pool; the row names the newest snapshot
//!   it holds of that sandbox (one row per sandbox and host).
//! - The host-loss watcher ([`super::Cluster::watch_round`]) of a live host
//!   that holds a replica of a lost host's sandbox takes its lease as owner
//!   and installs the replica; the other watchers leave such a sandbox to
//!   it while it is live.

use ring::hmac;
use strata_core::SandboxId;

use super::{host_to_service, Cluster};
use crate::service::{ServiceError, ServiceResult};
use crate::store::{OwnerLease, Replica};

/// The `Authorization` scheme of the host credential.
pub const CREDENTIAL_SCHEME: &str = "StrataHost";

/// The owner re-checks the replicas of the sandboxes it owns every this
/// many host-loss watches (`watch_every`): 50 s by default.
pub const SWEEP_EVERY_WATCHES: u32 = 10;

/// How far a credential's time may be from the receiver's clock.
pub const CREDENTIAL_SKEW_MS: i64 = 5 * 60 * 1000;

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn message(host: &str, sandbox: &str, at_ms: i64) -> String {
    format!("strata host credential v1\n{host}\n{sandbox}\n{at_ms}")
}

/// The `Authorization` value host `host` presents for sandbox `sandbox`
/// at `at_ms` (ms since the epoch), with the cluster host key `key`.
pub fn credential(key: &hmac::Key, host: &str, sandbox: &SandboxId, at_ms: i64) -> String {
    let tag = hmac::sign(key, message(host, sandbox.as_str(), at_ms).as_bytes());
    format!(
        "{CREDENTIAL_SCHEME} {host} {sandbox} {at_ms} {}",
        hex::encode(tag.as_ref())
    )
}

/// The current credential of `host` for `sandbox`.
pub fn credential_now(key: &hmac::Key, host: &str, sandbox: &SandboxId) -> String {
    credential(key, host, sandbox, now_ms())
}

/// Checks a host credential (`header`, the `Authorization` value) for
/// `sandbox` at `now_ms`: answers the host it names, or `403 forbidden`
/// saying why (malformed, another sandbox, too old or new, a wrong MAC).
pub fn verify(
    key: &hmac::Key,
    header: &str,
    sandbox: &SandboxId,
    now_ms: i64,
) -> ServiceResult<String> {
    let bad = |why: &str| ServiceError::Forbidden(format!("host credential: {why}"));
    let mut parts = header.split(' ');
    if parts.next() != Some(CREDENTIAL_SCHEME) {
        return Err(bad(&format!("expected `{CREDENTIAL_SCHEME} …`")));
    }
    let (Some(host), Some(sb), Some(at), Some(mac), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(bad("expected `<host> <sandbox> <unix ms> <mac>`"));
    };
    if sb != sandbox.as_str() {
        return Err(bad("issued for another sandbox"));
    }
    let at: i64 = at.parse().map_err(|_| bad("time is not a number"))?;
    if (now_ms - at).abs() > CREDENTIAL_SKEW_MS {
        return Err(bad("too old or from the future"));
    }
    let mac = hex::decode(mac).map_err(|_| bad("MAC is not hex"))?;
    hmac::verify(key, message(host, sb, at).as_bytes(), &mac)
        .map_err(|_| bad("MAC does not verify (another cluster's master key?)"))?;
    Ok(host.to_owned())
}

/// [`verify`] against this host's clock.
pub fn verify_now(key: &hmac::Key, header: &str, sandbox: &SandboxId) -> ServiceResult<String> {
    verify(key, header, sandbox, now_ms())
}

impl Cluster {
    /// The replicas of `sandbox` as PostgreSQL records them.
    pub async fn replicas(&self, sandbox: &SandboxId) -> ServiceResult<Vec<Replica>> {
        let id = sandbox.clone();
        self.blocking(move |h| h.replicas(&id))
            .await
            .map_err(host_to_service)
    }

    /// Records that this host holds `snapshot` of `sandbox`.
    pub async fn put_replica(&self, sandbox: &SandboxId, snapshot: &str) -> ServiceResult<()> {
        let (id, me, s) = (sandbox.clone(), self.info.id.clone(), snapshot.to_owned());
        self.blocking(move |h| h.put_replica(&id, &me, &s))
            .await
            .map_err(host_to_service)
    }

    /// Forgets host `host`'s replica of `sandbox`.
    pub async fn remove_replica(&self, sandbox: &SandboxId, host: &str) -> ServiceResult<()> {
        let (id, host) = (sandbox.clone(), host.to_owned());
        self.blocking(move |h| h.remove_replica(&id, &host))
            .await
            .map_err(host_to_service)
    }

    /// The snapshots this host holds as replicas of other hosts'
    /// sandboxes (its recovery keeps them: not orphans).
    pub async fn held_replicas(&self) -> ServiceResult<Vec<String>> {
        let me = self.info.id.clone();
        self.blocking(move |h| h.host_replicas(&me))
            .await
            .map_err(host_to_service)
    }

    /// The replicas this host holds of deleted sandboxes (at most
    /// `limit`): (sandbox, snapshot).
    pub async fn deleted_replicas(&self, limit: usize) -> ServiceResult<Vec<(String, String)>> {
        let me = self.info.id.clone();
        self.blocking(move |h| h.deleted_replicas(&me, limit))
            .await
            .map_err(host_to_service)
    }

    /// The lease of `sandbox` (whoever holds it, expired or not).
    pub async fn owner_of(&self, sandbox: &SandboxId) -> ServiceResult<Option<OwnerLease>> {
        let id = sandbox.clone();
        self.blocking(move |h| h.sandbox_owner(&id))
            .await
            .map_err(host_to_service)
    }

    /// Whether a live host other than `lost` and this one holds a replica
    /// among `replicas` (then its own watcher recovers the sandbox).
    pub(super) async fn replica_elsewhere(&self, replicas: &[Replica], lost: &str) -> bool {
        let Ok(hosts) = self.hosts_view().await else {
            return false;
        };
        replicas.iter().any(|r| {
            r.host_id != lost
                && r.host_id != self.info.id
                && hosts.iter().any(|h| h.info.id == r.host_id && h.alive)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_verifies_only_for_its_sandbox_key_and_time() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"one cluster");
        let other = hmac::Key::new(hmac::HMAC_SHA256, b"another cluster");
        let (sb, sb2) = (SandboxId::generate(), SandboxId::generate());
        let at = 1_800_000_000_000;
        let c = credential(&key, "host-a", &sb, at);
        assert_eq!(verify(&key, &c, &sb, at + 1000).expect("valid"), "host-a");
        for (k, s, now, why) in [
            (&other, &sb, at, "MAC"),
            (&key, &sb2, at, "another sandbox"),
            (&key, &sb, at + CREDENTIAL_SKEW_MS + 1, "too old"),
            (&key, &sb, at - CREDENTIAL_SKEW_MS - 1, "too old"),
        ] {
            let e = verify(k, &c, s, now).expect_err(why);
            assert!(e.message().contains(why), "{}", e.message());
        }
        // Another host named with the same MAC does not verify.
        let forged = c.replace("host-a", "host-x");
        assert!(verify(&key, &forged, &sb, at).is_err());
        assert!(verify(&key, "Bearer abc", &sb, at).is_err());
        assert!(verify(&key, "StrataHost a b", &sb, at).is_err());
    }
}
