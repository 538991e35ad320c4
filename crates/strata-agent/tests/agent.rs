//! Integration tests: the real `strata-agent --listen-unix` binary driven by
//! the real `AgentClient` over a unix socket.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use strata_proto::frame::{decode_frame, Decoded, Frame, SYNC_MAGIC};
use strata_proto::{
    AgentClient, AgentError, ExecEvent, ExecRequest, FileKind, RemoteErrorKind, Request, Response,
    RestoreSync, Stdin,
};

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Self {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("strata-agent-test-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_strata-agent"))
            .arg("--listen-unix")
            .arg(&sock)
            .arg("--dry-system")
            .args(extra)
            .env("STRATA_AGENT_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Self { child, dir, sock }
    }

    async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock, Duration::from_secs(10))
            .await
            .unwrap()
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sh(s: &str) -> ExecRequest {
    ExecRequest::shell(s)
}

/// Processes whose process group is `pgid` (from /proc).
fn group_members(pgid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let state = fields.first().copied().unwrap_or("");
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) && state != "Z" {
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            out.push((pid, cmd));
        }
    }
    out
}

#[tokio::test]
async fn echo_exit_codes_and_stderr() {
    let agent = Agent::start();
    let c = agent.client().await;
    assert_eq!(c.info().protocol_version, strata_proto::PROTOCOL_VERSION);
    let info = c.ping().await.unwrap();
    assert!(!info.boot_id.is_empty());

    let out = c
        .exec_collect(ExecRequest::argv(["echo", "hello", "world"]))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert!(out.stderr.is_empty());
    assert!(out.status.success());

    let out = c
        .exec_collect(sh("echo out; echo err >&2; exit 3"))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code, Some(3));
    assert_eq!(out.status.signal, None);
    assert!(!out.status.timed_out);
}

#[tokio::test]
async fn signals() {
    let agent = Agent::start();
    let c = agent.client().await;
    let out = c.exec_collect(sh("kill -TERM $$")).await.unwrap();
    assert_eq!(out.status.code, None);
    assert_eq!(out.status.signal, Some(libc::SIGTERM));

    let mut h = c.exec(ExecRequest::argv(["sleep", "100"])).await.unwrap();
    let Some(Ok(ExecEvent::Started { pid })) = h.next_event().await else {
        panic!("no start");
    };
    assert!(pid > 1);
    h.signal(libc::SIGKILL).await.unwrap();
    let t = Instant::now();
    match h.next_event().await.unwrap().unwrap() {
        ExecEvent::Exit(s) => assert_eq!(s.signal, Some(libc::SIGKILL)),
        other => panic!("unexpected {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn stdin_env_cwd() {
    let agent = Agent::start();
    let c = agent.client().await;
    let mut req = ExecRequest::argv(["cat"]);
    req.stdin = Stdin::Bytes(b"from stdin\n".to_vec());
    let out = c.exec_collect(req).await.unwrap();
    assert_eq!(out.stdout, b"from stdin\n");

    // Streamed stdin, larger than the stdin window.
    let mut req = sh("sha256sum | cut -d' ' -f1");
    req.stdin = Stdin::Stream;
    let mut h = c.exec(req).await.unwrap();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    h.write_stdin(&data).await.unwrap();
    h.close_stdin().await.unwrap();
    let mut stdout = Vec::new();
    while let Some(ev) = h.next_event().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => stdout.extend_from_slice(&b),
            ExecEvent::Exit(s) => assert!(s.success()),
            _ => {}
        }
    }
    let want = hex::encode(Sha256::digest(&data));
    assert_eq!(String::from_utf8_lossy(&stdout).trim(), want);

    let mut req = sh("echo \"$FOO:$BAR\"; pwd");
    req.env.insert("FOO".into(), "foo value".into());
    req.env.insert("BAR".into(), "42".into());
    req.cwd = Some(agent.dir.path().to_str().unwrap().to_owned());
    let out = c.exec_collect(req).await.unwrap();
    let want = format!("foo value:42\n{}\n", agent.dir.path().display());
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);

    let mut req = sh("true");
    req.cwd = Some("/nonexistent/dir".into());
    let e = c.exec_collect(req).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
}

