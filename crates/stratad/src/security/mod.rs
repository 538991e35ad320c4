//! Security of the daemon (issue 5): API tokens, tenants and roles; the
//! tool-call policy applied before the engine is called; the approval queue
//! (persisted in SQLite); the hash-chained audit log; per-sandbox egress
//! proxies; per-token rate limits.
//!
//! The policy engine, approval queue, audit log and proxy are
//! `strata_policy`'s; this module wires them to the store, the API and the
//! configuration. The HTTP side (middleware and routes) is `api::security`.
//!
//! Tenancy is decided from the [`crate::caller::Caller`] each front door
//! builds and passes to every service command (no task-local, no second
//! router): the service's lookups answer another tenant's ids exactly like
//! unknown ids, and the gate ([`gate::ToolGate`]) sees the caller's actor.

pub mod auth;
pub mod gate;
pub mod intercept;
pub mod keys;
pub mod ratelimit;
pub mod secrets;
pub mod store;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use serde::Serialize;
use strata_policy::approval::ApprovalQueue;
use strata_policy::audit::{
    self, AuditDecision, AuditLimits, AuditLog, AuditOptions, ChainStart, Outcome,
};
use strata_policy::proxy::{
    Egress, HostTunnels, PolicySource, ProxyConfig, Resolver, StaticResolver, SystemResolver,
    TunnelLimits,
};
use strata_policy::{Decision, Policy, PolicySet, ToolCall};
use strata_proto::client::{OpenFuture, TunnelHandler, TunnelService, TunnelStream};

/// How the audit head sink says the security store's disk is full (its
/// error is a string): the write fails closed with `507 store_full`.
const STORE_FULL: &str = "store full";

use crate::config::Config;
pub use crate::config::SecurityConfig;
use crate::store::DEFAULT_TENANT;
use auth::{Principal, Role};
use ratelimit::RateLimiter;
use store::{SecStoreError, SecurityStore, TokenRecord};

/// Why the security subsystem could not start.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    /// The security tables.
    #[error(transparent)]
    Store(#[from] SecStoreError),
    /// The platform policy file.
    #[error("platform policy")]
    Policy(#[from] strata_policy::policy::LoadError),
    /// Policies that do not compose.
    #[error("policy: {0}")]
    Compose(String),
    /// The audit log.
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
    /// The approval queue could not be reloaded.
    #[error(transparent)]
    Approvals(#[from] strata_policy::approval::StoreError),
    /// The record of where the audit log's keyed chain begins (in the key dir).
    #[error("audit chain start {path}: {why}")]
    ChainStart {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Writing the bootstrap token.
    #[error("writing {path}")]
    Bootstrap {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The TLS interception CA or the upstream trust could not be set up.
    #[error("TLS interception: {0}")]
    Intercept(String),
}

/// Why a token was refused (all answer `401 unauthorized`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization` header.
    Missing,
    /// Not `Bearer <strata token>`.
    Malformed,
    /// Unknown token.
    Unknown,
    /// Past its expiry.
    Expired,
    /// Revoked.
    Revoked,
}

impl AuthFailure {
    /// Message for the client.
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing Authorization: Bearer <token>",
            AuthFailure::Malformed => "malformed Authorization header: expected Bearer <token>",
            AuthFailure::Unknown => "unknown token",
            AuthFailure::Expired => "token expired",
            AuthFailure::Revoked => "token revoked",
        }
    }
}

/// A new token and its secret (shown once).
#[derive(Debug, Clone, Serialize)]
pub struct IssuedToken {
    /// The record.
    #[serde(flatten)]
    pub record: TokenRecord,
    /// The secret: `Authorization: Bearer <token>`. Not stored; not shown again.
    pub token: String,
    /// The same secret in E2B's key format (`e2b_` + hex), for the E2B
    /// door's `X-API-KEY` (E2B's SDKs check a key's prefix).
    pub e2b_key: String,
}

/// What a new token is.
#[derive(Debug, Clone)]
pub struct NewToken<'a> {
    /// Its tenant.
    pub tenant: &'a str,
    /// Its role.
    pub role: Role,
    /// A name, if any.
    pub name: Option<String>,
    /// When it expires, if ever.
    pub expires_at: Option<DateTime<Utc>>,
    /// Who made it (a token id, or `bootstrap`).
    pub by: &'a str,
}

/// Rule id used when stored policies no longer compose.
pub const INVALID_POLICY_RULE: &str = "invalid-policy";

/// A cached policy layer: when it was read, and what (`None`: no layer).
type Cached = (std::time::Instant, Option<Arc<Policy>>);

/// How long a process that shares its security store with others (a
/// cluster's PostgreSQL) trusts a cached policy layer: a layer written
/// through another process is in force here within this time.
pub const SHARED_POLICY_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// How often a held call's waiter reads its approval request again when
/// the store is shared: an answer written through another process
/// releases it within this time.
pub const SHARED_APPROVAL_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Parsed policies, cached by tenant and sandbox.
pub struct Policies {
    platform: Option<Arc<Policy>>,
    /// The platform policy's text (a builder's platform layer is it plus
    /// the build connector).
    platform_text: String,
    /// Template builders (sandbox id → their platform layer: the platform
    /// policy with the [`BUILD_CONNECTOR`] of the build's hosts). Only these
    /// sandboxes know the connector, so no other sandbox can reach the
    /// registries whatever the defaults say.
    builders: Mutex<HashMap<String, Arc<Policy>>>,
    store: Arc<SecurityStore>,
    tenants: Mutex<HashMap<String, Cached>>,
    sandboxes: Mutex<HashMap<String, Cached>>,
    fallback: Arc<PolicySet>,
    /// How long a cached layer is trusted (`None`: until this process
    /// writes it; the store is this process's alone).
    ttl: Option<std::time::Duration>,
}

