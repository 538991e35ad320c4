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
//! service's, so the modules that raise them import none of each other),
//! [`cluster`] (on a cluster: each request naming a sandbox goes to the
//! host that holds it, a create to the host placement picks).
//!
//! Security: `X-API-KEY` is a configured E2B key ([`auth::ApiKey`]: its
//! own tenant and actor, or for a bare key a developer of tenant `default`)
//! or a strata API token (its tenant and role): that
//! [`stratad::caller::Caller`] is passed to every service command, which
//! decides tenancy (another tenant's id answers like an unknown one) and
//! gates tool calls (lifecycle, exec, file reads and writes) through
//! stratad's policy engine, approval queue and audit log. envd calls act as
//! the caller the sandbox's access token was handed to (stored in stratad's
//! security store); guest file operations and the door's helper commands
//! run under the service's [`stratad::service::Grant`] of the decided call.
//!
//! Bounds: credentials are checked by middleware before any body is read
//! (an anonymous request is answered without reading its body); Connect and
//! JSON bodies are capped at [`E2bConfig::max_request_bytes`], uploads are
//! streamed to the guest under the service's `max_upload_bytes` (`413`);
//! token buckets per configured key, per sandbox (envd) and per source
//! address for failed authentication answer `429`.

pub mod auth;
pub mod cluster;
pub mod connect;
pub mod control;
pub mod envd;
pub mod error;
pub mod policy;
pub mod ports;
pub mod procs;
pub mod proto;
pub mod public;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::http::{header, HeaderMap};
use axum::routing::{delete, get, post, put};
use axum::Router;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use strata_core::SandboxId;
use stratad::security::ratelimit::RateLimiter;
use stratad::security::Security;
use stratad::service::Service;

/// The envd version advertised to the SDK. The SDK gates features on it:
/// 0.4.0 (default user), 0.5.2 (`CloseStdin`), 0.5.7 (octet-stream upload),
/// 0.6.2 (file metadata), 0.6.3 (watch events with entries), 0.6.4
/// (`allow_network_mounts`, accepted: the watcher polls).
pub const ENVD_VERSION: &str = "0.6.4";

/// Settings of the E2B front door.
#[derive(Debug, Clone)]
pub struct E2bConfig {
    /// Accepted `X-API-KEY` values besides strata API tokens, each with the
    /// tenant and actor it acts as ([`auth::ApiKey::parse`]). Empty, and the
    /// daemon has no authentication: the control plane is open (local
    /// development).
    pub api_keys: Vec<auth::ApiKey>,
    /// Secret the per-sandbox envd access tokens are derived from (HMAC of
    /// the sandbox id): the same secret gives the same tokens after a restart.
    pub token_secret: Vec<u8>,
    /// Directory relative guest paths resolve against (E2B's user home).
    pub home_dir: String,
    /// `clientID` reported for every sandbox.
    pub client_id: String,
    /// Sandbox timeout when the create request gives none, in seconds.
    pub default_timeout_s: u64,
    /// Largest Connect or JSON request body (every route but `POST /files`),
    /// in bytes; larger answers `413`.
    pub max_request_bytes: usize,
    /// Token bucket of each configured key (control plane) and of each
    /// sandbox (envd calls): requests per second sustained; `0` turns the
    /// limits off.
    pub rate_limit_per_second: f64,
    /// Requests at once of those buckets.
    pub rate_limit_burst: u32,
    /// Failed authentications (bad `X-API-KEY` or `X-Access-Token`) a source
    /// address may make per minute (as many at once); past that every
    /// request from it answers `429` until its bucket refills. `0`: no limit.
    pub auth_failures_per_minute: u32,
    /// The `domain` answered at create/connect (`get_host(port)` =
    /// `<port>-<id>.<domain>`; the daemon sets `localhost:<its port>` unless
    /// configured); `None`: answered as `null`.
    pub domain: Option<String>,
    /// Guest ports answer requests without a credential ([`ports`]).
    pub public_ports: bool,
    /// PEM CA bundle given to the template builds of this door
    /// ([`control::templates`]; `[e2b] template_ca_bundle`): for hosts whose
    /// registry TLS is re-signed by a local CA. `None`: none.
    pub template_ca_bundle: Option<std::path::PathBuf>,
}

/// Default of [`E2bConfig::max_request_bytes`]: 16 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 << 20;