#[tokio::test]
async fn user_switch() {
    let agent = Agent::start();
    let c = agent.client().await;
    let mut req = ExecRequest::argv(["true"]);
    req.user = Some("no-such-user-xyz".into());
    let e = c.exec_collect(req).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } == 0 {
        let mut req = ExecRequest::argv(["id", "-u"]);
        req.user = Some("nobody".into());
        let out = c.exec_collect(req).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "65534");
    }
}

#[tokio::test]
async fn timeout_kills_whole_group() {
    let agent = Agent::start();
    let c = agent.client().await;
    let mut req = sh("sleep 1000 & sleep 1000");
    req.timeout = Some(Duration::from_millis(500));
    let t = Instant::now();
    let mut h = c.exec(req).await.unwrap();
    let mut pgid = 0;
    let mut status = None;
    while let Some(ev) = h.next_event().await {
        match ev.unwrap() {
            ExecEvent::Started { pid } => {
                pgid = pid;
                // Give the shell time to start both sleeps.
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert!(group_members(pgid).len() >= 2, "{:?}", group_members(pgid));
            }
            ExecEvent::Exit(s) => status = Some(s),
            _ => {}
        }
    }
    let status = status.unwrap();
    assert!(status.timed_out);
    assert_eq!(status.signal, Some(libc::SIGKILL));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Nothing of that group survives (allow a moment for reaping by init).
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = group_members(pgid);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left over: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn twenty_concurrent_commands() {
    let agent = Agent::start();
    let c = agent.client().await;
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.exec_collect(sh(&format!(
                "sleep 0.5; echo {i}; echo e{i} >&2; exit {}",
                i % 7
            )))
            .await
            .unwrap()
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let out = t.await.unwrap();
        assert_eq!(out.stdout, format!("{i}\n").as_bytes());
        assert_eq!(out.stderr, format!("e{i}\n").as_bytes());
        assert_eq!(out.status.code, Some((i % 7) as i32));
    }
    // Sequential would take 10 s.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[tokio::test]
async fn output_streams_before_exit() {
    let agent = Agent::start();
    let c = agent.client().await;
    let t = Instant::now();
    let mut h = c
        .exec(sh("echo first; sleep 2; echo second"))
        .await
        .unwrap();
    let mut first_at = None;
    let mut exit_at = None;
    let mut out = Vec::new();
    while let Some(ev) = h.next_event().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => {
                first_at.get_or_insert(t.elapsed());
                out.extend_from_slice(&b);
            }
            ExecEvent::Exit(_) => exit_at = Some(t.elapsed()),
            _ => {}
        }
    }
    let (first_at, exit_at) = (first_at.unwrap(), exit_at.unwrap());
    assert_eq!(out, b"first\nsecond\n");
    assert!(
        first_at < Duration::from_millis(1500),
        "first chunk at {first_at:?}"
    );
    assert!(exit_at >= Duration::from_secs(2));
}

