//! Directory watches, host-only: the real `strata-agent --listen-unix`
//! binary (real inotify on a directory of the machine it runs on) and the
//! real `AgentClient::watch_dir`; files written through the agent's own
//! files op and changed by commands it runs.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use strata_proto::client::{AgentError, DirWatch, ExecRequest};
use strata_proto::{AgentClient, WatchEvent, WatchKind};

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
}

impl Agent {
    fn start() -> Self {
        Self::start_bin(PathBuf::from(env!("CARGO_BIN_EXE_strata-agent")))
    }

    fn start_bin(bin: PathBuf) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("strata-agent-watch-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = std::process::Command::new(bin)
            .arg("--listen-unix")
            .arg(&sock)
            .arg("--dry-system")
            .args(["--egress-listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Self { child, dir, sock }
    }

    async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock, Duration::from_secs(10))
            .await
            .unwrap()
    }

    /// A fresh directory to watch.
    fn watched(&self, name: &str) -> String {
        let p = self.dir.path().join(name);
        std::fs::create_dir_all(&p).unwrap();
        p.to_str().unwrap().to_owned()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Everything the watch holds now (polls until `more` is false).
async fn drain(w: &mut DirWatch) -> Vec<WatchEvent> {
    let mut all = Vec::new();
    loop {
        let b = w.poll(Duration::ZERO).await.unwrap();
        all.extend(b.events);
        if !b.more {
            return all;
        }
    }
}

fn ev(kind: WatchKind, name: &str) -> (WatchKind, String) {
    (kind, name.to_owned())
}

fn kinds(evs: &[WatchEvent]) -> Vec<(WatchKind, String)> {
    evs.iter().map(|e| (e.kind, e.name.clone())).collect()
}

async fn sh(c: &AgentClient, script: &str) {
    let out = c.exec_collect(ExecRequest::shell(script)).await.unwrap();
    assert!(
        out.status.success(),
        "{script}: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What the E2B door does for a file write: the files op (written beside,
/// renamed into place), then the new file given to the user (`chown`, an
/// `IN_ATTRIB`). The watch reports the file's own events under its name,
/// nothing of the temporary file: create, write, chmod; then an overwrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_through_the_files_op_gives_create_write_chmod() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.watched("w");
    let mut w = c.watch_dir(&dir, false).await.unwrap();
    assert_eq!(w.dirs(), 1);
    assert!(drain(&mut w).await.is_empty());

    let f = format!("{dir}/a.txt");
    c.write_file(&f, Some(0o644), &b"hello"[..]).await.unwrap();
    sh(&c, &format!("chown 1000 '{f}'")).await;
    // No sleep: a poll after the operations returned sees their events.
    assert_eq!(
        kinds(&drain(&mut w).await),
        [
            ev(WatchKind::Create, "a.txt"),
            ev(WatchKind::Write, "a.txt"),
            ev(WatchKind::Chmod, "a.txt"),
        ]
    );

    // A command's writes, as the kernel names them.
    sh(&c, &format!("echo more >> '{f}'; chmod 600 '{f}'; mv '{f}' '{dir}/b.txt'; rm '{dir}/b.txt'; mkdir '{dir}/d'")).await;
    let got = drain(&mut w).await;
    assert_eq!(
        kinds(&got),
        [
            ev(WatchKind::Write, "a.txt"),
            ev(WatchKind::Chmod, "a.txt"),
            ev(WatchKind::Rename, "a.txt"),
            ev(WatchKind::Create, "b.txt"),
            ev(WatchKind::Remove, "b.txt"),
            ev(WatchKind::Create, "d"),
        ]
    );
    assert!(got[5].dir && !got[0].dir);

    // A long poll answers at the first event; an upload's events come once
    // it is in place (an entry made for them shows the whole file).
    let c2 = c.clone();
    let g = format!("{dir}/late");
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        c2.write_file(&g, None, &[7u8; 3 << 20][..]).await.unwrap();
    });
    let t = std::time::Instant::now();
    let b = w.poll(Duration::from_secs(20)).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(
        std::fs::metadata(format!("{dir}/late")).unwrap().len(),
        3 << 20
    );
    assert_eq!(
        kinds(&b.events),
        [ev(WatchKind::Create, "late"), ev(WatchKind::Write, "late")]
    );
}

/// Recursive: a file in an existing nested directory is named relative to
/// the root; a directory made after the start is watched as it appears
/// (with what is made inside it right after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recursive_watch_names_nested_files_and_follows_new_directories() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.watched("r");
    std::fs::create_dir_all(format!("{dir}/nested/deeper")).unwrap();
    let mut w = c.watch_dir(&dir, true).await.unwrap();
    assert_eq!(w.dirs(), 3);

