//! The load phases: what one client operation is (exec `true`, a 64 KiB
//! file write, a manual snapshot, each classed on failure), the closed-loop
//! clients of a phase, and the daemon side around them — the sandboxes under
//! load, the rolling schedule switched on and off, the rolling snapshots read
//! back from the store.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use strata_core::SandboxId;
use strata_testkit::Api;
use stratad::caller::{Caller, SystemReason};
use stratad::store::{SnapshotKind, SnapshotRecord};

use super::{Args, Op, FILE_BYTES};
use crate::ctx::BenchDaemon;

/// One operation as a client saw it.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Rec {
    /// 0 = baseline, 1 = rolling.
    pub(super) phase: usize,
    pub(super) op: Op,
    pub(super) sandbox: usize,
    /// Seconds since the start of phase (a).
    pub(super) start_s: f64,
    pub(super) ms: f64,
    /// The failure's class (`429`, `409`, `transport`, `exit 1`, …); None = ok.
    pub(super) err: Option<String>,
    /// A manual snapshot's vCPU pause, from the API's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pause_ms: Option<f64>,
}

/// A failed operation: its class (for counting) and the message.
pub(super) struct Fail {
    class: String,
    pub(super) msg: String,
}

fn fail(class: impl Into<String>, msg: impl Into<String>) -> Fail {
    Fail {
        class: class.into(),
        msg: msg.into(),
    }
}

fn transport(e: reqwest::Error) -> Fail {
    fail("transport", e.to_string())
}

/// Sends `rb`; the body when the answer has status `want`, else a failure
/// classed by its status (`what` names the operation in the message).
async fn send(rb: reqwest::RequestBuilder, want: u16, what: &str) -> Result<bytes::Bytes, Fail> {
    let resp = rb.send().await.map_err(transport)?;
    let status = resp.status().as_u16();
    let body = resp.bytes().await.map_err(transport)?;
    if status != want {
        return Err(fail(
            status.to_string(),
            format!("{what}: {status} {}", String::from_utf8_lossy(&body)),
        ));
    }
    Ok(body)
}

/// `exec true` through the API, to its exit line.
pub(super) async fn op_exec(h: &Api, id: &str) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
        .json(&json!({ "cmd": ["true"] }));
    let body = send(rb, 200, "exec").await?;
    match exit_code(&body) {
        Some(0) => Ok(None),
        Some(c) => Err(fail(format!("exit {c}"), format!("exec true exited {c}"))),
        None => Err(fail(
            "no exit line",
            format!("exec: no exit line in {}", String::from_utf8_lossy(&body)),
        )),
    }
}

/// The exit code in an exec response (NDJSON, one line `{"exit":{"code":…}}`).
fn exit_code(body: &[u8]) -> Option<i64> {
    body.split(|b| *b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Value>(l).ok())
        .find_map(|v| v.pointer("/exit/code").and_then(Value::as_i64))
}

/// PUT of a 64 KiB file through the files API.
async fn op_write(h: &Api, id: &str, client: usize, data: &[u8]) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(
            reqwest::Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/tmp/load-{client}.bin"),
        )
        .body(data.to_vec());
    send(rb, 201, "file write").await?;
    Ok(None)
}

/// POST of a manual snapshot; its vCPU pause from the answer.
async fn op_snapshot(h: &Api, id: &str) -> Result<Option<f64>, Fail> {
    let rb = h
        .req(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/snapshots"),
        )
        .json(&json!({ "label": "load" }));
    let body = send(rb, 201, "snapshot").await?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Ok(v.get("pause_ms").and_then(Value::as_f64))
}

/// Creates `n` sandboxes two at a time (each is a restore of the template's
/// snapshot), each answering a warm-up `exec true`: their ids and the create
/// latencies, ms.
pub(super) async fn create_sandboxes(h: &Api, n: usize) -> Result<(Vec<String>, Vec<f64>)> {
    let creates = futures::stream::iter(0..n)
        .map(|_| {
            let h = h.clone();
            async move {
                let t = Instant::now();
                let v = h
                    .expect(
                        reqwest::Method::POST,
                        "/v1/sandboxes",
                        Some(json!({ "snapshot_interval": "0s" })),
                        201,
                    )
                    .await?;
                let id = v["id"]
                    .as_str()
                    .ok_or_else(|| anyhow!("create: no id in {v}"))?
                    .to_owned();
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                let (code, _) = h.exec_output(&id, &["true"]).await?;
                if code != 0 {
                    return Err(anyhow!("warm-up exec in {id} exited {code}"));
                }
                Ok::<_, anyhow::Error>((id, ms))
            }
        })
        .buffer_unordered(2)
        .collect::<Vec<_>>()
        .await;
    let mut ids = Vec::new();
    let mut create_ms = Vec::new();
    for c in creates {
        let (id, ms) = c.context("create a sandbox")?;
        ids.push(id);
        create_ms.push(ms);
    }
    Ok((ids, create_ms))
}

/// What the clients of one phase did.
pub(super) struct PhaseOut {
    pub(super) recs: Vec<Rec>,
    /// First failure message per op.
    pub(super) first_err: BTreeMap<Op, String>,
}

