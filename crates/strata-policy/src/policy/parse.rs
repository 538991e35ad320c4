//! The TOML policy file: schema, parsing with positions, compilation.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

use super::matchers::{glob_set, one_glob, ArgsMatcher, GlobMode, HostPattern, IpNet};
use super::{
    Access, CatalogTool, Connector, Effect, McpServer, McpUpstream, Policy, Rule, KIND_COUNT,
};
use crate::call::KindName;
use std::collections::BTreeMap;

/// A policy file was refused. The whole file is refused; the caller keeps the
/// policy that was in force.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy refused at line {line}, column {column}: {message}")]
pub struct ParseError {
    /// 1-based line of the offending text.
    pub line: usize,
    /// 1-based column (in characters) of the offending text.
    pub column: usize,
    /// What is wrong.
    pub message: String,
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let col = before
        .rsplit('\n')
        .next()
        .map(|l| l.chars().count())
        .unwrap_or(0)
        + 1;
    (line, col)
}

fn err_at(text: &str, span: std::ops::Range<usize>, message: impl Into<String>) -> ParseError {
    let (line, column) = line_col(text, span.start);
    ParseError {
        line,
        column,
        message: message.into(),
    }
}

/// A string or a list of strings.
#[derive(Debug, Clone, Default)]
pub(crate) struct StrList(pub Vec<String>);

impl<'de> Deserialize<'de> for StrList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StrList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StrList, E> {
                Ok(StrList(vec![v.to_string()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StrList, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(StrList(out))
            }
        }
        d.deserialize_any(V)
    }
}

type Field = Option<Spanned<StrList>>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    version: Option<Spanned<u32>>,
    #[serde(default)]
    default: Option<Effect>,
    #[serde(default)]
    read_methods: Field,
    #[serde(default)]
    allow_env: Field,
    #[serde(default, rename = "connector")]
    connectors: Vec<Spanned<ConnectorFile>>,
    #[serde(default, rename = "rule")]
    rules: Vec<Spanned<RuleFile>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectorFile {
    name: Spanned<String>,
    #[serde(default)]
    hosts: Option<Spanned<StrList>>,
    #[serde(default)]
    cidrs: Field,
    #[serde(default)]
    read_methods: Field,
    #[serde(default)]
    write_methods: Field,
    #[serde(default)]
    ports: Option<Vec<u16>>,
    #[serde(default)]
    tls_ports: Option<Vec<u16>>,
    #[serde(default)]
    read_only: bool,
    #[serde(default)]
    intercept: Option<bool>,
    #[serde(default)]
    secrets: Option<Spanned<Vec<String>>>,
    /// `http` (default) or `mcp`.
    #[serde(default)]
    kind: Option<Spanned<String>>,
    /// An `mcp` connector's streamable-HTTP endpoint.
    #[serde(default)]
    url: Option<Spanned<String>>,
    /// An `mcp` connector's stdio server command (program and arguments).
    #[serde(default)]
    command: Option<Spanned<StrList>>,
    /// Environment of a stdio server (credentials).
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    /// Headers sent to an HTTP MCP server (credentials).
    #[serde(default)]
    headers: Option<BTreeMap<String, String>>,
    /// The catalog: `[[connector.tool]]`.
    #[serde(default, rename = "tool")]
    tools: Vec<Spanned<CatalogTool>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    #[serde(default)]
    id: Option<Spanned<String>>,
    effect: Effect,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    hard: bool,
    #[serde(default)]
    kind: Field,
    #[serde(default)]
    program: Field,
    #[serde(default)]
    args: Field,
    #[serde(default)]
    args_contain: Field,
    #[serde(default)]
    command: Field,
    #[serde(default)]
    env: Field,
    #[serde(default)]
    path: Field,
    #[serde(default)]
    connector: Field,
    #[serde(default)]
    method: Field,
    #[serde(default)]
    host: Field,
    #[serde(default)]
    cidr: Field,
    #[serde(default)]
    http_path: Field,
    #[serde(default)]
    access: Option<Access>,
    #[serde(default)]
    op: Field,
    #[serde(default)]
    tool: Field,
    #[serde(default)]
    arguments: Option<Spanned<BTreeMap<String, StrList>>>,
}

