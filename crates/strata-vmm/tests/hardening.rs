//! A real VM (TCG, the real image) confined as the daemon runs it: QEMU under its
//! seccomp filter as the unprivileged `strata-vm` user (when that user exists), in its
//! own cgroup with the sandbox size's limits, its sockets in a 0700 run dir. Device
//! state save, disk resize and adoption keep working; the cgroup is gone after kill.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use strata_vmm::cgroup::{self, Limits, VmCgroup};
use strata_vmm::{default_vm_user, lookup_user, QemuDriver, Vm};

/// SIGKILLs a VM we started if the test fails half-way, and removes its cgroup.
struct KillOnDrop(u32, Vec<PathBuf>);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if Path::new(&format!("/proc/{}", self.0)).exists() {
            // SAFETY: kill(2) with the pid of a QEMU this test started; no memory involved.
            unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
        }
        for _ in 0..100 {
            self.1
                .retain(|d| std::fs::remove_dir(d).is_err() && d.exists());
            if self.1.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn status_field(pid: u32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// Bytes charged to the cgroup (v2 `memory.current`, v1 `memory.usage_in_bytes`).
fn memory_charged(cg: &VmCgroup) -> u64 {
    let file = match cg.version {
        2 => cg.dirs[0].join("memory.current"),
        _ => cg.dirs[1].join("memory.usage_in_bytes"),
    };
    std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_runs_unprivileged_in_its_cgroup_with_private_sockets() {
    let h = match cgroup::detect() {
        Ok(h) => Some(h),
        Err(e) => {
            println!("REPORT no cgroup hierarchy here ({e}); limits are checked as not applied");
            None
        }
    };
    let d = scratch("vmm-h");
    let name = format!("vmm-hard-{}", std::process::id());
    let mut spec = image_spec(d.path(), &name);
    spec.run_as = default_vm_user();
    let limits = Limits::for_guest(1, spec.memory_mib);
    spec.limits = Some(limits);
    let netns = strata_vmm::netns::ensure(strata_vmm::netns::DEFAULT_NETNS).unwrap();
    spec.netns = Some(netns.clone());
    // A run dir someone left world-readable is locked down.
    std::fs::create_dir_all(&spec.run_dir).unwrap();
    std::fs::set_permissions(&spec.run_dir, std::fs::Permissions::from_mode(0o755)).unwrap();

    let vm = QemuDriver::new().start_vm(&spec).await.unwrap();
    let pid = vm.pid();
    let _g = KillOnDrop(pid, vm.confinement().cgroup_dirs);
    let agent_c = agent(&vm.agent_socket(), Duration::from_secs(120)).await;
    assert_eq!(sh(&agent_c, "echo hi").await, "hi");

    // --- run dir and sockets: the daemon's user only
    let meta = std::fs::metadata(&spec.run_dir).unwrap();
    // SAFETY: geteuid has no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        meta.mode() & 0o7777,
        0o700,
        "run dir mode {:o}",
        meta.mode()
    );
    assert_eq!(meta.uid(), euid);
    for sock in [
        spec.agent_socket(),
        spec.qmp_socket(),
        spec.console_socket(),
    ] {
        let m = std::fs::metadata(&sock).unwrap();
        assert_eq!(m.mode() & 0o077, 0, "{sock:?} mode {:o}", m.mode());
    }
    let mem_mode = std::fs::metadata(&spec.mem_path).unwrap().mode();
    assert_eq!(mem_mode & 0o077, 0, "guest RAM file mode {mem_mode:o}");
    println!("REPORT run dir mode 0700, sockets and RAM file owner-only");

    // --- network: QEMU is in the empty namespace, not the host's
    let qemu_ns = strata_vmm::netns::netns_of(pid).unwrap();
    assert_eq!(qemu_ns, strata_vmm::netns::netns_inode(&netns).unwrap());
    assert_ne!(
        qemu_ns,
        strata_vmm::netns::netns_of(std::process::id()).unwrap()
    );
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, ["lo"], "QEMU's network namespace has more than lo");
    println!("REPORT QEMU in network namespace {netns:?}: interfaces {ifaces:?}");

    // --- user
    let uid_line = status_field(pid, "Uid");
    match &spec.run_as {
        Some(user) => {
            let ids = lookup_user(user).unwrap();
            let want = format!("{0}\t{0}\t{0}\t{0}", ids.uid);
            assert_eq!(uid_line, want, "QEMU uids");
            assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
            println!(
                "REPORT QEMU runs as {user} (uid {}), no capabilities",
                ids.uid
            );
        }
        None => println!("REPORT user strata-vm missing: QEMU runs as uid {uid_line}"),
    }
    assert_eq!(status_field(pid, "Seccomp"), "2", "seccomp filter mode");

    // --- cgroup
    let conf = vm.confinement();
    assert_eq!(conf.limits, Some(limits));
    let cg = match &h {
        Some(h) => VmCgroup::locate(h, &name),
        None => {
            assert!(!conf.limits_applied && conf.error.is_some(), "{conf:?}");
            vm.kill().await.unwrap();
            return;
        }
    };
    assert!(conf.limits_applied, "{conf:?}");
    assert_eq!(conf.cgroup_dirs, cg.dirs);
    assert!(cg.contains(pid).unwrap(), "pid {pid} not in {:?}", cg.dirs);
    for (file, value) in cg.limit_files(&limits) {
        let got = std::fs::read_to_string(&file).unwrap();
        assert_eq!(got.trim(), value, "{file:?}");
    }
    assert_eq!(
        cg.read_limits().unwrap(),
        (Some(1000), Some((256 + 512) << 20))
    );
    // Every thread is in it, and it was joined before exec: QEMU's memory is charged here.
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let own = std::fs::read_to_string(t.unwrap().path().join("cgroup")).unwrap();
        assert!(own.contains(&format!("/strata/{name}")), "{own}");
    }
    let charged = memory_charged(&cg);
    assert!(
        charged > 32 << 20,
        "only {charged} bytes charged to the VM's cgroup"
    );
    println!(
        "REPORT cgroup v{} {:?}: cpu 1000 millis, memory {} MiB, {} MiB charged",
        cg.version,
        cg.dirs,
        limits.memory_bytes >> 20,
        charged >> 20
    );

    // --- what QEMU does after dropping privileges: resize, save (fd), resume
    vm.block_resize(2 << 30).await.unwrap();
    assert_eq!(std::fs::metadata(&spec.disk_path).unwrap().len(), 2 << 30);
    vm.pause().await.unwrap();
    let state = d.path().join("device.state");
    let stats = vm.save_device_state(&state).await.unwrap();
    assert!(stats.bytes > 0);
    vm.resume().await.unwrap();
    assert_eq!(sh(&agent_c, "echo again").await, "again");
    drop(agent_c);

    // --- a fresh driver adopts it: same cgroup, limits still applied
    drop(vm);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let adopted = QemuDriver::new().adopt_vm(&spec).await.unwrap();
    let conf = adopted.confinement();
    assert!(conf.limits_applied, "{conf:?}");
    assert_eq!(conf.cgroup_dirs, cg.dirs);

    // --- kill: the cgroup goes with the process
    let exit = adopted.kill().await.unwrap();
    assert!(exit.expected, "{exit:?}");
    assert!(!cg.exists(), "cgroup left behind: {:?}", cg.dirs);
    println!("REPORT cgroup removed after kill");
}

