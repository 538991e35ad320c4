//! Audit chain: append, verify, and detection of edited, removed, reordered lines.

use std::path::Path;

use strata_policy::audit::{self, AuditDecision, AuditError, AuditLog, Filter, Outcome};
use strata_policy::{CallKind, Decision, Effect, ToolCall};

fn call(tenant: &str, sandbox: &str, i: usize) -> ToolCall {
    ToolCall {
        tenant: tenant.into(),
        sandbox: Some(sandbox.into()),
        actor: format!("tok{i}"),
        kind: CallKind::FileRead {
            path: format!("/workspace/{i}"),
        },
    }
}

fn dec(i: usize) -> AuditDecision {
    let d = Decision {
        effect: if i.is_multiple_of(3) {
            Effect::Deny
        } else {
            Effect::Allow
        },
        layer: None,
        rule_id: format!("r{i}"),
        rule_index: None,
        hard: false,
        reason: "because".into(),
    };
    AuditDecision::from_decision(
        &d,
        if i.is_multiple_of(3) {
            Outcome::Denied
        } else {
            Outcome::Allowed
        },
        None,
    )
}

fn fill(path: &Path, n: usize) {
    let log = AuditLog::open(path).unwrap_or_else(|e| panic!("{e}"));
    for i in 1..=n {
        let (t, s) = if i.is_multiple_of(2) {
            ("acme", "sb1")
        } else {
            ("globex", "sb2")
        };
        let e = log
            .append(&call(t, s, i), dec(i), None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(e.seq, i as u64);
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

fn write_lines(path: &Path, l: &[String]) {
    std::fs::write(path, l.join("\n") + "\n").unwrap_or_else(|e| panic!("{e}"));
}

fn broken_at(path: &Path) -> (usize, Option<u64>, String) {
    match audit::verify(path) {
        Err(AuditError::Broken { line, seq, problem }) => (line, seq, problem),
        other => panic!("expected a broken chain, got {other:?}"),
    }
}

#[test]
fn chain_verifies_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 5);
    let log = AuditLog::open(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(log.head().0, 5);
    let e = log
        .append(&call("acme", "sb1", 6), dec(6), Some("alice".into()))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(e.seq, 6);
    let v = audit::verify(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(v.entries, 6);
    assert_eq!(v.head, e.hash);
    audit::verify_head(&p, 6, &e.hash).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn edited_line_is_detected_with_its_seq() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 6);
    let mut l = lines(&p);
    l[3] = l[3]
        .replace("\"outcome\":\"allowed\"", "\"outcome\":\"denied\"")
        .replace("\"r4\"", "\"r4x\"");
    write_lines(&p, &l);
    let (line, seq, problem) = broken_at(&p);
    assert_eq!((line, seq), (4, Some(4)), "{problem}");
    assert!(problem.contains("edited"), "{problem}");
    // re-opening a tampered log refuses to append to it
    assert!(matches!(
        AuditLog::open(&p),
        Err(AuditError::Broken { seq: Some(4), .. })
    ));
}

#[test]
fn removed_line_is_detected() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 6);
    let mut l = lines(&p);
    l.remove(2);
    write_lines(&p, &l);
    let (line, seq, problem) = broken_at(&p);
    assert_eq!((line, seq), (3, Some(4)), "{problem}");
}

#[test]
fn removed_line_with_renumbering_is_detected() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 6);
    let mut l = lines(&p);
    l.remove(2);
    for (i, line) in l.iter_mut().enumerate().skip(2) {
        *line = line.replace(&format!("\"seq\":{}", i + 2), &format!("\"seq\":{}", i + 1));
    }
    write_lines(&p, &l);
    let (line, seq, problem) = broken_at(&p);
    assert_eq!((line, seq), (3, Some(3)), "{problem}");
}

#[test]
fn reordered_lines_are_detected() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 6);
    let mut l = lines(&p);
    l.swap(1, 4);
    write_lines(&p, &l);
    let (line, seq, _) = broken_at(&p);
    assert_eq!((line, seq), (2, Some(5)));
}

#[test]
fn cut_tail_is_caught_by_recorded_head() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 6);
    let head = audit::verify(&p).unwrap_or_else(|e| panic!("{e}"));
    let l = lines(&p);
    write_lines(&p, &l[..4]);
    assert!(
        audit::verify(&p).is_ok(),
        "the chain alone cannot see a cut tail"
    );
    assert!(matches!(
        audit::verify_head(&p, 6, &head.head),
        Err(AuditError::Broken { seq: Some(5), .. })
    ));
}

