//! The QEMU command line, built by one function so that a VM and every VM restored
//! from its device state get the same devices, in the same order, with the same ids.

use crate::spec::{netdev_arg, path_str, qemu_escape, RamBacking, ResolvedAccel, VmSpec};

/// The qdev id of the guest agent's virtio-serial port (what QMP
/// `VSERPORT_CHANGE` names). Part of the machine layout: never change it.
pub const AGENT_PORT_ID: &str = "agentport";

/// Version of the device layout below, the one new VMs get. Bump it whenever a
/// device, its order, its id or the vCPU model changes: device state saved under
/// one layout cannot be loaded into another, so [`qemu_args`] keeps building every
/// older layout for the restores of states made under it ([`VmSpec::layout`]).
///
/// - 1: the first layout.
/// - 2: under TCG, `-cpu qemu64,+arat` ([`TCG_CPU`]): an idle guest's tick stops.
/// - 3: legacy virtio-mmio (`virtio-mmio.force-legacy=true`, the register
///   layout of virtio 0.9.5, which the guest's `virtio_mmio` driver speaks as
///   well). A modern virtio-mmio device carries, in its device state, the
///   transport's and the virtio core's per-queue arrays for all 1,024
///   possible queues (`virtio_mmio/state`, `virtio/virtqueues`), used or
///   not: three devices, ~147 KiB, most of the ~3–4 ms QEMU takes to save a
///   stopped guest's devices inside each snapshot's pause. A legacy device has
///   neither ([`LEGACY_VIRTIO_FROM`]).
pub const MACHINE_LAYOUT_VERSION: u32 = 3;

/// The first layout whose virtio-mmio devices are legacy (see
/// [`MACHINE_LAYOUT_VERSION`]); states made under earlier ones restore with
/// modern devices, as they were made.
pub const LEGACY_VIRTIO_FROM: u32 = 3;

/// The oldest layout this build still restores.
pub const OLDEST_LAYOUT_VERSION: u32 = 1;

/// vCPU model under TCG from layout 2 on: QEMU's default `qemu64` plus ARAT
/// (always-running APIC timer, CPUID.06H:EAX bit 2). Without ARAT the guest
/// kernel flags the local APIC timer `C3STOP` (it might stop in deep C-states),
/// and on `microvm` (ACPI hardware-reduced: no PIT or HPET clock event to fall
/// back on) it then cannot use it in one-shot mode: the tick stays periodic at
/// `CONFIG_HZ` (250/s) and every tick is a TCG timer interrupt. TCG's APIC timer
/// never stops, so ARAT is the truth; with it the guest goes tickless when idle
/// (NOHZ, high-resolution timers). Measured: idle CPU 2.5 % → 0.8 % of a core per
/// guest (docs/bench/idle-cost.md). Guests on layout 1 keep the periodic tick.
pub const TCG_CPU: &str = "qemu64,+arat";

/// Machine type and options.
pub const MACHINE: &str = "microvm,x-option-roms=off,rtc=on,isa-serial=on,memory-backend=ram";

/// Default size of TCG's translation block cache per VM, in MiB
/// ([`VmSpec::tcg_tb_size_mib`]).
///
/// Under TCG every new guest process is translated afresh (a translated block
/// is keyed by its virtual address too, and ASLR moves a process's code), so a
/// guest running short commands fills the cache and QEMU flushes all of it,
/// kernel included: with 64 MiB one `python3 -c` in twenty ran 2–3× slower
/// (back-to-back p50 360 ms, p99 1.01 s; with 512 MiB p50 334 ms, p99 434 ms,
/// docs/bench/packing.md). The cache is resident only as far as it is
/// written: an idle guest keeps the few MiB its boot used, a busy one grows
/// to the size.
pub const TCG_TB_SIZE_MIB: u32 = 512;

/// The `-accel` value device layouts are hashed with under TCG, whatever
/// the TB cache size: it is host-side only (not in the migration stream),
/// and layouts were first hashed with 64 MiB, so the size may change
/// without making a snapshot look incompatible.
const LAYOUT_TCG_ACCEL: &str = "tcg,tb-size=64";

/// Fixed MAC of the guest NIC (user networking; identity is reset by the agent on fork).
pub const GUEST_MAC: &str = "52:54:00:12:34:56";

