//! Authentication: `X-API-KEY` on the control plane (a configured E2B key
//! ([`ApiKey`]) or a strata API token), the per-sandbox `X-Access-Token` on
//! envd (HMAC-SHA256 of the sandbox id under a secret). Both are checked by
//! middleware ([`require_api_key`], [`require_access_token`]) before any
//! extractor reads the request's body, with the door's rate limits: a
//! token bucket per configured key, per sandbox on envd, and per source
//! address for failed authentications ([`FailureLimiter`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use sha2::{Digest, Sha256};

use strata_core::SandboxId;
use stratad::caller::Caller;
use stratad::security::auth::{Role, TOKEN_PREFIX};
use stratad::store::DEFAULT_TENANT;

use crate::connect::{Code, ConnectError};
use crate::error::E2bError;
use crate::policy::{api_key_caller, may_write, API_KEY_ACTOR};
use crate::E2b;

/// Prefix of [`ApiKey::id`]: `e2b-key-` and 12 hex digits of the key's
/// SHA-256 (names the key in logs, audit and rate limits, never reveals it).
pub const KEY_ID_PREFIX: &str = "e2b-key-";

/// A configured E2B API key and who it acts as.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    key: String,
    tenant: String,
    /// `None`: a bare key (the old form), actor and token `e2b-api-key`.
    actor: Option<String>,
    id: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("id", &self.id)
            .field("tenant", &self.tenant)
            .field("actor", &self.actor())
            .finish_non_exhaustive()
    }
}

/// Why a `--e2b-api-key` / `[e2b] api_keys` entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeySpecError {
    /// Nothing before `=`, or an empty entry.
    #[error("an E2B API key entry has an empty key")]
    EmptyKey,
    /// The tenant is not 1-63 of `[a-z0-9-_]`.
    #[error("E2B API key {id}: tenant {tenant:?} is not 1-63 of [a-z0-9-_]")]
    Tenant {
        /// The key's id.
        id: String,
        /// What was given.
        tenant: String,
    },
    /// The same key is configured twice.
    #[error("E2B API key {0} is configured twice")]
    Duplicate(String),
    /// The actor is not 1-128 of `[A-Za-z0-9-_.@:]`.
    #[error("E2B API key {id}: actor {actor:?} is not 1-128 of [A-Za-z0-9-_.@:]")]
    Actor {
        /// The key's id.
        id: String,
        /// What was given.
        actor: String,
    },
}

