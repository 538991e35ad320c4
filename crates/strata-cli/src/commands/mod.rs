//! The command line: global options, one module per verb, and what they share.

use clap::{Parser, Subcommand};
use serde_json::Value;

use std::io::{IsTerminal as _, Read as _};
use std::path::PathBuf;
use std::time::Duration;

use crate::api::{ApiClient, ApiError, Gate, DEFAULT_URL};
use crate::human::{duration_arg, parse_duration};

pub mod approvals;
pub mod audit;
pub mod ca;
pub mod create;
pub mod dev;
pub mod events;
pub mod exec;
pub mod files;
pub mod fork;
pub mod hibernate;
pub mod image;
pub mod info;
pub mod logs;
pub mod ls;
pub mod r#move;
pub mod pause;
pub mod policy;
pub mod port;
pub mod pull;
pub mod push;
pub mod resume;
pub mod rewind;
pub mod rm;
pub mod run_code;
pub mod secret;
pub mod serve;
pub mod snapshot;
pub mod snapshots;
pub mod stats;
pub mod template;
pub mod token;
pub mod webhook;
pub mod whoami;

/// strata: microVM sandboxes for AI agents (client of stratad).
#[derive(Debug, Parser)]
#[command(name = "strata", version, about, propagate_version = true)]
pub struct Cli {
    /// Address of stratad.
    #[arg(long, global = true, env = "STRATA_URL", default_value = DEFAULT_URL)]
    pub url: String,
    /// PEM CA certificates an `https://` URL's server must chain to,
    /// instead of the system's trust store.
    #[arg(long, global = true, env = "STRATA_CA_BUNDLE", value_name = "FILE")]
    pub ca_bundle: Option<std::path::PathBuf>,
    /// API token, sent as `Authorization: Bearer`.
    #[arg(long, global = true, env = "STRATA_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Machine-readable output (errors as {"error":{"code","message"}}).
    #[arg(long, global = true)]
    pub json: bool,
    /// Do not wait: a call held for approval prints the approval id and
    /// exits 75; `template build` returns once the build is accepted.
    #[arg(long, global = true)]
    pub no_wait: bool,
    /// Re-send a held call with this approved request id.
    #[arg(long, global = true, value_name = "ID")]
    pub approval: Option<String>,
    /// How long to wait for a held call's approval, e.g. 10m.
    #[arg(long, global = true, value_parser = duration_arg, default_value = "10m")]
    pub approval_timeout: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The verbs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Build or list guest images (local, no daemon).
    #[command(subcommand)]
    Image(image::ImageCmd),
    /// Developer tools that run on this host without a daemon.
    #[command(subcommand)]
    Dev(dev::DevCmd),
    /// Create a sandbox from a template.
    Create(create::Args),
    /// List sandboxes.
    Ls(ls::Args),
    /// Show one sandbox.
    Info(info::Args),
    /// Delete a sandbox.
    Rm(rm::Args),
    /// Run a command in a sandbox, streaming its output.
    Exec(exec::Args),
    /// Run code in a code-interpreter sandbox's kernel; results after the output.
    RunCode(run_code::Args),
    /// Move files in and out of a sandbox.
    #[command(subcommand)]
    Files(files::FilesCmd),
    /// Stop a sandbox's vCPUs (RAM kept).
    Pause(pause::Args),
    /// Continue a paused sandbox, or wake a hibernated one.
    Resume(resume::Args),
    /// Snapshot a sandbox and stop its VM (no CPU, no RAM).
    Hibernate(hibernate::Args),
    /// Move a sandbox to another deployment (it stays here, hibernated).
    Push(push::Args),
    /// Copy a sandbox of another deployment here (it stays there, hibernated).
    Pull(pull::Args),
    /// Move a sandbox to another host of the cluster (same id; memory kept).
    Move(r#move::Args),
    /// Take a snapshot of a sandbox.
    Snapshot(snapshot::Args),
    /// Show a sandbox's snapshot timeline.
    Snapshots(snapshots::Args),
    /// Fork a sandbox (its present state) or a snapshot into a new sandbox.
    Fork(fork::Args),
    /// Return a sandbox to one of its snapshots, in place.
    Rewind(rewind::Args),
    /// Build, list or delete templates.
    #[command(subcommand)]
    Template(template::TemplateCmd),
    /// Latency percentiles of the daemon's operations; with ID, that
    /// sandbox's CPU, memory and disk use over time.
    Stats(stats::Args),
    /// What a sandbox's commands printed (the daemon's process log); -f follows.
    Logs(logs::Args),
    /// The approval queue: calls held by policy until a human answers.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCmd),
    /// The audit log: verify the keyed chain (admin), export entries.
    #[command(subcommand)]
    Audit(audit::AuditCmd),
    /// Tool-call policies (tenant or sandbox): get, set, dry-run test.
    #[command(subcommand)]
    Policy(policy::PolicyCmd),
    /// API tokens: create, list, revoke.
    #[command(subcommand)]
    Token(token::TokenCmd),
    /// The tenant's journal (transitions, snapshots, approvals, policy
    /// refusals); --follow streams it live.
    Events(events::Args),
    /// Webhooks (approval notifications): add, list, remove, deliveries.
    #[command(subcommand)]
    Webhook(webhook::WebhookCmd),
    /// Connector secrets the egress proxy injects (admin): set, list,
    /// remove. Values come from stdin or a file, never argv.
    #[command(subcommand)]
    Secret(secret::SecretCmd),
    /// Connectors of the tenant's policy: hosts, write block, secrets.
    #[command(subcommand)]
    Connector(secret::ConnectorCmd),
    /// Who the token is: tenant, role, token id.
    Whoami,
    /// The daemon's local CA certificate (PEM), which signs its TLS
    /// listener's certificates (`[e2b] tls_listen`).
    Ca,
    /// The URL(s) of a guest port: the /v1 route and, with --e2b-domain,
    /// the E2B routed host.
    Port(port::Args),
    /// Run the daemon (execs the `stratad` binary).
    Serve(serve::Args),
}

/// Exit code of a call held for approval and not waited for (`--no-wait`,
/// or the wait ran out): `EX_TEMPFAIL`, "try again later".
pub const EXIT_HELD: i32 = 75;

/// Where the daemon writes its bootstrap admin token, in this order:
/// `$STRATA_DATA_DIR/admin.token`, `/var/lib/strata/admin.token`.
pub fn admin_token_paths(data_dir: Option<&std::ffi::OsStr>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = data_dir.filter(|d| !d.is_empty()) {
        v.push(PathBuf::from(d).join("admin.token"));
    }
    v.push(PathBuf::from("/var/lib/strata/admin.token"));
    v
}

/// The token to use: `--token` / `STRATA_TOKEN`, else the first readable,
/// non-empty admin token file of [`admin_token_paths`].
pub fn resolve_token(given: Option<&str>, files: &[PathBuf]) -> Option<String> {
    if let Some(t) = given.map(str::trim).filter(|t| !t.is_empty()) {
        return Some(t.to_owned());
    }
    files.iter().find_map(|p| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    })
}

