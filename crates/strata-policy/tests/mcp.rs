//! The MCP gateway with real parts: the `mcp` Python SDK (PyPI) as the
//! client, reaching the gateway through the egress proxy with `HTTP_PROXY`
//! exactly as a guest does; a FastMCP server standing in for Slack, once as
//! a streamable-HTTP server on the host and once as a stdio server the
//! gateway runs. The venv comes from `scripts/mcp-venv.sh` (made once,
//! cached under /var/cache/strata/venv).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use strata_policy::approval::ApprovalQueue;
use strata_policy::audit::AuditLog;
use strata_policy::call::CallKind;
use strata_policy::proxy::mcp::{McpGateway, McpLimits};
use strata_policy::proxy::{EgressProxy, ProxyConfig, SharedPolicy};
use strata_policy::{Policy, PolicySet};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp")
}

/// The venv's python (made by scripts/mcp-venv.sh when missing).
fn python() -> String {
    let out = std::process::Command::new("bash")
        .arg(root().join("scripts/mcp-venv.sh"))
        .output()
        .unwrap_or_else(|e| panic!("mcp-venv.sh: {e}"));
    assert!(
        out.status.success(),
        "mcp-venv.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn policy_text(py: &str, http_port: u16, count: &Path, extra: &str) -> String {
    let server = fixtures().join("slack_server.py");
    format!(
        r#"
default = "allow"
[[connector]]
name = "slack"
kind = "mcp"
url = "http://127.0.0.1:{http_port}/mcp"
headers = {{ Authorization = "Bearer xoxb-test" }}
{extra}
[[connector.tool]]
name = "search"
read_only = true
[[connector.tool]]
name = "post_message"

[[connector]]
name = "slack-stdio"
kind = "mcp"
command = ["{py}", "{server}", "stdio"]
env = {{ COUNT_FILE = "{count}" }}
{extra}
[[connector.tool]]
name = "search"
read_only = true

[[rule]]
id = "no-deletes"
effect = "deny"
kind = "mcp"
tool = "delete_*"
"#,
        server = server.display(),
        count = count.display(),
    )
}

fn set(text: &str) -> PolicySet {
    let p = Policy::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    PolicySet::new(None, Some(Arc::new(p)), None).unwrap_or_else(|e| panic!("{e}"))
}

async fn client(py: &str, proxy: u16, connector: &str, tool: &str, args: &str) -> Value {
    let out = tokio::process::Command::new(py)
        .arg(fixtures().join("client.py"))
        .arg(format!("http://mcp.strata.internal/{connector}/mcp"))
        .arg(tool)
        .arg(args)
        .env("HTTP_PROXY", format!("http://127.0.0.1:{proxy}"))
        .env("http_proxy", format!("http://127.0.0.1:{proxy}"))
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("client: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "client output {e}: {text}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

const INIT: &str = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;

fn pp2(p: &EgressProxy) -> u16 {
    p.local_addr().port()
}

/// One raw POST through the proxy to the gateway: (status, body).
async fn post(proxy: u16, connector: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", proxy))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let req = format!(
        "POST http://mcp.strata.internal/{connector}/mcp HTTP/1.1\r\nHost: mcp.strata.internal\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

fn lines(p: &Path) -> usize {
    std::fs::read_to_string(p)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_sdk_through_the_gateway_list_call_write_block_and_approval() {
    let py = python();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let http_count = dir.path().join("http-count");
    let stdio_count = dir.path().join("stdio-count");
    // The HTTP stand-in for Slack.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        l.local_addr().map(|a| a.port()).unwrap_or(0)
    };
    let mut server = tokio::process::Command::new(&py)
        .arg(fixtures().join("slack_server.py"))
        .arg("http")
        .arg(port.to_string())
        .env("COUNT_FILE", &http_count)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("server: {e}"));
    let t0 = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let policy = Arc::new(SharedPolicy::new(set(&policy_text(
        &py,
        port,
        &stdio_count,
        "",
    ))));
    let approvals = Arc::new(ApprovalQueue::new());
    let audit_path = dir.path().join("audit.jsonl");
    let mut cfg = ProxyConfig::new("acme", Some("sb1"), policy.clone());
    cfg.approvals = Some(approvals.clone());
    cfg.approval_timeout = Duration::from_secs(60);
    cfg.audit = Some(Arc::new(
        AuditLog::open(&audit_path).unwrap_or_else(|e| panic!("{e}")),
    ));
    // The stand-ins live on loopback and the stdio server is a host
    // command: both allowed to this tenant here (off by default, below).
    let gw = McpGateway::new(McpLimits {
        progress_every: Duration::from_millis(200),
        tenant_stdio: true,
        tenant_private_urls: true,
        ..McpLimits::default()
    });
    cfg.mcp = Some(gw.clone());
    let proxy = EgressProxy::bind("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")), cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let pp = proxy.local_addr().port();

    for conn in ["slack", "slack-stdio"] {
        // 1. The read tool runs; the denied tool is not listed; the
        //    annotations are the catalog's, not the server's claim.
        let v = client(&py, pp, conn, "search", r#"{"query": "q1"}"#).await;
        assert_eq!(
            v["tools"],
            serde_json::json!(["search", "post_message"]),
            "{conn}: {v}"
        );
        assert_eq!(
            v["annotations"]["post_message"]["readOnlyHint"], false,
            "{conn}: {v}"
        );
        assert_eq!(
            v["annotations"]["search"]["readOnlyHint"], true,
            "{conn}: {v}"
        );
        assert_eq!(v["result"]["text"][0], "found: q1", "{conn}: {v}");
        // A direct call of the hidden tool is refused too.
        let v = client(&py, pp, conn, "delete_channel", r#"{"channel": "x"}"#).await;
        assert_eq!(v["error"]["code"], -32001, "{conn}: {v}");
        assert_eq!(v["error"]["data"]["rule"], "no-deletes", "{conn}: {v}");
    }

    // 2. The platform write block: post_message is not read-only in the
    //    catalog, so it is refused with an MCP error and never runs.
    policy.replace(set(&policy_text(
        &py,
        port,
        &stdio_count,
        "read_only = true",
    )));
    for (conn, count) in [("slack", &http_count), ("slack-stdio", &stdio_count)] {
        let v = client(
            &py,
            pp,
            conn,
            "post_message",
            r#"{"channel": "general", "text": "blocked"}"#,
        )
        .await;
        assert_eq!(v["error"]["code"], -32001, "{conn}: {v}");
        assert_eq!(
            v["error"]["data"]["rule"],
            format!("connector:{conn}:read-only"),
            "{conn}: {v}"
        );
        assert_eq!(v["tools"], serde_json::json!(["search"]), "{conn}: {v}");
        assert_eq!(
            lines(count),
            0,
            "{conn}: the refused call reached the server"
        );
        let v = client(&py, pp, conn, "search", r#"{"query": "q2"}"#).await;
        assert_eq!(v["result"]["text"][0], "found: q2", "{conn}: {v}");
    }

    // 3. An approve rule: the call waits (progress reported), is approved,
    //    then runs exactly once.
    let approve = policy_text(&py, port, &stdio_count, "")
        + "\n[[rule]]\nid = \"posts-need-ok\"\neffect = \"approve\"\nkind = \"mcp\"\ntool = \"post_message\"\n";
    policy.replace(set(&approve));
    for (conn, count) in [("slack", &http_count), ("slack-stdio", &stdio_count)] {
        let (py2, conn2) = (py.clone(), conn.to_string());
        let call = tokio::spawn(async move {
            client(
                &py2,
                pp,
                &conn2,
                "post_message",
                r#"{"channel": "general", "text": "hello-arg-7f3a"}"#,
            )
            .await
        });
        let t0 = Instant::now();
        let pending = loop {
            if let Some(p) = approvals.list("acme", true).into_iter().next() {
                break p;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{conn}: no approval request"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // The approver sees the tool and its arguments.
        match &pending.call.kind {
            CallKind::Mcp {
                connector,
                tool,
                arguments,
                ..
            } => {
                assert_eq!((connector.as_str(), tool.as_str()), (conn, "post_message"));
                assert!(
                    arguments
                        .as_deref()
                        .is_some_and(|a| a.contains("hello-arg-7f3a")),
                    "{arguments:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Held: it has not run. Wait long enough for progress to flow.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(lines(count), 0, "{conn}: ran before approval");
        approvals
            .answer("acme", &pending.id, "alice", true)
            .unwrap_or_else(|e| panic!("{e}"));
        let v = call.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v["result"]["text"][0], "posted to general", "{conn}: {v}");
        assert!(
            v["progress"].as_array().is_some_and(|p| !p.is_empty()),
            "{conn}: no progress while held: {v}"
        );
        assert_eq!(lines(count), 1, "{conn}: must run exactly once");
    }

    // 4. Audited with the argument digest, never the arguments.
    let audit = std::fs::read_to_string(&audit_path).unwrap_or_default();
    assert!(audit.contains("\"kind\":\"mcp\""), "{audit}");
    assert!(audit.contains("\"arguments_sha256\":\"sha256:"), "{audit}");
    assert!(audit.contains("posts-need-ok"), "{audit}");
    assert!(
        !audit.contains("hello-arg-7f3a"),
        "arguments leaked to the audit log"
    );
    assert!(!audit.contains("xoxb-test"), "credential in the audit log");

    // Every client ended its session (DELETE): no stdio server is left.
    assert_eq!(gw.running(), 0);
    gw.stop();

    // By default a tenant's connector may neither run a host command nor
    // reach loopback: both refused before anything starts.
    let mut cfg = ProxyConfig::new("acme", Some("sb2"), policy.clone());
    let strict = McpGateway::new(McpLimits::default());
    cfg.mcp = Some(strict.clone());
    let p2 = EgressProxy::bind("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")), cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for conn in ["slack", "slack-stdio"] {
        let (status, body) = post(p2.local_addr().port(), conn, INIT).await;
        assert_eq!(status, 403, "{conn}: {body}");
        assert!(body.contains("mcp_tenant_"), "{conn}: {body}");
    }
    assert_eq!(strict.running(), 0);
    // Hostile input answers a JSON-RPC error, not a crash.
    let (status, body) = post(pp2(&p2), "slack", "[1,2]").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("-32600"), "{body}");
    let _ = server.start_kill();
    let _ = server.wait().await;
}

/// A proxy whose gateway runs `command` as the stdio server of connector
/// `srv` (declared by the platform layer, so no tenant switch is needed).
async fn stdio_proxy(command: &str, limits: McpLimits) -> (EgressProxy, Arc<McpGateway>) {
    let text = format!(
        "default = \"allow\"\n[[connector]]\nname = \"srv\"\nkind = \"mcp\"\ncommand = {command}\n"
    );
    let p = Policy::parse(&text).unwrap_or_else(|e| panic!("{e}"));
    let set = PolicySet::new(Some(Arc::new(p)), None, None).unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = ProxyConfig::new("acme", Some("sb3"), Arc::new(SharedPolicy::new(set)));
    let gw = McpGateway::new(limits);
    cfg.mcp = Some(gw.clone());
    let p = EgressProxy::bind("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")), cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (p, gw)
}

async fn until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdio_servers_are_bounded_in_number_idle_time_and_output() {
    // `cat` echoes each request back: the gateway takes it for a request
    // from the server, refuses it on cat's stdin, and cat's echo of that
    // refusal is the answer. Enough to start sessions.
    let (p, gw) = stdio_proxy(
        r#"["cat"]"#,
        McpLimits {
            sessions_per_connector: 2,
            idle: Duration::from_millis(300),
            ..McpLimits::default()
        },
    )
    .await;
    let port = p.local_addr().port();
    for _ in 0..2 {
        let (status, body) = post(port, "srv", INIT).await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body.to_ascii_lowercase().contains("mcp-session-id"),
            "{body}"
        );
    }
    assert_eq!(gw.running(), 2);
    // A third session is refused under the cap.
    let (status, body) = post(port, "srv", INIT).await;
    assert_eq!(status, 503, "{body}");
    // Idle ones are stopped.
    until("idle stdio servers were not stopped", || gw.running() == 0).await;

    // A server that writes a line over the bound is stopped; the request
    // waiting on it gets an error, not a hang.
    let (p, gw) = stdio_proxy(
        r#"["sh", "-c", "head -c 9000000 /dev/zero | tr '\\0' a; exec sleep 30"]"#,
        McpLimits::default(),
    )
    .await;
    let (status, body) = post(p.local_addr().port(), "srv", INIT).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("-32002"), "{body}");
    until("the over-long server was not stopped", || gw.running() == 0).await;
}