const EXEC: u16 = 1 << KindName::Exec as u16;
const FILES: u16 = (1 << KindName::FileRead as u16) | (1 << KindName::FileWrite as u16);
const EGRESS: u16 = 1 << KindName::Egress as u16;
const LIFECYCLE: u16 = 1 << KindName::Lifecycle as u16;
const MCP: u16 = 1 << KindName::Mcp as u16;
const ALL_KINDS: u16 = (1 << KIND_COUNT) - 1;

/// HTTP methods that read unless a connector (or its file's top-level
/// `read_methods`) says otherwise; every other method writes.
pub const DEFAULT_READ_METHODS: [&str; 3] = ["GET", "HEAD", "OPTIONS"];

/// Ports on which a connector's tunnels must carry TLS unless its
/// `tls_ports` says otherwise.
pub const DEFAULT_TLS_PORTS: [u16; 1] = [443];

fn nonempty(text: &str, f: &Spanned<StrList>, name: &str) -> Result<Vec<String>, ParseError> {
    if f.get_ref().0.is_empty() {
        return Err(err_at(
            text,
            f.span(),
            format!("`{name}` must not be an empty list"),
        ));
    }
    Ok(f.get_ref().0.clone())
}

fn globs(
    text: &str,
    f: &Field,
    name: &str,
    mode: GlobMode,
) -> Result<Option<globset::GlobSet>, ParseError> {
    let Some(f) = f else { return Ok(None) };
    let pats = nonempty(text, f, name)?;
    glob_set(&pats, mode)
        .map(Some)
        .map_err(|(_, e)| err_at(text, f.span(), format!("`{name}`: {e}")))
}

fn upper_list(text: &str, f: &Field, name: &str) -> Result<Option<Vec<String>>, ParseError> {
    let Some(f) = f else { return Ok(None) };
    let v = nonempty(text, f, name)?;
    for m in &v {
        if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(err_at(
                text,
                f.span(),
                format!("`{name}`: `{m}` is not an HTTP method"),
            ));
        }
    }
    Ok(Some(v.iter().map(|m| m.to_ascii_uppercase()).collect()))
}

/// A list of HTTP methods (tokens, upper-cased) that may be empty, without
/// `CONNECT` (a tunnel always counts as a write).
fn method_list(text: &str, f: &Field, name: &str) -> Result<Option<Vec<String>>, ParseError> {
    let Some(f) = f else { return Ok(None) };
    let mut out = Vec::new();
    for m in &f.get_ref().0 {
        let token = !m.is_empty()
            && m.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            return Err(err_at(
                text,
                f.span(),
                format!("`{name}`: `{m}` is not an HTTP method"),
            ));
        }
        let m = m.to_ascii_uppercase();
        if m == "CONNECT" {
            return Err(err_at(
                text,
                f.span(),
                format!(
                    "`{name}`: CONNECT is always a write (a tunnel's contents cannot be inspected)"
                ),
            ));
        }
        if !out.contains(&m) {
            out.push(m);
        }
    }
    Ok(Some(out))
}

fn hosts(text: &str, f: &Spanned<StrList>, name: &str) -> Result<Vec<HostPattern>, ParseError> {
    nonempty(text, f, name)?
        .iter()
        .map(|h| {
            HostPattern::parse(h).map_err(|e| err_at(text, f.span(), format!("`{name}`: {e}")))
        })
        .collect()
}

fn nets(text: &str, f: &Spanned<StrList>, name: &str) -> Result<Vec<IpNet>, ParseError> {
    nonempty(text, f, name)?
        .iter()
        .map(|n| IpNet::parse(n).map_err(|e| err_at(text, f.span(), format!("`{name}`: {e}"))))
        .collect()
}

