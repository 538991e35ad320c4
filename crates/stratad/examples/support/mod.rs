//! Shared by the stratad examples (`api_bench`): argument
//! parsing, the daemon served on a loopback port, an HTTP client with the
//! bootstrap admin token, and the teardown that leaves no VM or mount behind.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{json, Value};
use stratad::App;

/// Result of the benchmarks.
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `--name N` from the command line, else `default`.
pub fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A client of the served API.
pub struct Http {
    url: String,
    token: Option<String>,
    client: reqwest::Client,
}

impl Http {
    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let rb = self.client.request(method, format!("{}{path}", self.url));
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub async fn json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Res<(u16, Value)> {
        let mut rb = self.req(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let resp = rb.send().await?;
        let s = resp.status().as_u16();
        let b = resp.bytes().await?;
        Ok((s, serde_json::from_slice(&b).unwrap_or(Value::Null)))
    }

    /// Exec through the API, reading the ndjson stream to its exit line.
    pub async fn exec_true(&self, id: &str) -> Res<()> {
        let resp = self
            .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/exec"))
            .json(&json!({"cmd": ["true"]}))
            .send()
            .await?;
        if resp.status().as_u16() != 200 {
            return Err(format!("exec: {} {}", resp.status(), resp.text().await?).into());
        }
        let mut s = resp.bytes_stream();
        let mut body = Vec::new();
        while let Some(c) = s.next().await {
            body.extend_from_slice(&c?);
        }
        let text = String::from_utf8_lossy(&body);
        if !text.contains("\"exit\":{\"code\":0") {
            return Err(format!("exec answered {text}").into());
        }
        Ok(())
    }
}

pub async fn serve(app: &Arc<App>) -> Res<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let router = app.router();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(url)
}

pub fn http(url: String, data_dir: &Path) -> Res<Http> {
    Ok(Http {
        url,
        token: std::fs::read_to_string(data_dir.join("admin.token"))
            .ok()
            .map(|t| t.trim().to_owned()),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()?,
    })
}

/// Kills the QEMUs of `root/run`, unmounts and detaches `root/data/pool`, removes `root`.
pub fn cleanup(root: &Path) {
    let mnt = root.join("data/pool");
    let run = root.join("run");
    let vm_dirs = std::fs::read_dir(&run).into_iter().flatten().flatten();
    for pid in vm_dirs.filter_map(|e| strata_vmm::qemu_in_run_dir(&e.path())) {
        // SAFETY: kill(2) on a QEMU whose pid file and command line name this
        // benchmark's run dir.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    if let Err(e) =
        strata_storage::unmount_image(&mnt, &root.join("data/pool.img"), Duration::from_secs(10))
    {
        eprintln!("teardown: {e}");
    }
    let _ = std::fs::remove_dir_all(root);
}
