//! The E2B door's security matrix, the counterpart of stratad's `/v1` one
//! (`crates/stratad/src/api/tests/matrix.rs`): every route of
//! [`strata_e2b::router`] (the tables of `control` and `envd` are checked
//! against its source, in `routes`)
//! × every kind of caller × every spelling of the sandbox id.
//!
//! - Control plane (`X-API-KEY`, the id in the path): strata tokens of tenant
//!   `acme` (admin, developer, approver, viewer, metrics), the configured E2B
//!   key (tenant `default`), no key, a wrong key, a forged strata token; ids
//!   own / foreign (tenant `beta`), each plain, with the first byte and with
//!   every byte percent-encoded, unknown, malformed, undecodable.
//! - envd (`E2b-Sandbox-Id` + `X-Access-Token`): sandboxes whose token was
//!   handed to an acme admin, an acme developer, the E2B key, or never handed
//!   out (the `e2b-envd` fallback); the own sandbox with its token, with
//!   another sandbox's token, without a token; a foreign, an unknown and a
//!   malformed id with the caller's own token; no id at all.
//!
//! Each case asserts the status, the error's shape (E2B's
//! `{"code": <status>, "message": …}` on the control plane, `/files` and
//! `/health`; Connect's `{"code": "<code>", "message": …}` on envd's RPCs),
//! that a foreign id's answer is the unknown id's byte for byte once the id
//! is replaced (a Connect stream's envelopes compared decoded: their length
//! prefixes follow the id's length), and whether the tool-call gate ran: the
//! lines `audit.jsonl` gained (exactly one per own tool call, two for a move,
//! with the caller as actor; none otherwise) and, for refused calls, that the
//! engine was not called at all. All checks of a test are collected and
//! reported together.
//!
//! Around the two matrices: create and list per caller; `/health`; a
//! killed sandbox's (or an unknown id's) valid token; process and watcher
//! handles across sandboxes; and, `#[ignore]`d with the reason, the door
//! bugs this file found (undecodable ids answer axum's plain text; the
//! handle-only envd routes answer a gone sandbox with `not_found`/200; they
//! wake a paused sandbox without a gate decision; a revoked token's envd
//! calls still run).
//!
//! The daemon is real (store, security, policy, audit); the engine is the
//! double of `common` (no VM).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

#[path = "../common/mod.rs"]
mod common;

mod control;
mod envd;
mod envd_edges;
mod routes;
mod support;
