//! Stage 3b, TLS interception of connector hosts (`docs/tls-interception.md`).
//!
//! A `CONNECT` to a host the sandbox's policy names as a connector (platform
//! or tenant layer, `intercept` not turned off), on one of the connector's
//! `ports` that is also a `tls_ports` entry, or a TLS ClientHello sent to
//! the proxy without `CONNECT` whose SNI names such a host (port 443), is
//! not spliced: the proxy
//!
//! 1. checks that the ClientHello names the `CONNECT` host (as for any
//!    tunnel, [`super::sniff::client_hello`]);
//! 2. terminates TLS with a leaf for that host issued by the deployment's
//!    interception CA ([`LeafIssuer`], cached by the issuer), ALPN offering
//!    `http/1.1` only: a client that offers only `h2` fails the handshake
//!    (`no_application_protocol`), one that speaks HTTP/2 with prior
//!    knowledge is closed, both audited (`tls-h2-only`);
//! 3. serves HTTP/1.1 inside with keep-alive: every request on the
//!    connection goes through [`super::http::judge`], the same method,
//!    path, override and framing rules as a plain-HTTP request, and is
//!    audited like one (method, path) with `tls: true`; `Upgrade` requests
//!    are refused (`tls-upgrade`: the protocol after an upgrade cannot be
//!    judged);
//! 4. runs the [`super::RequestHook`] on the allowed request, then sends it
//!    upstream over TLS it originates itself, verified against the system
//!    roots plus the configured bundle ([`Interception::new`]); a
//!    certificate that does not verify refuses the request (`502
//!    upstream_tls`, audited `upstream-tls` with the reason). One upstream
//!    connection per guest connection, reused while it stays open.
//!
//! A connector host with interception off, every other host, and every
//! sandbox whose proxy has no [`Interception`] keep `CONNECT`-by-name
//! tunnels (host-level policy only).

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use super::decide::{record_cut, refuse_request, Checked};
use super::http::{
    answer, bad, full, judge, parse_authority, refuse, run_hook, smuggling_check, strip_hop_by_hop,
    upstream_for, Body,
};
use super::sniff::{self, Hello, Rewind, MAX_HEAD};
use super::tunnel::Tunnel;
use super::upstream::Upstream;
use super::ProxyConfig;
use crate::call::{CallKind, ToolCall};
use crate::policy::parse_ip_literal;

/// Issues the certificate the proxy shows the guest for an intercepted
/// host: a leaf for exactly that name, signed by the deployment's
/// interception CA. Implementations cache (with a bound); the daemon's is
/// `stratad::tls::LeafCache`.
pub trait LeafIssuer: Send + Sync {
    /// The leaf (chain and key) for `host` (lower case, no trailing dot),
    /// or `None` when none can be issued (the connection is closed).
    fn leaf(&self, host: &str) -> Option<Arc<CertifiedKey>>;
}

/// Why interception could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum InterceptError {
    /// rustls refused a configuration or a certificate.
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The extra upstream bundle could not be read or holds no certificate.
    #[error("{path}: {reason}")]
    Bundle {
        /// The bundle file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No root to verify upstreams with (no system roots, no bundle).
    #[error("no trusted roots for upstream TLS (system store empty and no bundle)")]
    NoRoots,
}

/// Interception for one deployment: the leaves shown to guests and the
/// trust upstream certificates are verified against.
pub struct Interception {
    leaves: Arc<dyn LeafIssuer>,
    upstream: Arc<rustls::ClientConfig>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception").finish_non_exhaustive()
    }
}

