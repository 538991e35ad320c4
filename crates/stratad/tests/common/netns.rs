//! Hosts of their own on one machine: network namespaces joined to this
//! process's (the "root") namespace, for tests/cluster_netns.rs.
//!
//! [`Net::create`] makes, for `n` hosts of a test (names carry the test's
//! pid, so parallel runs do not collide):
//!
//! - a bridge `s<pid>br` in the root namespace, `10.R.0.1/24` (R picked
//!   among unused `10.R.` prefixes): the **cluster network**;
//! - per host `h` (1-based) a namespace `s<pid>h<h>` with `lo` up and two
//!   veth pairs:
//!   - `s<pid>c<h>a` (root end, on the bridge) / `s<pid>c<h>b` (in the
//!     namespace, `10.R.0.<h+1>/24`): where the host's API listens and it
//!     reaches PostgreSQL and the other hosts — [`Net::cut`] sets its root
//!     end down;
//!   - `s<pid>u<h>a` (root, `10.R.<h>.1/30`) / `s<pid>u<h>b` (namespace,
//!     `10.R.<h>.2/30`): the host's **uplink**, where its guests' egress
//!     leaves (the test's HTTP server listens on the root end). Never cut,
//!     so a partition from the cluster leaves egress possible.
//!
//! No routing or forwarding is enabled anywhere: every address a host
//! reaches is on a link of its own. The bridge does not pass its frames to
//! the root namespace's iptables (`nf_call_iptables 0`).
//!
//! Daemons run in a namespace through `nsenter --net=/run/netns/NAME`
//! ([`Net::wrapper`]): it enters only the network namespace and execs the
//! daemon in place (same pid). `ip netns exec` would also give it a mount
//! namespace of its own (to remount `/sys`), hiding the daemon's
//! loop-mounted pool from this process and from the harness's cleanup.
//!
//! Dropping the [`Net`] deletes every link and namespace it made (also
//! after a failed test: it runs while the panic unwinds).
//!
//! Also here: [`Relay`] (TCP in the root namespace to PostgreSQL's unix
//! socket) and [`Recorder`] (an HTTP server that logs every request with
//! its arrival time).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One host's namespace and addresses.
#[derive(Debug, Clone)]
pub struct HostNet {
    /// The namespace's name (`/run/netns/<ns>`).
    pub ns: String,
    /// Its address on the cluster network (API, PostgreSQL, other hosts).
    pub ip: Ipv4Addr,
    /// The root end of its uplink: where its guests' egress goes.
    pub uplink_gw: Ipv4Addr,
    /// The root end of its cluster veth ([`Net::cut`] sets it down).
    pub cluster_link: String,
}

/// The namespaces, links and bridge of one test.
#[derive(Debug)]
pub struct Net {
    /// The bridge's address: the root namespace on the cluster network.
    pub gw: Ipv4Addr,
    /// The hosts, in order.
    pub hosts: Vec<HostNet>,
    bridge: String,
    made_ns: Vec<String>,
    made_links: Vec<String>,
}

/// Runs `ip args…`; panics with its stderr when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether `10.r.` is used by an address of the root namespace.
fn prefix_in_use(r: u8) -> bool {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.contains(&format!(" 10.{r}."))
}

