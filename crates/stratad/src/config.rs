//! Daemon configuration: embedded defaults, an optional TOML file, then flags.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_core::{Accel, SandboxSize};

use crate::duration::serde_human;
use crate::retention::RetentionPolicy;

/// The defaults, as a TOML file (also the reference for the file format).
pub const DEFAULT_TOML: &str = include_str!("../stratad.default.toml");

/// How creates, forks and wakes are admitted on this host (`[capacity]
/// admission`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AdmissionMode {
    /// By what the host measures: the running sandboxes' recent CPU peaks
    /// and memory, with headroom kept (`service::admission`).
    #[default]
    Use,
    /// By nominal sizes: vCPUs × `cpu_overcommit` and memory reserved.
    Nominal,
}

/// Host capacity the daemon places sandboxes against.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Capacity {
    /// Host CPUs given to sandboxes (0: all of the host's). Nominal
    /// admission multiplies it by `cpu_overcommit`; admission by use
    /// counts it in cores.
    pub vcpus: u32,
    /// Memory available to sandboxes in MiB (0: 90 % of the host's RAM).
    /// Nominal admission reserves each sandbox's size against it;
    /// admission by use keeps `memory_headroom` of the host's RAM free.
    pub memory_mib: u64,
    /// How many vCPUs may share one host CPU (nominal admission).
    pub cpu_overcommit: f64,
    /// `use` (the default) or `nominal`.
    pub admission: AdmissionMode,
    /// Admission by use: share of the CPUs kept free for bursts beyond
    /// the running sandboxes' recent peaks (0..1).
    pub cpu_headroom: f64,
    /// Admission by use: share of the host's RAM kept available (0..1).
    pub memory_headroom: f64,
    /// Admission by use: how far back a sandbox's recent CPU peak reaches.
    #[serde(with = "serde_human")]
    pub peak_window: Duration,
    /// Admission by use: cores a sandbox is counted at per vCPU until the
    /// sampler has measured it (a new sandbox, a wake without history).
    pub new_sandbox_cpu: f64,
    /// Admission by use: the least a running sandbox is counted at, in
    /// cores, whatever it measured.
    pub idle_cpu_floor: f64,
    /// Admission by use: the most of the CPU budget the host's other load
    /// (programs besides the VMs) may take from sandboxes (0..1). Beyond
    /// it, other load is not counted: a busy laptop still admits idle
    /// sandboxes, which cost almost nothing, instead of refusing with no
    /// VM to protect.
    pub other_load_share: f64,
    /// Admission by use admits at least what nominal admission would: while
    /// the vCPUs held stay within the CPUs × `cpu_overcommit`, the CPU is
    /// not judged by use (memory still is). A small host is then never
    /// stricter than before because one sandbox was briefly busy; use
    /// decides beyond that.
    pub nominal_floor: bool,
    /// Most VMs (sandboxes with a VM, warm guests, builders) at once, in
    /// either mode (0: no limit).
    pub max_vms: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Capacity {
            vcpus: 0,
            memory_mib: 0,
            cpu_overcommit: 4.0,
            admission: AdmissionMode::Use,
            cpu_headroom: 0.25,
            memory_headroom: 0.10,
            peak_window: Duration::from_secs(60),
            new_sandbox_cpu: 0.25,
            idle_cpu_floor: 0.005,
            other_load_share: 0.5,
            nominal_floor: true,
            max_vms: 512,
        }
    }
}

impl Capacity {
    /// Host CPUs given to sandboxes (`vcpus`, or the host's count).
    pub fn cores(&self) -> u64 {
        if self.vcpus == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get() as u64)
                .unwrap_or(1)
        } else {
            u64::from(self.vcpus)
        }
    }

    /// The vCPUs nominal admission gives out: the CPUs × `cpu_overcommit`
    /// (at least 1).
    pub fn nominal_vcpus(&self) -> u64 {
        ((self.cores() as f64) * self.cpu_overcommit.max(1.0)) as u64
    }

    /// Resolves automatic values against this host: `(vcpus, memory_mib)`
    /// of nominal admission.
    pub fn resolve(&self) -> (u64, u64) {
        let vcpus = self.nominal_vcpus();
        let mem = if self.memory_mib == 0 {
            host_memory_mib().map(|m| m * 9 / 10).unwrap_or(4096)
        } else {
            self.memory_mib
        };
        (vcpus, mem)
    }

    /// Checks the values that have a range.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("cpu_headroom", self.cpu_headroom),
            ("memory_headroom", self.memory_headroom),
            ("other_load_share", self.other_load_share),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(format!("[capacity] {name} must be in 0..1, got {v}"));
            }
        }
        for (name, v) in [
            ("new_sandbox_cpu", self.new_sandbox_cpu),
            ("idle_cpu_floor", self.idle_cpu_floor),
            ("cpu_overcommit", self.cpu_overcommit),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("[capacity] {name} must be a number >= 0, got {v}"));
            }
        }
        Ok(())
    }
}

/// `[pressure]`: pressure-driven hibernation (`service::lifecycle::pressure`).
/// When the host's CPU or memory pressure (PSI, `/proc/pressure/*`) stays
/// over a threshold, warm guests end first, then the least recently active
/// idle sandboxes hibernate (memory kept; the next call or port request
/// wakes them), one every `step` while it lasts. Never one with a call in
/// flight, one used within `min_idle`, or one whose lifecycle policy does
/// not wake it on use. The idle timeout stays the upper bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PressureConfig {
    /// Whether pressure hibernates anything (admission still may).
    pub enabled: bool,
    /// Between two readings of the host's pressure.
    #[serde(with = "serde_human")]
    pub interval: Duration,
    /// CPU pressure (share of the time some task waited for a CPU, percent)
    /// that counts as pressure.
    pub cpu_pct: f64,
    /// Memory pressure (share of the time some task stalled on memory,
    /// percent) that counts as pressure.
    pub memory_pct: f64,
    /// Readings in a row over a threshold before anything is done.
    pub sustain: u32,
    /// A sandbox used more recently than this is not idle.
    #[serde(with = "serde_human")]
    pub min_idle: Duration,
    /// Time between two hibernations while the pressure lasts.
    #[serde(with = "serde_human")]
    pub step: Duration,
}

impl Default for PressureConfig {
    fn default() -> Self {
        PressureConfig {
            enabled: true,
            interval: Duration::from_secs(1),
            cpu_pct: 60.0,
            memory_pct: 10.0,
            sustain: 3,
            min_idle: Duration::from_secs(15),
            step: Duration::from_secs(2),
        }
    }
}

