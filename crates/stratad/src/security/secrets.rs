//! Connector secrets brokered by the egress proxy (`docs/secrets.md`).
//!
//! A tenant's admin writes a secret (`POST /v1/secrets`): a name, the
//! connector it is bound to (one of the tenant's policy's connectors, by
//! name) and either an injection rule with a value (`bearer`, `header`,
//! `basic`, `query`) or kind `oauth2` (token URL, client id and secret,
//! refresh token). The material is sealed by the key store
//! ([`Purpose::ConnectorSecret`], bound to `<tenant>/<name>`) and never
//! returned; writing the name again rotates it.
//!
//! The [`Broker`] is every sandbox proxy's [`RequestHook`]: on a request
//! the policy allowed to a connector's host (plain HTTP, or HTTPS under
//! interception), the secrets of the sandbox's tenant bound to that
//! connector (and admitted by the connector's `secrets` list, when the
//! policy gives one) are put on it; the audit entry names them. OAuth2
//! access tokens are obtained and cached by the broker: refreshed when
//! less than [`REFRESH_MARGIN`] of their life is left, and once after the
//! upstream answers `401` to one. The token URL must pass the egress
//! proxy's public-address filter (or `[security] secrets_allow_private`,
//! test-only) and present a certificate that verifies against the system
//! roots plus `egress_upstream_ca_bundle`.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use strata_policy::call::{CallKind, ToolCall};
use strata_policy::proxy::{HookFuture, Injected, RequestHook, Resolver, SecretFuture};
use strata_policy::secrets::{self, Injection};

use super::keys::{KeyStore, Purpose, Sealer};
use super::store::{SecretRow, SecurityStore};
use super::Policies;

/// An access token with less than this left is refreshed before use.
pub const REFRESH_MARGIN: Duration = Duration::from_secs(30);
/// Longest secret value (and OAuth2 field).
pub const MAX_VALUE: usize = 8 * 1024;
/// Most secrets per tenant.
pub const MAX_PER_TENANT: usize = 256;
/// How long a token request may take.
const TOKEN_TIMEOUT: Duration = Duration::from_secs(15);

/// What a secret is, as stored beside its sealed material (no secret in it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Spec {
    /// A fixed value put on requests by `rule`.
    Static {
        /// How it is put on a request.
        rule: Injection,
    },
    /// OAuth2 refresh-token grant: the broker injects access tokens
    /// (`Authorization: Bearer`).
    Oauth2 {
        /// The token endpoint (`https`).
        token_url: String,
        /// The client id (not secret).
        client_id: String,
        /// Scopes asked for, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scope: Option<String>,
    },
}

impl Spec {
    fn kind(&self) -> &'static str {
        match self {
            Spec::Static { .. } => "static",
            Spec::Oauth2 { .. } => "oauth2",
        }
    }
}

/// The sealed part.
#[derive(Default, Serialize, Deserialize)]
struct Material {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    client_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    refresh_token: Option<String>,
}

/// `POST /v1/secrets` body.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetSecret {
    /// Name (1-64 of `[A-Za-z0-9_.-]`).
    pub name: String,
    /// The connector (by name) it is injected for.
    pub connector: String,
    /// `static` (default) or `oauth2`.
    #[serde(default)]
    pub kind: Option<String>,
    /// The injection rule of a static secret.
    #[serde(default)]
    pub rule: Option<Injection>,
    /// The value of a static secret.
    #[serde(default)]
    pub value: Option<String>,
    /// The grant of an OAuth2 secret.
    #[serde(default)]
    pub oauth2: Option<OAuth2Input>,
}

/// The `oauth2` object of a [`SetSecret`].
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuth2Input {
    /// Token endpoint.
    pub token_url: String,
    /// Client id.
    pub client_id: String,
    /// Client secret.
    #[serde(default)]
    pub client_secret: Option<String>,
    /// Refresh token.
    pub refresh_token: String,
    /// Scopes.
    #[serde(default)]
    pub scope: Option<String>,
}

