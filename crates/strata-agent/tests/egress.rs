//! Egress tunnels, host-only: the real `strata-agent --listen-unix` binary
//! with `--egress-listen 127.0.0.1:0`, the real `AgentClient` serving
//! tunnels to a local TCP server standing in for the egress proxy.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;
use sha2::{Digest, Sha256};
use strata_proto::{AgentClient, ExecRequest, TunnelHandler};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("strata-agent-egress-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_strata-agent"))
            .arg("--listen-unix")
            .arg(&sock)
            .arg("--dry-system")
            .args(["--egress-listen", "127.0.0.1:0"])
            .env("STRATA_AGENT_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Self { child, dir, sock }
    }

    async fn client(&self, egress: Option<SocketAddr>) -> AgentClient {
        AgentClient::connect_unix_with(
            &self.sock,
            Duration::from_secs(10),
            egress.map(TunnelHandler::tcp),
        )
        .await
        .unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP echo server (half-close aware) standing in for the egress proxy.
/// Counts accepted connections and connections that reached end of file.
struct Echo {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
}

async fn echo_server() -> Echo {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicUsize::new(0));
    let (a, e) = (accepted.clone(), ended.clone());
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            let e = e.clone();
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
                e.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Echo {
        addr,
        accepted,
        ended,
    }
}