fn host_memory_mib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// Limits of one tenant (`[quotas.tenant]`, `[quotas.tenants.<name>]`):
/// unset fields are unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantLimits {
    /// Sandboxes not deleted (hibernated ones count).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u64>,
    /// vCPUs of the tenant's sandboxes with a VM (or starting one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u64>,
    /// Memory (MiB) of the tenant's sandboxes with a VM (or starting one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Pool bytes charged to the tenant's snapshots (see `docs/snapshots.md`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_bytes: Option<u64>,
}

impl TenantLimits {
    /// These limits with every field `over` sets replacing the one here.
    pub fn overridden_by(self, over: &TenantLimits) -> TenantLimits {
        TenantLimits {
            sandboxes: over.sandboxes.or(self.sandboxes),
            vcpus: over.vcpus.or(self.vcpus),
            memory_mib: over.memory_mib.or(self.memory_mib),
            pool_bytes: over.pool_bytes.or(self.pool_bytes),
        }
    }
}

/// Limits of every single sandbox (`[quotas.sandbox]`): unset fields are unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// vCPUs of one sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u64>,
    /// Memory (MiB) of one sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Pool bytes charged to one sandbox's snapshots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_bytes: Option<u64>,
}

/// `[quotas]`: per-tenant and per-sandbox limits, enforced by strata (never
/// by a kernel limit on a live subvolume), refused with `quota_exceeded`.
/// Everything unset (the default) is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaConfig {
    /// Limits of every tenant without an override.
    pub tenant: TenantLimits,
    /// Per-tenant overrides: each field set replaces the default's.
    pub tenants: BTreeMap<String, TenantLimits>,
    /// Limits of each sandbox.
    pub sandbox: SandboxLimits,
    /// Bytes of the pool's space reserve (`<pool>/.reserve`, fallocated),
    /// released when free space falls under `reserve_low_water_bytes` so
    /// running guests keep writing (0: no reserve).
    pub reserve_bytes: u64,
    /// Free bytes under which the reserve is released (0: 1/4 of the reserve).
    pub reserve_low_water_bytes: u64,
}

impl QuotaConfig {
    /// The limits of `tenant`: the default with its override applied.
    pub fn for_tenant(&self, tenant: &str) -> TenantLimits {
        match self.tenants.get(tenant) {
            Some(o) => self.tenant.overridden_by(o),
            None => self.tenant,
        }
    }

    /// True when some pool-bytes limit is set (charges are then computed on
    /// the snapshot path).
    pub fn limits_pool_bytes(&self) -> bool {
        self.tenant.pool_bytes.is_some()
            || self.sandbox.pool_bytes.is_some()
            || self.tenants.values().any(|t| t.pool_bytes.is_some())
    }

    /// The low-water mark of the reserve.
    pub fn reserve_low_water(&self) -> u64 {
        if self.reserve_low_water_bytes == 0 {
            self.reserve_bytes / 4
        } else {
            self.reserve_low_water_bytes
        }
    }
}

/// `[security]` of the daemon configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecurityConfig {
    /// Require `Authorization: Bearer <token>` on `/v1` (except `/healthz`,
    /// `/metrics`). Off: every caller is an admin of tenant `default`
    /// (local development only).
    pub auth: bool,
    /// Platform policy file (TOML, see `crates/strata-policy/docs/policy.md`);
    /// unset: a built-in platform policy with `default = "allow"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform_policy: Option<PathBuf>,
    /// How long a held call waits for an approver by default.
    #[serde(with = "serde_human")]
    pub approval_timeout: Duration,
    /// Longest `approval_timeout` a request may ask for.
    #[serde(with = "serde_human")]
    pub max_approval_timeout: Duration,
    /// A pending approval request nobody answered within this is timed out
    /// (denied), whether or not its caller still waits (`wait=false`, a
    /// restart).
    #[serde(with = "serde_human")]
    pub approval_pending_ttl: Duration,
    /// How long after it was approved an approval may be used (a
    /// `?approval=<id>` re-submission); later it is refused.
    #[serde(with = "serde_human")]
    pub approval_ttl: Duration,
    /// Most pending approval requests per sandbox (per tenant for calls
    /// without one); more are refused with `rate_limited` (429).
    pub max_pending_approvals_per_sandbox: usize,
    /// Largest upload held for approval, in bytes: it is spooled to a
    /// file under `<data_dir>/held-uploads` so the approver sees its size
    /// and SHA-256 and the approval is bound to them (also capped by
    /// `max_upload_bytes`); larger answers `413`.
    pub held_upload_max_bytes: u64,
    /// Bytes all spooled held uploads may take at once; past it a held
    /// upload is refused with `insufficient_capacity` until others end.
    pub held_uploads_total_bytes: u64,
    /// Sustained requests per second per token (0: no limit).
    pub rate_limit_per_second: f64,
    /// Requests a token may make at once before the sustained rate applies.
    pub rate_limit_burst: u32,
    /// No longer used: each sandbox's egress proxy is served in-process on
    /// its tunnels, with no listener (accepted so old files still load).
    pub egress_bind: IpAddr,
    /// Host names the egress proxy resolves to fixed addresses instead of
    /// DNS (pinning connector hosts; tests point them at loopback). The
    /// system resolver refuses private and loopback answers.
    pub egress_static_hosts: BTreeMap<String, IpAddr>,
    /// Non-public ranges (CIDRs) a DNS answer for an allowed host may fall
    /// in: the system resolver refuses private, CGNAT and documentation
    /// answers unless they are inside one of these (a network whose DNS
    /// sends registries to an internal mirror or a TLS-inspecting gateway).
    /// Loopback, link-local, multicast and reserved answers stay refused.
    #[serde(default)]
    pub egress_resolved_ranges: Vec<String>,
    /// Intercept TLS to connector hosts (`docs/tls-interception.md`): the
    /// egress proxy terminates a guest's TLS to a host a connector of its
    /// tenant names (leaf of the deployment's interception CA, kept in
    /// `key_dir`), judges every request inside like plain HTTP and opens
    /// verified TLS upstream. Off by default: a guest trusts the CA only
    /// once its image or template has it (`strata-image` bakes it in).
    #[serde(default)]
    pub egress_tls_intercept: bool,
    /// `mcp` connectors of a **tenant** policy may run a stdio `command`
    /// on the host (`docs/mcp.md`). Off: only the platform policy's may
    /// (a tenant admin could otherwise run any program on the host).
    #[serde(default)]
    pub mcp_tenant_stdio: bool,
    /// `mcp` connectors of a tenant policy may name a `url` whose host is
    /// (or resolves to) a loopback, private, link-local or otherwise
    /// non-public address. Off: refused (the gateway is not a way into the
    /// host's networks); the platform policy's connectors may always.
    #[serde(default)]
    pub mcp_tenant_private_urls: bool,
    /// A PEM bundle of CA certificates intercepted upstreams may also
    /// chain to, besides the system roots (an internal API's CA; tests'
    /// CAs).
    #[serde(default)]
    pub egress_upstream_ca_bundle: Option<PathBuf>,
    /// Addresses an OAuth2 secret's token URL may resolve to although the
    /// egress proxy's public-address filter refuses them (test-only, like
    /// `[webhooks] allow_private`; `docs/secrets.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets_allow_private: Vec<String>,
    /// Addresses (IP literals) a push (`POST /v1/sandboxes/{id}/push`) may
    /// reach although they are loopback or private: the remote deployments
    /// on this operator's own networks. Every other push target must pass
    /// the egress proxy's public-address filter (docs/move.md), so a token
    /// cannot aim the daemon at the host's networks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub push_allow_private: Vec<String>,
}

