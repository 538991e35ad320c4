//! Section `tls_proxy` (opt-in: `strata-bench --only tls_proxy`): what TLS
//! interception of a connector host (docs/tls-interception.md) costs per
//! HTTPS request, beside a direct TLS connection from the host to the same
//! server, in the same run.
//!
//! All on this host, no guest: a TLS server (leaf of a CA of this run, the
//! daemon's own [`stratad::tls::LeafResolver`]) answers `GET` with `ok`; the
//! egress proxy of one sandbox ([`strata_policy::proxy::EgressProxy`], the
//! code the daemon serves each guest's tunnels with) intercepts its host
//! with leaves from [`stratad::tls::LeafCache`] and verifies the server
//! against the run's CA. Cases, each a GET and its whole answer:
//!
//! - **direct, new connection**: TCP + TLS handshake + request;
//! - **direct, keep-alive**: one more request on an open TLS connection;
//! - **proxy, new connection**: `CONNECT` + TLS with the proxy (leaf from
//!   the cache) + the proxy's policy decision, audit-free, + its TLS to the
//!   server + request;
//! - **proxy, keep-alive**: one more request on an open intercepted
//!   connection (the proxy reuses its upstream connection).
//!
//! Not included: the guest's side of the tunnel (virtio-serial pump), which
//! every egress byte pays with or without interception.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _, Result};
use rustls::pki_types::{CertificateDer, ServerName};
use strata_policy::proxy::{EgressProxy, Interception, ProxyConfig, SharedPolicy, StaticResolver};
use strata_policy::{Policy, PolicySet};
use stratad::tls::{LeafCache, LeafResolver, LocalCa};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::ctx::Ctx;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples, Summary};

/// Flags of the `tls_proxy` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "tls_proxy-args")]
pub struct Args {
    /// Requests per case.
    #[arg(id = "tls-proxy-n", long = "tls-proxy-n", default_value_t = 300)]
    pub n: usize,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.n = self.n.min(30);
    }
}

const HOST: &str = "api.bench.test";

/// A keep-alive HTTP/1.1 server answering every request `ok`.
async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            let r = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok";
            if s.write_all(r).await.is_err() {
                return;
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// One GET on `s`; reads the whole answer (head and `Content-Length` body).
async fn get<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, host: &str) -> Result<()> {
    s.write_all(format!("GET /x HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            if !head.starts_with("http/1.1 200") {
                bail!("answer: {head}");
            }
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return Ok(());
            }
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            bail!("closed mid-answer");
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

struct Bench {
    server: SocketAddr,
    proxy: EgressProxy,
    direct: tokio_rustls::TlsConnector,
    via_proxy: tokio_rustls::TlsConnector,
    _dir: tempfile::TempDir,
}

fn connector(root: CertificateDer<'static>) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(root)?;
    let mut c = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    c.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(c)))
}

fn pem_der(pem: &str) -> Result<CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| anyhow!("CA PEM: {e}"))
}

async fn setup() -> Result<Bench> {
    let dir = tempfile::tempdir()?;
    let up_ca = Arc::new(LocalCa::open_in(
        dir.path(),
        "upstream",
        "bench upstream CA",
    )?);
    let ic_ca = Arc::new(LocalCa::open_in(
        dir.path(),
        "intercept",
        "bench interception CA",
    )?);
    let up_root = pem_der(up_ca.pem())?;
    let ic_root = pem_der(ic_ca.pem())?;
    let sc = stratad::tls::server_config(Arc::new(LeafResolver::new(up_ca, &[HOST.into()])))?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(sc));
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let server = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            let a = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(t) = a.accept(s).await {
                    serve(t).await
                }
            });
        }
    });
    let port = server.port();
    let tenant = Policy::parse(&format!(
        "default = \"deny\"\n[[connector]]\nname = \"bench\"\nhosts = [\"{HOST}\"]\nports = [{port}]\ntls_ports = [{port}]\nread_only = true\n[[rule]]\neffect = \"allow\"\nconnector = \"bench\"\n"
    ))?;
    let set = PolicySet::new(None, Some(Arc::new(tenant)), None)?;
    let mut cfg = ProxyConfig::new("bench", Some("sb-bench"), Arc::new(SharedPolicy::new(set)));
    cfg.resolver = Arc::new(StaticResolver(
        [(HOST.to_string(), IpAddr::V4(Ipv4Addr::LOCALHOST))]
            .into_iter()
            .collect(),
    ));
    cfg.host = strata_policy::proxy::HostTunnels::new(strata_policy::proxy::TunnelLimits {
        rate: 0.0,
        ..Default::default()
    });
    let leaves = Arc::new(LeafCache::new(ic_ca, 16));
    cfg.intercept = Some(Arc::new(Interception::new(
        leaves,
        false,
        vec![up_root.clone()],
    )?));
    let proxy = EgressProxy::bind("127.0.0.1:0".parse()?, cfg).await?;
    Ok(Bench {
        server,
        proxy,
        direct: connector(up_root)?,
        via_proxy: connector(ic_root)?,
        _dir: dir,
    })
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

