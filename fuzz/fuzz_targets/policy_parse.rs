//! The policy parser (a tenant or a sandbox owner uploads the text) and the
//! evaluator over whatever it accepts.
//!
//! A refusal names a position inside the text; an accepted policy composes
//! in every layer it is allowed in and evaluates calls built from the same
//! input (exec argv and shell script, file paths, egress hosts, lifecycle
//! ops) without panicking. The only refusal a sandbox-layer composition may
//! give for a policy the platform layer accepts is "connectors belong to the
//! platform or tenant policy".
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use strata_policy::{CallKind, ComposeError, Policy, PolicySet, ToolCall};

fn calls(text: &str) -> Vec<CallKind> {
    let short: String = text.chars().take(256).collect();
    let words: Vec<String> = short.split_whitespace().map(str::to_owned).collect();
    let first = words.first().cloned().unwrap_or_default();
    let line = short.lines().next().unwrap_or_default().to_owned();
    vec![
        CallKind::exec(words.clone()),
        CallKind::shell(short.clone()),
        CallKind::exec(words.clone()).with_context(
            &words.iter().map(|w| (w.clone(), line.clone())).collect(),
            Some(line.clone()),
            strata_policy::ExecStdin::Bytes(short.len() as u64),
        ),
        CallKind::FileRead { path: line.clone() },
        CallKind::FileWrite {
            path: format!("/workspace/{line}"),
        },
        CallKind::Egress {
            connector: Some(first.clone()),
            host: first.to_ascii_lowercase(),
            port: 443,
            method: "POST".into(),
            path: line.clone(),
            scheme: "https".into(),
            tls: true,
        },
        CallKind::Egress {
            connector: None,
            host: first.to_ascii_lowercase(),
            port: 80,
            method: "CONNECT".into(),
            path: String::new(),
            scheme: "http".into(),
            tls: false,
        },
        CallKind::Snapshot,
        CallKind::Fork,
        CallKind::Rewind,
        CallKind::mcp(
            &first,
            &line,
            Some(&serde_json::json!({ "a": line.clone(), "b": { "c": words.len() } })),
        ),
        CallKind::Mcp {
            connector: first.clone(),
            tool: line.clone(),
            arguments_sha256: String::new(),
            arguments: Some(short.clone()),
        },
        CallKind::Lifecycle { op: first },
    ]
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let p = match Policy::parse(text) {
        Err(e) => {
            let lines = text.matches('\n').count() + 1;
            assert!(
                e.line >= 1 && e.line <= lines && e.column >= 1,
                "refusal at {}:{} outside a {lines}-line text: {}",
                e.line,
                e.column,
                e.message
            );
            return;
        }
        Ok(p) => Arc::new(p),
    };
    let kinds = calls(text);
    let platform = PolicySet::new(Some(p.clone()), None, None);
    let tenant = PolicySet::new(None, Some(p.clone()), None);
    let sandbox = PolicySet::new(None, None, Some(p));
    if platform.is_ok() {
        if let Err(e) = &sandbox {
            assert!(
                matches!(
                    e,
                    ComposeError::ConnectorInSandbox(_) | ComposeError::ReadMethodsInSandbox
                ),
                "sandbox layer refused what the platform layer accepted: {e}"
            );
        }
    }
    for set in [platform, tenant, sandbox].into_iter().flatten() {
        for kind in &kinds {
            let call = ToolCall {
                tenant: "t".into(),
                sandbox: Some("s".into()),
                actor: "a".into(),
                kind: kind.clone(),
            };
            let a = set.evaluate(&call);
            let b = set.evaluate(&call);
            assert_eq!(a, b, "evaluation is not deterministic");
        }
    }
});
