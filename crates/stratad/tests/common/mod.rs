//! Harness of the end-to-end tests: a real `stratad` process (its own data
//! dir, loop-mounted btrfs pool, short run dir under /tmp, `accel = tcg`,
//! the test image) and an HTTP client.
//!
//! Cleanup: every daemon is registered; at process exit (atexit, which runs
//! after libtest is done, pass or fail) and on drop, the daemon and the
//! QEMUs listed in `<run_dir>/*/qemu.pid` are killed by pid, the pool is
//! unmounted, its loop device detached and the directory removed.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use serde_json::{json, Value};

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

/// Whether `pid` runs and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// QEMU pids listed in `<run_dir>/*/qemu.pid` that are alive and really ours.
pub fn qemu_pids(run_dir: &Path) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(run_dir) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(text) = std::fs::read_to_string(e.path().join("qemu.pid")) else {
            continue;
        };
        let Ok(pid) = text.trim().parse::<u32>() else {
            continue;
        };
        if alive(pid) && cmdline(pid).contains(&run_dir.to_string_lossy().to_string()) {
            out.push((name, pid));
        }
    }
    out
}

fn sigkill(pid: u32) {
    // SAFETY: kill(2) on a pid this test started (daemon) or read from our run dir.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

fn wait_gone(pid: u32) {
    let t = Instant::now();
    while alive(pid) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills the daemon and its QEMUs, unmounts the pool, removes `root`.
fn cleanup(root: &Path, daemon_pid: Option<i32>) {
    if let Some(pid) = daemon_pid {
        if cmdline(pid as u32).contains("stratad") {
            sigkill(pid as u32);
            wait_gone(pid as u32);
        }
    }
    let run = root.join("run");
    for (_, pid) in qemu_pids(&run) {
        sigkill(pid);
        wait_gone(pid);
    }
    let mnt = root.join("data/pool");
    let mounted = std::fs::read_to_string("/proc/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(&mnt.to_string_lossy()))
        })
        .unwrap_or(false);
    if mounted {
        for _ in 0..50 {
            let ok = Command::new("umount")
                .arg(&mnt)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let img = root.join("data/pool.img");
    if let Ok(out) = Command::new("losetup").arg("-j").arg(&img).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(dev) = line.split(':').next() {
                let _ = Command::new("losetup").args(["-d", dev]).status();
            }
        }
    }
    let still = std::fs::read_to_string("/proc/mounts")
        .map(|m| m.contains(&*mnt.to_string_lossy()))
        .unwrap_or(false);
    if still {
        eprintln!("e2e cleanup: {} is still mounted", mnt.display());
    } else {
        let _ = std::fs::remove_dir_all(root);
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
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    child: Mutex<Option<Child>>,
    starts: Mutex<u32>,
    /// HTTP client.
    pub http: reqwest::Client,
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl Daemon {
    /// Starts a daemon with `extra` TOML appended to the test defaults
    /// (tcg, 256 MiB default size, a 6 GiB pool, no rolling snapshots, no
    /// idle hibernation unless a sandbox asks).
    pub fn start(extra: &str) -> Daemon {
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
        let run_dir = root.join("run");
        let port = free_port();
        let config = root.join("config.toml");
        let text = format!(
            r#"listen = "127.0.0.1:{port}"
data_dir = "{data}"
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
"#,
            data = root.join("data").display(),
            run = run_dir.display(),
            img = image.dir.display(),
        );
        std::fs::write(&config, text).expect("write config");
        let d = Daemon {
            root: root.clone(),
            run_dir,
            config,
            url: format!("http://127.0.0.1:{port}"),
            child: Mutex::new(None),
            starts: Mutex::new(0),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(180))
                .build()
                .expect("client"),
        };
        REGISTRY.lock().expect("registry").push(Registered {
            root: root.clone(),
            pid: None,
        });
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
        let child = Command::new(env!("CARGO_BIN_EXE_stratad"))
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
        std::fs::read_to_string(self.root.join("data/admin.token"))
            .ok()
            .map(|t| t.trim().to_owned())
    }

    /// A request builder for `method path`, with the admin token if any.
    pub fn request(&self, method: &str, path: &str) -> reqwest::RequestBuilder {
        let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let rb = self.http.request(m, format!("{}{path}", self.url));
        match self.token() {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// A request; returns the status and the JSON body (`null` if none).
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut rb = self.request(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let resp = rb
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.expect("body");
        let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, v)
    }

    /// A request with a raw body.
    pub async fn raw(&self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let resp = self
            .request(method, path)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.bytes().await.expect("body").to_vec())
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
        let t0 = Instant::now();
        let resp = self
            .request("POST", &format!("/v1/sandboxes/{id}/exec"))
            .json(&body)
            .send()
            .await
            .expect("exec request");
        let status = resp.status().as_u16();
        let mut out = Exec {
            status,
            ..Exec::default()
        };
        if status != 200 {
            out.error = resp.json().await.unwrap_or(Value::Null);
            return out;
        }
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        let b64 = base64::engine::general_purpose::STANDARD;
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.expect("exec stream"));
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let v: Value = serde_json::from_slice(&line).expect("ndjson line");
                let at = t0.elapsed();
                if let Some(s) = v["stdout"].as_str() {
                    out.stdout.extend(b64.decode(s).expect("b64"));
                    out.stdout_at.push(at);
                } else if let Some(s) = v["stderr"].as_str() {
                    out.stderr.extend(b64.decode(s).expect("b64"));
                } else if v.get("exit").is_some() {
                    out.code = v["exit"]["code"].as_i64();
                    out.exit_at = Some(at);
                } else {
                    out.error = v;
                }
            }
        }
        out
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

/// The outcome of an exec through the API.
#[derive(Debug, Default)]
pub struct Exec {
    /// HTTP status.
    pub status: u16,
    /// Exit code.
    pub code: Option<i64>,
    /// Collected stdout.
    pub stdout: Vec<u8>,
    /// Collected stderr.
    pub stderr: Vec<u8>,
    /// When each stdout line arrived (since the request).
    pub stdout_at: Vec<Duration>,
    /// When the exit line arrived.
    pub exit_at: Option<Duration>,
    /// Error body (non-200) or error line.
    pub error: Value,
}

impl Exec {
    /// Stdout as trimmed text.
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).trim().to_owned()
    }
}
