//! The runtime's public types. The operations live on [`crate::Runtime`]
//! (added with the implementation); this module fixes the vocabulary the
//! daemon is written against.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_core::{Accel, SandboxSize};

/// Where the runtime keeps its state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// btrfs pool: an existing btrfs directory, or an image file to create and loop-mount.
    pub pool: PoolSetting,
    /// Directory for per-VM sockets and logs (short path: unix sockets ≤ 108 bytes).
    pub run_dir: PathBuf,
    /// Guest image directory (from `strata image build`) templates are booted from.
    pub image_dir: PathBuf,
    /// Accelerator choice.
    pub accel: Accel,
    /// QEMU binary.
    pub qemu_binary: PathBuf,
    /// Cap of each VM's console log in bytes.
    pub console_log_max_bytes: u64,
    /// How long to wait for a guest agent after boot or restore, in ms.
    pub agent_timeout_ms: u64,
    /// Unprivileged user QEMU switches to once it has opened its files (`-runas`).
    /// Default: [`default_run_as`] (`strata-vm` when that user exists); `None` keeps
    /// QEMU under the daemon's user.
    #[serde(default = "default_run_as")]
    pub run_as: Option<String>,
    /// QEMU may run as root when `run_as` is `None` (the `strata-vm` user is
    /// missing). Default `false`: [`crate::Runtime::open`] refuses to run VMs
    /// as root.
    #[serde(default)]
    pub allow_root: bool,
    /// Put each VM in its own cgroup with CPU (one CPU per vCPU) and memory (guest RAM
    /// + margin) limits from its size.
    #[serde(default = "default_cgroups")]
    pub cgroups: bool,
    /// A VM whose cgroup cannot be set up does not start (default). `false`:
    /// it starts without limits, with a warning.
    #[serde(default = "default_cgroups")]
    pub cgroups_required: bool,
    /// Named network namespace every QEMU joins ([`strata_vmm::netns`],
    /// created empty on open when missing). Default
    /// [`strata_vmm::netns::DEFAULT_NETNS`]; `None`: the host's namespace.
    #[serde(default = "default_netns")]
    pub netns: Option<String>,
    /// Every VM's root-disk limits (QEMU block throttling); `None`: none.
    #[serde(default)]
    pub disk_throttle: Option<strata_vmm::DiskThrottle>,
    /// Guest egress target (the daemon's egress proxy). When set, every agent
    /// connection enables egress: guest programs reach `127.0.0.1:3128` in the
    /// guest (their `http_proxy`), and each such connection is tunnelled over
    /// the agent channel to a TCP connection to this address. `None`: the
    /// guest has no egress at all.
    #[serde(default)]
    pub egress_proxy: Option<std::net::SocketAddr>,
    /// TCG's translation block cache per VM, MiB (ignored under KVM):
    /// resident as far as it is used, flushed whole when full.
    #[serde(default = "default_tb_size")]
    pub tcg_tb_size_mib: u32,
    /// Whether a guest's disk flush reaches the host's disk
    /// ([`strata_vmm::VmSpec::guest_disk_flush`]; default on).
    #[serde(default = "default_true")]
    pub guest_disk_flush: bool,
    /// The deployment's key for state signatures ([`crate::signing`]):
    /// every snapshot and template this runtime makes is signed, and every
    /// restore refuses a state whose `meta.json` or `device.state` does not
    /// carry a valid signature of this key (`snapshot_unusable`). `None`
    /// (tools and tests that run no daemon): nothing is signed or checked,
    /// the behaviour before signing. Never serialized.
    #[serde(skip)]
    pub signing: Option<std::sync::Arc<crate::signing::StateSigner>>,
    /// Most guests paused for a snapshot at once on this host (at least 1).
    /// A snapshot waits for a slot *before* it stops its guest, so a wave of
    /// rolling, manual and fork-source snapshots queues with its guests
    /// running instead of stacking pauses: the btrfs snapshot ioctls of one
    /// pool run one transaction commit at a time anyway, and a second guest
    /// stopped meanwhile would only wait, stopped, for the first's commit.
    #[serde(default = "default_max_concurrent_pauses")]
    pub max_concurrent_pauses: usize,
}

/// Use of the host's pause slots ([`RuntimeConfig::max_concurrent_pauses`]),
/// from [`crate::Runtime::pause_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PauseStats {
    /// Guests stopped by a snapshot now.
    pub in_flight: usize,
    /// The most stopped at once since the runtime opened.
    pub peak: usize,
    /// Snapshots that waited for a slot.
    pub waited: u64,
    /// Their summed wait, ms (their guests ran meanwhile).
    pub waited_ms: f64,
}

