//! Commands: output, exit codes and signals, stdin, env, cwd and user,
//! timeouts, concurrency, streaming, spawn errors, and the round-trip bench.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use strata_proto::{ExecEvent, ExecRequest, RemoteErrorKind, Stdin};

use crate::support::{group_members, sh, Agent};

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
