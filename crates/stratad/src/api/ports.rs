//! Guest ports over HTTP: the reverse-proxy core both doors use (the E2B
//! door's routed hosts, `strata_e2b::ports`, and `/v1`'s
//! `/v1/sandboxes/{id}/ports/{port}/…`), over [`Service::open_port`]
//! (tenancy, wake, policy kind `port`, one audit entry per connection).
//!
//! Each proxied request is one port connection (HTTP/1.1 to the guest, no
//! pooling), streamed both ways: bodies are never buffered whole (SSE and
//! chunked answers flow as the guest writes them). `Upgrade` requests
//! (WebSocket) get the guest's `101` and then a raw byte pipe between the
//! client's and the guest's connection.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use strata_core::SandboxId;

use strata_core::ErrorCode;

use super::{parse_id, ApiError};
use crate::caller::Caller;
use crate::security::gate::GateOptions;
use crate::service::{is_port_closed, Service, ServiceError};

/// Hop-by-hop headers (RFC 9110 §7.6.1), not forwarded either way
/// (`Connection` and `Upgrade` are set again for an upgrade).
const HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// Why a request did not reach the guest port.
#[derive(Debug)]
pub enum PortProxyError {
    /// [`Service::open_port`] refused or failed (nothing listening:
    /// [`is_port_closed`]).
    Open(ServiceError),
    /// The guest's side gave no HTTP answer.
    Guest(String),
    /// The request cannot be sent on (its target).
    BadRequest(String),
}

/// What a door strips and rewrites before the guest sees a request.
#[derive(Debug, Default, Clone, Copy)]
pub struct Forward<'a> {
    /// Headers that belong to the door (credentials, routing).
    pub drop_headers: &'a [&'a str],
    /// The guest's request target (path and query) when it is not the
    /// request's own (`/v1` strips its route prefix).
    pub target: Option<&'a str>,
}

/// Sends `req` to guest port `port` of sandbox `id` as `caller` and returns
/// the guest's answer, streamed (a `101` when the guest took an upgrade).
pub async fn forward(
    svc: &Arc<Service>,
    caller: &Caller,
    id: &SandboxId,
    port: u16,
    opts: &GateOptions,
    mut req: Request,
    how: Forward<'_>,
) -> Result<Response, PortProxyError> {
    let conn = svc
        .open_port(caller, id, port, opts)
        .await
        .map_err(PortProxyError::Open)?;
    // Title-case header names, as E2B's proxy (Go) sends them: a guest
    // server that reads `Host:` byte for byte finds it.
    let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
        .title_case_headers(true)
        .handshake(TokioIo::new(conn))
        .await
        .map_err(|e| PortProxyError::Guest(format!("guest port {port}: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(error = %e, "guest port connection ended with an error");
        }
    });
    let upgrade = is_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let out = guest_request(req, upgrade, how).map_err(PortProxyError::BadRequest)?;
    let mut resp = sender.send_request(out).await.map_err(|e| {
        PortProxyError::Guest(format!("guest port {port} gave no HTTP answer: {e}"))
    })?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let guest_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                let (c, g) = match tokio::try_join!(client_upgrade, guest_upgrade) {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::debug!(error = %e, "upgrade through the port proxy failed");
                        return;
                    }
                };
                let (mut c, mut g) = (TokioIo::new(c), TokioIo::new(g));
                if let Err(e) = tokio::io::copy_bidirectional(&mut c, &mut g).await {
                    tracing::debug!(error = %e, "upgraded port connection ended");
                }
            });
            let (mut parts, _) = resp.into_parts();
            let proto = parts.headers.get(header::UPGRADE).cloned();
            strip(&mut parts.headers, true);
            set_upgrade(&mut parts.headers, &proto);
            return Ok(Response::from_parts(parts, Body::empty()));
        }
    }
    let (mut parts, body) = resp.into_parts();
    strip(&mut parts.headers, false);
    Ok(Response::from_parts(parts, Body::new(body)))
}

fn set_upgrade(h: &mut HeaderMap, proto: &Option<HeaderValue>) {
    if let Some(p) = proto {
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, p.clone());
    }
}

