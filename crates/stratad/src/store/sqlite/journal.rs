//! The journal's other kinds, its retention, and webhooks with their
//! delivery queue (schema 14) in SQLite.

use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, OptionalExtension, Row};
use serde_json::{json, Value};

use super::rows::{from_ms, ms};
use crate::store::*;

/// Appends `note` and queues its deliveries (in the caller's transaction).
pub(super) fn insert_note(tx: &Connection, note: &JournalNote, limit: usize) -> StoreResult<i64> {
    tx.execute(
        "INSERT INTO events (at, tenant_id, sandbox_id, op, phase, kind, data) \
         VALUES (?1,?2,?3,?4,'done',?4,?5)",
        params![
            ms(note.at),
            note.tenant,
            note.sandbox_id,
            note.kind.as_str(),
            note.data.to_string(),
        ],
    )?;
    let seq = tx.last_insert_rowid();
    let entry = JournalEntry {
        seq,
        at: note.at,
        tenant: note.tenant.clone(),
        sandbox_id: note.sandbox_id.clone(),
        kind: note.kind,
        data: note.data.clone(),
    };
    queue_deliveries(tx, &entry, &note.topic, limit)?;
    Ok(seq)
}

/// Queues one delivery of `entry` to each of its tenant's webhooks that
/// subscribe to `topic` (or to its kind), while the tenant has fewer than
/// `limit` pending.
fn queue_deliveries(
    tx: &Connection,
    entry: &JournalEntry,
    topic: &str,
    limit: usize,
) -> StoreResult<()> {
    let hooks: Vec<(String, String)> = {
        let mut stmt = tx.prepare_cached(
            "SELECT id, events FROM webhooks WHERE tenant_id = ?1 AND deleted_at IS NULL",
        )?;
        let rows = stmt
            .query_map([&entry.tenant], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        rows
    };
    let kind = entry.kind.as_str();
    let wanted: Vec<String> = hooks
        .into_iter()
        .filter(|(_, events)| {
            serde_json::from_str::<Vec<String>>(events)
                .unwrap_or_default()
                .iter()
                .any(|e| e == topic || e == kind || e == "*")
        })
        .map(|(id, _)| id)
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let pending: i64 = tx.query_row(
        "SELECT count(*) FROM webhook_deliveries WHERE tenant_id = ?1 AND status = 'pending'",
        [&entry.tenant],
        |r| r.get(0),
    )?;
    let message = entry.message().to_string();
    let now = ms(entry.at);
    for (i, id) in wanted.iter().enumerate() {
        if pending as usize + i >= limit {
            tracing::warn!(tenant = %entry.tenant, webhook = %id, seq = entry.seq, limit, "webhook queue full: delivery dropped");
            continue;
        }
        tx.execute(
            "INSERT INTO webhook_deliveries (webhook_id, tenant_id, event_seq, topic, event, \
             status, attempts, next_attempt_at, created_at, updated_at) \
             VALUES (?1,?2,?3,?4,?5,'pending',0,?6,?6,?6)",
            params![id, entry.tenant, entry.seq, topic, message, now],
        )?;
    }
    Ok(())
}

/// The journal row a snapshot write makes: `taken` when it becomes ready,
/// `pruned` when a ready one is deleted (template snapshots: none).
pub(super) fn snapshot_note(
    tx: &Connection,
    rec: &SnapshotRecord,
    limit: usize,
) -> StoreResult<()> {
    if rec.kind == SnapshotKind::Template {
        return Ok(());
    }
    let before: Option<String> = tx
        .query_row(
            "SELECT status FROM snapshots WHERE id = ?1",
            [rec.id.as_str()],
            |r| r.get(0),
        )
        .optional()?;
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
    insert_note(tx, &note, limit).map(|_| ())
}

pub(in crate::store) type JRow = (
    i64,
    i64,
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    String,
    Option<String>,
    String,
    Option<String>,
);

fn jrow(r: &Row<'_>) -> rusqlite::Result<JRow> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
        r.get(10)?,
    ))
}

