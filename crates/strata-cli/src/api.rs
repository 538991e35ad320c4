//! A thin client of the stratad HTTP API (`/v1`).
//!
//! Every call returns the daemon's JSON as a [`serde_json::Value`] (commands
//! print it as-is under `--json` and read typed views of it otherwise), or an
//! [`ApiError`] carrying the HTTP status and the daemon's stable error code.

use std::time::Duration;

use futures::StreamExt;
use reqwest::{Method, RequestBuilder, Response, StatusCode, Url};
use serde::Serialize;
use serde_json::Value;

/// Default daemon address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";

/// Why an API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The server address is not a usable URL.
    #[error("invalid server URL {url:?}: {reason}")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Nothing answers at the address.
    #[error(
        "cannot reach stratad at {url} ({detail}): is stratad running? \
         Start it with `strata serve`, or point --url / STRATA_URL at it"
    )]
    Unreachable {
        /// The server URL.
        url: String,
        /// The innermost cause (e.g. `Connection refused (os error 111)`).
        detail: String,
    },
    /// The daemon answered with an error.
    #[error("{message}")]
    Api {
        /// HTTP status (0 when the error arrived inside a streamed body).
        status: u16,
        /// Stable machine-readable code (`not_found`, `invalid_state`, ...).
        code: String,
        /// The daemon's message.
        message: String,
    },
    /// The request failed on the way (timeout, reset, body error).
    #[error("request to {url} failed")]
    Transport {
        /// The URL requested.
        url: String,
        /// The underlying error.
        #[source]
        source: reqwest::Error,
    },
    /// The daemon holds the call for a human's approval and the caller
    /// chose not to wait (`--no-wait`), or waited in vain.
    #[error("{message}")]
    Held {
        /// The approval request's id.
        approval_id: String,
        /// What to do next.
        message: String,
        /// The daemon's `202` answer (`{"status":"pending","approval":{…}}`),
        /// or the approval record when the wait ran out.
        body: Value,
    },
    /// The daemon answered something this client does not understand.
    #[error("unexpected answer from {url}: {reason}")]
    Protocol {
        /// The URL requested.
        url: String,
        /// What was wrong.
        reason: String,
    },
}

impl ApiError {
    /// The stable code reported under `--json`.
    pub fn code(&self) -> &str {
        match self {
            ApiError::BadUrl { .. } => "invalid_request",
            ApiError::Unreachable { .. } => "unavailable",
            ApiError::Api { code, .. } => code,
            ApiError::Transport { .. } => "transport_error",
            ApiError::Protocol { .. } => "protocol_error",
            ApiError::Held { .. } => "approval_pending",
        }
    }

    /// The HTTP status of a daemon error (`None` for the client's own
    /// errors and for errors inside a streamed body).
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Api { status, .. } if *status != 0 => Some(*status),
            _ => None,
        }
    }
}

/// What a tool call does when the daemon's policy holds it for approval.
#[derive(Debug, Clone)]
pub struct Gate {
    /// Do not wait: fail with [`ApiError::Held`] at once (`--no-wait`).
    pub no_wait: bool,
    /// Re-send a held call with this approved request (`--approval ID`).
    pub approval: Option<String>,
    /// How long to wait for an answer (`--approval-timeout`).
    pub timeout: Duration,
    /// How often to ask the daemon.
    pub poll: Duration,
    /// Tell the user (on stderr) about the wait.
    pub notify: bool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            no_wait: false,
            approval: None,
            timeout: Duration::from_secs(600),
            poll: Duration::from_millis(500),
            notify: true,
        }
    }
}

/// The approval id of a daemon answer to a held call
/// (`202 {"status":"pending","approval":{"id":…}}`).
pub fn held_approval_id(v: &Value) -> Option<&str> {
    if v.get("status").and_then(Value::as_str) != Some("pending") {
        return None;
    }
    v.get("approval")?.get("id")?.as_str()
}

