//! Moving a sandbox with its memory between two deployments (two runtimes,
//! two pools, two signing keys) by incremental `btrfs send` / `receive`
//! (`strata_runtime::runtime::transfer`, docs/move.md), with a real guest
//! under TCG: a live process and RAM markers survive the move; a second
//! move sends about what changed; a return move to the origin sends only
//! what changed since the snapshot the origin made (against a parent
//! anchor of it); an interrupted stream leaves nothing and resumes; a
//! garbage stream is refused with nothing left behind.

use std::io::{self, Read};

use strata_core::SnapshotId;
use strata_runtime::{MoveError, Runtime, StateSigner};

mod common;

use common::{new_sandbox, sh, size, tokio_rt, TestRuntime};

/// Sends `snap` from `a` (against `parent`) into `b`; the stream bytes.
fn push(a: &Runtime, b: &Runtime, snap: &SnapshotId, parent: Option<&SnapshotId>) -> u64 {
    let parent_id = parent.map(|p| a.snapshot_identity(p).expect("identity"));
    let mut tx = a.send_snapshot(snap, parent).expect("send");
    // A snapshot is made read-only when a send first needs it (it and its
    // parent: `btrfs send` takes read-only subvolumes only).
    for s in std::iter::once(snap).chain(parent) {
        let dir = a.pool().snapshots_dir().join(s.as_str());
        assert!(a.pool().is_readonly(&dir).expect("flags"), "{s} sealed");
    }
    let got = b
        .receive_snapshot(snap, parent_id, 8 << 30, &mut tx, "tcg")
        .expect("receive");
    let sent = tx.finish().expect("btrfs send");
    assert_eq!(got.bytes, sent);
    sent
}

/// A reader that fails like a dropped connection after `left` bytes.
struct Cut<R> {
    inner: R,
    left: usize,
}

impl<R: Read> Read for Cut<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::from(io::ErrorKind::ConnectionReset));
        }
        let n = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..n])?;
        self.left -= n;
        Ok(n)
    }
}

