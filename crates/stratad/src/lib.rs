//! stratad: the strata daemon (HTTP API, metadata store, rolling snapshots, retention, recovery).

pub mod clock;
pub mod duration;
pub mod engine;
pub mod retention;
pub mod scheduler;
pub mod store;
pub mod config;
pub mod metrics;
