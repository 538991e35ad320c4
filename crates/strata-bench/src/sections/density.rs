//! Section `density`: what an idle running sandbox costs this host (memory
//! beyond its guest RAM, CPU while idle), how many fit, and that a hibernated
//! sandbox costs nothing but disk — down to 1,000 of them created directly
//! hibernated (`POST /v1/sandboxes {"start": false}`) and listed through the
//! daemon's HTTP API.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use reqwest::Method;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxSize, SnapshotId};
use strata_runtime::Source;

use crate::ctx::{BenchDaemon, BenchRuntime, Ctx};
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_bytes, fmt_ms, fmt_num, Samples};

/// Flags of the `density` section.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Idle running sandboxes measured side by side.
    #[arg(long = "density-running", id = "density_running", default_value_t = 10)]
    pub running: usize,
    /// Guest memory of each sandbox, MiB.
    #[arg(long = "density-mem", id = "density_mem", default_value_t = 256)]
    pub mem_mib: u32,
    /// Sandboxes created hibernated and listed through the daemon.
    #[arg(
        long = "density-hibernated",
        id = "density_hibernated",
        default_value_t = 1000
    )]
    pub hibernated: usize,
    /// Window over which idle CPU is sampled, seconds.
    #[arg(
        long = "density-idle-secs",
        id = "density_idle_secs",
        default_value_t = 20
    )]
    pub idle_secs: u64,
}

impl Args {
    /// Shrinks every count to the CI smoke size.
    pub fn smoke(&mut self) {
        self.running = 2;
        self.hibernated = 20;
        self.idle_secs = 3;
    }
}

// ------------------------------------------------------------ host figures

/// A `/proc/meminfo` (or `smaps_rollup`) field in bytes: the daemon's parser.
use stratad::host::meminfo_field as meminfo;

fn mem_available() -> Result<u64> {
    let t = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
    meminfo(&t, "MemAvailable").ok_or_else(|| anyhow!("no MemAvailable in /proc/meminfo"))
}

fn mem_total() -> Result<u64> {
    let t = std::fs::read_to_string("/proc/meminfo").context("read /proc/meminfo")?;
    meminfo(&t, "MemTotal").ok_or_else(|| anyhow!("no MemTotal in /proc/meminfo"))
}

/// `Rss` and `Pss` of `/proc/<pid>/smaps_rollup`, bytes.
fn parse_rollup(text: &str) -> Option<(u64, u64)> {
    Some((meminfo(text, "Rss")?, meminfo(text, "Pss")?))
}

fn rss_pss(pid: u32) -> Result<(u64, u64)> {
    let p = format!("/proc/{pid}/smaps_rollup");
    let t = std::fs::read_to_string(&p).with_context(|| format!("read {p}"))?;
    parse_rollup(&t).ok_or_else(|| anyhow!("no Rss/Pss in {p}"))
}

/// utime + stime (clock ticks) from the text of `/proc/<pid>/stat`.
pub(crate) fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces: fields count from after ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime 15.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

pub(crate) fn cpu_ticks(pid: u32) -> Result<u64> {
    let p = format!("/proc/{pid}/stat");
    let t = std::fs::read_to_string(&p).with_context(|| format!("read {p}"))?;
    parse_cpu_ticks(&t).ok_or_else(|| anyhow!("cannot parse {p}"))
}

pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant of the C library; no memory is passed.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Bytes used on the file system holding `path` (after a sync, so btrfs has
/// committed what was just written).
fn fs_used(path: &Path) -> Result<u64> {
    // SAFETY: sync(2) takes no arguments.
    unsafe { libc::sync() };
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .context("pool path with a NUL")?;
    // SAFETY: statvfs writes into a zeroed struct we own; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above: both pointers are valid for the call.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("statvfs {}", path.display()));
    }
    Ok((st.f_blocks - st.f_bfree) * st.f_frsize)
}

