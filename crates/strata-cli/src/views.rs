//! Typed, lenient views of the daemon's JSON for human output. Every field
//! defaults, so an older or newer daemon still prints; `--json` output is
//! the daemon's JSON untouched.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// Parses a view out of a value (a daemon answer that does not fit is an error).
pub fn view<T: DeserializeOwned>(v: &Value) -> anyhow::Result<T> {
    T::deserialize(v).map_err(|e| anyhow::anyhow!("unexpected answer from stratad: {e}"))
}

/// Field `k` of `v` for a table cell: a string as it is, `-` when absent
/// or null, anything else as JSON.
pub fn field(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(other) => other.to_string(),
    }
}

/// The `items` of a list answer as JSON values (none when absent).
pub fn items_or_empty(v: &Value) -> Vec<Value> {
    v.get("items")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The `items` of a list answer.
pub fn items<T: DeserializeOwned>(v: &Value) -> anyhow::Result<Vec<T>> {
    match v.get("items") {
        Some(items) => view(items),
        None => view(v),
    }
}

/// A sandbox size.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Size {
    /// vCPUs.
    pub vcpus: u32,
    /// MiB.
    pub memory_mib: u32,
    /// GiB.
    pub disk_gib: u32,
}

impl Size {
    /// `2 vCPU, 512 MiB, 2 GiB`.
    pub fn describe(&self) -> String {
        format!(
            "{} vCPU, {} MiB, {} GiB",
            self.vcpus, self.memory_mib, self.disk_gib
        )
    }
}

/// A sandbox record.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Sandbox {
    /// Id.
    pub id: String,
    /// State.
    pub state: String,
    /// Why it is in that state.
    pub state_reason: Option<String>,
    /// Operation in progress.
    pub pending_op: Option<String>,
    /// Template it came from.
    pub template: Option<String>,
    /// Snapshot it was forked from.
    pub source_snapshot: Option<String>,
    /// Size.
    pub size: Size,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Idle timeout (s).
    pub idle_timeout_s: Option<u64>,
    /// Rolling snapshot interval (s).
    pub snapshot_interval_s: Option<u64>,
    /// Created.
    pub created_at: Option<DateTime<Utc>>,
    /// Last activity.
    pub last_activity_at: Option<DateTime<Utc>>,
    /// VM pid.
    pub pid: Option<u32>,
    /// Accelerator.
    pub accel: Option<String>,
    /// What its idle timeout does and whether use wakes it (`GET` only).
    pub lifecycle: Option<Lifecycle>,
}

/// A sandbox's lifecycle policy.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Lifecycle {
    /// `hibernate` or `delete`.
    pub on_timeout: String,
    /// Whether use wakes it from hibernation.
    pub auto_resume: bool,
}

impl Lifecycle {
    /// `hibernate, wakes on use` / `delete, wakes on resume only`.
    pub fn describe(&self) -> String {
        let wake = if self.auto_resume {
            "wakes on use"
        } else {
            "wakes on resume only"
        };
        format!("{}, {wake}", self.on_timeout)
    }
}

/// A snapshot record.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Snapshot {
    /// Id.
    pub id: String,
    /// Its sandbox.
    pub sandbox_id: String,
    /// manual / rolling / pre_rewind / ...
    pub kind: String,
    /// Label.
    pub label: Option<String>,
    /// pending / ready / deleted.
    pub status: String,
    /// When.
    pub created_at: Option<DateTime<Utc>>,
    /// vCPU pause (ms).
    pub pause_ms: Option<f64>,
    /// Bytes only it holds.
    pub exclusive_bytes: Option<u64>,
    /// Bytes it references.
    pub referenced_bytes: Option<u64>,
    /// A rolling snapshot of an unchanged guest: the earlier snapshot it
    /// is the same as (rewinding to it restores that one).
    pub same_as: Option<String>,
}

impl Snapshot {
    /// Bytes it shares with other snapshots (referenced - exclusive).
    pub fn shared_bytes(&self) -> Option<u64> {
        Some(
            self.referenced_bytes?
                .saturating_sub(self.exclusive_bytes.unwrap_or(0)),
        )
    }
}

/// Progress of a template build.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct Progress {
    /// Step.
    pub step: String,
    /// Fraction done.
    pub fraction: Option<f32>,
}

/// A template.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Template {
    /// Id.
    pub id: String,
    /// Name.
    pub name: Option<String>,
    /// Size.
    pub size: Size,
    /// building / ready / failed / deleted.
    pub status: String,
    /// Why it failed.
    pub status_reason: Option<String>,
    /// Accelerator.
    pub accel: Option<String>,
    /// Created.
    pub created_at: Option<DateTime<Utc>>,
    /// Build progress.
    pub progress: Option<Progress>,
}

