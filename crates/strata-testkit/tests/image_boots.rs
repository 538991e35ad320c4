//! Boots the test image under QEMU `microvm` (TCG) and checks, on the serial
//! console, that the initramfs loads its modules, mounts the root disk and
//! starts the real agent, which finds its virtio-serial port.
//!
//! Needs QEMU (`qemu-system-x86`) and root (debootstrap) for a cold build.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn image_boots_to_the_agent() {
    let image = strata_testkit::test_image();
    let dir = strata_testkit::scratch_dir("sti-boot");
    let disk = dir.path().join("disk.img");
    let status = Command::new("cp")
        .args(["--reflink=auto", "--sparse=always"])
        .arg(&image.rootfs)
        .arg(&disk)
        .status()
        .unwrap();
    assert!(status.success());
    let kernel = image.kernel_pvh.as_ref().unwrap_or(&image.kernel);
    let mut cmdline = image.cmdline.replace(" quiet", "");
    if let Some(khz) = strata_testkit::host_tsc_khz() {
        cmdline.push_str(&format!(" tsc_early_khz={khz}"));
    }
    let sock = dir.path().join("agent.sock");
    let mem = dir.path().join("mem");
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "microvm,x-option-roms=off,rtc=on",
            "-accel",
            "tcg",
            "-m",
            "512",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
        ])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(&image.initrd)
        .args(["-append", &cmdline])
        .args([
            "-drive",
            &format!("id=root,file={},format=raw,if=none", disk.display()),
        ])
        .args(["-device", "virtio-blk-device,drive=root"])
        .args([
            "-object",
            &format!(
                "memory-backend-file,id=ram,size=512M,mem-path={},share=on",
                mem.display()
            ),
        ])
        .args([
            "-machine",
            "memory-backend=ram",
            "-device",
            "virtio-serial-device",
        ])
        .args([
            "-chardev",
            &format!("socket,id=ag,path={},server=on,wait=off", sock.display()),
        ])
        .args(["-device", "virtserialport,chardev=ag,name=strata.agent"])
        .args([
            "-netdev",
            "user,id=n0,restrict=on",
            "-device",
            "virtio-net-device,netdev=n0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 (package qemu-system-x86) must be installed");
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut console = Vec::new();
    let mut agent_ready = None;
    while start.elapsed() < BOOT_TIMEOUT {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                let done = line.contains("serving on virtio-serial port");
                console.push(line);
                if done {
                    agent_ready = Some(start.elapsed());
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Ok(Some(status)) = child.try_wait() {
                    console.push(format!("<qemu exited: {status}>"));
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
    let text = console.join("\n");
    let tail: String = console
        .iter()
        .rev()
        .take(40)
        .rev()
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    let ctx = format!("qemu {status}, stderr: {stderr}\nconsole tail:\n{tail}");
    let elapsed =
        agent_ready.unwrap_or_else(|| panic!("agent not ready within {BOOT_TIMEOUT:?}; {ctx}"));
    eprintln!(
        "agent ready {:.2} s after QEMU start",
        elapsed.as_secs_f64()
    );
    for expected in [
        "[strata-init",
        "loaded 14 modules: crc16 crc32c_generic mbcache jbd2 ext4",
        "root /dev/vda mounted",
        "starting /usr/local/bin/strata-agent --init",
    ] {
        assert!(text.contains(expected), "console lacks {expected:?}; {ctx}");
    }
    let failed = console
        .iter()
        .any(|l| l.contains("strata-init") && l.contains("insmod") && l.contains("failed"));
    assert!(!failed, "a module failed to load; {ctx}");
    let served = console
        .iter()
        .find(|l| l.contains("serving on virtio-serial port"))
        .unwrap();
    assert!(served.contains("/dev/vport"), "agent port line: {served}");
}
