//! Shared harness of the E2B door's integration tests: a real stratad `App`
//! (SQLite store, security tables, policy engine, audit log in a temp dir,
//! authentication on) whose engine is [`Double`], a test double that needs no
//! VM, behind the E2B router on a local listener.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)] // test code

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use chrono::Utc;
use futures::StreamExt;
use serde_json::{json, Value};
use strata_core::{SandboxId, SandboxSize, SnapshotId, TemplateId};
use stratad::clock::SystemClock;
use stratad::config::Config;
use stratad::engine::{
    ByteStream, Command, DirEntry, Engine, EngineResult, ExecEvent, ExecRequest, ExecStream,
    ExitStatus, FileKind, GuestErrorKind, LiveVm, ProgressSink, RuntimeError, SnapshotInfo, Source,
    SpaceUsage, Subvolumes, TemplateBuilt, VmDied, VmInfo,
};
use stratad::store::{SqliteStore, Store, TemplateRecord, TemplateStatus};
use stratad::App;

/// The configured `--e2b-api-key`.
pub const KEY: &str = "e2b_matrix_key";
/// The envd token secret.
pub const SECRET: &[u8] = b"e2b-matrix-secret-e2b-matrix-sec";

/// The envd access tokens the door handed out (every `envdAccessToken`
/// of a response read by [`Door::send`]), by sandbox: the last one.
static ISSUED: std::sync::LazyLock<Mutex<std::collections::HashMap<String, String>>> =
    std::sync::LazyLock::new(Default::default);

/// The envd access token of sandbox `id`: the last one the door handed
/// out for it (its tokens are random and stored), else its legacy token
/// (HMAC of the id: a sandbox the door never issued a token for, as one
/// made before tokens were stored).
pub fn envd_token(id: &str) -> String {
    ISSUED
        .lock()
        .unwrap()
        .get(id)
        .cloned()
        .unwrap_or_else(|| legacy_envd_token(id))
}

/// The legacy (HMAC) envd access token of sandbox `id`.
pub fn legacy_envd_token(id: &str) -> String {
    strata_e2b::auth::envd_token(SECRET, id)
}

/// Records every `{sandboxID, envdAccessToken}` pair in `v`.
pub fn remember_tokens(v: &Value) {
    match v {
        Value::Object(m) => {
            if let (Some(Value::String(id)), Some(Value::String(t))) =
                (m.get("sandboxID"), m.get("envdAccessToken"))
            {
                ISSUED.lock().unwrap().insert(id.clone(), t.clone());
            }
            m.values().for_each(remember_tokens);
        }
        Value::Array(a) => a.iter().for_each(remember_tokens),
        _ => {}
    }
}

// ------------------------------------------------------------------ engine

type Fut<'a, T> = Pin<Box<dyn Future<Output = EngineResult<T>> + Send + 'a>>;

/// An engine with no VM behind it: lifecycle operations succeed, files are
/// answered from a few rules (`*.txt` and `/etc/hostname` are files, paths
/// with `/new-` do not exist until made, anything else is a directory), and
/// exec understands the door's process wrapper (it reports a pid; a `sleep`
/// runs forever, anything else prints `hi` and exits 0) and its `alive`
/// helper (every pid is alive); other commands exit 0 silently.
#[derive(Debug, Default)]
pub struct Double {
    pids: AtomicU32,
    made: Mutex<HashSet<String>>,
    ops: AtomicU64,
}

fn snap_info(id: &SnapshotId) -> SnapshotInfo {
    SnapshotInfo {
        id: id.clone(),
        pause_ms: 1.0,
        device_state_bytes: 1,
        created_at: Utc::now(),
        phases: Default::default(),
    }
}

impl Double {
    /// How many engine operations ran (lifecycle, exec and files; not the
    /// background `snapshot_usage` nor the start-up inventory).
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    fn op(&self) {
        self.ops.fetch_add(1, Ordering::SeqCst);
    }

