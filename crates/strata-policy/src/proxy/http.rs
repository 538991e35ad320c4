//! Stage 3, HTTP: the guest's stream served as an HTTP/1.1 proxy by
//! hyper, each request checked by the policy stage ([`super::decide`]) and
//! sent on by the upstream stage ([`super::upstream`]).
//!
//! Built on hyper 1.x rather than a hand-rolled parser: hyper (over
//! `httparse`) already refuses obsolete line folding, bad chunk framing,
//! differing duplicate `Content-Length`s and malformed request lines, and it
//! re-serialises every forwarded request, so bytes the guest sends are never
//! relayed verbatim to an upstream. hyper is lenient where RFC 9112 allows it
//! (it collapses identical duplicate `Content-Length`s and lets
//! `Transfer-Encoding` override `Content-Length`), so the proxy also checks
//! each request head on the raw bytes with `httparse` before hyper normalises
//! it ([`super::sniff::HeadCheck`]), and refuses any duplicate
//! `Content-Length` or `Transfer-Encoding`, both together, a
//! `Transfer-Encoding` other than `chunked`, duplicate `Host`, a `Host` that
//! disagrees with the absolute URL, and userinfo in the URL. A request
//! carrying a method override (`X-HTTP-Method-Override`, `X-HTTP-Method`,
//! `X-Method-Override`, a `_method` query parameter) is refused, and the
//! path is decoded strictly ([`crate::path::http_path`]) before policy sees
//! it: the canonical path that was matched is the one forwarded. Plain
//! client connections carry one request each (no keep-alive; an
//! intercepted TLS connection keeps alive and judges each request with
//! [`judge`], see [`super::intercept`]) and every forwarded
//! request uses a fresh upstream connection, so there is no connection on
//! which a desync could carry over to a next request.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::decide::{decide, record_cut, refuse_request, Checked, Verdict};
use super::sniff::{self, HeadCheck, Hello, MAX_HEAD};
use super::tunnel::Tunnel;
use super::upstream::{self, Upstream, UpstreamError};
use super::{intercept, Injected, ProxyConfig};
use crate::path::http_path;
use crate::policy::{looks_like_ip, parse_ip_literal, Decision};
use crate::secrets;

/// Default [`ProxyConfig::head_timeout`].
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves one admitted stream as an HTTP proxy connection (one request).
pub(super) async fn serve<S>(cfg: Arc<ProxyConfig>, tunnel: Tunnel, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let tunnel = Arc::new(tunnel);
    let head_timeout = cfg.head_timeout;
    let (io, verdict) = HeadCheck::new(stream);
    let svc = hyper::service::service_fn(move |req| {
        let raw = *verdict.lock().unwrap_or_else(|e| e.into_inner());
        handle(cfg.clone(), tunnel.clone(), raw, req)
    });
    let r = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(false)
        .header_read_timeout(head_timeout)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades()
        .await;
    if let Err(e) = r {
        tracing::debug!(error = %e, "egress proxy connection");
    }
}

/// Body of the proxy's answers.
pub(super) type Body = BoxBody<Bytes, hyper::Error>;