impl Default for E2bConfig {
    fn default() -> Self {
        E2bConfig {
            api_keys: Vec::new(),
            token_secret: auth::random_secret(),
            home_dir: "/root".into(),
            client_id: "strata".into(),
            default_timeout_s: 300,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            rate_limit_per_second: 100.0,
            rate_limit_burst: 200,
            auth_failures_per_minute: 60,
            domain: None,
            public_ports: true,
            template_ca_bundle: None,
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
    /// `envVars` given at create (and inherited by forks), applied to every
    /// command of the sandbox: a cache of what the service keeps with the
    /// sandbox ([`Service::set_sandbox_env`]), loaded at start.
    envs: Mutex<HashMap<SandboxId, BTreeMap<String, String>>>,
    /// Per-sandbox port settings (`public`): a cache of what the service
    /// keeps, loaded at start.
    port_settings: Mutex<HashMap<SandboxId, public::PortSettings>>,
    /// Polling directory watchers by id (in memory).
    watchers: Mutex<HashMap<String, envd::Watcher>>,
    /// Token buckets of the configured keys, by [`auth::ApiKey::id`].
    key_limiter: RateLimiter,
    /// Token buckets of envd calls, by sandbox.
    envd_limiter: RateLimiter,
    /// Failed authentications by source address.
    failures: auth::FailureLimiter,
    /// Template build requests, uploads and tags ([`control::templates`]).
    templates: control::templates::TemplateState,
}

impl E2b {
    /// The state over a service.
    pub fn new(svc: Arc<Service>, sec: Option<Arc<Security>>, cfg: E2bConfig) -> Arc<Self> {
        let envs = load_envs(&svc);
        let ports = public::load(&svc);
        let templates = control::templates::TemplateState::load(&svc);
        let st = Arc::new(E2b {
            svc,
            sec,
            procs: Arc::new(procs::Registry::default()),
            envs: Mutex::new(envs),
            port_settings: Mutex::new(ports),
            watchers: Mutex::new(HashMap::new()),
            key_limiter: RateLimiter::new(cfg.rate_limit_per_second, cfg.rate_limit_burst),
            envd_limiter: RateLimiter::new(cfg.rate_limit_per_second, cfg.rate_limit_burst),
            failures: auth::FailureLimiter::per_minute(cfg.auth_failures_per_minute),
            templates,
            cfg,
        });
        if st.svc.cluster().is_some() {
            // The doors of a cluster check each other's envd tokens.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let st2 = st.clone();
                rt.spawn(async move {
                    match st2.check_shared_secret().await {
                        Ok(Some(id)) => {
                            tracing::info!(sandbox = %id, "E2B door: the envd token secret matches the cluster's")
                        }
                        Ok(None) => {}
                        Err(e) => tracing::error!("E2B door on a cluster: {e}"),
                    }
                });
            }
        }
        // Whoever deletes a sandbox (a user, its timeout), the door forgets it.
        let weak = Arc::downgrade(&st);
        st.svc.on_deleted(Arc::new(move |id| {
            if let Some(st) = weak.upgrade() {
                st.forget_sandbox(id);
            }
        }));
        st
    }

    /// Keeps `envs` with sandbox `id` (the service's store and the cache).
    async fn keep_envs(
        &self,
        caller: &stratad::caller::Caller,
        id: &SandboxId,
        envs: BTreeMap<String, String>,
    ) {
        if envs.is_empty() {
            return;
        }
        if let Err(e) = self.svc.set_sandbox_env(caller, id, envs.clone()).await {
            tracing::warn!(sandbox = %id, error = %e, "storing envVars failed: kept in memory only");
        }
        self.envs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), envs);
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

/// The environments the service keeps with its sandboxes; none (with a
/// warning) when the store fails.
fn load_envs(svc: &Service) -> HashMap<SandboxId, BTreeMap<String, String>> {
    match svc.stored_envs() {
        Ok(v) => v.into_iter().collect(),
        Err(e) => {
            tracing::warn!(error = %e, "reading the sandboxes' envVars failed");
            HashMap::new()
        }
    }
}

/// Why a capped request body was not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyError {
    /// Longer than the cap (in bytes), by `Content-Length` or as it came.
    TooLarge(usize),
    /// The client's body failed (connection closed, bad chunking).
    Read(String),
}