/// A secret as listed (never its value).
#[derive(Debug, Clone, Serialize)]
pub struct SecretView {
    /// Name.
    pub name: String,
    /// Connector.
    pub connector: String,
    /// `static` or `oauth2`.
    pub kind: String,
    /// The injection rule (`bearer` for OAuth2).
    pub rule: Injection,
    /// OAuth2 token endpoint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_url: Option<String>,
    /// OAuth2 client id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// When first written.
    pub created_at: DateTime<Utc>,
    /// When last written.
    pub updated_at: DateTime<Utc>,
    /// Who wrote it last.
    pub updated_by: Option<String>,
}

/// Why a secret could not be written, listed or used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Bad input (`400 invalid_request`).
    #[error("{0}")]
    Invalid(String),
    /// No such secret in the tenant (`404`).
    #[error("secret {0} not found")]
    NotFound(String),
    /// Too many secrets (`403 quota_exceeded`).
    #[error("{0}")]
    Quota(String),
    /// The key store is unusable: secrets can be neither sealed nor opened.
    #[error("key store: {0}")]
    Keys(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] super::store::SecStoreError),
}

/// One secret in memory (its material still sealed).
#[derive(Clone)]
struct Entry {
    name: String,
    connector: String,
    spec: Spec,
    sealed: String,
}

/// A cached OAuth2 access token.
#[derive(Default)]
struct Token {
    access: Option<String>,
    expires: Option<Instant>,
    /// Bumped at every refresh (a `401` refreshes only the token it saw).
    generation: u64,
    /// Set by a `401`: refresh before the next use.
    stale: bool,
}

/// A tenant's secrets as cached: when they were read, and they.
type Cached = (std::time::Instant, Arc<Vec<Entry>>);

/// The secrets broker: the proxies' [`RequestHook`].
pub struct Broker {
    store: Arc<SecurityStore>,
    policies: Arc<Policies>,
    sealer: Result<Sealer, String>,
    /// tenant → when its secrets were read, and they.
    cache: RwLock<HashMap<String, Cached>>,
    /// How long a tenant's cached secrets are trusted (`None`: until this
    /// process writes them; the store is its alone). With a shared store
    /// (a cluster's PostgreSQL) a secret written, replaced or deleted
    /// through another process is in force here within this time.
    ttl: Option<std::time::Duration>,
    /// `<tenant>/<name>` → its access token.
    tokens: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Token>>>>,
    resolver: Mutex<Arc<dyn Resolver>>,
    roots: Vec<reqwest::Certificate>,
    allow_private: Vec<String>,
    refreshes: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

fn bound(tenant: &str, name: &str) -> String {
    format!("{tenant}/{name}")
}

fn entry(r: &SecretRow) -> Option<Entry> {
    match serde_json::from_str::<Spec>(&r.rule) {
        Ok(spec) => Some(Entry {
            name: r.name.clone(),
            connector: r.connector.clone(),
            spec,
            sealed: r.sealed.clone(),
        }),
        Err(e) => {
            tracing::error!(tenant = %r.tenant, secret = %r.name, error = %e, "connector secret with an unreadable rule: not injected");
            None
        }
    }
}

fn view(r: &SecretRow) -> Option<SecretView> {
    let e = entry(r)?;
    let (rule, token_url, client_id) = match e.spec {
        Spec::Static { rule } => (rule, None, None),
        Spec::Oauth2 {
            token_url,
            client_id,
            ..
        } => (Injection::Bearer, Some(token_url), Some(client_id)),
    };
    Some(SecretView {
        name: r.name.clone(),
        connector: r.connector.clone(),
        kind: r.kind.clone(),
        rule,
        token_url,
        client_id,
        created_at: r.created_at,
        updated_at: r.updated_at,
        updated_by: r.updated_by.clone(),
    })
}

fn check_value(what: &str, v: &str) -> Result<(), SecretError> {
    if v.is_empty() || v.len() > MAX_VALUE {
        return Err(SecretError::Invalid(format!(
            "{what}: 1 to {MAX_VALUE} bytes"
        )));
    }
    if v.chars().any(char::is_control) {
        return Err(SecretError::Invalid(format!(
            "{what}: no control characters (it must fit in an HTTP header)"
        )));
    }
    Ok(())
}

impl Broker {
    /// The broker over `store`'s secrets, sealed by the key store in
    /// `key_dir`; OAuth2 token URLs verified against the system roots plus
    /// `extra_roots` (PEM certificates).
    pub fn open(
        store: Arc<SecurityStore>,
        policies: Arc<Policies>,
        key_dir: &std::path::Path,
        resolver: Arc<dyn Resolver>,
        extra_roots: &[Vec<u8>],
        allow_private: Vec<String>,
    ) -> Result<Broker, SecretError> {
        let sealer = KeyStore::open(key_dir)
            .and_then(|k| k.sealer(Purpose::ConnectorSecret))
            .map_err(|e| e.to_string());
        if let Err(e) = &sealer {
            tracing::error!(error = %e, "connector secrets unavailable: the key store is unusable");
        }
        let mut roots = Vec::new();
        for pem in extra_roots {
            roots.extend(
                reqwest::Certificate::from_pem_bundle(pem)
                    .map_err(|e| SecretError::Invalid(format!("upstream CA bundle: {e}")))?,
            );
        }
        let b = Broker {
            store,
            policies,
            sealer,
            cache: RwLock::new(HashMap::new()),
            ttl: None,
            tokens: Mutex::new(HashMap::new()),
            resolver: Mutex::new(resolver),
            roots,
            allow_private,
            refreshes: std::sync::atomic::AtomicU64::new(0),
        };
        b.reload(None)?;
        Ok(b)
    }

