//! Recovery of a lost host's sandbox from its replica (docs/cluster.md,
//! "Replicas"): two real `stratad` hosts with their own pools on one
//! PostgreSQL, real QEMU guests (TCG).
//!
//! 1. A sandbox created with `"replicate": true` runs on host A; a disk
//!    marker and a RAM marker (`/dev/shm`) are written, a snapshot taken;
//!    host B receives the replica (`GET` shows it in `replicas`, the
//!    snapshot is published in B's pool). A second snapshot (a second RAM
//!    marker) travels incrementally against the first.
//! 2. SIGKILL of A's daemon and its QEMUs: B's host-loss watcher takes the
//!    lease (a larger token) and installs the replica: the sandbox is
//!    `hibernated` on B with `state_reason` "recovered from replica …
//!    after host_lost of host-a" (the journal says so). A sandbox of A
//!    without replication is marked `failed` / `host_lost`, as before.
//! 3. An exec through B wakes it there: both markers are read back (disk
//!    and memory).
//! 4. A revived: its recovery does not adopt it (no VM of it), its own
//!    operations on it are `409` "not owned by this host", the record is
//!    unchanged.
//! 5. B, now the owner, replicates it onward by its periodic pass (the only
//!    other live host is A); A's restart keeps that replica (not an orphan
//!    to its recovery); A still runs nothing of it.
//! 6. Deleted on B: A's periodic pass removes the replica it holds (its
//!    subvolumes and its row in PostgreSQL).
//!
//! Needs `STRATA_TEST_PG_URL` (a unix-socket URL, as scripts/test-pg.sh
//! makes); without it the test prints a line and passes.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{alive, host_conf, metric, own, pg_row};
use common::Daemon;
use serde_json::{json, Value};

/// Waits until `GET` on `d` shows host `host` holding a replica of `id`
/// at snapshot `snap`.
async fn wait_replica(d: &Daemon, id: &str, host: &str, snap: &str) -> Value {
    d.wait_for(id, Duration::from_secs(120), |v| {
        v["replicas"].as_array().is_some_and(|rs| {
            rs.iter()
                .any(|r| r["host_id"] == host && r["snapshot_id"] == snap)
        })
    })
    .await
}

