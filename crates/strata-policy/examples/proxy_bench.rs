//! Egress proxy overhead per request vs a direct request: p50/p95/p99.
//! Every path opens a fresh connection per request (as the proxy does
//! upstream), to a local hyper server on 127.0.0.1: direct; through the
//! proxy on a loopback TCP listener (`tcp`, how the daemon reached it
//! before); through a stream handed to it in-process (`in-proc`, how the
//! daemon serves a guest tunnel now).
//!
//! `cargo run --release -p strata-policy --example proxy_bench`

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::TokioIo;
use strata_policy::proxy::{
    Egress, EgressProxy, HostTunnels, ProxyConfig, SharedPolicy, StaticResolver, TunnelLimits,
};
use strata_policy::{Policy, PolicySet};
use tokio::net::{TcpListener, TcpStream};

async fn get(addr: SocketAddr, uri: &str, host: &str) -> Duration {
    let t = Instant::now();
    let s = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    request(s, uri, host).await;
    t.elapsed()
}

async fn get_in_process(egress: &Arc<Egress>, uri: &str, host: &str) -> Duration {
    let t = Instant::now();
    let s = egress.open_stream().unwrap_or_else(|e| panic!("{e}"));
    request(s, uri, host).await;
    t.elapsed()
}

async fn request<S>(s: S, uri: &str, host: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(conn);
    let req = hyper::Request::get(uri)
        .header("host", host)
        .body(Empty::<Bytes>::new())
        .unwrap_or_else(|e| panic!("{e}"));
    let resp = tx.send_request(req).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resp.status(), 200);
    let _ = resp.into_body().collect().await;
}

fn report(name: &str, mut v: Vec<Duration>) {
    v.sort_unstable();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize].as_secs_f64() * 1e6;
    println!(
        "{name:8} p50 {:8.1} µs  p95 {:8.1} µs  p99 {:8.1} µs",
        p(0.5),
        p(0.95),
        p(0.99)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let up = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                        Bytes::from_static(b"{\"ok\":true}"),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let port = up.port();
    let platform = format!(
        "[[connector]]\nname = \"sf\"\nhosts = \"api.salesforce.test\"\nports = [{port}]\nread_only = true\n"
    );
    let tenant =
        "default = \"deny\"\n[[rule]]\neffect = \"allow\"\nconnector = \"sf\"\naccess = \"read\"\n";
    let set = PolicySet::new(
        Some(Arc::new(
            Policy::parse(&platform).unwrap_or_else(|e| panic!("{e}")),
        )),
        Some(Arc::new(
            Policy::parse(tenant).unwrap_or_else(|e| panic!("{e}")),
        )),
        None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut cfg = ProxyConfig::new("t", Some("s"), Arc::new(SharedPolicy::new(set)));
    cfg.resolver = Arc::new(StaticResolver(
        [(
            "api.salesforce.test".to_string(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )]
        .into_iter()
        .collect(),
    ));
    cfg.host = HostTunnels::new(TunnelLimits {
        rate: 0.0,
        ..TunnelLimits::default()
    });
    let proxy = EgressProxy::bind("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")), cfg)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let host = format!("api.salesforce.test:{port}");
    let url = format!("http://{host}/services/data");
    let n = 2000;
    let (mut direct, mut proxied) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut in_proc = Vec::with_capacity(n);
    let egress = proxy.egress().clone();
    for i in 0..n + 200 {
        // interleave A/B/C so all see the same machine load
        let d = get(up, "/services/data", &host).await;
        let p = get(proxy.local_addr(), &url, &host).await;
        let q = get_in_process(&egress, &url, &host).await;
        if i >= 200 {
            direct.push(d);
            proxied.push(p);
            in_proc.push(q);
        }
    }
    report("direct", direct.clone());
    report("tcp", proxied.clone());
    report("in-proc", in_proc.clone());
    let mut over: Vec<Duration> = proxied
        .iter()
        .zip(&direct)
        .map(|(p, d)| p.saturating_sub(*d))
        .collect();
    over.sort_unstable();
    report("overhead", over);
}