fn valid_tenant(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 63
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn valid_actor(a: &str) -> bool {
    !a.is_empty()
        && a.len() <= 128
        && a.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@:".contains(&b))
}

impl ApiKey {
    /// A bare key: a developer of tenant `default` with actor and token
    /// `e2b-api-key` (what every key was before keys had tenants).
    pub fn bare(key: impl Into<String>) -> ApiKey {
        let key = key.into();
        ApiKey {
            id: key_id(&key),
            key,
            tenant: DEFAULT_TENANT.to_owned(),
            actor: None,
        }
    }

    /// `KEY`, `KEY=TENANT` or `KEY=TENANT:ACTOR`. The key ends at the last
    /// `=`; a spec whose last `=` ends it (base64 padding) is a bare key.
    /// Without an actor the key acts as its [`ApiKey::id`]. A key with a
    /// tenant is a developer of that tenant.
    pub fn parse(spec: &str) -> Result<ApiKey, KeySpecError> {
        let spec = spec.trim();
        let (key, who) = match spec.rsplit_once('=') {
            Some((k, w)) if !w.is_empty() => (k, Some(w)),
            _ => (spec, None),
        };
        if key.is_empty() {
            return Err(KeySpecError::EmptyKey);
        }
        let mut k = ApiKey::bare(key);
        let Some(who) = who else {
            return Ok(k);
        };
        let (tenant, actor) = match who.split_once(':') {
            Some((t, a)) => (t, a.to_owned()),
            None => (who, k.id.clone()),
        };
        if !valid_tenant(tenant) {
            return Err(KeySpecError::Tenant {
                id: k.id,
                tenant: tenant.to_owned(),
            });
        }
        if !valid_actor(&actor) {
            return Err(KeySpecError::Actor { id: k.id, actor });
        }
        k.tenant = tenant.to_owned();
        k.actor = Some(actor);
        Ok(k)
    }

    /// Parses every entry ([`ApiKey::parse`]); the same key twice is
    /// refused (which tenant it acts for would be ambiguous).
    pub fn parse_all<S: AsRef<str>>(specs: &[S]) -> Result<Vec<ApiKey>, KeySpecError> {
        let mut out: Vec<ApiKey> = Vec::with_capacity(specs.len());
        for s in specs {
            let k = ApiKey::parse(s.as_ref())?;
            if out.iter().any(|o| o.id == k.id) {
                return Err(KeySpecError::Duplicate(k.id));
            }
            out.push(k);
        }
        Ok(out)
    }

    /// `e2b-key-` and 12 hex digits of the key's SHA-256.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tenant the key acts for.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The actor recorded for its calls (audit, approvals).
    pub fn actor(&self) -> &str {
        self.actor.as_deref().unwrap_or(API_KEY_ACTOR)
    }

    /// Whether `given` is this key (constant time).
    pub fn matches(&self, given: &str) -> bool {
        constant_time_eq(self.key.as_bytes(), given.as_bytes())
    }

    /// The caller the key acts as: a developer of its tenant, its actor,
    /// its id as the credential (a bare key: [`api_key_caller`]).
    pub fn caller(&self) -> Caller {
        match &self.actor {
            None => api_key_caller(),
            Some(actor) => Caller::Api {
                tenant: self.tenant.clone(),
                actor: actor.clone(),
                role: Role::Developer,
                token: self.id.clone(),
                name: None,
            },
        }
    }
}

/// [`ApiKey::id`] of `key`.
pub fn key_id(key: &str) -> String {
    let h = Sha256::digest(key.as_bytes());
    format!("{KEY_ID_PREFIX}{}", &hex::encode(h)[..12])
}

/// Failed authentications per source address: each failure takes one
/// token of the address's bucket (`per_minute` at once, refilled at
/// `per_minute` a minute); while the bucket is empty every request from the
/// address is refused before its credentials are looked at, so guessing
/// keys or access tokens runs at the refill rate at most.
#[derive(Debug)]
pub struct FailureLimiter {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

/// Addresses tracked before idle (full) buckets are dropped.
const MAX_TRACKED: usize = 100_000;

impl FailureLimiter {
    /// `per_minute` failures at once and per minute; `0`: no limit.
    pub fn per_minute(per_minute: u32) -> Self {
        FailureLimiter {
            per_second: f64::from(per_minute) / 60.0,
            burst: f64::from(per_minute),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn level(&self, b: (f64, Instant), now: Instant) -> f64 {
        (b.0 + now.saturating_duration_since(b.1).as_secs_f64() * self.per_second).min(self.burst)
    }

    /// `Some(wait)` while `addr` is refused (its bucket is empty).
    pub fn blocked(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        if self.per_second <= 0.0 {
            return None;
        }
        let g = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let level = self.level(*g.get(&addr)?, now);
        (level < 1.0).then(|| Duration::from_secs_f64((1.0 - level) / self.per_second))
    }

    /// Records a failed authentication from `addr`.
    pub fn failed(&self, addr: IpAddr, now: Instant) {
        if self.per_second <= 0.0 {
            return;
        }
        let mut g = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() >= MAX_TRACKED {
            let burst = self.burst;
            g.retain(|_, b| self.level(*b, now) < burst);
        }
        let b = g.entry(addr).or_insert((self.burst, now));
        *b = ((self.level(*b, now) - 1.0).max(0.0), now);
    }
}

/// The source address of a request, when the server was started with
/// connect info (`into_make_service_with_connect_info::<SocketAddr>()`, as
/// stratad does); without it there is no per-address limit.
fn source(req: &Request) -> Option<IpAddr> {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
}

fn retry_secs(wait: Duration) -> f64 {
    wait.as_secs_f64().ceil().max(1.0)
}

fn too_many_failures(wait: Duration) -> String {
    format!(
        "too many failed authentications from this address; retry in {}s",
        retry_secs(wait)
    )
}

/// 32 random bytes.
pub fn random_secret() -> Vec<u8> {
    let mut k = vec![0u8; 32];
    rand::thread_rng().fill_bytes(&mut k);
    k
}

/// HMAC-SHA256 (RFC 2104).
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    let ih = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(ih);
    outer.finalize().into()
}

/// The *legacy* envd access token of sandbox `id` (HMAC of the id: the
/// same for the sandbox's whole life and whoever asked). Handed out before
/// tokens were stored; still accepted for a sandbox that has no stored
/// token ([`envd_token_of`]), so SDK clients holding one keep working.
pub fn envd_token(secret: &[u8], id: &str) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("strata-e2b envd {id}").as_bytes(),
    ))
}

