//! The sandbox runtime of one host: live snapshots, fork, rewind,
//! pause/resume, hibernate/wake and templates.
//!
//! It combines the VMM driver (`strata-vmm`), the btrfs pool
//! (`strata-storage`) and the guest agent client (`strata-proto`). It keeps
//! the live VM handles of this host; the daemon owns the records (which
//! state a sandbox is in, which snapshots exist) and calls the runtime to act.
//!
//! Pool layout:
//!
//! ```text
//! <pool>/sandboxes/<sb-id>/      writable subvolume: mem, disk.img, device.state, meta.json
//! <pool>/snapshots/<snap-id>/    read-only subvolume, same files, meta.json = SnapshotMeta
//! <pool>/templates/<tpl-id>/     read-only subvolume, a snapshot of a freshly booted guest
//! <pool>/signatures/…/<id>.sig   signatures of states made before signing (`signing`)
//! <run_dir>/<sb-id>/             qmp.sock, agent.sock, qemu.pid, console.log (outside the pool)
//! ```

pub mod api;
pub mod error;
pub mod meta;
mod runtime;
pub mod signing;

pub use api::*;
pub use error::{GuestErrorKind, RuntimeError};
pub use meta::{GuestCommand, StartCommand, StateMeta, SNAPSHOT_FORMAT_VERSION};
pub use runtime::PortOpenError;
pub use runtime::{
    load_image, qemu_version, Adoption, CallBoost, CpuSource, DiskWrites, EgressResolver,
    MoveError, ReceivedSnapshot, ReceivedTemplate, Runtime, TemplateBuilt, VmDied, VmUsage,
    CALL_CPU_WEIGHT, SYSTEM_CA_BUNDLE, TRUSTED_CA_PATH, WARM_CPU_WEIGHT,
};
pub use signing::StateSigner;
pub use strata_proto::client::{PortCounters, PortError, PortStream};
