//! Evaluation table tests: kinds × matchers × layers, hard-block precedence.

use super::*;

const PLATFORM: &str = r#"
version = 1

[[connector]]
name = "salesforce"
hosts = ["*.salesforce.com", "login.salesforce.com"]
read_only = true

[[connector]]
name = "slack"
hosts = "slack.com"
write_methods = ["POST"]

[[rule]]
id = "no-rm-rf-root"
effect = "deny"
program = "rm"
args_contain = ["-*[rR]*", "/"]
reason = "recursive delete of /"

[[rule]]
id = "no-etc-shadow"
effect = "deny"
kind = ["file_read", "file_write"]
path = ["/etc/shadow", "/etc/gshadow"]

[[rule]]
id = "curl-needs-ok"
effect = "approve"
program = ["curl", "wget"]
reason = "network tools need a human"
"#;

const TENANT: &str = r#"
default = "deny"

[[connector]]
name = "snowflake"
hosts = ["*.snowflakecomputing.com"]

[[rule]]
id = "ws-read"
effect = "allow"
kind = "file_read"
path = "/workspace/**"

[[rule]]
id = "ws-write"
effect = "allow"
kind = "file_write"
path = "/workspace/**"

[[rule]]
id = "tmp-any"
effect = "allow"
path = "/tmp/*"

[[rule]]
id = "sf-read"
effect = "allow"
connector = "salesforce"
access = "read"

[[rule]]
id = "slack-post"
effect = "approve"
connector = "slack"
method = "POST"
http_path = "/api/chat.postMessage"
reason = "posting to Slack needs approval"

[[rule]]
id = "slack-read"
effect = "allow"
connector = "slack"
method = ["GET"]

[[rule]]
id = "no-delete-sandbox"
effect = "deny"
hard = true
kind = "lifecycle"
op = "delete"
reason = "tenant admins delete sandboxes"

[[rule]]
id = "snap"
effect = "allow"
kind = ["snapshot", "fork", "rewind"]

[[rule]]
id = "lifecycle"
effect = "allow"
kind = "lifecycle"

[[rule]]
id = "git"
effect = "allow"
program = ["git", "/usr/bin/git"]

[[rule]]
id = "ls"
effect = "allow"
program = "ls"
args = ["-l", "..."]

[[rule]]
id = "py-exact"
effect = "allow"
program = "python3"
args = ["-c", "print(*)"]

[[rule]]
id = "snowflake-any"
effect = "approve"
connector = "snowflake"
"#;

const SANDBOX: &str = r#"
default = "allow"

[[rule]]
id = "sb-allow-rm"
effect = "allow"
program = "rm"

[[rule]]
id = "sb-allow-sf-writes"
effect = "allow"
connector = "salesforce"

[[rule]]
id = "sb-allow-delete"
effect = "allow"
kind = "lifecycle"
op = "delete"

[[rule]]
id = "sb-deny-git-push"
effect = "deny"
program = "git"
args = ["push", "..."]

[[rule]]
id = "sb-curl"
effect = "allow"
program = "curl"

[[rule]]
id = "sb-secrets"
effect = "deny"
path = "/workspace/secrets/**"
"#;

