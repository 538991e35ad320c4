//! Identity: roles, the authenticated caller ([`Principal`]), token secrets
//! and the role matrix of the HTTP routes.

use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything in its tenant: tokens, policies, audit verification, and
    /// all a developer and an approver may do.
    Admin,
    /// Sandboxes, exec, files, snapshots, fork, rewind, templates (+ read).
    Developer,
    /// Answers approval requests (+ read).
    Approver,
    /// Reads records (GET), never guest files.
    Viewer,
    /// Reads `/metrics` (and `whoami`), nothing else. Made only by admins of
    /// the platform tenant: the metrics cover every tenant.
    Metrics,
}

impl Role {
    /// The name used in the API and the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Developer => "developer",
            Role::Approver => "approver",
            Role::Viewer => "viewer",
            Role::Metrics => "metrics",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "admin" => Ok(Role::Admin),
            "developer" => Ok(Role::Developer),
            "approver" => Ok(Role::Approver),
            "viewer" => Ok(Role::Viewer),
            "metrics" => Ok(Role::Metrics),
            _ => Err(format!(
                "role {s:?}: expected admin, developer, approver, viewer or metrics"
            )),
        }
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    /// Token id (`tok-…`), or `anonymous` with authentication off.
    pub token_id: String,
    /// Tenant the caller acts for.
    pub tenant: String,
    /// Role.
    pub role: Role,
    /// Token name, if any.
    pub name: Option<String>,
}

impl Principal {
    /// The actor name recorded in approvals and the audit log.
    pub fn actor(&self) -> String {
        format!("token:{}", self.token_id)
    }

    /// The caller of service commands this credential makes.
    pub fn caller(&self) -> crate::caller::Caller {
        crate::caller::Caller::Api {
            tenant: self.tenant.clone(),
            actor: self.actor(),
            role: self.role,
            token: self.token_id.clone(),
            name: self.name.clone(),
        }
    }
}

/// Prefix of every token secret (helps secret scanners).
pub const TOKEN_PREFIX: &str = "strata_";

/// A fresh token: `(id, secret)`. The secret is 32 random bytes, hex.
pub fn new_token() -> (String, String) {
    let mut rng = rand::thread_rng();
    let mut id = [0u8; 8];
    let mut secret = [0u8; 32];
    rng.fill_bytes(&mut id);
    rng.fill_bytes(&mut secret);
    (
        format!("tok-{}", hex::encode(id)),
        format!("{TOKEN_PREFIX}{}", hex::encode(secret)),
    )
}

/// Prefix of the E2B-format spelling of a token (`e2b_` + the same 64 hex
/// digits): what E2B's SDKs expect an API key to look like.
pub const E2B_KEY_PREFIX: &str = "e2b_";

/// The E2B-format spelling of a strata token secret (`strata_<hex>` →
/// `e2b_<hex>`): the same credential, accepted wherever the token is.
pub fn e2b_key(secret: &str) -> String {
    match secret.strip_prefix(TOKEN_PREFIX) {
        Some(hex) => format!("{E2B_KEY_PREFIX}{hex}"),
        None => secret.to_owned(),
    }
}

/// Whether `t` is a token in either spelling: `strata_` or `e2b_`
/// followed by 64 hex digits.
pub fn is_token(t: &str) -> bool {
    [TOKEN_PREFIX, E2B_KEY_PREFIX].iter().any(|p| {
        t.strip_prefix(p)
            .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
    })
}

/// SHA-256 of a secret, hex (what the database keeps). The E2B spelling
/// of a token hashes as its `strata_` spelling.
pub fn hash_secret(secret: &str) -> String {
    let canonical = match secret.strip_prefix(E2B_KEY_PREFIX) {
        Some(hex) => format!("{TOKEN_PREFIX}{hex}"),
        None => secret.to_owned(),
    };
    hex::encode(Sha256::digest(canonical.as_bytes()))
}

/// The secret of an `Authorization: Bearer <secret>` header value, if well formed.
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let t = rest.trim();
    is_token(t).then_some(t)
}

/// Whether `role` may call `(method, matched route)`: what the route table
/// (`api::routes::ROUTES`) says (`HEAD` counts as `GET`; unknown routes: no).
pub fn allowed(method: &str, route: &str, role: Role) -> bool {
    crate::api::routes::find(method, route).is_some_and(|r| r.allows(role))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex_and_hash_stably() {
        let (id, s) = new_token();
        let (id2, s2) = new_token();
        assert_ne!(s, s2);
        assert_ne!(id, id2);
        assert_eq!(bearer(&format!("Bearer {s}")), Some(s.as_str()));
        assert_eq!(hash_secret(&s), hash_secret(&s));
        assert_eq!(hash_secret(&s).len(), 64);
        // The E2B spelling is the same credential.
        let e = e2b_key(&s);
        assert!(e.starts_with("e2b_") && e.len() == 68, "{e}");
        assert_eq!(bearer(&format!("Bearer {e}")), Some(e.as_str()));
        assert_eq!(hash_secret(&e), hash_secret(&s));
        assert!(!is_token("e2b_strata_test_key"));
        for bad in [
            "",
            "Bearer",
            "Bearer ",
            "Basic abc",
            "Bearer strata_xyz",
            &format!("Token {s}"),
            &format!("Bearer {}", &s[..s.len() - 1]),
        ] {
            assert_eq!(bearer(bad), None, "{bad}");
        }
    }

    #[test]
    fn role_matrix_basics() {
        use Role::*;
        assert!(allowed("GET", "/v1/sandboxes", Viewer));
        assert!(!allowed("POST", "/v1/sandboxes", Viewer));
        assert!(allowed("POST", "/v1/sandboxes", Developer));
        assert!(!allowed("POST", "/v1/sandboxes", Approver));
        assert!(allowed("POST", "/v1/approvals/:id/approve", Approver));
        assert!(!allowed("POST", "/v1/approvals/:id/approve", Developer));
        assert!(!allowed("POST", "/v1/approvals/:id/approve", Viewer));
        assert!(!allowed("GET", "/v1/tokens", Developer));
        assert!(allowed("GET", "/v1/tokens", Admin));
        assert!(!allowed("PUT", "/v1/policy", Developer));
        assert!(allowed("GET", "/v1/policy", Viewer));
        assert!(!allowed("GET", "/v1/audit/verify", Approver));
        for r in [Viewer, Approver, Metrics] {
            assert!(!allowed("GET", "/v1/sandboxes/:id/files", r), "{r:?}");
            assert!(!allowed("HEAD", "/v1/sandboxes/:id/files", r), "{r:?}");
            assert!(!allowed("GET", "/v1/sandboxes/:id/files/stat", r), "{r:?}");
        }
        assert!(allowed("HEAD", "/v1/sandboxes/:id/files", Developer));
        assert!(!allowed("GET", "/v1/sandboxes", Metrics));
        assert!(allowed("GET", "/v1/whoami", Metrics));
    }
}
