//! Append-only, chained audit log of policy decisions (JSON lines).
//!
//! Each line is one [`AuditEntry`]. Its `hash` links it to the one before,
//! computed over `prev_hash || canonical JSON of the entry without "hash"`
//! (object keys sorted, no insignificant white space). The first entry's
//! `prev_hash` is 64 zeros. Two rules, told apart by the entry's `v`:
//!
//! - `v` absent (1): `hash = sha256(…)` — the unkeyed chain of logs written
//!   before the audit key existed. Anyone who can write the file can
//!   recompute it.
//! - `v: 2`: `hash = HMAC-SHA256(audit key, …)`, the key derived from the
//!   deployment's key store (outside the data dir). Without the key an
//!   edited entry cannot be given a link that verifies.
//!
//! A log is keyed from one point on: its entries up to [`ChainStart`] are
//! in the old form, every later one is keyed, and the first keyed entry's
//! `prev_hash` is the last unkeyed one's link, so the switch is in the
//! chain. The daemon keeps the [`ChainStart`] beside the key, where whoever
//! rewrites the data dir cannot move it.
//!
//! Durability: every line written is followed by `fsync` (`sync_data`)
//! before the call returns, so a decision acknowledged to anyone is on
//! disk, and the log's head is handed to a [`HeadSink`] (the daemon's
//! database) on every write. A torn last line (a crash in the middle of a
//! write, never acknowledged) is cut off when the log is reopened.
//!
//! Bounded writes ([`AuditLimits`], opt-in): a denial identical to one
//! written less than a window ago is counted, not written; at the end of
//! the window one entry with `count` and `aggregate: "repeat"` says how
//! many there were. Each sandbox has a token bucket of denial writes; a
//! denial without a token is counted into one `aggregate: "rate_limited"`
//! entry of that sandbox per window. Nothing is dropped: the counts add up
//! to every denial. What is not yet written when the process dies (at most
//! one window of counts) is lost.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use ring::hmac;
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
    /// The connector secret(s) the egress proxy injects on an allowed call
    /// (names only, comma-separated; `docs/secrets.md`). Left out when
    /// none, so entries written before it hash the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
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
            secret: None,
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
    /// How many decisions this entry stands for (1 unless aggregated).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub count: u64,
    /// Why `count` decisions share one entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<Aggregate>,
    /// When the first of the aggregated decisions was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first: Option<DateTime<Utc>>,
    /// The link rule: 1 (absent) = SHA-256, 2 = HMAC-SHA256 under the audit key.
    #[serde(default = "one_u8", skip_serializing_if = "is_one_u8")]
    pub v: u8,
    /// Link of the previous entry.
    pub prev_hash: String,
    /// This entry's link (a SHA-256 or an HMAC, per `v`).
    pub hash: String,
}

/// Why an entry stands for several decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregate {
    /// The same denial (tenant, sandbox, actor, call, rule, reason) again,
    /// within the window after an entry for it was written.
    Repeat,
    /// Denials of one sandbox over its audit-write budget; the call and
    /// decision shown are the first of them.
    RateLimited,
}

fn one() -> u64 {
    1
}
fn is_one(n: &u64) -> bool {
    *n == 1
}
fn one_u8() -> u8 {
    1
}
fn is_one_u8(n: &u8) -> bool {
    *n == 1
}

/// Where a log's keyed chain begins: entries `1..=legacy_seq` use the old
/// unkeyed rule, every later one the keyed rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainStart {
    /// The last unkeyed entry (0: the whole log is keyed).
    pub legacy_seq: u64,
    /// That entry's link ([`GENESIS`] for 0).
    pub legacy_hash: String,
}

/// Called with `(seq, link)` after every write, under the log's lock; an
/// error fails that append (the line is on disk, its head not recorded).
pub type HeadSink = Box<dyn Fn(u64, &str) -> Result<(), String> + Send + Sync>;

/// Bounds on the writes of denials (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AuditLimits {
    /// How long identical denials are counted into one entry.
    pub window: Duration,
    /// Denial writes a sandbox may make at once.
    pub burst: u32,
    /// Denial writes a sandbox regains per second.
    pub per_second: f64,
}

impl Default for AuditLimits {
    fn default() -> Self {
        AuditLimits {
            window: Duration::from_secs(10),
            burst: 20,
            per_second: 2.0,
        }
    }
}

