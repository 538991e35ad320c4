//! Real VMs under TCG with the real guest image: boot to agent-ready, pause, device-state
//! save, restore with a running process, adoption by another process, exit detection,
//! console cap, disk resize. One cold boot per test binary; the other VMs are restores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use strata_vmm::{QemuDriver, SaveMethod, Vm, VmSpec};

const HELPER_ENV: &str = "STRATA_VMM_TEST_HELPER_SPEC";

/// SIGKILLs a VM we started if the test fails half-way.
struct KillOnDrop(u32);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if Path::new(&format!("/proc/{}", self.0)).exists() {
            // SAFETY: kill(2) with a pid of a QEMU this test started; no memory involved.
            unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
        }
    }
}

fn kill9(pid: u32) {
    // SAFETY: see KillOnDrop.
    let r = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(r, 0, "kill -9 {pid}");
}

/// The direct save (no migration) of `b`, a restored VM running the
/// counter: its first save is a migration, the next one direct. A direct
/// file holds the same bytes as a migration's of the same stopped guest,
/// without the RAM module's sections; a VM restored from it is paused until
/// `cont` and its counter goes on.
async fn direct_save_matches_migrate_and_restores(
    driver: &QemuDriver,
    b: &strata_vmm::QemuVm,
    agent_b: &strata_proto::AgentClient,
    spec_b: &VmSpec,
) {
    use strata_vmm::qemu::stream;
    let dir = scratch("vmm-direct");
    b.pause().await.unwrap();
    let first = b
        .save_device_state(&dir.path().join("first.state"))
        .await
        .unwrap();
    assert_eq!(first.method, SaveMethod::Fd, "a VM's first save migrates");
    assert_eq!(b.status().await.unwrap().status, "postmigrate");
    b.resume().await.unwrap();
    let c_save = count(agent_b).await;
    b.pause().await.unwrap();
    let direct_path = dir.path().join("direct.state");
    let direct = b.save_device_state(&direct_path).await.unwrap();
    assert_eq!(direct.method, SaveMethod::Direct, "{direct:?}");
    assert_eq!(b.status().await.unwrap().status, "paused");
    // The same save into memory (a memfd; what a snapshot's pause uses, so
    // that no pool file is written while the guest is stopped).
    let (in_memory, mem_stats) = b
        .save_device_state_in_memory()
        .await
        .unwrap()
        .expect("a VM that saves directly saves into memory");
    assert_eq!(mem_stats.method, SaveMethod::Direct);
    assert_eq!(in_memory.len() as u64, mem_stats.bytes);
    assert_eq!(b.status().await.unwrap().status, "paused");
    let memory_path = dir.path().join("memory.state");
    std::fs::write(&memory_path, &in_memory).unwrap();
    let migrated_path = dir.path().join("migrated.state");
    let migrated = b
        .save_device_state_with(&migrated_path, SaveMethod::Fd)
        .await
        .unwrap();
    println!(
        "REPORT direct save {:?} ({} KiB, steps {:?}) vs migrate {:?} ({} KiB, steps {:?})",
        direct.elapsed,
        direct.bytes / 1024,
        direct.steps,
        migrated.elapsed,
        migrated.bytes / 1024,
        migrated.steps
    );

    // Byte for byte: header and configuration, then every device section
    // and EOF as the migration wrote them after its RAM sections
    // (`globalstate` included: the driver makes it say `paused`), then an
    // empty description.
    let d = std::fs::read(&direct_path).unwrap();
    let m = std::fs::read(&migrated_path).unwrap();
    assert_eq!(d.len() as u64, direct.bytes);
    assert!(
        d == in_memory,
        "the save into memory is the direct file, byte for byte ({} vs {} bytes)",
        in_memory.len(),
        d.len()
    );
    println!(
        "REPORT direct save into memory {:?} ({} KiB, steps {:?})",
        mem_stats.elapsed,
        mem_stats.bytes / 1024,
        mem_stats.steps
    );
    let head = stream::HEADER.len() + stream::configuration(&m).unwrap().len();
    assert_eq!(d[..head], m[..head], "header and configuration");
    assert!(d.ends_with(&stream::VMDESC));
    let devices = &d[head..d.len() - stream::VMDESC.len()];
    let at = m
        .windows(64)
        .enumerate()
        .filter(|(_, w)| *w == &devices[..64])
        .map(|(i, _)| i)
        .find(|&i| m.get(i..i + devices.len()) == Some(devices))
        .expect("the direct file's device sections are in the migration's stream");
    assert_eq!(
        m[at + devices.len()],
        0x06,
        "the device sections end where the migration's description starts"
    );
    assert!(
        m.len() - devices.len() > 16 * 1024,
        "the migration has RAM sections the direct file does not"
    );

    // Restored from the state saved in memory (RAM and disk as of now):
    // paused until `cont`.
    let de = scratch("vmm-e");
    let mut spec_e = restore_spec(spec_b, de.path(), &memory_path, "vmm-e");
    spec_e.start_paused = true;
    b.resume().await.unwrap();
    // The direct saves' fd sets are gone once B runs again.
    let sets = b.qmp("query-fdsets", None).await.unwrap();
    assert_eq!(sets, serde_json::json!([]), "fd sets left: {sets}");

    let e = driver.start_vm(&spec_e).await.unwrap();
    let _ge = KillOnDrop(e.pid());
    assert_eq!(e.status().await.unwrap().status, "paused");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(e.status().await.unwrap().status, "paused");
    e.resume().await.unwrap();
    let agent_e = agent(&e.agent_socket(), Duration::from_secs(30)).await;
    let c_e = count(&agent_e).await;
    assert!(
        c_e >= c_save && c_e <= c_save + 10,
        "restored counter {c_e}, direct save at {c_save}"
    );
    wait_count_at_least(&agent_e, c_e + 2).await;
    println!("REPORT restored from a direct save into memory: counter {c_save} -> {c_e}, runs on");
    drop(agent_e);
    e.kill().await.unwrap();
}