pub(super) fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub(super) fn refuse(status: StatusCode, error: &str, detail: serde_json::Value) -> Response<Body> {
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

pub(super) fn bad(msg: &str) -> Response<Body> {
    refuse(
        StatusCode::BAD_REQUEST,
        "bad_request",
        serde_json::json!({ "reason": msg }),
    )
}

pub(super) fn denied(d: &Decision, approval_id: Option<&str>) -> Response<Body> {
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
pub(super) fn smuggling_check(h: &HeaderMap) -> Result<(), &'static str> {
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

/// Split and check an authority (`host[:port]`), lower-casing the host. A
/// canonical IP literal (`203.0.113.7`, `[2001:db8::1]`) comes back as the
/// address's text (IPv6 without brackets, IPv4-mapped IPv6 as IPv4), for
/// the policy stage's address rules; other numeric forms (`127.1`,
/// `0x7f.0.0.1`, `2130706433`) are refused as `IP literal`.
pub(super) fn parse_authority(
    a: &str,
    default_port: Option<u16>,
) -> Result<(String, u16), &'static str> {
    if a.contains('@') {
        return Err("userinfo in the request target");
    }
    if let Some(rest) = a.strip_prefix('[') {
        let (inner, after) = rest.split_once(']').ok_or("bad IPv6 literal")?;
        let ip = parse_ip_literal(inner).ok_or("bad IPv6 literal")?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse::<u16>().map_err(|_| "bad port")?,
            None if after.is_empty() => default_port.ok_or("port required")?,
            None => return Err("bad IPv6 literal"),
        };
        if port == 0 {
            return Err("bad port");
        }
        return Ok((ip.to_string(), port));
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
        // Only the canonical dotted quad names an address.
        return match parse_ip_literal(&host) {
            Some(ip) if ip.to_string() == host => Ok((host, port)),
            _ => Err("IP literal"),
        };
    }
    if !crate::policy::is_host_name(&host) {
        return Err("not a host name");
    }
    Ok((host, port))
}

/// Connects the upstream of an allowed call, or the answer to give instead.
pub(super) async fn upstream_for(
    cfg: &ProxyConfig,
    tunnel: &Tunnel,
    c: &Checked,
) -> Result<Upstream, Response<Body>> {
    upstream::connect(&*cfg.resolver, cfg.connect_timeout, tunnel, &c.host, c.port)
        .await
        .map_err(|e| match e {
            UpstreamError::Busy(why) => refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "egress_busy",
                serde_json::json!({ "reason": why.to_string() }),
            ),
            UpstreamError::Unreachable(why) => refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                serde_json::json!({ "reason": why }),
            ),
        })
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

/// Headers some frameworks read as the request's "real" method.
const METHOD_OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Percent-decodes a query parameter name (`+` is a space); `None` when it
/// does not decode.
fn query_name(name: &str) -> Option<String> {
    let b = name.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = b.get(i + 1..i + 3)?;
                if !h.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Why a request asks for another method than its own, if it does: an
/// override header, or a `_method` query parameter (in any encoding).
fn method_override(h: &HeaderMap, query: Option<&str>) -> Option<String> {
    if let Some(name) = METHOD_OVERRIDE_HEADERS.iter().find(|n| h.contains_key(**n)) {
        return Some(format!(
            "method override header `{name}` refused: the proxy decides on the request's own method"
        ));
    }
    let query = query?;
    let hit = query.split(['&', ';']).any(|pair| {
        let name = pair.split('=').next().unwrap_or("");
        query_name(name).is_none_or(|n| n.trim().eq_ignore_ascii_case("_method"))
    });
    hit.then(|| {
        "method override query parameter `_method` refused (or a parameter name that does not decode): the proxy decides on the request's own method".to_string()
    })
}

pub(super) fn strip_hop_by_hop(h: &mut HeaderMap) {
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
    tunnel: Arc<Tunnel>,
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
        return Ok(connect_tunnel(cfg, tunnel, req).await);
    }
    Ok(forward(cfg, tunnel, req).await)
}

