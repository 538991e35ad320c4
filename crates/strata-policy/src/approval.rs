//! Human approval of held tool calls: an in-memory queue with a write-through
//! persistence hook ([`ApprovalStore`]) that the daemon backs with SQLite.
//!
//! An approval covers one run of one request by one requester:
//! - it is bound to a digest of the whole request ([`request_digest`]: the
//!   tenant, sandbox, requester and every field of the [`CallKind`], plus the
//!   digest of the bytes the call carries, [`BodyDigest`]); using it for
//!   anything else, or as anyone else, is refused ([`ApprovalQueue::take`]);
//! - it is consumed atomically: [`ApprovalQueue::wait`] reports `Approved`
//!   only to the one waiter that consumed it, and [`ApprovalQueue::take`]
//!   consumes it for a re-submission; whoever loses is refused;
//! - it expires ([`ApprovalLimits`]): a pending request nobody answered in
//!   time is timed out (even with nobody waiting, or after a restart), an
//!   approved one nobody used is refused;
//! - pending requests are capped per sandbox.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use sha2::{Digest, Sha256};

use crate::call::ToolCall;
use crate::policy::Decision;

/// The bytes a held call carries that its [`ToolCall`] does not show: an
/// upload's content, an exec's stdin. The approver sees their size and
/// SHA-256; the approval is bound to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BodyDigest {
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the bytes, lower-case hex.
    pub sha256: String,
}

impl BodyDigest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        BodyDigest {
            bytes: data.len() as u64,
            sha256: hex::encode(Sha256::digest(data)),
        }
    }
}

/// The digest an approval is bound to (`sha256:<hex>`): of the tenant, the
/// sandbox, the requester and the whole call (every field of its kind: an
/// exec's argv, env digests, cwd and stdin; a path; a host …), and of the
/// bytes it carries, if any.
pub fn request_digest(call: &ToolCall, body: Option<&BodyDigest>) -> String {
    // serde_json writes struct fields in declaration order and maps (env) in
    // key order: the same request always serialises the same way.
    let v = serde_json::json!({ "call": call, "body": body });
    format!(
        "sha256:{}",
        hex::encode(Sha256::digest(v.to_string().as_bytes()))
    )
}

/// How long approval requests live and how many may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApprovalLimits {
    /// A pending request nobody answered within this is timed out (denied),
    /// whether or not anybody waits for it.
    pub pending_ttl: Duration,
    /// An approved request nobody used within this of its answer is
    /// refused.
    pub approved_ttl: Duration,
    /// Most pending requests per sandbox (per tenant for calls without a
    /// sandbox); more are refused ([`ApprovalError::TooManyPending`]).
    pub max_pending_per_sandbox: usize,
}

impl Default for ApprovalLimits {
    fn default() -> Self {
        ApprovalLimits {
            pending_ttl: Duration::from_secs(3600),
            approved_ttl: Duration::from_secs(3600),
            max_pending_per_sandbox: 32,
        }
    }
}

fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    chrono::TimeDelta::from_std(d)
        .ok()
        .and_then(|d| t.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

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
        /// The approver's reason, when one was given (absent in answers
        /// made before it existed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A human refused.
    Denied {
        /// Who answered.
        by: String,
        /// When.
        at: DateTime<Utc>,
        /// The answerer's reason, when one was given (absent in answers
        /// made before it existed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
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
    /// Size and SHA-256 of the bytes the call carries (an upload's
    /// content, an exec's stdin), when it carries any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<BodyDigest>,
    /// What the approval is bound to: [`request_digest`] of the call and
    /// body (empty in records made before it existed: computed on load).
    #[serde(default)]
    pub request_sha256: String,
    /// When a pending request times out, or an approved one may no longer
    /// be used (none once denied, timed out or used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
    /// When the approved call was run (an approval runs it once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumed_at: Option<DateTime<Utc>>,
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
    /// Record that an approved request was used (`req.consumed_at` is set):
    /// `false` when the store already had it used (nothing written), so
    /// two processes sharing a store cannot both run it.
    fn consume(&self, req: &ApprovalRequest) -> Result<bool, StoreError> {
        self.update(req).map(|()| true)
    }
    /// Request `id` as recorded now (`None`: not recorded). A store that
    /// several processes share overrides this with one read; the default
    /// loads every request.
    fn load_one(&self, id: &str) -> Result<Option<ApprovalRequest>, StoreError> {
        Ok(self.load()?.into_iter().find(|r| r.id == id))
    }
    /// Every request of `tenant` (the default filters [`Self::load`]).
    fn load_tenant(&self, tenant: &str) -> Result<Vec<ApprovalRequest>, StoreError> {
        let mut all = self.load()?;
        all.retain(|r| r.tenant == tenant);
        Ok(all)
    }
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
    /// The sandbox has as many pending requests as allowed; nothing was
    /// recorded.
    #[error("{pending} approval requests of this sandbox are pending already (at most {limit}); answer or let them expire first")]
    TooManyPending {
        /// Pending now.
        pending: usize,
        /// The cap.
        limit: usize,
    },
    /// The request is not (or no longer) approved: pending, denied or
    /// timed out.
    #[error("approval request is {}", status_name(.status))]
    NotApproved {
        /// Its status.
        status: ApprovalStatus,
    },
    /// The approval was used already (it runs its call once).
    #[error("approval was used already")]
    Used,
    /// The approval expired before it was used.
    #[error("approval expired at {0}")]
    Expired(DateTime<Utc>),
    /// The approval was asked for by another caller.
    #[error("approval was asked for by another caller")]
    OtherRequester,
    /// The approval was granted for a different request (another call, or
    /// other bytes).
    #[error(
        "approval was granted for a different request ({approved}), not this one ({presented})"
    )]
    Mismatch {
        /// What was approved.
        approved: String,
        /// What was presented.
        presented: String,
    },
    /// Persistence failed; nothing changed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn status_name(s: &ApprovalStatus) -> &'static str {
    match s {
        ApprovalStatus::Pending => "pending",
        ApprovalStatus::Approved { .. } => "approved",
        ApprovalStatus::Denied { .. } => "denied",
        ApprovalStatus::TimedOut { .. } => "timed out",
    }
}

struct Entry {
    req: ApprovalRequest,
    tx: watch::Sender<ApprovalStatus>,
}

/// The approval queue. Cheap to share behind an `Arc`.
pub struct ApprovalQueue {
    entries: Mutex<HashMap<String, Entry>>,
    store: Option<Arc<dyn ApprovalStore>>,
    limits: ApprovalLimits,
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
            .field("limits", &self.limits)
            .finish()
    }
}

type Map = HashMap<String, Entry>;

impl ApprovalQueue {
    /// An in-memory queue with the default [`ApprovalLimits`].
    pub fn new() -> Self {
        ApprovalQueue {
            entries: Mutex::new(HashMap::new()),
            store: None,
            limits: ApprovalLimits::default(),
        }
    }

    /// An in-memory queue with `limits`.
    pub fn with_limits(limits: ApprovalLimits) -> Self {
        ApprovalQueue {
            limits,
            ..Self::new()
        }
    }

    /// A queue persisted in `store`, reloaded from it, with the default
    /// [`ApprovalLimits`].
    pub fn with_store(store: Arc<dyn ApprovalStore>) -> Result<Self, StoreError> {
        Self::open(store, ApprovalLimits::default())
    }

