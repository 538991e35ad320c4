//! `strata dev run` against the real guest image under TCG: output, exit
//! codes, and a command that does not exist. Each test boots one VM; they run
//! one at a time (the machine is small).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_VM_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `strata dev run --image IMG --accel tcg -- ARGS`, failing the test
/// if it takes longer than `limit` (the process is killed then).
fn dev_run(args: &[&str], limit: Duration) -> Output {
    let _one = ONE_VM_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let image = strata_testkit::test_image();
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["dev", "run", "--accel", "tcg", "--memory", "256", "--image"])
        .arg(&image.dir)
        .arg("--")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn strata");
    let t0 = Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!(
                "strata dev run {args:?} still running after {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("wait")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The QEMU pid `strata dev run` reported on stderr must be gone once it exited.
fn qemu_is_gone(stderr: &str) {
    let pid = stderr
        .split("QEMU pid ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no QEMU pid in stderr: {stderr}"));
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("qemu"),
        "QEMU {pid} still runs after strata exited"
    );
}

#[test]
fn uname_runs_in_the_guest() {
    let out = dev_run(&["uname", "-a"], Duration::from_secs(180));
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(
        stdout.contains("Linux"),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    // Timings on stderr, not mixed into the command's output.
    assert!(stderr.contains("agent ready"), "{stderr}");
    assert!(stderr.contains("exit code 0"), "{stderr}");
    assert!(!stdout.contains("strata dev"), "{stdout}");
    qemu_is_gone(&stderr);
}

#[test]
fn exit_code_and_streams_come_through() {
    let out = dev_run(
        &["sh", "-c", "echo to-out; echo to-err >&2; exit 7"],
        Duration::from_secs(180),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(7),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert_eq!(stdout, "to-out\n");
    assert!(stderr.contains("to-err\n"), "{stderr}");
    assert!(!stdout.contains("to-err"));
    qemu_is_gone(&stderr);
}

#[test]
fn missing_command_fails_clearly() {
    let out = dev_run(&["/no/such/cmd"], Duration::from_secs(180));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "stderr: {stderr}");
    assert!(stderr.contains("/no/such/cmd"), "{stderr}");
    assert!(stderr.contains("not found"), "{stderr}");
    assert!(out.stdout.is_empty());
}