/// What every command gets: output mode and how to reach the daemon.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// `--json`.
    pub json: bool,
    /// `--no-wait`.
    pub no_wait: bool,
    url: String,
    ca_bundle: Option<std::path::PathBuf>,
    token: Option<String>,
    gate: Gate,
}

impl Ctx {
    /// From the parsed global options.
    pub fn new(cli: &Cli) -> Self {
        let gate = Gate {
            no_wait: cli.no_wait,
            approval: cli.approval.clone(),
            timeout: parse_duration(&cli.approval_timeout).unwrap_or(Duration::from_secs(600)),
            ..Gate::default()
        };
        Ctx {
            json: cli.json,
            no_wait: cli.no_wait,
            url: cli.url.clone(),
            ca_bundle: cli.ca_bundle.clone(),
            token: cli.token.clone(),
            gate,
        }
    }

    /// A client of the daemon. Without `--token`/`STRATA_TOKEN`, the
    /// daemon's bootstrap admin token is used when its file is readable.
    pub fn client(&self) -> Result<ApiClient, ApiError> {
        let files = admin_token_paths(std::env::var_os("STRATA_DATA_DIR").as_deref());
        let token = resolve_token(self.token.as_deref(), &files);
        Ok(
            ApiClient::with_ca_bundle(&self.url, token, self.ca_bundle.as_deref())?
                .with_gate(self.gate.clone()),
        )
    }