/// The status name of an approval record: `pending`, `approved`, `denied`,
/// `timed_out` (`"status"` is `{"status":"approved","by":…,"at":…}`).
pub fn approval_status(v: &Value) -> &str {
    match v.get("status") {
        Some(Value::String(s)) => s,
        Some(o) => o.get("status").and_then(Value::as_str).unwrap_or("unknown"),
        None => "unknown",
    }
}

/// Result of API calls.
pub type ApiResult<T> = Result<T, ApiError>;

/// The client: base URL, optional bearer token, one connection pool.
#[derive(Debug, Clone)]
pub struct ApiClient {
    base: Url,
    token: Option<String>,
    http: reqwest::Client,
    gate: Gate,
}

impl ApiClient {
    /// A client of the daemon at `url` (e.g. `http://127.0.0.1:7070`, or
    /// `https://…` checked against the system's trust store).
    #[cfg(test)]
    pub fn new(url: &str, token: Option<String>) -> ApiResult<Self> {
        Self::with_ca_bundle(url, token, None)
    }

    /// [`ApiClient::new`]; an `https://` server must chain to a certificate
    /// of the PEM file `ca_bundle` when given (`--ca-bundle`,
    /// `STRATA_CA_BUNDLE`; the system's roots are then not used).
    pub fn with_ca_bundle(
        url: &str,
        token: Option<String>,
        ca_bundle: Option<&std::path::Path>,
    ) -> ApiResult<Self> {
        let bad = |reason: &str| ApiError::BadUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let base = Url::parse(url.trim()).map_err(|e| bad(&e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(bad("expected http:// or https://"));
        }
        if base.cannot_be_a_base() || base.host().is_none() {
            return Err(bad("expected http(s)://HOST:PORT"));
        }
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .use_rustls_tls()
            .https_only(base.scheme() == "https");
        if let Some(path) = ca_bundle {
            let pem = std::fs::read(path).map_err(|e| {
                bad(&format!(
                    "cannot read the CA bundle {}: {e}",
                    path.display()
                ))
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| bad(&format!("CA bundle {}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(bad(&format!(
                    "CA bundle {} holds no PEM certificate",
                    path.display()
                )));
            }
            builder = builder.tls_built_in_root_certs(false);
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        let http = builder.build().map_err(|e| bad(&e.to_string()))?;
        Ok(ApiClient {
            base,
            token: token.filter(|t| !t.is_empty()),
            http,
            gate: Gate::default(),
        })
    }

    /// Sets what tool calls do when held for approval.
    pub fn with_gate(mut self, gate: Gate) -> Self {
        self.gate = gate;
        self
    }

    /// The server's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// `base` + path segments (each percent-encoded) + query pairs.
    pub fn url(&self, segments: &[&str], query: &[(&str, &str)]) -> Url {
        let mut u = self.base.clone();
        if let Ok(mut p) = u.path_segments_mut() {
            p.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            u.query_pairs_mut().extend_pairs(query);
        }
        u
    }

    /// A request with the bearer token set.
    pub fn request(&self, method: Method, url: Url) -> RequestBuilder {
        let rb = self.http.request(method, url);
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// Sends a request; a non-2xx answer becomes [`ApiError::Api`].
    pub async fn send(&self, rb: RequestBuilder) -> ApiResult<Response> {
        let req = rb.build().map_err(|e| ApiError::Protocol {
            url: self.base.to_string(),
            reason: format!("cannot build request: {e}"),
        })?;
        let url = req.url().to_string();
        let resp = self
            .http
            .execute(req)
            .await
            .map_err(|e| self.transport(&url, e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(error_from_response(resp).await)
    }

    fn transport(&self, url: &str, e: reqwest::Error) -> ApiError {
        if e.is_connect() {
            ApiError::Unreachable {
                url: self.base.as_str().trim_end_matches('/').to_owned(),
                detail: innermost(&e),
            }
        } else {
            ApiError::Transport {
                url: url.to_owned(),
                source: e,
            }
        }
    }

    /// A request to `base` + `segments` + `query`, with the bearer token set.
    fn at(&self, method: Method, segments: &[&str], query: &[(&str, &str)]) -> RequestBuilder {
        self.request(method, self.url(segments, query))
    }

    /// The JSON of an answer's body (`null` when it is empty).
    async fn body_json(&self, resp: Response) -> ApiResult<Value> {
        let url = resp.url().to_string();
        let bytes = resp.bytes().await.map_err(|e| self.transport(&url, e))?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| ApiError::Protocol {
            url,
            reason: format!("invalid JSON: {e}"),
        })
    }

    /// Sends a request and parses the JSON answer.
    pub async fn json(&self, rb: RequestBuilder) -> ApiResult<Value> {
        self.body_json(self.send(rb).await?).await
    }

    /// `GET` a JSON resource.
    pub async fn get(&self, segments: &[&str], query: &[(&str, &str)]) -> ApiResult<Value> {
        self.json(self.at(Method::GET, segments, query)).await
    }

    /// `POST` a JSON body.
    pub async fn post(&self, segments: &[&str], body: &impl Serialize) -> ApiResult<Value> {
        self.json(self.at(Method::POST, segments, &[]).json(body))
            .await
    }

    /// `DELETE` a resource.
    pub async fn delete(&self, segments: &[&str], query: &[(&str, &str)]) -> ApiResult<Value> {
        self.json(self.at(Method::DELETE, segments, query)).await
    }

    /// Sends a tool call (exec, files, snapshot, fork, lifecycle …): one the
    /// daemon's policy may hold for a human's approval.
    ///
    /// The call goes out with `?wait=false`, so a held call answers at once
    /// `202 {"status":"pending","approval":{…}}` instead of a silent wait.
    /// Then, per [`Gate`]: with `no_wait`, [`ApiError::Held`]; otherwise the
    /// wait is announced on stderr, the approval is polled until answered,
    /// and the same request is re-sent with `?approval=<id>` (it runs once).
    /// A denial or timeout is `403 policy_denied`. With `gate.approval` set,
    /// the call is sent with `?approval=<id>` directly.
    pub async fn send_call(&self, rb: RequestBuilder) -> ApiResult<Response> {
        if let Some(id) = &self.gate.approval {
            return self.send(rb.query(&[("approval", id.as_str())])).await;
        }
        let retry = rb.try_clone();
        let resp = self.send(rb.query(&[("wait", "false")])).await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Ok(resp);
        }
        let status = resp.status();
        let headers = resp.headers().clone();
        let url = resp.url().clone();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| self.transport(url.as_str(), e))?;
        let held: Option<(String, Value)> = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| held_approval_id(&v).map(|id| (id.to_owned(), v.clone())));
        let Some((id, body)) = held else {
            // A plain 202 (e.g. a template build accepted): hand it back.
            let mut r = http::Response::new(bytes);
            *r.status_mut() = status;
            *r.headers_mut() = headers;
            return Ok(Response::from(r));
        };
        if self.gate.no_wait {
            return Err(ApiError::Held {
                message: format!(
                    "held for approval {id}: answer with `strata approvals approve {id}`, \
                     then re-send with --approval {id}"
                ),
                approval_id: id,
                body,
            });
        }
        if self.gate.notify {
            eprintln!("strata: waiting for approval {id} (strata approvals approve {id})");
        }
        let record = self.wait_approval(&id).await?;
        match approval_status(&record) {
            "approved" => {}
            "pending" => {
                return Err(ApiError::Held {
                    message: format!(
                        "approval {id} still pending after {}s: re-send later with --approval {id}",
                        self.gate.timeout.as_secs()
                    ),
                    approval_id: id,
                    body: record,
                })
            }
            other => {
                let by = record
                    .get("status")
                    .and_then(|s| s.get("by"))
                    .and_then(Value::as_str)
                    .map(|b| format!(" by {b}"))
                    .unwrap_or_default();
                return Err(ApiError::Api {
                    status: 403,
                    code: "policy_denied".into(),
                    message: format!(
                        "approval {id} {}{by}: the call did not run",
                        other.replace('_', " ")
                    ),
                });
            }
        }
        let Some(retry) = retry else {
            return Err(ApiError::Held {
                message: format!(
                    "approval {id} granted, but this request cannot be re-sent by itself \
                     (streamed body): run it again with --approval {id}"
                ),
                approval_id: id,
                body: record,
            });
        };
        if self.gate.notify {
            eprintln!("strata: approval {id} granted, sending the call again");
        }
        self.send(retry.query(&[("approval", id.as_str())])).await
    }

    /// Polls `GET /v1/approvals/{id}` until it is no longer pending or the
    /// gate's timeout ends; returns the last record.
    async fn wait_approval(&self, id: &str) -> ApiResult<Value> {
        let deadline = tokio::time::Instant::now() + self.gate.timeout;
        loop {
            let v = self.get(&["v1", "approvals", id], &[]).await?;
            if approval_status(&v) != "pending" || tokio::time::Instant::now() >= deadline {
                return Ok(v);
            }
            tokio::time::sleep(self.gate.poll).await;
        }
    }

    /// [`Self::send_call`] with a JSON answer.
    pub async fn json_call(&self, rb: RequestBuilder) -> ApiResult<Value> {
        self.body_json(self.send_call(rb).await?).await
    }

    /// `POST` a tool call with a JSON body (see [`Self::send_call`]).
    pub async fn post_call(&self, segments: &[&str], body: &impl Serialize) -> ApiResult<Value> {
        self.json_call(self.at(Method::POST, segments, &[]).json(body))
            .await
    }

    /// `GET` as a tool call (file reads; see [`Self::send_call`]).
    pub async fn get_call(&self, segments: &[&str], query: &[(&str, &str)]) -> ApiResult<Value> {
        self.json_call(self.at(Method::GET, segments, query)).await
    }

    /// `DELETE` as a tool call (see [`Self::send_call`]).
    pub async fn delete_call(&self, segments: &[&str], query: &[(&str, &str)]) -> ApiResult<Value> {
        self.json_call(self.at(Method::DELETE, segments, query))
            .await
    }

    /// `PUT` bytes as a tool call (a template build's `copy` archive).
    pub async fn put_bytes_call(&self, segments: &[&str], body: Vec<u8>) -> ApiResult<Value> {
        self.json_call(
            self.at(Method::PUT, segments, &[])
                .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
                .body(body),
        )
        .await
    }

    /// Whether `GET segments` answers 2xx (`false` on 404).
    pub async fn exists(&self, segments: &[&str]) -> ApiResult<bool> {
        match self.get(segments, &[]).await {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(404) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `PUT` a text body (policies are TOML).
    pub async fn put_text(&self, segments: &[&str], body: String) -> ApiResult<Value> {
        self.json(
            self.at(Method::PUT, segments, &[])
                .header(reqwest::header::CONTENT_TYPE, "application/toml")
                .body(body),
        )
        .await
    }

    /// Reads a streamed body to its end, calling `f` for each chunk.
    pub async fn for_each_chunk<F>(&self, resp: Response, mut f: F) -> ApiResult<()>
    where
        F: FnMut(&[u8]) -> ApiResult<()>,
    {
        let url = resp.url().to_string();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.transport(&url, e))?;
            f(&chunk)?;
        }
        Ok(())
    }
}

/// The `{"error":{"code","message"}}` body of a failed answer, or a code made
/// from the status when the body is not that.
async fn error_from_response(resp: Response) -> ApiError {
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    parse_error_body(status, &text)
}

/// Turns an error answer into an [`ApiError::Api`].
pub fn parse_error_body(status: StatusCode, text: &str) -> ApiError {
    if let Some(ApiError::Api { code, message, .. }) = error_object(text) {
        return ApiError::Api {
            status: status.as_u16(),
            code,
            message,
        };
    }
    let code = match status {
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        s if s.is_client_error() => "invalid_request",
        _ => "internal",
    };
    let body: String = text.trim().chars().take(300).collect();
    ApiError::Api {
        status: status.as_u16(),
        code: code.to_owned(),
        message: if body.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {body}")
        },
    }
}