/// The envd access token of sandbox `id` issued with `nonce` (32 random
/// bytes, hex): `v2.<nonce>.<mac>`, the MAC an HMAC of the id and nonce
/// under the door's secret. The store keeps the nonce and the token's
/// SHA-256 (the row decides whether it still holds); the door derives the
/// token again to check a signed file URL or to hand a credential its
/// token once more, and the MAC tells a token it issued for a sandbox that
/// is gone (answered "not running", as E2B does) from a guess (401).
pub fn envd_token_of(secret: &[u8], id: &str, nonce: &str) -> String {
    let mac = hmac_sha256(
        secret,
        format!("strata-e2b envd v2 {id} {nonce}").as_bytes(),
    );
    format!("{ENVD_TOKEN_PREFIX}{nonce}.{}", hex::encode(mac))
}

/// Prefix of the envd access tokens of [`envd_token_of`].
pub const ENVD_TOKEN_PREFIX: &str = "v2.";

/// Whether `token` is one [`envd_token_of`] made for sandbox `id` under
/// `secret` (whatever its nonce; constant time in the MAC).
pub fn issued_for(secret: &[u8], id: &str, token: &str) -> bool {
    let Some((nonce, _)) = token
        .strip_prefix(ENVD_TOKEN_PREFIX)
        .and_then(|t| t.split_once('.'))
    else {
        return false;
    };
    nonce.len() == 64
        && nonce.bytes().all(|b| b.is_ascii_hexdigit())
        && constant_time_eq(
            envd_token_of(secret, id, nonce).as_bytes(),
            token.as_bytes(),
        )
}

/// A fresh nonce of [`envd_token_of`].
pub fn envd_nonce() -> String {
    hex::encode(random_secret())
}

/// The SHA-256 (hex) under which a token is stored and looked up.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// Compares without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why an `X-API-KEY` was refused, or who it is. A configured key takes a
/// token of its bucket (429 when empty), a strata token one of the
/// security subsystem's (as on `/v1`).
pub async fn caller_of(st: &E2b, given: &str) -> Result<Caller, E2bError> {
    if let Some(k) = st.cfg.api_keys.iter().find(|k| k.matches(given)) {
        if let Err(wait) = st.key_limiter.check(k.id()) {
            return Err(E2bError::new(
                429,
                format!(
                    "rate limit of {} requests/s for E2B API key {} exceeded; retry in {}s",
                    st.cfg.rate_limit_per_second,
                    k.id(),
                    retry_secs(wait)
                ),
            ));
        }
        return Ok(k.caller());
    }
    let strata_auth = st.sec.as_ref().filter(|s| s.config().auth);
    if let Some(sec) = strata_auth {
        if given.starts_with(TOKEN_PREFIX) || stratad::security::auth::is_token(given) {
            let sec2 = sec.clone();
            let header = format!("Bearer {given}");
            let p = tokio::task::spawn_blocking(move || sec2.authenticate(Some(&header)))
                .await
                .map_err(|e| E2bError::new(500, format!("authentication: {e}")))?
                .map_err(|f| E2bError::new(401, f.message()))?;
            if let Err(wait) = sec.limiter().check(&p.token_id) {
                return Err(E2bError::new(
                    429,
                    format!(
                        "rate limit of {} requests/s for this token exceeded; retry in {}s",
                        sec.config().rate_limit_per_second,
                        retry_secs(wait)
                    ),
                ));
            }
            return Ok(p.caller());
        }
    } else if st.cfg.api_keys.is_empty() {
        // No key list and no strata authentication: open (development).
        return Ok(api_key_caller());
    }
    Err(E2bError::new(
        401,
        if given.is_empty() {
            "missing X-API-KEY header"
        } else {
            "invalid API key"
        },
    ))
}