impl Default for SecurityConfig {
    fn default() -> Self {
        SecurityConfig {
            auth: true,
            platform_policy: None,
            approval_timeout: Duration::from_secs(60),
            max_approval_timeout: Duration::from_secs(600),
            approval_pending_ttl: Duration::from_secs(3600),
            approval_ttl: Duration::from_secs(3600),
            max_pending_approvals_per_sandbox: 32,
            held_upload_max_bytes: 64 << 20,
            held_uploads_total_bytes: 1 << 30,
            rate_limit_per_second: 50.0,
            rate_limit_burst: 100,
            egress_bind: IpAddr::from([127, 0, 0, 1]),
            egress_static_hosts: BTreeMap::new(),
            egress_resolved_ranges: Vec::new(),
            egress_tls_intercept: false,
            mcp_tenant_stdio: false,
            mcp_tenant_private_urls: false,
            egress_upstream_ca_bundle: None,
            secrets_allow_private: Vec::new(),
            push_allow_private: Vec::new(),
        }
    }
}

/// `[e2b]`: the E2B-compatible front door (the `strata-e2b` crate). The
/// `stratad` binary serves it on the API's listener when `enabled` (or
/// `--e2b`); this library only carries the settings (an embedder mounts the
/// door itself, see [`crate::daemon::Mount`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct E2bSettings {
    /// Serve the E2B control plane and envd next to `/v1`.
    pub enabled: bool,
    /// Accepted `X-API-KEY` values besides strata API tokens, each
    /// `KEY=TENANT[:ACTOR]` (a developer of that tenant, audited as ACTOR,
    /// by default `e2b-key-<12 hex of the key's SHA-256>`) or a bare `KEY`
    /// (a developer of tenant `default`, actor `e2b-api-key`, as before).
    /// Each key has its own token bucket. Flags: `--e2b-api-key`, env
    /// `STRATA_E2B_API_KEYS`. Empty with `[security] auth = false`: the
    /// control plane is open to anyone who can reach the listener.
    pub api_keys: Vec<String>,
    /// File holding the secret the per-sandbox envd access tokens are derived
    /// from (created with mode 0600 on first start); unset:
    /// `<data_dir>/e2b.secret`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_secret_file: Option<PathBuf>,
    /// Guest directory relative paths resolve against (E2B's user home).
    pub home_dir: String,
    /// `clientID` reported for every sandbox.
    pub client_id: String,
    /// Sandbox timeout when a create request gives none.
    #[serde(with = "serde_human")]
    pub default_timeout: Duration,
    /// Largest Connect / JSON request body in bytes (every E2B route but
    /// `POST /files`, which streams under `max_upload_bytes`); larger
    /// answers `413`.
    pub max_request_bytes: u64,
    /// Requests per second sustained of each configured key (control plane)
    /// and of each sandbox (envd calls); `0` turns these limits off.
    pub rate_limit_per_second: f64,
    /// Requests at once of those token buckets.
    pub rate_limit_burst: u32,
    /// Failed authentications a source address may make per minute (as
    /// many at once); past that the address gets `429` until its bucket
    /// refills. `0`: no limit.
    pub auth_failures_per_minute: u32,
    /// The `domain` of the create/connect answers: the SDKs' `get_host(port)`
    /// is `<port>-<sandbox id>.<domain>`, routed by the `Host` header (a
    /// real wildcard domain, e.g. `sandboxes.example.com`). Unset:
    /// `localhost:<the port of listen>` (docs/ports.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Guest ports are reachable without a credential, by anyone who knows
    /// the sandbox id (E2B's `allow_public_traffic` default). `false`: a
    /// port request needs `e2b-traffic-access-token`, `X-Access-Token` or
    /// `X-API-KEY`.
    pub public_ports: bool,
    /// Also serve the daemon's routes (routed hosts `<port>-<id>.<domain>`
    /// among them) over TLS on this address, with certificates from a local
    /// CA the daemon keeps (`<data_dir>/ca/ca.pem`, `strata ca`). With
    /// `domain` unset the answers' default becomes `localhost:<this port>`.
    /// Unset (default): no TLS listener. Flag: `--e2b-tls-listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_listen: Option<std::net::SocketAddr>,
    /// PEM CA bundle (at most 1 MiB) the door's E2B template builds
    /// (`Template().build()`) give their builder, as `strata template build
    /// --ca-bundle` does: for hosts whose registry TLS is re-signed by a
    /// local CA (docs/templates.md). Unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template_ca_bundle: Option<PathBuf>,
}

impl Default for E2bSettings {
    fn default() -> Self {
        E2bSettings {
            enabled: false,
            api_keys: Vec::new(),
            token_secret_file: None,
            home_dir: "/root".into(),
            client_id: "strata".into(),
            default_timeout: Duration::from_secs(300),
            max_request_bytes: 16 << 20,
            rate_limit_per_second: 100.0,
            rate_limit_burst: 200,
            auth_failures_per_minute: 60,
            domain: None,
            public_ports: true,
            tls_listen: None,
            template_ca_bundle: None,
        }
    }
}

impl E2bSettings {
    /// The envd token secret file: `token_secret_file`, else
    /// `<data_dir>/e2b.secret`.
    pub fn token_secret_path(&self, data_dir: &Path) -> PathBuf {
        self.token_secret_file
            .clone()
            .unwrap_or_else(|| data_dir.join("e2b.secret"))
    }
}