impl std::fmt::Debug for Policies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policies").finish_non_exhaustive()
    }
}

fn parse_stored(what: &str, text: Option<String>) -> Option<Arc<Policy>> {
    let text = text?;
    match Policy::parse(&text) {
        Ok(p) => Some(Arc::new(p)),
        Err(e) => {
            // Only accepted policies are stored; this is a tampered database.
            tracing::error!(policy = what, error = %e, "stored policy no longer parses; denying");
            Policy::parse(&deny_all_toml("stored policy does not parse"))
                .ok()
                .map(Arc::new)
        }
    }
}

fn deny_all_toml(reason: &str) -> String {
    format!(
        "default = \"deny\"\n[[rule]]\nid = \"{INVALID_POLICY_RULE}\"\neffect = \"deny\"\nhard = true\nreason = {}\n",
        toml::Value::String(reason.to_owned())
    )
}

impl Policies {
    fn lock<'a, T>(m: &'a Mutex<T>) -> std::sync::MutexGuard<'a, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A layer from `cache` (read less than the TTL ago, when the store is
    /// shared), else loaded from the store and cached.
    fn cached(
        &self,
        cache: &Mutex<HashMap<String, Cached>>,
        key: &str,
        load: impl FnOnce(&str) -> Result<Option<String>, SecStoreError>,
    ) -> Result<Option<Arc<Policy>>, SecStoreError> {
        let now = std::time::Instant::now();
        if let Some((at, p)) = Self::lock(cache).get(key) {
            if self.ttl.is_none_or(|ttl| now.duration_since(*at) < ttl) {
                return Ok(p.clone());
            }
        }
        let p = parse_stored(key, load(key)?);
        Self::lock(cache).insert(key.to_owned(), (now, p.clone()));
        Ok(p)
    }

    /// The tenant layer in force.
    pub fn tenant(&self, tenant: &str) -> Result<Option<Arc<Policy>>, SecStoreError> {
        self.cached(&self.tenants, tenant, |t| self.store.tenant_policy(t))
    }

    /// The sandbox layer in force.
    pub fn sandbox(&self, sandbox: &str) -> Result<Option<Arc<Policy>>, SecStoreError> {
        self.cached(&self.sandboxes, sandbox, |s| self.store.sandbox_policy(s))
    }

    /// The platform layer of calls on `sandbox` (a builder's has the build
    /// connector).
    fn platform_for(&self, sandbox: Option<&str>) -> Option<Arc<Policy>> {
        if let Some(s) = sandbox {
            if let Some(p) = Self::lock(&self.builders).get(s) {
                return Some(p.clone());
            }
        }
        self.platform.clone()
    }

    /// Makes `sandbox` a template builder: its platform layer gets the
    /// connector [`BUILD_CONNECTOR`] of `hosts` (ports 80 and 443), its own
    /// layer allows those hosts and denies every other egress (soft: a
    /// tenant's hard rules still decide first). The layer names hosts, not
    /// the connector, so it still composes when the sandbox is no builder.
    pub fn make_builder(
        &self,
        tenant: &str,
        sandbox: &str,
        hosts: &[String],
        by: &str,
    ) -> Result<(), String> {
        let list = hosts
            .iter()
            .map(|h| toml::Value::String(h.clone()).to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let mut text = self.platform_text.clone();
        if !hosts.is_empty() {
            text.push_str(&format!(
                "\n[[connector]]\nname = \"{BUILD_CONNECTOR}\"\nhosts = [{list}]\nports = [80, 443]\n# Registries are reached by name (no TLS interception): builds run on\n# images that may predate the interception CA.\nintercept = false\n"
            ));
        }
        let platform =
            Arc::new(Policy::parse(&text).map_err(|e| format!("the build connector: {e}"))?);
        Self::lock(&self.builders).insert(sandbox.to_owned(), platform);
        let mut layer = String::from(
            "# Written by a template build: the package registries ([templates] build_egress), nothing else.\n",
        );
        if !hosts.is_empty() {
            // By host, not by connector name: the layer must still compose
            // once the sandbox is no builder (after a restart), or every
            // call on it (its delete too) would meet the deny-all fallback.
            layer.push_str(&format!(
                "\n[[rule]]\nid = \"build-egress\"\neffect = \"allow\"\nkind = \"egress\"\nhost = [{list}]\n"
            ));
        }
        layer.push_str(
            "\n[[rule]]\nid = \"build-egress-rest\"\neffect = \"deny\"\nkind = \"egress\"\nreason = \"a template build reaches the package registries only\"\n",
        );
        let r = self.put_sandbox(tenant, sandbox, &layer, by);
        if r.is_err() {
            Self::lock(&self.builders).remove(sandbox);
        }
        r
    }

    /// `sandbox` is no builder any more (its build ended).
    pub fn end_builder(&self, sandbox: &str) {
        Self::lock(&self.builders).remove(sandbox);
    }

    /// The composed policy for a call of `tenant` on `sandbox`. Layers that
    /// no longer compose (a tenant policy dropped a connector a sandbox rule
    /// names) give a deny-everything set: fail closed.
    pub fn set(&self, tenant: &str, sandbox: Option<&str>) -> Arc<PolicySet> {
        let layers = (|| -> Result<_, SecStoreError> {
            Ok((
                self.tenant(tenant)?,
                match sandbox {
                    Some(s) => self.sandbox(s)?,
                    None => None,
                },
            ))
        })();
        let composed = match layers {
            Ok((t, s)) => {
                PolicySet::new(self.platform_for(sandbox), t, s).map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        match composed {
            Ok(set) => Arc::new(set),
            Err(why) => {
                tracing::error!(tenant, ?sandbox, error = %why, "policy layers do not compose; denying");
                self.fallback.clone()
            }
        }
    }

    /// Checks and stores a tenant policy; on error the old one stays.
    pub fn put_tenant(&self, tenant: &str, text: &str, by: &str) -> Result<(), String> {
        let p = Arc::new(Policy::parse(text).map_err(|e| e.to_string())?);
        PolicySet::new(self.platform.clone(), Some(p.clone()), None).map_err(|e| e.to_string())?;
        self.store
            .put_tenant_policy(tenant, text, by)
            .map_err(|e| format!("storing policy: {e}"))?;
        Self::lock(&self.tenants).insert(tenant.to_owned(), (std::time::Instant::now(), Some(p)));
        Ok(())
    }

    /// Gives sandbox `to` (a fork) the policy layer `from` has, if any:
    /// a fork runs on its parent's memory, so whatever the parent was kept
    /// from (an E2B sandbox without internet access, a `/v1` sandbox
    /// policy) the fork is kept from too, from its first instruction.
    pub fn inherit_sandbox(&self, tenant: &str, from: &str, to: &str) -> Result<(), String> {
        let text = self
            .store
            .sandbox_policy(from)
            .map_err(|e| format!("reading the policy of {from}: {e}"))?;
        match text {
            Some(text) => self.put_sandbox(tenant, to, &text, &format!("fork of {from}")),
            None => Ok(()),
        }
    }

    /// Checks and stores a sandbox policy; on error the old one stays.
    pub fn put_sandbox(
        &self,
        tenant: &str,
        sandbox: &str,
        text: &str,
        by: &str,
    ) -> Result<(), String> {
        let p = Arc::new(Policy::parse(text).map_err(|e| e.to_string())?);
        let t = self.tenant(tenant).map_err(|e| e.to_string())?;
        PolicySet::new(self.platform_for(Some(sandbox)), t, Some(p.clone()))
            .map_err(|e| e.to_string())?;
        self.store
            .put_sandbox_policy(tenant, sandbox, text, by)
            .map_err(|e| format!("storing policy: {e}"))?;
        Self::lock(&self.sandboxes)
            .insert(sandbox.to_owned(), (std::time::Instant::now(), Some(p)));
        Ok(())
    }
}

/// The security subsystem of a daemon.
pub struct Security {
    cfg: SecurityConfig,
    data_dir: PathBuf,
    store: Arc<SecurityStore>,
    policies: Arc<Policies>,
    approvals: Arc<ApprovalQueue>,
    audit: Arc<AuditLog>,
    limiter: RateLimiter,
    resolver: Mutex<Arc<dyn Resolver>>,
    proxies: Mutex<HashMap<String, Arc<Egress>>>,
    tunnels: Arc<HostTunnels>,
    egress_head_timeout: std::time::Duration,
    egress_tunnel_idle_timeout: std::time::Duration,
    /// TLS interception of connector hosts, when `egress_tls_intercept`.
    intercept: Option<Arc<strata_policy::proxy::Interception>>,
    /// Connector secrets, injected by every sandbox's proxy.
    secrets: Arc<secrets::Broker>,
    /// Where audited approvals and refusals are journaled (`events`).
    journal: std::sync::OnceLock<Arc<crate::events::JournalSink>>,
    /// Other processes share the store (a cluster): approvals and policy
    /// layers are read again from it ([`SHARED_APPROVAL_POLL`],
    /// [`SHARED_POLICY_TTL`]).
    shared: bool,
    /// An API-only process (`[cluster] role = "api"`): the creates it
    /// places are held, if at all, by the host they are sent to.
    api_only: bool,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("auth", &self.cfg.auth)
            .finish_non_exhaustive()
    }
}

/// The connector a template builder's egress goes through (its platform
/// layer only: `Policies::make_builder`).
pub const BUILD_CONNECTOR: &str = "strata-build-registries";

/// The built-in platform policy when no file is configured.
pub const DEFAULT_PLATFORM_POLICY: &str = "default = \"allow\"\n";

impl Security {
    /// Opens the security tables (in `config.db_path()`, migrated by the
    /// store; in PostgreSQL when `[store] url` is PostgreSQL), the audit log (`<data_dir>/audit.jsonl`, checked against the
    /// head recorded in the database) and the platform policy; makes the
    /// bootstrap admin token on first start.
    pub fn open(config: &Config) -> Result<Arc<Security>, SecurityError> {
        let cfg = config.security.clone();
        // Other processes write the same tables (docs/cluster.md).
        let shared = config.cluster.enabled;
        let api_only = shared && config.cluster.role == crate::cluster::Role::Api;
        let store = Arc::new(open_store(config)?);
        let platform = match &cfg.platform_policy {
            Some(p) => Policy::load(p)?,
            None => Policy::parse(DEFAULT_PLATFORM_POLICY)
                .map_err(strata_policy::policy::LoadError::Parse)?,
        };
        let platform_text = match &cfg.platform_policy {
            // Loaded just above; a builder's layer parses it again.
            Some(p) => std::fs::read_to_string(p).unwrap_or_default(),
            None => DEFAULT_PLATFORM_POLICY.to_owned(),
        };
        let deny = Policy::parse(&deny_all_toml("the stored policy layers do not compose"))
            .map_err(strata_policy::policy::LoadError::Parse)?;
        let fallback = PolicySet::new(Some(Arc::new(deny)), None, None)
            .map_err(|e| SecurityError::Compose(e.to_string()))?;
        let audit = Arc::new(open_audit(config)?);
        if let Some((seq, hash)) = store.audit_head()? {
            audit.verify(Some((seq, &hash)))?;
        }
        // Every write records the head, whoever appends (the egress proxies
        // included): a cut tail is detected at the next start.
        let st = store.clone();
        audit.set_head_sink(Box::new(move |seq, hash| {
            st.set_audit_head(seq, hash).map_err(|e| {
                let full = e.is_full();
                let msg = strata_runtime::error::chain(&e);
                if full {
                    format!("{STORE_FULL}: {msg}")
                } else {
                    msg
                }
            })
        }));
        spawn_audit_flusher(&audit);
        let approvals = ApprovalQueue::open(
            store.clone(),
            strata_policy::approval::ApprovalLimits {
                pending_ttl: cfg.approval_pending_ttl,
                approved_ttl: cfg.approval_ttl,
                max_pending_per_sandbox: cfg.max_pending_approvals_per_sandbox,
            },
        )?;
        let ranges = cfg
            .egress_resolved_ranges
            .iter()
            .map(|r| {
                strata_policy::policy::IpNet::parse(r).map_err(|e| {
                    SecurityError::Compose(format!("egress_resolved_ranges {r:?}: {e}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let resolver: Arc<dyn Resolver> = if !cfg.egress_static_hosts.is_empty() {
            Arc::new(StaticResolver(
                cfg.egress_static_hosts
                    .iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), *v))
                    .collect(),
            ))
        } else if !ranges.is_empty() {
            Arc::new(strata_policy::proxy::RangeResolver { ranges })
        } else {
            Arc::new(SystemResolver)
        };
        let policies = Arc::new(Policies {
            platform: Some(Arc::new(platform)),
            platform_text,
            builders: Mutex::new(HashMap::new()),
            store: store.clone(),
            tenants: Mutex::new(HashMap::new()),
            sandboxes: Mutex::new(HashMap::new()),
            fallback: Arc::new(fallback),
            ttl: shared.then_some(SHARED_POLICY_TTL),
        });
        let extra_roots = match &cfg.egress_upstream_ca_bundle {
            Some(p) => vec![std::fs::read(p)
                .map_err(|e| SecurityError::Intercept(format!("{}: {e}", p.display())))?],
            None => Vec::new(),
        };
        let mut broker = secrets::Broker::open(
            store.clone(),
            policies.clone(),
            &config.key_dir,
            resolver.clone(),
            &extra_roots,
            cfg.secrets_allow_private.clone(),
        )
        .map_err(|e| SecurityError::Compose(format!("connector secrets: {e}")))?;
        if shared {
            broker.set_shared_ttl(SHARED_POLICY_TTL);
        }
        let secrets = Arc::new(broker);
        let sec = Security {
            limiter: RateLimiter::new(cfg.rate_limit_per_second, cfg.rate_limit_burst),
            data_dir: config.data_dir.clone(),
            policies,
            secrets,
            store,
            approvals: Arc::new(approvals),
            audit,
            resolver: Mutex::new(resolver),
            proxies: Mutex::new(HashMap::new()),
            tunnels: HostTunnels::new(tunnel_limits(&config.egress)),
            egress_head_timeout: config.egress.head_timeout,
            egress_tunnel_idle_timeout: config.egress.tunnel_idle_timeout,
            intercept: intercept::interception(config)?,
            journal: std::sync::OnceLock::new(),
            shared,
            api_only,
            cfg,
        };
        let l = sec.tunnels.limits();
        tracing::info!(
            per_sandbox = l.per_sandbox,
            host = l.host,
            rate = l.rate,
            burst = l.burst,
            "egress tunnel caps"
        );
        if sec.cfg.auth {
            sec.bootstrap()?;
        }
        Ok(Arc::new(sec))
    }

    /// The configuration.
    pub fn config(&self) -> &SecurityConfig {
        &self.cfg
    }

    /// The security tables.
    pub fn store(&self) -> &Arc<SecurityStore> {
        &self.store
    }

    /// Parsed policies.
    pub fn policies(&self) -> &Arc<Policies> {
        &self.policies
    }

    /// The connector secrets broker (`docs/secrets.md`).
    pub fn secrets(&self) -> &Arc<secrets::Broker> {
        &self.secrets
    }

    /// The approval queue.
    pub fn approvals(&self) -> &Arc<ApprovalQueue> {
        &self.approvals
    }

    /// Whether other processes share the security store (a cluster): the
    /// approval queue is then brought up to date from it before it is read.
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// The audit log file.
    pub fn audit_path(&self) -> &Path {
        self.audit.path()
    }

    /// The per-token rate limiter.
    pub fn limiter(&self) -> &RateLimiter {
        &self.limiter
    }

    /// Where the bootstrap admin token is written.
    pub fn bootstrap_token_path(&self) -> PathBuf {
        self.data_dir.join("admin.token")
    }

    /// After `rec` was revoked: if it is the bootstrap token and
    /// `<data_dir>/admin.token` still holds it, the file goes (a revoked
    /// secret is not left on disk, and the CLI stops picking it up). A file
    /// holding anything else is left alone.
    pub fn forget_bootstrap_file(&self, rec: &TokenRecord) {
        if rec.created_by.as_deref() != Some("bootstrap") || rec.revoked_at.is_none() {
            return;
        }
        let path = self.bootstrap_token_path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        if auth::hash_secret(text.trim()) != rec.hash {
            return;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!(
                path = %path.display(),
                token_id = %rec.id,
                "bootstrap admin token revoked: its file is removed"
            ),
            Err(e) => tracing::warn!(
                path = %path.display(),
                error = %e,
                "bootstrap admin token revoked, but its file could not be removed"
            ),
        }
    }

    /// On first start (no token was ever made): an admin token of tenant
    /// `default`, written to `<data_dir>/admin.token` with mode 0600.
    fn bootstrap(&self) -> Result<(), SecurityError> {
        if self.store.token_count()? > 0 {
            return Ok(());
        }
        let path = self.bootstrap_token_path();
        let issued = Self::make_token(NewToken {
            tenant: DEFAULT_TENANT,
            role: Role::Admin,
            name: Some("bootstrap".into()),
            expires_at: None,
            by: "bootstrap",
        });
        let io = |source| SecurityError::Bootstrap {
            path: path.clone(),
            source,
        };
        let tmp = path.with_extension("token.tmp");
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io)?;
            f.write_all(format!("{}\n", issued.token).as_bytes())
                .map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &path).map_err(io)?;
        self.store.insert_token(&issued.record)?;
        tracing::info!(
            path = %path.display(),
            token_id = %issued.record.id,
            "bootstrap admin token written (mode 0600); read it once, then make tokens with POST /v1/tokens"
        );
        Ok(())
    }

    fn make_token(t: NewToken<'_>) -> IssuedToken {
        let (id, secret) = auth::new_token();
        IssuedToken {
            record: TokenRecord {
                id,
                tenant: t.tenant.to_owned(),
                role: t.role,
                name: t.name,
                created_at: Utc::now(),
                created_by: Some(t.by.to_owned()),
                expires_at: t.expires_at,
                revoked_at: None,
                hash: auth::hash_secret(&secret),
            },
            e2b_key: auth::e2b_key(&secret),
            token: secret,
        }
    }

    /// Makes and stores a token.
    pub fn issue_token(&self, t: NewToken<'_>) -> Result<IssuedToken, SecStoreError> {
        let t = Self::make_token(t);
        self.store.insert_token(&t.record)?;
        Ok(t)
    }

    /// The caller of a request with this `Authorization` header value.
    pub fn authenticate(&self, header: Option<&str>) -> Result<Principal, AuthFailure> {
        if !self.cfg.auth {
            return Ok(Principal {
                token_id: "anonymous".into(),
                tenant: DEFAULT_TENANT.into(),
                role: Role::Admin,
                name: None,
            });
        }
        let h = header.ok_or(AuthFailure::Missing)?;
        let secret = auth::bearer(h).ok_or(AuthFailure::Malformed)?;
        let t = self
            .store
            .token_by_hash(&auth::hash_secret(secret))
            .map_err(|e| {
                tracing::error!(error = %e, "token lookup failed");
                AuthFailure::Unknown
            })?
            .ok_or(AuthFailure::Unknown)?;
        if t.revoked_at.is_some() {
            return Err(AuthFailure::Revoked);
        }
        if t.expires_at.is_some_and(|e| e <= Utc::now()) {
            return Err(AuthFailure::Expired);
        }
        Ok(Principal {
            token_id: t.id,
            tenant: t.tenant,
            role: t.role,
            name: t.name,
        })
    }

    /// Whether an API caller's credential still holds (a stored caller, such
    /// as the one an E2B envd token was handed to, outlives its request): a
    /// strata token must still exist in its tenant, unrevoked and unexpired.
    /// Configured keys and the anonymous caller of `auth = false` hold.
    pub fn credential_holds(&self, caller: &crate::caller::Caller) -> Result<bool, SecStoreError> {
        let crate::caller::Caller::Api { tenant, token, .. } = caller else {
            return Ok(true);
        };
        if !token.starts_with("tok-") {
            return Ok(true);
        }
        Ok(match self.store.token(tenant, token)? {
            Some(t) => t.revoked_at.is_none() && t.expires_at.is_none_or(|e| e > Utc::now()),
            None => false,
        })
    }

    /// Evaluates a call against the layers in force.
    pub fn evaluate(&self, call: &ToolCall) -> Decision {
        self.policies
            .set(&call.tenant, call.sandbox.as_deref())
            .evaluate(call)
    }

    /// Appends a decision of the API to the audit log (on disk, with its
    /// head in the database, when it returns). Each is written: API callers
    /// are rate-limited per token; the aggregation of repeated denials and
    /// the per-sandbox write budget apply to the egress proxies' decisions,
    /// which a guest can make at will (`AuditLog::record`).
    pub fn record(
        &self,
        call: &ToolCall,
        decision: &Decision,
        outcome: Outcome,
        approval_id: Option<String>,
        by: Option<String>,
    ) -> Result<(), gate::GateRefusal> {
        let req = match (&approval_id, self.journal.get()) {
            (Some(id), Some(_)) => self.approvals.get(&call.tenant, id).ok(),
            _ => None,
        };
        let by_journal = by.clone();
        self.audit
            .append(
                call,
                AuditDecision::from_decision(decision, outcome, approval_id),
                by,
            )
            .map(|_| ())
            .map_err(|e| {
                let full = match &e {
                    audit::AuditError::Io { source, .. } => {
                        source.raw_os_error() == Some(libc::ENOSPC)
                    }
                    audit::AuditError::Head(m) => m.starts_with(STORE_FULL),
                    _ => false,
                };
                let msg = format!("audit log: {}", strata_runtime::error::chain(&e));
                if full {
                    gate::GateRefusal::Full(msg)
                } else {
                    gate::GateRefusal::Internal(msg)
                }
            })?;
        if let Some(sink) = self.journal.get() {
            sink.decided(call, decision, outcome, req.as_ref(), by_journal.as_deref());
        }
        Ok(())
    }

    /// Journals every audited approval and refusal from now on (once).
    pub fn set_journal(&self, sink: Arc<crate::events::JournalSink>) {
        let _ = self.journal.set(sink);
    }

    /// The audit log.
    pub fn audit(&self) -> &Arc<AuditLog> {
        &self.audit
    }

    /// Verifies the audit chain (under the audit key and the keyed chain's
    /// recorded start) and that it still reaches the recorded head.
    pub fn verify_audit(&self) -> Result<audit::Verified, audit::AuditError> {
        let head = self
            .store
            .audit_head()
            .map_err(|e| audit::AuditError::Head(e.to_string()))?;
        self.audit
            .verify(head.as_ref().map(|(s, h)| (*s, h.as_str())))
    }

    /// Replaces the resolver of egress proxies started from now on.
    pub fn set_egress_resolver(&self, r: Arc<dyn Resolver>) {
        self.secrets.set_resolver(r.clone());
        *self.resolver.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    /// The egress proxy of a sandbox (made on first use): served
    /// in-process on the streams its guest's tunnels carry, with no
    /// listener. Its caps share the host's counters.
    pub fn egress_proxy(&self, guest: &crate::caller::Caller) -> std::io::Result<Arc<Egress>> {
        let crate::caller::Caller::Guest { sandbox, tenant } = guest else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an egress proxy serves a guest caller",
            ));
        };
        let (tenant, sandbox) = (tenant.as_str(), sandbox.as_str());
        let mut g = self.proxies.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = g.get(sandbox) {
            return Ok(p.clone());
        }
        let policies = self.policies.clone();
        let (t, s) = (tenant.to_owned(), sandbox.to_owned());
        let source: Arc<dyn PolicySource> = Arc::new(move || policies.set(&t, Some(s.as_str())));
        let mut pc = ProxyConfig::new(tenant, Some(sandbox), source);
        pc.actor = guest.actor();
        pc.resolver = self
            .resolver
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        pc.approvals = Some(self.approvals.clone());
        pc.approval_timeout = self.cfg.approval_timeout;
        pc.audit = Some(self.audit.clone());
        pc.host = self.tunnels.clone();
        pc.head_timeout = self.egress_head_timeout;
        pc.tunnel_idle_timeout = self.egress_tunnel_idle_timeout;
        pc.intercept = self.intercept.clone();
        pc.request_hook = Some(self.secrets.clone());
        pc.mcp = Some(strata_policy::proxy::mcp::McpGateway::new(
            strata_policy::proxy::mcp::McpLimits {
                tenant_stdio: self.cfg.mcp_tenant_stdio,
                tenant_private_urls: self.cfg.mcp_tenant_private_urls,
                ..Default::default()
            },
        ));
        let proxy = Egress::new(pc);
        tracing::info!(sandbox, "egress proxy ready (in-process)");
        g.insert(sandbox.to_owned(), proxy.clone());
        Ok(proxy)
    }

    /// What the runtime serves a sandbox's tunnels with: each becomes a
    /// stream into the sandbox's proxy, or is refused under the caps.
    pub fn tunnel_handler(&self, guest: &crate::caller::Caller) -> std::io::Result<TunnelHandler> {
        self.tunnel_handler_noting(guest, None)
    }

    /// [`Security::tunnel_handler`], calling `note` at every tunnel
    /// open and every read or write of its stream (the daemon records
    /// egress as activity of the sandbox: `service::unchanged`).
    pub fn tunnel_handler_noting(
        &self,
        guest: &crate::caller::Caller,
        note: Option<TunnelNote>,
    ) -> std::io::Result<TunnelHandler> {
        Ok(TunnelHandler::new(Arc::new(SandboxTunnels(
            self.egress_proxy(guest)?,
            note,
        ))))
    }

    /// Stops a sandbox's egress proxy (on delete): no new streams; the
    /// streams it serves end with their tunnels.
    pub async fn stop_egress_proxy(&self, sandbox: &str) {
        self.forget_egress_proxy(sandbox);
    }

    /// [`Security::stop_egress_proxy`], callable from a sync hook
    /// ([`crate::service::Service::on_deleted`]): the proxy is forgotten and
    /// its MCP gateway's stdio servers are killed.
    pub fn forget_egress_proxy(&self, sandbox: &str) {
        let p = self
            .proxies
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sandbox);
        // Its stdio MCP servers stop now, not when the last stream ends.
        if let Some(g) = p.as_ref().and_then(|p| p.config().mcp.as_ref()) {
            g.stop();
        }
    }
}

