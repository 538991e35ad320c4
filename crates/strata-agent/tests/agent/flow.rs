//! Flow control of guest output (see `PROTOCOL.md`, *Flow control*): a host
//! that grants no credit stalls the command, not its own memory; collecting
//! has a limit; an agent that overruns its window (or, without a window,
//! the client's buffer caps) loses only that request.
//!
//! The real agent binary for the first half; a fake agent on a unix socket
//! (this file's [`Fake`]) for the agents that break the rules.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use strata_proto::client::{CALL_BUFFER_CAP, CONNECTION_BUFFER_CAP, OUTPUT_WINDOW};
use strata_proto::frame::{Decoded, Frame, FrameDecoder, FrameKind, SYNC_MAGIC};
use strata_proto::{
    AgentClient, AgentError, AgentInfo, Command, ExecEvent, ExecRequest, RemoteErrorKind, Request,
    Response, Stdin,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::support::{sh, Agent};

/// What the client may hold for one windowed command that nobody reads:
/// the window plus the queue's per-item overhead.
const STALLED_MAX: usize = OUTPUT_WINDOW as usize + 64 * 1024;

async fn wait_file(p: &str, max: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < max {
        if Path::new(p).exists() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test]
async fn unread_output_stalls_the_command_and_completes_when_read() {
    let agent = Agent::start();
    let c = agent.client().await;
    assert_eq!(c.output_window(), Some(OUTPUT_WINDOW));
    let marker = agent.path("wrote-all");
    let total: u64 = 64 * 1024 * 1024;
    let mut h = c
        .exec(sh(&format!("head -c {total} /dev/zero; touch {marker}")))
        .await
        .unwrap();
    // Nobody reads for two seconds: the command is blocked on its pipe.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !Path::new(&marker).exists(),
        "the command wrote all of its output with nobody reading"
    );
    let held = c.buffered_bytes();
    assert!(held <= STALLED_MAX, "client holds {held} bytes unread");
    // Another request on the same connection is not held up.
    assert_eq!(c.exec_collect(sh("echo hi")).await.unwrap().stdout, b"hi\n");
    // Reading it all gets every byte, then the exit.
    let mut got = 0u64;
    let mut status = None;
    while let Some(ev) = h.next_event().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => {
                assert!(b.iter().all(|&x| x == 0));
                got += b.len() as u64;
            }
            ExecEvent::Exit(s) => status = Some(s),
            _ => {}
        }
    }
    assert_eq!(got, total);
    assert!(status.unwrap().success());
    assert!(Path::new(&marker).exists());
}

#[tokio::test]
async fn host_without_the_window_still_gets_unwindowed_output() {
    // An older host never asks for a window: the agent sends as before.
    let agent = Agent::start();
    let c = AgentClient::connect_unix_unwindowed(&agent.sock, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(c.output_window(), None);
    let marker = agent.path("wrote-all");
    let total = 4 * 1024 * 1024;
    let mut h = c
        .exec(sh(&format!("head -c {total} /dev/zero; touch {marker}")))
        .await
        .unwrap();
    assert!(
        wait_file(&marker, Duration::from_secs(10)).await,
        "no window: the command runs through"
    );
    let mut got = 0;
    while let Some(ev) = h.next_event().await {
        if let ExecEvent::Stdout(b) = ev.unwrap() {
            got += b.len();
        }
    }
    assert_eq!(got, total);
}

#[tokio::test]
async fn dropped_handle_lets_the_command_run_on() {
    let agent = Agent::start();
    let c = agent.client().await;
    let marker = agent.path("done");
    let mut h = c
        .exec(sh(&format!("head -c 16777216 /dev/zero; touch {marker}")))
        .await
        .unwrap();
    assert!(matches!(
        h.next_event().await,
        Some(Ok(ExecEvent::Started { .. }))
    ));
    drop(h);
    assert!(
        wait_file(&marker, Duration::from_secs(10)).await,
        "the command stalled after its handle went away"
    );
    assert_eq!(c.buffered_bytes(), 0);
}

#[tokio::test]
async fn collecting_has_a_limit_and_stdin_bytes_do_not_deadlock() {
    let agent = Agent::start();
    let c = agent.client().await;
    let t = Instant::now();
    let e = c
        .exec_collect_max(sh("exec cat /dev/zero"), 1024 * 1024)
        .await
        .unwrap_err();
    assert!(
        matches!(e, AgentError::OutputLimit { limit: 1048576 }),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    // The command was killed: nothing of it is left.
    let out = c.exec_collect(sh("pgrep -x cat || true")).await.unwrap();
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // `cat` echoes 8 MiB of stdin: its output window fills long before its
    // input is all sent; feeding stdin while reading keeps both moving.
    let data: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let mut req = ExecRequest::argv(["cat"]);
    req.stdin = Stdin::Bytes(data.clone());
    let out = tokio::time::timeout(Duration::from_secs(30), c.exec_collect(req))
        .await
        .expect("cat with a large stdin deadlocked")
        .unwrap();
    assert!(out.stdout == data, "echoed {} bytes", out.stdout.len());
}

/// A fake agent: answers the handshake, `ping` and `output_window` (when
/// `windowed`), and for `exec {argv: ["flood", N]}` sends `started` and N
/// bytes of stdout, never an exit, whatever the window; `exec {argv:
/// ["echo", S]}` is answered normally; `read_file` floods like `flood` with
/// the size in the path. Records the signals it gets.
struct Fake {
    _dir: tempfile::TempDir,
    sock: std::path::PathBuf,
    signals: Arc<Mutex<Vec<(u32, i32)>>>,
}

impl Fake {
    fn start(windowed: bool) -> Fake {
        let dir = tempfile::Builder::new()
            .prefix("strata-fake-agent-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let signals = Arc::new(Mutex::new(Vec::new()));
        let s2 = signals.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(fake_session(conn, windowed, s2.clone()));
            }
        });
        Fake {
            _dir: dir,
            sock,
            signals,
        }
    }

    async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock, Duration::from_secs(10))
            .await
            .unwrap()
    }

    fn signals(&self) -> Vec<(u32, i32)> {
        self.signals.lock().unwrap().clone()
    }
}

