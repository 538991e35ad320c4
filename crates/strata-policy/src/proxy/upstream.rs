//! Stage 4, upstream: resolving an allowed host, connecting to it (one host
//! unit per socket, see [`super::tunnel`]) and splicing a tunnel to it.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::tunnel::{Tunnel, UpstreamSlot};
use crate::policy::{canonical_ip, parse_ip_literal, IpNet};

/// Future returned by [`Resolver::resolve`].
pub type ResolveFuture<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Turns an allowed host name into addresses to connect to.
pub trait Resolver: Send + Sync {
    /// Addresses for `host:port`.
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a>;
}

/// The system resolver, refusing answers that point inside (loopback,
/// private, link-local, CGNAT, unique-local, unspecified, multicast,
/// reserved, the host's own addresses; see [`is_public`]): a connector's
/// DNS name must not become a way into the host's networks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

/// The IPv4 address an IPv6 address carries for translation: NAT64
/// (`64:ff9b::/96`, its last 32 bits) and 6to4 (`2002::/16`, bits 16-48).
/// A gateway turns traffic to them into traffic to that IPv4 address.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let v4 = |hi: u16, lo: u16| {
        let [a, b] = hi.to_be_bytes();
        let [c, d] = lo.to_be_bytes();
        Ipv4Addr::new(a, b, c, d)
    };
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(v4(s[6], s[7]));
    }
    (s[0] == 0x2002).then(|| v4(s[1], s[2]))
}

/// Is `ip` in public unicast space? Not: loopback, RFC 1918, CGNAT
/// (`100.64/10`), link-local, "this network" (`0/8`), IETF protocol
/// assignments (`192.0.0.0/24`), benchmarking (`198.18/15`), the
/// documentation nets, multicast, reserved and broadcast (`240/4`);
/// IPv6 loopback, unspecified, IPv4-compatible (`::/96`), multicast,
/// unique-local (`fc00::/7`), link-local (`fe80::/10`), site-local
/// (`fec0::/10`), local-use NAT64 (`64:ff9b:1::/48`), and NAT64 or 6to4
/// addresses whose embedded IPv4 address is not public.
fn is_public_space(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_documentation()
                || o[0] == 0
                || o[0] >= 240
                || (o[0] == 100 && (64..128).contains(&o[1]))
                || (o[0] == 192 && o[1] == 0 && o[2] == 0)
                || (o[0] == 198 && (o[1] & 0xfe) == 18))
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_space(IpAddr::V4(v4));
            }
            if let Some(v4) = embedded_v4(v6) {
                return is_public_space(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || s[..6] == [0; 6]
                || s[..3] == [0x64, 0xff9b, 1]
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0)
        }
    }
}

/// How long the host's interface addresses are trusted before they are
/// read again (addresses come and go: DHCP, VPNs, containers).
const OWN_ADDRESSES_TTL: Duration = Duration::from_secs(2);

/// The host's interface addresses (`getifaddrs`), read at most every
/// [`OWN_ADDRESSES_TTL`]. A failure to read them counts as none (and is
/// logged): the address guard's bind test still covers IP literals.
fn own_addresses() -> Arc<Vec<IpAddr>> {
    static CACHE: Mutex<Option<(Instant, Arc<Vec<IpAddr>>)>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, addrs)) = cache.as_ref() {
        if at.elapsed() < OWN_ADDRESSES_TTL {
            return addrs.clone();
        }
    }
    let addrs: Vec<IpAddr> = match nix::ifaddrs::getifaddrs() {
        Ok(list) => list
            .filter_map(|i| i.address)
            .filter_map(|a| {
                a.as_sockaddr_in()
                    .map(|s| IpAddr::V4(s.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
            })
            .map(canonical_ip)
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "reading the host's interface addresses");
            Vec::new()
        }
    };
    let addrs = Arc::new(addrs);
    *cache = Some((Instant::now(), addrs.clone()));
    addrs
}

/// [`is_public_space`], and not one of `own` (the host's addresses): a
/// service the host exposes on `0.0.0.0` is no egress destination.
fn is_public_given(ip: IpAddr, own: &[IpAddr]) -> bool {
    let ip = canonical_ip(ip);
    is_public_space(ip) && !own.contains(&ip)
}

/// Is `ip` a public address that is not the host's own?
pub(super) fn is_public(ip: IpAddr) -> bool {
    is_public_given(ip, &own_addresses())
}

/// Non-public blocks a connector may open by naming a range inside one of
/// them (RFC 1918, CGNAT, benchmarking, the documentation nets,
/// unique-local IPv6).
const PRIVATE_BLOCKS: [&str; 9] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "198.18.0.0/15",
    "192.0.2.0/24",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "fc00::/7",
];