#[tokio::test]
async fn restore_under_run_as_and_limits_and_unknown_user() {
    // A restore runs QEMU from `-incoming defer`: the state file comes over QMP as an
    // fd, after the privilege drop.
    let d = scratch("vmm-h2");
    let name = format!("vmm-hard2-{}", std::process::id());
    let mut spec = image_spec(d.path(), &name);
    spec.run_as = Some("no-such-user-strata".into());
    let err = QemuDriver::new().start_vm(&spec).await.unwrap_err();
    assert!(
        matches!(&err, strata_vmm::VmmError::InvalidSpec(m) if m.contains("does not exist")),
        "{err:?}"
    );
    spec.run_as = default_vm_user();
    spec.limits = Some(Limits::for_guest(1, spec.memory_mib));
    let vm = QemuDriver::new().start_vm(&spec).await.unwrap();
    let _g = KillOnDrop(vm.pid(), vm.confinement().cgroup_dirs);
    let a = agent(&vm.agent_socket(), Duration::from_secs(120)).await;
    sh(&a, "echo 41 > /tmp/x").await;
    drop(a);
    vm.pause().await.unwrap();
    let state = d.path().join("device.state");
    vm.save_device_state(&state).await.unwrap();
    vm.kill().await.unwrap();

    let d2 = scratch("vmm-h3");
    let mut rspec = restore_spec(&spec, d2.path(), &state, &format!("{name}-r"));
    rspec.start_paused = false;
    // A state saved without the network namespace and disk throttling
    // restores with both (host-side only, not in the device layout).
    assert!(spec.netns.is_none() && spec.disk_throttle.is_none());
    rspec.netns = Some(strata_vmm::netns::ensure(strata_vmm::netns::DEFAULT_NETNS).unwrap());
    rspec.disk_throttle = strata_vmm::DiskThrottle::new(200, 10 << 20);
    let r = QemuDriver::new().start_vm(&rspec).await.unwrap();
    let _gr = KillOnDrop(r.pid(), r.confinement().cgroup_dirs);
    let a = agent(&r.agent_socket(), Duration::from_secs(30)).await;
    assert_eq!(sh(&a, "cat /tmp/x").await, "41");
    assert_eq!(
        strata_vmm::netns::netns_of(r.pid()).unwrap(),
        strata_vmm::netns::netns_inode(rspec.netns.as_ref().unwrap()).unwrap()
    );
    let blocks = r.qmp_client().execute("query-block", None).await.unwrap();
    let disk = blocks
        .as_array()
        .and_then(|bs| bs.iter().find(|b| b["device"] == "disk0"))
        .unwrap_or_else(|| panic!("no disk0 in {blocks}"));
    assert_eq!(disk["inserted"]["iops"], 200, "{disk}");
    assert_eq!(disk["inserted"]["bps"], 10 << 20, "{disk}");
    // The guest still writes its disk under the limits.
    assert_eq!(
        sh(&a, "dd if=/dev/zero of=/var/tmp/t bs=64k count=16 conv=fsync 2>/dev/null; wc -c < /var/tmp/t").await,
        "1048576"
    );
    println!(
        "REPORT restore of an unconfined state into netns + throttle (iops 200, bps 10 MiB/s): ok"
    );
    let conf = r.confinement();
    if cgroup::detect().is_ok() {
        assert!(conf.limits_applied, "{conf:?}");
    }
    let dirs = conf.cgroup_dirs.clone();
    r.kill().await.unwrap();
    assert!(dirs.iter().all(|d| !d.exists()), "{dirs:?}");
}