/// The caps `[egress]` asks for, the host's lowered to what the process's
/// descriptor limit leaves after the reserve.
pub fn tunnel_limits(c: &crate::config::EgressConfig) -> TunnelLimits {
    let mut host = c.max_tunnels_host;
    if let Some(nofile) = crate::daemon::nofile_limit() {
        let room = usize::try_from(nofile)
            .unwrap_or(usize::MAX)
            .saturating_sub(c.fd_reserve);
        if room < host {
            tracing::warn!(
                nofile,
                reserve = c.fd_reserve,
                configured = host,
                effective = room.max(1),
                "RLIMIT_NOFILE leaves less room than max_tunnels_host; lowering it"
            );
            host = room;
        }
    }
    TunnelLimits {
        per_sandbox: c.max_tunnels_per_sandbox.max(1),
        host: host.max(1),
        rate: c.open_rate_per_second.max(0.0),
        burst: c.open_burst.max(1),
    }
}

/// Called at each egress event of one sandbox (must be cheap).
pub type TunnelNote = Arc<dyn Fn() + Send + Sync>;

/// A sandbox's proxy as the agent client's tunnel service.
struct SandboxTunnels(Arc<Egress>, Option<TunnelNote>);

/// A tunnel's stream that notes each read and write.
struct Noted {
    inner: TunnelStream,
    note: TunnelNote,
}

