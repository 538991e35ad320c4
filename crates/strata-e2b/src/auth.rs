//! Authentication: `X-API-KEY` on the control plane (a configured E2B key
//! or a strata API token), the per-sandbox `X-Access-Token` on envd
//! (HMAC-SHA256 of the sandbox id under a secret).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::RngCore;
use sha2::{Digest, Sha256};

use stratad::caller::Caller;
use stratad::security::auth::{Role, TOKEN_PREFIX};

use crate::error::E2bError;
use crate::policy::{api_key_caller, may_write};
use crate::E2b;

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

/// The envd access token of sandbox `id`.
pub fn envd_token(secret: &[u8], id: &str) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("strata-e2b envd {id}").as_bytes(),
    ))
}

/// Compares without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why an `X-API-KEY` was refused, or who it is.
pub async fn caller_of(st: &E2b, given: &str) -> Result<Caller, E2bError> {
    if st
        .cfg
        .api_keys
        .iter()
        .any(|k| constant_time_eq(k.as_bytes(), given.as_bytes()))
    {
        return Ok(api_key_caller());
    }
    let strata_auth = st.sec.as_ref().filter(|s| s.config().auth);
    if let Some(sec) = strata_auth {
        if given.starts_with(TOKEN_PREFIX) {
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
                        wait.as_secs_f64().ceil().max(1.0)
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
/// key, or a strata API token: its tenant and role) or 401; read-only roles
/// (viewer, approver) may only `GET`, a metrics token nothing. The caller
/// goes into the request's extensions: every handler passes it to the
/// service commands, which decide tenancy (and gate tool calls) from it.
pub async fn require_api_key(State(st): State<Arc<E2b>>, mut req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim()
        .to_owned();
    let caller = match caller_of(&st, &given).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
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
    fn tokens_depend_on_secret_and_id() {
        let a = envd_token(b"s1", "sbx-a");
        assert_eq!(a, envd_token(b"s1", "sbx-a"));
        assert_ne!(a, envd_token(b"s2", "sbx-a"));
        assert_ne!(a, envd_token(b"s1", "sbx-b"));
        assert!(constant_time_eq(a.as_bytes(), a.as_bytes()));
        assert!(!constant_time_eq(a.as_bytes(), b"x"));
    }
}
