//! Any size from any template (size variants, `service::variants`) against
//! a real `stratad`, real TCG guests and the `strata` CLI:
//!
//! 1. `strata template build -f web.toml --sizes 2x768`: a recipe template
//!    (a file made by a step, `python3 -m http.server` as its start
//!    command), then its 2 vCPU / 768 MiB variant. A create of that size is
//!    a fork of the variant: the guest has 2 CPUs and ~768 MiB, the step's
//!    file, and the server answering at once (the start command ran again in
//!    the variant).
//! 2. A create at a size with no variant answers `202` with the build's
//!    progress (a second create joins the same build); `strata create`
//!    follows the build and then creates; a later create of that size is a
//!    fork (no new build).
//! 3. The default template with `"wait": true`; a recipe built at another
//!    size than its base's builds on the base's variant (reused).
//!    A `[pools]` entry of that size keeps a warm fork of the variant,
//!    which the create claims.
//! 4. Variants are not listed with the templates, are listed by
//!    `GET /v1/templates/{id}/variants`, and go with their template; no
//!    builder sandbox is left.

mod common;

use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

const WEB: &str = r#"
base = "default"

[[step]]
run = "mkdir -p /srv/site && echo hello-variant > /srv/site/hello.txt"

[start]
cmd = "python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv/site"

[ready]
http = { port = 8000, path = "/hello.txt" }
timeout_secs = 120
"#;

/// The guest's CPU count and memory (MiB, from /proc/meminfo).
async fn cpus_and_mib(d: &Daemon, id: &str) -> (u32, u64) {
    let e = d
        .sh(
            id,
            "nproc; awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo",
        )
        .await;
    assert_eq!(e.code, Some(0), "{:?}", e.error);
    let out = e.out();
    let mut l = out.lines();
    let cpus = l.next().expect("nproc").trim().parse().expect("cpus");
    let mib = l.next().expect("meminfo").trim().parse().expect("mib");
    (cpus, mib)
}

/// Memory the guest kernel reports for a VM of `mib`: a little less
/// (kernel code and reserved pages), never more.
fn about(mib: u64, want: u64) -> bool {
    mib <= want && mib + 128 >= want
}

async fn events(d: &Daemon, kind: &str) -> u64 {
    d.api.events_total(kind).await.expect("GET /metrics")
}

