//! Core types shared by every strata crate: identifiers, sandbox sizes, the
//! sandbox state machine, accelerator choice and the stable error codes the
//! API reports.

pub mod duration;
pub mod error;
pub mod id;
pub mod size;
pub mod state;
pub mod stats;
pub mod text;

pub use error::ErrorCode;
pub use id::{SandboxId, SnapshotId, TemplateId};
pub use size::{Accel, SandboxSize, SizeError};
pub use state::{ForkSource, Op, SandboxState, TransitionError};
pub use stats::LatencySummary;

/// The strata release, recorded in snapshot metadata.
pub const STRATA_VERSION: &str = env!("CARGO_PKG_VERSION");
