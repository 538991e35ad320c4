//! `POST /v1/sandboxes/{id}/code` and `strata run-code` end to end: a real
//! `stratad`, real TCG guests, the code-interpreter template built from
//! templates/code-interpreter/recipe.toml through the daemon (pip through
//! the builder's egress proxy; this host's registry TLS is re-signed, so the
//! build gets the host's CA bundle), on a 1 GiB base (the kernel with numpy
//! and matplotlib does not fit the test daemon's 256 MiB default size).
//!
//! 1. The NDJSON stream of the guest's interpreter comes through: the state
//!    is kept between calls, stdout and stderr lines, an error's
//!    name/value/traceback, a png result.
//! 2. `strata run-code`: stdout as it comes, the value, `--out-dir` saves a
//!    png, an error exits 1 with the name and value on stderr.
//! 3. Refusals: no `code` (400), a sandbox where nothing listens on 49999
//!    (409 invalid_state), an unknown context (404); a run past its
//!    `timeout` ends with a `TimeoutError` line and the kernel is
//!    interrupted (the next call runs at once).

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

const CA: &str = "/etc/ssl/certs/ca-certificates.crt";

/// `egress_resolved_ranges` for the registries' non-public addresses (see
/// template_recipes.rs `registry_ranges`).
fn registry_ranges() -> String {
    use std::net::ToSocketAddrs;
    let mut ranges = Vec::new();
    for host in ["pypi.org", "files.pythonhosted.org"] {
        for a in (host, 443).to_socket_addrs().into_iter().flatten() {
            if let std::net::IpAddr::V4(v4) = a.ip() {
                let o = v4.octets();
                let public = !(v4.is_private()
                    || v4.is_documentation()
                    || (o[0] == 100 && (64..128).contains(&o[1])));
                let r = format!("\"{v4}/32\"");
                if !public && !ranges.contains(&r) {
                    ranges.push(r);
                }
            }
        }
    }
    format!(
        "[security]\negress_resolved_ranges = [{}]\n",
        ranges.join(", ")
    )
}

fn strata(d: &Daemon, args: &[&str]) -> std::process::Output {
    strata_testkit::run_strata(
        &strata_testkit::strata_bin(),
        &d.url,
        d.token().as_deref(),
        args,
    )
}

/// The lines of a `/code` answer.
async fn run(d: &Daemon, id: &str, body: Value) -> (u16, Vec<Value>) {
    let resp = d
        .request("POST", &format!("/v1/sandboxes/{id}/code"))
        .json(&body)
        .timeout(Duration::from_secs(300))
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    let lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    (status, lines)
}

fn of<'a>(lines: &'a [Value], ty: &str) -> Vec<&'a Value> {
    lines.iter().filter(|l| l["type"] == ty).collect()
}

