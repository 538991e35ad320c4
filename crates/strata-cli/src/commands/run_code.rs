//! `strata run-code ID <code | -f file>`: runs code in the code interpreter
//! of a sandbox made from the `code-interpreter` template (`POST
//! /v1/sandboxes/{id}/code`). Its stdout and stderr are printed as they
//! come; the cell's results after them: text to stdout, a png saved under
//! `--out-dir` (its path said on stderr). An error result prints its name,
//! value and traceback on stderr and exits 1. `--json` prints one object:
//! `{execution_count, stdout, stderr, results, error}`.

use std::io::Read as _;
use std::path::PathBuf;

use base64::Engine as _;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::exec::LineSplitter;
use super::Ctx;
use crate::api::ApiError;

/// `strata run-code`
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["code", "file"])))]
pub struct Args {
    /// Sandbox id (made from the code-interpreter template).
    pub id: String,
    /// The code to run.
    pub code: Option<String>,
    /// Read the code from this file (`-` for stdin).
    #[arg(short = 'f', long)]
    pub file: Option<PathBuf>,
    /// Language of the default context to run in (default python).
    #[arg(long, conflicts_with = "context")]
    pub language: Option<String>,
    /// An interpreter context id (the server's `POST /contexts`).
    #[arg(long)]
    pub context: Option<String>,
    /// Environment variable for this run, KEY=VALUE (repeatable).
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Seconds the whole run may take (the daemon's default: 300).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Save png (and jpeg, svg) results in this directory as
    /// `result-<n>.<ext>`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

fn body(a: &Args) -> anyhow::Result<Value> {
    let code = match (&a.code, &a.file) {
        (Some(c), _) => c.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            s
        }
        (None, Some(f)) => std::fs::read_to_string(f)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", f.display()))?,
        (None, None) => anyhow::bail!("give the code or -f FILE"),
    };
    let mut b = json!({ "code": code });
    if let Some(l) = &a.language {
        b["language"] = json!(l);
    }
    if let Some(c) = &a.context {
        b["context_id"] = json!(c);
    }
    if !a.env.is_empty() {
        let mut env = Map::new();
        for kv in &a.env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--env {kv:?}: expected KEY=VALUE"))?;
            env.insert(k.to_owned(), json!(v));
        }
        b["env_vars"] = Value::Object(env);
    }
    if let Some(t) = a.timeout {
        b["timeout"] = json!(t);
    }
    Ok(b)
}

/// What one run printed and returned.
#[derive(Debug, Default)]
struct Run {
    execution_count: Option<i64>,
    stdout: String,
    stderr: String,
    results: Vec<Value>,
    error: Option<Value>,
}

impl Run {
    /// Takes one stream line; prints stdout/stderr at once unless `quiet`.
    fn take(&mut self, line: &[u8], quiet: bool) -> Result<(), ApiError> {
        let v: Value = serde_json::from_slice(line).map_err(|e| ApiError::Protocol {
            url: "/v1/sandboxes/{id}/code".into(),
            reason: format!("a line of the interpreter's answer is not JSON: {e}"),
        })?;
        let text = || v["text"].as_str().unwrap_or_default().to_owned();
        match v["type"].as_str().unwrap_or_default() {
            "number_of_executions" => self.execution_count = v["execution_count"].as_i64(),
            "stdout" => {
                let t = text();
                if !quiet {
                    write_flush(&mut std::io::stdout().lock(), t.as_bytes());
                }
                self.stdout.push_str(&t);
            }
            "stderr" => {
                let t = text();
                if !quiet {
                    write_flush(&mut std::io::stderr().lock(), t.as_bytes());
                }
                self.stderr.push_str(&t);
            }
            "result" => self.results.push(v),
            "error" => self.error = Some(v),
            _ => {}
        }
        Ok(())
    }
}

fn write_flush(w: &mut dyn std::io::Write, b: &[u8]) {
    let _ = w.write_all(b);
    let _ = w.flush();
}

/// Writes `results`' images under `dir` (`result-<n>.<ext>`); returns the
/// paths written, by result index.
fn save_images(dir: &std::path::Path, results: &[Value]) -> anyhow::Result<Vec<(usize, PathBuf)>> {
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    let mut saved = Vec::new();
    for (i, r) in results.iter().enumerate() {
        for ext in ["png", "jpeg", "svg"] {
            let Some(data) = r[ext].as_str() else {
                continue;
            };
            let bytes = if ext == "svg" {
                data.as_bytes().to_vec()
            } else {
                base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .map_err(|e| anyhow::anyhow!("result {i}: {ext} is not base64: {e}"))?
            };
            let p = dir.join(format!("result-{}.{ext}", i + 1));
            std::fs::write(&p, bytes).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            saved.push((i, p));
        }
    }
    Ok(saved)
}

