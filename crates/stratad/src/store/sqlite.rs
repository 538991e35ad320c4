//! The embedded SQLite store.
//!
//! Durability: the database runs in WAL mode with `synchronous=FULL`, so a
//! commit returns only after its WAL frames are fsynced. `NORMAL` would be
//! enough against a `kill -9` of the daemon (the WAL write has reached the
//! kernel before `COMMIT` returns) but not against a host crash or power cut,
//! where the last transactions before a checkpoint could be lost; the daemon
//! acknowledges a state change only after its commit, and the rate of writes
//! (state changes, about one snapshot per running sandbox per minute) is far
//! below what one fsync per commit allows.
//!
//! Concurrency: one writer connection behind a mutex (SQLite has one writer
//! anyway) and a small pool of read-only connections, which WAL lets read
//! while the writer writes. Callers are on the blocking pool.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use rusqlite::{
    params, Connection, OpenFlags, OptionalExtension, Row, Transaction, TransactionBehavior,
};
use strata_core::{SandboxId, SandboxState, SnapshotId, TemplateId};

use super::*;

pub(in crate::store) mod journal;
pub(in crate::store) mod rows;
mod schema;

use rows::*;
use schema::MIGRATIONS;
pub use schema::SCHEMA_VERSION;

/// SQLite implementation of [`Store`].
pub struct SqliteStore {
    writer: Mutex<Connection>,
    readers: Vec<Mutex<Connection>>,
    next_reader: AtomicUsize,
    /// Changed after every commit that appended to the journal.
    changes: tokio::sync::watch::Sender<u64>,
    /// Most pending webhook deliveries per tenant.
    delivery_limit: AtomicUsize,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("readers", &self.readers.len())
            .finish()
    }
}

