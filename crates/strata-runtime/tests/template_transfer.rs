//! Templates between the hosts of a cluster (`Runtime::send_template` /
//! `receive_template`, docs/cluster.md "Templates across hosts"), with
//! real pools and a real guest under TCG: a template sent in full forks on
//! the receiver; a template made from it travels incrementally against it;
//! a receiver with another signing key refuses it and keeps nothing; a
//! garbage stream is refused.

use std::time::Instant;

use strata_core::{SandboxId, SnapshotId, TemplateId};
use strata_runtime::{MoveError, Runtime, RuntimeError, Source, StateSigner};

mod common;

use common::{new_sandbox, sh, size, tokio_rt, TestRuntime};

/// Sends template `tpl` from `a` into `b` (incremental against `parent`
/// when `b` received it before); (stream bytes, ms, parent used).
fn send(
    a: &Runtime,
    b: &Runtime,
    tpl: &TemplateId,
    parent: Option<&TemplateId>,
) -> Result<(u64, u128, bool), MoveError> {
    let t0 = Instant::now();
    let want = parent.and_then(|p| b.received_template_identity(p).map(|u| (p, u)));
    let (mut tx, used) = a.send_template(tpl, want)?;
    let got = b.receive_template(tpl, used, 8 << 30, &mut tx, "tcg");
    let sent = tx.finish();
    let got = got?;
    assert_eq!(Some(got.bytes), sent.ok());
    Ok((got.bytes, t0.elapsed().as_millis(), used.is_some()))
}

#[test]
fn a_template_travels_in_full_then_a_derived_one_incrementally_and_a_foreign_key_is_refused() {
    let signer = |s: u8| std::sync::Arc::new(StateSigner::from_seed(&[s; 32]).expect("signer"));
    // a and b share a key (hosts of one cluster share the master key); c does not.
    let a = TestRuntime::start("strtpla-", size(), |c| c.signing = Some(signer(1)));
    let b = TestRuntime::start("strtplb-", size(), |c| c.signing = Some(signer(1)));
    let c = TestRuntime::start("strtplc-", size(), |c| c.signing = Some(signer(2)));
    let (ra, rb, rc) = (&a.rt, &b.rt, &c.rt);
    let base = a.template.clone();
    tokio_rt().block_on(async {
        // In full: the receiver forks it.
        assert!(!rb.has_template(&base));
        let (full, ms, inc) = send(ra, rb, &base, None).expect("full send");
        eprintln!("template in full: {full} B in {ms} ms");
        assert!(!inc);
        assert!(rb.has_template(&base));
        let sb = SandboxId::generate();
        rb.create(&sb, &Source::Template(base.clone()), None)
            .await
            .expect("fork the received template");
        assert_eq!(sh(rb, &sb, "echo forked-$((6*7))").await, "forked-42");
        rb.delete(&sb).await.expect("delete");

        // A template made from it on a: incremental against the base b holds.
        let id = new_sandbox(&a).await;
        sh(ra, &id, "head -c 4194304 /dev/urandom > /root/blob; sync").await;
        let snap = SnapshotId::generate();
        ra.snapshot(&id, &snap).await.expect("snapshot");
        let derived = TemplateId::generate();
        ra.template_from_snapshot(&snap, &derived, None, None)
            .await
            .expect("derived template");
        ra.delete(&id).await.expect("delete");
        let (incr, ms, inc) = send(ra, rb, &derived, Some(&base)).expect("incremental send");
        eprintln!("derived template, incremental against its base: {incr} B in {ms} ms (full base {full} B)");
        assert!(inc, "the base was not used as parent");
        assert!(incr < full / 4, "{incr} B incremental vs {full} B full");
        let sb = SandboxId::generate();
        rb.create(&sb, &Source::Template(derived.clone()), None)
            .await
            .expect("fork the derived template");
        assert_eq!(sh(rb, &sb, "stat -c %s /root/blob").await, "4194304");
        rb.delete(&sb).await.expect("delete");

        // Another key: refused, nothing kept.
        let e = send(ra, rc, &base, None).expect_err("foreign key");
        eprintln!("foreign key: {e}");
        assert!(
            matches!(
                e,
                MoveError::Runtime(RuntimeError::SnapshotUnusable { .. })
            ),
            "{e}"
        );
        assert!(!rc.has_template(&base));
        assert!(!rc.pool().import_dir().join(base.as_str()).exists());
        assert!(!rc.pool().templates_dir().join(base.as_str()).exists());

        // Garbage: refused, nothing kept.
        let g = TemplateId::generate();
        let junk = vec![0x42u8; 1 << 16];
        let e = rb
            .receive_template(&g, None, 8 << 30, &junk[..], "tcg")
            .expect_err("garbage");
        assert!(matches!(e, MoveError::Transfer(_)), "{e}");
        assert!(!rb.pool().import_dir().join(g.as_str()).exists());
        assert!(!rb.has_template(&g));
    });
}
