//! The E2B door on a cluster (docs/cluster.md, "The E2B door on a
//! cluster"): one real host (host-a: a TCG guest, the template) and one
//! API-only process (`[cluster] role = "api"`), both with the door on, the
//! same E2B API key and the same envd token secret. The judge is the
//! unmodified `e2b` Python SDK (the venv of crates/strata-e2b/tests/
//! run-python.sh: `$VENV` or /tmp/strata-e2b-venv), pointed at the **API
//! process** only (`E2B_API_URL` = `E2B_SANDBOX_URL` = its address):
//!
//! 1. `Sandbox.create()` through the API process lands on host-a (the lease
//!    is host-a's);
//! 2. `commands.run` with its output, a background command listed and
//!    killed (its handle lives in host-a's door), `files.write` /
//!    `files.read`, `is_running`, a guest HTTP server started: envd calls
//!    the API process forwards;
//! 3. read back over the wire: `GET /sandboxes/{id}`, an envd `Stat` and
//!    the guest port by `Host: 8000-<id>.<the API process's domain>`
//!    through the API process are host-a's answers (`x-strata-host`), the
//!    list is the API process's own; an E2B template build there is `421`
//!    in E2B's error shape (`{"code": 421, "message": "host_required: …"}`);
//! 4. a second API process started with another envd token secret logs the
//!    mismatch (the first does not);
//! 5. `Sandbox.connect(id)` (the token handed out again) runs a command,
//!    `Sandbox.kill(id)` deletes the sandbox on host-a;
//! 6. host-b (8 vCPUs, no template) joins: an E2B create sent to host-a's
//!    door with a strata token as `X-API-KEY` is placed on host-b and made
//!    there (`201`, `x-strata-host: host-b`, host-b's lease; host-b fetched
//!    the template from host-a with that token); an envd call on it through
//!    the API process is host-b's answer;
//! 7. with host-b's daemon killed, that sandbox's `GET` through the API
//!    process is `503` `{"code": 503, "message": "owner_unreachable: host
//!    host-b …"}` and an envd call a Connect `unavailable` error (`503`);
//! 8. no API process ever held a lease; the first has no child process (no
//!    QEMU), no `qemu.pid` in its run dir.
//!
//! Needs `STRATA_TEST_PG_URL` (scripts/test-pg.sh) and a Python with `e2b`;
//! without either the test prints why and passes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::cluster::{api_conf, assert_ran_no_vm, host_conf, host_of, pg_row};
use common::{share_keys, Daemon};
use serde_json::Value;

const KEY: &str = "e2b_cluster_test_key";
/// The envd token secret every door of the cluster shares.
const SECRET: &str = "5d1c0ffee5d1c0ffee5d1c0ffee5d1c0ffee5d1c0ffee5d1c0ffee5d1c0ffee0";

/// The door's settings of every process: one key, one secret file.
fn door_conf() -> String {
    format!(
        "[e2b]\nenabled = true\napi_keys = [\"{KEY}\"]\ntoken_secret_file = \"{{root}}/e2b.secret\"\n"
    )
}

fn write_secret(root: &Path) {
    std::fs::write(root.join("e2b.secret"), SECRET).expect("write the secret");
}

/// A Python that imports `e2b` (run-python.sh's venv), or `None` after
/// printing why the test is skipped.
fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("VENV").unwrap_or_else(|| "/tmp/strata-e2b-venv".into());
    let py = PathBuf::from(venv).join("bin/python");
    let ok = Command::new(&py)
        .args(["-c", "import e2b"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "skipped: no Python with the e2b SDK at {} (crates/strata-e2b/tests/run-python.sh makes it)",
            py.display()
        );
    }
    ok.then_some(py)
}