impl Interception {
    /// Leaves from `leaves`; upstreams verified against the system's roots
    /// (when `system_roots`) plus every certificate of `extra`.
    pub fn new(
        leaves: Arc<dyn LeafIssuer>,
        system_roots: bool,
        extra: Vec<CertificateDer<'static>>,
    ) -> Result<Interception, InterceptError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        if system_roots {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "loading a system root certificate");
            }
            roots.add_parsable_certificates(found.certs);
        }
        for c in extra {
            roots.add(c)?;
        }
        if roots.is_empty() {
            return Err(InterceptError::NoRoots);
        }
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Interception {
            leaves,
            upstream: Arc::new(cfg),
            provider,
        })
    }

    /// The server side shown to the guest for one host: its leaf, ALPN
    /// `http/1.1` only.
    fn server_config(
        &self,
        leaf: Arc<CertifiedKey>,
    ) -> Result<rustls::ServerConfig, rustls::Error> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneLeaf(leaf)));
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(cfg)
    }
}

/// Reads a PEM bundle of CA certificates (the configured extra upstream
/// trust).
pub fn load_bundle(path: &Path) -> Result<Vec<CertificateDer<'static>>, InterceptError> {
    use rustls::pki_types::pem::PemObject as _;
    let err = |reason: String| InterceptError::Bundle {
        path: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("bad PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(err("no certificate in it".into()));
    }
    Ok(certs)
}

/// The one leaf of an intercepted connection, whatever the SNI (already
/// checked to name the host).
#[derive(Debug)]
struct OneLeaf(Arc<CertifiedKey>);

impl ResolvesServerCert for OneLeaf {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// Interception for `host:port` in this sandbox's proxy, if it applies:
/// the proxy intercepts, `host` is a name (not an address literal) that a
/// connector of the sandbox's policy names with interception on, and
/// `port` is one of that connector's `ports` and `tls_ports`.
pub(super) fn applies(cfg: &ProxyConfig, host: &str, port: u16) -> Option<Arc<Interception>> {
    let ic = cfg.intercept.as_ref()?;
    if parse_ip_literal(host).is_some() {
        return None;
    }
    let policy = cfg.policy.current();
    let c = policy.connector_for_host(host)?;
    (c.intercept && c.ports.contains(&port) && c.tls_ports.contains(&port)).then(|| ic.clone())
}

/// The call an intercepted connection is audited as when it is cut before
/// any request (its connector named).
fn connection_call(cfg: &ProxyConfig, host: &str, port: u16) -> ToolCall {
    let mut c = Checked::new(
        cfg,
        host.into(),
        port,
        "CONNECT",
        String::new(),
        "https",
        true,
    );
    let policy = cfg.policy.current();
    if let CallKind::Egress { connector, .. } = &mut c.call.kind {
        *connector = policy.connector_for_host(host).map(|c| c.name.clone());
    }
    c.call
}

/// Answers an intercepted `CONNECT` (`200`) and serves the tunnel it opens.
pub(super) fn connect(
    cfg: Arc<ProxyConfig>,
    tunnel: Arc<Tunnel>,
    mut req: Request<Incoming>,
    ic: Arc<Interception>,
    host: String,
    port: u16,
) -> Response<Body> {
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(error = %e, "CONNECT upgrade");
                return;
            }
        };
        let mut client = TokioIo::new(upgraded);
        let cut = |rule: &str, reason: String| {
            tracing::warn!(host = %strata_core::text::Escaped(&host), reason = %strata_core::text::Escaped(&reason), "intercepted tunnel closed");
            record_cut(&cfg, &connection_call(&cfg, &host, port), rule, reason);
        };
        match sniff::client_hello(&mut client, &host, true, cfg.head_timeout).await {
            Hello::Pass(first) => {
                let stream = Rewind::new(first, client);
                serve_tls(cfg.clone(), tunnel, stream, ic, host.clone(), port).await
            }
            Hello::Mismatch(sni) => cut(
                "tunnel-sni",
                format!("the ClientHello names {sni:?}, not the CONNECT host `{host}`"),
            ),
            Hello::NoSni => cut(
                "tunnel-sni",
                format!("the ClientHello names no server (SNI); a tunnel to `{host}` must name it"),
            ),
            Hello::NotTls => cut(
                "tunnel-not-tls",
                format!("port {port} of `{host}` is a TLS port (`tls_ports`) and the tunnel does not start with a TLS ClientHello"),
            ),
            Hello::Closed => {}
        }
    });
    Response::new(full(Bytes::new()))
}