    /// A queue persisted in `store`, reloaded from it, with `limits`.
    /// Records made before requests were bound and expired get their
    /// digest and expiry now (from their stored call and times).
    pub fn open(store: Arc<dyn ApprovalStore>, limits: ApprovalLimits) -> Result<Self, StoreError> {
        let mut map = HashMap::new();
        for mut req in store.load()? {
            if req.request_sha256.is_empty() {
                req.request_sha256 = request_digest(&req.call, req.body.as_ref());
            }
            if req.expires_at.is_none() && req.consumed_at.is_none() {
                req.expires_at = expiry(&req.status, req.created_at, &limits);
            }
            let (tx, _) = watch::channel(req.status.clone());
            map.insert(req.id.clone(), Entry { req, tx });
        }
        Ok(ApprovalQueue {
            entries: Mutex::new(map),
            store: Some(store),
            limits,
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> ApprovalLimits {
        self.limits
    }

    /// Brings request `id` up to date with the store, which other processes
    /// share (a cluster's PostgreSQL): a request another process recorded
    /// is learnt, an answer or a use another process wrote replaces a
    /// pending (or unused) copy and wakes its waiters. Answers whether the
    /// request is still pending here (`false` for an unknown one, and
    /// without a store: nothing to learn).
    pub fn sync(&self, id: &str) -> Result<bool, StoreError> {
        let Some(store) = &self.store else {
            return Ok(self
                .lock()
                .get(id)
                .is_some_and(|e| e.req.status == ApprovalStatus::Pending));
        };
        let stored = store.load_one(id)?;
        let mut map = self.lock();
        if let Some(req) = stored {
            self.merge(&mut map, req);
        }
        Ok(map
            .get(id)
            .is_some_and(|e| e.req.status == ApprovalStatus::Pending))
    }

    /// [`Self::sync`] of every request of `tenant` the store holds (a
    /// listing on a process that shares the store with others).
    pub fn sync_tenant(&self, tenant: &str) -> Result<(), StoreError> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let all = store.load_tenant(tenant)?;
        let mut map = self.lock();
        for req in all {
            self.merge(&mut map, req);
        }
        Ok(())
    }

    /// Takes a stored record into `map`: a new one is added; a known one
    /// moves forward only (pending → answered, unused → used), never back.
    fn merge(&self, map: &mut Map, mut req: ApprovalRequest) {
        if req.request_sha256.is_empty() {
            req.request_sha256 = request_digest(&req.call, req.body.as_ref());
        }
        match map.get_mut(&req.id) {
            None => {
                if req.expires_at.is_none() && req.consumed_at.is_none() {
                    req.expires_at = expiry(&req.status, req.created_at, &self.limits);
                }
                let (tx, _) = watch::channel(req.status.clone());
                map.insert(req.id.clone(), Entry { req, tx });
            }
            Some(e) => {
                let answered = e.req.status == ApprovalStatus::Pending
                    && req.status != ApprovalStatus::Pending;
                let used = e.req.consumed_at.is_none() && req.consumed_at.is_some();
                if answered || used {
                    let changed = e.req.status != req.status;
                    e.req = req;
                    if changed {
                        e.tx.send_replace(e.req.status.clone());
                    }
                }
            }
        }
    }

    /// Request `id` of `tenant` in `map`, its expiry applied now.
    fn current<'m>(
        &self,
        map: &'m mut Map,
        tenant: &str,
        id: &str,
    ) -> Result<&'m mut Entry, ApprovalError> {
        let e = map
            .get_mut(id)
            .filter(|e| e.req.tenant == tenant)
            .ok_or(ApprovalError::NotFound)?;
        self.expire(e, Utc::now())?;
        Ok(e)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        // A panic while holding the lock cannot leave an entry half-updated
        // (each update is a single assignment), so poisoning is ignored.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes `updated` through and makes it the entry's record.
    fn commit(&self, e: &mut Entry, updated: ApprovalRequest) -> Result<(), ApprovalError> {
        if let Some(s) = &self.store {
            s.update(&updated)?;
        }
        let changed = e.req.status != updated.status;
        e.req = updated;
        if changed {
            e.tx.send_replace(e.req.status.clone());
        }
        Ok(())
    }

    /// Times the entry out if it is pending past its expiry.
    fn expire(&self, e: &mut Entry, now: DateTime<Utc>) -> Result<(), ApprovalError> {
        match e.req.expires_at {
            Some(at) if e.req.status == ApprovalStatus::Pending && at <= now => {
                let mut updated = e.req.clone();
                updated.status = ApprovalStatus::TimedOut { at };
                updated.expires_at = None;
                self.commit(e, updated)
            }
            _ => Ok(()),
        }
    }

    /// Times out every pending request of `tenant` (all tenants: `None`)
    /// past its expiry. A store failure leaves the entry pending (it is
    /// tried again on the next look).
    fn expire_all(&self, map: &mut Map, tenant: Option<&str>, now: DateTime<Utc>) {
        for e in map.values_mut() {
            if tenant.is_none_or(|t| t == e.req.tenant) {
                if let Err(err) = self.expire(e, now) {
                    tracing::warn!(approval = %e.req.id, error = %err, "timing out an expired approval request");
                }
            }
        }
    }

    /// Hold `call` for approval because of `decision`.
    pub fn request(
        &self,
        call: &ToolCall,
        decision: &Decision,
    ) -> Result<ApprovalRequest, ApprovalError> {
        self.request_with(call, decision, None)
    }

    /// Hold `call`, carrying the bytes `body` digests, for approval because
    /// of `decision`: refused with [`ApprovalError::TooManyPending`] (and
    /// nothing recorded) when its sandbox has the most pending requests
    /// allowed.
    pub fn request_with(
        &self,
        call: &ToolCall,
        decision: &Decision,
        body: Option<BodyDigest>,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let now = Utc::now();
        let req = ApprovalRequest {
            id: uuid::Uuid::new_v4().to_string(),
            tenant: call.tenant.clone(),
            sandbox: call.sandbox.clone(),
            call: call.clone(),
            reason: decision.reason.clone(),
            rule_id: decision.rule_id.clone(),
            requested_by: call.actor.clone(),
            created_at: now,
            status: ApprovalStatus::Pending,
            request_sha256: request_digest(call, body.as_ref()),
            body,
            expires_at: Some(plus(now, self.limits.pending_ttl)),
            consumed_at: None,
        };
        let mut map = self.lock();
        self.expire_all(&mut map, Some(&call.tenant), now);
        let pending = map
            .values()
            .filter(|e| {
                e.req.status == ApprovalStatus::Pending
                    && e.req.tenant == call.tenant
                    && e.req.sandbox == call.sandbox
            })
            .count();
        let limit = self.limits.max_pending_per_sandbox;
        if pending >= limit {
            return Err(ApprovalError::TooManyPending { pending, limit });
        }
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
        let mut map = self.lock();
        let e = self.current(&mut map, tenant, id)?;
        Ok(e.req.clone())
    }

    /// Requests of `tenant`, oldest first; only pending ones if asked.
    pub fn list(&self, tenant: &str, pending_only: bool) -> Vec<ApprovalRequest> {
        let mut map = self.lock();
        self.expire_all(&mut map, Some(tenant), Utc::now());
        let mut v: Vec<_> = map
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
        let e = self.current(&mut map, tenant, id)?;
        if e.req.status != ApprovalStatus::Pending {
            return Err(ApprovalError::AlreadyAnswered {
                status: e.req.status.clone(),
            });
        }
        if !requester_may && who == Some(e.req.requested_by.as_str()) {
            return Err(ApprovalError::SelfApproval);
        }
        let mut updated = e.req.clone();
        updated.expires_at = expiry(&status, e.req.created_at, &self.limits);
        updated.status = status;
        self.commit(e, updated.clone())?;
        Ok(updated)
    }

    /// Answer a pending request. Authorisation (the approver role) is the
    /// caller's job; the requester cannot answer their own request. An
    /// approval may be used until [`ApprovalLimits::approved_ttl`] after it.
    pub fn answer(
        &self,
        tenant: &str,
        id: &str,
        approver: &str,
        approve: bool,
    ) -> Result<ApprovalRequest, ApprovalError> {
        self.answer_with_reason(tenant, id, approver, approve, None)
    }

    /// [`Self::answer`] with the answerer's reason, kept in the status.
    pub fn answer_with_reason(
        &self,
        tenant: &str,
        id: &str,
        approver: &str,
        approve: bool,
        reason: Option<String>,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let at = Utc::now();
        let by = approver.to_string();
        let status = if approve {
            ApprovalStatus::Approved { by, at, reason }
        } else {
            ApprovalStatus::Denied { by, at, reason }
        };
        self.settle(tenant, id, status, false, Some(approver))
    }

    /// Marks an approved, unused, unexpired entry used (write-through,
    /// under the queue's lock: of two takers exactly one wins).
    fn consume(&self, e: &mut Entry, now: DateTime<Utc>) -> Result<ApprovalRequest, ApprovalError> {
        if !matches!(e.req.status, ApprovalStatus::Approved { .. }) {
            return Err(ApprovalError::NotApproved {
                status: e.req.status.clone(),
            });
        }
        if e.req.consumed_at.is_some() {
            return Err(ApprovalError::Used);
        }
        if let Some(at) = e.req.expires_at.filter(|at| *at <= now) {
            return Err(ApprovalError::Expired(at));
        }
        let mut updated = e.req.clone();
        updated.consumed_at = Some(now);
        updated.expires_at = None;
        if let Some(s) = &self.store {
            if !s.consume(&updated)? {
                return Err(ApprovalError::Used);
            }
        }
        e.req = updated.clone();
        Ok(updated)
    }

    /// Uses approval `id` of `tenant` for `call` carrying `body` (a
    /// re-submission of a held call): `Ok` once, when it is approved,
    /// unused, unexpired, asked for by the same requester and bound to the
    /// same request ([`request_digest`]); it is then used. Every refusal
    /// changes nothing.
    pub fn take(
        &self,
        tenant: &str,
        id: &str,
        call: &ToolCall,
        body: Option<&BodyDigest>,
    ) -> Result<ApprovalRequest, ApprovalError> {
        let mut map = self.lock();
        let e = map
            .get_mut(id)
            .filter(|e| e.req.tenant == tenant && call.tenant == tenant)
            .ok_or(ApprovalError::NotFound)?;
        if e.req.call.actor != call.actor || e.req.requested_by != call.actor {
            return Err(ApprovalError::OtherRequester);
        }
        let presented = request_digest(call, body);
        if e.req.request_sha256 != presented {
            return Err(ApprovalError::Mismatch {
                approved: e.req.request_sha256.clone(),
                presented,
            });
        }
        self.consume(e, Utc::now())
    }

    /// Wait up to `timeout` for an answer. A request nobody answered in time
    /// is marked timed out (denied) for good; answering it later fails with
    /// [`ApprovalError::AlreadyAnswered`].
    ///
    /// `Approved` means the approval is this waiter's: it was used by this
    /// call (it runs once). When another waiter or a re-submission used it
    /// first, or it expired, this fails ([`ApprovalError::Used`],
    /// [`ApprovalError::Expired`]): the caller must not run the call.
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
        let mut map = self.lock();
        let e = self.current(&mut map, tenant, id)?;
        Ok(match e.req.status.clone() {
            ApprovalStatus::Approved { by, at, .. } => {
                self.consume(e, Utc::now())?;
                Outcome::Approved { by, at }
            }
            ApprovalStatus::Denied { by, at, .. } => Outcome::Denied { by, at },
            ApprovalStatus::TimedOut { .. } | ApprovalStatus::Pending => Outcome::TimedOut,
        })
    }
}