// A cold build of the template is ~30 min under TCG (its pip step alone
// 19 min), over the CI budget until the test daemon reuses a built template
// (the host cache by recipe hash): run it with `--ignored`.
#[test]
#[ignore = "builds the code-interpreter template: ~30 min under TCG without a cached template"]
fn run_code_streams_the_interpreter_and_the_cli_prints_it() {
    let d = Daemon::start(&registry_ranges());
    let root =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../templates/code-interpreter");
    // The recipe as shipped, on a 1 GiB base (copy sources beside it).
    let dir = tempfile::tempdir().expect("dir");
    let recipe = std::fs::read_to_string(root.join("recipe.toml")).expect("recipe");
    assert!(
        recipe.contains("base = \"default\""),
        "the recipe's base changed"
    );
    std::fs::write(
        dir.path().join("recipe.toml"),
        recipe.replace("base = \"default\"", "base = \"interp-base\""),
    )
    .expect("write");
    for f in ["server.py", "kernel_init.py"] {
        std::fs::copy(root.join(f), dir.path().join(f)).expect("copy");
    }
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let out = strata(&d, &["template", "build", "--name", "interp-base", "--memory", "1024"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let t = Instant::now();
        let out = strata(
            &d,
            &[
                "template", "build", "-f",
                dir.path().join("recipe.toml").to_str().expect("path"),
                "--name", "code-interpreter", "--ca-bundle", CA, "--id", "tpl-interp",
                "--timeout", "2400",
            ],
        );
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "build failed:\n{log}\n{}", d.logs());
        eprintln!("code-interpreter template build: {:.1} s", t.elapsed().as_secs_f64());

        let id = d.create(json!({"template": "tpl-interp"})).await;

        // 1. The stream, state between calls.
        let t = Instant::now();
        let (s, l) = run(&d, &id, json!({"code": "x = 41\nprint('hi')\nx + 1"})).await;
        eprintln!("first /code in a fresh fork: {:.0} ms", t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(s, 200, "{l:?}");
        assert_eq!(l.first().map(|v| v["type"].clone()), Some(json!("number_of_executions")), "{l:?}");
        assert_eq!(l.last().map(|v| v["type"].clone()), Some(json!("end_of_execution")), "{l:?}");
        assert_eq!(of(&l, "stdout")[0]["text"], "hi\n", "{l:?}");
        let res = of(&l, "result");
        assert_eq!(res.len(), 1, "{l:?}");
        assert_eq!(res[0]["text"], "42");
        assert_eq!(res[0]["is_main_result"], true);
        let (_, l) = run(&d, &id, json!({"code": "x * 2", "env_vars": {"FOO": "bar"}})).await;
        assert_eq!(of(&l, "result")[0]["text"], "82", "{l:?}");
        let (_, l) = run(&d, &id, json!({"code": "import sys; print('e', file=sys.stderr); 1/0"})).await;
        assert_eq!(of(&l, "stderr")[0]["text"], "e\n", "{l:?}");
        let e = of(&l, "error");
        assert_eq!(e.len(), 1, "{l:?}");
        assert_eq!(e[0]["name"], "ZeroDivisionError");
        assert_eq!(e[0]["value"], "division by zero");
        assert!(e[0]["traceback"].as_str().unwrap_or("").contains("1/0"), "{e:?}");
        let (_, l) = run(
            &d,
            &id,
            json!({"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()"}),
        )
        .await;
        let png = of(&l, "result")
            .iter()
            .find_map(|r| r["png"].as_str().map(str::to_owned))
            .unwrap_or_else(|| panic!("no png: {l:?}"));
        assert!(png.starts_with("iVBORw0KGgo"), "{}", &png[..20.min(png.len())]);

        // 2. The CLI.
        let out = strata(&d, &["run-code", &id, "print('from cli'); x"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "from cli\n41\n");
        let pics = tempfile::tempdir().expect("dir");
        let f = pics.path().join("plot.py");
        std::fs::write(&f, "import matplotlib.pyplot as plt\nplt.bar([1, 2], [3, 4])\nplt.show()\n").expect("write");
        let out = strata(
            &d,
            &["run-code", &id, "-f", f.to_str().expect("path"), "--out-dir", pics.path().to_str().expect("path")],
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let saved = std::fs::read(pics.path().join("result-1.png")).expect("png saved");
        assert_eq!(&saved[..8], b"\x89PNG\r\n\x1a\n");
        let out = strata(&d, &["run-code", &id, "raise KeyError('nope')"]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("KeyError: 'nope'"), "{err}");
        assert!(err.contains("Traceback") || err.contains("raise KeyError"), "{err}");

        // 3. Refusals and the deadline.
        let (s, v) = d.call("POST", &format!("/v1/sandboxes/{id}/code"), Some(json!({}))).await;
        assert_eq!((s, v["error"]["code"].as_str()), (400, Some("invalid_request")), "{v}");
        let (s, v) = d
            .call("POST", &format!("/v1/sandboxes/{id}/code"), Some(json!({"code": "1", "context_id": "no-such"})))
            .await;
        assert_eq!((s, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
        let t = Instant::now();
        let (s, l) = run(&d, &id, json!({"code": "import time\nwhile True: time.sleep(0.1)", "timeout": 3})).await;
        assert_eq!(s, 200);
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        let last = l.last().expect("a line");
        assert_eq!((last["type"].as_str(), last["name"].as_str()), (Some("error"), Some("TimeoutError")), "{l:?}");
        let t = Instant::now();
        let (_, l) = run(&d, &id, json!({"code": "x"})).await;
        assert_eq!(of(&l, "result")[0]["text"], "41", "the kernel was interrupted, its state kept: {l:?}");
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());

        let plain = d.create(json!({})).await;
        let (s, v) = d
            .call("POST", &format!("/v1/sandboxes/{plain}/code"), Some(json!({"code": "1"})))
            .await;
        assert_eq!((s, v["error"]["code"].as_str()), (409, Some("invalid_state")), "{v}");
        assert!(v.to_string().contains("49999"), "{v}");
    });
}