/// Everything `stratad` can be told.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the HTTP API.
    pub listen: SocketAddr,
    /// State directory: `strata.db`, `pool.img`, `pool/` (the pool's mount point).
    pub data_dir: PathBuf,
    /// Accelerator for new VMs.
    pub accel: Accel,
    /// Size of the pool image (`<data_dir>/pool.img`, sparse) created on first
    /// start, in GiB; a larger value grows an existing image.
    pub pool_size_gib: u64,
    /// An existing btrfs directory to use as the pool instead of the image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_path: Option<PathBuf>,
    /// Per-VM sockets, pid files and console logs. Short on purpose: unix
    /// socket paths inside it must stay under 108 bytes.
    pub run_dir: PathBuf,
    /// The key store (`security::keys`): a directory outside the data dir
    /// (mode 0700) holding the deployment's master key (`master.key`,
    /// 0600), created on first use. A copy of the data dir without it
    /// reveals no sealed value (a sandbox's stored environment variables).
    /// It also holds the key that signs snapshots and templates: the daemon
    /// does not start without it, and losing it makes every existing
    /// snapshot unrestorable (docs/keys.md).
    pub key_dir: PathBuf,
    /// Guest image directory (`strata image build` prints it); unset: the
    /// newest image in the image cache (`$STRATA_IMAGE_CACHE` or
    /// `/var/cache/strata/images`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_dir: Option<PathBuf>,
    /// QEMU binary.
    pub qemu_binary: PathBuf,
    /// How long to wait for a guest agent after a boot or a restore.
    #[serde(with = "serde_human")]
    pub agent_timeout: Duration,
    /// Cap of each VM's console log, in bytes.
    pub console_log_max_bytes: u64,
    /// TCG's translation block cache per VM, MiB (ignored under KVM). Under
    /// TCG each new guest process is translated afresh; a cache too small
    /// for a guest's commands is flushed whole and the next command runs
    /// 2–3× slower. Resident only as far as used.
    pub tcg_tb_size_mib: u32,
    /// On start, build the template `tpl-default` (named `default`, of
    /// `default_size`) in the background when no template exists.
    pub default_template: bool,
    /// How long a create without a template waits for a template that is
    /// still being built before answering `409 invalid_state`.
    #[serde(with = "serde_human")]
    pub template_wait: Duration,
    /// Rolling snapshot interval (a sandbox may override it; `0s` turns them off).
    #[serde(with = "serde_human")]
    pub snapshot_interval: Duration,
    /// Idle time after which a sandbox hibernates (a sandbox may override it; `0s`: never).
    #[serde(with = "serde_human")]
    pub idle_timeout: Duration,
    /// Period of the GC sweep over every sandbox with snapshots.
    #[serde(with = "serde_human")]
    pub gc_sweep_interval: Duration,
    /// Scheduled tasks (snapshots, hibernations) run at once.
    pub max_concurrent_tasks: usize,
    /// Retention of rolling snapshots.
    pub retention: RetentionPolicy,
    /// `[snapshots]`: rolling snapshots of unchanged guests (docs/snapshots.md).
    pub snapshots: SnapshotsConfig,
    /// Size of a sandbox created without one.
    pub default_size: SandboxSize,
    /// Host capacity.
    pub capacity: Capacity,
    /// Largest JSON request body, in bytes.
    pub max_json_body_bytes: usize,
    /// Largest file upload, in bytes.
    pub max_upload_bytes: u64,
    /// How long a connection to a running sandbox's port retries a guest
    /// port that refuses it (a server the agent just started may not listen
    /// yet), with backoff from 50 ms to 500 ms; `0s`: a refusal is final at
    /// once. A connection that woke its sandbox retries for at least 10 s.
    #[serde(with = "serde_human")]
    pub port_connect_grace: Duration,
    /// Recovery removes subvolumes that no record owns (VMs no record owns
    /// are ended whatever this says).
    pub clean_orphans: bool,
    /// A sandbox whose VM died is restored from its latest snapshot.
    pub auto_recover: bool,
    /// Read-only SQLite connections.
    pub db_readers: usize,
    /// Tokens, policy, approvals, audit, egress, rate limits.
    pub security: SecurityConfig,
    /// The E2B-compatible front door (served by the `stratad` binary).
    pub e2b: E2bSettings,
    /// Per-tenant and per-sandbox quotas, the pool's space reserve.
    pub quotas: QuotaConfig,
    /// Caps on guest egress connections (tunnels).
    pub egress: EgressConfig,
    /// The per-sandbox usage sampler (`docs/metrics.md`).
    pub metrics: MetricsConfig,
    /// `[pressure]`: pressure-driven hibernation (docs/capacity.md).
    pub pressure: PressureConfig,
    /// `[logs]`: process logs kept per sandbox.
    pub logs: LogsConfig,
    /// `[templates]`: recipe builds (docs/templates.md).
    pub templates: TemplatesConfig,
    /// `[pools]`: warm pools, sandboxes started ahead of creates
    /// (docs/warm-pools.md).
    pub pools: PoolsConfig,
    /// `[listener]`: connection cap and timeouts of every HTTP listener
    /// (docs/listener.md).
    pub listener: crate::listener::ListenerConfig,
    /// Also serve the API (`/v1`, and the E2B door's routes when it is
    /// mounted) over TLS on this address, with `tls_cert` and `tls_key`
    /// (docs/listener.md). Unset (default): plain HTTP on `listen` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_listen: Option<SocketAddr>,
    /// PEM certificate chain of `tls_listen` (leaf first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert` (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// `[vm]`: how QEMU is confined (docs/hardening.md).
    pub vm: VmConfig,
    /// `[events]`: the journal's retention and the event streams
    /// (docs/events.md).
    pub events: crate::events::EventsConfig,
    /// `[webhooks]`: approval notifications (docs/events.md).
    pub webhooks: crate::events::WebhooksConfig,
    /// `[console]`: where the web console is reached (the link in a
    /// webhook's payload; docs/events.md).
    pub console: crate::events::ConsoleConfig,
    /// `[store]`: where the metadata store lives (docs/store.md).
    pub store: StoreConfig,
    /// `[cluster]`: one host of several on one PostgreSQL (docs/cluster.md).
    pub cluster: crate::cluster::ClusterConfig,
}

/// `[store]`: where the metadata store lives (docs/store.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `postgres://…` or `postgresql://…`: PostgreSQL; `sqlite:PATH`: that
    /// SQLite file; unset (default): SQLite at `<data_dir>/strata.db`.
    /// With PostgreSQL the security tables (tokens, policies, approvals,
    /// audit heads, envd tokens, connector secrets) are there too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// PostgreSQL: the schema of the tables (created if missing); unset:
    /// the connection's default (`public`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// PostgreSQL: most connections of this daemon.
    pub pool_size: usize,
    /// PostgreSQL: bound of every store call (pool wait, connect and
    /// statements together); beyond it the call fails `storage_failed`.
    #[serde(with = "serde_human")]
    pub timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: None,
            schema: None,
            pool_size: 8,
            timeout: Duration::from_secs(10),
        }
    }
}

/// Which store `[store] url` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL connection string.
    Postgres(String),
}

