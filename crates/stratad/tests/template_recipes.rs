//! Recipe builds end to end: a real `stratad`, real TCG guests, the real
//! egress proxy, PyPI as this host reaches it (its TLS re-signed by a local
//! CA, so the build is given the host's CA bundle), and the `strata` CLI.
//!
//! 1. `strata template build -f recipe.toml --ca-bundle …`: pip installs a
//!    small package through the builder's policy proxy, copies files from
//!    the client, switches user and workdir, starts `python3 -m
//!    http.server` and waits for it; progress and the build log stream to
//!    the CLI. A sandbox made from the template has the package, the copied
//!    files owned by `user`, and the server already answering (curl, no
//!    retry, right after the create).
//! 2. Changing only the last step rebuilds from the cached steps (the log
//!    says how many) and is faster than the full build (times printed; the
//!    ratio is `strata-bench`'s to judge).
//! 3. A failing step fails the build with its output in the reason and
//!    the log, and no template: a create from it is refused.
//! 4. Bad recipes are refused at the request (400 `invalid_recipe`), and
//!    nothing is recorded.

mod common;

use std::time::Instant;

use common::Daemon;
use serde_json::{json, Value};

const CA: &str = strata_testkit::registry::HOST_CA_BUNDLE;

fn recipe(last: &str) -> String {
    format!(
        r#"
base = "default"

[[step]]
pip = ["tomli-w==1.0.0"]

[[step]]
copy = {{ src = "site", dest = "/home/user/site", owner = "user" }}

[[step]]
user = "user"

[[step]]
workdir = "/home/user/site"

[[step]]
run = "{last}"

[start]
cmd = "python3 -m http.server 8000 --bind 127.0.0.1"

[ready]
http = {{ port = 8000, path = "/hello.txt" }}
timeout_secs = 120
"#
    )
}

/// `strata template build -f <dir>/<file> --id <id>` (with the host's CA
/// bundle): whether it succeeded, its stderr (progress and the build log),
/// seconds.
fn build(d: &Daemon, dir: &std::path::Path, file: &str, id: &str) -> (bool, String, f64) {
    let bin = strata_testkit::strata_bin();
    let t = Instant::now();
    let path = dir.join(file);
    let args = [
        "template",
        "build",
        "-f",
        path.to_str().expect("path"),
        "--ca-bundle",
        CA,
        "--id",
        id,
        "--timeout",
        "1200",
    ];
    let out = strata_testkit::run_strata(&bin, &d.url, d.token().as_deref(), &args);
    let secs = t.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), stderr, secs)
}

