//! Snapshot signing at start-up: adopting the states made before it
//! (`docs/keys.md`).
//!
//! Contract:
//! - The first start of a daemon whose engine signs states
//!   ([`Engine::signs_states`]) adopts every ready snapshot and every
//!   template it has a record of ([`Engine::adopt_unsigned`]: a state
//!   without a signature gets a sidecar signature outside its read-only
//!   subvolume; one already signed is left as it is), before recovery
//!   restores anything, then records that adoption is done (setting
//!   [`ADOPTED_KEY`] of the platform scope).
//! - Later starts adopt nothing: from then on a state that lost its
//!   signature, was changed, or was signed by another deployment is
//!   refused on restore as `snapshot_unusable`.
//! - An engine error (I/O) leaves adoption unrecorded, so the next start
//!   tries again; a state that cannot be adopted (its signature does not
//!   verify, its metadata is unreadable) is reported and stays refused.

use super::prelude::*;
use crate::engine::Adoption;

/// The platform-scope setting that records that the states made before
/// signing were adopted (its value: when, and how many).
pub const ADOPTED_KEY: &str = "strata.snapshot_signing.adopted";

/// What adoption found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AdoptionReport {
    /// States that had no signature and are now signed.
    pub signed: usize,
    /// States already signed by this deployment.
    pub already_signed: usize,
    /// Records whose subvolume is gone.
    pub missing: usize,
    /// States left refused, with the reason: `(id, reason)`.
    pub refused: Vec<(String, String)>,
    /// Why nothing was adopted (already done, or an engine that does not sign).
    pub skipped: Option<String>,
}

impl Service {
    /// Adopts the states made before signing, once; see the module
    /// documentation.
    pub async fn adopt_unsigned_states(&self) -> ServiceResult<AdoptionReport> {
        let mut report = AdoptionReport::default();
        if !self.engine.signs_states() {
            report.skipped = Some("the engine does not sign states".into());
            return Ok(report);
        }
        let done = self
            .db(|s| s.tenant_settings(ADOPTED_KEY))
            .await?
            .into_iter()
            .any(|(tenant, key, _)| tenant == PLATFORM_SCOPE && key == ADOPTED_KEY);
        if done {
            report.skipped = Some("adopted at an earlier start".into());
            return Ok(report);
        }
        let snapshots = self.db(|s| s.ready_snapshot_ids()).await?;
        let templates = self.db(|s| s.all_templates()).await?;
        let states = snapshots
            .into_iter()
            .map(Source::Snapshot)
            .chain(templates.into_iter().map(|t| Source::Template(t.id)));
        let mut complete = true;
        for state in states {
            let name = match &state {
                Source::Snapshot(s) => s.to_string(),
                Source::Template(t) => t.to_string(),
            };
            match self.engine.adopt_unsigned(&state).await {
                Ok(Adoption::Signed) => report.signed += 1,
                Ok(Adoption::AlreadySigned) => report.already_signed += 1,
                Ok(Adoption::Missing) => report.missing += 1,
                Ok(Adoption::Refused(why)) => {
                    warn!(state = %name, reason = %why, "a state made before signing cannot be adopted; it stays refused");
                    report.refused.push((name, why));
                }
                Err(e) => {
                    let why = ServiceError::from(e).message();
                    warn!(state = %name, error = %why, "adopting a state failed; adoption runs again at the next start");
                    report.refused.push((name, why));
                    complete = false;
                }
            }
        }
        if complete {
            let value = serde_json::json!({
                "at": self.clock.now(),
                "signed": report.signed,
                "already_signed": report.already_signed,
                "refused": report.refused.len(),
            })
            .to_string();
            self.db(move |s| s.put_tenant_setting(PLATFORM_SCOPE, ADOPTED_KEY, Some(&value)))
                .await?;
        }
        info!(
            signed = report.signed,
            already_signed = report.already_signed,
            missing = report.missing,
            refused = report.refused.len(),
            complete,
            "states made before signing adopted"
        );
        Ok(report)
    }
}
