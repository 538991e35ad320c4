//! Human approval of held tool calls: an in-memory queue with a write-through
//! persistence hook ([`ApprovalStore`]) that the daemon backs with SQLite.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::call::ToolCall;
use crate::policy::Decision;

/// Where a request stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// Waiting for a human.
    Pending,
    /// A human approved.
    Approved {
        /// Who answered.
        by: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// A human refused.
    Denied {
        /// Who answered.
        by: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Nobody answered in time: the call is refused.
    TimedOut {
        /// When the wait gave up.
        at: DateTime<Utc>,
    },
}

/// A held tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalRequest {
    /// Request id.
    pub id: String,
    /// Tenant; the request is invisible to every other tenant.
    pub tenant: String,
    /// Sandbox, when there is one.
    pub sandbox: Option<String>,
    /// The held call.
    pub call: ToolCall,
    /// Why it was held (the rule's reason).
    pub reason: String,
    /// Id of the rule that asked for approval.
    pub rule_id: String,
    /// Who made the call.
    pub requested_by: String,
    /// When it was held.
    pub created_at: DateTime<Utc>,
    /// Current status.
    pub status: ApprovalStatus,
}

/// What a waiting caller learns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Run the call.
    Approved {
        /// Who approved.
        by: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Do not run the call.
    Denied {
        /// Who refused.
        by: String,
        /// When.
        at: DateTime<Utc>,
    },
    /// Nobody answered in time; treat as denied.
    TimedOut,
}

impl Outcome {
    /// Whether the call may run.
    pub fn is_approved(&self) -> bool {
        matches!(self, Outcome::Approved { .. })
    }
}

/// A persistence failure reported by an [`ApprovalStore`].
#[derive(Debug, thiserror::Error)]
#[error("approval store: {0}")]
pub struct StoreError(pub String);

/// Write-through persistence for approval requests. Every state change is
/// written here before it becomes visible, so an acknowledged answer
/// survives a daemon restart.
pub trait ApprovalStore: Send + Sync {
    /// Record a new pending request.
    fn insert(&self, req: &ApprovalRequest) -> Result<(), StoreError>;
    /// Record a status change of an existing request.
    fn update(&self, req: &ApprovalRequest) -> Result<(), StoreError>;
    /// Every request known, to reload the queue on start.
    fn load(&self) -> Result<Vec<ApprovalRequest>, StoreError>;
}

/// Errors of queue operations.
#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    /// No such request for this tenant (a foreign tenant's id looks the same).
    #[error("approval request not found")]
    NotFound,
    /// The request was answered (or timed out) already.
    #[error("approval request already answered")]
    AlreadyAnswered {
        /// Its status.
        status: ApprovalStatus,
    },
    /// The caller who made the request may not approve it.
    #[error("the requester cannot answer their own request")]
    SelfApproval,
    /// Persistence failed; nothing changed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

struct Entry {
    req: ApprovalRequest,
    tx: watch::Sender<ApprovalStatus>,
}

/// The approval queue. Cheap to share behind an `Arc`.
pub struct ApprovalQueue {
    entries: Mutex<HashMap<String, Entry>>,
    store: Option<Arc<dyn ApprovalStore>>,
}

impl Default for ApprovalQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for ApprovalQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApprovalQueue")
            .field("persistent", &self.store.is_some())
            .finish()
    }
}

impl ApprovalQueue {
    /// An in-memory queue.
    pub fn new() -> Self {
        ApprovalQueue {
            entries: Mutex::new(HashMap::new()),
            store: None,
        }
    }

