//! Guest ports through the door: the two ways the E2B SDKs address a
//! sandbox port, reverse-proxied to `127.0.0.1:<port>` in the guest over
//! the agent channel ([`Service::open_port`]: tenancy, wake, policy, one
//! audit entry per connection).
//!
//! - `Host: <port>-<sandbox id>.<domain>` (what `get_host(port)` gives;
//!   `domain` is the create/connect answer's, [`E2b::domain`]), any path.
//! - `E2b-Sandbox-Id` + `E2b-Sandbox-Port` other than envd's 49983 (how the
//!   SDKs send everything to `E2B_SANDBOX_URL`), any path.
//!
//! Port 49983 (by either) is envd: the request goes on to the envd routes.
//! Every other request is not a port request and goes on unchanged.
//!
//! Credentials (checked before the body is read): `e2b-traffic-access-token`
//! (the create answer's `trafficAccessToken`) or `X-Access-Token` (the envd
//! token) of that sandbox act as the caller the sandbox's envd token was
//! handed to; `X-API-KEY` acts as its key's caller (another tenant's sandbox
//! answers like an unknown one). Without any, the request is served as the
//! sandbox's envd caller when [`crate::E2bConfig::public_ports`] (E2B's
//! `allow_public_traffic` default), else refused `401`. A wrong token is
//! `401` and counts against the source address. The credential headers are
//! not forwarded to the guest.
//!
//! On a cluster, once the credential is checked, a port request for a
//! sandbox another host holds goes to that host's door ([`crate::cluster`]).
//!
//! The proxying itself is the daemon's ([`stratad::api::ports::forward`],
//! shared with `/v1/sandboxes/{id}/ports/{port}`). Each proxied HTTP
//! request is one port connection (HTTP/1.1 to the guest,
//! no pooling), streamed both ways: request and response bodies are never
//! buffered whole (SSE and chunked answers flow as the guest writes them).
//! `Upgrade` requests (WebSocket) get the guest's `101` and then a raw byte
//! pipe between the client's and the guest's connection. Answers the door
//! makes itself: `502` when nothing listens on the guest port (E2B's "port
//! is not open"), `404` for an unknown sandbox, the service's codes else,
//! as `{"code": <status>, "message": …, "sandboxId": …, "port": …}`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use strata_core::SandboxId;
use stratad::api::forward::{door, DoorCall, DoorRefusal};
use stratad::api::ports::{forward, Forward, PortProxyError};
use stratad::caller::Caller;
use stratad::service::{is_port_closed, ServiceError};

use crate::policy::gate_opts;
use crate::E2b;

/// envd's port: requests for it are served by the door's envd routes.
pub const ENVD_PORT: u16 = 49983;
/// The SDKs' header naming the sandbox.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// The SDKs' header naming the sandbox port.
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
/// The traffic token header of non-public sandboxes.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Headers that are the door's (credentials, routing) and stay here.
const DOOR_HEADERS: [&str; 5] = [
    "x-api-key",
    "x-access-token",
    TRAFFIC_TOKEN_HEADER,
    SANDBOX_ID_HEADER,
    SANDBOX_PORT_HEADER,
];

/// The port traffic token of sandbox `id` (distinct from its envd token).
pub fn traffic_token(secret: &[u8], id: &str) -> String {
    hex::encode(crate::auth::hmac_sha256(
        secret,
        format!("traffic:{id}").as_bytes(),
    ))
}

/// Where a port request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The sandbox, as the request spelled it.
    pub sandbox: String,
    /// The guest port.
    pub port: u16,
}

