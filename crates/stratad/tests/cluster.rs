//! Two real `stratad` hosts on one PostgreSQL (`[cluster] enabled`,
//! docs/cluster.md), each with its own btrfs pool and run dir:
//!
//! 1. placement: a create whose anti-affinity group already runs on the
//!    host asked is forwarded to the other host (which answers it);
//! 2. host loss: host A's daemon and its QEMUs get SIGKILL; host B marks
//!    A's sandbox `failed` with `host_lost: …` (the record stays);
//! 3. fencing: A, revived, does not adopt it and cannot act on it (`409`,
//!    the record unchanged);
//! 4. partition: A reaches PostgreSQL through a TCP relay the test
//!    blackholes; A's VM is killed before its lease expires (by the
//!    lease's own expiry in PostgreSQL), and B then marks it lost.
//!
//! Three hosts in three network namespaces, egress checked directly by a
//! server in the root namespace: tests/cluster_netns.rs.
//!
//! Auth is on: the hosts share the security store on PostgreSQL (B starts
//! with A's bootstrap token and master key), and a forwarded call carries
//! the caller's own token, which the owner checks again.
//!
//! Needs `STRATA_TEST_PG_URL` (a unix-socket URL, as scripts/test-pg.sh
//! makes); without it the test prints a line and passes.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::{alive, host_conf, own, pg_row};
use common::Daemon;
use serde_json::{json, Value};

/// A TCP relay to PostgreSQL's unix socket that the test can blackhole:
/// once cut, nothing more is forwarded on any connection (old or new) and
/// no socket is closed, as when a host's network link goes down.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
}

fn pump(mut from: impl Read, mut to: impl Write, cut: Arc<AtomicBool>) {
    let mut buf = [0u8; 16384];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) {
            // Held open, never forwarded again.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

impl Relay {
    fn start(socket: std::path::PathBuf) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").expect("relay listen");
        let port = l.local_addr().expect("addr").port();
        let cut = Arc::new(AtomicBool::new(false));
        let c = cut.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(tcp) = conn else { continue };
                if c.load(Ordering::SeqCst) {
                    // Accepted and ignored (a SYN into the void would not
                    // even be answered; close enough).
                    std::thread::spawn(move || {
                        let _keep = tcp;
                        std::thread::sleep(Duration::from_secs(3600));
                    });
                    continue;
                }
                let Ok(unix) = UnixStream::connect(&socket) else {
                    continue;
                };
                let (t2, u2) = (
                    tcp.try_clone().expect("clone"),
                    unix.try_clone().expect("clone"),
                );
                let (c1, c2) = (c.clone(), c.clone());
                std::thread::spawn(move || pump(tcp, unix, c1));
                std::thread::spawn(move || pump(u2, t2, c2));
            }
        });
        Relay { port, cut }
    }
}