impl Net {
    /// Whether this process can make namespaces (root, `ip`, `nsenter`).
    pub fn available() -> Result<(), String> {
        // SAFETY: geteuid(2) takes no argument and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root".into());
        }
        for (prog, arg) in [("ip", "-V"), ("nsenter", "--version")] {
            if !Command::new(prog)
                .arg(arg)
                .output()
                .is_ok_and(|o| o.status.success())
            {
                return Err(format!("{prog} is missing"));
            }
        }
        Ok(())
    }

    /// Makes the bridge and `n` hosts (module docs). Panics when a step
    /// fails; what was made by then is removed by the drop.
    pub fn create(n: u8) -> Net {
        assert!((1..=200).contains(&n), "1 to 200 hosts");
        let pid = std::process::id();
        let start = 200 + (pid % 50) as u8;
        let r = (0..50u8)
            .map(|i| 200 + (start - 200 + i) % 50)
            .find(|r| !prefix_in_use(*r))
            .expect("a free 10.R.0.0/16 among 10.200-249");
        let mut net = Net {
            gw: Ipv4Addr::new(10, r, 0, 1),
            hosts: Vec::new(),
            bridge: format!("s{pid}br"),
            made_ns: Vec::new(),
            made_links: Vec::new(),
        };
        let br = net.bridge.clone();
        ip(&["link", "add", &br, "type", "bridge"]);
        net.made_links.push(br.clone());
        // Host-to-host frames stay out of the root namespace's iptables
        // (with br_netfilter loaded, a FORWARD policy of DROP, as Docker
        // sets, would drop them).
        ip(&[
            "link",
            "set",
            &br,
            "type",
            "bridge",
            "nf_call_iptables",
            "0",
            "nf_call_ip6tables",
            "0",
            "nf_call_arptables",
            "0",
        ]);
        ip(&["addr", "add", &format!("{}/24", net.gw), "dev", &br]);
        ip(&["link", "set", &br, "up"]);
        for h in 1..=n {
            let ns = format!("s{pid}h{h}");
            ip(&["netns", "add", &ns]);
            net.made_ns.push(ns.clone());
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            let host_ip = Ipv4Addr::new(10, r, 0, h + 1);
            let uplink_gw = Ipv4Addr::new(10, r, h, 1);
            let uplink_ip = Ipv4Addr::new(10, r, h, 2);
            for (kind, root_addr, ns_addr) in [
                ('c', None, format!("{host_ip}/24")),
                (
                    'u',
                    Some(format!("{uplink_gw}/30")),
                    format!("{uplink_ip}/30"),
                ),
            ] {
                let (a, b) = (format!("s{pid}{kind}{h}a"), format!("s{pid}{kind}{h}b"));
                ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
                net.made_links.push(a.clone());
                ip(&["link", "set", &b, "netns", &ns]);
                match root_addr {
                    None => ip(&["link", "set", &a, "master", &br]),
                    Some(addr) => ip(&["addr", "add", &addr, "dev", &a]),
                }
                ip(&["link", "set", &a, "up"]);
                ip(&["-n", &ns, "addr", "add", &ns_addr, "dev", &b]);
                ip(&["-n", &ns, "link", "set", &b, "up"]);
            }
            net.hosts.push(HostNet {
                ns,
                ip: host_ip,
                uplink_gw,
                cluster_link: format!("s{pid}c{h}a"),
            });
        }
        net
    }

    /// The command that runs a program in host `h`'s namespace (0-based).
    pub fn wrapper(&self, h: usize) -> Vec<String> {
        vec![
            "nsenter".into(),
            format!("--net=/run/netns/{}", self.hosts[h].ns),
        ]
    }

    /// Takes host `h`'s cluster link down (its root end): the host reaches
    /// neither PostgreSQL nor the other hosts, and nobody reaches it.
    pub fn cut(&self, h: usize) {
        ip(&["link", "set", &self.hosts[h].cluster_link, "down"]);
    }

    /// Brings host `h`'s cluster link back up.
    pub fn heal(&self, h: usize) {
        ip(&["link", "set", &self.hosts[h].cluster_link, "up"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a root end deletes its peer too, even while processes
        // still hold the namespace; then the namespaces' names.
        for l in self.made_links.iter().rev() {
            let _ = Command::new("ip").args(["link", "del", l]).output();
        }
        for ns in &self.made_ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// A TCP listener in the root namespace relaying every connection to a
/// unix socket (PostgreSQL's): how hosts in namespaces reach a PostgreSQL
/// that listens only on a socket. Its threads end with the process.
pub struct Relay {
    /// Where it listens.
    pub addr: SocketAddr,
}

fn pump(mut from: impl Read, mut to: impl Write) {
    let mut buf = [0u8; 16384];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

impl Relay {
    /// Listens on `ip` (a free port) and relays to `socket`.
    pub fn start(ip: Ipv4Addr, socket: PathBuf) -> Relay {
        let l = TcpListener::bind((ip, 0)).expect("relay listen");
        let addr = l.local_addr().expect("relay addr");
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(tcp) = conn else { continue };
                let Ok(unix) = UnixStream::connect(&socket) else {
                    continue;
                };
                let (Ok(t2), Ok(u2)) = (tcp.try_clone(), unix.try_clone()) else {
                    continue;
                };
                std::thread::spawn(move || {
                    pump(tcp, unix);
                });
                std::thread::spawn(move || {
                    pump(u2, t2);
                });
            }
        });
        Relay { addr }
    }
}

/// One request a [`Recorder`] received.
#[derive(Debug, Clone)]
pub struct Hit {
    /// Arrival, ms since the epoch (this machine's clock, the one
    /// PostgreSQL's `clock_timestamp()` reads too).
    pub at_ms: i64,
    /// The address it listened on.
    pub on: SocketAddr,
    /// The request's path.
    pub path: String,
}

/// A tiny HTTP/1.1 server on one or more addresses (one port): every
/// request is answered `200 ok` (connections kept alive) and logged with
/// its arrival time.
pub struct Recorder {
    /// The port (the same on every address).
    pub port: u16,
    hits: Arc<Mutex<Vec<Hit>>>,
}

/// Milliseconds since the epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Recorder {
    /// Listens on every address of `ips`, on one free port.
    pub fn start(ips: &[Ipv4Addr]) -> Recorder {
        let hits = Arc::new(Mutex::new(Vec::new()));
        let first = TcpListener::bind((ips[0], 0)).expect("recorder listen");
        let port = first.local_addr().expect("addr").port();
        let mut listeners = vec![first];
        for ip in &ips[1..] {
            listeners.push(TcpListener::bind((*ip, port)).expect("recorder listen"));
        }
        for l in listeners {
            let hits = hits.clone();
            std::thread::spawn(move || {
                let on = l.local_addr().expect("addr");
                for conn in l.incoming() {
                    let Ok(conn) = conn else { continue };
                    let hits = hits.clone();
                    std::thread::spawn(move || serve(conn, on, &hits));
                }
            });
        }
        Recorder { port, hits }
    }

    /// Every request so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.hits.lock().map(|h| h.clone()).unwrap_or_default()
    }
}

fn serve(conn: TcpStream, on: SocketAddr, hits: &Mutex<Vec<Hit>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(60)));
    let Ok(clone) = conn.try_clone() else { return };
    let mut r = BufReader::new(clone);
    let mut w = conn;
    // Keep-alive: one connection may carry many requests (a client
    // tunnelled through the egress proxy keeps one open).
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).is_err() || line.is_empty() {
            return;
        }
        let at_ms = now_ms();
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).is_err() || h.trim().is_empty() {
                break;
            }
        }
        if let Ok(mut v) = hits.lock() {
            v.push(Hit { at_ms, on, path });
        }
        if w.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok",
        )
        .and_then(|()| w.flush())
        .is_err()
        {
            return;
        }
    }
}
