//! Security records in the daemon's SQLite database: API tokens, tenants,
//! tenant and sandbox policies, approval requests (the library's
//! [`ApprovalStore`]), the audit log's head and egress proxy ports.
//!
//! The schema is migration 2 of `store::sqlite` ([`MIGRATION_V2`]); this
//! module keeps its own writer connection to the same file (WAL mode lets
//! both writers take turns; every write is one short transaction).

use std::path::Path;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};
use serde::{Deserialize, Serialize};
use strata_policy::approval::{ApprovalRequest, ApprovalStatus, ApprovalStore, StoreError};

use super::auth::Role;

/// Schema of the security tables (migration 2 of the SQLite store).
pub const MIGRATION_V2: &str = r#"
    CREATE TABLE tenants (
        id TEXT PRIMARY KEY,
        created_at INTEGER NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO tenants (id, created_at) VALUES ('default', 0);
    CREATE TABLE api_tokens (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        role TEXT NOT NULL,
        name TEXT,
        hash TEXT NOT NULL UNIQUE,
        created_at INTEGER NOT NULL,
        created_by TEXT,
        expires_at INTEGER,
        revoked_at INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX api_tokens_by_tenant ON api_tokens (tenant_id, created_at);
    CREATE TABLE tenant_policies (
        tenant_id TEXT PRIMARY KEY,
        toml TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        updated_by TEXT
    ) WITHOUT ROWID;
    CREATE TABLE sandbox_policies (
        sandbox_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        toml TEXT NOT NULL,
        updated_at INTEGER NOT NULL,
        updated_by TEXT
    ) WITHOUT ROWID;
    CREATE TABLE approvals (
        id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        status TEXT NOT NULL,
        body TEXT NOT NULL,
        consumed_at INTEGER
    ) WITHOUT ROWID;
    CREATE INDEX approvals_by_tenant ON approvals (tenant_id, status, created_at);
    CREATE TABLE audit_head (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        seq INTEGER NOT NULL,
        hash TEXT NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE TABLE egress_ports (
        sandbox_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        port INTEGER NOT NULL
    ) WITHOUT ROWID;
"#;

/// Errors of the security store.
#[derive(Debug, thiserror::Error)]
pub enum SecStoreError {
    /// SQLite failed.
    #[error("security store")]
    Sqlite(#[from] rusqlite::Error),
    /// The database has not been migrated to the security schema.
    #[error("database {0} lacks the security tables (schema older than 2)")]
    Schema(String),
    /// A stored row could not be decoded.
    #[error("corrupt security record: {0}")]
    Corrupt(String),
}

/// Result of store calls.
pub type SecResult<T> = Result<T, SecStoreError>;

/// An API token as stored (never the secret itself, only its SHA-256).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// Token id (`tok-…`), safe to show and log.
    pub id: String,
    /// Tenant the token acts for.
    pub tenant: String,
    /// Role.
    pub role: Role,
    /// Free-form name.
    pub name: Option<String>,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// Token id of the admin who made it (`bootstrap` for the first one).
    pub created_by: Option<String>,
    /// When it stops working.
    pub expires_at: Option<DateTime<Utc>>,
    /// When it was revoked.
    pub revoked_at: Option<DateTime<Utc>>,
    /// SHA-256 of the secret, hex; not serialized to clients.
    #[serde(skip)]
    pub hash: String,
}

/// A connector secret as stored (schema 15): its material only sealed.
#[derive(Clone)]
pub struct SecretRow {
    /// Tenant.
    pub tenant: String,
    /// Name, unique per tenant.
    pub name: String,
    /// The connector it is bound to (by name).
    pub connector: String,
    /// `static` or `oauth2`.
    pub kind: String,
    /// The injection rule (and OAuth2 token URL, client id) as JSON.
    pub rule: String,
    /// The material, sealed by the key store (`sealed:v1:…`).
    pub sealed: String,
    /// When first written.
    pub created_at: DateTime<Utc>,
    /// When last written (rotated).
    pub updated_at: DateTime<Utc>,
    /// Who wrote it last.
    pub updated_by: Option<String>,
}

impl std::fmt::Debug for SecretRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRow")
            .field("tenant", &self.tenant)
            .field("name", &self.name)
            .field("connector", &self.connector)
            .finish_non_exhaustive()
    }
}

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

fn from_ms(v: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(v).unwrap_or_default()
}

const TOKEN_COLS: &str =
    "id, tenant_id, role, name, hash, created_at, created_by, expires_at, revoked_at";

fn token_row(r: &Row<'_>) -> rusqlite::Result<(TokenRecord, String)> {
    let role: String = r.get(2)?;
    Ok((
        TokenRecord {
            id: r.get(0)?,
            tenant: r.get(1)?,
            role: Role::Viewer,
            name: r.get(3)?,
            hash: r.get(4)?,
            created_at: from_ms(r.get(5)?),
            created_by: r.get(6)?,
            expires_at: r.get::<_, Option<i64>>(7)?.map(from_ms),
            revoked_at: r.get::<_, Option<i64>>(8)?.map(from_ms),
        },
        role,
    ))
}

fn token_record((mut t, role): (TokenRecord, String)) -> SecResult<TokenRecord> {
    t.role = role
        .parse()
        .map_err(|_| SecStoreError::Corrupt(format!("token {}: role {role:?}", t.id)))?;
    Ok(t)
}

/// The security tables.
pub struct SecurityStore {
    conn: Mutex<Connection>,
    /// Tokens found by hash lately ([`SecurityStore::token_by_hash`]).
    token_cache: Mutex<TokenCache>,
}

/// How long a token found by its hash is answered from memory. A
/// revocation through this store takes effect at once; one written by
/// another process on the same database within this.
pub const TOKEN_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most tokens held in memory; past it the cache starts over.
pub const TOKEN_CACHE_MAX: usize = 4096;

/// Found tokens by secret hash, with when each was read.
#[derive(Debug, Default)]
struct TokenCache(std::collections::HashMap<String, (TokenRecord, std::time::Instant)>);

impl TokenCache {
    fn get(&self, hash: &str) -> Option<TokenRecord> {
        self.0
            .get(hash)
            .filter(|(_, at)| at.elapsed() < TOKEN_CACHE_TTL)
            .map(|(t, _)| t.clone())
    }

    fn put(&mut self, hash: &str, t: &TokenRecord) {
        if self.0.len() >= TOKEN_CACHE_MAX {
            self.0.retain(|_, (_, at)| at.elapsed() < TOKEN_CACHE_TTL);
            if self.0.len() >= TOKEN_CACHE_MAX {
                self.0.clear();
            }
        }
        self.0
            .insert(hash.to_owned(), (t.clone(), std::time::Instant::now()));
    }

    fn forget(&mut self, tenant: &str, id: &str) {
        self.0
            .retain(|_, (t, _)| !(t.id == id && t.tenant == tenant));
    }
}

impl std::fmt::Debug for SecurityStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecurityStore").finish_non_exhaustive()
    }
}