/// `Content-Length` of a request, when it gives a valid one.
pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// Reads a whole request body of at most `limit` bytes: a `Content-Length`
/// over it is refused before anything is read, a body that grows past it
/// (chunked) as soon as it does; never more than `limit` bytes are held.
pub(crate) async fn capped_body(req: Request, limit: usize) -> Result<Bytes, BodyError> {
    if content_length(req.headers()).is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge(limit));
    }
    let mut stream = req.into_body().into_data_stream();
    let mut buf = BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(format!("reading the request body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The E2B API (control plane and envd) over `svc`, with `sec` (stratad's
/// security subsystem: `app.security().cloned()`) for strata tokens,
/// tenancy, policy and audit. Has no fallback, so it merges into stratad's
/// router (`app.router().merge(strata_e2b::router(…))`).
pub fn router(svc: Arc<Service>, sec: Option<Arc<Security>>, cfg: E2bConfig) -> Router {
    routes(E2b::new(svc, sec, cfg))
}

/// The router to serve: `api` (stratad's) with the E2B API merged, and in
/// front of every route the door's guest-port routing ([`ports::dispatch`]:
/// a `Host` of `<port>-<id>.<domain>`, or `E2b-Sandbox-Port` other than
/// envd's, goes to that guest port whatever its path).
pub fn router_with_api(
    api: Router,
    svc: Arc<Service>,
    sec: Option<Arc<Security>>,
    cfg: E2bConfig,
) -> Router {
    let state = E2b::new(svc, sec, cfg);
    api.merge(routes(state.clone()))
        .layer(axum::middleware::from_fn_with_state(state, ports::dispatch))
}

fn routes(state: Arc<E2b>) -> Router {
    let control = Router::new()
        .route("/sandboxes", post(control::create).get(control::list_v1))
        .route("/v2/sandboxes", post(control::create).get(control::list_v2))
        .route(
            "/sandboxes/:id",
            get(control::get).merge(delete(control::kill)),
        )
        .route("/sandboxes/metrics", get(control::metrics::list_metrics))
        .route(
            "/sandboxes/:id/metrics",
            get(control::metrics::sandbox_metrics),
        )
        .route("/sandboxes/:id/logs", get(control::logs::sandbox_logs_v1))
        .route(
            "/v2/sandboxes/:id/logs",
            get(control::logs::sandbox_logs_v2),
        )
        .route("/sandboxes/:id/connect", post(control::connect))
        .route("/v2/sandboxes/:id/connect", post(control::connect))
        .route("/sandboxes/:id/resume", post(control::resume))
        .route("/sandboxes/:id/timeout", post(control::set_timeout))
        .route("/sandboxes/:id/refreshes", post(control::refresh))
        .route("/sandboxes/:id/pause", post(control::pause))
        .route("/sandboxes/:id/fork", post(control::fork::fork))
        .route("/sandboxes/:id/network", put(control::network::update))
        .route(
            "/sandboxes/:id/snapshots",
            post(control::snapshots::create_snapshot),
        )
        .route("/snapshots", get(control::snapshots::list_snapshots))
        .route("/templates/:id", delete(control::templates::delete))
        .route("/v3/templates", post(control::templates::request_build))
        .route(
            "/templates/:id/files/:hash",
            get(control::templates::file_upload_link),
        )
        .route(
            "/v2/templates/:id/builds/:build",
            post(control::templates::start_build),
        )
        .route(
            "/templates/:id/builds/:build/status",
            get(control::templates::build_status),
        )
        .route("/templates/aliases/:id", get(control::templates::alias))
        .route(
            "/templates/tags",
            post(control::templates::assign_tags).delete(control::templates::remove_tags),
        )
        .route("/templates/:id/tags", get(control::templates::list_tags))
        // On a cluster: to the sandbox's host (inside the key check).
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            cluster::control,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ));
    let p = "/process.Process";
    let f = "/filesystem.Filesystem";
    // Each group checks `E2b-Sandbox-Id` / `X-Access-Token` (and the rate
    // limits) in a route layer, before any extractor reads the body, and
    // refuses in the group's error shape.
    let checked = |shape| {
        axum::middleware::from_fn_with_state((state.clone(), shape), auth::require_access_token)
    };
    // On a cluster: to the sandbox's host, once the check found it.
    let owner = |shape| axum::middleware::from_fn_with_state((state.clone(), shape), cluster::envd);
    let unary = Router::new()
        .route(&format!("{p}/List"), post(envd::list))
        .route(&format!("{p}/SendInput"), post(envd::send_input))
        .route(&format!("{p}/SendSignal"), post(envd::send_signal))
        .route(&format!("{p}/Update"), post(envd::update))
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
        .route_layer(owner(auth::Shape::Unary))
        .route_layer(checked(auth::Shape::Unary));
    let streams = Router::new()
        .route(&format!("{p}/Start"), post(envd::start))
        .route(&format!("{p}/Connect"), post(envd::connect))
        .route(&format!("{f}/WatchDir"), post(envd::watch_dir))
        .route_layer(owner(auth::Shape::Stream))
        .route_layer(checked(auth::Shape::Stream));
    // A build's upload link is its own credential (as a presigned URL is).
    let uploads = Router::new()
        .route(
            "/e2b-template-uploads/:token",
            put(control::templates::upload),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            cluster::control,
        ));
    let files = Router::new()
        .route("/files", get(envd::download).post(envd::upload))
        .route_layer(owner(auth::Shape::Files))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            envd::signed::files_access,
        ));
    // `/health` reads no body and answers a bad token as an unknown sandbox.
    let envd = Router::new()
        .route("/health", get(envd::health))
        .merge(unary)
        .merge(streams)
        .merge(files);
    control.merge(uploads).merge(envd).with_state(state)
}