#[tokio::test]
async fn big_file_round_trip() {
    let agent = Agent::start();
    let c = agent.client().await;
    const SIZE: usize = 100 * 1024 * 1024;
    // Source file on the host, written in pieces.
    let src = agent.dir.path().join("src.bin");
    let mut hasher = Sha256::new();
    {
        let mut f = std::fs::File::create(&src).unwrap();
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..SIZE / buf.len() {
            for b in buf.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            hasher.update(&buf);
            f.write_all(&buf).unwrap();
        }
    }
    let want = hasher.finalize();
    let dest = agent.path("dest.bin");

    let t = Instant::now();
    let f = tokio::fs::File::open(&src).await.unwrap();
    let n = c.write_file(&dest, Some(0o600), f).await.unwrap();
    let up = t.elapsed();
    assert_eq!(n, SIZE as u64);
    let st = c.stat(&dest).await.unwrap().unwrap();
    assert_eq!(st.size, SIZE as u64);
    assert_eq!(st.mode, 0o600);
    assert_eq!(st.kind, FileKind::File);

    let t = Instant::now();
    let dl = c.read_file(&dest).await.unwrap();
    assert_eq!(dl.size(), SIZE as u64);
    let back = agent.dir.path().join("back.bin");
    let mut out = tokio::fs::File::create(&back).await.unwrap();
    let got = dl.copy_to(&mut out).await.unwrap();
    let down = t.elapsed();
    assert_eq!(got, SIZE as u64);
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(&back).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    assert_eq!(h.finalize(), want);
    let mib = SIZE as f64 / (1024.0 * 1024.0);
    println!(
        "BENCH file upload 100 MiB: {:.0} MiB/s ({:?}); download: {:.0} MiB/s ({:?})",
        mib / up.as_secs_f64(),
        up,
        mib / down.as_secs_f64(),
        down
    );

    // AsyncRead view of a download.
    use tokio::io::AsyncReadExt;
    let mut r = Box::pin(c.read_file(&dest).await.unwrap().into_async_read());
    let mut first = vec![0u8; 10];
    r.read_exact(&mut first).await.unwrap();
    let mut direct = [0u8; 10];
    std::fs::File::open(&src)
        .unwrap()
        .read_exact(&mut direct)
        .unwrap();
    assert_eq!(first, direct);
    drop(r);
    // No temporary upload files are left behind.
    let names: Vec<String> = c
        .list_dir(agent.dir.path().to_str().unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(
        !names.iter().any(|n| n.contains("strata-upload")),
        "{names:?}"
    );
}

#[tokio::test]
async fn file_operations_and_errors() {
    let agent = Agent::start();
    let c = agent.client().await;
    let base = agent.path("tree");
    c.mkdir_all(&format!("{base}/a/b/c"), None).await.unwrap();
    c.mkdir_all(&format!("{base}/a/b/c"), None).await.unwrap(); // idempotent
    c.write_file(&format!("{base}/a/f.txt"), None, &b"hello"[..])
        .await
        .unwrap();
    std::os::unix::fs::symlink("f.txt", format!("{base}/a/link")).unwrap();
    let list = c.list_dir(&format!("{base}/a")).await.unwrap();
    let summary: Vec<(String, FileKind)> = list.iter().map(|e| (e.name.clone(), e.kind)).collect();
    assert_eq!(
        summary,
        vec![
            ("b".into(), FileKind::Dir),
            ("f.txt".into(), FileKind::File),
            ("link".into(), FileKind::Symlink)
        ]
    );
    assert_eq!(list[1].size, 5);
    assert_eq!(list[1].mode, 0o644);
    assert!(list[1].mtime > 1_600_000_000);
    // Empty file.
    c.write_file(&format!("{base}/empty"), None, &b""[..])
        .await
        .unwrap();
    assert_eq!(
        c.stat(&format!("{base}/empty"))
            .await
            .unwrap()
            .unwrap()
            .size,
        0
    );
    let mut dl = c.read_file(&format!("{base}/empty")).await.unwrap();
    assert!(dl.next_chunk().await.is_none());

    assert!(c.stat(&format!("{base}/nope")).await.unwrap().is_none());
    let e = c.read_file(&format!("{base}/nope")).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.list_dir(&format!("{base}/nope")).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.read_file(&base).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::IsADirectory), "{e}");
    let e = c
        .write_file(&format!("{base}/nodir/x"), None, &b"x"[..])
        .await
        .unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.write_file(&base, None, &b"x"[..]).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::IsADirectory), "{e}");
    let e = c.stat(&format!("{base}/a\0b")).await.unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    let e = c
        .write_file("relative/path", None, &b"x"[..])
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    let e = c
        .mkdir_all(&format!("{base}/a/f.txt/sub"), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotADirectory), "{e}");

    let e = c.remove(&format!("{base}/a"), false).await.unwrap_err();
    assert!(matches!(e, AgentError::Remote { .. }), "{e}");
    c.remove(&format!("{base}/a/link"), false).await.unwrap();
    assert!(std::path::Path::new(&format!("{base}/a/f.txt")).exists());
    c.remove(&format!("{base}/a"), true).await.unwrap();
    assert!(c.stat(&format!("{base}/a")).await.unwrap().is_none());
    let e = c.remove(&format!("{base}/a"), true).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.remove("/", true).await.unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
}