fn status_str(s: &ApprovalStatus) -> &'static str {
    match s {
        ApprovalStatus::Pending => "pending",
        ApprovalStatus::Approved { .. } => "approved",
        ApprovalStatus::Denied { .. } => "denied",
        ApprovalStatus::TimedOut { .. } => "timed_out",
    }
}

impl SecurityStore {
    /// Opens the database at `path`; it must carry schema version 2 or later
    /// (the main store migrates it when it opens).
    pub fn open(path: &Path) -> SecResult<Self> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch("PRAGMA synchronous=FULL;")?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version < 2 {
            return Err(SecStoreError::Schema(path.display().to_string()));
        }
        Ok(SecurityStore {
            conn: Mutex::new(conn),
            token_cache: Mutex::new(TokenCache::default()),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic mid-call rolls its transaction back; the connection is fine.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of tokens ever made (revoked ones included).
    pub fn token_count(&self) -> SecResult<u64> {
        let n: i64 = self
            .conn()
            .query_row("SELECT COUNT(*) FROM api_tokens", [], |r| r.get(0))?;
        Ok(n.max(0) as u64)
    }

    /// Records a new token (and its tenant, if new).
    pub fn insert_token(&self, t: &TokenRecord) -> SecResult<()> {
        let mut c = self.conn();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute(
            "INSERT OR IGNORE INTO tenants (id, created_at) VALUES (?1, ?2)",
            params![t.tenant, ms(t.created_at)],
        )?;
        tx.execute(
            &format!("INSERT INTO api_tokens ({TOKEN_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9)"),
            params![
                t.id,
                t.tenant,
                t.role.as_str(),
                t.name,
                t.hash,
                ms(t.created_at),
                t.created_by,
                t.expires_at.map(ms),
                t.revoked_at.map(ms)
            ],
        )?;
        tx.commit()?;
        Ok(())
    }

    fn tokens_cached(&self) -> std::sync::MutexGuard<'_, TokenCache> {
        self.token_cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The token whose secret hashes to `hash`: from memory when it was
    /// read within [`TOKEN_CACHE_TTL`] (every request authenticates; the
    /// connection is shared with the audit log), else from the database.
    /// Unknown hashes are never cached.
    pub fn token_by_hash(&self, hash: &str) -> SecResult<Option<TokenRecord>> {
        if let Some(t) = self.tokens_cached().get(hash) {
            return Ok(Some(t));
        }
        let found = self
            .conn()
            .query_row(
                &format!("SELECT {TOKEN_COLS} FROM api_tokens WHERE hash = ?1"),
                [hash],
                token_row,
            )
            .optional()?
            .map(token_record)
            .transpose()?;
        if let Some(t) = &found {
            self.tokens_cached().put(hash, t);
        }
        Ok(found)
    }

    /// One token of `tenant`.
    pub fn token(&self, tenant: &str, id: &str) -> SecResult<Option<TokenRecord>> {
        self.conn()
            .query_row(
                &format!("SELECT {TOKEN_COLS} FROM api_tokens WHERE id = ?1 AND tenant_id = ?2"),
                [id, tenant],
                token_row,
            )
            .optional()?
            .map(token_record)
            .transpose()
    }

    /// Tokens of `tenant`, oldest first.
    pub fn tokens(&self, tenant: &str) -> SecResult<Vec<TokenRecord>> {
        let c = self.conn();
        let mut st = c.prepare(&format!(
            "SELECT {TOKEN_COLS} FROM api_tokens WHERE tenant_id = ?1 ORDER BY created_at, id"
        ))?;
        let rows = st.query_map([tenant], token_row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(token_record(r?)?);
        }
        Ok(out)
    }

    /// Marks a token revoked; false when it does not exist for `tenant`.
    pub fn revoke_token(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> SecResult<bool> {
        let n = self.conn().execute(
            "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, ?3) WHERE id = ?1 AND tenant_id = ?2",
            params![id, tenant, ms(at)],
        )?;
        // Before the answer: the revoked token's next request is refused.
        self.tokens_cached().forget(tenant, id);
        Ok(n > 0)
    }

    /// Every tenant's policy text.
    pub fn tenant_policy(&self, tenant: &str) -> SecResult<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT toml FROM tenant_policies WHERE tenant_id = ?1",
                [tenant],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Replaces a tenant's policy text.
    pub fn put_tenant_policy(&self, tenant: &str, toml: &str, by: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO tenant_policies (tenant_id, toml, updated_at, updated_by) VALUES (?1,?2,?3,?4)",
            params![tenant, toml, ms(Utc::now()), by],
        )?;
        Ok(())
    }

    /// A sandbox's policy text.
    pub fn sandbox_policy(&self, sandbox: &str) -> SecResult<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT toml FROM sandbox_policies WHERE sandbox_id = ?1",
                [sandbox],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Replaces a sandbox's policy text.
    pub fn put_sandbox_policy(
        &self,
        tenant: &str,
        sandbox: &str,
        toml: &str,
        by: &str,
    ) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO sandbox_policies (sandbox_id, tenant_id, toml, updated_at, updated_by) VALUES (?1,?2,?3,?4,?5)",
            params![sandbox, tenant, toml, ms(Utc::now()), by],
        )?;
        Ok(())
    }

