//! The egress proxy's guest side: whatever bytes a guest program writes to
//! its proxy (`http_proxy`, or raw TLS without `CONNECT`) go through the
//! whole proxy — the sniff of the first bytes (TLS ClientHello or HTTP), the
//! raw request-head checks, hyper's request parsing, `CONNECT` and its
//! tunnel's first bytes, the policy decision and the refusal answers — on an
//! in-memory stream. Nothing resolves (no upstream is ever dialled), so every
//! allowed request ends in a refusal from the proxy itself.
//!
//! Checked: no panic; the proxy ends the stream on its own within its
//! timeouts once the guest has finished writing; what it answers is empty or
//! an HTTP/1.x response; and the stream's place under the host's caps is
//! given back when it ends.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use strata_policy::proxy::{
    Egress, HostTunnels, ProxyConfig, SharedPolicy, StaticResolver, TunnelLimits,
};
use strata_policy::{Policy, PolicySet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PLATFORM: &str = r#"
default = "deny"

[[connector]]
name = "salesforce"
hosts = ["api.salesforce.test"]
read_only = true

[[connector]]
name = "slack"
hosts = ["slack.test", "*.slack.test"]
"#;

const TENANT: &str = r#"
default = "deny"

[[rule]]
effect = "allow"
connector = "salesforce"
access = "read"

[[rule]]
effect = "approve"
connector = "slack"
method = "POST"

[[rule]]
effect = "allow"
connector = "slack"
"#;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

fn policy() -> Arc<SharedPolicy> {
    static P: OnceLock<Arc<SharedPolicy>> = OnceLock::new();
    P.get_or_init(|| {
        let parse = |t: &str| Some(Arc::new(Policy::parse(t).expect("fixture policy")));
        let set = PolicySet::new(parse(PLATFORM), parse(TENANT), None).expect("fixture set");
        Arc::new(SharedPolicy::new(set))
    })
    .clone()
}

/// A fresh proxy per input: its caps and open-rate bucket start full, so
/// one input never sees another's streams.
fn egress() -> Arc<Egress> {
    let mut cfg = ProxyConfig::new("t", Some("sb-fuzz"), policy());
    cfg.resolver = Arc::new(StaticResolver(HashMap::new()));
    cfg.host = HostTunnels::new(TunnelLimits::default());
    // Short, so an input that stops mid-head ends quickly.
    cfg.head_timeout = Duration::from_millis(50);
    cfg.connect_timeout = Duration::from_millis(50);
    cfg.tunnel_idle_timeout = Duration::from_millis(100);
    cfg.approval_timeout = Duration::from_millis(10);
    Egress::new(cfg)
}

fuzz_target!(|data: &[u8]| {
    runtime().block_on(async {
        let eg = egress();
        let Ok(tunnel) = eg.admit() else {
            panic!("a stream refused while none is open: {:?}", eg.stats());
        };
        let (guest, proxy_side) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(eg.clone().serve(tunnel, proxy_side));
        let (mut rd, mut wr) = tokio::io::split(guest);
        let mut out = Vec::new();
        // Write and read at once: the proxy may answer (and stop reading)
        // before the guest has written everything.
        let write = async {
            let _ = guest_write(&mut wr, data).await;
        };
        let (_, read) = tokio::join!(write, async {
            tokio::time::timeout(Duration::from_secs(5), read_all(&mut rd, &mut out)).await
        });
        drop((rd, wr));
        assert!(read.is_ok(), "the proxy kept the stream open 5 s after the guest finished");
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("the proxy's task ends once the guest is gone")
            .expect("the proxy's task does not panic");
        assert!(
            out.is_empty() || out.starts_with(b"HTTP/1."),
            "answer is not HTTP: {:?}",
            String::from_utf8_lossy(&out[..out.len().min(64)])
        );
        let stats = eg.stats();
        assert_eq!(stats.open, 0, "a stream's place was not given back: {stats:?}");
    });
});

async fn guest_write(
    g: &mut tokio::io::WriteHalf<tokio::io::DuplexStream>,
    data: &[u8],
) -> std::io::Result<()> {
    // Not the whole input at once when the proxy stops reading: bounded.
    for chunk in data.chunks(4096) {
        tokio::time::timeout(Duration::from_millis(500), g.write_all(chunk))
            .await
            .map_err(|_| std::io::Error::other("proxy stopped reading"))??;
    }
    g.shutdown().await
}

async fn read_all(g: &mut tokio::io::ReadHalf<tokio::io::DuplexStream>, out: &mut Vec<u8>) {
    let mut buf = [0u8; 4096];
    loop {
        match g.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if out.len() < 1 << 20 {
                    out.extend_from_slice(&buf[..n]);
                }
            }
        }
    }
}
