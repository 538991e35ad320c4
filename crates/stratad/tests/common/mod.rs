//! Harness of the end-to-end tests: a real `stratad` process (its own data
//! dir and key dir, loop-mounted btrfs pool, short run dir under /tmp, `accel = tcg`,
//! the test image) and a client of its API (`strata_testkit::Api`, with the
//! admin token the daemon writes on its first start).
//!
//! Cleanup: every daemon is registered; at process exit (atexit, which runs
//! after libtest is done, pass or fail) and on drop, the daemon and the
//! QEMUs listed in `<run_dir>/*/qemu.pid` are killed by pid, the pool is
//! unmounted, its loop device detached and the directory removed
//! (`strata_testkit::teardown`).

#![allow(dead_code)]

pub mod cluster;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_testkit::teardown::{cmdline, remove_daemon_root, sigkill, wait_gone};
use strata_testkit::{error_chain, Api, Exec};

/// What cleanup needs of one daemon.
#[derive(Debug, Clone)]
struct Registered {
    root: PathBuf,
    pid: Option<i32>,
}

static REGISTRY: Mutex<Vec<Registered>> = Mutex::new(Vec::new());
static ATEXIT: Once = Once::new();

extern "C" fn cleanup_all() {
    let all: Vec<Registered> = REGISTRY
        .lock()
        .map(|mut g| std::mem::take(&mut *g))
        .unwrap_or_default();
    for r in all {
        cleanup(&r.root, r.pid);
    }
}

/// Kills the daemon (when `daemon_pid` still runs it) and its QEMUs,
/// unmounts the pool, removes `root`.
fn cleanup(root: &std::path::Path, daemon_pid: Option<i32>) {
    if let Some(pid) = daemon_pid {
        let pid = pid as u32;
        if cmdline(pid).contains("stratad") {
            sigkill(pid);
            wait_gone(pid, Duration::from_secs(10));
        }
    }
    unmount_fixtures(root);
    remove_daemon_root(root);
}

/// `<root>/fixture-mounts`: mount points a test set up under a daemon's
/// root before it started ([`Daemon::start_on`]), one a line; at cleanup,
/// once the QEMUs are gone, each is unmounted (last first; `<mp>.img`
/// beside it is a loop-mounted image whose loop device is detached).
pub const FIXTURE_MOUNTS: &str = "fixture-mounts";

fn unmount_fixtures(root: &std::path::Path) {
    let Ok(text) = std::fs::read_to_string(root.join(FIXTURE_MOUNTS)) else {
        return;
    };
    strata_testkit::teardown::kill_qemus(&root.join("run"));
    for mp in text.lines().rev().filter(|l| !l.is_empty()) {
        let mp = PathBuf::from(mp);
        let img = mp.with_extension("img");
        let r = if img.exists() {
            strata_storage::unmount_image(&mp, &img, Duration::from_secs(10))
                .map_err(|e| e.to_string())
        } else {
            Command::new("umount")
                .arg(&mp)
                .status()
                .map_err(|e| e.to_string())
                .and_then(|s| s.success().then_some(()).ok_or(format!("umount: {s}")))
        };
        if let Err(e) = r {
            eprintln!("test cleanup: {} stays mounted: {e}", mp.display());
        }
    }
}

/// A `stratad` child process and its directories.
#[derive(Debug)]
pub struct Daemon {
    /// `/tmp/stratad-e2e-XXXXXX`.
    pub root: PathBuf,
    /// `<root>/run`.
    pub run_dir: PathBuf,
    /// `<root>/config.toml`.
    pub config: PathBuf,
    /// `http://<ip>:<port>` (127.0.0.1 unless [`Launch::ip`]).
    pub url: String,
    child: Mutex<Option<Child>>,
    starts: Mutex<u32>,
    /// A client of its API with the admin token (once the daemon wrote it).
    pub api: Api,
    /// [`Launch::wrapper`].
    wrapper: Vec<String>,
}

