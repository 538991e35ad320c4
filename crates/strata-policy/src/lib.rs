//! Tool-call policy for strata: the tool-call model, a layered TOML policy
//! with precompiled matchers, an approval queue, a tamper-evident audit log
//! and an HTTP egress proxy that applies the policy per request.
//!
//! See `docs/policy.md` for the file format and the guarantees.

pub mod approval;
pub mod audit;
pub mod call;
pub mod path;
pub mod policy;
pub mod proxy;
pub mod secrets;
pub mod sni;

pub use call::{CallKind, ExecStdin, KindName, PortBytes, ToolCall};
pub use policy::{
    Access, ComposeError, Connector, Decision, Effect, Layer, ParseError, Policy, PolicySet,
};
