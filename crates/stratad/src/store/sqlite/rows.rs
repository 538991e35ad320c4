//! Rows ⇄ records: column lists, row decoding (parse errors are
//! `StoreError::Corrupt`, never a panic), cursors, and the writes of one
//! transaction (the sandbox write is a compare-and-set on its version).

use base64::Engine as _;
use chrono::{DateTime, Utc};
use rusqlite::{params, Connection, OptionalExtension, Row};
use strata_core::{Op, SandboxId, SandboxSize, SandboxState};

use super::*;

/// The first columns of a row as a tuple (`columns!(row; 0 1 2)`).
macro_rules! columns {
    ($r:expr; $($i:tt)*) => {
        ($($r.get($i)?,)*)
    };
}
pub(in crate::store) use columns;

pub(in crate::store) fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

pub(in crate::store) fn from_ms(v: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(v).unwrap_or_default()
}

pub(in crate::store) fn op_str(op: Op) -> String {
    op.to_string()
}

pub(in crate::store) fn parse_op(s: &str) -> Option<Op> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).ok()
}

pub(in crate::store) fn corrupt(
    table: &'static str,
    id: &str,
    what: impl Into<String>,
) -> StoreError {
    StoreError::Corrupt {
        table,
        id: id.to_owned(),
        what: what.into(),
    }
}

pub(in crate::store) const SANDBOX_COLS: &str =
    "id, tenant_id, template_id, source_snapshot_id, vcpus, memory_mib, \
    disk_gib, labels, state, state_reason, pending_op, idle_timeout_s, snapshot_interval_s, \
    created_at, updated_at, last_activity_at, pid, accel, deleted_at, version";

/// Raw row, converted outside rusqlite's closure so parse errors are ours.
pub(in crate::store) struct SandboxRow {
    pub(in crate::store) id: String,
    pub(in crate::store) tenant: String,
    pub(in crate::store) template: Option<String>,
    pub(in crate::store) source: Option<String>,
    pub(in crate::store) vcpus: u32,
    pub(in crate::store) memory_mib: u32,
    pub(in crate::store) disk_gib: u32,
    pub(in crate::store) labels: String,
    pub(in crate::store) state: String,
    pub(in crate::store) state_reason: Option<String>,
    pub(in crate::store) pending_op: Option<String>,
    pub(in crate::store) idle: Option<i64>,
    pub(in crate::store) interval: Option<i64>,
    pub(in crate::store) created: i64,
    pub(in crate::store) updated: i64,
    pub(in crate::store) activity: i64,
    pub(in crate::store) pid: Option<i64>,
    pub(in crate::store) accel: Option<String>,
    pub(in crate::store) deleted: Option<i64>,
    pub(in crate::store) version: i64,
}

pub(in crate::store) fn sandbox_row(r: &Row<'_>) -> rusqlite::Result<SandboxRow> {
    Ok(SandboxRow {
        id: r.get(0)?,
        tenant: r.get(1)?,
        template: r.get(2)?,
        source: r.get(3)?,
        vcpus: r.get(4)?,
        memory_mib: r.get(5)?,
        disk_gib: r.get(6)?,
        labels: r.get(7)?,
        state: r.get(8)?,
        state_reason: r.get(9)?,
        pending_op: r.get(10)?,
        idle: r.get(11)?,
        interval: r.get(12)?,
        created: r.get(13)?,
        updated: r.get(14)?,
        activity: r.get(15)?,
        pid: r.get(16)?,
        accel: r.get(17)?,
        deleted: r.get(18)?,
        version: r.get(19)?,
    })
}

