//! `strata secret set|ls|rm` (admin; docs/secrets.md) and `strata connector
//! ls`: connector secrets the egress proxy injects, and the connectors of
//! the tenant's policy. A secret's value is read from stdin or a file,
//! never from the command line (argv is visible to every local user).

use std::io::Read as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Subcommand;
use serde_json::{json, Value};

use super::{CliError, Ctx};

/// `strata secret ...`
// Parsed once per process: the size of the `Set` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum SecretCmd {
    /// Write (or rotate) a secret bound to a connector; its value comes
    /// from stdin or --value-file (for --oauth2: the refresh token, and
    /// the client secret from --client-secret-file).
    Set(SetArgs),
    /// List the tenant's secrets (names, connector, rule; never a value).
    Ls,
    /// Delete a secret.
    Rm {
        /// Secret name.
        name: String,
    },
}

/// `strata secret set`
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("rule").required(true).args(["bearer", "header", "basic", "query", "oauth2"])))]
pub struct SetArgs {
    /// Secret name (1-64 of [A-Za-z0-9_.-]).
    pub name: String,
    /// The connector (by name) whose requests carry it.
    #[arg(long)]
    pub connector: String,
    /// Inject `Authorization: Bearer <value>`.
    #[arg(long)]
    pub bearer: bool,
    /// Inject header H (`--template` shapes its value).
    #[arg(long, value_name = "H")]
    pub header: Option<String>,
    /// The header's value, `{value}` once [default: {value}].
    #[arg(long, requires = "header")]
    pub template: Option<String>,
    /// Inject `Authorization: Basic` as USER and the value.
    #[arg(long, value_name = "USER")]
    pub basic: Option<String>,
    /// Inject query parameter P.
    #[arg(long, value_name = "P")]
    pub query: Option<String>,
    /// An OAuth2 refresh-token grant against this token URL: the proxy
    /// refreshes and injects access tokens (the value is the refresh token).
    #[arg(long, value_name = "TOKEN_URL", requires = "client_id")]
    pub oauth2: Option<String>,
    /// OAuth2 client id.
    #[arg(long, requires = "oauth2")]
    pub client_id: Option<String>,
    /// OAuth2 client secret, read from this file.
    #[arg(long, requires = "oauth2")]
    pub client_secret_file: Option<PathBuf>,
    /// OAuth2 scope.
    #[arg(long, requires = "oauth2")]
    pub scope: Option<String>,
    /// Read the value from this file instead of stdin.
    #[arg(long)]
    pub value_file: Option<PathBuf>,
}

/// `strata connector ...`
#[derive(Debug, Subcommand)]
pub enum ConnectorCmd {
    /// The connectors of the tenant's policy: hosts, write block, secrets.
    Ls,
}

fn read_value(file: Option<&PathBuf>) -> anyhow::Result<String> {
    let mut raw = String::new();
    match file {
        Some(f) => {
            raw = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read {}", f.display()))?
        }
        None => {
            std::io::stdin()
                .read_to_string(&mut raw)
                .context("cannot read the value from stdin")?;
        }
    }
    // One trailing newline (echo, a file) is not part of the value.
    let v = raw
        .strip_suffix("\r\n")
        .or_else(|| raw.strip_suffix('\n'))
        .unwrap_or(&raw)
        .to_owned();
    if v.is_empty() {
        return Err(CliError::InvalidArgument(
            "the value is empty (give it on stdin or with --value-file)".into(),
        )
        .into());
    }
    Ok(v)
}

/// The `POST /v1/secrets` body of `a`, its value `value`.
pub fn set_body(a: &SetArgs, value: String, client_secret: Option<String>) -> Value {
    if let Some(url) = &a.oauth2 {
        let mut o = json!({ "token_url": url, "client_id": a.client_id, "refresh_token": value });
        if let Some(cs) = client_secret {
            o["client_secret"] = cs.into();
        }
        if let Some(s) = &a.scope {
            o["scope"] = s.clone().into();
        }
        return json!({ "name": a.name, "connector": a.connector, "kind": "oauth2", "oauth2": o });
    }
    let rule = if let Some(h) = &a.header {
        json!({ "type": "header", "name": h, "template": a.template.clone().unwrap_or_else(|| "{value}".into()) })
    } else if let Some(u) = &a.basic {
        json!({ "type": "basic", "user": u })
    } else if let Some(p) = &a.query {
        json!({ "type": "query", "param": p })
    } else {
        json!({ "type": "bearer" })
    };
    json!({ "name": a.name, "connector": a.connector, "kind": "static", "rule": rule, "value": value })
}

use crate::views::{field as s, items_or_empty as items};

fn rule_text(r: &Value) -> String {
    match r.get("type").and_then(Value::as_str) {
        Some("header") => format!("header {}", s(r, "name")),
        Some("basic") => format!("basic {}", s(r, "user")),
        Some("query") => format!("query {}", s(r, "param")),
        Some(t) => t.to_owned(),
        None => "-".into(),
    }
}

