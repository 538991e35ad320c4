//! Files: a 100 MiB round trip, file operations and their errors, and an
//! upload to a full disk.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};
use strata_proto::{AgentError, FileKind, RemoteErrorKind};

use crate::support::Agent;

#[tokio::test]
async fn big_file_round_trip() {
    let agent = Agent::start();
    let c = agent.client().await;
    const SIZE: usize = 100 * 1024 * 1024;
    // Source file on the host, written in pieces.
    let src = agent.dir.path().join("src.bin");
    let mut hasher = Sha256::new();
    {
        let mut f = std::fs::File::create(&src).unwrap();
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..SIZE / buf.len() {
            for b in buf.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            hasher.update(&buf);
            f.write_all(&buf).unwrap();
        }
    }
    let want = hasher.finalize();
    let dest = agent.path("dest.bin");

    let t = Instant::now();
    let f = tokio::fs::File::open(&src).await.unwrap();
    let n = c.write_file(&dest, Some(0o600), f).await.unwrap();
    let up = t.elapsed();
    assert_eq!(n, SIZE as u64);
    let st = c.stat(&dest).await.unwrap().unwrap();
    assert_eq!(st.size, SIZE as u64);
    assert_eq!(st.mode, 0o600);
    assert_eq!(st.kind, FileKind::File);

    let t = Instant::now();
    let dl = c.read_file(&dest).await.unwrap();
    assert_eq!(dl.size(), SIZE as u64);
    let back = agent.dir.path().join("back.bin");
    let mut out = tokio::fs::File::create(&back).await.unwrap();
    let got = dl.copy_to(&mut out).await.unwrap();
    let down = t.elapsed();
    assert_eq!(got, SIZE as u64);
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(&back).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    assert_eq!(h.finalize(), want);
    let mib = SIZE as f64 / (1024.0 * 1024.0);
    println!(
        "BENCH file upload 100 MiB: {:.0} MiB/s ({:?}); download: {:.0} MiB/s ({:?})",
        mib / up.as_secs_f64(),
        up,
        mib / down.as_secs_f64(),
        down
    );

    // AsyncRead view of a download.
    use tokio::io::AsyncReadExt;
    let mut r = Box::pin(c.read_file(&dest).await.unwrap().into_async_read());
    let mut first = vec![0u8; 10];
    r.read_exact(&mut first).await.unwrap();
    let mut direct = [0u8; 10];
    std::fs::File::open(&src)
        .unwrap()
        .read_exact(&mut direct)
        .unwrap();
    assert_eq!(first, direct);
    drop(r);
    // No temporary upload files are left behind.
    let names: Vec<String> = c
        .list_dir(agent.dir.path().to_str().unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(
        !names.iter().any(|n| n.contains("strata-upload")),
        "{names:?}"
    );
}

#[tokio::test]
async fn file_operations_and_errors() {
    let agent = Agent::start();
    let c = agent.client().await;
    let base = agent.path("tree");
    c.mkdir_all(&format!("{base}/a/b/c"), None).await.unwrap();
    c.mkdir_all(&format!("{base}/a/b/c"), None).await.unwrap(); // idempotent
    c.write_file(&format!("{base}/a/f.txt"), None, &b"hello"[..])
        .await
        .unwrap();
    std::os::unix::fs::symlink("f.txt", format!("{base}/a/link")).unwrap();
    let list = c.list_dir(&format!("{base}/a")).await.unwrap();
    let summary: Vec<(String, FileKind)> = list.iter().map(|e| (e.name.clone(), e.kind)).collect();
    assert_eq!(
        summary,
        vec![
            ("b".into(), FileKind::Dir),
            ("f.txt".into(), FileKind::File),
            ("link".into(), FileKind::Symlink)
        ]
    );
    assert_eq!(list[1].size, 5);
    assert_eq!(list[1].mode, 0o644);
    assert!(list[1].mtime > 1_600_000_000);
    // Empty file.
    c.write_file(&format!("{base}/empty"), None, &b""[..])
        .await
        .unwrap();
    assert_eq!(
        c.stat(&format!("{base}/empty"))
            .await
            .unwrap()
            .unwrap()
            .size,
        0
    );
    let mut dl = c.read_file(&format!("{base}/empty")).await.unwrap();
    assert!(dl.next_chunk().await.is_none());

    assert!(c.stat(&format!("{base}/nope")).await.unwrap().is_none());
    let e = c.read_file(&format!("{base}/nope")).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.list_dir(&format!("{base}/nope")).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.read_file(&base).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::IsADirectory), "{e}");
    let e = c
        .write_file(&format!("{base}/nodir/x"), None, &b"x"[..])
        .await
        .unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.write_file(&base, None, &b"x"[..]).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::IsADirectory), "{e}");
    let e = c.stat(&format!("{base}/a\0b")).await.unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    let e = c
        .write_file("relative/path", None, &b"x"[..])
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
    let e = c
        .mkdir_all(&format!("{base}/a/f.txt/sub"), None)
        .await
        .unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotADirectory), "{e}");

    let e = c.remove(&format!("{base}/a"), false).await.unwrap_err();
    assert!(matches!(e, AgentError::Remote { .. }), "{e}");
    c.remove(&format!("{base}/a/link"), false).await.unwrap();
    assert!(std::path::Path::new(&format!("{base}/a/f.txt")).exists());
    c.remove(&format!("{base}/a"), true).await.unwrap();
    assert!(c.stat(&format!("{base}/a")).await.unwrap().is_none());
    let e = c.remove(&format!("{base}/a"), true).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NotFound), "{e}");
    let e = c.remove("/", true).await.unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(RemoteErrorKind::InvalidArgument),
        "{e}"
    );
}

