//! `strata token create|ls|revoke`: API tokens of the caller's tenant
//! (admin only). A new token's secret is printed once.

use chrono::{DateTime, Utc};
use clap::Subcommand;
use serde_json::{json, Value};

use super::Ctx;
use crate::human::{self, duration_arg};
use crate::views::{items, view, Token};

/// Roles a token can carry.
pub const ROLES: [&str; 5] = ["admin", "developer", "approver", "viewer", "metrics"];

/// `strata token ...`
#[derive(Debug, Subcommand)]
pub enum TokenCmd {
    /// Make a token; its secret is shown only once.
    Create(CreateArgs),
    /// List the tenant's tokens (never their secrets).
    Ls(LsArgs),
    /// Revoke a token: it stops working at once.
    Revoke {
        /// Token id (`tok-…`).
        id: String,
        /// Tenant of the token (platform admins only).
        #[arg(long)]
        tenant: Option<String>,
    },
}

/// `strata token create`
#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    /// admin, developer, approver, viewer or metrics (reads `/metrics` only;
    /// made by admins of the platform tenant).
    #[arg(long, value_parser = ROLES)]
    pub role: String,
    /// Tenant the token acts for [default: the caller's]; platform admins only.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Lifetime, e.g. 30d or 12h [default: no expiry].
    #[arg(long, value_parser = duration_arg, value_name = "DURATION")]
    pub expires_in: Option<String>,
    /// A name to recognise it by.
    #[arg(long)]
    pub name: Option<String>,
}

/// `strata token ls`
#[derive(Debug, clap::Args)]
pub struct LsArgs {
    /// Another tenant's tokens (platform admins only).
    #[arg(long)]
    pub tenant: Option<String>,
}

/// The `POST /v1/tokens` body.
pub fn create_body(a: &CreateArgs) -> Value {
    let mut b = json!({ "role": a.role });
    if let Some(t) = &a.tenant {
        b["tenant"] = t.clone().into();
    }
    if let Some(e) = &a.expires_in {
        b["expires_in"] = e.clone().into();
    }
    if let Some(n) = &a.name {
        b["name"] = n.clone().into();
    }
    b
}

/// Runs a token command.
pub async fn run(ctx: &Ctx, cmd: TokenCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        TokenCmd::Create(a) => {
            let v = client.post(&["v1", "tokens"], &create_body(&a)).await?;
            if !ctx.json {
                eprintln!(
                    "strata: this is the only time the token is shown: store it now \
                     (the daemon keeps only its hash)"
                );
            }
            ctx.emit(&v, || Ok(format_created(&view(&v)?)))?;
        }
        TokenCmd::Ls(a) => {
            let q: Vec<(&str, &str)> = a.tenant.iter().map(|t| ("tenant", t.as_str())).collect();
            let v = client.get(&["v1", "tokens"], &q).await?;
            ctx.emit(&v, || Ok(format_list(&items(&v)?, Utc::now())))?;
        }
        TokenCmd::Revoke { id, tenant } => {
            let q: Vec<(&str, &str)> = tenant.iter().map(|t| ("tenant", t.as_str())).collect();
            let v = client.delete(&["v1", "tokens", &id], &q).await?;
            ctx.emit(&v, || Ok(format!("revoked {id}\n")))?;
        }
    }
    Ok(0)
}

/// The secret on its own line (easy to copy or capture), then the record.
pub fn format_created(t: &Token) -> String {
    let mut s = format!(
        "{}\n{}  {} of tenant {}",
        t.token.as_deref().unwrap_or("(no token in the answer)"),
        t.id,
        t.role,
        t.tenant
    );
    if let Some(n) = &t.name {
        s.push_str(&format!("  name {n}"));
    }
    match t.expires_at {
        Some(e) => s.push_str(&format!("  expires {}", human::local_time(e))),
        None => s.push_str("  no expiry"),
    }
    s.push('\n');
    s
}

fn state(t: &Token, now: DateTime<Utc>) -> String {
    if let Some(r) = t.revoked_at {
        return format!("revoked {}", human::age(r, now));
    }
    match t.expires_at {
        Some(e) if e <= now => "expired".into(),
        Some(e) => format!("expires {}", human::age(e, now)),
        None => "active".into(),
    }
}

/// The token table.
pub fn format_list(list: &[Token], now: DateTime<Utc>) -> String {
    if list.is_empty() {
        return "no tokens\n".into();
    }
    human::table_of(
        &["ID", "ROLE", "TENANT", "NAME", "CREATED", "BY", "STATE"],
        list,
        |t| {
            vec![
                t.id.clone(),
                t.role.clone(),
                t.tenant.clone(),
                t.name.clone().unwrap_or_else(|| "-".into()),
                t.created_at.map(|c| human::age(c, now)).unwrap_or_default(),
                t.created_by.clone().unwrap_or_else(|| "-".into()),
                state(t, now),
            ]
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;

    #[test]
    fn create_body_has_only_what_was_given() {
        let a = CreateArgs {
            role: "developer".into(),
            tenant: None,
            expires_in: Some("30d".into()),
            name: Some("ci".into()),
        };
        assert_eq!(
            create_body(&a),
            json!({"role": "developer", "expires_in": "30d", "name": "ci"})
        );
    }

    #[test]
    fn created_token_comes_first() {
        let t: Token = view(&json!({
            "id": "tok-1", "tenant": "acme", "role": "developer", "name": "ci",
            "created_at": "2026-01-01T00:00:00Z", "expires_at": null,
            "token": "strata_abc"
        }))
        .unwrap();
        let s = format_created(&t);
        assert!(
            s.starts_with("strata_abc\ntok-1  developer of tenant acme  name ci  no expiry"),
            "{s}"
        );
    }

    #[test]
    fn list_shows_state() {
        let now = Utc::now();
        let mk = |id: &str, revoked: Option<DateTime<Utc>>, expires: Option<DateTime<Utc>>| Token {
            id: id.into(),
            role: "viewer".into(),
            tenant: "default".into(),
            created_at: Some(now - TimeDelta::seconds(120)),
            revoked_at: revoked,
            expires_at: expires,
            ..Token::default()
        };
        let s = format_list(
            &[
                mk("tok-a", None, None),
                mk("tok-b", Some(now - TimeDelta::seconds(60)), None),
                mk("tok-c", None, Some(now - TimeDelta::seconds(1))),
                mk("tok-d", None, Some(now + TimeDelta::seconds(3600))),
            ],
            now,
        );
        assert!(s.starts_with("ID "), "{s}");
        assert!(s.contains("active"), "{s}");
        assert!(s.contains("revoked 1m ago"), "{s}");
        assert!(s.contains("expired"), "{s}");
        assert!(s.contains("expires in 1h"), "{s}");
        assert_eq!(format_list(&[], now), "no tokens\n");
    }
}