/// A guest directory entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct FileEntry {
    /// Name.
    pub name: String,
    /// file / dir / symlink / other.
    pub kind: String,
    /// Bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
}

/// Summary of one latency histogram, in milliseconds.
pub use strata_core::LatencySummary as Summary;

/// `/v1/stats`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// Per API operation.
    pub api: BTreeMap<String, Summary>,
    /// Per VM step.
    pub steps: BTreeMap<String, Summary>,
    /// Sandboxes per state.
    pub sandboxes: BTreeMap<String, u64>,
    /// Ready snapshots.
    pub snapshots: u64,
    /// Warm pools (an operator's token only; empty otherwise).
    pub warm_pools: Vec<WarmPool>,
    /// The host's CPU, memory, pressure and admission (operator only).
    pub host: Option<HostStats>,
}

/// `/v1/stats` `host`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HostStats {
    /// The sampler's newest host point.
    pub latest: Option<HostPoint>,
    /// The storage pool's space at the sampler's last round.
    pub pool: Option<PoolSpace>,
    /// `use` or `nominal`.
    pub admission: String,
    /// What admission by use counts.
    pub budget: Option<UseBudget>,
    /// The pressure monitor's last reading.
    pub pressure: Option<PressureReading>,
}

/// The host over one sampler round.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HostPoint {
    /// Online CPUs.
    pub cpus: u32,
    /// CPU busy, cores.
    pub cpu_busy_cores: f64,
    /// CPU the VMs used, cores.
    pub vm_cores: f64,
    /// VMs sampled.
    pub vms: u32,
    /// MemTotal.
    pub mem_total_bytes: u64,
    /// MemAvailable.
    pub mem_available_bytes: u64,
    /// CPU pressure, percent.
    pub cpu_pressure_pct: Option<f64>,
    /// Memory pressure, percent.
    pub mem_pressure_pct: Option<f64>,
}

/// The storage pool's space (`/v1/stats` `host.pool`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PoolSpace {
    /// Size of the pool's file system.
    pub size_bytes: u64,
    /// Bytes in use.
    pub used_bytes: u64,
    /// Bytes available for new data (the space reserve not counted).
    pub available_bytes: u64,
}

/// What admission by use counts.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct UseBudget {
    /// Host CPUs given to sandboxes.
    pub cores: f64,
    /// Cores given out (less headroom).
    pub cpu_budget_cores: f64,
    /// Cores counted against it.
    pub cpu_demand_cores: f64,
    /// Of which the sandboxes' recent peaks.
    pub sandbox_cores: f64,
    /// The host's other load.
    pub other_cores: f64,
    /// Of which counted (at most `other_load_share` of the budget).
    pub other_counted_cores: f64,
    /// VMs held or starting.
    pub vms: u64,
}

/// The pressure monitor's last reading.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PressureReading {
    /// What counted as pressure.
    pub over: Vec<String>,
    /// Whether hibernation acts now.
    pub active: bool,
    /// Hibernations made for pressure.
    pub hibernated: u64,
}

/// One warm pool of `/v1/stats`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct WarmPool {
    /// Template id.
    pub template: String,
    /// vCPUs of its guests.
    pub vcpus: u32,
    /// Memory of its guests, MiB.
    pub memory_mib: u32,
    /// Guests ready to be claimed.
    pub ready: u64,
}

/// `GET /v1/whoami`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Whoami {
    /// Token id.
    pub token_id: String,
    /// Tenant.
    pub tenant: String,
    /// Role.
    pub role: String,
    /// Token name.
    pub name: Option<String>,
}

/// An API token record (the secret only in [`Self::token`], once).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Token {
    /// Id (`tok-…`).
    pub id: String,
    /// Tenant.
    pub tenant: String,
    /// Role.
    pub role: String,
    /// Name.
    pub name: Option<String>,
    /// Made.
    pub created_at: Option<DateTime<Utc>>,
    /// Made by (token id, or `bootstrap`).
    pub created_by: Option<String>,
    /// Expiry.
    pub expires_at: Option<DateTime<Utc>>,
    /// Revoked.
    pub revoked_at: Option<DateTime<Utc>>,
    /// The secret (only in the answer of a creation).
    pub token: Option<String>,
}

/// A policy decision (`POST /v1/policy/test`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Decision {
    /// allow / deny / approve.
    pub effect: String,
    /// platform / tenant / sandbox (none: built-in default, invalid call).
    pub layer: Option<String>,
    /// Deciding rule id.
    pub rule_id: String,
    /// Index of the rule in its layer.
    pub rule_index: Option<u64>,
    /// A hard rule decided.
    pub hard: bool,
    /// Why.
    pub reason: String,
    /// egress: the connector secret(s) the proxy would inject.
    pub secret: Option<String>,
}