    /// Trusts cached secrets for `ttl` only: for a store other processes
    /// write too (a cluster), so that a secret put, rotated or deleted
    /// through any of them is injected (or no longer) here within `ttl`.
    pub fn set_shared_ttl(&mut self, ttl: std::time::Duration) {
        self.ttl = Some(ttl);
    }

    /// Replaces the resolver token URLs are resolved with.
    pub fn set_resolver(&self, r: Arc<dyn Resolver>) {
        *self.resolver.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    /// OAuth2 token refreshes made since the start.
    pub fn refreshes(&self) -> u64 {
        self.refreshes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the secrets of `tenant` (every tenant's when `None`) into memory.
    fn reload(&self, tenant: Option<&str>) -> Result<(), SecretError> {
        let rows = self.store.secrets(tenant)?;
        let mut by: HashMap<String, Vec<Entry>> = HashMap::new();
        if let Some(t) = tenant {
            by.insert(t.to_owned(), Vec::new());
        }
        for r in &rows {
            if let Some(e) = entry(r) {
                by.entry(r.tenant.clone()).or_default().push(e);
            }
        }
        let now = std::time::Instant::now();
        let mut c = self.cache.write().unwrap_or_else(|p| p.into_inner());
        for (t, v) in by {
            c.insert(t, (now, Arc::new(v)));
        }
        Ok(())
    }

    fn of_tenant(&self, tenant: &str) -> Arc<Vec<Entry>> {
        let cached = self
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
            .cloned();
        let Some(ttl) = self.ttl else {
            return cached.map(|(_, v)| v).unwrap_or_default();
        };
        if let Some((at, v)) = &cached {
            if at.elapsed() < ttl {
                return v.clone();
            }
        }
        // Shared store, stale or never read: read again. Unreadable: none
        // injected (a secret deleted elsewhere must not go on being used
        // because the store cannot say so).
        if let Err(e) = self.reload(Some(tenant)) {
            tracing::warn!(tenant, error = %e, "connector secrets cannot be read again: none injected");
            return Arc::default();
        }
        self.cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    fn sealer(&self) -> Result<&Sealer, SecretError> {
        self.sealer
            .as_ref()
            .map_err(|e| SecretError::Keys(e.clone()))
    }

    /// The tenant's secrets, by name (never a value).
    pub fn list(&self, tenant: &str) -> Result<Vec<SecretView>, SecretError> {
        Ok(self
            .store
            .secrets(Some(tenant))?
            .iter()
            .filter_map(view)
            .collect())
    }

    /// Writes (or rotates) a secret of `tenant`; `by` is recorded.
    pub async fn set(
        &self,
        tenant: &str,
        by: &str,
        cmd: SetSecret,
    ) -> Result<SecretView, SecretError> {
        secrets::check_name(&cmd.name).map_err(|e| SecretError::Invalid(e.0))?;
        let set = self.policies.set(tenant, None);
        if !set.connectors().any(|(_, c)| c.name == cmd.connector) {
            return Err(SecretError::Invalid(format!(
                "connector {:?}: the tenant's policy declares no connector of that name (`strata connector ls`)",
                cmd.connector
            )));
        }
        let kind = cmd.kind.as_deref().unwrap_or(if cmd.oauth2.is_some() {
            "oauth2"
        } else {
            "static"
        });
        let (spec, material) = match kind {
            "static" => {
                if cmd.oauth2.is_some() {
                    return Err(SecretError::Invalid(
                        "oauth2: only for kind `oauth2`".into(),
                    ));
                }
                let rule = cmd.rule.ok_or_else(|| {
                    SecretError::Invalid(
                        "rule: required (bearer, header, basic or query), e.g. {\"type\":\"bearer\"}"
                            .into(),
                    )
                })?;
                rule.check()
                    .map_err(|e| SecretError::Invalid(format!("rule: {e}")))?;
                let value = cmd
                    .value
                    .ok_or_else(|| SecretError::Invalid("value: required".into()))?;
                check_value("value", &value)?;
                (
                    Spec::Static { rule },
                    Material {
                        value: Some(value),
                        ..Material::default()
                    },
                )
            }
            "oauth2" => {
                if cmd.rule.is_some() || cmd.value.is_some() {
                    return Err(SecretError::Invalid(
                        "rule, value: not for kind `oauth2` (the proxy injects `Authorization: Bearer <access token>`)".into(),
                    ));
                }
                let o = cmd
                    .oauth2
                    .ok_or_else(|| SecretError::Invalid("oauth2: required for kind `oauth2` (token_url, client_id, client_secret, refresh_token)".into()))?;
                check_value("oauth2.client_id", &o.client_id)?;
                check_value("oauth2.refresh_token", &o.refresh_token)?;
                if let Some(s) = &o.client_secret {
                    check_value("oauth2.client_secret", s)?;
                }
                self.check_token_url(&o.token_url).await?;
                (
                    Spec::Oauth2 {
                        token_url: o.token_url,
                        client_id: o.client_id,
                        scope: o.scope,
                    },
                    Material {
                        client_secret: o.client_secret,
                        refresh_token: Some(o.refresh_token),
                        ..Material::default()
                    },
                )
            }
            other => {
                return Err(SecretError::Invalid(format!(
                    "kind {other:?}: `static` or `oauth2`"
                )))
            }
        };
        let existing = self.store.secrets(Some(tenant))?;
        let prior = existing.iter().find(|r| r.name == cmd.name);
        if prior.is_none() && existing.len() >= MAX_PER_TENANT {
            return Err(SecretError::Quota(format!(
                "at most {MAX_PER_TENANT} secrets per tenant"
            )));
        }
        let json = serde_json::to_vec(&material).map_err(|e| SecretError::Keys(e.to_string()))?;
        let sealed = self
            .sealer()?
            .seal(&bound(tenant, &cmd.name), &json)
            .map_err(|e| SecretError::Keys(e.to_string()))?;
        // Stored to the millisecond: the answer shows what a listing will.
        let now = Utc::now();
        let now = DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now);
        let row = SecretRow {
            tenant: tenant.to_owned(),
            name: cmd.name.clone(),
            connector: cmd.connector,
            kind: spec.kind().to_owned(),
            rule: serde_json::to_string(&spec).map_err(|e| SecretError::Keys(e.to_string()))?,
            sealed,
            created_at: prior.map_or(now, |p| p.created_at),
            updated_at: now,
            updated_by: Some(by.to_owned()),
        };
        self.store.put_secret(&row)?;
        self.forget_token(tenant, &cmd.name);
        self.reload(Some(tenant))?;
        tracing::info!(tenant, secret = %row.name, connector = %row.connector, kind = %row.kind, "connector secret written");
        view(&row).ok_or_else(|| SecretError::Keys("stored rule unreadable".into()))
    }

    /// Deletes a secret of `tenant`.
    pub fn delete(&self, tenant: &str, name: &str) -> Result<(), SecretError> {
        if !self.store.delete_secret(tenant, name)? {
            return Err(SecretError::NotFound(name.to_owned()));
        }
        self.forget_token(tenant, name);
        self.reload(Some(tenant))?;
        tracing::info!(tenant, secret = %name, "connector secret deleted");
        Ok(())
    }

    fn forget_token(&self, tenant: &str, name: &str) {
        self.tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&bound(tenant, name));
    }

    /// The secrets that would be injected on a call of `tenant` (its
    /// sandbox `sandbox`) to `connector`.
    pub fn would_inject(
        &self,
        tenant: &str,
        sandbox: Option<&str>,
        connector: &str,
    ) -> Vec<String> {
        let set = self.policies.set(tenant, sandbox);
        let Some(conn) = set
            .connectors()
            .map(|(_, c)| c)
            .find(|c| c.name == connector)
        else {
            return Vec::new();
        };
        self.of_tenant(tenant)
            .iter()
            .filter(|e| e.connector == connector && conn.admits_secret(&e.name))
            .map(|e| e.name.clone())
            .collect()
    }

    fn applicable(&self, call: &ToolCall) -> Vec<Entry> {
        let CallKind::Egress {
            connector: Some(connector),
            ..
        } = &call.kind
        else {
            return Vec::new();
        };
        let names = self.would_inject(&call.tenant, call.sandbox.as_deref(), connector);
        self.of_tenant(&call.tenant)
            .iter()
            .filter(|e| names.contains(&e.name))
            .cloned()
            .collect()
    }

    fn open_material(&self, tenant: &str, e: &Entry) -> Result<Material, String> {
        let s = self.sealer().map_err(|e| e.to_string())?;
        let bytes = s
            .open(&bound(tenant, &e.name), &e.sealed)
            .map_err(|err| format!("secret {}: {err}", e.name))?;
        serde_json::from_slice(&bytes)
            .map_err(|_| format!("secret {}: unreadable material", e.name))
    }

    /// Checks an OAuth2 token URL and resolves it: `https`, no
    /// credentials, every address passing the egress filter (or on
    /// `secrets_allow_private`).
    async fn check_token_url(
        &self,
        url: &str,
    ) -> Result<(reqwest::Url, String, Vec<SocketAddr>), SecretError> {
        let bad = |m: String| SecretError::Invalid(format!("oauth2.token_url: {m}"));
        if url.len() > 2048 {
            return Err(bad("longer than 2048 bytes".into()));
        }
        let u = reqwest::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        if u.scheme() != "https" {
            return Err(bad("https only".into()));
        }
        if !u.username().is_empty() || u.password().is_some() {
            return Err(bad("no credentials in the url".into()));
        }
        let host = u
            .host_str()
            .ok_or_else(|| bad("no host".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        let port = u.port_or_known_default().unwrap_or(443);
        let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => {
                let r = self
                    .resolver
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                let r2 = r.clone();
                let h = host.clone();
                // The configured resolver (pinned hosts), else the system's
                // without its public-only filter: the filter is below.
                let pinned = tokio::time::timeout(TOKEN_TIMEOUT, r2.resolve(&h, port)).await;
                match pinned {
                    Ok(Ok(a)) => a,
                    _ => tokio::time::timeout(
                        TOKEN_TIMEOUT,
                        tokio::net::lookup_host((h.as_str(), port)),
                    )
                    .await
                    .map_err(|_| bad(format!("resolving {host}: timed out")))?
                    .map_err(|e| bad(format!("resolving {host}: {e}")))?
                    .collect(),
                }
            }
        };
        if addrs.is_empty() {
            return Err(bad(format!("{host} resolves to no address")));
        }
        for a in &addrs {
            let ip = a.ip();
            if self
                .allow_private
                .iter()
                .any(|p| p.parse::<IpAddr>().ok() == Some(ip))
            {
                continue;
            }
            let any = if ip.is_ipv4() { "0.0.0.0/0" } else { "::/0" };
            let range = strata_policy::policy::IpNet::parse(any).map_err(bad)?;
            strata_policy::proxy::upstream::address_guard(ip, &range)
                .map_err(|e| bad(format!("{host}: {e}")))?;
        }
        Ok((u, host, addrs))
    }

    /// A fresh access token from the token endpoint (refresh-token grant).
    async fn refresh(
        &self,
        tenant: &str,
        e: &Entry,
        token_url: &str,
        client_id: &str,
        scope: Option<&str>,
    ) -> Result<(String, Option<Duration>), String> {
        let m = self.open_material(tenant, e)?;
        let refresh_token = m
            .refresh_token
            .clone()
            .ok_or_else(|| format!("secret {}: no refresh token", e.name))?;
        let (u, host, addrs) = self
            .check_token_url(token_url)
            .await
            .map_err(|err| format!("secret {}: {err}", e.name))?;
        let mut b = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(TOKEN_TIMEOUT)
            .https_only(true)
            .no_proxy()
            .resolve_to_addrs(&host, &addrs);
        for c in &self.roots {
            b = b.add_root_certificate(c.clone());
        }
        let client = b.build().map_err(|err| format!("token client: {err}"))?;
        let mut form: Vec<(&str, &str)> = vec![
            ("grant_type", "refresh_token"),
            ("refresh_token", refresh_token.as_str()),
            ("client_id", client_id),
        ];
        if let Some(cs) = m.client_secret.as_deref() {
            form.push(("client_secret", cs));
        }
        if let Some(s) = scope {
            form.push(("scope", s));
        }
        self.refreshes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let resp = client
            .post(u)
            .header("accept", "application/json")
            .form(&form)
            .send()
            .await
            // reqwest's error names the URL, never the form.
            .map_err(|err| format!("secret {}: token endpoint: {err}", e.name))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(format!(
                "secret {}: token endpoint answered {status}",
                e.name
            ));
        }
        #[derive(Deserialize)]
        struct TokenAnswer {
            access_token: String,
            #[serde(default)]
            expires_in: Option<u64>,
            #[serde(default)]
            refresh_token: Option<String>,
        }
        let t: TokenAnswer = resp.json().await.map_err(|_| {
            format!(
                "secret {}: the token endpoint's answer is not a token",
                e.name
            )
        })?;
        check_value("access_token", &t.access_token).map_err(|err| err.to_string())?;
        if let Some(new) = t.refresh_token.filter(|r| *r != refresh_token) {
            // A rotated refresh token replaces the stored one.
            self.store_refresh_token(tenant, e, m, new);
        }
        Ok((t.access_token, t.expires_in.map(Duration::from_secs)))
    }

    fn store_refresh_token(&self, tenant: &str, e: &Entry, mut m: Material, new: String) {
        m.refresh_token = Some(new);
        let r = (|| -> Result<(), String> {
            let json = serde_json::to_vec(&m).map_err(|e| e.to_string())?;
            let sealed = self
                .sealer()
                .map_err(|e| e.to_string())?
                .seal(&bound(tenant, &e.name), &json)
                .map_err(|e| e.to_string())?;
            let rows = self
                .store
                .secrets(Some(tenant))
                .map_err(|e| e.to_string())?;
            let Some(mut row) = rows.into_iter().find(|r| r.name == e.name) else {
                return Ok(());
            };
            row.sealed = sealed;
            row.updated_at = Utc::now();
            self.store.put_secret(&row).map_err(|e| e.to_string())?;
            self.reload(Some(tenant)).map_err(|e| e.to_string())
        })();
        if let Err(err) = r {
            tracing::warn!(tenant, secret = %e.name, error = %err, "storing a rotated refresh token");
        }
    }

    /// The access token of an OAuth2 secret (cached, refreshed when close
    /// to expiry or after a `401`), and its generation.
    async fn access_token(
        &self,
        tenant: &str,
        e: &Entry,
    ) -> Result<(String, u64, Arc<tokio::sync::Mutex<Token>>), String> {
        let Spec::Oauth2 {
            token_url,
            client_id,
            scope,
        } = &e.spec
        else {
            return Err("not an oauth2 secret".into());
        };
        let slot = self
            .tokens
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(bound(tenant, &e.name))
            .or_default()
            .clone();
        let mut t = slot.lock().await;
        let fresh = match (&t.access, t.expires) {
            (Some(_), Some(exp)) => !t.stale && exp > Instant::now() + REFRESH_MARGIN,
            (Some(_), None) => !t.stale,
            (None, _) => false,
        };
        if !fresh {
            let (access, life) = self
                .refresh(tenant, e, token_url, client_id, scope.as_deref())
                .await?;
            t.access = Some(access);
            t.expires = life.map(|l| Instant::now() + l);
            t.generation += 1;
            t.stale = false;
            tracing::info!(tenant, secret = %e.name, generation = t.generation, "oauth2 access token refreshed");
        }
        let access = t.access.clone().unwrap_or_default();
        let generation = t.generation;
        drop(t);
        Ok((access, generation, slot))
    }
}

impl Broker {
    /// What secret `e` of `tenant` puts on a request now: a static
    /// secret's value, or an OAuth2 secret's access token (cached or
    /// refreshed) with its token slot and generation, which a `401`
    /// marks stale.
    async fn current_value(
        &self,
        tenant: &str,
        e: &Entry,
    ) -> Result<(String, Option<(Arc<tokio::sync::Mutex<Token>>, u64)>), String> {
        match &e.spec {
            Spec::Static { .. } => {
                let v = self
                    .open_material(tenant, e)?
                    .value
                    .ok_or_else(|| format!("secret {}: no value", e.name))?;
                Ok((v, None))
            }
            Spec::Oauth2 { .. } => {
                let (access, generation, slot) = self.access_token(tenant, e).await?;
                Ok((access, Some((slot, generation))))
            }
        }
    }
}

impl RequestHook for Broker {
    fn secret_value<'a>(
        &'a self,
        tenant: &'a str,
        connector: &'a str,
        name: &'a str,
    ) -> SecretFuture<'a> {
        Box::pin(async move {
            let Some(e) = self
                .of_tenant(tenant)
                .iter()
                .find(|e| e.name == name && e.connector == connector)
                .cloned()
            else {
                return Ok(None);
            };
            self.current_value(tenant, &e).await.map(|(v, _)| Some(v))
        })
    }