/// The kernel command line actually passed: under TCG, `tsc_early_khz=<host khz>` and
/// `tsc=reliable` are appended (unless already there) because on a loaded host the
/// guest's PIT calibration of the TSC fails and the kernel hangs without a clocksource.
/// Under TCG the guest TSC runs at the host TSC rate, so the host value is right.
pub fn effective_cmdline(spec: &VmSpec, host_tsc_khz: Option<u64>) -> String {
    let mut c = spec.cmdline.trim().to_owned();
    if spec.accel == ResolvedAccel::Tcg {
        if let Some(khz) = host_tsc_khz {
            if !c.contains("tsc_early_khz=") {
                c.push_str(&format!(" tsc_early_khz={khz}"));
            }
        }
        if !c.contains("tsc=") {
            c.push_str(" tsc=reliable");
        }
    }
    c
}

/// QEMU's seccomp filter. With `run_as`, set*id calls stay allowed: QEMU installs the
/// filter before it drops to the user (`setgid`, `initgroups`, `setuid` of `-runas`),
/// and `elevateprivileges=deny` would kill it there with SIGSYS. After the drop the
/// process has no capabilities, so those calls can no longer raise its privileges.
pub fn sandbox_arg(spec: &VmSpec) -> &'static str {
    if spec.run_as.is_some() {
        "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
    } else {
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    }
}

