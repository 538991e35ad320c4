//! Commands on a pseudo-terminal: the terminal is the command's controlling
//! tty, its size follows `resize`, input is echoed and read through the line
//! discipline, `^C` interrupts the foreground; an agent older than PTYs
//! answers with the typed "unsupported" error.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use strata_proto::client::EventStream;
use strata_proto::{AgentError, ExecEvent, ExecHandle, ExecInput, ExecRequest, PtySize, Stdin};

use crate::support::{sh, Agent};

const WAIT: Duration = Duration::from_secs(20);

fn on_pty(script: &str, cols: u16, rows: u16) -> ExecRequest {
    ExecRequest {
        stdin: Stdin::Stream,
        pty: Some(PtySize { cols, rows }),
        ..sh(script)
    }
}

/// Reads the command's output until it contains `want`; returns all of it.
async fn until(h: &mut ExecHandle, seen: &mut String, want: &str) {
    let found = tokio::time::timeout(WAIT, async {
        while !seen.contains(want) {
            match h.next_event().await {
                Some(Ok(ExecEvent::Stdout(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(ExecEvent::Stderr(b))) => panic!("stderr on a pty: {b:?}"),
                Some(Ok(ExecEvent::Started { .. })) => {}
                other => panic!("waiting for {want:?} in {seen:?}: {other:?}"),
            }
        }
    })
    .await;
    assert!(found.is_ok(), "no {want:?} in {seen:?}");
}

async fn exit_of(h: &mut ExecHandle) -> strata_proto::ExitStatus {
    loop {
        match tokio::time::timeout(WAIT, h.next_event()).await {
            Ok(Some(Ok(ExecEvent::Exit(s)))) => return s,
            Ok(Some(Ok(_))) => {}
            other => panic!("no exit: {other:?}"),
        }
    }
}

#[tokio::test]
async fn pty_is_the_controlling_tty_with_its_size_echo_and_term() {
    let agent = Agent::start();
    let c = agent.client().await;
    let script = r#"tty; [ -t 1 ] && echo stdout-is-tty; echo "term=$TERM"; stty size;
        read line; echo "got:$line"; ps -o tty= -p $$"#;
    let mut h = c.exec(on_pty(script, 91, 33)).await.unwrap();
    assert!(h.is_pty());
    let mut seen = String::new();
    until(&mut h, &mut seen, "33 91").await;
    assert!(seen.contains("/dev/pts/"), "{seen:?}");
    assert!(seen.contains("stdout-is-tty"), "{seen:?}");
    assert!(seen.contains("term=xterm-256color"), "{seen:?}");
    h.write_stdin(b"hello pty\n").await.unwrap();
    until(&mut h, &mut seen, "got:hello pty").await;
    // The line discipline echoed the input (and made CR LF of it).
    assert!(seen.contains("hello pty\r\n"), "{seen:?}");
    // ps names the controlling terminal of the shell: the pts.
    until(&mut h, &mut seen, "pts/").await;
    assert!(exit_of(&mut h).await.success());

    // A TERM of the request wins.
    let mut req = on_pty("echo term=$TERM", 80, 24);
    req.env.insert("TERM".into(), "vt100".into());
    let out = c.exec_collect(req).await.unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("term=vt100"));

    // Without a PTY nothing changed: pipes, no terminal.
    let out = c
        .exec_collect(sh(
            "[ -t 0 ] || [ -t 1 ] || echo no-tty; echo ${TERM:-unset}",
        ))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"no-tty\nunset\n");
}

