//! Benchmark of issue 2's figures on a real guest (TCG): exec round trip of
//! `true` (argv, no shell) over N runs, file upload/download throughput of a
//! 100 MiB file, and QEMU's resident memory beyond guest RAM.
//!
//! ```text
//! cargo run --release -p strata-runtime --example guest_bench -- [--runs 200] [--file-mib 100]
//! ```

use std::time::Instant;

use sha2::{Digest, Sha256};
use strata_core::{SandboxId, SandboxSize, TemplateId};
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
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[idx.min(v.len() - 1)]
}

fn main() {
    let runs = arg("--runs", 200) as usize;
    let file_mib = arg("--file-mib", 100) as usize;
    let image = strata_testkit::test_image();
    let pool = TestPool::new(16 << 30).expect("pool");
    let run = tempfile::Builder::new()
        .prefix("strg-")
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
        memory_mib: 512,
        disk_gib: 2,
    };
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio");
    tokio.block_on(async {
        let rt = Runtime::open(cfg).await.expect("runtime");
        let tpl = TemplateId::generate();
        let built = rt
            .build_template(&tpl, size, &|_| {})
            .await
            .expect("template");
        println!(
            "# guest benchmark: 512 MiB, 1 vCPU, TCG; {}",
            rt.qemu_version()
        );
        println!(
            "cold boot to agent-ready (template build): {:.0} ms",
            built.boot_ms
        );
        let id = SandboxId::generate();
        rt.create(&id, &Source::Template(tpl), None)
            .await
            .expect("create");
        let agent = rt.agent(&id).await.expect("agent");
        // Warm up.
        for _ in 0..5 {
            agent
                .exec_collect(ExecRequest::argv(["true"]))
                .await
                .expect("exec");
        }
        let mut lat = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            let out = agent
                .exec_collect(ExecRequest::argv(["true"]))
                .await
                .expect("exec");
            assert!(out.status.success());
            lat.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        println!(
            "exec round trip of `true` (n={runs}): p50={:.2} p95={:.2} p99={:.2} max={:.2} ms",
            pct(&mut lat, 50.0),
            pct(&mut lat, 95.0),
            pct(&mut lat, 99.0),
            pct(&mut lat, 100.0)
        );
        let mut ping = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            agent.ping().await.expect("ping");
            ping.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        println!(
            "agent ping round trip (n={runs}): p50={:.2} p95={:.2} p99={:.2} ms",
            pct(&mut ping, 50.0),
            pct(&mut ping, 95.0),
            pct(&mut ping, 99.0)
        );
        let data: Vec<u8> = (0..file_mib * 1024 * 1024)
            .map(|i| ((i * 2654435761usize) >> 13) as u8)
            .collect();
        let want = hex::encode(Sha256::digest(&data));
        let t = Instant::now();
        agent
            .write_file("/root/big.bin", None, &data[..])
            .await
            .expect("upload");
        let up = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut dl = agent.read_file("/root/big.bin").await.expect("download");
        let mut h = Sha256::new();
        let mut n = 0usize;
        while let Some(chunk) = dl.next_chunk().await {
            let c = chunk.expect("chunk");
            n += c.len();
            h.update(&c);
        }
        let down = t.elapsed().as_secs_f64();
        assert_eq!(n, data.len());
        assert_eq!(hex::encode(h.finalize()), want, "round trip checksum");
        println!(
            "file {file_mib} MiB: upload {:.1} MiB/s, download {:.1} MiB/s (sha256 verified)",
            file_mib as f64 / up,
            file_mib as f64 / down
        );
        let overhead = rt.vm_overhead_bytes(&id).expect("rss");
        println!(
            "QEMU RSS beyond guest RAM: {:.1} MiB",
            overhead as f64 / 1048576.0
        );
        rt.delete(&id).await.expect("delete");
        rt.kill_all();
    });
}
