//! `strata approvals ls|show|approve|deny`: the queue of tool calls the
//! policy holds until a human answers (approver or admin role).

use chrono::{DateTime, Utc};
use clap::Subcommand;
use serde_json::json;

use super::Ctx;
use crate::human;
use crate::views::{describe_call, items, view, Approval};

/// `strata approvals ...`
#[derive(Debug, Subcommand)]
pub enum ApprovalsCmd {
    /// List pending approval requests (`--all`: answered ones too).
    Ls {
        /// Include approved, denied and timed-out requests.
        #[arg(long)]
        all: bool,
    },
    /// Show one request: who asked, what, why it was held, its status.
    Show {
        /// Approval id.
        id: String,
    },
    /// Approve a held call (it runs once).
    Approve {
        /// Approval id.
        id: String,
    },
    /// Deny a held call (it does not run).
    Deny {
        /// Approval id.
        id: String,
    },
}

/// Runs an approvals command.
pub async fn run(ctx: &Ctx, cmd: ApprovalsCmd) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    match cmd {
        ApprovalsCmd::Ls { all } => {
            let status = if all { "all" } else { "pending" };
            let v = client
                .get(&["v1", "approvals"], &[("status", status)])
                .await?;
            ctx.emit(&v, || Ok(format_list(&items(&v)?, all, Utc::now())))?;
        }
        ApprovalsCmd::Show { id } => {
            let v = client.get(&["v1", "approvals", &id], &[]).await?;
            ctx.emit(&v, || Ok(format_one(&view(&v)?, Utc::now())))?;
        }
        ApprovalsCmd::Approve { id } => answer(ctx, &id, true).await?,
        ApprovalsCmd::Deny { id } => answer(ctx, &id, false).await?,
    }
    Ok(0)
}

async fn answer(ctx: &Ctx, id: &str, approve: bool) -> anyhow::Result<()> {
    let verb = if approve { "approve" } else { "deny" };
    let v = ctx
        .client()?
        .post(&["v1", "approvals", id, verb], &json!({}))
        .await?;
    ctx.emit(&v, || {
        let a: Approval = view(&v)?;
        Ok(format!(
            "{}  {}: {}{}\n",
            a.id,
            a.status.status,
            describe_call(&a.call.kind),
            a.call
                .sandbox
                .as_deref()
                .map(|s| format!(" on {s}"))
                .unwrap_or_default()
        ))
    })
}

fn status_text(a: &Approval) -> String {
    match &a.status.by {
        Some(by) => format!("{} by {by}", a.status.status),
        None => a.status.status.clone(),
    }
}

/// The queue as a table.
pub fn format_list(list: &[Approval], all: bool, now: DateTime<Utc>) -> String {
    if list.is_empty() {
        return if all {
            "no approval requests\n".into()
        } else {
            "no pending approval requests\n".into()
        };
    }
    human::table_of(
        &[
            "ID",
            "AGE",
            "REQUESTED BY",
            "SANDBOX",
            "CALL",
            "BODY",
            "HELD BY RULE",
            "STATUS",
        ],
        list,
        |a| {
            vec![
                a.id.clone(),
                a.created_at.map(|c| human::age(c, now)).unwrap_or_default(),
                a.requested_by.clone(),
                a.sandbox.clone().unwrap_or_else(|| "-".into()),
                describe_call(&a.call.kind),
                a.body
                    .as_ref()
                    .map(|b| b.describe(false))
                    .unwrap_or_else(|| "-".into()),
                format!("{}: {}", a.rule_id, a.reason),
                status_text(a),
            ]
        },
    )
}

