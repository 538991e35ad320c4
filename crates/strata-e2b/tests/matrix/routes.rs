//! The tables of the matrix against the routes the door serves.

use std::collections::BTreeSet;

use crate::control::{FORK_SNAPSHOT_ROUTES, ID_ROUTES, LIST_CREATE, TEMPLATE_ROUTES};
use crate::envd::ENVD_ROUTES;

/// `(METHOD, path)` of every route `strata_e2b::router` serves, read from
/// its source.
fn door_routes() -> BTreeSet<(String, String)> {
    let src = include_str!("../../src/lib.rs");
    let body = src
        .split("pub fn router(")
        .nth(1)
        .expect("router in lib.rs");
    let mut out = BTreeSet::new();
    for seg in body.split(".route(").skip(1) {
        let seg = seg.split(".layer(").next().unwrap();
        let start = seg.find('"').expect("a path") + 1;
        let end = start + seg[start..].find('"').unwrap();
        let path = seg[start..end]
            .replace("{p}", "/process.Process")
            .replace("{f}", "/filesystem.Filesystem");
        for m in ["get", "post", "put", "patch", "delete"] {
            let pat = format!("{m}(");
            let called = seg.match_indices(&pat).any(|(i, _)| {
                i == 0
                    || !seg.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && seg.as_bytes()[i - 1] != b'_'
            });
            if called {
                out.insert((m.to_ascii_uppercase(), path.clone()));
            }
        }
    }
    out
}

#[test]
fn the_tables_cover_every_route_of_the_door() {
    let served = door_routes();
    assert!(served.len() > 20, "{served:?}");
    let mut tested: BTreeSet<(String, String)> = BTreeSet::new();
    for r in &ID_ROUTES {
        tested.insert((r.method.into(), r.path.into()));
    }
    for (m, p, _, _) in LIST_CREATE {
        tested.insert((m.into(), p.into()));
    }
    for (m, p) in FORK_SNAPSHOT_ROUTES {
        tested.insert((m.into(), p.into()));
    }
    for (m, p) in TEMPLATE_ROUTES {
        tested.insert((m.into(), p.into()));
    }
    for r in &ENVD_ROUTES {
        tested.insert((r.method.into(), r.path.into()));
    }
    let untested: Vec<_> = served.difference(&tested).collect();
    let unknown: Vec<_> = tested.difference(&served).collect();
    assert!(
        untested.is_empty() && unknown.is_empty(),
        "routes the matrix does not test: {untested:?}; tested routes the door does not serve: {unknown:?}"
    );
}
