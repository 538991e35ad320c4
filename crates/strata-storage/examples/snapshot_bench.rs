//! Snapshot benchmark (filled in below).
fn main() {}
