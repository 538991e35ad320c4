//! The six parts of the benchmark. Each module has an `Args` (its flags,
//! all prefixed with the section key, with defaults sized so the whole run
//! finishes in under 15 minutes on a 2-core machine, and a `smoke()` that
//! shrinks them to the CI smoke size; it must carry `#[group(id = "<key>-args")]`,
//! or clap refuses the flattened CLI) and a `run` that fills a [`Section`]
//! as it measures, so a failure part-way still reports what was measured.

pub mod chaos;
pub mod density;
pub mod events;
pub mod history;
pub mod interp;
pub mod load;
pub mod mcp;
pub mod packing;
pub mod pool;
pub mod recipe;
pub mod restore;
pub mod scale;
pub mod sdk;
pub mod snapshot;
pub mod soak;
pub mod tls_proxy;
pub mod transfer;

/// Section keys in report order.
pub const ALL: &[&str] = &["snapshot", "restore", "load", "density", "history", "scale"];

/// Sections run only when `--only` names them (not in the default nor the
/// smoke run): `sdk` needs the `e2b` package from PyPI, `recipe` the
/// package registries, `pool` runs two daemons for minutes, `interp` the
/// code-interpreter template (a cold build ~25 min under TCG), `packing`
/// a hundred sandboxes for about ten minutes, `soak` twenty for two hours,
/// `tls_proxy` measures the egress proxy on the host alone (no guest),
/// `events` (no VMs, seconds) notifications of approval requests, `chaos`
/// 100 kills for about an hour, `mcp` (no VMs, seconds; the `mcp` package
/// from PyPI) the MCP gateway's cost per `tools/call`, `move` (no VMs,
/// about a minute) incremental `btrfs send` moves vs full sends
/// (module [`transfer`]).
pub const OPT_IN: &[&str] = &[
    "sdk",
    "recipe",
    "pool",
    "interp",
    "packing",
    "soak",
    "tls_proxy",
    "events",
    "chaos",
    "mcp",
    "move",
];
