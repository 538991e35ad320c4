//! Section `sdk` (opt-in: `strata-bench --only sdk`, not in the default run
//! nor the smoke run: it needs the `e2b` package from PyPI): what an agent
//! written for E2B sees, beside strata's own API, on one daemon in one run.
//!
//! A `stratad` process (the binary with the E2B door, `[e2b] enabled`) on a
//! loopback port, real guests of the run's image. Then, with `--sdk-n`
//! iterations each after one untimed warm-up:
//!
//! - **E2B SDK** (the unmodified Python `e2b` package, driven by
//!   `crates/strata-e2b/tests/python/bench.py`): `Sandbox.create()` → first
//!   `commands.run("true")`, and `sandbox.fork(count=4)` of one running
//!   parent (the call's return: four running sandboxes);
//! - **strata /v1** (this process, HTTP): `POST /v1/sandboxes` → first
//!   `POST /v1/sandboxes/{id}/exec ["true"]`, and four
//!   `POST /v1/sandboxes/{id}/fork` one after the other (what the door does
//!   for a count of 4; two forks of one source cannot overlap: 409).
//!
//! Every sandbox is deleted after its sample (not timed). The SDK side pays
//! what a user of the SDK pays (its HTTP client, envd's Connect protocol, the
//! door's mapping), which is the point of the comparison.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use reqwest::Method;
use serde_json::{json, Value};
use strata_testkit::teardown::{remove_daemon_root, sigkill, wait_gone};
use strata_testkit::Api;

use crate::ctx::Ctx;
use crate::plot;
use crate::report::{Section, Table};
use crate::stats::{fmt_ms, Samples, Summary};

/// The `e2b` version of the Python SDK (the one `run-python.sh` pins).
const E2B_PY: &str = "2.63.0";
/// The venv `run-python.sh` makes; reused (and made when missing).
const DEFAULT_VENV: &str = "/tmp/strata-e2b-venv";
/// The door's API key (E2B's format: `e2b_` + 40 hex).
const API_KEY: &str = "e2b_5d0c0ffee5d0c0ffee5d0c0ffee5d0c0ffee5d0c";

/// Flags of the `sdk` section.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "sdk-args")]
pub struct Args {
    /// Timed iterations of each case (after one warm-up).
    #[arg(long = "sdk-n", default_value_t = 20)]
    pub n: usize,
    /// Forks per fork call.
    #[arg(long = "sdk-forks", default_value_t = 4)]
    pub forks: usize,
    /// Guest memory of every sandbox, MiB.
    #[arg(long = "sdk-memory-mib", default_value_t = 256)]
    pub memory_mib: u64,
    /// Python with the `e2b` package [default: the venv of run-python.sh,
    /// $VENV or /tmp/strata-e2b-venv, made with e2b from PyPI when missing].
    #[arg(long = "sdk-python")]
    pub python: Option<PathBuf>,
}

impl Args {
    /// Shrinks the counts to the CI smoke size.
    pub fn smoke(&mut self) {
        self.n = self.n.min(2);
        self.forks = self.forks.min(2);
    }
}

/// The daemon process; killed, its VMs killed and its pool unmounted on drop.
pub(crate) struct Door {
    pub(crate) root: PathBuf,
    pub(crate) url: String,
    pub(crate) api: Api,
    child: Child,
}

impl Drop for Door {
    fn drop(&mut self) {
        let pid = self.child.id();
        // SAFETY: kill(2) with a pid this process spawned and has not reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        if !wait_gone(pid, Duration::from_secs(10)) {
            sigkill(pid);
        }
        let _ = self.child.wait();
        remove_daemon_root(&self.root);
    }
}

impl Door {
    async fn start(ctx: &Ctx, memory_mib: u64) -> Result<Door> {
        Self::start_with(ctx, memory_mib, "", "").await
    }

