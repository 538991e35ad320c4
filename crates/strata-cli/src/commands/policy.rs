//! `strata policy get|set|test`: the tenant's (or a sandbox's) tool-call
//! policy, as TOML, and a dry evaluation of one call.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Subcommand;
use serde_json::{json, Value};

use super::{CliError, Ctx};
use crate::views::{view, Decision};

/// `strata policy ...`
// Parsed once per process: the size of the `Test` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum PolicyCmd {
    /// Print the tenant's policy (or a sandbox's) as TOML.
    Get {
        /// A sandbox's own policy layer instead of the tenant's.
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Replace the tenant's policy (or a sandbox's) with a TOML file (admin).
    /// A file with an error is refused whole; the old policy stays.
    Set {
        /// The policy file (TOML), `-` for stdin.
        file: PathBuf,
        /// A sandbox's own policy layer instead of the tenant's.
        #[arg(long)]
        sandbox: Option<String>,
    },
    /// Evaluate one tool call against the policies in force, without running it.
    Test(TestArgs),
}

/// Kinds of tool call `policy test` can build.
pub const KINDS: [&str; 9] = [
    "exec",
    "file_read",
    "file_write",
    "egress",
    "snapshot",
    "fork",
    "rewind",
    "lifecycle",
    "mcp",
];

/// `strata policy test`
#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// Kind of call (`mcp` when --mcp is given).
    #[arg(long, value_parser = KINDS, required_unless_present = "mcp")]
    pub kind: Option<String>,
    /// mcp: a `tools/call` through the MCP gateway to this connector
    /// (docs/mcp.md); with --tool and --args.
    #[arg(long, value_name = "CONNECTOR")]
    pub mcp: Option<String>,
    /// mcp: the tool's name.
    #[arg(long)]
    pub tool: Option<String>,
    /// mcp: the tool's arguments, a JSON object (default `{}`).
    #[arg(long, value_name = "JSON")]
    pub args: Option<String>,
    /// exec: the command line, split like a shell would (quotes, backslashes).
    #[arg(long, conflicts_with = "argv")]
    pub cmd: Option<String>,
    /// file_read / file_write: absolute path in the guest.
    #[arg(long)]
    pub path: Option<String>,
    /// egress: the connector you expect (the daemon recomputes it from --host).
    #[arg(long)]
    pub connector: Option<String>,
    /// egress: destination host name.
    #[arg(long)]
    pub host: Option<String>,
    /// egress: the request as a URL (`https://api.example.com/v1/x?q=1`):
    /// sets host, port, scheme and path. An `https` request other than
    /// `CONNECT` is evaluated as the proxy judges one inside an
    /// intercepted connection (docs/tls-interception.md).
    /// (Not `--url`: that is the API's address, a global flag.)
    #[arg(long, conflicts_with_all = ["host", "port", "http_path"])]
    pub request_url: Option<String>,
    /// egress: HTTP method (CONNECT for a tunnel).
    #[arg(long, default_value = "GET")]
    pub method: String,
    /// egress: destination port [default: 443 for https, 80 for http].
    #[arg(long)]
    pub port: Option<u16>,
    /// egress: http or https.
    #[arg(long, default_value = "https", value_parser = ["http", "https"])]
    pub scheme: String,
    /// egress: request path.
    #[arg(long, default_value = "/")]
    pub http_path: String,
    /// lifecycle: operation (create, delete, pause, resume, hibernate, …).
    #[arg(long)]
    pub op: Option<String>,
    /// Evaluate with this sandbox's policy layer too.
    #[arg(long)]
    pub sandbox: Option<String>,
    /// exec: the argv as separate words, instead of --cmd.
    #[arg(last = true, value_name = "ARGV")]
    pub argv: Vec<String>,
}

