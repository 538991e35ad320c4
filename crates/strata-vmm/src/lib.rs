//! VMM drivers for strata: the driver trait and the QEMU microvm driver (process, QMP, accel probe, console).
