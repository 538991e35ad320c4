//! E2B-compatible API over strata sandboxes.
