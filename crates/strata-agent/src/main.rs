//! The strata guest agent: runs inside the microVM, executes commands and moves files for the host over virtio-serial.

fn main() {}