/// How many sandboxes fit: by memory (`avail` / `per_sandbox` bytes) and by
/// CPU (`cores` × 100 % / `cpu_pct` per idle guest); (memory, cpu).
fn capacity(avail: u64, per_sandbox: f64, cores: usize, cpu_pct: f64) -> (f64, f64) {
    let by_mem = if per_sandbox > 0.0 {
        (avail as f64 / per_sandbox).floor()
    } else {
        f64::INFINITY
    };
    let by_cpu = if cpu_pct > 0.0 {
        (cores as f64 * 100.0 / cpu_pct).floor()
    } else {
        f64::INFINITY
    };
    (by_mem, by_cpu)
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

struct Running {
    id: SandboxId,
    pid: u32,
    rss: u64,
    pss: u64,
    overhead: u64,
    cpu_pct: f64,
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    let size = SandboxSize {
        memory_mib: args.mem_mib,
        ..SandboxSize::default()
    };
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let total = mem_total()?;
    sec.text(format!(
        "**Method.** Running: {} sandboxes of {} MiB / {} vCPU, each a fork of one template (runtime API), left idle. \
         After they settle, per QEMU process: RSS and PSS from `/proc/<pid>/smaps_rollup`, \"beyond guest RAM\" \
         (the runtime's `vm_overhead_bytes`: VmRSS minus the resident pages of the guest-RAM file mapping, i.e. QEMU's own heap, \
         TCG translation cache and binaries), and idle CPU from `utime+stime` in `/proc/<pid>/stat` over a {} s window; \
         host `MemAvailable` before the sandboxes started and while they idle. \
         Hibernated: one of them is hibernated (its process ends) and its snapshot's exclusive bytes are read; then a stratad daemon \
         (HTTP on loopback) creates {} sandboxes with `POST /v1/sandboxes {{\"start\": false}}` — hibernated from the start, each one \
         btrfs snapshot of the template, no QEMU — timed per request, lists them all page by page, and the QEMU count, host memory and \
         pool bytes are compared before and after. Host: {} cores, {} RAM; accelerator {}.",
        args.running,
        size.memory_mib,
        size.vcpus,
        args.idle_secs,
        args.hibernated,
        cores,
        fmt_bytes(total as f64),
        ctx.accel
    ));

    // ------------------------------------------------------------ running
    let env = BenchRuntime::start(ctx, "strata-bench-density-", 16, |_| {}).await?;
    let rt = env.rt.clone();
    eprintln!("density: building the template ({} MiB)", size.memory_mib);
    let (tpl, _) = env.template(size).await?;
    let avail_before = mem_available()?;
    let mut ids = Vec::new();
    let mut create_ms = Samples::new();
    for i in 0..args.running {
        let id = SandboxId::generate();
        let vm = rt
            .create(&id, &Source::Template(tpl.clone()), None)
            .await
            .with_context(|| format!("start running sandbox {i}"))?;
        create_ms.push(vm.ready_ms);
        ids.push((id, vm.pid));
    }
    eprintln!("density: {} sandboxes running; settling", ids.len());
    tokio::time::sleep(Duration::from_secs(if ctx.smoke { 1 } else { 3 })).await;
    let t0_ticks: Vec<u64> = ids
        .iter()
        .map(|(_, pid)| cpu_ticks(*pid))
        .collect::<Result<_>>()?;
    let t0 = Instant::now();
    eprintln!("density: sampling idle CPU for {} s", args.idle_secs);
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let secs = t0.elapsed().as_secs_f64();
    let hz = clock_ticks();
    let mut running = Vec::new();
    for ((id, pid), t0t) in ids.iter().zip(&t0_ticks) {
        let t1 = cpu_ticks(*pid)?;
        let (rss, pss) = rss_pss(*pid)?;
        let overhead = rt
            .vm_overhead_bytes(id)
            .with_context(|| format!("overhead of {id}"))?;
        running.push(Running {
            id: id.clone(),
            pid: *pid,
            rss,
            pss,
            overhead,
            cpu_pct: (t1.saturating_sub(*t0t)) as f64 / hz / secs * 100.0,
        });
    }
    let avail_running = mem_available()?;
    let n = running.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Running) -> f64| running.iter().map(f).sum::<f64>() / n;
    let (m_rss, m_pss, m_over, m_cpu) = (
        mean(&|r| r.rss as f64),
        mean(&|r| r.pss as f64),
        mean(&|r| r.overhead as f64),
        mean(&|r| r.cpu_pct),
    );
    let change_per = (avail_before as f64 - avail_running as f64) / n;
    let drop_per = change_per.max(0.0);
    let guest = size.memory_bytes() as f64;
    let mut t = Table::new(
        format!(
            "Idle running sandboxes ({} MiB guests), after {:.0} s idle",
            size.memory_mib, secs
        ),
        &[
            "sandbox",
            "pid",
            "guest RAM",
            "RSS",
            "PSS",
            "beyond guest RAM",
            "idle CPU",
        ],
    );
    for r in &running {
        t.row(vec![
            r.id.to_string(),
            r.pid.to_string(),
            fmt_bytes(guest),
            fmt_bytes(r.rss as f64),
            fmt_bytes(r.pss as f64),
            fmt_bytes(r.overhead as f64),
            format!("{} %", fmt_num(r.cpu_pct)),
        ]);
    }
    t.row(vec![
        format!("mean of {}", running.len()),
        "".into(),
        fmt_bytes(guest),
        fmt_bytes(m_rss),
        fmt_bytes(m_pss),
        fmt_bytes(m_over),
        format!("{} %", fmt_num(m_cpu)),
    ]);
    sec.table(t);
    // Memory a sandbox really takes: the larger of its PSS and its share of
    // the drop in MemAvailable (page cache of the RAM files, kernel memory).
    let per_sandbox = m_pss.max(drop_per);
    let (by_mem, by_cpu) = capacity(avail_before, per_sandbox, cores, m_cpu);
    let bound = if by_mem <= by_cpu { "memory" } else { "CPU" };
    let fits = by_mem.min(by_cpu);
    let mut cap = Table::new(
        "How many such idle sandboxes this host holds",
        &["bound", "per sandbox", "host budget", "sandboxes"],
    );
    cap.row(vec![
        "memory".into(),
        format!(
            "{} (max of mean PSS {} and MemAvailable drop / n {})",
            fmt_bytes(per_sandbox),
            fmt_bytes(m_pss),
            fmt_bytes(drop_per)
        ),
        format!("{} MemAvailable before", fmt_bytes(avail_before as f64)),
        format!("{by_mem:.0}"),
    ]);
    cap.row(vec![
        "CPU".into(),
        format!("{} % of a core idle", fmt_num(m_cpu)),
        format!("{cores} cores"),
        format!("{by_cpu:.0}"),
    ]);
    sec.table(cap);
    sec.text(format!(
        "The binding constraint is **{bound}**: about {:.0} idle {} MiB sandboxes fit (memory alone: {:.0}, CPU alone: {:.0}). \
         Guests run under {}; an idle TCG guest burns more host CPU than a KVM one would (timer interrupts are emulated in \
         QEMU's translation loop), so with KVM the CPU bound would be far higher and memory would bind. The guest RAM is a \
         shared file mapping on btrfs: a guest only costs the pages it touched (RSS {} of {} guest RAM on average), and those \
         pages are page cache that the kernel can write back under pressure, so `MemAvailable` (which counts reclaimable page \
         cache as available) moved by only {} per sandbox (a drop is positive; other work on this shared host moves it too).",
        fits,
        size.memory_mib,
        by_mem,
        by_cpu,
        ctx.accel,
        fmt_bytes(m_rss),
        fmt_bytes(guest),
        fmt_bytes(change_per),
    ));

    // One hibernated: no process, disk only.
    let (hid, hpid) = ids
        .first()
        .cloned()
        .ok_or_else(|| anyhow!("no running sandbox (--density-running 0)"))?;
    let hsnap = SnapshotId::generate();
    rt.hibernate(&hid, &hsnap)
        .await
        .context("hibernate a running sandbox")?;
    let mut gone = false;
    for _ in 0..100 {
        if !Path::new(&format!("/proc/{hpid}")).exists() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !gone {
        bail!("QEMU {hpid} still runs after hibernate");
    }
    // The hibernated sandbox keeps its working subvolume, identical to (and
    // sharing every block with) its hibernation snapshot; set it aside so the
    // snapshot's exclusive bytes are what this sandbox adds beyond the template.
    rt.delete(&hid)
        .await
        .context("remove the working subvolume")?;
    // btrfs drops a deleted subvolume's extent references later, in its
    // cleaner thread: wait for the trash, then for the cleaner.
    let pool = rt.clone();
    let _ = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || {
            pool.pool().wait_trash_empty();
            std::process::Command::new("btrfs")
                .args(["subvolume", "sync"])
                .arg(pool.pool().root())
                .stdout(std::process::Stdio::null())
                .status()
        }),
    )
    .await;
    let usage = rt
        .snapshot_usage(&hsnap)
        .await
        .context("usage of the hibernation snapshot")?;
    let mut ht = Table::new(
        "One sandbox hibernated (runtime API)",
        &["", "running (mean)", "hibernated"],
    );
    ht.row(vec![
        "QEMU process".into(),
        "1".into(),
        format!("0 (pid {hpid} gone)"),
    ]);
    ht.row(vec![
        "CPU".into(),
        format!("{} %", fmt_num(m_cpu)),
        "0 %".into(),
    ]);
    ht.row(vec!["RSS".into(), fmt_bytes(m_rss), "0 B".into()]);
    ht.row(vec![
        "disk: hibernation snapshot exclusive / referenced (shared with the template)".into(),
        "–".into(),
        format!(
            "{} / {}",
            fmt_bytes(usage.exclusive_bytes as f64),
            fmt_bytes(usage.referenced_bytes as f64)
        ),
    ]);
    sec.table(ht);
    let running_data: Vec<Value> = running
        .iter()
        .map(|r| json!({"id": r.id.to_string(), "pid": r.pid, "rss": r.rss, "pss": r.pss, "overhead": r.overhead, "cpu_pct": r.cpu_pct}))
        .collect();
    sec.data = json!({
        "params": { "running": args.running, "memory_mib": size.memory_mib, "hibernated": args.hibernated, "idle_secs": args.idle_secs, "cores": cores, "mem_total": total, "accel": ctx.accel.to_string() },
        "running": running_data,
        "create_ready_ms": create_ms.0,
        "mem_available_before": avail_before, "mem_available_running": avail_running,
        "capacity": { "per_sandbox_bytes": per_sandbox, "by_memory": by_mem, "by_cpu": by_cpu, "bound": bound },
        "hibernated_one": { "exclusive_bytes": usage.exclusive_bytes, "referenced_bytes": usage.referenced_bytes },
    });

    let file = "density-memory.svg";
    let mut cats: Vec<String> = (1..=running.len()).map(|i| format!("sb{i}")).collect();
    cats.push("hibernated".into());
    let col = |f: &dyn Fn(&Running) -> f64, hib: f64| -> Vec<f64> {
        let mut v: Vec<f64> = running.iter().map(|r| mib(f(r))).collect();
        v.push(mib(hib));
        v
    };
    plot::bars(
        &ctx.file(file),
        &format!("Memory per idle {} MiB sandbox", size.memory_mib),
        "MiB",
        &cats,
        &[
            ("guest RAM (configured)".into(), col(&|_| guest, 0.0)),
            ("RSS".into(), col(&|r| r.rss as f64, 0.0)),
            ("PSS".into(), col(&|r| r.pss as f64, 0.0)),
            (
                "beyond guest RAM (QEMU)".into(),
                col(&|r| r.overhead as f64, 0.0),
            ),
        ],
        false,
    )?;
    sec.plot(
        file,
        "Per idle running sandbox: configured guest RAM, RSS, PSS and QEMU's memory beyond the guest RAM; a hibernated sandbox holds none",
    );
    sec.headline(format!(
        "an idle {} MiB sandbox: PSS {}, QEMU beyond guest RAM {}, idle CPU {} % ({}); this {}-core host holds ~{:.0} of them ({} binds)",
        size.memory_mib,
        fmt_bytes(m_pss),
        fmt_bytes(m_over),
        fmt_num(m_cpu),
        ctx.accel,
        cores,
        fits,
        bound
    ));
    env.stop();

    // ------------------------------------------------------------ 1,000 hibernated
    hibernated_many(ctx, args, size, sec).await
}