/// Runs a policy command.
pub async fn run(ctx: &Ctx, cmd: PolicyCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        PolicyCmd::Get { sandbox } => {
            let v = match &sandbox {
                Some(s) => client.get(&["v1", "sandboxes", s, "policy"], &[]).await?,
                None => client.get(&["v1", "policy"], &[]).await?,
            };
            ctx.emit(&v, || Ok(format_get(&v, sandbox.as_deref())))?;
        }
        PolicyCmd::Set { file, sandbox } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("cannot read stdin")?
            } else {
                std::fs::read_to_string(&file)
                    .with_context(|| format!("cannot read {}", file.display()))?
            };
            let v = match &sandbox {
                Some(s) => {
                    client
                        .put_text(&["v1", "sandboxes", s, "policy"], text)
                        .await?
                }
                None => client.put_text(&["v1", "policy"], text).await?,
            };
            ctx.emit(&v, || {
                Ok(match &sandbox {
                    Some(s) => format!("policy of sandbox {s} updated from {}\n", file.display()),
                    None => {
                        let t = v.get("tenant").and_then(Value::as_str).unwrap_or("?");
                        format!("policy of tenant {t} updated from {}\n", file.display())
                    }
                })
            })?;
        }
        PolicyCmd::Test(a) => {
            let body = test_body(&a)?;
            let v = client.post(&["v1", "policy", "test"], &body).await?;
            ctx.emit(&v, || Ok(format_decision(&view(&v)?)))?;
        }
    }
    Ok(0)
}

fn format_get(v: &Value, sandbox: Option<&str>) -> String {
    match v.get("toml").and_then(Value::as_str) {
        Some(t) => {
            let mut s = t.to_owned();
            if !s.ends_with('\n') {
                s.push('\n');
            }
            s
        }
        None => match sandbox {
            Some(sb) => format!("# sandbox {sb} has no policy of its own: the tenant's applies\n"),
            None => "# no tenant policy set: the platform policy and defaults apply\n".into(),
        },
    }
}

fn need(v: &Option<String>, flag: &str, kind: &str) -> Result<String, CliError> {
    v.clone()
        .ok_or_else(|| CliError::InvalidArgument(format!("--kind {kind} needs {flag}")))
}

/// The `POST /v1/policy/test` body for the arguments.
pub fn test_body(a: &TestArgs) -> Result<Value, CliError> {
    let kind = match (&a.kind, &a.mcp) {
        (Some(k), _) => k.as_str(),
        (None, _) => "mcp",
    };
    let call = match kind {
        "mcp" => {
            let connector = need(&a.mcp, "--mcp CONNECTOR", kind)?;
            let tool = need(&a.tool, "--tool", kind)?;
            let args: Value = match &a.args {
                Some(t) => serde_json::from_str(t)
                    .map_err(|e| CliError::InvalidArgument(format!("--args is not JSON: {e}")))?,
                None => json!({}),
            };
            if !args.is_object() {
                return Err(CliError::InvalidArgument(
                    "--args must be a JSON object".into(),
                ));
            }
            json!({ "kind": "mcp", "connector": connector, "tool": tool, "arguments": args.to_string() })
        }
        "exec" => {
            let argv = match &a.cmd {
                Some(c) => split_command(c).map_err(CliError::InvalidArgument)?,
                None => a.argv.clone(),
            };
            if argv.is_empty() {
                return Err(CliError::InvalidArgument(
                    "--kind exec needs --cmd \"PROGRAM ARGS…\" (or -- PROGRAM ARGS…)".into(),
                ));
            }
            json!({ "kind": "exec", "argv": argv })
        }
        "file_read" | "file_write" => {
            json!({ "kind": kind, "path": need(&a.path, "--path", kind)? })
        }
        "egress" => {
            let method = a.method.to_ascii_uppercase();
            let (host, port, scheme, path) = match &a.request_url {
                Some(u) => egress_url(u)?,
                None => (
                    need(&a.host, "--host", kind)?,
                    a.port.unwrap_or(if a.scheme == "http" { 80 } else { 443 }),
                    a.scheme.clone(),
                    a.http_path.clone(),
                ),
            };
            let path = if method == "CONNECT" {
                String::new()
            } else {
                path
            };
            let tls = a.request_url.is_some() && scheme == "https" && method != "CONNECT";
            let mut c = json!({
                "kind": "egress", "connector": a.connector, "host": host, "port": port,
                "method": method, "path": path, "scheme": scheme,
            });
            if tls {
                c["tls"] = true.into();
            }
            c
        }
        "lifecycle" => json!({ "kind": "lifecycle", "op": need(&a.op, "--op", kind)? }),
        other => json!({ "kind": other }),
    };
    let mut b = json!({ "call": call });
    if let Some(s) = &a.sandbox {
        b["sandbox"] = s.clone().into();
    }
    Ok(b)
}