#[test]
fn torn_last_line_is_cut_on_open() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 3);
    let mut s = std::fs::read_to_string(&p).unwrap_or_default();
    s.push_str("{\"seq\":4,\"ti");
    std::fs::write(&p, s).unwrap_or_else(|e| panic!("{e}"));
    let log = AuditLog::open(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(log.head().0, 3);
    log.append(&call("acme", "sb1", 4), dec(4), None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(audit::verify(&p).map(|v| v.entries).ok(), Some(4));
}

#[test]
fn query_and_export_per_tenant_and_sandbox() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    fill(&p, 10);
    let acme = audit::query(
        &p,
        &Filter {
            tenant: Some("acme".into()),
            sandbox: None,
            ..Filter::default()
        },
    )
    .unwrap_or_default();
    assert_eq!(acme.len(), 5);
    assert!(acme.iter().all(|e| e.tenant == "acme"));
    let none = audit::query(
        &p,
        &Filter {
            tenant: Some("acme".into()),
            sandbox: Some("sb2".into()),
            ..Filter::default()
        },
    )
    .unwrap_or_default();
    assert!(none.is_empty());
    let mut out = Vec::new();
    let n = audit::export(
        &p,
        &Filter {
            tenant: Some("globex".into()),
            sandbox: Some("sb2".into()),
            ..Filter::default()
        },
        &mut out,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(n, 5);
    let text = String::from_utf8(out).unwrap_or_default();
    assert_eq!(text.lines().count(), 5);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v["tenant"], "globex");
        // exported lines are byte-identical to the log, so their hashes still check
        assert!(lines(&p).iter().any(|x| x == l));
    }
}

fn key(k: &[u8]) -> ring::hmac::Key {
    ring::hmac::Key::new(ring::hmac::HMAC_SHA256, k)
}

fn keyed_opts(k: &[u8], start: Option<audit::ChainStart>) -> audit::AuditOptions {
    audit::AuditOptions {
        key: Some(key(k)),
        start,
        limits: None,
    }
}

/// Rewrites every line as an attacker without the key would: `edit` the
/// entry, then recompute each link with `rule` from the genesis on.
fn rewrite(
    path: &Path,
    edit: impl Fn(&mut serde_json::Value),
    rule: impl Fn(&str, &serde_json::Value) -> String,
) -> (u64, String) {
    let mut prev = audit::GENESIS.to_string();
    let mut out = String::new();
    let mut seq = 0;
    for l in lines(path) {
        let mut v: serde_json::Value = serde_json::from_str(&l).unwrap_or_else(|e| panic!("{e}"));
        edit(&mut v);
        v["prev_hash"] = prev.clone().into();
        let h = rule(&prev, &v);
        v["hash"] = h.clone().into();
        out.push_str(&v.to_string());
        out.push('\n');
        prev = h;
        seq = v["seq"].as_u64().unwrap_or(0);
    }
    std::fs::write(path, out).unwrap_or_else(|e| panic!("{e}"));
    (seq, prev)
}