/// The MCP part of a connector: `None` for `kind = "http"` (which may not
/// use the MCP fields).
fn mcp_server(text: &str, c: &ConnectorFile, name: &str) -> Result<Option<McpServer>, ParseError> {
    let kind = c
        .kind
        .as_ref()
        .map(|k| k.get_ref().as_str())
        .unwrap_or("http");
    let has_mcp_fields = c.url.is_some()
        || c.command.is_some()
        || c.env.is_some()
        || c.headers.is_some()
        || !c.tools.is_empty();
    match kind {
        "http" => {
            if has_mcp_fields {
                return Err(err_at(
                    text,
                    c.name.span(),
                    format!("connector `{name}`: `url`, `command`, `env`, `headers` and `tool` belong to `kind = \"mcp\"` connectors"),
                ));
            }
            return Ok(None);
        }
        "mcp" => {}
        other => {
            let span = c.kind.as_ref().map(|k| k.span()).unwrap_or(c.name.span());
            return Err(err_at(
                text,
                span,
                format!("unknown connector kind `{other}` (expected http or mcp)"),
            ));
        }
    }
    if c.hosts.is_some() || c.cidrs.is_some() || c.ports.is_some() || c.tls_ports.is_some() {
        return Err(err_at(
            text,
            c.name.span(),
            format!("connector `{name}` is of kind mcp: it has no `hosts`, `cidrs` or ports (the gateway reaches its server)"),
        ));
    }
    let upstream = match (&c.url, &c.command) {
        (Some(u), None) => {
            let url = u.get_ref().trim().to_string();
            if !(url.starts_with("http://") || url.starts_with("https://"))
                || url
                    .parse::<hyper::Uri>()
                    .map(|u| u.host().is_none())
                    .unwrap_or(true)
            {
                return Err(err_at(
                    text,
                    u.span(),
                    "`url` must be an http:// or https:// URL",
                ));
            }
            if c.env.is_some() {
                return Err(err_at(
                    text,
                    c.name.span(),
                    "`env` is for stdio servers (`command`)",
                ));
            }
            McpUpstream::Http {
                url,
                headers: c.headers.clone().unwrap_or_default(),
            }
        }
        (None, Some(cmd)) => {
            let command = nonempty(text, cmd, "command")?;
            if command.iter().any(|a| a.contains('\0')) || command[0].trim().is_empty() {
                return Err(err_at(text, cmd.span(), "`command` needs a program"));
            }
            if c.headers.is_some() {
                return Err(err_at(
                    text,
                    c.name.span(),
                    "`headers` are for HTTP servers (`url`)",
                ));
            }
            McpUpstream::Stdio {
                command,
                env: c.env.clone().unwrap_or_default(),
            }
        }
        _ => {
            return Err(err_at(
                text,
                c.name.span(),
                format!("connector `{name}` of kind mcp needs exactly one of `url` and `command`"),
            ))
        }
    };
    let mut catalog: Vec<CatalogTool> = Vec::new();
    for t in &c.tools {
        let tool = t.get_ref();
        if tool.name.is_empty() || catalog.iter().any(|x| x.name == tool.name) {
            return Err(err_at(
                text,
                t.span(),
                format!("catalog tool `{}` is empty or listed twice", tool.name),
            ));
        }
        catalog.push(tool.clone());
    }
    Ok(Some(McpServer { upstream, catalog }))
}