/// `<port>-<id>` of a `Host` (the first label, any port suffix removed):
/// `None` when it does not have that form, or the rest is not `domain`
/// (when one is configured; compared without `:port`, so one domain serves
/// the plain and the TLS listener).
pub fn host_target(host: &str, domain: Option<&str>) -> Option<Target> {
    let (label, rest) = host.split_once('.')?;
    if let Some(d) = domain {
        let bare = |s: &str| -> String {
            let s = s.trim_end_matches('.');
            let s = match s.rsplit_once(':') {
                Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
                _ => s,
            };
            s.trim_end_matches('.').to_ascii_lowercase()
        };
        if bare(rest) != bare(d) {
            return None;
        }
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port: u16 = port.parse().ok()?;
    id.parse::<SandboxId>().ok()?;
    Some(Target {
        sandbox: id.to_owned(),
        port,
    })
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// The port request `headers` make, if any: `Err` for a malformed one.
fn target(st: &E2b, headers: &HeaderMap) -> Option<Result<Target, Response>> {
    if let Some(host) = header_str(headers, header::HOST.as_str()) {
        if let Some(t) = host_target(host, st.cfg.domain.as_deref()) {
            return (t.port != ENVD_PORT).then_some(Ok(t));
        }
    }
    let port = header_str(headers, SANDBOX_PORT_HEADER)?;
    let Ok(port) = port.parse::<u16>() else {
        return Some(Err(refuse(
            400,
            format!("{SANDBOX_PORT_HEADER} {port:?} is not a port"),
            None,
        )));
    };
    if port == ENVD_PORT {
        return None;
    }
    let Some(id) = header_str(headers, SANDBOX_ID_HEADER) else {
        return Some(Err(refuse(
            400,
            format!("{SANDBOX_PORT_HEADER} without {SANDBOX_ID_HEADER}"),
            None,
        )));
    };
    Some(Ok(Target {
        sandbox: id.to_owned(),
        port,
    }))
}

fn refuse(status: u16, message: String, t: Option<&Target>) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut body = json!({"code": status, "message": message});
    if let Some(t) = t {
        body["sandboxId"] = json!(t.sandbox);
        body["port"] = json!(t.port);
    }
    (code, Json(body)).into_response()
}

/// Middleware in front of every route: port requests are proxied, the rest
/// goes on (see the module docs).
pub async fn dispatch(State(st): State<Arc<E2b>>, req: Request, next: Next) -> Response {
    match target(&st, req.headers()) {
        None => next.run(req).await,
        Some(Err(r)) => r,
        Some(Ok(t)) => proxy(st, t, req).await,
    }
}

/// The caller a port request acts as (module docs), or the refusal.
async fn port_caller(
    st: &E2b,
    id: &SandboxId,
    t: &Target,
    h: &HeaderMap,
) -> Result<Caller, Response> {
    let secret = &st.cfg.token_secret;
    if let Some(given) = header_str(h, TRAFFIC_TOKEN_HEADER) {
        let want = traffic_token(secret, id.as_str());
        if !crate::auth::constant_time_eq(given.as_bytes(), want.as_bytes()) {
            return Err(refuse(
                401,
                "invalid traffic access token for this sandbox".into(),
                Some(t),
            ));
        }
        return st
            .sandbox_envd_caller(id)
            .await
            .map_err(|e| caller_refusal(e, t));
    }
    if let Some(given) = header_str(h, "x-access-token") {
        // An envd access token acts as the caller it was issued to.
        return st
            .envd_check(id.as_str(), given)
            .await
            .map(|target| target.caller)
            .map_err(|e| caller_refusal(e, t));
    }
    if let Some(key) = header_str(h, "x-api-key").filter(|k| !k.is_empty()) {
        return crate::auth::caller_of(st, key)
            .await
            .map_err(|e| refuse(e.status, e.message.clone(), Some(t)));
    }
    if !st.port_settings(id).public.unwrap_or(st.cfg.public_ports) {
        // Not public (the sandbox's allowPublicTraffic, else the door's
        // public_ports): E2B answers 403 without a credential.
        return Err(refuse(
            403,
            format!("sandbox ports need {TRAFFIC_TOKEN_HEADER} (or X-Access-Token / X-API-KEY)"),
            Some(t),
        ));
    }
    st.sandbox_envd_caller(id)
        .await
        .map_err(|e| caller_refusal(e, t))
}

fn service_refusal(e: &ServiceError, t: &Target) -> Response {
    if is_port_closed(e) {
        return refuse(
            502,
            format!(
                "the sandbox {} is running but nothing listens on port {}: {}",
                t.sandbox,
                t.port,
                e.message()
            ),
            Some(t),
        );
    }
    refuse(e.code().http_status(), e.message(), Some(t))
}

fn source_of(req: &Request) -> Option<std::net::IpAddr> {
    req.extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip())
}