    /// Writes a connector secret (a new one, or a rotation keeping its
    /// creation time).
    pub fn put_secret(&self, r: &SecretRow) -> SecResult<()> {
        self.conn().execute(
            "INSERT INTO connector_secrets (tenant_id, name, connector, kind, rule, sealed, created_at, updated_at, updated_by) \
             VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9) \
             ON CONFLICT (tenant_id, name) DO UPDATE SET connector = excluded.connector, kind = excluded.kind, \
             rule = excluded.rule, sealed = excluded.sealed, updated_at = excluded.updated_at, updated_by = excluded.updated_by",
            params![
                r.tenant,
                r.name,
                r.connector,
                r.kind,
                r.rule,
                r.sealed,
                ms(r.created_at),
                ms(r.updated_at),
                r.updated_by
            ],
        )?;
        Ok(())
    }

    /// Connector secrets of `tenant` (every tenant's when `None`), by name.
    pub fn secrets(&self, tenant: Option<&str>) -> SecResult<Vec<SecretRow>> {
        let c = self.conn();
        let mut st = c.prepare(
            "SELECT tenant_id, name, connector, kind, rule, sealed, created_at, updated_at, updated_by \
             FROM connector_secrets WHERE ?1 IS NULL OR tenant_id = ?1 ORDER BY tenant_id, name",
        )?;
        let rows = st.query_map([tenant], |r| {
            Ok(SecretRow {
                tenant: r.get(0)?,
                name: r.get(1)?,
                connector: r.get(2)?,
                kind: r.get(3)?,
                rule: r.get(4)?,
                sealed: r.get(5)?,
                created_at: from_ms(r.get(6)?),
                updated_at: from_ms(r.get(7)?),
                updated_by: r.get(8)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Deletes a connector secret; false when `tenant` has none of that name.
    pub fn delete_secret(&self, tenant: &str, name: &str) -> SecResult<bool> {
        let n = self.conn().execute(
            "DELETE FROM connector_secrets WHERE tenant_id = ?1 AND name = ?2",
            [tenant, name],
        )?;
        Ok(n > 0)
    }

    /// The recorded audit head `(seq, hash)`.
    pub fn audit_head(&self) -> SecResult<Option<(u64, String)>> {
        Ok(self
            .conn()
            .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |r| {
                Ok((r.get::<_, i64>(0)?.max(0) as u64, r.get(1)?))
            })
            .optional()?)
    }

    /// Records the audit head.
    pub fn set_audit_head(&self, seq: u64, hash: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO audit_head (id, seq, hash, updated_at) VALUES (1, ?1, ?2, ?3)",
            params![i64::try_from(seq).unwrap_or(i64::MAX), hash, ms(Utc::now())],
        )?;
        Ok(())
    }

    /// The egress proxy port last used for a sandbox.
    pub fn egress_port(&self, sandbox: &str) -> SecResult<Option<u16>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT port FROM egress_ports WHERE sandbox_id = ?1",
                [sandbox],
                |r| r.get::<_, i64>(0),
            )
            .optional()?
            .and_then(|p| u16::try_from(p).ok()))
    }