/// `[vm]`: how every VM's QEMU is confined (docs/hardening.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    /// The unprivileged user QEMU switches to (`-runas`) once it has opened
    /// its files.
    pub user: String,
    /// When `user` does not exist, run QEMU as the daemon's user (root)
    /// instead of refusing to start. Logged at every start.
    pub allow_root: bool,
    /// A VM whose cgroup (CPU and memory limits) cannot be set up does not
    /// start. `false`: it starts without limits (logged at start and for
    /// each such VM).
    pub require_cgroups: bool,
    /// The named network namespace every QEMU joins (created empty at start
    /// when missing: `ip netns add`). `""`: QEMU keeps the host's network
    /// namespace (logged).
    pub netns: String,
    /// Disk operations per second each sandbox's root disk may do (QEMU
    /// block throttling, reads and writes together); `0`: no limit.
    pub disk_iops: u64,
    /// Disk bytes per second each sandbox's root disk may move; `0`: no
    /// limit.
    pub disk_bps: u64,
    /// Whether a guest's disk flush (an `fsync` inside the sandbox) is
    /// passed to the host's disk (the default). `false`: QEMU answers it at
    /// once (`cache.no-flush=on`). On the btrfs pool such a flush can commit
    /// the whole pool's transaction, outside the pauses' commit gate; a
    /// sandbox's state after a host crash is its newest snapshot either way
    /// (its RAM is gone, so a flushed disk without it is never booted).
    /// docs/hardening.md "Guest disk flushes".
    pub guest_disk_flush: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            user: strata_vmm::DEFAULT_VM_USER.to_owned(),
            allow_root: false,
            require_cgroups: true,
            netns: strata_vmm::netns::DEFAULT_NETNS.to_owned(),
            disk_iops: 0,
            disk_bps: 0,
            guest_disk_flush: true,
        }
    }
}

/// `[pools]`: warm pools. A warm guest is a sandbox of a template at the
/// template's size, restored ahead of time and paused (memory, no CPU); a
/// create of that template and size claims one (resumed, given fresh
/// entropy, the clock, its owner's egress) instead of restoring. Warm
/// guests count against the host's capacity and are the first to go when
/// a create, fork or wake needs the room.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolsConfig {
    /// Warm guests of the default template (the one a create without a
    /// template gets) at its size.
    pub default_template: usize,
    /// Warm pools of other templates.
    pub templates: Vec<WarmPoolConfig>,
    /// Most warm guests this host keeps, all pools together.
    pub max_total: usize,
}

/// One `[[pools.templates]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmPoolConfig {
    /// A template id, or the name of a platform template (the newest ready
    /// one of that name).
    pub template: String,
    /// Warm guests kept.
    pub count: usize,
    /// vCPUs of the pool's guests [default: the template's]; another size
    /// than the template's is a pool of its size variant (built first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Memory of the pool's guests in MiB [default: the template's].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
}

impl Default for PoolsConfig {
    fn default() -> Self {
        PoolsConfig {
            default_template: 1,
            templates: Vec::new(),
            max_total: 8,
        }
    }
}

/// `[snapshots]`: what a rolling snapshot of a guest where nothing changed
/// since its previous snapshot does (`service::unchanged`,
/// docs/snapshots.md "Unchanged guests"). The interval itself is the
/// top-level `snapshot_interval`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotsConfig {
    /// Record a rolling snapshot of an unchanged guest (no disk writes, no
    /// API, port or egress activity, CPU under `unchanged_max_cpu_pct`) as
    /// `same_as` its previous snapshot, without pausing it or writing a
    /// subvolume. `false`: every rolling snapshot is taken.
    pub skip_unchanged: bool,
    /// Peak CPU (percent of the sandbox's vCPUs, as the `[metrics]`
    /// sampler measures it) under which a guest counts as idle. An idle
    /// guest under TCG uses 2-3 %; under KVM well under 1 %.
    pub unchanged_max_cpu_pct: f64,
    /// Most guests stopped by snapshots at once on this host (rolling,
    /// manual, E2B pauses and fork sources alike). A snapshot waits for a
    /// slot with its guest still running, so a wave of them queues instead
    /// of stacking pauses.
    pub max_concurrent_pauses: usize,
}

impl Default for SnapshotsConfig {
    fn default() -> Self {
        SnapshotsConfig {
            skip_unchanged: true,
            unchanged_max_cpu_pct: 1.0,
            max_concurrent_pauses: strata_runtime::DEFAULT_MAX_CONCURRENT_PAUSES,
        }
    }
}

/// `[metrics]`: the per-sandbox usage sampler (CPU, memory, disk over time;
/// `GET /v1/sandboxes/{id}/metrics`, `docs/metrics.md`). Its memory is
/// bounded: at most `max_sandboxes` series of at most
/// `service::sampler::MAX_POINTS` points each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Time between two samples of every running sandbox (`0s`: no sampler).
    #[serde(with = "serde_human")]
    pub interval: Duration,
    /// How far back a sandbox's series reaches.
    #[serde(with = "serde_human")]
    pub window: Duration,
    /// Series kept at once (the least recently sampled goes first).
    pub max_sandboxes: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            interval: Duration::from_secs(5),
            window: Duration::from_secs(3600),
            max_sandboxes: 1024,
        }
    }
}

/// `[logs]`: the process logs the daemon keeps of every sandbox's commands
/// (`service::logs`), in memory, bounded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogsConfig {
    /// Bytes of entries kept per sandbox (the oldest go first; 0: no logs).
    pub max_bytes_per_sandbox: usize,
    /// Sandboxes with a log at once (the least recently written goes).
    pub max_sandboxes: usize,
}

impl Default for LogsConfig {
    fn default() -> Self {
        LogsConfig {
            max_bytes_per_sandbox: 256 * 1024,
            max_sandboxes: 1024,
        }
    }
}

/// `[templates]`: recipe builds (`service::build`, docs/templates.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TemplatesConfig {
    /// Hosts a builder sandbox may reach through its egress proxy (its
    /// policy layer allows these and denies the rest): the package
    /// registries of `apt`, `pip` and `npm` steps.
    pub build_egress: Vec<String>,
    /// Cached step states kept per owner (the most recently made).
    pub step_cache_per_owner: usize,
    /// How long one step may run before it is killed (the build fails).
    #[serde(with = "serde_human")]
    pub step_timeout: Duration,
    /// Bytes of a build's log kept (`GET /v1/templates/{id}/logs`).
    pub log_max_bytes: u64,
    /// A host-level cache of built templates by recipe hash (and owner),
    /// shared by every daemon of the host: a build whose recipe is there
    /// imports it instead of running (CI does not rebuild). Unset: the
    /// environment's `STRATA_TEMPLATE_CACHE`, else none. It holds guest
    /// RAM and disks in the clear, outside the data dir: give it the same
    /// protection (the daemon makes it 0700).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// Entries the host-level cache keeps (the least recently used go).
    pub cache_max_entries: usize,
    /// How long a create with `"wait": true` waits for the size variant it
    /// needs to be built (without `wait` it answers `202` with the build's
    /// progress at once).
    #[serde(with = "serde_human")]
    pub variant_wait: Duration,
    /// Template builds (recipe and size-variant builds, each booting a
    /// builder VM) that may run at once on this host; one more is refused
    /// `insufficient_capacity` until one ends. At least 1.
    pub max_concurrent_builds: u64,
}

