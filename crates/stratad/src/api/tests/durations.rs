//! Durations from outside (issue 12 part 2, finding 20): a duration that
//! parses but reaches past what the calendar holds ("100000000000d" is
//! 274 million years) answers 400 `invalid_request` and changes nothing,
//! instead of panicking the request's task on chrono arithmetic.

use super::security::{req, sec_harness};
use super::*;

const HUGE: &str = "100000000000d";

#[tokio::test]
async fn rewind_ago_beyond_the_calendar_is_invalid_and_changes_nothing() {
    let h = harness();
    let id = create(&h).await;
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/rewind"),
        format!(r#"{{"ago":"{HUGE}"}}"#),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    assert!(
        v["error"]["message"].as_str().unwrap().contains("ago"),
        "{v}"
    );
    let (_, got) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(got["state"], "running", "no state changed: {got}");
    assert!(got["pending_op"].is_null(), "{got}");
}

#[tokio::test]
async fn create_timeouts_beyond_a_year_are_invalid_and_make_nothing() {
    let h = harness();
    for field in ["idle_timeout", "snapshot_interval"] {
        for d in [HUGE, "367d"] {
            let (s, v) = call(
                &h,
                "POST",
                "/v1/sandboxes",
                format!(r#"{{"template":"tpl-base","{field}":"{d}"}}"#),
            )
            .await;
            assert_eq!(
                (s, code(&v)),
                (StatusCode::BAD_REQUEST, "invalid_request"),
                "{field} {d}: {v}"
            );
        }
    }
    let (s, list) = call(&h, "GET", "/v1/sandboxes", "").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(0), "{list}");
    // A year is still taken.
    let (s, v) = call(
        &h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","snapshot_interval":"365d","idle_timeout":"365d"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn token_expiry_and_audit_since_beyond_the_calendar_are_invalid() {
    let h = sec_harness(|_| {});
    let (_, before, _) = req(&h, "GET", "/v1/tokens", Some(&h.admin), "").await;
    let (s, v, _) = req(
        &h,
        "POST",
        "/v1/tokens",
        Some(&h.admin),
        json!({ "role": "developer", "expires_in": HUGE }).to_string(),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    let (_, after, _) = req(&h, "GET", "/v1/tokens", Some(&h.admin), "").await;
    assert_eq!(before, after, "no token made");
    let (s, v, _) = req(
        &h,
        "GET",
        &format!("/v1/audit?since={HUGE}"),
        Some(&h.admin),
        "",
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
}