/// When a request in `status` stops counting: a pending one times out
/// `pending_ttl` after it was made, an approved one may be used until
/// `approved_ttl` after its answer; others never expire (they are final).
fn expiry(
    status: &ApprovalStatus,
    created_at: DateTime<Utc>,
    limits: &ApprovalLimits,
) -> Option<DateTime<Utc>> {
    match status {
        ApprovalStatus::Pending => Some(plus(created_at, limits.pending_ttl)),
        ApprovalStatus::Approved { at, .. } => Some(plus(*at, limits.approved_ttl)),
        ApprovalStatus::Denied { .. } | ApprovalStatus::TimedOut { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::CallKind;
    use crate::policy::Effect;

    fn call(actor: &str, argv: &[&str]) -> ToolCall {
        ToolCall {
            tenant: "acme".into(),
            sandbox: Some("sb".into()),
            actor: actor.into(),
            kind: CallKind::exec(argv.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn held() -> Decision {
        Decision {
            effect: Effect::Approve,
            layer: None,
            rule_id: "r".into(),
            rule_index: None,
            hard: false,
            reason: "a human looks".into(),
        }
    }

    fn approved(q: &ApprovalQueue, c: &ToolCall, body: Option<BodyDigest>) -> String {
        let r = q.request_with(c, &held(), body).unwrap();
        q.answer("acme", &r.id, "boss", true).unwrap();
        r.id
    }

    #[test]
    fn the_digest_covers_every_field_and_the_body() {
        let base = call("dev", &["curl", "x"]);
        let d = request_digest(&base, None);
        assert!(d.starts_with("sha256:") && d.len() == 7 + 64, "{d}");
        assert_eq!(d, request_digest(&base.clone(), None), "stable");
        let env: std::collections::BTreeMap<String, String> =
            [("TOKEN".to_string(), "a".to_string())].into();
        let mut others = vec![
            call("other", &["curl", "x"]),
            call("dev", &["curl", "y"]),
            ToolCall {
                sandbox: Some("sb2".into()),
                ..base.clone()
            },
            ToolCall {
                tenant: "beta".into(),
                ..base.clone()
            },
        ];
        for (env, cwd, stdin) in [
            (env.clone(), None, crate::call::ExecStdin::None),
            (
                Default::default(),
                Some("/tmp".to_string()),
                crate::call::ExecStdin::None,
            ),
            (Default::default(), None, crate::call::ExecStdin::Bytes(3)),
        ] {
            others.push(ToolCall {
                kind: base.kind.clone().with_context(&env, cwd, stdin),
                ..base.clone()
            });
        }
        for o in &others {
            assert_ne!(request_digest(o, None), d, "{o:?}");
        }
        assert_ne!(request_digest(&base, Some(&BodyDigest::of(b"abc"))), d);
        assert_ne!(
            request_digest(&base, Some(&BodyDigest::of(b"abc"))),
            request_digest(&base, Some(&BodyDigest::of(b"abd")))
        );
    }

    #[test]
    fn take_runs_the_bound_request_once() {
        let q = ApprovalQueue::new();
        let c = call("dev", &["curl", "x"]);
        let body = BodyDigest::of(b"payload");
        let id = approved(&q, &c, Some(body.clone()));
        // Another requester, another call, other bytes: refused, nothing used.
        assert!(matches!(
            q.take("acme", &id, &call("dev2", &["curl", "x"]), Some(&body)),
            Err(ApprovalError::OtherRequester)
        ));
        assert!(matches!(
            q.take("acme", &id, &call("dev", &["curl", "y"]), Some(&body)),
            Err(ApprovalError::Mismatch { .. })
        ));
        assert!(matches!(
            q.take("acme", &id, &c, Some(&BodyDigest::of(b"payloaD"))),
            Err(ApprovalError::Mismatch { .. })
        ));
        assert!(matches!(
            q.take("acme", &id, &c, None),
            Err(ApprovalError::Mismatch { .. })
        ));
        assert!(matches!(
            q.take("beta", &id, &c, Some(&body)),
            Err(ApprovalError::NotFound)
        ));
        assert!(q.get("acme", &id).unwrap().consumed_at.is_none());
        let used = q.take("acme", &id, &c, Some(&body)).unwrap();
        assert!(used.consumed_at.is_some());
        assert!(matches!(
            q.take("acme", &id, &c, Some(&body)),
            Err(ApprovalError::Used)
        ));
    }

    #[tokio::test]
    async fn a_waiter_and_a_resubmission_cannot_both_run() {
        let q = Arc::new(ApprovalQueue::new());
        let c = call("dev", &["curl", "x"]);
        let r = q.request(&c, &held()).unwrap();
        let (q2, id) = (q.clone(), r.id.clone());
        let waiter =
            tokio::spawn(async move { q2.wait("acme", &id, Duration::from_secs(5)).await });
        q.answer("acme", &r.id, "boss", true).unwrap();
        // The re-submission comes first: the waiter wakes to a used approval.
        q.take("acme", &r.id, &c, None).unwrap();
        assert!(matches!(waiter.await.unwrap(), Err(ApprovalError::Used)));
        // And the other way round.
        let r = q.request(&c, &held()).unwrap();
        q.answer("acme", &r.id, "boss", true).unwrap();
        assert!(q
            .wait("acme", &r.id, Duration::from_secs(1))
            .await
            .unwrap()
            .is_approved());
        assert!(matches!(
            q.take("acme", &r.id, &c, None),
            Err(ApprovalError::Used)
        ));
        assert!(matches!(
            q.wait("acme", &r.id, Duration::from_secs(1)).await,
            Err(ApprovalError::Used)
        ));
    }

    #[tokio::test]
    async fn approvals_and_pending_requests_expire() {
        let q = ApprovalQueue::with_limits(ApprovalLimits {
            pending_ttl: Duration::from_millis(50),
            approved_ttl: Duration::from_millis(50),
            max_pending_per_sandbox: 8,
        });
        let c = call("dev", &["curl", "x"]);
        let pending = q.request(&c, &held()).unwrap();
        let id = approved(&q, &c, None);
        std::thread::sleep(Duration::from_millis(80));
        // Nobody waits for it, yet it times out.
        assert!(matches!(
            q.get("acme", &pending.id).unwrap().status,
            ApprovalStatus::TimedOut { .. }
        ));
        assert!(q.list("acme", true).is_empty());
        assert!(matches!(
            q.answer("acme", &pending.id, "boss", true),
            Err(ApprovalError::AlreadyAnswered { .. })
        ));
        assert!(matches!(
            q.take("acme", &id, &c, None),
            Err(ApprovalError::Expired(_))
        ));
        assert!(q.get("acme", &id).unwrap().consumed_at.is_none());
    }

    #[test]
    fn pending_requests_are_capped_per_sandbox() {
        let q = ApprovalQueue::with_limits(ApprovalLimits {
            max_pending_per_sandbox: 2,
            ..ApprovalLimits::default()
        });
        let c = call("dev", &["curl", "x"]);
        let first = q.request(&c, &held()).unwrap();
        q.request(&c, &held()).unwrap();
        assert!(matches!(
            q.request(&c, &held()),
            Err(ApprovalError::TooManyPending {
                pending: 2,
                limit: 2
            })
        ));
        assert_eq!(q.list("acme", false).len(), 2, "nothing recorded");
        // Another sandbox has its own count; an answer makes room.
        let other = ToolCall {
            sandbox: Some("sb2".into()),
            ..c.clone()
        };
        q.request(&other, &held()).unwrap();
        q.answer("acme", &first.id, "boss", false).unwrap();
        q.request(&c, &held()).unwrap();
    }
}