impl Default for TemplatesConfig {
    fn default() -> Self {
        TemplatesConfig {
            build_egress: [
                "deb.debian.org",
                "security.debian.org",
                "pypi.org",
                "files.pythonhosted.org",
                "registry.npmjs.org",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            step_cache_per_owner: 32,
            step_timeout: Duration::from_secs(30 * 60),
            log_max_bytes: 4 * 1024 * 1024,
            cache_dir: std::env::var_os("STRATA_TEMPLATE_CACHE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            cache_max_entries: 16,
            variant_wait: Duration::from_secs(30 * 60),
            max_concurrent_builds: crate::service::MAX_CONCURRENT_TEMPLATE_BUILDS,
        }
    }
}

/// `[egress]`: caps on what a guest can open through its egress proxy
/// (`docs/hardening.md`). An open past a cap is refused with
/// `tunnel_close {error}`: that guest connection is closed, the agent
/// session goes on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressConfig {
    /// Egress connections one sandbox may have open at once.
    pub max_tunnels_per_sandbox: usize,
    /// Egress connections plus their upstream sockets all sandboxes together
    /// may hold. The daemon lowers it to its `RLIMIT_NOFILE` (raised to the
    /// hard limit at start) minus `fd_reserve`.
    pub max_tunnels_host: usize,
    /// Descriptors kept for everything else (the API listener and its
    /// connections, SQLite, the audit log, QEMU's sockets).
    pub fd_reserve: usize,
    /// Sustained egress connection opens per second per sandbox (0: no limit).
    pub open_rate_per_second: f64,
    /// Opens a sandbox may make at once before the sustained rate applies.
    pub open_burst: u32,
    /// A guest connection that sends no complete request head within this
    /// long is closed (and gives its place under the caps back).
    #[serde(with = "serde_human")]
    pub head_timeout: Duration,
    /// A `CONNECT` tunnel in which no byte moves either way for this long
    /// is closed (15 min).
    #[serde(with = "serde_human")]
    pub tunnel_idle_timeout: Duration,
}

impl Default for EgressConfig {
    fn default() -> Self {
        EgressConfig {
            max_tunnels_per_sandbox: 128,
            max_tunnels_host: 4096,
            fd_reserve: 256,
            open_rate_per_second: 100.0,
            open_burst: 200,
            head_timeout: Duration::from_secs(30),
            tunnel_idle_timeout: strata_policy::proxy::TUNNEL_IDLE_TIMEOUT,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            data_dir: PathBuf::from("/var/lib/strata"),
            accel: Accel::Auto,
            pool_size_gib: 64,
            pool_path: None,
            run_dir: PathBuf::from("/run/strata"),
            key_dir: PathBuf::from("/etc/strata/keys"),
            image_dir: None,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            agent_timeout: Duration::from_secs(60),
            console_log_max_bytes: 1024 * 1024,
            tcg_tb_size_mib: strata_vmm::cmdline::TCG_TB_SIZE_MIB,
            default_template: true,
            template_wait: Duration::from_secs(300),
            snapshot_interval: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30 * 60),
            gc_sweep_interval: Duration::from_secs(10 * 60),
            max_concurrent_tasks: 4,
            retention: RetentionPolicy::default(),
            snapshots: SnapshotsConfig::default(),
            default_size: SandboxSize::default(),
            capacity: Capacity::default(),
            max_json_body_bytes: 1024 * 1024,
            max_upload_bytes: 1024 * 1024 * 1024,
            port_connect_grace: Duration::from_secs(3),
            clean_orphans: true,
            auto_recover: true,
            db_readers: 4,
            security: SecurityConfig::default(),
            e2b: E2bSettings::default(),
            quotas: QuotaConfig::default(),
            egress: EgressConfig::default(),
            metrics: MetricsConfig::default(),
            pressure: PressureConfig::default(),
            logs: LogsConfig::default(),
            templates: TemplatesConfig::default(),
            pools: PoolsConfig::default(),
            listener: crate::listener::ListenerConfig::default(),
            tls_listen: None,
            tls_cert: None,
            tls_key: None,
            vm: VmConfig::default(),
            events: crate::events::EventsConfig::default(),
            webhooks: crate::events::WebhooksConfig::default(),
            console: crate::events::ConsoleConfig::default(),
            store: StoreConfig::default(),
            cluster: crate::cluster::ClusterConfig::default(),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("invalid configuration in {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Reads a TOML file over the defaults (missing keys keep their default).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let cfg = Self::read_file(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// [`Config::from_file`] without [`Config::validate`]: for a caller
    /// that sets more (flags, the environment: e.g. `[store] url` from
    /// `STRATAD_STORE_URL`, which `[cluster] enabled` needs) and validates
    /// the whole.
    pub fn read_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg: Config = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        Ok(cfg)
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.retention
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.default_size
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("default_size: {e}")))?;
        self.capacity.validate().map_err(ConfigError::Invalid)?;
        self.listener.validate().map_err(ConfigError::Invalid)?;
        self.store_location()?;
        self.cluster.validate().map_err(ConfigError::Invalid)?;
        if self.cluster.enabled && !matches!(self.store_location()?, StoreLocation::Postgres(_)) {
            return Err(ConfigError::Invalid(
                "[cluster] enabled = true needs [store] url = postgres://… (hosts share one PostgreSQL)"
                    .into(),
            ));
        }
        // `[e2b] enabled` on an API process: its door forwards to the hosts
        // (docs/cluster.md, "The E2B door on a cluster").
        if !self.security.auth {
            // Without tokens every caller is an admin: never off this host.
            let open = [Some(self.listen), self.e2b.tls_listen, self.tls_listen]
                .into_iter()
                .flatten()
                .find(|a| !a.ip().is_loopback());
            if let Some(a) = open {
                return Err(ConfigError::Invalid(format!(
                    "[security] auth = false (--auth off) makes every caller an admin: it is only allowed on a loopback address, and {a} is not"
                )));
            }
        }
        if self.snapshots.max_concurrent_pauses == 0 {
            return Err(ConfigError::Invalid(
                "snapshots.max_concurrent_pauses must be at least 1".into(),
            ));
        }
        if self.templates.max_concurrent_builds == 0 {
            return Err(ConfigError::Invalid(
                "templates.max_concurrent_builds must be at least 1".into(),
            ));
        }
        match (&self.tls_listen, &self.tls_cert, &self.tls_key) {
            (Some(_), Some(_), Some(_)) | (None, None, None) => {}
            (Some(_), _, _) => {
                return Err(ConfigError::Invalid(
                    "tls_listen needs tls_cert and tls_key (PEM files)".into(),
                ))
            }
            (None, _, _) => {
                return Err(ConfigError::Invalid(
                    "tls_cert and tls_key are used only with tls_listen".into(),
                ))
            }
        }
        if !self.vm.netns.is_empty() {
            strata_vmm::netns::validate_name(&self.vm.netns)
                .map_err(|e| ConfigError::Invalid(format!("[vm] netns: {e}")))?;
        }
        if self.vm.user.is_empty() {
            return Err(ConfigError::Invalid("[vm] user must not be empty".into()));
        }
        if self.pressure.interval < Duration::from_millis(100) {
            return Err(ConfigError::Invalid(
                "pressure.interval must be at least 100ms".into(),
            ));
        }
        if !self.snapshot_interval.is_zero() && self.snapshot_interval < Duration::from_secs(1) {
            return Err(ConfigError::Invalid(
                "snapshot_interval must be 0s (off) or at least 1s".into(),
            ));
        }
        let pct = self.snapshots.unchanged_max_cpu_pct;
        if !(pct > 0.0 && pct <= 100.0) {
            return Err(ConfigError::Invalid(format!(
                "[snapshots] unchanged_max_cpu_pct must be in (0, 100], not {pct}"
            )));
        }
        if self.pool_path.is_none() && self.pool_size_gib == 0 {
            return Err(ConfigError::Invalid(
                "pool_size_gib must be at least 1".into(),
            ));
        }
        // `<run_dir>/<sb-id>/agent.sock`: ids take up to 67 bytes.
        let longest = self.run_dir.as_os_str().len() + 1 + 67 + 1 + "agent.sock".len();
        if longest > 107 {
            return Err(ConfigError::Invalid(format!(
                "run_dir {} is too long for unix socket paths (at most {} bytes)",
                self.run_dir.display(),
                107 - (longest - self.run_dir.as_os_str().len())
            )));
        }
        if self.agent_timeout < Duration::from_secs(1) {
            return Err(ConfigError::Invalid(
                "agent_timeout must be at least 1s".into(),
            ));
        }
        if !self.e2b.home_dir.starts_with('/') {
            return Err(ConfigError::Invalid(format!(
                "e2b.home_dir must be an absolute guest path, not {:?}",
                self.e2b.home_dir
            )));
        }
        if !(1024..=1 << 30).contains(&self.e2b.max_request_bytes) {
            return Err(ConfigError::Invalid(
                "e2b.max_request_bytes must be between 1024 and 1073741824".into(),
            ));
        }
        if !self.e2b.rate_limit_per_second.is_finite() || self.e2b.rate_limit_per_second < 0.0 {
            return Err(ConfigError::Invalid(
                "e2b.rate_limit_per_second must be a number >= 0".into(),
            ));
        }
        if self.e2b.default_timeout < Duration::from_secs(1) {
            return Err(ConfigError::Invalid(
                "e2b.default_timeout must be at least 1s".into(),
            ));
        }
        let m = &self.metrics;
        if !m.interval.is_zero()
            && (m.interval < Duration::from_secs(1) || m.interval > Duration::from_secs(3600))
        {
            return Err(ConfigError::Invalid(
                "metrics.interval must be 0s (off) or between 1s and 1h".into(),
            ));
        }
        if m.window < m.interval || m.window > Duration::from_secs(7 * 86400) {
            return Err(ConfigError::Invalid(
                "metrics.window must be at least metrics.interval and at most 7d".into(),
            ));
        }
        if !(1..=65536).contains(&m.max_sandboxes) {
            return Err(ConfigError::Invalid(
                "metrics.max_sandboxes must be between 1 and 65536".into(),
            ));
        }
        let sec = &self.security;
        if sec.approval_pending_ttl < Duration::from_secs(1)
            || sec.approval_ttl < Duration::from_secs(1)
        {
            return Err(ConfigError::Invalid(
                "[security] approval_pending_ttl and approval_ttl must be at least 1s".into(),
            ));
        }
        if sec.max_pending_approvals_per_sandbox == 0 {
            return Err(ConfigError::Invalid(
                "[security] max_pending_approvals_per_sandbox must be at least 1".into(),
            ));
        }
        if sec.held_uploads_total_bytes < sec.held_upload_max_bytes {
            return Err(ConfigError::Invalid(
                "[security] held_uploads_total_bytes must be at least held_upload_max_bytes".into(),
            ));
        }
        if self.max_json_body_bytes < 1024 {
            return Err(ConfigError::Invalid(
                "max_json_body_bytes must be at least 1024".into(),
            ));
        }
        Ok(())
    }

