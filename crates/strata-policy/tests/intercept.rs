//! TLS interception over real sockets: a local TLS server with its own test
//! CA stands in for `api.salesforce.test`, the proxy intercepts with a CA of
//! its own (leaves minted here with rcgen, as the daemon's issuer does), and
//! a rustls client plays the guest (`CONNECT`, then TLS trusting the
//! interception CA). The guest-side scenarios (curl, Python requests, a warm
//! template) are in `stratad`'s `e2e_egress` tests.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use strata_policy::audit::AuditLog;
use strata_policy::proxy::{
    EgressProxy, Interception, LeafIssuer, ProxyConfig, SharedPolicy, StaticResolver,
};
use strata_policy::{Policy, PolicySet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn ok<T, E: std::fmt::Display>(r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// A certificate authority made for one test.
struct Ca {
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = ok(KeyPair::generate());
        let mut p = ok(CertificateParams::new(Vec::<String>::new()));
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = ok(p.self_signed(&key));
        Ca { key, cert }
    }
    fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }
    /// A leaf for `host`: its chain and key.
    fn issue(&self, host: &str) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        let key = ok(KeyPair::generate());
        let p = ok(CertificateParams::new(vec![host.to_string()]));
        let cert = ok(p.signed_by(&key, &self.cert, &self.key));
        (
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
    }
}

/// Leaves of the interception CA, counting what was asked for.
struct Leaves {
    ca: Ca,
    asked: Mutex<Vec<String>>,
}

impl LeafIssuer for Leaves {
    fn leaf(&self, host: &str) -> Option<Arc<CertifiedKey>> {
        self.asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(host.to_string());
        let (chain, key) = self.ca.issue(host);
        let signer = rustls::crypto::ring::sign::any_supported_type(&key).ok()?;
        Some(Arc::new(CertifiedKey::new(chain, signer)))
    }
}

/// The stand-in for `api.salesforce.test`: TLS with a leaf of `ca`, a JSON
/// echo of each request; counts requests and connections.
struct Upstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    conns: Arc<AtomicUsize>,
}

async fn tls_upstream(ca: &Ca) -> Upstream {
    let (chain, key) = ca.issue("api.salesforce.test");
    let mut sc = ok(rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions())
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap_or_else(|e| panic!("{e}"));
    sc.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(sc));
    let l = ok(TcpListener::bind("127.0.0.1:0").await);
    let addr = ok(l.local_addr());
    let hits = Arc::new(AtomicUsize::new(0));
    let conns = Arc::new(AtomicUsize::new(0));
    let (h, c) = (hits.clone(), conns.clone());
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (h, acceptor) = (h.clone(), acceptor.clone());
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                common::serve_echo(tls, h).await;
            });
        }
    });
    Upstream { addr, hits, conns }
}

/// A tenant whose read-only connector `salesforce` names
/// `api.salesforce.test` on the upstream's port (a TLS port).
fn salesforce_policy(port: u16) -> PolicySet {
    let tenant = format!(
        r#"
default = "deny"

[[connector]]
name = "salesforce"
hosts = ["api.salesforce.test"]
ports = [{port}]
tls_ports = [{port}]
read_only = true

[[rule]]
effect = "allow"
connector = "salesforce"
"#
    );
    let t = ok(Policy::parse(&tenant));
    ok(PolicySet::new(None, Some(Arc::new(t)), None))
}

/// Tenant B: it names the same host itself, without interception, and
/// allows tunnels to it.
fn other_tenant_policy(port: u16) -> PolicySet {
    let tenant = format!(
        r#"
default = "deny"

[[connector]]
name = "mine"
hosts = ["api.salesforce.test"]
ports = [{port}]
tls_ports = [{port}]
intercept = false

[[rule]]
effect = "allow"
connector = "mine"
method = "CONNECT"
"#
    );
    let t = ok(Policy::parse(&tenant));
    ok(PolicySet::new(None, Some(Arc::new(t)), None))
}