#[tokio::test]
async fn upload_to_full_disk_is_no_space_and_leaves_nothing() {
    // Needs root to mount a small tmpfs; skipped (with a message) otherwise.
    let agent = Agent::start();
    let mnt = agent.dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP: cannot mount tmpfs (not root?)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _u = Unmount(mnt.clone());
    let c = agent.client().await;
    let data = vec![7u8; 4 * 1024 * 1024];
    let dest = format!("{}/big", mnt.display());
    let e = c.write_file(&dest, None, &data[..]).await.unwrap_err();
    assert_eq!(e.remote_kind(), Some(RemoteErrorKind::NoSpace), "{e}");
    assert!(
        std::fs::read_dir(&mnt).unwrap().next().is_none(),
        "partial file left"
    );
    // The connection is still usable.
    assert!(c.ping().await.is_ok());
    drop(c);
    wait_dir_empty(&mnt);
}

fn wait_dir_empty(p: &Path) {
    let _ = std::fs::read_dir(p);
}

/// A reader that yields `n` bytes, then fails (`fail`) or never ends.
struct Cut {
    left: usize,
    fail: bool,
}

impl tokio::io::AsyncRead for Cut {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.left == 0 {
            return if self.fail {
                std::task::Poll::Ready(Err(std::io::Error::other("source cut off")))
            } else {
                std::task::Poll::Pending
            };
        }
        let n = self.left.min(buf.remaining());
        buf.put_slice(&vec![b'z'; n]);
        self.left -= n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// Temporary upload files in `dir`, through the agent.
async fn temporaries(c: &strata_proto::AgentClient, dir: &Path) -> Vec<String> {
    c.list_dir(dir.to_str().unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .filter(|n| n.contains("strata-upload"))
        .collect()
}

/// An upload the host gives up on (its source fails, or its caller drops
/// it) is abandoned in the guest at once (`write_abort`): the temporary
/// file goes while the session lives on. Before, it stayed until the agent
/// session ended.
#[tokio::test]
async fn an_abandoned_upload_leaves_no_temporary_file_while_the_session_lives() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.dir.path().join("up");
    std::fs::create_dir(&dir).unwrap();
    // The abort is dispatched before any later request on the session, and
    // the agent removes the file as it dispatches it: the very next listing
    // must not see it (the E2B SDK test lists right after a refusal).
    let wait_clean = |what: &'static str| {
        let (c, dir) = (&c, &dir);
        async move {
            let left = temporaries(c, dir).await;
            assert!(left.is_empty(), "{what}: still there: {left:?}");
        }
    };
    // The source fails after 3 MiB.
    let dest = dir.join("failed.bin");
    let src = Cut {
        left: 3 << 20,
        fail: true,
    };
    let e = c
        .write_file(dest.to_str().unwrap(), None, src)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, AgentError::Io(io) if io.to_string().contains("source cut off")),
        "{e:?}"
    );
    wait_clean("a failed source").await;
    // The caller drops the upload mid-stream.
    let dest2 = dir.join("dropped.bin");
    let src = Cut {
        left: 2 << 20,
        fail: false,
    };
    let up = c.write_file(dest2.to_str().unwrap(), None, src);
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(500), up)
            .await
            .is_err(),
        "an endless source finished"
    );
    wait_clean("a dropped upload").await;
    assert!(!dest.exists() && !dest2.exists());
    // The session is the same one, and still works.
    c.write_file(dir.join("ok").to_str().unwrap(), None, &b"ok"[..])
        .await
        .unwrap();
    assert_eq!(std::fs::read(dir.join("ok")).unwrap(), b"ok");
}
