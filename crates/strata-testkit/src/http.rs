//! A client of strata's `/v1` HTTP API for tests and benchmarks — JSON
//! requests with a bearer token, exec streams read to their exit line — and
//! [`serve`], which puts an axum router on a loopback port.
//!
//! ```no_run
//! # async fn f() -> Result<(), strata_testkit::ApiError> {
//! use strata_testkit::Api;
//! let api = Api::new("http://127.0.0.1:7070").admin_token_of("/tmp/d/data".as_ref());
//! let v = api.expect(reqwest::Method::POST, "/v1/sandboxes", None, 201).await?;
//! let (code, stdout) = api.exec_output(v["id"].as_str().unwrap_or(""), &["uname"]).await?;
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};

/// A failed request (the request is named as `METHOD /path`).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request did not get an answer (connection, timeout, body read).
    #[error("{what}")]
    Transport {
        /// `METHOD /path`.
        what: String,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
    /// An answer with another status than the one expected.
    #[error("{what}: {status} {body}")]
    Status {
        /// `METHOD /path`.
        what: String,
        /// The status.
        status: u16,
        /// The body (JSON as text, or the raw text).
        body: String,
    },
    /// An exec stream that is not NDJSON of the expected events, or has no
    /// exit line.
    #[error("{what}: {message}")]
    Stream {
        /// `METHOD /path`.
        what: String,
        /// What was wrong.
        message: String,
    },
}

/// Where the bearer token comes from.
#[derive(Debug, Clone)]
enum Token {
    None,
    Fixed(String),
    /// Read at every request (a daemon writes its bootstrap token on its
    /// first start; absent = no token).
    File(PathBuf),
}

/// A client of a served strata API (`http://127.0.0.1:port`), cheap to clone.
#[derive(Debug, Clone)]
pub struct Api {
    url: String,
    token: Token,
    client: reqwest::Client,
}

impl Api {
    /// A client of `url` without a token: 300 s timeout, up to 64 idle
    /// connections kept (closed-loop load from many tasks).
    ///
    /// Panics if reqwest cannot build a client (test support).
    pub fn new(url: impl Into<String>) -> Api {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .pool_max_idle_per_host(64)
            .build()
            .unwrap_or_else(|e| panic!("strata-testkit: cannot build an HTTP client: {e}"));
        Api::with_client(url, client)
    }

    /// A client of `url` over `client` (its own timeout, pool…), without a token.
    pub fn with_client(url: impl Into<String>, client: reqwest::Client) -> Api {
        Api {
            url: url.into(),
            token: Token::None,
            client,
        }
    }

    /// The same client with bearer `token`.
    pub fn bearer(self, token: impl Into<String>) -> Api {
        Api {
            token: Token::Fixed(token.into()),
            ..self
        }
    }

    /// The same client with the bootstrap admin token a daemon wrote to
    /// `<data_dir>/admin.token`, read now (none when there is no such file).
    pub fn admin_token_of(self, data_dir: &Path) -> Api {
        match read_token(&data_dir.join("admin.token")) {
            Some(t) => self.bearer(t),
            None => Api {
                token: Token::None,
                ..self
            },
        }
    }