pub(in crate::store) fn entry(
    (seq, at, tenant, sb, op, from, to, phase, detail, kind, data): JRow,
) -> JournalEntry {
    let (kind, data) = match kind.as_str() {
        "snapshot" => (JournalKind::Snapshot, data),
        "approval" => (JournalKind::Approval, data),
        "policy" => (JournalKind::Policy, data),
        _ => (JournalKind::Sandbox, None),
    };
    let data = match (kind, data) {
        (JournalKind::Sandbox, _) => json!({
            "op": op,
            "from_state": from,
            "to_state": to,
            "phase": phase,
            "detail": detail,
        }),
        (_, Some(d)) => serde_json::from_str(&d).unwrap_or_else(|_| json!({})),
        (_, None) => json!({}),
    };
    JournalEntry {
        seq,
        at: from_ms(at),
        tenant,
        sandbox_id: sb,
        kind,
        data,
    }
}

pub(in crate::store) const JCOLS: &str =
    "seq, at, tenant_id, sandbox_id, op, from_state, to_state, phase, detail, kind, data";

pub(super) fn journal_after(
    conn: &Connection,
    tenant: &str,
    sandbox: Option<&str>,
    after: i64,
    limit: usize,
) -> StoreResult<Vec<JournalEntry>> {
    let limit = limit.clamp(1, 10_000) as i64;
    let rows: Vec<JRow> = match sandbox {
        Some(sb) => {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {JCOLS} FROM events WHERE sandbox_id = ?1 AND tenant_id = ?2 \
                 AND seq > ?3 ORDER BY seq LIMIT ?4"
            ))?;
            let v = stmt
                .query_map(params![sb, tenant, after, limit], jrow)?
                .collect::<Result<Vec<_>, _>>()?;
            v
        }
        None => {
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {JCOLS} FROM events WHERE tenant_id = ?1 AND seq > ?2 \
                 ORDER BY seq LIMIT ?3"
            ))?;
            let v = stmt
                .query_map(params![tenant, after, limit], jrow)?
                .collect::<Result<Vec<_>, _>>()?;
            v
        }
    };
    Ok(rows.into_iter().map(entry).collect())
}

pub(super) fn prune(tx: &Connection, before: DateTime<Utc>) -> StoreResult<u64> {
    // The append-only trigger lets deletes through while this row exists
    // (this transaction only).
    tx.execute("INSERT INTO journal_pruning (active) VALUES (1)", [])?;
    let n = tx.execute("DELETE FROM events WHERE at < ?1", [ms(before)])?;
    tx.execute("DELETE FROM journal_pruning", [])?;
    tx.execute(
        "DELETE FROM webhook_deliveries WHERE status != 'pending' AND updated_at < ?1",
        [ms(before)],
    )?;
    Ok(n as u64)
}

pub(in crate::store) const HCOLS: &str =
    "id, tenant_id, url, events, format, secret, created_by, created_at";

fn hook(r: &Row<'_>) -> rusqlite::Result<Webhook> {
    let events: String = r.get(3)?;
    let format: String = r.get(4)?;
    Ok(Webhook {
        id: r.get(0)?,
        tenant: r.get(1)?,
        url: r.get(2)?,
        events: serde_json::from_str(&events).unwrap_or_default(),
        format: WebhookFormat::parse(&format).unwrap_or_default(),
        secret_sealed: r.get(5)?,
        created_by: r.get(6)?,
        created_at: from_ms(r.get(7)?),
    })
}

pub(super) fn put_webhook(tx: &Connection, h: &Webhook) -> StoreResult<()> {
    tx.execute(
        &format!("INSERT INTO webhooks ({HCOLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8)"),
        params![
            h.id,
            h.tenant,
            h.url,
            serde_json::to_string(&h.events).unwrap_or_else(|_| "[]".into()),
            h.format.as_str(),
            h.secret_sealed,
            h.created_by,
            ms(h.created_at),
        ],
    )?;
    Ok(())
}

pub(super) fn webhooks(conn: &Connection, tenant: &str) -> StoreResult<Vec<Webhook>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {HCOLS} FROM webhooks WHERE tenant_id = ?1 AND deleted_at IS NULL \
         ORDER BY created_at, id"
    ))?;
    let v = stmt
        .query_map([tenant], hook)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(v)
}