/// Parse and compile one policy layer from TOML text.
pub fn parse(text: &str) -> Result<Policy, ParseError> {
    let file: PolicyFile = toml::from_str(text).map_err(|e| {
        let (line, column) = e.span().map(|s| line_col(text, s.start)).unwrap_or((1, 1));
        ParseError {
            line,
            column,
            message: e.message().to_string(),
        }
    })?;
    if let Some(v) = &file.version {
        if *v.get_ref() != 1 {
            return Err(err_at(
                text,
                v.span(),
                format!("unsupported policy version {}", v.get_ref()),
            ));
        }
    }

    let file_reads = method_list(text, &file.read_methods, "read_methods")?;
    let mut connectors = Vec::new();
    for c in &file.connectors {
        let span = c.span();
        let c = c.get_ref();
        let name = c.name.get_ref().trim().to_string();
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(err_at(
                text,
                c.name.span(),
                "connector name must be letters, digits, `-` or `_`",
            ));
        }
        if connectors.iter().any(|x: &Connector| x.name == name) {
            return Err(err_at(
                text,
                c.name.span(),
                format!("connector `{name}` defined twice"),
            ));
        }
        let read_methods = match method_list(text, &c.read_methods, "read_methods")? {
            Some(m) => m,
            None => file_reads
                .clone()
                .unwrap_or_else(|| DEFAULT_READ_METHODS.iter().map(|s| s.to_string()).collect()),
        };
        let write_methods =
            method_list(text, &c.write_methods, "write_methods")?.unwrap_or_default();
        let ports = c.ports.clone().unwrap_or_else(|| vec![80, 443]);
        if ports.is_empty() || ports.contains(&0) {
            return Err(err_at(text, span, "`ports` must list ports 1-65535"));
        }
        let tls_ports = c
            .tls_ports
            .clone()
            .unwrap_or_else(|| DEFAULT_TLS_PORTS.to_vec());
        if tls_ports.contains(&0) {
            return Err(err_at(text, span, "`tls_ports` must list ports 1-65535"));
        }
        let mcp = mcp_server(text, c, &name)?;
        if mcp.is_none() && c.hosts.is_none() && c.cidrs.is_none() {
            return Err(err_at(
                text,
                c.name.span(),
                format!("connector `{name}` needs `hosts` or `cidrs`"),
            ));
        }
        let secrets = match &c.secrets {
            None => None,
            Some(list) => {
                for n in list.get_ref() {
                    if let Err(e) = crate::secrets::check_name(n) {
                        return Err(err_at(
                            text,
                            list.span(),
                            format!("connector `{name}`: {e}"),
                        ));
                    }
                }
                Some(list.get_ref().clone())
            }
        };
        connectors.push(Connector {
            name,
            hosts: match &c.hosts {
                Some(h) => hosts(text, h, "hosts")?,
                None => Vec::new(),
            },
            cidrs: match &c.cidrs {
                Some(n) => nets(text, n, "cidrs")?,
                None => Vec::new(),
            },
            read_methods,
            write_methods,
            ports,
            tls_ports,
            read_only: c.read_only,
            intercept: c.intercept.unwrap_or(true),
            secrets,
            mcp,
        });
    }

    let mut rules: Vec<Rule> = Vec::new();
    for (index, r) in file.rules.iter().enumerate() {
        let span = r.span();
        let r = r.get_ref();
        let id = match &r.id {
            Some(id) => {
                let s = id.get_ref().trim().to_string();
                if s.is_empty() {
                    return Err(err_at(text, id.span(), "rule id must not be empty"));
                }
                if rules.iter().any(|x| x.id == s) {
                    return Err(err_at(text, id.span(), format!("rule id `{s}` used twice")));
                }
                s
            }
            None => format!("rule-{}", index + 1),
        };

        // Which kinds the matchers apply to.
        let mut applicable = ALL_KINDS;
        let mut narrow = |present: bool, mask: u16| {
            if present {
                applicable &= mask;
            }
        };
        narrow(
            r.program.is_some()
                || r.args.is_some()
                || r.args_contain.is_some()
                || r.command.is_some()
                || r.env.is_some(),
            EXEC,
        );
        narrow(r.path.is_some(), FILES);
        narrow(r.connector.is_some() || r.access.is_some(), EGRESS | MCP);
        narrow(
            r.method.is_some() || r.host.is_some() || r.cidr.is_some() || r.http_path.is_some(),
            EGRESS,
        );
        narrow(r.tool.is_some() || r.arguments.is_some(), MCP);
        narrow(r.op.is_some(), LIFECYCLE);
        if applicable == 0 {
            return Err(err_at(
                text,
                span,
                "rule mixes matchers of different kinds; it could never match",
            ));
        }
        let kinds = match &r.kind {
            None => applicable,
            Some(k) => {
                let mut mask = 0u16;
                for name in nonempty(text, k, "kind")? {
                    let kind = KindName::ALL
                        .iter()
                        .find(|x| x.as_str() == name)
                        .ok_or_else(|| {
                            let all: Vec<_> = KindName::ALL.iter().map(|k| k.as_str()).collect();
                            err_at(
                                text,
                                k.span(),
                                format!(
                                    "unknown kind `{name}` (expected one of {})",
                                    all.join(", ")
                                ),
                            )
                        })?;
                    if applicable & (1 << kind.index()) == 0 {
                        return Err(err_at(
                            text,
                            k.span(),
                            format!("the rule's matchers do not apply to kind `{name}`"),
                        ));
                    }
                    mask |= 1 << kind.index();
                }
                mask
            }
        };

        let args = match &r.args {
            None => None,
            Some(f) => {
                let mut pats = f.get_ref().0.clone();
                let rest = pats.last().is_some_and(|p| p == "...");
                if rest {
                    pats.pop();
                }
                if pats.iter().any(|p| p == "...") {
                    return Err(err_at(text, f.span(), "`...` may only end the `args` list"));
                }
                let positions = pats
                    .iter()
                    .map(|p| one_glob(p, GlobMode::Text).map(|g| g.compile_matcher()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| err_at(text, f.span(), format!("`args`: {e}")))?;
                Some(ArgsMatcher { positions, rest })
            }
        };
        let args_contain = match &r.args_contain {
            None => None,
            Some(f) => Some(
                nonempty(text, f, "args_contain")?
                    .iter()
                    .map(|p| one_glob(p, GlobMode::Text).map(|g| g.compile_matcher()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| err_at(text, f.span(), format!("`args_contain`: {e}")))?,
            ),
        };
        let connector = match &r.connector {
            None => None,
            Some(f) => Some(nonempty(text, f, "connector")?),
        };
        let host = match &r.host {
            None => None,
            Some(f) => Some(hosts(text, f, "host")?),
        };
        let cidr = match &r.cidr {
            None => None,
            Some(f) => Some(nets(text, f, "cidr")?),
        };
        let op = match &r.op {
            None => None,
            Some(f) => Some(nonempty(text, f, "op")?),
        };
        rules.push(Rule {
            id,
            index,
            effect: r.effect,
            reason: r.reason.clone(),
            hard: r.hard,
            kinds,
            program: globs(text, &r.program, "program", GlobMode::Text)?,
            args,
            args_contain,
            command: globs(text, &r.command, "command", GlobMode::Text)?,
            env: globs(text, &r.env, "env", GlobMode::Text)?,
            path: globs(text, &r.path, "path", GlobMode::Path)?,
            connector,
            method: upper_list(text, &r.method, "method")?,
            host,
            cidr,
            http_path: globs(text, &r.http_path, "http_path", GlobMode::Path)?,
            access: r.access,
            op,
            tool: globs(text, &r.tool, "tool", GlobMode::Text)?,
            arguments: match &r.arguments {
                None => None,
                Some(a) => {
                    let mut out = Vec::new();
                    for (k, v) in a.get_ref() {
                        if k.is_empty() || k.split('.').any(str::is_empty) {
                            return Err(err_at(
                                text,
                                a.span(),
                                format!(
                                    "`arguments`: `{k}` is not an argument name or dotted path"
                                ),
                            ));
                        }
                        if v.0.is_empty() {
                            return Err(err_at(
                                text,
                                a.span(),
                                format!("`arguments.{k}` must not be an empty list"),
                            ));
                        }
                        let set = glob_set(&v.0, GlobMode::Text).map_err(|(_, e)| {
                            err_at(text, a.span(), format!("`arguments.{k}`: {e}"))
                        })?;
                        out.push((k.clone(), set));
                    }
                    Some(out)
                }
            },
        });
    }
    Ok(Policy {
        default: file.default,
        read_methods: file_reads,
        connectors,
        rules,
        allow_env: globs(text, &file.allow_env, "allow_env", GlobMode::Text)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(text: &str) -> ParseError {
        match parse(text) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(e) => e,
        }
    }

    #[test]
    fn syntax_error_names_line_and_column() {
        let e = refused("default = \"deny\"\n\n[[rule]]\neffect = \"allow\"\nkind = [\"exec\"\n");
        assert_eq!(e.line, 6, "{e}");
        let e = refused("default = \"deny\"\n[[rule]\neffect = \"allow\"\n");
        assert_eq!((e.line, e.column), (2, 7), "{e}");
        assert!(
            e.to_string()
                .starts_with("policy refused at line 2, column 7"),
            "{e}"
        );
    }

    #[test]
    fn unknown_field_is_refused_with_position() {
        let e = refused("default = \"deny\"\n[[rule]]\neffect = \"allow\"\nkindd = \"exec\"\n");
        assert_eq!(e.line, 4, "{e}");
        assert!(e.message.contains("kindd"), "{e}");
        let e = refused("defualt = \"deny\"\n");
        assert_eq!((e.line, e.column), (1, 1), "{e}");
        let e = refused("[[connector]]\nname = \"x\"\nhosts = \"a.com\"\nreadonly = true\n");
        assert_eq!(e.line, 4, "{e}");
    }

    #[test]
    fn semantic_errors_have_positions() {
        let e = refused("[[rule]]\neffect = \"maybe\"\n");
        assert_eq!(e.line, 2, "{e}");
        let e = refused("[[rule]]\neffect = \"deny\"\npath = \"/a/[\"\n");
        assert_eq!((e.line, e.column), (3, 8), "{e}");
        let e = refused("[[rule]]\neffect = \"deny\"\nkind = \"exec\"\npath = \"/a\"\n");
        assert_eq!(e.line, 3, "{e}");
        let e = refused("[[rule]]\neffect = \"deny\"\nkind = \"teleport\"\n");
        assert!(e.message.contains("teleport"), "{e}");
        let e = refused("[[rule]]\neffect = \"deny\"\nprogram = \"rm\"\npath = \"/a\"\n");
        assert_eq!(e.line, 1, "{e}");
        let e = refused(
            "[[rule]]\nid = \"a\"\neffect = \"deny\"\n[[rule]]\nid = \"a\"\neffect = \"deny\"\n",
        );
        assert_eq!(e.line, 5, "{e}");
        let e = refused("[[connector]]\nname = \"x\"\nhosts = [\"10.0.0.1\"]\n");
        assert_eq!(e.line, 3, "{e}");
        let e = refused("version = 2\n");
        assert_eq!(e.line, 1);
        let e = refused("[[rule]]\neffect = \"deny\"\nargs = [\"...\", \"x\"]\n");
        assert_eq!(e.line, 3);
        let e = refused("[[rule]]\neffect = \"deny\"\nprogram = 5\n");
        assert!(e.message.contains("a string or a list of strings"), "{e}");
        let e = refused("[[rule]]\neffect = \"deny\"\nmethod = []\n");
        assert_eq!(e.line, 3);
    }

    #[test]
    fn read_methods_per_connector_and_per_file() {
        let p = parse(
            r#"
read_methods = ["get", "PROPFIND"]
[[connector]]
name = "dav"
hosts = "dav.test"
[[connector]]
name = "api"
hosts = "api.test"
read_methods = ["GET", "HEAD"]
write_methods = ["HEAD"]
tls_ports = [443, 8443]
[[connector]]
name = "strict"
hosts = "strict.test"
read_methods = []
"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let c = |n: &str| {
            p.connectors
                .iter()
                .find(|c| c.name == n)
                .unwrap_or_else(|| panic!("no {n}"))
        };
        assert_eq!(
            p.read_methods,
            Some(vec!["GET".to_string(), "PROPFIND".to_string()])
        );
        // The file's list is the default of its connectors.
        assert!(!c("dav").is_write("PROPFIND"));
        assert!(c("dav").is_write("HEAD"));
        assert!(c("dav").is_write("MKCOL"));
        // A connector's own list wins; `write_methods` demotes a read.
        assert!(!c("api").is_write("GET"));
        assert!(c("api").is_write("HEAD"));
        assert!(c("api").is_write("PROPFIND"));
        assert_eq!(c("api").tls_ports, vec![443, 8443]);
        assert_eq!(c("dav").tls_ports, vec![443]);
        // An empty list: everything writes.
        assert!(c("strict").is_write("GET"));
        // Without any list: GET, HEAD, OPTIONS read; anything else writes.
        let p = parse("[[connector]]\nname = \"x\"\nhosts = \"x.test\"\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let x = &p.connectors[0];
        for m in ["GET", "HEAD", "OPTIONS"] {
            assert!(!x.is_write(m), "{m}");
        }
        for m in [
            "POST",
            "PUT",
            "PATCH",
            "DELETE",
            "MKCOL",
            "MOVE",
            "COPY",
            "PROPPATCH",
            "LOCK",
            "PURGE",
            "FROBNICATE",
            "CONNECT",
        ] {
            assert!(x.is_write(m), "{m}");
        }
        // CONNECT can never read; a method must be a token.
        let e = refused("[[connector]]\nname = \"x\"\nhosts = \"x.test\"\nread_methods = [\"GET\", \"CONNECT\"]\n");
        assert_eq!(e.line, 4, "{e}");
        assert!(e.message.contains("CONNECT"), "{e}");
        let e = refused("read_methods = [\"G ET\"]\n");
        assert_eq!(e.line, 1, "{e}");
        let e = refused("[[connector]]\nname = \"x\"\nhosts = \"x.test\"\ntls_ports = [0]\n");
        assert!(e.message.contains("tls_ports"), "{e}");
    }

    #[test]
    fn line_col_counts_characters() {
        assert_eq!(line_col("ab\ncé d", 6), (2, 3));
        assert_eq!(line_col("", 10), (1, 1));
    }
}