struct Env {
    proxy: EgressProxy,
    up: Upstream,
    upstream_ca: Ca,
    leaves: Arc<Leaves>,
    audit_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// A proxy for tenant `acme` (policy `policy(port)`), intercepting with a
/// fresh CA and verifying upstreams against `trust` (the upstream's own CA
/// unless a test says otherwise).
async fn env(policy: fn(u16) -> PolicySet, trust_upstream: bool) -> Env {
    let upstream_ca = Ca::new("test upstream CA");
    let up = tls_upstream(&upstream_ca).await;
    let leaves = Arc::new(Leaves {
        ca: Ca::new("test interception CA"),
        asked: Mutex::default(),
    });
    let trust = if trust_upstream {
        upstream_ca.der()
    } else {
        Ca::new("some other CA").der()
    };
    let ic = ok(Interception::new(leaves.clone(), false, vec![trust]));
    let dir = ok(tempfile::tempdir());
    let audit_path = dir.path().join("audit.jsonl");
    let mut cfg = ProxyConfig::new(
        "acme",
        Some("sb1"),
        Arc::new(SharedPolicy::new(policy(up.addr.port()))),
    );
    cfg.resolver = Arc::new(StaticResolver(
        [(
            "api.salesforce.test".to_string(),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        )]
        .into_iter()
        .collect(),
    ));
    cfg.audit = Some(Arc::new(ok(AuditLog::open(&audit_path))));
    cfg.intercept = Some(Arc::new(ic));
    let proxy = ok(EgressProxy::bind(ok("127.0.0.1:0".parse()), cfg).await);
    HOST.with(|h| *h.borrow_mut() = format!("api.salesforce.test:{}", up.addr.port()));
    Env {
        proxy,
        up,
        upstream_ca,
        leaves,
        audit_path,
        _dir: dir,
    }
}

fn client_config(root: CertificateDer<'static>, alpn: &[&[u8]]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    ok(roots.add(root));
    let mut c = ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions())
    .with_root_certificates(roots)
    .with_no_client_auth();
    c.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    c
}

