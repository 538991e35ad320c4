//! stratad: the strata daemon (HTTP API, metadata store, rolling snapshots, retention, recovery).
