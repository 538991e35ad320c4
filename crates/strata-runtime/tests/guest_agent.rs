//! The guest agent inside a real guest (TCG, the image strata builds): exec,
//! signals, stdin, env/cwd, timeouts that kill a process tree, concurrency,
//! streaming, a 100 MiB file round trip, and the error cases. One template
//! boot per test binary; the sandbox is a fork of it.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use strata_core::SandboxSize;
use strata_proto::client::{AgentClient, ExecEvent, ExecRequest, Stdin};
use strata_proto::msg::RemoteErrorKind;

mod common;

use common::{sandbox_agent, tokio_rt, TestRuntime};

struct Fixture {
    agent: AgentClient,
    _t: TestRuntime,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let size = SandboxSize {
            vcpus: 1,
            memory_mib: 512,
            disk_gib: 2,
        };
        let t = TestRuntime::start("strga-", size, |_| {});
        let agent = sandbox_agent(&t);
        Fixture { agent, _t: t }
    })
}

fn shell(s: &str) -> ExecRequest {
    ExecRequest::shell(s)
}

#[test]
fn echo_exit_codes_signals_stderr_stdin_env_cwd() {
    let a = &fixture().agent;
    tokio_rt().block_on(async {
        let out = a
            .exec_collect(ExecRequest::argv(["echo", "hello"]))
            .await
            .unwrap();
        assert_eq!(out.stdout, b"hello\n");
        assert_eq!(out.status.code, Some(0));

        let out = a.exec_collect(shell("exit 42")).await.unwrap();
        assert_eq!(out.status.code, Some(42));

        let out = a.exec_collect(shell("kill -TERM $$")).await.unwrap();
        assert_eq!(out.status.signal, Some(15));
        assert_eq!(out.status.code, None);

        let out = a
            .exec_collect(shell("echo out; echo err >&2"))
            .await
            .unwrap();
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");

        let mut req = ExecRequest::argv(["cat"]);
        req.stdin = Stdin::Bytes(b"from stdin".to_vec());
        let out = a.exec_collect(req).await.unwrap();
        assert_eq!(out.stdout, b"from stdin");

        let mut req = shell("echo $GREETING; pwd");
        req.env = BTreeMap::from([("GREETING".to_owned(), "hi".to_owned())]);
        req.cwd = Some("/tmp".into());
        let out = a.exec_collect(req).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n/tmp\n");

        let mut req = ExecRequest::argv(["id", "-u"]);
        req.user = Some("user".into());
        let out = a.exec_collect(req).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1000");
    });
}

#[test]
fn timeout_kills_the_whole_process_tree() {
    let a = &fixture().agent;
    tokio_rt().block_on(async {
        let mut req = shell("sleep 1000 & sleep 1000");
        req.timeout = Some(Duration::from_secs(2));
        let t = Instant::now();
        let out = a.exec_collect(req).await.unwrap();
        assert!(out.status.timed_out, "{:?}", out.status);
        assert!(t.elapsed() < Duration::from_secs(30));
        let left = a
            .exec_collect(shell("ps -eo args | grep -c '^sleep 1000' || true"))
            .await
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&left.stdout).trim(),
            "0",
            "no sleep left"
        );
    });
}