/// Addresses no rule opens: loopback, link-local (the cloud metadata
/// address `169.254.169.254` among them), "this network", unspecified,
/// multicast, broadcast and reserved (`240.0.0.0/4`), IPv6 site-local, and
/// NAT64 or 6to4 addresses embedding any of those.
fn never_reachable(ip: IpAddr) -> bool {
    if let IpAddr::V6(v6) = ip {
        if let Some(v4) = embedded_v4(v6) {
            return never_reachable(IpAddr::V4(v4));
        }
    }
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || o[0] == 0
                || o[0] >= 240
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
        }
    }
}

/// Is `ip` one of this host's own addresses? Binding a socket to it
/// succeeds only then (with `ip_nonlocal_bind` set it always succeeds, and
/// every address counts as the host's: closed, not open).
fn is_own_address(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The guard on an IP-literal destination, authoritative over every rule:
/// `range` is the connector range that holds `ip`. Loopback, link-local,
/// multicast, reserved and the host's own addresses are never reached; a
/// non-public address only when `range` itself lies inside private space
/// (an operator who wrote `10.77.0.0/16` meant it; `0.0.0.0/0` means the
/// public internet).
pub fn address_guard(ip: IpAddr, range: &IpNet) -> Result<(), String> {
    let ip = canonical_ip(ip);
    if never_reachable(ip) {
        return Err(format!(
            "`{ip}` is a loopback, link-local, multicast or reserved address; no rule opens it"
        ));
    }
    if is_own_address(ip) {
        return Err(format!(
            "`{ip}` is one of the host's own addresses; no rule opens it"
        ));
    }
    if !is_public(ip) {
        let explicit = PRIVATE_BLOCKS
            .iter()
            .filter_map(|b| IpNet::parse(b).ok())
            .any(|b| range.within(&b));
        if !explicit {
            return Err(format!(
                "`{ip}` is a private address and connector range {range} is not a private range; only a range inside private space (e.g. 10.0.0.0/8) opens private addresses"
            ));
        }
    }
    Ok(())
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

/// The system resolver that also accepts answers inside operator-named
/// ranges (`[security] egress_resolved_ranges`): a network whose DNS sends
/// allowed registries to a private or documentation address (an internal
/// mirror, a TLS-inspecting gateway). Loopback, link-local, multicast and
/// reserved answers stay refused whatever the ranges say.
#[derive(Debug, Default, Clone)]
pub struct RangeResolver {
    /// Non-public ranges an answer may fall in.
    pub ranges: Vec<IpNet>,
}

impl Resolver for RangeResolver {
    fn resolve<'a>(&'a self, host: &'a str, port: u16) -> ResolveFuture<'a> {
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
                .await?
                .filter(|a| {
                    let ip = canonical_ip(a.ip());
                    let own = own_addresses();
                    is_public_given(ip, &own)
                        || (!never_reachable(ip)
                            && !own.contains(&ip)
                            && self.ranges.iter().any(|r| r.contains(ip)))
                })
                .collect();
            if addrs.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "no public address (nor one in egress_resolved_ranges)",
                ));
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
    // An address literal was decided (and guarded) as that address: it is
    // connected to as is, never resolved.
    let addrs = match parse_ip_literal(host) {
        Some(ip) => vec![SocketAddr::new(ip, port)],
        None => resolver
            .resolve(host, port)
            .await
            .map_err(|e| UpstreamError::Unreachable(format!("resolving {host}: {e}")))?,
    };
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

/// How a [`splice`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpliceEnd {
    /// Both sides finished, or one failed.
    Done,
    /// No byte moved either way for the idle timeout: both sockets closed.
    Idle,
}

/// Copies both ways between the guest's side and the upstream until both
/// are done, or until no byte has moved in either direction for `idle`
/// (a tunnel nobody uses must not hold its stream, its host unit and two
/// descriptors forever). The upstream's unit is given back when it returns.
pub(super) async fn splice<C>(client: &mut C, upstream: Upstream, idle: Duration) -> SpliceEnd
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let Upstream { mut sock, slot } = upstream;
    let moved = Arc::new(Activity::new());
    let mut client = Watched::new(client, moved.clone());
    let mut sock = Watched::new(&mut sock, moved.clone());
    let copy = tokio::io::copy_bidirectional(&mut client, &mut sock);
    tokio::pin!(copy);
    let end = loop {
        let deadline = moved.last() + idle;
        tokio::select! {
            _ = &mut copy => break SpliceEnd::Done,
            _ = tokio::time::sleep_until(deadline.into()) => {
                if moved.last().elapsed() >= idle {
                    break SpliceEnd::Idle;
                }
            }
        }
    };
    drop(slot);
    end
}

