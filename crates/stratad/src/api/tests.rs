//! HTTP-layer tests: validation and error mapping. The engine here is a
//! test double (the end-to-end suite with real guests uses the runtime);
//! the store, service, router and extractors under test are the real ones.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use axum::body::Body as AxBody;
use axum::http::{Request, StatusCode};
use chrono::Utc;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use tower::ServiceExt;

use crate::clock::SystemClock;
use crate::config::Config;
use crate::engine::*;
use crate::store::{SqliteStore, Store, TemplateRecord, TemplateStatus};
use crate::App;

#[derive(Default)]
struct Double {
    pids: AtomicU32,
    fail_pause: AtomicBool,
    /// Rewinds fail as one whose new VM died before its agent answered.
    fail_rewind: AtomicBool,
    slow_rewind: tokio::sync::Notify,
    hold_rewind: AtomicBool,
    snaps: std::sync::Mutex<Vec<SnapshotId>>,
    /// Quotas: bytes the next snapshot of a sandbox holds that its base does not.
    written: std::sync::Mutex<std::collections::HashMap<SandboxId, u64>>,
    /// Quotas: each snapshot's bytes, and the bases it was charged against.
    held: std::sync::Mutex<std::collections::HashMap<SnapshotId, u64>>,
    charged: std::sync::Mutex<Vec<(SnapshotId, Option<Source>)>>,
    deleted_snaps: std::sync::Mutex<Vec<SnapshotId>>,
    /// What rewinds and restores were asked to return to.
    returned_to: std::sync::Mutex<Vec<SnapshotId>>,
    /// Warm pools: guests started ahead, claimed, deleted; claims fail
    /// while `fail_claim` is set.
    prewarmed: std::sync::Mutex<Vec<SandboxId>>,
    claimed: std::sync::Mutex<Vec<SandboxId>>,
    deleted: std::sync::Mutex<Vec<SandboxId>>,
    fail_claim: AtomicBool,
    /// Commands the engine was asked to run.
    execs: AtomicU32,
    /// Files the engine was asked to write: path and content.
    uploads: std::sync::Mutex<Vec<(String, Vec<u8>)>>,
}

fn snap_info(id: &SnapshotId) -> SnapshotInfo {
    SnapshotInfo {
        id: id.clone(),
        pause_ms: 15.0,
        device_state_bytes: 50_000,
        created_at: Utc::now(),
        phases: Default::default(),
    }
}

impl Double {
    fn vm(&self, size: SandboxSize) -> VmInfo {
        VmInfo {
            pid: 10_000 + self.pids.fetch_add(1, Ordering::Relaxed),
            accel: "tcg".into(),
            size,
            ready_ms: 1.0,
        }
    }
}

