//! The PostgreSQL store: [`Store`] over `tokio-postgres` with a
//! `deadpool-postgres` pool, selected by `[store] url = "postgres://…"`.
//!
//! # Sync trait, async client
//!
//! [`Store`] is synchronous (the service calls it on the blocking pool;
//! some callers are plain threads or async tasks). The store owns a small
//! tokio runtime of its own (two threads, `strata-pg`) that drives every
//! connection's socket. A call builds its future on the calling thread and
//! waits for it there with `futures::executor::block_on`, inside the store
//! runtime's context: the client's futures only exchange messages with the
//! connection tasks, so they need no reactor on the calling thread. This
//! works from any thread (a blocking-pool thread, a test thread, even an
//! async worker, where `Handle::block_on` or the `postgres` crate would
//! panic) and needs no `'static` copies of the arguments.
//!
//! Nothing waits without bound: every call is wrapped in one timeout
//! (`[store] timeout_ms`, default 10 s) covering the pool checkout, a
//! connect, and every statement; the server is told the same
//! `statement_timeout`. A lost connection, a refused connect or a timeout is
//! [`StoreError::Unavailable`] (the API's `storage_failed`, 503); after a
//! timeout the pool's idle connections are dropped (one of them may still
//! carry the abandoned statement).
//!
//! # Semantics
//!
//! The same as SQLite's, row for row (the store tests run on both):
//! every write method is one transaction; a sandbox update is a
//! compare-and-set on `version` (`SELECT … FOR UPDATE`, then the write;
//! [`StoreError::Stale`] from an older copy). Journal readers in every
//! process are woken through `LISTEN/NOTIFY` (channel `strata_journal`,
//! sent inside the committing transaction), and at once in the writing
//! process.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use futures::StreamExt as _;
use serde_json::json;
use strata_core::{SandboxId, SandboxState, SnapshotId, TemplateId};
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, NoTls, Row};

use super::sqlite::journal::{entry, JRow, DCOLS, HCOLS, JCOLS};
use super::sqlite::rows::{
    charge_record, corrupt, decode_cursor, encode_cursor, from_ms, ms, op_str, parse_op,
    snapshot_record, template_record, SandboxRow, SANDBOX_COLS, SNAPSHOT_COLS, SNAPSHOT_SELECT,
    TEMPLATE_COLS,
};
use super::*;

mod hosts;
mod schema;

pub use schema::{pg_schema_version, PG_CLUSTER_MIGRATIONS, PG_MIGRATIONS};

/// The channel journal commits notify.
const CHANNEL: &str = "strata_journal";

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct PgOptions {
    /// A libpq-style URL or key=value string (`postgres://user@host/db`,
    /// `host=/run/postgresql dbname=strata`).
    pub url: String,
    /// The schema the tables live in (created if missing); `None`: the
    /// connection's default (`public`).
    pub schema: Option<String>,
    /// Most connections.
    pub pool_size: usize,
    /// Bound of every call: pool checkout, connect and statements together.
    pub timeout: Duration,
}

impl PgOptions {
    /// Options for `url` with the defaults (no schema, 8 connections, 10 s).
    pub fn new(url: impl Into<String>) -> Self {
        PgOptions {
            url: url.into(),
            schema: None,
            pool_size: 8,
            timeout: Duration::from_secs(10),
        }
    }
}

/// PostgreSQL implementation of [`Store`].
pub struct PgStore {
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    pool: Pool,
    timeout: Duration,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
    delivery_limit: AtomicUsize,
    listener: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.listener.abort();
        self.pool.close();
        if let Some(rt) = self.rt.take() {
            // Never blocks (callable from async code too).
            rt.shutdown_background();
        }
    }
}

/// Whether an error means the database is out of reach (rather than that
/// it refused this statement).
fn unreachable(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        // Class 08: connection exceptions; 57: operator intervention
        // (shutdown, statement timeout, cannot connect now); 53300: too
        // many connections.
        Some(c) => {
            let c = c.code();
            c.starts_with("08") || c.starts_with("57") || c == "53300"
        }
        // No SQLSTATE: the client's own error; its kind is only visible in
        // its text (tokio-postgres keeps `Kind` private).
        None => {
            let t = e.to_string();
            [
                "error connecting",
                "error communicating",
                "connection closed",
                "timeout",
                "unexpected message",
                "error parsing",
            ]
            .iter()
            .any(|p| t.starts_with(p))
        }
    }
}

fn pg_err(e: tokio_postgres::Error) -> StoreError {
    let msg = strata_runtime::error::chain(&e);
    if e.code() == Some(&tokio_postgres::error::SqlState::DISK_FULL) {
        StoreError::Full(msg)
    } else if unreachable(&e) {
        StoreError::Unavailable(msg)
    } else {
        StoreError::Pg(msg)
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        pg_err(e)
    }
}

fn pool_err(e: deadpool_postgres::PoolError) -> StoreError {
    match e {
        deadpool_postgres::PoolError::Backend(e) => pg_err(e),
        other => StoreError::Unavailable(format!("connection pool: {other}")),
    }
}

fn i64_of(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}

fn u32_of(v: i64) -> u32 {
    v.clamp(0, u32::MAX as i64) as u32
}

/// A sandbox row (columns [`SANDBOX_COLS`] from `at`) decoded.
fn sandbox_of(r: &Row) -> StoreResult<SandboxRecord> {
    SandboxRow {
        id: r.try_get(0)?,
        tenant: r.try_get(1)?,
        template: r.try_get(2)?,
        source: r.try_get(3)?,
        vcpus: u32_of(r.try_get(4)?),
        memory_mib: u32_of(r.try_get(5)?),
        disk_gib: u32_of(r.try_get(6)?),
        labels: r.try_get(7)?,
        state: r.try_get(8)?,
        state_reason: r.try_get(9)?,
        pending_op: r.try_get(10)?,
        idle: r.try_get(11)?,
        interval: r.try_get(12)?,
        created: r.try_get(13)?,
        updated: r.try_get(14)?,
        activity: r.try_get(15)?,
        pid: r.try_get(16)?,
        accel: r.try_get(17)?,
        deleted: r.try_get(18)?,
        version: r.try_get(19)?,
    }
    .into_record()
}

fn snapshot_of(r: &Row) -> StoreResult<SnapshotRecord> {
    snapshot_record((
        r.try_get(0)?,
        r.try_get(1)?,
        r.try_get(2)?,
        r.try_get(3)?,
        r.try_get(4)?,
        r.try_get(5)?,
        r.try_get(6)?,
        r.try_get(7)?,
        r.try_get(8)?,
        r.try_get(9)?,
        r.try_get(10)?,
        r.try_get(11)?,
        r.try_get(12)?,
    ))
}

fn template_of(r: &Row) -> StoreResult<TemplateRecord> {
    template_record((
        r.try_get(0)?,
        r.try_get(1)?,
        r.try_get(2)?,
        u32_of(r.try_get(3)?),
        u32_of(r.try_get(4)?),
        u32_of(r.try_get(5)?),
        r.try_get(6)?,
        r.try_get(7)?,
        r.try_get(8)?,
        r.try_get(9)?,
        r.try_get(10)?,
        r.try_get(11)?,
    ))
}