    c.write_file(&format!("{dir}/nested/f.txt"), None, &b"content"[..])
        .await
        .unwrap();
    let got = kinds(&drain(&mut w).await);
    assert_eq!(
        got,
        [
            ev(WatchKind::Create, "nested/f.txt"),
            ev(WatchKind::Write, "nested/f.txt")
        ]
    );

    c.mkdir_all(&format!("{dir}/new/sub"), None).await.unwrap();
    c.write_file(&format!("{dir}/new/sub/g.txt"), None, &b"g"[..])
        .await
        .unwrap();
    sh(&c, &format!("echo x > '{dir}/nested/deeper/h'")).await;
    let got = kinds(&drain(&mut w).await);
    // (g.txt's write is reported only if `new/sub` was watched before it:
    // the agent follows new directories as it reads their parent's events,
    // and a file already written when its directory is scanned is a create.)
    for want in [
        ev(WatchKind::Create, "new"),
        ev(WatchKind::Create, "new/sub"),
        ev(WatchKind::Create, "new/sub/g.txt"),
        ev(WatchKind::Create, "nested/deeper/h"),
        ev(WatchKind::Write, "nested/deeper/h"),
    ] {
        assert!(got.contains(&want), "{want:?} missing from {got:?}");
    }

    // A non-recursive watch of the same root sees none of the nested files.
    let mut flat = c.watch_dir(&dir, false).await.unwrap();
    sh(
        &c,
        &format!("echo y > '{dir}/nested/other'; echo z > '{dir}/top'"),
    )
    .await;
    assert_eq!(
        kinds(&drain(&mut flat).await),
        [ev(WatchKind::Create, "top"), ev(WatchKind::Write, "top")]
    );
}

/// A tree made faster than the watch can follow (`mkdir -p` and a file at
/// its bottom, in one command; then an archive unpacked): every directory
/// and the file are reported created exactly once, whether the kernel saw
/// them or the scan of their new parent found them; a directory moved in
/// is reported alone, as the kernel reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_made_at_once_is_reported_once_per_entry() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.watched("tree");
    let outside = agent.watched("outside");
    let mut w = c.watch_dir(&dir, true).await.unwrap();
    sh(
        &c,
        &format!(
            "mkdir -p '{dir}/a/b/c/d' && echo x > '{dir}/a/b/c/d/f' && \
             mkdir -p '{outside}/m/n' && tar -C '{outside}' -cf '{outside}/t.tar' m && \
             tar -C '{dir}/a' -xf '{outside}/t.tar' && \
             for i in 0 1 2 3 4 5 6 7; do mkdir -p '{dir}'/t$i/u/v; : > '{dir}'/t$i/u/v/w; done"
        ),
    )
    .await;
    let got = kinds(&drain(&mut w).await);
    let mut names: Vec<String> = ["a", "a/b", "a/b/c", "a/b/c/d", "a/b/c/d/f", "a/m", "a/m/n"]
        .map(String::from)
        .into();
    for i in 0..8 {
        for rel in ["", "/u", "/u/v", "/u/v/w"] {
            names.push(format!("t{i}{rel}"));
        }
    }
    for name in &names {
        let n = got
            .iter()
            .filter(|(k, e)| *k == WatchKind::Create && e == name)
            .count();
        assert_eq!(n, 1, "create of {name} reported {n} times in {got:?}");
    }
    // Moved in: the directory, not what it holds.
    std::fs::create_dir_all(format!("{outside}/moved/inner")).unwrap();
    std::fs::rename(format!("{outside}/moved"), format!("{dir}/moved")).unwrap();
    let got = kinds(&drain(&mut w).await);
    assert_eq!(got, [ev(WatchKind::Create, "moved")]);
    // ...and it is watched: a file made in it afterwards is reported.
    std::fs::write(format!("{dir}/moved/inner/late"), b"l").unwrap();
    let got = kinds(&drain(&mut w).await);
    assert!(
        got.contains(&ev(WatchKind::Create, "moved/inner/late")),
        "{got:?}"
    );
}