/// The QEMU processes whose command line names sandbox `id` and run dir
/// `run` (one host's VMs of it).
fn qemus_of(id: &str, run: &std::path::Path) -> Vec<u32> {
    let run = run.to_string_lossy().into_owned();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let cmd = strata_testkit::teardown::cmdline(pid);
        if cmd.contains("qemu") && cmd.contains(id) && cmd.contains(&run) && alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// `logs` without ANSI colour sequences.
fn plain(logs: &str) -> String {
    let mut out = String::with_capacity(logs.len());
    let mut esc = false;
    for c in logs.chars() {
        match (esc, c) {
            (false, '\x1b') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

#[test]
fn a_lost_hosts_replicated_sandbox_is_recovered_on_the_replica_host_with_memory_and_disk() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let t_all = Instant::now();
    let schema = common::cluster::schema("replica");
    let a = Daemon::start(&host_conf("host-a", &url, &schema, 4, true));
    let rt = strata_testkit::tokio_rt();
    rt.block_on(a.wait_template());
    let b = Daemon::start_sharing(&host_conf("host-b", &url, &schema, 2, false), &a);
    eprintln!("[{:?}] both hosts up", t_all.elapsed());
    rt.block_on(async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        // 1. A replicated sandbox on A (most free vCPUs); markers; snapshot.
        let id = a
            .create(json!({ "replicate": true, "snapshot_interval": "0s" }))
            .await;
        let v = a.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(v["replicate"], true, "{v}");
        assert_eq!(v["host"], "host-a", "{v}");
        let ex = a
            .sh(
                &id,
                "echo disk-marker-7 > /root/disk.txt && sync && \
                 head -c 4194304 /dev/urandom > /dev/shm/ram.bin && sha256sum /dev/shm/ram.bin | cut -d' ' -f1",
            )
            .await;
        assert_eq!(ex.code, Some(0), "{ex:?}");
        let ram_sum = String::from_utf8_lossy(&ex.stdout).trim().to_owned();
        assert_eq!(ram_sum.len(), 64, "{ex:?}");
        let t = Instant::now();
        let s1 = a
            .ok("POST", &format!("/v1/sandboxes/{id}/snapshots"), Some(json!({})), 201)
            .await;
        let s1 = s1["id"].as_str().expect("snapshot id").to_owned();
        let v = wait_replica(&a, &id, "host-b", &s1).await;
        eprintln!(
            "[{:?}] first replica on host-b {} ms after the snapshot call: {}",
            t_all.elapsed(),
            t.elapsed().as_millis(),
            v["replicas"]
        );
        assert!(
            b.root.join(format!("data/pool/snapshots/{s1}")).exists(),
            "the replica is not published in B's pool"
        );
        // A second snapshot with one more RAM marker: incremental.
        let ex = a.sh(&id, "echo ram-marker-2 > /dev/shm/two.txt").await;
        assert_eq!(ex.code, Some(0), "{ex:?}");
        let t = Instant::now();
        let s2 = a
            .ok("POST", &format!("/v1/sandboxes/{id}/snapshots"), Some(json!({})), 201)
            .await;
        let s2 = s2["id"].as_str().expect("snapshot id").to_owned();
        wait_replica(&a, &id, "host-b", &s2).await;
        eprintln!(
            "[{:?}] second replica on host-b {} ms after the snapshot call",
            t_all.elapsed(),
            t.elapsed().as_millis()
        );
        // The owner logs a replication once the receiver answered (the
        // receiver's row may show first).
        let t = Instant::now();
        let logs = loop {
            let logs = plain(&a.logs());
            if logs.matches("snapshot replicated").count() >= 2 {
                break logs;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no second replication logged");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let line = logs
            .lines()
            .rfind(|l| l.contains("snapshot replicated"))
            .unwrap_or_default()
            .to_owned();
        for l in logs.lines().filter(|l| l.contains("snapshot replicated")) {
            eprintln!("A's log: {l}");
        }
        assert!(line.contains("incremental=true"), "not incremental: {line}");
        // B dropped the first replica once it held the second.
        let t = Instant::now();
        while b.root.join(format!("data/pool/snapshots/{s1}")).exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "B kept the older replica");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (_, text) = a.raw("GET", "/metrics", Vec::new()).await;
        let text = String::from_utf8_lossy(&text).into_owned();
        assert!(metric(&text, "cluster_replica_sent") >= 2, "metrics:\n{text}");

        // 2. Host loss: A and its QEMUs die; B recovers the sandbox.
        let owner = |id: String| {
            let (url, schema) = (url.clone(), schema.clone());
            async move {
                pg_row(
                    &url,
                    &format!("SELECT host_id, token FROM {schema}.sandbox_owners WHERE sandbox_id = '{id}'"),
                )
                .await
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
            }
        };
        // A sandbox without replication on A too: it is marked lost, as
        // without replicas.
        let plain_id = a.create(json!({ "snapshot_interval": "0s" })).await;
        // Its setting changed through B: forwarded to A, the owner.
        for on in [true, false] {
            let r = b
                .request("PATCH", &format!("/v1/sandboxes/{plain_id}"))
                .json(&json!({ "replicate": on }))
                .send()
                .await
                .expect("patch through B");
            let by = r
                .headers()
                .get("x-strata-host")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let st = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or_default();
            assert_eq!((st, by.as_str()), (200, "host-a"), "{v}");
            assert_eq!(v["replicate"], on, "{v}");
        }
        let (_, t_a) = owner(id.clone()).await.expect("lease");
        let pid = a.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        a.kill9();
        strata_testkit::teardown::kill_qemus(&a.run_dir);
        assert!(!alive(pid));
        let t = Instant::now();
        let v = b
            .wait_for(&id, Duration::from_secs(60), |v| v["state"] == "hibernated")
            .await;
        eprintln!(
            "[{:?}] recovered on B {} ms after the kill: {v}",
            t_all.elapsed(),
            t.elapsed().as_millis()
        );
        assert_eq!(v["host"], "host-b", "{v}");
        let reason = v["state_reason"].as_str().unwrap_or_default();
        assert_eq!(
            reason,
            format!("recovered from replica {s2} after host_lost of host-a"),
            "{v}"
        );
        let lost = b
            .wait_for(&plain_id, Duration::from_secs(30), |v| {
                v["state"] == "failed"
                    && v["state_reason"]
                        .as_str()
                        .is_some_and(|r| r.starts_with("host_lost"))
            })
            .await;
        assert_eq!(lost["replicate"], false, "{lost}");
        let (h, t_b) = owner(id.clone()).await.expect("lease");
        assert_eq!(h, "host-b");
        assert!(t_b > t_a, "token {t_b} not larger than {t_a}");
        let events = b
            .ok("GET", &format!("/v1/sandboxes/{id}/events"), None, 200)
            .await;
        assert!(
            events.to_string().contains("recovered on host host-b from replica"),
            "{events}"
        );
        let (_, text) = b.raw("GET", "/metrics", Vec::new()).await;
        let text = String::from_utf8_lossy(&text).into_owned();
        assert_eq!(metric(&text, "cluster_sandbox_recovered"), 1, "{text}");
        assert_eq!(metric(&text, "cluster_sandbox_host_lost"), 1, "{text}");

        // 3. An exec on B wakes it there: disk and memory as snapshotted.
        let t = Instant::now();
        let ex = b
            .sh(
                &id,
                "cat /root/disk.txt; sha256sum /dev/shm/ram.bin | cut -d' ' -f1; cat /dev/shm/two.txt",
            )
            .await;
        eprintln!(
            "[{:?}] exec on B (wake included) {} ms",
            t_all.elapsed(),
            t.elapsed().as_millis()
        );
        assert_eq!(ex.code, Some(0), "{ex:?}\n{}", b.logs());
        let out = String::from_utf8_lossy(&ex.stdout).into_owned();
        assert_eq!(
            out.lines().collect::<Vec<_>>(),
            ["disk-marker-7", ram_sum.as_str(), "ram-marker-2"],
            "{out}"
        );
        let v = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(v["state"], "running", "{v}");

        // 4. A revived: not adopted, its own operations refused.
        a.start_again();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        for (method, path) in [
            ("POST", format!("/v1/sandboxes/{id}/pause")),
            ("DELETE", format!("/v1/sandboxes/{id}")),
        ] {
            let (st, v) = own(&a, method, &path).await;
            assert_eq!(st, 409, "{method} {path} on the old owner: {v}");
            let m = v["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains("not owned by this host"), "{v}");
        }
        let after = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(before["state"], after["state"]);
        assert_eq!(before["pid"], after["pid"]);
        assert_eq!(before["updated_at"], after["updated_at"], "the old owner's attempts changed the record");
        assert!(
            qemus_of(&id, &a.run_dir).is_empty(),
            "A runs a VM of it after its revival"
        );
        assert_eq!(qemus_of(&id, &b.run_dir).len(), 1, "B runs no VM of it");
        let (h, _) = owner(id.clone()).await.expect("lease");
        assert_eq!(h, "host-b");
        // Through A (forwarded to B, the owner): B answers.
        let r = a
            .request("GET", &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .expect("get through A");
        assert_eq!(
            r.headers().get("x-strata-host").and_then(|v| v.to_str().ok()),
            Some("host-b")
        );
        // 5. B, the owner now, keeps a replica too: its periodic pass
        // (every 10 watches, 10 s here) sends the sandbox's newest snapshot
        // to the only other live host, A (whose own copy of that snapshot
        // from before its loss its recovery removed as an orphan).
        let t = Instant::now();
        let v = b
            .wait_for(&id, Duration::from_secs(60), |v| {
                v["replicas"].as_array().is_some_and(|rs| {
                    rs.iter()
                        .any(|r| r["host_id"] == "host-a" && r["snapshot_id"] == s2.as_str())
                })
            })
            .await;
        eprintln!(
            "[{:?}] replica back on host-a {} ms after its revival: {}",
            t_all.elapsed(),
            t.elapsed().as_millis(),
            v["replicas"]
        );
        // A replica host's restart keeps its replicas (they are not
        // orphans to its recovery, which removes orphans by default).
        let copy = a.root.join(format!("data/pool/snapshots/{s2}"));
        assert!(copy.exists(), "A holds no copy at {}", copy.display());
        a.restart();
        assert!(copy.exists(), "A's restart removed the replica it holds");
        let v = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(v["replicas"][0]["host_id"], "host-a", "{v}");
        assert!(qemus_of(&id, &a.run_dir).is_empty(), "A runs a VM of it");

        // 6. Deleted on B, its owner: A's periodic pass (every 10 watches,
        // 10 s here) removes the replica it holds (published snapshot and
        // import anchor) and its row; the delete does not wait for it.
        let t = Instant::now();
        b.ok("DELETE", &format!("/v1/sandboxes/{id}"), None, 200).await;
        let anchor = a.root.join(format!("data/pool/import/{s2}"));
        let row_sql =
            format!("SELECT host_id FROM {schema}.sandbox_replicas WHERE sandbox_id = '{id}'");
        loop {
            let row = pg_row(&url, &row_sql).await;
            if row.is_none() && !copy.exists() && !anchor.exists() {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "A still holds the deleted sandbox's replica: row {:?}, copy {}, anchor {}",
                row.map(|r| r.get::<_, String>(0)),
                copy.exists(),
                anchor.exists()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "[{:?}] replica removed from host-a {} ms after the delete",
            t_all.elapsed(),
            t.elapsed().as_millis()
        );
        eprintln!("wall time: {:?}", t_all.elapsed());
    });
}