/// The policy stage of one request, the same for plain HTTP and for a
/// request read inside an intercepted TLS connection (`tls`): a method
/// override refused, the path decoded strictly, the call decided
/// ([`decide`]). On `Ok`, the call and the canonical path-and-query to
/// forward (the one policy matched).
pub(super) async fn judge(
    cfg: &ProxyConfig,
    host: String,
    port: u16,
    tls: bool,
    parts: &hyper::http::request::Parts,
) -> Result<(Checked, String), Response<Body>> {
    let scheme = if tls { "https" } else { "http" };
    let method = parts.method.as_str().to_string();
    let uri = &parts.uri;
    // The call as the guest sent it, for a refusal before the path is read.
    let raw = |host: String| {
        Checked::new(
            cfg,
            host,
            port,
            &method,
            uri.path().to_string(),
            scheme,
            tls,
        )
    };
    if let Some(why) = method_override(&parts.headers, uri.query()) {
        let mut c = raw(host);
        return Err(refuse_request(
            cfg,
            &mut c,
            StatusCode::BAD_REQUEST,
            "method_override",
            "method-override",
            why,
        ));
    }
    // Policy matches the decoded path and the upstream gets the same path.
    let path = match http_path(uri.path()) {
        Ok(p) => p,
        Err(e) => {
            let mut c = raw(host);
            return Err(refuse_request(
                cfg,
                &mut c,
                StatusCode::BAD_REQUEST,
                "bad_path",
                "path-refused",
                format!("{e}; the proxy forwards only paths it can match as the server reads them"),
            ));
        }
    };
    let mut c = Checked::new(
        cfg,
        host,
        port,
        &method,
        path.canonical.clone(),
        scheme,
        tls,
    );
    if let Verdict::Refuse(r) = decide(cfg, &mut c).await {
        return Err(r);
    }
    let pq = match uri.query() {
        Some(q) => format!("{}?{q}", path.canonical),
        None => path.canonical,
    };
    Ok((c, pq))
}

/// Runs the configured [`super::RequestHook`] on an allowed request, just
/// before it goes upstream; its refusal (audited) is the answer `403
/// egress_hook_refused` returned as `Err`; `Ok` lets the request go with
/// what the hook injected.
pub(super) async fn run_hook(
    cfg: &ProxyConfig,
    c: &Checked,
    parts: &mut hyper::http::request::Parts,
) -> Result<Injected, Response<Body>> {
    let Some(h) = cfg.request_hook.as_ref() else {
        return Ok(Injected::default());
    };
    match h.before_upstream(&c.call, parts).await {
        Ok(i) => Ok(i),
        Err(why) => {
            record_cut(cfg, &c.call, "request-hook", why.clone());
            Err(refuse(
                StatusCode::FORBIDDEN,
                "egress_hook_refused",
                serde_json::json!({ "rule": "request-hook", "reason": why }),
            ))
        }
    }
}

/// The upstream's answer as given to the guest: hop-by-hop headers
/// removed and, when secrets were injected, their values stripped from the
/// headers and from a body of at most [`secrets::STRIP_BODY_MAX`] bytes
/// that is neither compressed nor an event stream (`docs/secrets.md`).
pub(super) async fn answer(resp: Response<Incoming>, inj: &Injected) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Some(f) = &inj.on_status {
        f(parts.status.as_u16());
    }
    if inj.strip.is_empty() {
        return Response::from_parts(parts, body.boxed());
    }
    secrets::strip_headers(&mut parts.headers, &inj.strip);
    let encoded = parts
        .headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let stream = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let len = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if encoded || stream || len.is_some_and(|l| l > secrets::STRIP_BODY_MAX) {
        return Response::from_parts(parts, body.boxed());
    }
    // Read up to the bound; a longer body passes unchanged after it.
    let mut body = body;
    let mut buf = bytes::BytesMut::new();
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "upstream body");
                return refuse(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    serde_json::json!({ "reason": e.to_string() }),
                );
            }
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
                if buf.len() > secrets::STRIP_BODY_MAX {
                    let head = buf.freeze();
                    let rest = body.boxed();
                    return Response::from_parts(parts, Prefixed::new(head, rest).boxed());
                }
            }
        }
    }
    let whole = buf.freeze();
    match secrets::strip_body(&whole, &inj.strip) {
        // Unchanged (an empty body of a HEAD or 304 among them): the
        // upstream's framing headers stay as they were.
        None => Response::from_parts(parts, full(whole)),
        Some(out) => {
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(out.len()));
            Response::from_parts(parts, full(out))
        }
    }
}

/// A body that yields `head` and then `rest`.
struct Prefixed {
    head: Option<Bytes>,
    rest: Body,
}

impl Prefixed {
    fn new(head: Bytes, rest: Body) -> Self {
        Prefixed {
            head: Some(head),
            rest,
        }
    }
}

impl hyper::body::Body for Prefixed {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        if let Some(h) = self.head.take() {
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(h))));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }
}