impl tokio::io::AsyncRead for Noted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if r.is_ready() {
            (self.note)();
        }
        r
    }
}

impl tokio::io::AsyncWrite for Noted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if r.is_ready() {
            (self.note)();
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl TunnelService for SandboxTunnels {
    fn open(&self, peer: &str) -> OpenFuture {
        if let Some(n) = &self.1 {
            n();
        }
        let note = self.1.clone();
        let r = self.0.open_stream().map_err(|why| {
            // Debug: a guest decides how often this happens; the counts
            // are in `GET /v1/sandboxes/{id}/egress`.
            tracing::debug!(sandbox = ?self.0.config().sandbox, peer = %strata_core::text::Escaped(peer), why = %strata_core::text::Escaped(&why.to_string()), "egress tunnel refused");
            why.to_string()
        });
        Box::pin(async move {
            r.map(|s| {
                let s = Box::new(s) as TunnelStream;
                match note {
                    Some(note) => Box::new(Noted { inner: s, note }) as TunnelStream,
                    None => s,
                }
            })
        })
    }

    fn describe(&self) -> String {
        format!(
            "egress proxy of {}",
            self.0.config().sandbox.as_deref().unwrap_or("-")
        )
    }
}

/// The guest side of the egress proxy: the guest agent listens here and
/// tunnels every connection over the agent channel to the sandbox's proxy
/// on the host; commands run through the agent get it as `http_proxy`.
pub const GUEST_PROXY: &str = "127.0.0.1:3128";

/// Where the start of `data_dir`'s keyed audit chain is recorded: in the
/// key dir, out of reach of whoever can only write the data dir (one file
/// per data dir, so daemons sharing a key dir do not collide).
pub fn chain_start_path(key_dir: &Path, data_dir: &Path) -> PathBuf {
    use sha2::{Digest, Sha256};
    let dir = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let id = Sha256::digest(dir.as_os_str().as_encoded_bytes());
    key_dir.join(format!("audit-chain-{}.json", &hex::encode(id)[..16]))
}

/// Opens `<data_dir>/audit.jsonl`, keyed with the key store's
/// [`keys::Purpose::AuditChain`] key when the key store is usable. On the
/// first keyed open the chain's start (the end of the unkeyed entries so
/// far) is recorded beside the key; later opens hold the log to it, so a
/// log rewritten in the unkeyed form is refused.
/// The security store on the backend `[store] url` names: the SQLite file
/// (unchanged), or PostgreSQL, where this daemon's audit head is the row
/// of its audit log id ([`audit_log_id`]).
fn open_store(config: &Config) -> Result<SecurityStore, SecurityError> {
    match config
        .store_location()
        .map_err(|e| SecurityError::Compose(e.to_string()))?
    {
        crate::config::StoreLocation::Sqlite(path) => Ok(SecurityStore::open(&path)?),
        crate::config::StoreLocation::Postgres(url) => {
            let log = audit_log_id(&config.data_dir)?;
            let pg = store::PgSecurity::open(
                &crate::store::PgOptions {
                    url,
                    schema: config.store.schema.clone(),
                    // Its own pool beside the main store's: a few suffice.
                    pool_size: config.store.pool_size.clamp(1, 4),
                    timeout: config.store.timeout,
                },
                &log,
            )?;
            Ok(SecurityStore::with_backend(Box::new(pg)))
        }
    }
}

/// The file holding this data dir's audit log id.
pub const AUDIT_LOG_ID_FILE: &str = "audit-log.id";

/// This data dir's audit log id (`<data_dir>/audit-log.id`, 32 random hex
/// digits made on first use, 0600): the key of its audit head when the
/// security store is shared (PostgreSQL), so every daemon's own
/// `audit.jsonl` is checked against its own head.
pub fn audit_log_id(data_dir: &Path) -> Result<String, SecurityError> {
    let path = data_dir.join(AUDIT_LOG_ID_FILE);
    let bad = |why: String| SecurityError::Compose(format!("{}: {why}", path.display()));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(id.to_owned())
            } else {
                Err(bad("not an audit log id (32 hex digits)".into()))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = format!("{:032x}", rand::random::<u128>());
            write_private(&path, id.as_bytes()).map_err(|e| bad(e.to_string()))?;
            Ok(id)
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

fn open_audit(config: &Config) -> Result<AuditLog, SecurityError> {
    let path = config.data_dir.join("audit.jsonl");
    let key = match keys::KeyStore::open(&config.key_dir)
        .and_then(|k| k.hmac_key(keys::Purpose::AuditChain))
    {
        Ok(k) => Some(k),
        Err(e) => {
            tracing::error!(
                error = %e,
                "the audit chain is NOT keyed: the key store is unusable, so new audit entries use the unkeyed chain (whoever can write the data dir can rewrite them); fix the key dir and restart"
            );
            None
        }
    };
    let marker = chain_start_path(&config.key_dir, &config.data_dir);
    let bad = |why: String| SecurityError::ChainStart {
        path: marker.clone(),
        why,
    };
    let start: Option<ChainStart> = match (&key, std::fs::read(&marker)) {
        (None, _) => None,
        (Some(_), Ok(b)) => Some(serde_json::from_slice(&b).map_err(|e| bad(e.to_string()))?),
        (Some(_), Err(e)) if e.kind() == std::io::ErrorKind::NotFound => None,
        (Some(_), Err(e)) => return Err(bad(e.to_string())),
    };
    let recorded = start.is_some();
    let log = AuditLog::open_with(
        &path,
        AuditOptions {
            key,
            start,
            limits: Some(AuditLimits::default()),
        },
    )?;
    if let (false, Some(st)) = (recorded, log.chain_start()) {
        write_private(
            &marker,
            &serde_json::to_vec(st).map_err(|e| bad(e.to_string()))?,
        )
        .map_err(|e| bad(e.to_string()))?;
        tracing::info!(
            unkeyed_entries = st.legacy_seq,
            marker = %marker.display(),
            "audit chain keyed from here on"
        );
    }
    Ok(log)
}

/// Writes `bytes` to `path` (mode 0600) through a temporary file and a rename.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("json.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Writes the audit log's due aggregates about once a second, until the
/// log is dropped.
fn spawn_audit_flusher(audit: &Arc<AuditLog>) {
    let weak = Arc::downgrade(audit);
    let spawned = std::thread::Builder::new()
        .name("audit-flush".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            let Some(a) = weak.upgrade() else { break };
            if let Err(e) = a.flush() {
                tracing::error!(error = %e, "audit log: writing aggregated denials");
            }
        });
    if let Err(e) = spawned {
        // Aggregates are still written by the next decision and at close.
        tracing::error!(error = %e, "audit flusher thread");
    }
}

#[cfg(test)]
mod builder_tests {
    use strata_policy::{CallKind, Effect, ToolCall};