#[test]
fn a_recipe_builds_a_warm_template_rebuilds_from_cache_and_fails_cleanly() {
    let dir = tempfile::tempdir().expect("dir");
    let cache = dir.path().join("template-cache");
    // Where the registries' names resolve to a non-public gateway (this
    // host), the operator names it (strata_testkit::registry).
    let d = Daemon::start(&format!(
        "[security]\negress_resolved_ranges = {}\n[templates]\ncache_dir = \"{}\"\n",
        strata_testkit::registry::registry_ranges_toml(),
        cache.display()
    ));
    std::fs::create_dir_all(dir.path().join("site")).expect("site");
    std::fs::write(dir.path().join("site/hello.txt"), "hello from the recipe\n").expect("file");
    std::fs::write(dir.path().join("web.toml"), recipe("echo v1 > version.txt")).expect("recipe");
    std::fs::write(
        dir.path().join("web2.toml"),
        recipe("echo v2 > version.txt"),
    )
    .expect("recipe");
    std::fs::write(
        dir.path().join("bad.toml"),
        "base = \"default\"\n[[step]]\nrun = \"echo first\"\n[[step]]\nrun = \"echo the-step-broke >&2; exit 3\"\n",
    )
    .expect("recipe");
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;

        // 1. The full build.
        let (ok, log, full) = build(&d, dir.path(), "web.toml", "tpl-web");
        assert!(ok, "build failed:\n{log}\n{}", d.logs());
        eprintln!("full build: {full:.1} s");
        assert!(log.contains("step 1/5 pip install"), "progress in the log:\n{log}");
        assert!(log.contains("Successfully installed tomli-w"), "pip's output streamed:\n{log}");
        assert!(log.contains("0 cached"), "{log}");
        let t = d.ok("GET", "/v1/templates/tpl-web", None, 200).await;
        assert_eq!(t["status"], "ready", "{t}");
        // Cached steps are not templates anyone lists.
        let all = d.ok("GET", "/v1/templates", None, 200).await;
        let ids: Vec<&str> = all["items"]
            .as_array()
            .expect("items")
            .iter()
            .filter_map(|t| t["id"].as_str())
            .collect();
        assert!(ids.iter().all(|i| !i.starts_with("tpl-s")), "{all}");
        // No builder left behind.
        let sbs = d.ok("GET", "/v1/sandboxes", None, 200).await;
        assert!(
            !sbs.to_string().contains("strata.build"),
            "builder sandboxes remain: {sbs}"
        );

        // A sandbox of it: the server already runs (no retry), the package
        // is installed, the copied files belong to `user`.
        let id = d.create(json!({"template": "tpl-web"})).await;
        let e = d
            .sh(&id, "curl -sS --max-time 5 http://127.0.0.1:8000/hello.txt")
            .await;
        assert_eq!(e.out(), "hello from the recipe", "{:?}", String::from_utf8_lossy(&e.stderr));
        let e = d
            .sh(
                &id,
                "python3 -c 'import tomli_w; print(tomli_w.dumps({\"a\": 1}).strip())'; \
                 stat -c %U /home/user/site/hello.txt; cat /home/user/site/version.txt",
            )
            .await;
        assert_eq!(e.out(), "a = 1\nuser\nv1", "{:?}", String::from_utf8_lossy(&e.stderr));
        d.ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200).await;

        // 2. Only the last step changed: the cached steps are reused.
        let (ok, log, rebuild) = build(&d, dir.path(), "web2.toml", "tpl-web2");
        assert!(ok, "rebuild failed:\n{log}");
        eprintln!(
            "rebuild after changing the last step: {rebuild:.1} s (full {full:.1} s, {:.1}x)",
            full / rebuild
        );
        assert!(log.contains("4 cached"), "resumed after the 4 unchanged steps:\n{log}");
        assert!(!log.contains("pip install"), "pip ran again:\n{log}");
        assert!(rebuild < full, "rebuild {rebuild:.1} s vs full {full:.1} s");
        let id = d.create(json!({"template": "tpl-web2"})).await;
        let e = d.sh(&id, "cat /home/user/site/version.txt").await;
        assert_eq!(e.out(), "v2");
        d.ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200).await;

        // The host-level cache (by recipe hash): the same recipe under
        // another id is imported, not built, and works the same.
        assert!(log.contains("copied to the host's template cache"), "{log}");
        let (ok, log, again) = build(&d, dir.path(), "web.toml", "tpl-web3");
        assert!(ok, "cached build failed:\n{log}");
        assert!(log.contains("imported from the host's template cache"), "{log}");
        assert!(!log.contains("step 1/5"), "{log}");
        eprintln!("identical recipe from the host cache: {again:.1} s");
        let id = d.create(json!({"template": "tpl-web3"})).await;
        let e = d
            .sh(&id, "curl -sS --max-time 5 http://127.0.0.1:8000/hello.txt; cat /home/user/site/version.txt")
            .await;
        assert_eq!(e.out(), "hello from the recipe\nv1");
        d.ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200).await;

        // 3. A failing step.
        let (ok, stderr, _) = build(&d, dir.path(), "bad.toml", "tpl-bad");
        assert!(!ok, "{stderr}");
        assert!(stderr.contains("the-step-broke"), "the step's output:\n{stderr}");
        assert!(stderr.contains("exited 3"), "{stderr}");
        let t = d.ok("GET", "/v1/templates/tpl-bad", None, 200).await;
        assert_eq!(t["status"], "failed", "{t}");
        assert!(
            t["status_reason"].as_str().unwrap_or("").contains("the-step-broke"),
            "{t}"
        );
        let (s, v) = d
            .call("POST", "/v1/sandboxes", Some(json!({"template": "tpl-bad"})))
            .await;
        assert_eq!(s, 409, "{v}");
        let logs = d
            .ok("GET", "/v1/templates/tpl-bad/logs", None, 200)
            .await;
        assert!(logs["data"].as_str().unwrap_or("").contains("the-step-broke"), "{logs}");
        assert_eq!(logs["done"], true, "{logs}");

        // 4. Refused at the request, nothing recorded.
        let bad: &[(Value, &str)] = &[
            (json!({"id": "tpl-x1", "recipe": {"base": "ubuntu:22.04", "step": []}}), "not supported"),
            (json!({"id": "tpl-x2", "recipe": {"step": [{"run": "x", "pip": ["y"]}]}}), ""),
            (json!({"id": "tpl-x3", "recipe": {"step": [{"pip": ["a; rm -rf /"]}]}}), ""),
            (
                json!({"id": "tpl-x4", "recipe": {"step": [{"copy": {"src": "a", "dest": "/a", "sha256": "0".repeat(64)}}]}}),
                "was not uploaded",
            ),
            (json!({"id": "tpl-x5", "ca_bundle": "nope", "recipe": {"step": []}}), "PEM"),
        ];
        for (body, want) in bad {
            let (s, v) = d.call("POST", "/v1/templates", Some(body.clone())).await;
            assert_eq!(s, 400, "{body} -> {v}");
            let code = v["error"]["code"].as_str();
            assert!(
                code == Some("invalid_recipe") || code == Some("invalid_request"),
                "{v}"
            );
            assert!(v.to_string().contains(want), "{body} -> {v}");
            let id = body["id"].as_str().expect("id");
            let (s, _) = d.call("GET", &format!("/v1/templates/{id}"), None).await;
            assert_eq!(s, 404, "{id} recorded");
        }
        // A template file whose content does not match its name.
        let (s, v) = d
            .raw("PUT", &format!("/v1/template-files/{}", "a".repeat(64)), b"x".to_vec())
            .await;
        assert_eq!(s, 400, "{}", String::from_utf8_lossy(&v));
    });
}