#[test]
fn a_keyed_log_rewritten_with_its_head_but_without_the_key_fails() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    let start = {
        let log = AuditLog::open_with(&p, keyed_opts(b"deployment key", None))
            .unwrap_or_else(|e| panic!("{e}"));
        for i in 1..=6 {
            log.append(&call("acme", "sb1", i), dec(i), None)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        log.chain_start()
            .cloned()
            .unwrap_or_else(|| panic!("no start"))
    };
    assert_eq!(
        start.legacy_seq, 0,
        "a new log is keyed from its first entry"
    );
    let verify = |head: (u64, &str)| {
        audit::verify_with(
            &p,
            &audit::VerifyOptions {
                key: Some(&key(b"deployment key")),
                start: Some(&start),
                head: Some(head),
            },
        )
    };
    let original = std::fs::read_to_string(&p).unwrap_or_default();
    let head = audit::verify_with(
        &p,
        &audit::VerifyOptions {
            key: Some(&key(b"deployment key")),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(head.keyed_from, Some(1));
    assert!(verify((6, &head.head)).is_ok());

    // 1. Entry 3's denial turned into an allow; every link recomputed in
    //    the old unkeyed form (what an attacker can compute), head to match.
    let (seq, forged_head) = rewrite(
        &p,
        |v| {
            if v["seq"] == 3 {
                v["decision"]["outcome"] = "allowed".into();
            }
            v.as_object_mut().map(|m| m.remove("v"));
        },
        audit::entry_hash,
    );
    // The old (unkeyed) rule accepts the rewrite: this is what the old
    // code verified with.
    assert!(audit::verify_head(&p, seq, &forged_head).is_ok());
    let err = verify((seq, &forged_head)).err().map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("line 1 ") && e.contains("unkeyed entry")),
        "{err:?}"
    );
    // …and the daemon's open refuses it too.
    assert!(AuditLog::open_with(&p, keyed_opts(b"deployment key", Some(start.clone()))).is_err());

    // 2. The same edit, kept in the keyed form with links made under a
    //    guessed key.
    std::fs::write(&p, &original).unwrap_or_else(|e| panic!("{e}"));
    let guessed = key(b"guess");
    let (seq, forged_head) = rewrite(
        &p,
        |v| {
            if v["seq"] == 3 {
                v["decision"]["outcome"] = "allowed".into();
            }
        },
        |prev, v| audit::entry_mac(&guessed, prev, v),
    );
    let err = verify((seq, &forged_head)).err().map(|e| e.to_string());
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("line 1 ") && e.contains("MAC")),
        "{err:?}"
    );

    // 3. Without the key, a keyed log is not accepted either.
    std::fs::write(&p, &original).unwrap_or_else(|e| panic!("{e}"));
    assert!(audit::verify(&p).is_err());
    assert!(AuditLog::open(&p).is_err());
}