/// Whether the peer closed `s` (EOF or reset) within `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 16];
    matches!(
        tokio::time::timeout(within, s.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn wait_until(what: &str, within: Duration, f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_tunnels_move_one_mib_each_way() {
    let echo = echo_server().await;
    let agent = Agent::start();
    let c = agent.client(Some(echo.addr)).await;
    let listen = c.egress_listen().expect("egress enabled");
    assert!(listen.ip().is_loopback() && listen.port() != 0, "{listen}");
    assert!(
        agent.log().contains("egress listener bound"),
        "{}",
        agent.log()
    );

    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(tokio::spawn(async move {
            let mut data = vec![0u8; 1 << 20];
            rand::thread_rng().fill_bytes(&mut data);
            let sent_sum = Sha256::digest(&data);
            let s = TcpStream::connect(listen).await.unwrap();
            let (mut r, mut w) = s.into_split();
            let writer = tokio::spawn(async move {
                // Odd-sized writes, so frames do not line up with the buffer.
                for chunk in data.chunks(77_777) {
                    w.write_all(chunk).await.unwrap();
                }
                w.shutdown().await.unwrap();
            });
            let mut got = Vec::new();
            r.read_to_end(&mut got).await.unwrap();
            writer.await.unwrap();
            assert_eq!(got.len(), 1 << 20);
            assert_eq!(Sha256::digest(&got), sent_sum);
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("tunnels finished in time")
            .unwrap();
    }
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 10);
    // Both sides forget finished tunnels.
    wait_until("host tunnels forgotten", Duration::from_secs(5), || {
        c.open_tunnels() == 0
    })
    .await;
    // The connection is still fine for ordinary requests.
    c.ping().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_get_proxy_variables_only_with_egress() {
    let echo = echo_server().await;
    let agent = Agent::start();
    let script = "echo \"$http_proxy|$https_proxy|$HTTP_PROXY|$HTTPS_PROXY|$no_proxy\"";
    let c = agent.client(None).await;
    let out = c.exec_collect(ExecRequest::shell(script)).await.unwrap();
    assert_eq!(out.stdout, b"||||\n");
    drop(c);
    let c = agent.client(Some(echo.addr)).await;
    let listen = c.egress_listen().unwrap();
    let out = c.exec_collect(ExecRequest::shell(script)).await.unwrap();
    let url = format!("http://{listen}");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{url}|{url}|{url}|{url}|localhost,127.0.0.1\n")
    );
    // The request's own env wins.
    let mut req = ExecRequest::shell("echo $http_proxy");
    req.env.insert("http_proxy".into(), "http://mine:1".into());
    let out = c.exec_collect(req).await.unwrap();
    assert_eq!(out.stdout, b"http://mine:1\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_when_the_host_has_not_enabled_egress() {
    let echo = echo_server().await;
    let agent = Agent::start();

    // 1. Host with egress: the listener is bound and tunnels work.
    let c = agent.client(Some(echo.addr)).await;
    let listen = c.egress_listen().unwrap();
    let mut s = TcpStream::connect(listen).await.unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    drop(s);

    // 2. The host goes away: the listener stays, connections are closed at once.
    drop(c);
    wait_until("agent saw the host go", Duration::from_secs(5), || {
        agent.log().contains("host disconnected")
    })
    .await;
    let mut s = TcpStream::connect(listen).await.unwrap();
    let _ = s.write_all(b"hello").await;
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);

    // 3. A host that does not enable egress (an older host): still refused,
    //    and nothing tunnel-related reaches it (its connection stays healthy).
    let old = AgentClient::connect_unix(&agent.sock, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(old.egress_listen().is_none());
    let mut s = TcpStream::connect(listen).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    old.ping().await.unwrap();
    assert!(!old.is_closed());

    // 4. A host that enables egress but has no target refuses each tunnel.
    old.enable_egress().await.unwrap();
    let mut s = TcpStream::connect(listen).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    old.ping().await.unwrap();
    drop(old);

    // 5. A target that refuses connections: the tunnel is refused too.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let c = agent.client(Some(dead)).await;
    let mut s = TcpStream::connect(listen).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    c.ping().await.unwrap();
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 1);
    let log = agent.log();
    assert!(log.contains("not enabled by the current host"), "{log}");
    assert!(log.contains("host refused egress tunnel"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_disconnect_closes_open_tunnels() {
    let echo = echo_server().await;
    let agent = Agent::start();
    let c = agent.client(Some(echo.addr)).await;
    let listen = c.egress_listen().unwrap();
    let mut socks = Vec::new();
    for i in 0..3u8 {
        let mut s = TcpStream::connect(listen).await.unwrap();
        s.write_all(&[i; 10]).await.unwrap();
        let mut b = [0u8; 10];
        s.read_exact(&mut b).await.unwrap();
        assert_eq!(b, [i; 10]);
        socks.push(s);
    }
    assert_eq!(c.open_tunnels(), 3);
    drop(c);
    for s in &mut socks {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "guest side closed"
        );
    }
    // The host side closed its target connections too.
    let ended = echo.ended.clone();
    wait_until("target connections closed", Duration::from_secs(5), || {
        ended.load(Ordering::SeqCst) == 3
    })
    .await;

    // A new host session enables egress again and tunnels work again.
    let c = agent.client(Some(echo.addr)).await;
    assert_eq!(c.egress_listen(), Some(listen));
    let mut s = TcpStream::connect(listen).await.unwrap();
    s.write_all(b"again").await.unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_guest_reader_stalls_only_its_own_tunnel() {
    // The target sends 16 MiB at once; the guest program does not read it
    // for a while. Another tunnel keeps working meanwhile, and in the end
    // every byte arrives intact.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = l.local_addr().unwrap();
    let mut big = vec![0u8; 16 << 20];
    rand::thread_rng().fill_bytes(&mut big);
    let big_sum = Sha256::digest(&big);
    let big = Arc::new(big);
    let b2 = big.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let big = b2.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                s.read_exact(&mut first).await.unwrap();
                if first[0] == b'B' {
                    s.write_all(&big).await.unwrap();
                    s.shutdown().await.unwrap();
                } else {
                    s.write_all(b"small").await.unwrap();
                    s.shutdown().await.unwrap();
                }
            });
        }
    });
    let agent = Agent::start();
    let c = agent.client(Some(target)).await;
    let listen = c.egress_listen().unwrap();
    let mut slow = TcpStream::connect(listen).await.unwrap();
    slow.write_all(b"B").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        let mut s = TcpStream::connect(listen).await.unwrap();
        s.write_all(b"S").await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
            .await
            .expect("small tunnel not stalled")
            .unwrap();
        assert_eq!(got, b"small");
    }
    let mut got = Vec::new();
    slow.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), big.len());
    assert_eq!(Sha256::digest(&got), big_sum);
}