    /// A queue persisted in `store`, reloaded from it.
    pub fn with_store(store: Arc<dyn ApprovalStore>) -> Result<Self, StoreError> {
        let mut map = HashMap::new();
        for req in store.load()? {
            let (tx, _) = watch::channel(req.status.clone());
            map.insert(req.id.clone(), Entry { req, tx });
        }
        Ok(ApprovalQueue {
            entries: Mutex::new(map),
            store: Some(store),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock cannot leave an entry half-updated
        // (each update is a single assignment), so poisoning is ignored.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hold `call` for approval because of `decision`.
    pub fn request(
        &self,
        call: &ToolCall,
        decision: &Decision,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let req = ApprovalRequest {
            id: uuid::Uuid::new_v4().to_string(),
            tenant: call.tenant.clone(),
            sandbox: call.sandbox.clone(),
            call: call.clone(),
            reason: decision.reason.clone(),
            rule_id: decision.rule_id.clone(),
            requested_by: call.actor.clone(),
            created_at: Utc::now(),
            status: ApprovalStatus::Pending,
        };
        let mut map = self.lock();
        if let Some(s) = &self.store {
            s.insert(&req)?;
        }
        let (tx, _) = watch::channel(ApprovalStatus::Pending);
        map.insert(
            req.id.clone(),
            Entry {
                req: req.clone(),
                tx,
            },
        );
        Ok(req)
    }

    /// One request of `tenant`.
    pub fn get(&self, tenant: &str, id: &str) -> Result<ApprovalRequest, ApprovalError> {
        self.lock()
            .get(id)
            .filter(|e| e.req.tenant == tenant)
            .map(|e| e.req.clone())
            .ok_or(ApprovalError::NotFound)
    }

    /// Requests of `tenant`, oldest first; only pending ones if asked.
    pub fn list(&self, tenant: &str, pending_only: bool) -> Vec<ApprovalRequest> {
        let mut v: Vec<_> = self
            .lock()
            .values()
            .filter(|e| {
                e.req.tenant == tenant && (!pending_only || e.req.status == ApprovalStatus::Pending)
            })
            .map(|e| e.req.clone())
            .collect();
        v.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        v
    }

    fn settle(
        &self,
        tenant: &str,
        id: &str,
        status: ApprovalStatus,
        requester_may: bool,
        who: Option<&str>,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let mut map = self.lock();
        let e = map
            .get_mut(id)
            .filter(|e| e.req.tenant == tenant)
            .ok_or(ApprovalError::NotFound)?;
        if e.req.status != ApprovalStatus::Pending {
            return Err(ApprovalError::AlreadyAnswered {
                status: e.req.status.clone(),
            });
        }
        if !requester_may && who == Some(e.req.requested_by.as_str()) {
            return Err(ApprovalError::SelfApproval);
        }
        let mut updated = e.req.clone();
        updated.status = status.clone();
        if let Some(s) = &self.store {
            s.update(&updated)?;
        }
        e.req = updated.clone();
        e.tx.send_replace(status);
        Ok(updated)
    }

    /// Answer a pending request. Authorisation (the approver role) is the
    /// caller's job; the requester cannot answer their own request.
    pub fn answer(
        &self,
        tenant: &str,
        id: &str,
        approver: &str,
        approve: bool,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let at = Utc::now();
        let by = approver.to_string();
        let status = if approve {
            ApprovalStatus::Approved { by, at }
        } else {
            ApprovalStatus::Denied { by, at }
        };
        self.settle(tenant, id, status, false, Some(approver))
    }

    /// Wait up to `timeout` for an answer. A request nobody answered in time
    /// is marked timed out (denied) for good; answering it later fails with
    /// [`ApprovalError::AlreadyAnswered`].
    pub async fn wait(
        &self,
        tenant: &str,
        id: &str,
        timeout: Duration,
    ) -> Result<Outcome, ApprovalError> {
        let mut rx = {
            let map = self.lock();
            let e = map
                .get(id)
                .filter(|e| e.req.tenant == tenant)
                .ok_or(ApprovalError::NotFound)?;
            e.tx.subscribe()
        };
        let answered = tokio::time::timeout(timeout, async {
            // The sender lives in the map as long as the entry does; if it is
            // dropped we fall through to the timeout path.
            let _ = rx.wait_for(|s| *s != ApprovalStatus::Pending).await;
        })
        .await;
        if answered.is_err() {
            match self.settle(
                tenant,
                id,
                ApprovalStatus::TimedOut { at: Utc::now() },
                true,
                None,
            ) {
                Ok(_) => return Ok(Outcome::TimedOut),
                Err(ApprovalError::AlreadyAnswered { .. }) => {} // answered at the last moment
                Err(e) => return Err(e),
            }
        }
        Ok(match self.get(tenant, id)?.status {
            ApprovalStatus::Approved { by, at } => Outcome::Approved { by, at },
            ApprovalStatus::Denied { by, at } => Outcome::Denied { by, at },
            ApprovalStatus::TimedOut { .. } | ApprovalStatus::Pending => Outcome::TimedOut,
        })
    }
}
