//! `strata template build|ls|rm|replicate`.

use std::time::{Duration, Instant};

use chrono::Utc;
use clap::Subcommand;
use serde_json::json;

use super::{CliError, Ctx, SizeArgs};
use crate::human;
use crate::views::{items, view, Template};

/// `strata template ...`
#[derive(Debug, Subcommand)]
pub enum TemplateCmd {
    /// Build a template: boot the image and snapshot it, or (`-f`) run a
    /// recipe's steps on a base template; shows progress and the build log.
    Build(BuildArgs),
    /// List templates.
    Ls,
    /// Delete templates.
    Rm {
        /// Template ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Copy a template into a cluster host's pool ahead of the creates
    /// there (`btrfs send` from a live host that holds it).
    Replicate {
        /// Template id.
        id: String,
        /// The host's cluster id.
        #[arg(long)]
        host: String,
    },
}

/// `strata template build`
#[derive(Debug, clap::Args)]
#[command(mut_arg("vcpus", |a| a.help("Virtual CPUs of the template guest")))]
pub struct BuildArgs {
    /// Human name.
    #[arg(long)]
    pub name: Option<String>,
    /// Template id to use [default: generated].
    #[arg(long)]
    pub id: Option<String>,
    /// Size of the template guest.
    #[command(flatten)]
    pub size: SizeArgs,
    /// Give up waiting after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// A recipe: `*.toml`, `*.json`, or a Dockerfile (FROM, RUN, COPY, ENV,
    /// WORKDIR, USER, CMD = start, HEALTHCHECK CMD = ready). `copy`
    /// sources are read relative to the recipe's directory (or `--context`)
    /// and uploaded by hash.
    #[arg(short = 'f', long = "file")]
    pub file: Option<std::path::PathBuf>,
    /// Directory `copy` sources are relative to [default: the recipe's].
    #[arg(long, requires = "file")]
    pub context: Option<std::path::PathBuf>,
    /// PEM file of CAs the builder's guest trusts (and the template keeps),
    /// e.g. `/etc/ssl/certs/ca-certificates.crt` where registry TLS is
    /// re-signed by a local CA.
    #[arg(long, requires = "file")]
    pub ca_bundle: Option<std::path::PathBuf>,
    /// Other sizes to build variants of once the template is ready, as
    /// VCPUSxMEMORY_MIB, comma-separated (e.g. `2x1024,4x4096`): creates of
    /// those sizes fork them from the first one.
    #[arg(long, value_delimiter = ',', value_parser = size_pair)]
    pub sizes: Vec<(u32, u32)>,
}

/// `2x1024` → (2 vCPUs, 1024 MiB).
fn size_pair(s: &str) -> Result<(u32, u32), String> {
    let (c, m) = s
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("{s:?}: expected VCPUSxMEMORY_MIB, e.g. 2x1024"))?;
    let c: u32 = c
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: vCPUs {c:?} is not a number"))?;
    let m: u32 = m
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: memory {m:?} is not a number of MiB"))?;
    if c == 0 || m == 0 {
        return Err(format!("{s:?}: vCPUs and memory must be at least 1"));
    }
    Ok((c, m))
}

/// Largest `copy` archive the CLI packs.
const MAX_COPY_BYTES: u64 = 1 << 30;

/// Runs a template command.
pub async fn run(ctx: &Ctx, cmd: TemplateCmd) -> anyhow::Result<i32> {
    match cmd {
        TemplateCmd::Build(a) => build(ctx, a).await,
        TemplateCmd::Ls => ls(ctx).await,
        TemplateCmd::Rm { ids } => rm(ctx, ids).await,
        TemplateCmd::Replicate { id, host } => replicate(ctx, &id, &host).await,
    }
}

async fn build(ctx: &Ctx, a: BuildArgs) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let mut body = json!({ "size": a.size.json() });
    if let Some(n) = &a.name {
        body["name"] = n.clone().into();
    }
    if let Some(i) = &a.id {
        body["id"] = i.clone().into();
    }
    let recipe_build = a.file.is_some();
    if let Some(file) = &a.file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", file.display()))?;
        let name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut recipe = strata_template::Recipe::from_file_text(&name, &text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        let context = a.context.clone().unwrap_or_else(|| {
            file.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map(|p| p.to_path_buf())
                .unwrap_or_else(|| ".".into())
        });
        let blobs = strata_template::pack_all(&mut recipe, &context, MAX_COPY_BYTES)
            .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
        for (sha, bytes) in blobs {
            if client.exists(&["v1", "template-files", &sha]).await? {
                continue;
            }
            if !ctx.json {
                eprintln!(
                    "strata: uploading copy archive {sha} ({} bytes)",
                    bytes.len()
                );
            }
            client
                .put_bytes_call(&["v1", "template-files", &sha], bytes)
                .await?;
        }
        body["recipe"] = serde_json::to_value(&recipe)?;
        if let Some(ca) = &a.ca_bundle {
            let pem = std::fs::read_to_string(ca)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", ca.display()))?;
            body["ca_bundle"] = pem.into();
        }
    }
    if !a.sizes.is_empty() {
        body["sizes"] = a
            .sizes
            .iter()
            .map(|(c, m)| json!({"vcpus": c, "memory_mib": m}))
            .collect::<Vec<_>>()
            .into();
    }
    let v = client.post_call(&["v1", "templates"], &body).await?;
    let t: Template = view(&v)?;
    if !ctx.json {
        eprintln!("strata: building template {}", t.id);
    }
    let (v, t) = if ctx.no_wait {
        (v, t)
    } else {
        follow_build(ctx, &client, &t.id, a.timeout, recipe_build).await?
    };
    if t.status == "failed" {
        return Err(CliError::OperationFailed(format!(
            "template {} failed to build: {}",
            t.id,
            t.status_reason.as_deref().unwrap_or("no reason given")
        ))
        .into());
    }
    ctx.emit(&v, || {
        Ok(format!(
            "{}  {}  {}{}",
            t.id,
            t.status,
            t.size.describe(),
            t.status_reason
                .as_ref()
                .map(|r| format!("  ({r})"))
                .unwrap_or_default()
        ))
    })?;
    if !a.sizes.is_empty() && !ctx.no_wait {
        // The variants the daemon started once the template was ready.
        let list = client
            .get(&["v1", "templates", &t.id, "variants"], &[])
            .await?;
        let variants: Vec<Template> = items(&list)?;
        let mut failed = 0;
        for var in variants {
            if !ctx.json {
                eprintln!("strata: size variant {} ({})", var.id, var.size.describe());
            }
            let (_, done) = follow_build(ctx, &client, &var.id, a.timeout, false).await?;
            if !ctx.json {
                println!("{}  {}  {}", done.id, done.status, done.size.describe());
            }
            if done.status == "failed" {
                failed += 1;
                eprintln!(
                    "strata: variant {} failed: {}",
                    done.id,
                    done.status_reason.as_deref().unwrap_or("no reason given")
                );
            }
        }
        if failed > 0 {
            return Ok(1);
        }
    }
    Ok(0)
}