/// An envd-caller failure as a port refusal: an unknown sandbox `404`.
fn caller_refusal(e: crate::connect::ConnectError, t: &Target) -> Response {
    let status = match e.code {
        crate::connect::Code::NotFound | crate::connect::Code::Unavailable => 404,
        crate::connect::Code::Unauthenticated => 401,
        crate::connect::Code::PermissionDenied => 403,
        _ => 500,
    };
    refuse(status, e.message, Some(t))
}

async fn proxy(st: Arc<E2b>, t: Target, mut req: Request) -> Response {
    if let Some(wait) = source_of(&req).and_then(|a| st.failures.blocked(a, Instant::now())) {
        return refuse(
            429,
            format!(
                "too many failed authentications from this address; retry in {}s",
                wait.as_secs().max(1)
            ),
            Some(&t),
        );
    }
    let Ok(id) = t.sandbox.parse::<SandboxId>() else {
        return refuse(404, format!("sandbox {} not found", t.sandbox), Some(&t));
    };
    let addr = source_of(&req);
    let caller = match port_caller(&st, &id, &t, req.headers()).await {
        Ok(c) => c,
        Err(r) => {
            if r.status() == StatusCode::UNAUTHORIZED {
                if let Some(a) = addr {
                    st.failures.failed(a, Instant::now());
                }
            }
            return r;
        }
    };
    if let Some(host) = st.port_settings(&id).host_for(t.port) {
        // maskRequestHost: checked at create, so always a valid value.
        if let Ok(v) = axum::http::HeaderValue::from_str(&host) {
            req.headers_mut().insert(axum::http::header::HOST, v);
        }
    }
    if st.svc.cluster().is_some() {
        // Forwarded to the sandbox's host, its door routes by these (its
        // `domain` may not be this one's); they never reach the guest.
        for (name, value) in [
            (SANDBOX_ID_HEADER, t.sandbox.clone()),
            (SANDBOX_PORT_HEADER, t.port.to_string()),
        ] {
            if let Ok(v) = axum::http::HeaderValue::from_str(&value) {
                req.headers_mut().insert(name, v);
            }
        }
    }
    let svc = st.svc.clone();
    let call = DoorCall::Sandbox {
        id: id.clone(),
        read: false,
    };
    let shape = |r: DoorRefusal| {
        refuse(
            r.status.as_u16(),
            format!("{}: {}", r.code, r.message),
            Some(&t),
        )
    };
    let local = |req: Request| async {
        let how = Forward {
            drop_headers: &DOOR_HEADERS,
            target: None,
        };
        match forward(&st.svc, &caller, &id, t.port, &gate_opts(), req, how).await {
            Ok(r) => r,
            Err(PortProxyError::Open(e)) => service_refusal(&e, &t),
            Err(PortProxyError::Guest(m)) => refuse(502, m, Some(&t)),
            Err(PortProxyError::BadRequest(m)) => refuse(400, m, Some(&t)),
        }
    };
    door(&svc, call, req, shape, local).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_get_host_are_recognised() {
        let t = host_target("8000-sb-0123456789abcdef.localhost:47983", None);
        assert_eq!(
            t,
            Some(Target {
                sandbox: "sb-0123456789abcdef".into(),
                port: 8000
            })
        );
        for not in [
            "localhost:47983",
            "127.0.0.1:47983",
            "abc-sb-1.localhost",
            "8000-notanid.localhost",
            "99999-sb-0123456789abcdef.localhost",
            "8000-sb-0123456789abcdef",
        ] {
            assert_eq!(host_target(not, None), None, "{not}");
        }
        let d = Some("sandboxes.example.com");
        assert!(host_target("80-sb-0123456789abcdef.sandboxes.example.com", d).is_some());
        assert!(host_target("80-sb-0123456789abcdef.other.example.com", d).is_none());
        // One domain for the plain and the TLS listener: ports are not compared.
        let d = Some("localhost:47983");
        assert!(host_target("80-sb-0123456789abcdef.localhost:47984", d).is_some());
        assert!(host_target("80-sb-0123456789abcdef.localhost", d).is_some());
        assert!(host_target("80-sb-0123456789abcdef.example.com:47983", d).is_none());
    }
}
