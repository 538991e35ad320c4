//! The typed commands (request bodies of the front doors) and their validation.

use super::prelude::*;
use strata_policy::ExecStdin;

/// A size in a request: missing fields come from the template (or the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SizeSpec {
    /// Virtual CPUs.
    pub vcpus: Option<u32>,
    /// Memory in MiB.
    pub memory_mib: Option<u32>,
    /// Disk in GiB.
    pub disk_gib: Option<u32>,
}

impl SizeSpec {
    /// Fills missing fields from `base`.
    pub fn over(&self, base: SandboxSize) -> SandboxSize {
        SandboxSize {
            vcpus: self.vcpus.unwrap_or(base.vcpus),
            memory_mib: self.memory_mib.unwrap_or(base.memory_mib),
            disk_gib: self.disk_gib.unwrap_or(base.disk_gib),
        }
    }
}

/// Settings of a new sandbox (create and fork).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Size (fields default to the template's or the source's).
    #[serde(default)]
    pub size: SizeSpec,
    /// Labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Idle timeout, e.g. `"30m"`; `"0s"` never hibernates.
    #[serde(default)]
    pub idle_timeout: Option<String>,
    /// Rolling snapshot interval, e.g. `"60s"`; `"0s"` turns them off.
    #[serde(default)]
    pub snapshot_interval: Option<String>,
    /// What the idle timeout does and whether use wakes it (default:
    /// hibernate, wake on use; a fork: its source's).
    #[serde(default)]
    pub lifecycle: Option<LifecyclePolicy>,
    /// Replicate its snapshots to another host of the cluster, to recover
    /// it there when its host is lost (docs/cluster.md "Replicas"; default
    /// off; without `[cluster]` kept and unused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicate: Option<bool>,
}

/// `PATCH /v1/sandboxes/{id}`: settings kept beside the record; a field
/// left out is unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchSandbox {
    /// Replication to another host of the cluster (docs/cluster.md
    /// "Replicas"): on, the newest snapshot is replicated at once; off, the
    /// replicas are forgotten (recovery no longer uses them).
    #[serde(default)]
    pub replicate: Option<bool>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Template to start from (default: the newest ready template).
    #[serde(default)]
    pub template: Option<TemplateId>,
    /// When the size asked needs a variant of the template not built yet
    /// (`service::variants`): wait for it (up to `[templates]
    /// variant_wait`) instead of answering `202` with its progress.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait: bool,
    /// Settings.
    #[serde(flatten)]
    pub spec: SandboxSpec,
}

/// Where a rewind goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rewind {
    /// A snapshot of this sandbox.
    #[serde(default)]
    pub to: Option<SnapshotId>,
    /// Or a time ago, e.g. `"10m"`: the newest snapshot at or before then.
    #[serde(default)]
    pub ago: Option<String>,
}

/// `POST /v1/sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeSnapshot {
    /// Free-form label.
    #[serde(default)]
    pub label: Option<String>,
}

/// `POST /v1/templates`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildTemplate {
    /// Id to use (default: generated).
    #[serde(default)]
    pub id: Option<TemplateId>,
    /// Human name.
    #[serde(default)]
    pub name: Option<String>,
    /// Size of the template guest (with a recipe: the base's vCPUs and
    /// memory; the disk may be larger).
    #[serde(default)]
    pub size: SizeSpec,
    /// Build from this recipe (a base template and steps) instead of
    /// booting the image (`service::build`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<strata_template::Recipe>,
    /// PEM certificates the builder's guest trusts (appended to its system
    /// bundle `/etc/ssl/certs/ca-certificates.crt` before the first step,
    /// and kept in the template; `NODE_EXTRA_CA_CERTS` names them during
    /// the build): for hosts whose registry TLS is re-signed by a local CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_bundle: Option<String>,
    /// Other sizes (vCPUs and memory) to build variants of once the
    /// template is ready (`service::variants`): creates of those sizes are
    /// forks from the start.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sizes: Vec<SizeSpec>,
}

/// Progress of a template build (kept in memory).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BuildProgress {
    /// Current step.
    pub step: String,
    /// Fraction done, when known.
    pub fraction: Option<f32>,
}

/// A template with its build progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateView {
    /// The record.
    #[serde(flatten)]
    pub record: TemplateRecord,
    /// Progress while building.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<BuildProgress>,
}

pub(crate) fn lifecycle(op: &str) -> CallKind {
    CallKind::Lifecycle { op: op.to_owned() }
}

pub(crate) fn parse_opt_duration(s: &Option<String>, what: &str) -> ServiceResult<Option<u64>> {
    match s {
        None => Ok(None),
        Some(s) => crate::duration::parse_duration(s)
            .map(|d| Some(d.as_secs()))
            .map_err(|e| ServiceError::InvalidRequest(format!("{what}: {e}"))),
    }
}

