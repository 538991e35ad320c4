//! Security records: API tokens, tenants, tenant and sandbox policies,
//! approval requests (the library's [`ApprovalStore`]), the audit log's
//! head, egress proxy ports, envd tokens and bindings, connector secrets.
//!
//! [`SecurityStore`] is what the daemon uses; it keeps the token cache and
//! hands every read and write to a [`SecurityBackend`]:
//!
//! - [`SqliteSecurity`]: the daemon's SQLite database. The schema is
//!   migration 2 (and 4, 14, 15) of `store::sqlite` ([`MIGRATION_V2`]);
//!   this backend keeps its own writer connection to the same file (WAL
//!   mode lets both writers take turns; every write is one short
//!   transaction).
//! - [`PgSecurity`] (`store/postgres.rs` here): PostgreSQL, when `[store]
//!   url` is PostgreSQL, so every daemon on that database sees the same
//!   tokens, policies, approvals and secrets (docs/store.md).

use std::path::Path;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};
use serde::{Deserialize, Serialize};
use strata_policy::approval::{ApprovalRequest, ApprovalStatus, ApprovalStore, StoreError};

use super::auth::Role;

mod postgres;

pub use postgres::{PgSecurity, PG_SECURITY_MIGRATIONS};

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
    /// PostgreSQL failed (out of reach, full, or it refused a statement).
    #[error("security store")]
    Pg(#[from] crate::store::StoreError),
    /// An approval request is not in the store.
    #[error("approval {0} not recorded")]
    ApprovalNotRecorded(String),
    /// An approval request was answered (or timed out) already, through
    /// another daemon sharing the database; nothing was written.
    #[error("approval {0} was answered already")]
    ApprovalAnswered(String),
    /// The audit head would move back or to another chain (another writer
    /// of the same log recorded a head this one does not continue); nothing
    /// was written.
    #[error("audit head of log {log}: {seq} {hash} does not continue the recorded {found_seq} {found_hash}")]
    AuditFork {
        /// The audit log's id.
        log: String,
        /// The head offered.
        seq: u64,
        /// Its link.
        hash: String,
        /// The head recorded.
        found_seq: u64,
        /// Its link.
        found_hash: String,
    },
}

