//! Signed `/files` URLs (the SDKs' `download_url` / `upload_url` of a
//! secured sandbox), checked as envd checks them: `signature` =
//! `v1_` + unpadded base64 of SHA-256 over
//! `<path>:<read|write>:<username or "">:<envd access token>[:<expiration>]`,
//! with `path` and `username` exactly as the query carries them and
//! `signature_expiration` a Unix time in seconds after which the URL is
//! refused (`401 signature is already expired`).
//!
//! The SDKs send such a URL to `E2B_SANDBOX_URL` without naming the
//! sandbox, so the sandbox is the one named by `E2b-Sandbox-Id` if the
//! request has it, else the one whose token the signature was made with:
//! the sandboxes of the door's tenants (every configured key's and
//! `default`; at most [`MAX_SEARCHED`]) are tried, one hash per token each
//! (a sandbox's stored tokens, derived again from their nonces, or its
//! legacy token when it has none). A
//! request with an `X-Access-Token`, or without `signature`, is checked as
//! every envd call is ([`crate::auth::require_access_token`]).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::json;
use sha2::{Digest, Sha256};
use strata_core::SandboxId;
use stratad::caller::{Caller, SystemReason};
use stratad::store::SandboxFilter;

use super::{ACCESS_TOKEN_HEADER, SANDBOX_ID_HEADER};
use crate::auth::{self, constant_time_eq, EnvdSandbox, Shape};
use crate::E2b;

/// Most sandboxes one unnamed signed request is tried against.
pub const MAX_SEARCHED: usize = 10_000;

/// envd's v1 signature of a `/files` URL.
pub fn signature(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    let raw = match exp {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The parts of a signed URL's query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    /// `path`, as given ("" when absent).
    pub path: String,
    /// `username`, as given ("" when absent).
    pub user: String,
    /// `signature`.
    pub signature: String,
    /// `signature_expiration`.
    pub expiration: Option<i64>,
}

/// The signed-URL parameters of `query`; `None` without `signature`,
/// `Some(Err)` for an expiration that is not a number.
pub fn parse(query: Option<&str>) -> Option<Result<Signed, String>> {
    let mut s = Signed {
        path: String::new(),
        user: String::new(),
        signature: String::new(),
        expiration: None,
    };
    let mut exp = None;
    let mut has_sig = false;
    for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match &*k {
            "path" => s.path = v.into_owned(),
            "username" => s.user = v.into_owned(),
            "signature" => {
                has_sig = true;
                s.signature = v.into_owned();
            }
            "signature_expiration" => exp = Some(v.into_owned()),
            _ => {}
        }
    }
    if !has_sig {
        return None;
    }
    if let Some(e) = exp {
        match e.parse::<i64>() {
            Ok(n) => s.expiration = Some(n),
            Err(_) => return Some(Err(format!("signature_expiration {e:?} is not a number"))),
        }
    }
    Some(Ok(s))
}

/// Whether `s` was made with `token` for `op`; then whether it expired
/// (`now`: Unix seconds).
pub fn check(s: &Signed, op: &str, token: &str, now: i64) -> Option<Result<(), &'static str>> {
    let want = signature(&s.path, op, &s.user, token, s.expiration);
    if !constant_time_eq(want.as_bytes(), s.signature.as_bytes()) {
        return None;
    }
    Some(match s.expiration {
        Some(e) if e < now => Err("signature is already expired"),
        _ => Ok(()),
    })
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (
        status,
        Json(json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

impl E2b {
    /// The sandboxes an unnamed signed request may be for.
    async fn signing_candidates(&self) -> Vec<SandboxId> {
        let mut tenants: Vec<String> = vec!["default".to_owned()];
        for k in &self.cfg.api_keys {
            if !tenants.iter().any(|t| t == k.tenant()) {
                tenants.push(k.tenant().to_owned());
            }
        }
        let caller = Caller::system(SystemReason::Embedder);
        let mut out = Vec::new();
        for tenant in tenants {
            let mut cursor = None;
            loop {
                let page = match self
                    .svc
                    .list_sandboxes(
                        &caller,
                        SandboxFilter {
                            tenant: tenant.clone(),
                            states: Vec::new(),
                            labels: Default::default(),
                            limit: 1000,
                            cursor,
                        },
                    )
                    .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(error = %e, "listing sandboxes for a signed URL");
                        break;
                    }
                };
                out.extend(page.items.into_iter().map(|r| r.id));
                if out.len() >= MAX_SEARCHED {
                    out.truncate(MAX_SEARCHED);
                    return out;
                }
                cursor = page.next_cursor;
                if cursor.is_none() {
                    break;
                }
            }
        }
        out
    }
}

