//! `idle_probe`: where an idle guest's host CPU goes, variant beside variant
//! in one run (docs/bench/idle-cost.md).
//!
//! ```text
//! cargo run --release -p strata-bench --example idle_probe -- \
//!     --variant base=/var/cache/strata/images/<hash> \
//!     --variant lean=/tmp/img-lean --n 4 --secs 30
//! ```
//!
//! Each variant is a guest image directory (its `manifest.json` cmdline is
//! what the template boots with) on its own runtime and pool; `NAME=DIR@HZ`
//! adds HZ extra agent pings per second per guest during the host window
//! (to price one ping); `+PATH` runs that QEMU binary (e.g. a wrapper that
//! adds an option under test). Every guest of every variant runs at once; then, in
//! one host window, per QEMU thread: CPU and context switches from
//! `/proc/<pid>/task/*/{stat,status}`; then, in a second window of the same
//! length, guest-side deltas of `/proc/interrupts` and `/proc/softirqs` read
//! through the agent (the reads fall outside the host window).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use clap::Parser;
use strata_bench::ctx::{teardown_all, BenchRuntime, Ctx};
use strata_core::{Accel, SandboxId, SandboxSize};
use strata_proto::ExecRequest;
use strata_runtime::{Runtime, Source};

#[derive(Debug, Parser)]
struct Cli {
    /// NAME=IMAGE_DIR[@EXTRA_PING_HZ][+QEMU_BINARY], repeatable.
    #[arg(long = "variant", required = true)]
    variants: Vec<String>,
    /// Guests per variant.
    #[arg(long, default_value_t = 4)]
    n: usize,
    /// Length of each window, seconds.
    #[arg(long, default_value_t = 30)]
    secs: u64,
    /// Settle time after the last guest started, seconds.
    #[arg(long, default_value_t = 10)]
    settle: u64,
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 256)]
    mem: u32,
    /// QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu: PathBuf,
    /// Also dump one guest's /proc/timer_list per variant.
    #[arg(long)]
    timer_list: bool,
    /// A shell command run in one guest of each variant; its output is printed.
    #[arg(long)]
    exec: Vec<String>,
}

struct Variant {
    name: String,
    ping_hz: f64,
    env: BenchRuntime,
    guests: Vec<(SandboxId, u32)>,
}

/// Per thread name: (ticks, voluntary, involuntary switches).
type Threads = BTreeMap<String, (u64, u64, u64)>;

fn threads(pid: u32) -> Result<Threads> {
    let mut out = Threads::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let p = e?.path();
        let (Ok(stat), Ok(status)) = (
            std::fs::read_to_string(p.join("stat")),
            std::fs::read_to_string(p.join("status")),
        ) else {
            continue;
        };
        let (Some(a), Some(b)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let mut name = stat[a + 1..b].to_string();
        if name.starts_with("worker") {
            name = "worker".into();
        }
        let f: Vec<&str> = stat[b + 1..].split_whitespace().collect();
        let ticks = f.get(11).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|r| r.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let e = out.entry(name).or_default();
        e.0 += ticks;
        e.1 += field("voluntary_ctxt_switches:");
        e.2 += field("nonvoluntary_ctxt_switches:");
    }
    Ok(out)
}

/// Per interrupt line (or softirq): total count over CPUs.
fn counters(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for l in text.lines().skip(1) {
        let Some((k, rest)) = l.split_once(':') else {
            continue;
        };
        let mut sum = 0u64;
        let mut label = Vec::new();
        for w in rest.split_whitespace() {
            match w.parse::<u64>() {
                Ok(n) if label.is_empty() => sum += n,
                _ => label.push(w),
            }
        }
        let key = format!("{} {}", k.trim(), label.join(" "));
        out.insert(key.trim().to_string(), sum);
    }
    out
}

