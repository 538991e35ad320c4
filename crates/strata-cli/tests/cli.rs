//! The `strata` binary without a daemon or a VM: errors are clear, typed
//! under `--json`, and the exit status is non-zero.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};

fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .env_remove("STRATA_URL")
        .env_remove("STRATA_TOKEN")
        .stdin(Stdio::null())
        .output()
        .expect("run strata")
}

/// A local port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn unreachable_daemon_is_a_json_error() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let out = strata(&["--json", "--url", &url, "ls"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert_eq!(v["error"]["code"], "unavailable");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("is stratad running"), "{msg}");
    assert!(msg.contains(&url), "{msg}");
}

#[test]
fn unreachable_daemon_human_message() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let out = strata(&["--url", &url, "info", "sb-x"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("strata: error: cannot reach stratad"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn env_url_is_used() {
    let url = format!("http://127.0.0.1:{}", closed_port());
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["--json", "stats"])
        .env("STRATA_URL", &url)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains(&url));
}

#[test]
fn bad_url_and_bad_arguments() {
    let out = strata(&["--json", "--url", "localhost:7070", "ls"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "invalid_request");
    // Usage errors come from clap: exit 2, nothing on stdout.
    let out = strata(&["rewind", "sb-1", "--ago", "yesterday"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid duration"));
}

#[test]
fn dev_run_without_image_says_how_to_get_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = strata(&[
        "--json",
        "dev",
        "run",
        "--cache-dir",
        dir.path().to_str().unwrap(),
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "not_found");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("strata image build"));
}

#[test]
fn image_build_without_agent_is_clear() {
    let dir = tempfile::tempdir().unwrap();
    let out = strata(&[
        "image",
        "build",
        "--cache-dir",
        dir.path().to_str().unwrap(),
        "--agent",
        "/nonexistent/strata-agent",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/strata-agent"), "{err}");
}