pub(super) fn get_webhook(
    conn: &Connection,
    tenant: &str,
    id: &str,
) -> StoreResult<Option<Webhook>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {HCOLS} FROM webhooks WHERE id = ?1 AND tenant_id = ?2 AND deleted_at IS NULL"
    ))?;
    Ok(stmt.query_row([id, tenant], hook).optional()?)
}

pub(super) fn delete_webhook(
    tx: &Connection,
    tenant: &str,
    id: &str,
    at: DateTime<Utc>,
) -> StoreResult<bool> {
    let n = tx.execute(
        "UPDATE webhooks SET deleted_at = ?3 WHERE id = ?1 AND tenant_id = ?2 AND deleted_at IS NULL",
        params![id, tenant, ms(at)],
    )?;
    tx.execute(
        "UPDATE webhook_deliveries SET status = 'cancelled', next_attempt_at = NULL, updated_at = ?2 \
         WHERE webhook_id = ?1 AND status = 'pending'",
        params![id, ms(at)],
    )?;
    Ok(n > 0)
}

pub(in crate::store) const DCOLS: &str =
    "id, webhook_id, tenant_id, event_seq, topic, event, status, attempts, \
                     last_status, last_error, next_attempt_at, created_at, updated_at";

fn delivery(r: &Row<'_>) -> rusqlite::Result<Delivery> {
    let event: String = r.get(5)?;
    let status: String = r.get(6)?;
    let next: Option<i64> = r.get(10)?;
    let last_status: Option<i64> = r.get(8)?;
    Ok(Delivery {
        id: r.get(0)?,
        webhook_id: r.get(1)?,
        tenant: r.get(2)?,
        event_seq: r.get(3)?,
        topic: r.get(4)?,
        event: serde_json::from_str(&event).unwrap_or(Value::Null),
        status: DeliveryStatus::parse(&status).unwrap_or(DeliveryStatus::Failed),
        attempts: r.get::<_, i64>(7)?.clamp(0, u32::MAX as i64) as u32,
        last_status: last_status.map(|s| s.clamp(0, u16::MAX as i64) as u16),
        last_error: r.get(9)?,
        next_attempt_at: next.map(from_ms),
        created_at: from_ms(r.get(11)?),
        updated_at: from_ms(r.get(12)?),
    })
}

pub(super) fn due(
    conn: &Connection,
    now: DateTime<Utc>,
    limit: usize,
) -> StoreResult<Vec<Delivery>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {DCOLS} FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ?1 \
         ORDER BY next_attempt_at, id LIMIT ?2"
    ))?;
    let v = stmt
        .query_map(params![ms(now), limit.clamp(1, 1000) as i64], delivery)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(v)
}

pub(super) fn next_due(conn: &Connection) -> StoreResult<Option<DateTime<Utc>>> {
    let v: Option<i64> = conn.query_row(
        "SELECT min(next_attempt_at) FROM webhook_deliveries WHERE status = 'pending'",
        [],
        |r| r.get(0),
    )?;
    Ok(v.map(from_ms))
}

pub(super) fn update_delivery(tx: &Connection, d: &Delivery) -> StoreResult<()> {
    tx.execute(
        "UPDATE webhook_deliveries SET status = ?2, attempts = ?3, last_status = ?4, \
         last_error = ?5, next_attempt_at = ?6, updated_at = ?7 WHERE id = ?1",
        params![
            d.id,
            d.status.as_str(),
            d.attempts as i64,
            d.last_status.map(i64::from),
            d.last_error,
            d.next_attempt_at.map(ms),
            ms(d.updated_at),
        ],
    )?;
    Ok(())
}

pub(super) fn deliveries(
    conn: &Connection,
    webhook: &str,
    limit: usize,
) -> StoreResult<Vec<Delivery>> {
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT {DCOLS} FROM webhook_deliveries WHERE webhook_id = ?1 ORDER BY id DESC LIMIT ?2"
    ))?;
    let v = stmt
        .query_map(params![webhook, limit.clamp(1, 1000) as i64], delivery)?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(v)
}