/// Default of [`RuntimeConfig::max_concurrent_pauses`].
pub const DEFAULT_MAX_CONCURRENT_PAUSES: usize = 1;

fn default_max_concurrent_pauses() -> usize {
    DEFAULT_MAX_CONCURRENT_PAUSES
}

fn default_tb_size() -> u32 {
    strata_vmm::cmdline::TCG_TB_SIZE_MIB
}

/// `strata-vm` when that user exists on this host, else `None` (warned once).
impl RuntimeConfig {
    /// A configuration with the defaults: accel `auto`, `qemu-system-x86_64`,
    /// 1 MiB console logs, 60 s agent timeout, QEMU as `strata-vm` when that
    /// user exists (never as root), cgroups required, the `strata-vm` network
    /// namespace, no disk throttling, egress closed.
    pub fn new(
        pool: PoolSetting,
        run_dir: impl Into<PathBuf>,
        image_dir: impl Into<PathBuf>,
    ) -> Self {
        RuntimeConfig {
            pool,
            run_dir: run_dir.into(),
            image_dir: image_dir.into(),
            accel: Accel::Auto,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            console_log_max_bytes: 1 << 20,
            agent_timeout_ms: 60_000,
            run_as: default_run_as(),
            allow_root: false,
            cgroups: default_cgroups(),
            cgroups_required: default_cgroups(),
            netns: default_netns(),
            disk_throttle: None,
            egress_proxy: None,
            tcg_tb_size_mib: default_tb_size(),
            guest_disk_flush: true,
            signing: None,
            max_concurrent_pauses: DEFAULT_MAX_CONCURRENT_PAUSES,
        }
    }
}

pub fn default_run_as() -> Option<String> {
    strata_vmm::default_vm_user()
}

fn default_cgroups() -> bool {
    true
}

fn default_true() -> bool {
    true
}

fn default_netns() -> Option<String> {
    Some(strata_vmm::netns::DEFAULT_NETNS.to_owned())
}

/// How the btrfs pool is provided.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolSetting {
    /// A directory on an existing btrfs mount.
    Path(PathBuf),
    /// An image file created, formatted and loop-mounted by strata.
    Image {
        /// The image file.
        image: PathBuf,
        /// Size of the image in bytes.
        size_bytes: u64,
        /// Where to mount it.
        mount_point: PathBuf,
    },
}

/// What a new sandbox starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A template (a snapshot of a freshly booted guest).
    Template(strata_core::TemplateId),
    /// Any snapshot (a fork).
    Snapshot(strata_core::SnapshotId),
}

/// Facts about a live sandbox VM.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmInfo {
    /// QEMU process id.
    pub pid: u32,
    /// Resolved accelerator.
    pub accel: String,
    /// Size the VM runs with.
    pub size: SandboxSize,
    /// Milliseconds from request to agent answering.
    pub ready_ms: f64,
}

/// Where the last start of a sandbox from a state went: when each step
/// ended, in ms since the runtime call began (a latency breakdown for
/// benchmarks and debug logs; [`crate::Runtime::start_timeline`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StartTimeline {
    /// The state was checked (metadata read, QEMU compatibility).
    pub opened_ms: f64,
    /// The btrfs snapshot of the state became the sandbox's subvolume.
    pub cloned_ms: f64,
    /// The driver was called (metadata written, signature checked).
    pub vm_called_ms: f64,
    /// The QEMU process was spawned.
    pub spawned_ms: f64,
    /// QMP answered its handshake.
    pub qmp_ms: f64,
    /// The VM handle was ready (console attached, watchers running).
    pub assembled_ms: f64,
    /// The device state was loaded (a restore; `None` for a cold boot).
    pub incoming_ms: Option<f64>,
    /// `cont` was answered: the vCPUs run.
    pub running_ms: Option<f64>,
    /// QEMU reported the guest's agent port open (`VSERPORT_CHANGE`), if it did.
    pub port_open_ms: Option<f64>,
    /// The agent socket was connected (the connection the handshake used).
    pub connected_ms: f64,
    /// The last Hello before the answer was sent.
    pub last_hello_ms: f64,
    /// `hello_ok` arrived.
    pub hello_ok_ms: f64,
    /// Hellos sent.
    pub hellos: u32,
    /// Of them, sent at once because the port opened.
    pub hellos_cued: u32,
    /// The agent session was set up (output window, egress).
    pub session_ms: f64,
    /// The guest was synced (entropy, clock, identity).
    pub synced_ms: f64,
    /// The start returned (disk grown when asked).
    pub ready_ms: f64,
}