/// Middleware of the control plane: `X-API-KEY` → [`Caller`] (a configured
/// key: its tenant and actor, or a strata API token: its tenant and role)
/// or 401; read-only roles (viewer, approver) may only `GET`, a metrics
/// token nothing. The caller goes into the request's extensions: every
/// handler passes it to the service commands, which decide tenancy (and
/// gate tool calls) from it. Runs before any extractor reads the body; an
/// address over its failed-authentication budget answers 429.
pub async fn require_api_key(State(st): State<Arc<E2b>>, mut req: Request, next: Next) -> Response {
    let addr = source(&req);
    if let Some(wait) = addr.and_then(|a| st.failures.blocked(a, Instant::now())) {
        return E2bError::new(429, too_many_failures(wait)).into_response();
    }
    let given = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim()
        .to_owned();
    let caller = match caller_of(&st, &given).await {
        Ok(c) => c,
        Err(e) => {
            if e.status == 401 {
                if let Some(a) = addr {
                    st.failures.failed(a, Instant::now());
                }
            }
            return e.into_response();
        }
    };
    let role = caller.role().map_or("none", Role::as_str);
    if caller.role() == Some(Role::Metrics) {
        return E2bError::new(403, format!("role {role} may not use the E2B API")).into_response();
    }
    let read = matches!(*req.method(), Method::GET | Method::HEAD);
    if !read && !may_write(&caller) {
        return E2bError::new(
            403,
            format!("role {role} may only read (GET) through the E2B API"),
        )
        .into_response();
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

/// The error shape of a group of envd routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Unary Connect: the code's HTTP status, `{"code":"…","message":"…"}`.
    Unary,
    /// Server-streaming Connect: an error trailer.
    Stream,
    /// `/files`: `{"code": <status>, "message": "…"}`.
    Files,
}

impl Shape {
    /// `e` as this group answers it.
    pub fn refuse(self, e: ConnectError) -> Response {
        match self {
            Shape::Unary => e.into_response(),
            Shape::Stream => crate::connect::stream_error(e),
            Shape::Files => crate::envd::files::files_err(e),
        }
    }
}

/// The sandbox of an envd request whose access token was checked and the
/// caller that token was handed to (whose credential still holds): what
/// the call acts as. Dereferences to the sandbox id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdTarget {
    /// The sandbox.
    pub id: SandboxId,
    /// Who the call acts as.
    pub caller: Caller,
}

impl std::ops::Deref for EnvdTarget {
    type Target = SandboxId;

    fn deref(&self) -> &SandboxId {
        &self.id
    }
}

impl std::fmt::Display for EnvdTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.id.fmt(f)
    }
}

/// The sandbox of an envd request whose access token was checked, put into
/// the request's extensions by [`require_access_token`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdSandbox(pub EnvdTarget);

