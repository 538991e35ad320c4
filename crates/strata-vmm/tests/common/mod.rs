//! Shared helpers of the strata-vmm integration tests (real QEMU, TCG, the real image).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use strata_proto::{AgentClient, ExecRequest};
use strata_vmm::{ResolvedAccel, VmSpec};

/// A spec for the test image with its own copy of the root disk in `dir`.
pub fn image_spec(dir: &Path, name: &str) -> VmSpec {
    let img = strata_testkit::test_image();
    let disk = dir.join("disk.img");
    if !disk.exists() {
        copy(&img.rootfs, &disk);
    }
    let kernel = img.kernel_pvh.clone().unwrap_or_else(|| img.kernel.clone());
    let mut spec = VmSpec::new(name, dir.join("run"), kernel, dir.join("mem"), disk);
    spec.initrd = Some(img.initrd.clone());
    spec.cmdline = img.cmdline.clone();
    spec.memory_mib = 256;
    spec.vcpus = 1;
    spec.accel = ResolvedAccel::Tcg;
    spec
}

/// `cp --reflink=auto --sparse=always` (what the storage layer does on btrfs).
pub fn copy(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success(), "cp {from:?} {to:?}: {st}");
}

/// A restored-VM spec: copies of `src`'s mem and disk in `dir`, restoring from `state`.
pub fn restore_spec(src: &VmSpec, dir: &Path, state: &Path, name: &str) -> VmSpec {
    copy(&src.mem_path, &dir.join("mem"));
    copy(&src.disk_path, &dir.join("disk.img"));
    let mut spec = src.clone();
    spec.name = name.into();
    spec.run_dir = dir.join("run");
    spec.mem_path = dir.join("mem");
    spec.disk_path = dir.join("disk.img");
    spec.incoming = Some(state.to_path_buf());
    spec
}

pub async fn agent(sock: &Path, timeout: Duration) -> AgentClient {
    let c = AgentClient::connect_unix(sock, timeout).await.unwrap();
    c.ping().await.unwrap();
    c
}

pub async fn sh(agent: &AgentClient, script: &str) -> String {
    let out = agent
        .exec_collect(ExecRequest::shell(script))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Starts the counter of the brief in the background of the guest.
pub async fn start_counter(agent: &AgentClient) {
    sh(
        agent,
        "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done' \
         </dev/null >/dev/null 2>&1 &",
    )
    .await;
}

pub async fn count(agent: &AgentClient) -> u64 {
    let s = sh(agent, "cat /tmp/count").await;
    s.parse().unwrap_or_else(|_| panic!("count {s:?}"))
}

pub async fn wait_count_at_least(agent: &AgentClient, n: u64) -> u64 {
    let t0 = Instant::now();
    loop {
        if let Ok(out) = agent
            .exec_collect(ExecRequest::shell("cat /tmp/count"))
            .await
        {
            if let Ok(c) = String::from_utf8_lossy(&out.stdout).trim().parse::<u64>() {
                if c >= n {
                    return c;
                }
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "counter never reached {n}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// utime + stime of `pid`, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

pub fn scratch(prefix: &str) -> tempfile::TempDir {
    strata_testkit::scratch_dir(prefix)
}

pub fn path_of(d: &tempfile::TempDir) -> PathBuf {
    d.path().to_path_buf()
}
