//! Port tunnels, host-only: the real `strata-agent --listen-unix` binary
//! (it connects to `127.0.0.1:<port>` of the machine it runs on, here the
//! host) and the real `AgentClient::connect_port`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::RngCore;
use sha2::{Digest, Sha256};
use strata_proto::client::PortError;
use strata_proto::AgentClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

struct Agent {
    child: Child,
    _dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Self {
        Self::start_bin(PathBuf::from(env!("CARGO_BIN_EXE_strata-agent")))
    }

    fn start_bin(bin: PathBuf) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("strata-agent-ports-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = std::process::Command::new(bin)
            .arg("--listen-unix")
            .arg(&sock)
            .arg("--dry-system")
            .args(["--egress-listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Self {
            child,
            _dir: dir,
            sock,
        }
    }

    async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock, Duration::from_secs(10))
            .await
            .unwrap()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An echo server: copies what it reads back, then shuts down writing.
async fn echo_server() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_port_tunnels_echo_two_mib_each_with_half_close_and_counts() {
    let port = echo_server().await;
    let agent = Agent::start();
    let c = agent.client().await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut data = vec![0u8; 2 << 20];
            rand::thread_rng().fill_bytes(&mut data);
            let s = c.connect_port(port).await.unwrap();
            let counters = s.counters();
            let (mut r, mut w) = tokio::io::split(s);
            let sent = Sha256::digest(&data);
            let writer = tokio::spawn(async move {
                w.write_all(&data).await.unwrap();
                // Half-close: the echo server sees EOF and closes its side.
                w.shutdown().await.unwrap();
                w
            });
            let mut back = Vec::new();
            tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut back))
                .await
                .expect("echo within 60 s")
                .unwrap();
            let _w = writer.await.unwrap();
            assert_eq!(back.len(), 2 << 20);
            assert_eq!(Sha256::digest(&back), sent);
            assert_eq!(counters.to_guest.load(Ordering::SeqCst), 2 << 20);
            assert_eq!(counters.from_guest.load(Ordering::SeqCst), 2 << 20);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Every tunnel left both tables once both sides finished.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while c.open_ports() != 0 || c.open_tunnels() != 0 {
        assert!(tokio::time::Instant::now() < deadline, "tunnels left open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_nobody_listens_on_is_refused_and_the_session_goes_on() {
    // A port that was just free: bind, learn it, close.
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let agent = Agent::start();
    let c = agent.client().await;
    match c.connect_port(free).await {
        Err(PortError::Refused { port, .. }) => assert_eq!(port, free),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(matches!(
        c.connect_port(0).await,
        Err(PortError::InvalidPort(0))
    ));
    assert_eq!(c.open_ports(), 0);
    c.ping().await.unwrap();
    // The next one works on the same connection.
    let port = echo_server().await;
    let mut s = c.connect_port(port).await.unwrap();
    s.write_all(b"hello").await.unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_stream_closes_the_guest_connection() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let agent = Agent::start();
    let c = agent.client().await;
    let s = c.connect_port(port).await.unwrap();
    let (mut guest_side, _) = l.accept().await.unwrap();
    drop(s);
    let mut b = [0u8; 8];
    let n = tokio::time::timeout(Duration::from_secs(10), guest_side.read(&mut b))
        .await
        .expect("closed within 10 s")
        .unwrap_or(0);
    assert_eq!(n, 0);
}

/// The previous release's agent (built and cached by `scripts/previous-release.sh`).
fn previous_agent() -> PathBuf {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = std::process::Command::new("bash")
        .arg(format!("{root}/scripts/previous-release.sh"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/previous-release.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_agent_answers_a_typed_unsupported() {
    let port = echo_server().await;
    let agent = Agent::start_bin(previous_agent());
    let c = agent.client().await;
    match c.connect_port(port).await {
        Err(PortError::Unsupported) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert_eq!(c.open_ports(), 0);
    assert_eq!(c.open_tunnels(), 0);
    // The session goes on.
    c.ping().await.unwrap();
}
