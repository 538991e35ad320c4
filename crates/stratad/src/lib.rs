//! stratad: the strata daemon (HTTP API, metadata store, rolling snapshots, retention, recovery).

pub mod clock;
pub mod config;
pub mod duration;
pub mod engine;
pub mod metrics;
pub mod retention;
pub mod scheduler;
pub mod service;
pub mod store;