/// Parses `{"error":{"code":..,"message":..}}` (status 0).
pub fn error_object(text: &str) -> Option<ApiError> {
    let v: Value = serde_json::from_str(text).ok()?;
    error_from_value(&v)
}

/// Reads `{"error":{"code":..,"message":..}}` out of a JSON value (status 0).
pub fn error_from_value(v: &Value) -> Option<ApiError> {
    let e = v.get("error")?;
    let code = e.get("code")?.as_str()?.to_owned();
    let message = e
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    Some(ApiError::Api {
        status: 0,
        code,
        message,
    })
}

fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        last = s.to_string();
        src = s.source();
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_encode_segments_and_keep_a_prefix() {
        let c = ApiClient::new("http://127.0.0.1:7070", None).unwrap();
        let u = c.url(&["v1", "sandboxes", "sb-1", "files"], &[("path", "/a b/c")]);
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:7070/v1/sandboxes/sb-1/files?path=%2Fa+b%2Fc"
        );
        let c = ApiClient::new("http://h:1/strata/", None).unwrap();
        assert_eq!(
            c.url(&["v1", "x/y"], &[]).as_str(),
            "http://h:1/strata/v1/x%2Fy"
        );
    }

    #[test]
    fn bad_urls_are_refused() {
        for u in ["127.0.0.1:7070", "ftp://x", "not a url"] {
            let e = ApiClient::new(u, None).unwrap_err();
            assert_eq!(e.code(), "invalid_request", "{u}: {e}");
        }
        ApiClient::new("https://strata.example:7443", None).unwrap();
        let d = tempfile::tempdir().unwrap();
        let empty = d.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        for bundle in [empty, d.path().join("missing.pem")] {
            let e = ApiClient::with_ca_bundle("https://h:1", None, Some(&bundle)).unwrap_err();
            assert_eq!(e.code(), "invalid_request", "{e}");
        }
    }

    #[test]
    fn error_bodies_become_typed_errors() {
        let e = parse_error_body(
            StatusCode::CONFLICT,
            r#"{"error":{"code":"invalid_state","message":"sandbox is paused"}}"#,
        );
        match &e {
            ApiError::Api {
                status,
                code,
                message,
            } => {
                assert_eq!((*status, code.as_str()), (409, "invalid_state"));
                assert_eq!(message, "sandbox is paused");
            }
            other => panic!("{other:?}"),
        }
        let e = parse_error_body(StatusCode::BAD_GATEWAY, "<html>proxy</html>");
        assert_eq!(e.code(), "internal");
        assert!(e.to_string().contains("502"), "{e}");
        assert_eq!(
            parse_error_body(StatusCode::NOT_FOUND, "").code(),
            "not_found"
        );
    }

    #[test]
    fn held_answers_are_recognised() {
        let v = serde_json::json!({"status": "pending", "approval": {"id": "apr-1", "status": {"status": "pending"}}});
        assert_eq!(held_approval_id(&v), Some("apr-1"));
        assert_eq!(approval_status(&v["approval"]), "pending");
        // A template build accepted (202) is not a held call.
        assert_eq!(
            held_approval_id(&serde_json::json!({"id": "tpl-1", "status": "building"})),
            None
        );
        assert_eq!(
            approval_status(&serde_json::json!({"status": {"status": "timed_out", "at": "x"}})),
            "timed_out"
        );
        assert_eq!(approval_status(&serde_json::json!({})), "unknown");
    }

    #[tokio::test]
    async fn refused_connection_says_is_stratad_running() {
        // A port nobody listens on: bind, take the port, close.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let c = ApiClient::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
        let e = c.get(&["v1", "sandboxes"], &[]).await.unwrap_err();
        assert_eq!(e.code(), "unavailable");
        let msg = e.to_string();
        assert!(msg.contains("is stratad running"), "{msg}");
        assert!(msg.contains(&port.to_string()), "{msg}");
    }
}
