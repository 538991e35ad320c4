//! The web console: static files served at `/console/`, compiled into the
//! binary (`crates/stratad/console/`, no build step, nothing from a CDN).
//!
//! The console is a client of the `/v1` API like the CLI: these routes are
//! public files that hold no data and no credential; every figure the pages
//! show comes from `/v1` with the bearer token the user typed, which the page
//! keeps in a JavaScript variable only (no cookie, no storage), so nothing a
//! browser sends by itself authenticates anyone. Every response carries a
//! strict Content-Security-Policy (scripts and styles from these files only,
//! no inline script, no framing) and `nosniff`; see docs/console.md.

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The Content-Security-Policy of every console response.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; \
frame-ancestors 'none'; form-action 'self'";

/// One embedded file: its name under `/console/`, content type and bytes.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

/// Every file of the console.
const ASSETS: &[Asset] = &[
    Asset {
        name: "index.html",
        content_type: "text/html; charset=utf-8",
        body: include_str!("../console/index.html"),
    },
    Asset {
        name: "style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../console/style.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../console/app.js"),
    },
    Asset {
        name: "api.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../console/api.js"),
    },
    Asset {
        name: "dom.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../console/dom.js"),
    },
    Asset {
        name: "pages.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../console/pages.js"),
    },
    Asset {
        name: "terminal.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../console/terminal.js"),
    },
];

/// The headers of every console response.
fn secured(mut r: Response) -> Response {
    let h = r.headers_mut();
    let set: [(HeaderName, &'static str); 6] = [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-cache"),
        (
            HeaderName::from_static("cross-origin-resource-policy"),
            "same-origin",
        ),
    ];
    for (k, v) in set {
        h.insert(k, HeaderValue::from_static(v));
    }
    r
}

fn file(name: &str) -> Response {
    let r = match ASSETS.iter().find(|a| a.name == name) {
        Some(a) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(a.content_type),
            )],
            a.body,
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            "no such console file\n",
        )
            .into_response(),
    };
    secured(r)
}

fn redirect() -> Response {
    secured(
        (
            StatusCode::PERMANENT_REDIRECT,
            [(header::LOCATION, HeaderValue::from_static("/console/"))],
        )
            .into_response(),
    )
}

/// The console's routes: `/console/` (the page), `/console/<file>` and
/// `/console` (a redirect to `/console/`). No fallback, so it merges into
/// the daemon's router.
pub fn router() -> Router {
    Router::new()
        .route("/console", get(|| async { redirect() }))
        .route("/console/", get(|| async { file("index.html") }))
        .route(
            "/console/*file",
            get(|axum::extract::Path(f): axum::extract::Path<String>| async move { file(&f) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get(uri: &str) -> (StatusCode, axum::http::HeaderMap, String) {
        let r = router()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let (s, h) = (r.status(), r.headers().clone());
        let b = r.into_body().collect().await.unwrap().to_bytes();
        (s, h, String::from_utf8_lossy(&b).into_owned())
    }

    #[tokio::test]
    async fn every_console_response_carries_the_strict_headers() {
        for uri in [
            "/console/",
            "/console/app.js",
            "/console/style.css",
            "/console/nope.js",
            "/console",
        ] {
            let (_, h, _) = get(uri).await;
            assert_eq!(h["content-security-policy"], CSP, "{uri}");
            assert_eq!(h["x-content-type-options"], "nosniff", "{uri}");
            assert_eq!(h["referrer-policy"], "no-referrer", "{uri}");
            assert_eq!(h["x-frame-options"], "DENY", "{uri}");
            assert!(h.get("access-control-allow-origin").is_none(), "{uri}");
        }
        let (s, h, body) = get("/console/").await;
        assert_eq!(s, StatusCode::OK);
        assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
        assert!(body.contains("app.js"));
        let (s, h, _) = get("/console/app.js").await;
        assert_eq!(s, StatusCode::OK);
        assert!(h["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript"));
        assert_eq!(get("/console/nope.js").await.0, StatusCode::NOT_FOUND);
        let (s, h, _) = get("/console").await;
        assert_eq!(s, StatusCode::PERMANENT_REDIRECT);
        assert_eq!(h["location"], "/console/");
    }

    #[test]
    fn the_pages_hold_no_inline_script_or_style_and_no_outside_source() {
        for a in ASSETS {
            let b = a.body;
            if a.name.ends_with(".html") {
                // Every <script> names a file of its own; no style attribute
                // or element, no inline handler.
                for (i, _) in b.match_indices("<script") {
                    let tag = &b[i..i + b[i..].find('>').unwrap()];
                    assert!(tag.contains("src=\"/console/"), "{}: {tag}", a.name);
                }
                assert!(!b.contains("<style"), "{}", a.name);
                assert!(!b.contains(" style="), "{}", a.name);
                let lower = b.to_lowercase();
                for (i, _) in lower.match_indices(" on") {
                    let name: String = lower[i + 3..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphabetic())
                        .collect();
                    let after = &lower[i + 3 + name.len()..];
                    assert!(
                        !after.starts_with('='),
                        "{}: inline handler on{name}",
                        a.name
                    );
                }
            }
            // Nothing loads from elsewhere (the SVG namespace is a name, not a load).
            let b2 = b.replace("http://www.w3.org/2000/svg", "");
            assert!(
                !b2.contains("http://") && !b2.contains("https://"),
                "{}",
                a.name
            );
            // Data is never written as markup.
            for sink in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
            ] {
                assert!(!b.contains(sink), "{} uses {sink}", a.name);
            }
        }
    }
}