    /// Prints `v` as JSON under `--json`, else the human text `human()`.
    pub fn emit(
        &self,
        v: &Value,
        human: impl FnOnce() -> anyhow::Result<String>,
    ) -> anyhow::Result<()> {
        if self.json {
            println!("{v}");
        } else {
            // Guest- and tenant-chosen text (file names, labels, reasons,
            // console tails) never reaches the terminal as escape sequences.
            let text = human()?;
            let text = strata_core::text::escape_text(&text);
            print!("{text}");
            if !text.is_empty() && !text.ends_with('\n') {
                println!();
            }
        }
        Ok(())
    }
}

/// Runs one command; returns the process exit code.
pub async fn run(ctx: &Ctx, cmd: Command) -> anyhow::Result<i32> {
    match cmd {
        Command::Image(c) => image::run(ctx, c).await,
        Command::Dev(c) => dev::run(ctx, c).await,
        Command::Create(a) => create::run(ctx, a).await,
        Command::Ls(a) => ls::run(ctx, a).await,
        Command::Info(a) => info::run(ctx, a).await,
        Command::Rm(a) => rm::run(ctx, a).await,
        Command::Exec(a) => exec::run(ctx, a).await,
        Command::RunCode(a) => run_code::run(ctx, a).await,
        Command::Files(c) => files::run(ctx, c).await,
        Command::Pause(a) => pause::run(ctx, a).await,
        Command::Resume(a) => resume::run(ctx, a).await,
        Command::Hibernate(a) => hibernate::run(ctx, a).await,
        Command::Push(a) => push::run(ctx, a).await,
        Command::Pull(a) => pull::run(ctx, a).await,
        Command::Move(a) => r#move::run(ctx, a).await,
        Command::Snapshot(a) => snapshot::run(ctx, a).await,
        Command::Snapshots(a) => snapshots::run(ctx, a).await,
        Command::Fork(a) => fork::run(ctx, a).await,
        Command::Rewind(a) => rewind::run(ctx, a).await,
        Command::Template(c) => template::run(ctx, c).await,
        Command::Stats(a) => stats::run(ctx, a).await,
        Command::Logs(a) => logs::run(ctx, a).await,
        Command::Approvals(c) => approvals::run(ctx, c).await,
        Command::Audit(c) => audit::run(ctx, c).await,
        Command::Policy(c) => policy::run(ctx, c).await,
        Command::Token(c) => token::run(ctx, c).await,
        Command::Events(a) => events::run(ctx, a).await,
        Command::Webhook(c) => webhook::run(ctx, c).await,
        Command::Secret(c) => secret::run(ctx, c).await,
        Command::Connector(c) => secret::run_connector(ctx, c).await,
        Command::Whoami => whoami::run(ctx).await,
        Command::Ca => ca::run(ctx).await,
        Command::Port(a) => port::run(ctx, a).await,
        Command::Serve(a) => serve::run(ctx, a).await,
    }
}

/// Errors found by the CLI itself (before or without the daemon).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A bad argument the parser could not catch.
    #[error("{0}")]
    InvalidArgument(String),
    /// Something needed on this host is missing (agent binary, image, stratad).
    #[error("{0}")]
    Missing(String),
    /// A long operation the daemon accepted ended in failure.
    #[error("{0}")]
    OperationFailed(String),
    /// Interrupted by a signal.
    #[error("interrupted")]
    Interrupted,
}

impl CliError {
    fn code(&self) -> &'static str {
        match self {
            CliError::InvalidArgument(_) => "invalid_request",
            CliError::Missing(_) => "not_found",
            CliError::OperationFailed(_) => "operation_failed",
            CliError::Interrupted => "interrupted",
        }
    }
}