async fn send(conn: &mut UnixStream, id: u32, r: &Response) {
    let b = Frame::control(id, r).unwrap().encode().unwrap();
    conn.write_all(&b).await.unwrap();
}

async fn flood(conn: &mut UnixStream, kind: FrameKind, id: u32, total: usize) {
    let chunk = Bytes::from(vec![7u8; 64 * 1024]);
    let mut left = total;
    let mut buf = BytesMut::new();
    while left > 0 {
        let n = left.min(chunk.len());
        Frame::data(kind, id, chunk.slice(..n))
            .encode_into(&mut buf)
            .unwrap();
        left -= n;
        if buf.len() >= 1024 * 1024 || left == 0 {
            if conn.write_all(&buf).await.is_err() {
                return; // the client closed the connection
            }
            buf.clear();
        }
    }
}

async fn fake_session(mut conn: UnixStream, windowed: bool, signals: Arc<Mutex<Vec<(u32, i32)>>>) {
    let info = AgentInfo {
        protocol_version: strata_proto::PROTOCOL_VERSION,
        agent_version: "fake".into(),
        hostname: "fake".into(),
        boot_id: "fake".into(),
        uptime_ms: 0,
    };
    let mut dec = FrameDecoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        dec.extend(&buf[..n]);
        while let Ok(Some(item)) = dec.next_item() {
            let Decoded::Frame(f) = item else { continue };
            let Ok(req) = f.parse::<Request>() else {
                continue;
            };
            let id = f.id;
            match req {
                Request::Hello { nonce, .. } => {
                    let mut b = SYNC_MAGIC.to_vec();
                    b.extend_from_slice(
                        &Frame::control(
                            0,
                            &Response::HelloOk {
                                nonce,
                                info: info.clone(),
                            },
                        )
                        .unwrap()
                        .encode()
                        .unwrap(),
                    );
                    conn.write_all(&b).await.unwrap();
                }
                Request::OutputWindow { .. } if windowed => {
                    send(&mut conn, id, &Response::Ok).await
                }
                Request::OutputWindow { .. } => {
                    // What an older agent answers to an op it does not know.
                    let r = Response::Error {
                        kind: RemoteErrorKind::InvalidArgument,
                        message: "bad request: unknown variant `output_window`".into(),
                    };
                    send(&mut conn, id, &r).await
                }
                Request::Ping {} => {
                    let r = Response::Pong { info: info.clone() };
                    send(&mut conn, id, &r).await
                }
                Request::Exec {
                    command: Command::Argv(v),
                    ..
                } => {
                    send(&mut conn, id, &Response::Started { pid: 4242 }).await;
                    match v.first().map(String::as_str) {
                        Some("flood") => {
                            let n = v[1].parse().unwrap();
                            flood(&mut conn, FrameKind::Stdout, id, n).await;
                        }
                        _ => {
                            let out = Bytes::from(v.get(1).cloned().unwrap_or_default());
                            let b = Frame::data(FrameKind::Stdout, id, out).encode().unwrap();
                            conn.write_all(&b).await.unwrap();
                            let exit = Response::Exit {
                                code: Some(0),
                                signal: None,
                                timed_out: false,
                            };
                            send(&mut conn, id, &exit).await;
                        }
                    }
                }
                Request::ReadFile { path } => {
                    let n: usize = path.trim_start_matches('/').parse().unwrap();
                    send(&mut conn, id, &Response::FileStart { size: n as u64 }).await;
                    flood(&mut conn, FrameKind::FileData, id, n).await;
                }
                Request::Signal { signal } => signals.lock().unwrap().push((id, signal)),
                _ => {}
            }
        }
    }
}

