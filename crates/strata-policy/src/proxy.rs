//! HTTP egress proxy: the only way out of a sandbox.
//!
//! Built on hyper 1.x rather than a hand-rolled parser: hyper (over
//! `httparse`) already refuses obsolete line folding, bad chunk framing,
//! differing duplicate `Content-Length`s and malformed request lines, and it
//! re-serialises every forwarded request, so bytes the guest sends are never
//! relayed verbatim to an upstream. hyper is lenient where RFC 9112 allows it
//! (it collapses identical duplicate `Content-Length`s and lets
//! `Transfer-Encoding` override `Content-Length`), so the proxy also checks
//! each request head on the raw bytes with `httparse` before hyper normalises
//! it, and refuses any duplicate `Content-Length` or `Transfer-Encoding`,
//! both together, a `Transfer-Encoding` other than `chunked`, duplicate
//! `Host`, a `Host` that disagrees with the absolute URL, and userinfo in
//! the URL. Client connections carry one request each (no keep-alive) and
//! every forwarded request uses a fresh upstream connection, so there is no
//! connection on which a desync could carry over to a next request.
//!
//! Plain HTTP requests get method-level policy; `CONNECT` tunnels get
//! host-level policy only (see `docs/policy.md`). The ClientHello's SNI of a
//! tunnel must name the `CONNECT` host.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::approval::{ApprovalQueue, Outcome as ApprovalOutcome};
use crate::audit::{AuditDecision, AuditLog, Outcome};
use crate::call::{CallKind, ToolCall};
use crate::policy::{looks_like_ip, Decision, Effect, PolicySet};

/// Gives the proxy the policy in force; called once per request, so the
/// daemon can swap policies live.
pub trait PolicySource: Send + Sync {
    /// The current policy.
    fn current(&self) -> Arc<PolicySet>;
}

impl<F: Fn() -> Arc<PolicySet> + Send + Sync> PolicySource for F {
    fn current(&self) -> Arc<PolicySet> {
        self()
    }
}

/// A policy that can be replaced atomically.
#[derive(Debug)]
pub struct SharedPolicy(RwLock<Arc<PolicySet>>);

impl SharedPolicy {
    /// Start with `p`.
    pub fn new(p: PolicySet) -> Self {
        SharedPolicy(RwLock::new(Arc::new(p)))
    }
    /// Put `p` in force for every later request.
    pub fn replace(&self, p: PolicySet) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(p);
    }
}

impl PolicySource for SharedPolicy {
    fn current(&self) -> Arc<PolicySet> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

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

fn is_public(ip: IpAddr) -> bool {
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

/// Everything one proxy listener needs; one listener serves one sandbox.
pub struct ProxyConfig {
    /// Tenant of the sandbox behind this listener.
    pub tenant: String,
    /// The sandbox.
    pub sandbox: Option<String>,
    /// Actor recorded for calls through this proxy.
    pub actor: String,
    /// Policy in force.
    pub policy: Arc<dyn PolicySource>,
    /// Name resolution for upstreams.
    pub resolver: Arc<dyn Resolver>,
    /// Where `approve` decisions wait; without one they are refused.
    pub approvals: Option<Arc<ApprovalQueue>>,
    /// How long a held request waits for a human.
    pub approval_timeout: Duration,
    /// Where decisions are recorded.
    pub audit: Option<Arc<AuditLog>>,
    /// Upstream connect timeout.
    pub connect_timeout: Duration,
}

impl ProxyConfig {
    /// A configuration with the system resolver, no approvals, no audit.
    pub fn new(tenant: &str, sandbox: Option<&str>, policy: Arc<dyn PolicySource>) -> Self {
        ProxyConfig {
            tenant: tenant.into(),
            sandbox: sandbox.map(String::from),
            actor: format!("sandbox:{}", sandbox.unwrap_or("-")),
            policy,
            resolver: Arc::new(SystemResolver),
            approvals: None,
            approval_timeout: Duration::from_secs(300),
            audit: None,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// A running proxy listener.
pub struct EgressProxy {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for EgressProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxy")
            .field("addr", &self.addr)
            .finish()
    }
}

impl EgressProxy {
    /// Listen on `addr` (port 0 for any) and serve until dropped.
    pub async fn bind(addr: SocketAddr, cfg: ProxyConfig) -> io::Result<EgressProxy> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let cfg = Arc::new(cfg);
        let task = tokio::spawn(async move {
            loop {
                let (stream, _) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "egress proxy accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let cfg = cfg.clone();
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    let verdict = Arc::new(Mutex::new(None));
                    let io = SniffIo {
                        inner: stream,
                        head: Vec::new(),
                        done: false,
                        verdict: verdict.clone(),
                    };
                    let svc = hyper::service::service_fn(move |req| {
                        let raw = *verdict.lock().unwrap_or_else(|e| e.into_inner());
                        handle(cfg.clone(), raw, req)
                    });
                    let r = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .keep_alive(false)
                        .header_read_timeout(Duration::from_secs(30))
                        .max_buf_size(64 * 1024)
                        .serve_connection(TokioIo::new(io), svc)
                        .with_upgrades()
                        .await;
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "egress proxy connection");
                    }
                });
            }
        });
        Ok(EgressProxy { addr, task })
    }

    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

