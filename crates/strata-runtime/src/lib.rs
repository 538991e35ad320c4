//! Sandbox runtime: live snapshots, fork, rewind, pause, hibernate and templates, combining the VMM driver and the btrfs pool.