/// Creates `path` mode 0600 if missing, else sets its mode to 0600 (a
/// missing WAL or shared-memory file is created empty, which SQLite accepts).
fn restrict_mode(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if path.as_os_str().is_empty() || path == Path::new(":memory:") {
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

impl SqliteStore {
    /// Wakes the journal's readers (after a commit).
    fn changed(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// One row by id, decoded (`None`: no such row).
    fn by_id<R, T>(
        &self,
        sql: &str,
        id: &str,
        row: fn(&Row<'_>) -> rusqlite::Result<R>,
        into: fn(R) -> StoreResult<T>,
    ) -> StoreResult<Option<T>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(sql)?;
        let r = stmt.query_row([id], row).optional()?;
        r.map(into).transpose()
    }

    /// Opens (creating and migrating if needed) the database at `path`, with
    /// `readers` read-only connections.
    pub fn open(path: &Path, readers: usize) -> StoreResult<Self> {
        let open_err = |source| StoreError::Open {
            path: path.display().to_string(),
            source,
        };
        // It holds secrets (sandbox environments, token bindings): owner only.
        if let Err(e) = restrict_mode(path) {
            tracing::warn!(path = %path.display(), error = %e, "could not make the database mode 0600");
        }
        let mut writer = Connection::open(path).map_err(open_err)?;
        writer.busy_timeout(std::time::Duration::from_secs(5))?;
        let mode: String = writer.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(corrupt("pragma", "journal_mode", format!("got {mode}")));
        }
        writer.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")?;
        Self::migrate(&mut writer)?;
        // The WAL and shared-memory files exist now: owner only too.
        for ext in ["-wal", "-shm"] {
            let mut p = path.as_os_str().to_owned();
            p.push(ext);
            let _ = restrict_mode(Path::new(&p));
        }
        let mut pool = Vec::new();
        for _ in 0..readers.max(1) {
            let c = Connection::open_with_flags(
                path,
                OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(open_err)?;
            c.busy_timeout(std::time::Duration::from_secs(5))?;
            pool.push(Mutex::new(c));
        }
        Ok(SqliteStore {
            writer: Mutex::new(writer),
            readers: pool,
            next_reader: AtomicUsize::new(0),
            changes: tokio::sync::watch::channel(0).0,
            delivery_limit: AtomicUsize::new(1000),
        })
    }

    fn migrate(conn: &mut Connection) -> StoreResult<()> {
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute_batch(sql)?;
            tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))?;
            tx.commit()?;
        }
        Ok(())
    }

    fn writer(&self) -> MutexGuard<'_, Connection> {
        // A poisoned lock only means another thread panicked mid-call; the
        // connection itself rolled the transaction back.
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn reader(&self) -> MutexGuard<'_, Connection> {
        let n = self.readers.len();
        let start = self.next_reader.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            if let Ok(g) = self.readers[(start + i) % n].try_lock() {
                return g;
            }
        }
        self.readers[start % n]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// `(sandbox id, text)` rows of a per-sandbox table (`sql` selects the
    /// id and the value of sandboxes not deleted); an id that does not
    /// parse is a corrupt row of `table`.
    fn live_sandbox_values<P: rusqlite::Params>(
        &self,
        table: &'static str,
        sql: &str,
        params: P,
    ) -> StoreResult<Vec<(SandboxId, String)>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(sql)?;
        let rows = stmt.query_map(params, |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, value) = row?;
            let sid: SandboxId = id
                .parse()
                .map_err(|e| corrupt(table, &id, format!("{e}")))?;
            out.push((sid, value));
        }
        Ok(out)
    }

    fn ready_snapshot_at_ms(
        &self,
        sandbox: &SandboxId,
        at_ms: i64,
    ) -> StoreResult<Option<SnapshotRecord>> {
        let conn = self.reader();
        let mut v = Self::query_snapshots(
            &conn,
            &format!(
                "SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE sandbox_id = ?1 AND status = 'ready' \
                 AND created_at <= ?2 ORDER BY created_at DESC, id DESC LIMIT 1"
            ),
            &[&sandbox.as_str(), &at_ms],
        )?;
        Ok(v.pop())
    }

    /// Every row of a query, decoded (rows first, so a parse error is ours).
    fn query<R, T>(
        conn: &Connection,
        sql: &str,
        args: &[&dyn rusqlite::ToSql],
        row: fn(&Row<'_>) -> rusqlite::Result<R>,
        into: fn(R) -> StoreResult<T>,
    ) -> StoreResult<Vec<T>> {
        let mut stmt = conn.prepare_cached(sql)?;
        let rows = stmt.query_map(args, row)?.collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().map(into).collect()
    }

    fn query_sandboxes(
        conn: &Connection,
        sql: &str,
        args: &[&dyn rusqlite::ToSql],
    ) -> StoreResult<Vec<SandboxRecord>> {
        Self::query(conn, sql, args, sandbox_row, SandboxRow::into_record)
    }

    fn query_snapshots(
        conn: &Connection,
        sql: &str,
        args: &[&dyn rusqlite::ToSql],
    ) -> StoreResult<Vec<SnapshotRecord>> {
        Self::query(conn, sql, args, snapshot_row, snapshot_record)
    }
}

/// Ids read from `table`, parsed (a bad one is `Corrupt`).
fn parse_ids<T: std::str::FromStr>(table: &'static str, ids: Vec<String>) -> StoreResult<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    ids.into_iter()
        .map(|s| s.parse().map_err(|e| corrupt(table, &s, format!("{e}"))))
        .collect()
}

/// A write transaction that takes SQLite's write lock when it begins. The
/// security store writes the same file from its own connection; a deferred
/// transaction that read first (the sandbox compare-and-set) could then not
/// be promoted to a writer (`SQLITE_BUSY_SNAPSHOT`, which the busy timeout
/// does not retry). Begun `IMMEDIATE`, it waits its turn instead.
fn write_tx(conn: &mut Connection) -> rusqlite::Result<Transaction<'_>> {
    conn.transaction_with_behavior(TransactionBehavior::Immediate)
}