fn list(v: &[Value]) -> String {
    let names: Vec<String> = v
        .iter()
        .filter_map(|x| x.as_str().map(str::to_owned))
        .collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join(",")
    }
}

/// Runs a secret command.
pub async fn run(ctx: &Ctx, cmd: SecretCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        SecretCmd::Set(a) => {
            let value = read_value(a.value_file.as_ref())?;
            let cs = match &a.client_secret_file {
                Some(f) => Some(read_value(Some(f))?),
                None => None,
            };
            let body = set_body(&a, value, cs);
            let v = client.post(&["v1", "secrets"], &body).await?;
            ctx.emit(&v, || {
                Ok(format!(
                    "secret {} set for connector {} ({} {})\n",
                    s(&v, "name"),
                    s(&v, "connector"),
                    s(&v, "kind"),
                    v.get("rule").map(rule_text).unwrap_or_default()
                ))
            })?;
        }
        SecretCmd::Ls => {
            let v = client.get(&["v1", "secrets"], &[]).await?;
            ctx.emit(&v, || {
                let mut out = String::from("NAME                 CONNECTOR            KIND    RULE                 UPDATED\n");
                for x in items(&v) {
                    out.push_str(&format!(
                        "{:<20} {:<20} {:<7} {:<20} {}\n",
                        s(&x, "name"),
                        s(&x, "connector"),
                        s(&x, "kind"),
                        x.get("rule").map(rule_text).unwrap_or_default(),
                        s(&x, "updated_at")
                    ));
                }
                Ok(out)
            })?;
        }
        SecretCmd::Rm { name } => {
            let v = client.delete(&["v1", "secrets", &name], &[]).await?;
            ctx.emit(&v, || Ok(format!("deleted secret {name}\n")))?;
        }
    }
    Ok(0)
}

/// Runs a connector command.
pub async fn run_connector(ctx: &Ctx, cmd: ConnectorCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        ConnectorCmd::Ls => {
            let v = client.get(&["v1", "connectors"], &[]).await?;
            ctx.emit(&v, || {
                let mut out = String::from(
                    "NAME                 LAYER     WRITES   SECRETS              HOSTS\n",
                );
                for c in items(&v) {
                    let hosts = c
                        .get("hosts")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    let secrets = c
                        .get("secrets")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    let writes = if c.get("read_only") == Some(&Value::Bool(true)) {
                        "blocked"
                    } else {
                        "policy"
                    };
                    out.push_str(&format!(
                        "{:<20} {:<9} {:<8} {:<20} {}\n",
                        s(&c, "name"),
                        s(&c, "layer"),
                        writes,
                        list(&secrets),
                        list(&hosts)
                    ));
                }
                Ok(out)
            })?;
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::{Cli, Command};
    use clap::Parser as _;

    fn set_args(args: &[&str]) -> Result<SetArgs, clap::Error> {
        let cli = Cli::try_parse_from(["strata", "secret", "set"].iter().chain(args.iter()))?;
        match cli.command {
            Command::Secret(SecretCmd::Set(a)) => Ok(a),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rules_map_to_the_api_body_and_the_value_never_comes_from_argv() {
        let a = set_args(&["sf", "--connector", "salesforce", "--bearer"]).unwrap();
        let b = set_body(&a, "v".into(), None);
        assert_eq!(b["rule"], json!({ "type": "bearer" }));
        assert_eq!(b["value"], "v");
        let a = set_args(&[
            "k",
            "--connector",
            "c",
            "--header",
            "X-Api-Key",
            "--template",
            "Token {value}",
        ])
        .unwrap();
        assert_eq!(
            set_body(&a, "v".into(), None)["rule"],
            json!({ "type": "header", "name": "X-Api-Key", "template": "Token {value}" })
        );
        let a = set_args(&["k", "--connector", "c", "--basic", "bob"]).unwrap();
        assert_eq!(
            set_body(&a, "v".into(), None)["rule"],
            json!({ "type": "basic", "user": "bob" })
        );
        let a = set_args(&["k", "--connector", "c", "--query", "api_key"]).unwrap();
        assert_eq!(
            set_body(&a, "v".into(), None)["rule"],
            json!({ "type": "query", "param": "api_key" })
        );
        let a = set_args(&[
            "o",
            "--connector",
            "c",
            "--oauth2",
            "https://login.test/token",
            "--client-id",
            "cid",
        ])
        .unwrap();
        let b = set_body(&a, "refresh".into(), Some("cs".into()));
        assert_eq!(b["kind"], "oauth2");
        assert_eq!(b["oauth2"]["refresh_token"], "refresh");
        assert_eq!(b["oauth2"]["client_secret"], "cs");
        // A rule is required, one only, and there is no --value flag.
        assert!(set_args(&["k", "--connector", "c"]).is_err());
        assert!(set_args(&["k", "--connector", "c", "--bearer", "--query", "p"]).is_err());
        assert!(set_args(&["k", "--connector", "c", "--bearer", "--value", "x"]).is_err());
    }
}
