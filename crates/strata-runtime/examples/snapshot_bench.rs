//! Benchmark of issue 3: snapshot pause (strata vs a full-memory save, side by
//! side on the same guest), fork and wake to agent-ready, and the space of 60
//! snapshots of an idle guest. Real guests under TCG on a real btrfs pool.
//!
//! ```text
//! cargo run --release -p strata-runtime --example snapshot_bench -- [--mem 512] [--runs 20] [--forks 20] [--full-runs 5] [--space-snaps 60]
//! ```
//! Needs root (loop-mounted btrfs) and a built image (`strata image build`).

use std::time::{Duration, Instant};

use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use strata_proto::client::ExecRequest;
use strata_runtime::{PoolSetting, Runtime, RuntimeConfig, Source};
use strata_storage::testing::TestPool;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[idx.min(v.len() - 1)]
}

fn report(name: &str, v: &mut [f64]) -> f64 {
    let p50 = pct(v, 50.0);
    println!(
        "{name:<44} n={:<3} p50={:>8.1} p95={:>8.1} p99={:>8.1} max={:>8.1} ms",
        v.len(),
        p50,
        pct(v, 95.0),
        pct(v, 99.0),
        pct(v, 100.0)
    );
    p50
}

/// The classic full-memory save (what `virsh save` does): stop, migrate ALL RAM
/// to a file (over a local TCP socket copied to the file), cont. Returns the pause.
async fn full_save(rt: &Runtime, id: &SandboxId, path: &std::path::Path) -> f64 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let out = path.to_path_buf();
    let sink = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut f = tokio::fs::File::create(&out).await.expect("create");
        let n = tokio::io::copy(&mut s, &mut f).await.expect("copy");
        f.sync_all().await.expect("fsync");
        n
    });
    let t0 = Instant::now();
    rt.qmp(id, "stop", None).await.expect("stop");
    rt.qmp(
        id,
        "migrate-set-capabilities",
        Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": false}]})),
    )
    .await
    .expect("caps");
    rt.qmp(
        id,
        "migrate",
        Some(serde_json::json!({"uri": format!("tcp:127.0.0.1:{port}")})),
    )
    .await
    .expect("migrate");
    loop {
        let st = rt.qmp(id, "query-migrate", None).await.expect("query");
        match st.get("status").and_then(|s| s.as_str()) {
            Some("completed") => break,
            Some("failed") | Some("cancelled") => panic!("full save failed: {st}"),
            _ => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
    let bytes = sink.await.expect("sink");
    rt.qmp(id, "cont", None).await.expect("cont");
    let pause = t0.elapsed().as_secs_f64() * 1000.0;
    let _ = std::fs::remove_file(path);
    eprintln!("  full save wrote {} MiB", bytes >> 20);
    pause
}

async fn sh(rt: &Runtime, id: &SandboxId, script: &str) -> String {
    let agent = rt.agent(id).await.expect("agent");
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .expect("exec");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mem = arg("--mem", 512) as u32;
    let runs = arg("--runs", 20) as usize;
    let forks = arg("--forks", 20) as usize;
    let full_runs = arg("--full-runs", 5) as usize;
    let space_snaps = arg("--space-snaps", 60) as usize;
    let image = strata_testkit::test_image();
    let pool = TestPool::new(32 << 30).expect("pool");
    let run = tempfile::Builder::new()
        .prefix("strb-")
        .tempdir_in("/tmp")
        .expect("run dir");
    let cfg = RuntimeConfig {
        accel: strata_core::Accel::Tcg,
        ..RuntimeConfig::new(
            PoolSetting::Path(pool.root().to_path_buf()),
            run.path().to_path_buf(),
            image.dir.clone(),
        )
    };
    let size = SandboxSize {
        vcpus: 1,
        memory_mib: mem,
        disk_gib: 2,
    };
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    tokio.block_on(async {
        let rt = Runtime::open(cfg).await.expect("runtime");
        println!("# strata snapshot benchmark: guest {mem} MiB, accel tcg, {}", rt.qemu_version());
        let tpl = TemplateId::generate();
        let built = rt.build_template(&tpl, size, &|_| {}).await.expect("template");
        println!("template cold boot to agent-ready: {:.0} ms", built.boot_ms);
        let a = SandboxId::generate();
        rt.create(&a, &Source::Template(tpl.clone()), None).await.expect("create");
        // Touch guest memory once so RAM is really populated (not just zero pages).
        sh(&rt, &a, "python3 -c 'b=bytearray(64<<20)' ; echo ok").await;

        for (label, writer) in [("idle", false), ("writer 64 MiB/s", true)] {
            if writer {
                sh(&rt, &a, "nohup python3 -c '\nimport time\nb=bytearray(64<<20)\nn=0\nwhile True:\n  t=time.time()\n  for o in range(0, 64<<20, 4096): b[o]=(b[o]+1)&255\n  n+=1\n  time.sleep(max(0, 1-(time.time()-t)))\n' >/dev/null 2>&1 &").await;
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            let mut strata = Vec::new();
            let mut snaps = Vec::new();
            for _ in 0..runs {
                let s = SnapshotId::generate();
                let info = rt.snapshot(&a, &s).await.expect("snapshot");
                strata.push(info.pause_ms);
                snaps.push(s);
                tokio::time::sleep(Duration::from_millis(1000)).await;
            }
            let mut full = Vec::new();
            for _ in 0..full_runs {
                full.push(full_save(&rt, &a, &run.path().join("full.state")).await);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            let s50 = report(&format!("snapshot pause, strata ({label})"), &mut strata);
            let f50 = report(&format!("snapshot pause, full-memory save ({label})"), &mut full);
            println!("  ratio full/strata at p50: {:.1}x", f50 / s50);
            for s in snaps {
                rt.delete_snapshot(&s).await.expect("delete snapshot");
            }
        }
        sh(&rt, &a, "pkill python3; true").await;

        let base = SnapshotId::generate();
        rt.snapshot(&a, &base).await.expect("base snapshot");
        let mut fork_ms = Vec::new();
        for _ in 0..forks {
            let id = SandboxId::generate();
            let t0 = Instant::now();
            rt.create(&id, &Source::Snapshot(base.clone()), None).await.expect("fork");
            sh(&rt, &id, "true").await;
            fork_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
            rt.delete(&id).await.expect("delete");
        }
        report("fork of a snapshot to agent answering", &mut fork_ms);

        let mut wake_ms = Vec::new();
        for _ in 0..forks.min(20) {
            let s = SnapshotId::generate();
            rt.hibernate(&a, &s).await.expect("hibernate");
            let t0 = Instant::now();
            rt.wake(&a, &s).await.expect("wake");
            sh(&rt, &a, "true").await;
            wake_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
        report("wake from hibernation to agent answering", &mut wake_ms);

        // Space: 60 snapshots one second apart of an idle guest.
        let idle = SandboxId::generate();
        rt.create(&idle, &Source::Template(tpl.clone()), None).await.expect("create idle");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let warm = SnapshotId::generate();
        rt.snapshot(&idle, &warm).await.expect("warm-up snapshot");
        let sync = || {
            let _ = std::process::Command::new("sync").status();
        };
        sync();
        let before = rt.pool().usage().expect("usage").used_bytes;
        for _ in 0..space_snaps {
            rt.snapshot(&idle, &SnapshotId::generate()).await.expect("snapshot");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        sync();
        let after = rt.pool().usage().expect("usage").used_bytes;
        let logical = size.memory_bytes() + size.disk_bytes();
        let used = after.saturating_sub(before);
        println!(
            "space of {space_snaps} snapshots 1 s apart (idle guest): {:.1} MiB = {:.2} % of guest RAM + disk ({} MiB)",
            used as f64 / 1048576.0,
            100.0 * used as f64 / logical as f64,
            logical >> 20
        );
        rt.kill_all();
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
}
