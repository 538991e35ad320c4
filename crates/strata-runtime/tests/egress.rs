//! Guest egress inside a real guest (TCG, the image strata builds): with
//! `egress_proxy` set, programs in the guest reach the host's proxy through
//! the agent's listener on 127.0.0.1:3128 (tunnelled over virtio-serial),
//! while direct egress stays closed (QEMU user networking with
//! `restrict=on`). The "proxy" is a tiny HTTP server on the host that
//! records the request lines it sees. One template boot per test binary.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use strata_core::SandboxSize;
use strata_proto::client::{AgentClient, ExecOutput, ExecRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const BODY: &str = "hello from the host proxy";

mod common;

use common::{sandbox_agent, tokio_rt, TestRuntime};

struct Fixture {
    agent: AgentClient,
    proxy: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
    _t: TestRuntime,
}

/// A minimal HTTP/1.1 server: records each request's first line (and Host
/// header) and answers `BODY`, then closes.
async fn http_server(seen: Arc<Mutex<Vec<String>>>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let mut lines = text.lines();
                let first = lines.next().unwrap_or_default().to_owned();
                let host = lines
                    .find(|l| l.to_ascii_lowercase().starts_with("host:"))
                    .unwrap_or_default()
                    .to_owned();
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("{first} | {host}"));
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n{BODY}",
                    BODY.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let proxy = tokio_rt().block_on(http_server(seen.clone()));
        let size = SandboxSize {
            vcpus: 1,
            memory_mib: 512,
            disk_gib: 2,
        };
        let t = TestRuntime::start("stregr-", size, |c| c.egress_proxy = Some(proxy));
        let agent = sandbox_agent(&t);
        Fixture {
            agent,
            proxy,
            seen,
            _t: t,
        }
    })
}

/// Runs a shell script in the guest and collects its output.
async fn shell(a: &AgentClient, script: impl Into<String>) -> ExecOutput {
    a.exec_collect(ExecRequest::shell(script))
        .await
        .expect("exec")
}

fn seen(f: &Fixture) -> Vec<String> {
    f.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

#[test]
fn guest_reaches_the_host_proxy_through_the_agent() {
    let f = fixture();
    let a = &f.agent;
    assert_eq!(
        a.egress_listen(),
        Some("127.0.0.1:3128".parse().unwrap()),
        "egress enabled in the restored sandbox"
    );
    tokio_rt().block_on(async {
        let before = seen(f).len();
        let out = shell(a, "curl -s -S -m 30 -x http://127.0.0.1:3128 http://anything.test/hello").await;
        assert_eq!(
            out.status.code,
            Some(0),
            "curl failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), BODY);
        let s = seen(f);
        assert_eq!(s.len(), before + 1, "{s:?}");
        // An absolute-form proxy request, as the policy proxy expects.
        assert_eq!(
            s[before],
            "GET http://anything.test/hello HTTP/1.1 | Host: anything.test"
        );

        // The default environment carries the proxy: plain curl uses it.
        let out = shell(a, "echo \"$http_proxy $https_proxy $no_proxy\"; curl -s -S -m 30 http://other.test/x").await;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("http://127.0.0.1:3128 http://127.0.0.1:3128 localhost,127.0.0.1\n{BODY}"),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s = seen(f);
        assert!(s.last().unwrap().starts_with("GET http://other.test/x HTTP/1.1"), "{s:?}");

        // Several at once.
        let out = shell(a, "for i in 1 2 3 4 5 6; do curl -s -m 60 http://p$i.test/ > /tmp/o$i & done; wait; cat /tmp/o1 /tmp/o2 /tmp/o3 /tmp/o4 /tmp/o5 /tmp/o6").await;
        assert_eq!(String::from_utf8_lossy(&out.stdout), BODY.repeat(6));
    });
}

#[test]
fn direct_egress_stays_closed() {
    let f = fixture();
    let a = &f.agent;
    tokio_rt().block_on(async {
        // 10.0.2.2 is the host under QEMU user networking; restrict=on drops it.
        for url in [
            "http://10.0.2.2/".to_owned(),
            format!("http://10.0.2.2:{}/direct", f.proxy.port()),
        ] {
            let out = shell(
                a,
                format!("curl -s --noproxy '*' --connect-timeout 5 -m 10 {url}"),
            )
            .await;
            assert_ne!(out.status.code, Some(0), "direct {url} must fail");
            assert!(
                out.stdout.is_empty(),
                "{:?}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = seen(f);
        assert!(
            !s.iter()
                .any(|r| r.contains("/direct") || r.contains("10.0.2.2")),
            "the server saw a direct request: {s:?}"
        );
    });
}
