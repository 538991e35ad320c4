//! Shared fixtures for strata's integration tests: the guest image, a btrfs pool, test sandboxes.