/// All arguments after the binary name. Cold boot starts with `-S` (vCPUs stopped
/// until the driver has attached the console); restore uses `-incoming defer`.
pub fn qemu_args(spec: &VmSpec, host_tsc_khz: Option<u64>) -> Vec<String> {
    let mut a: Vec<String> = Vec::with_capacity(64);
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    let mem = format!("{}M", spec.memory_mib);
    let name = format!("guest={},debug-threads=on", qemu_escape(&spec.name));
    let machine = MACHINE;
    // TCG's translation cache defaults to 1 GiB per VM on 64-bit hosts; it is
    // resident memory on top of guest RAM. 64 MiB keeps an idle guest fast and
    // the per-VM overhead small (density).
    let accel = match spec.accel {
        ResolvedAccel::Tcg => format!("tcg,tb-size={}", spec.tcg_tb_size_mib.max(1)),
        ResolvedAccel::Kvm => spec.accel.qemu_name().to_owned(),
    };
    let smp = spec.vcpus.to_string();
    let ram = match spec.ram {
        RamBacking::File => format!(
            "memory-backend-file,id=ram,size={mem},mem-path={},share=on,prealloc=off",
            path_str(&spec.mem_path)
        ),
        RamBacking::Anonymous => format!("memory-backend-ram,id=ram,size={mem}"),
    };
    // auto-read-only=off: QEMU keeps the read-write fd it opened at start-up. With the
    // default (on) it reopens the file read-only when a migration inactivates the disk
    // and read-write again on `cont`, which fails once it runs as `run_as`.
    // Throttling is host-side (not in the migration stream, not in the
    // device layout): a snapshot made without it restores with it and back.
    // cache.no-flush: a guest's flush is answered without an fdatasync
    // (`VmSpec::guest_disk_flush`); host-side, not in the layout either.
    let drive = format!(
        "id=disk0,file={},format={},if=none,cache=writeback,{}discard=unmap,aio=threads,auto-read-only=off{}",
        path_str(&spec.disk_path),
        spec.disk_format.qemu_name(),
        if spec.guest_disk_flush {
            ""
        } else {
            "cache.no-flush=on,"
        },
        spec.disk_throttle
            .map(|t| t.drive_options())
            .unwrap_or_default()
    );
    let agent = format!(
        "socket,id=ag,path={},server=on,wait=off",
        path_str(&spec.agent_socket())
    );
    let console = format!(
        "socket,id=con,path={},server=on,wait=off",
        path_str(&spec.console_socket())
    );
    let qmp = format!(
        "socket,id=qmp,path={},server=on,wait=off",
        path_str(&spec.qmp_socket())
    );
    let netdev = netdev_arg(&spec.net);
    let nic = format!("virtio-net-device,netdev=net0,mac={GUEST_MAC}");
    let cmdline = effective_cmdline(spec, host_tsc_khz);

    push(&["-name", &name]);
    push(&["-M", machine, "-accel", &accel]);
    match spec.accel {
        ResolvedAccel::Kvm => push(&["-cpu", "host"]),
        ResolvedAccel::Tcg if spec.layout >= 2 => push(&["-cpu", TCG_CPU]),
        ResolvedAccel::Tcg => {}
    }
    push(&["-smp", &smp, "-m", &mem, "-object", &ram]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    push(&["-msg", "timestamp=on"]);
    if spec.layout >= LEGACY_VIRTIO_FROM {
        push(&["-global", "virtio-mmio.force-legacy=true"]);
    } else {
        push(&["-global", "virtio-mmio.force-legacy=false"]);
    }
    push(&["-kernel", &spec.kernel.to_string_lossy()]);
    if let Some(initrd) = &spec.initrd {
        push(&["-initrd", &initrd.to_string_lossy()]);
    }
    push(&["-append", &cmdline]);
    // Devices: order and ids are part of the device state. Do not reorder.
    push(&["-chardev", &console, "-serial", "chardev:con"]);
    push(&[
        "-drive",
        &drive,
        "-device",
        "virtio-blk-device,drive=disk0,id=vda",
    ]);
    push(&["-device", "virtio-serial-device,id=vser0"]);
    push(&[
        "-chardev",
        &agent,
        "-device",
        &format!("virtserialport,chardev=ag,name=strata.agent,id={AGENT_PORT_ID}"),
    ]);
    push(&["-netdev", &netdev, "-device", &nic]);
    push(&["-chardev", &qmp, "-mon", "chardev=qmp,mode=control"]);
    if spec.seccomp {
        push(&["-sandbox", sandbox_arg(spec)]);
    }
    if let Some(user) = &spec.run_as {
        push(&["-runas", user]);
    }
    if spec.incoming.is_some() {
        push(&["-incoming", "defer"]);
    } else {
        push(&["-S"]);
    }
    a
}

/// The part of the command line that must match between a VM and one restored from
/// its device state: everything except the boot-only and per-instance options.
pub fn device_layout(spec: &VmSpec) -> Vec<String> {
    let args = qemu_args(spec, None);
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-accel" => {
                let v = it.next().unwrap_or_default();
                let v = if v.starts_with("tcg,") {
                    LAYOUT_TCG_ACCEL.to_owned()
                } else {
                    v
                };
                out.push(format!("{arg} {v}"));
            }
            "-device" | "-M" | "-global" | "-smp" | "-m" | "-cpu" => {
                let v = it.next().unwrap_or_default();
                out.push(format!("{arg} {v}"));
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> VmSpec {
        let mut s = VmSpec::new("box,1", "/r/a", "/k/vmlinuz", "/s/mem", "/s/disk.img");
        s.initrd = Some("/k/initrd.img".into());
        s.cmdline = "console=ttyS0 quiet".into();
        s
    }

    #[test]
    fn cold_boot_and_restore_share_the_device_layout() {
        let cold = spec();
        let mut restore = spec();
        restore.incoming = Some("/s2/device.state".into());
        restore.mem_path = "/s2/mem".into();
        restore.disk_path = "/s2/disk.img".into();
        restore.run_dir = "/r/b".into();
        assert_eq!(device_layout(&cold), device_layout(&restore));
        let a = qemu_args(&cold, Some(2_100_000));
        let b = qemu_args(&restore, Some(2_100_000));
        assert!(a.contains(&"-S".to_string()) && !a.contains(&"-incoming".to_string()));
        assert!(b.ends_with(&["-incoming".to_string(), "defer".to_string()]));
        assert_eq!(a.len() + 1, b.len());
    }

    #[test]
    fn the_tcg_cache_size_is_on_the_command_line_but_not_in_the_layout() {
        let mut small = spec();
        small.tcg_tb_size_mib = 64;
        let big = spec();
        assert_eq!(big.tcg_tb_size_mib, TCG_TB_SIZE_MIB);
        let accel = |s: &VmSpec| {
            let a = qemu_args(s, None);
            let i = a.iter().position(|x| x == "-accel").unwrap();
            a[i + 1].clone()
        };
        assert_eq!(accel(&small), "tcg,tb-size=64");
        assert_eq!(accel(&big), format!("tcg,tb-size={TCG_TB_SIZE_MIB}"));
        // Snapshots hashed with the 64 MiB layout keep matching.
        assert_eq!(device_layout(&small), device_layout(&big));
        assert!(device_layout(&big).contains(&"-accel tcg,tb-size=64".to_string()));
    }

    #[test]
    fn disk_throttling_is_on_the_command_line_but_not_in_the_layout() {
        let plain = spec();
        let mut limited = spec();
        limited.disk_throttle = crate::spec::DiskThrottle::new(500, 50 << 20);
        let drive = |s: &VmSpec| {
            let a = qemu_args(s, None);
            let i = a.iter().position(|x| x == "-drive").unwrap();
            a[i + 1].clone()
        };
        assert!(!drive(&plain).contains("throttling"), "{}", drive(&plain));
        assert!(
            drive(&limited).ends_with(",throttling.iops-total=500,throttling.bps-total=52428800"),
            "{}",
            drive(&limited)
        );
        limited.disk_throttle = crate::spec::DiskThrottle::new(0, 1 << 20);
        assert!(drive(&limited).ends_with(",auto-read-only=off,throttling.bps-total=1048576"));
        assert_eq!(crate::spec::DiskThrottle::new(0, 0), None);
        // Snapshots made without throttling keep matching, in every layout.
        for layout in [1, 2, 3] {
            let (mut a, mut b) = (plain.clone(), limited.clone());
            a.layout = layout;
            b.layout = layout;
            assert_eq!(device_layout(&a), device_layout(&b));
        }
    }

    #[test]
    fn the_network_namespace_is_host_side_only() {
        let plain = spec();
        let mut confined = spec();
        confined.netns = Some("/run/netns/strata-vm".into());
        // Not on the command line at all (the child joins it before exec),
        // so neither the device layout nor the slirp state changes.
        assert_eq!(qemu_args(&plain, None), qemu_args(&confined, None));
        assert_eq!(device_layout(&plain), device_layout(&confined));
    }

    #[test]
    fn guest_flushes_pass_unless_turned_off_and_are_not_in_the_layout() {
        let drive = |s: &VmSpec| {
            let a = qemu_args(s, None);
            let i = a.iter().position(|x| x == "-drive").unwrap();
            a[i + 1].clone()
        };
        let flushing = spec();
        assert!(flushing.guest_disk_flush, "passed through by default");
        let mut plain = spec();
        plain.guest_disk_flush = false;
        assert!(
            drive(&plain).contains(",cache=writeback,cache.no-flush=on,"),
            "{}",
            drive(&plain)
        );
        assert!(
            !drive(&flushing).contains("no-flush"),
            "{}",
            drive(&flushing)
        );
        // Snapshots made either way restore either way, in every layout.
        for layout in [1, 2, 3] {
            let (mut a, mut b) = (plain.clone(), flushing.clone());
            a.layout = layout;
            b.layout = layout;
            assert_eq!(device_layout(&a), device_layout(&b));
        }
        // A spec.json written before the field existed reads as it ran.
        let mut v = serde_json::to_value(&plain).unwrap();
        v.as_object_mut().unwrap().remove("guest_disk_flush");
        let old: VmSpec = serde_json::from_value(v).unwrap();
        assert!(old.guest_disk_flush);
    }

    #[test]
    fn layout_2_adds_arat_under_tcg_and_layout_1_is_unchanged() {
        let new = spec();
        assert_eq!(new.layout, MACHINE_LAYOUT_VERSION);
        let args = qemu_args(&new, None);
        let i = args.iter().position(|a| a == "-cpu").unwrap();
        assert_eq!(args[i + 1], "qemu64,+arat");
        assert!(device_layout(&new).contains(&"-cpu qemu64,+arat".to_string()));
        // A state made under layout 1 restores with exactly the old devices.
        let mut old = spec();
        old.layout = 1;
        assert!(!qemu_args(&old, None).contains(&"-cpu".to_string()));
        assert_eq!(
            device_layout(&old),
            [
                format!("-M {MACHINE}"),
                "-accel tcg,tb-size=64".into(),
                "-smp 1".into(),
                "-m 256M".into(),
                "-global virtio-mmio.force-legacy=false".into(),
                "-device virtio-blk-device,drive=disk0,id=vda".into(),
                "-device virtio-serial-device,id=vser0".into(),
                "-device virtserialport,chardev=ag,name=strata.agent,id=agentport".into(),
                format!("-device virtio-net-device,netdev=net0,mac={GUEST_MAC}"),
            ]
        );
        assert_ne!(device_layout(&old), device_layout(&new));
        // Layout 2: ARAT and modern virtio-mmio; layout 3: ARAT and legacy.
        let mut two = spec();
        two.layout = 2;
        let l2 = device_layout(&two);
        assert!(l2.contains(&"-cpu qemu64,+arat".to_string()));
        assert!(l2.contains(&"-global virtio-mmio.force-legacy=false".to_string()));
        let l3 = device_layout(&new);
        assert!(l3.contains(&"-global virtio-mmio.force-legacy=true".to_string()));
        assert!(!l3.contains(&"-global virtio-mmio.force-legacy=false".to_string()));
        assert_ne!(l2, l3);
        // KVM: the host CPU in every layout.
        for layout in [1, 2, 3] {
            let mut k = spec();
            k.accel = ResolvedAccel::Kvm;
            k.layout = layout;
            let a = qemu_args(&k, None);
            let i = a.iter().position(|a| a == "-cpu").unwrap();
            assert_eq!(a[i + 1], "host");
        }
        let mut bad = spec();
        bad.layout = MACHINE_LAYOUT_VERSION + 1;
        assert!(bad.validate().unwrap_err().contains("layout"));
        bad.layout = 0;
        assert!(bad.validate().is_err());
    }

    #[test]
    fn tcg_gets_tsc_hint_kvm_does_not() {
        let s = spec();
        assert_eq!(
            effective_cmdline(&s, Some(2_100_000)),
            "console=ttyS0 quiet tsc_early_khz=2100000 tsc=reliable"
        );
        let mut k = spec();
        k.accel = ResolvedAccel::Kvm;
        assert_eq!(effective_cmdline(&k, Some(1)), "console=ttyS0 quiet");
        assert!(qemu_args(&k, None).contains(&"host".to_string()));
    }

    #[test]
    fn run_as_adds_runas_and_keeps_the_rest_of_the_sandbox() {
        let plain = qemu_args(&spec(), None);
        assert!(!plain.contains(&"-runas".to_string()));
        assert!(plain.contains(
            &"on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".to_string()
        ));
        let mut s = spec();
        s.run_as = Some("strata-vm".into());
        let args = qemu_args(&s, None);
        let i = args.iter().position(|a| a == "-runas").unwrap();
        assert_eq!(args[i + 1], "strata-vm");
        let j = args.iter().position(|a| a == "-sandbox").unwrap();
        assert_eq!(
            args[j + 1],
            "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
        );
        // Same device layout: a VM saved as root restores under run_as and back.
        assert_eq!(device_layout(&s), device_layout(&spec()));
        s.run_as = Some("bad user".into());
        assert!(s.validate().is_err());
    }

    #[test]
    fn qcow2_disk_and_anonymous_ram() {
        let plain = qemu_args(&spec(), None);
        assert!(plain
            .iter()
            .any(|a| a.starts_with("id=disk0,file=/s/disk.img,format=raw,")));
        let mut s = spec();
        s.disk_format = crate::spec::DiskFormat::Qcow2;
        s.ram = RamBacking::Anonymous;
        let args = qemu_args(&s, None);
        assert!(args.contains(&"memory-backend-ram,id=ram,size=256M".to_string()));
        assert!(!args.iter().any(|a| a.contains("mem-path")));
        assert!(args
            .iter()
            .any(|a| a.starts_with("id=disk0,file=/s/disk.img,format=qcow2,")));
        // Same devices: only the backing of RAM and the disk's format differ.
        assert_eq!(device_layout(&s), device_layout(&spec()));
        s.validate().unwrap();
        s.incoming = Some("/s/device.state".into());
        assert!(s.validate().unwrap_err().contains("file-backed RAM"));
    }

    #[test]
    fn names_and_paths_are_escaped() {
        let args = qemu_args(&spec(), None);
        assert!(args.contains(&"guest=box,,1,debug-threads=on".to_string()));
        assert!(args.iter().any(
            |a| a.starts_with("memory-backend-file,id=ram,size=256M,mem-path=/s/mem,share=on")
        ));
    }
}