impl SandboxRow {
    pub(in crate::store) fn into_record(self) -> StoreResult<SandboxRecord> {
        let t = "sandboxes";
        let id: SandboxId = self
            .id
            .parse()
            .map_err(|e| corrupt(t, &self.id, format!("{e}")))?;
        let template = match self.template {
            Some(s) => Some(
                s.parse()
                    .map_err(|e| corrupt(t, &self.id, format!("{e}")))?,
            ),
            None => None,
        };
        let source_snapshot = match self.source {
            Some(s) => Some(
                s.parse()
                    .map_err(|e| corrupt(t, &self.id, format!("{e}")))?,
            ),
            None => None,
        };
        let labels = serde_json::from_str(&self.labels)
            .map_err(|e| corrupt(t, &self.id, format!("labels: {e}")))?;
        let state = self
            .state
            .parse()
            .map_err(|e: String| corrupt(t, &self.id, e))?;
        let pending_op = match self.pending_op {
            Some(s) => Some(parse_op(&s).ok_or_else(|| corrupt(t, &self.id, format!("op {s:?}")))?),
            None => None,
        };
        Ok(SandboxRecord {
            id,
            tenant: self.tenant,
            template,
            source_snapshot,
            size: SandboxSize {
                vcpus: self.vcpus,
                memory_mib: self.memory_mib,
                disk_gib: self.disk_gib,
            },
            labels,
            state,
            state_reason: self.state_reason,
            pending_op,
            idle_timeout_s: self.idle.map(|v| v.max(0) as u64),
            snapshot_interval_s: self.interval.map(|v| v.max(0) as u64),
            created_at: from_ms(self.created),
            updated_at: from_ms(self.updated),
            last_activity_at: from_ms(self.activity),
            pid: self.pid.and_then(|p| u32::try_from(p).ok()),
            accel: self.accel,
            deleted_at: self.deleted.map(from_ms),
            version: self.version.max(0) as u64,
        })
    }
}

pub(in crate::store) const SNAPSHOT_COLS: &str =
    "id, tenant_id, sandbox_id, kind, label, status, status_reason, \
    created_at, pause_ms, exclusive_bytes, referenced_bytes, same_as";

/// What a snapshot query selects: the columns, then its cached charge.
pub(in crate::store) const SNAPSHOT_SELECT: &str =
    "id, tenant_id, sandbox_id, kind, label, status, status_reason, \
    created_at, pause_ms, exclusive_bytes, referenced_bytes, same_as, \
    (SELECT c.bytes FROM snapshot_charges c WHERE c.snapshot_id = snapshots.id)";

pub(in crate::store) type SnapshotRow = (
    String,
    String,
    String,
    String,
    Option<String>,
    String,
    Option<String>,
    i64,
    Option<f64>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
);

pub(in crate::store) fn snapshot_row(r: &Row<'_>) -> rusqlite::Result<SnapshotRow> {
    Ok(columns!(r; 0 1 2 3 4 5 6 7 8 9 10 11 12))
}

pub(in crate::store) fn snapshot_record(row: SnapshotRow) -> StoreResult<SnapshotRecord> {
    let (
        id,
        tenant,
        sandbox,
        kind,
        label,
        status,
        reason,
        created,
        pause,
        excl,
        refd,
        same,
        charge,
    ) = row;
    let t = "snapshots";
    Ok(SnapshotRecord {
        id: id.parse().map_err(|e| corrupt(t, &id, format!("{e}")))?,
        tenant,
        sandbox_id: sandbox
            .parse()
            .map_err(|e| corrupt(t, &id, format!("{e}")))?,
        kind: SnapshotKind::parse(&kind)
            .ok_or_else(|| corrupt(t, &id, format!("kind {kind:?}")))?,
        label,
        status: SnapshotStatus::parse(&status)
            .ok_or_else(|| corrupt(t, &id, format!("status {status:?}")))?,
        status_reason: reason,
        created_at: from_ms(created),
        pause_ms: pause,
        exclusive_bytes: excl.map(|v| v.max(0) as u64),
        referenced_bytes: refd.map(|v| v.max(0) as u64),
        charge_bytes: charge.map(|v| v.max(0) as u64),
        same_as: same
            .map(|x| {
                x.parse()
                    .map_err(|e| corrupt(t, &id, format!("same_as: {e}")))
            })
            .transpose()?,
    })
}

