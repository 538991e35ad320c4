//! Upgrades: the previous release's guest agent and image under today's
//! runtime, and a snapshot of that guest (its `meta.json` in the form the
//! previous release wrote) restored and forked by today's runtime.
//!
//! The previous release is the commit in `tests/compat/PREVIOUS_RELEASE`; its
//! agent is built by `scripts/previous-release.sh` (scripts/test.sh runs it
//! before `cargo test`) into `/var/cache/strata/compat/<commit>/strata-agent`
//! (or `$STRATA_COMPAT_CACHE/<commit>/…`). The image is today's builder with
//! that agent: the image builder (`strata-image`, `RECIPE_VERSION` 1) is the
//! same as in that release, so it is the image the previous release built.
//! Without the binary the test fails and prints the command that makes it.
//!
//! Today's runtime signs states (`strata_runtime::signing`); the previous
//! release wrote no signature. The legacy path is explicit: the old
//! snapshot (no `state.sig`) is refused until adopted
//! (`Runtime::adopt_unsigned`, what the daemon does once at its first
//! start with signing), then forks and rewinds as before.

use std::path::PathBuf;
use std::time::Duration;

use strata_core::{SandboxId, SnapshotId};
use strata_proto::client::{AgentClient, ExecRequest};
use strata_runtime::{Adoption, Runtime, RuntimeError, Source, StateSigner};

mod common;

use common::{new_sandbox, size, tokio_rt, TestRuntime};

/// The fields of `meta.json` as the previous release (cf98469,
/// `crates/strata-runtime/src/meta.rs`) wrote them; `first_start` only when
/// set. Update it with `PREVIOUS_RELEASE` when a release adds fields.
const PREVIOUS_META_FIELDS: &[&str] = &[
    "format_version",
    "strata_version",
    "qemu_version",
    "accel",
    "machine_layout",
    "size",
    "cmdline",
    "image_hash",
    "kernel_version",
    "net",
    "sandbox",
    "template",
    "hostname",
    "written_at",
];

/// The previous release's commit, from `tests/compat/PREVIOUS_RELEASE`.
fn previous_release() -> String {
    let pin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/compat/PREVIOUS_RELEASE");
    let text = std::fs::read_to_string(&pin)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", pin.display()));
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .find(|l| !l.is_empty())
        .unwrap_or_else(|| panic!("no commit in {}", pin.display()))
        .to_owned()
}

/// The previous release's agent binary; panics with the command that builds it.
fn previous_agent() -> PathBuf {
    let commit = previous_release();
    let cache = std::env::var_os("STRATA_COMPAT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/strata/compat"));
    let bin = cache.join(&commit).join("strata-agent");
    assert!(
        bin.is_file(),
        "the previous release's agent ({commit}) is missing at {}: run `scripts/previous-release.sh` \
         (scripts/test.sh does) to build it",
        bin.display()
    );
    bin
}

async fn sh(agent: &AgentClient, script: &str) -> (i32, String) {
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .expect("exec");
    (
        out.status.code.unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
    )
}

async fn count(rt: &Runtime, id: &SandboxId) -> u64 {
    let agent = rt.agent(id).await.expect("agent");
    let (_, out) = sh(&agent, "cat /tmp/count").await;
    out.parse().unwrap_or_else(|_| panic!("count is {out:?}"))
}

/// Rewrites the read-only snapshot's `meta.json` with only the fields the
/// previous release wrote (today's writer must write all of them), and
/// removes its signature (the previous release signed nothing).
fn write_previous_meta(rt: &Runtime, snap: &SnapshotId) {
    let dir = rt.pool().snapshots_dir().join(snap.as_str());
    let path = dir.join("meta.json");
    let text = std::fs::read_to_string(&path).expect("read meta.json");
    let now: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).expect("meta.json is an object");
    for f in PREVIOUS_META_FIELDS {
        assert!(
            now.contains_key(*f),
            "today's meta.json lacks {f}, which the previous release wrote: {text}"
        );
    }
    let old: serde_json::Map<String, serde_json::Value> = now
        .into_iter()
        .filter(|(k, _)| PREVIOUS_META_FIELDS.contains(&k.as_str()))
        .collect();
    rt.pool()
        .set_readonly(&dir, false)
        .expect("unlock snapshot");
    std::fs::write(&path, serde_json::to_vec_pretty(&old).expect("json")).expect("write meta.json");
    std::fs::remove_file(dir.join("state.sig")).expect("today's runtime signed the snapshot");
    rt.pool().set_readonly(&dir, true).expect("relock snapshot");
}

