//! Stage 4, upstream: resolving an allowed host, connecting to it (one host
//! unit per socket, see [`super::tunnel`]) and splicing a tunnel to it.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::tunnel::{Tunnel, UpstreamSlot};

/// Future returned by [`Resolver::resolve`].
pub type ResolveFuture<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Turns an allowed host name into addresses to connect to.
pub trait Resolver: Send + Sync {
    /// Addresses for `host:port`.
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a>;
}

/// The system resolver, refusing answers that point inside (loopback,
/// private, link-local, CGNAT, unique-local, unspecified, multicast): a
/// connector's DNS name must not become a way into the host's networks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

pub(super) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (64..128).contains(&o[1])))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80)
        }
    }
}

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a> {
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
                .await?
                .filter(|a| is_public(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(io::Error::new(io::ErrorKind::NotFound, "no public address"));
            }
            Ok(addrs)
        })
    }
}

/// A fixed host → IP table (tests, or pinning connector hosts).
#[derive(Debug, Default, Clone)]
pub struct StaticResolver(pub std::collections::HashMap<String, IpAddr>);

impl Resolver for StaticResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a> {
        let r = self
            .0
            .get(host)
            .map(|ip| vec![SocketAddr::new(*ip, port)])
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "host not in table"));
        Box::pin(async move { r })
    }
}

/// Why no upstream connection was made.
#[derive(Debug, thiserror::Error)]
pub(super) enum UpstreamError {
    /// The host's cap left no unit for another socket.
    #[error(transparent)]
    Busy(#[from] super::tunnel::Refused),
    /// Resolution or connection failed.
    #[error("{0}")]
    Unreachable(String),
}

/// A connected upstream socket and the host unit it holds.
pub(super) struct Upstream {
    pub(super) sock: TcpStream,
    pub(super) slot: UpstreamSlot,
}

/// Connects to an allowed `host:port` for `tunnel`, trying each resolved
/// address within `timeout`.
pub(super) async fn connect(
    resolver: &dyn Resolver,
    timeout: Duration,
    tunnel: &Tunnel,
    host: &str,
    port: u16,
) -> Result<Upstream, UpstreamError> {
    let slot = tunnel.upstream()?;
    let addrs = resolver
        .resolve(host, port)
        .await
        .map_err(|e| UpstreamError::Unreachable(format!("resolving {host}: {e}")))?;
    let mut last = String::from("no address");
    for a in addrs {
        match tokio::time::timeout(timeout, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(Upstream { sock: s, slot });
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "connect timed out".into(),
        }
    }
    Err(UpstreamError::Unreachable(format!(
        "connecting to {host}:{port}: {last}"
    )))
}

/// Copies both ways between the guest's side and the upstream until both
/// are done (the upstream's unit is given back when it returns).
pub(super) async fn splice<C>(client: &mut C, upstream: Upstream)
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let Upstream { mut sock, slot } = upstream;
    let _ = tokio::io::copy_bidirectional(client, &mut sock).await;
    drop(slot);
}