#[test]
fn an_old_format_log_still_verifies_and_the_switch_is_in_the_chain() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    // A line exactly as the unkeyed log wrote it before entries had a `v`.
    let mut old: serde_json::Value = serde_json::json!({
        "seq": 1, "time": "2026-11-01T10:00:00Z", "tenant": "acme", "sandbox": "sb1",
        "actor": "tok1",
        "call": {"tenant": "acme", "sandbox": "sb1", "actor": "tok1",
                 "kind": {"kind": "file_read", "path": "/workspace/1"}},
        "decision": {"outcome": "allowed", "effect": "allow", "rule_id": "r1", "layer": null, "reason": "because"},
        "by": null, "prev_hash": audit::GENESIS, "hash": ""
    });
    old["hash"] = audit::entry_hash(audit::GENESIS, &old).into();
    std::fs::write(&p, format!("{old}\n")).unwrap_or_else(|e| panic!("{e}"));
    {
        let log = AuditLog::open(&p).unwrap_or_else(|e| panic!("{e}"));
        for i in 2..=4 {
            log.append(&call("globex", "sb2", i), dec(i), None)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    let legacy = audit::verify(&p).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(legacy.entries, 4);
    assert!(!std::fs::read_to_string(&p)
        .unwrap_or_default()
        .contains("\"v\""));

    // The first keyed open: the chain is keyed after entry 4.
    let start = {
        let log = AuditLog::open_with(&p, keyed_opts(b"k", None)).unwrap_or_else(|e| panic!("{e}"));
        let st = log
            .chain_start()
            .cloned()
            .unwrap_or_else(|| panic!("no start"));
        assert_eq!(
            (st.legacy_seq, st.legacy_hash.as_str()),
            (4, legacy.head.as_str())
        );
        let e = log
            .append(&call("acme", "sb1", 5), dec(5), None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((e.v, e.prev_hash.as_str()), (2, legacy.head.as_str()));
        st
    };
    let v = AuditLog::open_with(&p, keyed_opts(b"k", Some(start.clone())))
        .unwrap_or_else(|e| panic!("{e}"))
        .verify(None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((v.entries, v.keyed_from, v.legacy.0), (5, Some(5), 4));
    assert_eq!(v.tenants["acme"].entries, 2);
    assert_eq!(v.tenants["globex"].entries, 3);

    // The switch cannot be moved: an unkeyed entry after it (the keyed one
    // rewritten in the old form) is refused.
    let text = std::fs::read_to_string(&p).unwrap_or_default();
    let mut ls: Vec<String> = text.lines().map(String::from).collect();
    let mut last: serde_json::Value =
        serde_json::from_str(&ls[4]).unwrap_or_else(|e| panic!("{e}"));
    last.as_object_mut().map(|m| m.remove("v"));
    last["hash"] = audit::entry_hash(&legacy.head, &last).into();
    ls[4] = last.to_string();
    std::fs::write(&p, ls.join("\n") + "\n").unwrap_or_else(|e| panic!("{e}"));
    let err = AuditLog::open_with(&p, keyed_opts(b"k", Some(start)))
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("line 5 ")),
        "{err:?}"
    );
}

#[test]
fn a_denial_flood_makes_a_bounded_number_of_entries_with_the_right_counts() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let p = dir.path().join("audit.jsonl");
    let limits = audit::AuditLimits {
        window: std::time::Duration::from_millis(300),
        burst: 5,
        per_second: 1.0,
    };
    let deny = |i: usize| dec(i * 3);
    let denied_call = |path: String| ToolCall {
        tenant: "acme".into(),
        sandbox: Some("sb1".into()),
        actor: "sandbox:sb1".into(),
        kind: CallKind::FileRead { path },
    };
    let written = std::cell::Cell::new(0u64);
    {
        let log = AuditLog::open_with(
            &p,
            audit::AuditOptions {
                limits: Some(limits),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let h = heads.clone();
        log.set_head_sink(Box::new(move |seq, _| {
            h.lock().map(|mut v| v.push(seq)).map_err(|e| e.to_string())
        }));
        let started = std::time::Instant::now();
        let mut n = 0u64;
        // 20,000 identical denials and 20,000 all different, over ~1 s.
        while n < 40_000 {
            let i = n as usize;
            let c = if n.is_multiple_of(2) {
                denied_call("/etc/shadow".into())
            } else {
                denied_call(format!("/etc/{i}"))
            };
            let r = log
                .record(&c, deny(1), None)
                .unwrap_or_else(|e| panic!("{e}"));
            if matches!(r, audit::Recorded::Written(_)) {
                written.set(written.get() + 1);
            }
            n += 1;
            if n.is_multiple_of(4_000) {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        // Another sandbox keeps its own budget; allowed calls are written.
        let other = ToolCall {
            sandbox: Some("sb9".into()),
            ..denied_call("/etc/shadow".into())
        };
        assert!(matches!(
            log.record(&other, deny(1), None),
            Ok(audit::Recorded::Written(_))
        ));
        assert!(matches!(
            log.record(&call("acme", "sb1", 1), dec(1), None),
            Ok(audit::Recorded::Written(_))
        ));
        let secs = started.elapsed().as_secs_f64();
        log.flush_all().unwrap_or_else(|e| panic!("{e}"));
        // Every write recorded the head.
        let (seq, _) = log.head();
        assert_eq!(
            heads.lock().map(|v| v.last().copied()).ok().flatten(),
            Some(seq)
        );
        // The bound: the burst plus the refill, each write with at most one
        // repeat aggregate, plus one rate-limited aggregate per window.
        let budget = f64::from(limits.burst) + secs * limits.per_second;
        let windows = secs / limits.window.as_secs_f64() + 2.0;
        let bound = (2.0 * budget + windows + 2.0).ceil() as u64;
        eprintln!(
            "denial flood: {seq} entries for 40,002 decisions in {secs:.2} s (bound {bound})"
        );
        assert!(
            seq <= bound,
            "{seq} entries for 40,002 decisions (bound {bound}, {secs:.2} s)"
        );
    }
    let entries = audit::query(&p, &Filter::default()).unwrap_or_else(|e| panic!("{e}"));
    let denied: u64 = entries
        .iter()
        .filter(|e| e.sandbox.as_deref() == Some("sb1") && e.decision.outcome == Outcome::Denied)
        .map(|e| e.count)
        .sum();
    assert_eq!(denied, 40_000, "every denial is counted, none dropped");
    let repeat: u64 = entries
        .iter()
        .filter(|e| e.call == denied_call("/etc/shadow".into()))
        .map(|e| e.count)
        .sum();
    let rate: u64 = entries
        .iter()
        .filter(|e| e.aggregate == Some(audit::Aggregate::RateLimited))
        .map(|e| e.count)
        .sum();
    assert!(repeat >= 2, "identical denials are aggregated into counts");
    assert!(
        rate > 0,
        "denials over the budget are counted in rate-limited entries"
    );
    assert!(entries
        .iter()
        .any(|e| e.aggregate == Some(audit::Aggregate::Repeat) && e.count > 1));
    assert!(written.get() <= entries.len() as u64);
    assert!(audit::verify(&p).is_ok());
}
