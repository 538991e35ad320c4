//! Policy layers, their composition and evaluation of tool calls.
//!
//! Precedence (see `docs/policy.md`):
//! 1. **Hard rules** — every rule of the platform layer, and rules marked
//!    `hard = true` in the tenant or sandbox layer, plus the implicit write
//!    block of a `read_only` connector. Each layer's first matching hard rule
//!    gives that layer's verdict; the strictest verdict (deny > approve >
//!    allow) is a floor no other rule can loosen.
//! 2. **Soft rules** — first match among the sandbox layer's rules, then the
//!    tenant layer's; if none matches, the sandbox `default`, else the tenant
//!    `default`, else the platform `default`, else `deny`.
//! 3. The result is the stricter of the floor and the soft verdict.

mod env;
mod matchers;
mod parse;

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use globset::{Candidate, GlobSet};
use serde::{Deserialize, Serialize};

use crate::call::{CallKind, KindName, ToolCall};
use crate::path::{http_path, normalize};
pub use env::{is_dangerous_env, DANGEROUS_ENV};
pub use matchers::{canonical_ip, is_host_name, looks_like_ip, split_script, HostPattern, IpNet};
use matchers::{exec_reading, ArgsMatcher, ExecReading};
pub use matchers::{MAX_DEPTH, MAX_VIEWS};
pub use parse::{ParseError, DEFAULT_READ_METHODS, DEFAULT_TLS_PORTS};

const KIND_COUNT: usize = KindName::ALL.len();

/// What the policy says about a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Effect {
    /// Run it.
    Allow,
    /// Refuse it.
    Deny,
    /// Hold it until a human approves.
    Approve,
}

impl Effect {
    /// Strictness order: allow < approve < deny.
    pub fn strictness(self) -> u8 {
        match self {
            Effect::Allow => 0,
            Effect::Approve => 1,
            Effect::Deny => 2,
        }
    }
}

/// Whether an egress request reads or writes, relative to its connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// A method in the connector's `read_methods` (`GET`, `HEAD`,
    /// `OPTIONS` unless configured) and not in its `write_methods`.
    Read,
    /// Any other method, unknown ones included, and every `CONNECT` tunnel
    /// (whose contents the proxy cannot see).
    Write,
}

/// Where a policy comes from; also its rank in precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layer {
    /// Platform administrators: every rule is hard.
    Platform,
    /// The tenant's policy.
    Tenant,
    /// One sandbox's policy.
    Sandbox,
}

impl Layer {
    /// Name as used in decisions and docs.
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Platform => "platform",
            Layer::Tenant => "tenant",
            Layer::Sandbox => "sandbox",
        }
    }
}

/// A named external API: the hosts it lives on and which methods read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connector {
    /// Name used in rules (`salesforce`).
    pub name: String,
    /// Host patterns (`login.salesforce.com`, `*.my.salesforce.com`).
    pub hosts: Vec<HostPattern>,
    /// IP networks whose address literals (`CONNECT 203.0.113.7:443`)
    /// belong to this connector. A range inside private space (`10.0.0.0/8`
    /// and smaller, RFC 1918, CGNAT, unique-local, documentation) opens
    /// those private addresses; any other range (`0.0.0.0/0`) covers only
    /// its public addresses. Loopback, link-local (the metadata address
    /// `169.254.169.254` too), multicast and the host's own addresses are
    /// never reachable (the proxy's guard, `docs/policy.md`).
    pub cidrs: Vec<IpNet>,
    /// Upper-case HTTP methods that read (default `GET`, `HEAD`,
    /// `OPTIONS`); every other method writes.
    pub read_methods: Vec<String>,
    /// Upper-case HTTP methods that write even when `read_methods` lists
    /// them (the older way to configure writes; empty by default).
    pub write_methods: Vec<String>,
    /// Ports egress may use (default 80 and 443).
    pub ports: Vec<u16>,
    /// Ports on which a tunnel must carry TLS whose ClientHello names the
    /// host (default 443).
    pub tls_ports: Vec<u16>,
    /// Writes are refused whatever the other rules say.
    pub read_only: bool,
    /// When the deployment intercepts TLS (`docs/tls-interception.md`),
    /// a tunnel to this connector's hosts on a TLS port is terminated and
    /// every request inside judged (default `true`); `false` keeps them
    /// `CONNECT`-by-name tunnels (for clients that pin certificates).
    pub intercept: bool,
    /// The connector secrets the egress proxy may inject on requests to
    /// this connector (`docs/secrets.md`); `None`: every secret bound to
    /// the connector by name. Only names: values are never in a policy.
    pub secrets: Option<Vec<String>>,
    /// For a connector of kind `mcp`: the server the MCP gateway offers
    /// the guest (`docs/mcp.md`); `None` for an HTTP connector.
    pub mcp: Option<McpServer>,
}