/// The route layer of `/files`: a signed URL is checked here, anything
/// else as every envd call.
pub async fn files_access(State(st): State<Arc<E2b>>, mut req: Request, next: Next) -> Response {
    let signed = if req.headers().contains_key(ACCESS_TOKEN_HEADER) {
        None
    } else {
        parse(req.uri().query())
    };
    let Some(signed) = signed else {
        return auth::require_access_token(State((st, Shape::Files)), req, next).await;
    };
    let signed = match signed {
        Ok(s) => s,
        Err(m) => return refuse(StatusCode::BAD_REQUEST, &m),
    };
    let addr = req
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    if let Some(wait) = addr.and_then(|a| st.failures.blocked(a, Instant::now())) {
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            &format!(
                "too many failed authentications; retry in {}s",
                wait.as_secs().max(1)
            ),
        );
    }
    let op = if req.method() == Method::GET {
        "read"
    } else {
        "write"
    };
    let named = req
        .headers()
        .get(SANDBOX_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<SandboxId>().ok());
    let candidates = match named {
        Some(id) => vec![id],
        None => st.signing_candidates().await,
    };
    let now = chrono::Utc::now().timestamp();
    // Each candidate's stored tokens (derived again from their nonces), or
    // its legacy token when it has none.
    let stored = match st
        .stored_envd_tokens_of(candidates.iter().map(|c| c.to_string()).collect())
        .await
    {
        Ok(s) => s,
        Err(e) => return Shape::Files.refuse(e),
    };
    let found = candidates.into_iter().zip(stored).find_map(|(id, tokens)| {
        let tokens: Vec<(String, Option<Caller>)> = if tokens.is_empty() {
            vec![(st.envd_token(id.as_str()), None)]
        } else {
            tokens.into_iter().map(|(t, c)| (t, Some(c))).collect()
        };
        tokens
            .into_iter()
            .find_map(|(t, c)| check(&signed, op, &t, now).map(|r| (c, r)))
            .map(|(c, r)| (id, c, r))
    });
    let (id, caller) = match found {
        Some((id, c, Ok(()))) => (id, c),
        Some((_, _, Err(m))) => return refuse(StatusCode::UNAUTHORIZED, m),
        None => {
            if let Some(a) = addr {
                st.failures.failed(a, Instant::now());
            }
            return refuse(StatusCode::UNAUTHORIZED, "invalid signature");
        }
    };
    if st.envd_limiter.check(id.as_str()).is_err() {
        return refuse(
            StatusCode::TOO_MANY_REQUESTS,
            &format!(
                "rate limit of {} envd requests/s for sandbox {id} exceeded",
                st.cfg.rate_limit_per_second
            ),
        );
    }
    // The caller the token was issued to, whose credential must still hold.
    let caller = match caller {
        Some(c) => st.still_holds(c).await,
        None => st.legacy_envd_caller(&id).await,
    };
    let caller = match caller {
        Ok(c) => c,
        Err(e) => return Shape::Files.refuse(e),
    };
    req.extensions_mut()
        .insert(EnvdSandbox(auth::EnvdTarget { id, caller }));
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_sdks() {
        // The e2b SDK's get_signature("/home/user/a.txt", "read", "user",
        // "tok", expiration 1700000000) (sha256, base64, '=' stripped).
        let want = {
            let d = Sha256::digest(b"/home/user/a.txt:read:user:tok:1700000000");
            format!(
                "v1_{}",
                base64::engine::general_purpose::STANDARD
                    .encode(d)
                    .trim_end_matches('=')
            )
        };
        assert_eq!(
            signature(
                "/home/user/a.txt",
                "read",
                "user",
                "tok",
                Some(1_700_000_000)
            ),
            want
        );
        assert_ne!(
            signature("/a", "read", "", "tok", None),
            signature("/a", "write", "", "tok", None)
        );
    }

    #[test]
    fn parse_and_check() {
        assert_eq!(parse(Some("path=/a&username=user")), None);
        let sig = signature("/a b", "read", "", "tok", Some(100));
        let q = form_urlencoded::Serializer::new(String::new())
            .append_pair("path", "/a b")
            .append_pair("signature", &sig)
            .append_pair("signature_expiration", "100")
            .finish();
        let s = parse(Some(&q)).unwrap().unwrap();
        assert_eq!(
            (s.path.as_str(), s.user.as_str(), s.expiration),
            ("/a b", "", Some(100))
        );
        assert_eq!(check(&s, "read", "tok", 99), Some(Ok(())));
        assert_eq!(
            check(&s, "read", "tok", 101),
            Some(Err("signature is already expired"))
        );
        assert_eq!(check(&s, "write", "tok", 99), None);
        assert_eq!(check(&s, "read", "other", 99), None);
        let mut later = s.clone();
        later.expiration = Some(10_000);
        assert_eq!(
            check(&later, "read", "tok", 99),
            None,
            "expiration is signed"
        );
        assert!(parse(Some("signature=x&signature_expiration=soon"))
            .unwrap()
            .is_err());
    }
}