    fn vm(&self, size: SandboxSize) -> VmInfo {
        VmInfo {
            pid: 10_000 + self.pids.fetch_add(1, Ordering::Relaxed),
            accel: "tcg".into(),
            size,
            ready_ms: 1.0,
        }
    }

    fn exec_now(&self, req: ExecRequest) -> ExecStream {
        let exit = || {
            Ok(ExecEvent::Exit(ExitStatus {
                code: Some(0),
                signal: None,
                timed_out: false,
            }))
        };
        let Command::Argv(cmd) = req.command else {
            return futures::stream::iter([exit()]).boxed();
        };
        let wrapper =
            cmd.len() >= 6 && cmd[0] == "/bin/sh" && cmd[2].starts_with("d=/tmp/.strata-e2b");
        if wrapper {
            let pid = 20_000 + self.pids.fetch_add(1, Ordering::Relaxed);
            let marker = Ok(ExecEvent::Stdout(Bytes::from(format!(
                "\x1estrata-e2b-pid {pid}\n"
            ))));
            let forever = cmd[5..].iter().any(|a| a.contains("sleep"));
            if forever {
                return futures::stream::iter([marker])
                    .chain(futures::stream::pending())
                    .boxed();
            }
            let out = Ok(ExecEvent::Stdout(Bytes::from_static(b"hi\n")));
            return futures::stream::iter([marker, out, exit()]).boxed();
        }
        if cmd.get(3).map(String::as_str) == Some("alive") {
            let pids: String = cmd[4..].iter().map(|p| format!("{p}\n")).collect();
            let out = Ok(ExecEvent::Stdout(Bytes::from(pids)));
            return futures::stream::iter([out, exit()]).boxed();
        }
        futures::stream::iter([exit()]).boxed()
    }

    fn stat_now(&self, id: &SandboxId, path: &str) -> EngineResult<DirEntry> {
        let name = path.rsplit('/').next().unwrap_or("").to_owned();
        let made = self.made.lock().unwrap().contains(path);
        let kind = if made {
            FileKind::Dir
        } else if path.contains("/new-") {
            return Err(RuntimeError::Guest {
                id: id.to_string(),
                kind: GuestErrorKind::NotFound,
                message: format!("{path}: no such file or directory"),
            });
        } else if path.ends_with(".txt") || path == "/etc/hostname" {
            FileKind::File
        } else {
            FileKind::Dir
        };
        Ok(DirEntry {
            name,
            kind,
            size: 5,
            mode: if kind == FileKind::Dir {
                0o40755
            } else {
                0o100644
            },
            mtime: 0,
            ext: None,
        })
    }
}

