//! A move whose adopt call is lost (docs/move.md "Inside a cluster",
//! docs/cluster.md "Moving a sandbox: a lost adopt call"): two real
//! `stratad` hosts with their own pools on one PostgreSQL, a real QEMU guest
//! (TCG).
//!
//! 1. A sandbox runs on host A with a disk marker and a RAM marker
//!    (`/dev/shm`).
//! 2. It is moved to host B; A runs with `[cluster] test_drop_adopt = true`
//!    (test only): it hands the lease over in PostgreSQL, then drops its
//!    adopt call to B, as if the network had lost it, and waits for
//!    PostgreSQL to show B holding the renewed lease before it answers:
//!    `200`, `adoption: "taken_up"`, the sandbox hibernated, B's token.
//! 3. B's take-up pass found the handed-over lease unrenewed for half its
//!    TTL and took it up (same token, larger than A's, journaled "adopt
//!    call was not received", `cluster_move_adopted_unasked` counted), not
//!    before half the TTL had passed.
//! 4. An exec through B wakes it there: both markers read back.
//! 5. Past the handed-over lease's first expiry plus the takeover margin
//!    and two watches of A (which would mark it lost), it is not
//!    `host_lost`; no host counted a lost sandbox.
//! 6. A late adopt call of the source is a no-op success (no second
//!    take-up, nothing journaled again).
//! 7. A revived: its own `pause` and `DELETE` are `409` "not owned by this
//!    host"; it runs no VM of it and has no subvolume of it.
//!
//! Needs `STRATA_TEST_PG_URL` (a unix-socket URL, as scripts/test-pg.sh
//! makes); without it the test prints a line and passes.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{host_conf, lease_of, metric_of, own};
use common::Daemon;
use serde_json::{json, Value};

/// `[cluster] lease_ttl` of `host_conf`.
const TTL: Duration = Duration::from_secs(6);

