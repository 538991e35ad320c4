//! Helpers of the cluster tests (several daemons on one PostgreSQL).

use serde_json::Value;

use super::Daemon;

/// `STRATA_TEST_PG_URL` (scripts/test-pg.sh), or `None` after printing why
/// the test is skipped.
pub fn pg_url() -> Option<String> {
    let url = std::env::var("STRATA_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("skipped: STRATA_TEST_PG_URL is not set (scripts/test-pg.sh)");
    }
    url
}

/// A PostgreSQL schema of its own for one test run.
pub fn schema(prefix: &str) -> String {
    format!("{prefix}_{}_{}", std::process::id(), rand::random::<u32>())
}

/// The `[store]` and `[cluster]` sections every cluster test's daemon has
/// (a 6 s lease renewed every second); `role` is a `role = …` line or empty.
fn store_and_cluster(id: &str, url: &str, schema: &str, role: &str) -> String {
    format!(
        r#"[store]
url = "{url}"
schema = "{schema}"
timeout = "3s"
[cluster]
enabled = true
{role}host_id = "{id}"
lease_ttl = "6s"
renew_every = "1s"
takeover_margin = "1s"
fence_margin = "2s"
watch_every = "1s"
"#
    )
}

pub fn host_conf(id: &str, url: &str, schema: &str, vcpus: u32, build: bool) -> String {
    format!(
        r#"default_template = {build}
{}[capacity]
admission = "nominal"
vcpus = {vcpus}
cpu_overcommit = 1.0
"#,
        store_and_cluster(id, url, schema, "")
    )
}

/// An API-only process (`[cluster] role = "api"`) on the same database.
pub fn api_conf(id: &str, url: &str, schema: &str) -> String {
    format!(
        "default_template = false\n{}",
        store_and_cluster(id, url, schema, "role = \"api\"\n")
    )
}

/// The `x-strata-host` header of an answer: which host answered it.
pub fn host_of(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-strata-host")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

pub async fn pg_row(url: &str, sql: &str) -> Option<tokio_postgres::Row> {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL unreachable: {e}"));
    let task = tokio::spawn(conn);
    let r = c.query_opt(sql, &[]).await.expect("query");
    drop(c);
    let _ = task.await;
    r
}

pub fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// `method path` on `d`, marked as forwarded: `d` answers it itself.
pub async fn own(d: &Daemon, method: &str, path: &str) -> (u16, Value) {
    let r = d
        .request(method, path)
        .header("x-strata-forwarded-by", "test")
        .send()
        .await
        .expect("request");
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

/// The `strata_events_total{kind="…"}` count in a `/metrics` text.
pub fn metric(text: &str, kind: &str) -> u64 {
    let needle = format!("kind=\"{kind}\"");
    text.lines()
        .filter(|l| l.starts_with("strata_events_total") && l.contains(&needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// `d`'s `/metrics` count of event kind `kind`.
pub async fn metric_of(d: &Daemon, kind: &str) -> u64 {
    let (_, text) = d.raw("GET", "/metrics", Vec::new()).await;
    metric(&String::from_utf8_lossy(&text), kind)
}

/// Sandbox `id`'s lease in PostgreSQL: (host, token, ms until it expires
/// by the database's clock).
pub async fn lease_of(url: &str, schema: &str, id: &str) -> Option<(String, i64, i64)> {
    pg_row(
        url,
        &format!(
            "SELECT host_id, token, expires_at - (extract(epoch from clock_timestamp()) * 1000)::bigint \
             FROM {schema}.sandbox_owners WHERE sandbox_id = '{id}'"
        ),
    )
    .await
    .map(|r| (r.get(0), r.get(1), r.get(2)))
}

/// An API-only process ran no VM: no child process (QEMU), no `qemu.pid`
/// under its run dir.
pub fn assert_ran_no_vm(pid: u32, run_dir: &std::path::Path) {
    let kids = children(pid);
    assert!(kids.is_empty(), "the API process has children: {kids:?}");
    let qemus: Vec<_> = std::fs::read_dir(run_dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.path().join("qemu.pid").exists())
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    assert!(qemus.is_empty(), "{qemus:?}");
}

/// The pids whose parent is `pid`, with their command names.
pub fn children(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces.
        let Some((head, tail)) = stat.rsplit_once(')') else {
            continue;
        };
        let comm = head.split_once('(').map(|x| x.1).unwrap_or_default();
        let ppid = tail
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push((p, comm.to_owned()));
        }
    }
    out
}
