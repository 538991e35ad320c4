//! `btrfs send` / `receive` between two real pools (loop-mounted images; needs root).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

use strata_storage::testing::TestPool;
use strata_storage::{subvol_info, ReceiveSpec, TransferError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// `mib` MiB of non-repeating data starting at `seed`.
fn write_at(path: &Path, offset: u64, mib: u64, seed: u64) {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .expect("open");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    let mut buf = vec![0u8; MIB as usize];
    for i in 0..mib {
        for (j, chunk) in buf.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&(seed ^ (i * MIB + j as u64 * 8 + 1)).to_le_bytes());
        }
        f.write_all(&buf).expect("write");
    }
    f.sync_all().expect("fsync");
}

fn spec(name: &str, parent: Option<strata_storage::Uuid>) -> ReceiveSpec {
    ReceiveSpec {
        name: name.into(),
        parent,
        max_bytes: GIB,
    }
}

/// A reader that fails with a connection reset after `left` bytes.
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

fn import_is_empty(p: &TestPool) -> bool {
    match fs::read_dir(p.import_dir()) {
        Ok(rd) => rd.count() == 0,
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

#[test]
fn incremental_send_receive_moves_only_changes_and_refuses_bad_streams() {
    let a = TestPool::new(GIB).expect("pool a");
    let b = TestPool::new(GIB).expect("pool b");
    let sb = a.create_subvolume("sandboxes/sb").expect("subvol");
    write_at(&sb.join("mem"), 0, 32, 1);
    fs::write(sb.join("meta.json"), b"{}").expect("meta");
    a.snapshot(&sb, "snapshots/s1", true).expect("s1");

    // Full send of s1.
    let mut tx = a.send(Path::new("snapshots/s1"), None).expect("send");
    let got = b.receive(&spec("s1", None), &mut tx).expect("receive s1");
    let full = tx.finish().expect("send ok");
    let s1 = subvol_info(&a.root().join("snapshots/s1")).expect("info");
    assert_eq!(got.info.received_uuid, Some(s1.identity()));
    assert!(got.info.readonly);
    assert_eq!(got.bytes, full);
    assert!(full > 32 * MIB, "full send {full}");
    assert_eq!(
        fs::read(got.path.join("mem")).expect("read"),
        fs::read(a.root().join("snapshots/s1/mem")).expect("read")
    );

    // Change 1 MiB; the incremental stream carries about that.
    write_at(&sb.join("mem"), 5 * MIB, 1, 99);
    a.snapshot(&sb, "snapshots/s2", true).expect("s2");
    let mut tx = a
        .send(Path::new("snapshots/s2"), Some(Path::new("snapshots/s1")))
        .expect("send");
    let got2 = b
        .receive(&spec("s2", Some(s1.identity())), &mut tx)
        .expect("receive s2");
    let incr = tx.finish().expect("send ok");
    assert_eq!(got2.bytes, incr);
    eprintln!("full {full} B, incremental {incr} B for 1 MiB changed");
    assert!(
        incr as f64 <= 1.2 * MIB as f64,
        "incremental stream {incr} B > 1.2 x 1 MiB"
    );
    assert_eq!(
        fs::read(got2.path.join("mem")).expect("read"),
        fs::read(a.root().join("snapshots/s2/mem")).expect("read")
    );
    let s2 = subvol_info(&a.root().join("snapshots/s2")).expect("info");

    // Listed with the sender's identities: what a sender compares.
    let held = b.list_received().expect("list");
    let ids: Vec<_> = held
        .iter()
        .map(|(n, i)| (n.as_str(), i.received_uuid))
        .collect();
    assert_eq!(
        ids,
        vec![("s1", Some(s1.identity())), ("s2", Some(s2.identity()))]
    );

    // Interrupted transfer: nothing partial remains, and it resumes.
    write_at(&sb.join("mem"), 9 * MIB, 2, 7);
    a.snapshot(&sb, "snapshots/s3", true).expect("s3");
    let tx = a
        .send(Path::new("snapshots/s3"), Some(Path::new("snapshots/s2")))
        .expect("send");
    let e = b
        .receive(
            &spec("s3", Some(s2.identity())),
            Cut {
                inner: tx,
                left: 300 << 10,
            },
        )
        .expect_err("cut stream");
    assert!(matches!(e, TransferError::Read(_)), "{e}");
    assert!(!b.import_dir().join("s3").exists(), "partial s3 left");
    let mut tx = a
        .send(Path::new("snapshots/s3"), Some(Path::new("snapshots/s2")))
        .expect("send");
    b.receive(&spec("s3", Some(s2.identity())), &mut tx)
        .expect("resumed s3");
    tx.finish().expect("send ok");
    // Received twice: refused, the first copy kept.
    let mut tx = a
        .send(Path::new("snapshots/s3"), Some(Path::new("snapshots/s2")))
        .expect("send");
    let e = b
        .receive(&spec("s3", Some(s2.identity())), &mut tx)
        .expect_err("twice");
    assert!(matches!(e, TransferError::AlreadyReceived(_)), "{e}");
    drop(tx);
    assert!(b.import_dir().join("s3/mem").exists());

    // Hostile input into a clean pool: nothing left behind.
    let c = TestPool::new(GIB).expect("pool c");
    let garbage = vec![0x5au8; 100_000];
    let e = c
        .receive(&spec("s1", None), &garbage[..])
        .expect_err("garbage");
    assert!(matches!(e, TransferError::BadStream(_)), "{e}");
    assert!(import_is_empty(&c));
    let mut tx = a.send(Path::new("snapshots/s1"), None).expect("send");
    let e = c
        .receive(&spec("evil", None), &mut tx)
        .expect_err("wrong name");
    assert!(matches!(e, TransferError::UnexpectedName { .. }), "{e}");
    drop(tx);
    assert!(import_is_empty(&c));
    // An incremental stream where a full one was agreed on.
    let mut tx = a
        .send(Path::new("snapshots/s2"), Some(Path::new("snapshots/s1")))
        .expect("send");
    let e = c.receive(&spec("s2", None), &mut tx).expect_err("parent");
    assert!(matches!(e, TransferError::UnexpectedParent { .. }), "{e}");
    drop(tx);
    // Over its bound: stopped mid-way, the partial subvolume deleted.
    let mut tx = a.send(Path::new("snapshots/s1"), None).expect("send");
    let e = c
        .receive(
            &ReceiveSpec {
                max_bytes: 8 * MIB,
                ..spec("s1", None)
            },
            &mut tx,
        )
        .expect_err("bound");
    assert!(matches!(e, TransferError::TooLarge { .. }), "{e}");
    drop(tx);
    assert!(import_is_empty(&c));
    // A stream whose bytes were flipped mid-way (btrfs receive checks each
    // command's CRC): refused, nothing left.
    let mut bytes = Vec::new();
    let mut tx = a.send(Path::new("snapshots/s1"), None).expect("send");
    tx.read_to_end(&mut bytes).expect("read");
    tx.finish().expect("send ok");
    let mid = bytes.len() / 2;
    for b in &mut bytes[mid..mid + 64] {
        *b ^= 0xff;
    }
    let e = c
        .receive(&spec("s1", None), &bytes[..])
        .expect_err("corrupt");
    eprintln!("corrupt stream: {e}");
    assert!(import_is_empty(&c));
    let _ = File::open(a.root()).expect("pool a still there");
}

/// A → B → A: the snapshot A made travels to B in full; B's next snapshot
/// (made from the received one) comes back incremental against A's own
/// snapshot, received against a parent anchor of it in A's import
/// directory (`Pool::anchor_received`): only what B changed travels.
#[test]
fn a_return_move_is_incremental_against_the_origins_own_snapshot() {
    let a = TestPool::new(GIB).expect("pool a");
    let b = TestPool::new(GIB).expect("pool b");
    let sb = a.create_subvolume("sandboxes/sb").expect("subvol");
    write_at(&sb.join("mem"), 0, 32, 3);
    fs::write(sb.join("meta.json"), b"{}").expect("meta");
    a.snapshot(&sb, "snapshots/s1", true).expect("s1");
    let s1 = subvol_info(&a.root().join("snapshots/s1")).expect("info");

    // A → B, in full.
    let mut tx = a.send(Path::new("snapshots/s1"), None).expect("send");
    let got = b.receive(&spec("s1", None), &mut tx).expect("receive s1");
    let full = tx.finish().expect("send ok");
    assert_eq!(got.info.received_uuid, Some(s1.identity()));

    // On B: a sandbox from the received snapshot, 2 MiB rewritten, a new
    // snapshot of it.
    let sb_b = b.root().join("sandboxes/sb");
    fs::create_dir_all(b.root().join("sandboxes")).expect("dir");
    b.snapshot(&got.path, &sb_b, false).expect("sandbox on b");
    write_at(&sb_b.join("mem"), 7 * MIB, 2, 1234);
    b.snapshot(&sb_b, "snapshots/s2", true).expect("s2 on b");
    let s2 = b.root().join("snapshots/s2");
    let changed = b
        .written_since(&s2, Some(got.path.as_path()))
        .expect("changed bytes");
    assert!(changed >= 2 * MIB, "{changed}");

    // B → A, incremental against the received s1, whose identity is A's
    // s1. `btrfs receive` looks a parent up by received UUID (then by
    // UUID), and clone sources by received UUID only: A's anchor of its
    // own s1 under import/ carries that identity as received UUID.
    // The anchor: A's own s1 under import/, carrying its identity.
    let anchor = a
        .anchor_received(Path::new("snapshots/s1"), "s1")
        .expect("anchor");
    assert!(anchor.readonly);
    assert_eq!(anchor.received_uuid, Some(s1.identity()));
    assert_eq!(anchor.identity(), s1.identity());
    // Idempotent; listed as received with that identity.
    assert_eq!(
        a.anchor_received(Path::new("snapshots/s1"), "s1")
            .expect("again")
            .uuid,
        anchor.uuid
    );
    assert_eq!(
        a.list_received().expect("list"),
        vec![("s1".to_owned(), anchor)]
    );
    // A writable source is refused.
    assert!(a.anchor_received(Path::new("sandboxes/sb"), "sb").is_err());

    let mut tx = b.send(&s2, Some(&got.path)).expect("send");
    let back = a
        .receive(&spec("s2", Some(s1.identity())), &mut tx)
        .expect("receive s2 on a");
    let incr = tx.finish().expect("send ok");
    eprintln!(
        "return move: {incr} B for {changed} B changed since the common parent ({:.4}x; the first move {full} B)",
        incr as f64 / changed as f64
    );
    assert!(
        incr as f64 <= 1.2 * changed as f64,
        "{incr} B sent for {changed} B changed"
    );
    assert_eq!(
        fs::read(back.path.join("mem")).expect("read"),
        fs::read(s2.join("mem")).expect("read")
    );
    assert_eq!(
        back.info.received_uuid,
        Some(subvol_info(&s2).expect("info").identity())
    );
}
