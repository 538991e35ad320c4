//! The security store on PostgreSQL: the same tables as SQLite's security
//! migrations, in the `[store]` database and schema, so every daemon on
//! that database sees the same tokens, policies, approvals, envd tokens and
//! connector secrets (docs/store.md).
//!
//! It runs on a [`PgStore`] of its own (the pool and runtime pattern of
//! `store::postgres`: every call bounded by `[store] timeout`, a lost
//! database is `StoreError::Unavailable`). Its migrations have their own
//! numbering ([`PG_SECURITY_MIGRATIONS`], recorded in
//! `strata_security_migrations`), so they never take a number the SQLite
//! migrations will use.
//!
//! Writers in several daemons at once:
//!
//! - the audit head is one row per audit log (`audit_heads`, keyed by the
//!   daemon's audit log id) and moves by compare-and-set from the head this
//!   handle last read or wrote: a second writer of the same log (a copied
//!   data dir, a stale process) is refused [`SecStoreError::AuditFork`]
//!   and never forks the recorded chain;
//! - an approval leaves `pending` once: the update of an answer (or a
//!   time-out) only matches a pending row, so an answer through another
//!   daemon is refused [`SecStoreError::ApprovalAnswered`]; its use is the
//!   same single-statement compare-and-set as SQLite's;
//! - an envd token is issued under a row lock on (sandbox, credential)
//!   (`INSERT … ON CONFLICT`), so two daemons issuing at once store one.

use std::sync::Mutex;

use chrono::{DateTime, Utc};
use strata_policy::approval::{ApprovalRequest, ApprovalStatus};
use tokio_postgres::Row;

use super::{
    from_ms, ms, status_str, EnvdTokenRow, SecResult, SecStoreError, SecretRow, SecurityBackend,
    TokenRecord, TOKEN_COLS,
};
use crate::store::{PgOptions, PgStore, StoreError, StoreResult};

/// Every security migration: (version, SQL), ascending. Its own numbering
/// (`strata_security_migrations`): never the SQLite store's numbers.
pub const PG_SECURITY_MIGRATIONS: &[(i64, &str)] = &[(1, SEC_V1)];

/// The advisory lock key of security migrations (`hashtext` of the schema
/// is added, as for the main migrations).
const SEC_MIGRATION_LOCK: i64 = 0x5354_5241_5345; // "STRASE"