/// How [`Daemon::start_in`] runs a daemon.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The address it listens on and is reached at (default 127.0.0.1).
    pub ip: std::net::IpAddr,
    /// A program and its arguments run with `stratad --config …` appended
    /// (empty: `stratad` itself). It must exec `stratad` in place (same
    /// pid), as `nsenter --net=/run/netns/NAME` does.
    pub wrapper: Vec<String>,
}

impl Default for Launch {
    fn default() -> Self {
        Launch {
            ip: std::net::Ipv4Addr::LOCALHOST.into(),
            wrapper: Vec::new(),
        }
    }
}

/// Copies `from_root`'s bootstrap admin token and master key into the fresh
/// daemon root `root` (what a second host of a cluster starts with:
/// [`Daemon::start_sharing`]).
pub fn share_keys(from_root: &std::path::Path, root: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    for (from, to) in [("data/admin.token", "data"), ("keys/master.key", "keys")] {
        let dir = root.join(to);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let name = std::path::Path::new(from).file_name().expect("name");
        std::fs::copy(from_root.join(from), dir.join(name)).expect("copy from the first daemon");
    }
}

impl Daemon {
    /// Starts a daemon with `extra` TOML appended to the test defaults
    /// (tcg, 256 MiB default size, a 6 GiB pool, no rolling snapshots, no
    /// idle hibernation unless a sandbox asks, no warm pools unless `extra`
    /// has a `[pools]` table).
    pub fn start(extra: &str) -> Daemon {
        Self::start_on(extra, |_| {})
    }

    /// [`Daemon::start`] of a second daemon on `first`'s database (a
    /// cluster host): it starts with `first`'s bootstrap admin token (the
    /// shared security store makes no second one) and its master key (as
    /// docs/keys.md asks of daemons sharing a database).
    pub fn start_sharing(extra: &str, first: &Daemon) -> Daemon {
        let from_root = first.root.clone();
        Self::start_on(extra, move |root| share_keys(&from_root, root))
    }

    /// [`Daemon::start`], with `prepare` run on the fresh root before the
    /// daemon starts (to mount something under it: list such mounts in
    /// `<root>/`[`FIXTURE_MOUNTS`] so that cleanup unmounts them).
    pub fn start_on(extra: &str, prepare: impl FnOnce(&std::path::Path)) -> Daemon {
        Self::start_in(extra, Launch::default(), prepare)
    }

    /// [`Daemon::start_on`], launched as `launch` says (another address,
    /// a command around `stratad`, e.g. to enter a network namespace).
    pub fn start_in(extra: &str, launch: Launch, prepare: impl FnOnce(&std::path::Path)) -> Daemon {
        ATEXIT.call_once(|| {
            // SAFETY: registers a plain extern "C" fn without captures.
            unsafe { libc::atexit(cleanup_all) };
        });
        let image = strata_testkit::test_image();
        let root = tempfile::Builder::new()
            .prefix("stratad-e2e-")
            .tempdir_in("/tmp")
            .expect("scratch dir")
            .keep();
        REGISTRY.lock().expect("registry").push(Registered {
            root: root.clone(),
            pid: None,
        });
        prepare(&root);
        let extra = &extra.replace("{root}", &root.display().to_string());
        let run_dir = root.join("run");
        let port = strata_testkit::free_port();
        let config = root.join("config.toml");
        let text = format!(
            r#"listen = "{ip}:{port}"
data_dir = "{data}"
key_dir = "{keys}"
run_dir = "{run}"
image_dir = "{img}"
accel = "tcg"
pool_size_gib = 6
snapshot_interval = "0s"
idle_timeout = "0s"
agent_timeout = "60s"
{extra}
[default_size]
vcpus = 1
memory_mib = 256
disk_gib = 2
{pools}{capacity}{pressure}"#,
            // No warm guests unless a test asks (`[pools]` in `extra`): they
            // would be VMs no sandbox owns.
            pools = if extra.contains("[pools]") {
                ""
            } else {
                "[pools]\ndefault_template = 0\n"
            },
            // Admission by nominal sizes and no pressure-driven hibernation
            // unless a test asks: other test binaries' guests share this
            // host's CPUs, and a test's expectations should not move with them.
            capacity = if extra.contains("[capacity]") {
                ""
            } else {
                "[capacity]\nadmission = \"nominal\"\n"
            },
            pressure = if extra.contains("[pressure]") {
                ""
            } else {
                "[pressure]\nenabled = false\n"
            },
            data = root.join("data").display(),
            // Each daemon its own deployment key (as separate hosts).
            keys = root.join("keys").display(),
            run = run_dir.display(),
            img = image.dir.display(),
            ip = launch.ip,
        );
        std::fs::write(&config, text).expect("write config");
        let d = Daemon {
            root: root.clone(),
            run_dir,
            config,
            url: format!("http://{}:{port}", launch.ip),
            child: Mutex::new(None),
            starts: Mutex::new(0),
            api: Api::with_client(
                format!("http://{}:{port}", launch.ip),
                reqwest::Client::builder()
                    .timeout(Duration::from_secs(180))
                    .build()
                    .expect("client"),
            )
            .token_file(root.join("data/admin.token")),
            wrapper: launch.wrapper,
        };
        d.spawn();
        d
    }

