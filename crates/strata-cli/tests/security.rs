//! The security commands (`token`, `whoami`, `policy`, `approvals`, held
//! calls; `webhook` and `events`) against a REAL `stratad` with
//! authentication on. No VM is needed:
//! the daemon runs without a default template, on a small loop-mounted
//! btrfs pool in a scratch dir, and is killed by pid at the end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The daemon binary (crate `strata-daemon`), built when missing or stale.
fn stratad_bin() -> PathBuf {
    strata_testkit::stratad_bin()
}

/// A running daemon; dropping it kills it by pid and unmounts its pool.
struct Daemon {
    child: Option<Child>,
    root: PathBuf,
    run_dir: PathBuf,
    url: String,
    admin: String,
}

impl Daemon {
    fn start() -> Daemon {
        Daemon::start_with(None)
    }

    /// Starts a daemon with `config` (TOML) as its `--config`.
    fn start_with(config: Option<&str>) -> Daemon {
        let root = tempfile::Builder::new()
            .prefix("strata-cli-sec-")
            .tempdir_in("/tmp")
            .expect("scratch dir")
            .keep();
        let data = root.join("data");
        let images = root.join("images");
        std::fs::create_dir_all(&images).expect("image dir");
        // Unix socket paths must stay short.
        let run_dir = PathBuf::from(format!("/tmp/scs-{}", std::process::id()));
        let port = strata_testkit::free_port();
        let log = std::fs::File::create(root.join("stratad.log")).expect("log");
        let mut cmd = Command::new(stratad_bin());
        if let Some(c) = config {
            let path = root.join("stratad.toml");
            std::fs::write(&path, c).expect("config");
            cmd.arg("--config").arg(path);
        }
        let child = cmd
            .arg("--auth")
            .arg("on")
            .arg("--data-dir")
            .arg(&data)
            .arg("--pool-size-gib")
            .arg("2")
            .arg("--run-dir")
            .arg(&run_dir)
            .arg("--accel")
            .arg("tcg")
            .arg("--no-default-template")
            .arg("--image-dir")
            .arg(&images)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .env("NO_COLOR", "1")
            .env_remove("STRATAD_CONFIG")
            .env_remove("STRATAD_AUTH")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn stratad");
        let mut d = Daemon {
            child: Some(child),
            root,
            run_dir,
            url: format!("http://127.0.0.1:{port}"),
            admin: String::new(),
        };
        let t = Instant::now();
        loop {
            let token = std::fs::read_to_string(data.join("admin.token")).unwrap_or_default();
            if !token.trim().is_empty() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                d.admin = token.trim().to_owned();
                break;
            }
            if let Some(Ok(Some(st))) = d.child.as_mut().map(Child::try_wait) {
                panic!("stratad exited ({st}): {}", d.log());
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "stratad not up: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("stratad.log")).unwrap_or_default()
    }

    /// Runs `strata ARGS` with `token` (none: no token at all).
    fn strata(&self, token: Option<&str>, args: &[&str]) -> Output {
        let bin = std::path::Path::new(env!("CARGO_BIN_EXE_strata"));
        strata_testkit::run_strata(bin, &self.url, token, args)
    }

    /// `--json` run that must succeed.
    fn json(&self, token: &str, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.strata(Some(token), &all);
        assert!(out.status.success(), "strata {args:?} failed");
        serde_json::from_slice(&out.stdout).expect("json output")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        strata_testkit::teardown::kill_qemus(&self.run_dir);
        let _ = std::fs::remove_dir_all(&self.run_dir);
        strata_testkit::teardown::remove_daemon_root(&self.root);
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn security_commands_against_a_real_daemon() {
    let d = Daemon::start();
    let admin = d.admin.clone();

    // whoami with the bootstrap token; without a token: 401.
    let out = d.strata(Some(&admin), &["whoami"]);
    assert!(out.status.success());
    assert!(
        stdout(&out).contains("admin of tenant default"),
        "{}",
        stdout(&out)
    );
    let out = d.strata(None, &["whoami"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("(HTTP 401 unauthorized)"),
        "{}",
        stderr(&out)
    );

    // The admin.token file is used when no token is given.
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["--json", "whoami"])
        .env("STRATA_URL", &d.url)
        .env_remove("STRATA_TOKEN")
        .env("STRATA_DATA_DIR", d.root.join("data"))
        .output()
        .expect("run strata");
    assert!(out.status.success(), "{}", stdout(&out));
    let who: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(who["role"], "admin");

    // token create: the secret once, with the warning; a developer token.
    let out = d.strata(
        Some(&admin),
        &[
            "token",
            "create",
            "--role",
            "developer",
            "--name",
            "dev1",
            "--expires-in",
            "30d",
        ],
    );
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("only time the token is shown"),
        "{}",
        stderr(&out)
    );
    let dev = stdout(&out).lines().next().unwrap().trim().to_owned();
    assert!(dev.starts_with("strata_"), "{dev}");
    let who = d.json(&dev, &["whoami"]);
    assert_eq!(
        (who["role"].as_str(), who["tenant"].as_str()),
        (Some("developer"), Some("default"))
    );
    let dev_id = who["token_id"].as_str().unwrap().to_owned();

    // A developer may not make tokens: 403 shown, typed under --json.
    let out = d.strata(Some(&dev), &["token", "create", "--role", "admin"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("(HTTP 403 forbidden)"),
        "{}",
        stderr(&out)
    );
    let out = d.strata(
        Some(&dev),
        &["--json", "token", "create", "--role", "admin"],
    );
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (e["error"]["code"].as_str(), e["error"]["status"].as_u64()),
        (Some("forbidden"), Some(403))
    );

    // token ls lists it (never the secret); revoke → the token is refused (401).
    let out = d.strata(Some(&admin), &["token", "ls"]);
    assert!(stdout(&out).contains(&dev_id) && stdout(&out).contains("dev1"));
    assert!(!stdout(&out).contains(&dev));
    let out = d.strata(Some(&admin), &["token", "revoke", &dev_id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = d.strata(Some(&dev), &["--json", "whoami"]);
    assert_eq!(out.status.code(), Some(1));
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (e["error"]["code"].as_str(), e["error"]["status"].as_u64()),
        (Some("unauthorized"), Some(401))
    );

    // policy set / get / test.
    let good = d.root.join("good.toml");
    std::fs::write(
        &good,
        r#"default = "allow"

[[rule]]
id = "no-rm"
effect = "deny"
program = "rm"
hard = true
reason = "nobody deletes files here"

[[rule]]
id = "hold-create"
effect = "approve"
kind = "lifecycle"
op = "create"
reason = "new sandboxes cost money"
"#,
    )
    .unwrap();
    let out = d.strata(Some(&admin), &["policy", "set", good.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bad = d.root.join("bad.toml");
    std::fs::write(&bad, "default = \"deny\"\n\n[[rule]\nid = \"x\"\n").unwrap();
    let out = d.strata(Some(&admin), &["policy", "set", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("line 3, column"), "{err}");
    assert!(err.contains("(HTTP 400 invalid_request)"), "{err}");
    // The old policy is still in force.
    let got = d.strata(Some(&admin), &["policy", "get"]);
    assert_eq!(stdout(&got), std::fs::read_to_string(&good).unwrap());
    let out = d.strata(
        Some(&admin),
        &["policy", "test", "--kind", "exec", "--cmd", "rm -rf /"],
    );
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.contains("effect  deny"), "{text}");
    assert!(text.contains("rule    no-rm"), "{text}");
    assert!(text.contains("layer   tenant (hard)"), "{text}");
    assert!(text.contains("nobody deletes files here"), "{text}");
    let v = d.json(
        &admin,
        &["policy", "test", "--kind", "file_write", "--path", "/etc/x"],
    );
    assert_eq!(v["effect"], "allow");

    // A held call: --no-wait prints the approval id and exits 75.
    let out = d.strata(Some(&admin), &["create", "--no-wait"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let held = stdout(&out).trim().to_owned();
    assert!(stderr(&out).contains(&format!("strata approvals approve {held}")));
    let list = d.json(&admin, &["approvals", "ls"]);
    assert_eq!(list["items"][0]["id"], held.as_str());
    let out = d.strata(Some(&admin), &["approvals", "show", &held]);
    assert!(
        stdout(&out).contains("new sandboxes cost money"),
        "{}",
        stdout(&out)
    );

    // The requester cannot answer its own request; an approver can, once.
    let out = d.strata(Some(&admin), &["token", "create", "--role", "approver"]);
    let approver = stdout(&out).lines().next().unwrap().trim().to_owned();
    let out = d.strata(Some(&admin), &["approvals", "approve", &held]);
    assert!(
        stderr(&out).contains("(HTTP 403 forbidden)"),
        "{}",
        stderr(&out)
    );
    let out = d.strata(Some(&approver), &["approvals", "approve", &held]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("approved"));
    let out = d.strata(Some(&approver), &["approvals", "deny", &held]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("answered already"),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("(HTTP 409 conflict)"),
        "{}",
        stderr(&out)
    );

    // Re-sent with --approval: the call gets past the policy and reaches the
    // engine (which has no template: 409 invalid_state), once only.
    let out = d.strata(Some(&admin), &["create", "--approval", &held]);
    assert!(stderr(&out).contains("invalid_state"), "{}", stderr(&out));
    let out = d.strata(Some(&admin), &["create", "--approval", &held]);
    assert!(
        stderr(&out).contains("(HTTP 403 policy_denied)"),
        "{}",
        stderr(&out)
    );

    // Waiting: announced on stderr; a denial ends the wait with 403.
    let waiter = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        cmd.env("STRATA_URL", &d.url)
            .env("STRATA_TOKEN", &admin)
            .args(["create", "--approval-timeout", "60s"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn().expect("spawn strata create")
    };
    let t = Instant::now();
    let pending = loop {
        let v = d.json(&approver, &["approvals", "ls"]);
        if let Some(id) = v["items"][0]["id"].as_str() {
            break id.to_owned();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no held call appeared"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = d.strata(Some(&approver), &["approvals", "deny", &pending]);
    assert!(out.status.success());
    let out = waiter.wait_with_output().expect("wait strata create");
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "waiting for approval {pending} (strata approvals approve {pending})"
        )),
        "{err}"
    );
    assert!(err.contains("denied"), "{err}");
    assert!(err.contains("(HTTP 403 policy_denied)"), "{err}");
    assert_eq!(out.status.code(), Some(1));

    let all = d.json(&approver, &["approvals", "ls", "--all"]);
    assert_eq!(all["items"].as_array().map(Vec::len), Some(2));
}

/// What the local receiver got: each request's head (lower-cased) and body.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>;

/// A local webhook receiver: answers 200 to every request and keeps each
/// one's head and body.
fn receiver() -> (u16, Received) {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let g = got.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let (head, body) = loop {
                let Ok(n) = c.read(&mut chunk) else {
                    break (String::new(), String::new());
                };
                if n == 0 {
                    break (String::new(), String::new());
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf).into_owned();
                let Some(i) = text.find("\r\n\r\n") else {
                    continue;
                };
                let head = text[..i].to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= i + 4 + len {
                    break (head, text[i + 4..].to_owned());
                }
            };
            let _ =
                c.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            g.lock().unwrap().push((head, body));
        }
    });
    (port, got)
}

#[test]
fn webhook_and_events_commands_against_a_real_daemon() {
    let (port, got) = receiver();
    // The local receiver is on loopback: allowed for this test only.
    let d = Daemon::start_with(Some("[webhooks]\nallow_private = [\"127.0.0.1\"]\n"));
    let admin = d.admin.clone();
    let hook_url = format!("http://127.0.0.1:{port}/hook");

    // add: the secret once; a private target is refused.
    let out = d.strata(Some(&admin), &["--json", "webhook", "add", &hook_url]);
    assert!(out.status.success(), "{}", stderr(&out));
    let hook: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(
        hook["secret"].as_str().unwrap().starts_with("whsec_"),
        "{hook}"
    );
    let id = hook["id"].as_str().unwrap().to_owned();
    let out = d.strata(Some(&admin), &["webhook", "add", "http://10.0.0.1/hook"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("webhook target refused"),
        "{}",
        stderr(&out)
    );
    let out = d.strata(Some(&admin), &["webhook", "ls"]);
    assert!(stdout(&out).contains(&id), "{}", stdout(&out));
    assert!(!stdout(&out).contains(hook["secret"].as_str().unwrap()));

    // A held create: delivered to the receiver, signed.
    let policy = d.root.join("hold.toml");
    std::fs::write(
        &policy,
        "default = \"allow\"\n\n[[rule]]\nid = \"hold-create\"\neffect = \"approve\"\nkind = \"lifecycle\"\nop = \"create\"\nreason = \"a human decides\"\n",
    )
    .unwrap();
    let out = d.strata(Some(&admin), &["policy", "set", policy.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = d.strata(Some(&admin), &["create", "--no-wait"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let held = stdout(&out).trim().to_owned();
    let t = Instant::now();
    while got.lock().unwrap().is_empty() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (head, body) = got.lock().unwrap().first().cloned().expect("a delivery");
    assert!(head.starts_with("post /hook"), "{head}");
    assert!(head.contains("strata-signature: t="), "{head}");
    assert!(head.contains("strata-event: approval.requested"), "{head}");
    let p: Value = serde_json::from_str(&body).expect("json payload");
    assert_eq!(p["approval"]["id"], held.as_str());

    // deliveries: its status is visible.
    let t = Instant::now();
    let delivered = loop {
        let v = d.json(&admin, &["webhook", "deliveries", &id]);
        if v["items"][0]["status"] == "delivered" {
            break v["items"][0].clone();
        }
        assert!(t.elapsed() < Duration::from_secs(30), "{v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(delivered["attempts"], 1, "{delivered}");
    assert_eq!(delivered["last_status"], 200, "{delivered}");
    let out = d.strata(Some(&admin), &["webhook", "deliveries", &id]);
    let text = stdout(&out);
    assert!(
        text.contains("approval.requested") && text.contains("delivered"),
        "{text}"
    );

    // events: the journal's backlog holds the request.
    let out = d.strata(Some(&admin), &["events"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(&held), "{}", stdout(&out));

    // rm: gone from the list.
    let out = d.strata(Some(&admin), &["webhook", "rm", &id]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = d.strata(Some(&admin), &["webhook", "ls"]);
    assert!(!stdout(&out).contains(&id), "{}", stdout(&out));
}