/// Middleware of envd: `E2b-Sandbox-Id` and `X-Access-Token` checked before
/// any extractor reads the body (an anonymous request with a 1 GiB
/// `Content-Length` is answered at once, its body never read), then the
/// sandbox's token bucket (429); the sandbox goes into the request's
/// extensions as [`EnvdSandbox`]. A failed check counts against the source
/// address ([`FailureLimiter`]).
pub async fn require_access_token(
    State((st, shape)): State<(Arc<E2b>, Shape)>,
    mut req: Request,
    next: Next,
) -> Response {
    let addr = source(&req);
    if let Some(wait) = addr.and_then(|a| st.failures.blocked(a, Instant::now())) {
        return shape.refuse(ConnectError::new(
            Code::ResourceExhausted,
            too_many_failures(wait),
        ));
    }
    let target = match st.envd_target(req.headers()).await {
        Ok(t) => t,
        Err(e) => {
            // A wrong or missing credential counts; a good one on a
            // sandbox that is gone does not.
            let failed = matches!(e.code, Code::Unauthenticated | Code::InvalidArgument);
            if let Some(a) = addr.filter(|_| failed) {
                st.failures.failed(a, Instant::now());
            }
            return shape.refuse(e);
        }
    };
    let id = &target.id;
    if let Err(wait) = st.envd_limiter.check(id.as_str()) {
        return shape.refuse(ConnectError::new(
            Code::ResourceExhausted,
            format!(
                "rate limit of {} envd requests/s for sandbox {id} exceeded; retry in {}s",
                st.cfg.rate_limit_per_second,
                retry_secs(wait)
            ),
        ));
    }
    req.extensions_mut().insert(EnvdSandbox(target));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn key_specs() {
        let bare = ApiKey::parse("e2b_abc").unwrap();
        assert_eq!((bare.tenant(), bare.actor()), ("default", API_KEY_ACTOR));
        assert_eq!(bare.caller(), api_key_caller());
        assert!(bare.matches("e2b_abc") && !bare.matches("e2b_ab"));
        // Base64 padding stays part of a bare key.
        let pad = ApiKey::parse("YWJjZA==").unwrap();
        assert!(pad.matches("YWJjZA==") && pad.tenant() == "default");
        let k = ApiKey::parse("sekrit=acme:ci-bot").unwrap();
        assert!(k.matches("sekrit") && !k.matches("sekrit=acme:ci-bot"));
        let c = k.caller();
        assert_eq!((c.tenant(), c.actor()), (Some("acme"), "ci-bot".to_owned()));
        assert_eq!(c.role(), Some(Role::Developer));
        let k2 = ApiKey::parse("other=acme").unwrap();
        assert_eq!(k2.actor(), k2.id());
        assert!(k2.id().starts_with(KEY_ID_PREFIX) && k2.id().len() == KEY_ID_PREFIX.len() + 12);
        assert_ne!(k.id(), k2.id());
        assert!(!format!("{k:?}").contains("sekrit"), "Debug shows the key");
        assert_eq!(ApiKey::parse("=acme"), Err(KeySpecError::EmptyKey));
        assert!(matches!(
            ApiKey::parse("k=Acme"),
            Err(KeySpecError::Tenant { .. })
        ));
        assert!(matches!(
            ApiKey::parse("k=acme:"),
            Err(KeySpecError::Actor { .. })
        ));
        assert!(matches!(
            ApiKey::parse("k=acme:a b"),
            Err(KeySpecError::Actor { .. })
        ));
        assert!(matches!(
            ApiKey::parse_all(&["k=acme", "k=beta"]),
            Err(KeySpecError::Duplicate(_))
        ));
        assert_eq!(ApiKey::parse_all(&["a", "b=beta"]).unwrap().len(), 2);
    }

    #[test]
    fn failures_block_an_address_until_its_bucket_refills() {
        let f = FailureLimiter::per_minute(3);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        assert_eq!(f.blocked(a, t0), None);
        for _ in 0..3 {
            assert_eq!(f.blocked(a, t0), None);
            f.failed(a, t0);
        }
        let wait = f.blocked(a, t0).unwrap();
        assert!(
            wait > Duration::from_secs(19) && wait <= Duration::from_secs(20),
            "{wait:?}"
        );
        assert_eq!(f.blocked(b, t0), None, "per address");
        assert_eq!(f.blocked(a, t0 + Duration::from_secs(21)), None);
        let off = FailureLimiter::per_minute(0);
        for _ in 0..10 {
            off.failed(a, t0);
        }
        assert_eq!(off.blocked(a, t0), None);
    }

    #[test]
    fn issued_tokens_are_tied_to_secret_sandbox_and_nonce() {
        let n = envd_nonce();
        let t = envd_token_of(b"s1", "sbx-a", &n);
        assert!(t.starts_with(ENVD_TOKEN_PREFIX) && t.contains(&n));
        assert_ne!(t, envd_token_of(b"s1", "sbx-a", &envd_nonce()));
        assert!(issued_for(b"s1", "sbx-a", &t));
        assert!(!issued_for(b"s2", "sbx-a", &t));
        assert!(!issued_for(b"s1", "sbx-b", &t));
        let forged = format!("{ENVD_TOKEN_PREFIX}{n}.{}", "0".repeat(64));
        assert!(!issued_for(b"s1", "sbx-a", &forged));
        assert!(!issued_for(b"s1", "sbx-a", &envd_token(b"s1", "sbx-a")));
        assert_eq!(token_hash(&t).len(), 64);
    }

    #[test]
    fn tokens_depend_on_secret_and_id() {
        let a = envd_token(b"s1", "sbx-a");
        assert_eq!(a, envd_token(b"s1", "sbx-a"));
        assert_ne!(a, envd_token(b"s2", "sbx-a"));
        assert_ne!(a, envd_token(b"s1", "sbx-b"));
        assert!(constant_time_eq(a.as_bytes(), a.as_bytes()));
        assert!(!constant_time_eq(a.as_bytes(), b"x"));
    }
}