fn refuse(status: StatusCode, error: &str, detail: serde_json::Value) -> Response<Body> {
    let mut body = serde_json::json!({ "error": error });
    if let (Some(b), serde_json::Value::Object(d)) = (body.as_object_mut(), detail) {
        b.extend(d);
    }
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

fn bad(msg: &str) -> Response<Body> {
    refuse(
        StatusCode::BAD_REQUEST,
        "bad_request",
        serde_json::json!({ "reason": msg }),
    )
}

fn denied(d: &Decision, approval_id: Option<&str>) -> Response<Body> {
    refuse(
        StatusCode::FORBIDDEN,
        "policy_denied",
        serde_json::json!({
            "rule": d.rule_id,
            "layer": d.layer.map(|l| l.as_str()),
            "reason": d.reason,
            "approval_id": approval_id,
        }),
    )
}

/// Request-framing checks that hyper does not make.
fn smuggling_check(h: &HeaderMap) -> Result<(), &'static str> {
    let cl: Vec<_> = h.get_all(header::CONTENT_LENGTH).iter().collect();
    if cl.len() > 1 {
        return Err("more than one Content-Length");
    }
    if let Some(v) = cl.first() {
        if v.is_empty() || !v.as_bytes().iter().all(u8::is_ascii_digit) {
            return Err("Content-Length is not a number");
        }
    }
    let te: Vec<_> = h.get_all(header::TRANSFER_ENCODING).iter().collect();
    if !te.is_empty() {
        if !cl.is_empty() {
            return Err("Transfer-Encoding together with Content-Length");
        }
        if te.len() > 1 || !te[0].as_bytes().eq_ignore_ascii_case(b"chunked") {
            return Err("Transfer-Encoding other than a single `chunked`");
        }
    }
    if h.get_all(header::HOST).iter().count() > 1 {
        return Err("more than one Host");
    }
    Ok(())
}

/// Split and check an authority (`host[:port]`), lower-casing the host.
fn parse_authority(a: &str, default_port: Option<u16>) -> Result<(String, u16), &'static str> {
    if a.contains('@') {
        return Err("userinfo in the request target");
    }
    if a.starts_with('[') {
        return Err("IP literal");
    }
    let (host, port) = match a.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| "bad port")?),
        None => (a, default_port.ok_or("port required")?),
    };
    if port == 0 {
        return Err("bad port");
    }
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if looks_like_ip(&host) {
        return Err("IP literal");
    }
    if !crate::policy::is_host_name(&host) {
        return Err("not a host name");
    }
    Ok((host, port))
}

struct Checked {
    call: ToolCall,
    host: String,
    port: u16,
}

enum Verdict {
    Go,
    Refuse(Response<Body>),
}

impl Checked {
    fn new(
        cfg: &ProxyConfig,
        host: String,
        port: u16,
        method: &str,
        path: String,
        scheme: &str,
    ) -> Self {
        let call = ToolCall {
            tenant: cfg.tenant.clone(),
            sandbox: cfg.sandbox.clone(),
            actor: cfg.actor.clone(),
            kind: CallKind::Egress {
                connector: None,
                host: host.clone(),
                port,
                method: method.to_string(),
                path,
                scheme: scheme.into(),
            },
        };
        Checked { call, host, port }
    }
}

fn record(
    cfg: &ProxyConfig,
    call: &ToolCall,
    d: &Decision,
    outcome: Outcome,
    approval: Option<String>,
    by: Option<String>,
) {
    if let Some(a) = &cfg.audit {
        if let Err(e) = a.append(call, AuditDecision::from_decision(d, outcome, approval), by) {
            tracing::error!(error = %e, "audit append failed");
        }
    }
}

