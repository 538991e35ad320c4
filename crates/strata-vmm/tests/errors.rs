//! Bad input gets typed errors; the accel probe answers in time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use strata_core::Accel;
use strata_vmm::{QemuDriver, ResolvedAccel, VmmDriver, VmmError};

#[tokio::test]
async fn missing_inputs_are_typed_errors() {
    let d = scratch("vmm-e");
    let good = image_spec(d.path(), "err");
    let driver = QemuDriver::new();

    let mut s = good.clone();
    s.kernel = d.path().join("no-kernel");
    assert!(matches!(
        driver.start(&s).await,
        Err(VmmError::KernelMissing { .. })
    ));

    let mut s = good.clone();
    s.initrd = Some(d.path().join("no-initrd"));
    assert!(matches!(
        driver.start(&s).await,
        Err(VmmError::InitrdMissing { .. })
    ));

    let mut s = good.clone();
    s.disk_path = d.path().join("no-disk");
    assert!(matches!(
        driver.start(&s).await,
        Err(VmmError::DiskMissing { .. })
    ));

    let mut s = good.clone();
    s.qemu_binary = "qemu-system-nonexistent".into();
    let e = driver.start(&s).await.unwrap_err();
    assert!(matches!(e, VmmError::QemuNotFound { .. }), "{e:?}");
    assert!(
        e.to_string().contains("apt-get install qemu-system-x86"),
        "{e}"
    );

    let mut s = good.clone();
    s.run_dir = Path::new("/tmp").join("x".repeat(110));
    assert!(matches!(
        driver.start(&s).await,
        Err(VmmError::InvalidSpec(_))
    ));

    let mut s = good.clone();
    s.incoming = Some(d.path().join("no-state"));
    assert!(matches!(
        driver.start(&s).await,
        Err(VmmError::StateMissing { .. })
    ));

    // Nothing was left running, and adopting an empty run dir is refused.
    assert!(!good.pid_file().exists());
    let e = driver.adopt(&good).await.unwrap_err();
    assert!(matches!(e, VmmError::AdoptFailed { .. }), "{e:?}");
}

#[tokio::test]
async fn corrupt_device_state_is_a_migration_error() {
    let d = scratch("vmm-c");
    let mut s = image_spec(d.path(), "corrupt");
    let mem = std::fs::File::create(&s.mem_path).unwrap();
    mem.set_len(1 << 20).unwrap();
    let state = d.path().join("device.state");
    std::fs::write(&state, b"this is not a QEMU migration stream").unwrap();
    s.incoming = Some(state);
    let e = QemuDriver::new().start(&s).await.unwrap_err();
    assert!(matches!(e, VmmError::InvalidSpec(_)), "{e:?}");
    mem.set_len(s.memory_mib << 20).unwrap();
    let e = QemuDriver::new().start(&s).await.unwrap_err();
    assert!(matches!(e, VmmError::Migration { .. }), "{e:?}");
    // The failed QEMU is gone.
    let pid: u32 = std::fs::read_to_string(s.pid_file())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}/cmdline")).exists()
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| !c.is_empty())
            .unwrap_or(false)
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "QEMU {pid} still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn auto_accel_resolves_in_time() {
    let img = strata_testkit::test_image();
    let driver = QemuDriver::new();
    assert_eq!(
        driver.resolve_accel(Accel::Tcg, &img.kernel).await,
        ResolvedAccel::Tcg
    );
    let t = Instant::now();
    let acc = driver.resolve_accel(Accel::Auto, &img.kernel).await;
    let first = t.elapsed();
    let t = Instant::now();
    assert_eq!(driver.resolve_accel(Accel::Auto, &img.kernel).await, acc);
    let cached = t.elapsed();
    println!("REPORT accel auto -> {acc} in {first:?} (cached: {cached:?})");
    assert!(first < Duration::from_secs(6), "probe took {first:?}");
    assert!(cached < Duration::from_millis(50));
    if !Path::new("/dev/kvm").exists() {
        assert_eq!(acc, ResolvedAccel::Tcg);
    }
}