fn is_upgrade(h: &HeaderMap) -> bool {
    h.contains_key(header::UPGRADE)
        && h.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// Removes hop-by-hop headers (and those `Connection` names); with
/// `keep_upgrade`, `Upgrade` stays for the caller to set again.
fn strip(h: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for n in named {
        if !(keep_upgrade && n == header::UPGRADE) {
            h.remove(n);
        }
    }
    for n in HOP_HEADERS {
        h.remove(n);
    }
    if !keep_upgrade {
        h.remove(header::UPGRADE);
    }
}

/// The request as the guest gets it: origin-form URI, the client's headers
/// without the door's and hop-by-hop ones, the body streamed.
fn guest_request(req: Request, upgrade: bool, how: Forward<'_>) -> Result<Request, String> {
    let (mut parts, body) = req.into_parts();
    let pq = match how.target {
        Some(t) => t.to_owned(),
        None => parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| "/".into()),
    };
    parts.uri = pq.parse().map_err(|e| format!("request target: {e}"))?;
    let proto = parts.headers.get(header::UPGRADE).cloned();
    strip(&mut parts.headers, upgrade);
    for n in how.drop_headers {
        parts.headers.remove(*n);
    }
    if upgrade {
        set_upgrade(&mut parts.headers, &proto);
    }
    if !parts.headers.contains_key(header::HOST) {
        parts
            .headers
            .insert(header::HOST, HeaderValue::from_static("localhost"));
    }
    parts.version = axum::http::Version::HTTP_11;
    Ok(Request::from_parts(parts, body))
}

/// Headers of `/v1` port requests that are the daemon's, not the guest's.
const V1_DOOR_HEADERS: [&str; 1] = ["authorization"];

/// `ANY /v1/sandboxes/{id}/ports/{port}[/{*rest}]`: the request, minus the
/// route prefix and the `Authorization` header, to guest port `port`. The
/// query goes to the guest unchanged (no gate parameters: an `approve`
/// decision waits like the E2B door's). Nothing listening → `502
/// port_closed`; another tenant's sandbox → `404` like an unknown one.
pub(crate) async fn proxy(
    State(svc): State<Arc<Service>>,
    caller: Option<axum::Extension<Caller>>,
    params: Result<axum::extract::RawPathParams, axum::extract::rejection::RawPathParamsRejection>,
    req: Request,
) -> Response {
    let Some(axum::Extension(caller)) = caller else {
        return ApiError::new(ErrorCode::Internal, "no caller: security layer missing")
            .into_response();
    };
    let params = match params {
        Ok(p) => p,
        Err(e) => {
            return ApiError::new(
                ErrorCode::InvalidRequest,
                format!("path: {}", e.body_text()),
            )
            .into_response()
        }
    };
    match proxy_inner(&svc, caller, params, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn proxy_inner(
    svc: &Arc<Service>,
    caller: Caller,
    params: axum::extract::RawPathParams,
    req: Request,
) -> Result<Response, ApiError> {
    let mut id = String::new();
    let mut port = None;
    let mut rest = String::new();
    for (k, v) in params.iter() {
        match k {
            "id" => id = v.to_owned(),
            "port" => port = Some(v.to_owned()),
            "rest" => rest = v.to_owned(),
            _ => {}
        }
    }
    let id: SandboxId = parse_id(&id)?;
    let port: u16 = port
        .as_deref()
        .and_then(|p| p.parse().ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidRequest,
                format!("port {:?} is not 1-65535", port.unwrap_or_default()),
            )
        })?;
    let mut target = format!("/{rest}");
    if let Some(q) = req.uri().query() {
        target.push('?');
        target.push_str(q);
    }
    let how = Forward {
        drop_headers: &V1_DOOR_HEADERS,
        target: Some(&target),
    };
    match forward(svc, &caller, &id, port, &GateOptions::waiting(), req, how).await {
        Ok(r) => Ok(r),
        Err(PortProxyError::Open(e)) if is_port_closed(&e) => {
            let mut r = ApiError::new(
                e.code(),
                format!(
                    "nothing listens on port {port} in sandbox {id}: {}",
                    e.message()
                ),
            )
            .into_response();
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            Ok(r)
        }
        Err(PortProxyError::Open(e)) => Err(e.into()),
        Err(PortProxyError::Guest(m)) => {
            let mut r = ApiError::new(ErrorCode::InvalidState, m).into_response();
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            Ok(r)
        }
        Err(PortProxyError::BadRequest(m)) => Err(ApiError::new(ErrorCode::InvalidRequest, m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_headers_go_and_upgrade_is_kept_only_when_asked() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-drop"),
        );
        h.insert("x-drop", HeaderValue::from_static("1"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        let mut a = h.clone();
        strip(&mut a, false);
        assert!(a.get("x-keep").is_some());
        for gone in ["connection", "x-drop", "upgrade", "transfer-encoding"] {
            assert!(a.get(gone).is_none(), "{gone}");
        }
        let mut b = h;
        strip(&mut b, true);
        assert!(b.get(header::UPGRADE).is_some());
    }
}