/// The stable code of an error for `--json` (the first typed error in the chain).
pub fn error_code(e: &anyhow::Error) -> String {
    for cause in e.chain() {
        if let Some(a) = cause.downcast_ref::<ApiError>() {
            return a.code().to_owned();
        }
        if let Some(c) = cause.downcast_ref::<CliError>() {
            return c.code().to_owned();
        }
        if cause.downcast_ref::<strata_image::ImageError>().is_some() {
            return "image_error".into();
        }
        if cause.downcast_ref::<strata_vmm::VmmError>().is_some() {
            return "vm_failed".into();
        }
        if cause.downcast_ref::<strata_proto::AgentError>().is_some() {
            return "agent_error".into();
        }
        if cause.downcast_ref::<std::io::Error>().is_some() {
            return "io_error".into();
        }
    }
    "internal".into()
}

/// The first [`ApiError`] in an error's chain.
pub fn api_error(e: &anyhow::Error) -> Option<&ApiError> {
    e.chain().find_map(|c| c.downcast_ref::<ApiError>())
}

/// The process exit code of a failed command: 130 when interrupted,
/// [`EXIT_HELD`] for a call left waiting for approval, else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    if matches!(api_error(e), Some(ApiError::Held { .. })) {
        return EXIT_HELD;
    }
    // 128 + SIGINT, as shells report an interrupted command.
    if error_code(e) == "interrupted" {
        130
    } else {
        1
    }
}

/// Prints an error: under `--json` `{"error":{"code","message","status"}}`
/// on stdout, else `strata: error: MESSAGE (HTTP STATUS CODE)` on stderr.
/// A call held for approval prints the approval id on stdout (the daemon's
/// `202` answer under `--json`) and the hint on stderr.
pub fn print_failure(ctx: &Ctx, e: &anyhow::Error, code: &str, message: &str) {
    let api = api_error(e);
    if let Some(ApiError::Held {
        approval_id, body, ..
    }) = api
    {
        if ctx.json {
            println!("{body}");
        } else {
            println!("{approval_id}");
            eprintln!("strata: {}", strata_core::text::escape_text(message));
        }
        return;
    }
    let status = api.and_then(ApiError::status);
    if ctx.json {
        let mut err = serde_json::json!({ "code": code, "message": message });
        if let Some(s) = status {
            err["status"] = s.into();
        }
        println!("{}", serde_json::json!({ "error": err }));
    } else {
        eprintln!(
            "strata: error: {}",
            strata_core::text::escape_text(&human_error(message, code, status))
        );
    }
}

/// Prints an error of the client's own: under `--json`
/// `{"error":{"code","message"}}` on stdout, else `strata: error: MESSAGE`.
pub fn print_error(ctx: &Ctx, code: &str, message: &str) {
    if ctx.json {
        let body = serde_json::json!({ "error": { "code": code, "message": message } });
        println!("{body}");
    } else {
        eprintln!("strata: error: {}", strata_core::text::escape_text(message));
    }
}

/// `MESSAGE (HTTP 403 forbidden)` for a daemon error, else `MESSAGE`.
pub fn human_error(message: &str, code: &str, status: Option<u16>) -> String {
    match status {
        Some(s) => format!("{message} (HTTP {s} {code})"),
        None => message.to_owned(),
    }
}

/// Parses `KEY=VALUE` (labels, env).
pub fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// `{"k": "v", ...}` from pairs (labels, env).
pub fn string_map(pairs: &[(String, String)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect(),
    )
}

/// `--vcpus`, `--memory`, `--disk`: the size asked for a new sandbox or
/// template. A verb words whose size is the default with [`size_defaults`].
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SizeArgs {
    /// Virtual CPUs.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub vcpus: Option<u32>,
    /// Memory in MiB.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub memory: Option<u32>,
    /// Disk in GiB.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub disk: Option<u32>,
}

impl SizeArgs {
    /// The size object of a request (only the fields given).
    pub fn json(&self) -> Value {
        let mut m = serde_json::Map::new();
        if let Some(v) = self.vcpus {
            m.insert("vcpus".into(), v.into());
        }
        if let Some(v) = self.memory {
            m.insert("memory_mib".into(), v.into());
        }
        if let Some(v) = self.disk {
            m.insert("disk_gib".into(), v.into());
        }
        Value::Object(m)
    }
}