#[async_trait]
impl Engine for Double {
    async fn create(&self, _: &SandboxId, _: &Source, size: SandboxSize) -> EngineResult<VmInfo> {
        Ok(self.vm(size))
    }
    async fn create_hibernated(
        &self,
        _: &SandboxId,
        _: &Source,
        snap: &SnapshotId,
        _: SandboxSize,
    ) -> EngineResult<SnapshotInfo> {
        Ok(snap_info(snap))
    }
    async fn snapshot(&self, id: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        self.snaps.lock().unwrap().push(snap.clone());
        let w = self.written.lock().unwrap().remove(id).unwrap_or(0);
        self.held.lock().unwrap().insert(snap.clone(), w);
        Ok(snap_info(snap))
    }
    async fn fork_live(
        &self,
        _: &SandboxId,
        snap: &SnapshotId,
        _: &SandboxId,
        size: SandboxSize,
    ) -> EngineResult<(SnapshotInfo, VmInfo)> {
        Ok((snap_info(snap), self.vm(size)))
    }
    async fn rewind(
        &self,
        _: &SandboxId,
        to: &SnapshotId,
        pre: Option<&SnapshotId>,
    ) -> EngineResult<(Option<SnapshotInfo>, VmInfo)> {
        self.returned_to.lock().unwrap().push(to.clone());
        if self.hold_rewind.load(Ordering::Relaxed) {
            self.slow_rewind.notified().await;
        }
        if self.fail_rewind.load(Ordering::Relaxed) {
            return Err(RuntimeError::AgentTimeout {
                id: "rewound".into(),
                timeout_ms: 60_000,
            });
        }
        Ok((pre.map(snap_info), self.vm(SandboxSize::default())))
    }
    async fn restore(&self, _: &SandboxId, from: &SnapshotId) -> EngineResult<VmInfo> {
        self.returned_to.lock().unwrap().push(from.clone());
        Ok(self.vm(SandboxSize::default()))
    }
    async fn pause(&self, id: &SandboxId) -> EngineResult<()> {
        if self.fail_pause.load(Ordering::Relaxed) {
            return Err(RuntimeError::VmFailed {
                id: id.to_string(),
                reason: "qmp stop timed out".into(),
            });
        }
        Ok(())
    }
    async fn resume(&self, _: &SandboxId) -> EngineResult<()> {
        Ok(())
    }
    async fn hibernate(&self, _: &SandboxId, snap: &SnapshotId) -> EngineResult<SnapshotInfo> {
        Ok(snap_info(snap))
    }
    async fn wake(&self, _: &SandboxId, _: &SnapshotId) -> EngineResult<VmInfo> {
        Ok(self.vm(SandboxSize::default()))
    }
    async fn delete(&self, id: &SandboxId) -> EngineResult<()> {
        self.deleted.lock().unwrap().push(id.clone());
        Ok(())
    }
    async fn prewarm(&self, id: &SandboxId, _: &Source, size: SandboxSize) -> EngineResult<VmInfo> {
        self.prewarmed.lock().unwrap().push(id.clone());
        Ok(self.vm(size))
    }
    async fn claim(&self, id: &SandboxId) -> EngineResult<()> {
        if self.fail_claim.load(Ordering::Relaxed) {
            return Err(RuntimeError::VmFailed {
                id: id.to_string(),
                reason: "the warm guest's QEMU is gone".into(),
            });
        }
        self.claimed.lock().unwrap().push(id.clone());
        Ok(())
    }
    async fn delete_snapshot(&self, snap: &SnapshotId) -> EngineResult<()> {
        self.deleted_snaps.lock().unwrap().push(snap.clone());
        Ok(())
    }
    async fn snapshot_charge(&self, snap: &SnapshotId, base: Option<&Source>) -> EngineResult<u64> {
        self.charged
            .lock()
            .unwrap()
            .push((snap.clone(), base.cloned()));
        Ok(self.held.lock().unwrap().get(snap).copied().unwrap_or(0))
    }
    async fn snapshot_usage(&self, _: &SnapshotId) -> EngineResult<SpaceUsage> {
        Ok(SpaceUsage {
            exclusive_bytes: 4096,
            referenced_bytes: 1 << 20,
        })
    }
    /// Echoes stdin as output; a signal ends it (killed by that signal),
    /// the end of its input with code 0.
    async fn exec_interactive(
        &self,
        _: &SandboxId,
        _: ExecRequest,
    ) -> EngineResult<(ExecStream, ExecInputs)> {
        self.execs.fetch_add(1, Ordering::Relaxed);
        let (in_tx, mut in_rx) = tokio::sync::mpsc::channel::<ExecInput>(4);
        let (out_tx, out_rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut status = ExitStatus {
                code: Some(0),
                signal: None,
                timed_out: false,
            };
            while let Some(i) = in_rx.recv().await {
                match i {
                    ExecInput::Stdin(b)
                        if out_tx.send(Ok(ExecEvent::Stdout(b.clone()))).await.is_err() =>
                    {
                        return;
                    }
                    ExecInput::Signal(n) => {
                        status.code = None;
                        status.signal = Some(n);
                        break;
                    }
                    _ => {}
                }
            }
            let _ = out_tx.send(Ok(ExecEvent::Exit(status))).await;
        });
        let out = futures::stream::unfold(out_rx, |mut rx| async move {
            rx.recv().await.map(|ev| (ev, rx))
        });
        Ok((out.boxed(), in_tx))
    }
    async fn exec(&self, _: &SandboxId, req: ExecRequest) -> EngineResult<ExecStream> {
        self.execs.fetch_add(1, Ordering::Relaxed);
        let Command::Argv(argv) = req.command else {
            unreachable!("the API runs argv")
        };
        let out = bytes::Bytes::from(argv.join(" "));
        Ok(futures::stream::iter(vec![
            Ok(ExecEvent::Stdout(out)),
            Ok(ExecEvent::Stderr(bytes::Bytes::from_static(b"warn"))),
            Ok(ExecEvent::Exit(ExitStatus {
                code: Some(3),
                signal: None,
                timed_out: false,
            })),
        ])
        .boxed())
    }
    async fn read_file(&self, _: &SandboxId, _: &str) -> EngineResult<ByteStream> {
        Ok(futures::stream::iter(vec![Ok(bytes::Bytes::from_static(b"hello"))]).boxed())
    }
    async fn write_file(
        &self,
        _: &SandboxId,
        path: &str,
        _: u32,
        mut body: ByteStream,
    ) -> EngineResult<u64> {
        use futures::StreamExt;
        let mut data = Vec::new();
        while let Some(c) = body.next().await {
            data.extend_from_slice(&c?);
        }
        let n = data.len() as u64;
        self.uploads.lock().unwrap().push((path.to_owned(), data));
        Ok(n)
    }
    async fn list_dir(&self, _: &SandboxId, _: &str) -> EngineResult<Vec<DirEntry>> {
        Ok(vec![])
    }
    async fn stat(&self, id: &SandboxId, p: &str) -> EngineResult<DirEntry> {
        Err(RuntimeError::Guest {
            id: id.to_string(),
            kind: GuestErrorKind::Other,
            message: format!("{p}: no such file or directory"),
        })
    }
    async fn mkdir(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
        Ok(())
    }
    async fn remove(&self, _: &SandboxId, _: &str, _: bool) -> EngineResult<()> {
        Ok(())
    }
    async fn build_template(
        &self,
        tpl: &TemplateId,
        size: SandboxSize,
        _: ProgressSink,
    ) -> EngineResult<TemplateBuilt> {
        Ok(TemplateBuilt {
            id: tpl.clone(),
            size,
            accel: "tcg".into(),
            boot_ms: 1.0,
            build_ms: 1.0,
        })
    }
    async fn delete_template(&self, _: &TemplateId) -> EngineResult<()> {
        Ok(())
    }
    async fn live_vms(&self) -> EngineResult<Vec<LiveVm>> {
        Ok(vec![])
    }
    async fn pool_space(&self) -> EngineResult<Option<crate::host::PoolSpace>> {
        Ok(Some(crate::host::PoolSpace {
            size_bytes: 100 << 30,
            used_bytes: 40 << 30,
            available_bytes: 59 << 30,
        }))
    }
    async fn subvolumes(&self) -> EngineResult<Subvolumes> {
        Ok(Subvolumes {
            snapshots: self.snaps.lock().unwrap().clone(),
            ..Subvolumes::default()
        })
    }
    async fn adopt(&self, id: &SandboxId) -> EngineResult<VmInfo> {
        Err(RuntimeError::SandboxNotFound(id.to_string()))
    }
    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied> {
        tokio::sync::mpsc::unbounded_channel().1
    }
}