/// Policy, connector and approval checks shared by plain requests and tunnels.
async fn decide(cfg: &ProxyConfig, c: &mut Checked) -> Verdict {
    let policy = cfg.policy.current();
    let Some(conn) = policy.connector_for_host(&c.host) else {
        let d = Decision {
            effect: Effect::Deny,
            layer: None,
            rule_id: "unlisted-host".into(),
            rule_index: None,
            hard: true,
            reason: format!(
                "`{}` belongs to no connector; egress is closed by default",
                c.host
            ),
        };
        record(cfg, &c.call, &d, Outcome::Denied, None, None);
        return Verdict::Refuse(denied(&d, None));
    };
    if let CallKind::Egress { connector, .. } = &mut c.call.kind {
        *connector = Some(conn.name.clone());
    }
    if !conn.ports.contains(&c.port) {
        let d = Decision {
            effect: Effect::Deny,
            layer: None,
            rule_id: "connector-port".into(),
            rule_index: None,
            hard: true,
            reason: format!("port {} is not open for connector `{}`", c.port, conn.name),
        };
        record(cfg, &c.call, &d, Outcome::Denied, None, None);
        return Verdict::Refuse(denied(&d, None));
    }
    let d = policy.evaluate(&c.call);
    match d.effect {
        Effect::Allow => {
            record(cfg, &c.call, &d, Outcome::Allowed, None, None);
            Verdict::Go
        }
        Effect::Deny => {
            record(cfg, &c.call, &d, Outcome::Denied, None, None);
            Verdict::Refuse(denied(&d, None))
        }
        Effect::Approve => {
            let Some(q) = &cfg.approvals else {
                record(cfg, &c.call, &d, Outcome::Denied, None, None);
                return Verdict::Refuse(denied(&d, None));
            };
            let req = match q.request(&c.call, &d) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(error = %e, "approval request failed");
                    record(cfg, &c.call, &d, Outcome::Denied, None, None);
                    return Verdict::Refuse(denied(&d, None));
                }
            };
            record(cfg, &c.call, &d, Outcome::Held, Some(req.id.clone()), None);
            let out = q.wait(&cfg.tenant, &req.id, cfg.approval_timeout).await;
            let (outcome, by) = match &out {
                Ok(ApprovalOutcome::Approved { by, .. }) => (Outcome::Approved, Some(by.clone())),
                Ok(ApprovalOutcome::Denied { by, .. }) => (Outcome::Rejected, Some(by.clone())),
                Ok(ApprovalOutcome::TimedOut) | Err(_) => (Outcome::TimedOut, None),
            };
            record(cfg, &c.call, &d, outcome, Some(req.id.clone()), by);
            if outcome == Outcome::Approved {
                Verdict::Go
            } else {
                Verdict::Refuse(denied(&d, Some(&req.id)))
            }
        }
    }
}

async fn connect(cfg: &ProxyConfig, host: &str, port: u16) -> Result<TcpStream, Response<Body>> {
    let gw = |why: String| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "upstream_unreachable",
            serde_json::json!({ "reason": why }),
        )
    };
    let addrs = cfg
        .resolver
        .resolve(host, port)
        .await
        .map_err(|e| gw(format!("resolving {host}: {e}")))?;
    let mut last = String::from("no address");
    for a in addrs {
        match tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(a)).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "connect timed out".into(),
        }
    }
    Err(gw(format!("connecting to {host}:{port}: {last}")))
}

const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .filter(|s| !s.is_empty())
        .collect();
    for n in HOP_BY_HOP.iter().map(|s| s.to_string()).chain(named) {
        h.remove(n.as_str());
    }
}

async fn handle(
    cfg: Arc<ProxyConfig>,
    raw: Option<Result<(), &'static str>>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    // hyper has parsed the whole head, so the sniffer has seen it.
    match raw {
        Some(Ok(())) => {}
        Some(Err(why)) => return Ok(bad(why)),
        None => return Ok(bad("request head not seen")),
    }
    if let Err(why) = smuggling_check(req.headers()) {
        return Ok(bad(why));
    }
    if req.method() == Method::CONNECT {
        return Ok(tunnel(cfg, req).await);
    }
    Ok(forward(cfg, req).await)
}

async fn forward(cfg: Arc<ProxyConfig>, req: Request<Incoming>) -> Response<Body> {
    let uri = req.uri().clone();
    match uri.scheme_str() {
        Some("http") => {}
        Some(_) => return bad("only http:// in absolute form; use CONNECT for https"),
        None => return bad("a proxy request needs an absolute-form URL"),
    }
    let Some(authority) = uri.authority() else {
        return bad("absolute-form URL without a host");
    };
    let (host, port) = match parse_authority(authority.as_str(), Some(80)) {
        Ok(hp) => hp,
        Err("IP literal") => {
            return refuse(StatusCode::FORBIDDEN, "ip_literal", serde_json::json!({}))
        }
        Err(why) => return bad(why),
    };
    let Some(host_hdr) = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
    else {
        return bad("missing Host header");
    };
    match parse_authority(host_hdr, Some(80)) {
        Ok(hp) if hp == (host.clone(), port) => {}
        _ => return bad("Host header disagrees with the request URL"),
    }
    let path = uri.path().to_string();
    let mut c = Checked::new(&cfg, host, port, req.method().as_str(), path, "http");
    if let Verdict::Refuse(r) = decide(&cfg, &mut c).await {
        return r;
    }

    let stream = match connect(&cfg, &c.host, c.port).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
    {
        Ok(x) => x,
        Err(e) => {
            return refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                serde_json::json!({ "reason": e.to_string() }),
            )
        }
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    parts.uri = match pq.parse() {
        Ok(u) => u,
        Err(_) => return bad("bad path"),
    };
    strip_hop_by_hop(&mut parts.headers);
    let out = Request::from_parts(parts, body);
    match sender.send_request(out).await {
        Ok(resp) => {
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, body.boxed())
        }
        Err(e) => refuse(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            serde_json::json!({ "reason": e.to_string() }),
        ),
    }
}