impl Store for SqliteStore {
    fn insert_sandbox(&self, rec: &SandboxRecord, event: &Event) -> StoreResult<()> {
        let mut w = self.writer();
        let tx = write_tx(&mut w)?;
        write_sandbox(&tx, rec, true)?;
        write_event(&tx, event)?;
        tx.commit()?;
        self.changed();
        Ok(())
    }

    fn update_sandbox(&self, rec: &SandboxRecord, event: Option<&Event>) -> StoreResult<()> {
        self.commit(&[rec], &[], event)
    }

    fn touch_sandbox(&self, id: &SandboxId, at: DateTime<Utc>) -> StoreResult<()> {
        self.writer().execute(
            "UPDATE sandboxes SET last_activity_at = max(last_activity_at, ?2) WHERE id = ?1",
            params![id.as_str(), ms(at)],
        )?;
        Ok(())
    }

    fn get_sandbox(&self, id: &SandboxId) -> StoreResult<Option<SandboxRecord>> {
        self.by_id(
            &format!("SELECT {SANDBOX_COLS} FROM sandboxes WHERE id = ?1"),
            id.as_str(),
            sandbox_row,
            SandboxRow::into_record,
        )
    }

    fn list_sandboxes(&self, f: &SandboxFilter) -> StoreResult<Page<SandboxRecord>> {
        let limit = f.limit.clamp(1, 1000);
        let cols = SANDBOX_COLS
            .split(',')
            .map(|c| format!("s.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut args: Vec<Box<dyn rusqlite::ToSql>> = vec![Box::new(f.tenant.clone())];
        let mut labels = f.labels.iter();
        // With a label filter the first label leads: its index yields the
        // tenant's sandboxes carrying it already in listing order (label rows
        // exist only for sandboxes not deleted). Without one, the sandboxes'
        // own (tenant, created_at, id) index does.
        let (mut sql, order) = match labels.next() {
            Some((k, v)) => {
                args.push(Box::new(k.clone()));
                args.push(Box::new(v.clone()));
                (
                    format!(
                        "SELECT {cols} FROM sandbox_labels l JOIN sandboxes s ON s.id = l.sandbox_id \
                         WHERE l.tenant_id = ? AND l.key = ? AND l.value = ? AND s.tenant_id = l.tenant_id"
                    ),
                    ("l.created_at", "l.sandbox_id"),
                )
            }
            None => (
                format!("SELECT {cols} FROM sandboxes s WHERE s.tenant_id = ?"),
                ("s.created_at", "s.id"),
            ),
        };
        if f.states.is_empty() {
            sql.push_str(" AND s.state != 'deleted'");
        } else {
            sql.push_str(" AND s.state IN (");
            for (i, st) in f.states.iter().enumerate() {
                sql.push_str(if i == 0 { "?" } else { ",?" });
                args.push(Box::new(st.as_str()));
            }
            sql.push(')');
        }
        for (k, v) in labels {
            sql.push_str(
                " AND EXISTS (SELECT 1 FROM sandbox_labels x WHERE x.sandbox_id = s.id AND x.key = ? AND x.value = ?)",
            );
            args.push(Box::new(k.clone()));
            args.push(Box::new(v.clone()));
        }
        if let Some(c) = &f.cursor {
            let (t, id) = decode_cursor(c)?;
            sql.push_str(&format!(" AND ({}, {}) > (?, ?)", order.0, order.1));
            args.push(Box::new(t));
            args.push(Box::new(id));
        }
        sql.push_str(&format!(" ORDER BY {}, {} LIMIT ?", order.0, order.1));
        args.push(Box::new((limit + 1) as i64));
        let conn = self.reader();
        let refs: Vec<&dyn rusqlite::ToSql> = args.iter().map(|b| b.as_ref()).collect();
        let mut items = Self::query_sandboxes(&conn, &sql, &refs)?;
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|r| encode_cursor(r.created_at, &r.id))
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    fn reserved_capacity(&self) -> StoreResult<(u64, u64)> {
        let conn = self.reader();
        let (v, m): (i64, i64) = conn.query_row(
            "SELECT coalesce(sum(vcpus), 0), coalesce(sum(memory_mib), 0) FROM sandboxes \
             WHERE state IN ('creating', 'running', 'paused') \
             OR (state != 'deleted' AND pending_op IN ('resume', 'rewind', 'recover'))",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        Ok((v.max(0) as u64, m.max(0) as u64))
    }

    fn reserved_sandboxes(&self) -> StoreResult<Vec<ReservedSandbox>> {
        let conn = self.reader();
        let mut st = conn.prepare_cached(
            "SELECT id, vcpus, memory_mib, disk_gib, state, pending_op, last_activity_at FROM sandboxes \
             WHERE state IN ('creating', 'running', 'paused') \
             OR (state != 'deleted' AND pending_op IN ('resume', 'rewind', 'recover')) \
             ORDER BY id",
        )?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, u32>(1)?,
                r.get::<_, u32>(2)?,
                r.get::<_, u32>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, Option<String>>(5)?,
                r.get::<_, i64>(6)?,
            ))
        })?;
        let t = "sandboxes";
        let mut out = Vec::new();
        for row in rows {
            let (id, vcpus, memory_mib, disk_gib, state, op, last) = row?;
            let pending_op = match op {
                Some(s) => Some(parse_op(&s).ok_or_else(|| corrupt(t, &id, format!("op {s:?}")))?),
                None => None,
            };
            out.push(ReservedSandbox {
                id: id.parse().map_err(|e| corrupt(t, &id, format!("{e}")))?,
                size: SandboxSize {
                    vcpus,
                    memory_mib,
                    disk_gib,
                },
                state: state.parse().map_err(|e: String| corrupt(t, &id, e))?,
                pending_op,
                last_activity_at: from_ms(last),
            });
        }
        Ok(out)
    }

    fn live_sandboxes(&self) -> StoreResult<Vec<SandboxRecord>> {
        let conn = self.reader();
        Self::query_sandboxes(
            &conn,
            &format!("SELECT {SANDBOX_COLS} FROM sandboxes WHERE state != 'deleted' ORDER BY created_at, id"),
            &[],
        )
    }

    fn put_sandbox_env(&self, id: &SandboxId, sealed: Option<&str>) -> StoreResult<()> {
        let w = self.writer();
        let Some(sealed) = sealed else {
            w.execute(
                "DELETE FROM sandbox_env WHERE sandbox_id = ?1",
                [id.as_str()],
            )?;
            return Ok(());
        };
        // Only for a sandbox not deleted (a delete racing this keeps none).
        w.execute(
            "INSERT OR REPLACE INTO sandbox_env (sandbox_id, env, updated_at) \
             SELECT ?1, ?2, ?3 FROM sandboxes WHERE id = ?1 AND state != 'deleted'",
            params![id.as_str(), sealed, ms(Utc::now())],
        )?;
        Ok(())
    }

    fn sandbox_envs(&self) -> StoreResult<Vec<(SandboxId, String)>> {
        self.live_sandbox_values(
            "sandbox_env",
            "SELECT e.sandbox_id, e.env FROM sandbox_env e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE s.state != 'deleted' ORDER BY e.sandbox_id",
            [],
        )
    }

    fn put_sandbox_setting(
        &self,
        id: &SandboxId,
        key: &str,
        value: Option<&str>,
    ) -> StoreResult<()> {
        let w = self.writer();
        let Some(value) = value else {
            w.execute(
                "DELETE FROM sandbox_settings WHERE sandbox_id = ?1 AND key = ?2",
                params![id.as_str(), key],
            )?;
            return Ok(());
        };
        // Only for a sandbox not deleted (a delete racing this keeps none).
        w.execute(
            "INSERT OR REPLACE INTO sandbox_settings (sandbox_id, key, value, updated_at) \
             SELECT ?1, ?2, ?3, ?4 FROM sandboxes WHERE id = ?1 AND state != 'deleted'",
            params![id.as_str(), key, value, ms(Utc::now())],
        )?;
        Ok(())
    }

    fn sandbox_settings(&self, key: &str) -> StoreResult<Vec<(SandboxId, String)>> {
        self.live_sandbox_values(
            "sandbox_settings",
            "SELECT e.sandbox_id, e.value FROM sandbox_settings e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE e.key = ?1 AND s.state != 'deleted' ORDER BY e.sandbox_id",
            [key],
        )
    }

    fn sandbox_setting(&self, id: &SandboxId, key: &str) -> StoreResult<Option<String>> {
        let conn = self.reader();
        Ok(conn
            .query_row(
                "SELECT value FROM sandbox_settings WHERE sandbox_id = ?1 AND key = ?2",
                [id.as_str(), key],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn put_tenant_setting(&self, tenant: &str, key: &str, value: Option<&str>) -> StoreResult<()> {
        let w = self.writer();
        match value {
            None => w.execute(
                "DELETE FROM tenant_settings WHERE tenant_id = ?1 AND key = ?2",
                params![tenant, key],
            )?,
            Some(v) => w.execute(
                "INSERT OR REPLACE INTO tenant_settings (tenant_id, key, value, updated_at) VALUES (?1, ?2, ?3, ?4)",
                params![tenant, key, v, ms(Utc::now())],
            )?,
        };
        Ok(())
    }

    fn tenant_setting(&self, tenant: &str, key: &str) -> StoreResult<Option<String>> {
        let conn = self.reader();
        Ok(conn
            .query_row(
                "SELECT value FROM tenant_settings WHERE tenant_id = ?1 AND key = ?2",
                [tenant, key],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn tenant_settings(&self, prefix: &str) -> StoreResult<Vec<(String, String, String)>> {
        let conn = self.reader();
        let mut stmt = conn.prepare(
            "SELECT tenant_id, key, value FROM tenant_settings WHERE substr(key, 1, length(?1)) = ?1 ORDER BY tenant_id, key",
        )?;
        let rows = stmt.query_map([prefix], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r?);
        }
        Ok(out)
    }

    fn put_sandbox_lifecycle(&self, id: &SandboxId, policy: &LifecyclePolicy) -> StoreResult<()> {
        // Only for a sandbox not deleted (a delete racing this keeps none).
        self.writer().execute(
            "INSERT OR REPLACE INTO sandbox_lifecycle (sandbox_id, on_timeout, auto_resume, updated_at) \
             SELECT ?1, ?2, ?3, ?4 FROM sandboxes WHERE id = ?1 AND state != 'deleted'",
            params![
                id.as_str(),
                policy.on_timeout.as_str(),
                policy.auto_resume,
                ms(Utc::now())
            ],
        )?;
        Ok(())
    }

    fn sandbox_lifecycle(&self, id: &SandboxId) -> StoreResult<Option<LifecyclePolicy>> {
        let conn = self.reader();
        let row: Option<(String, bool)> = conn
            .query_row(
                "SELECT on_timeout, auto_resume FROM sandbox_lifecycle WHERE sandbox_id = ?1",
                [id.as_str()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let Some((on, auto_resume)) = row else {
            return Ok(None);
        };
        let on_timeout = match on.as_str() {
            "hibernate" => OnTimeout::Hibernate,
            "delete" => OnTimeout::Delete,
            "hibernate_disk" => OnTimeout::HibernateDisk,
            other => {
                return Err(corrupt(
                    "sandbox_lifecycle",
                    id.as_str(),
                    format!("on_timeout {other:?}"),
                ))
            }
        };
        Ok(Some(LifecyclePolicy {
            on_timeout,
            auto_resume,
        }))
    }

    fn put_snapshot(&self, rec: &SnapshotRecord) -> StoreResult<()> {
        self.commit(&[], &[rec], None)
    }

    fn commit(
        &self,
        sandboxes: &[&SandboxRecord],
        snapshots: &[&SnapshotRecord],
        event: Option<&Event>,
    ) -> StoreResult<()> {
        let mut w = self.writer();
        let tx = write_tx(&mut w)?;
        for s in sandboxes {
            write_sandbox(&tx, s, false)?;
        }
        let limit = self.delivery_limit.load(Ordering::Relaxed);
        for s in snapshots {
            journal::snapshot_note(&tx, s, limit)?;
            write_snapshot(&tx, s)?;
        }
        if let Some(ev) = event {
            write_event(&tx, ev)?;
        }
        tx.commit()?;
        if event.is_some() || !snapshots.is_empty() {
            self.changed();
        }
        Ok(())
    }

    fn get_snapshot(&self, id: &SnapshotId) -> StoreResult<Option<SnapshotRecord>> {
        let conn = self.reader();
        let mut v = Self::query_snapshots(
            &conn,
            &format!("SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE id = ?1"),
            &[&id.as_str()],
        )?;
        Ok(v.pop())
    }

    fn list_snapshots(
        &self,
        sandbox: &SandboxId,
        include_deleted: bool,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        let conn = self.reader();
        let filter = if include_deleted {
            ""
        } else {
            " AND status != 'deleted'"
        };
        Self::query_snapshots(
            &conn,
            &format!("SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE sandbox_id = ?1{filter} ORDER BY created_at, id"),
            &[&sandbox.as_str()],
        )
    }

    fn pending_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        let conn = self.reader();
        Self::query_snapshots(
            &conn,
            &format!("SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE status = 'pending'"),
            &[],
        )
    }

    fn latest_ready_snapshot(&self, sandbox: &SandboxId) -> StoreResult<Option<SnapshotRecord>> {
        self.ready_snapshot_at_ms(sandbox, i64::MAX)
    }

    fn ready_snapshot_at(
        &self,
        sandbox: &SandboxId,
        at: DateTime<Utc>,
    ) -> StoreResult<Option<SnapshotRecord>> {
        self.ready_snapshot_at_ms(sandbox, ms(at))
    }

    fn ready_snapshot_ids(&self) -> StoreResult<Vec<SnapshotId>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached("SELECT id FROM snapshots WHERE status = 'ready'")?;
        let ids = stmt
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<Result<Vec<_>, _>>()?;
        parse_ids("snapshots", ids)
    }

    fn sandboxes_with_snapshots(
        &self,
        after: Option<&SandboxId>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxId>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(
            "SELECT DISTINCT sandbox_id FROM snapshots WHERE status = 'ready' AND sandbox_id > ?1 \
             ORDER BY sandbox_id LIMIT ?2",
        )?;
        let ids = stmt
            .query_map(
                params![after.map(|a| a.as_str()).unwrap_or(""), limit as i64],
                |r| r.get::<_, String>(0),
            )?
            .collect::<Result<Vec<_>, _>>()?;
        parse_ids("snapshots", ids)
    }

    fn put_template(&self, rec: &TemplateRecord) -> StoreResult<()> {
        self.writer().execute(
            &format!("REPLACE INTO templates ({TEMPLATE_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)"),
            params![
                rec.id.as_str(),
                rec.tenant,
                rec.name,
                rec.size.vcpus,
                rec.size.memory_mib,
                rec.size.disk_gib,
                rec.status.as_str(),
                rec.status_reason,
                rec.accel,
                ms(rec.created_at),
                ms(rec.updated_at),
                rec.variant_of.as_ref().map(|v| v.as_str()),
            ],
        )?;
        Ok(())
    }

    fn get_template(&self, id: &TemplateId) -> StoreResult<Option<TemplateRecord>> {
        self.by_id(
            &format!("SELECT {TEMPLATE_COLS} FROM templates WHERE id = ?1"),
            id.as_str(),
            template_row,
            template_record,
        )
    }

    fn all_templates(&self) -> StoreResult<Vec<TemplateRecord>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {TEMPLATE_COLS} FROM templates WHERE status != 'deleted' ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([], template_row)?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().map(template_record).collect()
    }

    fn list_templates(&self, tenant: &str) -> StoreResult<Vec<TemplateRecord>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {TEMPLATE_COLS} FROM templates WHERE tenant_id = ?1 AND status != 'deleted' ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([tenant], template_row)?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().map(template_record).collect()
    }

    fn events(&self, sandbox: &SandboxId, limit: usize) -> StoreResult<Vec<Event>> {
        let conn = self.reader();
        let mut stmt = conn.prepare_cached(
            "SELECT seq, at, tenant_id, sandbox_id, op, from_state, to_state, phase, detail \
             FROM events WHERE sandbox_id = ?1 AND kind = 'sandbox' ORDER BY seq DESC LIMIT ?2",
        )?;
        type EvRow = (
            i64,
            i64,
            String,
            String,
            String,
            Option<String>,
            Option<String>,
            String,
            Option<String>,
        );
        let rows: Vec<EvRow> = stmt
            .query_map(params![sandbox.as_str(), limit as i64], |r| {
                Ok(columns!(r; 0 1 2 3 4 5 6 7 8))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = Vec::with_capacity(rows.len());
        for (seq, at, tenant, sb, op, from, to, phase, detail) in rows.into_iter().rev() {
            let id = seq.to_string();
            let st = |s: Option<String>| -> StoreResult<Option<SandboxState>> {
                s.map(|s| s.parse().map_err(|e: String| corrupt("events", &id, e)))
                    .transpose()
            };
            out.push(Event {
                seq,
                at: from_ms(at),
                tenant,
                sandbox_id: sb
                    .parse()
                    .map_err(|e| corrupt("events", &id, format!("{e}")))?,
                op: parse_op(&op).ok_or_else(|| corrupt("events", &id, format!("op {op:?}")))?,
                from_state: st(from)?,
                to_state: st(to)?,
                phase: match phase.as_str() {
                    "pending" => EventPhase::Pending,
                    "done" => EventPhase::Done,
                    "failed" => EventPhase::Failed,
                    "recovered" => EventPhase::Recovered,
                    other => return Err(corrupt("events", &id, format!("phase {other:?}"))),
                },
                detail,
            });
        }
        Ok(out)
    }

    fn counts(&self, tenant: Option<&str>) -> StoreResult<StoreCounts> {
        let conn = self.reader();
        let mut out = StoreCounts::default();
        // `?1 IS NULL`: every tenant.
        let mut stmt = conn.prepare_cached(
            "SELECT state, count(*) FROM sandboxes WHERE state != 'deleted' \
             AND (?1 IS NULL OR tenant_id = ?1) GROUP BY state",
        )?;
        for row in stmt.query_map([tenant], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
        })? {
            let (s, n) = row?;
            out.sandboxes_by_state.insert(s, n.max(0) as u64);
        }
        out.snapshots_ready = conn.query_row(
            "SELECT count(*) FROM snapshots WHERE status = 'ready' AND (?1 IS NULL OR tenant_id = ?1)",
            [tenant],
            |r| r.get::<_, i64>(0),
        )? as u64;
        out.templates_ready = conn.query_row(
            "SELECT count(*) FROM templates WHERE status = 'ready' \
             AND (?1 IS NULL OR tenant_id = ?1 OR tenant_id = '@platform')",
            [tenant],
            |r| r.get::<_, i64>(0),
        )? as u64;
        Ok(out)
    }

    fn tenant_usage(&self, tenant: &str) -> StoreResult<TenantUsage> {
        let conn = self.reader();
        let (n, v, m): (i64, i64, i64) = conn.query_row(
            "SELECT count(*), \
             coalesce(sum(CASE WHEN state IN ('creating', 'running', 'paused') \
                 OR pending_op IN ('resume', 'rewind', 'recover') THEN vcpus ELSE 0 END), 0), \
             coalesce(sum(CASE WHEN state IN ('creating', 'running', 'paused') \
                 OR pending_op IN ('resume', 'rewind', 'recover') THEN memory_mib ELSE 0 END), 0) \
             FROM sandboxes WHERE tenant_id = ?1 AND state != 'deleted'",
            [tenant],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        Ok(TenantUsage {
            sandboxes: n.max(0) as u64,
            vcpus: v.max(0) as u64,
            memory_mib: m.max(0) as u64,
        })
    }

    fn tenant_ready_snapshots(&self, tenant: &str) -> StoreResult<Vec<SnapshotRecord>> {
        let conn = self.reader();
        Self::query_snapshots(
            &conn,
            &format!(
                "SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE tenant_id = ?1 AND status = 'ready' \
                 ORDER BY sandbox_id, created_at, id"
            ),
            &[&tenant],
        )
    }

    fn snapshot_charges(&self, tenant: &str) -> StoreResult<Vec<SnapshotCharge>> {
        let conn = self.reader();
        Self::query(
            &conn,
            "SELECT c.snapshot_id, c.tenant_id, c.sandbox_id, c.base, c.bytes, c.computed_at \
             FROM snapshot_charges c JOIN snapshots s ON s.id = c.snapshot_id \
             WHERE c.tenant_id = ?1 AND s.status = 'ready'",
            &[&tenant],
            charge_row,
            charge_record,
        )
    }

    fn put_charge(&self, c: &SnapshotCharge) -> StoreResult<()> {
        let conn = self.writer();
        conn.execute(
            "REPLACE INTO snapshot_charges \
             (snapshot_id, tenant_id, sandbox_id, base, bytes, computed_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                c.snapshot_id.as_str(),
                c.tenant,
                c.sandbox_id.as_str(),
                c.base,
                c.bytes.min(i64::MAX as u64) as i64,
                ms(c.computed_at)
            ],
        )?;
        Ok(())
    }

    fn append_journal(&self, note: &JournalNote) -> StoreResult<i64> {
        let limit = self.delivery_limit.load(Ordering::Relaxed);
        let mut w = self.writer();
        let tx = write_tx(&mut w)?;
        let seq = journal::insert_note(&tx, note, limit)?;
        tx.commit()?;
        drop(w);
        self.changed();
        Ok(seq)
    }

    fn journal_after(
        &self,
        tenant: &str,
        sandbox: Option<&str>,
        after: i64,
        limit: usize,
    ) -> StoreResult<Vec<JournalEntry>> {
        journal::journal_after(&self.reader(), tenant, sandbox, after, limit)
    }

    fn journal_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn prune_journal(&self, before: DateTime<Utc>) -> StoreResult<u64> {
        let mut w = self.writer();
        let tx = write_tx(&mut w)?;
        let n = journal::prune(&tx, before)?;
        tx.commit()?;
        Ok(n)
    }

    fn set_delivery_limit(&self, limit: usize) {
        self.delivery_limit.store(limit, Ordering::Relaxed);
    }

    fn put_webhook(&self, hook: &Webhook) -> StoreResult<()> {
        journal::put_webhook(&self.writer(), hook)
    }

    fn webhooks(&self, tenant: &str) -> StoreResult<Vec<Webhook>> {
        journal::webhooks(&self.reader(), tenant)
    }

    fn get_webhook(&self, tenant: &str, id: &str) -> StoreResult<Option<Webhook>> {
        journal::get_webhook(&self.reader(), tenant, id)
    }

    fn delete_webhook(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> StoreResult<bool> {
        let mut w = self.writer();
        let tx = write_tx(&mut w)?;
        let found = journal::delete_webhook(&tx, tenant, id, at)?;
        tx.commit()?;
        Ok(found)
    }

    fn due_deliveries(&self, now: DateTime<Utc>, limit: usize) -> StoreResult<Vec<Delivery>> {
        journal::due(&self.reader(), now, limit)
    }

    fn next_delivery_at(&self) -> StoreResult<Option<DateTime<Utc>>> {
        journal::next_due(&self.reader())
    }

    fn update_delivery(&self, d: &Delivery) -> StoreResult<()> {
        journal::update_delivery(&self.writer(), d)
    }

    fn deliveries(&self, webhook: &str, limit: usize) -> StoreResult<Vec<Delivery>> {
        journal::deliveries(&self.reader(), webhook, limit)
    }
}

#[cfg(test)]
mod tests;