/// Checks a guest path from a request: absolute, no `..`, no NUL, bounded.
pub fn validate_guest_path(path: &str) -> ServiceResult<()> {
    let bad = |why: &str| {
        Err(ServiceError::InvalidRequest(format!(
            "path {path:?}: {why}"
        )))
    };
    if path.is_empty() {
        return bad("empty");
    }
    if path.len() > 4096 {
        return bad("longer than 4096 bytes");
    }
    if path.contains('\0') {
        return bad("contains a NUL byte");
    }
    if !path.starts_with('/') {
        return bad("must be absolute");
    }
    if path.split('/').any(|c| c == "..") {
        return bad("contains a `..` component");
    }
    Ok(())
}

/// Checks a command from a request: a program (or a script), no NUL bytes,
/// a valid cwd, stdin given as bytes if at all (the engine has no stdin writer).
pub(crate) fn validate_exec(req: &ExecRequest) -> ServiceResult<()> {
    let words: &[String] = match &req.command {
        Command::Argv(argv) => argv,
        Command::Shell(script) => std::slice::from_ref(script),
    };
    if words.first().is_none_or(|w| w.is_empty()) {
        return Err(ServiceError::InvalidRequest(
            "cmd: give at least the program".into(),
        ));
    }
    if words
        .iter()
        .chain(req.env.keys())
        .chain(req.env.values())
        .chain(req.user.iter())
        .any(|s| s.contains('\0'))
    {
        return Err(ServiceError::InvalidRequest(
            "cmd/env: NUL bytes are not allowed".into(),
        ));
    }
    if let Some(cwd) = &req.cwd {
        validate_guest_path(cwd)?;
    }
    if req.stdin == Stdin::Stream {
        return Err(ServiceError::InvalidRequest(
            "stdin: give the bytes (a stdin stream has no writer here)".into(),
        ));
    }
    Ok(())
}

/// The tool call a command is, for the gate: its argv or script, and what
/// it runs with besides (env, cwd, stdin; a terminal makes stdin a stream).
pub(crate) fn exec_call(req: &ExecRequest) -> CallKind {
    let kind = match &req.command {
        Command::Argv(argv) => CallKind::exec(argv.clone()),
        Command::Shell(script) => CallKind::shell(script.clone()),
    };
    let stdin = match (&req.stdin, req.pty) {
        (Stdin::Stream, _) | (_, Some(_)) => ExecStdin::Stream,
        (Stdin::Bytes(b), None) => ExecStdin::Bytes(b.len() as u64),
        (Stdin::Null, None) => ExecStdin::None,
    };
    kind.with_context(&req.env, req.cwd.clone(), stdin)
}

/// The bytes a command carries for the gate besides its call: its stdin,
/// when given as bytes (a held command's approval is bound to them).
pub(crate) fn exec_body(req: &ExecRequest) -> Option<strata_policy::approval::BodyDigest> {
    match (&req.stdin, req.pty) {
        (Stdin::Bytes(b), None) => Some(strata_policy::approval::BodyDigest::of(b)),
        _ => None,
    }
}

/// Longest idle timeout a sandbox may have (a year): larger values would
/// overflow the time arithmetic of the E2B door's `endAt` and gain nothing.
pub const MAX_IDLE_TIMEOUT_S: u64 = 366 * 24 * 3600;

/// Id of the template built on first start.
pub const DEFAULT_TEMPLATE: &str = "tpl-default";

/// A sandbox made from a snapshot keeps its vCPUs and memory; its disk only grows.
pub(crate) fn check_source_size(
    what: &str,
    source: SandboxSize,
    asked: SandboxSize,
) -> ServiceResult<()> {
    if asked.vcpus != source.vcpus || asked.memory_mib != source.memory_mib {
        return Err(ServiceError::InvalidRequest(format!(
            "{what} has {} vCPU(s) and {} MiB; a sandbox made from it keeps them (asked {} vCPU(s), {} MiB): leave vcpus/memory_mib out or build a template of that size",
            source.vcpus, source.memory_mib, asked.vcpus, asked.memory_mib
        )));
    }
    if asked.disk_gib < source.disk_gib {
        return Err(ServiceError::InvalidRequest(format!(
            "disk_gib {} is smaller than {what}'s {} GiB; disks only grow",
            asked.disk_gib, source.disk_gib
        )));
    }
    Ok(())
}

pub(crate) fn validate_labels(labels: &BTreeMap<String, String>) -> ServiceResult<()> {
    if labels.len() > 64 {
        return Err(ServiceError::InvalidRequest("at most 64 labels".into()));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
        if !key_ok || v.len() > 255 || v.contains('\0') {
            return Err(ServiceError::InvalidRequest(format!(
                "label {k:?}: keys are 1-63 of [A-Za-z0-9-_./], values at most 255 bytes"
            )));
        }
    }
    Ok(())
}
