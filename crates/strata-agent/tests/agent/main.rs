//! Integration tests: the real `strata-agent --listen-unix` binary driven by
//! the real `AgentClient` over a unix socket.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod exec;
mod files;
mod flow;
mod pty;
mod session;
mod support;
mod wire;