/// Follows template (or variant) `id`'s build until it is no longer
/// `building`, its steps (and, `with_log`, its log) on stderr; gives up
/// after `timeout` seconds. Returns the last answer and its view.
pub async fn follow_build(
    ctx: &Ctx,
    client: &crate::api::ApiClient,
    id: &str,
    timeout: u64,
    with_log: bool,
) -> anyhow::Result<(serde_json::Value, Template)> {
    let started = Instant::now();
    let mut v = client.get(&["v1", "templates", id], &[]).await?;
    let mut t: Template = view(&v)?;
    let mut last_progress = None;
    let mut log_offset = 0u64;
    while t.status == "building" {
        if started.elapsed() > Duration::from_secs(timeout) {
            anyhow::bail!(
                "template {} still building after {} s (see `strata template ls`)",
                t.id,
                timeout
            );
        }
        if !ctx.json && t.progress != last_progress {
            if let Some(p) = &t.progress {
                let pct = p
                    .fraction
                    .map(|f| format!(" {:>3.0}%", f * 100.0))
                    .unwrap_or_default();
                eprintln!(
                    "[{:>6.1}s]{pct} {}",
                    started.elapsed().as_secs_f64(),
                    p.step
                );
            }
            last_progress = t.progress.clone();
        }
        if with_log && !ctx.json {
            log_offset = print_log(client, &t.id, log_offset).await?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        v = client.get(&["v1", "templates", id], &[]).await?;
        t = view(&v)?;
    }
    if with_log && !ctx.json {
        // The rest of the log (the last step's output, the failure).
        loop {
            let next = print_log(client, &t.id, log_offset).await?;
            if next == log_offset {
                break;
            }
            log_offset = next;
        }
    }
    Ok((v, t))
}

/// Prints the build log of `id` from `offset` to stderr; returns the next offset.
async fn print_log(client: &crate::api::ApiClient, id: &str, offset: u64) -> anyhow::Result<u64> {
    let off = offset.to_string();
    let v = match client
        .get(&["v1", "templates", id, "logs"], &[("offset", &off)])
        .await
    {
        Ok(v) => v,
        // An older daemon has no build logs.
        Err(e) if e.status() == Some(404) => return Ok(offset),
        Err(e) => return Err(e.into()),
    };
    if let Some(d) = v["data"].as_str().filter(|d| !d.is_empty()) {
        eprint!("{d}");
    }
    Ok(v["offset"].as_u64().unwrap_or(offset))
}

async fn ls(ctx: &Ctx) -> anyhow::Result<i32> {
    let v = ctx.client()?.get(&["v1", "templates"], &[]).await?;
    ctx.emit(&v, || {
        let list: Vec<Template> = items(&v)?;
        if list.is_empty() {
            return Ok("no templates (build one with `strata template build`)\n".into());
        }
        let now = Utc::now();
        Ok(human::table_of(
            &["ID", "NAME", "STATUS", "SIZE", "ACCEL", "CREATED"],
            &list,
            |t| {
                let mut status = t.status.clone();
                if let Some(p) = t.progress.as_ref().filter(|_| t.status == "building") {
                    status = format!("building: {}", p.step);
                }
                vec![
                    t.id.clone(),
                    t.name.clone().unwrap_or_else(|| "-".into()),
                    status,
                    t.size.describe(),
                    t.accel.clone().unwrap_or_else(|| "-".into()),
                    t.created_at.map(|c| human::age(c, now)).unwrap_or_default(),
                ]
            },
        ))
    })?;
    Ok(0)
}

async fn replicate(ctx: &Ctx, id: &str, host: &str) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .post(
            &["v1", "templates", id, "replicate"],
            &json!({ "host": host }),
        )
        .await?;
    ctx.emit(&v, || {
        Ok(match v.get("fetched").filter(|f| !f.is_null()) {
            Some(f) => format!(
                "{id} copied to {host} from {}: {} bytes in {} ms\n",
                f["from"].as_str().unwrap_or("?"),
                f["bytes"],
                f["ms"]
            ),
            None => format!("{host} holds {id} already\n"),
        })
    })?;
    Ok(0)
}

async fn rm(ctx: &Ctx, ids: Vec<String>) -> anyhow::Result<i32> {
    super::delete_each(ctx, "templates", &ids, |id, _| id.to_owned()).await
}
