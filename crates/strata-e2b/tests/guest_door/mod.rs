//! Shared harness of the E2B door's real-guest tests (`ports.rs`, `tls.rs`):
//! a `stratad` process with the door on (`[e2b] enabled`, the given keys,
//! no rate limits), a TCG guest of the test image behind it, and `/v1`
//! helpers. Dropped, the daemon is killed by pid and waited for, and its
//! root removed with its QEMUs and pool (`strata_testkit::teardown`) unless
//! [`GuestDoor::kill_keep_root`] kept it for a restart.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)] // test code

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_testkit::teardown::{remove_daemon_root, sigkill, wait_gone};
use strata_testkit::Api;

/// A daemon with the E2B door, on a plain port (and a TLS one if asked).
pub struct GuestDoor {
    /// Its scratch root (`data/`, `run/`, `config.toml`, `stratad.log`).
    pub root: PathBuf,
    /// The plain listener's port.
    pub port: u16,
    /// The `--e2b-tls-listen` port, when started with TLS.
    pub tls_port: Option<u16>,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// A `/v1` client with the admin token.
    pub api: Api,
    child: Child,
    keep_root: bool,
}

fn wait_listen(port: u16, root: &Path) {
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "stratad did not listen on {port}: {}",
            std::fs::read_to_string(root.join("stratad.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl GuestDoor {
    /// A daemon on `root` (a new `/tmp/<prefix>XXXXXX` when `None`) whose
    /// door accepts `keys` (`[e2b] api_keys` entries), with a TLS listener
    /// on a second port when `tls`.
    pub fn start(prefix: &str, root: Option<PathBuf>, keys: &[&str], tls: bool) -> GuestDoor {
        let image = strata_testkit::test_image();
        let root = root.unwrap_or_else(|| {
            tempfile::Builder::new()
                .prefix(prefix)
                .tempdir_in("/tmp")
                .unwrap()
                .keep()
        });
        let port = strata_testkit::free_port();
        let tls_port = tls.then(|| loop {
            let p = strata_testkit::free_port();
            if p != port {
                break p;
            }
        });
        let keys: Vec<String> = keys.iter().map(|k| format!("{k:?}")).collect();
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

[e2b]
enabled = true
api_keys = [{keys}]
rate_limit_per_second = 0.0
auth_failures_per_minute = 0

[default_size]
vcpus = 1
memory_mib = 256
disk_gib = 2

[pools]
default_template = 0

# Not what these tests are about: sizes admit, nothing hibernates for
# pressure (other test daemons' guests are this host's other load).
[capacity]
admission = "nominal"

[pressure]
enabled = false
"#,
            data = root.join("data").display(),
            run = root.join("run").display(),
            img = image.dir.display(),
            keys = keys.join(", "),
        );
        std::fs::write(&config, text).unwrap();
        // Appended: a restart on the same root keeps the earlier log.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(root.join("stratad.log"))
            .unwrap();
        let mut cmd = Command::new(strata_testkit::stratad_bin());
        cmd.arg("--config").arg(&config);
        if let Some(p) = tls_port {
            cmd.arg("--e2b-tls-listen").arg(format!("127.0.0.1:{p}"));
        }
        let child = cmd
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        wait_listen(port, &root);
        if let Some(p) = tls_port {
            wait_listen(p, &root);
        }
        let url = format!("http://127.0.0.1:{port}");
        let api = Api::with_client(
            url.clone(),
            reqwest::Client::builder()
                .timeout(Duration::from_secs(180))
                .build()
                .unwrap(),
        )
        .token_file(root.join("data/admin.token"));
        GuestDoor {
            root,
            port,
            tls_port,
            url,
            api,
            child,
            keep_root: false,
        }
    }

    /// Everything the daemon logged (all starts on this root).
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.root.join("stratad.log")).unwrap_or_default()
    }

    /// A `/v1` call with the admin token: status and JSON body (`null` if none).
    pub async fn v1(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut rq = self.api.req(method, path);
        if let Some(b) = body {
            rq = rq.json(&b);
        }
        let r = rq.send().await.unwrap();
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    /// Waits (≤ 5 min) for the default template to be ready.
    pub async fn wait_template(&self) {
        let t = Instant::now();
        loop {
            let (s, v) = self
                .v1(reqwest::Method::GET, "/v1/templates/tpl-default", None)
                .await;
            if s == 200 && v["status"] == "ready" {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(300),
                "default template: {s} {v}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Runs `script` with `sh -c` in sandbox `id`: its stdout.
    pub async fn sh(&self, id: &str, script: &str) -> String {
        let e = self
            .api
            .exec(id, json!({"cmd": ["sh", "-c", script]}))
            .await
            .unwrap();
        e.out()
    }

    /// The sandbox's state as `/v1` reports it.
    pub async fn state(&self, id: &str) -> String {
        let (_, v) = self
            .v1(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        v["state"].as_str().unwrap_or_default().to_owned()
    }

    /// Kills the daemon (its VMs live on) and hands back its root.
    pub fn kill_keep_root(mut self) -> PathBuf {
        self.keep_root = true;
        self.root.clone()
    }
}

impl Drop for GuestDoor {
    fn drop(&mut self) {
        let pid = self.child.id();
        sigkill(pid);
        wait_gone(pid, Duration::from_secs(10));
        let _ = self.child.wait();
        if !self.keep_root {
            remove_daemon_root(&self.root);
        }
    }
}
