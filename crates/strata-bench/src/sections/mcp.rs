//! Section `mcp` (opt-in: `strata-bench --only mcp`; seconds, no VMs): what
//! the MCP gateway (docs/mcp.md) costs per `tools/call`, beside a call
//! straight to the same server, in the same run.
//!
//! All on this host: a FastMCP server (the `mcp` package from PyPI, made
//! once by scripts/mcp-venv.sh) serves streamable HTTP with a `search` tool;
//! the egress proxy of one sandbox ([`strata_policy::proxy::EgressProxy`],
//! the code the daemon serves each guest's tunnels with) carries its MCP
//! gateway with an `mcp` connector for it (`search` read-only in the
//! catalog, a write block, an allow rule, audit to a file). Each sample is
//! one `tools/call` POST on a new connection and its whole answer (the
//! server's SSE stream), directly or through the proxy's
//! `http://mcp.strata.internal/bench/mcp`; interleaved.
//!
//! Not included: the guest's side of the tunnel, which every egress byte
//! pays.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::json;
use strata_policy::audit::AuditLog;
use strata_policy::proxy::mcp::{McpGateway, McpLimits};
use strata_policy::proxy::{EgressProxy, ProxyConfig, SharedPolicy};
use strata_policy::{Policy, PolicySet};

use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples};

/// Flags of the `mcp` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "mcp-args")]
pub struct Args {
    /// `tools/call`s per case.
    #[arg(id = "mcp-n", long = "mcp-n", default_value_t = 300)]
    pub n: usize,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.n = self.n.min(20);
    }
}

const SERVER: &str = r#"
import sys
from mcp.server.fastmcp import FastMCP
mcp = FastMCP("bench", host="127.0.0.1", port=int(sys.argv[1]), stateless_http=True)

@mcp.tool()
def search(query: str) -> str:
    return "found: " + query

mcp.run("streamable-http")
"#;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python() -> Result<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mcp-venv.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("mcp-venv.sh: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

async fn call(c: &reqwest::Client, url: &str, i: usize) -> Result<()> {
    let body = json!({"jsonrpc": "2.0", "id": i, "method": "tools/call",
        "params": {"name": "search", "arguments": {"query": format!("q{i}")}}});
    let r = c
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(&body)
        .send()
        .await?;
    let st = r.status();
    let text = r.text().await?;
    if !st.is_success() || !text.contains(&format!("found: q{i}")) {
        bail!("tools/call answered {st}: {text}");
    }
    Ok(())
}

/// Runs the section.
pub async fn run(_ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let py = python()?;
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let _server = Child(
        std::process::Command::new(&py)
            .arg("-c")
            .arg(SERVER)
            .arg(port.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting the FastMCP server")?,
    );
    let t0 = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("the FastMCP server did not start");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let tenant = Policy::parse(&format!(
        "default = \"deny\"\n[[connector]]\nname = \"bench\"\nkind = \"mcp\"\nurl = \"http://127.0.0.1:{port}/mcp\"\nread_only = true\n[[connector.tool]]\nname = \"search\"\nread_only = true\n[[rule]]\neffect = \"allow\"\nkind = \"mcp\"\nconnector = \"bench\"\n"
    ))?;
    let set = PolicySet::new(None, Some(Arc::new(tenant)), None)?;
    let mut cfg = ProxyConfig::new("bench", Some("sb-bench"), Arc::new(SharedPolicy::new(set)));
    cfg.host = strata_policy::proxy::HostTunnels::new(strata_policy::proxy::TunnelLimits {
        rate: 0.0,
        ..Default::default()
    });
    cfg.audit = Some(Arc::new(AuditLog::open(&dir.path().join("audit.jsonl"))?));
    // The server is on loopback: allowed to this (tenant-layer) connector.
    cfg.mcp = Some(McpGateway::new(McpLimits {
        tenant_private_urls: true,
        ..McpLimits::default()
    }));
    let proxy = EgressProxy::bind("127.0.0.1:0".parse()?, cfg).await?;
    let direct = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()?;
    let via = reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!(
            "http://{}",
            proxy.local_addr()
        ))?)
        .pool_max_idle_per_host(0)
        .build()?;
    let direct_url = format!("http://127.0.0.1:{port}/mcp");
    let gw_url = "http://mcp.strata.internal/bench/mcp";
    // Warm both paths.
    call(&direct, &direct_url, 0).await.context("direct")?;
    call(&via, gw_url, 0).await.context("through the gateway")?;
    let (mut d, mut g) = (Samples::new(), Samples::new());
    for i in 1..=args.n.max(1) {
        let t = Instant::now();
        call(&direct, &direct_url, i).await?;
        d.push_dur(t.elapsed());
        let t = Instant::now();
        call(&via, gw_url, i).await?;
        g.push_dur(t.elapsed());
    }
    let (ds, gs) = (d.summary(), g.summary());
    if ds.p50 <= 0.0 {
        return Err(anyhow!("no samples"));
    }
    let mut t = Table::latency(
        "One MCP tools/call and its answer on a new connection, host only (no guest), interleaved",
        &["ratio (p50)"],
    );
    t.latency_row("direct to the FastMCP server", &ds, vec![String::new()]);
    t.latency_row(
        "through the gateway (policy, audit)",
        &gs,
        vec![format!("{:.2}×", gs.p50 / ds.p50)],
    );
    sec.table(t);
    sec.headline(format!(
        "The MCP gateway adds {} (p50) / {} (p99) per tools/call ({:.2}× direct at p50)",
        fmt_ms(gs.p50 - ds.p50),
        fmt_ms(gs.p99 - ds.p99),
        gs.p50 / ds.p50
    ));
    sec.text(
        "Through the gateway a call pays the proxy hop, the JSON-RPC read and bounds, the policy decision, an audit entry and the gateway's own upstream connection, and the answer is re-framed as SSE. The server is Python; its own time dominates both cases. Figures from a debug build are several times a release build's.",
    );
    Ok(())
}