#[test]
fn previous_release_agent_and_snapshot_work_under_todays_runtime() {
    let agent_bin = previous_agent();
    let recipe = strata_image::ImageRecipe::new(&agent_bin);
    let image = strata_image::build(&recipe, &strata_image::default_cache_dir(), &|p| {
        eprintln!("strata-image {p}")
    })
    .unwrap_or_else(|e| panic!("image with the previous agent: {e}"));
    eprintln!("previous-release image {}", image.dir.display());
    let t = TestRuntime::start_with_image("strcp-", size(), &image.dir, |c| {
        c.signing = Some(std::sync::Arc::new(
            StateSigner::from_seed(&[9; 32]).expect("signer"),
        ))
    });
    tokio_rt().block_on(async {
        let a = new_sandbox(&t).await;
        let agent = t.rt.agent(&a).await.expect("the old agent answers today's host");
        eprintln!("old agent: {:?}", agent.info());
        // The old agent predates output flow control: it answered the
        // negotiation with an error, and today's host runs without a window.
        assert_eq!(
            agent.output_window(),
            None,
            "this agent negotiated output_window: it is not the previous release's"
        );
        // Output larger than the 1 MiB window today's agents are held to.
        let big = 3 << 20;
        let out = agent
            .exec_collect(ExecRequest::shell(format!("head -c {big} /dev/zero | tr '\\0' x")))
            .await
            .expect("exec with 3 MiB of output");
        assert_eq!(out.status.code, Some(0));
        assert_eq!(out.stdout.len(), big);
        assert!(out.stdout.iter().all(|&b| b == b'x'));

        // A file on disk and a value held only in a process's memory.
        let (code, _) = sh(&agent, "echo from-the-old-agent > /root/compat; sync").await;
        assert_eq!(code, 0);
        let (code, _) = sh(
            &agent,
            "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done' >/dev/null 2>&1 &",
        )
        .await;
        assert_eq!(code, 0);
        tokio::time::sleep(Duration::from_millis(800)).await;

        let snap = SnapshotId::generate();
        t.rt.snapshot(&a, &snap).await.expect("snapshot");
        let at_snap = count(&t.rt, &a).await;
        write_previous_meta(&t.rt, &snap);
        let meta = t.rt.snapshot_meta(&snap).expect("the old form of meta.json loads");
        assert_eq!(meta.image_hash, image.hash, "the snapshot is of the old image");
        // Unsigned: refused until adopted, as the daemon adopts it once.
        let e = t
            .rt
            .create(&SandboxId::generate(), &Source::Snapshot(snap.clone()), None)
            .await
            .unwrap_err();
        assert!(
            matches!(e, RuntimeError::SnapshotUnusable { ref reason, .. } if reason.contains("no signature")),
            "{e}"
        );
        assert_eq!(
            t.rt.adopt_unsigned(&Source::Snapshot(snap.clone()))
                .await
                .expect("adopt the previous release's snapshot"),
            Adoption::Signed
        );

        // A fork of the snapshot: the file and the running counter are back.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let b = SandboxId::generate();
        t.rt.create(&b, &Source::Snapshot(snap.clone()), None)
            .await
            .expect("fork of the previous release's snapshot");
        let fork = t.rt.agent(&b).await.expect("agent of the fork");
        assert_eq!(fork.output_window(), None);
        let (code, file) = sh(&fork, "cat /root/compat").await;
        assert_eq!((code, file.as_str()), (0, "from-the-old-agent"));
        let fork_start = count(&t.rt, &b).await;
        assert!(
            fork_start >= at_snap.saturating_sub(5) && fork_start < count(&t.rt, &a).await,
            "the fork resumed the in-memory counter from the snapshot ({at_snap}), not a cold boot: {fork_start}"
        );
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(count(&t.rt, &b).await > fork_start, "the fork's process runs on");
        let out = fork
            .exec_collect(ExecRequest::shell(format!("head -c {big} /dev/zero")))
            .await
            .expect("large exec in the fork");
        assert_eq!(out.stdout.len(), big);

        // The original rewound to the snapshot: the file written after
        // it is gone, the counter is back near the snapshot's value.
        sh(&agent, "rm /root/compat; sync").await;
        t.rt.rewind(&a, &snap, None)
            .await
            .expect("rewind to the previous release's snapshot");
        let restored = t.rt.agent(&a).await.expect("agent after restore");
        let (code, file) = sh(&restored, "cat /root/compat").await;
        assert_eq!((code, file.as_str()), (0, "from-the-old-agent"));
        let after = count(&t.rt, &a).await;
        assert!(
            after >= at_snap.saturating_sub(5) && after < at_snap + 300,
            "restored counter {after} vs snapshot {at_snap}"
        );
        for id in [&a, &b] {
            t.rt.delete(id).await.expect("delete");
        }
        t.rt.delete_snapshot(&snap).await.expect("delete snapshot");
    });
}
