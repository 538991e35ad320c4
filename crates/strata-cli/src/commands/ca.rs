//! `strata ca`: the certificate (PEM) of the daemon's local CA, which signs
//! the certificates of its TLS listener (`[e2b] tls_listen`), `GET /v1/ca`.
//! Trust it, e.g. `strata ca > strata-ca.pem` and
//! `SSL_CERT_FILE=strata-ca.pem`, to reach routed hosts over `https`.

use std::io::Write as _;

use reqwest::Method;

use super::Ctx;

/// Runs `strata ca`.
pub async fn run(ctx: &Ctx) -> anyhow::Result<i32> {
    let c = ctx.client()?;
    let resp = c
        .send(c.request(Method::GET, c.url(&["v1", "ca"], &[])))
        .await?;
    let pem = resp.text().await?;
    std::io::stdout().write_all(pem.as_bytes())?;
    Ok(0)
}
