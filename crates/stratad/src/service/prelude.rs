//! What every module of the service names (one import list for the room).
#![allow(unused_imports)]

pub(crate) use std::collections::{BTreeMap, HashMap};
pub(crate) use std::sync::{Arc, Mutex};
pub(crate) use std::time::{Duration, Instant};

pub(crate) use async_trait::async_trait;
pub(crate) use chrono::{DateTime, Utc};
pub(crate) use futures::StreamExt;
pub(crate) use serde::{Deserialize, Serialize};
pub(crate) use strata_core::{
    ErrorCode, Op, SandboxId, SandboxSize, SandboxState, SizeError, SnapshotId, TemplateId,
    TransitionError,
};
pub(crate) use strata_policy::{CallKind, ToolCall};
pub(crate) use tokio::sync::OwnedMutexGuard;
pub(crate) use tracing::{info, warn, Instrument};

pub(crate) use crate::caller::{Caller, PLATFORM_SCOPE};
pub(crate) use crate::clock::Clock;
pub(crate) use crate::config::Config;
pub(crate) use crate::engine::{
    ByteStream, Command, DirEntry, Engine, ExecEvent, ExecRequest, ExecStream, RuntimeError,
    Source, Stdin,
};
pub(crate) use crate::metrics::{step, Metrics};
pub(crate) use crate::retention::Point;
pub(crate) use crate::scheduler::{Actions, SchedulerHandle, Timing};
pub(crate) use crate::security::gate::{GateOptions, GateRefusal, ToolGate};
pub(crate) use crate::store::*;

pub(crate) use super::*;