#[tokio::test]
async fn missing_command_is_an_error_not_a_hang() {
    let agent = Agent::start();
    let c = agent.client().await;
    let t = Instant::now();
    let e = c
        .exec_collect(ExecRequest::argv(["no-such-command-xyz"]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.remote_kind(),
            Some(RemoteErrorKind::NotFound | RemoteErrorKind::SpawnFailed)
        ),
        "{e}"
    );
    assert!(e.to_string().contains("no-such-command-xyz"), "{e}");
    let e = c
        .exec_collect(ExecRequest::argv(Vec::<String>::new()))
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    // Still serving.
    assert!(c.exec_collect(sh("true")).await.unwrap().status.success());
}

/// Raw socket helper: read until a control frame decodes (or timeout).
fn raw_read_response(s: &mut StdUnixStream) -> Option<(u32, Response)> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        let mut off = 0;
        while let Ok(Some((item, used))) = decode_frame(&buf[off..]) {
            off += used;
            if let Decoded::Frame(f) = item {
                if let Ok(r) = f.parse::<Response>() {
                    return Some((f.id, r));
                }
            }
        }
        let n = s.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

fn raw_hello(version: u32) -> Vec<u8> {
    let mut v = SYNC_MAGIC.to_vec();
    v.extend_from_slice(
        &Frame::control(0, &Request::Hello { version, nonce: 77 })
            .unwrap()
            .encode()
            .unwrap(),
    );
    v
}

#[tokio::test]
async fn malformed_and_truncated_frames() {
    let mut agent = Agent::start();
    // Wait until the agent listens.
    let _ = agent.client().await;

    // 1. Malformed: a valid session, then a frame with an unknown kind.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { nonce: 77, .. }), "{r:?}");
    s.write_all(&[0, 0, 0, 3, 200, 0, 0, 0, 9, 1, 2, 3])
        .unwrap();
    let (id, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(id, 0);
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::Protocol,
                ..
            }
        ),
        "{r:?}"
    );
    // Invalid JSON in a control frame for a request id: that request fails, the session lives.
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { .. }), "{r:?}");
    let bad = Frame {
        kind: strata_proto::FrameKind::Control,
        id: 5,
        payload: bytes::Bytes::from_static(b"{not json"),
    };
    s.write_all(&bad.encode().unwrap()).unwrap();
    let (id, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(id, 5);
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::InvalidArgument,
                ..
            }
        ),
        "{r:?}"
    );
    // An oversized length.
    s.write_all(&[0x7f, 0xff, 0xff, 0xff, 1, 0, 0, 0, 1])
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(
        matches!(
            r,
            Response::Error {
                kind: RemoteErrorKind::Protocol,
                ..
            }
        ),
        "{r:?}"
    );
    drop(s);

    // 2. Truncated: hello, then half a frame, then hang up.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let _ = raw_read_response(&mut s).unwrap();
    let ping = Frame::control(1, &Request::Ping {})
        .unwrap()
        .encode()
        .unwrap();
    s.write_all(&ping[..ping.len() - 3]).unwrap();
    drop(s);
    // Let the agent see this hang-up before the next connection replaces it.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // 3. Garbage without any sync marker, then hang up.
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&[0xAB; 10_000]).unwrap();
    drop(s);

    // The agent survived and serves a new connection.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(agent.alive());
    let c = agent.client().await;
    assert!(c.exec_collect(sh("echo ok")).await.unwrap().stdout == b"ok\n");
    let log = agent.log();
    assert!(log.contains("protocol error"), "{log}");
    assert!(log.contains("ended inside a frame"), "{log}");
}

