//! Append-only, hash-chained audit log of policy decisions (JSON lines).
//!
//! Each line is one [`AuditEntry`]; `hash = sha256(prev_hash || canonical
//! JSON of the entry without "hash")`, hex encoded, where canonical JSON has
//! object keys sorted and no insignificant white space. The first entry's
//! `prev_hash` is 64 zeros.
//!
//! Durability: [`AuditLog::append`] writes the line and calls `fsync`
//! (`sync_data`) before it returns, so a decision acknowledged to anyone is
//! on disk. A torn last line (a crash in the middle of a write, never
//! acknowledged) is cut off when the log is reopened.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::call::ToolCall;
use crate::policy::{Decision, Effect, Layer};

/// The hash before the first entry.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What happened to the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Allowed by policy.
    Allowed,
    /// Denied by policy.
    Denied,
    /// Held for approval.
    Held,
    /// Approved by a human.
    Approved,
    /// Refused by a human.
    Rejected,
    /// Nobody answered in time (denied).
    TimedOut,
}

/// The decision part of an entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditDecision {
    /// What happened.
    pub outcome: Outcome,
    /// The policy effect.
    pub effect: Effect,
    /// Deciding rule id.
    pub rule_id: String,
    /// Deciding layer.
    pub layer: Option<Layer>,
    /// Reason shown.
    pub reason: String,
    /// Approval request id, for held / answered calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_id: Option<String>,
}

impl AuditDecision {
    /// The audit form of a policy decision.
    pub fn from_decision(d: &Decision, outcome: Outcome, approval_id: Option<String>) -> Self {
        AuditDecision {
            outcome,
            effect: d.effect,
            rule_id: d.rule_id.clone(),
            layer: d.layer,
            reason: d.reason.clone(),
            approval_id,
        }
    }
}

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// 1, 2, 3 … without gaps.
    pub seq: u64,
    /// When it was appended.
    pub time: DateTime<Utc>,
    /// Tenant.
    pub tenant: String,
    /// Sandbox.
    pub sandbox: Option<String>,
    /// Who made the call.
    pub actor: String,
    /// The call.
    pub call: ToolCall,
    /// What was decided.
    pub decision: AuditDecision,
    /// Who answered, for human decisions.
    pub by: Option<String>,
    /// Hash of the previous entry.
    pub prev_hash: String,
    /// This entry's hash.
    pub hash: String,
}

/// Errors of the audit log.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// File I/O failed.
    #[error("audit log {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The chain is broken.
    #[error("audit log broken at line {line} (seq {seq:?}): {problem}")]
    Broken {
        /// 1-based line number.
        line: usize,
        /// Sequence number at or expected at that line.
        seq: Option<u64>,
        /// What is wrong.
        problem: String,
    },
    /// An entry could not be encoded.
    #[error("encoding audit entry")]
    Encode(#[source] serde_json::Error),
}

fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let mut out = serde_json::Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// Hash of an entry given as a JSON object (its `hash` field is ignored).
pub fn entry_hash(prev_hash: &str, entry: &Value) -> String {
    let mut v = canonical(entry);
    if let Value::Object(m) = &mut v {
        m.remove("hash");
    }
    let mut h = Sha256::new();
    h.update(prev_hash.as_bytes());
    h.update(v.to_string().as_bytes());
    hex::encode(h.finalize())
}

struct State {
    file: File,
    seq: u64,
    head: String,
}

/// An open audit log, appended to by one process.
pub struct AuditLog {
    path: PathBuf,
    state: Mutex<State>,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("path", &self.path)
            .finish()
    }
}

/// Filter for queries and exports.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only this sandbox.
    pub sandbox: Option<String>,
}

impl Filter {
    fn matches(&self, e: &AuditEntry) -> bool {
        self.tenant.as_ref().is_none_or(|t| &e.tenant == t)
            && self
                .sandbox
                .as_ref()
                .is_none_or(|s| e.sandbox.as_ref() == Some(s))
    }
}

/// Summary of a verified log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Number of entries.
    pub entries: u64,
    /// Hash of the last entry ([`GENESIS`] for an empty log).
    pub head: String,
}

