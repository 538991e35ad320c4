//! Commands on a pseudo-terminal in a real guest (TCG, the image strata
//! builds): the PTY is the command's controlling terminal (`tty` names a
//! `/dev/pts/N` the user owns), `stty size` follows a resize, input is
//! echoed by the line discipline and read by the command, `^C` typed into
//! the terminal interrupts the foreground process.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::Duration;

use strata_core::SandboxSize;
use strata_proto::client::{ExecEvent, ExecHandle, ExecRequest, Stdin};
use strata_proto::PtySize;

mod common;

use common::{sandbox_agent, tokio_rt, TestRuntime};

/// TCG is slow: a generous bound per expected output.
const WAIT: Duration = Duration::from_secs(60);

async fn read_until(h: &mut ExecHandle, seen: &mut String, want: &str) {
    let r = tokio::time::timeout(WAIT, async {
        while !seen.contains(want) {
            match h.next_event().await {
                Some(Ok(ExecEvent::Stdout(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(ExecEvent::Started { .. })) => {}
                other => panic!("waiting for {want:?} in {seen:?}: {other:?}"),
            }
        }
    })
    .await;
    assert!(r.is_ok(), "no {want:?} in {seen:?}");
}

#[test]
fn pty_session_tty_resize_echo_and_ctrl_c() {
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: 512,
        disk_gib: 2,
    };
    let t = TestRuntime::start("strpty-", size, |_| {});
    let agent = sandbox_agent(&t);
    tokio_rt().block_on(async {
        let script = r#"t=$(tty); echo "tty=$t owner=$(stat -c %U "$t")"; stty size; echo ready;
            read l; echo "got:$l"; stty size; echo sleeping; exec sleep 1000"#;
        let req = ExecRequest {
            stdin: Stdin::Stream,
            user: Some("user".into()),
            pty: Some(PtySize { cols: 80, rows: 24 }),
            ..ExecRequest::shell(script)
        };
        let mut h = agent.exec(req).await.expect("exec");
        let mut seen = String::new();
        read_until(&mut h, &mut seen, "ready").await;
        assert!(seen.contains("tty=/dev/pts/"), "{seen:?}");
        assert!(seen.contains("owner=user"), "{seen:?}");
        assert!(seen.contains("24 80"), "{seen:?}");

        h.resize(PtySize {
            cols: 120,
            rows: 40,
        })
        .await
        .unwrap();
        h.write_stdin(b"typed line\n").await.unwrap();
        read_until(&mut h, &mut seen, "sleeping").await;
        // The terminal echoed the input, the command read it, and the size
        // it reads now is the new one.
        assert!(seen.contains("typed line\r\n"), "no echo: {seen:?}");
        assert!(seen.contains("got:typed line"), "{seen:?}");
        assert!(seen.contains("40 120"), "{seen:?}");

        // ^C in the terminal: SIGINT for the foreground (the shell, then
        // its `sleep`), not a byte for the command to read. The guest is
        // slow (TCG): give `exec sleep` a moment, and press again if the
        // first one landed before it ran.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let t0 = std::time::Instant::now();
        let mut presses = 0;
        let end = loop {
            h.write_stdin(b"\x03").await.unwrap();
            presses += 1;
            let step = tokio::time::timeout(Duration::from_secs(10), async {
                while let Some(ev) = h.next_event().await {
                    if let Ok(ExecEvent::Exit(s)) = ev {
                        return Some(s);
                    }
                }
                None
            })
            .await;
            match step {
                Ok(Some(s)) => break s,
                Ok(None) => panic!("stream ended without an exit: {seen:?}"),
                Err(_) => assert!(t0.elapsed() < WAIT, "no exit after {presses} ^C"),
            }
        };
        eprintln!("exit after {presses} ^C: {end:?}");
        assert_eq!(end.signal, Some(libc::SIGINT), "{end:?}");
    });
}