    use super::*;

    fn call(sandbox: &str, kind: CallKind) -> ToolCall {
        ToolCall {
            tenant: "acme".into(),
            sandbox: Some(sandbox.into()),
            actor: format!("sandbox:{sandbox}"),
            kind,
        }
    }

    fn egress(host: &str) -> CallKind {
        CallKind::Egress {
            connector: None,
            host: host.into(),
            port: 443,
            method: "CONNECT".into(),
            path: String::new(),
            scheme: "https".into(),
            tls: false,
        }
    }

    /// A builder knows the registries' connector and reaches only them; no
    /// other sandbox knows it; once its build is over (or the daemon
    /// restarted) its layer still composes, so it can be deleted.
    #[test]
    fn only_a_builder_reaches_the_registries_and_its_layer_outlives_the_build() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config {
            data_dir: dir.path().to_owned(),
            ..Config::default()
        };
        // The store migrates the database the security tables live in.
        let _store = crate::store::SqliteStore::open(&cfg.db_path(), 1).unwrap();
        let sec = Security::open(&cfg).unwrap();
        let p = sec.policies();
        p.make_builder("acme", "sb-builder", &["pypi.org".into()], "test")
            .unwrap();
        let set = p.set("acme", Some("sb-builder"));
        assert!(set.connector_for_host("pypi.org").is_some());
        assert_eq!(
            set.evaluate(&call("sb-builder", egress("pypi.org"))).effect,
            Effect::Allow
        );
        // Another sandbox of the tenant: no such connector.
        assert!(p
            .set("acme", Some("sb-other"))
            .connector_for_host("pypi.org")
            .is_none());
        // The build ends: no connector, and the layer still composes (a
        // delete is decided by the normal policy, not the deny-all fallback).
        p.end_builder("sb-builder");
        let set = p.set("acme", Some("sb-builder"));
        assert!(set.connector_for_host("pypi.org").is_none());
        let d = set.evaluate(&call(
            "sb-builder",
            CallKind::Lifecycle {
                op: "delete".into(),
            },
        ));
        assert_eq!(d.effect, Effect::Allow, "{d:?}");
        assert_ne!(d.rule_id, INVALID_POLICY_RULE);
    }