#[tokio::test]
async fn version_mismatch() {
    // Raw: an old/new host talking to this agent.
    let mut agent = Agent::start();
    let _ = agent.client().await;
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(99)).unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert_eq!(
        r,
        Response::VersionMismatch {
            nonce: 77,
            host_version: 99,
            agent_version: strata_proto::PROTOCOL_VERSION
        }
    );
    drop(s);
    assert!(agent.alive());

    // Client: this host talking to an agent that speaks another version.
    let mut other = Agent::start_with(&["--pretend-protocol-version", "2"]);
    let t = Instant::now();
    let e = AgentClient::connect_unix(&other.sock, Duration::from_secs(10))
        .await
        .unwrap_err();
    assert!(
        matches!(e, AgentError::VersionMismatch { host: 1, agent: 2 }),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(other.alive());
}

#[tokio::test]
async fn connect_waits_for_late_agent_and_times_out() {
    let dir = tempfile::Builder::new()
        .prefix("strata-agent-test-")
        .tempdir_in("/tmp")
        .unwrap();
    let sock = dir.path().join("never.sock");
    let t = Instant::now();
    let e = AgentClient::connect_unix(&sock, Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(e, AgentError::ConnectTimeout(_)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));

    // A listener that accepts but never answers (QEMU before the guest agent runs).
    let silent = dir.path().join("silent.sock");
    let _l = std::os::unix::net::UnixListener::bind(&silent).unwrap();
    let e = AgentClient::connect_unix(&silent, Duration::from_millis(700))
        .await
        .unwrap_err();
    assert!(matches!(e, AgentError::ConnectTimeout(_)), "{e}");

    // Agent started after the client began connecting.
    let sock2 = dir.path().join("late.sock");
    let sock2c = sock2.clone();
    let connecting =
        tokio::spawn(
            async move { AgentClient::connect_unix(&sock2c, Duration::from_secs(10)).await },
        );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata-agent"))
        .arg("--listen-unix")
        .arg(&sock2)
        .arg("--dry-system")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let c = connecting.await.unwrap().unwrap();
    assert!(c.ping().await.is_ok());
    drop(c);
    child.kill().unwrap();
    child.wait().unwrap();
}

#[tokio::test]
async fn disconnect_mid_exec_then_reconnect() {
    let mut agent = Agent::start();
    let marker = agent.path("marker");
    let c = agent.client().await;
    let mut h = c
        .exec(sh(&format!(
            "echo started; sleep 1; echo done > {marker}; sleep 1"
        )))
        .await
        .unwrap();
    let Some(Ok(ExecEvent::Started { pid })) = h.next_event().await else {
        panic!()
    };
    let Some(Ok(ExecEvent::Stdout(_))) = h.next_event().await else {
        panic!()
    };
    // Second clone observes the loss too.
    let c2 = c.clone();
    drop(h);
    drop(c);
    drop(c2); // all clones gone: connection closed.

    let c = agent.client().await;
    // The command kept running across the disconnect.
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    let out = c.exec_collect(sh("echo again")).await.unwrap();
    assert_eq!(out.stdout, b"again\n");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "done\n");

    // In-flight requests fail with Closed when the agent goes away.
    let mut h = c.exec(sh("sleep 30")).await.unwrap();
    let _ = h.next_event().await; // Started
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), h.next_event())
        .await
        .unwrap();
    assert!(matches!(ev, Some(Err(AgentError::Closed))), "{ev:?}");
    assert!(c.is_closed());
    assert!(matches!(c.ping().await, Err(AgentError::Closed)));
}

#[tokio::test]
async fn new_connection_replaces_old_session() {
    let agent = Agent::start();
    let c1 = agent.client().await;
    let c2 = agent.client().await;
    // The first connection was replaced by the second.
    let r = tokio::time::timeout(Duration::from_secs(5), c1.ping())
        .await
        .unwrap();
    assert!(r.is_err());
    assert!(c2.ping().await.is_ok());
}