impl Connector {
    /// May secret `name` (bound to this connector) be injected?
    pub fn admits_secret(&self, name: &str) -> bool {
        self.secrets
            .as_ref()
            .is_none_or(|l| l.iter().any(|n| n == name))
    }
}

/// The server behind an `mcp` connector and the admin's catalog of its tools.
#[derive(Clone, PartialEq, Eq)]
pub struct McpServer {
    /// Where the gateway reaches it.
    pub upstream: McpUpstream,
    /// Admin-trusted tool annotations; a tool not listed is a write.
    pub catalog: Vec<CatalogTool>,
}

impl McpServer {
    /// The catalog entry of `tool`.
    pub fn tool(&self, tool: &str) -> Option<&CatalogTool> {
        self.catalog.iter().find(|t| t.name == tool)
    }

    /// Whether the catalog marks `tool` read-only (a tool it does not list
    /// is not).
    pub fn is_read_only(&self, tool: &str) -> bool {
        self.tool(tool).is_some_and(|t| t.read_only)
    }
}

/// How the gateway reaches an MCP server. Header and env values are the
/// connector's credentials: held by the daemon, never given to the guest,
/// never printed (`Debug` shows names only).
#[derive(Clone, PartialEq, Eq)]
pub enum McpUpstream {
    /// A streamable-HTTP MCP endpoint.
    Http {
        /// `http://` or `https://` URL of the endpoint.
        url: String,
        /// Headers sent with every request (`Authorization`, …).
        headers: std::collections::BTreeMap<String, String>,
    },
    /// A stdio server the daemon runs on the host, outside the guest.
    Stdio {
        /// Program and arguments.
        command: Vec<String>,
        /// Environment variables it gets (besides `PATH`, `HOME`, `LANG`).
        env: std::collections::BTreeMap<String, String>,
    },
}

impl std::fmt::Debug for McpUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            McpUpstream::Http { url, headers } => f
                .debug_struct("Http")
                .field("url", url)
                .field("headers", &headers.keys().collect::<Vec<_>>())
                .finish(),
            McpUpstream::Stdio { command, env } => f
                .debug_struct("Stdio")
                .field("command", command)
                .field("env", &env.keys().collect::<Vec<_>>())
                .finish(),
        }
    }
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("upstream", &self.upstream)
            .field("catalog", &self.catalog)
            .finish()
    }
}

/// One tool of an MCP connector's catalog: the annotations the gateway
/// trusts (a server's own `annotations` are never trusted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogTool {
    /// The tool's name.
    pub name: String,
    /// `readOnlyHint`: the tool changes nothing (only these pass a
    /// connector's `read_only` write block).
    #[serde(default)]
    pub read_only: bool,
    /// `destructiveHint` (default `true` unless `read_only`, as in MCP).
    #[serde(default)]
    pub destructive: Option<bool>,
}

impl CatalogTool {
    /// The effective `destructiveHint`.
    pub fn is_destructive(&self) -> bool {
        self.destructive.unwrap_or(!self.read_only)
    }
}

impl Connector {
    /// Does `method` (upper case) write through this connector? Anything
    /// but a listed read does, `CONNECT` always.
    pub fn is_write(&self, method: &str) -> bool {
        method == "CONNECT"
            || !self.read_methods.iter().any(|m| m == method)
            || self.write_methods.iter().any(|m| m == method)
    }
}