    fn secrets_for(&self, call: &ToolCall) -> Option<String> {
        let names: Vec<String> = self.applicable(call).into_iter().map(|e| e.name).collect();
        (!names.is_empty()).then(|| names.join(","))
    }

    fn before_upstream<'a>(
        &'a self,
        call: &'a ToolCall,
        req: &'a mut hyper::http::request::Parts,
    ) -> HookFuture<'a> {
        Box::pin(async move {
            let mut inj = Injected::default();
            let mut stale_on_401: Vec<(Arc<tokio::sync::Mutex<Token>>, u64)> = Vec::new();
            for e in self.applicable(call) {
                let (value, token) = self.current_value(&call.tenant, &e).await?;
                let rule = match &e.spec {
                    Spec::Static { rule } => rule.clone(),
                    Spec::Oauth2 { .. } => Injection::Bearer,
                };
                stale_on_401.extend(token);
                let needles =
                    secrets::apply(req, &e.name, &rule, &value).map_err(|err| err.to_string())?;
                inj.strip.extend(needles);
                inj.secrets.push(e.name.clone());
            }
            if !stale_on_401.is_empty() {
                inj.on_status = Some(Arc::new(move |status| {
                    if status != 401 {
                        return;
                    }
                    for (slot, generation) in &stale_on_401 {
                        // Only the token the upstream refused: one refresh
                        // per refused token, however many requests saw it.
                        if let Ok(mut t) = slot.try_lock() {
                            if t.generation == *generation {
                                t.stale = true;
                            }
                        }
                    }
                }));
            }
            Ok(inj)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_store_no_secret_and_read_back() {
        let s = Spec::Static {
            rule: Injection::Header {
                name: "X-Api-Key".into(),
                template: "{value}".into(),
            },
        };
        let j = serde_json::to_string(&s).unwrap_or_default();
        assert_eq!(
            j,
            r#"{"kind":"static","rule":{"type":"header","name":"X-Api-Key","template":"{value}"}}"#
        );
        assert_eq!(serde_json::from_str::<Spec>(&j).ok(), Some(s));
        let o = Spec::Oauth2 {
            token_url: "https://login.test/token".into(),
            client_id: "cid".into(),
            scope: None,
        };
        let j = serde_json::to_string(&o).unwrap_or_default();
        assert_eq!(serde_json::from_str::<Spec>(&j).ok(), Some(o));
    }
}
