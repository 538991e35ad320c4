//! `PUT|GET /v1/template-files/{sha256}` (a recipe's `copy` archives):
//! per tenant, content-checked, gated and audited like a build, refused to
//! viewers, and a malformed or mismatching hash changes nothing.

use sha2::{Digest, Sha256};

use super::security::{req, sec_harness, token};
use super::*;

#[tokio::test]
async fn template_files_are_per_tenant_and_content_checked() {
    let h = sec_harness(|_| {});
    let acme = token(&h, "acme", "developer").await;
    let acme_viewer = token(&h, "acme", "viewer").await;
    let beta = token(&h, "beta", "developer").await;
    let body = b"a tar, as far as the daemon cares".to_vec();
    let sha = hex::encode(Sha256::digest(&body));
    let path = format!("/v1/template-files/{sha}");

    // Not uploaded yet: 404 for everyone.
    let (s, v, _) = req(&h, "GET", &path, Some(&acme), "").await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );

    // Content that does not hash to the name: 400, nothing kept.
    let (s, v, _) = req(&h, "PUT", &path, Some(&acme), b"other bytes".to_vec()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, _, _) = req(&h, "GET", &path, Some(&acme), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Not a sha256: 400.
    for bad in ["abc", "NOT-A-SHA", &"A".repeat(64)] {
        let (s, v, _) = req(
            &h,
            "PUT",
            &format!("/v1/template-files/{bad}"),
            Some(&acme),
            body.clone(),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        let (s, _, _) = req(
            &h,
            "GET",
            &format!("/v1/template-files/{bad}"),
            Some(&acme),
            "",
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}");
    }
    // A viewer uploads nothing and reads nothing.
    let (s, _, _) = req(&h, "PUT", &path, Some(&acme_viewer), body.clone()).await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // The right content: 201, audited as the developer's build call.
    let (s, v, _) = req(&h, "PUT", &path, Some(&acme), body.clone()).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["bytes"], body.len());
    let audit = std::fs::read_to_string(h.dir.path().join("audit.jsonl")).unwrap();
    assert!(
        audit
            .lines()
            .any(|l| l.contains("build_template") && l.contains("\"acme\"")),
        "{audit}"
    );
    let (s, _, _) = req(&h, "GET", &path, Some(&acme), "").await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = req(&h, "GET", &path, Some(&acme_viewer), "").await;
    assert_eq!(s, StatusCode::FORBIDDEN);

    // Another tenant does not see it: the same answer as for any unknown hash.
    let (s, v, _) = req(&h, "GET", &path, Some(&beta), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let other = hex::encode(Sha256::digest(b"never uploaded"));
    let (_, unknown, _) = req(
        &h,
        "GET",
        &format!("/v1/template-files/{other}"),
        Some(&beta),
        "",
    )
    .await;
    assert_eq!(
        v.to_string().replace(&sha, "X"),
        unknown.to_string().replace(&other, "X")
    );
}

/// A body over `max_upload_bytes` that declares no length (chunked) is
/// found out as it streams: `413 payload_too_large`, nothing kept.
#[tokio::test]
async fn a_chunked_template_file_over_the_limit_is_413_and_leaves_nothing() {
    let h = sec_harness(|c| c.max_upload_bytes = 16);
    let acme = token(&h, "acme", "developer").await;
    let body = vec![b'x'; 40];
    let sha = hex::encode(Sha256::digest(&body));
    let path = format!("/v1/template-files/{sha}");
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = body
        .chunks(10)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    let (s, v, _) = req(
        &h,
        "PUT",
        &path,
        Some(&acme),
        AxBody::from_stream(futures::stream::iter(chunks)),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"]["code"], "payload_too_large", "{v}");
    let (s, _, _) = req(&h, "GET", &path, Some(&acme), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}