/// Not a test on its own: run by `lifecycle` in a child process to start a VM and exit,
/// so the VM outlives the process that started it. Does nothing without the env var.
#[tokio::test]
async fn helper_start_vm_then_exit() {
    let Some(path) = std::env::var_os(HELPER_ENV) else {
        return;
    };
    let spec: VmSpec = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let vm = QemuDriver::new().start_vm(&spec).await.unwrap();
    println!("helper started pid {}", vm.pid());
}

fn start_in_child_process(spec: &VmSpec, dir: &Path) {
    let spec_file = dir.join("spec.json");
    std::fs::write(&spec_file, serde_json::to_vec(spec).unwrap()).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["helper_start_vm_then_exit", "--exact", "--nocapture"])
        .env(HELPER_ENV, &spec_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helper failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle() {
    if std::env::var_os(HELPER_ENV).is_some() {
        return;
    }
    let driver = QemuDriver::new();
    let da = scratch("vmm-a");
    let mut spec_a = image_spec(da.path(), "vmm-a");
    spec_a.console_log_max_bytes = 64 * 1024;
    // Confined as the daemon runs VMs: unprivileged user (when it exists), cgroup limits.
    spec_a.run_as = strata_vmm::default_vm_user();
    spec_a.limits = Some(strata_vmm::Limits::for_guest(1, spec_a.memory_mib));

    // --- cold boot to agent-ready
    let t0 = Instant::now();
    let a = driver.start_vm(&spec_a).await.unwrap();
    let _ga = KillOnDrop(a.pid());
    let agent_a = agent(&a.agent_socket(), Duration::from_secs(120)).await;
    let boot = t0.elapsed();
    println!("REPORT boot to agent-ready (TCG): {boot:?}");
    assert!(std::fs::read_to_string(spec_a.pid_file())
        .unwrap()
        .contains(&a.pid().to_string()));

    let rss = a.rss_bytes().unwrap();
    println!(
        "REPORT rss total {} MiB, guest RAM resident {} MiB, beyond guest RAM {} MiB (anon {} MiB, file {} MiB, shmem {} MiB)",
        rss.total >> 20,
        rss.guest_ram >> 20,
        rss.beyond_guest_ram() >> 20,
        rss.anon >> 20,
        rss.file >> 20,
        rss.shmem >> 20
    );
    assert!(rss.guest_ram > 0 && rss.beyond_guest_ram() < rss.total);

    start_counter(&agent_a).await;
    wait_count_at_least(&agent_a, 3).await;

    // --- pause: no guest progress, no CPU
    let before = count(&agent_a).await;
    a.pause().await.unwrap();
    let st = a.status().await.unwrap();
    assert_eq!((st.status.as_str(), st.running), ("paused", false));
    let ticks0 = cpu_ticks(a.pid());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ticks = cpu_ticks(a.pid()) - ticks0;
    assert!(ticks <= 10, "paused QEMU used {ticks} ticks in 1 s");
    a.resume().await.unwrap();
    let after = count(&agent_a).await;
    assert!(
        after - before <= 3,
        "counter moved {before} -> {after} across a 1 s pause"
    );
    println!("REPORT paused QEMU CPU over 1 s: {ticks} ticks; counter {before} -> {after}");

    // --- disk resize
    a.block_resize(3 << 30).await.unwrap();
    assert_eq!(std::fs::metadata(&spec_a.disk_path).unwrap().len(), 3 << 30);
    let t = Instant::now();
    loop {
        let sectors = sh(&agent_a, "cat /sys/block/vda/size").await;
        if sectors == ((3u64 << 30) / 512).to_string() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "guest sees {sectors} sectors"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // --- save device state (RAM stays in the shared file)
    wait_count_at_least(&agent_a, 8).await;
    let c_snap = count(&agent_a).await;
    a.pause().await.unwrap();
    let state = da.path().join("device.state");
    let stats = a.save_device_state(&state).await.unwrap();
    println!(
        "REPORT device-state save (fd): {:?}, {} KiB",
        stats.elapsed,
        stats.bytes / 1024
    );
    assert!(stats.bytes > 0 && stats.bytes < 4 << 20);
    assert_eq!(a.status().await.unwrap().status, "postmigrate");
    // Copies of RAM and disk as of the snapshot, taken while A is still stopped.
    let db = scratch("vmm-b");
    let spec_b = restore_spec(&spec_a, db.path(), &state, "vmm-b");
    let dc = scratch("vmm-c");
    let spec_c = restore_spec(&spec_a, dc.path(), &state, "vmm-c");
    let dd = scratch("vmm-d");
    let mut spec_d = restore_spec(&spec_a, dd.path(), &state, "vmm-d");

    // The source resumes from postmigrate and keeps going.
    a.resume().await.unwrap();
    assert!(a.status().await.unwrap().running);
    let c_a = wait_count_at_least(&agent_a, c_snap + 2).await;
    assert!(c_a >= c_snap + 2);

    // --- restore B in this process; the counter continues from the snapshot
    let t0 = Instant::now();
    let b = driver.start_vm(&spec_b).await.unwrap();
    let _gb = KillOnDrop(b.pid());
    let restored_running = t0.elapsed();
    let agent_b = agent(&b.agent_socket(), Duration::from_secs(30)).await;
    let restored_ready = t0.elapsed();
    println!(
        "REPORT restore: running after {restored_running:?}, agent-ready after {restored_ready:?}"
    );
    let c_b = count(&agent_b).await;
    assert!(
        c_b >= c_snap && c_b <= c_snap + 10,
        "restored counter {c_b}, snapshot had {c_snap}"
    );
    let c_b2 = wait_count_at_least(&agent_b, c_b + 2).await;
    assert!(c_b2 > c_b);

    direct_save_matches_migrate_and_restores(&driver, &b, &agent_b, &spec_b).await;

    // --- console cap: the guest prints ~400 KiB, the log stays <= 64 KiB and keeps the end
    sh(
        &agent_a,
        "i=0; while [ $i -lt 5000 ]; do i=$((i+1)); \
         echo \"console flood line $i .............................................................\"; \
         done > /dev/console; echo flood-done > /dev/console",
    )
    .await;
    let t = Instant::now();
    while !a.console_tail(4096).contains("flood-done") {
        assert!(t.elapsed() < Duration::from_secs(30), "console copier lags");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let size = std::fs::metadata(spec_a.console_log()).unwrap().len();
    println!("REPORT console.log after 400 KiB of output: {size} bytes (cap 65536)");
    assert!(size <= 64 * 1024, "console.log is {size} bytes");
    assert!(a.console_tail(4096).contains("console flood line 5000"));

    // --- fd vs exec device-state save, on B (needs QEMU without seccomp for exec)
    drop(agent_b);
    b.pause().await.unwrap();
    let via_fd = b
        .save_device_state_with(&db.path().join("s1"), SaveMethod::Fd)
        .await
        .unwrap();
    // A second migration needs a resume in between (QEMU refuses to migrate
    // from postmigrate).
    let again = b
        .save_device_state_with(&db.path().join("s1b"), SaveMethod::Fd)
        .await;
    assert!(again.is_err(), "{again:?}");
    b.resume().await.unwrap();
    b.pause().await.unwrap();
    // The save's end seen by polling alone (the benchmark's "before"): the
    // same bytes as through the MIGRATION event (process-wide switch; any
    // save of another test meanwhile just polls).
    strata_vmm::qemu::set_completion_events(false);
    let polled = b
        .save_device_state_with(&db.path().join("s1-polled"), SaveMethod::Fd)
        .await;
    strata_vmm::qemu::set_completion_events(true);
    let polled = polled.unwrap();
    assert!(
        polled.bytes > 0 && polled.bytes.abs_diff(via_fd.bytes) < via_fd.bytes / 4,
        "polled save {polled:?} vs evented {via_fd:?}"
    );
    b.resume().await.unwrap();
    b.pause().await.unwrap();
    // Saves set the migration capabilities once per VM; a raw QMP command
    // (here: the snapshot bench's full save turning `x-ignore-shared` off)
    // makes the next save set them again, so it still leaves RAM out.
    b.qmp(
        "migrate-set-capabilities",
        Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": false}]})),
    )
    .await
    .unwrap();
    let after_raw = b
        .save_device_state_with(&db.path().join("s1-raw"), SaveMethod::Fd)
        .await
        .unwrap();
    assert!(
        after_raw.bytes.abs_diff(via_fd.bytes) < via_fd.bytes / 4,
        "a save after a raw capability change wrote RAM: {after_raw:?} vs {via_fd:?}"
    );
    b.resume().await.unwrap();
    b.pause().await.unwrap();
    let err = b
        .save_device_state_with(&db.path().join("s2"), SaveMethod::Exec)
        .await;
    println!(
        "REPORT save via fd: {:?}; via exec under seccomp: {err:?}",
        via_fd.elapsed
    );
    assert!(
        b.status().await.is_ok(),
        "refused exec save must leave the VM alive"
    );
    assert!(
        matches!(err, Err(strata_vmm::VmmError::Migration { .. })),
        "exec: migration must be refused under -sandbox spawn=deny"
    );

    // --- graceful shutdown (the guest ignores ACPI, so quit does it)
    let exit = b.shutdown(Duration::from_secs(4)).await.unwrap();
    println!("REPORT shutdown: {}", exit.reason);
    assert!(exit.expected, "{exit:?}");

    // --- C is started by another process that then exits; a fresh driver adopts it
    start_in_child_process(&spec_c, dc.path());
    let pid_c: u32 = std::fs::read_to_string(spec_c.pid_file())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _gc = KillOnDrop(pid_c);
    let c = QemuDriver::new().adopt_vm(&spec_c).await.unwrap();
    assert_eq!(c.pid(), pid_c);
    assert!(c.status().await.unwrap().running);
    let agent_c = agent(&c.agent_socket(), Duration::from_secs(30)).await;
    let c_c = count(&agent_c).await;
    assert!(c_c >= c_snap, "adopted VM's counter {c_c} < {c_snap}");
    // Adopting a run dir whose pid is not that QEMU is refused.
    let mut wrong = spec_c.clone();
    wrong.run_dir = PathBuf::from("/tmp/vmm-nope");
    assert!(QemuDriver::new().adopt_vm(&wrong).await.is_err());
    // kill -9 behind the driver's back: the adopted handle reports it.
    kill9(pid_c);
    let exit = tokio::time::timeout(Duration::from_secs(10), c.wait_exit())
        .await
        .expect("adopted VM exit not detected");
    println!("REPORT adopted VM killed: {}", exit.reason);
    assert!(
        !exit.expected && exit.reason.contains("disappeared"),
        "{exit:?}"
    );

    // --- guest kernel panic is reported as such
    spec_d.seccomp = false;
    // exec: migration runs `cat > file` as QEMU's user, in a directory only root can enter.
    spec_d.run_as = None;
    let d = driver.start_vm(&spec_d).await.unwrap();
    let _gd = KillOnDrop(d.pid());
    let agent_d = agent(&d.agent_socket(), Duration::from_secs(30)).await;
    d.pause().await.unwrap();
    let via_exec = d
        .save_device_state_with(&dd.path().join("s-exec"), SaveMethod::Exec)
        .await
        .unwrap();
    d.resume().await.unwrap();
    d.pause().await.unwrap();
    let via_fd = d
        .save_device_state_with(&dd.path().join("s-fd"), SaveMethod::Fd)
        .await
        .unwrap();
    d.resume().await.unwrap();
    println!(
        "REPORT save via exec: {:?}, via fd: {:?} ({} KiB)",
        via_exec.elapsed,
        via_fd.elapsed,
        via_fd.bytes / 1024
    );
    let _ = agent_d
        .exec_collect(strata_proto::ExecRequest::shell(
            "echo c > /proc/sysrq-trigger",
        ))
        .await;
    let exit = tokio::time::timeout(Duration::from_secs(30), d.wait_exit())
        .await
        .expect("panicked VM did not exit");
    println!("REPORT guest panic: {}", exit.reason);
    assert!(!exit.expected && exit.reason.contains("panic"), "{exit:?}");

    // --- kill -9 of our own child behind the driver's back
    kill9(a.pid());
    let exit = tokio::time::timeout(Duration::from_secs(10), a.wait_exit())
        .await
        .expect("exit not detected");
    println!("REPORT child VM killed: {}", exit.reason);
    assert_eq!(exit.signal, Some(9));
    assert!(
        !exit.expected && exit.reason.contains("SIGKILL"),
        "{exit:?}"
    );
    assert!(matches!(
        a.pause().await,
        Err(strata_vmm::VmmError::ProcessDied { .. })
    ));
}

/// A state made under an older device layout (2: modern virtio-mmio)
/// restores with that layout's devices after layout 3 made virtio-mmio
/// legacy: the week of history a host holds when it upgrades keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_of_device_layout_2_restores_as_it_was_made() {
    if std::env::var_os(HELPER_ENV).is_some() {
        return;
    }
    const { assert!(strata_vmm::cmdline::MACHINE_LAYOUT_VERSION > 2) };
    let driver = QemuDriver::new();
    let dir = scratch("vmm-layout2");
    let mut spec = image_spec(dir.path(), "vmm-layout2");
    spec.layout = 2;
    assert!(strata_vmm::cmdline::qemu_args(&spec, None)
        .contains(&"virtio-mmio.force-legacy=false".to_string()));
    let a = driver.start_vm(&spec).await.unwrap();
    let _ga = KillOnDrop(a.pid());
    let agent_a = agent(&a.agent_socket(), Duration::from_secs(120)).await;
    start_counter(&agent_a).await;
    wait_count_at_least(&agent_a, 2).await;
    let c_save = count(&agent_a).await;
    a.pause().await.unwrap();
    let state = dir.path().join("layout2.state");
    let saved = a.save_device_state(&state).await.unwrap();
    drop(agent_a);
    a.kill().await.unwrap();

    let dr = scratch("vmm-layout2-r");
    let spec_r = restore_spec(&spec, dr.path(), &state, "vmm-layout2-r");
    assert_eq!(spec_r.layout, 2);
    let r = driver.start_vm(&spec_r).await.unwrap();
    let _gr = KillOnDrop(r.pid());
    r.resume().await.ok();
    let agent_r = agent(&r.agent_socket(), Duration::from_secs(30)).await;
    let c_r = count(&agent_r).await;
    assert!(
        c_r >= c_save && c_r <= c_save + 10,
        "restored counter {c_r}, saved at {c_save}"
    );
    wait_count_at_least(&agent_r, c_r + 2).await;
    println!(
        "REPORT layout 2 state ({} KiB) restored with layout 2: counter {c_save} -> {c_r}, runs on",
        saved.bytes / 1024
    );
    drop(agent_r);
    r.kill().await.unwrap();
}