/// A flood of creates with nobody polling: the agent holds at most its
/// buffer and one overflow marker, and the watch goes on afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_bounded_with_one_overflow_marker() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.watched("flood");
    let mut w = c.watch_dir(&dir, false).await.unwrap();
    // 6000 files: one create each, past the buffer.
    sh(
        &c,
        &format!("cd '{dir}' && i=0; while [ $i -lt 6000 ]; do : > f$i; i=$((i+1)); done"),
    )
    .await;
    let got = drain(&mut w).await;
    assert!(got.len() <= 4097, "{} events held", got.len());
    assert!(got.len() >= 4000, "{} events held", got.len());
    assert_eq!(got.last().unwrap().kind, WatchKind::Overflow);
    assert_eq!(
        got.iter().filter(|e| e.kind == WatchKind::Overflow).count(),
        1
    );
    assert_eq!(got[0].name, "f0");
    // Drained: new events come again.
    sh(&c, &format!("rm '{dir}/f0'")).await;
    assert_eq!(kinds(&drain(&mut w).await), [ev(WatchKind::Remove, "f0")]);
}

/// Bad paths fail typed; the per-session cap holds; a stopped watch frees
/// its place; the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_the_watch_cap() {
    let agent = Agent::start();
    let c = agent.client().await;
    let dir = agent.watched("caps");
    let e = c
        .watch_dir(&format!("{dir}/nope"), false)
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(strata_proto::RemoteErrorKind::NotFound),
        "{e}"
    );
    std::fs::write(format!("{dir}/file"), b"x").unwrap();
    let e = c
        .watch_dir(&format!("{dir}/file"), false)
        .await
        .unwrap_err();
    assert_eq!(
        e.remote_kind(),
        Some(strata_proto::RemoteErrorKind::NotADirectory),
        "{e}"
    );
    let mut open = Vec::new();
    for _ in 0..64 {
        open.push(c.watch_dir(&dir, false).await.unwrap());
    }
    let e = c.watch_dir(&dir, false).await.unwrap_err();
    assert!(e.to_string().contains("too many directory watches"), "{e}");
    drop(open.pop());
    // The stop reaches the agent before the next request on the connection.
    let mut again = c.watch_dir(&dir, false).await.unwrap();
    sh(&c, &format!("touch '{dir}/t'")).await;
    assert_eq!(
        kinds(&drain(&mut again).await)[0],
        ev(WatchKind::Create, "t")
    );
    c.ping().await.unwrap();
}

/// The previous release's agent (built and cached by `scripts/previous-release.sh`).
fn previous_agent() -> PathBuf {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = std::process::Command::new("bash")
        .arg(format!("{root}/scripts/previous-release.sh"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/previous-release.sh failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_agent_answers_a_typed_unsupported() {
    let agent = Agent::start_bin(previous_agent());
    let c = agent.client().await;
    let dir = agent.watched("old");
    match c.watch_dir(&dir, false).await {
        Err(AgentError::Unsupported { .. }) => {}
        other => panic!("expected Unsupported, got {other:?}"),
    }
    c.ping().await.unwrap();
}
