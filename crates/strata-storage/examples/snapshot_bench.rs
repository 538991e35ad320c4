//! Snapshot benchmark: a 512 MiB RAM-like file (mapped MAP_SHARED, like QEMU's
//! memory-backend-file with share=on) in a sandbox subvolume; N MiB of random pages
//! dirtied through the mapping, then a read-only snapshot of the subvolume.
//! Compared side by side in one run: the ioctl vs spawning `btrfs subvolume snapshot`,
//! each with btrfs quotas off and on. Also times the usage queries and deletes.
//!
//! Run as root: `cargo run --release -p strata-storage --example snapshot_bench -- [iterations] [off|on|both]`
//! (quotas `on` is slow: minutes per row once snapshots are being deleted).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use strata_storage::testing::TestPool;
use strata_storage::{subvol, PoolOptions, StorageError, UsageMethod};

const MIB: usize = 1 << 20;
const PAGE: usize = 4096;
const RAM: usize = 512 * MIB;

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

fn summary(mut v: Vec<Duration>) -> String {
    v.sort();
    format!(
        "p50 {:8.2}  p95 {:8.2}  p99 {:8.2}  max {:8.2} ms  (n={})",
        pct(&v, 0.50),
        pct(&v, 0.95),
        pct(&v, 0.99),
        pct(&v, 1.0),
        v.len()
    )
}

/// xorshift: reproducible random page numbers without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn time<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let t = Instant::now();
    let r = f();
    (t.elapsed(), r)
}

fn cli_snapshot(src: &Path, dst: &Path) -> Result<(), String> {
    let st = Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(src)
        .arg(dst)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if st.success() {
        Ok(())
    } else {
        Err(st.to_string())
    }
}

fn run(iters: usize, quotas: bool) -> Result<(), StorageError> {
    let tp = TestPool::with_options(8 << 30, PoolOptions { quotas })?;
    let sb = tp.create_subvolume("sandboxes/vm")?;
    let mem_path = sb.join("mem");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&mem_path)
        .map_err(|e| StorageError::Io {
            op: "create",
            path: mem_path.clone(),
            source: e,
        })?;
    {
        // A long-running guest has touched all of its RAM: write it all once.
        let mut w = &f;
        let chunk = vec![0x42u8; MIB];
        for _ in 0..RAM / MIB {
            w.write_all(&chunk).map_err(|e| StorageError::Io {
                op: "write",
                path: mem_path.clone(),
                source: e,
            })?;
        }
        f.sync_all().map_err(|e| StorageError::Io {
            op: "fsync",
            path: mem_path.clone(),
            source: e,
        })?;
    }
    // SAFETY: maps the RAM file we just created, RAM bytes long; unmapped at the end.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RAM,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(StorageError::Io {
            op: "mmap",
            path: mem_path,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `ptr` is a live writable mapping of RAM bytes, only used in this function.
    let mem = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, RAM) };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut seq = 0u64;
    println!("\n=== quotas {} ===", if quotas { "ON" } else { "off" });
    for dirty_mib in [0usize, 16, 64] {
        for method in ["ioctl", "btrfs-cli"] {
            let mut samples = Vec::with_capacity(iters);
            let mut names = Vec::new();
            for i in 0..=iters {
                for _ in 0..dirty_mib * MIB / PAGE {
                    let page = (rng.next() as usize) % (RAM / PAGE);
                    seq += 1;
                    mem[page * PAGE..page * PAGE + 8].copy_from_slice(&seq.to_le_bytes());
                }
                let dst = tp
                    .snapshots_dir()
                    .join(format!("vm-{method}-{dirty_mib}-{i}"));
                let (d, r) = time(|| match method {
                    "ioctl" => tp
                        .snapshot(&sb, &dst, true)
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    _ => cli_snapshot(&sb, &dst),
                });
                if let Err(e) = r {
                    eprintln!("snapshot failed: {e}");
                    std::process::exit(1);
                }
                names.push(dst);
                if i > 0 {
                    samples.push(d); // i == 0 is a warm-up
                }
            }
            println!(
                "snapshot 512 MiB RAM, {dirty_mib:>2} MiB dirty, {method:<9}: {}",
                summary(samples)
            );
            if dirty_mib == 64 && method == "ioctl" {
                usage_costs(
                    &tp,
                    &sb,
                    names.last().map(|p| p.as_path()).unwrap_or(&sb),
                    quotas,
                )?;
            }
            let mut del = Vec::new();
            for n in names {
                let (d, r) = time(|| tp.delete_subvolume(&n));
                r?;
                del.push(d);
            }
            if dirty_mib == 64 && method == "ioctl" {
                println!(
                    "delete_subvolume (ioctl) of those snapshots: {}",
                    summary(del)
                );
            }
            subvol::sync_fs(tp.root())?;
        }
    }
    // SAFETY: unmapping the mapping created above; `mem` is not used afterwards.
    unsafe { libc::munmap(ptr, RAM) };
    Ok(())
}

fn usage_costs(tp: &TestPool, sb: &Path, snap: &Path, quotas: bool) -> Result<(), StorageError> {
    let (d, u) = time(|| tp.subvolume_usage(snap, UsageMethod::Extents));
    let u = u?;
    println!(
        "  usage by extent walk (FIEMAP), latest snapshot: {:.2} ms  excl {} KiB ref {} KiB",
        d.as_secs_f64() * 1e3,
        u.exclusive_bytes >> 10,
        u.referenced_bytes >> 10
    );
    let (d, u) = time(|| tp.subvolume_usage(sb, UsageMethod::Extents));
    let u = u?;
    println!(
        "  usage by extent walk (FIEMAP), live sandbox:    {:.2} ms  excl {} KiB ref {} KiB",
        d.as_secs_f64() * 1e3,
        u.exclusive_bytes >> 10,
        u.referenced_bytes >> 10
    );
    let (d, _) = time(|| {
        Command::new("btrfs")
            .args(["filesystem", "du", "-s", "--raw"])
            .arg(snap)
            .output()
    });
    println!(
        "  `btrfs filesystem du -s --raw` (process):      {:.2} ms",
        d.as_secs_f64() * 1e3
    );
    if quotas {
        let (d, u) = time(|| tp.subvolume_usage(snap, UsageMethod::Qgroups));
        let u = u?;
        println!(
            "  usage by qgroup (sync + tree search):           {:.2} ms  excl {} KiB ref {} KiB",
            d.as_secs_f64() * 1e3,
            u.exclusive_bytes >> 10,
            u.referenced_bytes >> 10
        );
        let (d, _) = time(|| {
            Command::new("btrfs")
                .args(["qgroup", "show", "--raw"])
                .arg(tp.root())
                .output()
        });
        println!(
            "  `btrfs qgroup show --raw` (process):           {:.2} ms",
            d.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

fn main() {
    let iters = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(30usize);
    println!("strata-storage snapshot benchmark: {iters} snapshots per row (after 1 warm-up), times in ms");
    for quotas in [false, true] {
        if let Err(e) = run(iters, quotas) {
            eprintln!("benchmark failed: {e}");
            std::process::exit(1);
        }
    }
}