#[test]
fn a_sandbox_moves_with_its_memory_and_moves_again_incrementally() {
    let signer = |s: u8| std::sync::Arc::new(StateSigner::from_seed(&[s; 32]).expect("signer"));
    let a = TestRuntime::start("strmova-", size(), |c| c.signing = Some(signer(1)));
    let b = TestRuntime::start("strmovb-", size(), |c| c.signing = Some(signer(2)));
    let (ra, rb) = (&a.rt, &b.rt);
    tokio_rt().block_on(async {
        let id = new_sandbox(&a).await;
        // RAM-only markers: a tmpfs file and a sleeping process whose
        // environment (in its memory) holds a value.
        let pid = sh(
            ra,
            &id,
            "mkdir -p /run/m && mount -t tmpfs t /run/m 2>/dev/null; \
             echo ram-marker-41 > /run/m/mark; \
             MARK=env-marker-42 setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!",
        )
        .await;
        let s1 = SnapshotId::generate();
        ra.snapshot(&id, &s1).await.expect("s1");
        sh(ra, &id, "echo two > /root/f; sync").await;
        let s2 = SnapshotId::generate();
        ra.snapshot(&id, &s2).await.expect("s2");
        let h1 = SnapshotId::generate();
        ra.hibernate(&id, &h1).await.expect("hibernate");

        // First move: s1 in full, then each with the previous as parent.
        let full = push(ra, rb, &s1, None);
        let d2 = push(ra, rb, &s2, Some(&s1));
        let d3 = push(ra, rb, &h1, Some(&s2));
        eprintln!("first move: {full} B full, then {d2} B and {d3} B");
        assert!(d2 < full / 4 && d3 < full / 4, "{full} {d2} {d3}");
        // B holds all three, by the sender's identities.
        let held = rb.received_snapshots().expect("held");
        for s in [&s1, &s2, &h1] {
            let want = ra.snapshot_identity(s).expect("identity");
            assert!(
                held.iter().any(|(n, u)| n == s.as_str() && *u == want),
                "{s} not held"
            );
        }

        // Woken on B (another key: the received states were re-signed).
        rb.wake(&id, &h1).await.expect("wake on b");
        assert_eq!(sh(rb, &id, "cat /run/m/mark").await, "ram-marker-41");
        let env = sh(rb, &id, &format!("tr '\\0' '\\n' < /proc/{pid}/environ | grep ^MARK=")).await;
        assert_eq!(env, "MARK=env-marker-42");
        assert_eq!(sh(rb, &id, "cat /root/f").await, "two");

        // The source wakes its copy, changes a little, hibernates and
        // moves again: only what changed since h1 (held by B) travels.
        ra.wake(&id, &h1).await.expect("wake on a");
        sh(ra, &id, "head -c 1048576 /dev/urandom > /run/m/more; echo three > /root/f; sync").await;
        let h2 = SnapshotId::generate();
        ra.hibernate(&id, &h2).await.expect("hibernate again");
        let changed = ra
            .pool()
            .written_since(
                ra.pool().snapshots_dir().join(h2.as_str()),
                Some(&ra.pool().snapshots_dir().join(h1.as_str())),
            )
            .expect("changed bytes");
        let bytes = push(ra, rb, &h2, Some(&h1));
        eprintln!("second move: {bytes} B sent for {changed} B changed since the common parent (first full {full} B)");
        assert!(
            bytes as f64 <= 1.2 * changed as f64,
            "{bytes} B sent for {changed} B changed"
        );
        assert!(bytes < full / 4, "{bytes} vs full {full}");
        rb.delete(&id).await.expect("end b's vm");
        rb.wake(&id, &h2).await.expect("wake h2 on b");
        assert_eq!(sh(rb, &id, "cat /root/f").await, "three");
        assert_eq!(sh(rb, &id, "cat /run/m/mark").await, "ram-marker-41");
        assert_eq!(sh(rb, &id, &format!("test -d /proc/{pid} && echo alive")).await, "alive");

        // An interrupted stream: nothing partial is left, the move resumes.
        ra.wake(&id, &h2).await.expect("wake on a");
        sh(ra, &id, "echo four > /root/f; sync").await;
        let h3 = SnapshotId::generate();
        ra.hibernate(&id, &h3).await.expect("hibernate a third time");
        let p = ra.snapshot_identity(&h2).expect("identity");
        let tx = ra.send_snapshot(&h3, Some(&h2)).expect("send");
        let e = rb
            .receive_snapshot(&h3, Some(p), 8 << 30, Cut { inner: tx, left: 4096 }, "tcg")
            .expect_err("cut");
        eprintln!("cut stream: {e}");
        assert!(matches!(e, MoveError::Transfer(_)), "{e}");
        assert!(!rb.pool().import_dir().join(h3.as_str()).exists());
        assert!(!rb.pool().snapshots_dir().join(h3.as_str()).exists());
        push(ra, rb, &h3, Some(&h2));
        assert!(rb.pool().snapshots_dir().join(h3.as_str()).exists());

        // A return move: B wakes h3, changes a little and hibernates; the
        // new snapshot goes back to A incremental against h3, which A made
        // (A receives it against a parent anchor of its own h3).
        rb.delete(&id).await.expect("end b's vm");
        rb.wake(&id, &h3).await.expect("wake h3 on b");
        assert_eq!(sh(rb, &id, "cat /root/f").await, "four");
        sh(rb, &id, "echo back-marker-5 > /run/m/back; echo five > /root/f; sync").await;
        let hb = SnapshotId::generate();
        rb.hibernate(&id, &hb).await.expect("hibernate on b");
        // Both name h3 by A's identity (B by its received copy).
        let h3_id = ra.snapshot_identity(&h3).expect("identity");
        assert_eq!(rb.snapshot_identity(&h3).expect("identity"), h3_id);
        assert_eq!(ra.anchor_snapshot(&h3).expect("anchor"), h3_id);
        assert_eq!(ra.snapshot_identity(&h3).expect("identity"), h3_id);
        let changed = rb
            .pool()
            .written_since(
                rb.pool().snapshots_dir().join(hb.as_str()),
                Some(&rb.pool().import_dir().join(h3.as_str())),
            )
            .expect("changed bytes");
        let back = push(rb, ra, &hb, Some(&h3));
        eprintln!(
            "return move: {back} B sent for {changed} B changed since the common parent ({:.3}x; first move {full} B)",
            back as f64 / changed as f64
        );
        assert!(
            back as f64 <= 1.2 * changed as f64,
            "{back} B sent for {changed} B changed"
        );
        assert!(back < full / 4, "{back} vs full {full}");
        ra.wake(&id, &hb).await.expect("wake the returned snapshot on a");
        assert_eq!(sh(ra, &id, "cat /root/f").await, "five");
        assert_eq!(sh(ra, &id, "cat /run/m/back /run/m/mark").await, "back-marker-5\nram-marker-41");
        assert_eq!(sh(ra, &id, &format!("test -d /proc/{pid} && echo alive")).await, "alive");

        // Garbage: refused, nothing left.
        let junk = vec![0x42u8; 1 << 16];
        let g = SnapshotId::generate();
        let e = rb
            .receive_snapshot(&g, None, 8 << 30, &junk[..], "tcg")
            .expect_err("garbage");
        assert!(matches!(e, MoveError::Transfer(_)), "{e}");
        assert!(!rb.pool().import_dir().join(g.as_str()).exists());
        assert!(!rb.pool().snapshots_dir().join(g.as_str()).exists());
        for r in [ra, rb] {
            let _ = r.delete(&id).await;
        }
    });
}