/// The unix socket and database of a `postgresql://user@%2Fdir:port/db` URL.
fn socket_of(url: &str) -> (std::path::PathBuf, String, String) {
    let rest = url.split_once('@').expect("url has a user").1;
    let (host_port, db) = rest.split_once('/').expect("url has a database");
    let (host, port) = host_port.rsplit_once(':').expect("url has a port");
    let dir = host.replace("%2F", "/").replace("%2f", "/");
    (
        std::path::PathBuf::from(format!("{dir}/.s.PGSQL.{port}")),
        db.to_owned(),
        url.split_once("://")
            .and_then(|(_, r)| r.split_once('@'))
            .map(|(u, _)| u.to_owned())
            .unwrap_or_default(),
    )
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

async fn wait_lost(d: &Daemon, id: &str, max: Duration) -> Value {
    d.wait_for(id, max, |v| {
        v["state"] == "failed"
            && v["state_reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("host_lost"))
    })
    .await
}

#[test]
fn two_hosts_place_mark_a_lost_host_fence_its_revival_and_self_fence_a_partition() {
    let Some(url) = common::cluster::pg_url() else {
        return;
    };
    let (socket, db, user) = socket_of(&url);
    let relay = Relay::start(socket);
    let relayed = format!("postgresql://{user}@127.0.0.1:{}/{db}", relay.port);
    let schema = common::cluster::schema("cluster");
    // A: 4 vCPUs, reaches PostgreSQL through the relay; B: 1 vCPU, no
    // template of its own (it only watches here).
    let a = Daemon::start(&host_conf("host-a", &relayed, &schema, 4, true));
    let rt = strata_testkit::tokio_rt();
    // B starts once A's template is built: a host's recovery marks any
    // `building` template of the shared store interrupted (docs/cluster.md).
    rt.block_on(a.wait_template());
    // The hosts share one security store on PostgreSQL: B makes no
    // bootstrap token of its own (A's is in the database), so its client
    // uses A's; and, as docs/keys.md asks of daemons sharing a database,
    // B gets A's master key before its first start.
    let b = Daemon::start_sharing(&host_conf("host-b", &url, &schema, 1, false), &a);
    rt.block_on(async {
        // Both registered and heartbeating.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let hosts = pg_row(
            &url,
            &format!("SELECT count(*) FROM {schema}.hosts WHERE lease_until > (extract(epoch from clock_timestamp()) * 1000)::bigint"),
        )
        .await
        .map(|r| r.get::<_, i64>(0));
        assert_eq!(hosts, Some(2));

        // 1. Placement: A has the most free vCPUs; a second member of an
        // anti-affinity group is sent to B.
        let group = json!({ "labels": { "strata.io/anti-affinity": "g1" } });
        let s1 = a.create(group.clone()).await;
        let owner = |id: String| {
            let (url, schema) = (url.clone(), schema.clone());
            async move {
                pg_row(
                    &url,
                    &format!("SELECT host_id, token, expires_at FROM {schema}.sandbox_owners WHERE sandbox_id = '{id}'"),
                )
                .await
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, i64>(2)))
            }
        };
        let (h1, t1, _) = owner(s1.clone()).await.expect("s1 has an owner lease");
        assert_eq!(h1, "host-a");
        // Forwarded to B, which answers it: B holds no template, so it
        // first fetches the one A built (docs/cluster.md "Templates across
        // hosts"), then creates it; deleted again through A (forwarded to
        // B) so that the steps below see one member.
        let r = a
            .request("POST", "/v1/sandboxes")
            .json(&group)
            .send()
            .await
            .expect("create through A");
        let by = r
            .headers()
            .get("x-strata-host")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let st = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or_default();
        assert_eq!(by, "host-b", "the second member was not sent to B ({st}): {v}");
        assert_eq!(st, 201, "B did not fetch the template and create it: {v}");
        let s_b = v["id"].as_str().expect("id").to_owned();
        let tpl = a.ok("GET", "/v1/templates/tpl-default", None, 200).await;
        let mut holders: Vec<String> = tpl["hosts"]
            .as_array()
            .map(|h| h.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        holders.sort();
        assert_eq!(holders, ["host-a", "host-b"], "template holders: {tpl}");
        a.ok("DELETE", &format!("/v1/sandboxes/{s_b}"), None, 200).await;

        // A template deleted through A leaves B's pool too (B's renewal
        // round finds the shared record deleted), not at B's next restart.
        let v = a
            .ok(
                "POST",
                "/v1/templates",
                Some(json!({"id": "tpl-gone", "recipe": {"base": "default", "step": [{"run": "echo gone > /gone"}]}})),
                202,
            )
            .await;
        assert_eq!(v["id"], "tpl-gone", "{v}");
        let t = Instant::now();
        loop {
            let v = a.ok("GET", "/v1/templates/tpl-gone", None, 200).await;
            if v["status"] == "ready" {
                break;
            }
            assert!(
                v["status"] == "building" && t.elapsed() < Duration::from_secs(300),
                "tpl-gone: {v}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        a.ok(
            "POST",
            "/v1/templates/tpl-gone/replicate",
            Some(json!({"host": "host-b"})),
            200,
        )
        .await;
        let b_copy = b.root.join("data/pool/templates/tpl-gone");
        assert!(b_copy.exists(), "B holds no copy at {}", b_copy.display());
        a.ok("DELETE", "/v1/templates/tpl-gone", None, 200).await;
        let t = Instant::now();
        while b_copy.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "B still holds the deleted template after 15 s: {}",
                b.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "a deleted template left B's pool in {} ms",
            t.elapsed().as_millis()
        );

        let listed = a.ok("GET", "/v1/sandboxes?label=strata.io/anti-affinity=g1", None, 200).await;
        assert_eq!(listed["items"].as_array().map(Vec::len), Some(1), "{listed}");

        // 2. Host loss: A and its QEMUs die; B marks s1 lost, keeps it.
        let pid1 = a.ok("GET", &format!("/v1/sandboxes/{s1}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        a.kill9();
        strata_testkit::teardown::kill_qemus(&a.run_dir);
        assert!(!alive(pid1));
        let t = Instant::now();
        let lost = wait_lost(&b, &s1, Duration::from_secs(30)).await;
        eprintln!("host loss marked after {:?}: {lost}", t.elapsed());
        let (h, t_custody, _) = owner(s1.clone()).await.expect("custody lease");
        assert_eq!(h, "host-b");
        assert!(t_custody > t1);

        // 3. A revived does not adopt it and cannot act on it.
        a.start_again();
        let before = b.ok("GET", &format!("/v1/sandboxes/{s1}"), None, 200).await;
        // (Marked forwarded, so that A acts itself instead of forwarding
        // the call to B, the custodian.)
        for (method, path) in [("DELETE", format!("/v1/sandboxes/{s1}"))] {
            let (st, v) = own(&a, method, &path).await;
            assert_eq!(st, 409, "{method} {path} on the old owner: {v}");
            assert_eq!(v["error"]["code"], "conflict", "{v}");
            let m = v["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains("not owned by this host"), "{v}");
        }
        let after = b.ok("GET", &format!("/v1/sandboxes/{s1}"), None, 200).await;
        assert_eq!(before, after, "the old owner's attempts changed the record");

        // 4. Partition: A (4 free vCPUs against B's 1) gets a new sandbox;
        // its link to PostgreSQL goes dark; its VM dies before its lease
        // expires; B marks it lost after expiry plus the margin.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s2 = a.create(json!({})).await;
        let pid2 = a.ok("GET", &format!("/v1/sandboxes/{s2}"), None, 200).await["pid"]
            .as_u64()
            .expect("pid") as u32;
        assert!(alive(pid2));
        tokio::time::sleep(Duration::from_secs(2)).await;
        relay.cut.store(true, Ordering::SeqCst);
        let cut_at = now_ms();
        let t = Instant::now();
        while alive(pid2) {
            assert!(t.elapsed() < Duration::from_secs(20), "A's VM outlived the partition:\n{}", a.logs());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let gone_at = now_ms();
        // The lease as PostgreSQL holds it: never renewed after the cut.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (h2, _, expires) = owner(s2.clone()).await.expect("s2 lease");
        eprintln!(
            "partition: cut at {cut_at}, VM gone at {gone_at} (+{} ms), lease expires at {expires} (VM gone {} ms before)",
            gone_at - cut_at,
            expires - gone_at
        );
        assert!(
            h2 == "host-a" && gone_at < expires,
            "VM gone at {gone_at}, lease of {h2} expires at {expires}"
        );
        let lost2 = wait_lost(&b, &s2, Duration::from_secs(30)).await;
        assert_eq!(lost2["pid"], Value::Null, "{lost2}");
        // Healed: A still cannot act on it.
        relay.cut.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (st, v) = own(&a, "DELETE", &format!("/v1/sandboxes/{s2}")).await;
        assert_eq!(st, 409, "{v}");
        assert_eq!(v["error"]["code"], "conflict", "{v}");
    });
}
