//! Snapshot signing against a real `stratad` and real guests (issue 12,
//! docs/keys.md): the upgrade from a release that signed nothing (its
//! snapshots, wake snapshot and template carry no signature and the store
//! has no adoption record) adopts them at the first start, and they restore;
//! after that, a snapshot that lost its signature and one whose
//! `device.state` was changed are refused as `snapshot_unusable` (the
//! sandbox runs on), while the adopted ones keep restoring.

mod common;

use std::path::{Path, PathBuf};

use common::Daemon;
use serde_json::{json, Value};
use stratad::store::Store;

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

fn pool(d: &Daemon) -> PathBuf {
    d.root.join("data/pool")
}

/// What an attacker with write access to the pool (or the previous
/// release's writer) does to a read-only state subvolume.
fn with_writable(dir: &Path, change: impl FnOnce(&Path)) {
    strata_storage::subvol::set_readonly(dir, false).expect("writable");
    change(dir);
    strata_storage::subvol::set_readonly(dir, true).expect("read-only again");
}

fn unsign(dir: &Path) {
    with_writable(dir, |d| match std::fs::remove_file(d.join("state.sig")) {
        Ok(()) => {}
        Err(e) => panic!("{} had no signature: {e}", d.display()),
    });
}

/// Makes the pool and store look as the release before signing left
/// them: no signature on any snapshot or template, no adoption record.
fn as_before_signing(d: &Daemon) {
    for kind in ["snapshots", "templates"] {
        for e in std::fs::read_dir(pool(d).join(kind))
            .expect("state dir")
            .flatten()
        {
            unsign(&e.path());
        }
    }
    let store =
        stratad::store::SqliteStore::open(&d.root.join("data/strata.db"), 1).expect("store");
    store
        .put_tenant_setting(
            stratad::caller::PLATFORM_SCOPE,
            stratad::service::signing::ADOPTED_KEY,
            None,
        )
        .expect("clear the adoption record");
}

#[test]
fn states_made_before_signing_are_adopted_once_and_tampered_ones_are_refused() {
    let rt = strata_testkit::tokio_rt();
    let d = Daemon::start("");
    let (a, s1, h) = rt.block_on(async {
        d.wait_template().await;
        let a = d.create(json!({})).await;
        assert_eq!(d.sh(&a, "echo one > /root/f; sync").await.code, Some(0));
        let s1 = d
            .ok("POST", &format!("/v1/sandboxes/{a}/snapshots"), None, 201)
            .await;
        let s1 = s1["id"].as_str().expect("id").to_owned();
        let h = d.create(json!({})).await;
        assert_eq!(d.sh(&h, "echo asleep > /root/h; sync").await.code, Some(0));
        let v = d
            .ok("POST", &format!("/v1/sandboxes/{h}/hibernate"), None, 200)
            .await;
        assert_eq!(v["state"], "hibernated", "{v}");
        (a, s1, h)
    });
    d.stop();
    as_before_signing(&d);
    d.start_again();
    rt.block_on(async {
        let logs = d.logs();
        assert!(
            logs.contains("states made before signing adopted"),
            "adoption ran at the upgrade:\n{logs}"
        );
        // The adopted snapshot forks, the hibernated sandbox wakes, the
        // template makes sandboxes.
        let b = d
            .ok(
                "POST",
                &format!("/v1/snapshots/{s1}/fork"),
                Some(json!({})),
                201,
            )
            .await;
        let b = b["id"].as_str().expect("id").to_owned();
        assert_eq!(d.sh(&b, "cat /root/f").await.out(), "one");
        let v = d
            .ok("POST", &format!("/v1/sandboxes/{h}/resume"), None, 200)
            .await;
        assert_eq!(v["state"], "running", "{v}");
        assert_eq!(d.sh(&h, "cat /root/h").await.out(), "asleep");
        let c = d.create(json!({})).await;
        assert_eq!(d.sh(&c, "echo fresh").await.out(), "fresh");
        for id in [&b, &c, &h] {
            d.ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200)
                .await;
        }
    });

    // After the upgrade: two snapshots taken (signed), then one loses its
    // signature and one gets a changed device.state while the daemon is
    // down; the next start adopts nothing.
    let (s2, s3) = rt.block_on(async {
        assert_eq!(d.sh(&a, "echo two > /root/f; sync").await.code, Some(0));
        let mut ids = Vec::new();
        for _ in 0..2 {
            let s = d
                .ok("POST", &format!("/v1/sandboxes/{a}/snapshots"), None, 201)
                .await;
            ids.push(s["id"].as_str().expect("id").to_owned());
        }
        assert_eq!(d.sh(&a, "echo three > /root/f; sync").await.code, Some(0));
        (ids[0].clone(), ids[1].clone())
    });
    d.stop();
    unsign(&pool(&d).join("snapshots").join(&s2));
    with_writable(&pool(&d).join("snapshots").join(&s3), |dir| {
        let p = dir.join("device.state");
        let mut b = std::fs::read(&p).expect("device.state");
        let i = b.len() / 2;
        b[i] ^= 0x01;
        std::fs::write(&p, b).expect("write");
    });
    d.start_again();
    rt.block_on(async {
        let (s, v) = d
            .call("POST", &format!("/v1/snapshots/{s2}/fork"), Some(json!({})))
            .await;
        assert_eq!((s, code(&v)), (422, "snapshot_unusable"), "{v}");
        assert!(v.to_string().contains("no signature"), "{v}");
        let (s, v) = d
            .call(
                "POST",
                &format!("/v1/sandboxes/{a}/rewind"),
                Some(json!({"to": s3})),
            )
            .await;
        assert_eq!((s, code(&v)), (422, "snapshot_unusable"), "{v}");
        assert!(v.to_string().contains("device.state was changed"), "{v}");
        assert_eq!(
            d.sh(&a, "cat /root/f").await.out(),
            "three",
            "a refused rewind leaves the sandbox running as it was"
        );
        // The adopted snapshot still restores.
        d.ok(
            "POST",
            &format!("/v1/sandboxes/{a}/rewind"),
            Some(json!({"to": s1})),
            200,
        )
        .await;
        assert_eq!(d.sh(&a, "cat /root/f").await.out(), "one");
        d.ok("DELETE", &format!("/v1/sandboxes/{a}"), None, 200)
            .await;
    });
    d.shutdown();
}