    /// Two processes on one store with `[cluster] enabled` (as a cluster's
    /// hosts and API processes share PostgreSQL): a connector secret set,
    /// rotated or deleted through one is what the other injects within
    /// [`SHARED_POLICY_TTL`], without a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_secret_written_through_another_process_is_injected_here_within_the_ttl() {
        use strata_policy::proxy::RequestHook;
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config {
            data_dir: dir.path().to_owned(),
            ..Config::default()
        };
        cfg.cluster.enabled = true;
        let _store = crate::store::SqliteStore::open(&cfg.db_path(), 1).unwrap();
        let a = Security::open(&cfg).unwrap();
        let b = Security::open(&cfg).unwrap();
        let policy =
            "default = \"deny\"\n[[connector]]\nname = \"crm\"\nhosts = [\"api.crm.test\"]\n";
        a.policies().put_tenant("acme", policy, "test").unwrap();
        let put = |v: &str| -> secrets::SetSecret {
            serde_json::from_value(serde_json::json!({
                "name": "crm-key", "connector": "crm",
                "rule": {"type": "bearer"}, "value": v,
            }))
            .unwrap()
        };
        // b reads the tenant's (empty) secrets before a writes one.
        assert_eq!(
            b.secrets()
                .secret_value("acme", "crm", "crm-key")
                .await
                .unwrap(),
            None
        );
        a.secrets().set("acme", "test", put("v1")).await.unwrap();
        let seen = |want: Option<&'static str>| {
            let b = b.clone();
            async move {
                let t0 = std::time::Instant::now();
                loop {
                    let got = b
                        .secrets()
                        .secret_value("acme", "crm", "crm-key")
                        .await
                        .unwrap();
                    if got.as_deref() == want {
                        return t0.elapsed();
                    }
                    assert!(
                        t0.elapsed() < SHARED_POLICY_TTL * 3,
                        "still {got:?} after {:?}, want {want:?}",
                        t0.elapsed()
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        };
        let set_in = seen(Some("v1")).await;
        a.secrets().set("acme", "test", put("v2")).await.unwrap();
        let rotated_in = seen(Some("v2")).await;
        a.secrets().delete("acme", "crm-key").unwrap();
        let deleted_in = seen(None).await;
        println!(
            "REPORT set seen after {set_in:?}, rotation {rotated_in:?}, deletion {deleted_in:?}"
        );
    }
}