use futures::StreamExt as _;

struct Harness {
    app: App,
    engine: Arc<Double>,
    _dir: tempfile::TempDir,
}

fn harness() -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        // The audit key comes from here (never the host's /etc/strata/keys).
        key_dir: dir.path().join("keys"),
        max_json_body_bytes: 4096,
        max_upload_bytes: 16,
        ..Config::default()
    };
    cfg.capacity.vcpus = 4;
    cfg.capacity.cpu_overcommit = 1.0;
    cfg.capacity.memory_mib = 8192;
    cfg.capacity.admission = crate::config::AdmissionMode::Nominal;
    cfg.pressure.enabled = false;
    // Authentication and policy have their own tests (tests/security.rs).
    cfg.security.auth = false;
    let store = store_with_base_template(&cfg);
    let engine = Arc::new(Double::default());
    let app = App::new(cfg, store, engine.clone(), Arc::new(SystemClock));
    Harness {
        app,
        engine,
        _dir: dir,
    }
}

async fn call(
    h: &Harness,
    method: &str,
    uri: &str,
    body: impl Into<AxBody>,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .body(body.into())
        .unwrap();
    let resp = h.app.router().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("<none>")
}

async fn create(h: &Harness) -> String {
    let (s, v) = call(
        h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","labels":{"team":"a"}}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "running");
    v["id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn malformed_bodies_are_invalid_request() {
    let h = harness();
    let count = |v: Value| v["items"].as_array().map_or(0, Vec::len);
    let templates = count(call(&h, "GET", "/v1/templates", "").await.1);
    for body in [
        "{not json",
        r#"{"template": 5}"#,
        r#"{"template":"tpl-base","colour":"red"}"#,
        r#"{"template":"tpl-base","size":{"vcpus":"two"}}"#,
        r#"{"template":"tpl-base","size":{"vcpus":-1}}"#,
        r#"{"template":"../etc"}"#,
        r#"{"template":"tpl-base","idle_timeout":"soon"}"#,
        // A struct also reads from a JSON array, field by field in order:
        // the API fuzz's `[null, null]` started a template build (202).
        r#"["tpl-base"]"#,
        "[null, null]",
        "null",
        r#""tpl-base""#,
    ] {
        for path in ["/v1/sandboxes", "/v1/templates"] {
            let (s, v) = call(&h, "POST", path, body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
            assert_eq!(code(&v), "invalid_request", "{path} {body}: {v}");
            assert!(!v["error"]["message"].as_str().unwrap().is_empty());
        }
    }
    let (_, v) = call(&h, "GET", "/v1/sandboxes", "").await;
    assert_eq!(count(v), 0, "no sandbox was created");
    let (_, v) = call(&h, "GET", "/v1/templates", "").await;
    assert_eq!(count(v), templates, "no template build was started");
}

/// Another vCPU count or memory than the template's is a size variant's
/// build (`service::variants`): `202` with its progress, one build for
/// concurrent creates; this engine cannot hibernate a disk, so the build
/// fails, with its reason, leaving no sandbox; until a minute has passed a
/// create answers that failure instead of building again.
#[tokio::test]
async fn a_create_at_another_size_answers_202_and_a_failed_variant_says_why() {
    let h = harness();
    let body = r#"{"template":"tpl-base","size":{"vcpus":2}}"#;
    let (s, v) = call(&h, "POST", "/v1/sandboxes", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["status"], "building", "{v}");
    let vid = v["variant"]["id"].as_str().unwrap().to_owned();
    assert!(vid.starts_with("tpl-v"), "{v}");
    assert_eq!(v["variant"]["variant_of"], "tpl-base", "{v}");
    assert_eq!(v["variant"]["size"]["vcpus"], 2, "{v}");
    assert_eq!(v["poll"], format!("/v1/templates/{vid}"), "{v}");
    let t = std::time::Instant::now();
    let rec = loop {
        let (s, r) = call(&h, "GET", &format!("/v1/templates/{vid}"), "").await;
        assert_eq!(s, StatusCode::OK, "{r}");
        if r["status"] != "building" {
            break r;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "{r}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(rec["status"], "failed", "{rec}");
    assert!(
        rec["status_reason"]
            .as_str()
            .is_some_and(|r| r.contains("cannot hibernate without memory")),
        "{rec}"
    );
    let (s, v) = call(&h, "POST", "/v1/sandboxes", body).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("failed") && m.contains(&vid)),
        "{v}"
    );
    let (_, list) = call(&h, "GET", "/v1/sandboxes", "").await;
    assert_eq!(
        list["items"].as_array().unwrap().len(),
        0,
        "builders left: {list}"
    );
    let (_, all) = call(&h, "GET", "/v1/templates", "").await;
    assert!(
        !all.to_string().contains(&vid),
        "variants are not listed: {all}"
    );
    let (s, vs) = call(&h, "GET", "/v1/templates/tpl-base/variants", "").await;
    assert_eq!(s, StatusCode::OK, "{vs}");
    assert_eq!(vs["items"][0]["id"], vid.as_str(), "{vs}");
}

/// A template keeps at most 8 size variants: a ninth size deletes the
/// oldest (here all failed: this engine cannot build them), so no caller
/// holds a shared template's sizes for good.
#[tokio::test]
async fn a_ninth_size_variant_evicts_the_oldest() {
    let h = harness();
    let mut ids = Vec::new();
    for i in 0..9u32 {
        let body = format!(
            r#"{{"template":"tpl-base","size":{{"memory_mib":{}}}}}"#,
            600 + i * 8
        );
        let (s, v) = call(&h, "POST", "/v1/sandboxes", body).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{v}");
        let vid = v["variant"]["id"].as_str().unwrap().to_owned();
        let t = std::time::Instant::now();
        loop {
            let (_, r) = call(&h, "GET", &format!("/v1/templates/{vid}"), "").await;
            if r["status"] != "building" {
                break;
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(20), "{r}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        ids.push(vid);
    }
    let (_, vs) = call(&h, "GET", "/v1/templates/tpl-base/variants", "").await;
    let listed: Vec<&str> = vs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 8, "{vs}");
    assert!(!listed.contains(&ids[0].as_str()), "the oldest went: {vs}");
    assert!(listed.contains(&ids[8].as_str()), "{vs}");
    let (s, _) = call(&h, "GET", &format!("/v1/templates/{}", ids[0]), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn sizes_are_validated_and_capacity_enforced() {
    let h = harness();
    for (body, status, c) in [
        (r#"{"size":{"vcpus":0}}"#, 400, "invalid_size"),
        (r#"{"size":{"memory_mib":1048576}}"#, 400, "invalid_size"),
        (r#"{"size":{"disk_gib":0}}"#, 400, "invalid_size"),
    ] {
        let (s, v) = call(&h, "POST", "/v1/sandboxes", body).await;
        assert_eq!(s.as_u16(), status, "{body}: {v}");
        assert_eq!(code(&v), c, "{body}: {v}");
    }
    // Four 1-vCPU sandboxes fill the 4 vCPUs; the fifth does not fit.
    for _ in 0..4 {
        create(&h).await;
    }
    let (s, v) = call(&h, "POST", "/v1/sandboxes", "{}").await;
    assert_eq!(s.as_u16(), 507, "{v}");
}

/// Every operation that starts a VM is admitted against the host's room,
/// not only creates: a wake (resume, or any call that wakes on access), a
/// rewind of a sandbox without a VM, a template build. A refused one is
/// `507 insufficient_capacity` and changes nothing.
#[tokio::test]
async fn every_operation_that_starts_a_vm_needs_room() {
    let h = harness();
    let mut asleep = Vec::new();
    for _ in 0..3 {
        let (s, v) = call(
            &h,
            "POST",
            "/v1/sandboxes",
            r#"{"template":"tpl-base","start":false}"#,
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        asleep.push(v["id"].as_str().unwrap().to_owned());
    }
    // Hibernated sandboxes hold no room: four running ones fill the 4 vCPUs.
    let mut awake = Vec::new();
    for _ in 0..4 {
        awake.push(create(&h).await);
    }
    let refused = |s: StatusCode, v: &Value, what: &str| {
        assert_eq!(s.as_u16(), 507, "{what}: {v}");
        assert_eq!(code(v), "insufficient_capacity", "{what}: {v}");
    };
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/resume", asleep[0]),
        "",
    )
    .await;
    refused(s, &v, "resume");
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/exec", asleep[1]),
        r#"{"cmd":["true"]}"#,
    )
    .await;
    refused(s, &v, "exec (wake on access)");
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/rewind", asleep[2]),
        r#"{"ago":"0s"}"#,
    )
    .await;
    refused(s, &v, "rewind of a hibernated sandbox");
    let (s, v) = call(&h, "POST", "/v1/templates", "{}").await;
    refused(s, &v, "template build");
    for id in &asleep {
        let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
        assert_eq!(
            v["state"], "hibernated",
            "a refused wake changes nothing: {v}"
        );
        assert!(v["pending_op"].is_null(), "{v}");
    }
    // Room again: one wake fits and holds it, so the next one is refused.
    let (s, v) = call(&h, "DELETE", &format!("/v1/sandboxes/{}", awake[0]), "").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/resume", asleep[0]),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running");
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/resume", asleep[1]),
        "",
    )
    .await;
    refused(s, &v, "the second wake");
    // A paused sandbox keeps its VM: resuming it needs no new room.
    let (s, v) = call(&h, "POST", &format!("/v1/sandboxes/{}/pause", awake[1]), "").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{}/resume", awake[1]),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK, "resume of a paused sandbox: {v}");
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let h = harness();
    let big = format!(r#"{{"labels":{{"k":"{}"}}}}"#, "x".repeat(10_000));
    let (s, v) = call(&h, "POST", "/v1/sandboxes", big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(code(&v), "payload_too_large");
    let id = create(&h).await;
    let (s, v) = call(
        &h,
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/tmp/x"),
        vec![0u8; 64],
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    let (s, v) = call(
        &h,
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path=/tmp/x"),
        vec![0u8; 8],
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["bytes"], 8);
}

#[tokio::test]
async fn unknown_and_malformed_ids() {
    let h = harness();
    let (s, v) = call(&h, "GET", "/v1/sandboxes/sb-doesnotexist", "").await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (s, v) = call(&h, "POST", "/v1/sandboxes/sb-nope/pause", "").await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (s, v) = call(&h, "GET", "/v1/sandboxes/NOT-AN-ID", "").await;
    assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request"));
    let (s, v) = call(&h, "DELETE", "/v1/snapshots/snap-nope", "").await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (s, v) = call(&h, "GET", "/v1/nothing-here", "").await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
    let (s, _) = call(&h, "PATCH", "/v1/sandboxes", "").await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn guest_paths_are_checked() {
    let h = harness();
    let id = create(&h).await;
    for q in [
        "path=/etc/../root",
        "path=..",
        "path=relative",
        "path=/a%00b",
        "",
        "path=/x&bogus=1",
    ] {
        let (s, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}/files/stat?{q}"), "").await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::BAD_REQUEST, "invalid_request"),
            "{q}: {v}"
        );
    }
    let (s, v) = call(
        &h,
        "GET",
        &format!("/v1/sandboxes/{id}/files/stat?path=/nope"),
        "",
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_GATEWAY, "agent_error"),
        "{v}"
    );
    let (s, v) = call(
        &h,
        "GET",
        &format!("/v1/sandboxes/{id}/files?path=/etc/hostname"),
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, Value::String("hello".into()));
}

#[tokio::test]
async fn exec_streams_ndjson() {
    let h = harness();
    let id = create(&h).await;
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":["echo","hi"]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let text = v.as_str().unwrap().to_owned();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0], json!({"stdout": "ZWNobyBoaQ=="}));
    assert_eq!(lines[1], json!({"stderr": "d2Fybg=="}));
    assert_eq!(lines[2], json!({"exit": {"code": 3, "signal": null}}));
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":[]}"#,
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request"));
    // Exec in a paused sandbox is refused with the state, not queued.
    call(&h, "POST", &format!("/v1/sandboxes/{id}/pause"), "").await;
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":["true"]}"#,
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::CONFLICT, "invalid_state"),
        "{v}"
    );
}

#[tokio::test]
async fn concurrent_rewinds_conflict_and_state_is_kept() {
    let h = harness();
    let id = create(&h).await;
    let (_, snap) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/snapshots"),
        r#"{"label":"base"}"#,
    )
    .await;
    let snap_id = snap["id"].as_str().unwrap().to_owned();
    assert_eq!(snap["status"], "ready");
    h.engine.hold_rewind.store(true, Ordering::Relaxed);
    let body = format!(r#"{{"to":"{snap_id}"}}"#);
    let router = h.app.router();
    let first = tokio::spawn({
        let (uri, body) = (format!("/v1/sandboxes/{id}/rewind"), body.clone());
        async move {
            let req = Request::builder()
                .method("POST")
                .uri(uri)
                .body(AxBody::from(body))
                .unwrap();
            router.oneshot(req).await.unwrap().status()
        }
    });
    // Let the first one take the lock.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/rewind"),
        body.clone(),
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::CONFLICT, "conflict"), "{v}");
    h.engine.slow_rewind.notify_one();
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    let (_, list) = call(&h, "GET", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let kinds: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, vec!["manual", "pre_rewind", "rewind"]);
}

#[tokio::test]
async fn rewind_targets_are_checked() {
    let h = harness();
    let a = create(&h).await;
    let b = create(&h).await;
    let (_, snap) = call(&h, "POST", &format!("/v1/sandboxes/{b}/snapshots"), "").await;
    let other = snap["id"].as_str().unwrap();
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{a}/rewind"),
        format!(r#"{{"to":"{other}"}}"#),
    )
    .await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{a}/rewind"),
        r#"{"ago":"30d"}"#,
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    let (s, v) = call(&h, "POST", &format!("/v1/sandboxes/{a}/rewind"), r#"{}"#).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    let (_, got) = call(&h, "GET", &format!("/v1/sandboxes/{a}"), "").await;
    assert_eq!(got["state"], "running", "no state changed");
}

#[tokio::test]
async fn failed_operation_keeps_previous_state_with_reason() {
    let h = harness();
    let id = create(&h).await;
    h.engine.fail_pause.store(true, Ordering::Relaxed);
    let (s, v) = call(&h, "POST", &format!("/v1/sandboxes/{id}/pause"), "").await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::INTERNAL_SERVER_ERROR, "vm_failed"),
        "{v}"
    );
    let (_, got) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(got["state"], "running");
    assert!(got["pending_op"].is_null());
    assert!(got["state_reason"]
        .as_str()
        .unwrap()
        .contains("qmp stop timed out"));
    let (_, ev) = call(&h, "GET", &format!("/v1/sandboxes/{id}/events"), "").await;
    let phases: Vec<&str> = ev["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, vec!["pending", "done", "pending", "failed"]);
}

/// Found by the chaos harness (a QEMU killed in the middle of a rewind): the
/// rewind failed after the engine had ended the old VM, and the record stayed
/// `running` with the old VM's pid and no VM behind it, so every later call
/// failed. Now the sandbox is marked failed with the reason and restored
/// from its latest snapshot (this double reports no live VM).
#[tokio::test]
async fn a_rewind_that_loses_its_vm_restores_the_latest_snapshot() {
    let h = harness();
    let id = create(&h).await;
    let (_, snap) = call(&h, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let snap = snap["id"].as_str().unwrap().to_owned();
    let (_, before) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    h.engine.fail_rewind.store(true, Ordering::Relaxed);
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/rewind"),
        format!(r#"{{"to":"{snap}"}}"#),
    )
    .await;
    assert_ne!(s, StatusCode::OK, "{v}");
    let (_, got) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(got["state"], "running", "{got}");
    assert_ne!(got["pid"], before["pid"], "restored into a new VM: {got}");
    let (_, ev) = call(&h, "GET", &format!("/v1/sandboxes/{id}/events"), "").await;
    let items = ev["items"].as_array().unwrap();
    let ops: Vec<&str> = items.iter().map(|e| e["op"].as_str().unwrap()).collect();
    assert!(ops.ends_with(&["fail", "recover", "recover"]), "{ops:?}");
    assert!(
        ev.to_string().contains("vm gone after a failed rewind"),
        "the reason is recorded: {ev}"
    );
}

#[tokio::test]
async fn hibernated_sandbox_wakes_on_access() {
    let h = harness();
    let id = create(&h).await;
    let (_, v) = call(&h, "POST", &format!("/v1/sandboxes/{id}/hibernate"), "").await;
    assert_eq!(v["state"], "hibernated");
    let (s, _) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":["true"]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(v["state"], "running");
}

#[tokio::test]
async fn create_with_start_false_is_hibernated_and_wakes_on_access() {
    let h = harness();
    let (s, v) = call(
        &h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","start":false,"labels":{"team":"h"}}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["state"], "hibernated", "{v}");
    assert!(v["pid"].is_null(), "{v}");
    assert!(v["pending_op"].is_null(), "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let (_, snaps) = call(&h, "GET", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let items = snaps["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{snaps}");
    assert_eq!(
        (&items[0]["kind"], &items[0]["status"]),
        (&json!("hibernate"), &json!("ready"))
    );
    // A hibernated sandbox holds no capacity: many fit where four running ones do.
    for _ in 0..6 {
        let (s, v) = call(&h, "POST", "/v1/sandboxes", r#"{"start":false}"#).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
    }
    let (s, _) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        r#"{"cmd":["true"]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(v["state"], "running");
    assert!(v["pid"].is_number(), "{v}");
    for body in [
        r#"{"start":"no"}"#,
        r#"{"start":0}"#,
        r#"{"start":false,"colour":"red"}"#,
        r#"{"start":false,"template":"tpl-nope"}"#,
    ] {
        let (s, v) = call(&h, "POST", "/v1/sandboxes", body).await;
        assert!(s.is_client_error(), "{body}: {s} {v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty(), "{v}");
    }
}

#[tokio::test]
async fn list_filters_and_pages_over_http() {
    let h = harness();
    for _ in 0..3 {
        create(&h).await;
    }
    let (_, p1) = call(
        &h,
        "GET",
        "/v1/sandboxes?limit=2&label=team%3Da&state=running",
        "",
    )
    .await;
    assert_eq!(p1["items"].as_array().unwrap().len(), 2);
    let cursor = p1["next_cursor"].as_str().unwrap();
    let (_, p2) = call(
        &h,
        "GET",
        &format!("/v1/sandboxes?limit=2&label=team%3Da&cursor={cursor}"),
        "",
    )
    .await;
    assert_eq!(p2["items"].as_array().unwrap().len(), 1);
    assert!(p2["next_cursor"].is_null());
    for q in [
        "state=sleepy",
        "limit=0",
        "label=nokv",
        "cursor=%%%",
        "colour=red",
    ] {
        let (s, v) = call(&h, "GET", &format!("/v1/sandboxes?{q}"), "").await;
        assert_eq!(
            (s, code(&v)),
            (StatusCode::BAD_REQUEST, "invalid_request"),
            "{q}: {v}"
        );
    }
}

#[tokio::test]
async fn every_route_is_documented_and_served() {
    let doc: Value = serde_json::from_str(super::OPENAPI_JSON).unwrap();
    let h = harness();
    for &crate::api::Route { method, path, .. } in super::ROUTES {
        let oa_path = path
            .replace(":id", "{id}")
            .replace(":port", "{port}")
            .replace("*rest", "{rest}");
        let op = &doc["paths"][&oa_path][method.to_lowercase()];
        assert!(op.is_object(), "{method} {path} missing from openapi.json");
        // The route exists: whatever it answers, it is not the fallback.
        let mut uri = path.replace(":id", "sb-zzz");
        if path == "/v1/events" {
            // A stream: the backlog only, then it ends.
            uri.push_str("?follow=false");
        }
        let (s, v) = call(&h, method, &uri, "").await;
        assert_ne!(s, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_ne!(v["error"]["message"], "no such endpoint", "{method} {path}");
    }
    // And nothing documented is missing from the router.
    let n: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_object().unwrap().len())
        .sum();
    assert_eq!(n, super::ROUTES.len());
}

#[tokio::test]
async fn livez_answers_without_the_store_and_healthz_does_not() {
    let h = harness();
    for path in ["/livez", "/healthz"] {
        let (s, v) = call(&h, "GET", path, "").await;
        assert_eq!(
            (s, v["status"].as_str()),
            (StatusCode::OK, Some("ok")),
            "{path}"
        );
    }
    // Break the real store under the daemon: another connection renames
    // the table the store's counts read.
    let db = rusqlite::Connection::open(h._dir.path().join("strata.db")).unwrap();
    db.execute_batch("ALTER TABLE sandboxes RENAME TO sandboxes_away")
        .unwrap();
    let (s, v) = call(&h, "GET", "/healthz", "").await;
    assert!(
        s.is_server_error(),
        "/healthz with the store broken: {s} {v}"
    );
    let (s, v) = call(&h, "GET", "/livez", "").await;
    assert_eq!(s, StatusCode::OK, "/livez with the store broken: {v}");
}

#[tokio::test]
async fn metrics_and_stats_report_quantiles() {
    let h = harness();
    let id = create(&h).await;
    call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    let (s, text) = call(&h, "GET", "/metrics", "").await;
    assert_eq!(s, StatusCode::OK);
    let text = text.as_str().unwrap();
    assert!(
        text.contains(
            r#"strata_api_request_duration_seconds{op="GET /v1/sandboxes/:id",quantile="0.99"}"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"strata_sandboxes{state="running"} 1"#),
        "{text}"
    );
    let (_, stats) = call(&h, "GET", "/v1/stats", "").await;
    assert!(
        stats["api"]["POST /v1/sandboxes"]["p99_ms"].is_number(),
        "{stats}"
    );
    assert!(stats["steps"]["spawn"]["count"].as_u64().unwrap() >= 1);
    assert_eq!(stats["sandboxes"]["running"], 1);
    // The pool's space is the sampler's, read on its tick: none before it.
    assert!(!text.contains("strata_host_pool_bytes"), "{text}");
    assert_eq!(stats["host"]["pool"], Value::Null, "{stats}");
    h.app.service().sample_usage().await;
    let (_, text) = call(&h, "GET", "/metrics", "").await;
    let text = text.as_str().unwrap();
    for (kind, gib) in [("size", 100u64), ("used", 40), ("available", 59)] {
        let line = format!("strata_host_pool_bytes{{kind=\"{kind}\"}} {}\n", gib << 30);
        assert!(text.contains(&line), "{line} in {text}");
    }
    let (_, stats) = call(&h, "GET", "/v1/stats", "").await;
    assert_eq!(
        stats["host"]["pool"],
        json!({"size_bytes": 100u64 << 30, "used_bytes": 40u64 << 30, "available_bytes": 59u64 << 30}),
        "{stats}"
    );
}

#[tokio::test]
async fn recovery_restores_a_sandbox_whose_vm_died() {
    let h = harness();
    let id = create(&h).await;
    call(&h, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    // The double reports no live VMs: the VM is gone, a snapshot exists.
    let report = crate::recovery::reconcile(h.app.service()).await.unwrap();
    assert_eq!(report.restored.len(), 1, "{report:?}");
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(v["state"], "running");
    let (_, ev) = call(&h, "GET", &format!("/v1/sandboxes/{id}/events"), "").await;
    let ops: Vec<&str> = ev["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["op"].as_str().unwrap())
        .collect();
    assert!(ops.ends_with(&["fail", "recover", "recover"]), "{ops:?}");
    let (_, ev) = call(&h, "GET", &format!("/v1/sandboxes/{id}/events"), "").await;
    let ops: Vec<&str> = ev["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["op"].as_str().unwrap())
        .collect();
    assert!(ops.ends_with(&["fail", "recover", "recover"]), "{ops:?}");
}

/// Found by the chaos harness: a QEMU killed after an acknowledged rewind
/// was restored from the pre-rewind snapshot (the newest by time), undoing
/// the rewind. The rewind's `rewind` record (same_as its target) is the
/// restore point now.
#[tokio::test]
async fn a_vm_death_after_a_rewind_restores_the_rewinds_target() {
    let h = harness();
    let id = create(&h).await;
    let (_, snap) = call(&h, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let target = snap["id"].as_str().unwrap().to_owned();
    call(&h, "POST", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let (s, v) = call(
        &h,
        "POST",
        &format!("/v1/sandboxes/{id}/rewind"),
        format!(r#"{{"to":"{target}"}}"#),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let pre = v["pre_rewind_snapshot"]["id"].as_str().unwrap().to_owned();
    let (_, list) = call(&h, "GET", &format!("/v1/sandboxes/{id}/snapshots"), "").await;
    let last = list["items"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        (&last["kind"], &last["same_as"], &last["status"]),
        (&json!("rewind"), &json!(target), &json!("ready")),
        "{list}"
    );
    h.engine.returned_to.lock().unwrap().clear();
    // The double reports no live VMs: the VM is gone.
    let report = crate::recovery::reconcile(h.app.service()).await.unwrap();
    assert_eq!(report.restored.len(), 1, "{report:?}");
    let back = h.engine.returned_to.lock().unwrap().clone();
    assert_eq!(
        back.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        vec![target.clone()],
        "restored from the rewind's target, not the pre-rewind state {pre}"
    );
}

mod approvals;
mod durations;
mod events;
mod keys;
mod matrix;
mod quotas;
mod same_as;
mod secrets;
mod security;
mod template_files;
mod terminal;
mod warm;

/// A store at `cfg`'s database path holding the platform template `tpl-base`.
pub(super) fn store_with_base_template(cfg: &Config) -> Arc<SqliteStore> {
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), 2).unwrap());
    store
        .put_template(&TemplateRecord {
            id: "tpl-base".parse().unwrap(),
            tenant: crate::caller::PLATFORM_SCOPE.into(),
            name: None,
            size: SandboxSize::default(),
            status: TemplateStatus::Ready,
            status_reason: None,
            accel: Some("tcg".into()),
            created_at: Utc::now(),
            updated_at: Utc::now(),
            variant_of: None,
        })
        .unwrap();
    store
}

#[tokio::test]
async fn a_move_outside_a_cluster_is_refused_and_changes_nothing() {
    let h = harness();
    let id = create(&h).await;
    let (_, before) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    let uri = format!("/v1/sandboxes/{id}/move");
    // Not a cluster host: 409 with a message saying so; still running.
    let (s, v) = call(&h, "POST", &uri, r#"{"host":"h2"}"#).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(code(&v), "conflict", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not a cluster host")),
        "{v}"
    );
    // A body that is not a move's: 400 before anything runs.
    for body in [
        r#"{"host":"h2","to":"x"}"#,
        r#"{"host":5}"#,
        r#"{"wake":"yes"}"#,
    ] {
        let (s, v) = call(&h, "POST", &uri, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(code(&v), "invalid_request", "{body}: {v}");
    }
    // An unknown sandbox: 404.
    let (s, v) = call(
        &h,
        "POST",
        "/v1/sandboxes/sb-0000000000000000zzzz/move",
        r#"{"host":"h2"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    let (_, after) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(after["state"], "running", "{after}");
    assert_eq!(after["state"], before["state"], "{after}");
    // The target's side refuses as well outside a cluster.
    let (s, v) = call(&h, "POST", &format!("/v1/imports/{id}/adopt"), "{}").await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
}

#[tokio::test]
async fn replicate_is_kept_and_shown_and_host_routes_want_a_host_credential() {
    let h = harness();
    // Off by default (old sandboxes, creates without it).
    let plain = create(&h).await;
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{plain}"), "").await;
    assert_eq!(v["replicate"], false, "{v}");
    assert!(v.get("replicas").is_none(), "not a cluster host: {v}");
    let (s, v) = call(
        &h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","replicate":true}"#,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{id}"), "").await;
    assert_eq!(v["replicate"], true, "{v}");
    let (s, v) = call(
        &h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","replicate":"yes"}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // The tenant's default: new sandboxes replicate unless they say no.
    let (s, v) = call(&h, "GET", "/v1/settings", "").await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(false)), "{v}");
    let (s, v) = call(&h, "PUT", "/v1/settings", r#"{"replicate":true}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(true)), "{v}");
    let by_default = create(&h).await;
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{by_default}"), "").await;
    assert_eq!(v["replicate"], true, "{v}");
    let (_, v) = call(
        &h,
        "POST",
        "/v1/sandboxes",
        r#"{"template":"tpl-base","replicate":false}"#,
    )
    .await;
    let said_no = v["id"].as_str().unwrap().to_owned();
    let (_, v) = call(&h, "GET", &format!("/v1/sandboxes/{said_no}"), "").await;
    assert_eq!(v["replicate"], false, "{v}");
    let (s, v) = call(&h, "PUT", "/v1/settings", r#"{"replicate":false}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(false)), "{v}");
    // null, like a field left out, changes nothing (the document says
    // nullable: the API fuzz sends it).
    let (s, v) = call(&h, "PUT", "/v1/settings", r#"{"replicate":null}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(false)), "{v}");
    let (s, v) = call(&h, "PUT", "/v1/settings", r#"{"replicate":"yes"}"#).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    let (s, v) = call(&h, "PUT", "/v1/settings", r#"{"other":1}"#).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    // PATCH turns it on and off; a field it does not know is refused.
    let uri = format!("/v1/sandboxes/{plain}");
    let (s, v) = call(&h, "PATCH", &uri, r#"{"replicate":true}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(true)), "{v}");
    assert_eq!(v["id"], plain.as_str(), "{v}");
    let (_, v) = call(&h, "GET", &uri, "").await;
    assert_eq!(v["replicate"], true, "{v}");
    let (s, v) = call(&h, "PATCH", &uri, r#"{"replicate":false}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(false)), "{v}");
    let (s, v) = call(&h, "PATCH", &uri, r#"{"replicate":null}"#).await;
    assert_eq!((s, &v["replicate"]), (StatusCode::OK, &json!(false)), "{v}");
    let (s, v) = call(&h, "PATCH", &uri, r#"{"idle":"1s"}"#).await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::BAD_REQUEST, "invalid_request"),
        "{v}"
    );
    let (s, v) = call(
        &h,
        "PATCH",
        "/v1/sandboxes/sb-nope",
        r#"{"replicate":true}"#,
    )
    .await;
    assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{v}");
    // The replica routes: no token applies; without a valid host
    // credential they are refused before anything is read.
    let key = crate::security::keys::KeyStore::open(&h.app.service().config().key_dir)
        .unwrap()
        .hmac_key(crate::security::keys::Purpose::ClusterHost)
        .unwrap();
    let sid: SandboxId = id.parse().unwrap();
    let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, b"another cluster");
    for (auth, why) in [
        (String::new(), "expected `StrataHost"),
        ("Bearer abc".to_owned(), "expected `StrataHost"),
        (
            crate::cluster::replicas::credential_now(&other, "host-x", &sid),
            "does not verify",
        ),
        (
            crate::cluster::replicas::credential_now(&key, "host-x", &SandboxId::generate()),
            "another sandbox",
        ),
    ] {
        for (method, uri, body) in [
            (
                "POST",
                format!("/v1/cluster/replicas/{id}/offer"),
                r#"{"snapshots":[]}"#,
            ),
            (
                "PUT",
                format!("/v1/cluster/replicas/{id}/snapshots?snapshot=snap-0000000000000000zzzz"),
                "stream",
            ),
        ] {
            let mut req = Request::builder().method(method).uri(&uri);
            if !auth.is_empty() {
                req = req.header("authorization", &auth);
            }
            let resp = h
                .app
                .router()
                .oneshot(req.body(AxBody::from(body)).unwrap())
                .await
                .unwrap();
            let st = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            assert_eq!(st, StatusCode::FORBIDDEN, "{method} {uri} {auth:?}: {v}");
            assert_eq!(code(&v), "forbidden", "{v}");
            let m = v["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains(why), "{why}: {m}");
        }
    }
    // A valid credential on a daemon that is not a cluster host: 409.
    let ok = crate::cluster::replicas::credential_now(&key, "host-x", &sid);
    let req = Request::builder()
        .method("POST")
        .uri(format!("/v1/cluster/replicas/{id}/offer"))
        .header("authorization", &ok)
        .header("content-type", "application/json")
        .body(AxBody::from(r#"{"snapshots":[]}"#))
        .unwrap();
    let resp = h.app.router().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::CONFLICT);
}