async fn open_direct(b: &Bench) -> Result<Tls> {
    let s = TcpStream::connect(b.server).await?;
    s.set_nodelay(true)?;
    Ok(b.direct.connect(ServerName::try_from(HOST)?, s).await?)
}

async fn open_proxied(b: &Bench) -> Result<Tls> {
    let mut s = TcpStream::connect(b.proxy.local_addr()).await?;
    s.set_nodelay(true)?;
    let target = format!("{HOST}:{}", b.server.port());
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::new();
    let mut one = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut one).await? == 0 {
            bail!("proxy closed during CONNECT");
        }
        head.push(one[0]);
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT: {}", String::from_utf8_lossy(&head));
    }
    Ok(b.via_proxy.connect(ServerName::try_from(HOST)?, s).await?)
}

/// Runs the section.
pub async fn run(_ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let b = setup()
        .await
        .context("setting up the server and the proxy")?;
    let host = format!("{HOST}:{}", b.server.port());
    let n = args.n.max(1);
    let mut direct_new = Samples::new();
    let mut direct_ka = Samples::new();
    let mut proxy_new = Samples::new();
    let mut proxy_ka = Samples::new();
    // Interleaved, so drift on a shared machine hits every case alike.
    let mut dk = open_direct(&b).await?;
    let mut pk = open_proxied(&b).await?;
    // Warm: the leaf is minted once (cached after), connections settle.
    get(&mut dk, &host).await?;
    get(&mut pk, &host).await?;
    for _ in 0..n {
        let t = Instant::now();
        let mut s = open_direct(&b).await?;
        get(&mut s, &host).await?;
        direct_new.push_dur(t.elapsed());
        let t = Instant::now();
        let mut s = open_proxied(&b).await?;
        get(&mut s, &host).await?;
        proxy_new.push_dur(t.elapsed());
        let t = Instant::now();
        get(&mut dk, &host).await?;
        direct_ka.push_dur(t.elapsed());
        let t = Instant::now();
        get(&mut pk, &host).await?;
        proxy_ka.push_dur(t.elapsed());
    }
    let (dn, dk, pn, pk) = (
        direct_new.summary(),
        direct_ka.summary(),
        proxy_new.summary(),
        proxy_ka.summary(),
    );
    let signed = |ms: f64| {
        if ms < 0.0 {
            format!("−{}", fmt_ms(-ms))
        } else {
            format!("+{}", fmt_ms(ms))
        }
    };
    let over = |p: &Summary, d: &Summary| {
        format!(
            "{} p50 / {} p99",
            signed(p.p50 - d.p50),
            signed(p.p99 - d.p99)
        )
    };
    let mut t = Table::latency(
        "One HTTPS GET and its answer, host only (no guest), interleaved",
        &["proxy overhead"],
    );
    t.latency_row("direct TLS, new connection", &dn, vec![String::new()]);
    t.latency_row("intercepted, new connection", &pn, vec![over(&pn, &dn)]);
    t.latency_row("direct TLS, keep-alive", &dk, vec![String::new()]);
    t.latency_row("intercepted, keep-alive", &pk, vec![over(&pk, &dk)]);
    sec.table(t);
    sec.headline(format!(
        "TLS interception adds {} (p50) per new HTTPS connection and {} per keep-alive request",
        signed(pn.p50 - dn.p50),
        signed(pk.p50 - dk.p50)
    ));
    sec.text(
        "A new intercepted connection pays a CONNECT, a second TLS handshake (the guest's with the proxy; the leaf comes from the cache) and the policy decision; a keep-alive request pays the decision and one more hop. The guest's tunnel is not included. Figures from a debug build are several times a release build's.",
    );
    Ok(())
}