    /// [`Door::start`] with lines added to its `[security]` table and
    /// tables appended at the end of its configuration.
    pub(crate) async fn start_with(
        ctx: &Ctx,
        memory_mib: u64,
        security: &str,
        tail: &str,
    ) -> Result<Door> {
        // Built (when stale) before anything is made that would need removing.
        let bin = strata_testkit::stratad_bin();
        let root = tempfile::Builder::new()
            .prefix("sbsdk")
            .tempdir_in("/tmp")
            .context("daemon root")?
            .keep();
        let port = strata_testkit::free_port();
        let config = root.join("config.toml");
        let text = format!(
            r#"listen = "127.0.0.1:{port}"
data_dir = "{data}"
run_dir = "{run}"
image_dir = "{img}"
accel = "{accel}"
qemu_binary = "{qemu}"
pool_size_gib = 16
snapshot_interval = "0s"
idle_timeout = "0s"

[security]
rate_limit_per_second = 0.0
{security}

[e2b]
enabled = true
api_keys = ["{API_KEY}"]
rate_limit_per_second = 0.0
auth_failures_per_minute = 0

[default_size]
vcpus = 1
memory_mib = {memory_mib}
disk_gib = 2

[pools]
default_template = 0

{tail}
"#,
            data = root.join("data").display(),
            run = root.join("run").display(),
            img = ctx.image.display(),
            accel = ctx.accel,
            qemu = ctx.qemu.display(),
        );
        let spawn = || -> Result<Child> {
            std::fs::write(&config, text).context("daemon config")?;
            let log = std::fs::File::create(root.join("stratad.log")).context("daemon log")?;
            Command::new(&bin)
                .arg("--config")
                .arg(&config)
                .env("RUST_LOG", "info")
                .env("NO_COLOR", "1")
                .stdin(Stdio::null())
                .stdout(log.try_clone().context("daemon log")?)
                .stderr(log)
                .spawn()
                .context("start stratad")
        };
        let child = match spawn() {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&root);
                return Err(e);
            }
        };
        let url = format!("http://127.0.0.1:{port}");
        let api = Api::with_client(
            url.clone(),
            reqwest::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .context("HTTP client")?,
        )
        .token_file(root.join("data/admin.token"));
        let door = Door {
            root,
            url,
            api,
            child,
        };
        let t = Instant::now();
        loop {
            let ready = match door
                .api
                .json(Method::GET, "/v1/templates/tpl-default", None)
                .await
            {
                Ok((200, v)) if v["status"] == "ready" => true,
                Ok((_, v)) if v["status"] == "failed" => bail!("default template: {v}"),
                _ => false,
            };
            if ready {
                break;
            }
            if t.elapsed() > Duration::from_secs(600) {
                bail!(
                    "no ready default template after 10 min: {}",
                    door.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(door)
    }

    pub(crate) fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.root.join("stratad.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    async fn post(&self, path: &str, body: Value, want: u16) -> Result<Value> {
        self.api
            .expect(Method::POST, path, Some(body), want)
            .await
            .map_err(|e| anyhow!("{e}"))
    }

    async fn delete(&self, id: &str) -> Result<()> {
        self.api
            .expect(Method::DELETE, &format!("/v1/sandboxes/{id}"), None, 200)
            .await
            .map_err(|e| anyhow!("{e}"))?;
        Ok(())
    }

    async fn create(&self) -> Result<String> {
        let v = self
            .post(
                "/v1/sandboxes",
                json!({"labels": {"suite": "strata-bench-sdk"}}),
                201,
            )
            .await?;
        id_of(&v)
    }

    async fn fork(&self, parent: &str) -> Result<String> {
        let v = self
            .post(&format!("/v1/sandboxes/{parent}/fork"), json!({}), 201)
            .await?;
        id_of(&v)
    }
}

fn id_of(v: &Value) -> Result<String> {
    v["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("no id in {v}"))
}

/// A Python that imports `e2b` at [`E2B_PY`]: `--sdk-python`, else the
/// run-python.sh venv (made as run-python.sh makes it when missing).
fn python(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.python {
        return Ok(p.clone());
    }
    let venv = std::env::var_os("VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_VENV));
    let py = venv.join("bin/python");
    let check = format!(
        "import importlib.metadata as m, sys; sys.exit(0 if m.version('e2b') == '{E2B_PY}' else 1)"
    );
    let ok = |py: &Path| {
        Command::new(py)
            .args(["-c", &check])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if ok(&py) {
        return Ok(py);
    }
    eprintln!(
        "sdk: making the virtualenv {} (e2b=={E2B_PY})",
        venv.display()
    );
    let st = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .context("python3 -m venv")?;
    if !st.success() {
        bail!("python3 -m venv {}: {st}", venv.display());
    }
    let st = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", &format!("e2b=={E2B_PY}"), "pytest"])
        .status()
        .context("pip install e2b")?;
    if !st.success() || !ok(&py) {
        bail!("pip install e2b=={E2B_PY} into {}: {st}", venv.display());
    }
    Ok(py)
}

/// The SDK side: bench.py's samples.
struct SdkSamples {
    create: Samples,
    first: Samples,
    total: Samples,
    fork: Samples,
}

async fn run_sdk(door: &Door, py: &Path, args: &Args) -> Result<SdkSamples> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../strata-e2b/tests/python/bench.py");
    let mut cmd = tokio::process::Command::new(py);
    cmd.arg(&script)
        .arg(args.n.to_string())
        .args([
            "--forks",
            &args.forks.to_string(),
            "--warmup",
            "1",
            "--json",
        ])
        .env("E2B_API_URL", &door.url)
        .env("E2B_SANDBOX_URL", &door.url)
        .env("E2B_API_KEY", API_KEY)
        .env("E2B_DEBUG", "false")
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_ACCESS_TOKEN")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let out = cmd.output().await.context("run bench.py")?;
    if !out.status.success() {
        bail!("bench.py: {}; daemon log:\n{}", out.status, door.log_tail());
    }
    let v: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("bench.py output: {}", String::from_utf8_lossy(&out.stdout)))?;
    let get = |k: &str| -> Result<Samples> {
        let a = v[k]
            .as_array()
            .ok_or_else(|| anyhow!("bench.py: no {k} in {v}"))?;
        Ok(Samples(a.iter().filter_map(Value::as_f64).collect()))
    };
    Ok(SdkSamples {
        create: get("create_ms")?,
        first: get("first_run_ms")?,
        total: get("create_run_ms")?,
        fork: get("fork_ms")?,
    })
}

/// The /v1 side.
struct ApiSamples {
    create: Samples,
    first: Samples,
    total: Samples,
    fork_seq: Samples,
}

async fn run_api(door: &Door, args: &Args) -> Result<ApiSamples> {
    let mut s = ApiSamples {
        create: Samples::new(),
        first: Samples::new(),
        total: Samples::new(),
        fork_seq: Samples::new(),
    };
    for i in 0..=args.n {
        let t0 = Instant::now();
        let id = door.create().await?;
        let t1 = Instant::now();
        let (code, _) = door
            .api
            .exec_output(&id, &["true"])
            .await
            .map_err(|e| anyhow!("{e}"))?;
        let t2 = Instant::now();
        door.delete(&id).await?;
        if code != 0 {
            bail!("exec true exited {code}");
        }
        if i > 0 {
            s.create.push_dur(t1 - t0);
            s.first.push_dur(t2 - t1);
            s.total.push_dur(t2 - t0);
        }
    }
    let parent = door.create().await?;
    let res = async {
        for i in 0..=args.n {
            let t0 = Instant::now();
            let mut ids = Vec::new();
            let mut err = None;
            for _ in 0..args.forks {
                match door.fork(&parent).await {
                    Ok(id) => ids.push(id),
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
            let dt = t0.elapsed();
            for id in &ids {
                door.delete(id).await?;
            }
            if let Some(e) = err {
                return Err(e);
            }
            if i > 0 {
                s.fork_seq.push_dur(dt);
            }
        }
        Ok(())
    }
    .await;
    door.delete(&parent).await?;
    res?;
    Ok(s)
}

fn ratio(sdk: &Summary, api: &Summary) -> String {
    format!("{:.2}×", sdk.p50 / api.p50)
}

/// Measures and fills `sec`.
pub async fn run(ctx: &Ctx, args: &Args, sec: &mut Section) -> Result<()> {
    if args.n == 0 || args.forks == 0 {
        bail!("--sdk-n and --sdk-forks must be at least 1");
    }
    let py = python(args)?;
    let t = Instant::now();
    let door = Door::start(ctx, args.memory_mib).await?;
    eprintln!(
        "sdk: daemon {} ({}) ready in {:.0} s, python {}",
        door.url,
        door.root.display(),
        t.elapsed().as_secs_f64(),
        py.display()
    );
    let t = Instant::now();
    let sdk = run_sdk(&door, &py, args).await?;
    eprintln!("sdk: SDK side in {:.0} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let api = run_api(&door, args).await?;
    eprintln!("sdk: /v1 side in {:.0} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    drop(door);
    eprintln!("sdk: daemon stopped in {:.0} s", t.elapsed().as_secs_f64());

    let f = args.forks;
    let mut t = Table::latency(
        format!(
            "E2B SDK (Python e2b {E2B_PY}) beside strata's /v1, same daemon; {} timed runs each after one warm-up; ratio = SDK p50 / /v1 p50",
            args.n
        ),
        &["ratio"],
    );
    let rows = [
        (
            "create".to_owned(),
            &sdk.create,
            "create".to_owned(),
            &api.create,
        ),
        (
            "first command".into(),
            &sdk.first,
            "first exec".into(),
            &api.first,
        ),
        (
            "create → first command".into(),
            &sdk.total,
            "create → first exec".into(),
            &api.total,
        ),
        (
            format!("fork(count={f})"),
            &sdk.fork,
            format!("{f} forks, one after the other"),
            &api.fork_seq,
        ),
    ];
    for (sn, sdk_s, an, api_s) in rows {
        let (ss, aa) = (sdk_s.summary(), api_s.summary());
        t.latency_row(format!("SDK: {sn}"), &ss, vec![ratio(&ss, &aa)]);
        t.latency_row(format!("/v1: {an}"), &aa, vec!["1×".into()]);
    }
    sec.table(t);

    let file = "sdk-cdf.svg";
    plot::cdf(
        &ctx.file(file),
        "E2B SDK vs strata /v1",
        "ms",
        &[
            ("SDK create → first command".into(), sdk.total.0.clone()),
            ("/v1 create → first exec".into(), api.total.0.clone()),
            (format!("SDK fork(count={f})"), sdk.fork.0.clone()),
            (format!("/v1 {f} forks"), api.fork_seq.0.clone()),
        ],
    )
    .map_err(|e| anyhow!("plot: {e}"))?;
    sec.plot(
        file,
        "CDF of the SDK's and /v1's create → first command and forks",
    );

    let (st, at) = (sdk.total.summary(), api.total.summary());
    let (sf, af) = (sdk.fork.summary(), api.fork_seq.summary());
    sec.headline(format!(
        "create → first command: SDK p50 {} p99 {} vs /v1 p50 {} p99 {} ({}); fork(count={f}): SDK p50 {} p99 {} vs /v1 p50 {} p99 {} ({}); n={}, {}",
        fmt_ms(st.p50),
        fmt_ms(st.p99),
        fmt_ms(at.p50),
        fmt_ms(at.p99),
        ratio(&st, &at),
        fmt_ms(sf.p50),
        fmt_ms(sf.p99),
        fmt_ms(af.p50),
        fmt_ms(af.p99),
        ratio(&sf, &af),
        args.n,
        ctx.accel,
    ));
    sec.text(format!(
        "The SDK side is the unmodified Python `e2b` package (bench.py) against the daemon's E2B door; the /v1 side is this process over HTTP to the same daemon, right after. A fork with count {f} through the door is {f} strata forks one after the other, so the /v1 row beside it does the same (forks of one source cannot overlap: a second one while one runs answers 409 `conflict`). Guests: 1 vCPU, {} MiB, under {}.",
        args.memory_mib, ctx.accel
    ));
    sec.data = json!({
        "params": { "n": args.n, "forks": f, "memory_mib": args.memory_mib, "e2b": E2B_PY, "accel": ctx.accel.to_string() },
        "sdk": { "create_ms": sdk.create.0, "first_ms": sdk.first.0, "create_first_ms": sdk.total.0, "fork_ms": sdk.fork.0 },
        "v1": { "create_ms": api.create.0, "first_ms": api.first.0, "create_first_ms": api.total.0, "fork_seq_ms": api.fork_seq.0 },
    });
    Ok(())
}