/// Runs the closed-loop clients for `secs`; times are relative to `t0`.
pub(super) async fn run_phase(
    h: &Api,
    ids: &Arc<Vec<String>>,
    args: &Args,
    phase: usize,
    t0: Instant,
) -> Result<PhaseOut> {
    let end = Instant::now() + Duration::from_secs(args.load_secs);
    let mut tasks = Vec::new();
    for client in 0..args.load_clients {
        let h = h.clone();
        let ids = ids.clone();
        let mix = args.load_mix;
        let seed = 0x5eed_0000 + (phase as u64) * 10_000 + client as u64;
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let data: Vec<u8> = (0..FILE_BYTES).map(|i| (i * 31 + client) as u8).collect();
            let mut recs = Vec::new();
            let mut first_err: BTreeMap<Op, String> = BTreeMap::new();
            while Instant::now() < end {
                let sandbox = rng.gen_range(0..ids.len());
                let op = mix.pick(rng.gen_range(0..100));
                let id = &ids[sandbox];
                let t = Instant::now();
                let r = match op {
                    Op::Exec => op_exec(&h, id).await,
                    Op::Write => op_write(&h, id, client, &data).await,
                    Op::Snapshot => op_snapshot(&h, id).await,
                };
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                let start_s = t.duration_since(t0).as_secs_f64();
                let (err, pause_ms) = match r {
                    Ok(p) => (None, p),
                    Err(f) => {
                        first_err.entry(op).or_insert(f.msg);
                        (Some(f.class), None)
                    }
                };
                recs.push(Rec {
                    phase,
                    op,
                    sandbox,
                    start_s,
                    ms,
                    err,
                    pause_ms,
                });
            }
            (recs, first_err)
        }));
    }
    let mut out = PhaseOut {
        recs: Vec::new(),
        first_err: BTreeMap::new(),
    };
    for t in tasks {
        let (recs, errs) = t.await.context("a load client panicked")?;
        out.recs.extend(recs);
        for (op, m) in errs {
            out.first_err.entry(op).or_insert(m);
        }
    }
    out.recs.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    Ok(out)
}

/// Sets every sandbox's own rolling interval (`0` = off) and reschedules it.
///
/// There is no API to change a running sandbox's interval (only at create),
/// so this does what a per-sandbox `snapshot_interval` does: record it in the
/// store, then tell the scheduler.
pub(super) async fn set_interval(d: &BenchDaemon, ids: &[String], secs: u64) -> Result<()> {
    let svc = d.app.service().clone();
    for id in ids {
        let sid: SandboxId = id.parse().map_err(|e| anyhow!("sandbox id {id}: {e}"))?;
        let mut rec = svc
            .get_sandbox(&Caller::system(SystemReason::Embedder), &sid)
            .await
            .map_err(|e| anyhow!("get {id}: {}", e.message()))?;
        rec.snapshot_interval_s = Some(secs);
        let r = rec.clone();
        svc.db(move |s| s.update_sandbox(&r, None))
            .await
            .map_err(|e| anyhow!("record the interval of {id}: {}", e.message()))?;
        svc.reschedule(&rec);
    }
    Ok(())
}

/// A rolling snapshot of phase (b): when (s since phase (a)'s start), which
/// sandbox, its vCPU pause.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Rolling {
    pub(super) at_s: f64,
    pub(super) sandbox: usize,
    pub(super) pause_ms: Option<f64>,
}

/// The rolling snapshots the store holds of `ids` taken in `[from, to]`,
/// oldest first, their times in seconds since `t0`.
pub(super) async fn rolling_snapshots(
    d: &BenchDaemon,
    ids: &[String],
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    t0: DateTime<Utc>,
) -> Result<Vec<Rolling>> {
    let svc = d.app.service().clone();
    let since_t0 = |at: DateTime<Utc>| (at - t0).num_milliseconds() as f64 / 1000.0;
    let index: BTreeMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    let mut rolling: Vec<Rolling> = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let sid: SandboxId = id.parse().map_err(|e| anyhow!("sandbox id {id}: {e}"))?;
        let list: Vec<SnapshotRecord> = svc
            .db(move |s| s.list_snapshots(&sid, true))
            .await
            .map_err(|e| anyhow!("list the snapshots of {id}: {}", e.message()))?;
        rolling.extend(
            list.into_iter()
                .filter(|s| {
                    s.kind == SnapshotKind::Rolling && s.created_at >= from && s.created_at <= to
                })
                .map(|s| Rolling {
                    at_s: since_t0(s.created_at),
                    sandbox: index.get(s.sandbox_id.as_str()).copied().unwrap_or(i),
                    pause_ms: s.pause_ms,
                }),
        );
    }
    rolling.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    Ok(rolling)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_lines() {
        let body = b"{\"stdout\":\"\"}\n{\"exit\":{\"code\":0}}\n";
        assert_eq!(exit_code(body), Some(0));
        assert_eq!(exit_code(b"{\"exit\":{\"code\":3}}"), Some(3));
        assert_eq!(exit_code(b"garbage\n"), None);
    }
}
