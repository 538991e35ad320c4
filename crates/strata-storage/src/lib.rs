//! The btrfs storage pool: loop-mounted image, one subvolume per sandbox, read-only snapshot subvolumes, space accounting.
