//! E2B-compatible front door for strata.
//!
//! The unmodified `e2b` SDK talks to two endpoints: the control plane
//! (`E2B_API_URL`: `/sandboxes`, `/v2/sandboxes`, …, authenticated with
//! `X-API-KEY`) and envd, the in-sandbox daemon (`E2B_SANDBOX_URL`: the
//! Connect RPCs `process.Process/*`, `filesystem.Filesystem/*` and
//! `/files`, authenticated with the per-sandbox `X-Access-Token`, the
//! sandbox named by the `E2b-Sandbox-Id` header). [`router`] serves both on
//! one listener, on top of stratad's [`Service`]: the sandboxes are strata's
//! own (they show in `strata ls`, can be snapshotted, forked, rewound).
//!
//! Modules: [`connect`] (Connect protocol framing), [`proto`] (envd
//! messages in proto3 JSON), [`control`] (control-plane handlers),
//! [`envd`] (envd handlers: `files`, `filesystem`, `process`), [`procs`]
//! (E2B process handles on top of strata's one-shot exec), [`auth`] (API
//! keys and strata tokens, envd tokens), [`policy`] (callers, the envd
//! token bindings), [`error`] (the door's errors and the mapping of the
//! service's, so the modules that raise them import none of each other).
//!
//! Security: `X-API-KEY` is a configured E2B key (tenant `default`,
//! developer) or a strata API token (its tenant and role): that
//! [`stratad::caller::Caller`] is passed to every service command, which
//! decides tenancy (another tenant's id answers like an unknown one) and
//! gates tool calls (lifecycle, exec, file reads and writes) through
//! stratad's policy engine, approval queue and audit log. envd calls act as
//! the caller the sandbox's access token was handed to (stored in stratad's
//! security store); guest file operations and the door's helper commands
//! run under the service's [`stratad::service::Grant`] of the decided call.

pub mod auth;
pub mod connect;
pub mod control;
pub mod envd;
pub mod error;
pub mod policy;
pub mod procs;
pub mod proto;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::routing::{delete, get, post};
use axum::Router;
use strata_core::SandboxId;
use stratad::security::Security;
use stratad::service::Service;

/// The envd version advertised to the SDK. The SDK gates features on it:
/// 0.4.0 (default user), 0.5.2 (`CloseStdin`), 0.5.7 (octet-stream upload).
/// 0.6.2 (file metadata) and 0.6.3 (watch entries) are not implemented.
pub const ENVD_VERSION: &str = "0.5.7";

/// Settings of the E2B front door.
#[derive(Debug, Clone)]
pub struct E2bConfig {
    /// Accepted `X-API-KEY` values besides strata API tokens (a key of this
    /// list acts as a developer of tenant `default`). Empty, and the daemon
    /// has no authentication: the control plane is open (local development).
    pub api_keys: Vec<String>,
    /// Secret the per-sandbox envd access tokens are derived from (HMAC of
    /// the sandbox id): the same secret gives the same tokens after a restart.
    pub token_secret: Vec<u8>,
    /// Directory relative guest paths resolve against (E2B's user home).
    pub home_dir: String,
    /// `clientID` reported for every sandbox.
    pub client_id: String,
    /// Sandbox timeout when the create request gives none, in seconds.
    pub default_timeout_s: u64,
}

impl Default for E2bConfig {
    fn default() -> Self {
        E2bConfig {
            api_keys: Vec::new(),
            token_secret: auth::random_secret(),
            home_dir: "/root".into(),
            client_id: "strata".into(),
            default_timeout_s: 300,
        }
    }
}

/// Shared state of the handlers.
#[derive(Debug)]
pub struct E2b {
    svc: Arc<Service>,
    /// stratad's security subsystem (tokens, the envd token bindings);
    /// `None`: no strata tokens and no stored bindings (tests). Tool calls
    /// are gated by the service whatever this is.
    sec: Option<Arc<Security>>,
    cfg: E2bConfig,
    procs: Arc<procs::Registry>,
    /// `envVars` given at create, applied to every command of the sandbox.
    /// Kept in memory: lost when the daemon restarts.
    envs: Mutex<HashMap<SandboxId, BTreeMap<String, String>>>,
    /// Polling directory watchers by id (in memory).
    watchers: Mutex<HashMap<String, envd::Watcher>>,
}