/// When bytes last moved through a [`splice`], as milliseconds after its
/// start (one atomic store per read: no lock on the data path).
struct Activity {
    start: Instant,
    ms: std::sync::atomic::AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_millis(self.ms.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// A stream that records in [`Activity`] every read that brought bytes.
struct Watched<S> {
    inner: S,
    moved: Arc<Activity>,
}

impl<S> Watched<S> {
    fn new(inner: S, moved: Arc<Activity>) -> Self {
        Watched { inner, moved }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.moved.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        IpNet::parse(s).unwrap_or_else(|e| panic!("{e}"))
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn public_space_excludes_special_and_translated_inside_addresses() {
        for a in [
            "93.184.216.34",
            "8.8.8.8",
            "2606:4700::1111",
            "64:ff9b::808:808",
            "2002:808:808::1",
            "::ffff:8.8.8.8",
            "192.0.1.1",
            "198.20.0.1",
        ] {
            assert!(is_public_given(ip(a), &[]), "{a} is public");
        }
        for a in [
            // IPv4 special-purpose blocks
            "192.0.0.8",
            "192.0.0.170",
            "198.18.0.1",
            "198.19.255.255",
            "240.0.0.1",
            "250.1.2.3",
            "255.255.255.255",
            "10.0.0.1",
            "100.100.0.1",
            "127.0.0.1",
            "169.254.169.254",
            "0.1.2.3",
            // NAT64 and 6to4 carrying a private or special IPv4 address
            "64:ff9b::a00:1",
            "64:ff9b::7f00:1",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b:1::808:808",
            "2002:a00:1::1",
            "2002:7f00:1::",
            "2002:c0a8:101::1",
            // IPv6 special blocks
            "fec0::1",
            "feff::1",
            "fd00::1",
            "fe80::1",
            "::1",
            "::",
            "::10.0.0.1",
            "ff02::1",
        ] {
            assert!(!is_public_given(ip(a), &[]), "{a} is not public");
        }
        // The host's own addresses, public or not, are never a destination.
        let own = [ip("93.184.216.34"), ip("2606:4700::1111")];
        assert!(!is_public_given(ip("93.184.216.34"), &own));
        assert!(!is_public_given(ip("::ffff:93.184.216.34"), &own));
        assert!(!is_public_given(ip("2606:4700::1111"), &own));
        assert!(is_public_given(ip("8.8.8.8"), &own));
        // ... and the list is the host's interface addresses.
        let listed = own_addresses();
        for a in fib_local_addresses() {
            assert!(
                listed.contains(&a),
                "own address {a} not listed: {listed:?}"
            );
            assert!(!is_public(a), "own address {a}");
        }
        assert!(listed.contains(&ip("127.0.0.1")), "{listed:?}");
        // The guard refuses translated forms of never-reachable addresses.
        assert!(address_guard(ip("64:ff9b::a9fe:a9fe"), &net("::/0")).is_err());
        assert!(address_guard(ip("2002:7f00:1::1"), &net("2002::/16")).is_err());
    }

    /// This host's local IPv4 addresses (loopback aside), read from the
    /// kernel's routing table rather than `getifaddrs`.
    fn fib_local_addresses() -> Vec<IpAddr> {
        std::fs::read_to_string("/proc/net/fib_trie")
            .unwrap_or_default()
            .lines()
            .collect::<Vec<_>>()
            .windows(2)
            .filter(|w| w[1].contains("/32 host LOCAL"))
            .filter_map(|w| w[0].trim().trim_start_matches("|-- ").parse().ok())
            .filter(|a: &IpAddr| !a.is_loopback())
            .collect()
    }

    #[test]
    fn the_guard_keeps_inside_addresses_closed() {
        let all = net("0.0.0.0/0");
        let all6 = net("::/0");
        // Public addresses under any range.
        assert_eq!(address_guard(ip("93.184.216.34"), &all), Ok(()));
        assert_eq!(address_guard(ip("2606:4700::1111"), &all6), Ok(()));
        // Never, whatever the range says.
        for (a, r) in [
            ("127.0.0.1", "127.0.0.0/8"),
            ("169.254.169.254", "169.254.169.254/32"),
            ("169.254.169.254", "0.0.0.0/0"),
            ("0.0.0.0", "0.0.0.0/0"),
            ("224.0.0.1", "224.0.0.0/4"),
            ("255.255.255.255", "0.0.0.0/0"),
            ("::1", "::/0"),
            ("fe80::1", "fe80::/10"),
            ("::ffff:127.0.0.1", "::/0"),
        ] {
            assert!(address_guard(ip(a), &net(r)).is_err(), "{a} under {r}");
        }
        // Private: only from a range inside private space.
        assert!(address_guard(ip("10.1.2.3"), &all).is_err());
        assert!(address_guard(ip("192.168.1.1"), &net("192.0.0.0/8")).is_err());
        assert!(address_guard(ip("100.64.0.9"), &all).is_err());
        assert!(address_guard(ip("fd00::9"), &all6).is_err());
        assert_eq!(
            address_guard(ip("10.200.1.2"), &net("10.200.0.0/16")),
            Ok(())
        );
        assert_eq!(address_guard(ip("fd00::9"), &net("fd00::/8")), Ok(()));
        // The host's own addresses: loopback aside, whatever this host has.
        for a in fib_local_addresses() {
            assert!(
                address_guard(a, &net("0.0.0.0/0")).is_err()
                    && address_guard(a, &IpNet::parse(&format!("{a}/32")).unwrap_or(all)).is_err(),
                "own address {a}"
            );
        }
    }
}
