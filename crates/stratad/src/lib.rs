//! stratad: the strata daemon (HTTP API, metadata store, rolling snapshots, retention, recovery).

pub mod duration;
pub mod engine;
pub mod store;
