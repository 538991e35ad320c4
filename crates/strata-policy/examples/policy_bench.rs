//! Policy decision latency with 1,000 rules: p50/p95/p99.
//!
//! `cargo run --release -p strata-policy --example policy_bench`

use std::sync::Arc;
use std::time::Instant;

use strata_policy::{CallKind, Policy, PolicySet, ToolCall};

fn main() {
    let mut t = String::from(
        "default = \"deny\"\n\n[[connector]]\nname = \"sf\"\nhosts = [\"*.salesforce.com\"]\n",
    );
    for i in 0..1000 {
        match i % 4 {
            0 => t.push_str(&format!(
                "[[rule]]\neffect = \"deny\"\nprogram = \"tool{i}\"\nargs = [\"--x{i}*\", \"...\"]\n"
            )),
            1 => t.push_str(&format!("[[rule]]\neffect = \"allow\"\npath = \"/data/p{i}/**/*.csv\"\n")),
            2 => t.push_str(&format!(
                "[[rule]]\neffect = \"approve\"\nconnector = \"sf\"\nmethod = \"POST\"\nhttp_path = \"/api/v{i}/**\"\n"
            )),
            _ => t.push_str(&format!("[[rule]]\neffect = \"deny\"\ncommand = \"*secret{i}*\"\n")),
        }
    }
    // the calls below match the last rules of their kind, or nothing
    let t0 = Instant::now();
    let tenant = Policy::parse(&t).unwrap_or_else(|e| panic!("{e}"));
    let parse = t0.elapsed();
    let set = PolicySet::new(None, Some(Arc::new(tenant)), None).unwrap_or_else(|e| panic!("{e}"));
    let call = |kind| ToolCall {
        tenant: "t".into(),
        sandbox: Some("s".into()),
        actor: "a".into(),
        kind,
    };
    let calls = [
        (
            "exec (no match, 500 exec rules)",
            call(CallKind::exec(vec![
                "python3".into(),
                "-c".into(),
                "print(1)".into(),
            ])),
        ),
        (
            "exec via shell (derived readings)",
            call(CallKind::shell("ls -l; tool996 --x996 y".into())),
        ),
        (
            "file_read (last path rule)",
            call(CallKind::FileRead {
                path: "/data/p997/a/b/c.csv".into(),
            }),
        ),
        (
            "egress (last egress rule)",
            call(CallKind::Egress {
                connector: None,
                host: "na1.salesforce.com".into(),
                port: 443,
                method: "POST".into(),
                path: "/api/v998/sobjects/x".into(),
                scheme: "https".into(),
                tls: false,
            }),
        ),
    ];
    println!("parse + compile of 1000 rules: {parse:?}");
    for (name, c) in &calls {
        for _ in 0..1000 {
            std::hint::black_box(set.evaluate(c));
        }
        let n = 20_000;
        let mut ns: Vec<u128> = Vec::with_capacity(n);
        let mut last = None;
        for _ in 0..n {
            let t = Instant::now();
            let d = set.evaluate(std::hint::black_box(c));
            ns.push(t.elapsed().as_nanos());
            last = Some(d);
        }
        ns.sort_unstable();
        let p = |q: f64| ns[((n as f64 - 1.0) * q) as usize] as f64 / 1000.0;
        let d = last
            .map(|d| format!("{:?}/{}", d.effect, d.rule_id))
            .unwrap_or_default();
        println!(
            "{name:38} p50 {:7.2} µs  p95 {:7.2} µs  p99 {:7.2} µs  -> {d}",
            p(0.5),
            p(0.95),
            p(0.99)
        );
    }
}