impl SecStoreError {
    /// Whether the database is full (SQLite's or PostgreSQL's disk).
    pub fn is_full(&self) -> bool {
        match self {
            SecStoreError::Sqlite(rusqlite::Error::SqliteFailure(f, _)) => {
                f.code == rusqlite::ErrorCode::DiskFull
            }
            SecStoreError::Pg(crate::store::StoreError::Full(_)) => true,
            _ => false,
        }
    }
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

/// The security tables, on the backend the daemon's store uses.
pub struct SecurityStore {
    backend: Box<dyn SecurityBackend>,
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

/// What a backend of the security store does: the rows of the security
/// tables, read and written. Every write is one transaction. Callers
/// use [`SecurityStore`], which adds the token cache and the typed forms.
pub trait SecurityBackend: Send + Sync {
    /// Number of tokens ever made (revoked ones included).
    fn token_count(&self) -> SecResult<u64>;
    /// Records a new token (and its tenant, if new).
    fn insert_token(&self, t: &TokenRecord) -> SecResult<()>;
    /// The token whose secret hashes to `hash`, from the database.
    fn token_by_hash(&self, hash: &str) -> SecResult<Option<TokenRecord>>;
    /// One token of `tenant`.
    fn token(&self, tenant: &str, id: &str) -> SecResult<Option<TokenRecord>>;
    /// Tokens of `tenant`, oldest first.
    fn tokens(&self, tenant: &str) -> SecResult<Vec<TokenRecord>>;
    /// Marks a token revoked (the first revocation time stays); false when
    /// it does not exist for `tenant`.
    fn revoke_token(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> SecResult<bool>;
    /// A tenant's policy text.
    fn tenant_policy(&self, tenant: &str) -> SecResult<Option<String>>;
    /// Replaces a tenant's policy text.
    fn put_tenant_policy(&self, tenant: &str, toml: &str, by: &str) -> SecResult<()>;
    /// A sandbox's policy text.
    fn sandbox_policy(&self, sandbox: &str) -> SecResult<Option<String>>;
    /// Replaces a sandbox's policy text.
    fn put_sandbox_policy(
        &self,
        tenant: &str,
        sandbox: &str,
        toml: &str,
        by: &str,
    ) -> SecResult<()>;
    /// Writes a connector secret (new, or rotated keeping its creation time).
    fn put_secret(&self, r: &SecretRow) -> SecResult<()>;
    /// Connector secrets of `tenant` (every tenant's when `None`), by
    /// tenant and name.
    fn secrets(&self, tenant: Option<&str>) -> SecResult<Vec<SecretRow>>;
    /// Deletes a connector secret; false when there was none.
    fn delete_secret(&self, tenant: &str, name: &str) -> SecResult<bool>;
    /// The recorded audit head `(seq, hash)` of this daemon's audit log.
    fn audit_head(&self) -> SecResult<Option<(u64, String)>>;
    /// Records the audit head of this daemon's audit log.
    fn set_audit_head(&self, seq: u64, hash: &str) -> SecResult<()>;
    /// The egress proxy port last used for a sandbox.
    fn egress_port(&self, sandbox: &str) -> SecResult<Option<u16>>;
    /// Records the egress proxy port of a sandbox.
    fn set_egress_port(&self, tenant: &str, sandbox: &str, port: u16) -> SecResult<()>;
    /// Binds a sandbox's envd token to a caller (JSON).
    fn bind_envd(&self, sandbox: &str, caller_json: &str) -> SecResult<()>;
    /// The caller (JSON) a sandbox's envd token was bound to.
    fn envd_binding(&self, sandbox: &str) -> SecResult<Option<String>>;
    /// Forgets a sandbox's envd binding.
    fn unbind_envd(&self, sandbox: &str) -> SecResult<()>;
    /// Stores an envd token of (`sandbox`, `credential`) unless one is held
    /// (then only its caller is refreshed); returns the nonce in force.
    fn issue_envd_token(&self, t: &EnvdTokenRow<'_>) -> SecResult<String>;
    /// The sandbox and caller (JSON) of the envd token hashing to `hash`.
    fn envd_token(&self, hash: &str) -> SecResult<Option<(String, String)>>;
    /// Nonce and caller (JSON) of every envd token of `sandbox`, oldest first.
    fn envd_tokens_of(&self, sandbox: &str) -> SecResult<Vec<(String, String)>>;
    /// Records a new approval request (`body` is its JSON).
    fn approval_insert(&self, req: &ApprovalRequest, body: &str) -> SecResult<()>;
    /// Records a status change of a request.
    fn approval_update(&self, req: &ApprovalRequest, body: &str) -> SecResult<()>;
    /// Every request: its JSON body and the `consumed_at` column (ms).
    fn approval_load(&self) -> SecResult<Vec<(String, Option<i64>)>>;
    /// Request `id`: its JSON body and `consumed_at` column (ms).
    fn approval_get(&self, id: &str) -> SecResult<Option<(String, Option<i64>)>>;
    /// The requests of `tenant`, as [`Self::approval_load`].
    fn approval_load_tenant(&self, tenant: &str) -> SecResult<Vec<(String, Option<i64>)>>;
    /// Marks an approved, unused request used; false when it was used.
    fn approval_consume(&self, id: &str, at: DateTime<Utc>, body: &str) -> SecResult<bool>;
}

/// An envd token to store ([`SecurityBackend::issue_envd_token`]).
#[derive(Debug)]
pub struct EnvdTokenRow<'a> {
    /// The sandbox.
    pub sandbox: &'a str,
    /// Its tenant.
    pub tenant: &'a str,
    /// The credential it was issued for (token id, key id, actor).
    pub credential: &'a str,
    /// The caller, as JSON.
    pub caller: &'a str,
    /// The nonce the token derives from.
    pub nonce: &'a str,
    /// SHA-256 of the token.
    pub hash: &'a str,
}

/// The security tables in the daemon's SQLite file.
pub struct SqliteSecurity {
    conn: Mutex<Connection>,
}

impl std::fmt::Debug for SqliteSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteSecurity").finish_non_exhaustive()
    }
}

impl SqliteSecurity {
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
        Ok(SqliteSecurity {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic mid-call rolls its transaction back; the connection is fine.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl SecurityBackend for SqliteSecurity {
    fn token_count(&self) -> SecResult<u64> {
        let n: i64 = self
            .conn()
            .query_row("SELECT COUNT(*) FROM api_tokens", [], |r| r.get(0))?;
        Ok(n.max(0) as u64)
    }

    fn insert_token(&self, t: &TokenRecord) -> SecResult<()> {
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

    fn token_by_hash(&self, hash: &str) -> SecResult<Option<TokenRecord>> {
        self.conn()
            .query_row(
                &format!("SELECT {TOKEN_COLS} FROM api_tokens WHERE hash = ?1"),
                [hash],
                token_row,
            )
            .optional()?
            .map(token_record)
            .transpose()
    }

    fn token(&self, tenant: &str, id: &str) -> SecResult<Option<TokenRecord>> {
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

    fn tokens(&self, tenant: &str) -> SecResult<Vec<TokenRecord>> {
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

    fn revoke_token(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> SecResult<bool> {
        let n = self.conn().execute(
            "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, ?3) WHERE id = ?1 AND tenant_id = ?2",
            params![id, tenant, ms(at)],
        )?;
        Ok(n > 0)
    }

    fn tenant_policy(&self, tenant: &str) -> SecResult<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT toml FROM tenant_policies WHERE tenant_id = ?1",
                [tenant],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn put_tenant_policy(&self, tenant: &str, toml: &str, by: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO tenant_policies (tenant_id, toml, updated_at, updated_by) VALUES (?1,?2,?3,?4)",
            params![tenant, toml, ms(Utc::now()), by],
        )?;
        Ok(())
    }

    fn sandbox_policy(&self, sandbox: &str) -> SecResult<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT toml FROM sandbox_policies WHERE sandbox_id = ?1",
                [sandbox],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn put_sandbox_policy(
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

    fn put_secret(&self, r: &SecretRow) -> SecResult<()> {
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

    fn secrets(&self, tenant: Option<&str>) -> SecResult<Vec<SecretRow>> {
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

    fn delete_secret(&self, tenant: &str, name: &str) -> SecResult<bool> {
        let n = self.conn().execute(
            "DELETE FROM connector_secrets WHERE tenant_id = ?1 AND name = ?2",
            [tenant, name],
        )?;
        Ok(n > 0)
    }

    fn audit_head(&self) -> SecResult<Option<(u64, String)>> {
        Ok(self
            .conn()
            .query_row("SELECT seq, hash FROM audit_head WHERE id = 1", [], |r| {
                Ok((r.get::<_, i64>(0)?.max(0) as u64, r.get(1)?))
            })
            .optional()?)
    }

    fn set_audit_head(&self, seq: u64, hash: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO audit_head (id, seq, hash, updated_at) VALUES (1, ?1, ?2, ?3)",
            params![i64::try_from(seq).unwrap_or(i64::MAX), hash, ms(Utc::now())],
        )?;
        Ok(())
    }

    fn egress_port(&self, sandbox: &str) -> SecResult<Option<u16>> {
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

    fn set_egress_port(&self, tenant: &str, sandbox: &str, port: u16) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO egress_ports (sandbox_id, tenant_id, port) VALUES (?1,?2,?3)",
            params![sandbox, tenant, i64::from(port)],
        )?;
        Ok(())
    }

    fn bind_envd(&self, sandbox: &str, caller_json: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT OR REPLACE INTO envd_bindings (sandbox_id, caller, updated_at) VALUES (?1,?2,?3)",
            params![sandbox, caller_json, Utc::now().timestamp_millis()],
        )?;
        Ok(())
    }

    fn envd_binding(&self, sandbox: &str) -> SecResult<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT caller FROM envd_bindings WHERE sandbox_id = ?1",
                [sandbox],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn unbind_envd(&self, sandbox: &str) -> SecResult<()> {
        self.conn()
            .execute("DELETE FROM envd_bindings WHERE sandbox_id = ?1", [sandbox])?;
        Ok(())
    }

    fn issue_envd_token(&self, t: &EnvdTokenRow<'_>) -> SecResult<String> {
        let mut c = self.conn();
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let held: Option<String> = tx
            .query_row(
                "SELECT nonce FROM envd_tokens WHERE sandbox_id = ?1 AND credential = ?2",
                params![t.sandbox, t.credential],
                |r| r.get(0),
            )
            .optional()?;
        let out = match held {
            Some(n) => {
                tx.execute(
                    "UPDATE envd_tokens SET caller = ?3 WHERE sandbox_id = ?1 AND credential = ?2",
                    params![t.sandbox, t.credential, t.caller],
                )?;
                n
            }
            None => {
                tx.execute(
                    "INSERT INTO envd_tokens (token_hash, sandbox_id, tenant_id, credential, caller, nonce, created_at) \
                     VALUES (?1,?2,?3,?4,?5,?6,?7)",
                    params![t.hash, t.sandbox, t.tenant, t.credential, t.caller, t.nonce, ms(Utc::now())],
                )?;
                t.nonce.to_owned()
            }
        };
        tx.commit()?;
        Ok(out)
    }

    fn envd_token(&self, hash: &str) -> SecResult<Option<(String, String)>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT sandbox_id, caller FROM envd_tokens WHERE token_hash = ?1",
                [hash],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    fn envd_tokens_of(&self, sandbox: &str) -> SecResult<Vec<(String, String)>> {
        let c = self.conn();
        let mut st = c.prepare(
            "SELECT nonce, caller FROM envd_tokens WHERE sandbox_id = ?1 ORDER BY created_at, token_hash",
        )?;
        let rows = st
            .query_map([sandbox], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    fn approval_insert(&self, req: &ApprovalRequest, body: &str) -> SecResult<()> {
        self.conn().execute(
            "INSERT INTO approvals (id, tenant_id, created_at, status, body) VALUES (?1,?2,?3,?4,?5)",
            params![req.id, req.tenant, ms(req.created_at), status_str(&req.status), body],
        )?;
        Ok(())
    }

    fn approval_update(&self, req: &ApprovalRequest, body: &str) -> SecResult<()> {
        let n = self.conn().execute(
            "UPDATE approvals SET status = ?2, body = ?3 WHERE id = ?1",
            params![req.id, status_str(&req.status), body],
        )?;
        if n == 0 {
            return Err(SecStoreError::ApprovalNotRecorded(req.id.clone()));
        }
        Ok(())
    }

    fn approval_load(&self) -> SecResult<Vec<(String, Option<i64>)>> {
        let c = self.conn();
        let mut st =
            c.prepare("SELECT body, consumed_at FROM approvals ORDER BY created_at, id")?;
        let rows = st
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    fn approval_load_tenant(&self, tenant: &str) -> SecResult<Vec<(String, Option<i64>)>> {
        let c = self.conn();
        let mut st = c.prepare(
            "SELECT body, consumed_at FROM approvals WHERE tenant_id = ?1 ORDER BY created_at, id",
        )?;
        let rows = st
            .query_map([tenant], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    fn approval_get(&self, id: &str) -> SecResult<Option<(String, Option<i64>)>> {
        let c = self.conn();
        let mut st = c.prepare("SELECT body, consumed_at FROM approvals WHERE id = ?1")?;
        let mut rows = st.query_map([id], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, Option<i64>>(1)?))
        })?;
        Ok(rows.next().transpose()?)
    }

    fn approval_consume(&self, id: &str, at: DateTime<Utc>, body: &str) -> SecResult<bool> {
        let n = self.conn().execute(
            "UPDATE approvals SET consumed_at = ?2, body = ?3 \
             WHERE id = ?1 AND consumed_at IS NULL AND status = 'approved'",
            params![id, ms(at), body],
        )?;
        Ok(n > 0)
    }
}

fn caller_json(caller: &crate::caller::Caller) -> SecResult<String> {
    serde_json::to_string(caller).map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))
}

fn caller_of(json: &str) -> SecResult<crate::caller::Caller> {
    serde_json::from_str(json).map_err(|e| SecStoreError::Corrupt(format!("caller: {e}")))
}

impl SecurityStore {
    /// Opens the security tables of the SQLite database at `path`; it must
    /// carry schema version 2 or later (the main store migrates it when it
    /// opens).
    pub fn open(path: &Path) -> SecResult<Self> {
        Ok(Self::with_backend(Box::new(SqliteSecurity::open(path)?)))
    }

    /// The security store over `backend`.
    pub fn with_backend(backend: Box<dyn SecurityBackend>) -> Self {
        SecurityStore {
            backend,
            token_cache: Mutex::new(TokenCache::default()),
        }
    }

    /// Number of tokens ever made (revoked ones included).
    pub fn token_count(&self) -> SecResult<u64> {
        self.backend.token_count()
    }

    /// Records a new token (and its tenant, if new).
    pub fn insert_token(&self, t: &TokenRecord) -> SecResult<()> {
        self.backend.insert_token(t)
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
        let found = self.backend.token_by_hash(hash)?;
        if let Some(t) = &found {
            self.tokens_cached().put(hash, t);
        }
        Ok(found)
    }

    /// One token of `tenant`.
    pub fn token(&self, tenant: &str, id: &str) -> SecResult<Option<TokenRecord>> {
        self.backend.token(tenant, id)
    }

    /// Tokens of `tenant`, oldest first.
    pub fn tokens(&self, tenant: &str) -> SecResult<Vec<TokenRecord>> {
        self.backend.tokens(tenant)
    }

    /// Marks a token revoked; false when it does not exist for `tenant`.
    pub fn revoke_token(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> SecResult<bool> {
        let found = self.backend.revoke_token(tenant, id, at)?;
        // Before the answer: the revoked token's next request is refused.
        self.tokens_cached().forget(tenant, id);
        Ok(found)
    }

    /// Every tenant's policy text.
    pub fn tenant_policy(&self, tenant: &str) -> SecResult<Option<String>> {
        self.backend.tenant_policy(tenant)
    }

    /// Replaces a tenant's policy text.
    pub fn put_tenant_policy(&self, tenant: &str, toml: &str, by: &str) -> SecResult<()> {
        self.backend.put_tenant_policy(tenant, toml, by)
    }

    /// A sandbox's policy text.
    pub fn sandbox_policy(&self, sandbox: &str) -> SecResult<Option<String>> {
        self.backend.sandbox_policy(sandbox)
    }

    /// Replaces a sandbox's policy text.
    pub fn put_sandbox_policy(
        &self,
        tenant: &str,
        sandbox: &str,
        toml: &str,
        by: &str,
    ) -> SecResult<()> {
        self.backend.put_sandbox_policy(tenant, sandbox, toml, by)
    }

    /// Writes a connector secret (a new one, or a rotation keeping its
    /// creation time).
    pub fn put_secret(&self, r: &SecretRow) -> SecResult<()> {
        self.backend.put_secret(r)
    }

    /// Connector secrets of `tenant` (every tenant's when `None`), by name.
    pub fn secrets(&self, tenant: Option<&str>) -> SecResult<Vec<SecretRow>> {
        self.backend.secrets(tenant)
    }

    /// Deletes a connector secret; false when `tenant` has none of that name.
    pub fn delete_secret(&self, tenant: &str, name: &str) -> SecResult<bool> {
        self.backend.delete_secret(tenant, name)
    }

    /// The recorded audit head `(seq, hash)`.
    pub fn audit_head(&self) -> SecResult<Option<(u64, String)>> {
        self.backend.audit_head()
    }

    /// Records the audit head.
    pub fn set_audit_head(&self, seq: u64, hash: &str) -> SecResult<()> {
        self.backend.set_audit_head(seq, hash)
    }

    /// The egress proxy port last used for a sandbox.
    pub fn egress_port(&self, sandbox: &str) -> SecResult<Option<u16>> {
        self.backend.egress_port(sandbox)
    }

    /// Records the egress proxy port of a sandbox.
    pub fn set_egress_port(&self, tenant: &str, sandbox: &str, port: u16) -> SecResult<()> {
        self.backend.set_egress_port(tenant, sandbox, port)
    }

    /// Binds a sandbox's E2B envd access token to the caller it was handed
    /// to (schema 4): envd calls then act as that caller, across restarts.
    pub fn bind_envd(&self, sandbox: &str, caller: &crate::caller::Caller) -> SecResult<()> {
        self.backend.bind_envd(sandbox, &caller_json(caller)?)
    }

    /// The caller a sandbox's envd token was handed to, if recorded.
    pub fn envd_binding(&self, sandbox: &str) -> SecResult<Option<crate::caller::Caller>> {
        self.backend
            .envd_binding(sandbox)?
            .map(|j| caller_of(&j))
            .transpose()
    }

    /// Forgets a sandbox's envd binding (on delete).
    pub fn unbind_envd(&self, sandbox: &str) -> SecResult<()> {
        self.backend.unbind_envd(sandbox)
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
        let json = caller_json(caller)?;
        let credential = envd_credential(caller);
        let tenant = caller.tenant().unwrap_or_default().to_owned();
        self.backend.issue_envd_token(&EnvdTokenRow {
            sandbox,
            tenant: &tenant,
            credential: &credential,
            caller: &json,
            nonce,
            hash,
        })
    }

    /// The sandbox and caller of the stored envd token whose SHA-256 is
    /// `hash`.
    pub fn envd_token(&self, hash: &str) -> SecResult<Option<(String, crate::caller::Caller)>> {
        self.backend
            .envd_token(hash)?
            .map(|(s, j)| caller_of(&j).map(|c| (s, c)))
            .transpose()
    }

    /// The stored envd tokens of `sandbox`: the nonce of each and its
    /// caller, oldest first (empty: none was ever issued, or the sandbox is
    /// gone).
    pub fn envd_tokens_of(&self, sandbox: &str) -> SecResult<Vec<(String, crate::caller::Caller)>> {
        self.backend
            .envd_tokens_of(sandbox)?
            .into_iter()
            .map(|(n, j)| caller_of(&j).map(|c| (n, c)))
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

fn store_err_chain(e: SecStoreError) -> StoreError {
    StoreError(strata_runtime::error::chain(&e))
}

/// An approval request from its stored JSON and `consumed_at` column.
fn approval_row((body, consumed): (String, Option<i64>)) -> Result<ApprovalRequest, StoreError> {
    let mut req: ApprovalRequest = serde_json::from_str(&body).map_err(store_err)?;
    // Rows used before the body recorded it kept it in the column.
    if req.consumed_at.is_none() {
        req.consumed_at = consumed.map(from_ms);
    }
    Ok(req)
}

impl ApprovalStore for SecurityStore {
    fn insert(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        self.backend
            .approval_insert(req, &body)
            .map_err(store_err_chain)
    }

    fn update(&self, req: &ApprovalRequest) -> Result<(), StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        self.backend
            .approval_update(req, &body)
            .map_err(store_err_chain)
    }

    fn load(&self) -> Result<Vec<ApprovalRequest>, StoreError> {
        self.backend
            .approval_load()
            .map_err(store_err_chain)?
            .into_iter()
            .map(approval_row)
            .collect()
    }

    fn load_tenant(&self, tenant: &str) -> Result<Vec<ApprovalRequest>, StoreError> {
        self.backend
            .approval_load_tenant(tenant)
            .map_err(store_err_chain)?
            .into_iter()
            .map(approval_row)
            .collect()
    }

    fn load_one(&self, id: &str) -> Result<Option<ApprovalRequest>, StoreError> {
        self.backend
            .approval_get(id)
            .map_err(store_err_chain)?
            .map(approval_row)
            .transpose()
    }

    /// Marks an approved request used, in one statement: `false` (nothing
    /// written) when it was used before, so it runs once.
    fn consume(&self, req: &ApprovalRequest) -> Result<bool, StoreError> {
        let body = serde_json::to_string(req).map_err(store_err)?;
        let at = req.consumed_at.unwrap_or_else(Utc::now);
        self.backend
            .approval_consume(&req.id, at, &body)
            .map_err(store_err_chain)
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

    use crate::store::tests::TestDb;

    /// A security store on `db` (a daemon's handle; PostgreSQL: of the
    /// audit log `log`), with the main store migrated first, as at start.
    fn open_on(db: &TestDb, log: &str) -> Arc<SecurityStore> {
        match db {
            TestDb::Sqlite(dir) => {
                let path = dir.path().join("strata.db");
                SqliteStore::open(&path, 1).unwrap();
                Arc::new(SecurityStore::open(&path).unwrap())
            }
            TestDb::Postgres { .. } => Arc::new(SecurityStore::with_backend(Box::new(
                PgSecurity::open(&db.pg_options().unwrap(), log).unwrap(),
            ))),
        }
    }

    fn token(id: &str, tenant: &str, hash: &str) -> TokenRecord {
        TokenRecord {
            id: id.into(),
            tenant: tenant.into(),
            role: Role::Developer,
            name: Some("ci".into()),
            created_at: DateTime::from_timestamp_millis(1_700_000_000_123).unwrap(),
            created_by: Some("bootstrap".into()),
            expires_at: None,
            revoked_at: None,
            hash: hash.into(),
        }
    }

    /// Each test once per backend, as `store::tests`: `<backend>::<test>`.
    macro_rules! on_every_backend {
        ($($name:ident),* $(,)?) => {
            mod sqlite_backend {
                $(
                    #[test]
                    fn $name() {
                        super::$name(&super::TestDb::sqlite());
                    }
                )*
            }
            mod postgres_backend {
                $(
                    #[test]
                    fn $name() {
                        if let Some(db) = super::TestDb::postgres(stringify!($name)) {
                            super::$name(&db);
                        }
                    }
                )*
            }
        };
    }

    on_every_backend!(
        tokens_round_trip_and_revoke_once,
        policies_replace,
        secrets_rotate_keep_creation_and_delete,
        audit_head_survives_reopen,
        egress_ports_and_envd_records,
        envd_tokens_go_with_their_deleted_sandbox,
        approval_used_once_across_queues,
        an_answer_through_one_queue_wakes_the_other_queues_waiter,
    );

    fn tokens_round_trip_and_revoke_once(db: &TestDb) {
        let s = open_on(db, "log-a");
        assert_eq!(s.token_count().unwrap(), 0);
        let a = token("tok-a", "acme", "h-a");
        let mut b = token("tok-b", "acme", "h-b");
        b.created_at += chrono::TimeDelta::seconds(1);
        b.role = Role::Admin;
        b.expires_at = Some(b.created_at + chrono::TimeDelta::days(1));
        s.insert_token(&a).unwrap();
        s.insert_token(&b).unwrap();
        s.insert_token(&token("tok-c", "other", "h-c")).unwrap();
        // The same hash twice is refused.
        assert!(s.insert_token(&token("tok-d", "acme", "h-a")).is_err());
        assert_eq!(s.token_count().unwrap(), 3);
        assert_eq!(s.token_by_hash("h-b").unwrap(), Some(b.clone()));
        assert_eq!(s.token_by_hash("nope").unwrap(), None);
        assert_eq!(s.token("acme", "tok-a").unwrap(), Some(a.clone()));
        assert_eq!(s.token("other", "tok-a").unwrap(), None);
        assert_eq!(s.tokens("acme").unwrap(), vec![a.clone(), b]);
        let t1 = DateTime::from_timestamp_millis(1_800_000_000_000).unwrap();
        assert!(s.revoke_token("acme", "tok-a", t1).unwrap());
        assert!(s
            .revoke_token("acme", "tok-a", t1 + chrono::TimeDelta::hours(1))
            .unwrap());
        assert!(!s.revoke_token("other", "tok-a", t1).unwrap());
        // The first revocation stays; the cache forgot the token.
        assert_eq!(
            s.token_by_hash("h-a").unwrap().unwrap().revoked_at,
            Some(t1)
        );
    }

    fn policies_replace(db: &TestDb) {
        let s = open_on(db, "log-a");
        assert_eq!(s.tenant_policy("acme").unwrap(), None);
        s.put_tenant_policy("acme", "default = \"deny\"\n", "tok-a")
            .unwrap();
        s.put_tenant_policy("acme", "default = \"allow\"\n", "tok-a")
            .unwrap();
        assert_eq!(
            s.tenant_policy("acme").unwrap().as_deref(),
            Some("default = \"allow\"\n")
        );
        assert_eq!(s.sandbox_policy("sb-1").unwrap(), None);
        s.put_sandbox_policy("acme", "sb-1", "a", "tok-a").unwrap();
        s.put_sandbox_policy("acme", "sb-1", "b", "tok-a").unwrap();
        assert_eq!(s.sandbox_policy("sb-1").unwrap().as_deref(), Some("b"));
    }

    fn secret(tenant: &str, name: &str, sealed: &str, at: i64) -> SecretRow {
        SecretRow {
            tenant: tenant.into(),
            name: name.into(),
            connector: "github".into(),
            kind: "static".into(),
            rule: "{}".into(),
            sealed: sealed.into(),
            created_at: from_ms(at),
            updated_at: from_ms(at),
            updated_by: Some("tok-a".into()),
        }
    }

    fn secrets_rotate_keep_creation_and_delete(db: &TestDb) {
        let s = open_on(db, "log-a");
        s.put_secret(&secret("acme", "gh", "sealed:v1:one", 1000))
            .unwrap();
        s.put_secret(&secret("acme", "aa", "sealed:v1:x", 1500))
            .unwrap();
        s.put_secret(&secret("zeta", "gh", "sealed:v1:z", 1600))
            .unwrap();
        // A rotation: the creation time of the first write stays.
        let mut rot = secret("acme", "gh", "sealed:v1:two", 2000);
        rot.created_at = from_ms(2000);
        s.put_secret(&rot).unwrap();
        let acme = s.secrets(Some("acme")).unwrap();
        let names: Vec<_> = acme.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["aa", "gh"]);
        assert_eq!(acme[1].sealed, "sealed:v1:two");
        assert_eq!(acme[1].created_at, from_ms(1000));
        assert_eq!(acme[1].updated_at, from_ms(2000));
        assert_eq!(s.secrets(None).unwrap().len(), 3);
        assert!(s.delete_secret("acme", "gh").unwrap());
        assert!(!s.delete_secret("acme", "gh").unwrap());
        assert_eq!(s.secrets(Some("acme")).unwrap().len(), 1);
    }

    fn audit_head_survives_reopen(db: &TestDb) {
        let s = open_on(db, "log-a");
        assert_eq!(s.audit_head().unwrap(), None);
        s.set_audit_head(1, "h1").unwrap();
        s.set_audit_head(2, "h2").unwrap();
        drop(s);
        let s = open_on(db, "log-a");
        assert_eq!(s.audit_head().unwrap(), Some((2, "h2".into())));
        s.set_audit_head(3, "h3").unwrap();
        assert_eq!(s.audit_head().unwrap(), Some((3, "h3".into())));
    }

    fn egress_ports_and_envd_records(db: &TestDb) {
        let s = open_on(db, "log-a");
        assert_eq!(s.egress_port("sb-1").unwrap(), None);
        s.set_egress_port("acme", "sb-1", 40001).unwrap();
        s.set_egress_port("acme", "sb-1", 40002).unwrap();
        assert_eq!(s.egress_port("sb-1").unwrap(), Some(40002));
        let who = crate::caller::Caller::Api {
            token: "tok-a".into(),
            tenant: "acme".into(),
            actor: "token:tok-a".into(),
            role: Role::Developer,
            name: None,
        };
        assert!(s.envd_binding("sb-1").unwrap().is_none());
        s.bind_envd("sb-1", &who).unwrap();
        assert!(s.envd_binding("sb-1").unwrap().is_some());
        s.unbind_envd("sb-1").unwrap();
        assert!(s.envd_binding("sb-1").unwrap().is_none());
        // One token per sandbox and credential: a second issue keeps the
        // first nonce.
        assert_eq!(s.issue_envd_token("sb-1", &who, "n1", "th1").unwrap(), "n1");
        assert_eq!(s.issue_envd_token("sb-1", &who, "n2", "th2").unwrap(), "n1");
        assert_eq!(s.envd_token("th1").unwrap().unwrap().0, "sb-1");
        assert!(s.envd_token("th2").unwrap().is_none());
        let all = s.envd_tokens_of("sb-1").unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].0, "n1");
    }

    fn envd_tokens_go_with_their_deleted_sandbox(db: &TestDb) {
        let main = db.open();
        let s = open_on(db, "log-a");
        let mut rec = crate::store::tests::sandbox(1, strata_core::SandboxState::Running);
        main.insert_sandbox(&rec, &crate::store::tests::created(&rec))
            .unwrap();
        let who = crate::caller::Caller::Api {
            token: "tok-a".into(),
            tenant: "acme".into(),
            actor: "token:tok-a".into(),
            role: Role::Developer,
            name: None,
        };
        let id = rec.id.to_string();
        s.issue_envd_token(&id, &who, "n1", "th1").unwrap();
        s.issue_envd_token("sb-other", &who, "n2", "th2").unwrap();
        rec.state = strata_core::SandboxState::Paused;
        main.update_sandbox(&rec, None).unwrap();
        assert_eq!(s.envd_tokens_of(&id).unwrap().len(), 1);
        rec.version += 1;
        rec.state = strata_core::SandboxState::Deleted;
        main.update_sandbox(&rec, None).unwrap();
        assert!(s.envd_tokens_of(&id).unwrap().is_empty());
        assert!(s.envd_token("th1").unwrap().is_none());
        assert_eq!(s.envd_tokens_of("sb-other").unwrap().len(), 1);
    }

    fn approval_used_once_across_queues(db: &TestDb) {
        let store = open_on(db, "log-a");
        let body = BodyDigest::of(b"content");
        let q = ApprovalQueue::with_store(store.clone()).unwrap();
        let r = q
            .request_with(&call(), &held(), Some(body.clone()))
            .unwrap();
        q.answer("acme", &r.id, "token:tok-boss", true).unwrap();
        let other = ApprovalQueue::with_store(open_on(db, "log-b")).unwrap();
        q.take("acme", &r.id, &call(), Some(&body)).unwrap();
        assert!(matches!(
            other.take("acme", &r.id, &call(), Some(&body)),
            Err(strata_policy::approval::ApprovalError::Used)
        ));
        let got = ApprovalQueue::with_store(store)
            .unwrap()
            .get("acme", &r.id)
            .unwrap();
        assert!(got.consumed_at.is_some());
        assert_eq!(got.body, Some(body));
    }

    /// A call held by one process, answered through another sharing the
    /// store: the holder learns the answer by [`ApprovalQueue::sync`] (the
    /// gate's poll in a cluster), its waiter runs the call once; a queue
    /// opened before the request learns it by `sync_tenant` (a listing).
    fn an_answer_through_one_queue_wakes_the_other_queues_waiter(db: &TestDb) {
        let holder = Arc::new(ApprovalQueue::with_store(open_on(db, "log-a")).unwrap());
        let other = ApprovalQueue::with_store(open_on(db, "log-b")).unwrap();
        let r = holder.request_with(&call(), &held(), None).unwrap();
        assert!(matches!(
            other.get("acme", &r.id),
            Err(strata_policy::approval::ApprovalError::NotFound)
        ));
        other.sync_tenant("other-tenant").unwrap();
        assert!(other.list("acme", true).is_empty());
        other.sync_tenant("acme").unwrap();
        assert_eq!(other.list("acme", true).len(), 1);
        other.answer("acme", &r.id, "token:tok-boss", true).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let got = rt.block_on(async {
            let h = holder.clone();
            let id = r.id.clone();
            let waiter = tokio::spawn(async move {
                h.wait("acme", &id, std::time::Duration::from_secs(5)).await
            });
            tokio::task::yield_now().await;
            assert!(!holder.sync(&r.id).unwrap(), "answered");
            waiter.await.unwrap()
        });
        assert!(got.unwrap().is_approved());
        // Used once: the other queue learns it too.
        other.sync(&r.id).unwrap();
        assert!(other.get("acme", &r.id).unwrap().consumed_at.is_some());
    }

    /// Two daemons on one PostgreSQL: two handles (pools, runtimes) on one
    /// database, as two `stratad`s would have.
    mod two_daemons {
        use super::*;

        fn pg(test: &str) -> Option<TestDb> {
            TestDb::postgres(test)
        }

        #[test]
        fn a_token_made_through_one_authenticates_through_the_other() {
            let Some(db) = pg("a_token_made_through_one_authenticates_through_the_other") else {
                return;
            };
            let a = open_on(&db, "log-a");
            let b = open_on(&db, "log-b");
            a.insert_token(&token("tok-a", "acme", "h-a")).unwrap();
            let found = b.token_by_hash("h-a").unwrap().unwrap();
            assert_eq!(found.id, "tok-a");
            assert_eq!(b.token_count().unwrap(), 1);
            a.put_tenant_policy("acme", "default = \"deny\"\n", "tok-a")
                .unwrap();
            assert!(b.tenant_policy("acme").unwrap().is_some());
            a.put_secret(&secret("acme", "gh", "sealed:v1:one", 1000))
                .unwrap();
            assert_eq!(b.secrets(Some("acme")).unwrap().len(), 1);
            // Revoked through one: a handle that has not cached it sees it
            // revoked at once (one that has, within TOKEN_CACHE_TTL).
            a.revoke_token("acme", "tok-a", Utc::now()).unwrap();
            let c = open_on(&db, "log-c");
            assert!(c
                .token_by_hash("h-a")
                .unwrap()
                .unwrap()
                .revoked_at
                .is_some());
        }

        #[test]
        fn an_approval_answered_through_one_cannot_be_answered_through_the_other() {
            let Some(db) =
                pg("an_approval_answered_through_one_cannot_be_answered_through_the_other")
            else {
                return;
            };
            let qa = ApprovalQueue::with_store(open_on(&db, "log-a")).unwrap();
            let r = qa.request_with(&call(), &held(), None).unwrap();
            // The other daemon knows the pending request (it loaded it).
            let qb = ApprovalQueue::with_store(open_on(&db, "log-b")).unwrap();
            qa.answer("acme", &r.id, "token:tok-boss", true).unwrap();
            let err = qb
                .answer("acme", &r.id, "token:tok-other", false)
                .unwrap_err();
            assert!(
                err.to_string().contains("answered") || format!("{err:?}").contains("answered"),
                "{err:?}"
            );
            // The store keeps the first answer; it is used once.
            let qc = ApprovalQueue::with_store(open_on(&db, "log-c")).unwrap();
            let got = qc.get("acme", &r.id).unwrap();
            assert!(
                matches!(got.status, ApprovalStatus::Approved { .. }),
                "{got:?}"
            );
            qc.take("acme", &r.id, &call(), None).unwrap();
            assert!(qa.take("acme", &r.id, &call(), None).is_err());
        }

        #[test]
        fn one_audit_log_has_one_head_whoever_writes_it() {
            let Some(db) = pg("one_audit_log_has_one_head_whoever_writes_it") else {
                return;
            };
            // Two handles of the same log (a copied data dir): the second
            // cannot record a head that does not continue the first's.
            let a = open_on(&db, "log-same");
            let b = open_on(&db, "log-same");
            assert_eq!(a.audit_head().unwrap(), None);
            assert_eq!(b.audit_head().unwrap(), None);
            a.set_audit_head(1, "a1").unwrap();
            assert!(matches!(
                b.set_audit_head(1, "b1"),
                Err(SecStoreError::AuditFork { found_seq: 1, .. })
            ));
            a.set_audit_head(2, "a2").unwrap();
            assert!(b.set_audit_head(3, "b3").is_err());
            assert_eq!(b.audit_head().unwrap(), Some((2, "a2".into())));
            // Concurrent appenders, each advancing from the head it read:
            // every accepted seq is taken once, the head never forks.
            let handles: Vec<_> = (0..3).map(|_| open_on(&db, "log-same")).collect();
            let accepted: Vec<Vec<u64>> = std::thread::scope(|sc| {
                let js: Vec<_> = handles
                    .iter()
                    .enumerate()
                    .map(|(i, h)| {
                        sc.spawn(move || {
                            let mut mine = Vec::new();
                            for _ in 0..40 {
                                let (seq, _) = h.audit_head().unwrap().unwrap();
                                match h.set_audit_head(seq + 1, &format!("w{i}-{}", seq + 1)) {
                                    Ok(()) => mine.push(seq + 1),
                                    Err(SecStoreError::AuditFork { .. }) => {}
                                    Err(e) => panic!("{e:?}"),
                                }
                            }
                            mine
                        })
                    })
                    .collect();
                js.into_iter().map(|j| j.join().unwrap()).collect()
            });
            let mut all: Vec<u64> = accepted.concat();
            all.sort_unstable();
            let n = all.len() as u64;
            assert!(n >= 40, "{n}");
            assert_eq!(all, (3..3 + n).collect::<Vec<_>>());
            let (seq, hash) = a.audit_head().unwrap().unwrap();
            assert_eq!(seq, 2 + n);
            let writer = accepted.iter().position(|v| v.contains(&seq)).unwrap();
            assert_eq!(hash, format!("w{writer}-{seq}"));
        }

        #[test]
        fn two_daemons_audit_logs_append_concurrently_and_each_verifies() {
            let Some(db) = pg("two_daemons_audit_logs_append_concurrently_and_each_verifies")
            else {
                return;
            };
            use strata_policy::audit::{AuditDecision, AuditLog, Outcome};
            let dir = tempfile::tempdir().unwrap();
            let daemons: Vec<(AuditLog, Arc<SecurityStore>, String)> = ["a", "b"]
                .iter()
                .map(|n| {
                    let log =
                        crate::security::audit_log_id(&dir.path().join(n)).unwrap_or_else(|_| {
                            std::fs::create_dir_all(dir.path().join(n)).unwrap();
                            crate::security::audit_log_id(&dir.path().join(n)).unwrap()
                        });
                    let store = open_on(&db, &log);
                    assert_eq!(store.audit_head().unwrap(), None);
                    let audit = AuditLog::open(&dir.path().join(format!("{n}.jsonl"))).unwrap();
                    let st = store.clone();
                    audit.set_head_sink(Box::new(move |seq, hash| {
                        st.set_audit_head(seq, hash).map_err(|e| e.to_string())
                    }));
                    (audit, store, log)
                })
                .collect();
            assert_ne!(daemons[0].2, daemons[1].2);
            std::thread::scope(|sc| {
                for (audit, _, _) in &daemons {
                    sc.spawn(move || {
                        for _ in 0..60 {
                            audit
                                .append(
                                    &call(),
                                    AuditDecision::from_decision(&held(), Outcome::Allowed, None),
                                    None,
                                )
                                .unwrap();
                        }
                    });
                }
            });
            for (audit, _, log) in &daemons {
                // A fresh handle (a restart) reads this log's head.
                let head = open_on(&db, log).audit_head().unwrap().unwrap();
                assert_eq!(head.0, 60);
                assert_eq!(head, audit.head());
                audit.verify(Some((head.0, &head.1))).unwrap();
            }
            // Each log is checked against its own head, not the other's.
            let other = daemons[1].1.audit_head().unwrap().unwrap();
            assert!(daemons[0].0.verify(Some((other.0, &other.1))).is_err());
        }
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
        let (dir, store) = open();
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
        let c = Connection::open(dir.path().join("strata.db")).unwrap();
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
