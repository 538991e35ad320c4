//! Why a service command failed, mapped onto the API's stable error codes once.

use super::prelude::*;

/// Why a service call failed; maps onto the API's error codes.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Malformed request.
    #[error("{0}")]
    InvalidRequest(String),
    /// Size outside the absolute bounds.
    #[error(transparent)]
    InvalidSize(#[from] SizeError),
    /// Not enough room on this host.
    #[error("{0}")]
    InsufficientCapacity(String),
    /// A `[quotas]` limit of the tenant or the sandbox would be exceeded.
    #[error("{0}")]
    QuotaExceeded(String),
    /// No such resource.
    #[error("{kind} {id} not found")]
    NotFound {
        /// Resource kind.
        kind: &'static str,
        /// Id as given.
        id: String,
    },
    /// Not allowed in the present state.
    #[error(transparent)]
    InvalidState(#[from] TransitionError),
    /// Not allowed for another reason tied to state (template building...).
    #[error("{0}")]
    InvalidStateOther(String),
    /// Another operation is in progress.
    #[error("{0}")]
    Conflict(String),
    /// The create needs a size variant of its template that is being built
    /// (`service::variants`): the API answers `202` with its progress; retry
    /// (or create with `"wait": true`).
    #[error("the {} vCPU / {} MiB variant of template {} is being built; retry, or create with \"wait\": true", .0.record.size.vcpus, .0.record.size.memory_mib, .0.record.variant_of.as_ref().map(|t| t.as_str()).unwrap_or("?"))]
    VariantBuilding(Box<TemplateView>),
    /// The engine failed; [`RuntimeError::code`] is its API code.
    #[error(transparent)]
    Engine(#[from] RuntimeError),
    /// The store failed.
    #[error("metadata store")]
    Store(#[from] StoreError),
    /// The caller's role or scope does not allow this (a platform template).
    #[error("{0}")]
    Forbidden(String),
    /// The tool-call gate refused (denied, held for approval, or failed closed).
    #[error("{}", gate_message(.0))]
    Gate(GateRefusal),
    /// The key store could not be opened or a value not sealed (fails
    /// closed: nothing is stored unsealed).
    #[error("key store: {0}")]
    Keys(String),
    /// A body over its size limit, found while it streamed in
    /// (`payload_too_large`).
    #[error("{0}")]
    TooLarge(String),
    /// A cluster host needs a template it does not hold and cannot fetch
    /// it from any live host (`template_unavailable`, 503).
    #[error("template {template} is not on this host and cannot be fetched: {why}")]
    TemplateUnavailable {
        /// The template.
        template: String,
        /// Why (no holder, no live holder, each holder's failure).
        why: String,
    },
    /// A recipe the build cannot run (`invalid_recipe`; over a size limit:
    /// `payload_too_large`).
    #[error(transparent)]
    Recipe(#[from] strata_template::RecipeError),
}

pub(crate) fn gate_message(r: &GateRefusal) -> String {
    match r {
        GateRefusal::Invalid(m) | GateRefusal::Internal(m) | GateRefusal::Full(m) => m.clone(),
        GateRefusal::Denied { message, .. } => message.clone(),
        GateRefusal::Pending(req) => format!("held for approval {}", req.id),
    }
}

impl ServiceError {
    /// The stable API code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ServiceError::InvalidRequest(_) => ErrorCode::InvalidRequest,
            ServiceError::InvalidSize(_) => ErrorCode::InvalidSize,
            ServiceError::InsufficientCapacity(_) => ErrorCode::InsufficientCapacity,
            ServiceError::QuotaExceeded(_) => ErrorCode::QuotaExceeded,
            ServiceError::NotFound { .. } => ErrorCode::NotFound,
            ServiceError::InvalidState(_) | ServiceError::InvalidStateOther(_) => {
                ErrorCode::InvalidState
            }
            ServiceError::Conflict(_) => ErrorCode::Conflict,
            ServiceError::VariantBuilding(_) => ErrorCode::InvalidState,
            ServiceError::Engine(e) => e.code(),
            ServiceError::Store(StoreError::BadCursor) => ErrorCode::InvalidRequest,
            ServiceError::Store(StoreError::Fenced { .. }) => ErrorCode::Conflict,
            ServiceError::Store(e) if e.is_full() => ErrorCode::StoreFull,
            ServiceError::Store(e) if e.is_unavailable() => ErrorCode::StorageFailed,
            ServiceError::Store(_) => ErrorCode::Internal,
            ServiceError::Forbidden(_) => ErrorCode::Forbidden,
            ServiceError::Keys(_) => ErrorCode::Internal,
            ServiceError::TooLarge(_) => ErrorCode::PayloadTooLarge,
            ServiceError::TemplateUnavailable { .. } => ErrorCode::TemplateUnavailable,
            ServiceError::Recipe(e) => match e.status() {
                413 => ErrorCode::PayloadTooLarge,
                500 => ErrorCode::Internal,
                _ => ErrorCode::InvalidRecipe,
            },
            ServiceError::Gate(GateRefusal::Invalid(_)) => ErrorCode::InvalidRequest,
            ServiceError::Gate(GateRefusal::Internal(_)) => ErrorCode::Internal,
            ServiceError::Gate(GateRefusal::Full(_)) => ErrorCode::StoreFull,
            ServiceError::Gate(GateRefusal::Denied { decision, .. })
                if crate::security::gate::is_approval_limit(decision) =>
            {
                ErrorCode::RateLimited
            }
            ServiceError::Gate(GateRefusal::Denied { .. } | GateRefusal::Pending(_)) => {
                ErrorCode::PolicyDenied
            }
        }
    }

    /// The message for the API: the whole chain, once.
    pub fn message(&self) -> String {
        let mut msg = self.to_string();
        let mut src = std::error::Error::source(self);
        while let Some(e) = src {
            msg.push_str(": ");
            msg.push_str(&e.to_string());
            src = e.source();
        }
        msg
    }
}

/// Result of service calls.
pub type ServiceResult<T> = Result<T, ServiceError>;

pub(crate) fn not_found(kind: &'static str, id: impl ToString) -> ServiceError {
    ServiceError::NotFound {
        kind,
        id: id.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqlite(code: std::ffi::c_int) -> StoreError {
        StoreError::Db(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            None,
        ))
    }

    #[test]
    fn a_full_store_is_store_full_other_store_errors_internal() {
        let full = ServiceError::Store(sqlite(rusqlite::ffi::SQLITE_FULL));
        assert_eq!(full.code(), ErrorCode::StoreFull);
        assert_eq!(full.code().http_status(), 507);
        let busy = ServiceError::Store(sqlite(rusqlite::ffi::SQLITE_BUSY));
        assert_eq!(busy.code(), ErrorCode::Internal);
        let gate = ServiceError::Gate(GateRefusal::Full("audit log: full".into()));
        assert_eq!(gate.code(), ErrorCode::StoreFull);
    }
}
