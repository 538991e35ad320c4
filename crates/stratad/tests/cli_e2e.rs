//! End to end through the `strata` CLI against a real `stratad` with real
//! guests: the commands a user types, their output and exit codes.

mod common;

use std::process::Output;

use common::Daemon;
use serde_json::Value;

/// `strata ARGS` against `d` with its admin token (the `strata` binary of
/// this workspace, built on demand when only `cargo test -p stratad` ran).
fn strata(d: &Daemon, args: &[&str]) -> Output {
    strata_testkit::run_strata(
        &strata_testkit::strata_bin(),
        &d.url,
        d.token().as_deref(),
        args,
    )
}

fn json(d: &Daemon, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = strata(d, &all);
    assert!(out.status.success(), "strata {args:?} failed");
    serde_json::from_slice(&out.stdout).expect("json output")
}

fn id_of(v: &Value) -> String {
    v.get("id")
        .or_else(|| v.get("sandbox").and_then(|s| s.get("id")))
        .and_then(|i| i.as_str())
        .unwrap_or_else(|| panic!("no id in {v}"))
        .to_owned()
}

#[test]
fn cli_lifecycle_against_a_real_daemon() {
    let rt = strata_testkit::tokio_rt();
    let d = Daemon::start("");
    rt.block_on(d.wait_template());

    // create
    let created = json(&d, &["create", "--label", "suite=cli"]);
    let id = id_of(&created);

    // exec: output streamed to our stdout/stderr, exit code propagated.
    let out = strata(
        &d,
        &[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 3",
        ],
    );
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "out");
    assert!(String::from_utf8_lossy(&out.stderr).contains("err"));

    // files put / get / ls
    let scratch = tempfile::tempdir().expect("scratch");
    let local = scratch.path().join("in.bin");
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&local, &payload).expect("write local");
    let out = strata(
        &d,
        &[
            "files",
            "put",
            &id,
            local.to_str().expect("utf8"),
            "/root/in.bin",
        ],
    );
    assert!(out.status.success());
    let back = scratch.path().join("back.bin");
    let out = strata(
        &d,
        &[
            "files",
            "get",
            &id,
            "/root/in.bin",
            back.to_str().expect("utf8"),
        ],
    );
    assert!(out.status.success());
    assert_eq!(std::fs::read(&back).expect("read back"), payload);
    let out = strata(&d, &["files", "ls", &id, "/root"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("in.bin"));

    // snapshot, change, rewind, check.
    let snap = json(&d, &["snapshot", &id, "--label", "before"]);
    let snap_id = snap["id"].as_str().expect("snapshot id").to_owned();
    assert!(strata(&d, &["exec", &id, "--", "rm", "/root/in.bin"])
        .status
        .success());
    let out = strata(&d, &["exec", &id, "--", "test", "-e", "/root/in.bin"]);
    assert_eq!(out.status.code(), Some(1));
    let out = strata(&d, &["rewind", &id, "--to", &snap_id]);
    assert!(out.status.success());
    let out = strata(&d, &["exec", &id, "--", "test", "-e", "/root/in.bin"]);
    assert_eq!(out.status.code(), Some(0), "file is back after rewind");

    // the timeline shows the manual snapshot with its label and the pre-rewind one.
    let out = strata(&d, &["snapshots", &id]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("before"), "{text}");
    assert!(text.contains("pre"), "{text}");

    // fork from the live sandbox: independent, same files.
    let fork = json(&d, &["fork", &id]);
    let fork_id = id_of(&fork);
    assert_ne!(fork_id, id);
    let out = strata(&d, &["exec", &fork_id, "--", "cat", "/root/in.bin"]);
    assert_eq!(out.stdout.len(), payload.len());

    // ls / info / pause / resume / rm
    let listed = json(&d, &["ls", "--label", "suite=cli"]);
    let text = listed.to_string();
    assert!(text.contains(&id), "{text}");
    let info = json(&d, &["info", &id]);
    assert_eq!(info["state"], "running");
    assert!(strata(&d, &["pause", &id]).status.success());
    assert_eq!(json(&d, &["info", &id])["state"], "paused");
    assert!(strata(&d, &["resume", &id]).status.success());
    assert_eq!(json(&d, &["info", &id])["state"], "running");

    // errors: unknown id → not_found, non-zero exit, machine-readable.
    let out = strata(&d, &["--json", "info", "sb-doesnotexist"]);
    assert!(!out.status.success());
    let err: Value = serde_json::from_slice(&out.stdout).expect("error json");
    assert_eq!(err["error"]["code"], "not_found");

    for sb in [&id, &fork_id] {
        assert!(strata(&d, &["rm", sb]).status.success());
    }
    d.shutdown();
}