async fn wait_ready(d: &Daemon, id: &str, max: Duration) -> Value {
    let t = Instant::now();
    loop {
        let v = d.ok("GET", &format!("/v1/templates/{id}"), None, 200).await;
        if v["status"] != "building" {
            return v;
        }
        assert!(t.elapsed() < max, "{id} still building: {v}\n{}", d.logs());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[test]
fn templates_serve_any_size_through_variants() {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("web.toml"), WEB).expect("recipe");
    let d = Daemon::start(
        r#"[templates]
variant_wait = "10m"

[pools]
default_template = 0
templates = [{ template = "tpl-web", count = 1, vcpus = 2, memory_mib = 768 }]
"#,
    );
    let bin = strata_testkit::strata_bin();
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;

        // 1. The template and its 2x768 variant, by the CLI.
        let t = Instant::now();
        let path = dir.path().join("web.toml");
        let out = strata_testkit::run_strata(
            &bin,
            &d.url,
            d.token().as_deref(),
            &[
                "template",
                "build",
                "-f",
                path.to_str().expect("path"),
                "--id",
                "tpl-web",
                "--sizes",
                "2x768",
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "build: {stderr}\n{}", d.logs());
        assert!(
            stderr.contains("size variant"),
            "the CLI follows the variant: {stderr}"
        );
        eprintln!(
            "template + 2x768 variant: {:.1} s",
            t.elapsed().as_secs_f64()
        );
        let vs = d
            .ok("GET", "/v1/templates/tpl-web/variants", None, 200)
            .await;
        let items = vs["items"].as_array().expect("items").clone();
        assert_eq!(items.len(), 1, "{vs}");
        assert_eq!(items[0]["status"], "ready", "{vs}");
        assert_eq!(items[0]["size"]["vcpus"], 2, "{vs}");
        assert_eq!(items[0]["size"]["memory_mib"], 768, "{vs}");
        assert_eq!(items[0]["variant_of"], "tpl-web", "{vs}");
        let v768 = items[0]["id"].as_str().expect("id").to_owned();
        assert_eq!(events(&d, "template_variant_started").await, 1);

        // The pool of that size fills with a fork of the variant; the
        // create claims it.
        d.wait_warm(1, Duration::from_secs(120)).await;
        let t = Instant::now();
        let a = d
            .create(json!({"template": "tpl-web", "size": {"vcpus": 2, "memory_mib": 768}}))
            .await;
        eprintln!(
            "create of the variant's size: {} ms",
            t.elapsed().as_millis()
        );
        assert_eq!(
            events(&d, "warm_pool_claim").await,
            1,
            "a warm guest of the variant"
        );
        let e = d
            .sh(
                &a,
                "curl -sS --max-time 5 http://127.0.0.1:8000/hello.txt; hostname",
            )
            .await;
        assert_eq!(
            e.code,
            Some(0),
            "the start command runs in a fork of the variant: {:?} {}",
            e.error,
            String::from_utf8_lossy(&e.stderr)
        );
        let out = e.out();
        let mut l = out.lines();
        assert_eq!(l.next(), Some("hello-variant"), "{out}");
        assert_eq!(l.next(), Some(a.as_str()), "the fork's own hostname: {out}");
        let (cpus, mib) = cpus_and_mib(&d, &a).await;
        assert_eq!(cpus, 2, "vCPUs of the 2x768 fork");
        assert!(about(mib, 768), "MemTotal {mib} MiB in a 768 MiB guest");
        let rec = d.ok("GET", &format!("/v1/sandboxes/{a}"), None, 200).await;
        assert_eq!(rec["template"], v768.as_str(), "{rec}");
        assert_eq!(rec["size"]["vcpus"], 2, "{rec}");

        // 2. Another size: 202 with progress, the same build for a second
        // create, then the CLI waits and creates.
        let body = json!({"template": "tpl-web", "size": {"memory_mib": 1024}});
        let (s, v) = d.call("POST", "/v1/sandboxes", Some(body.clone())).await;
        assert_eq!(s, 202, "{v}");
        assert_eq!(v["status"], "building", "{v}");
        let v1024 = v["variant"]["id"].as_str().expect("variant id").to_owned();
        assert!(v1024.starts_with("tpl-v"), "{v}");
        assert_ne!(v1024, v768);
        assert!(v["variant"]["progress"]["step"].is_string(), "{v}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("1024 MiB")),
            "{v}"
        );
        let (s, again) = d.call("POST", "/v1/sandboxes", Some(body.clone())).await;
        assert_eq!(s, 202, "{again}");
        assert_eq!(again["variant"]["id"], v1024.as_str(), "one build: {again}");
        assert_eq!(events(&d, "template_variant_started").await, 2);
        let out = strata_testkit::run_strata(
            &bin,
            &d.url,
            d.token().as_deref(),
            &[
                "--json",
                "create",
                "--template",
                "tpl-web",
                "--memory",
                "1024",
            ],
        );
        assert!(
            out.status.success(),
            "strata create: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            d.logs()
        );
        let made: Value = serde_json::from_slice(&out.stdout).expect("--json sandbox");
        let b = made["id"].as_str().expect("id").to_owned();
        let (cpus, mib) = cpus_and_mib(&d, &b).await;
        assert_eq!(cpus, 1);
        assert!(about(mib, 1024), "MemTotal {mib} MiB in a 1024 MiB guest");
        let t = Instant::now();
        let c = d.create(body).await;
        let fork_ms = t.elapsed().as_millis();
        assert_eq!(
            events(&d, "template_variant_started").await,
            2,
            "no new build"
        );
        eprintln!("a later create of that size: {fork_ms} ms (a fork)");
        let e = d
            .sh(&c, "curl -sS --max-time 5 http://127.0.0.1:8000/hello.txt")
            .await;
        assert_eq!(e.out().trim(), "hello-variant");

        // 3. The default template, waiting; a recipe at another size than
        // its base's builds on the base's variant, which it reuses after.
        let (s, v) = d
            .call(
                "POST",
                "/v1/sandboxes",
                Some(json!({"size": {"vcpus": 2, "memory_mib": 768}, "wait": true})),
            )
            .await;
        assert_eq!(s, 201, "{v}\n{}", d.logs());
        let dflt = v["id"].as_str().expect("id").to_owned();
        assert_eq!(cpus_and_mib(&d, &dflt).await.0, 2);
        assert_eq!(events(&d, "template_variant_started").await, 3);
        let v = d
            .ok(
                "POST",
                "/v1/templates",
                Some(json!({
                    "id": "tpl-two",
                    "size": {"vcpus": 2, "memory_mib": 768},
                    "recipe": {"base": "default", "step": [{"run": "echo two > /two"}]},
                })),
                202,
            )
            .await;
        assert_eq!(v["size"]["vcpus"], 2, "{v}");
        let v = wait_ready(&d, "tpl-two", Duration::from_secs(600)).await;
        assert_eq!(v["status"], "ready", "{v}\n{}", d.logs());
        assert_eq!(
            events(&d, "template_variant_started").await,
            3,
            "the base's 2x768 variant was reused"
        );
        let two = d.create(json!({"template": "tpl-two"})).await;
        let e = d.sh(&two, "cat /two; nproc").await;
        assert_eq!(e.out().trim(), "two\n2");

        // 4. Not listed; they go with their template; no builder left.
        let all = d.ok("GET", "/v1/templates", None, 200).await;
        assert!(!all.to_string().contains("tpl-v"), "{all}");
        let sbs = d.ok("GET", "/v1/sandboxes", None, 200).await;
        assert!(
            !sbs.to_string().contains("strata.build"),
            "builder sandboxes remain: {sbs}"
        );
        d.ok("DELETE", "/v1/templates/tpl-web", None, 200).await;
        for v in [&v768, &v1024] {
            d.ok("GET", &format!("/v1/templates/{v}"), None, 404).await;
        }
        let (s, v) = d
            .call(
                "POST",
                "/v1/sandboxes",
                Some(json!({"template": "tpl-web", "size": {"vcpus": 2, "memory_mib": 768}})),
            )
            .await;
        assert_eq!(s, 404, "{v}");
        // Sandboxes made from the variants run on (they are independent).
        let e = d.sh(&a, "true").await;
        assert_eq!(e.code, Some(0));
    });
}