    /// Records the egress proxy port of a sandbox.
    pub fn set_egress_port(&self, tenant: &str, sandbox: &str, port: u16) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO egress_ports (sandbox_id, tenant_id, port) VALUES (?1,?2,?3)",
            params![sandbox, tenant, i64::from(port)],
        )?;
        Ok(())
    }

    /// Binds a sandbox's E2B envd access token to the caller it was handed
    /// to (schema 4): envd calls then act as that caller, across restarts.
    pub fn bind_envd(&self, sandbox: &str, caller: &crate::caller::Caller) -> SecResult<()> {
        let json = serde_json::to_string(caller)
            .map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))?;
        self.conn().execute(
            "INSERT OR REPLACE INTO envd_bindings (sandbox_id, caller, updated_at) VALUES (?1,?2,?3)",
            params![sandbox, json, Utc::now().timestamp_millis()],
        )?;
        Ok(())
    }

    /// The caller a sandbox's envd token was handed to, if recorded.
    pub fn envd_binding(&self, sandbox: &str) -> SecResult<Option<crate::caller::Caller>> {
        let json: Option<String> = self
            .conn()
            .query_row(
                "SELECT caller FROM envd_bindings WHERE sandbox_id = ?1",
                [sandbox],
                |r| r.get(0),
            )
            .optional()?;
        json.map(|j| {
            serde_json::from_str(&j).map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))
        })
        .transpose()
    }

    /// Forgets a sandbox's envd binding (on delete).
    pub fn unbind_envd(&self, sandbox: &str) -> SecResult<()> {
        self.conn()
            .execute("DELETE FROM envd_bindings WHERE sandbox_id = ?1", [sandbox])?;
        Ok(())
    }

    /// Records an E2B envd access token of `sandbox` for `caller` (schema
    /// 14): one per sandbox and credential (the caller's token id, or E2B
    /// key id). When that credential already has one, only its caller is
    /// refreshed and its nonce is returned (the door derives the same token
    /// from it); else `nonce` and `hash` (the SHA-256 of the token derived
    /// from `nonce`) are stored and `nonce` is returned.
    pub fn issue_envd_token(
        &self,
        sandbox: &str,
        caller: &crate::caller::Caller,
        nonce: &str,
        hash: &str,
    ) -> SecResult<String> {
        let json = serde_json::to_string(caller)
            .map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))?;
        let credential = envd_credential(caller);
        let tenant = caller.tenant().unwrap_or_default().to_owned();
        let mut c = self.conn();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let held: Option<String> = tx
            .query_row(
                "SELECT nonce FROM envd_tokens WHERE sandbox_id = ?1 AND credential = ?2",
                params![sandbox, credential],
                |r| r.get(0),
            )
            .optional()?;
        let out = match held {
            Some(n) => {
                tx.execute(
                    "UPDATE envd_tokens SET caller = ?3 WHERE sandbox_id = ?1 AND credential = ?2",
                    params![sandbox, credential, json],
                )?;
                n
            }
            None => {
                tx.execute(
                    "INSERT INTO envd_tokens (token_hash, sandbox_id, tenant_id, credential, caller, nonce, created_at) \
                     VALUES (?1,?2,?3,?4,?5,?6,?7)",
                    params![hash, sandbox, tenant, credential, json, nonce, ms(Utc::now())],
                )?;
                nonce.to_owned()
            }
        };
        tx.commit()?;
        Ok(out)
    }

    /// The sandbox and caller of the stored envd token whose SHA-256 is
    /// `hash`.
    pub fn envd_token(&self, hash: &str) -> SecResult<Option<(String, crate::caller::Caller)>> {
        let row: Option<(String, String)> = self
            .conn()
            .query_row(
                "SELECT sandbox_id, caller FROM envd_tokens WHERE token_hash = ?1",
                [hash],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        row.map(|(s, j)| {
            serde_json::from_str(&j)
                .map(|c| (s, c))
                .map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))
        })
        .transpose()
    }

    /// The stored envd tokens of `sandbox`: the nonce of each and its
    /// caller, oldest first (empty: none was ever issued, or the sandbox is
    /// gone).
    pub fn envd_tokens_of(&self, sandbox: &str) -> SecResult<Vec<(String, crate::caller::Caller)>> {
        let c = self.conn();
        let mut st = c.prepare(
            "SELECT nonce, caller FROM envd_tokens WHERE sandbox_id = ?1 ORDER BY created_at, token_hash",
        )?;
        let rows = st
            .query_map([sandbox], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(n, j)| {
                serde_json::from_str(&j)
                    .map(|c| (n, c))
                    .map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))
            })
            .collect()
    }
}