fn set(platform: bool, tenant: bool, sandbox: bool) -> PolicySet {
    let p = |t: &str| Some(Arc::new(Policy::parse(t).unwrap_or_else(|e| panic!("{e}"))));
    PolicySet::new(
        if platform { p(PLATFORM) } else { None },
        if tenant { p(TENANT) } else { None },
        if sandbox { p(SANDBOX) } else { None },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn call(kind: CallKind) -> ToolCall {
    ToolCall {
        tenant: "acme".into(),
        sandbox: Some("sb1".into()),
        actor: "tok1".into(),
        kind,
    }
}
fn exec(argv: &[&str]) -> CallKind {
    CallKind::exec(argv.iter().map(|s| s.to_string()).collect())
}
fn sh(script: &str) -> CallKind {
    CallKind::shell(script.into())
}
fn read(p: &str) -> CallKind {
    CallKind::FileRead { path: p.into() }
}
fn write(p: &str) -> CallKind {
    CallKind::FileWrite { path: p.into() }
}
fn egress(host: &str, method: &str, path: &str) -> CallKind {
    CallKind::Egress {
        connector: None,
        host: host.into(),
        port: 443,
        method: method.into(),
        path: path.into(),
        scheme: "https".into(),
        tls: false,
    }
}
fn op(o: &str) -> CallKind {
    CallKind::Lifecycle { op: o.into() }
}

use Effect::{Allow as A, Approve as P, Deny as D};

/// (layers platform/tenant/sandbox, call, expected effect, expected rule id)
type Row = ((bool, bool, bool), CallKind, Effect, &'static str);

fn rows() -> Vec<Row> {
    let pt = (true, true, false);
    let all = (true, true, true);
    vec![
        // exec: program + args
        (pt, exec(&["git", "status"]), A, "git"),
        (pt, exec(&["/usr/bin/git", "log"]), A, "git"),
        (pt, exec(&["/opt/git"]), A, "git"),
        (pt, exec(&["ls", "-l"]), A, "ls"),
        (pt, exec(&["ls", "-l", "/x", "/y"]), A, "ls"),
        (pt, exec(&["ls", "-a"]), D, "default"),
        (pt, exec(&["ls"]), D, "default"),
        (pt, exec(&["python3", "-c", "print(1)"]), A, "py-exact"),
        (
            pt,
            exec(&["python3", "-c", "print(1)", "extra"]),
            D,
            "default",
        ),
        (pt, exec(&["python3", "-c", "import os"]), D, "default"),
        (pt, exec(&["rm", "-rf", "/"]), D, "no-rm-rf-root"),
        (pt, exec(&["rm", "-fr", "/"]), D, "no-rm-rf-root"),
        (pt, exec(&["rm", "-r", "-f", "/"]), D, "no-rm-rf-root"),
        (pt, exec(&["/bin/rm", "-Rf", "/"]), D, "no-rm-rf-root"),
        (pt, exec(&["sudo", "rm", "-rf", "/"]), D, "no-rm-rf-root"),
        (
            pt,
            exec(&["env", "X=1", "rm", "-rf", "/"]),
            D,
            "no-rm-rf-root",
        ),
        (pt, sh("cd / && rm -rf /"), D, "no-rm-rf-root"),
        (
            pt,
            exec(&["bash", "-c", "echo hi; rm -rf '/'"]),
            D,
            "no-rm-rf-root",
        ),
        (pt, exec(&["rm", "-rf", "/workspace/x"]), D, "default"),
        // a hard approve is a floor, but the tenant's default deny is stricter
        (pt, exec(&["curl", "https://x"]), D, "default"),
        (all, sh("ls -l | curl -d @- x"), P, "curl-needs-ok"),
        (pt, exec(&["", "x"]), D, "default"),
        // an allow rule never matches a derived reading: `git` inside a shell is not `git`
        (pt, sh("git status; cat /etc/shadow"), D, "default"),
        (pt, exec(&["sudo", "git", "status"]), D, "default"),
        // files: normalisation, globs
        (pt, read("/workspace/src/main.rs"), A, "ws-read"),
        (pt, read("/workspace"), D, "default"),
        (pt, read("/workspace/a/../../etc/passwd"), D, "default"),
        (pt, read("/workspace/../etc/shadow"), D, "no-etc-shadow"),
        (pt, read("//etc//./shadow"), D, "no-etc-shadow"),
        (pt, read("/workspace/../../etc/passwd"), D, "invalid-call"),
        (pt, read("workspace/a"), D, "invalid-call"),
        (pt, read("/workspace/a\0"), D, "invalid-call"),
        (pt, write("/workspace/out.txt"), A, "ws-write"),
        (pt, write("/tmp/x"), A, "tmp-any"),
        (pt, read("/tmp/x"), A, "tmp-any"),
        (pt, write("/tmp/a/b"), D, "default"),
        (pt, write("/etc/shadow"), D, "no-etc-shadow"),
        // egress: connectors, methods, access, http path
        (
            pt,
            egress("na1.salesforce.com", "GET", "/services/data"),
            A,
            "sf-read",
        ),
        (pt, egress("NA1.Salesforce.COM.", "get", "/x"), A, "sf-read"),
        (
            pt,
            egress("login.salesforce.com", "HEAD", "/"),
            A,
            "sf-read",
        ),
        (
            pt,
            egress("na1.salesforce.com", "POST", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("na1.salesforce.com", "DELETE", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("na1.salesforce.com", "CONNECT", ""),
            D,
            "connector:salesforce:read-only",
        ),
        (pt, egress("salesforce.com", "GET", "/"), D, "default"),
        (
            pt,
            egress("slack.com", "POST", "/api/chat.postMessage"),
            P,
            "slack-post",
        ),
        // Dot segments are refused, literal or encoded (finding 10).
        (
            pt,
            egress("slack.com", "POST", "/api/x/../chat.postMessage"),
            D,
            "invalid-call",
        ),
        (
            pt,
            egress("slack.com", "POST", "/api/x/%2e%2e/chat.postMessage"),
            D,
            "invalid-call",
        ),
        // Paths are decoded before matching, `;` parameters refused.
        (
            pt,
            egress("slack.com", "POST", "/api/chat%2EpostMessage"),
            P,
            "slack-post",
        ),
        (
            pt,
            egress("slack.com", "POST", "/api/chat.postMessage;x"),
            D,
            "invalid-call",
        ),
        (
            pt,
            egress("slack.com", "POST", "/api%2fchat.postMessage"),
            D,
            "invalid-call",
        ),
        // Reads are GET, HEAD, OPTIONS; any other method writes.
        (
            pt,
            egress("na1.salesforce.com", "OPTIONS", "/x"),
            A,
            "sf-read",
        ),
        (
            pt,
            egress("na1.salesforce.com", "MKCOL", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("na1.salesforce.com", "PROPPATCH", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("na1.salesforce.com", "PURGE", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("na1.salesforce.com", "FROBNICATE", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            pt,
            egress("slack.com", "POST", "/api/chat.postMessage?x=1"),
            P,
            "slack-post",
        ),
        (
            pt,
            egress("slack.com", "POST", "/api/files.upload"),
            D,
            "default",
        ),
        (
            pt,
            egress("slack.com", "GET", "/api/conversations.list"),
            A,
            "slack-read",
        ),
        (pt, egress("slack.com", "PUT", "/api/x"), D, "default"),
        (
            pt,
            egress("x.snowflakecomputing.com", "POST", "/q"),
            P,
            "snowflake-any",
        ),
        (pt, egress("example.com", "GET", "/"), D, "default"),
        (
            pt,
            egress("slack.com", "GET", "/../../x"),
            D,
            "invalid-call",
        ),
        // other kinds
        (pt, CallKind::Snapshot, A, "snap"),
        (pt, CallKind::Fork, A, "snap"),
        (pt, CallKind::Rewind, A, "snap"),
        (pt, op("pause"), A, "lifecycle"),
        (pt, op("delete"), D, "no-delete-sandbox"),
        // sandbox layer loosens soft tenant rules but never hard ones
        (all, exec(&["rm", "x"]), A, "sb-allow-rm"),
        (all, exec(&["rm", "-rf", "/"]), D, "no-rm-rf-root"),
        (all, sh("rm -rf /"), D, "no-rm-rf-root"),
        (
            all,
            egress("na1.salesforce.com", "POST", "/x"),
            D,
            "connector:salesforce:read-only",
        ),
        (
            all,
            egress("na1.salesforce.com", "GET", "/x"),
            A,
            "sb-allow-sf-writes",
        ),
        (all, op("delete"), D, "no-delete-sandbox"),
        (all, exec(&["curl", "x"]), P, "curl-needs-ok"),
        (all, exec(&["git", "push", "origin"]), D, "sb-deny-git-push"),
        (all, exec(&["git", "pull"]), A, "git"),
        (all, read("/workspace/secrets/key"), D, "sb-secrets"),
        (all, read("/workspace/ok"), A, "ws-read"),
        (all, read("/srv/ok"), A, "default"),
        (all, read("/etc/shadow"), D, "no-etc-shadow"),
        (all, egress("example.com", "GET", "/"), A, "default"),
        // nothing at all: built-in deny
        ((false, false, false), CallKind::Snapshot, D, "default"),
    ]
}

#[test]
fn evaluation_table() {
    let sets: Vec<((bool, bool, bool), PolicySet)> = {
        let mut v = Vec::new();
        for r in rows() {
            if !v.iter().any(|(k, _)| *k == r.0) {
                v.push((r.0, set(r.0 .0, r.0 .1, r.0 .2)));
            }
        }
        v
    };
    let mut failures = Vec::new();
    for (i, (layers, kind, effect, rule)) in rows().into_iter().enumerate() {
        let Some((_, s)) = sets.iter().find(|(k, _)| *k == layers) else {
            continue;
        };
        let d = s.evaluate(&call(kind.clone()));
        if d.effect != effect || d.rule_id != rule {
            failures.push(format!(
                "row {i} {layers:?} {kind:?}: want {effect:?}/{rule}, got {d:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn decisions_carry_layer_index_and_reason() {
    let s = set(true, true, true);
    let d = s.evaluate(&call(exec(&["rm", "-rf", "/"])));
    assert_eq!(d.layer, Some(Layer::Platform));
    assert_eq!(d.rule_index, Some(0));
    assert!(d.hard);
    assert_eq!(d.reason, "recursive delete of /");
    let d = s.evaluate(&call(egress("slack.com", "POST", "/api/chat.postMessage")));
    assert_eq!(
        (d.layer, d.rule_index, d.hard),
        (Some(Layer::Tenant), Some(4), false)
    );
    assert_eq!(d.reason, "posting to Slack needs approval");
    let d = s.evaluate(&call(op("delete")));
    assert_eq!((d.layer, d.hard), (Some(Layer::Tenant), true));
    let d = s.evaluate(&call(read("/workspace/x")));
    assert_eq!(
        (d.layer, d.rule_id.as_str()),
        (Some(Layer::Tenant), "ws-read")
    );
    let d = s.evaluate(&call(read("/srv/x")));
    assert_eq!(
        (d.layer, d.rule_id.as_str()),
        (Some(Layer::Sandbox), "default")
    );
}

#[test]
fn caller_cannot_claim_a_connector() {
    let s = set(true, true, false);
    let mut k = egress("na1.salesforce.com", "POST", "/x");
    if let CallKind::Egress { connector, .. } = &mut k {
        *connector = Some("slack".into());
    }
    assert_eq!(
        s.evaluate(&call(k)).rule_id,
        "connector:salesforce:read-only"
    );
}

#[test]
fn hard_approve_is_a_floor_and_hard_allow_loosens_nothing() {
    let platform = Policy::parse(
        "[[rule]]\neffect = \"allow\"\nkind = \"snapshot\"\n[[rule]]\neffect = \"approve\"\nkind = \"fork\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let sandbox =
        Policy::parse("default = \"deny\"\n[[rule]]\neffect = \"allow\"\nkind = \"fork\"\n")
            .unwrap_or_else(|e| panic!("{e}"));
    let s = PolicySet::new(Some(Arc::new(platform)), None, Some(Arc::new(sandbox)))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.evaluate(&call(CallKind::Snapshot)).effect, Effect::Deny);
    let d = s.evaluate(&call(CallKind::Fork));
    assert_eq!(
        (d.effect, d.layer),
        (Effect::Approve, Some(Layer::Platform))
    );
}

#[test]
fn composition_errors() {
    let c = |t: &str| Some(Arc::new(Policy::parse(t).unwrap_or_else(|e| panic!("{e}"))));
    let conn = "[[connector]]\nname = \"x\"\nhosts = \"x.com\"\n";
    assert!(matches!(
        PolicySet::new(None, None, c(conn)),
        Err(ComposeError::ConnectorInSandbox(_))
    ));
    assert!(matches!(
        PolicySet::new(c(conn), c(conn), None),
        Err(ComposeError::DuplicateConnector(_))
    ));
    let rule = "[[rule]]\neffect = \"allow\"\nconnector = \"y\"\n";
    assert!(matches!(
        PolicySet::new(c(conn), c(rule), None),
        Err(ComposeError::UnknownConnector { .. })
    ));
}

#[test]
fn exact_host_beats_wildcard() {
    let p = Policy::parse(
        "[[connector]]\nname = \"wild\"\nhosts = \"*.example.com\"\n[[connector]]\nname = \"exact\"\nhosts = \"api.example.com\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let s = PolicySet::new(Some(Arc::new(p)), None, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.connector_for_host("api.example.com")
            .map(|c| c.name.as_str()),
        Some("exact")
    );
    assert_eq!(
        s.connector_for_host("b.example.com")
            .map(|c| c.name.as_str()),
        Some("wild")
    );
    assert!(s.connector_for_host("example.com").is_none());
}

#[test]
fn random_input_never_panics_the_parser() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let pieces = [
        "[[rule]]",
        "[[connector]]",
        "effect",
        "=",
        "\"allow\"",
        "\"deny\"",
        "\"approve\"",
        "kind",
        "path",
        "program",
        "args",
        "[",
        "]",
        "{",
        "}",
        ",",
        "\n",
        "\"",
        "'",
        "\"/a/**\"",
        "\"[\"",
        "\"...\"",
        "hosts",
        "name",
        "\"*.x.com\"",
        "true",
        "1",
        "-",
        "#",
        "é",
        "\\",
        "hard",
        "default",
        "version",
        "method",
        "\"GET\"",
        "access",
        "\"read\"",
    ];
    for _ in 0..20_000 {
        let n = rng.gen_range(0..40);
        let mut s = String::new();
        for _ in 0..n {
            if rng.gen_bool(0.15) {
                s.push(char::from(rng.gen_range(0u8..128)));
            } else {
                s.push_str(pieces[rng.gen_range(0..pieces.len())]);
                s.push(' ');
            }
        }
        if let Err(e) = Policy::parse(&s) {
            assert!(e.line >= 1 && e.column >= 1, "{e:?} for {s:?}");
        }
    }
}

#[test]
fn cidr_rules_and_connector_ranges() {
    let platform = Policy::parse(
        r#"
default = "allow"
[[connector]]
name = "lab"
cidrs = ["10.77.0.0/16", "2001:db8::/32"]
[[connector]]
name = "internet"
cidrs = ["0.0.0.0/0"]
hosts = ["example.com"]
[[rule]]
id = "no-lab-admin"
effect = "deny"
cidr = "10.77.9.0/24"
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let sandbox = Policy::parse(
        r#"
[[rule]]
id = "allow-one"
effect = "allow"
cidr = ["10.77.1.2", "10.77.9.9"]
[[rule]]
id = "deny-lab"
effect = "deny"
cidr = "10.77.0.0/16"
[[rule]]
id = "deny-v6"
effect = "deny"
kind = "egress"
cidr = "2001:db8::/48"
"#,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let s = PolicySet::new(Some(Arc::new(platform)), None, Some(Arc::new(sandbox)))
        .unwrap_or_else(|e| panic!("{e}"));
    let ip = |t: &str| t.parse::<IpAddr>().unwrap_or_else(|e| panic!("{e}"));
    // The most specific range wins: 10.77/16 is `lab`, not `internet`.
    let (c, n) = s
        .connector_for_ip(ip("10.77.5.5"))
        .unwrap_or_else(|| panic!("no connector"));
    assert_eq!(
        (c.name.as_str(), n.to_string().as_str()),
        ("lab", "10.77.0.0/16")
    );
    assert_eq!(
        s.connector_for_ip(ip("::ffff:10.77.5.5"))
            .map(|(c, _)| c.name.as_str()),
        Some("lab")
    );
    assert_eq!(
        s.connector_for_ip(ip("8.8.8.8"))
            .map(|(c, _)| c.name.as_str()),
        Some("internet")
    );
    assert!(s.connector_for_ip(ip("::1")).is_none());
    let e = |h: &str| s.evaluate(&call(egress(h, "CONNECT", ""))).effect;
    let rule = |h: &str| s.evaluate(&call(egress(h, "CONNECT", ""))).rule_id;
    // First matching sandbox rule: the allowed address, then the denied range.
    assert_eq!(e("10.77.1.2"), A);
    assert_eq!(rule("10.77.3.3"), "deny-lab");
    assert_eq!(e("[::ffff:10.77.1.2]"), A);
    // A hard platform deny beats the sandbox's allow.
    assert_eq!(
        (e("10.77.9.9"), rule("10.77.9.9").as_str()),
        (D, "no-lab-admin")
    );
    // CIDR rules match address literals only, never names.
    assert_eq!(e("example.com"), A);
    assert_eq!(e("8.8.8.8"), A);
    assert_eq!(e("2001:db8::1"), D);
    assert_eq!(e("2001:db8:1::1"), A);
    // Bad ranges and rules are refused with a position.
    for (text, line) in [
        ("[[rule]]\neffect = \"deny\"\ncidr = \"10.0.0.0/33\"\n", 3),
        ("[[rule]]\neffect = \"deny\"\ncidr = []\n", 3),
        (
            "[[rule]]\neffect = \"deny\"\ncidr = \"10.0.0.0/8\"\npath = \"/a\"\n",
            1,
        ),
        ("[[connector]]\nname = \"x\"\ncidrs = [\"127.1\"]\n", 3),
        ("[[connector]]\nname = \"x\"\n", 2),
    ] {
        match Policy::parse(text) {
            Ok(_) => panic!("accepted {text:?}"),
            Err(err) => assert_eq!(err.line, line, "{text:?}: {err}"),
        }
    }
}

/// Finding 10: a tunnel voids method and path rules, so where such a rule
/// applies a `CONNECT` needs an allow rule that names `CONNECT`.
#[test]
fn connect_needs_an_explicit_allow_where_request_rules_apply() {
    let platform = r#"
default = "allow"
[[connector]]
name = "slack"
hosts = "slack.com"
[[connector]]
name = "files"
hosts = "files.test"
[[connector]]
name = "plain"
hosts = "plain.test"
[[rule]]
id = "no-file-delete"
effect = "deny"
host = "files.test"
method = "DELETE"
[[rule]]
id = "plain-tunnel"
effect = "allow"
connector = "plain"
method = "CONNECT"
"#;
    let tenant = |extra: &str| {
        format!(
            "[[rule]]\nid = \"slack-post\"\neffect = \"approve\"\nconnector = \"slack\"\nmethod = \"POST\"\nhttp_path = \"/api/chat.postMessage\"\n{extra}"
        )
    };
    let set = |extra: &str| {
        let p = |t: &str| Some(Arc::new(Policy::parse(t).unwrap_or_else(|e| panic!("{e}"))));
        PolicySet::new(p(platform), p(&tenant(extra)), None).unwrap_or_else(|e| panic!("{e}"))
    };
    let s = set("");
    let connect = |s: &PolicySet, h: &str| s.evaluate(&call(egress(h, "CONNECT", "")));
    // The README's slack-post rule is no longer bypassed by https://.
    let d = connect(&s, "slack.com");
    assert_eq!(
        (d.effect, d.rule_id.as_str()),
        (D, "connector:slack:connect"),
        "{d:?}"
    );
    assert!(d.reason.contains("slack-post"), "{d:?}");
    // A rule matching by host counts too.
    assert_eq!(connect(&s, "files.test").rule_id, "connector:files:connect");
    // No request rules: the default decides as before; an explicit allow
    // is fine anyway.
    assert_eq!(connect(&s, "plain.test").effect, A);
    // Plain requests are not affected.
    assert_eq!(
        s.evaluate(&call(egress("slack.com", "GET", "/x"))).effect,
        A
    );
    // An explicit allow opens the tunnel; a blanket allow does not.
    let blanket = set("[[rule]]\nid = \"slack-any\"\neffect = \"allow\"\nconnector = \"slack\"\n");
    assert_eq!(connect(&blanket, "slack.com").effect, D);
    let explicit = set("[[rule]]\nid = \"slack-tunnel\"\neffect = \"allow\"\nconnector = \"slack\"\nmethod = \"CONNECT\"\n");
    let d = connect(&explicit, "slack.com");
    assert_eq!((d.effect, d.rule_id.as_str()), (A, "slack-tunnel"), "{d:?}");
    // A sandbox policy cannot set read_methods (it declares no connectors).
    let sandbox = Policy::parse("read_methods = [\"GET\"]\n").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        PolicySet::new(None, None, Some(Arc::new(sandbox))).err(),
        Some(ComposeError::ReadMethodsInSandbox)
    );
}

// --- Exec honesty (security review finding 8): env, stdin, shell and
// wrapper options, budget and depth. Every case here was allowed before.

const EXEC_PLATFORM: &str = r#"
[[rule]]
id = "no-rm"
effect = "deny"
program = "rm"
reason = "no deleting"

[[rule]]
id = "no-rm-rf-root"
effect = "deny"
program = "shred"
args_contain = ["-*[rR]*", "{/,/[*]}"]
"#;

fn exec_set(tenant: &str) -> PolicySet {
    let p = |t: &str| Some(Arc::new(Policy::parse(t).unwrap_or_else(|e| panic!("{e}"))));
    PolicySet::new(p(EXEC_PLATFORM), p(tenant), None).unwrap_or_else(|e| panic!("{e}"))
}

fn with_env(kind: CallKind, env: &[(&str, &str)]) -> CallKind {
    let env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    kind.with_context(&env, None, crate::call::ExecStdin::None)
}

fn with_stdin(kind: CallKind, stdin: crate::call::ExecStdin) -> CallKind {
    kind.with_context(&Default::default(), None, stdin)
}

fn decide(s: &PolicySet, kind: CallKind) -> Decision {
    s.evaluate(&call(kind))
}

#[test]
fn dangerous_environment_variables_are_denied_unless_allowed() {
    let s = exec_set("default = \"allow\"\n");
    // The review's example: bash gets a function `true` that runs rm.
    let d = decide(
        &s,
        with_env(
            exec(&["bash", "-c", "true"]),
            &[("BASH_FUNC_true%%", "() { rm -rf /data; }")],
        ),
    );
    assert_eq!(
        (d.effect, d.rule_id.as_str()),
        (D, "dangerous-env"),
        "{d:?}"
    );
    assert!(d.reason.contains("`BASH_FUNC_true%%`"), "{d:?}");
    for name in [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "BASH_ENV",
        "ENV",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PERL5OPT",
        "NODE_OPTIONS",
        "GIT_SSH_COMMAND",
        "GIT_CONFIG_COUNT",
    ] {
        let d = decide(&s, with_env(exec(&["true"]), &[(name, "x")]));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "dangerous-env"),
            "{name}: {d:?}"
        );
    }
    // A shell script is checked the same way.
    let d = decide(&s, with_env(sh("ls"), &[("LD_PRELOAD", "/tmp/x.so")]));
    assert_eq!(d.rule_id, "dangerous-env");
    // Ordinary variables pass.
    let d = decide(
        &s,
        with_env(
            exec(&["true"]),
            &[
                ("PATH", "/usr/bin"),
                ("HOME", "/root"),
                ("PYTHONUNBUFFERED", "1"),
            ],
        ),
    );
    assert_eq!(d.effect, A, "{d:?}");
    // `allow_env` in any layer lets a name through; the others stay denied.
    let s = exec_set("default = \"allow\"\nallow_env = [\"PYTHONPATH\", \"LD_LIBRARY_*\"]\n");
    let d = decide(
        &s,
        with_env(
            exec(&["true"]),
            &[("PYTHONPATH", "/w"), ("LD_LIBRARY_PATH", "/opt")],
        ),
    );
    assert_eq!(d.effect, A, "{d:?}");
    let d = decide(
        &s,
        with_env(
            exec(&["true"]),
            &[("PYTHONPATH", "/w"), ("LD_PRELOAD", "x")],
        ),
    );
    assert_eq!(d.rule_id, "dangerous-env");
    assert!(
        d.reason.contains("`LD_PRELOAD`") && !d.reason.contains("PYTHONPATH"),
        "{d:?}"
    );
    // An `env` matcher denies or holds names off the built-in list.
    let s = exec_set(
        "default = \"allow\"\n[[rule]]\nid = \"no-path\"\neffect = \"deny\"\nhard = true\nenv = \"PATH\"\n",
    );
    let d = decide(&s, with_env(exec(&["ls"]), &[("PATH", "/tmp/evil")]));
    assert_eq!(d.rule_id, "no-path", "{d:?}");
    assert_eq!(decide(&s, exec(&["ls"])).effect, A);
}

#[test]
fn a_shell_fed_from_stdin_is_unreadable_and_fails_closed() {
    use crate::call::ExecStdin;
    let s = exec_set("default = \"allow\"\n");
    for argv in [
        &["sh"][..],
        &["bash"],
        &["/bin/bash", "-s"],
        &["bash", "-e", "-x"],
        &["sudo", "sh"],
        &["busybox", "sh"],
    ] {
        for stdin in [ExecStdin::Bytes(9), ExecStdin::Stream] {
            let d = decide(&s, with_stdin(exec(argv), stdin));
            assert_eq!(d.effect, D, "{argv:?} {stdin:?}: {d:?}");
            assert_eq!(d.rule_id, "no-rm", "the first exec deny rule: {d:?}");
            assert!(d.reason.contains("reads its commands from stdin"), "{d:?}");
        }
        // Without stdin a shell with no script reads nothing.
        assert_eq!(decide(&s, exec(argv)).effect, A, "{argv:?}");
    }
    // `sh -c` reads its script, not stdin: read as usual.
    let d = decide(
        &s,
        with_stdin(exec(&["sh", "-c", "ls"]), ExecStdin::Bytes(9)),
    );
    assert_eq!(d.effect, A, "{d:?}");
    // Inside a script, a bare shell reads whatever the pipe carries.
    let d = decide(&s, sh("echo rm -rf / | sh"));
    assert_eq!(d.effect, D, "{d:?}");
    // With no exec deny/approve rule, an unreadable call is just allowed.
    let open = PolicySet::new(
        None,
        Some(Arc::new(
            Policy::parse("default = \"allow\"\n").unwrap_or_else(|e| panic!("{e}")),
        )),
        None,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let d = open.evaluate(&call(with_stdin(exec(&["bash"]), ExecStdin::Stream)));
    assert_eq!(d.effect, A, "{d:?}");
}

#[test]
fn shell_options_do_not_hide_the_script() {
    let s = exec_set("default = \"allow\"\n");
    for argv in [
        &["sh", "-c", "--", "rm -rf /x"][..],
        &["bash", "-c", "-e", "rm -rf /x"],
        &["bash", "-e", "-o", "pipefail", "-c", "rm -rf /x"],
        &["bash", "-O", "extglob", "-c", "rm -rf /x"],
        &["bash", "--norc", "--rcfile", "/dev/null", "-c", "rm x"],
        &["dash", "-ec", "--", "rm x"],
        &["zsh", "-c", "eval 'rm x'"],
        &["sh", "-c", "X=1 rm x"],
        &["sh", "-c", "exec -a name rm x"],
    ] {
        let d = decide(&s, exec(argv));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "no-rm"),
            "{argv:?}: {d:?}"
        );
    }
    // An option the reading does not know makes the call unreadable.
    let d = decide(&s, exec(&["zsh", "-Z", "x", "-c", "ls"]));
    assert_eq!(d.effect, D, "{d:?}");
    assert!(d.reason.contains("cannot be read"), "{d:?}");
}

#[test]
fn wrapper_options_with_values_do_not_hide_the_program() {
    let s = exec_set("default = \"allow\"\n");
    for argv in [
        &["sudo", "-u", "root", "rm", "x"][..],
        &["sudo", "-g", "wheel", "-D", "/", "rm", "x"],
        &["sudo", "--user", "root", "--", "rm", "x"],
        &["doas", "-u", "root", "rm", "x"],
        &["env", "-u", "X", "rm", "x"],
        &["env", "-C", "/", "rm", "x"],
        &["env", "--chdir", "/", "A=1", "rm", "x"],
        &["env", "-S", "rm -rf /"],
        &["env", "-S", "-i A=1 rm x"],
        &["timeout", "-s", "KILL", "5", "rm", "x"],
        &["timeout", "--kill-after", "1", "10s", "rm", "x"],
        &["xargs", "-I", "{}", "rm", "{}"],
        &["xargs", "-n", "1", "-P", "4", "rm"],
        &["time", "-f", "%e", "rm", "x"],
        &["nice", "-n", "5", "nohup", "stdbuf", "-o", "L", "rm", "x"],
        &["setsid", "-f", "command", "-p", "rm", "x"],
    ] {
        let d = decide(&s, exec(argv));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "no-rm"),
            "{argv:?}: {d:?}"
        );
    }
    // An option the reading does not know: unreadable, fails closed.
    let d = decide(&s, exec(&["sudo", "--frobnicate", "ls"]));
    assert_eq!(d.effect, D, "{d:?}");
    assert!(
        d.reason.contains("unknown option `--frobnicate` of `sudo`"),
        "{d:?}"
    );
    // Known wrappers of harmless programs stay allowed.
    let d = decide(
        &s,
        exec(&["sudo", "-u", "root", "timeout", "-s", "KILL", "5", "ls"]),
    );
    assert_eq!(d.effect, A, "{d:?}");
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[test]
fn running_out_the_budget_or_the_depth_fails_closed() {
    let s = exec_set("default = \"allow\"\n");
    // 64 no-op commands, then the real one: still read.
    for tail in ["sudo rm x", "env rm x"] {
        let script = format!("{}{tail}", "true; ".repeat(64));
        let d = decide(&s, sh(&script));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "no-rm"),
            "{tail}: {d:?}"
        );
    }
    // Past the budget: every exec deny rule applies.
    let script = format!("{}sudo ls", "true; ".repeat(MAX_VIEWS));
    let d = decide(&s, sh(&script));
    assert_eq!(d.effect, D, "{d:?}");
    assert!(
        d.reason
            .contains(&format!("more than {MAX_VIEWS} readings")),
        "{d:?}"
    );
    let d = decide(&s, sh(&"true; ".repeat(MAX_VIEWS)));
    assert_eq!(d.effect, D, "{d:?}");
    // Shells nested up to the limit are read; deeper fails closed.
    let nest = |depth: usize, inner: &str| {
        let mut script = inner.to_string();
        for _ in 0..depth {
            script = format!("sh -c {}", quote(&script));
        }
        script
    };
    // (`sh(…)` is the outermost shell: MAX_DEPTH shells in all.)
    let d = decide(&s, sh(&nest(MAX_DEPTH - 1, "rm x")));
    assert_eq!((d.effect, d.rule_id.as_str()), (D, "no-rm"), "{d:?}");
    let d = decide(&s, sh(&nest(MAX_DEPTH - 1, "ls")));
    assert_eq!(d.effect, A, "{d:?}");
    for inner in ["ls", "sudo rm x"] {
        let d = decide(&s, sh(&nest(MAX_DEPTH, inner)));
        assert_eq!(d.effect, D, "{inner}: {d:?}");
        assert!(d.reason.contains("nest more than"), "{d:?}");
    }
}

#[test]
fn root_spelled_differently_is_still_root() {
    // The README's rule (rm -rf /) sees `//`, `/.` and `/tmp/..` as `/`.
    let s = set(true, true, true);
    for arg in ["//", "/.", "/./", "/tmp/..", "/.."] {
        let d = s.evaluate(&call(exec(&["rm", "-rf", arg])));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "no-rm-rf-root"),
            "{arg}: {d:?}"
        );
    }
    let d = s.evaluate(&call(sh("rm -rf //")));
    assert_eq!(d.rule_id, "no-rm-rf-root", "{d:?}");
    assert_eq!(s.evaluate(&call(exec(&["rm", "-rf", "/tmp/x"]))).effect, A);
    // `/*` is its own spelling: the documented rule lists it.
    let s = exec_set("default = \"allow\"\n");
    for arg in ["/", "/*", "//", "/.", "/./*"] {
        let d = decide(&s, exec(&["shred", "-r", arg]));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (D, "no-rm-rf-root"),
            "{arg}: {d:?}"
        );
    }
    let d = decide(&s, sh("shred -fr /*"));
    assert_eq!(d.rule_id, "no-rm-rf-root", "{d:?}");
    assert_eq!(decide(&s, exec(&["shred", "-r", "/tmp/*"])).effect, A);
}
