//! E2B template tags survive a restart of the door: a build's `name:tag`
//! and `tags`, a later assignment and a removal are stored with the tenant
//! before each call is answered, and a new door over the same store lists
//! exactly them (before, they were only in the door's memory).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{door, KEY};
use serde_json::{json, Value};

/// `GET /templates/{name}/tags` on the door at `url`.
async fn tags_json(url: &str, name: &str) -> Value {
    reqwest::Client::new()
        .get(format!("{url}/templates/{name}/tags"))
        .header("X-API-KEY", KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The tag names of `name`, sorted.
async fn tags_of(url: &str, name: &str) -> Vec<String> {
    let v = tags_json(url, name).await;
    let mut tags: Vec<String> = v
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t["tag"].as_str().unwrap().to_owned())
        .collect();
    tags.sort();
    tags
}

#[tokio::test]
async fn template_tags_are_kept_across_a_restart_of_the_door() {
    let d = door().await;
    let r = d
        .control(
            "POST",
            "/v3/templates",
            Some(KEY),
            r#"{"name": "tagged-app:v1", "tags": ["stable"]}"#,
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    let (tid, bid) = (
        v["templateID"].as_str().unwrap().to_owned(),
        v["buildID"].as_str().unwrap().to_owned(),
    );
    let r = d
        .control(
            "POST",
            &format!("/v2/templates/{tid}/builds/{bid}"),
            Some(KEY),
            &json!({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["true"]}]})
                .to_string(),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let r = d
        .control(
            "POST",
            "/templates/tags",
            Some(KEY),
            r#"{"target": "tagged-app:v1", "tags": ["v2", "old"]}"#,
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = d
        .control(
            "DELETE",
            "/templates/tags",
            Some(KEY),
            r#"{"name": "tagged-app", "tags": ["old"]}"#,
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(tags_of(&d.url, "tagged-app").await, ["stable", "v1", "v2"]);

    // A new door over the same service and store: what a restart reads.
    let router = strata_e2b::router(
        d.app.service().clone(),
        d.app.security().cloned(),
        strata_e2b::E2bConfig {
            api_keys: vec![strata_e2b::auth::ApiKey::bare(KEY)],
            token_secret: common::SECRET.to_vec(),
            rate_limit_per_second: 0.0,
            auth_failures_per_minute: 0,
            ..Default::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, service).await });
    assert_eq!(tags_of(&url, "tagged-app").await, ["stable", "v1", "v2"]);
    // Each tag still names the build it was given to.
    let v = tags_json(&url, "tagged-app").await;
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .all(|t| t["buildID"] == bid.as_str()),
        "{v}"
    );
}