pub(in crate::store) type ChargeRow = (String, String, String, String, i64, i64);

pub(in crate::store) fn charge_row(r: &Row<'_>) -> rusqlite::Result<ChargeRow> {
    Ok(columns!(r; 0 1 2 3 4 5))
}

pub(in crate::store) fn charge_record(row: ChargeRow) -> StoreResult<SnapshotCharge> {
    let (id, tenant, sandbox, base, bytes, at) = row;
    let t = "snapshot_charges";
    Ok(SnapshotCharge {
        snapshot_id: id.parse().map_err(|e| corrupt(t, &id, format!("{e}")))?,
        tenant,
        sandbox_id: sandbox
            .parse()
            .map_err(|e| corrupt(t, &id, format!("{e}")))?,
        base,
        bytes: bytes.max(0) as u64,
        computed_at: from_ms(at),
    })
}

pub(in crate::store) const TEMPLATE_COLS: &str =
    "id, tenant_id, name, vcpus, memory_mib, disk_gib, status, \
    status_reason, accel, created_at, updated_at, variant_of";

pub(in crate::store) type TemplateRow = (
    String,
    String,
    Option<String>,
    u32,
    u32,
    u32,
    String,
    Option<String>,
    Option<String>,
    i64,
    i64,
    Option<String>,
);

pub(in crate::store) fn template_row(r: &Row<'_>) -> rusqlite::Result<TemplateRow> {
    Ok(columns!(r; 0 1 2 3 4 5 6 7 8 9 10 11))
}

pub(in crate::store) fn template_record(row: TemplateRow) -> StoreResult<TemplateRecord> {
    let (
        id,
        tenant,
        name,
        vcpus,
        memory_mib,
        disk_gib,
        status,
        reason,
        accel,
        created,
        updated,
        variant_of,
    ) = row;
    let t = "templates";
    Ok(TemplateRecord {
        id: id.parse().map_err(|e| corrupt(t, &id, format!("{e}")))?,
        tenant,
        name,
        size: SandboxSize {
            vcpus,
            memory_mib,
            disk_gib,
        },
        status: TemplateStatus::parse(&status)
            .ok_or_else(|| corrupt(t, &id, format!("status {status:?}")))?,
        status_reason: reason,
        accel,
        created_at: from_ms(created),
        updated_at: from_ms(updated),
        variant_of: variant_of
            .map(|v| {
                v.parse()
                    .map_err(|e| corrupt(t, &id, format!("variant_of: {e}")))
            })
            .transpose()?,
    })
}

pub(in crate::store) fn encode_cursor(created: DateTime<Utc>, id: &SandboxId) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{}:{}", ms(created), id))
}

pub(in crate::store) fn decode_cursor(c: &str) -> StoreResult<(i64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .map_err(|_| StoreError::BadCursor)?;
    let s = String::from_utf8(raw).map_err(|_| StoreError::BadCursor)?;
    let (t, id) = s.split_once(':').ok_or(StoreError::BadCursor)?;
    let t: i64 = t.parse().map_err(|_| StoreError::BadCursor)?;
    id.parse::<SandboxId>().map_err(|_| StoreError::BadCursor)?;
    Ok((t, id.to_owned()))
}