// The trait is `#[async_trait]`; this crate has no `async-trait`, so the
// methods are written as that macro expands them.
impl Engine for Double {
    fn create<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 Source,
        size: SandboxSize,
    ) -> Fut<'at, VmInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(self.vm(size))
        })
    }
    fn create_hibernated<'l0, 'l1, 'l2, 'l3, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 Source,
        snap: &'l3 SnapshotId,
        _: SandboxSize,
    ) -> Fut<'at, SnapshotInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        'l3: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(snap_info(snap))
        })
    }
    fn snapshot<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        snap: &'l2 SnapshotId,
    ) -> Fut<'at, SnapshotInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(snap_info(snap))
        })
    }
    fn fork_live<'l0, 'l1, 'l2, 'l3, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        snap: &'l2 SnapshotId,
        _: &'l3 SandboxId,
        size: SandboxSize,
    ) -> Fut<'at, (SnapshotInfo, VmInfo)>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        'l3: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok((snap_info(snap), self.vm(size)))
        })
    }
    fn rewind<'l0, 'l1, 'l2, 'l3, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 SnapshotId,
        pre: Option<&'l3 SnapshotId>,
    ) -> Fut<'at, (Option<SnapshotInfo>, VmInfo)>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        'l3: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok((pre.map(snap_info), self.vm(SandboxSize::default())))
        })
    }
    fn restore<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 SnapshotId,
    ) -> Fut<'at, VmInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(self.vm(SandboxSize::default()))
        })
    }
    fn pause<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SandboxId) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn resume<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SandboxId) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn hibernate<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        snap: &'l2 SnapshotId,
    ) -> Fut<'at, SnapshotInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(snap_info(snap))
        })
    }
    fn wake<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 SnapshotId,
    ) -> Fut<'at, VmInfo>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(self.vm(SandboxSize::default()))
        })
    }
    fn delete<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SandboxId) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn delete_snapshot<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SnapshotId) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn snapshot_usage<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SnapshotId) -> Fut<'at, SpaceUsage>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            // Background or start-up work: not counted.

            Ok(SpaceUsage {
                exclusive_bytes: 4096,
                referenced_bytes: 1 << 20,
            })
        })
    }
    fn exec<'l0, 'l1, 'at>(&'l0 self, _: &'l1 SandboxId, req: ExecRequest) -> Fut<'at, ExecStream>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(self.exec_now(req))
        })
    }
    fn read_file<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 str,
    ) -> Fut<'at, ByteStream>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(futures::stream::iter([Ok(Bytes::from_static(b"hello"))]).boxed())
        })
    }
    fn write_file<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 str,
        _: u32,
        mut body: ByteStream,
    ) -> Fut<'at, u64>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            let mut n = 0;
            while let Some(c) = body.next().await {
                n += c?.len() as u64;
            }
            Ok(n)
        })
    }
    fn list_dir<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 str,
    ) -> Fut<'at, Vec<DirEntry>>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(Vec::new())
        })
    }
    fn stat<'l0, 'l1, 'l2, 'at>(&'l0 self, id: &'l1 SandboxId, p: &'l2 str) -> Fut<'at, DirEntry>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            self.stat_now(id, p)
        })
    }
    fn mkdir<'l0, 'l1, 'l2, 'at>(&'l0 self, _: &'l1 SandboxId, p: &'l2 str, _: bool) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            self.made.lock().unwrap().insert(p.to_owned());
            Ok(())
        })
    }
    fn remove<'l0, 'l1, 'l2, 'at>(
        &'l0 self,
        _: &'l1 SandboxId,
        _: &'l2 str,
        _: bool,
    ) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        'l2: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn build_template<'l0, 'l1, 'at>(
        &'l0 self,
        tpl: &'l1 TemplateId,
        size: SandboxSize,
        _: ProgressSink,
    ) -> Fut<'at, TemplateBuilt>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(TemplateBuilt {
                id: tpl.clone(),
                size,
                accel: "tcg".into(),
                boot_ms: 1.0,
                build_ms: 1.0,
            })
        })
    }
    fn delete_template<'l0, 'l1, 'at>(&'l0 self, _: &'l1 TemplateId) -> Fut<'at, ()>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            self.op();
            Ok(())
        })
    }
    fn live_vms<'l0, 'at>(&'l0 self) -> Fut<'at, Vec<LiveVm>>
    where
        'l0: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            // Background or start-up work: not counted.
            Ok(Vec::new())
        })
    }
    fn subvolumes<'l0, 'at>(&'l0 self) -> Fut<'at, Subvolumes>
    where
        'l0: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            // Background or start-up work: not counted.
            Ok(Subvolumes::default())
        })
    }
    fn adopt<'l0, 'l1, 'at>(&'l0 self, id: &'l1 SandboxId) -> Fut<'at, VmInfo>
    where
        'l0: 'at,
        'l1: 'at,
        Self: 'at,
    {
        Box::pin(async move {
            // Background or start-up work: not counted.
            Err(RuntimeError::SandboxNotFound(id.to_string()))
        })
    }
    fn exit_events(&self) -> tokio::sync::mpsc::UnboundedReceiver<VmDied> {
        tokio::sync::mpsc::unbounded_channel().1
    }
}