/// One compiled rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Rule id (`rule-N` when the file gives none).
    pub id: String,
    /// Position in its layer (0-based).
    pub index: usize,
    /// What the rule decides.
    pub effect: Effect,
    /// Text shown to approvers and in refusals.
    pub reason: Option<String>,
    /// A hard rule cannot be loosened by lower layers.
    pub hard: bool,
    kinds: u16,
    program: Option<GlobSet>,
    args: Option<ArgsMatcher>,
    args_contain: Option<Vec<globset::GlobMatcher>>,
    command: Option<GlobSet>,
    env: Option<GlobSet>,
    path: Option<GlobSet>,
    connector: Option<Vec<String>>,
    method: Option<Vec<String>>,
    host: Option<Vec<HostPattern>>,
    cidr: Option<Vec<IpNet>>,
    http_path: Option<GlobSet>,
    access: Option<Access>,
    op: Option<Vec<String>>,
    tool: Option<GlobSet>,
    arguments: Option<Vec<(String, GlobSet)>>,
}

/// One parsed policy layer.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// Effect when no rule matches (the lowest layer that sets one wins).
    pub default: Option<Effect>,
    /// The file's top-level `read_methods`: the default of the connectors
    /// it declares (already applied to them).
    pub read_methods: Option<Vec<String>>,
    /// Connectors declared by this layer.
    pub connectors: Vec<Connector>,
    /// Rules in file order.
    pub rules: Vec<Rule>,
    /// Names (globs) of environment variables on the built-in dangerous
    /// list ([`DANGEROUS_ENV`]) that exec calls may set anyway.
    pub allow_env: Option<GlobSet>,
}

/// Errors loading a policy file from disk.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("reading policy file {path}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file was refused.
    #[error(transparent)]
    Parse(#[from] ParseError),
}

impl Policy {
    /// Parse TOML text. A syntax error, an unknown field or an invalid value
    /// refuses the whole policy with the line and column.
    pub fn parse(text: &str) -> Result<Policy, ParseError> {
        parse::parse(text)
    }

    /// Read and parse a policy file.
    pub fn load(path: &Path) -> Result<Policy, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Policy::parse(&text)?)
    }
}

/// Errors composing layers into a [`PolicySet`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComposeError {
    /// Sandbox policies may not declare connectors.
    #[error("connector `{0}` declared in a sandbox policy; connectors belong to the platform or tenant policy")]
    ConnectorInSandbox(String),
    /// Sandbox policies declare no connectors, so `read_methods` there
    /// would mean nothing.
    #[error("`read_methods` set in a sandbox policy; it belongs to the platform or tenant policy (or a connector)")]
    ReadMethodsInSandbox,
    /// Two layers declare the same connector name.
    #[error("connector `{0}` declared by both the platform and the tenant policy")]
    DuplicateConnector(String),
    /// A rule names a connector no layer declares.
    #[error("rule `{rule}` of the {layer} policy names unknown connector `{connector}`")]
    UnknownConnector {
        /// Layer of the rule.
        layer: &'static str,
        /// Rule id.
        rule: String,
        /// The unknown name.
        connector: String,
    },
}

/// The decision for one tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// allow, deny or approve.
    pub effect: Effect,
    /// The layer whose rule or default decided; `None` for the built-in
    /// default or an invalid call.
    pub layer: Option<Layer>,
    /// Id of the deciding rule, `default`, `connector:<name>:read-only`, or
    /// `invalid-call`.
    pub rule_id: String,
    /// Index of the deciding rule in its layer.
    pub rule_index: Option<usize>,
    /// Whether a hard rule decided.
    pub hard: bool,
    /// Why; shown to approvers and in refusals.
    pub reason: String,
}

struct LayerIndex {
    layer: Layer,
    policy: Arc<Policy>,
    hard: [Vec<u32>; KIND_COUNT],
    soft: [Vec<u32>; KIND_COUNT],
}

/// Platform, tenant and sandbox policies composed and indexed for evaluation.
/// Immutable: swap a whole `Arc<PolicySet>` to change policy.
pub struct PolicySet {
    layers: Vec<LayerIndex>,
    connectors: Vec<(Layer, Connector)>,
}