pub(in crate::store) fn write_sandbox(
    tx: &Connection,
    rec: &SandboxRecord,
    insert: bool,
) -> StoreResult<()> {
    let labels = serde_json::to_string(&rec.labels).unwrap_or_else(|_| "{}".into());
    let verb = if insert { "INSERT" } else { "REPLACE" };
    // Compare-and-set: an update must come from the stored version (the
    // writer connection is exclusive and this runs in its transaction).
    let version = if insert {
        rec.version
    } else {
        let found: Option<i64> = tx
            .query_row(
                "SELECT version FROM sandboxes WHERE id = ?1",
                [rec.id.as_str()],
                |r| r.get(0),
            )
            .optional()?;
        let found = found.map(|v| v.max(0) as u64);
        if let Some(found) = found.filter(|f| *f != rec.version) {
            return Err(StoreError::Stale {
                id: rec.id.to_string(),
                expected: rec.version,
                found,
            });
        }
        rec.version + 1
    };
    tx.execute(
        &format!("{verb} INTO sandboxes ({SANDBOX_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?17,?18,?19,?20)"),
        params![
            rec.id.as_str(),
            rec.tenant,
            rec.template.as_ref().map(|t| t.as_str().to_owned()),
            rec.source_snapshot.as_ref().map(|t| t.as_str().to_owned()),
            rec.size.vcpus,
            rec.size.memory_mib,
            rec.size.disk_gib,
            labels,
            rec.state.as_str(),
            rec.state_reason,
            rec.pending_op.map(op_str),
            rec.idle_timeout_s.map(|v| v.min(i64::MAX as u64) as i64),
            rec.snapshot_interval_s.map(|v| v.min(i64::MAX as u64) as i64),
            ms(rec.created_at),
            ms(rec.updated_at),
            ms(rec.last_activity_at),
            rec.pid.map(i64::from),
            rec.accel,
            rec.deleted_at.map(ms),
            i64::try_from(version).unwrap_or(i64::MAX),
        ],
    )?;
    tx.execute(
        "DELETE FROM sandbox_labels WHERE sandbox_id = ?1",
        params![rec.id.as_str()],
    )?;
    if rec.state == SandboxState::Deleted {
        tx.execute(
            "DELETE FROM sandbox_env WHERE sandbox_id = ?1",
            params![rec.id.as_str()],
        )?;
        tx.execute(
            "DELETE FROM sandbox_lifecycle WHERE sandbox_id = ?1",
            params![rec.id.as_str()],
        )?;
        tx.execute(
            "DELETE FROM sandbox_settings WHERE sandbox_id = ?1",
            params![rec.id.as_str()],
        )?;
        tx.execute(
            "DELETE FROM envd_tokens WHERE sandbox_id = ?1",
            params![rec.id.as_str()],
        )?;
    }
    if rec.state != SandboxState::Deleted {
        let mut stmt = tx.prepare_cached(
            "INSERT INTO sandbox_labels (sandbox_id, key, value, tenant_id, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
        )?;
        for (k, v) in &rec.labels {
            stmt.execute(params![
                rec.id.as_str(),
                k,
                v,
                rec.tenant,
                ms(rec.created_at)
            ])?;
        }
    }
    Ok(())
}

pub(in crate::store) fn write_snapshot(tx: &Connection, rec: &SnapshotRecord) -> StoreResult<()> {
    tx.execute(
        &format!(
            "REPLACE INTO snapshots ({SNAPSHOT_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)"
        ),
        params![
            rec.id.as_str(),
            rec.tenant,
            rec.sandbox_id.as_str(),
            rec.kind.as_str(),
            rec.label,
            rec.status.as_str(),
            rec.status_reason,
            ms(rec.created_at),
            rec.pause_ms,
            rec.exclusive_bytes.map(|v| v.min(i64::MAX as u64) as i64),
            rec.referenced_bytes.map(|v| v.min(i64::MAX as u64) as i64),
            rec.same_as.as_ref().map(|t| t.as_str()),
        ],
    )?;
    Ok(())
}

pub(in crate::store) fn write_event(tx: &Connection, ev: &Event) -> StoreResult<()> {
    tx.execute(
        "INSERT INTO events (at, tenant_id, sandbox_id, op, from_state, to_state, phase, detail) \
         VALUES (?1,?2,?3,?4,?5,?6,?7,?8)",
        params![
            ms(ev.at),
            ev.tenant,
            ev.sandbox_id.as_str(),
            op_str(ev.op),
            ev.from_state.map(|s| s.as_str()),
            ev.to_state.map(|s| s.as_str()),
            ev.phase.as_str(),
            ev.detail,
        ],
    )?;
    Ok(())
}
