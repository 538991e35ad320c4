//! HTTP egress proxy: the only way out of a sandbox.
//!
//! One [`Egress`] per sandbox serves every stream its guest opens, in
//! process: the daemon hands it each tunnel's byte stream
//! ([`Egress::open_stream`]), so there is no listener a local user (or
//! another guest) could reach. A stream goes through four stages, each a
//! module later work extends:
//!
//! 1. [`tunnel`]: admission under the caps (streams per sandbox, units per
//!    host, a token bucket on opens); a refusal closes that stream only.
//! 2. [`sniff`]: what the stream starts with (TLS ClientHello or HTTP), the
//!    raw-byte checks on the request head, the SNI of a `CONNECT` tunnel.
//! 3. [`http`] and [`decide`]: hyper serving the proxy request, and the
//!    policy evaluation (connectors, rules, approvals, audit).
//! 4. [`upstream`]: resolving, connecting (one host unit per socket),
//!    splicing.
//!
//! Plain HTTP requests get method-level policy; `CONNECT` tunnels get
//! host-level policy only (see `docs/policy.md`), except to a connector
//! host under interception ([`intercept`], `docs/tls-interception.md`):
//! there the proxy terminates TLS and every request inside is judged like
//! a plain one.
//!
//! The place to change an allowed request before it leaves (a secrets
//! broker injecting a credential, replacing a placeholder) is
//! [`RequestHook`]: called once per request after the policy decision and
//! before the request is sent upstream, plain HTTP and intercepted HTTPS
//! alike (never for an opaque `CONNECT` tunnel: there is no request to
//! change). The ClientHello's SNI of a
//! tunnel must name the `CONNECT` host. [`EgressProxy`] serves the same on
//! a TCP listener, for tests and tools.

pub mod decide;
pub mod http;
pub mod intercept;
pub mod mcp;
pub mod sniff;
pub mod tunnel;
pub mod upstream;

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio::net::TcpListener;

use crate::approval::ApprovalQueue;
use crate::audit::AuditLog;
use crate::policy::PolicySet;

pub use intercept::{InterceptError, Interception, LeafIssuer};
pub use sniff::Sniffed;
pub use tunnel::{HostTunnels, Refused, Tunnel, TunnelLimits, TunnelStats};
pub use upstream::{RangeResolver, ResolveFuture, Resolver, StaticResolver, SystemResolver};

/// Bytes buffered per direction between a tunnel's pump and the proxy.
pub const STREAM_BUFFER: usize = 64 * 1024;

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

/// What a [`RequestHook`] did to a request: the secrets it put on it (for
/// the log) and the byte strings to strip from the answer.
#[derive(Clone, Default)]
pub struct Injected {
    /// Names of the secrets injected.
    pub secrets: Vec<String>,
    /// Values (and encoded forms) to replace in the answer's headers and
    /// body ([`crate::secrets::strip_headers`], [`crate::secrets::strip_body`]).
    pub strip: Vec<Vec<u8>>,
    /// Called with the upstream's status (a broker refreshes an OAuth2
    /// token the upstream refused with `401`).
    pub on_status: Option<Arc<dyn Fn(u16) + Send + Sync>>,
}

impl std::fmt::Debug for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values.
        f.debug_struct("Injected")
            .field("secrets", &self.secrets)
            .finish_non_exhaustive()
    }
}

/// Future of [`RequestHook::before_upstream`].
pub type HookFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Injected, String>> + Send + 'a>>;

/// Changes (or refuses) an allowed request just before it is sent upstream:
/// the step a secrets broker plugs into (inject a header, replace a
/// placeholder the guest sent). Called after the policy decision (and any
/// approval), on the request as it will be forwarded (its URI the
/// canonical path and query policy matched): hop-by-hop headers are
/// stripped after it. Not called for opaque `CONNECT` tunnels.
pub trait RequestHook: Send + Sync {
    /// The names (comma-separated) of the secrets [`Self::before_upstream`]
    /// would inject on `call`, recorded in the audit entry of an allowed
    /// call (`secret`); `None` when none.
    fn secrets_for(&self, call: &crate::call::ToolCall) -> Option<String> {
        let _ = call;
        None
    }

    /// Edit `req` for `call` (its connector resolved, `tls` set when the
    /// request was read inside an intercepted connection); `Err(reason)`
    /// refuses it (`403 egress_hook_refused`, audited with `reason`).
    fn before_upstream<'a>(
        &'a self,
        call: &'a crate::call::ToolCall,
        req: &'a mut hyper::http::request::Parts,
    ) -> HookFuture<'a>;

    /// The value of tenant `tenant`'s secret `name` bound to connector
    /// `connector` (an OAuth2 secret's current access token), for a
    /// `strata:secret/<name>` placeholder in an MCP connector's headers or
    /// environment (`docs/mcp.md`); `Ok(None)` when there is no such
    /// secret. The default knows none.
    fn secret_value<'a>(
        &'a self,
        tenant: &'a str,
        connector: &'a str,
        name: &'a str,
    ) -> SecretFuture<'a> {
        let _ = (tenant, connector, name);
        Box::pin(async { Ok(None) })
    }
}

/// Future of [`RequestHook::secret_value`].
pub type SecretFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Option<String>, String>> + Send + 'a>,
>;