async fn sh(rt: &Runtime, id: &SandboxId, script: &str) -> Result<String> {
    let a = rt.agent(id).await.context("agent")?;
    let o = a
        .exec_collect(ExecRequest::shell(script))
        .await
        .with_context(|| format!("exec {script}"))?;
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

const GUEST_READ: &str = "cat /proc/interrupts; echo ----; cat /proc/softirqs";

fn split_guest(s: &str) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let (i, so) = s.split_once("----\n").unwrap_or((s, ""));
    (counters(i), counters(so))
}

fn hz() -> f64 {
    // SAFETY: sysconf reads a constant of the C library.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

async fn run(cli: Cli) -> Result<()> {
    let size = SandboxSize {
        memory_mib: cli.mem,
        ..SandboxSize::default()
    };
    let mut vs = Vec::new();
    for v in &cli.variants {
        // NAME=DIR[@HZ][+QEMU]
        let (name, rest) = v
            .split_once('=')
            .ok_or_else(|| anyhow!("--variant NAME=DIR[@HZ][+QEMU]: {v}"))?;
        let (rest, qemu) = match rest.split_once('+') {
            Some((r, q)) => (r, PathBuf::from(q)),
            None => (rest, cli.qemu.clone()),
        };
        let (dir, ping_hz) = match rest.rsplit_once('@') {
            Some((d, h)) => (d, h.parse::<f64>().context("ping hz")?),
            None => (rest, 0.0),
        };
        let ctx = Ctx {
            out: std::env::temp_dir(),
            image: PathBuf::from(dir),
            accel: Accel::Tcg,
            qemu,
            smoke: false,
        };
        let env = BenchRuntime::start(&ctx, "strata-idle-probe-", 8, |_| {}).await?;
        let (tpl, boot_ms) = env.template(size).await?;
        eprintln!("{name}: template booted in {boot_ms:.0} ms");
        let mut guests = Vec::new();
        for _ in 0..cli.n {
            let id = SandboxId::generate();
            let vm = env
                .rt
                .create(&id, &Source::Template(tpl.clone()), None)
                .await?;
            guests.push((id, vm.pid));
        }
        vs.push(Variant {
            name: name.to_string(),
            ping_hz,
            env,
            guests,
        });
    }
    for v in &vs {
        let (id, _) = &v.guests[0];
        let info = sh(
            &v.env.rt,
            id,
            "cat /proc/cmdline; cat /sys/devices/system/clocksource/clocksource0/current_clocksource; \
             cat /sys/devices/system/clockevents/clockevent0/current_device 2>/dev/null; \
             grep -h . /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null; ps -eo pid,comm | wc -l",
        )
        .await?;
        println!("== {}: {}", v.name, info.replace('\n', " | "));
        if cli.timer_list {
            println!("{}", sh(&v.env.rt, id, "cat /proc/timer_list").await?);
        }
        for c in &cli.exec {
            println!("$ {c}\n{}", sh(&v.env.rt, id, c).await?);
        }
    }
    eprintln!("settling {} s", cli.settle);
    tokio::time::sleep(Duration::from_secs(cli.settle)).await;

    // ---- host window
    let before: Vec<Vec<Threads>> = vs
        .iter()
        .map(|v| v.guests.iter().map(|(_, p)| threads(*p)).collect())
        .collect::<Result<_>>()?;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(cli.secs);
    let mut pingers = Vec::new();
    for v in &vs {
        if v.ping_hz <= 0.0 {
            continue;
        }
        for (id, _) in &v.guests {
            let rt: Arc<Runtime> = v.env.rt.clone();
            let id = id.clone();
            let every = Duration::from_secs_f64(1.0 / v.ping_hz);
            pingers.push(tokio::spawn(async move {
                let mut n = 0u64;
                let mut t = tokio::time::interval(every);
                while Instant::now() < deadline {
                    t.tick().await;
                    if let Ok(a) = rt.agent(&id).await {
                        if a.ping().await.is_ok() {
                            n += 1;
                        }
                    }
                }
                n
            }));
        }
    }
    tokio::time::sleep_until(deadline.into()).await;
    let secs = t0.elapsed().as_secs_f64();
    let after: Vec<Vec<Threads>> = vs
        .iter()
        .map(|v| v.guests.iter().map(|(_, p)| threads(*p)).collect())
        .collect::<Result<_>>()?;
    let mut pings = 0u64;
    for p in pingers {
        pings += p.await.unwrap_or(0);
    }
    let hz = hz();
    println!(
        "\n## host window {secs:.1} s (per guest, mean of {})",
        cli.n
    );
    for (i, v) in vs.iter().enumerate() {
        let mut per: BTreeMap<String, (f64, f64, f64)> = BTreeMap::new();
        let mut totals = Vec::new();
        for (b, a) in before[i].iter().zip(&after[i]) {
            let mut tot = 0.0;
            for (k, (t1, v1, i1)) in a {
                let (t0, v0, i0) = b.get(k).copied().unwrap_or((*t1, *v1, *i1));
                let e = per.entry(k.clone()).or_default();
                // Threads come and go (workers): a name's sum may drop.
                let c = t1.saturating_sub(t0) as f64 / hz / secs * 100.0;
                e.0 += c / cli.n as f64;
                e.1 += v1.saturating_sub(v0) as f64 / secs / cli.n as f64;
                e.2 += i1.saturating_sub(i0) as f64 / secs / cli.n as f64;
                tot += c;
            }
            totals.push(tot);
        }
        let mean = totals.iter().sum::<f64>() / totals.len().max(1) as f64;
        let extra = if v.ping_hz > 0.0 {
            format!(" (+{:.1} pings/s/guest sent by the probe)", v.ping_hz)
        } else {
            String::new()
        };
        println!(
            "\n### {}: idle CPU {:.2} % of a core per guest{} [{}]",
            v.name,
            mean,
            extra,
            totals
                .iter()
                .map(|t| format!("{t:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        println!("| thread | CPU % | voluntary cs/s | involuntary cs/s |\n|---|---:|---:|---:|");
        for (k, (c, vo, inv)) in &per {
            println!("| {k} | {c:.3} | {vo:.1} | {inv:.1} |");
        }
    }
    if pings > 0 {
        println!("\nprobe pings answered in the window: {pings}");
    }

    // ---- guest window
    let mut g0 = Vec::new();
    for v in &vs {
        let mut row = Vec::new();
        for (id, _) in &v.guests {
            row.push((sh(&v.env.rt, id, GUEST_READ).await?, Instant::now()));
        }
        g0.push(row);
    }
    tokio::time::sleep(Duration::from_secs(cli.secs)).await;
    println!("\n## guest window: /proc/interrupts and /proc/softirqs per second (mean per guest)");
    for (i, v) in vs.iter().enumerate() {
        let mut irq: BTreeMap<String, f64> = BTreeMap::new();
        let mut soft: BTreeMap<String, f64> = BTreeMap::new();
        for ((id, _), (s0, t0)) in v.guests.iter().zip(&g0[i]) {
            let s1 = sh(&v.env.rt, id, GUEST_READ).await?;
            let dt = t0.elapsed().as_secs_f64();
            let (i0, so0) = split_guest(s0);
            let (i1, so1) = split_guest(&s1);
            for (k, n) in i1 {
                let d = n.saturating_sub(*i0.get(&k).unwrap_or(&n)) as f64 / dt;
                *irq.entry(k).or_default() += d / cli.n as f64;
            }
            for (k, n) in so1 {
                let d = n.saturating_sub(*so0.get(&k).unwrap_or(&n)) as f64 / dt;
                *soft.entry(k).or_default() += d / cli.n as f64;
            }
        }
        println!("\n### {}", v.name);
        let show = |m: &BTreeMap<String, f64>| {
            m.iter()
                .filter(|(_, r)| **r >= 0.05)
                .map(|(k, r)| format!("{k}: {r:.1}"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        println!("interrupts/s: {}", show(&irq));
        println!("softirqs/s: {}", show(&soft));
    }
    for v in vs {
        v.env.stop();
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let r = run(cli).await;
    teardown_all();
    r
}