/// How to open a log.
#[derive(Default)]
pub struct AuditOptions {
    /// The audit key: new entries are keyed (`v: 2`). Without one, new
    /// entries use the old rule and a log holding keyed entries is refused.
    pub key: Option<hmac::Key>,
    /// Where the keyed chain began, as recorded when it did; `None` on the
    /// first open with a key (the start is then the current end of the
    /// log, see [`AuditLog::chain_start`]).
    pub start: Option<ChainStart>,
    /// Aggregation and token buckets for denials; `None` writes each one.
    pub limits: Option<AuditLimits>,
}

impl std::fmt::Debug for AuditOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditOptions")
            .field("keyed", &self.key.is_some())
            .field("start", &self.start)
            .field("limits", &self.limits)
            .finish()
    }
}

/// What [`AuditLog::record`] did with a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// Written as this entry (on disk).
    Written(Box<AuditEntry>),
    /// Counted into an aggregate entry written at the end of its window.
    Aggregated,
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
    /// The entry is on disk but its head could not be recorded.
    #[error("recording the audit head: {0}")]
    Head(String),
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

fn link_input(entry: &Value) -> String {
    let mut v = canonical(entry);
    if let Value::Object(m) = &mut v {
        m.remove("hash");
    }
    v.to_string()
}

/// Unkeyed (`v` 1) link of an entry given as a JSON object (its `hash`
/// field is ignored).
pub fn entry_hash(prev_hash: &str, entry: &Value) -> String {
    let mut h = Sha256::new();
    h.update(prev_hash.as_bytes());
    h.update(link_input(entry).as_bytes());
    hex::encode(h.finalize())
}

/// Keyed (`v` 2) link of an entry given as a JSON object.
pub fn entry_mac(key: &hmac::Key, prev_hash: &str, entry: &Value) -> String {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(prev_hash.as_bytes());
    ctx.update(link_input(entry).as_bytes());
    hex::encode(ctx.sign().as_ref())
}

struct Pending {
    since: Instant,
    first: DateTime<Utc>,
    count: u64,
    kind: Aggregate,
    call: ToolCall,
    decision: AuditDecision,
    by: Option<String>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

struct State {
    file: File,
    seq: u64,
    head: String,
    sink: Option<HeadSink>,
    buckets: HashMap<(String, Option<String>), Bucket>,
    pending: HashMap<[u8; 32], Pending>,
}

/// An open audit log, appended to by one process.
pub struct AuditLog {
    path: PathBuf,
    key: Option<hmac::Key>,
    start: Option<ChainStart>,
    limits: Option<AuditLimits>,
    state: Mutex<State>,
}

impl Drop for AuditLog {
    fn drop(&mut self) {
        // Counts still pending are written, not lost, when the log closes.
        if let Err(e) = self.flush_all() {
            tracing::error!(error = %e, "audit log: writing aggregated denials at close");
        }
    }
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
    /// Only entries written at or after this time.
    pub since: Option<DateTime<Utc>>,
}

impl Filter {
    fn matches(&self, e: &AuditEntry) -> bool {
        self.tenant.as_ref().is_none_or(|t| &e.tenant == t)
            && self
                .sandbox
                .as_ref()
                .is_none_or(|s| e.sandbox.as_ref() == Some(s))
            && self.since.is_none_or(|t| e.time >= t)
    }
}

/// One tenant's part of a verified log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantCount {
    /// Its entries.
    pub entries: u64,
    /// The decisions they stand for (aggregated entries count several).
    pub decisions: u64,
    /// Its first entry's seq.
    pub first_seq: Option<u64>,
    /// Its last entry's seq.
    pub last_seq: Option<u64>,
}

/// Summary of a verified log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Number of entries.
    pub entries: u64,
    /// Link of the last entry ([`GENESIS`] for an empty log).
    pub head: String,
    /// The first keyed entry, if any.
    pub keyed_from: Option<u64>,
    /// The last unkeyed entry and its link (`0`, [`GENESIS`] when none).
    pub legacy: (u64, String),
    /// Entries and decisions per tenant.
    pub tenants: BTreeMap<String, TenantCount>,
}

/// What a verification checks beyond the chain itself.
#[derive(Default)]
pub struct VerifyOptions<'a> {
    /// The audit key; keyed entries are refused without it.
    pub key: Option<&'a hmac::Key>,
    /// Where the keyed chain began: no unkeyed entry after it, and its
    /// last unkeyed link must be the recorded one.
    pub start: Option<&'a ChainStart>,
    /// A head recorded earlier: the log must still reach it.
    pub head: Option<(u64, &'a str)>,
}