async fn hibernated_many(
    ctx: &Ctx,
    args: &Args,
    size: SandboxSize,
    sec: &mut Section,
) -> Result<()> {
    eprintln!("density: starting a daemon (builds its default template)");
    let d = BenchDaemon::start(ctx, "strata-bench-density-d-", 16, size, |_| {}).await?;
    let engine = d.app.service().engine().clone();
    let pool = d.root.join("data/pool");
    let qemus = || async {
        engine
            .live_vms()
            .await
            .map(|v| v.len())
            .map_err(|e| anyhow!("list the daemon's VMs: {e}"))
    };
    let q_before = qemus().await?;
    let avail_before = mem_available()?;
    let used_before = fs_used(&pool)?;
    let mut create = Samples::new();
    let mut ids = Vec::with_capacity(args.hibernated);
    let t_all = Instant::now();
    for i in 0..args.hibernated {
        let t0 = Instant::now();
        let v = d
            .http
            .expect(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"start": false, "labels": {"bench": "density"}})),
                201,
            )
            .await
            .with_context(|| format!("create hibernated #{i}"))?;
        create.push_dur(t0.elapsed());
        if v["state"] != "hibernated" || !v["pid"].is_null() {
            bail!("create with start=false answered {v}");
        }
        let id = v["id"]
            .as_str()
            .ok_or_else(|| anyhow!("no id in {v}"))?
            .to_owned();
        ids.push(id);
        if (i + 1).is_multiple_of(250) {
            eprintln!(
                "density: {} hibernated created ({:.1} s)",
                i + 1,
                t_all.elapsed().as_secs_f64()
            );
        }
    }
    let create_wall = t_all.elapsed().as_secs_f64();
    let q_after = qemus().await?;
    let avail_after = mem_available()?;
    let used_after = fs_used(&pool)?;

    // List them all, page by page.
    let mut pages = Samples::new();
    let mut listed = 0usize;
    let mut cursor: Option<String> = None;
    let t_list = Instant::now();
    loop {
        let mut path = "/v1/sandboxes?state=hibernated&label=bench%3Ddensity&limit=100".to_owned();
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let t0 = Instant::now();
        let v = d.http.expect(Method::GET, &path, None, 200).await?;
        pages.push_dur(t0.elapsed());
        let items = v["items"]
            .as_array()
            .ok_or_else(|| anyhow!("no items in the listing: {v}"))?;
        listed += items.len();
        if items.iter().any(|s| s["state"] != "hibernated") {
            bail!("a listed sandbox is not hibernated");
        }
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let list_ms = t_list.elapsed().as_secs_f64() * 1000.0;
    if listed != ids.len() {
        bail!(
            "listed {listed} hibernated sandboxes, created {}",
            ids.len()
        );
    }

    // One of them used: it wakes (the first start of a never-started sandbox).
    let first = ids.first().ok_or_else(|| anyhow!("no sandbox created"))?;
    let t0 = Instant::now();
    let (code, _) = d.http.exec_output(first, &["true"]).await?;
    let wake_ms = t0.elapsed().as_secs_f64() * 1000.0;
    if code != 0 {
        bail!("exec in a woken sandbox exited {code}");
    }
    let q_woken = qemus().await?;
    let snaps = d
        .http
        .expect(
            Method::GET,
            &format!("/v1/sandboxes/{}/snapshots", ids[ids.len() / 2]),
            None,
            200,
        )
        .await?;
    let excl = snaps["items"][0]["exclusive_bytes"].as_u64();

    let n = ids.len().max(1) as f64;
    let cs = create.summary();
    let ps = pages.summary();
    let mut t = Table::latency(
        format!(
            "{} sandboxes created hibernated and listed through the daemon (HTTP)",
            ids.len()
        ),
        &["wall time"],
    );
    t.latency_row(
        "POST /v1/sandboxes {\"start\": false}",
        &cs,
        vec![format!("{:.1} s", create_wall)],
    );
    t.latency_row(
        format!("GET /v1/sandboxes page of 100 ({} pages)", pages.len()),
        &ps,
        vec![fmt_ms(list_ms)],
    );
    sec.table(t);
    let pool_delta = used_after.saturating_sub(used_before) as f64;
    let mem_delta = avail_before as f64 - avail_after as f64;
    let mut f = Table::new(
        format!("What the {} hibernated sandboxes cost", ids.len()),
        &["", "before", "after", "per sandbox"],
    );
    f.row(vec![
        "QEMU processes of the daemon".into(),
        q_before.to_string(),
        q_after.to_string(),
        format!("{} started in all", q_after as i64 - q_before as i64),
    ]);
    f.row(vec![
        "host MemAvailable".into(),
        fmt_bytes(avail_before as f64),
        fmt_bytes(avail_after as f64),
        format!(
            "{} drop (negative: it rose; other work on this shared host included)",
            fmt_bytes(mem_delta / n)
        ),
    ]);
    f.row(vec![
        "pool bytes used".into(),
        fmt_bytes(used_before as f64),
        fmt_bytes(used_after as f64),
        fmt_bytes(pool_delta / n),
    ]);
    f.row(vec![
        "wake snapshot exclusive bytes (one sandbox)".into(),
        "".into(),
        excl.map(|b| fmt_bytes(b as f64))
            .unwrap_or_else(|| "not yet measured".into()),
        "".into(),
    ]);
    sec.table(f);
    sec.text(format!(
        "Then one of them was used (`exec true`): it woke from its wake snapshot with its first start (new identity) in {} \
         and the daemon's QEMU count went to {q_woken}. Before that, no QEMU was started for any of them ({q_before} → {q_after}).",
        fmt_ms(wake_ms)
    ));
    sec.headline(format!(
        "{} hibernated sandboxes created through the API in {:.1} s (p50 {}, p99 {} per create), listed in {} ({} pages, p99 {}); \
         {} QEMU processes started, {} of pool each, host MemAvailable change {} in all",
        ids.len(),
        create_wall,
        fmt_ms(cs.p50),
        fmt_ms(cs.p99),
        fmt_ms(list_ms),
        pages.len(),
        fmt_ms(ps.p99),
        q_after.saturating_sub(q_before),
        fmt_bytes(pool_delta / n),
        fmt_bytes(mem_delta),
    ));
    if let Value::Object(m) = &mut sec.data {
        m.insert(
            "hibernated_many".into(),
            json!({
                "n": ids.len(), "create_ms": create.0, "create_wall_s": create_wall,
                "list_page_ms": pages.0, "list_total_ms": list_ms, "listed": listed,
                "qemu_before": q_before, "qemu_after": q_after, "qemu_after_one_exec": q_woken,
                "mem_available_before": avail_before, "mem_available_after": avail_after,
                "pool_used_before": used_before, "pool_used_after": used_after,
                "first_exec_wake_ms": wake_ms, "wake_snapshot_exclusive_bytes": excl,
            }),
        );
    }
    d.stop();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let mi = "MemTotal:       16316412 kB\nMemAvailable:    1000 kB\n";
        assert_eq!(meminfo(mi, "MemAvailable"), Some(1000 * 1024));
        assert_eq!(meminfo(mi, "Mem"), None);
        let roll = "55d0-7ff [rollup]\nRss:              204800 kB\nPss:              102400 kB\nPss_Anon: 1 kB\n";
        assert_eq!(parse_rollup(roll), Some((200 << 20, 100 << 20)));
        let stat = "1234 (qemu-system-x86 (x)) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0 100 0";
        assert_eq!(parse_cpu_ticks(stat), Some(325));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn capacity_bounds() {
        let (m, c) = capacity(10 << 30, (256u64 << 20) as f64, 2, 5.0);
        assert_eq!((m, c), (40.0, 40.0));
        let (m, c) = capacity(1 << 30, 0.0, 2, 0.0);
        assert!(m.is_infinite() && c.is_infinite());
    }
}
