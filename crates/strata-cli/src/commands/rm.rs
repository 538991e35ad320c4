//! `strata rm ID…`: delete sandboxes.

use serde_json::Value;

use super::{sandbox_line, Ctx};

/// `strata rm`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox ids.
    #[arg(required = true)]
    pub ids: Vec<String>,
}

/// Runs `strata rm`; stops at the first failure.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let mut done = Vec::new();
    for id in &a.ids {
        let v = client.delete_call(&["v1", "sandboxes", id], &[]).await?;
        if !ctx.json {
            println!(
                "deleted {}",
                sandbox_line(&v).unwrap_or_else(|_| id.clone())
            );
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