/// Version 1: SQLite's security tables (migrations 2, 4, 14 and 15), the
/// audit head keyed by audit log, and envd tokens dropped with their
/// sandbox (SQLite drops them in the sandbox write; here a trigger on
/// `sandboxes`, which the main migrations made, does it in the same
/// transaction).
const SEC_V1: &str = r#"
CREATE TABLE tenants (
    id TEXT COLLATE "C" PRIMARY KEY,
    created_at BIGINT NOT NULL
);
INSERT INTO tenants (id, created_at) VALUES ('default', 0);
CREATE TABLE api_tokens (
    id TEXT COLLATE "C" PRIMARY KEY,
    tenant_id TEXT COLLATE "C" NOT NULL,
    role TEXT NOT NULL,
    name TEXT,
    hash TEXT COLLATE "C" NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    created_by TEXT,
    expires_at BIGINT,
    revoked_at BIGINT
);
CREATE INDEX api_tokens_by_tenant ON api_tokens (tenant_id, created_at);
CREATE TABLE tenant_policies (
    tenant_id TEXT COLLATE "C" PRIMARY KEY,
    toml TEXT NOT NULL,
    updated_at BIGINT NOT NULL,
    updated_by TEXT
);
CREATE TABLE sandbox_policies (
    sandbox_id TEXT COLLATE "C" PRIMARY KEY,
    tenant_id TEXT COLLATE "C" NOT NULL,
    toml TEXT NOT NULL,
    updated_at BIGINT NOT NULL,
    updated_by TEXT
);
CREATE TABLE approvals (
    id TEXT COLLATE "C" PRIMARY KEY,
    tenant_id TEXT COLLATE "C" NOT NULL,
    created_at BIGINT NOT NULL,
    status TEXT COLLATE "C" NOT NULL,
    body TEXT NOT NULL,
    consumed_at BIGINT
);
CREATE INDEX approvals_by_tenant ON approvals (tenant_id, status, created_at);
CREATE TABLE audit_heads (
    log_id TEXT COLLATE "C" PRIMARY KEY,
    seq BIGINT NOT NULL,
    hash TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE TABLE egress_ports (
    sandbox_id TEXT COLLATE "C" PRIMARY KEY,
    tenant_id TEXT COLLATE "C" NOT NULL,
    port BIGINT NOT NULL
);
CREATE TABLE envd_bindings (
    sandbox_id TEXT COLLATE "C" PRIMARY KEY,
    caller TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);
CREATE TABLE envd_tokens (
    token_hash TEXT COLLATE "C" PRIMARY KEY,
    sandbox_id TEXT COLLATE "C" NOT NULL,
    tenant_id TEXT COLLATE "C" NOT NULL,
    credential TEXT COLLATE "C" NOT NULL,
    caller TEXT NOT NULL,
    nonce TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    UNIQUE (sandbox_id, credential)
);
CREATE INDEX envd_tokens_by_credential ON envd_tokens (credential);
CREATE TABLE connector_secrets (
    tenant_id TEXT COLLATE "C" NOT NULL,
    name TEXT COLLATE "C" NOT NULL,
    connector TEXT NOT NULL,
    kind TEXT NOT NULL,
    rule TEXT NOT NULL,
    sealed TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    updated_by TEXT,
    PRIMARY KEY (tenant_id, name)
);
CREATE FUNCTION strata_envd_tokens_of_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM envd_tokens WHERE sandbox_id = NEW.id;
    RETURN NEW;
END
$$;
CREATE TRIGGER sandboxes_drop_envd_tokens AFTER INSERT OR UPDATE OF state ON sandboxes
    FOR EACH ROW WHEN (NEW.state = 'deleted') EXECUTE FUNCTION strata_envd_tokens_of_deleted();
"#;

/// The security tables in PostgreSQL.
pub struct PgSecurity {
    pg: PgStore,
    /// This daemon's audit log (the key of its `audit_heads` row).
    audit_log: String,
    /// The audit head this handle last read or wrote, and its last write
    /// whose outcome is unknown (an error after the statement was sent).
    audit_seen: Mutex<AuditSeen>,
}

/// What one handle knows of its audit log's recorded head.
#[derive(Debug, Default)]
struct AuditSeen {
    /// The head last read or written (`None`: none was recorded): the
    /// expected value of the next compare-and-set.
    head: Option<(u64, String)>,
    /// Heads whose writes failed without an answer since the last one
    /// confirmed (any may have committed: a partition can lose several
    /// answers in a row), oldest first, at most [`MAX_UNSURE_HEADS`].
    unsure: std::collections::VecDeque<(u64, String)>,
}

/// Unanswered head writes remembered while the database is unreachable: a
/// partition longer than this many audited calls reports the fork instead
/// of recognising its own write (every call it audits is refused meanwhile
/// anyway: fail closed).
const MAX_UNSURE_HEADS: usize = 4096;

impl std::fmt::Debug for PgSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSecurity")
            .field("audit_log", &self.audit_log)
            .finish_non_exhaustive()
    }
}

fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn token_of(r: &Row) -> SecResult<TokenRecord> {
    let row = || -> Result<_, tokio_postgres::Error> {
        Ok((
            TokenRecord {
                id: r.try_get(0)?,
                tenant: r.try_get(1)?,
                role: super::Role::Viewer,
                name: r.try_get(3)?,
                hash: r.try_get(4)?,
                created_at: from_ms(r.try_get(5)?),
                created_by: r.try_get(6)?,
                expires_at: r.try_get::<_, Option<i64>>(7)?.map(from_ms),
                revoked_at: r.try_get::<_, Option<i64>>(8)?.map(from_ms),
            },
            r.try_get::<_, String>(2)?,
        ))
    };
    let row = row().map_err(StoreError::from)?;
    super::token_record(row)
}