impl std::fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicySet")
            .field(
                "layers",
                &self
                    .layers
                    .iter()
                    .map(|l| (l.layer, l.policy.rules.len()))
                    .collect::<Vec<_>>(),
            )
            .field(
                "connectors",
                &self
                    .connectors
                    .iter()
                    .map(|c| &c.1.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// An egress call, prepared.
struct EgressView<'a> {
    connector: Option<&'a Connector>,
    host: String,
    ip: Option<IpAddr>,
    method: String,
    path: String,
    write: bool,
}

/// An MCP `tools/call`, prepared.
struct McpView<'a> {
    connector: &'a Connector,
    tool: &'a str,
    /// The arguments, when known (a `tools/list` check has none).
    arguments: Option<serde_json::Value>,
    write: bool,
}

enum Prepared<'a> {
    Mcp(McpView<'a>),
    Exec(ExecReading),
    File(String),
    Egress(EgressView<'a>),
    Op(&'a str),
    None,
}

impl PolicySet {
    /// Compose layers. Any may be absent. Sandbox layers may not declare
    /// connectors; rules may only name declared connectors.
    pub fn new(
        platform: Option<Arc<Policy>>,
        tenant: Option<Arc<Policy>>,
        sandbox: Option<Arc<Policy>>,
    ) -> Result<PolicySet, ComposeError> {
        let mut connectors: Vec<(Layer, Connector)> = Vec::new();
        let mut layers = Vec::new();
        for (layer, p) in [
            (Layer::Platform, platform),
            (Layer::Tenant, tenant),
            (Layer::Sandbox, sandbox),
        ] {
            let Some(policy) = p else { continue };
            if layer == Layer::Sandbox && policy.read_methods.is_some() {
                return Err(ComposeError::ReadMethodsInSandbox);
            }
            for c in &policy.connectors {
                if layer == Layer::Sandbox {
                    return Err(ComposeError::ConnectorInSandbox(c.name.clone()));
                }
                if connectors.iter().any(|(_, x)| x.name == c.name) {
                    return Err(ComposeError::DuplicateConnector(c.name.clone()));
                }
                connectors.push((layer, c.clone()));
            }
            layers.push((layer, policy));
        }
        let mut out = Vec::new();
        for (layer, policy) in layers {
            let mut hard: [Vec<u32>; KIND_COUNT] = Default::default();
            let mut soft: [Vec<u32>; KIND_COUNT] = Default::default();
            for (i, r) in policy.rules.iter().enumerate() {
                for name in r.connector.iter().flatten() {
                    if !connectors.iter().any(|(_, c)| &c.name == name) {
                        return Err(ComposeError::UnknownConnector {
                            layer: layer.as_str(),
                            rule: r.id.clone(),
                            connector: name.clone(),
                        });
                    }
                }
                let is_hard = r.hard || layer == Layer::Platform;
                for k in 0..KIND_COUNT {
                    if r.kinds & (1 << k) != 0 {
                        let i = u32::try_from(i).unwrap_or(u32::MAX);
                        if is_hard {
                            hard[k].push(i)
                        } else {
                            soft[k].push(i)
                        }
                    }
                }
            }
            out.push(LayerIndex {
                layer,
                policy,
                hard,
                soft,
            });
        }
        Ok(PolicySet {
            layers: out,
            connectors,
        })
    }

    /// The connector an IP address literal belongs to, with the range that
    /// holds it: the most specific range of any connector (platform before
    /// tenant on a tie). Says nothing about the address guard.
    pub fn connector_for_ip(&self, ip: IpAddr) -> Option<(&Connector, IpNet)> {
        let ip = canonical_ip(ip);
        let mut best: Option<(&Connector, IpNet)> = None;
        for (_, c) in &self.connectors {
            for n in c.cidrs.iter().filter(|n| n.contains(ip)) {
                if best.is_none_or(|(_, b)| n.prefix() > b.prefix()) {
                    best = Some((c, *n));
                }
            }
        }
        best
    }

    /// The connector a host belongs to: an exact host pattern beats a
    /// wildcard; otherwise the first declared (platform before tenant).
    pub fn connector_for_host(&self, host: &str) -> Option<&Connector> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.connectors
            .iter()
            .find(|(_, c)| c.hosts.iter().any(|h| h.is_exact() && h.matches(&host)))
            .or_else(|| {
                self.connectors
                    .iter()
                    .find(|(_, c)| c.hosts.iter().any(|h| h.matches(&host)))
            })
            .map(|(_, c)| c)
    }

    fn connector_layer(&self, name: &str) -> Option<Layer> {
        self.connectors
            .iter()
            .find(|(_, c)| c.name == name)
            .map(|(l, _)| *l)
    }

    /// All connectors, with the layer that declared each.
    pub fn connectors(&self) -> impl Iterator<Item = (Layer, &Connector)> {
        self.connectors.iter().map(|(l, c)| (*l, c))
    }

    fn prepare<'a>(&'a self, call: &'a ToolCall) -> Result<Prepared<'a>, String> {
        Ok(match &call.kind {
            CallKind::Exec {
                argv,
                shell,
                env,
                cwd,
                stdin,
            } => {
                if shell.is_none() && argv.is_empty() {
                    return Err("exec with an empty argv".into());
                }
                if argv
                    .iter()
                    .chain(shell.iter())
                    .chain(env.keys())
                    .chain(cwd.iter())
                    .any(|a| a.contains('\0'))
                {
                    return Err("exec argument, env name or cwd contains a NUL byte".into());
                }
                let mut r = exec_reading(argv, shell.as_deref(), !stdin.is_none());
                r.env = env.keys().cloned().collect();
                Prepared::Exec(r)
            }
            CallKind::FileRead { path } | CallKind::FileWrite { path } => {
                Prepared::File(normalize(path).map_err(|e| format!("invalid path: {e}"))?)
            }
            CallKind::Egress {
                host, method, path, ..
            } => {
                let host = host.trim_end_matches('.').to_ascii_lowercase();
                let method = method.to_ascii_uppercase();
                let ip = parse_ip_literal(&host);
                let connector = match ip {
                    Some(ip) => self.connector_for_ip(ip).map(|(c, _)| c),
                    None => self.connector_for_host(&host),
                };
                let write = match connector {
                    Some(c) => c.is_write(&method),
                    None => method == "CONNECT" || !DEFAULT_READ_METHODS.contains(&method.as_str()),
                };
                let path = if path.is_empty() {
                    String::new()
                } else {
                    let p = path.split(['?', '#']).next().unwrap_or("");
                    http_path(p)
                        .map_err(|e| format!("invalid request path: {e}"))?
                        .matched
                };
                Prepared::Egress(EgressView {
                    connector,
                    host,
                    ip,
                    method,
                    path,
                    write,
                })
            }
            CallKind::Mcp {
                connector,
                tool,
                arguments,
                ..
            } => {
                let Some(c) = self
                    .connectors
                    .iter()
                    .map(|(_, c)| c)
                    .find(|c| &c.name == connector && c.mcp.is_some())
                else {
                    return Err(format!(
                        "`{connector}` is not an MCP connector of this policy"
                    ));
                };
                let arguments = match arguments {
                    None => None,
                    Some(t) => Some(
                        serde_json::from_str::<serde_json::Value>(t)
                            .map_err(|e| format!("MCP arguments are not JSON: {e}"))?,
                    ),
                };
                let write = !c.mcp.as_ref().is_some_and(|m| m.is_read_only(tool));
                Prepared::Mcp(McpView {
                    connector: c,
                    tool,
                    arguments,
                    write,
                })
            }
            CallKind::Lifecycle { op } => Prepared::Op(op),
            CallKind::Snapshot | CallKind::Fork | CallKind::Rewind | CallKind::Port { .. } => {
                Prepared::None
            }
        })
    }

    /// Decide a tool call. Pure and fast: no I/O, globs precompiled, rules
    /// indexed by kind.
    pub fn evaluate(&self, call: &ToolCall) -> Decision {
        let prepared = match self.prepare(call) {
            Ok(p) => p,
            Err(reason) => {
                return Decision {
                    effect: Effect::Deny,
                    layer: None,
                    rule_id: "invalid-call".into(),
                    rule_index: None,
                    hard: true,
                    reason,
                }
            }
        };
        if let Prepared::Exec(r) = &prepared {
            if let Some(d) = self.env_refusal(r) {
                return d;
            }
        }
        let kind = call.kind.kind().index();
        let file_cand = match &prepared {
            Prepared::File(p) => Some(Candidate::new(p.as_str())),
            _ => None,
        };
        let http_cand = match &prepared {
            Prepared::Egress(e) => Some(Candidate::new(e.path.as_str())),
            _ => None,
        };
        let exec = match &prepared {
            Prepared::Exec(r) => r
                .views
                .iter()
                .map(|v| ExecCands {
                    base: Candidate::new(v.program_base()),
                    full: Candidate::new(v.argv.first().map(String::as_str).unwrap_or("")),
                    line: Candidate::new(v.line.as_str()),
                    args: v
                        .argv
                        .iter()
                        .skip(1)
                        .map(|a| Candidate::new(a.as_str()))
                        .collect(),
                })
                .collect(),
            _ => Vec::new(),
        };
        let ctx = Ctx {
            prepared: &prepared,
            exec,
            file: file_cand.as_ref(),
            http: http_cand.as_ref(),
        };

        // 1. Hard floor.
        let mut floor: Option<Decision> = None;
        let consider = |d: Decision, floor: &mut Option<Decision>| {
            if floor
                .as_ref()
                .is_none_or(|f| d.effect.strictness() > f.effect.strictness())
            {
                *floor = Some(d);
            }
        };
        if let Prepared::Egress(e) = &prepared {
            if let Some(c) = e.connector {
                if c.read_only && e.write {
                    let layer = self.connector_layer(&c.name);
                    consider(
                        Decision {
                            effect: Effect::Deny,
                            layer,
                            rule_id: format!("connector:{}:read-only", c.name),
                            rule_index: None,
                            hard: true,
                            reason: format!(
                                "connector `{}` is read-only: {} is a write{}",
                                c.name,
                                e.method,
                                if e.method == "CONNECT" {
                                    " (a tunnel's contents cannot be inspected)"
                                } else {
                                    ""
                                }
                            ),
                        },
                        &mut floor,
                    );
                }
            }
        }
        if let Prepared::Mcp(m) = &prepared {
            if m.connector.read_only && m.write {
                consider(
                    Decision {
                        effect: Effect::Deny,
                        layer: self.connector_layer(&m.connector.name),
                        rule_id: format!("connector:{}:read-only", m.connector.name),
                        rule_index: None,
                        hard: true,
                        reason: format!(
                            "connector `{}` is read-only: tool `{}` is not marked read_only in its catalog",
                            m.connector.name, m.tool
                        ),
                    },
                    &mut floor,
                );
            }
        }
        // Whether an allow naming `CONNECT` decided (see `connect_gate`).
        let mut explicit_connect = false;
        for l in &self.layers {
            if let Some(r) = l.hard[kind]
                .iter()
                .map(|&i| &l.policy.rules[i as usize])
                .find(|r| r.matches(&ctx))
            {
                explicit_connect |= r.allows_connect_explicitly();
                consider(decision_of(l.layer, r, true), &mut floor);
            }
        }

        // 2. Soft: sandbox, then tenant (platform rules are all hard).
        let mut soft = None;
        for l in self.layers.iter().rev() {
            if let Some(r) = l.soft[kind]
                .iter()
                .map(|&i| &l.policy.rules[i as usize])
                .find(|r| r.matches(&ctx))
            {
                explicit_connect |= r.allows_connect_explicitly();
                soft = Some(decision_of(l.layer, r, false));
                break;
            }
        }
        let soft = soft.unwrap_or_else(|| {
            match self
                .layers
                .iter()
                .rev()
                .find_map(|l| l.policy.default.map(|d| (l.layer, d)))
            {
                Some((layer, effect)) => Decision {
                    effect,
                    layer: Some(layer),
                    rule_id: "default".into(),
                    rule_index: None,
                    hard: false,
                    reason: format!(
                        "no rule matched; the {} policy's default is {effect:?}",
                        layer.as_str()
                    )
                    .to_lowercase(),
                },
                None => Decision {
                    effect: Effect::Deny,
                    layer: None,
                    rule_id: "default".into(),
                    rule_index: None,
                    hard: false,
                    reason: "no rule matched and no policy sets a default: deny".into(),
                },
            }
        });

        // 3. The stricter wins; a hard deny/approve is reported over an equal soft one.
        let d = match floor {
            Some(f)
                if f.effect != Effect::Allow
                    && f.effect.strictness() >= soft.effect.strictness() =>
            {
                f
            }
            _ => soft,
        };
        match &prepared {
            Prepared::Egress(e) if d.effect == Effect::Allow && !explicit_connect => {
                self.connect_gate(e).unwrap_or(d)
            }
            Prepared::Exec(r) => env::note_unreadable(d, r),
            _ => d,
        }
    }

    /// A `CONNECT` tunnel voids every `method` and `http_path` rule of its
    /// destination (the proxy cannot see the requests inside). So where a
    /// rule of that kind applies to the connector, a tunnel is allowed only
    /// by an allow rule that names `method = "CONNECT"`: a default or a
    /// blanket allow is refused here.
    fn connect_gate(&self, e: &EgressView<'_>) -> Option<Decision> {
        let c = e.connector?;
        if e.method != "CONNECT" {
            return None;
        }
        let egress = KindName::Egress.index();
        let (layer, r) = self.layers.iter().find_map(|l| {
            l.hard[egress]
                .iter()
                .chain(&l.soft[egress])
                .map(|&i| &l.policy.rules[i as usize])
                .find(|r| r.is_request_rule() && r.destination_matches(e))
                .map(|r| (l.layer, r))
        })?;
        Some(Decision {
            effect: Effect::Deny,
            layer: self.connector_layer(&c.name),
            rule_id: format!("connector:{}:connect", c.name),
            rule_index: None,
            hard: true,
            reason: format!(
                "a CONNECT tunnel to connector `{}` would bypass its method/path rules (the {} policy's rule `{}`); only an allow rule with method = \"CONNECT\" opens a tunnel there",
                c.name,
                layer.as_str(),
                r.id
            ),
        })
    }
}

/// The address an egress call's host names, when it is a canonical IP
/// literal (`203.0.113.7`, `2001:db8::1`, `[2001:db8::1]`; IPv4-mapped IPv6
/// read as IPv4). Names, and forms like `127.1`, are not.
pub fn parse_ip_literal(host: &str) -> Option<IpAddr> {
    let h = host
        .strip_prefix('[')
        .and_then(|x| x.strip_suffix(']'))
        .unwrap_or(host);
    h.parse::<IpAddr>().ok().map(canonical_ip)
}

/// The text an `arguments` matcher sees for `key` (a top-level argument,
/// or a dotted path into objects): a string as it is, anything else as its
/// JSON text; `None` when absent.
fn argument_text(args: &serde_json::Value, key: &str) -> Option<String> {
    let mut v = args;
    for part in key.split('.') {
        v = v.as_object()?.get(part)?;
    }
    Some(match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

fn decision_of(layer: Layer, r: &Rule, hard: bool) -> Decision {
    Decision {
        effect: r.effect,
        layer: Some(layer),
        rule_id: r.id.clone(),
        rule_index: Some(r.index),
        hard,
        reason: r
            .reason
            .clone()
            .unwrap_or_else(|| format!("{} rule `{}`", layer.as_str(), r.id)),
    }
}

/// Glob candidates of one exec reading, built once per evaluation.
struct ExecCands<'a> {
    base: Candidate<'a>,
    full: Candidate<'a>,
    line: Candidate<'a>,
    args: Vec<Candidate<'a>>,
}

struct Ctx<'a, 'b> {
    prepared: &'a Prepared<'b>,
    exec: Vec<ExecCands<'a>>,
    file: Option<&'a Candidate<'a>>,
    http: Option<&'a Candidate<'a>>,
}

impl Rule {
    /// An allow rule that names `CONNECT` among its methods.
    fn allows_connect_explicitly(&self) -> bool {
        self.effect == Effect::Allow
            && self
                .method
                .as_ref()
                .is_some_and(|m| m.iter().any(|m| m == "CONNECT"))
    }

    /// A rule about the requests inside a connection: an `http_path`, or a
    /// `method` other than `CONNECT`.
    fn is_request_rule(&self) -> bool {
        self.http_path.is_some()
            || self
                .method
                .as_ref()
                .is_some_and(|m| m.iter().any(|m| m != "CONNECT"))
    }

    /// The destination part of an egress rule: connector, host, cidr.
    fn destination_matches(&self, e: &EgressView<'_>) -> bool {
        if let Some(names) = &self.connector {
            if !e
                .connector
                .is_some_and(|c| names.iter().any(|n| n == &c.name))
            {
                return false;
            }
        }
        if let Some(h) = &self.host {
            if !h.iter().any(|h| h.matches(&e.host)) {
                return false;
            }
        }
        if let Some(nets) = &self.cidr {
            if !e.ip.is_some_and(|ip| nets.iter().any(|n| n.contains(ip))) {
                return false;
            }
        }
        true
    }

    fn has_exec_matchers(&self) -> bool {
        self.program.is_some()
            || self.args.is_some()
            || self.args_contain.is_some()
            || self.command.is_some()
            || self.env.is_some()
    }

    fn exec_view_matches(&self, c: &ExecCands<'_>) -> bool {
        if let Some(p) = &self.program {
            if !(p.is_match_candidate(&c.base) || p.is_match_candidate(&c.full)) {
                return false;
            }
        }
        if let Some(a) = &self.args {
            let n = c.args.len();
            if n < a.positions.len() || (!a.rest && n != a.positions.len()) {
                return false;
            }
            if !a
                .positions
                .iter()
                .zip(&c.args)
                .all(|(m, x)| m.is_match_candidate(x))
            {
                return false;
            }
        }
        if let Some(m) = &self.args_contain {
            if !m
                .iter()
                .all(|m| c.args.iter().any(|a| m.is_match_candidate(a)))
            {
                return false;
            }
        }
        if let Some(set) = &self.command {
            if !set.is_match_candidate(&c.line) {
                return false;
            }
        }
        true
    }

    fn matches(&self, ctx: &Ctx<'_, '_>) -> bool {
        match ctx.prepared {
            Prepared::Exec(r) => {
                if !self.has_exec_matchers() {
                    return true;
                }
                // Derived readings (wrappers stripped, shell sub-commands) can
                // only make a call stricter: allow rules see the literal argv.
                let derived_ok = self.effect != Effect::Allow;
                // A call that cannot be read matches every deny/approve rule.
                if derived_ok && r.unreadable.is_some() {
                    return true;
                }
                if let Some(set) = &self.env {
                    if !r.env.iter().any(|n| set.is_match(n)) {
                        return false;
                    }
                }
                r.views
                    .iter()
                    .zip(&ctx.exec)
                    .any(|(v, c)| (v.literal || derived_ok) && self.exec_view_matches(c))
            }
            Prepared::File(_) => match (&self.path, ctx.file) {
                (Some(set), Some(c)) => set.is_match_candidate(c),
                (None, _) => true,
                _ => false,
            },
            Prepared::Egress(e) => {
                if !self.destination_matches(e) {
                    return false;
                }
                if let Some(m) = &self.method {
                    if !m.iter().any(|m| m == &e.method) {
                        return false;
                    }
                }
                if let Some(a) = self.access {
                    if (a == Access::Write) != e.write {
                        return false;
                    }
                }
                if let (Some(set), Some(c)) = (&self.http_path, ctx.http) {
                    if !set.is_match_candidate(c) {
                        return false;
                    }
                }
                true
            }
            Prepared::Mcp(m) => {
                if let Some(names) = &self.connector {
                    if !names.iter().any(|n| n == &m.connector.name) {
                        return false;
                    }
                }
                if let Some(t) = &self.tool {
                    if !t.is_match(m.tool) {
                        return false;
                    }
                }
                if let Some(a) = self.access {
                    if (a == Access::Write) != m.write {
                        return false;
                    }
                }
                match (&self.arguments, &m.arguments) {
                    (None, _) => true,
                    // Unknown arguments (a `tools/list` check): a rule about
                    // them does not decide.
                    (Some(_), None) => false,
                    (Some(ms), Some(args)) => ms.iter().all(|(key, set)| {
                        argument_text(args, key).is_some_and(|t| set.is_match(t.as_str()))
                    }),
                }
            }
            Prepared::Op(op) => self
                .op
                .as_ref()
                .is_none_or(|ops| ops.iter().any(|o| o == op)),
            Prepared::None => true,
        }
    }
}

#[cfg(test)]
mod tests;