impl AuditLog {
    /// Open (or create) an unkeyed log without limits; verifies the
    /// existing chain and cuts off a torn, unterminated last line.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        Self::open_with(path, AuditOptions::default())
    }

    /// Open (or create) a log with `opts`: verifies the existing chain
    /// under the key and start given, and cuts off a torn last line.
    pub fn open_with(path: &Path, opts: AuditOptions) -> Result<AuditLog, AuditError> {
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
        let v = verify_reader(
            &buf[..],
            &VerifyOptions {
                key: opts.key.as_ref(),
                start: opts.start.as_ref(),
                head: None,
            },
        )?;
        let start = match (&opts.key, opts.start) {
            (None, _) => None,
            (Some(_), Some(s)) => Some(s),
            // First open with the key: the chain is keyed from here on.
            (Some(_), None) => Some(ChainStart {
                legacy_seq: v.legacy.0,
                legacy_hash: v.legacy.1.clone(),
            }),
        };
        Ok(AuditLog {
            path: path.to_path_buf(),
            key: opts.key,
            start,
            limits: opts.limits,
            state: Mutex::new(State {
                file,
                seq: v.entries,
                head: v.head,
                sink: None,
                buckets: HashMap::new(),
                pending: HashMap::new(),
            }),
        })
    }

    /// Where this log's keyed chain begins (`None` when unkeyed): keep it
    /// where the data dir's writers cannot change it and pass it to later
    /// opens and verifications.
    pub fn chain_start(&self) -> Option<&ChainStart> {
        self.start.as_ref()
    }

    /// Whether new entries are keyed.
    pub fn keyed(&self) -> bool {
        self.key.is_some()
    }

    /// Calls `sink` with the head after every write from now on.
    pub fn set_head_sink(&self, sink: HeadSink) {
        self.lock().sink = Some(sink);
    }

    /// Verifies the file under this log's key and start (and `head`, if
    /// given, which must have been read before this call): the lines on
    /// disk when it is called, without holding appends off meanwhile.
    pub fn verify(&self, head: Option<(u64, &str)>) -> Result<Verified, AuditError> {
        let io = |source| AuditError::Io {
            path: self.path.clone(),
            source,
        };
        // Whole lines only: appends happen under the lock, so the length
        // read under it ends at a line's end.
        let len = self.lock().file.metadata().map_err(io)?.len();
        let f = File::open(&self.path).map_err(io)?;
        verify_reader(
            f.take(len),
            &VerifyOptions {
                key: self.key.as_ref(),
                start: self.start.as_ref(),
                head,
            },
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sequence number and link of the last entry; keep them elsewhere
    /// (e.g. the daemon's database) to detect a cut-off tail.
    pub fn head(&self) -> (u64, String) {
        let s = self.lock();
        (s.seq, s.head.clone())
    }

    /// Append one decision, always written; returns after the line is on
    /// disk and its head was handed to the [`HeadSink`].
    pub fn append(
        &self,
        call: &ToolCall,
        decision: AuditDecision,
        by: Option<String>,
    ) -> Result<AuditEntry, AuditError> {
        let mut s = self.lock();
        self.write(&mut s, call, decision, by, 1, None, None)
    }

    /// Record one decision under the [`AuditLimits`]: a denial may be
    /// counted into an aggregate entry instead of written; anything else
    /// is written as by [`append`](Self::append). Aggregates whose window
    /// has ended are written first; an error means the decision may not
    /// be on disk (callers refuse the call).
    pub fn record(
        &self,
        call: &ToolCall,
        decision: AuditDecision,
        by: Option<String>,
    ) -> Result<Recorded, AuditError> {
        let mut s = self.lock();
        let Some(limits) = self.limits else {
            return self
                .write(&mut s, call, decision, by, 1, None, None)
                .map(|e| Recorded::Written(Box::new(e)));
        };
        let now = Instant::now();
        self.flush_locked(&mut s, Some(now))?;
        if decision.outcome != Outcome::Denied {
            return self
                .write(&mut s, call, decision, by, 1, None, None)
                .map(|e| Recorded::Written(Box::new(e)));
        }
        let repeat = repeat_key(call, &decision, by.as_deref());
        if let Some(p) = s.pending.get_mut(&repeat) {
            p.count += 1;
            return Ok(Recorded::Aggregated);
        }
        let bucket_key = (call.tenant.clone(), call.sandbox.clone());
        let b = s.buckets.entry(bucket_key).or_insert(Bucket {
            tokens: f64::from(limits.burst),
            at: now,
        });
        let refill = now.saturating_duration_since(b.at).as_secs_f64() * limits.per_second;
        b.tokens = (b.tokens + refill).min(f64::from(limits.burst));
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            let e = self.write(&mut s, call, decision.clone(), by.clone(), 1, None, None)?;
            s.pending.insert(
                repeat,
                Pending {
                    since: now,
                    first: Utc::now(),
                    count: 0,
                    kind: Aggregate::Repeat,
                    call: call.clone(),
                    decision,
                    by,
                },
            );
            return Ok(Recorded::Written(Box::new(e)));
        }
        let rate = rate_key(call);
        s.pending
            .entry(rate)
            .or_insert_with(|| Pending {
                since: now,
                first: Utc::now(),
                count: 0,
                kind: Aggregate::RateLimited,
                call: call.clone(),
                decision,
                by,
            })
            .count += 1;
        Ok(Recorded::Aggregated)
    }

    /// Writes the aggregates whose window has ended (the daemon calls it
    /// about once a second, so a count never waits long for a later call).
    pub fn flush(&self) -> Result<(), AuditError> {
        let mut s = self.lock();
        self.flush_locked(&mut s, Some(Instant::now()))
    }

    /// Writes every pending aggregate now.
    pub fn flush_all(&self) -> Result<(), AuditError> {
        let mut s = self.lock();
        self.flush_locked(&mut s, None)
    }

    /// Writes the pending aggregates due at `now` (all of them for `None`).
    fn flush_locked(&self, s: &mut State, now: Option<Instant>) -> Result<(), AuditError> {
        let Some(limits) = self.limits else {
            return Ok(());
        };
        let mut due: Vec<[u8; 32]> = s
            .pending
            .iter()
            .filter(|(_, p)| {
                now.is_none_or(|n| n.saturating_duration_since(p.since) >= limits.window)
            })
            .map(|(k, _)| *k)
            .collect();
        // In the order they started, so the log reads in time order.
        due.sort_by_key(|k| s.pending.get(k).map(|p| p.since));
        for k in due {
            let Some(p) = s.pending.get(&k) else { continue };
            if p.count > 0 {
                let (call, decision, by) = (p.call.clone(), p.decision.clone(), p.by.clone());
                let (count, kind, first) = (p.count, p.kind, p.first);
                // On failure the count stays pending (not lost) and the
                // error goes to the caller.
                self.write(s, &call, decision, by, count, Some(kind), Some(first))?;
            }
            s.pending.remove(&k);
        }
        if let Some(n) = now {
            // A bucket full again is forgotten (the map stays as small as
            // the set of sandboxes denied lately).
            s.buckets.retain(|_, b| {
                let t =
                    b.tokens + n.saturating_duration_since(b.at).as_secs_f64() * limits.per_second;
                t < f64::from(limits.burst)
            });
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        s: &mut State,
        call: &ToolCall,
        decision: AuditDecision,
        by: Option<String>,
        count: u64,
        aggregate: Option<Aggregate>,
        first: Option<DateTime<Utc>>,
    ) -> Result<AuditEntry, AuditError> {
        let mut entry = AuditEntry {
            seq: s.seq + 1,
            time: Utc::now(),
            tenant: call.tenant.clone(),
            sandbox: call.sandbox.clone(),
            actor: call.actor.clone(),
            call: call.clone(),
            decision,
            by,
            count,
            aggregate,
            first,
            v: if self.key.is_some() { 2 } else { 1 },
            prev_hash: s.head.clone(),
            hash: String::new(),
        };
        let v = serde_json::to_value(&entry).map_err(AuditError::Encode)?;
        entry.hash = match &self.key {
            Some(k) => entry_mac(k, &s.head, &v),
            None => entry_hash(&s.head, &v),
        };
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
        if let Some(sink) = &s.sink {
            sink(s.seq, &s.head).map_err(AuditError::Head)?;
        }
        Ok(entry)
    }
}

fn repeat_key(call: &ToolCall, d: &AuditDecision, by: Option<&str>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"repeat\0");
    h.update(serde_json::to_vec(&(call, &d.rule_id, &d.reason, by)).unwrap_or_default());
    h.finalize().into()
}