fn secret_of(r: &Row) -> Result<SecretRow, tokio_postgres::Error> {
    Ok(SecretRow {
        tenant: r.try_get(0)?,
        name: r.try_get(1)?,
        connector: r.try_get(2)?,
        kind: r.try_get(3)?,
        rule: r.try_get(4)?,
        sealed: r.try_get(5)?,
        created_at: from_ms(r.try_get(6)?),
        updated_at: from_ms(r.try_get(7)?),
        updated_by: r.try_get(8)?,
    })
}

impl PgSecurity {
    /// Connects with `opts` (the daemon's `[store]`), migrates the main
    /// and the security schema (one daemon at a time: advisory locks), and
    /// keeps the audit head of the log `audit_log`.
    pub fn open(opts: &PgOptions, audit_log: &str) -> SecResult<Self> {
        let pg = PgStore::open(opts)?;
        let sec = PgSecurity {
            pg,
            audit_log: audit_log.to_owned(),
            audit_seen: Mutex::new(AuditSeen::default()),
        };
        sec.migrate(opts.schema.as_deref())?;
        Ok(sec)
    }

    fn migrate(&self, schema: Option<&str>) -> SecResult<()> {
        Ok(self.pg.block(async {
            let mut c = self.pg.client().await?;
            let tx = c.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock($1::bigint + hashtext($2))",
                &[&SEC_MIGRATION_LOCK, &schema.unwrap_or("")],
            )
            .await?;
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS strata_security_migrations (\
                 version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .await?;
            let found: i64 = tx
                .query_one(
                    "SELECT coalesce(max(version), 0) FROM strata_security_migrations",
                    &[],
                )
                .await?
                .try_get(0)?;
            let newest = PG_SECURITY_MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
            if found > newest {
                return Err(StoreError::TooNew {
                    found,
                    supported: newest,
                });
            }
            for (version, sql) in PG_SECURITY_MIGRATIONS.iter().filter(|m| m.0 > found) {
                tx.batch_execute(sql).await?;
                tx.execute(
                    "INSERT INTO strata_security_migrations (version) VALUES ($1)",
                    &[version],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })?)
    }

    /// Runs one statement; the number of rows it touched.
    fn exec(
        &self,
        sql: &str,
        args: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> SecResult<u64> {
        Ok(self.pg.block(async {
            let c = self.pg.client().await?;
            let st = c.prepare_cached(sql).await?;
            Ok(c.execute(&st, args).await?)
        })?)
    }

    /// Runs one query; its rows.
    fn rows(
        &self,
        sql: &str,
        args: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> SecResult<Vec<Row>> {
        Ok(self.pg.block(async {
            let c = self.pg.client().await?;
            let st = c.prepare_cached(sql).await?;
            Ok(c.query(&st, args).await?)
        })?)
    }

    /// One text column of at most one row.
    fn text(
        &self,
        sql: &str,
        args: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> SecResult<Option<String>> {
        self.rows(sql, args)?
            .first()
            .map(|r| r.try_get(0).map_err(|e| StoreError::from(e).into()))
            .transpose()
    }

    /// One compare-and-set of the audit head from `was`; rows written.
    fn audit_cas(&self, was: Option<&(u64, String)>, seq: u64, hash: &str) -> SecResult<u64> {
        let now = ms(Utc::now());
        match was {
            None => self.exec(
                "INSERT INTO audit_heads (log_id, seq, hash, updated_at) VALUES ($1,$2,$3,$4) \
                 ON CONFLICT (log_id) DO NOTHING",
                &[&self.audit_log, &i64_of(seq), &hash, &now],
            ),
            Some((was_seq, was_hash)) => self.exec(
                "UPDATE audit_heads SET seq = $2, hash = $3, updated_at = $4 \
                 WHERE log_id = $1 AND seq = $5 AND hash = $6 AND seq <= $2",
                &[
                    &self.audit_log,
                    &i64_of(seq),
                    &hash,
                    &now,
                    &i64_of(*was_seq),
                    was_hash,
                ],
            ),
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, AuditSeen> {
        self.audit_seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn rows_of<T>(
    rows: Vec<Row>,
    f: impl Fn(&Row) -> Result<T, tokio_postgres::Error>,
) -> SecResult<Vec<T>> {
    rows.iter()
        .map(|r| f(r).map_err(|e| StoreError::from(e).into()))
        .collect()
}

impl SecurityBackend for PgSecurity {
    fn token_count(&self) -> SecResult<u64> {
        let rows = self.rows("SELECT count(*) FROM api_tokens", &[])?;
        let n: i64 = rows_of(rows, |r| r.try_get(0))?
            .first()
            .copied()
            .unwrap_or(0);
        Ok(n.max(0) as u64)
    }

    fn insert_token(&self, t: &TokenRecord) -> SecResult<()> {
        Ok(self.pg.block(async {
            let mut c = self.pg.client().await?;
            let tx = c.transaction().await?;
            tx.execute(
                "INSERT INTO tenants (id, created_at) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
                &[&t.tenant, &ms(t.created_at)],
            )
            .await?;
            tx.execute(
                format!(
                    "INSERT INTO api_tokens ({TOKEN_COLS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9)"
                )
                .as_str(),
                &[
                    &t.id,
                    &t.tenant,
                    &t.role.as_str(),
                    &t.name,
                    &t.hash,
                    &ms(t.created_at),
                    &t.created_by,
                    &t.expires_at.map(ms),
                    &t.revoked_at.map(ms),
                ],
            )
            .await?;
            tx.commit().await?;
            StoreResult::Ok(())
        })?)
    }

    fn token_by_hash(&self, hash: &str) -> SecResult<Option<TokenRecord>> {
        let rows = self.rows(
            &format!("SELECT {TOKEN_COLS} FROM api_tokens WHERE hash = $1"),
            &[&hash],
        )?;
        rows.first().map(token_of).transpose()
    }

    fn token(&self, tenant: &str, id: &str) -> SecResult<Option<TokenRecord>> {
        let rows = self.rows(
            &format!("SELECT {TOKEN_COLS} FROM api_tokens WHERE id = $1 AND tenant_id = $2"),
            &[&id, &tenant],
        )?;
        rows.first().map(token_of).transpose()
    }

    fn tokens(&self, tenant: &str) -> SecResult<Vec<TokenRecord>> {
        self.rows(
            &format!(
                "SELECT {TOKEN_COLS} FROM api_tokens WHERE tenant_id = $1 ORDER BY created_at, id"
            ),
            &[&tenant],
        )?
        .iter()
        .map(token_of)
        .collect()
    }

    fn revoke_token(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> SecResult<bool> {
        let n = self.exec(
            "UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, $3) WHERE id = $1 AND tenant_id = $2",
            &[&id, &tenant, &ms(at)],
        )?;
        Ok(n > 0)
    }

    fn tenant_policy(&self, tenant: &str) -> SecResult<Option<String>> {
        self.text(
            "SELECT toml FROM tenant_policies WHERE tenant_id = $1",
            &[&tenant],
        )
    }

    fn put_tenant_policy(&self, tenant: &str, toml: &str, by: &str) -> SecResult<()> {
        self.exec(
            "INSERT INTO tenant_policies (tenant_id, toml, updated_at, updated_by) VALUES ($1,$2,$3,$4) \
             ON CONFLICT (tenant_id) DO UPDATE SET toml = EXCLUDED.toml, updated_at = EXCLUDED.updated_at, \
             updated_by = EXCLUDED.updated_by",
            &[&tenant, &toml, &ms(Utc::now()), &by],
        )?;
        Ok(())
    }

    fn sandbox_policy(&self, sandbox: &str) -> SecResult<Option<String>> {
        self.text(
            "SELECT toml FROM sandbox_policies WHERE sandbox_id = $1",
            &[&sandbox],
        )
    }

    fn put_sandbox_policy(
        &self,
        tenant: &str,
        sandbox: &str,
        toml: &str,
        by: &str,
    ) -> SecResult<()> {
        self.exec(
            "INSERT INTO sandbox_policies (sandbox_id, tenant_id, toml, updated_at, updated_by) VALUES ($1,$2,$3,$4,$5) \
             ON CONFLICT (sandbox_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, toml = EXCLUDED.toml, \
             updated_at = EXCLUDED.updated_at, updated_by = EXCLUDED.updated_by",
            &[&sandbox, &tenant, &toml, &ms(Utc::now()), &by],
        )?;
        Ok(())
    }

    fn put_secret(&self, r: &SecretRow) -> SecResult<()> {
        self.exec(
            "INSERT INTO connector_secrets (tenant_id, name, connector, kind, rule, sealed, created_at, updated_at, updated_by) \
             VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9) \
             ON CONFLICT (tenant_id, name) DO UPDATE SET connector = EXCLUDED.connector, kind = EXCLUDED.kind, \
             rule = EXCLUDED.rule, sealed = EXCLUDED.sealed, updated_at = EXCLUDED.updated_at, updated_by = EXCLUDED.updated_by",
            &[
                &r.tenant,
                &r.name,
                &r.connector,
                &r.kind,
                &r.rule,
                &r.sealed,
                &ms(r.created_at),
                &ms(r.updated_at),
                &r.updated_by,
            ],
        )?;
        Ok(())
    }

    fn secrets(&self, tenant: Option<&str>) -> SecResult<Vec<SecretRow>> {
        let rows = self.rows(
            "SELECT tenant_id, name, connector, kind, rule, sealed, created_at, updated_at, updated_by \
             FROM connector_secrets WHERE $1::text IS NULL OR tenant_id = $1 ORDER BY tenant_id, name",
            &[&tenant],
        )?;
        rows_of(rows, secret_of)
    }

    fn delete_secret(&self, tenant: &str, name: &str) -> SecResult<bool> {
        let n = self.exec(
            "DELETE FROM connector_secrets WHERE tenant_id = $1 AND name = $2",
            &[&tenant, &name],
        )?;
        Ok(n > 0)
    }

    fn audit_head(&self) -> SecResult<Option<(u64, String)>> {
        let rows = self.rows(
            "SELECT seq, hash FROM audit_heads WHERE log_id = $1",
            &[&self.audit_log],
        )?;
        let head = rows_of(rows, |r| {
            Ok((r.try_get::<_, i64>(0)?.max(0) as u64, r.try_get(1)?))
        })?
        .into_iter()
        .next();
        *self.seen() = AuditSeen {
            head: head.clone(),
            unsure: Default::default(),
        };
        Ok(head)
    }

    /// A compare-and-set from the head this handle last read or wrote; a
    /// head recorded meanwhile by another writer of the same log is
    /// [`SecStoreError::AuditFork`] and nothing is written.
    fn set_audit_head(&self, seq: u64, hash: &str) -> SecResult<()> {
        let mut seen = self.seen();
        let mut retried = false;
        loop {
            let written = self.audit_cas(seen.head.as_ref(), seq, hash);
            let n = match written {
                Ok(n) => n,
                Err(e) => {
                    if seen.unsure.len() >= MAX_UNSURE_HEADS {
                        seen.unsure.pop_front();
                    }
                    seen.unsure.push_back((seq, hash.to_owned()));
                    return Err(e);
                }
            };
            if n > 0 {
                *seen = AuditSeen {
                    head: Some((seq, hash.to_owned())),
                    unsure: Default::default(),
                };
                return Ok(());
            }
            let found = self
                .rows(
                    "SELECT seq, hash FROM audit_heads WHERE log_id = $1",
                    &[&self.audit_log],
                )
                .and_then(|rows| {
                    rows_of(rows, |r| {
                        Ok((r.try_get::<_, i64>(0)?.max(0) as u64, r.try_get(1)?))
                    })
                })?
                .into_iter()
                .next();
            // One of this handle's own writes whose answer was lost did
            // commit (a partition cut the answer of the write in flight and
            // failed the later ones): continue from it (once).
            if let Some(f) = found
                .as_ref()
                .filter(|f| !retried && seen.unsure.contains(f))
            {
                let f = f.clone();
                seen.unsure.clear();
                seen.head = Some(f);
                retried = true;
                continue;
            }
            let (found_seq, found_hash) = found.unwrap_or((0, String::new()));
            return Err(SecStoreError::AuditFork {
                log: self.audit_log.clone(),
                seq,
                hash: hash.to_owned(),
                found_seq,
                found_hash,
            });
        }
    }

    fn egress_port(&self, sandbox: &str) -> SecResult<Option<u16>> {
        let rows = self.rows(
            "SELECT port FROM egress_ports WHERE sandbox_id = $1",
            &[&sandbox],
        )?;
        Ok(rows_of(rows, |r| r.try_get::<_, i64>(0))?
            .first()
            .and_then(|p| u16::try_from(*p).ok()))
    }

    fn set_egress_port(&self, tenant: &str, sandbox: &str, port: u16) -> SecResult<()> {
        self.exec(
            "INSERT INTO egress_ports (sandbox_id, tenant_id, port) VALUES ($1,$2,$3) \
             ON CONFLICT (sandbox_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, port = EXCLUDED.port",
            &[&sandbox, &tenant, &i64::from(port)],
        )?;
        Ok(())
    }

    fn bind_envd(&self, sandbox: &str, caller_json: &str) -> SecResult<()> {
        self.exec(
            "INSERT INTO envd_bindings (sandbox_id, caller, updated_at) VALUES ($1,$2,$3) \
             ON CONFLICT (sandbox_id) DO UPDATE SET caller = EXCLUDED.caller, updated_at = EXCLUDED.updated_at",
            &[&sandbox, &caller_json, &ms(Utc::now())],
        )?;
        Ok(())
    }

    fn envd_binding(&self, sandbox: &str) -> SecResult<Option<String>> {
        self.text(
            "SELECT caller FROM envd_bindings WHERE sandbox_id = $1",
            &[&sandbox],
        )
    }

    fn unbind_envd(&self, sandbox: &str) -> SecResult<()> {
        self.exec(
            "DELETE FROM envd_bindings WHERE sandbox_id = $1",
            &[&sandbox],
        )?;
        Ok(())
    }

    /// One statement: the insert, or (the pair holds a token already,
    /// locked by the conflict) the caller refreshed; the nonce in force
    /// either way.
    fn issue_envd_token(&self, t: &EnvdTokenRow<'_>) -> SecResult<String> {
        let nonce = self.text(
            "INSERT INTO envd_tokens (token_hash, sandbox_id, tenant_id, credential, caller, nonce, created_at) \
             VALUES ($1,$2,$3,$4,$5,$6,$7) \
             ON CONFLICT (sandbox_id, credential) DO UPDATE SET caller = EXCLUDED.caller \
             RETURNING nonce",
            &[
                &t.hash,
                &t.sandbox,
                &t.tenant,
                &t.credential,
                &t.caller,
                &t.nonce,
                &ms(Utc::now()),
            ],
        )?;
        nonce.ok_or_else(|| SecStoreError::Corrupt("envd token: no row returned".into()))
    }

    fn envd_token(&self, hash: &str) -> SecResult<Option<(String, String)>> {
        let rows = self.rows(
            "SELECT sandbox_id, caller FROM envd_tokens WHERE token_hash = $1",
            &[&hash],
        )?;
        Ok(rows_of(rows, |r| Ok((r.try_get(0)?, r.try_get(1)?)))?
            .into_iter()
            .next())
    }

    fn envd_tokens_of(&self, sandbox: &str) -> SecResult<Vec<(String, String)>> {
        let rows = self.rows(
            "SELECT nonce, caller FROM envd_tokens WHERE sandbox_id = $1 ORDER BY created_at, token_hash",
            &[&sandbox],
        )?;
        rows_of(rows, |r| Ok((r.try_get(0)?, r.try_get(1)?)))
    }

    fn approval_insert(&self, req: &ApprovalRequest, body: &str) -> SecResult<()> {
        self.exec(
            "INSERT INTO approvals (id, tenant_id, created_at, status, body) VALUES ($1,$2,$3,$4,$5)",
            &[
                &req.id,
                &req.tenant,
                &ms(req.created_at),
                &status_str(&req.status),
                &body,
            ],
        )?;
        Ok(())
    }

    /// An answer or time-out matches only a pending row: the first of two
    /// daemons answering wins, the other gets
    /// [`SecStoreError::ApprovalAnswered`].
    fn approval_update(&self, req: &ApprovalRequest, body: &str) -> SecResult<()> {
        let status = status_str(&req.status);
        let n = if req.status == ApprovalStatus::Pending {
            self.exec(
                "UPDATE approvals SET status = $2, body = $3 WHERE id = $1",
                &[&req.id, &status, &body],
            )?
        } else {
            self.exec(
                "UPDATE approvals SET status = $2, body = $3 WHERE id = $1 AND status = 'pending'",
                &[&req.id, &status, &body],
            )?
        };
        if n > 0 {
            return Ok(());
        }
        let found = self.text("SELECT status FROM approvals WHERE id = $1", &[&req.id])?;
        Err(match found {
            Some(_) => SecStoreError::ApprovalAnswered(req.id.clone()),
            None => SecStoreError::ApprovalNotRecorded(req.id.clone()),
        })
    }

    fn approval_load(&self) -> SecResult<Vec<(String, Option<i64>)>> {
        let rows = self.rows(
            "SELECT body, consumed_at FROM approvals ORDER BY created_at, id",
            &[],
        )?;
        rows_of(rows, |r| Ok((r.try_get(0)?, r.try_get(1)?)))
    }

    fn approval_load_tenant(&self, tenant: &str) -> SecResult<Vec<(String, Option<i64>)>> {
        let rows = self.rows(
            "SELECT body, consumed_at FROM approvals WHERE tenant_id = $1 ORDER BY created_at, id",
            &[&tenant],
        )?;
        rows_of(rows, |r| Ok((r.try_get(0)?, r.try_get(1)?)))
    }

    fn approval_get(&self, id: &str) -> SecResult<Option<(String, Option<i64>)>> {
        let rows = self.rows(
            "SELECT body, consumed_at FROM approvals WHERE id = $1",
            &[&id],
        )?;
        Ok(rows_of(rows, |r| Ok((r.try_get(0)?, r.try_get(1)?)))?
            .into_iter()
            .next())
    }

    fn approval_consume(&self, id: &str, at: DateTime<Utc>, body: &str) -> SecResult<bool> {
        let n = self.exec(
            "UPDATE approvals SET consumed_at = $2, body = $3 \
             WHERE id = $1 AND consumed_at IS NULL AND status = 'approved'",
            &[&id, &ms(at), &body],
        )?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partition cut the answer of a head write that committed (13) and
    /// failed the next one (14): the healed handle continues from its own
    /// 13 (the three-host test's `500` "15 does not continue the recorded
    /// 13", when only the last unanswered write was remembered). A head it
    /// never wrote is still a fork.
    #[test]
    fn a_head_whose_answer_a_partition_lost_is_continued() {
        let Some(db) = crate::store::tests::TestDb::postgres(
            "a_head_whose_answer_a_partition_lost_is_continued",
        ) else {
            return;
        };
        let opts = db.pg_options().unwrap();
        let a = PgSecurity::open(&opts, "log-lost").unwrap();
        assert_eq!(a.audit_head().unwrap(), None);
        a.set_audit_head(12, "h12").unwrap();
        // 13 committed, its answer lost; 14 never reached the database.
        a.exec(
            "UPDATE audit_heads SET seq = 13, hash = 'h13' WHERE log_id = 'log-lost'",
            &[],
        )
        .unwrap();
        a.seen()
            .unsure
            .extend([(13, "h13".to_owned()), (14, "h14".to_owned())]);
        a.set_audit_head(15, "h15").unwrap();
        assert_eq!(a.audit_head().unwrap(), Some((15, "h15".into())));
        // Another writer of the same log moves the head: not this handle's.
        let b = PgSecurity::open(&opts, "log-lost").unwrap();
        assert_eq!(b.audit_head().unwrap(), Some((15, "h15".into())));
        b.set_audit_head(16, "b16").unwrap();
        a.seen().unsure.push_back((16, "a16".to_owned()));
        assert!(matches!(
            a.set_audit_head(17, "a17"),
            Err(SecStoreError::AuditFork { found_seq: 16, .. })
        ));
    }

    #[test]
    fn security_versions_ascend() {
        let v: Vec<i64> = PG_SECURITY_MIGRATIONS.iter().map(|m| m.0).collect();
        assert!(!v.is_empty());
        assert!(v.windows(2).all(|w| w[0] < w[1]), "{v:?}");
    }
}