/// Runs `strata run-code`.
pub async fn run(ctx: &Ctx, a: Args) -> anyhow::Result<i32> {
    let b = body(&a)?;
    let client = ctx.client()?;
    let url = client.url(&["v1", "sandboxes", &a.id, "code"], &[]);
    let resp = client
        .send_call(client.request(Method::POST, url).json(&b))
        .await?;
    let mut run = Run::default();
    let mut splitter = LineSplitter::default();
    let quiet = ctx.json;
    client
        .for_each_chunk(resp, |chunk| {
            for line in splitter.push(chunk) {
                run.take(&line, quiet)?;
            }
            Ok(())
        })
        .await?;
    if let Some(last) = splitter.finish() {
        run.take(&last, quiet)?;
    }
    let saved = match &a.out_dir {
        Some(d) => save_images(d, &run.results)?,
        None => Vec::new(),
    };
    let failed = run.error.is_some();
    if ctx.json {
        let v = json!({
            "execution_count": run.execution_count,
            "stdout": run.stdout,
            "stderr": run.stderr,
            "results": run.results,
            "error": run.error,
            "saved": saved.iter().map(|(_, p)| p.display().to_string()).collect::<Vec<_>>(),
        });
        println!("{v}");
        return Ok(i32::from(failed));
    }
    for (i, r) in run.results.iter().enumerate() {
        let images: Vec<&PathBuf> = saved
            .iter()
            .filter(|(j, _)| *j == i)
            .map(|(_, p)| p)
            .collect();
        for p in &images {
            eprintln!("strata: result {} saved to {}", i + 1, p.display());
        }
        let has_image = ["png", "jpeg", "svg"].iter().any(|k| r[*k].is_string());
        if has_image && images.is_empty() {
            eprintln!("strata: result {} is an image (--out-dir saves it)", i + 1);
        }
        // A figure's text is its repr (`<Figure …>`): the image says it.
        if let Some(t) = r["text"].as_str().filter(|_| !has_image) {
            write_flush(&mut std::io::stdout().lock(), format!("{t}\n").as_bytes());
        }
    }
    if let Some(e) = &run.error {
        let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
        let tb = s("traceback");
        let last = format!("{}: {}", s("name"), s("value"));
        if !tb.is_empty() {
            eprintln!("{}", tb.trim_end());
        }
        // IPython's traceback ends with that line already.
        if !tb.trim_end().ends_with(&last) {
            eprintln!("{last}");
        }
    }
    Ok(i32::from(failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_sorted_into_output_results_and_the_error() {
        let mut r = Run::default();
        for l in [
            r#"{"type":"number_of_executions","execution_count":3}"#,
            r#"{"type":"stdout","text":"a\n"}"#,
            r#"{"type":"stderr","text":"b\n"}"#,
            r#"{"type":"result","text":"2","is_main_result":true}"#,
            r#"{"type":"keepalive"}"#,
            r#"{"type":"error","name":"ValueError","value":"x","traceback":"tb"}"#,
            r#"{"type":"end_of_execution"}"#,
        ] {
            r.take(l.as_bytes(), true).expect("line");
        }
        assert_eq!(r.execution_count, Some(3));
        assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("a\n", "b\n"));
        assert_eq!(r.results.len(), 1);
        assert_eq!(
            r.error.as_ref().map(|e| e["name"].clone()),
            Some(json!("ValueError"))
        );
        assert!(r.take(b"not json", true).is_err());
    }

    #[test]
    fn images_are_saved_by_result_index() {
        let dir = tempfile::tempdir().expect("dir");
        let png = base64::engine::general_purpose::STANDARD.encode(b"\x89PNGdata");
        let saved = save_images(
            dir.path(),
            &[
                json!({"text": "t"}),
                json!({"png": png, "text": "<Figure>"}),
            ],
        )
        .expect("saved");
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].0, 1);
        assert_eq!(std::fs::read(&saved[0].1).expect("read"), b"\x89PNGdata");
        assert!(saved[0].1.ends_with("result-2.png"));
    }
}