/// Runs `script` with the SDK pointed at `url`; its last stdout line is JSON.
fn sdk(py: &Path, url: &str, script: &str) -> Value {
    let out = Command::new(py)
        .args(["-c", script])
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", KEY)
        .env("E2B_DEBUG", "false")
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_ACCESS_TOKEN")
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

const CREATE_AND_USE: &str = r#"
import json
from e2b import Sandbox
s = Sandbox.create(timeout=300, metadata={"suite": "cluster-e2b"})
out = {"id": s.sandbox_id}
r = s.commands.run("echo e2b-$((6*7)); cat /proc/sys/kernel/hostname")
out["stdout"], out["exit"] = r.stdout, r.exit_code
h = s.commands.run("sleep 120", background=True)
out["listed"] = [p.pid for p in s.commands.list()]
out["bg"] = h.pid
out["killed"] = h.kill()
s.files.write("/tmp/door.txt", "through the API process\n")
out["read"] = s.files.read("/tmp/door.txt")
out["running"] = s.is_running()
s.commands.run("mkdir -p /tmp/www && echo hello-port > /tmp/www/p.txt && cd /tmp/www && "
               "(setsid python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/h.log 2>&1 &)")
r = s.commands.run("for i in $(seq 1 100); do python3 -c 'import socket; "
                   "socket.create_connection((\"127.0.0.1\", 8000)).close()' 2>/dev/null "
                   "&& echo up && exit 0; sleep 0.2; done; echo down")
out["port"] = r.stdout.strip()
print(json.dumps(out))
"#;

#[test]
fn the_e2b_sdk_drives_a_cluster_through_an_api_process() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let Some(py) = python() else {
        return;
    };
    let t0 = Instant::now();
    let schema = common::cluster::schema("e2b");
    let host = format!(
        "{}{}",
        host_conf("host-a", &url, &schema, 4, true),
        door_conf()
    );
    let a = Daemon::start_on(&host, write_secret);
    let rt = strata_testkit::tokio_rt();
    rt.block_on(a.wait_template());
    eprintln!("host-a up, template ready: {:?}", t0.elapsed());
    let from = a.root.clone();
    let api = Daemon::start_on(
        &format!("{}{}", api_conf("api-1", &url, &schema), door_conf()),
        move |root| {
            share_keys(&from, root);
            write_secret(root);
        },
    );
    eprintln!("API process listening: {:?}", t0.elapsed());

    // 1-2. The SDK, through the API process only.
    let t = Instant::now();
    let v = sdk(&py, &api.url, CREATE_AND_USE);
    eprintln!(
        "SDK create + use through the API process: {:?}",
        t.elapsed()
    );
    let id = v["id"].as_str().expect("sandbox id").to_owned();
    assert_eq!(v["exit"], 0, "{v}");
    let stdout = v["stdout"].as_str().unwrap_or_default();
    assert!(stdout.starts_with("e2b-42\n"), "{v}");
    let bg = v["bg"].as_u64().expect("background pid");
    assert!(
        v["listed"]
            .as_array()
            .is_some_and(|l| l.iter().any(|p| p.as_u64() == Some(bg))),
        "{v}"
    );
    assert_eq!(v["killed"], true, "{v}");
    assert_eq!(v["read"], "through the API process\n", "{v}");
    assert_eq!(v["running"], true, "{v}");
    assert_eq!(v["port"], "up", "{v}");

    rt.block_on(async {
        let owner = pg_row(
            &url,
            &format!("SELECT host_id FROM {schema}.sandbox_owners WHERE sandbox_id = '{id}'"),
        )
        .await
        .map(|r| r.get::<_, String>(0));
        assert_eq!(owner.as_deref(), Some("host-a"), "the sandbox's lease");

        // 3. Over the wire: who answered.
        let http = reqwest::Client::new();
        let r = http
            .get(format!("{}/sandboxes/{id}", api.url))
            .header("x-api-key", KEY)
            .send()
            .await
            .expect("get");
        assert_eq!((r.status().as_u16(), host_of(&r)), (200, "host-a".into()));
        let detail: Value = r.json().await.expect("detail");
        let token = detail["envdAccessToken"]
            .as_str()
            .expect("envd token")
            .to_owned();
        let r = http
            .post(format!("{}/filesystem.Filesystem/Stat", api.url))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &token)
            .header("content-type", "application/json")
            .body(r#"{"path":"/tmp/door.txt"}"#)
            .send()
            .await
            .expect("stat");
        let who = host_of(&r);
        let st = r.status().as_u16();
        let stat: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!((st, who.as_str()), (200, "host-a"), "{stat}");
        assert_eq!(stat["entry"]["size"], "24", "{stat}");
        // A guest port by `Host`, as `get_host(8000)` names it on the API
        // process's domain (`localhost:<its port>`): host-a's guest answers.
        let port = api.url.rsplit(':').next().expect("port");
        let r = http
            .get(format!("{}/p.txt", api.url))
            .header("host", format!("8000-{id}.localhost:{port}"))
            .send()
            .await
            .expect("port request");
        assert_eq!((r.status().as_u16(), host_of(&r)), (200, "host-a".into()));
        assert_eq!(r.text().await.unwrap_or_default(), "hello-port\n");
        let r = http
            .get(format!("{}/v2/sandboxes", api.url))
            .header("x-api-key", KEY)
            .send()
            .await
            .expect("list");
        assert_eq!((r.status().as_u16(), host_of(&r)), (200, "api-1".into()));
        let list = r.text().await.unwrap_or_default();
        assert!(list.contains(&id), "{list}");
        let r = http
            .post(format!("{}/v3/templates", api.url))
            .header("x-api-key", KEY)
            .json(&serde_json::json!({ "name": "t", "cpuCount": 1, "memoryMB": 256 }))
            .send()
            .await
            .expect("template build");
        let st = r.status().as_u16();
        let e: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!((st, &e["code"]), (421, &Value::from(421)), "{e}");
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("host_required: ")),
            "{e}"
        );
    });

    // 4. A door whose envd token secret is not the cluster's says so.
    let from = a.root.clone();
    let odd = Daemon::start_on(
        &format!("{}{}", api_conf("api-2", &url, &schema), door_conf()),
        move |root| {
            share_keys(&from, root);
            std::fs::write(root.join("e2b.secret"), "0".repeat(64)).expect("write");
        },
    );
    let t = Instant::now();
    while !odd.logs().contains("another secret") {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "no mismatch logged:\n{}",
            odd.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    odd.shutdown();
    assert!(!api.logs().contains("another secret"), "{}", api.logs());

    // 5. Connect (the token handed out again) and kill, through the API
    // process.
    let v = sdk(
        &py,
        &api.url,
        &format!(
            "import json\nfrom e2b import Sandbox\ns = Sandbox.connect('{id}')\nr = s.commands.run('cat /tmp/door.txt')\nprint(json.dumps({{'again': r.stdout, 'killed': Sandbox.kill('{id}')}}))\n"
        ),
    );
    assert_eq!(v["again"], "through the API process\n", "{v}");
    assert_eq!(v["killed"], true, "{v}");
    rt.block_on(async {
        let (st, v) = a.call("GET", &format!("/v1/sandboxes/{id}"), None).await;
        assert!(st == 404 || v["state"] == "deleted", "{st} {v}");
    });

    // 6. A create through host-a's door that placement puts on host-b (more
    // free vCPUs, no copy of the template): sent to host-b's door, which
    // fetches the template from host-a with the caller's strata token (its
    // X-API-KEY).
    let from = a.root.clone();
    let b = Daemon::start_on(
        &format!(
            "{}{}",
            host_conf("host-b", &url, &schema, 8, false),
            door_conf()
        ),
        move |root| {
            share_keys(&from, root);
            write_secret(root);
        },
    );
    let admin = a.token().expect("admin token");
    rt.block_on(async {
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        let http = reqwest::Client::new();
        let t = Instant::now();
        let r = http
            .post(format!("{}/sandboxes", a.url))
            .header("x-api-key", &admin)
            .json(&serde_json::json!({ "timeout": 300 }))
            .send()
            .await
            .expect("create");
        let who = host_of(&r);
        let st = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!((st, who.as_str()), (201, "host-b"), "{v}\n{}", b.logs());
        eprintln!(
            "E2B create through host-a placed on host-b: {:?}",
            t.elapsed()
        );
        let id2 = v["sandboxID"].as_str().expect("id").to_owned();
        let token = v["envdAccessToken"].as_str().expect("token").to_owned();
        let owner = pg_row(
            &url,
            &format!("SELECT host_id FROM {schema}.sandbox_owners WHERE sandbox_id = '{id2}'"),
        )
        .await
        .map(|r| r.get::<_, String>(0));
        assert_eq!(owner.as_deref(), Some("host-b"), "the sandbox's lease");
        let stat = |path: &'static str| {
            http.post(format!("{}/filesystem.Filesystem/Stat", api.url))
                .header("e2b-sandbox-id", &id2)
                .header("x-access-token", &token)
                .header("content-type", "application/json")
                .body(format!(r#"{{"path":"{path}"}}"#))
                .send()
        };
        let r = stat("/").await.expect("stat");
        assert_eq!((r.status().as_u16(), host_of(&r)), (200, "host-b".into()));

        // 7. The owner gone: `owner_unreachable`, in the door's shapes.
        b.kill9();
        let r = http
            .get(format!("{}/sandboxes/{id2}", api.url))
            .header("x-api-key", KEY)
            .send()
            .await
            .expect("get");
        assert_eq!((r.status().as_u16(), host_of(&r)), (503, "api-1".into()));
        let e: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(e["code"], 503, "{e}");
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("owner_unreachable: host host-b")),
            "{e}"
        );
        let r = stat("/").await.expect("stat");
        let st = r.status().as_u16();
        let e: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(st, 503, "{e}");
        assert_eq!(e["code"], "unavailable", "{e}");
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("owner_unreachable: ")),
            "{e}"
        );

        // 8. The API process ran nothing.
        let held = pg_row(
            &url,
            &format!(
                "SELECT count(*) FROM {schema}.sandbox_owners WHERE host_id IN ('api-1', 'api-2')"
            ),
        )
        .await
        .map(|r| r.get::<_, i64>(0));
        assert_eq!(held, Some(0));
    });
    assert_ran_no_vm(api.pid(), &api.run_dir);
    eprintln!("whole test: {:?}", t0.elapsed());
}