/// What a snapshot cost and contains.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// Snapshot id.
    pub id: strata_core::SnapshotId,
    /// How long the guest's vCPUs were stopped, in ms.
    pub pause_ms: f64,
    /// Bytes of device state written.
    pub device_state_bytes: u64,
    /// When it was taken.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// Where the pause went (zero for a snapshot of a stopped guest).
    #[serde(default)]
    pub phases: PausePhases,
}

/// Where a snapshot's pause goes, ms: the steps between the guest's vCPUs
/// stopping and running again. The device-state save and the btrfs
/// snapshot run side by side (`Runtime::set_overlapped_state_save`, on by
/// default), so `pause_ms` is stop + the longer of the two + cont + glue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PausePhases {
    /// QMP `stop` round trip (QEMU drains and flushes block I/O).
    pub stop_ms: f64,
    /// Device state: everything but RAM to `device.state` (a migration
    /// on a VM's first save, a direct save after it: `device_state_method`).
    pub device_state_ms: f64,
    /// Hashing and signing `meta.json` and `device.state` and making the
    /// snapshot read-only: after `cont`, so **not** part of the pause
    /// (`pause_ms`); the snapshot is acknowledged only once it is done.
    pub sign_ms: f64,
    /// The pool's step inside the pause. Paused by copies (the default,
    /// `copies_in_pause`): the reflink copies of RAM and disk (writes back
    /// their dirty pages, no commit). Otherwise: the btrfs snapshot of the
    /// subvolume (writes back the dirty pages of RAM and disk, then commits).
    pub btrfs_ms: f64,
    /// QMP `cont` round trip.
    pub cont_ms: f64,
    /// The device-state step broken down (zero when the state saved by an
    /// earlier stop was reused).
    #[serde(default)]
    pub device_state_steps: strata_vmm::SaveSteps,
    /// Before the pause, with the guest running (**not** part of
    /// `pause_ms`): its RAM file written back, then the pool's btrfs
    /// transaction committed (`Runtime::set_commit_before_pause`).
    #[serde(default)]
    pub before_pause_ms: f64,
    /// How the device state was saved (`None` when the state saved by an
    /// earlier stop was reused).
    #[serde(default)]
    pub device_state_method: Option<strata_vmm::SaveMethod>,
    /// Whether the guest was paused by copies (`Runtime::set_copies_in_pause`):
    /// `btrfs_ms` is then the reflinks and `after_pause_ms` the btrfs snapshot.
    #[serde(default)]
    pub copies_in_pause: bool,
    /// After `cont` (**not** part of `pause_ms`), paused by copies: the
    /// btrfs snapshot of the subvolume with its commit and the copies put in
    /// its place, waiting for no pause to be in flight first.
    #[serde(default)]
    pub after_pause_ms: f64,
    /// Paused by copies, inside `btrfs_ms`: the RAM copy's catch-up (or its
    /// whole reflink when it could not be begun before the pause).
    #[serde(default)]
    pub copy_mem_ms: f64,
    /// Paused by copies, inside `btrfs_ms`: the disk image's catch-up (or
    /// its whole reflink).
    #[serde(default)]
    pub copy_disk_ms: f64,
    /// Paused by copies, the copies being the snapshot's own files
    /// (`Runtime::set_copies_into_snapshot`): the btrfs snapshot was made
    /// before the pause (in `before_pause_ms`) and nothing after `cont`
    /// but signing.
    #[serde(default)]
    pub copies_into_snapshot: bool,
    /// Whether the pause ran boosted (`Runtime::set_pause_boost`): the VM's
    /// CPU weight raised and the catch-up's thread at a higher priority
    /// while the guest was stopped. With the call CPU weight at or under the
    /// default (`Runtime::set_call_cpu_weight`) the VM's weight is left as
    /// it is; the field is still true.
    #[serde(default)]
    pub boosted: bool,
}

/// Space used by a snapshot.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct SpaceUsage {
    /// Bytes only this snapshot holds.
    pub exclusive_bytes: u64,
    /// Bytes it references in all (shared = referenced - exclusive).
    pub referenced_bytes: u64,
}

/// A VM process found alive on this host ([`crate::Runtime::live_vms`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveVm {
    /// The sandbox it belongs to.
    pub id: strata_core::SandboxId,
    /// Its QEMU process id.
    pub pid: u32,
}

/// The subvolumes found in the pool ([`crate::Runtime::subvolumes`]); names
/// that are not ids are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subvolumes {
    /// `<pool>/sandboxes/<id>`.
    pub sandboxes: Vec<strata_core::SandboxId>,
    /// `<pool>/snapshots/<id>`.
    pub snapshots: Vec<strata_core::SnapshotId>,
    /// `<pool>/templates/<id>`.
    pub templates: Vec<strata_core::TemplateId>,
}