/// `CONNECT api.salesforce.test:<port>` through the proxy; the status line
/// and the stream after the proxy's answer.
async fn connect(e: &Env) -> (u16, TcpStream) {
    let mut s = ok(TcpStream::connect(e.proxy.local_addr()).await);
    let port = e.up.addr.port();
    ok(s.write_all(
        format!(
            "CONNECT api.salesforce.test:{port} HTTP/1.1\r\nHost: api.salesforce.test:{port}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await);
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if ok(s.read(&mut b).await) == 0 {
            break;
        }
        head.push(b[0]);
    }
    let text = String::from_utf8_lossy(&head).to_string();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, s)
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

thread_local! {
    /// The `Host` header requests send (`api.salesforce.test:<port>`).
    static HOST: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// TLS to `api.salesforce.test` inside a `CONNECT`, trusting `root`.
async fn tls(e: &Env, root: CertificateDer<'static>, alpn: &[&[u8]]) -> std::io::Result<Tls> {
    let (status, s) = connect(e).await;
    assert_eq!(status, 200);
    let c = tokio_rustls::TlsConnector::from(Arc::new(client_config(root, alpn)));
    c.connect(ok(ServerName::try_from("api.salesforce.test")), s)
        .await
}

/// An HTTP/1.1 client on an intercepted connection.
async fn http(t: Tls) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let (sender, conn) = ok(hyper::client::conn::http1::handshake(TokioIo::new(t)).await);
    tokio::spawn(conn);
    sender
}

async fn send(
    s: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, serde_json::Value) {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", HOST.with(|h| h.borrow().clone()));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = ok(b.body(Full::new(Bytes::from_static(b"{}"))));
    let resp = ok(s.send_request(req).await);
    let status = resp.status().as_u16();
    let body = ok(resp.into_body().collect().await).to_bytes();
    let v = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    (status, v)
}

fn audit(e: &Env) -> Vec<serde_json::Value> {
    std::fs::read_to_string(&e.audit_path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Reads over HTTPS pass a read-only connector (each request on a
/// keep-alive connection judged, one upstream connection reused); writes
/// are refused and never reach the server; the audit shows method, path
/// and `tls: true`.
#[tokio::test]
async fn reads_pass_and_writes_are_refused_inside_intercepted_https() {
    let e = env(salesforce_policy, true).await;
    let ca = e.leaves.ca.der();
    let mut s = http(ok(tls(&e, ca.clone(), &[b"http/1.1"]).await)).await;
    let (st, j) = send(&mut s, "GET", "/services/data?q=1", &[]).await;
    assert_eq!(st, 200, "{j}");
    assert_eq!(j["method"], "GET");
    assert_eq!(j["uri"], "/services/data?q=1");
    let (st, j) = send(&mut s, "GET", "/services/other", &[]).await;
    assert_eq!(st, 200, "{j}");
    assert_eq!(e.up.hits.load(Ordering::SeqCst), 2);
    assert_eq!(e.up.conns.load(Ordering::SeqCst), 1, "upstream reused");
    // A write on the same connection is judged too.
    let (st, j) = send(&mut s, "POST", "/services/data/sobjects/Account", &[]).await;
    assert_eq!(st, 403, "{j}");
    assert_eq!(j["error"], "policy_denied");
    assert_eq!(j["rule"], "connector:salesforce:read-only");
    for m in ["PATCH", "DELETE", "PUT"] {
        let mut s = http(ok(tls(&e, ca.clone(), &[b"http/1.1"]).await)).await;
        let (st, j) = send(&mut s, m, "/services/data/sobjects/Account/1", &[]).await;
        assert_eq!(st, 403, "{m}: {j}");
    }
    // A method override is refused like over plain HTTP.
    let mut s = http(ok(tls(&e, ca.clone(), &[b"http/1.1"]).await)).await;
    let (st, j) = send(&mut s, "GET", "/x", &[("x-http-method-override", "DELETE")]).await;
    assert_eq!((st, j["error"].as_str()), (400, Some("method_override")));
    assert_eq!(
        e.up.hits.load(Ordering::SeqCst),
        2,
        "no write reached the server"
    );
    let log = audit(&e);
    let get = log
        .iter()
        .find(|l| l["call"]["kind"]["method"] == "GET")
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(get["call"]["kind"]["tls"], true, "{get}");
    assert_eq!(get["call"]["kind"]["path"], "/services/data");
    assert_eq!(get["call"]["kind"]["connector"], "salesforce");
    assert!(
        log.iter()
            .any(|l| l["call"]["kind"]["method"] == "DELETE" && l["call"]["kind"]["tls"] == true),
        "{log:?}"
    );
    assert_eq!(
        *e.leaves.asked.lock().unwrap_or_else(|e| e.into_inner()),
        vec!["api.salesforce.test".to_string(); 5]
    );
}

/// An upstream whose certificate does not verify: the guest gets `502
/// upstream_tls` with the reason, the audit says why, nothing is sent.
#[tokio::test]
async fn a_wrong_upstream_certificate_is_refused() {
    let e = env(salesforce_policy, false).await;
    let mut s = http(ok(tls(&e, e.leaves.ca.der(), &[b"http/1.1"]).await)).await;
    let (st, j) = send(&mut s, "GET", "/services/data", &[]).await;
    assert_eq!(st, 502, "{j}");
    assert_eq!(j["error"], "upstream_tls");
    assert!(
        j["reason"].as_str().unwrap_or("").contains("certificate")
            || j["reason"].as_str().unwrap_or("").contains("Unknown"),
        "{j}"
    );
    assert_eq!(e.up.hits.load(Ordering::SeqCst), 0);
    let log = audit(&e);
    assert!(
        log.iter()
            .any(|l| l["decision"]["rule_id"] == "upstream-tls"),
        "{log:?}"
    );
}

/// An h2-only client fails the handshake and an `Upgrade` request is
/// refused, both audited with the reason; nothing reaches the server.
#[tokio::test]
async fn h2_only_clients_and_upgrades_are_refused() {
    let e = env(salesforce_policy, true).await;
    let r = tls(&e, e.leaves.ca.der(), &[b"h2"]).await;
    let err = match r {
        Ok(mut t) => {
            // TLS 1.3: the alert may come with the first read.
            let mut b = [0u8; 1];
            let _ = t.write_all(b"x").await;
            t.read(&mut b).await.err()
        }
        Err(e) => Some(e),
    };
    // The handshake fails (an alert or the connection closed).
    assert!(err.is_some());
    let mut s = http(ok(tls(&e, e.leaves.ca.der(), &[b"http/1.1"]).await)).await;
    let (st, j) = send(
        &mut s,
        "GET",
        "/ws",
        &[("connection", "Upgrade"), ("upgrade", "websocket")],
    )
    .await;
    assert_eq!(
        (st, j["error"].as_str()),
        (403, Some("upgrade_refused")),
        "{j}"
    );
    assert_eq!(e.up.hits.load(Ordering::SeqCst), 0);
    // Give the cut's audit write a moment (it follows the alert).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let log = audit(&e);
    for rule in ["tls-h2-only", "tls-upgrade"] {
        assert!(
            log.iter().any(|l| l["decision"]["rule_id"] == rule),
            "{rule}: {log:?}"
        );
    }
}

/// Another tenant that names the host without interception gets a plain
/// tunnel to the real server (its certificate, not ours): no leaf is
/// minted for it; a client trusting only the interception CA fails.
#[tokio::test]
async fn a_host_without_interception_stays_a_tunnel_by_name() {
    let e = env(other_tenant_policy, true).await;
    let t = ok(tls(&e, e.upstream_ca.der(), &[b"http/1.1"]).await);
    let mut s = http(t).await;
    let (st, j) = send(&mut s, "GET", "/services/data", &[]).await;
    assert_eq!(st, 200, "{j}");
    assert!(e
        .leaves
        .asked
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_empty());
    assert!(tls(&e, e.leaves.ca.der(), &[b"http/1.1"]).await.is_err());
}
