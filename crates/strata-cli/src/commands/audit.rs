//! `strata audit verify|export`: the daemon's audit log of policy decisions.
//! `verify` (admin) has the daemon check the keyed chain and reports the
//! caller's tenant's part (the platform tenant's admins: every tenant's);
//! `export` streams the tenant's entries as JSON lines, byte for byte.

use std::io::Write;

use clap::Subcommand;
use serde_json::Value;

use super::Ctx;

/// `strata audit ...`
#[derive(Debug, Subcommand)]
pub enum AuditCmd {
    /// Have the daemon verify the audit chain (key, start, recorded head);
    /// exits 1 when it is broken.
    Verify,
    /// Write the tenant's audit entries to stdout as JSON lines (streamed).
    Export {
        /// Only this sandbox's entries.
        #[arg(long)]
        sandbox: Option<String>,
        /// Only entries since this RFC 3339 time or this long ago (`10m`).
        #[arg(long)]
        since: Option<String>,
    },
}

/// Runs an audit command.
pub async fn run(ctx: &Ctx, cmd: AuditCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        AuditCmd::Verify => {
            let v = client.get(&["v1", "audit", "verify"], &[]).await?;
            ctx.emit(&v, || Ok(format_verify(&v)))?;
            Ok(if v["ok"] == true { 0 } else { 1 })
        }
        AuditCmd::Export { sandbox, since } => {
            let mut q = Vec::new();
            if let Some(s) = &sandbox {
                q.push(("sandbox", s.as_str()));
            }
            if let Some(s) = &since {
                q.push(("since", s.as_str()));
            }
            let url = client.url(&["v1", "audit"], &q);
            let resp = client
                .send(client.request(reqwest::Method::GET, url.clone()))
                .await?;
            let mut out = std::io::stdout().lock();
            client
                .for_each_chunk(resp, |chunk| {
                    out.write_all(chunk)
                        .map_err(|e| crate::api::ApiError::Protocol {
                            url: url.to_string(),
                            reason: format!("writing stdout: {e}"),
                        })
                })
                .await?;
            out.flush()?;
            Ok(0)
        }
    }
}

/// `chain ok (keyed from seq 41): 1200 entries; tenant acme: 300 entries (310 decisions), seq 3–1200`.
pub fn format_verify(v: &Value) -> String {
    let tenant = v["tenant"].as_str().unwrap_or("?");
    if v["ok"] != true {
        return format!(
            "chain BROKEN: {}\n",
            v["error"].as_str().unwrap_or("unknown error")
        );
    }
    let keyed = match (v["keyed"].as_bool(), v["keyed_from"].as_u64()) {
        (Some(true), Some(k)) if k > 1 => format!("keyed from seq {k}"),
        (Some(true), _) => "keyed".to_string(),
        _ => "NOT keyed: the daemon has no usable key store".to_string(),
    };
    let mut s = format!(
        "chain ok ({keyed}): {} entries\n",
        v["entries"].as_u64().unwrap_or(0)
    );
    let line = |name: &str, entries: &Value, decisions: &Value, first: &Value, last: &Value| {
        let span = match (first.as_u64(), last.as_u64()) {
            (Some(a), Some(b)) => format!(", seq {a}–{b}"),
            _ => String::new(),
        };
        format!(
            "tenant {name}: {} entries ({} decisions){span}\n",
            entries.as_u64().unwrap_or(0),
            decisions.as_u64().unwrap_or(0)
        )
    };
    match v["tenants"].as_object() {
        Some(all) => {
            for (name, t) in all {
                s.push_str(&line(
                    name,
                    &t["entries"],
                    &t["decisions"],
                    &t["first_seq"],
                    &t["last_seq"],
                ));
            }
        }
        None => s.push_str(&line(
            tenant,
            &v["tenant_entries"],
            &v["tenant_decisions"],
            &v["tenant_first_seq"],
            &v["tenant_last_seq"],
        )),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_lines() {
        let v = serde_json::json!({
            "ok": true, "entries": 12, "keyed": true, "keyed_from": 5, "tenant": "acme",
            "tenant_entries": 3, "tenant_decisions": 40, "tenant_first_seq": 2, "tenant_last_seq": 12
        });
        assert_eq!(
            format_verify(&v),
            "chain ok (keyed from seq 5): 12 entries\ntenant acme: 3 entries (40 decisions), seq 2–12\n"
        );
        let v = serde_json::json!({"ok": false, "tenant": "acme", "error": "audit log broken at line 3"});
        assert_eq!(
            format_verify(&v),
            "chain BROKEN: audit log broken at line 3\n"
        );
    }
}
