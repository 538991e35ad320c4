//! `strata exec -t` against a real daemon and guest, driven the way a user
//! drives it: the CLI runs on a terminal (a PTY this test holds), keys are
//! typed into it, its window is resized, and the terminal is checked after
//! the CLI exits (raw mode undone).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;

const WAIT: Duration = Duration::from_secs(90);

fn set_size(master: &OwnedFd, cols: u16, rows: u16) {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the valid pointer.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    assert_eq!(r, 0);
}

/// A PTY pair: (master, slave).
fn open_pty() -> (OwnedFd, OwnedFd) {
    let (mut m, mut s) = (0, 0);
    // SAFETY: openpty writes two fds; null name/termios/winsize are allowed.
    let r = unsafe {
        libc::openpty(
            &mut m,
            &mut s,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: fresh fds owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) }
}

/// The terminal's local flags (ICANON, ECHO …).
fn lflags(fd: &OwnedFd) -> libc::tcflag_t {
    // SAFETY: `termios` is plain data; tcgetattr fills it.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and pointer.
    let r = unsafe { libc::tcgetattr(fd.as_raw_fd(), &mut t) };
    assert_eq!(r, 0);
    t.c_lflag
}

struct Screen(Arc<Mutex<Vec<u8>>>);

impl Screen {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn wait_for(&self, needle: &str) {
        let t0 = Instant::now();
        while t0.elapsed() < WAIT {
            if self.text().contains(needle) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{needle:?} not on the screen: {:?}", self.text());
    }
}

#[test]
fn exec_t_is_an_interactive_terminal_session() {
    let rt = strata_testkit::tokio_rt();
    let d = Daemon::start("");
    rt.block_on(d.wait_template());
    let out = strata_testkit::run_strata(
        &strata_testkit::strata_bin(),
        &d.url,
        d.token().as_deref(),
        &["--json", "create"],
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = v["id"].as_str().unwrap().to_owned();

    let (master, slave) = open_pty();
    set_size(&master, 100, 30);
    let mut cmd = std::process::Command::new(strata_testkit::strata_bin());
    cmd.env("STRATA_URL", &d.url)
        .env("STRATA_DATA_DIR", "/nonexistent/strata-testkit")
        .env_remove("STRATA_TOKEN")
        .args(["exec", "-t", &id, "--", "sh"])
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave.try_clone().unwrap()));
    if let Some(t) = d.token() {
        cmd.env("STRATA_TOKEN", t);
    }
    // SAFETY: between fork and exec only setsid and ioctl: the CLI leads a
    // session whose controlling terminal is our PTY (so it gets SIGWINCH).
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn strata exec -t");

    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut reader = std::fs::File::from(master.try_clone().unwrap());
    let sink = seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let screen = Screen(seen);
    let mut keys = std::fs::File::from(master.try_clone().unwrap());
    let mut type_ = |s: &str| keys.write_all(s.as_bytes()).unwrap();

    // The remote shell's terminal has our size; it is a real tty.
    type_("stty size; tty\r");
    screen.wait_for("30 100");
    screen.wait_for("/dev/pts/");
    // While it runs our terminal is raw: no local echo, no line editing.
    assert_eq!(lflags(&slave) & (libc::ICANON | libc::ECHO), 0);

    // Our window changes: the remote terminal follows (SIGWINCH -> resize).
    set_size(&master, 120, 40);
    std::thread::sleep(Duration::from_millis(500));
    type_("stty size\r");
    screen.wait_for("40 120");

    // ^C interrupts the remote foreground command, not the CLI.
    type_("sleep 1000\r");
    std::thread::sleep(Duration::from_secs(1));
    type_("\x03");
    type_("echo back-$((2+3))\r");
    screen.wait_for("back-5");

    type_("exit 7\r");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < WAIT,
            "strata exec -t did not exit: {:?}",
            screen.text()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status.code(), Some(7), "{:?}", screen.text());
    // The terminal is back in the mode it had.
    let l = lflags(&slave);
    assert_eq!(l & (libc::ICANON | libc::ECHO), libc::ICANON | libc::ECHO);
}
