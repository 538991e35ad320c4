//! Process logs end to end: a real `stratad`, a real TCG guest. What the
//! sandbox's commands print through `/v1` exec is in
//! `GET /v1/sandboxes/{id}/logs` (start with argv, stdout, stderr, exit),
//! pages by cursor, shows in `strata logs`; a guest flooding output stays
//! under `[logs] max_bytes_per_sandbox`; another tenant's sandbox answers
//! 404 like an unknown one; a viewer may not read it; bad cursors are 400;
//! the log goes with the sandbox. The ring's bounds are unit tests
//! (`service::logs`).

mod common;

use common::Daemon;
use serde_json::{json, Value};
use strata_testkit::Api;

async fn logs(api: &Api, id: &str, query: &str) -> (u16, Value) {
    api.json(
        reqwest::Method::GET,
        &format!("/v1/sandboxes/{id}/logs{query}"),
        None,
    )
    .await
    .expect("request")
}

fn texts(v: &Value) -> Vec<(String, String)> {
    v["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| {
            (
                e["stream"].as_str().unwrap_or("").to_owned(),
                e["text"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

#[test]
fn commands_output_is_logged_bounded_paged_and_tenant_scoped() {
    let cap = 64 * 1024;
    let d = Daemon::start(&format!("[logs]\nmax_bytes_per_sandbox = {cap}\n"));
    strata_testkit::tokio_rt().block_on(async {
        d.wait_template().await;
        let (a, a_token) = d.tenant_token("a", "developer").await;
        let (viewer, _) = d.tenant_token("a", "viewer").await;
        let (b, _) = d.tenant_token("b", "developer").await;
        let (s, v) = a
            .json(reqwest::Method::POST, "/v1/sandboxes", Some(json!({})))
            .await
            .expect("create");
        assert_eq!(s, 201, "{v}");
        let id = v["id"].as_str().expect("id").to_owned();

        let (code, _) = a
            .exec_output(
                &id,
                &["sh", "-c", "echo hello-out; echo hello-err >&2; exit 3"],
            )
            .await
            .expect("exec");
        assert_eq!(code, 3);
        let (s, v) = logs(&a, &id, "").await;
        assert_eq!(s, 200, "{v}");
        let got = texts(&v);
        assert_eq!(
            got.first(),
            Some(&(
                "start".to_owned(),
                "sh -c echo hello-out; echo hello-err >&2; exit 3".to_owned()
            )),
            "{v}"
        );
        let out: String = got
            .iter()
            .filter(|(k, _)| k == "stdout")
            .map(|(_, t)| t.as_str())
            .collect();
        let err: String = got
            .iter()
            .filter(|(k, _)| k == "stderr")
            .map(|(_, t)| t.as_str())
            .collect();
        assert_eq!((out.as_str(), err.as_str()), ("hello-out\n", "hello-err\n"));
        assert_eq!(got.last(), Some(&("exit".to_owned(), "exit 3".to_owned())));
        let next = v["next"].as_u64().expect("next");

        // Paging: after the cursor there is only what came later.
        a.exec_output(&id, &["echo", "second"]).await.expect("exec");
        let (_, v2) = logs(&a, &id, &format!("?after={next}")).await;
        let got2 = texts(&v2);
        assert_eq!(
            got2[0],
            ("start".to_owned(), "echo second".to_owned()),
            "{v2}"
        );
        assert!(v2["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["exec"] == 2));
        let (_, one) = logs(&a, &id, "?limit=1").await;
        assert_eq!(one["entries"].as_array().unwrap().len(), 1);

        // The CLI prints the same.
        let cli = strata_testkit::run_strata(
            &strata_testkit::strata_bin(),
            &d.url,
            Some(&a_token),
            &["logs", &id],
        );
        assert!(cli.status.success(), "{cli:?}");
        let stdout = String::from_utf8_lossy(&cli.stdout);
        assert!(stdout.contains("$ echo second]"), "{stdout}");
        assert!(stdout.contains("hello-out\n"), "{stdout}");
        assert!(
            String::from_utf8_lossy(&cli.stderr).contains("hello-err"),
            "{cli:?}"
        );

        // Another tenant: like an unknown sandbox; a viewer: refused; bad input: 400.
        let (s, v) = logs(&b, &id, "").await;
        assert_eq!(s, 404, "{v}");
        let (s, unknown) = logs(&b, "sb-000000000000", "").await;
        assert_eq!(s, 404);
        assert_eq!(v["error"]["code"], unknown["error"]["code"]);
        let (s, v) = logs(&viewer, &id, "").await;
        assert_eq!(s, 403, "{v}");
        for q in [
            "?after=-1",
            "?limit=0",
            "?limit=5000",
            "?after=x",
            "?after=1&after=2",
        ] {
            let (s, v) = logs(&a, &id, q).await;
            assert_eq!(s, 400, "{q}: {v}");
            assert_eq!(v["error"]["code"], "invalid_request", "{q}: {v}");
        }

        // A flood of 8 MiB stays under the cap; the tail is kept.
        let (code, _) = a
            .exec_output(
                &id,
                &[
                    "sh",
                    "-c",
                    "head -c 8388608 /dev/zero | tr '\\0' y; echo; echo THE-END",
                ],
            )
            .await
            .expect("exec");
        assert_eq!(code, 0);
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let (s, v) = logs(&a, &id, &format!("?after={after}&limit=1000")).await;
            assert_eq!(s, 200);
            let n = v["entries"].as_array().unwrap().len();
            all.extend(texts(&v));
            after = v["next"].as_u64().unwrap();
            if n < 1000 {
                assert!(v["dropped"].as_u64().unwrap() > 0, "{}", v["dropped"]);
                break;
            }
        }
        let kept: usize = all.iter().map(|(_, t)| t.len()).sum();
        assert!(
            kept <= cap,
            "kept {kept} bytes of text under a {cap} byte cap"
        );
        let tail: String = all
            .iter()
            .filter(|(k, _)| k == "stdout")
            .map(|(_, t)| t.as_str())
            .collect();
        assert!(
            tail.ends_with("THE-END\n"),
            "{}",
            &tail[tail.len().saturating_sub(40)..]
        );
        assert_eq!(all.last().map(|(_, t)| t.as_str()), Some("exit 0"));

        // Deleting the sandbox drops its log.
        let (s, _) = a
            .json(
                reqwest::Method::DELETE,
                &format!("/v1/sandboxes/{id}"),
                None,
            )
            .await
            .expect("delete");
        assert!(s == 200 || s == 204, "{s}");
        let (s, _) = logs(&a, &id, "").await;
        assert_eq!(s, 404);
    });
}