async fn tunnel(cfg: Arc<ProxyConfig>, mut req: Request<Incoming>) -> Response<Body> {
    let Some(authority) = req.uri().authority().map(|a| a.as_str().to_string()) else {
        return bad("CONNECT needs host:port");
    };
    let (host, port) = match parse_authority(&authority, None) {
        Ok(hp) => hp,
        Err("IP literal") => {
            return refuse(StatusCode::FORBIDDEN, "ip_literal", serde_json::json!({}))
        }
        Err(why) => return bad(why),
    };
    if let Some(h) = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
    {
        if parse_authority(h, Some(port)).ok() != Some((host.clone(), port)) {
            return bad("Host header disagrees with the CONNECT target");
        }
    }
    let mut c = Checked::new(&cfg, host, port, "CONNECT", String::new(), "https");
    if let Verdict::Refuse(r) = decide(&cfg, &mut c).await {
        return r;
    }
    let upstream = match connect(&cfg, &c.host, c.port).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let host = c.host.clone();
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "CONNECT upgrade");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        let mut upstream = upstream;
        // Peek at the first bytes: if they are a TLS ClientHello, its SNI must
        // name the CONNECT host (no fronting to another name on a shared IP).
        let mut first = Vec::with_capacity(4096);
        let mut chunk = [0u8; 4096];
        loop {
            let n = match tokio::time::timeout(Duration::from_secs(30), client.read(&mut chunk))
                .await
            {
                Ok(Ok(n)) if n > 0 => n,
                _ => return,
            };
            first.extend_from_slice(&chunk[..n]);
            match crate::sni::client_hello_sni(&first) {
                Some(Some(sni)) => {
                    if !sni.trim_end_matches('.').eq_ignore_ascii_case(&host) {
                        tracing::warn!(%host, %sni, "tunnel closed: SNI does not match CONNECT host");
                        return;
                    }
                    break;
                }
                Some(None) => break,
                // A TLS record still arriving: read on (a fragmented
                // ClientHello must not slip past the check).
                None if first[0] == 0x16 && first.len() < 16 * 1024 => continue,
                None if first[0] == 0x16 => return,
                None => break, // not TLS: host-level guarantee only
            }
        }
        if upstream.write_all(&first).await.is_err() {
            return;
        }
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    });
    Response::new(full(Bytes::new()))
}

/// Raw-head checks, made on the bytes before hyper normalises them (hyper
/// silently collapses identical duplicate `Content-Length`s and drops
/// `Content-Length` when `Transfer-Encoding` is present).
fn raw_head_check(head: &[u8]) -> Result<(), &'static str> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("request head too large"),
        Err(_) => return Err("malformed request head (obsolete line folding, bad characters)"),
    }
    let count = |name: &str| {
        req.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case(name))
            .count()
    };
    let (cl, te) = (count("content-length"), count("transfer-encoding"));
    if cl > 1 {
        return Err("more than one Content-Length");
    }
    if te > 1 {
        return Err("more than one Transfer-Encoding");
    }
    if cl > 0 && te > 0 {
        return Err("Transfer-Encoding together with Content-Length");
    }
    if count("host") > 1 {
        return Err("more than one Host");
    }
    Ok(())
}

const MAX_HEAD: usize = 64 * 1024;

/// Passes bytes through to hyper unchanged while keeping a copy of the first
/// request head (connections serve one request each) for [`raw_head_check`].
struct SniffIo {
    inner: TcpStream,
    head: Vec<u8>,
    done: bool,
    verdict: Arc<Mutex<Option<Result<(), &'static str>>>>,
}

impl AsyncRead for SniffIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if !this.done {
            if let Poll::Ready(Ok(())) = &r {
                let new = &buf.filled()[before..];
                let start = this.head.len().saturating_sub(3);
                this.head.extend_from_slice(new);
                let end = this.head[start..]
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map(|i| start + i + 4);
                let verdict = match end {
                    Some(end) => Some(raw_head_check(&this.head[..end])),
                    None if this.head.len() > MAX_HEAD => Some(Err("request head too large")),
                    None => None,
                };
                if let Some(v) = verdict {
                    *this.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
                    this.done = true;
                    this.head = Vec::new();
                }
            }
        }
        r
    }
}

impl AsyncWrite for SniffIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