#[test]
fn twenty_concurrent_commands_and_streaming() {
    let a = &fixture().agent;
    tokio_rt().block_on(async {
        let mut tasks = Vec::new();
        for i in 0..20 {
            let a = a.clone();
            tasks.push(tokio::spawn(async move {
                let out = a
                    .exec_collect(ExecRequest::shell(format!("sleep 0.5; echo {i}")))
                    .await
                    .unwrap();
                assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), i.to_string());
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // The first chunk arrives while the command still runs.
        let mut h = a
            .exec(shell("echo first; sleep 3; echo second"))
            .await
            .unwrap();
        let t = Instant::now();
        let first_at = loop {
            match h.next_event().await.expect("event").expect("ok") {
                ExecEvent::Stdout(b) => {
                    assert_eq!(&b[..], b"first\n");
                    break t.elapsed();
                }
                ExecEvent::Exit(s) => panic!("exited before output: {s:?}"),
                _ => {}
            }
        };
        let mut exited_at = None;
        while let Some(ev) = h.next_event().await {
            if let ExecEvent::Exit(_) = ev.unwrap() {
                exited_at = Some(t.elapsed());
            }
        }
        let exited_at = exited_at.expect("exit");
        assert!(
            exited_at > first_at + Duration::from_secs(2),
            "first chunk at {first_at:?}, exit at {exited_at:?}"
        );
    });
}

#[test]
fn hundred_mib_round_trip_and_file_operations() {
    let a = &fixture().agent;
    tokio_rt().block_on(async {
        let data: Vec<u8> = (0..100usize << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let want = hex::encode(Sha256::digest(&data));
        let n = a
            .write_file("/root/big.bin", Some(0o600), &data[..])
            .await
            .unwrap();
        assert_eq!(n, data.len() as u64);
        let out = a
            .exec_collect(ExecRequest::argv(["sha256sum", "/root/big.bin"]))
            .await
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).starts_with(&want));
        let mut dl = a.read_file("/root/big.bin").await.unwrap();
        let mut h = Sha256::new();
        while let Some(c) = dl.next_chunk().await {
            h.update(c.unwrap());
        }
        assert_eq!(hex::encode(h.finalize()), want);
        let st = a.stat("/root/big.bin").await.unwrap().expect("exists");
        assert_eq!(st.size, data.len() as u64);
        assert_eq!(st.mode & 0o777, 0o600);

        a.mkdir_all("/root/a/b/c", None).await.unwrap();
        let list = a.list_dir("/root/a/b").await.unwrap();
        assert!(list.iter().any(|e| e.name == "c"));
        a.remove("/root/a", true).await.unwrap();
        assert!(a.stat("/root/a").await.unwrap().is_none());
        a.remove("/root/big.bin", false).await.unwrap();
    });
}

#[test]
fn error_cases_are_typed_and_the_agent_survives() {
    let a = &fixture().agent;
    tokio_rt().block_on(async {
        // A command that does not exist.
        let r = a.exec_collect(ExecRequest::argv(["/no/such/program"])).await;
        let e = r.expect_err("missing program");
        assert!(
            matches!(e.remote_kind(), Some(RemoteErrorKind::NotFound | RemoteErrorKind::SpawnFailed)),
            "{e}"
        );
        // A path that does not exist.
        let e = a.read_file("/no/such/file").await.expect_err("missing file");
        assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
        assert!(a.stat("/no/such/file").await.unwrap().is_none());
        // NUL and relative paths.
        let e = a.read_file("/etc/pass\0wd").await.expect_err("NUL");
        assert_eq!(e.remote_kind(), Some(RemoteErrorKind::InvalidArgument), "{e}");
        let e = a.list_dir("relative").await.expect_err("relative");
        assert_eq!(e.remote_kind(), Some(RemoteErrorKind::InvalidArgument), "{e}");
        // A file larger than the free disk space: fill the disk, then upload.
        let out = a
            .exec_collect(shell(
                "fallocate -l $(( $(df --output=avail -B1 / | tail -1) - 8*1024*1024 )) /root/fill && echo ok",
            ))
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok", "{:?}", out);
        let data = vec![7u8; 64 << 20];
        let e = a
            .write_file("/root/too-big.bin", None, &data[..])
            .await
            .expect_err("disk full");
        assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NoSpace), "{e}");
        assert!(a.stat("/root/too-big.bin").await.unwrap().is_none(), "no partial file");
        a.remove("/root/fill", false).await.unwrap();
        // Still serving.
        let out = a.exec_collect(ExecRequest::argv(["echo", "alive"])).await.unwrap();
        assert_eq!(out.stdout, b"alive\n");
    });
}