/// Host, port, scheme and path (with its query) of an egress `--url`.
fn egress_url(u: &str) -> Result<(String, u16, String, String), CliError> {
    let bad = |why: &str| CliError::InvalidArgument(format!("--request-url {u:?}: {why}"));
    let url = reqwest::Url::parse(u).map_err(|e| bad(&e.to_string()))?;
    let scheme = url.scheme().to_owned();
    if scheme != "http" && scheme != "https" {
        return Err(bad("only http:// and https:// URLs"));
    }
    let host = url
        .host_str()
        .ok_or_else(|| bad("no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url.port_or_known_default().ok_or_else(|| bad("no port"))?;
    let path = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_owned(),
    };
    Ok((host, port, scheme, path))
}

/// `effect / rule / layer / reason`, one per line.
pub fn format_decision(d: &Decision) -> String {
    let rule = match d.rule_index {
        Some(i) => format!("{} (#{i})", d.rule_id),
        None => d.rule_id.clone(),
    };
    let layer = match (&d.layer, d.hard) {
        (Some(l), true) => format!("{l} (hard)"),
        (Some(l), false) => l.clone(),
        (None, _) => "- (built-in)".into(),
    };
    let mut out = format!(
        "effect  {}\nrule    {rule}\nlayer   {layer}\nreason  {}\n",
        d.effect, d.reason
    );
    if let Some(s) = &d.secret {
        out.push_str(&format!("secret  {s} (injected by the proxy)\n"));
    }
    out
}

/// Splits a command line into words like a POSIX shell would, without
/// expansions: whitespace separates, '…' is literal, "…" keeps spaces and
/// honours \\ \" \$ \`, a backslash outside quotes escapes the next char.
pub fn split_command(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err(format!("{s:?}: unterminated single quote")),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('\\' | '"' | '$' | '`')) => cur.push(c),
                            Some(c) => {
                                cur.push('\\');
                                cur.push(c);
                            }
                            None => return Err(format!("{s:?}: unterminated double quote")),
                        },
                        Some(c) => cur.push(c),
                        None => return Err(format!("{s:?}: unterminated double quote")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(c) => cur.push(c),
                    None => return Err(format!("{s:?}: trailing backslash")),
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::{Cli, Command};
    use clap::Parser as _;

    fn test_args(args: &[&str]) -> Result<TestArgs, clap::Error> {
        let cli = Cli::try_parse_from(
            ["strata", "policy", "test"]
                .iter()
                .chain(args.iter())
                .copied(),
        )?;
        match cli.command {
            Command::Policy(PolicyCmd::Test(a)) => Ok(a),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn commands_split_like_a_shell() {
        assert_eq!(split_command("rm -rf /").unwrap(), ["rm", "-rf", "/"]);
        assert_eq!(
            split_command(r#"sh -c 'echo a; rm x'  "a b"\ c"#).unwrap(),
            ["sh", "-c", "echo a; rm x", "a b c"]
        );
        assert_eq!(
            split_command(r#"echo "\"q\" \n" ''"#).unwrap(),
            ["echo", "\"q\" \\n", ""]
        );
        assert!(split_command("echo 'open").is_err());
        assert!(split_command("echo \"open").is_err());
        assert!(split_command("echo \\").is_err());
        assert!(split_command("   ").unwrap().is_empty());
    }

    #[test]
    fn exec_test_bodies() {
        let a = test_args(&["--kind", "exec", "--cmd", "rm -rf /", "--sandbox", "sb-1"]).unwrap();
        assert_eq!(
            test_body(&a).unwrap(),
            json!({"sandbox": "sb-1", "call": {"kind": "exec", "argv": ["rm", "-rf", "/"]}})
        );
        let a = test_args(&["--kind", "exec", "--", "git", "push", "--force"]).unwrap();
        assert_eq!(
            test_body(&a).unwrap()["call"]["argv"],
            json!(["git", "push", "--force"])
        );
        let a = test_args(&["--kind", "exec"]).unwrap();
        assert!(test_body(&a).unwrap_err().to_string().contains("--cmd"));
        assert!(test_args(&["--kind", "exec", "--cmd", "ls", "--", "ls"]).is_err());
        assert!(test_args(&["--kind", "shell"]).is_err());
    }

    #[test]
    fn mcp_call_body() {
        let a = test_args(&[
            "--mcp",
            "slack",
            "--tool",
            "post_message",
            "--args",
            r##"{"text": "hi", "channel": "#general"}"##,
        ])
        .unwrap();
        assert_eq!(
            test_body(&a).unwrap()["call"],
            json!({"kind": "mcp", "connector": "slack", "tool": "post_message",
                   "arguments": r##"{"channel":"#general","text":"hi"}"##})
        );
        let a = test_args(&["--mcp", "slack"]).unwrap();
        assert!(test_body(&a).unwrap_err().to_string().contains("--tool"));
        let a = test_args(&["--mcp", "slack", "--tool", "t", "--args", "[1]"]).unwrap();
        assert!(test_body(&a).unwrap_err().to_string().contains("object"));
        assert!(test_args(&["--tool", "t"]).is_err());
    }

    #[test]
    fn file_egress_and_lifecycle_bodies() {
        let a = test_args(&["--kind", "file_write", "--path", "/etc/x"]).unwrap();
        assert_eq!(
            test_body(&a).unwrap(),
            json!({"call": {"kind": "file_write", "path": "/etc/x"}})
        );
        let a = test_args(&["--kind", "file_read"]).unwrap();
        assert!(test_body(&a).unwrap_err().to_string().contains("--path"));
        let a = test_args(&[
            "--kind",
            "egress",
            "--connector",
            "salesforce",
            "--method",
            "post",
            "--host",
            "acme.my.salesforce.com",
        ])
        .unwrap();
        assert_eq!(
            test_body(&a).unwrap()["call"],
            json!({"kind": "egress", "connector": "salesforce", "host": "acme.my.salesforce.com",
                   "port": 443, "method": "POST", "path": "/", "scheme": "https"})
        );
        let a = test_args(&[
            "--kind", "egress", "--host", "h", "--method", "CONNECT", "--scheme", "http",
        ])
        .unwrap();
        let c = &test_body(&a).unwrap()["call"];
        assert_eq!(
            (c["port"].clone(), c["path"].clone()),
            (json!(80), json!(""))
        );
        // An HTTPS request by URL: judged as inside an intercepted connection.
        let a = test_args(&[
            "--kind",
            "egress",
            "--request-url",
            "https://api.salesforce.test/services/x?q=1",
            "--method",
            "POST",
        ])
        .unwrap();
        assert_eq!(
            test_body(&a).unwrap()["call"],
            json!({"kind": "egress", "connector": null, "host": "api.salesforce.test",
                   "port": 443, "method": "POST", "path": "/services/x?q=1", "scheme": "https",
                   "tls": true})
        );
        assert!(test_args(&[
            "--kind",
            "egress",
            "--request-url",
            "https://h/",
            "--host",
            "h"
        ])
        .is_err());
        let a = test_args(&["--kind", "egress", "--request-url", "ftp://h/"]).unwrap();
        assert!(test_body(&a).is_err());
        let a = test_args(&["--kind", "lifecycle", "--op", "delete"]).unwrap();
        assert_eq!(
            test_body(&a).unwrap()["call"],
            json!({"kind": "lifecycle", "op": "delete"})
        );
        let a = test_args(&["--kind", "snapshot"]).unwrap();
        assert_eq!(test_body(&a).unwrap()["call"], json!({"kind": "snapshot"}));
    }

    #[test]
    fn decisions_print_effect_rule_layer_reason() {
        let d: Decision = view(&json!({
            "effect": "deny", "layer": "tenant", "rule_id": "no-rm", "rule_index": 0,
            "hard": true, "reason": "never delete the root"
        }))
        .unwrap();
        assert_eq!(
            format_decision(&d),
            "effect  deny\nrule    no-rm (#0)\nlayer   tenant (hard)\nreason  never delete the root\n"
        );
        let d: Decision = view(
            &json!({"effect": "allow", "layer": null, "rule_id": "default",
            "rule_index": null, "hard": false, "reason": "default"}),
        )
        .unwrap();
        assert!(format_decision(&d).contains("layer   - (built-in)"));
    }

    #[test]
    fn policy_get_without_a_policy_says_so() {
        assert!(
            format_get(&json!({"tenant": "t", "toml": null}), None).contains("no tenant policy")
        );
        assert_eq!(
            format_get(&json!({"toml": "default = \"deny\""}), None),
            "default = \"deny\"\n"
        );
    }
}
