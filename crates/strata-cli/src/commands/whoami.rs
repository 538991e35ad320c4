//! `strata whoami`: the caller as the daemon sees it (`GET /v1/whoami`).

use super::Ctx;
use crate::views::{view, Whoami};

/// Runs `strata whoami`.
pub async fn run(ctx: &Ctx) -> anyhow::Result<i32> {
    let v = ctx.client()?.get(&["v1", "whoami"], &[]).await?;
    ctx.emit(&v, || Ok(format_whoami(&view(&v)?)))?;
    Ok(0)
}

/// `tok-…  admin of tenant default  (bootstrap)`.
pub fn format_whoami(w: &Whoami) -> String {
    let name = w
        .name
        .as_deref()
        .map(|n| format!("  ({n})"))
        .unwrap_or_default();
    format!("{}  {} of tenant {}{name}\n", w.token_id, w.role, w.tenant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whoami_line() {
        let w: Whoami = view(&serde_json::json!({
            "token_id": "tok-1", "tenant": "default", "role": "admin", "name": "bootstrap"
        }))
        .unwrap();
        assert_eq!(
            format_whoami(&w),
            "tok-1  admin of tenant default  (bootstrap)\n"
        );
    }
}