// ----------------------------------------------------------------- harness

/// A daemon with the E2B door, authentication on.
pub struct Door {
    /// Base URL of both the control plane and envd.
    pub url: String,
    /// The platform admin's bearer token (`admin.token`).
    pub admin: String,
    /// The daemon.
    pub app: App,
    /// HTTP client.
    pub http: reqwest::Client,
    /// The engine double.
    pub engine: Arc<Double>,
    /// Its data dir (`audit.jsonl` is there).
    pub dir: tempfile::TempDir,
}

/// A fresh daemon with the door on its own listener (the door's rate
/// limits off: the matrix sends many refused requests from one address).
pub async fn door() -> Door {
    door_with(|_, e2b| {
        e2b.rate_limit_per_second = 0.0;
        e2b.auth_failures_per_minute = 0;
    })
    .await
}

/// A fresh daemon whose configuration and door settings `tweak` changes
/// (the door starts with the configured key [`KEY`], the secret [`SECRET`]
/// and its default limits), served with connect info (the source address,
/// as stratad serves it).
pub async fn door_with(tweak: impl FnOnce(&mut Config, &mut strata_e2b::E2bConfig)) -> Door {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config {
        data_dir: dir.path().to_owned(),
        key_dir: dir.path().join("keys"),
        default_template: false,
        ..Config::default()
    };
    cfg.capacity.vcpus = 1 << 20;
    cfg.capacity.memory_mib = 1 << 40;
    cfg.capacity.admission = stratad::config::AdmissionMode::Nominal;
    cfg.pressure.enabled = false;
    cfg.security.auth = true;
    cfg.security.rate_limit_per_second = 0.0;
    cfg.security.approval_timeout = std::time::Duration::from_millis(50);
    let mut e2b = strata_e2b::E2bConfig {
        api_keys: vec![strata_e2b::auth::ApiKey::bare(KEY)],
        token_secret: SECRET.to_vec(),
        ..Default::default()
    };
    tweak(&mut cfg, &mut e2b);
    let store = Arc::new(SqliteStore::open(&cfg.db_path(), 2).unwrap());
    store
        .put_template(&TemplateRecord {
            id: "tpl-base".parse().unwrap(),
            tenant: stratad::caller::PLATFORM_SCOPE.into(),
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
    let engine = Arc::new(Double::default());
    let app = App::new(cfg, store, engine.clone(), Arc::new(SystemClock));
    let admin = std::fs::read_to_string(dir.path().join("admin.token"))
        .unwrap()
        .trim()
        .to_owned();
    let router = app.router().merge(strata_e2b::router(
        app.service().clone(),
        app.security().cloned(),
        e2b,
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, service).await });
    Door {
        url,
        admin,
        app,
        http: reqwest::Client::new(),
        engine,
        dir,
    }
}

/// A raw answer.
#[derive(Debug, Clone)]
pub struct Raw {
    /// HTTP status.
    pub status: u16,
    /// `Content-Type`.
    pub ctype: String,
    /// Body bytes (for a stream, up to where the reader stopped).
    pub body: Vec<u8>,
}

impl Raw {
    /// The body as JSON (`Null` when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Connect envelopes `(flags, payload)` of a (possibly partial) body.
pub fn frames(mut b: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    while b.len() >= 5 {
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        if b.len() < 5 + len {
            break;
        }
        let v = serde_json::from_slice(&b[5..5 + len]).unwrap_or(Value::Null);
        out.push((b[0], v));
        b = &b[5 + len..];
    }
    out
}

/// One Connect envelope around `msg`.
pub fn envelope(msg: &Value) -> Vec<u8> {
    let b = serde_json::to_vec(msg).unwrap();
    let mut out = vec![0u8];
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(&b);
    out
}

impl Door {
    /// Sends a request; a Connect stream is read until its end-of-stream
    /// envelope, or (`first_only`) its first envelope.
    pub async fn send(&self, rq: reqwest::RequestBuilder, first_only: bool) -> Raw {
        let mut r = rq.send().await.unwrap();
        let status = r.status().as_u16();
        let ctype = r
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let mut body = Vec::new();
        let stream = ctype == "application/connect+json";
        while let Some(c) = r.chunk().await.unwrap() {
            body.extend_from_slice(&c);
            if stream {
                let f = frames(&body);
                if f.iter().any(|(flags, _)| flags & 2 != 0) || (first_only && !f.is_empty()) {
                    break;
                }
            }
        }
        if ctype.starts_with("application/json") {
            if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                remember_tokens(&v);
            }
        }
        Raw {
            status,
            ctype,
            body,
        }
    }

    /// A control-plane request with `X-API-KEY: key` (none when `None`).
    pub async fn control(&self, method: &str, path: &str, key: Option<&str>, body: &str) -> Raw {
        let mut rq = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = key {
            rq = rq.header("X-API-KEY", k);
        }
        self.send(rq, false).await
    }

    /// The `x-next-token` header of a control-plane `GET` with `key`.
    pub async fn next_token(&self, path: &str, key: &str) -> Option<String> {
        let r = self
            .http
            .get(format!("{}{path}", self.url))
            .header("X-API-KEY", key)
            .send()
            .await
            .unwrap();
        r.headers()
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    /// A `/v1` request as the platform admin.
    pub async fn v1(&self, method: &str, path: &str, body: Value) -> Value {
        let r = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.url))
            .bearer_auth(&self.admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{method} {path}: {}", r.status());
        r.json().await.unwrap_or(Value::Null)
    }

    /// A strata token of `role` in `tenant`: `(secret, id)`.
    pub async fn token(&self, role: &str, tenant: &str) -> (String, String) {
        let v = self
            .v1(
                "POST",
                "/v1/tokens",
                json!({ "role": role, "tenant": tenant }),
            )
            .await;
        (
            v["token"].as_str().unwrap().to_owned(),
            v["id"].as_str().unwrap().to_owned(),
        )
    }

    fn audit_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("audit.jsonl")).unwrap_or_default()
    }

    /// How many lines `<data_dir>/audit.jsonl` has.
    pub fn audit_len(&self) -> usize {
        self.audit_text()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count()
    }

    /// The entries of `<data_dir>/audit.jsonl` after the first `n`.
    pub fn audit_since(&self, n: usize) -> Vec<Value> {
        self.audit_text()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .skip(n)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// A sandbox created through the door with `key`: its id.
    pub async fn create(&self, key: &str) -> String {
        let r = self
            .control(
                "POST",
                "/v2/sandboxes",
                Some(key),
                r#"{"templateID":"base","timeout":300}"#,
            )
            .await;
        assert_eq!(r.status, 201, "create: {}", r.text());
        r.json()["sandboxID"].as_str().unwrap().to_owned()
    }

    /// A sandbox created and paused (hibernated) through the door with `key`.
    pub async fn create_paused(&self, key: &str) -> String {
        let id = self.create(key).await;
        let r = self
            .control("POST", &format!("/sandboxes/{id}/pause"), Some(key), "")
            .await;
        assert_eq!(r.status, 204, "pause: {}", r.text());
        id
    }

    /// A running sandbox of `tenant` created through `/v1` (by a developer
    /// token of that tenant): no envd token was ever handed out for it.
    pub async fn v1_sandbox(&self, tenant: &str) -> String {
        let (tok, _) = self.token("developer", tenant).await;
        let r = self
            .http
            .post(format!("{}/v1/sandboxes", self.url))
            .bearer_auth(&tok)
            .json(&json!({ "template": "tpl-base" }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201, "POST /v1/sandboxes");
        let v: Value = r.json().await.unwrap();
        v["id"].as_str().unwrap().to_owned()
    }
}