/// The credential an envd token is stored under: the caller's token id
/// (`tok-…`, an E2B key id, `e2b-api-key`, `anonymous`), else its actor.
fn envd_credential(c: &crate::caller::Caller) -> String {
    match c {
        crate::caller::Caller::Api { token, .. } => token.clone(),
        other => other.actor(),
    }
}

fn store_err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

impl ApprovalStore for SecurityStore {
    fn insert(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        self.conn()
            .execute(
                "INSERT INTO approvals (id, tenant_id, created_at, status, body) VALUES (?1,?2,?3,?4,?5)",
                params![req.id, req.tenant, ms(req.created_at), status_str(&req.status), body],
            )
            .map_err(store_err)?;
        Ok(())
    }

    fn update(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        let n = self
            .conn()
            .execute(
                "UPDATE approvals SET status = ?2, body = ?3 WHERE id = ?1",
                params![req.id, status_str(&req.status), body],
            )
            .map_err(store_err)?;
        if n == 0 {
            return Err(StoreError(format!("approval {} not recorded", req.id)));
        }
        Ok(())
    }

    fn load(&self) -> Result<Vec<ApprovalRequest>, StoreError> {
        let c = self.conn();
        let mut st = c
            .prepare("SELECT body, consumed_at FROM approvals ORDER BY created_at, id")
            .map_err(store_err)?;
        let rows = st
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
            })
            .map_err(store_err)?;
        let mut out = Vec::new();
        for r in rows {
            let (body, consumed) = r.map_err(store_err)?;
            let mut req: ApprovalRequest = serde_json::from_str(&body).map_err(store_err)?;
            // Rows used before the body recorded it kept it in the column.
            if req.consumed_at.is_none() {
                req.consumed_at = consumed.map(from_ms);
            }
            out.push(req);
        }
        Ok(out)
    }

    /// Marks an approved request used, in one statement: `false` (nothing
    /// written) when it was used before, so it runs once.
    fn consume(&self, req: &ApprovalRequest) -> Result<bool, StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        let at = req.consumed_at.unwrap_or_else(Utc::now);
        let n = self
            .conn()
            .execute(
                "UPDATE approvals SET consumed_at = ?2, body = ?3 \
                 WHERE id = ?1 AND consumed_at IS NULL AND status = 'approved'",
                params![req.id, ms(at), body],
            )
            .map_err(store_err)?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use strata_policy::approval::{ApprovalQueue, ApprovalStatus, BodyDigest};
    use strata_policy::{CallKind, Decision, Effect, ToolCall};

    use super::*;
    use crate::store::SqliteStore;

    fn call() -> ToolCall {
        ToolCall {
            tenant: "acme".into(),
            sandbox: Some("sb-1".into()),
            actor: "token:tok-dev".into(),
            kind: CallKind::FileWrite {
                path: "/app/x".into(),
            },
        }
    }

    fn held() -> Decision {
        Decision {
            effect: Effect::Approve,
            layer: None,
            rule_id: "r".into(),
            rule_index: None,
            hard: false,
            reason: "why".into(),
        }
    }

    fn open() -> (tempfile::TempDir, Arc<SecurityStore>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("strata.db");
        SqliteStore::open(&path, 1).unwrap();
        let s = Arc::new(SecurityStore::open(&path).unwrap());
        (dir, s)
    }

    #[test]
    fn an_approval_is_used_once_across_queues_sharing_the_database() {
        let (_dir, store) = open();
        let body = BodyDigest::of(b"content");
        let q = ApprovalQueue::with_store(store.clone()).unwrap();
        let r = q
            .request_with(&call(), &held(), Some(body.clone()))
            .unwrap();
        q.answer("acme", &r.id, "token:tok-boss", true).unwrap();
        // A second queue on the same database (another process) loads it
        // approved and unused …
        let other = ApprovalQueue::with_store(store.clone()).unwrap();
        q.take("acme", &r.id, &call(), Some(&body)).unwrap();
        // … but the store has it used: the second take is refused.
        assert!(matches!(
            other.take("acme", &r.id, &call(), Some(&body)),
            Err(strata_policy::approval::ApprovalError::Used)
        ));
        // Reloaded, it stays used, with its digest and body.
        let again = ApprovalQueue::with_store(store).unwrap();
        let got = again.get("acme", &r.id).unwrap();
        assert!(got.consumed_at.is_some());
        assert_eq!(got.body, Some(body));
        assert!(matches!(got.status, ApprovalStatus::Approved { .. }));
    }

    #[test]
    fn rows_written_before_binding_load_bound_and_expiring() {
        let (_dir, store) = open();
        // An approved, unused request as the previous release wrote it (no
        // digest, expiry or use in its body), answered two hours ago, and
        // a used one (the use only in the column).
        let at = Utc::now() - chrono::TimeDelta::hours(2);
        let old = |id: &str| {
            serde_json::json!({
                "id": id, "tenant": "acme", "sandbox": "sb-1", "call": call(),
                "reason": "why", "rule_id": "r", "requested_by": "token:tok-dev",
                "created_at": at, "status": {"status": "approved", "by": "b", "at": at},
            })
            .to_string()
        };
        let c = store.conn();
        for (id, used) in [("old-1", None), ("old-2", Some(ms(at)))] {
            c.execute(
                "INSERT INTO approvals (id, tenant_id, created_at, status, body, consumed_at) VALUES (?1,'acme',?2,'approved',?3,?4)",
                params![id, ms(at), old(id), used],
            )
            .unwrap();
        }
        drop(c);
        let q = ApprovalQueue::with_store(store).unwrap();
        let r = q.get("acme", "old-1").unwrap();
        assert_eq!(
            r.request_sha256,
            strata_policy::approval::request_digest(&call(), None)
        );
        // Answered 2 h ago with a 1 h lifetime: expired, not usable.
        assert!(matches!(
            q.take("acme", "old-1", &call(), None),
            Err(strata_policy::approval::ApprovalError::Expired(_))
        ));
        assert!(q.get("acme", "old-2").unwrap().consumed_at.is_some());
    }
}