    /// The SQLite database.
    pub fn db_path(&self) -> PathBuf {
        match self.store_location() {
            Ok(StoreLocation::Sqlite(p)) => p,
            _ => self.data_dir.join("strata.db"),
        }
    }

    /// The store `[store] url` names: `postgres://` or `postgresql://` is
    /// PostgreSQL, `sqlite:PATH` that file, unset `<data_dir>/strata.db`.
    pub fn store_location(&self) -> Result<StoreLocation, ConfigError> {
        let Some(url) = self.store.url.as_deref().map(str::trim) else {
            return Ok(StoreLocation::Sqlite(self.data_dir.join("strata.db")));
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(StoreLocation::Postgres(url.to_owned()));
        }
        match url.strip_prefix("sqlite:") {
            Some(p) if !p.is_empty() => Ok(StoreLocation::Sqlite(PathBuf::from(p))),
            _ => Err(ConfigError::Invalid(
                "[store] url must start with postgres://, postgresql:// or sqlite:".into(),
            )),
        }
    }

    /// The pool image file.
    pub fn pool_image(&self) -> PathBuf {
        self.data_dir.join("pool.img")
    }

    /// Where the pool is mounted.
    pub fn pool_mount(&self) -> PathBuf {
        self.data_dir.join("pool")
    }