impl AuditLog {
    /// Open (or create) a log; verifies the existing chain and cuts off a
    /// torn, unterminated last line.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        let io = |source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io)?;
        if !buf.is_empty() && buf.last() != Some(&b'\n') {
            let keep = buf
                .iter()
                .rposition(|&b| b == b'\n')
                .map(|i| i + 1)
                .unwrap_or(0);
            tracing::warn!(path = %path.display(), "cutting a torn last audit line");
            file.set_len(keep as u64).map_err(io)?;
            file.sync_data().map_err(io)?;
            buf.truncate(keep);
        }
        file.seek(SeekFrom::End(0)).map_err(io)?;
        let v = verify_reader(&buf[..])?;
        Ok(AuditLog {
            path: path.to_path_buf(),
            state: Mutex::new(State {
                file,
                seq: v.entries,
                head: v.head,
            }),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sequence number and hash of the last entry; keep them elsewhere (e.g.
    /// the daemon's database) to detect a cut-off tail with [`verify_head`].
    pub fn head(&self) -> (u64, String) {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (s.seq, s.head.clone())
    }

    /// Append one decision; returns after the line is on disk.
    pub fn append(
        &self,
        call: &ToolCall,
        decision: AuditDecision,
        by: Option<String>,
    ) -> Result<AuditEntry, AuditError> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut entry = AuditEntry {
            seq: s.seq + 1,
            time: Utc::now(),
            tenant: call.tenant.clone(),
            sandbox: call.sandbox.clone(),
            actor: call.actor.clone(),
            call: call.clone(),
            decision,
            by,
            prev_hash: s.head.clone(),
            hash: String::new(),
        };
        let v = serde_json::to_value(&entry).map_err(AuditError::Encode)?;
        entry.hash = entry_hash(&s.head, &v);
        let mut line = serde_json::to_vec(&entry).map_err(AuditError::Encode)?;
        line.push(b'\n');
        let io = |source| AuditError::Io {
            path: self.path.clone(),
            source,
        };
        s.file.write_all(&line).map_err(io)?;
        s.file.sync_data().map_err(io)?;
        s.seq = entry.seq;
        s.head = entry.hash.clone();
        Ok(entry)
    }
}

fn verify_reader(r: impl Read) -> Result<Verified, AuditError> {
    let mut prev = GENESIS.to_string();
    let mut expected = 1u64;
    for (i, line) in BufReader::new(r).split(b'\n').enumerate() {
        let lineno = i + 1;
        let broken = |seq, problem: String| AuditError::Broken {
            line: lineno,
            seq,
            problem,
        };
        let line = line.map_err(|e| broken(Some(expected), format!("read error: {e}")))?;
        let v: Value = serde_json::from_slice(&line)
            .map_err(|e| broken(Some(expected), format!("not JSON: {e}")))?;
        let seq = v
            .get("seq")
            .and_then(Value::as_u64)
            .ok_or_else(|| broken(Some(expected), "no seq".into()))?;
        if seq != expected {
            return Err(broken(
                Some(seq),
                format!("expected seq {expected}, found {seq} (an entry was removed or moved)"),
            ));
        }
        let _: AuditEntry = serde_json::from_value(v.clone())
            .map_err(|e| broken(Some(seq), format!("not an audit entry: {e}")))?;
        let claimed_prev = v.get("prev_hash").and_then(Value::as_str).unwrap_or("");
        if claimed_prev != prev {
            return Err(broken(
                Some(seq),
                "prev_hash does not match the previous entry".into(),
            ));
        }
        let hash = entry_hash(&prev, &v);
        if v.get("hash").and_then(Value::as_str) != Some(hash.as_str()) {
            return Err(broken(
                Some(seq),
                "hash does not match the content (entry edited)".into(),
            ));
        }
        prev = hash;
        expected += 1;
    }
    Ok(Verified {
        entries: expected - 1,
        head: prev,
    })
}

/// Verify a log file's chain; names the first broken line and seq.
pub fn verify(path: &Path) -> Result<Verified, AuditError> {
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    verify_reader(f)
}

/// Verify a log file and that it still ends at a head recorded earlier
/// (`seq`, `hash`): detects a cut-off tail, which the chain alone cannot.
pub fn verify_head(path: &Path, seq: u64, hash: &str) -> Result<Verified, AuditError> {
    let v = verify(path)?;
    if v.entries < seq {
        return Err(AuditError::Broken {
            line: usize::try_from(v.entries + 1).unwrap_or(usize::MAX),
            seq: Some(v.entries + 1),
            problem: format!(
                "log ends at seq {} but entry {seq} was recorded (tail removed)",
                v.entries
            ),
        });
    }
    // Re-walk to find the hash at `seq`.
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if i as u64 + 1 == seq {
            let e: AuditEntry = serde_json::from_str(&line).map_err(AuditError::Encode)?;
            if e.hash != hash {
                return Err(AuditError::Broken {
                    line: i + 1,
                    seq: Some(seq),
                    problem: "hash differs from the recorded head".into(),
                });
            }
        }
    }
    Ok(v)
}

/// Entries matching `filter`, in order. Does not verify; call [`verify`] for that.
pub fn query(path: &Path, filter: &Filter) -> Result<Vec<AuditEntry>, AuditError> {
    let mut out = Vec::new();
    export_inner(path, filter, |e, _| {
        out.push(e);
        Ok(())
    })?;
    Ok(out)
}

/// Write the matching lines, byte for byte as stored, as JSON lines.
pub fn export(path: &Path, filter: &Filter, w: &mut impl Write) -> Result<u64, AuditError> {
    let mut n = 0;
    export_inner(path, filter, |_, line| {
        n += 1;
        w.write_all(line.as_bytes())
            .and_then(|_| w.write_all(b"\n"))
    })?;
    Ok(n)
}

fn export_inner(
    path: &Path,
    filter: &Filter,
    mut f: impl FnMut(AuditEntry, &str) -> std::io::Result<()>,
) -> Result<(), AuditError> {
    let io = |source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io)?;
        let e: AuditEntry = serde_json::from_str(&line).map_err(|e| AuditError::Broken {
            line: i + 1,
            seq: None,
            problem: format!("not an audit entry: {e}"),
        })?;
        if filter.matches(&e) {
            f(e, &line).map_err(io)?;
        }
    }
    Ok(())
}