async fn read_until(events: &mut EventStream, seen: &mut String, want: &str) {
    let r = tokio::time::timeout(WAIT, async {
        while !seen.contains(want) {
            match events.next().await {
                Some(Ok(ExecEvent::Stdout(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(ExecEvent::Started { .. })) => {}
                other => panic!("waiting for {want:?} in {seen:?}: {other:?}"),
            }
        }
    })
    .await;
    assert!(r.is_ok(), "no {want:?} in {seen:?}");
}

#[tokio::test]
async fn resize_reaches_the_terminal_and_the_foreground_gets_sigwinch() {
    let agent = Agent::start();
    let c = agent.client().await;
    // The trap prints the size the terminal has when SIGWINCH arrives.
    let script = r#"trap 'echo winch; stty size' WINCH; stty -echo; stty size; echo ready;
        while :; do sleep 0.05; done"#;
    let h = c.exec(on_pty(script, 80, 24)).await.unwrap();
    let (mut events, input) = h.interactive();
    let mut seen = String::new();
    read_until(&mut events, &mut seen, "ready").await;
    assert!(seen.contains("24 80"), "{seen:?}");
    input
        .send(ExecInput::Resize(PtySize {
            cols: 132,
            rows: 43,
        }))
        .await
        .unwrap();
    read_until(&mut events, &mut seen, "43 132").await;
    assert!(seen.contains("winch"), "no SIGWINCH seen: {seen:?}");
    // ^C through the input channel ends it.
    input.send(ExecInput::Stdin("\x03".into())).await.unwrap();
    let end = tokio::time::timeout(WAIT, async {
        while let Some(ev) = events.next().await {
            if let Ok(ExecEvent::Exit(s)) = ev {
                return s;
            }
        }
        panic!("stream ended without an exit");
    })
    .await
    .expect("exit after ^C");
    assert_eq!(end.signal, Some(libc::SIGINT), "{end:?}");
}

#[tokio::test]
async fn ctrl_c_on_the_pty_interrupts_the_foreground() {
    let agent = Agent::start();
    let c = agent.client().await;
    let mut h = c
        .exec(on_pty("echo sleeping; exec sleep 1000", 80, 24))
        .await
        .unwrap();
    let mut seen = String::new();
    until(&mut h, &mut seen, "sleeping").await;
    // Give `exec sleep` a moment to replace the shell.
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.write_stdin(b"\x03").await.unwrap();
    let s = exit_of(&mut h).await;
    assert_eq!(s.signal, Some(libc::SIGINT), "{s:?}");
}

#[tokio::test]
async fn ctrl_c_works_even_when_the_agent_was_started_ignoring_it() {
    // A shell's background job ignores SIGINT/SIGQUIT, nohup SIGHUP; the
    // agent's commands must not inherit that (they did: ^C did nothing).
    let agent = Agent::start_ignoring(&[libc::SIGINT, libc::SIGQUIT, libc::SIGHUP]);
    let c = agent.client().await;
    let mut h = c
        .exec(on_pty("echo sleeping; exec sleep 1000", 80, 24))
        .await
        .unwrap();
    let mut seen = String::new();
    until(&mut h, &mut seen, "sleeping").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.write_stdin(b"\x03").await.unwrap();
    let s = exit_of(&mut h).await;
    assert_eq!(s.signal, Some(libc::SIGINT), "{s:?}");
}

/// The previous release's agent (built by `scripts/previous-release.sh`
/// into the compat cache), if it is there.
fn previous_agent() -> Option<std::path::PathBuf> {
    let pin = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../strata-runtime/tests/compat/PREVIOUS_RELEASE"
    );
    let text = std::fs::read_to_string(pin).ok()?;
    let commit = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| !l.is_empty())?
        .to_owned();
    let cache = std::env::var_os("STRATA_COMPAT_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/var/cache/strata/compat".into());
    Some(cache.join(commit).join("strata-agent")).filter(|p| p.is_file())
}

#[tokio::test]
async fn an_agent_older_than_ptys_answers_unsupported_and_keeps_working() {
    let Some(bin) = previous_agent() else {
        panic!(
            "the previous release's agent is missing from the compat cache: run \
             scripts/previous-release.sh"
        );
    };
    let agent = Agent::start_binary(&bin, &[]);
    let c = agent.client().await;
    let mut h = c.exec(on_pty("tty", 80, 24)).await.unwrap();
    match h.next_event().await {
        Some(Err(AgentError::Unsupported { feature })) => assert_eq!(feature, "PTYs"),
        other => panic!("want Unsupported, got {other:?}"),
    }
    assert!(h.next_event().await.is_none());
    // The connection and plain commands go on.
    let out = c.exec_collect(sh("echo still")).await.unwrap();
    assert_eq!(out.stdout, b"still\n");
}

#[tokio::test]
async fn a_large_paste_into_an_echoing_pty_does_not_deadlock() {
    // `head` copies the terminal's input to its output: the command's
    // output grows with its input, past both windows (1 MiB each).
    const N: usize = 3_000_000;
    let agent = Agent::start();
    let c = agent.client().await;
    let h = c
        .exec(on_pty(
            &format!("stty raw -echo; echo go; exec head -c {N}"),
            80,
            24,
        ))
        .await
        .unwrap();
    let (mut events, input) = h.interactive();
    let mut seen = String::new();
    read_until(&mut events, &mut seen, "go").await;
    let feeder = tokio::spawn(async move {
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let mut sent = 0;
        while sent < N {
            let n = chunk.len().min(N - sent);
            if input
                .send(ExecInput::Stdin(chunk.slice(..n)))
                .await
                .is_err()
            {
                break;
            }
            sent += n;
        }
        input
    });
    let mut got = seen.len().saturating_sub(seen.find("go").unwrap() + 4);
    let end = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(ev) = events.next().await {
            match ev.unwrap() {
                ExecEvent::Stdout(b) => got += b.len(),
                ExecEvent::Exit(s) => return s,
                _ => {}
            }
        }
        panic!("no exit");
    })
    .await
    .unwrap_or_else(|_| panic!("stalled after {got} of {N} bytes"));
    assert!(end.success(), "{end:?}");
    assert!(got >= N, "{got} of {N} bytes came back");
    drop(feeder.await.unwrap());
}
