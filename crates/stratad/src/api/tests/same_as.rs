//! `same_as` records (rolling snapshots of unchanged guests,
//! `service::unchanged`) through the API and the service, with the test
//! double as the engine: a rewind to a record and a fork of it go to the
//! snapshot it names; retention keeps a target a kept record names and
//! removes no subvolume for a record; a user's delete of a target takes its
//! records with it. The decision itself: unit tests in `service::unchanged`;
//! with real guests: `tests/same_as.rs`.

use super::*;
use crate::store::{SnapshotKind, SnapshotRecord, SnapshotStatus};

async fn put(h: &Harness, rec: &SnapshotRecord) {
    let r = rec.clone();
    h.app
        .service()
        .db(move |s| s.put_snapshot(&r))
        .await
        .unwrap();
}

async fn status(h: &Harness, id: &SnapshotId) -> SnapshotStatus {
    let i = id.clone();
    h.app
        .service()
        .db(move |s| s.get_snapshot(&i))
        .await
        .unwrap()
        .unwrap()
        .status
}

#[tokio::test]
async fn records_resolve_to_their_target_and_never_outlive_it() {
    let h = harness();
    let (s, v) = call(&h, "POST", "/v1/sandboxes", r#"{"template":"tpl-base"}"#).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id: SandboxId = v["id"].as_str().unwrap().parse().unwrap();
    let (s, v) = call(&h, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "{}").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let snap: SnapshotId = v["id"].as_str().unwrap().parse().unwrap();
    let svc = h.app.service();
    let s2 = snap.clone();
    let base = svc.db(move |s| s.get_snapshot(&s2)).await.unwrap().unwrap();

    // History three hours back, 10-minute buckets (the default day tier):
    // [b, b+10m): t (real), r1 (= t), x (real), z (real);
    // [b+10m, b+20m): r2 (= x); then y (real, recent). The manual snapshot
    // taken above is left alone (its usage is written back meanwhile).
    let now = Utc::now();
    let b = {
        let t = now - chrono::TimeDelta::hours(3);
        let ms = t.timestamp_millis();
        chrono::DateTime::from_timestamp_millis(ms - ms.rem_euclid(600_000)).unwrap()
    };
    let rec = |n: &str, mins: i64, same_as: Option<&SnapshotRecord>| SnapshotRecord {
        id: format!("snap-{n}").parse().unwrap(),
        kind: SnapshotKind::Rolling,
        created_at: b + chrono::TimeDelta::minutes(mins),
        pause_ms: same_as.is_none().then_some(15.0),
        same_as: same_as.map(|t| t.id.clone()),
        ..base.clone()
    };
    let t = rec("t", 1, None);
    let r1 = rec("r1", 2, Some(&t));
    let x = rec("x", 3, None);
    let z = rec("z", 4, None);
    let r2 = rec("r2", 15, Some(&x));
    let mut y = rec("y", 0, None);
    y.created_at = now;
    for r in [&t, &r1, &x, &z, &r2, &y] {
        put(&h, r).await;
    }
    let (_, list) = call(&h, "GET", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let listed: Vec<(String, Value)> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["id"].as_str().unwrap().to_owned(), s["same_as"].clone()))
        .collect();
    assert!(
        listed.contains(&("snap-r2".into(), json!("snap-x"))),
        "{list}"
    );
    assert!(listed.contains(&("snap-x".into(), Value::Null)), "{list}");

    // Retention: one per bucket; x is named by the kept r2, so it stays.
    h.engine.deleted_snaps.lock().unwrap().clear();
    let gone = svc.gc(&id).await.unwrap();
    assert_eq!(status(&h, &r1.id).await, SnapshotStatus::Deleted);
    assert_eq!(
        status(&h, &x.id).await,
        SnapshotStatus::Ready,
        "a kept record's target stays"
    );
    assert_eq!(status(&h, &r2.id).await, SnapshotStatus::Ready);
    assert_eq!(
        status(&h, &t.id).await,
        SnapshotStatus::Ready,
        "oldest of its bucket"
    );
    assert_eq!(status(&h, &z.id).await, SnapshotStatus::Deleted);
    assert_eq!(status(&h, &snap).await, SnapshotStatus::Ready, "manual");
    assert_eq!(gone, 2, "r1 and z");
    assert_eq!(
        *h.engine.deleted_snaps.lock().unwrap(),
        vec![z.id.clone()],
        "a record has no subvolume to remove"
    );

    // A rewind to r2 returns the sandbox to x; the answer names r2.
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/rewind"),
        r#"{"to":"snap-r2"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["rewound_to"]["id"], "snap-r2", "{v}");
    assert_eq!(v["rewound_to"]["same_as"], "snap-x", "{v}");
    assert_eq!(h.engine.returned_to.lock().unwrap().last(), Some(&x.id));

    // A fork of r2 is a fork of x.
    let (s, v) = call(&h, "POST", "/v1/snapshots/snap-r2/fork", "{}").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["source_snapshot"], "snap-x", "{v}");

    // Deleting x takes r2 with it (one transaction); only x has a subvolume.
    h.engine.deleted_snaps.lock().unwrap().clear();
    let (s, v) = call(&h, "DELETE", "/v1/snapshots/snap-x", "").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(status(&h, &r2.id).await, SnapshotStatus::Deleted);
    assert_eq!(*h.engine.deleted_snaps.lock().unwrap(), vec![x.id.clone()]);
    let (s, _) = call(&h, "GET", "/v1/snapshots/snap-r2", "").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "a deleted record is not served");
}