/// For `#[command(mut_args(size_defaults("the template's")))]`: adds
/// `[default: WHOSE]` to the help of the [`SizeArgs`] flags.
pub fn size_defaults(whose: &'static str) -> impl FnMut(clap::Arg) -> clap::Arg {
    move |a| match a.get_id().as_str() {
        "vcpus" | "memory" | "disk" => {
            let help = a.get_help().map(ToString::to_string).unwrap_or_default();
            a.help(format!("{help} [default: {whose}]"))
        }
        _ => a,
    }
}

/// What `create` and `fork` ask of the new sandbox: size, labels, idle timeout.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct NewSandboxArgs {
    /// Size.
    #[command(flatten)]
    pub size: SizeArgs,
    /// Label (repeatable).
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = key_value)]
    pub labels: Vec<(String, String)>,
    /// Hibernate after this long without activity, e.g. 30m (0 = never).
    #[arg(long, value_parser = duration_arg)]
    pub idle_timeout: Option<String>,
}

impl NewSandboxArgs {
    /// The request body's `size`, `labels` and `idle_timeout` (when given).
    pub fn body(&self) -> Value {
        let mut b = serde_json::json!({
            "size": self.size.json(),
            "labels": string_map(&self.labels),
        });
        if let Some(t) = &self.idle_timeout {
            b["idle_timeout"] = t.clone().into();
        }
        b
    }
}

/// `--env`, `--cwd`, `--user`: how a command runs in the guest (`exec`,
/// `dev run`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ProcessArgs {
    /// Environment variable (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// User to run as (name or uid).
    #[arg(long)]
    pub user: Option<String>,
}

/// This process's stdin for a command, read to its end: `None` with
/// `--no-stdin`, on a terminal, or when it cannot be read (a closed stdin).
pub fn read_stdin(no_stdin: bool) -> Option<Vec<u8>> {
    if no_stdin || std::io::stdin().is_terminal() {
        return None;
    }
    let mut buf = Vec::new();
    std::io::stdin().read_to_end(&mut buf).ok().map(|_| buf)
}

/// The one argument of `info`, `pause`, `resume`, `hibernate`, `snapshots`.
#[derive(Debug, Clone, clap::Args)]
pub struct SandboxArg {
    /// Sandbox id.
    pub id: String,
}

/// `POST`s a tool call that answers with a sandbox record (create, fork,
/// pause …), then prints the record.
pub async fn post_for_sandbox(ctx: &Ctx, segments: &[&str], body: &Value) -> anyhow::Result<i32> {
    let v = ctx.client()?.post_call(segments, body).await?;
    ctx.emit(&v, || sandbox_line(&v))?;
    Ok(0)
}

/// `POST /v1/sandboxes/{id}/{verb}` with an empty body (pause, resume,
/// hibernate), then prints the sandbox record the daemon answers with.
pub async fn sandbox_action(ctx: &Ctx, id: &str, verb: &str) -> anyhow::Result<i32> {
    let segments = ["v1", "sandboxes", id, verb];
    post_for_sandbox(ctx, &segments, &serde_json::json!({})).await
}

/// `DELETE /v1/{collection}/{id}` for each id in turn, stopping at the first
/// failure. Prints `deleted WHAT` as each one goes (`what` names it from the
/// daemon's answer), or under `--json` at the end the answer (one id) or the
/// array of answers.
pub async fn delete_each(
    ctx: &Ctx,
    collection: &str,
    ids: &[String],
    what: impl Fn(&str, &Value) -> String,
) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let mut done = Vec::new();
    for id in ids {
        let v = client.delete_call(&["v1", collection, id], &[]).await?;
        if !ctx.json {
            println!("deleted {}", what(id, &v));
        }
        done.push(v);
    }
    if ctx.json {
        match done.len() {
            1 => println!("{}", done[0]),
            _ => println!("{}", Value::Array(done)),
        }
    }
    Ok(0)
}

