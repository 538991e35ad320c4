//! Stable, machine-readable error codes.
//!
//! Every error that leaves strata (HTTP API, CLI `--json`) carries one of
//! these codes. Codes are part of the API: add new ones, never rename.

use serde::{Deserialize, Serialize};

/// A stable error code with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed (bad JSON, wrong types, bad path).
    InvalidRequest,
    /// A size is outside the accepted bounds.
    InvalidSize,
    /// The host does not have the capacity asked for.
    InsufficientCapacity,
    /// No such resource (or not visible to the caller).
    NotFound,
    /// The operation is not allowed in the resource's present state.
    InvalidState,
    /// Another operation on the same resource is in progress.
    Conflict,
    /// Authentication missing or invalid.
    Unauthorized,
    /// Authenticated but not allowed.
    Forbidden,
    /// Denied by policy.
    PolicyDenied,
    /// Request body too large.
    PayloadTooLarge,
    /// Too many requests.
    RateLimited,
    /// The guest agent did not answer in time.
    AgentTimeout,
    /// The guest agent reported an error (e.g. no such file in the guest).
    AgentError,
    /// The storage pool is full.
    PoolFull,
    /// A quota of the caller's tenant (or of the sandbox) would be exceeded:
    /// sandboxes, vCPUs, memory or pool bytes (`[quotas]`). Not retried by
    /// waiting; free something first. Host room stays `insufficient_capacity`.
    QuotaExceeded,
    /// A snapshot is corrupt, missing parts, or incompatible with this host.
    SnapshotUnusable,
    /// The VM failed or died.
    VmFailed,
    /// A template recipe (or Dockerfile) is malformed, over a limit, or
    /// names something the build cannot use (an unsupported base image, a
    /// `copy` whose files were not uploaded); the message names the step
    /// or line.
    InvalidRecipe,
    /// The daemon's metadata store (its SQLite file) has no room left to
    /// record the change; nothing was done. Retry once the operator freed
    /// space on the data dir's file system.
    StoreFull,
    /// The storage pool refused a write for another reason than running
    /// full: an I/O error, or the pool went read-only (btrfs does that
    /// itself after a device error). Nothing was done; what was
    /// acknowledged before is kept.
    StorageFailed,
    /// A cluster host needs a template it does not hold and no live host
    /// could hand it over (docs/cluster.md "Templates across hosts").
    TemplateUnavailable,
    /// Anything else; a bug or an environment problem.
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code maps to.
    pub fn http_status(&self) -> u16 {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidSize | ErrorCode::InvalidRecipe => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden | ErrorCode::PolicyDenied | ErrorCode::QuotaExceeded => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::InvalidState | ErrorCode::Conflict => 409,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::SnapshotUnusable => 422,
            ErrorCode::RateLimited => 429,
            ErrorCode::InsufficientCapacity | ErrorCode::PoolFull | ErrorCode::StoreFull => 507,
            ErrorCode::StorageFailed | ErrorCode::TemplateUnavailable => 503,
            ErrorCode::AgentError => 502,
            ErrorCode::AgentTimeout => 504,
            ErrorCode::VmFailed | ErrorCode::Internal => 500,
        }
    }

    /// The snake_case name, as serialized.
    pub fn as_str(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_default()
            .trim_matches('"')
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_snake_case() {
        assert_eq!(ErrorCode::NotFound.as_str(), "not_found");
        assert_eq!(ErrorCode::InvalidState.http_status(), 409);
        assert_eq!(ErrorCode::QuotaExceeded.as_str(), "quota_exceeded");
        assert_eq!(ErrorCode::QuotaExceeded.http_status(), 403);
        assert_eq!(ErrorCode::StoreFull.as_str(), "store_full");
        assert_eq!(ErrorCode::StoreFull.http_status(), 507);
        assert_eq!(ErrorCode::StorageFailed.as_str(), "storage_failed");
        assert_eq!(ErrorCode::StorageFailed.http_status(), 503);
    }
}