    /// The same client with the token of file `path`, read at every request
    /// (for a daemon that writes it later, or again after a restart).
    pub fn token_file(self, path: impl Into<PathBuf>) -> Api {
        Api {
            token: Token::File(path.into()),
            ..self
        }
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The bearer token requests carry now, if any.
    pub fn token(&self) -> Option<String> {
        match &self.token {
            Token::None => None,
            Token::Fixed(t) => Some(t.clone()),
            Token::File(p) => read_token(p),
        }
    }

    /// The underlying HTTP client (for a request with another token).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// A request `method path` with the token set.
    pub fn req(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let rb = self.client.request(method, format!("{}{path}", self.url));
        match self.token() {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// A request with an optional JSON body: the status and the JSON answer
    /// (`Null` when the answer is not JSON).
    pub async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), ApiError> {
        let what = format!("{method} {path}");
        let mut rb = self.req(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let resp = rb.send().await.map_err(transport(&what))?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(transport(&what))?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    /// Like [`Api::json`], but any status other than `want` is an error.
    pub async fn expect(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        want: u16,
    ) -> Result<Value, ApiError> {
        let what = format!("{method} {path}");
        let (status, v) = self.json(method, path, body).await?;
        if status != want {
            return Err(ApiError::Status {
                what,
                status,
                body: v.to_string(),
            });
        }
        Ok(v)
    }

    /// A request with a raw body: the status and the raw answer.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, Vec<u8>), ApiError> {
        let what = format!("{method} {path}");
        let resp = self
            .req(method, path)
            .body(body)
            .send()
            .await
            .map_err(transport(&what))?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(transport(&what))?;
        Ok((status, bytes.to_vec()))
    }

    /// `strata_events_total{kind="<kind>"}` from the daemon's `/metrics`
    /// (0 while it has counted none).
    pub async fn events_total(&self, kind: &str) -> Result<u64, ApiError> {
        let (status, body) = self.raw(Method::GET, "/metrics", Vec::new()).await?;
        if status != 200 {
            return Err(ApiError::Status {
                what: "GET /metrics".into(),
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        let key = format!("strata_events_total{{kind=\"{kind}\"}} ");
        Ok(String::from_utf8_lossy(&body)
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64))
    }

    /// `POST /v1/sandboxes/{id}/exec` with `body` (`{"cmd": [...], ...}`),
    /// the NDJSON answer read to its end as it streams, each line timed.
    /// A refused exec is an [`Exec`] with that status and the error body.
    pub async fn exec(&self, id: &str, body: Value) -> Result<Exec, ApiError> {
        let path = format!("/v1/sandboxes/{id}/exec");
        let what = format!("POST {path}");
        let t0 = Instant::now();
        let resp = self
            .req(Method::POST, &path)
            .json(&body)
            .send()
            .await
            .map_err(transport(&what))?;
        let mut out = Exec {
            status: resp.status().as_u16(),
            ..Exec::default()
        };
        if out.status != 200 {
            let bytes = resp.bytes().await.map_err(transport(&what))?;
            out.error = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            return Ok(out);
        }
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            buf.extend_from_slice(&chunk.map_err(transport(&what))?);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                out.take_line(&line, t0.elapsed())
                    .map_err(|message| ApiError::Stream {
                        what: what.clone(),
                        message,
                    })?;
            }
        }
        if !buf.iter().all(u8::is_ascii_whitespace) {
            out.take_line(&buf, t0.elapsed())
                .map_err(|message| ApiError::Stream {
                    what: what.clone(),
                    message,
                })?;
        }
        Ok(out)
    }

    /// Runs `cmd` (argv) in sandbox `id`: its exit code and its stdout. An
    /// exec the API refuses, or a stream without an exit line, is an error.
    pub async fn exec_output(&self, id: &str, cmd: &[&str]) -> Result<(i64, String), ApiError> {
        let e = self.exec(id, json!({ "cmd": cmd })).await?;
        let what = || format!("POST /v1/sandboxes/{id}/exec");
        if e.status != 200 {
            return Err(ApiError::Status {
                what: what(),
                status: e.status,
                body: e.error.to_string(),
            });
        }
        let code = e.code.ok_or_else(|| ApiError::Stream {
            what: what(),
            message: format!("no exit line (error line: {})", e.error),
        })?;
        Ok((code, String::from_utf8_lossy(&e.stdout).into_owned()))
    }
}

fn read_token(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
}

fn transport(what: &str) -> impl Fn(reqwest::Error) -> ApiError + '_ {
    move |source| ApiError::Transport {
        what: what.to_owned(),
        source,
    }
}

/// The outcome of an exec through the API.
#[derive(Debug, Default)]
pub struct Exec {
    /// HTTP status.
    pub status: u16,
    /// Exit code, once the exit line came.
    pub code: Option<i64>,
    /// Collected stdout.
    pub stdout: Vec<u8>,
    /// Collected stderr.
    pub stderr: Vec<u8>,
    /// When each stdout line arrived (since the request was sent).
    pub stdout_at: Vec<Duration>,
    /// When the exit line arrived.
    pub exit_at: Option<Duration>,
    /// The error body (status other than 200) or an error line of the stream.
    pub error: Value,
}

impl Exec {
    /// Stdout as trimmed text.
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).trim().to_owned()
    }

    /// Takes one NDJSON line of the stream that arrived `at`.
    fn take_line(&mut self, line: &[u8], at: Duration) -> Result<(), String> {
        let v: Value = serde_json::from_slice(line).map_err(|e| {
            format!(
                "not an NDJSON line ({e}): {}",
                String::from_utf8_lossy(line)
            )
        })?;
        let b64 = base64::engine::general_purpose::STANDARD;
        let decode = |s: &str| b64.decode(s).map_err(|e| format!("base64 ({e}): {s}"));
        if let Some(s) = v["stdout"].as_str() {
            self.stdout.extend(decode(s)?);
            self.stdout_at.push(at);
        } else if let Some(s) = v["stderr"].as_str() {
            self.stderr.extend(decode(s)?);
        } else if v.get("exit").is_some() {
            self.code = v["exit"]["code"].as_i64();
            self.exit_at = Some(at);
        } else {
            self.error = v;
        }
        Ok(())
    }
}