#[tokio::test]
async fn restore_sync_dry_run() {
    let agent = Agent::start();
    let c = agent.client().await;
    c.restore_sync(RestoreSync {
        entropy: vec![0x5a; 64],
        unix_time_ns: 1_700_000_000_000_000_000,
        hostname: Some("fork-2".into()),
        machine_id: Some("0123456789abcdef0123456789abcdef".into()),
    })
    .await
    .unwrap();
    let e = c
        .restore_sync(RestoreSync {
            entropy: vec![1; 8],
            unix_time_ns: 1,
            hostname: None,
            machine_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    let log = agent.log();
    assert!(
        log.contains("dry-system: add_entropy") && log.contains("bytes=64"),
        "{log}"
    );
    assert!(
        log.contains("dry-system: set_hostname") && log.contains("fork-2"),
        "{log}"
    );
    assert!(log.contains("1700000000000000000"), "{log}");
}

#[tokio::test]
async fn upload_to_full_disk_is_no_space_and_leaves_nothing() {
    // Needs root to mount a small tmpfs; skipped (with a message) otherwise.
    let agent = Agent::start();
    let mnt = agent.dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP: cannot mount tmpfs (not root?)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(mnt.clone());
    let c = agent.client().await;
    let data = vec![7u8; 4 * 1024 * 1024];
    let dest = format!("{}/big", mnt.display());
    let e = c.write_file(&dest, None, &data[..]).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NoSpace), "{e}");
    assert!(
        std::fs::read_dir(&mnt).unwrap().next().is_none(),
        "partial file left"
    );
    // The connection is still usable.
    assert!(c.ping().await.is_ok());
    drop(c);
    wait_dir_empty(&mnt);
}

fn wait_dir_empty(p: &Path) {
    let _ = std::fs::read_dir(p);
}

#[tokio::test]
async fn bench_exec_round_trip() {
    let agent = Agent::start();
    let c = agent.client().await;
    let mut samples = Vec::with_capacity(200);
    for _ in 0..200 {
        let t = Instant::now();
        let out = c.exec_collect(ExecRequest::argv(["true"])).await.unwrap();
        samples.push(t.elapsed());
        assert!(out.status.success());
    }
    samples.sort();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!(
        "BENCH exec `true` round trip over unix socket: p50 {:?} p99 {:?} max {:?}",
        p(0.50),
        p(0.99),
        samples[199]
    );
    let t = Instant::now();
    for _ in 0..200 {
        c.ping().await.unwrap();
    }
    println!("BENCH ping round trip: mean {:?}", t.elapsed() / 200);
}

#[tokio::test]
async fn stale_partial_frame_is_skipped_on_rehello() {
    // The agent missed a disconnect (virtio-serial reconnect between polls):
    // a fragment of the old host's frame sits in its buffer, and the new
    // host's Hello bytes land inside it. Re-sent Hellos must still get through.
    let agent = Agent::start();
    let _ = agent.client().await;
    let mut s = StdUnixStream::connect(&agent.sock).unwrap();
    s.write_all(&raw_hello(strata_proto::PROTOCOL_VERSION))
        .unwrap();
    let (_, r) = raw_read_response(&mut s).unwrap();
    assert!(matches!(r, Response::HelloOk { nonce: 77, .. }));
    s.write_all(&[0, 0, 0x10, 0, 1, 0, 0, 0, 3]).unwrap(); // header of a 4 KiB frame, no body
    let mut hello = SYNC_MAGIC.to_vec();
    hello.extend_from_slice(
        &Frame::control(
            0,
            &Request::Hello {
                version: strata_proto::PROTOCOL_VERSION,
                nonce: 78,
            },
        )
        .unwrap()
        .encode()
        .unwrap(),
    );
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let got = 'outer: loop {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no reply to the re-sent hello"
        );
        s.write_all(&hello).unwrap();
        if let Ok(n) = s.read(&mut tmp) {
            buf.extend_from_slice(&tmp[..n]);
        }
        let mut off = 0;
        while let Ok(Some((item, used))) = decode_frame(&buf[off..]) {
            off += used;
            if let Decoded::Frame(f) = item {
                if let Ok(Response::HelloOk { nonce: 78, .. }) = f.parse::<Response>() {
                    break 'outer t.elapsed();
                }
            }
        }
        buf.drain(..off);
    };
    println!("resynchronised after {got:?}");
}