/// One request, field per line.
pub fn format_one(a: &Approval, now: DateTime<Utc>) -> String {
    let mut s = String::new();
    let mut line = |k: &str, v: String| s.push_str(&format!("{k:<13}{v}\n"));
    line("id", a.id.clone());
    line("status", status_text(a));
    if let Some(at) = a.status.at {
        line(
            "answered",
            format!("{} ({})", human::local_time(at), human::age(at, now)),
        );
    }
    line("requested by", a.requested_by.clone());
    line("sandbox", a.sandbox.clone().unwrap_or_else(|| "-".into()));
    line("call", describe_call(&a.call.kind));
    let kind = &a.call.kind;
    if let Some(env) = kind.get("env").and_then(|e| e.as_object()) {
        for (k, v) in env {
            line("env", format!("{k} = {}", v.as_str().unwrap_or_default()));
        }
    }
    // An MCP call's arguments (guest-written JSON text; escaped).
    if let Some(args) = kind.get("arguments").and_then(|c| c.as_str()) {
        line("arguments", strata_core::text::escape(args).into_owned());
    }
    if let Some(cwd) = kind.get("cwd").and_then(|c| c.as_str()) {
        line("cwd", cwd.to_owned());
    }
    if let Some(stdin) = kind.get("stdin") {
        let text = match stdin.get("bytes").and_then(|b| b.as_u64()) {
            Some(n) => human::bytes(n),
            None => stdin.as_str().unwrap_or_default().to_owned(),
        };
        line("stdin", text);
    }
    if let Some(b) = &a.body {
        line("body", b.describe(true));
    }
    if !a.request_sha256.is_empty() {
        line("request", a.request_sha256.clone());
    }
    line("rule", a.rule_id.clone());
    line("why held", a.reason.clone());
    if let Some(c) = a.created_at {
        line(
            "asked",
            format!("{} ({})", human::local_time(c), human::age(c, now)),
        );
    }
    if let Some(c) = a.consumed_at {
        line(
            "used",
            format!("{} ({})", human::local_time(c), human::age(c, now)),
        );
    } else if let Some(x) = a.expires_at {
        let what = if a.status.status == "pending" {
            "times out"
        } else {
            "usable until"
        };
        line(what, human::local_time(x));
    }
    if a.status.status == "pending" {
        line(
            "answer with",
            format!(
                "strata approvals approve {0}  |  strata approvals deny {0}",
                a.id
            ),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;
    use serde_json::Value;

    fn sample(now: DateTime<Utc>, status: Value) -> Value {
        json!({
            "id": "apr-1", "tenant": "default", "sandbox": "sb-1",
            "call": {"tenant": "default", "sandbox": "sb-1", "actor": "tok-dev",
                     "kind": {"kind": "exec", "argv": ["git", "push"]}},
            "reason": "pushes need a human", "rule_id": "push",
            "requested_by": "tok-dev",
            "created_at": (now - TimeDelta::seconds(90)).to_rfc3339(),
            "status": status
        })
    }

    #[test]
    fn show_gives_an_mcp_call_with_its_arguments_escaped() {
        let now = Utc::now();
        let mut v = sample(now, json!({"status": "pending"}));
        v["call"]["kind"] = json!({"kind": "mcp", "connector": "slack", "tool": "post_message",
            "arguments_sha256": "sha256:ab", "arguments": "{\"text\":\"hi\u{1b}[2J\"}"});
        let a: Approval = view(&v).unwrap();
        let s = format_one(&a, now);
        assert!(s.contains("mcp slack post_message"), "{s}");
        let args = s.lines().find(|l| l.starts_with("arguments")).unwrap();
        assert!(args.contains("hi") && !args.contains('\u{1b}'), "{args:?}");
    }

    #[test]
    fn list_says_who_what_why_and_age() {
        let now = Utc::now();
        let v = json!({"items": [sample(now, json!({"status": "pending"}))]});
        assert_eq!(crate::api::approval_status(&v["items"][0]), "pending");
        let s = format_list(&items(&v).unwrap(), false, now);
        let line = s.lines().nth(1).unwrap();
        for want in [
            "apr-1",
            "1m ago",
            "tok-dev",
            "sb-1",
            "exec git push",
            "push: pushes need a human",
            "pending",
        ] {
            assert!(line.contains(want), "{want} missing in {line:?}");
        }
        assert_eq!(
            format_list(&[], false, now),
            "no pending approval requests\n"
        );
    }

    #[test]
    fn the_approver_sees_what_the_call_carries() {
        let now = Utc::now();
        let mut v = sample(now, json!({"status": "pending"}));
        v["call"]["kind"] = json!({"kind": "file_write", "path": "/app/config.yml"});
        v["body"] = json!({"bytes": 13, "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"});
        v["request_sha256"] = json!("sha256:00ff");
        v["expires_at"] = json!((now + TimeDelta::seconds(3600)).to_rfc3339());
        let one = format_one(&view(&v).unwrap(), now);
        assert!(
            one.contains(
                "body         13 B, sha256 2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
            ),
            "{one}"
        );
        assert!(one.contains("request      sha256:00ff"), "{one}");
        assert!(one.contains("times out"), "{one}");
        let list = format_list(&[view(&v).unwrap()], false, now);
        assert!(list.contains("13 B, sha256 2cf24dba5fb0…"), "{list}");
        let mut e = sample(now, json!({"status": "pending"}));
        e["call"]["kind"] = json!({"kind": "exec", "argv": ["curl", "x"],
            "env": {"TOKEN": "sha256:abc"}, "cwd": "/work", "stdin": {"bytes": 5}});
        let one = format_one(&view(&e).unwrap(), now);
        for want in [
            "env          TOKEN = sha256:abc",
            "cwd          /work",
            "stdin        5 B",
        ] {
            assert!(one.contains(want), "{want} missing in {one}");
        }
    }

    #[test]
    fn one_request_shows_the_answer() {
        let now = Utc::now();
        let v = sample(
            now,
            json!({"status": "approved", "by": "tok-boss", "at": now.to_rfc3339()}),
        );
        assert_eq!(crate::api::approval_status(&v), "approved");
        let s = format_one(&view(&v).unwrap(), now);
        assert!(s.contains("status       approved by tok-boss"), "{s}");
        assert!(s.contains("why held     pushes need a human"), "{s}");
        assert!(!s.contains("answer with"), "{s}");
        let p = format_one(
            &view(&sample(now, json!({"status": "pending"}))).unwrap(),
            now,
        );
        assert!(p.contains("strata approvals approve apr-1"), "{p}");
    }
}