async fn forward(
    cfg: Arc<ProxyConfig>,
    tunnel: Arc<Tunnel>,
    req: Request<Incoming>,
) -> Response<Body> {
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
    // The MCP gateway answers its own host; nothing is forwarded as is.
    if host == super::mcp::HOST && port == 80 {
        if let Some(g) = &cfg.mcp {
            return g.clone().serve(cfg.clone(), req).await;
        }
    }
    let (mut parts, body) = req.into_parts();
    let (c, pq) = match judge(&cfg, host, port, false, &parts).await {
        Ok(j) => j,
        Err(r) => return r,
    };
    parts.uri = match pq.parse() {
        Ok(u) => u,
        Err(_) => return bad("bad path"),
    };
    let inj = match run_hook(&cfg, &c, &mut parts).await {
        Ok(i) => i,
        Err(r) => return r,
    };
    let up = match upstream_for(&cfg, &tunnel, &c).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let slot = up.slot;
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(up.sock)).await {
            Ok(x) => x,
            Err(e) => {
                return refuse(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    serde_json::json!({ "reason": e.to_string() }),
                )
            }
        };
    // The upstream socket (and its host unit) lives as long as this task.
    tokio::spawn(async move {
        let _ = conn.await;
        drop(slot);
    });
    strip_hop_by_hop(&mut parts.headers);
    let out = Request::from_parts(parts, body);
    match sender.send_request(out).await {
        Ok(resp) => answer(resp, &inj).await,
        Err(e) => refuse(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            serde_json::json!({ "reason": e.to_string() }),
        ),
    }
}

async fn connect_tunnel(
    cfg: Arc<ProxyConfig>,
    tunnel: Arc<Tunnel>,
    mut req: Request<Incoming>,
) -> Response<Body> {
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
    // A connector host on one of its TLS ports, under interception: the
    // tunnel is terminated and every request inside judged like a plain one.
    if let Some(ic) = intercept::applies(&cfg, &host, port) {
        return intercept::connect(cfg, tunnel, req, ic, host, port);
    }
    let mut c = Checked::new(&cfg, host, port, "CONNECT", String::new(), "https", false);
    if let Verdict::Refuse(r) = decide(&cfg, &mut c).await {
        return r;
    }
    let mut up = match upstream_for(&cfg, &tunnel, &c).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let Checked {
        call,
        host,
        port,
        tls_port,
    } = c;
    let head_timeout = cfg.head_timeout;
    let idle_timeout = cfg.tunnel_idle_timeout;
    tokio::spawn(async move {
        // The guest's stream stays admitted while the tunnel runs.
        let _tunnel = tunnel;
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "CONNECT upgrade");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        // No fronting to another name on a shared IP.
        let cut = |rule: &str, reason: String| {
            tracing::warn!(host = %strata_core::text::Escaped(&host), reason = %strata_core::text::Escaped(&reason), "tunnel closed");
            record_cut(&cfg, &call, rule, reason);
        };
        let first = match sniff::client_hello(&mut client, &host, tls_port, head_timeout).await {
            Hello::Pass(first) => first,
            Hello::Mismatch(sni) => {
                return cut(
                    "tunnel-sni",
                    format!("the ClientHello names {sni:?}, not the CONNECT host `{host}`"),
                )
            }
            Hello::NoSni => {
                return cut(
                    "tunnel-sni",
                    format!("the ClientHello names no server (SNI); a tunnel to `{host}` must name it"),
                )
            }
            Hello::NotTls => {
                return cut(
                    "tunnel-not-tls",
                    format!("port {port} of `{host}` is a TLS port (`tls_ports`) and the tunnel does not start with a TLS ClientHello"),
                )
            }
            Hello::Closed => return,
        };
        if up.sock.write_all(&first).await.is_err() {
            return;
        }
        if upstream::splice(&mut client, up, idle_timeout).await == upstream::SpliceEnd::Idle {
            tracing::info!(%host, idle_s = idle_timeout.as_secs(), "tunnel closed: idle");
        }
    });
    Response::new(full(Bytes::new()))
}