fn rate_key(call: &ToolCall) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"rate\0");
    h.update(serde_json::to_vec(&(&call.tenant, &call.sandbox)).unwrap_or_default());
    h.finalize().into()
}

fn verify_reader(r: impl Read, opts: &VerifyOptions<'_>) -> Result<Verified, AuditError> {
    let mut prev = GENESIS.to_string();
    let mut expected = 1u64;
    let mut keyed_from: Option<u64> = None;
    let mut legacy = (0u64, GENESIS.to_string());
    let mut tenants: BTreeMap<String, TenantCount> = BTreeMap::new();
    let mut head_seen = false;
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
        let e: AuditEntry = serde_json::from_value(v.clone())
            .map_err(|e| broken(Some(seq), format!("not an audit entry: {e}")))?;
        let claimed_prev = v.get("prev_hash").and_then(Value::as_str).unwrap_or("");
        if claimed_prev != prev {
            return Err(broken(
                Some(seq),
                "prev_hash does not match the previous entry".into(),
            ));
        }
        let hash = match e.v {
            1 => {
                if let Some(k) = keyed_from {
                    return Err(broken(
                        Some(seq),
                        format!("unkeyed entry after the keyed chain began at seq {k}"),
                    ));
                }
                if let Some(st) = opts.start.filter(|_| opts.key.is_some()) {
                    if seq > st.legacy_seq {
                        return Err(broken(
                            Some(seq),
                            format!(
                                "unkeyed entry where the chain is keyed (from seq {})",
                                st.legacy_seq + 1
                            ),
                        ));
                    }
                }
                entry_hash(&prev, &v)
            }
            2 => {
                let Some(key) = opts.key else {
                    return Err(broken(
                        Some(seq),
                        "keyed entry, but no audit key to verify it with".into(),
                    ));
                };
                if let Some(st) = opts.start {
                    if seq <= st.legacy_seq {
                        return Err(broken(
                            Some(seq),
                            format!(
                                "keyed entry where the recorded start expects the unkeyed prefix (to seq {})",
                                st.legacy_seq
                            ),
                        ));
                    }
                }
                keyed_from.get_or_insert(seq);
                entry_mac(key, &prev, &v)
            }
            n => return Err(broken(Some(seq), format!("unknown link rule v {n}"))),
        };
        if v.get("hash").and_then(Value::as_str) != Some(hash.as_str()) {
            return Err(broken(
                Some(seq),
                if e.v == 2 {
                    "link is not the audit key's MAC of the content (entry edited or forged)".into()
                } else {
                    "hash does not match the content (entry edited)".into()
                },
            ));
        }
        if e.v == 1 {
            legacy = (seq, hash.clone());
        }
        if let Some(st) = opts.start.filter(|_| opts.key.is_some()) {
            if seq == st.legacy_seq && hash != st.legacy_hash {
                return Err(broken(
                    Some(seq),
                    "the unkeyed prefix differs from the one recorded when the chain was keyed"
                        .into(),
                ));
            }
        }
        if let Some((hseq, hhash)) = opts.head {
            if seq == hseq {
                if hash != hhash {
                    return Err(broken(
                        Some(seq),
                        "link differs from the recorded head".into(),
                    ));
                }
                head_seen = true;
            }
        }
        let t = tenants.entry(e.tenant).or_default();
        t.entries += 1;
        t.decisions += e.count;
        t.first_seq.get_or_insert(seq);
        t.last_seq = Some(seq);
        prev = hash;
        expected += 1;
    }
    let entries = expected - 1;
    let end = usize::try_from(expected).unwrap_or(usize::MAX);
    if let Some(st) = opts.start.filter(|_| opts.key.is_some()) {
        if entries < st.legacy_seq {
            return Err(AuditError::Broken {
                line: end,
                seq: Some(expected),
                problem: format!(
                    "log ends at seq {entries}, before the keyed chain's recorded start (seq {})",
                    st.legacy_seq
                ),
            });
        }
    }
    if let Some((hseq, _)) = opts.head {
        if hseq > 0 && !head_seen {
            return Err(AuditError::Broken {
                line: end,
                seq: Some(expected),
                problem: format!(
                    "log ends at seq {entries} but entry {hseq} was recorded (tail removed)"
                ),
            });
        }
    }
    Ok(Verified {
        entries,
        head: prev,
        keyed_from,
        legacy,
        tenants,
    })
}

/// Verify an unkeyed log file's chain; names the first broken line and seq.
pub fn verify(path: &Path) -> Result<Verified, AuditError> {
    verify_with(path, &VerifyOptions::default())
}

/// Verify a log file under `opts` (key, keyed start, recorded head).
pub fn verify_with(path: &Path, opts: &VerifyOptions<'_>) -> Result<Verified, AuditError> {
    let f = File::open(path).map_err(|source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    verify_reader(f, opts)
}

/// Verify an unkeyed log file and that it still reaches a head recorded
/// earlier (`seq`, `hash`): detects a cut-off tail, which the chain alone
/// cannot.
pub fn verify_head(path: &Path, seq: u64, hash: &str) -> Result<Verified, AuditError> {
    verify_with(
        path,
        &VerifyOptions {
            head: Some((seq, hash)),
            ..VerifyOptions::default()
        },
    )
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

/// Write the matching lines, byte for byte as stored, as JSON lines; one
/// line in memory at a time.
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