/// Status of an approval request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ApprovalState {
    /// pending / approved / denied / timed_out.
    pub status: String,
    /// Who answered.
    pub by: Option<String>,
    /// When.
    pub at: Option<DateTime<Utc>>,
}

/// The held call inside an approval request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HeldCall {
    /// Sandbox.
    pub sandbox: Option<String>,
    /// Who asked.
    pub actor: String,
    /// The call: `{"kind":"exec","argv":[…]}` …
    pub kind: Value,
}

/// An approval request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Approval {
    /// Id.
    pub id: String,
    /// Sandbox.
    pub sandbox: Option<String>,
    /// The call.
    pub call: HeldCall,
    /// Why it was held.
    pub reason: String,
    /// Rule that held it.
    pub rule_id: String,
    /// Who asked.
    pub requested_by: String,
    /// When.
    pub created_at: Option<DateTime<Utc>>,
    /// Where it stands.
    pub status: ApprovalState,
    /// Size and SHA-256 of the bytes the call carries (an upload, an
    /// exec's stdin), if any.
    pub body: Option<HeldBody>,
    /// The digest of the whole request the approval is bound to.
    pub request_sha256: String,
    /// When a pending request times out, or an approved one can no longer
    /// be used.
    pub expires_at: Option<DateTime<Utc>>,
    /// When the approved call ran.
    pub consumed_at: Option<DateTime<Utc>>,
}

/// The bytes a held call carries, as the approver sees them.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct HeldBody {
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

impl HeldBody {
    /// `13 B, sha256 2cf24dba…` (the whole digest with `full`).
    pub fn describe(&self, full: bool) -> String {
        let sha = if full || self.sha256.len() <= 12 {
            self.sha256.clone()
        } else {
            format!("{}…", &self.sha256[..12])
        };
        format!("{}, sha256 {sha}", crate::human::bytes(self.bytes))
    }
}

/// One line describing a tool call: `exec rm -rf /`, `file_write /etc/x`,
/// `egress POST api.x.com:443/path`, `lifecycle delete`.
pub fn describe_call(kind: &Value) -> String {
    let s = |k: &str| kind.get(k).and_then(Value::as_str).unwrap_or("");
    let name = s("kind");
    match name {
        "exec" => {
            if let Some(sh) = kind.get("shell").and_then(Value::as_str) {
                return format!("exec sh -c {sh:?}");
            }
            let argv: Vec<&str> = kind
                .get("argv")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            format!("exec {}", argv.join(" "))
        }
        "file_read" | "file_write" => format!("{name} {}", s("path")),
        "egress" => {
            let port = kind.get("port").and_then(Value::as_u64).unwrap_or(0);
            let connector = match s("connector") {
                "" => String::new(),
                c => format!(" ({c})"),
            };
            format!(
                "egress {} {}:{port}{}{connector}",
                s("method"),
                s("host"),
                s("path")
            )
        }
        "lifecycle" => format!("lifecycle {}", s("op")),
        "mcp" => format!("mcp {} {}", s("connector"), s("tool")),
        "" => kind.to_string(),
        other => other.to_owned(),
    }
}

/// `k=v,k2=v2` (or `-`).
pub fn labels(l: &BTreeMap<String, String>) -> String {
    if l.is_empty() {
        return "-".into();
    }
    l.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn views_tolerate_missing_and_extra_fields() {
        let s: Sandbox = view(&json!({"id": "sb-1", "state": "running", "new_field": 1})).unwrap();
        assert_eq!(s.id, "sb-1");
        assert_eq!(s.size.vcpus, 0);
        let list: Vec<Snapshot> = items(&json!({"items": [
            {"id": "snap-1", "referenced_bytes": 100, "exclusive_bytes": 30}
        ]}))
        .unwrap();
        assert_eq!(list[0].shared_bytes(), Some(70));
        assert!(view::<Sandbox>(&json!({"id": 5})).is_err());
    }

    #[test]
    fn calls_are_described_on_one_line() {
        assert_eq!(
            describe_call(&json!({"kind": "exec", "argv": ["rm", "-rf", "/"]})),
            "exec rm -rf /"
        );
        assert_eq!(
            describe_call(&json!({"kind": "file_write", "path": "/etc/x"})),
            "file_write /etc/x"
        );
        assert_eq!(
            describe_call(
                &json!({"kind": "egress", "connector": "salesforce", "host": "a.my.salesforce.com",
                "port": 443, "method": "POST", "path": "/x", "scheme": "https"})
            ),
            "egress POST a.my.salesforce.com:443/x (salesforce)"
        );
        assert_eq!(
            describe_call(&json!({"kind": "lifecycle", "op": "delete"})),
            "lifecycle delete"
        );
        assert_eq!(describe_call(&json!({"kind": "snapshot"})), "snapshot");
    }
}
