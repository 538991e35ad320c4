//! The MCP gateway from inside a real guest (`docs/mcp.md`).
//!
//! A real `stratad`; the tenant's policy declares two `mcp` connectors
//! standing in for Slack (a FastMCP server from the `mcp` package on PyPI):
//! `slack`, a streamable-HTTP server on the host under the connector's
//! write block, and `slack-stdio`, the same server run by the daemon as a
//! stdio server, with an approve rule on `post_message`. The guest gets the
//! `mcp` SDK as a packed site-packages, unpacked into the guest's
//! `dist-packages` (the guest is Debian 12 with the host's python 3.11;
//! scripts/mcp-venv.sh makes the host venv once), and
//! runs `guest_flow.py`, which reaches the gateway through the proxy its
//! environment names (`HTTP_PROXY`), like any agent.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../strata-policy/tests/mcp")
}

fn python() -> String {
    let out = std::process::Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mcp-venv.sh"))
        .output()
        .expect("mcp-venv.sh");
    assert!(
        out.status.success(),
        "mcp-venv.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The stdio server's token: a connector secret, never in the guest.
const SLACK_TOKEN: &str = "xoxb-brokered-7f3a9c";

fn lines(p: &Path) -> usize {
    std::fs::read_to_string(p)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_mcp_sdk_through_the_gateway() {
    let py = python();
    let scratch = tempfile::Builder::new()
        .prefix("stratad-e2e-mcp-")
        .tempdir_in("/tmp")
        .expect("scratch");
    let http_count = scratch.path().join("http-count");
    let stdio_count = scratch.path().join("stdio-count");
    let site = scratch.path().join("site.tgz");
    let st = std::process::Command::new(&py)
        .arg(fixtures().join("pack_site.py"))
        .arg(&site)
        .status()
        .expect("pack");
    assert!(st.success());
    // The HTTP stand-in on the host.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let mut server = std::process::Command::new(&py)
        .arg(fixtures().join("slack_server.py"))
        .arg("http")
        .arg(port.to_string())
        .env("COUNT_FILE", &http_count)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("server");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
        if let Ok(Some(s)) = server.try_wait() {
            panic!("server exited: {s}");
        }
    }
    let _server = Kill(server);

    // The stand-ins are on loopback and one is a host command, declared by
    // the tenant's policy: both allowed here (off by default).
    let d = Daemon::start("[security]\nmcp_tenant_stdio = true\nmcp_tenant_private_urls = true\n");
    d.wait_template().await;
    let policy = format!(
        r#"default = "allow"

[[connector]]
name = "slack"
kind = "mcp"
url = "http://127.0.0.1:{port}/mcp"
headers = {{ Authorization = "Bearer xoxb-host-only" }}
read_only = true
[[connector.tool]]
name = "search"
read_only = true

[[connector]]
name = "slack-stdio"
kind = "mcp"
command = ["{py}", "{server}", "stdio"]
env = {{ COUNT_FILE = "{count}", SLACK_TOKEN = "strata:secret/slack-bot" }}
[[connector.tool]]
name = "search"
read_only = true

[[rule]]
id = "no-deletes"
effect = "deny"
kind = "mcp"
tool = "delete_*"

[[rule]]
id = "posts-need-ok"
effect = "approve"
kind = "mcp"
connector = "slack-stdio"
tool = "post_message"
"#,
        server = fixtures().join("slack_server.py").display(),
        count = stdio_count.display(),
    );
    let (s, body) = d.raw("PUT", "/v1/policy", policy.into_bytes()).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    // The stdio server's token is a connector secret: the policy names it
    // (`strata:secret/slack-bot`), the daemon holds the sealed value.
    d.ok(
        "POST",
        "/v1/secrets",
        Some(json!({
            "name": "slack-bot",
            "connector": "slack-stdio",
            "rule": { "type": "bearer" },
            "value": SLACK_TOKEN,
        })),
        201,
    )
    .await;

    let sb = d.create(json!({})).await;
    let (s, body) = d
        .raw(
            "PUT",
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/site.tgz"),
            std::fs::read(&site).expect("site"),
        )
        .await;
    assert!(
        s == 200 || s == 201,
        "{s} {}",
        String::from_utf8_lossy(&body)
    );
    let flow = std::fs::read(fixtures().join("guest_flow.py")).expect("flow");
    let (s, _) = d
        .raw(
            "PUT",
            &format!("/v1/sandboxes/{sb}/files?path=/tmp/guest_flow.py"),
            flow,
        )
        .await;
    assert!(s == 200 || s == 201);
    let e = d
        .sh(
            &sb,
            "d=/usr/local/lib/python3.11/dist-packages && mkdir -p $d && tar -xzf /tmp/site.tgz -C $d",
        )
        .await;
    assert_eq!(e.code, Some(0), "{}", String::from_utf8_lossy(&e.stderr));

    let run = d.exec_body(&sb, json!({ "cmd": ["python3", "/tmp/guest_flow.py"] }));
    tokio::pin!(run);
    let wait_approval = async {
        let t = Instant::now();
        loop {
            let v = d.ok("GET", "/v1/approvals", None, 200).await;
            let items = v["items"].as_array().cloned().unwrap_or_default();
            if let Some(i) = items.into_iter().find(|i| i["sandbox"] == sb.as_str()) {
                break i;
            }
            assert!(
                t.elapsed() < Duration::from_secs(240),
                "no approval appeared: {v}\n{}",
                d.logs()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    let item = tokio::select! {
        e = &mut run => panic!(
            "the flow ended before any approval: {}\n{}\n{}",
            e.out(),
            String::from_utf8_lossy(&e.stderr),
            d.logs()
        ),
        item = wait_approval => item,
    };
    // Held: it has not run; progress flows meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(lines(&stdio_count), 0, "ran before approval");
    let id = item["id"].as_str().expect("approval id").to_owned();
    d.ok("POST", &format!("/v1/approvals/{id}/approve"), None, 200)
        .await;
    let e = run.await;
    assert_eq!(
        e.code,
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&e.stderr),
        d.logs()
    );
    let v: Value = serde_json::from_str(e.out().trim()).expect("flow output");
    // The approver saw the tool and its arguments.
    assert_eq!(item["call"]["kind"]["kind"], "mcp", "{item}");
    assert_eq!(item["call"]["kind"]["tool"], "post_message", "{item}");
    assert!(
        item["call"]["kind"]["arguments"]
            .as_str()
            .is_some_and(|a| a.contains("approved-1")),
        "{item}"
    );
    // HTTP server: the denied tool hidden, the read tool runs, the write
    // block refuses post_message with an MCP error, and it never ran.
    // (post_message is refused by the write block whatever its arguments,
    // so it is not listed either.)
    assert_eq!(v["http_tools"], json!(["search"]), "{v}");
    assert_eq!(v["http_search"]["text"][0], "found: guest", "{v}");
    assert_eq!(v["http_post"]["error"]["code"], -32001, "{v}");
    assert_eq!(
        v["http_post"]["error"]["data"]["rule"], "connector:slack:read-only",
        "{v}"
    );
    assert_eq!(lines(&http_count), 0);
    // Stdio server run by the daemon: read tool runs; the held call ran
    // once after approval, with progress while it waited.
    assert_eq!(v["stdio_tools"], json!(["search", "post_message"]), "{v}");
    assert_eq!(v["stdio_search"]["text"][0], "found: guest", "{v}");
    assert_eq!(v["stdio_post"]["text"][0], "posted to general", "{v}");
    assert!(
        v["stdio_progress"]
            .as_array()
            .is_some_and(|p| !p.is_empty()),
        "{v}"
    );
    assert_eq!(lines(&stdio_count), 1, "must run exactly once");
    // The stdio server was started with the secret's value in its
    // environment (a digest of it is in its record), not the placeholder.
    let record = std::fs::read_to_string(&stdio_count).expect("count file");
    let want = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(SLACK_TOKEN.as_bytes()))[..16].to_owned()
    };
    assert_eq!(
        record.trim_end().rsplit('\t').next(),
        Some(want.as_str()),
        "{record}"
    );
    // The guest never held the connector's credential.
    let e = d
        .sh(
            &sb,
            &format!("grep -rlE 'xoxb-host-only|{SLACK_TOKEN}' /tmp /usr/local /root 2>/dev/null | head -1"),
        )
        .await;
    assert_eq!(e.out().trim(), "", "credential found in the guest");

    // Deleting the sandbox stops its stdio servers.
    d.ok("DELETE", &format!("/v1/sandboxes/{sb}"), None, 200)
        .await;
}