/// A router served on a loopback port; the server stops when this is dropped.
#[derive(Debug)]
#[must_use = "the server stops when this value is dropped"]
pub struct Served {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Served {
    /// Leaves the server running until its tokio runtime ends; its URL.
    pub fn detach(mut self) -> String {
        // Dropping a JoinHandle detaches its task.
        self.task.take();
        std::mem::take(&mut self.url)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Serves `router` on a free loopback port (on the current tokio runtime).
pub async fn serve(router: axum::Router) -> std::io::Result<Served> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Served {
        url,
        task: Some(task),
    })
}

#[cfg(test)]
mod tests {
    use axum::routing::{get, post};

    use super::*;

    fn router() -> axum::Router {
        axum::Router::new()
            .route(
                "/v1/echo",
                post(|headers: axum::http::HeaderMap, body: String| async move {
                    let auth = headers
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    axum::Json(json!({ "auth": auth, "body": body }))
                }),
            )
            .route("/v1/text", get(|| async { "plain" }))
            .route(
                "/v1/sandboxes/sb-1/exec",
                post(|| async {
                    "{\"stdout\":\"aGkK\"}\n{\"stderr\":\"ZXJy\"}\n{\"exit\":{\"code\":3}}\n"
                }),
            )
            .route(
                "/v1/sandboxes/sb-2/exec",
                post(|| async { "{\"stdout\":\"aGkK\"}\n" }),
            )
    }

    #[test]
    fn json_token_expect_and_exec() {
        crate::tokio_rt().block_on(async {
            let served = serve(router()).await.expect("serve");
            let dir = crate::scratch_dir("tk-http");
            let api = Api::new(served.url.clone()).admin_token_of(dir.path());
            assert_eq!(api.token(), None);

            let (s, v) = api
                .json(Method::POST, "/v1/echo", Some(json!({"a": 1})))
                .await
                .expect("echo");
            assert_eq!(s, 200);
            assert_eq!(v["auth"], "");
            assert_eq!(v["body"], "{\"a\":1}");
            let (s, v) = api.json(Method::GET, "/v1/text", None).await.expect("text");
            assert_eq!((s, v), (200, Value::Null));

            let file = dir.path().join("admin.token");
            let later = api.clone().token_file(&file);
            assert_eq!(later.token(), None);
            std::fs::write(&file, "secret\n").expect("token file");
            let v = later
                .expect(Method::POST, "/v1/echo", None, 200)
                .await
                .expect("echo");
            assert_eq!(v["auth"], "Bearer secret");
            let now = Api::new(served.url.clone()).admin_token_of(dir.path());
            assert_eq!(now.token().as_deref(), Some("secret"));

            let e = api
                .expect(Method::GET, "/v1/missing", None, 200)
                .await
                .expect_err("404");
            assert!(e.to_string().starts_with("GET /v1/missing: 404"), "{e}");

            let e = api.exec("sb-1", json!({"cmd": ["x"]})).await.expect("exec");
            assert_eq!((e.status, e.code, e.out()), (200, Some(3), "hi".to_owned()));
            assert_eq!(e.stderr, b"err");
            assert_eq!(e.stdout_at.len(), 1);
            assert!(e.exit_at.is_some());
            let (code, out) = api.exec_output("sb-1", &["x"]).await.expect("output");
            assert_eq!((code, out.as_str()), (3, "hi\n"));
            let e = api.exec_output("sb-2", &["x"]).await.expect_err("no exit");
            assert!(matches!(e, ApiError::Stream { .. }), "{e}");
            let e = api.exec_output("sb-3", &["x"]).await.expect_err("404");
            assert!(matches!(e, ApiError::Status { status: 404, .. }), "{e}");

            let kept = serve(router()).await.expect("serve").detach();
            let (s, _) = Api::new(kept)
                .json(Method::GET, "/v1/text", None)
                .await
                .expect("detached");
            assert_eq!(s, 200);

            let url = served.url.clone();
            drop(served);
            tokio::time::sleep(Duration::from_millis(50)).await;
            let gone = Api::new(url).json(Method::GET, "/v1/text", None).await;
            assert!(matches!(gone, Err(ApiError::Transport { .. })), "{gone:?}");
        });
    }
}