/// One-line human summary of a sandbox record.
pub fn sandbox_line(v: &Value) -> anyhow::Result<String> {
    let s: crate::views::Sandbox = crate::views::view(v)?;
    let mut line = format!("{}  {}  {}", s.id, s.state, s.size.describe());
    if let Some(r) = &s.state_reason {
        line.push_str(&format!("  ({r})"));
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("strata").chain(args.iter().copied()))
    }

    #[test]
    fn a_webhook_target_is_not_the_daemon_url() {
        // `webhook add URL` once shared clap's id with the global `--url`:
        // the CLI then sent the request to the webhook's target.
        let cli = parse(&[
            "--url",
            "http://h:1",
            "webhook",
            "add",
            "https://hooks.example/x",
        ])
        .unwrap();
        assert_eq!(cli.url, "http://h:1");
        let Command::Webhook(webhook::WebhookCmd::Add { target, .. }) = cli.command else {
            panic!("not webhook add: {:?}", cli.command);
        };
        assert_eq!(target, "https://hooks.example/x");
        let cli = parse(&["webhook", "add", "https://hooks.example/x"]).unwrap();
        assert_ne!(cli.url, "https://hooks.example/x");
    }

    #[test]
    fn global_options_go_anywhere() {
        let cli = parse(&["ls", "--json", "--url", "http://h:1", "--token", "t"]).unwrap();
        assert!(cli.json);
        assert_eq!(cli.url, "http://h:1");
        assert_eq!(cli.token.as_deref(), Some("t"));
        let cli = parse(&["--json", "info", "sb-1"]).unwrap();
        assert!(cli.json);
    }

    #[test]
    fn exec_takes_everything_after_the_double_dash() {
        let cli = parse(&[
            "exec",
            "sb-1",
            "--env",
            "A=1",
            "--cwd",
            "/tmp",
            "--",
            "sh",
            "-c",
            "echo --json",
        ])
        .unwrap();
        let Command::Exec(a) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(a.id, "sb-1");
        assert_eq!(a.cmd, ["sh", "-c", "echo --json"]);
        assert_eq!(a.process.env, [("A".to_string(), "1".to_string())]);
        assert!(!cli.json);
        assert!(parse(&["exec", "sb-1"]).is_err(), "a command is required");
    }

    #[test]
    fn rewind_needs_exactly_one_target() {
        assert!(parse(&["rewind", "sb-1", "--to", "snap-1"]).is_ok());
        assert!(parse(&["rewind", "sb-1", "--ago", "10m"]).is_ok());
        assert!(parse(&["rewind", "sb-1"]).is_err());
        assert!(parse(&["rewind", "sb-1", "--to", "snap-1", "--ago", "10m"]).is_err());
        let e = parse(&["rewind", "sb-1", "--ago", "ten minutes"]).unwrap_err();
        assert!(e.to_string().contains("invalid duration"), "{e}");
    }

    #[test]
    fn create_options() {
        let cli = parse(&[
            "create",
            "--template",
            "tpl-a",
            "--vcpus",
            "2",
            "--memory",
            "1024",
            "--label",
            "team=ml",
            "--label",
            "env=dev",
            "--idle-timeout",
            "30m",
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!("not create")
        };
        assert_eq!(a.sandbox.size.vcpus, Some(2));
        assert_eq!(a.sandbox.labels.len(), 2);
        assert_eq!(a.sandbox.idle_timeout.as_deref(), Some("30m"));
        assert!(parse(&["create", "--label", "novalue"]).is_err());
        assert!(parse(&["create", "--vcpus", "-1"]).is_err());
    }

    #[test]
    fn dev_run_defaults() {
        let cli = parse(&["dev", "run", "--", "uname", "-a"]).unwrap();
        let Command::Dev(dev::DevCmd::Run(a)) = cli.command else {
            panic!("not dev run")
        };
        assert_eq!(a.cmd, ["uname", "-a"]);
        assert_eq!(a.memory, 512);
        assert_eq!(a.vcpus, 1);
        assert_eq!(a.accel, strata_core::Accel::Auto);
        assert!(parse(&["dev", "run", "--accel", "fast", "--", "true"]).is_err());
    }

    #[test]
    fn approval_options_are_global() {
        let cli = parse(&["create", "--no-wait"]).unwrap();
        assert!(cli.no_wait);
        assert_eq!(cli.approval_timeout, "10m");
        let cli = parse(&["exec", "sb-1", "--approval", "apr-1", "--", "git", "push"]).unwrap();
        assert_eq!(cli.approval.as_deref(), Some("apr-1"));
        let cli = parse(&["template", "build", "--no-wait"]).unwrap();
        assert!(cli.no_wait);
        assert!(parse(&["create", "--approval-timeout", "soon"]).is_err());
        let ctx = Ctx::new(&parse(&["--approval-timeout", "90s", "ls"]).unwrap());
        assert_eq!(ctx.gate.timeout, Duration::from_secs(90));
    }

    #[test]
    fn security_commands_parse() {
        assert!(parse(&["approvals", "ls", "--all"]).is_ok());
        assert!(parse(&["audit", "verify"]).is_ok());
        assert!(parse(&["audit", "export", "--sandbox", "sb-1", "--since", "10m"]).is_ok());
        assert!(
            parse(&["approvals", "approve"]).is_err(),
            "an id is required"
        );
        assert!(parse(&[
            "token",
            "create",
            "--role",
            "developer",
            "--expires-in",
            "30d"
        ])
        .is_ok());
        assert!(parse(&["token", "create", "--role", "root"]).is_err());
        assert!(parse(&[
            "token",
            "create",
            "--role",
            "viewer",
            "--expires-in",
            "a month"
        ])
        .is_err());
        assert!(parse(&["token", "create"]).is_err(), "a role is required");
        assert!(parse(&["policy", "set", "p.toml", "--sandbox", "sb-1"]).is_ok());
        assert!(matches!(
            parse(&["whoami"]).unwrap().command,
            Command::Whoami
        ));
    }

    #[test]
    fn token_comes_from_the_flag_then_the_admin_token_file() {
        let dir = tempfile::tempdir().unwrap();
        let paths = admin_token_paths(Some(dir.path().as_os_str()));
        assert_eq!(paths[0], dir.path().join("admin.token"));
        assert_eq!(paths[1], PathBuf::from("/var/lib/strata/admin.token"));
        let only_mine = &paths[..1];
        assert_eq!(resolve_token(None, only_mine), None);
        std::fs::write(dir.path().join("admin.token"), "strata_abc\n").unwrap();
        assert_eq!(
            resolve_token(None, only_mine).as_deref(),
            Some("strata_abc")
        );
        assert_eq!(resolve_token(Some("t"), only_mine).as_deref(), Some("t"));
        assert_eq!(
            resolve_token(Some(" "), only_mine).as_deref(),
            Some("strata_abc")
        );
        assert_eq!(admin_token_paths(None).len(), 1);
    }

    #[test]
    fn errors_name_status_and_code() {
        assert_eq!(
            human_error(
                "role developer may not call POST /v1/tokens",
                "forbidden",
                Some(403)
            ),
            "role developer may not call POST /v1/tokens (HTTP 403 forbidden)"
        );
        assert_eq!(human_error("no daemon", "unavailable", None), "no daemon");
        let held = anyhow::Error::new(ApiError::Held {
            approval_id: "apr-1".into(),
            message: "held".into(),
            body: Value::Null,
        });
        assert_eq!(exit_code(&held), EXIT_HELD);
        assert_eq!(error_code(&held), "approval_pending");
        assert_eq!(exit_code(&anyhow::Error::new(CliError::Interrupted)), 130);
        assert_eq!(exit_code(&anyhow::anyhow!("x")), 1);
    }

    #[test]
    fn key_values() {
        assert_eq!(key_value("a=b=c").unwrap(), ("a".into(), "b=c".into()));
        assert_eq!(key_value("a=").unwrap(), ("a".into(), "".into()));
        assert!(key_value("=b").is_err());
        assert!(key_value("ab").is_err());
    }

    #[test]
    fn error_codes_come_from_the_first_typed_error() {
        let e = anyhow::Error::new(ApiError::Api {
            status: 404,
            code: "not_found".into(),
            message: "no sandbox sb-x".into(),
        })
        .context("info");
        assert_eq!(error_code(&e), "not_found");
        let e = anyhow::Error::new(CliError::InvalidArgument("x".into()));
        assert_eq!(error_code(&e), "invalid_request");
        assert_eq!(error_code(&anyhow::anyhow!("plain")), "internal");
    }
}