fn journal_of(r: &Row) -> StoreResult<JournalEntry> {
    let row: JRow = (
        r.try_get(0)?,
        r.try_get(1)?,
        r.try_get(2)?,
        r.try_get(3)?,
        r.try_get(4)?,
        r.try_get(5)?,
        r.try_get(6)?,
        r.try_get(7)?,
        r.try_get(8)?,
        r.try_get(9)?,
        r.try_get(10)?,
    );
    Ok(entry(row))
}

fn webhook_of(r: &Row) -> StoreResult<Webhook> {
    let events: String = r.try_get(3)?;
    let format: String = r.try_get(4)?;
    Ok(Webhook {
        id: r.try_get(0)?,
        tenant: r.try_get(1)?,
        url: r.try_get(2)?,
        events: serde_json::from_str(&events).unwrap_or_default(),
        format: WebhookFormat::parse(&format).unwrap_or_default(),
        secret_sealed: r.try_get(5)?,
        created_by: r.try_get(6)?,
        created_at: from_ms(r.try_get(7)?),
    })
}

fn delivery_of(r: &Row) -> StoreResult<Delivery> {
    let event: String = r.try_get(5)?;
    let status: String = r.try_get(6)?;
    let next: Option<i64> = r.try_get(10)?;
    let last_status: Option<i64> = r.try_get(8)?;
    Ok(Delivery {
        id: r.try_get(0)?,
        webhook_id: r.try_get(1)?,
        tenant: r.try_get(2)?,
        event_seq: r.try_get(3)?,
        topic: r.try_get(4)?,
        event: serde_json::from_str(&event).unwrap_or(serde_json::Value::Null),
        status: DeliveryStatus::parse(&status).unwrap_or(DeliveryStatus::Failed),
        attempts: r.try_get::<_, i64>(7)?.clamp(0, u32::MAX as i64) as u32,
        last_status: last_status.map(|s| s.clamp(0, u16::MAX as i64) as u16),
        last_error: r.try_get(9)?,
        next_attempt_at: next.map(from_ms),
        created_at: from_ms(r.try_get(11)?),
        updated_at: from_ms(r.try_get(12)?),
    })
}

