//! `strata port ID PORT`: where a server listening on `127.0.0.1:PORT`
//! inside sandbox ID is reached from outside: the `/v1` route
//! (`/v1/sandboxes/{id}/ports/{port}/…`, with this CLI's token as
//! `Authorization: Bearer`) and, given the E2B door's domain
//! (`--e2b-domain`, `STRATA_E2B_DOMAIN`: the create answer's `domain`, e.g.
//! `localhost:8080`), its routed host `http://<port>-<id>.<domain>`. The
//! sandbox is looked up first, so an unknown id is an error.

use serde_json::json;

use super::Ctx;

/// `strata port ID PORT`
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The sandbox.
    pub id: String,
    /// The guest port (1-65535).
    #[arg(value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// The E2B door's domain (the create answer's `domain`): also print the
    /// routed host `http://<port>-<id>.<domain>`.
    #[arg(long, env = "STRATA_E2B_DOMAIN")]
    pub e2b_domain: Option<String>,
}

/// Runs `strata port`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let c = ctx.client()?;
    let rec = c.get(&["v1", "sandboxes", &a.id], &[]).await?;
    let id = rec["id"].as_str().unwrap_or(&a.id).to_owned();
    let port = a.port.to_string();
    let v1 = c
        .url(&["v1", "sandboxes", &id, "ports", &port], &[])
        .to_string();
    let routed = a
        .e2b_domain
        .as_deref()
        .map(|d| format!("http://{port}-{id}.{}", d.trim_end_matches('/')));
    let v = json!({ "sandbox": id, "port": a.port, "url": v1, "e2b_url": routed });
    ctx.emit(&v, || {
        let mut out = format!("{v1}\n");
        if let Some(r) = &routed {
            out.push_str(&format!("{r}\n"));
        }
        Ok(out)
    })?;
    Ok(0)
}