impl E2b {
    /// The state over a service.
    pub fn new(svc: Arc<Service>, sec: Option<Arc<Security>>, cfg: E2bConfig) -> Arc<Self> {
        Arc::new(E2b {
            svc,
            sec,
            cfg,
            procs: Arc::new(procs::Registry::default()),
            envs: Mutex::new(HashMap::new()),
            watchers: Mutex::new(HashMap::new()),
        })
    }

    /// The envd access token of a sandbox.
    pub fn envd_token(&self, id: &str) -> String {
        auth::envd_token(&self.cfg.token_secret, id)
    }

    fn sandbox_envs(&self, id: &SandboxId) -> BTreeMap<String, String> {
        self.envs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    /// A guest path from the SDK: relative paths resolve against the home dir.
    fn guest_path(&self, p: &str) -> String {
        if p.starts_with('/') {
            p.to_owned()
        } else if p.is_empty() || p == "." {
            self.cfg.home_dir.clone()
        } else {
            format!(
                "{}/{}",
                self.cfg.home_dir.trim_end_matches('/'),
                p.trim_start_matches("./")
            )
        }
    }
}

/// The E2B API (control plane and envd) over `svc`, with `sec` (stratad's
/// security subsystem: `app.security().cloned()`) for strata tokens,
/// tenancy, policy and audit. Has no fallback, so it merges into stratad's
/// router (`app.router().merge(strata_e2b::router(…))`).
pub fn router(svc: Arc<Service>, sec: Option<Arc<Security>>, cfg: E2bConfig) -> Router {
    let state = E2b::new(svc, sec, cfg);
    let control = Router::new()
        .route("/sandboxes", post(control::create).get(control::list_v1))
        .route("/v2/sandboxes", post(control::create).get(control::list_v2))
        .route(
            "/sandboxes/:id",
            get(control::get).merge(delete(control::kill)),
        )
        .route("/sandboxes/:id/connect", post(control::connect))
        .route("/v2/sandboxes/:id/connect", post(control::connect))
        .route("/sandboxes/:id/resume", post(control::resume))
        .route("/sandboxes/:id/timeout", post(control::set_timeout))
        .route("/sandboxes/:id/refreshes", post(control::refresh))
        .route("/sandboxes/:id/pause", post(control::pause))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    let p = "/process.Process";
    let f = "/filesystem.Filesystem";
    let envd = Router::new()
        .route("/health", get(envd::health))
        .route("/files", get(envd::download).post(envd::upload))
        .route(&format!("{p}/Start"), post(envd::start))
        .route(&format!("{p}/Connect"), post(envd::connect))
        .route(&format!("{p}/List"), post(envd::list))
        .route(&format!("{p}/SendInput"), post(envd::send_input))
        .route(&format!("{p}/SendSignal"), post(envd::send_signal))
        .route(&format!("{p}/CloseStdin"), post(envd::close_stdin))
        .route(&format!("{f}/Stat"), post(envd::stat))
        .route(&format!("{f}/ListDir"), post(envd::list_dir))
        .route(&format!("{f}/MakeDir"), post(envd::make_dir))
        .route(&format!("{f}/Move"), post(envd::move_entry))
        .route(&format!("{f}/Remove"), post(envd::remove))
        .route(&format!("{f}/CreateWatcher"), post(envd::create_watcher))
        .route(
            &format!("{f}/GetWatcherEvents"),
            post(envd::get_watcher_events),
        )
        .route(&format!("{f}/RemoveWatcher"), post(envd::remove_watcher))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 30));
    control.merge(envd).with_state(state)
}