    /// Per-VM sockets and logs.
    pub fn run_dir(&self) -> PathBuf {
        self.run_dir.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_match_code_defaults() {
        let parsed: Config = toml::from_str(DEFAULT_TOML).unwrap();
        assert_eq!(parsed, Config::default());
        parsed.validate().unwrap();
    }

    #[test]
    fn vm_section_and_api_tls_keys() {
        let c = Config::default();
        assert_eq!(c.vm.user, "strata-vm");
        assert!(!c.vm.allow_root && c.vm.require_cgroups);
        assert_eq!(c.vm.netns, "strata-vm");
        assert!(c.vm.guest_disk_flush, "guests' flushes pass by default");
        let c: Config = toml::from_str(
            "[vm]\nallow_root = true\nrequire_cgroups = false\nnetns = \"\"\ndisk_iops = 100\ndisk_bps = 1048576\nguest_disk_flush = false\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert!(c.vm.allow_root && !c.vm.require_cgroups && c.vm.netns.is_empty());
        assert!(!c.vm.guest_disk_flush);
        assert!(toml::from_str::<Config>("[vm]\nallow_rot = true\n").is_err());
        let c: Config = toml::from_str("[vm]\nnetns = \"a/b\"\n").unwrap();
        assert!(c.validate().is_err());
        // tls_listen needs both files; the files alone mean nothing.
        let c: Config = toml::from_str("tls_listen = \"127.0.0.1:7443\"\n").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("tls_cert"));
        let c: Config = toml::from_str("tls_cert = \"/c\"\ntls_key = \"/k\"\n").unwrap();
        assert!(c.validate().is_err());
        let c: Config =
            toml::from_str("tls_listen = \"0.0.0.0:7443\"\ntls_cert = \"/c\"\ntls_key = \"/k\"\n")
                .unwrap();
        c.validate().unwrap();
        // Without tokens, not on a public TLS address either.
        let open = Config {
            security: SecurityConfig {
                auth: false,
                ..SecurityConfig::default()
            },
            ..c
        };
        assert!(open.validate().is_err());
    }

    #[test]
    fn partial_file_keeps_defaults_and_unknown_keys_fail() {
        let c: Config = toml::from_str("snapshot_interval = \"5s\"\n").unwrap();
        assert_eq!(c.snapshot_interval, Duration::from_secs(5));
        assert_eq!(c.listen, Config::default().listen);
        assert!(toml::from_str::<Config>("snapshot_intervall = \"5s\"\n").is_err());
        assert!(toml::from_str::<Config>("snapshot_interval = \"soon\"\n").is_err());
    }

    #[test]
    fn e2b_section() {
        let c: Config =
            toml::from_str("[e2b]\nenabled = true\ndefault_timeout = \"10m\"\n").unwrap();
        assert!(c.e2b.enabled);
        assert_eq!(c.e2b.default_timeout, Duration::from_secs(600));
        assert_eq!(c.e2b.home_dir, "/root");
        c.validate().unwrap();
        assert!(toml::from_str::<Config>("[e2b]\nenable = true\n").is_err());
        let c: Config = toml::from_str("[e2b]\nhome_dir = \"root\"\n").unwrap();
        assert!(c.validate().is_err());
        let c: Config = toml::from_str(
            "[e2b]\napi_keys = [\"k=acme:ci\"]\nmax_request_bytes = 65536\nrate_limit_per_second = 0.0\n",
        )
        .unwrap();
        assert_eq!(
            (c.e2b.max_request_bytes, c.e2b.auth_failures_per_minute),
            (65536, 60)
        );
        c.validate().unwrap();
        for bad in ["max_request_bytes = 100", "rate_limit_per_second = -1.0"] {
            let c: Config = toml::from_str(&format!("[e2b]\n{bad}\n")).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn security_config_keeps_its_old_path() {
        let c: crate::security::SecurityConfig = SecurityConfig::default();
        assert!(c.auth);
    }

    #[test]
    fn quotas_default_unlimited_and_override_per_tenant() {
        let c = Config::default();
        assert_eq!(c.quotas.for_tenant("acme"), TenantLimits::default());
        assert!(!c.quotas.limits_pool_bytes());
        let c: Config = toml::from_str(
            "[quotas.tenant]\nsandboxes = 10\nvcpus = 8\n\
             [quotas.tenants.acme]\nvcpus = 32\npool_bytes = 1048576\n\
             [quotas.sandbox]\nmemory_mib = 4096\n",
        )
        .unwrap();
        let acme = c.quotas.for_tenant("acme");
        assert_eq!((acme.sandboxes, acme.vcpus), (Some(10), Some(32)));
        assert_eq!(acme.pool_bytes, Some(1 << 20));
        assert_eq!(c.quotas.for_tenant("other").vcpus, Some(8));
        assert_eq!(c.quotas.sandbox.memory_mib, Some(4096));
        assert!(c.quotas.limits_pool_bytes());
        assert!(toml::from_str::<Config>("[quotas.tenant]\ncpus = 1\n").is_err());
    }

    #[test]
    fn metrics_section() {
        let c: Config = toml::from_str("[metrics]\ninterval = \"1s\"\nwindow = \"10m\"\n").unwrap();
        assert_eq!(c.metrics.interval, Duration::from_secs(1));
        assert_eq!(c.metrics.max_sandboxes, 1024);
        c.validate().unwrap();
        for bad in ["interval = \"2h\"", "window = \"1s\"", "max_sandboxes = 0"] {
            let c: Config = toml::from_str(&format!("[metrics]\n{bad}\n")).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
        assert!(toml::from_str::<Config>("[metrics]\nintervall = \"1s\"\n").is_err());
    }

    #[test]
    fn auth_off_only_on_loopback_and_listener_bounds() {
        let mut c = Config::default();
        c.security.auth = false;
        c.validate().unwrap();
        c.listen = "0.0.0.0:7070".parse().unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("loopback") && e.contains("0.0.0.0:7070"), "{e}");
        c.listen = "[::1]:7070".parse().unwrap();
        c.validate().unwrap();
        c.e2b.tls_listen = Some("192.0.2.1:8443".parse().unwrap());
        assert!(c.validate().is_err());
        c.security.auth = true;
        c.validate().unwrap();
        let c: Config =
            toml::from_str("[listener]\nmax_connections = 2\nheader_read_timeout = \"5s\"\n")
                .unwrap();
        assert_eq!(c.listener.max_connections, 2);
        assert_eq!(c.listener.header_read_timeout, Duration::from_secs(5));
        assert_eq!(c.listener.body_idle_timeout, Duration::from_secs(60));
        let c: Config = toml::from_str("[listener]\nmax_connections = 0\n").unwrap();
        assert!(c.validate().is_err());
        assert!(toml::from_str::<Config>("[listener]\nmax_conns = 1\n").is_err());
    }

    #[test]
    fn capacity_resolves() {
        let (v, m) = Capacity::default().resolve();
        assert!(v >= 4 && m > 0);
    }
}