/// `$1, $2, …, $n`.
fn placeholders(n: usize) -> String {
    (1..=n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `col = EXCLUDED.col` for every column of `cols` but the first (the key).
fn excluded(cols: &str) -> String {
    cols.split(',')
        .map(str::trim)
        .skip(1)
        .map(|c| format!("{c} = EXCLUDED.{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The sandbox write of one transaction: insert, or a compare-and-set
/// update on `version` (as `sqlite::rows::write_sandbox`).
async fn write_sandbox(
    tx: &impl GenericClient,
    rec: &SandboxRecord,
    insert: bool,
) -> StoreResult<()> {
    let labels = serde_json::to_string(&rec.labels).unwrap_or_else(|_| "{}".into());
    let version = if insert {
        rec.version
    } else {
        // The row lock holds other writers (every host) until commit.
        let found = tx
            .query_opt(
                "SELECT version FROM sandboxes WHERE id = $1 FOR UPDATE",
                &[&rec.id.as_str()],
            )
            .await?
            .map(|r| r.try_get::<_, i64>(0))
            .transpose()?
            .map(|v| v.max(0) as u64);
        if let Some(found) = found.filter(|f| *f != rec.version) {
            return Err(StoreError::Stale {
                id: rec.id.to_string(),
                expected: rec.version,
                found,
            });
        }
        rec.version + 1
    };
    let sql = if insert {
        format!(
            "INSERT INTO sandboxes ({SANDBOX_COLS}) VALUES ({})",
            placeholders(20)
        )
    } else {
        format!(
            "INSERT INTO sandboxes ({SANDBOX_COLS}) VALUES ({}) ON CONFLICT (id) DO UPDATE SET {}",
            placeholders(20),
            excluded(SANDBOX_COLS)
        )
    };
    let template = rec.template.as_ref().map(|t| t.as_str());
    let source = rec.source_snapshot.as_ref().map(|t| t.as_str());
    let vcpus = i64::from(rec.size.vcpus);
    let mem = i64::from(rec.size.memory_mib);
    let disk = i64::from(rec.size.disk_gib);
    let op = rec.pending_op.map(op_str);
    let idle = rec.idle_timeout_s.map(i64_of);
    let interval = rec.snapshot_interval_s.map(i64_of);
    let pid = rec.pid.map(i64::from);
    let deleted = rec.deleted_at.map(ms);
    let version = i64_of(version);
    let params: [&(dyn ToSql + Sync); 20] = [
        &rec.id.as_str(),
        &rec.tenant,
        &template,
        &source,
        &vcpus,
        &mem,
        &disk,
        &labels,
        &rec.state.as_str(),
        &rec.state_reason,
        &op,
        &idle,
        &interval,
        &ms(rec.created_at),
        &ms(rec.updated_at),
        &ms(rec.last_activity_at),
        &pid,
        &rec.accel,
        &deleted,
        &version,
    ];
    tx.execute(sql.as_str(), &params).await?;
    let id = rec.id.as_str();
    tx.execute("DELETE FROM sandbox_labels WHERE sandbox_id = $1", &[&id])
        .await?;
    if rec.state == SandboxState::Deleted {
        for table in ["sandbox_env", "sandbox_lifecycle", "sandbox_settings"] {
            tx.execute(
                format!("DELETE FROM {table} WHERE sandbox_id = $1").as_str(),
                &[&id],
            )
            .await?;
        }
    } else if !rec.labels.is_empty() {
        // One row per label, each a copy of the row just written (schema
        // version 17: the listing by label reads them alone).
        let (keys, values): (Vec<&str>, Vec<&str>) = rec
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .unzip();
        tx.execute(
            format!(
                "INSERT INTO sandbox_labels (key, value, {}) \
                 SELECT kv.k, kv.v, {SANDBOX_COLS} FROM sandboxes, \
                 unnest($2::text[], $3::text[]) AS kv(k, v) WHERE id = $1",
                label_cols("")
            )
            .as_str(),
            &[&id, &keys, &values],
        )
        .await?;
    }
    Ok(())
}

/// [`SANDBOX_COLS`] as `sandbox_labels` names them (`sandbox_id` for
/// `id`), each prefixed with `prefix` (e.g. `l.`).
fn label_cols(prefix: &str) -> String {
    SANDBOX_COLS
        .split(',')
        .map(str::trim)
        .map(|c| match c {
            "id" => format!("{prefix}sandbox_id"),
            c => format!("{prefix}{c}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn write_snapshot(tx: &impl GenericClient, rec: &SnapshotRecord) -> StoreResult<()> {
    let sql = format!(
        "INSERT INTO snapshots ({SNAPSHOT_COLS}) VALUES ({}) ON CONFLICT (id) DO UPDATE SET {}",
        placeholders(12),
        excluded(SNAPSHOT_COLS)
    );
    let excl = rec.exclusive_bytes.map(i64_of);
    let refd = rec.referenced_bytes.map(i64_of);
    let same = rec.same_as.as_ref().map(|t| t.as_str());
    tx.execute(
        sql.as_str(),
        &[
            &rec.id.as_str(),
            &rec.tenant,
            &rec.sandbox_id.as_str(),
            &rec.kind.as_str(),
            &rec.label,
            &rec.status.as_str(),
            &rec.status_reason,
            &ms(rec.created_at),
            &rec.pause_ms,
            &excl,
            &refd,
            &same,
        ],
    )
    .await?;
    Ok(())
}

async fn write_event(tx: &impl GenericClient, ev: &Event) -> StoreResult<()> {
    tx.execute(
        "INSERT INTO events (at, tenant_id, sandbox_id, op, from_state, to_state, phase, detail) \
         VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
        &[
            &ms(ev.at),
            &ev.tenant,
            &ev.sandbox_id.as_str(),
            &op_str(ev.op),
            &ev.from_state.map(|s| s.as_str()),
            &ev.to_state.map(|s| s.as_str()),
            &ev.phase.as_str(),
            &ev.detail,
        ],
    )
    .await?;
    Ok(())
}

/// The writes of [`Store::commit`] in the caller's transaction (and the
/// journal's NOTIFY, sent at its commit).
async fn write_all(
    tx: &impl GenericClient,
    sandboxes: &[&SandboxRecord],
    snapshots: &[&SnapshotRecord],
    event: Option<&Event>,
    limit: usize,
) -> StoreResult<()> {
    for s in sandboxes {
        write_sandbox(tx, s, false).await?;
    }
    for s in snapshots {
        snapshot_note(tx, s, limit).await?;
        write_snapshot(tx, s).await?;
    }
    if let Some(ev) = event {
        write_event(tx, ev).await?;
    }
    if event.is_some() || !snapshots.is_empty() {
        tx.batch_execute(&format!("NOTIFY {CHANNEL}")).await?;
    }
    Ok(())
}

/// Appends `note` and queues its deliveries (in the caller's transaction;
/// as `sqlite::journal::insert_note`).
async fn insert_note(
    tx: &impl GenericClient,
    note: &JournalNote,
    limit: usize,
) -> StoreResult<i64> {
    let row = tx
        .query_one(
            "INSERT INTO events (at, tenant_id, sandbox_id, op, phase, kind, data) \
             VALUES ($1,$2,$3,$4,'done',$4,$5) RETURNING seq",
            &[
                &ms(note.at),
                &note.tenant,
                &note.sandbox_id,
                &note.kind.as_str(),
                &note.data.to_string(),
            ],
        )
        .await?;
    let seq: i64 = row.try_get(0)?;
    let entry = JournalEntry {
        seq,
        at: note.at,
        tenant: note.tenant.clone(),
        sandbox_id: note.sandbox_id.clone(),
        kind: note.kind,
        data: note.data.clone(),
    };
    let hooks = tx
        .query(
            "SELECT id, events FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL",
            &[&entry.tenant],
        )
        .await?;
    let kind = entry.kind.as_str();
    let mut wanted = Vec::new();
    for h in hooks {
        let (id, events): (String, String) = (h.try_get(0)?, h.try_get(1)?);
        if serde_json::from_str::<Vec<String>>(&events)
            .unwrap_or_default()
            .iter()
            .any(|e| *e == note.topic || e == kind || e == "*")
        {
            wanted.push(id);
        }
    }
    if wanted.is_empty() {
        return Ok(seq);
    }
    let pending: i64 = tx
        .query_one(
            "SELECT count(*) FROM webhook_deliveries WHERE tenant_id = $1 AND status = 'pending'",
            &[&entry.tenant],
        )
        .await?
        .try_get(0)?;
    let message = entry.message().to_string();
    let now = ms(entry.at);
    for (i, id) in wanted.iter().enumerate() {
        if pending.max(0) as usize + i >= limit {
            tracing::warn!(tenant = %entry.tenant, webhook = %id, seq, limit, "webhook queue full: delivery dropped");
            continue;
        }
        tx.execute(
            "INSERT INTO webhook_deliveries (webhook_id, tenant_id, event_seq, topic, event, \
             status, attempts, next_attempt_at, created_at, updated_at) \
             VALUES ($1,$2,$3,$4,$5,'pending',0,$6,$6,$6)",
            &[id, &entry.tenant, &seq, &note.topic, &message, &now],
        )
        .await?;
    }
    Ok(seq)
}

/// The journal row a snapshot write makes (as `sqlite::journal::snapshot_note`).
async fn snapshot_note(
    tx: &impl GenericClient,
    rec: &SnapshotRecord,
    limit: usize,
) -> StoreResult<()> {
    if rec.kind == SnapshotKind::Template {
        return Ok(());
    }
    let before: Option<String> = tx
        .query_opt(
            "SELECT status FROM snapshots WHERE id = $1",
            &[&rec.id.as_str()],
        )
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
    let was_ready = before.as_deref() == Some("ready");
    let action = match rec.status {
        SnapshotStatus::Ready if !was_ready => "taken",
        SnapshotStatus::Deleted if was_ready => "pruned",
        _ => return Ok(()),
    };
    let at = match action {
        "taken" => rec.created_at,
        _ => Utc::now(),
    };
    let note = JournalNote {
        at,
        tenant: rec.tenant.clone(),
        sandbox_id: rec.sandbox_id.to_string(),
        kind: JournalKind::Snapshot,
        topic: format!("snapshot.{action}"),
        data: json!({
            "action": action,
            "snapshot_id": rec.id,
            "snapshot_kind": rec.kind.as_str(),
            "label": rec.label,
            "pause_ms": rec.pause_ms,
            "reason": rec.status_reason,
        }),
    };
    insert_note(tx, &note, limit).await.map(|_| ())
}

/// Keeps `changes` moving with every notification on [`CHANNEL`], from any
/// process; reconnects (and wakes the readers once, for what it missed)
/// after a loss.
async fn listen(cfg: tokio_postgres::Config, changes: Arc<tokio::sync::watch::Sender<u64>>) {
    loop {
        match cfg.connect(NoTls).await {
            Ok((client, mut conn)) => {
                let (tx, mut rx) = futures::channel::mpsc::unbounded();
                let stream = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
                let driver = tokio::spawn(stream.map(Ok).forward(tx));
                if client
                    .batch_execute(&format!("LISTEN {CHANNEL}"))
                    .await
                    .is_ok()
                {
                    changes.send_modify(|v| *v = v.wrapping_add(1));
                    while let Some(msg) = rx.next().await {
                        match msg {
                            Ok(tokio_postgres::AsyncMessage::Notification(_)) => {
                                changes.send_modify(|v| *v = v.wrapping_add(1))
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "journal listener lost its connection");
                                break;
                            }
                        }
                    }
                }
                driver.abort();
            }
            Err(e) => tracing::warn!(error = %e, "journal listener cannot connect"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs `f`, which may wait (up to the store timeout), so that it does not
/// hold an async worker of the daemon's runtime: on a worker of a
/// multi-thread runtime the worker's other tasks move to another thread
/// first (`block_in_place`). A sync store call made from async code (a
/// policy or secret reload on the egress path) would otherwise park the
/// worker for as long as PostgreSQL does not answer, and with every worker
/// parked nothing else runs: not the API, not the self-fencing timer.
/// Elsewhere (a blocking-pool thread, a plain thread, a current-thread
/// runtime, where `block_in_place` is not allowed) `f` runs as it is.
pub(crate) fn off_worker<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

impl PgStore {
    /// Connects, creates the schema if asked, and migrates (one daemon at
    /// a time: an advisory lock is held while migrating).
    pub fn open(opts: &PgOptions) -> StoreResult<Self> {
        let mut cfg: tokio_postgres::Config =
            opts.url.parse().map_err(|e: tokio_postgres::Error| {
                StoreError::Unavailable(format!("store url: {e}"))
            })?;
        let timeout = opts.timeout.max(Duration::from_millis(100));
        let mut options = format!("-c statement_timeout={}", timeout.as_millis());
        if let Some(schema) = &opts.schema {
            if schema.is_empty()
                || !schema
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                return Err(StoreError::Pg(format!(
                    "schema {schema:?}: letters, digits and _ only"
                )));
            }
            options.push_str(&format!(" -c search_path={schema}"));
        }
        if let Some(o) = cfg.get_options() {
            options = format!("{o} {options}");
        }
        cfg.options(&options)
            .connect_timeout(timeout)
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(30));
        if cfg.get_application_name().is_none() {
            cfg.application_name("stratad");
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("strata-pg")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Task(format!("store runtime: {e}")))?;
        let handle = rt.handle().clone();
        let mgr = Manager::from_config(
            cfg.clone(),
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = {
            let _g = handle.enter();
            Pool::builder(mgr)
                .max_size(opts.pool_size.max(1))
                .runtime(deadpool_postgres::Runtime::Tokio1)
                .wait_timeout(Some(timeout))
                .create_timeout(Some(timeout))
                .recycle_timeout(Some(timeout))
                .build()
                .map_err(|e| StoreError::Task(format!("connection pool: {e}")))?
        };
        let changes = Arc::new(tokio::sync::watch::channel(0).0);
        let listener = handle.spawn(listen(cfg, changes.clone()));
        let store = PgStore {
            rt: Some(rt),
            handle,
            pool,
            timeout,
            changes,
            delivery_limit: AtomicUsize::new(1000),
            listener,
        };
        store.migrate(opts.schema.as_deref())?;
        Ok(store)
    }

    /// Runs `fut` to completion on this thread, off the async worker
    /// ([`off_worker`]) and inside the store runtime's context; `None` when
    /// it did not finish within the timeout. [`PgStore::block`] and the
    /// host calls' `block_h` wait through it.
    pub(crate) fn bounded<F: Future>(&self, fut: F) -> Option<F::Output> {
        off_worker(|| {
            let _g = self.handle.enter();
            futures::executor::block_on(tokio::time::timeout(self.timeout, fut)).ok()
        })
    }

    /// The error of a call that found no answer within the timeout.
    pub(crate) fn no_answer(&self) -> StoreError {
        StoreError::Unavailable(format!(
            "no answer from PostgreSQL within {} ms",
            self.timeout.as_millis()
        ))
    }

    /// Runs `fut` to completion on this thread, bounded by the timeout
    /// (the security store's PostgreSQL backend runs its calls so too).
    pub(crate) fn block<T>(&self, fut: impl Future<Output = StoreResult<T>>) -> StoreResult<T> {
        let r = self.bounded(fut).unwrap_or_else(|| Err(self.no_answer()));
        if matches!(&r, Err(StoreError::Unavailable(_))) {
            // An abandoned statement may still occupy a pooled connection:
            // start over with fresh ones.
            self.pool.retain(|_, _| false);
        }
        r
    }

    /// A pooled connection.
    pub(crate) async fn client(&self) -> StoreResult<Object> {
        self.pool.get().await.map_err(pool_err)
    }

    /// Wakes this process's journal readers (other processes hear the
    /// NOTIFY sent in the transaction).
    fn changed(&self) {
        self.changes.send_modify(|v| *v = v.wrapping_add(1));
    }

    fn migrate(&self, schema: Option<&str>) -> StoreResult<()> {
        self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            tx.execute(
                "SELECT pg_advisory_xact_lock($1::bigint + hashtext($2))",
                &[&schema::MIGRATION_LOCK, &schema.unwrap_or("")],
            )
            .await?;
            if let Some(s) = schema {
                tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {s}"))
                    .await?;
            }
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS strata_migrations (\
                 version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .await?;
            let found: i64 = tx
                .query_one(
                    "SELECT coalesce(max(version), 0) FROM strata_migrations",
                    &[],
                )
                .await?
                .try_get(0)?;
            let newest = pg_schema_version();
            if found > newest {
                return Err(StoreError::TooNew {
                    found,
                    supported: newest,
                });
            }
            for (version, sql) in PG_MIGRATIONS.iter().filter(|m| m.0 > found) {
                tx.batch_execute(sql).await?;
                tx.execute(
                    "INSERT INTO strata_migrations (version) VALUES ($1)",
                    &[version],
                )
                .await?;
            }
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS strata_cluster_migrations (\
                 version BIGINT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .await?;
            let found: i64 = tx
                .query_one(
                    "SELECT coalesce(max(version), 0) FROM strata_cluster_migrations",
                    &[],
                )
                .await?
                .try_get(0)?;
            let newest = PG_CLUSTER_MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
            if found > newest {
                return Err(StoreError::TooNew {
                    found,
                    supported: newest,
                });
            }
            for (version, sql) in PG_CLUSTER_MIGRATIONS.iter().filter(|m| m.0 > found) {
                tx.batch_execute(sql).await?;
                tx.execute(
                    "INSERT INTO strata_cluster_migrations (version) VALUES ($1)",
                    &[version],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    /// The applied schema version (`strata_migrations`).
    pub fn schema_version(&self) -> StoreResult<i64> {
        self.block(async {
            let c = self.client().await?;
            Ok(c.query_one(
                "SELECT coalesce(max(version), 0) FROM strata_migrations",
                &[],
            )
            .await?
            .try_get(0)?)
        })
    }

    /// Runs raw SQL on one pooled connection (tests and tools: tampering
    /// checks, version bumps).
    #[doc(hidden)]
    pub fn execute_raw(&self, sql: &str) -> StoreResult<()> {
        self.block(async {
            let c = self.client().await?;
            c.batch_execute(sql).await?;
            Ok(())
        })
    }

    /// The first column of every row `sql` returns, as text (tools: the
    /// benchmark reads `EXPLAIN (ANALYZE)` output with it).
    #[doc(hidden)]
    pub fn query_lines(&self, sql: &str) -> StoreResult<Vec<String>> {
        self.block(async {
            let c = self.client().await?;
            let rows = c.query(sql, &[]).await?;
            rows.iter()
                .map(|r| Ok(r.try_get::<_, String>(0)?))
                .collect::<StoreResult<Vec<String>>>()
        })
    }

    /// The process ids of this store's idle pooled connections on the
    /// server (tests: to cut them).
    #[doc(hidden)]
    pub fn backend_pids(&self) -> StoreResult<Vec<i32>> {
        self.block(async {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT pid FROM pg_stat_activity \
                     WHERE application_name = current_setting('application_name') \
                     AND datname = current_database()",
                    &[],
                )
                .await?;
            rows.iter()
                .map(|r| Ok(r.try_get::<_, i32>(0)?))
                .collect::<StoreResult<Vec<i32>>>()
        })
    }

    async fn sandboxes(
        &self,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<SandboxRecord>> {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        c.query(&stmt, args).await?.iter().map(sandbox_of).collect()
    }

    async fn snapshots(
        &self,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<SnapshotRecord>> {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        c.query(&stmt, args)
            .await?
            .iter()
            .map(snapshot_of)
            .collect()
    }

    async fn templates(
        &self,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<TemplateRecord>> {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        c.query(&stmt, args)
            .await?
            .iter()
            .map(template_of)
            .collect()
    }

    /// `(sandbox id, text)` rows of a per-sandbox table, ids parsed.
    async fn live_values(
        &self,
        table: &'static str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<(SandboxId, String)>> {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        let mut out = Vec::new();
        for r in c.query(&stmt, args).await? {
            let id: String = r.try_get(0)?;
            let sid: SandboxId = id
                .parse()
                .map_err(|e| corrupt(table, &id, format!("{e}")))?;
            out.push((sid, r.try_get(1)?));
        }
        Ok(out)
    }

    async fn ids<T: std::str::FromStr>(
        &self,
        table: &'static str,
        sql: &str,
        args: &[&(dyn ToSql + Sync)],
    ) -> StoreResult<Vec<T>>
    where
        T::Err: std::fmt::Display,
    {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        let mut out = Vec::new();
        for r in c.query(&stmt, args).await? {
            let s: String = r.try_get(0)?;
            out.push(s.parse().map_err(|e| corrupt(table, &s, format!("{e}")))?);
        }
        Ok(out)
    }

    /// One statement on a pooled connection; rows changed.
    async fn exec(&self, sql: &str, args: &[&(dyn ToSql + Sync)]) -> StoreResult<u64> {
        let c = self.client().await?;
        let stmt = c.prepare_cached(sql).await?;
        Ok(c.execute(&stmt, args).await?)
    }

    fn ready_snapshot_at_ms(
        &self,
        sandbox: &SandboxId,
        at_ms: i64,
    ) -> StoreResult<Option<SnapshotRecord>> {
        self.block(async {
            let mut v = self
                .snapshots(
                    &format!(
                        "SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE sandbox_id = $1 AND status = 'ready' \
                         AND created_at <= $2 ORDER BY created_at DESC, id DESC LIMIT 1"
                    ),
                    &[&sandbox.as_str(), &at_ms],
                )
                .await?;
            Ok(v.pop())
        })
    }
}

/// The first `?` placeholders of `sql` numbered `$1…` (the listing query
/// is built with `?` like SQLite's).
fn number_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    for ch in sql.chars() {
        if ch == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(ch);
        }
    }
    out
}

impl Store for PgStore {
    fn insert_sandbox(&self, rec: &SandboxRecord, event: &Event) -> StoreResult<()> {
        self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            write_sandbox(&*tx, rec, true).await?;
            write_event(&*tx, event).await?;
            tx.batch_execute(&format!("NOTIFY {CHANNEL}")).await?;
            tx.commit().await?;
            Ok(())
        })?;
        self.changed();
        Ok(())
    }

    fn update_sandbox(&self, rec: &SandboxRecord, event: Option<&Event>) -> StoreResult<()> {
        self.commit(&[rec], &[], event)
    }

    fn touch_sandbox(&self, id: &SandboxId, at: DateTime<Utc>) -> StoreResult<()> {
        self.block(async {
            // The label rows carry the record too (schema version 17).
            self.exec(
                "WITH s AS (UPDATE sandboxes SET last_activity_at = GREATEST(last_activity_at, $2) \
                 WHERE id = $1 RETURNING id, last_activity_at) \
                 UPDATE sandbox_labels l SET last_activity_at = s.last_activity_at \
                 FROM s WHERE l.sandbox_id = s.id",
                &[&id.as_str(), &ms(at)],
            )
            .await
        })?;
        Ok(())
    }

    fn get_sandbox(&self, id: &SandboxId) -> StoreResult<Option<SandboxRecord>> {
        self.block(async {
            let mut v = self
                .sandboxes(
                    &format!("SELECT {SANDBOX_COLS} FROM sandboxes WHERE id = $1"),
                    &[&id.as_str()],
                )
                .await?;
            Ok(v.pop())
        })
    }

    fn list_sandboxes(&self, f: &SandboxFilter) -> StoreResult<Page<SandboxRecord>> {
        let limit = f.limit.clamp(1, 1000);
        let cols = SANDBOX_COLS
            .split(',')
            .map(|c| format!("s.{}", c.trim()))
            .collect::<Vec<_>>()
            .join(", ");
        let mut args: Vec<Box<dyn ToSql + Sync + Send>> = vec![Box::new(f.tenant.clone())];
        let mut labels = f.labels.iter();
        // By label: the label rows alone, which carry the record (schema
        // version 17), in the order of `sandbox_labels_in_order`.
        let (mut sql, order) = match labels.next() {
            Some((k, v)) => {
                args.push(Box::new(k.clone()));
                args.push(Box::new(v.clone()));
                (
                    format!(
                        "SELECT {} FROM sandbox_labels s \
                         WHERE s.tenant_id = ? AND s.key = ? AND s.value = ?",
                        label_cols("s.")
                    ),
                    ("s.created_at", "s.sandbox_id"),
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
                args.push(Box::new(st.as_str().to_owned()));
            }
            sql.push(')');
        }
        for (k, v) in labels {
            sql.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM sandbox_labels x WHERE x.sandbox_id = {} \
                 AND x.key = ? AND x.value = ?)",
                order.1
            ));
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
        let sql = number_placeholders(&sql);
        let refs: Vec<&(dyn ToSql + Sync)> = args
            .iter()
            .map(|b| b.as_ref() as &(dyn ToSql + Sync))
            .collect();
        let mut items = self.block(self.sandboxes(&sql, &refs))?;
        let next_cursor = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|r| encode_cursor(r.created_at, &r.id))
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    fn reserved_capacity(&self) -> StoreResult<(u64, u64)> {
        self.block(async {
            let c = self.client().await?;
            let r = c
                .query_one(
                    "SELECT coalesce(sum(vcpus), 0)::bigint, coalesce(sum(memory_mib), 0)::bigint \
                     FROM sandboxes WHERE state IN ('creating', 'running', 'paused') \
                     OR (state != 'deleted' AND pending_op IN ('resume', 'rewind', 'recover'))",
                    &[],
                )
                .await?;
            let (v, m): (i64, i64) = (r.try_get(0)?, r.try_get(1)?);
            Ok((v.max(0) as u64, m.max(0) as u64))
        })
    }

    fn reserved_sandboxes(&self) -> StoreResult<Vec<ReservedSandbox>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT id, vcpus, memory_mib, disk_gib, state, pending_op, last_activity_at \
                     FROM sandboxes WHERE state IN ('creating', 'running', 'paused') \
                     OR (state != 'deleted' AND pending_op IN ('resume', 'rewind', 'recover')) \
                     ORDER BY id",
                )
                .await?;
            let t = "sandboxes";
            let mut out = Vec::new();
            for r in c.query(&stmt, &[]).await? {
                let id: String = r.try_get(0)?;
                let state: String = r.try_get(4)?;
                let op: Option<String> = r.try_get(5)?;
                let pending_op = match op {
                    Some(s) => {
                        Some(parse_op(&s).ok_or_else(|| corrupt(t, &id, format!("op {s:?}")))?)
                    }
                    None => None,
                };
                out.push(ReservedSandbox {
                    id: id.parse().map_err(|e| corrupt(t, &id, format!("{e}")))?,
                    size: strata_core::SandboxSize {
                        vcpus: u32_of(r.try_get(1)?),
                        memory_mib: u32_of(r.try_get(2)?),
                        disk_gib: u32_of(r.try_get(3)?),
                    },
                    state: state.parse().map_err(|e: String| corrupt(t, &id, e))?,
                    pending_op,
                    last_activity_at: from_ms(r.try_get(6)?),
                });
            }
            Ok(out)
        })
    }

    fn live_sandboxes(&self) -> StoreResult<Vec<SandboxRecord>> {
        self.block(self.sandboxes(
            &format!(
                "SELECT {SANDBOX_COLS} FROM sandboxes WHERE state != 'deleted' ORDER BY created_at, id"
            ),
            &[],
        ))
    }

    fn put_sandbox_env(&self, id: &SandboxId, sealed: Option<&str>) -> StoreResult<()> {
        self.block(async {
            match sealed {
                None => {
                    self.exec(
                        "DELETE FROM sandbox_env WHERE sandbox_id = $1",
                        &[&id.as_str()],
                    )
                    .await?
                }
                // Only for a sandbox not deleted (a delete racing this keeps none).
                Some(sealed) => {
                    self.exec(
                        "INSERT INTO sandbox_env (sandbox_id, env, updated_at) \
                         SELECT $1, $2, $3 FROM sandboxes WHERE id = $1 AND state != 'deleted' \
                         ON CONFLICT (sandbox_id) DO UPDATE SET env = EXCLUDED.env, \
                         updated_at = EXCLUDED.updated_at",
                        &[&id.as_str(), &sealed, &ms(Utc::now())],
                    )
                    .await?
                }
            };
            Ok(())
        })
    }

    fn sandbox_envs(&self) -> StoreResult<Vec<(SandboxId, String)>> {
        self.block(self.live_values(
            "sandbox_env",
            "SELECT e.sandbox_id, e.env FROM sandbox_env e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE s.state != 'deleted' ORDER BY e.sandbox_id",
            &[],
        ))
    }

    fn put_sandbox_lifecycle(&self, id: &SandboxId, policy: &LifecyclePolicy) -> StoreResult<()> {
        self.block(async {
            self.exec(
                "INSERT INTO sandbox_lifecycle (sandbox_id, on_timeout, auto_resume, updated_at) \
                 SELECT $1, $2, $3, $4 FROM sandboxes WHERE id = $1 AND state != 'deleted' \
                 ON CONFLICT (sandbox_id) DO UPDATE SET on_timeout = EXCLUDED.on_timeout, \
                 auto_resume = EXCLUDED.auto_resume, updated_at = EXCLUDED.updated_at",
                &[
                    &id.as_str(),
                    &policy.on_timeout.as_str(),
                    &policy.auto_resume,
                    &ms(Utc::now()),
                ],
            )
            .await
        })?;
        Ok(())
    }

    fn sandbox_lifecycle(&self, id: &SandboxId) -> StoreResult<Option<LifecyclePolicy>> {
        let row: Option<(String, bool)> = self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT on_timeout, auto_resume FROM sandbox_lifecycle WHERE sandbox_id = $1",
                )
                .await?;
            c.query_opt(&stmt, &[&id.as_str()])
                .await?
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .transpose()
        })?;
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

    fn put_sandbox_setting(
        &self,
        id: &SandboxId,
        key: &str,
        value: Option<&str>,
    ) -> StoreResult<()> {
        self.block(async {
            match value {
                None => {
                    self.exec(
                        "DELETE FROM sandbox_settings WHERE sandbox_id = $1 AND key = $2",
                        &[&id.as_str(), &key],
                    )
                    .await?
                }
                Some(v) => {
                    self.exec(
                        "INSERT INTO sandbox_settings (sandbox_id, key, value, updated_at) \
                         SELECT $1, $2, $3, $4 FROM sandboxes WHERE id = $1 AND state != 'deleted' \
                         ON CONFLICT (sandbox_id, key) DO UPDATE SET value = EXCLUDED.value, \
                         updated_at = EXCLUDED.updated_at",
                        &[&id.as_str(), &key, &v, &ms(Utc::now())],
                    )
                    .await?
                }
            };
            Ok(())
        })
    }

    fn sandbox_settings(&self, key: &str) -> StoreResult<Vec<(SandboxId, String)>> {
        self.block(self.live_values(
            "sandbox_settings",
            "SELECT e.sandbox_id, e.value FROM sandbox_settings e JOIN sandboxes s ON s.id = e.sandbox_id \
             WHERE e.key = $1 AND s.state != 'deleted' ORDER BY e.sandbox_id",
            &[&key],
        ))
    }

    fn sandbox_setting(&self, id: &SandboxId, key: &str) -> StoreResult<Option<String>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT value FROM sandbox_settings WHERE sandbox_id = $1 AND key = $2",
                )
                .await?;
            c.query_opt(&stmt, &[&id.as_str(), &key])
                .await?
                .map(|r| r.try_get(0).map_err(StoreError::from))
                .transpose()
        })
    }

    fn put_tenant_setting(&self, tenant: &str, key: &str, value: Option<&str>) -> StoreResult<()> {
        self.block(async {
            match value {
                None => {
                    self.exec(
                        "DELETE FROM tenant_settings WHERE tenant_id = $1 AND key = $2",
                        &[&tenant, &key],
                    )
                    .await?
                }
                Some(v) => {
                    self.exec(
                        "INSERT INTO tenant_settings (tenant_id, key, value, updated_at) \
                         VALUES ($1, $2, $3, $4) ON CONFLICT (tenant_id, key) DO UPDATE \
                         SET value = EXCLUDED.value, updated_at = EXCLUDED.updated_at",
                        &[&tenant, &key, &v, &ms(Utc::now())],
                    )
                    .await?
                }
            };
            Ok(())
        })
    }

    fn tenant_setting(&self, tenant: &str, key: &str) -> StoreResult<Option<String>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT value FROM tenant_settings WHERE tenant_id = $1 AND key = $2",
                )
                .await?;
            c.query_opt(&stmt, &[&tenant, &key])
                .await?
                .map(|r| r.try_get(0).map_err(StoreError::from))
                .transpose()
        })
    }

    fn tenant_settings(&self, prefix: &str) -> StoreResult<Vec<(String, String, String)>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT tenant_id, key, value FROM tenant_settings \
                     WHERE left(key, length($1)) = $1 ORDER BY tenant_id, key",
                )
                .await?;
            c.query(&stmt, &[&prefix])
                .await?
                .iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                .collect()
        })
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
        let limit = self.delivery_limit.load(Ordering::Relaxed);
        let journaled = event.is_some() || !snapshots.is_empty();
        self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            write_all(&*tx, sandboxes, snapshots, event, limit).await?;
            tx.commit().await?;
            Ok(())
        })?;
        if journaled {
            self.changed();
        }
        Ok(())
    }

    fn get_snapshot(&self, id: &SnapshotId) -> StoreResult<Option<SnapshotRecord>> {
        self.block(async {
            let mut v = self
                .snapshots(
                    &format!("SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE id = $1"),
                    &[&id.as_str()],
                )
                .await?;
            Ok(v.pop())
        })
    }

    fn list_snapshots(
        &self,
        sandbox: &SandboxId,
        include_deleted: bool,
    ) -> StoreResult<Vec<SnapshotRecord>> {
        let filter = if include_deleted {
            ""
        } else {
            " AND status != 'deleted'"
        };
        self.block(self.snapshots(
            &format!(
                "SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE sandbox_id = $1{filter} ORDER BY created_at, id"
            ),
            &[&sandbox.as_str()],
        ))
    }

    fn pending_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        self.block(self.snapshots(
            &format!("SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE status = 'pending'"),
            &[],
        ))
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
        self.block(self.ids(
            "snapshots",
            "SELECT id FROM snapshots WHERE status = 'ready'",
            &[],
        ))
    }

    fn sandboxes_with_snapshots(
        &self,
        after: Option<&SandboxId>,
        limit: usize,
    ) -> StoreResult<Vec<SandboxId>> {
        let after = after.map(|a| a.as_str()).unwrap_or("");
        let limit = limit as i64;
        self.block(self.ids(
            "snapshots",
            "SELECT DISTINCT sandbox_id FROM snapshots WHERE status = 'ready' AND sandbox_id > $1 \
             ORDER BY sandbox_id LIMIT $2",
            &[&after, &limit],
        ))
    }

    fn put_template(&self, rec: &TemplateRecord) -> StoreResult<()> {
        let sql = format!(
            "INSERT INTO templates ({TEMPLATE_COLS}) VALUES ({}) ON CONFLICT (id) DO UPDATE SET {}",
            placeholders(12),
            excluded(TEMPLATE_COLS)
        );
        let (v, m, d) = (
            i64::from(rec.size.vcpus),
            i64::from(rec.size.memory_mib),
            i64::from(rec.size.disk_gib),
        );
        let variant = rec.variant_of.as_ref().map(|v| v.as_str());
        self.block(async {
            self.exec(
                &sql,
                &[
                    &rec.id.as_str(),
                    &rec.tenant,
                    &rec.name,
                    &v,
                    &m,
                    &d,
                    &rec.status.as_str(),
                    &rec.status_reason,
                    &rec.accel,
                    &ms(rec.created_at),
                    &ms(rec.updated_at),
                    &variant,
                ],
            )
            .await
        })?;
        Ok(())
    }

    fn get_template(&self, id: &TemplateId) -> StoreResult<Option<TemplateRecord>> {
        self.block(async {
            let mut v = self
                .templates(
                    &format!("SELECT {TEMPLATE_COLS} FROM templates WHERE id = $1"),
                    &[&id.as_str()],
                )
                .await?;
            Ok(v.pop())
        })
    }

    fn list_templates(&self, tenant: &str) -> StoreResult<Vec<TemplateRecord>> {
        self.block(self.templates(
            &format!(
                "SELECT {TEMPLATE_COLS} FROM templates WHERE tenant_id = $1 AND status != 'deleted' \
                 ORDER BY created_at, id"
            ),
            &[&tenant],
        ))
    }

    fn all_templates(&self) -> StoreResult<Vec<TemplateRecord>> {
        self.block(self.templates(
            &format!(
                "SELECT {TEMPLATE_COLS} FROM templates WHERE status != 'deleted' ORDER BY created_at, id"
            ),
            &[],
        ))
    }

    fn events(&self, sandbox: &SandboxId, limit: usize) -> StoreResult<Vec<Event>> {
        let rows = self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT seq, at, tenant_id, sandbox_id, op, from_state, to_state, phase, detail \
                     FROM events WHERE sandbox_id = $1 AND kind = 'sandbox' ORDER BY seq DESC LIMIT $2",
                )
                .await?;
            Ok(c.query(&stmt, &[&sandbox.as_str(), &(limit as i64)]).await?)
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows.iter().rev() {
            let seq: i64 = r.try_get(0)?;
            let id = seq.to_string();
            let st = |s: Option<String>| -> StoreResult<Option<SandboxState>> {
                s.map(|s| s.parse().map_err(|e: String| corrupt("events", &id, e)))
                    .transpose()
            };
            let sb: String = r.try_get(3)?;
            let op: String = r.try_get(4)?;
            let phase: String = r.try_get(7)?;
            out.push(Event {
                seq,
                at: from_ms(r.try_get(1)?),
                tenant: r.try_get(2)?,
                sandbox_id: sb
                    .parse()
                    .map_err(|e| corrupt("events", &id, format!("{e}")))?,
                op: parse_op(&op).ok_or_else(|| corrupt("events", &id, format!("op {op:?}")))?,
                from_state: st(r.try_get(5)?)?,
                to_state: st(r.try_get(6)?)?,
                phase: match phase.as_str() {
                    "pending" => EventPhase::Pending,
                    "done" => EventPhase::Done,
                    "failed" => EventPhase::Failed,
                    "recovered" => EventPhase::Recovered,
                    other => return Err(corrupt("events", &id, format!("phase {other:?}"))),
                },
                detail: r.try_get(8)?,
            });
        }
        Ok(out)
    }

    fn counts(&self, tenant: Option<&str>) -> StoreResult<StoreCounts> {
        self.block(async {
            let c = self.client().await?;
            let mut out = StoreCounts::default();
            // `$1 IS NULL`: every tenant.
            for r in c
                .query(
                    "SELECT state, count(*) FROM sandboxes WHERE state != 'deleted' \
                     AND ($1::text IS NULL OR tenant_id = $1) GROUP BY state",
                    &[&tenant],
                )
                .await?
            {
                let n: i64 = r.try_get(1)?;
                out.sandboxes_by_state
                    .insert(r.try_get(0)?, n.max(0) as u64);
            }
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM snapshots WHERE status = 'ready' \
                     AND ($1::text IS NULL OR tenant_id = $1)",
                    &[&tenant],
                )
                .await?
                .try_get(0)?;
            out.snapshots_ready = n.max(0) as u64;
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM templates WHERE status = 'ready' \
                     AND ($1::text IS NULL OR tenant_id = $1 OR tenant_id = '@platform')",
                    &[&tenant],
                )
                .await?
                .try_get(0)?;
            out.templates_ready = n.max(0) as u64;
            Ok(out)
        })
    }

    fn tenant_usage(&self, tenant: &str) -> StoreResult<TenantUsage> {
        self.block(async {
            let c = self.client().await?;
            let r = c
                .query_one(
                    "SELECT count(*), \
                     coalesce(sum(CASE WHEN state IN ('creating', 'running', 'paused') \
                         OR pending_op IN ('resume', 'rewind', 'recover') THEN vcpus ELSE 0 END), 0)::bigint, \
                     coalesce(sum(CASE WHEN state IN ('creating', 'running', 'paused') \
                         OR pending_op IN ('resume', 'rewind', 'recover') THEN memory_mib ELSE 0 END), 0)::bigint \
                     FROM sandboxes WHERE tenant_id = $1 AND state != 'deleted'",
                    &[&tenant],
                )
                .await?;
            let (n, v, m): (i64, i64, i64) = (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?);
            Ok(TenantUsage {
                sandboxes: n.max(0) as u64,
                vcpus: v.max(0) as u64,
                memory_mib: m.max(0) as u64,
            })
        })
    }

    fn tenant_ready_snapshots(&self, tenant: &str) -> StoreResult<Vec<SnapshotRecord>> {
        self.block(self.snapshots(
            &format!(
                "SELECT {SNAPSHOT_SELECT} FROM snapshots WHERE tenant_id = $1 AND status = 'ready' \
                 ORDER BY sandbox_id, created_at, id"
            ),
            &[&tenant],
        ))
    }

    fn snapshot_charges(&self, tenant: &str) -> StoreResult<Vec<SnapshotCharge>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(
                    "SELECT c.snapshot_id, c.tenant_id, c.sandbox_id, c.base, c.bytes, c.computed_at \
                     FROM snapshot_charges c JOIN snapshots s ON s.id = c.snapshot_id \
                     WHERE c.tenant_id = $1 AND s.status = 'ready'",
                )
                .await?;
            c.query(&stmt, &[&tenant])
                .await?
                .iter()
                .map(|r| {
                    charge_record((
                        r.try_get(0)?,
                        r.try_get(1)?,
                        r.try_get(2)?,
                        r.try_get(3)?,
                        r.try_get(4)?,
                        r.try_get(5)?,
                    ))
                })
                .collect()
        })
    }

    fn put_charge(&self, c: &SnapshotCharge) -> StoreResult<()> {
        let bytes = i64_of(c.bytes);
        self.block(async {
            self.exec(
                "INSERT INTO snapshot_charges \
                 (snapshot_id, tenant_id, sandbox_id, base, bytes, computed_at) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (snapshot_id) DO UPDATE SET \
                 tenant_id = EXCLUDED.tenant_id, sandbox_id = EXCLUDED.sandbox_id, \
                 base = EXCLUDED.base, bytes = EXCLUDED.bytes, computed_at = EXCLUDED.computed_at",
                &[
                    &c.snapshot_id.as_str(),
                    &c.tenant,
                    &c.sandbox_id.as_str(),
                    &c.base,
                    &bytes,
                    &ms(c.computed_at),
                ],
            )
            .await
        })?;
        Ok(())
    }

    fn append_journal(&self, note: &JournalNote) -> StoreResult<i64> {
        let limit = self.delivery_limit.load(Ordering::Relaxed);
        let seq = self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            let seq = insert_note(&*tx, note, limit).await?;
            tx.batch_execute(&format!("NOTIFY {CHANNEL}")).await?;
            tx.commit().await?;
            Ok(seq)
        })?;
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
        let limit = limit.clamp(1, 10_000) as i64;
        self.block(async {
            let c = self.client().await?;
            let rows = match sandbox {
                Some(sb) => {
                    let stmt = c
                        .prepare_cached(&format!(
                            "SELECT {JCOLS} FROM events WHERE sandbox_id = $1 AND tenant_id = $2 \
                             AND seq > $3 ORDER BY seq LIMIT $4"
                        ))
                        .await?;
                    c.query(&stmt, &[&sb, &tenant, &after, &limit]).await?
                }
                None => {
                    let stmt = c
                        .prepare_cached(&format!(
                            "SELECT {JCOLS} FROM events WHERE tenant_id = $1 AND seq > $2 \
                             ORDER BY seq LIMIT $3"
                        ))
                        .await?;
                    c.query(&stmt, &[&tenant, &after, &limit]).await?
                }
            };
            rows.iter().map(journal_of).collect()
        })
    }

    fn journal_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn prune_journal(&self, before: DateTime<Utc>) -> StoreResult<u64> {
        self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            // The append-only trigger lets deletes through in this
            // transaction only.
            tx.batch_execute("SET LOCAL strata.journal_pruning = 'on'")
                .await?;
            let n = tx
                .execute("DELETE FROM events WHERE at < $1", &[&ms(before)])
                .await?;
            tx.execute(
                "DELETE FROM webhook_deliveries WHERE status != 'pending' AND updated_at < $1",
                &[&ms(before)],
            )
            .await?;
            tx.commit().await?;
            Ok(n)
        })
    }

    fn set_delivery_limit(&self, limit: usize) {
        self.delivery_limit.store(limit, Ordering::Relaxed);
    }

    fn put_webhook(&self, h: &Webhook) -> StoreResult<()> {
        let events = serde_json::to_string(&h.events).unwrap_or_else(|_| "[]".into());
        self.block(async {
            self.exec(
                &format!("INSERT INTO webhooks ({HCOLS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)"),
                &[
                    &h.id,
                    &h.tenant,
                    &h.url,
                    &events,
                    &h.format.as_str(),
                    &h.secret_sealed,
                    &h.created_by,
                    &ms(h.created_at),
                ],
            )
            .await
        })?;
        Ok(())
    }

    fn webhooks(&self, tenant: &str) -> StoreResult<Vec<Webhook>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(&format!(
                    "SELECT {HCOLS} FROM webhooks WHERE tenant_id = $1 AND deleted_at IS NULL \
                     ORDER BY created_at, id"
                ))
                .await?;
            c.query(&stmt, &[&tenant])
                .await?
                .iter()
                .map(webhook_of)
                .collect()
        })
    }

    fn get_webhook(&self, tenant: &str, id: &str) -> StoreResult<Option<Webhook>> {
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(&format!(
                    "SELECT {HCOLS} FROM webhooks WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL"
                ))
                .await?;
            c.query_opt(&stmt, &[&id, &tenant])
                .await?
                .as_ref()
                .map(webhook_of)
                .transpose()
        })
    }

    fn delete_webhook(&self, tenant: &str, id: &str, at: DateTime<Utc>) -> StoreResult<bool> {
        self.block(async {
            let mut c = self.client().await?;
            let tx = c.transaction().await?;
            let n = tx
                .execute(
                    "UPDATE webhooks SET deleted_at = $3 WHERE id = $1 AND tenant_id = $2 \
                     AND deleted_at IS NULL",
                    &[&id, &tenant, &ms(at)],
                )
                .await?;
            tx.execute(
                "UPDATE webhook_deliveries SET status = 'cancelled', next_attempt_at = NULL, \
                 updated_at = $2 WHERE webhook_id = $1 AND status = 'pending'",
                &[&id, &ms(at)],
            )
            .await?;
            tx.commit().await?;
            Ok(n > 0)
        })
    }

    fn due_deliveries(&self, now: DateTime<Utc>, limit: usize) -> StoreResult<Vec<Delivery>> {
        let limit = limit.clamp(1, 1000) as i64;
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(&format!(
                    "SELECT {DCOLS} FROM webhook_deliveries WHERE status = 'pending' \
                     AND next_attempt_at <= $1 ORDER BY next_attempt_at, id LIMIT $2"
                ))
                .await?;
            c.query(&stmt, &[&ms(now), &limit])
                .await?
                .iter()
                .map(delivery_of)
                .collect()
        })
    }

    fn next_delivery_at(&self) -> StoreResult<Option<DateTime<Utc>>> {
        self.block(async {
            let c = self.client().await?;
            let v: Option<i64> = c
                .query_one(
                    "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'",
                    &[],
                )
                .await?
                .try_get(0)?;
            Ok(v.map(from_ms))
        })
    }

    fn update_delivery(&self, d: &Delivery) -> StoreResult<()> {
        self.block(async {
            self.exec(
                "UPDATE webhook_deliveries SET status = $2, attempts = $3, last_status = $4, \
                 last_error = $5, next_attempt_at = $6, updated_at = $7 WHERE id = $1",
                &[
                    &d.id,
                    &d.status.as_str(),
                    &i64::from(d.attempts),
                    &d.last_status.map(i64::from),
                    &d.last_error,
                    &d.next_attempt_at.map(ms),
                    &ms(d.updated_at),
                ],
            )
            .await
        })?;
        Ok(())
    }

    fn deliveries(&self, webhook: &str, limit: usize) -> StoreResult<Vec<Delivery>> {
        let limit = limit.clamp(1, 1000) as i64;
        self.block(async {
            let c = self.client().await?;
            let stmt = c
                .prepare_cached(&format!(
                    "SELECT {DCOLS} FROM webhook_deliveries WHERE webhook_id = $1 \
                     ORDER BY id DESC LIMIT $2"
                ))
                .await?;
            c.query(&stmt, &[&webhook, &limit])
                .await?
                .iter()
                .map(delivery_of)
                .collect()
        })
    }
}

#[cfg(test)]
mod tests;