fn flood_req(bytes: usize) -> ExecRequest {
    ExecRequest::argv(["flood".to_owned(), bytes.to_string()])
}

/// Starts `req`, reads nothing for a second, then returns the first event:
/// an aborted request has nothing queued but its error.
async fn unread_then_first(
    c: &AgentClient,
    req: ExecRequest,
) -> Option<Result<ExecEvent, AgentError>> {
    let mut h = c.exec(req).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.next_event().await
}

async fn still_works(c: &AgentClient) {
    assert!(!c.is_closed());
    c.ping().await.unwrap();
    let out = c
        .exec_collect(ExecRequest::argv(["echo", "after"]))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"after");
}

#[tokio::test]
async fn agent_overrunning_its_window_loses_only_that_request() {
    let fake = Fake::start(true);
    let c = fake.client().await;
    assert_eq!(c.output_window(), Some(OUTPUT_WINDOW));
    // A request that is in flight meanwhile survives.
    let mut other = c
        .exec(ExecRequest::argv(["echo", "bystander"]))
        .await
        .unwrap();
    // Three windows' worth, sent while the client reads nothing (so it
    // grants no credit): the request is aborted.
    let ev = unread_then_first(&c, flood_req(3 * OUTPUT_WINDOW as usize)).await;
    assert!(
        matches!(ev, Some(Err(AgentError::FlowControl(_)))),
        "{ev:?}"
    );
    // Its process group is killed.
    let id = {
        let t = Instant::now();
        loop {
            if let Some(s) = fake.signals().first() {
                break *s;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "no signal sent");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert_eq!(id.1, 9);
    let mut seen = Vec::new();
    while let Some(ev) = other.next_event().await {
        seen.push(ev.unwrap());
    }
    assert!(seen.contains(&ExecEvent::Stdout(Bytes::from_static(b"bystander"))));
    drop(other);
    assert_eq!(
        c.buffered_bytes(),
        0,
        "the aborted request's output is freed"
    );
    still_works(&c).await;

    // A download sent past its read_ack window fails the same way.
    let mut dl = c.read_file(&format!("/{}", 8 * 1024 * 1024)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut err = None;
    while let Some(r) = dl.next_chunk().await {
        if let Err(e) = r {
            err = Some(e);
            break;
        }
    }
    assert!(matches!(err, Some(AgentError::FlowControl(_))), "{err:?}");
    drop(dl);
    still_works(&c).await;
}

#[tokio::test]
async fn older_agent_is_capped_per_request_and_per_connection() {
    let fake = Fake::start(false);
    let c = fake.client().await;
    assert_eq!(c.output_window(), None, "an older agent has no window");
    still_works(&c).await;
    // One request past the per-request cap loses that request only.
    let ev = unread_then_first(&c, flood_req(CALL_BUFFER_CAP + 1024 * 1024)).await;
    assert!(
        matches!(ev, Some(Err(AgentError::FlowControl(_)))),
        "{ev:?}"
    );
    assert_eq!(fake.signals().len(), 1);
    still_works(&c).await;
    assert_eq!(c.buffered_bytes(), 0);

    // Unread requests each under the cap, together past the connection's
    // cap: the connection is closed (the runtime reconnects).
    let each = CALL_BUFFER_CAP - 1024 * 1024;
    let mut handles = Vec::new();
    for _ in 0..=(CONNECTION_BUFFER_CAP / each) {
        match c.exec(flood_req(each)).await {
            Ok(h) => handles.push(h),
            Err(e) => {
                assert!(matches!(e, AgentError::Closed), "{e}");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let t = Instant::now();
    while !c.is_closed() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "connection not closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(handles);
    assert_eq!(c.buffered_bytes(), 0);
    // A new connection works.
    still_works(&fake.client().await).await;
}