/// The `rustls::Error` inside an I/O error of a handshake, if any.
fn rustls_error(e: &std::io::Error) -> Option<&rustls::Error> {
    e.get_ref()?.downcast_ref::<rustls::Error>()
}

/// An HTTP/2 client with prior knowledge opens with this.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// Terminates the guest's TLS for `host` (its ClientHello at the start of
/// `stream`) and serves the HTTP/1.1 requests inside, each judged.
pub(super) async fn serve_tls<S>(
    cfg: Arc<ProxyConfig>,
    tunnel: Arc<Tunnel>,
    stream: S,
    ic: Arc<Interception>,
    host: String,
    port: u16,
) where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let cut = |rule: &str, reason: String| {
        tracing::info!(host = %strata_core::text::Escaped(&host), reason = %strata_core::text::Escaped(&reason), "intercepted connection closed");
        record_cut(&cfg, &connection_call(&cfg, &host, port), rule, reason);
    };
    let Some(leaf) = ic.leaves.leaf(&host) else {
        return cut(
            "tls-leaf",
            format!("no interception certificate could be issued for `{host}`"),
        );
    };
    let server = match ic.server_config(leaf) {
        Ok(s) => s,
        Err(e) => return cut("tls-leaf", format!("TLS server configuration: {e}")),
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let mut tls = match tokio::time::timeout(cfg.head_timeout, acceptor.accept(stream)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            return match rustls_error(&e) {
                Some(rustls::Error::NoApplicationProtocol) => cut(
                    "tls-h2-only",
                    format!("the client offers no ALPN protocol the proxy speaks: connections to connector host `{host}` are intercepted and only HTTP/1.1 (ALPN http/1.1) is served; an HTTP/2-only client cannot reach it"),
                ),
                _ => cut(
                    "tls-handshake",
                    format!("the guest's TLS handshake for `{host}` failed: {e} (a client that does not trust the deployment's interception CA, or pins certificates, fails here)"),
                ),
            };
        }
        Err(_) => return,
    };
    // HTTP/2 with prior knowledge (no ALPN): refused with a reason on the
    // audit log rather than a parse error.
    let mut first = vec![0u8; 4096];
    let n = match tokio::time::timeout(cfg.head_timeout, tls.read(&mut first)).await {
        Ok(Ok(n)) if n > 0 => n,
        _ => return,
    };
    first.truncate(n);
    if first.starts_with(&H2_PREFACE[..first.len().min(H2_PREFACE.len())]) && first.len() >= 3 {
        return cut(
            "tls-h2-only",
            format!("the client speaks HTTP/2 to connector host `{host}`; interception serves HTTP/1.1 only"),
        );
    }
    let io = Rewind::new(first, tls);
    let upstream: Arc<tokio::sync::Mutex<Option<SendRequest<Body>>>> = Arc::default();
    let head_timeout = cfg.head_timeout;
    let svc = hyper::service::service_fn(move |req| {
        request(
            cfg.clone(),
            tunnel.clone(),
            ic.clone(),
            upstream.clone(),
            host.clone(),
            port,
            req,
        )
    });
    let r = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(head_timeout)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(io), svc)
        .await;
    if let Err(e) = r {
        tracing::debug!(error = %e, "intercepted connection");
    }
}

