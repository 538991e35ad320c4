//! `strata template build|ls|rm`.

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
    /// Build a template (boot the image, snapshot it); shows progress.
    Build(BuildArgs),
    /// List templates.
    Ls,
    /// Delete templates.
    Rm {
        /// Template ids.
        #[arg(required = true)]
        ids: Vec<String>,
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
}

/// Runs a template command.
pub async fn run(ctx: &Ctx, cmd: TemplateCmd) -> anyhow::Result<i32> {
    match cmd {
        TemplateCmd::Build(a) => build(ctx, a).await,
        TemplateCmd::Ls => ls(ctx).await,
        TemplateCmd::Rm { ids } => rm(ctx, ids).await,
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
    let started = Instant::now();
    let mut v = client.post_call(&["v1", "templates"], &body).await?;
    let mut t: Template = view(&v)?;
    if !ctx.json {
        eprintln!("strata: building template {}", t.id);
    }
    let mut last_progress = None;
    while !ctx.no_wait && t.status == "building" {
        if started.elapsed() > Duration::from_secs(a.timeout) {
            anyhow::bail!(
                "template {} still building after {} s (see `strata template ls`)",
                t.id,
                a.timeout
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
        tokio::time::sleep(Duration::from_millis(500)).await;
        v = client.get(&["v1", "templates", &t.id], &[]).await?;
        t = view(&v)?;
    }
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
    Ok(0)
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

async fn rm(ctx: &Ctx, ids: Vec<String>) -> anyhow::Result<i32> {
    super::delete_each(ctx, "templates", &ids, |id, _| id.to_owned()).await
}