#[test]
fn a_move_whose_adopt_call_is_lost_is_taken_up_by_the_target_and_never_marked_host_lost() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let t_all = Instant::now();
    let schema = common::cluster::schema("adopt");
    let conf_a = host_conf("host-a", &url, &schema, 4, true)
        .replace("[cluster]\n", "[cluster]\ntest_drop_adopt = true\n");
    assert!(conf_a.contains("test_drop_adopt = true"));
    let a = Daemon::start(&conf_a);
    let rt = strata_testkit::tokio_rt();
    rt.block_on(a.wait_template());
    let b = Daemon::start_sharing(&host_conf("host-b", &url, &schema, 2, false), &a);
    eprintln!("[{:?}] both hosts up", t_all.elapsed());
    rt.block_on(async {
        // 1. A sandbox on A (most free vCPUs) with a disk and a RAM marker.
        let id = a.create(json!({ "snapshot_interval": "0s" })).await;
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
        let (h, t_a, _) = lease_of(&url, &schema, &id).await.expect("lease");
        assert_eq!(h, "host-a");

        // 2. The move: handed over, the adopt call dropped. Meanwhile the
        // lease is watched in PostgreSQL: when it first names B (what was
        // left of it), and how long after that B renewed it (took it up).
        let watch = {
            let (url, schema, id) = (url.clone(), schema.clone(), id.clone());
            tokio::spawn(async move {
                let mut first: Option<(Instant, i64)> = None;
                loop {
                    if let Some((h, _, left)) = lease_of(&url, &schema, &id).await {
                        match first {
                            None if h == "host-b" => first = Some((Instant::now(), left)),
                            Some((t0, l0)) => {
                                let since = t0.elapsed().as_millis() as i64;
                                if left > l0 - since + 500 {
                                    return (l0, since);
                                }
                            }
                            None => {}
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let t = Instant::now();
        let (st, v) = a
            .call(
                "POST",
                &format!("/v1/sandboxes/{id}/move"),
                Some(json!({ "host": "host-b" })),
            )
            .await;
        let t_moved = Instant::now();
        eprintln!(
            "[{:?}] move answered {st} in {} ms: {v}",
            t_all.elapsed(),
            t.elapsed().as_millis()
        );
        // The caller gets the truth: A waited until PostgreSQL showed B
        // holding the renewed lease (B's take-up), then answered the move
        // done, `adoption: "taken_up"` (not the `500` it answered before).
        assert_eq!(st, 200, "{v}\n{}", a.logs());
        assert_eq!(v["adoption"], "taken_up", "{v}");
        assert_eq!((v["from"].as_str(), v["to"].as_str()), (Some("host-a"), Some("host-b")), "{v}");
        assert_eq!(v["sandbox"]["id"], id.as_str(), "{v}");
        assert_eq!(v["sandbox"]["state"], "hibernated", "{v}");
        assert!(v["bytes"].as_u64().unwrap_or(0) > 1 << 20, "{v}");
        // By the answer, B had taken it up: counted, renewed (more than
        // half the TTL left) with the handover's token, larger than A's.
        assert_eq!(metric_of(&b, "cluster_move_adopted_unasked").await, 1);
        let (h, t_b, left) = lease_of(&url, &schema, &id).await.expect("lease");
        assert_eq!(h, "host-b", "the handover named B");
        assert!(t_b > t_a, "token {t_b} not larger than {t_a}");
        assert_eq!(v["token"].as_i64(), Some(t_b), "{v}");
        assert!(left > (TTL / 2).as_millis() as i64 - 1000, "{left} ms left");

        // 3. B took it up by itself once half the TTL had passed: the
        // source's own call has the first half.
        let (l0, renewed_after) = tokio::time::timeout(Duration::from_secs(5), watch)
            .await
            .expect("the lease watch saw no renewal")
            .expect("lease watch");
        let half = (TTL / 2).as_millis() as i64;
        eprintln!(
            "[{:?}] taken up by B {renewed_after} ms after the lease first named it ({l0} ms of it left then)",
            t_all.elapsed(),
        );
        assert!(
            renewed_after + 250 >= l0 - half,
            "taken up {renewed_after} ms after the handover, with {l0} ms left then"
        );
        let v = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(v["state"], "hibernated", "{v}");
        assert_eq!(v["host"], "host-b", "{v}");
        let (h, t_now, left) = lease_of(&url, &schema, &id).await.expect("lease");
        assert_eq!((h.as_str(), t_now), ("host-b", t_b), "the handover's token");
        assert!(
            left > (TTL / 2).as_millis() as i64,
            "B does not renew it: {left} ms left"
        );
        let events = b
            .ok("GET", &format!("/v1/sandboxes/{id}/events"), None, 200)
            .await
            .to_string();
        assert!(
            events.contains("the move's adopt call was not received"),
            "{events}"
        );

        // 4. An exec through B wakes it there: disk and memory as moved.
        let t = Instant::now();
        let ex = b
            .sh(
                &id,
                "cat /root/disk.txt; sha256sum /dev/shm/ram.bin | cut -d' ' -f1",
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
            ["disk-marker-7", ram_sum.as_str()],
            "{out}"
        );

        // 5. Past the handed-over lease's first expiry, the takeover margin
        // and two of A's host-loss watches: not marked lost.
        let until = TTL + Duration::from_secs(1 + 2);
        if let Some(rest) = until.checked_sub(t_moved.elapsed()) {
            tokio::time::sleep(rest).await;
        }
        let v = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(v["state"], "running", "{v}");
        assert_eq!(v["host"], "host-b", "{v}");
        assert!(
            !v["state_reason"]
                .as_str()
                .unwrap_or_default()
                .starts_with("host_lost"),
            "{v}"
        );
        for (name, d) in [("A", &a), ("B", &b)] {
            assert_eq!(
                metric_of(d, "cluster_sandbox_host_lost").await,
                0,
                "host {name} marked a sandbox lost"
            );
        }
        let (h, t_now, _) = lease_of(&url, &schema, &id).await.expect("lease");
        assert_eq!((h.as_str(), t_now), ("host-b", t_b));
        assert_eq!(
            strata_testkit::teardown::qemu_pids(&b.run_dir).len(),
            1,
            "B runs its VM"
        );

        // 6. The source's adopt call, late: a no-op success.
        let before = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        let r = b
            .request("POST", &format!("/v1/imports/{id}/adopt"))
            .header("x-strata-forwarded-by", "test")
            .json(&json!({ "from": "host-a", "wake": true }))
            .send()
            .await
            .expect("late adopt");
        let st = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(st, 200, "late adopt: {v}");
        assert_eq!(v["state"], "running", "{v}");
        let after = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(before["pid"], after["pid"]);
        assert_eq!(before["updated_at"], after["updated_at"], "the late adopt wrote");
        let events = b
            .ok("GET", &format!("/v1/sandboxes/{id}/events"), None, 200)
            .await
            .to_string();
        assert_eq!(events.matches("moved here").count(), 1, "{events}");
        assert_eq!(metric_of(&b, "cluster_move_adopted_unasked").await, 1);

        // 7. A revived cannot act on it and runs nothing of it.
        a.restart();
        tokio::time::sleep(Duration::from_secs(2)).await;
        for (method, path) in [
            ("POST", format!("/v1/sandboxes/{id}/pause")),
            ("DELETE", format!("/v1/sandboxes/{id}")),
        ] {
            let (st, v) = own(&a, method, &path).await;
            assert_eq!(st, 409, "{method} {path} on the old owner: {v}");
            let m = v["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains("not owned by this host"), "{v}");
        }
        let last = b.ok("GET", &format!("/v1/sandboxes/{id}"), None, 200).await;
        assert_eq!(last["state"], "running", "{last}");
        assert_eq!(last["pid"], after["pid"]);
        assert_eq!(last["updated_at"], after["updated_at"], "A's attempts changed the record");
        assert!(
            strata_testkit::teardown::qemu_pids(&a.run_dir).is_empty(),
            "A runs a VM"
        );
        assert!(!a.root.join(format!("data/pool/sandboxes/{id}")).exists());
        let (h, t_now, _) = lease_of(&url, &schema, &id).await.expect("lease");
        assert_eq!((h.as_str(), t_now), ("host-b", t_b));
        eprintln!("wall time: {:?}", t_all.elapsed());
    });
}