    /// Log file of the n-th start (1-based).
    pub fn log(&self, n: u32) -> PathBuf {
        self.root.join(format!("stratad.{n}.log"))
    }

    /// Everything the daemon logged, all starts.
    pub fn logs(&self) -> String {
        let n = *self.starts.lock().expect("starts");
        (1..=n)
            .map(|i| std::fs::read_to_string(self.log(i)).unwrap_or_default())
            .collect()
    }

    fn spawn(&self) {
        let mut starts = self.starts.lock().expect("starts");
        *starts += 1;
        let log = std::fs::File::create(self.log(*starts)).expect("log file");
        let mut cmd = match self.wrapper.split_first() {
            Some((prog, args)) => {
                let mut c = Command::new(prog);
                c.args(args).arg(strata_testkit::stratad_bin());
                c
            }
            None => Command::new(strata_testkit::stratad_bin()),
        };
        let child = cmd
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn stratad");
        let pid = child.id() as i32;
        for r in REGISTRY.lock().expect("registry").iter_mut() {
            if r.root == self.root {
                r.pid = Some(pid);
            }
        }
        *self.child.lock().expect("child") = Some(child);
        let t = Instant::now();
        loop {
            if std::net::TcpStream::connect(self.url.trim_start_matches("http://")).is_ok() {
                break;
            }
            if let Some(c) = self.child.lock().expect("child").as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("stratad exited ({st}):\n{}", self.logs());
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "stratad did not listen:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child
            .lock()
            .expect("child")
            .as_ref()
            .map(|c| c.id())
            .expect("daemon running")
    }

    /// `kill -9` of the daemon (its VMs keep running).
    pub fn kill9(&self) {
        if let Some(mut c) = self.child.lock().expect("child").take() {
            sigkill(c.id());
            let _ = c.wait();
        }
        for r in REGISTRY.lock().expect("registry").iter_mut() {
            if r.root == self.root {
                r.pid = None;
            }
        }
    }

    /// `SIGTERM` to the daemon, waited for (a graceful stop: it ends its
    /// warm guests; sandboxes' VMs keep running).
    pub fn stop(&self) {
        if let Some(mut c) = self.child.lock().expect("child").take() {
            // SAFETY: kill(2) on the pid of our own child, not yet reaped.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let t = Instant::now();
            while !matches!(c.try_wait(), Ok(Some(_))) {
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "stratad did not stop on SIGTERM"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        for r in REGISTRY.lock().expect("registry").iter_mut() {
            if r.root == self.root {
                r.pid = None;
            }
        }
    }

    /// Starts the daemon again after [`Daemon::stop`] or [`Daemon::kill9`].
    pub fn start_again(&self) {
        self.spawn();
    }

    /// Starts the daemon again on the same directories.
    pub fn restart(&self) {
        self.kill9();
        self.spawn();
    }

    /// Kills everything and unmounts (also done at exit).
    pub fn shutdown(&self) {
        self.kill9();
        REGISTRY
            .lock()
            .expect("registry")
            .retain(|r| r.root != self.root);
        cleanup(&self.root, None);
    }

    /// The bootstrap admin token the daemon wrote on first start (auth on).
    pub fn token(&self) -> Option<String> {
        self.api.token()
    }

    /// A request builder for `method path`, with the admin token if any.
    pub fn request(&self, method: &str, path: &str) -> reqwest::RequestBuilder {
        self.api.req(method_of(method), path)
    }

    /// A request; returns the status and the JSON body (`null` if none).
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.api
            .json(method_of(method), path, body)
            .await
            .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
    }

    /// A request with a raw body.
    pub async fn raw(&self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        self.api
            .raw(method_of(method), path, body)
            .await
            .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
    }

    /// A new token of `role` in `tenant` (made with the admin token): a
    /// client holding it, and the token itself.
    pub async fn tenant_token(&self, tenant: &str, role: &str) -> (Api, String) {
        let v = self
            .ok(
                "POST",
                "/v1/tokens",
                Some(json!({ "role": role, "tenant": tenant, "name": format!("{tenant}-{role}") })),
                201,
            )
            .await;
        let t = v["token"].as_str().expect("token").to_owned();
        (Api::new(self.url.clone()).bearer(&t), t)
    }

    /// Asserts `status` and returns the body.
    pub async fn ok(&self, method: &str, path: &str, body: Option<Value>, want: u16) -> Value {
        let (s, v) = self.call(method, path, body).await;
        assert_eq!(s, want, "{method} {path}: {v}");
        v
    }

    /// Creates a sandbox (from the default template unless `body` names one).
    pub async fn create(&self, body: Value) -> String {
        let v = self.ok("POST", "/v1/sandboxes", Some(body), 201).await;
        assert_eq!(v["state"], "running", "{v}");
        v["id"].as_str().expect("id").to_owned()
    }

    /// Runs a command through the API.
    pub async fn exec(&self, id: &str, cmd: &[&str]) -> Exec {
        self.exec_body(id, json!({ "cmd": cmd })).await
    }

    /// Runs `sh -c script`.
    pub async fn sh(&self, id: &str, script: &str) -> Exec {
        self.exec(id, &["sh", "-c", script]).await
    }

    /// Runs a command with a full exec body; records when each line came.
    pub async fn exec_body(&self, id: &str, body: Value) -> Exec {
        self.api
            .exec(id, body)
            .await
            .unwrap_or_else(|e| panic!("{}", error_chain(&e)))
    }

    /// Polls `GET /v1/sandboxes/{id}` until `pred` holds (or panics after `max`).
    pub async fn wait_for(&self, id: &str, max: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let t = Instant::now();
        loop {
            let (_, v) = self.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
            if pred(&v) {
                return v;
            }
            assert!(t.elapsed() < max, "timed out waiting on {id}: last {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Warm guests ready, all pools (the operator's `/v1/stats`).
    pub async fn warm_ready(&self) -> u64 {
        let v = self.ok("GET", "/v1/stats", None, 200).await;
        v["warm_pools"]
            .as_array()
            .unwrap_or_else(|| panic!("no warm_pools in {v}"))
            .iter()
            .map(|p| p["ready"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Waits until exactly `want` warm guests are ready (or panics after `max`).
    pub async fn wait_warm(&self, want: u64, max: Duration) {
        let t = Instant::now();
        loop {
            let n = self.warm_ready().await;
            if n == want {
                return;
            }
            assert!(
                t.elapsed() < max,
                "{n} warm guests ready, want {want} after {max:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until the default template is ready.
    pub async fn wait_template(&self) {
        let t = Instant::now();
        loop {
            let (s, v) = self.call("GET", "/v1/templates/tpl-default", None).await;
            if s == 200 && v["status"] == "ready" {
                return;
            }
            assert!(
                s == 200 && v["status"] == "building" && t.elapsed() < Duration::from_secs(240),
                "default template: {s} {v}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn method_of(method: &str) -> reqwest::Method {
    reqwest::Method::from_bytes(method.as_bytes()).expect("method")
}