/// One request inside an intercepted connection to `host:port`.
async fn request(
    cfg: Arc<ProxyConfig>,
    tunnel: Arc<Tunnel>,
    ic: Arc<Interception>,
    upstream: Arc<tokio::sync::Mutex<Option<SendRequest<Body>>>>,
    host: String,
    port: u16,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    if let Err(why) = smuggling_check(req.headers()) {
        return Ok(bad(why));
    }
    if req.method() == Method::CONNECT {
        return Ok(bad("CONNECT inside an intercepted connection"));
    }
    let target = (host.clone(), port);
    if let Some(a) = req.uri().authority() {
        if req.uri().scheme_str() != Some("https")
            || parse_authority(a.as_str(), Some(443)).ok().as_ref() != Some(&target)
        {
            return Ok(bad(
                "the request URL names another host than the connection",
            ));
        }
    }
    match req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(|h| parse_authority(h, Some(443)))
    {
        Some(Ok(hp)) if hp == target => {}
        Some(_) => return Ok(bad("Host header disagrees with the intercepted host")),
        None => return Ok(bad("missing Host header")),
    }
    let (mut parts, body) = req.into_parts();
    if parts.headers.contains_key(header::UPGRADE) {
        let mut c = Checked::new(
            &cfg,
            host,
            port,
            parts.method.as_str(),
            parts.uri.path().to_string(),
            "https",
            true,
        );
        return Ok(refuse_request(
            &cfg,
            &mut c,
            StatusCode::FORBIDDEN,
            "upgrade_refused",
            "tls-upgrade",
            "`Upgrade` refused on an intercepted connection: the proxy judges HTTP/1.1 requests and cannot judge the protocol after an upgrade (websocket, h2c)".into(),
        ));
    }
    let (c, pq) = match judge(&cfg, host, port, true, &parts).await {
        Ok(j) => j,
        Err(r) => return Ok(r),
    };
    parts.uri = match pq.parse() {
        Ok(u) => u,
        Err(_) => return Ok(bad("bad path")),
    };
    let inj = match run_hook(&cfg, &c, &mut parts).await {
        Ok(i) => i,
        Err(r) => return Ok(r),
    };
    strip_hop_by_hop(&mut parts.headers);
    let mut up = upstream.lock().await;
    let fresh = match up.as_mut() {
        Some(s) => s.ready().await.is_err(),
        None => true,
    };
    if fresh {
        *up = None;
        match open_upstream(&cfg, &tunnel, &ic, &c).await {
            Ok(s) => *up = Some(s),
            Err(r) => return Ok(*r),
        }
    }
    let Some(sender) = up.as_mut() else {
        return Ok(bad("no upstream"));
    };
    match sender
        .send_request(Request::from_parts(parts, body.boxed()))
        .await
    {
        Ok(resp) => {
            // The upstream connection is free again once the head is in.
            drop(up);
            Ok(answer(resp, &inj).await)
        }
        Err(e) => {
            *up = None;
            Ok(refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                serde_json::json!({ "reason": e.to_string() }),
            ))
        }
    }
}

/// Opens the verified TLS connection to an intercepted upstream.
async fn open_upstream(
    cfg: &ProxyConfig,
    tunnel: &Tunnel,
    ic: &Interception,
    c: &Checked,
) -> Result<SendRequest<Body>, Box<Response<Body>>> {
    let Upstream { sock, slot } = upstream_for(cfg, tunnel, c).await.map_err(Box::new)?;
    let name =
        ServerName::try_from(c.host.clone()).map_err(|_| Box::new(bad("not a TLS server name")))?;
    let connector = tokio_rustls::TlsConnector::from(ic.upstream.clone());
    let tls = match tokio::time::timeout(cfg.connect_timeout, connector.connect(name, sock)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            let reason = format!(
                "TLS to `{}:{}` refused: {e}; an intercepted upstream must present a certificate for its name that verifies against the system roots or the configured bundle",
                c.host, c.port
            );
            record_cut(cfg, &c.call, "upstream-tls", reason.clone());
            return Err(Box::new(refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_tls",
                serde_json::json!({ "rule": "upstream-tls", "reason": reason }),
            )));
        }
        Err(_) => {
            return Err(Box::new(refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                serde_json::json!({ "reason": "TLS handshake with the upstream timed out" }),
            )))
        }
    };
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| {
            Box::new(refuse(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                serde_json::json!({ "reason": e.to_string() }),
            ))
        })?;
    // The upstream socket (and its host unit) lives as long as this task.
    tokio::spawn(async move {
        let _ = conn.await;
        drop(slot);
    });
    Ok(sender)
}