/// Everything one sandbox's proxy needs (one [`Egress`] per sandbox, so it
/// knows whose calls it sees).
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
    /// The host's tunnel counters and caps, shared by every sandbox's proxy.
    pub host: Arc<HostTunnels>,
    /// How long a stream may take to send its first bytes and its request
    /// head (and a `CONNECT` tunnel its first bytes) before it is closed.
    pub head_timeout: Duration,
    /// A `CONNECT` tunnel in which no byte moves either way for this long
    /// is closed (its stream, host unit and sockets given back).
    pub tunnel_idle_timeout: Duration,
    /// TLS interception of connector hosts (the deployment's CA and the
    /// upstream trust); `None`: connector hosts are `CONNECT`-by-name
    /// tunnels like any other.
    pub intercept: Option<Arc<Interception>>,
    /// Called on every allowed request before it goes upstream.
    pub request_hook: Option<Arc<dyn RequestHook>>,
    /// The MCP gateway answering `http://mcp.strata.internal/<connector>/mcp`
    /// (`docs/mcp.md`); `None`: that host is like any other (no connector
    /// names it, so refused).
    pub mcp: Option<Arc<mcp::McpGateway>>,
}

impl ProxyConfig {
    /// A configuration with the system resolver, no approvals, no audit,
    /// and host counters of its own under the default [`TunnelLimits`].
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
            host: HostTunnels::new(TunnelLimits::default()),
            head_timeout: http::HEAD_TIMEOUT,
            tunnel_idle_timeout: TUNNEL_IDLE_TIMEOUT,
            intercept: None,
            request_hook: None,
            mcp: None,
        }
    }
}

/// Default [`ProxyConfig::tunnel_idle_timeout`]: like common forward
/// proxies' read timeouts, long enough for a quiet long-poll or websocket.
pub const TUNNEL_IDLE_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// One sandbox's egress proxy, served on the streams handed to it.
pub struct Egress {
    cfg: Arc<ProxyConfig>,
    tunnels: tunnel::SandboxTunnels,
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress")
            .field("tenant", &self.cfg.tenant)
            .field("sandbox", &self.cfg.sandbox)
            .field("tunnels", &self.tunnels.stats())
            .finish()
    }
}

impl Egress {
    /// The proxy of `cfg`'s sandbox.
    pub fn new(cfg: ProxyConfig) -> Arc<Egress> {
        let tunnels = tunnel::SandboxTunnels::new(cfg.host.clone());
        Arc::new(Egress {
            cfg: Arc::new(cfg),
            tunnels,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.cfg
    }

    /// Stage 1: admits one stream under the caps, or says why not.
    pub fn admit(&self) -> Result<Tunnel, Refused> {
        self.tunnels.admit()
    }

    /// Stages 2–4 on an admitted stream, until the guest's connection is
    /// done (the stream's place under the caps is given back then).
    pub async fn serve<S>(self: Arc<Self>, tunnel: Tunnel, stream: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        match sniff::sniff(stream, self.cfg.head_timeout).await {
            Sniffed::Http(s) => http::serve(self.cfg.clone(), tunnel, s).await,
            Sniffed::Tls { sni, stream } => {
                // TLS without CONNECT: only a connector host under
                // interception is served (on its TLS port 443).
                let hit = sni.as_deref().and_then(|h| {
                    let h = h.trim_end_matches('.').to_ascii_lowercase();
                    intercept::applies(&self.cfg, &h, 443).map(|ic| (ic, h))
                });
                match hit {
                    Some((ic, host)) => {
                        intercept::serve_tls(
                            self.cfg.clone(),
                            Arc::new(tunnel),
                            stream,
                            ic,
                            host,
                            443,
                        )
                        .await
                    }
                    None => tracing::info!(
                        sandbox = ?self.cfg.sandbox,
                        ?sni,
                        "egress stream closed: TLS without CONNECT to a host that is not intercepted"
                    ),
                }
            }
            Sniffed::Closed => {}
        }
    }

    /// Admits a stream and serves it in a task of its own; returns the
    /// guest's end of an in-process duplex ([`STREAM_BUFFER`] per
    /// direction) to pump the tunnel into.
    pub fn open_stream(self: &Arc<Self>) -> Result<DuplexStream, Refused> {
        let t = self.admit()?;
        let (guest, proxy) = tokio::io::duplex(STREAM_BUFFER);
        tokio::spawn(self.clone().serve(t, proxy));
        Ok(guest)
    }

    /// Counts and caps of this sandbox's streams.
    pub fn stats(&self) -> TunnelStats {
        self.tunnels.stats()
    }
}

/// A proxy on a TCP listener (tests, tools; the daemon serves
/// [`Egress::open_stream`] instead). Accepted connections go through the
/// same caps.
pub struct EgressProxy {
    addr: SocketAddr,
    egress: Arc<Egress>,
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
        let egress = Egress::new(cfg);
        let e = egress.clone();
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
                match e.admit() {
                    Ok(t) => {
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(e.clone().serve(t, stream));
                    }
                    Err(why) => tracing::debug!(%why, "egress connection refused"),
                }
            }
        });
        Ok(EgressProxy { addr, egress, task })
    }

    /// The address the proxy listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy behind the listener.
    pub fn egress(&self) -> &Arc<Egress> {
        &self.egress
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
