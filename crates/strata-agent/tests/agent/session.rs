//! Connections: connecting to a late or silent agent, losing and replacing
//! a connection, and the restore sync of a forked VM.

use std::process::Stdio;
use std::time::{Duration, Instant};

use strata_proto::{AgentClient, AgentError, ExecEvent, RemoteErrorKind, RestoreSync};

use crate::support::{sh, Agent};

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
