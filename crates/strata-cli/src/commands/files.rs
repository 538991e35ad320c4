//! `strata files put|get|ls`: stream files in and out of a sandbox.

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Subcommand;
use reqwest::header::CONTENT_LENGTH;
use reqwest::Method;
use serde_json::json;
use tokio::io::AsyncWriteExt as _;

use super::Ctx;
use crate::human;
use crate::views::{items, FileEntry};

/// `strata files ...`
#[derive(Debug, Subcommand)]
pub enum FilesCmd {
    /// Upload LOCAL (or `-` for stdin) to REMOTE in the sandbox.
    Put {
        /// Sandbox id.
        id: String,
        /// Local file, or `-` for stdin.
        local: PathBuf,
        /// Absolute guest path.
        remote: String,
        /// Permission bits in octal [default: the local file's].
        #[arg(long, value_parser = parse_mode)]
        mode: Option<u32>,
    },
    /// Download REMOTE from the sandbox to LOCAL (or `-` for stdout).
    Get {
        /// Sandbox id.
        id: String,
        /// Absolute guest path.
        remote: String,
        /// Local file, or `-` for stdout.
        local: PathBuf,
    },
    /// List a guest directory.
    Ls {
        /// Sandbox id.
        id: String,
        /// Absolute guest path.
        #[arg(default_value = "/")]
        path: String,
    },
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?}: expected octal permission bits, e.g. 644"))
}

/// Runs a files command.
pub async fn run(ctx: &Ctx, cmd: FilesCmd) -> anyhow::Result<i32> {
    match cmd {
        FilesCmd::Put {
            id,
            local,
            remote,
            mode,
        } => put(ctx, &id, &local, &remote, mode).await,
        FilesCmd::Get { id, remote, local } => get(ctx, &id, &remote, &local).await,
        FilesCmd::Ls { id, path } => ls(ctx, &id, &path).await,
    }
}

fn is_dash(p: &std::path::Path) -> bool {
    p.as_os_str() == "-"
}

async fn put(
    ctx: &Ctx,
    id: &str,
    local: &std::path::Path,
    remote: &str,
    mode: Option<u32>,
) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let (body, len, local_mode) = if is_dash(local) {
        let stdin = tokio_util::io::ReaderStream::new(tokio::io::stdin());
        (reqwest::Body::wrap_stream(stdin), None, None)
    } else {
        let f = tokio::fs::File::open(local)
            .await
            .with_context(|| format!("cannot open {}", local.display()))?;
        let meta = f
            .metadata()
            .await
            .with_context(|| format!("cannot stat {}", local.display()))?;
        if !meta.is_file() {
            anyhow::bail!("{} is not a regular file", local.display());
        }
        let stream = tokio_util::io::ReaderStream::with_capacity(f, 256 * 1024);
        (
            reqwest::Body::wrap_stream(stream),
            Some(meta.len()),
            Some(meta.permissions().mode() & 0o7777),
        )
    };
    let mode = mode.or(local_mode).map(|m| format!("{m:o}"));
    let mut q = vec![("path", remote)];
    if let Some(m) = &mode {
        q.push(("mode", m));
    }
    let url = client.url(&["v1", "sandboxes", id, "files"], &q);
    let mut rb = client.request(Method::PUT, url).body(body);
    if let Some(n) = len {
        rb = rb.header(CONTENT_LENGTH, n);
    }
    let v = client.json_call(rb).await?;
    ctx.emit(&v, || {
        let n = v
            .get("bytes")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        Ok(format!("{remote}: {} written\n", human::bytes(n)))
    })?;
    Ok(0)
}

async fn get(ctx: &Ctx, id: &str, remote: &str, local: &std::path::Path) -> anyhow::Result<i32> {
    let client = ctx.client()?;
    let url = client.url(&["v1", "sandboxes", id, "files"], &[("path", remote)]);
    let resp = client.send_call(client.request(Method::GET, url)).await?;
    let mut written: u64 = 0;
    if is_dash(local) {
        let mut out = tokio::io::stdout();
        let mut stream = resp.bytes_stream();
        use futures::StreamExt as _;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.context("download interrupted")?;
            out.write_all(&chunk)
                .await
                .context("cannot write to stdout")?;
        }
        out.flush().await.context("cannot write to stdout")?;
        return Ok(0);
    }
    // Written beside the target and renamed at the end: no half file on failure.
    let dir = match local.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".strata-get-")
        .tempfile_in(&dir)
        .with_context(|| format!("cannot create a file in {}", dir.display()))?;
    let mut f = tokio::fs::File::from_std(
        tmp.reopen()
            .with_context(|| format!("cannot open {}", tmp.path().display()))?,
    );
    {
        let mut stream = resp.bytes_stream();
        use futures::StreamExt as _;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.context("download interrupted")?;
            f.write_all(&chunk)
                .await
                .with_context(|| format!("cannot write {}", tmp.path().display()))?;
            written += chunk.len() as u64;
        }
    }
    f.flush().await?;
    f.sync_all().await?;
    tmp.persist(local)
        .with_context(|| format!("cannot write {}", local.display()))?;
    let v = json!({ "path": remote, "local": local, "bytes": written });
    ctx.emit(&v, || {
        Ok(format!(
            "{remote} → {}: {}\n",
            local.display(),
            human::bytes(written)
        ))
    })?;
    Ok(0)
}

async fn ls(ctx: &Ctx, id: &str, path: &str) -> anyhow::Result<i32> {
    let v = ctx
        .client()?
        .get_call(&["v1", "sandboxes", id, "files", "list"], &[("path", path)])
        .await?;
    ctx.emit(&v, || Ok(ls_table(&items::<FileEntry>(&v)?)))?;
    Ok(0)
}

/// The `ls` table: names are the guest's, shown escaped (a name with a
/// newline or a terminal escape stays one row of plain text).
fn ls_table(entries: &[FileEntry]) -> String {
    human::table_of(
        &["MODE", "KIND", ">SIZE", "MODIFIED", "NAME"],
        entries,
        |e| {
            let mtime = chrono::DateTime::from_timestamp(e.mtime, 0)
                .map(human::local_time)
                .unwrap_or_default();
            let name = if e.kind == "dir" {
                format!("{}/", e.name)
            } else {
                e.name.clone()
            };
            vec![
                format!("{:04o}", e.mode),
                e.kind.clone(),
                human::bytes(e.size),
                mtime,
                name,
            ]
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_file_names_are_listed_without_terminal_escapes() {
        let entries = [
            FileEntry {
                name: "evil\n-rw-r--r--  file  0  fake.txt".into(),
                kind: "file".into(),
                ..FileEntry::default()
            },
            FileEntry {
                name: "\u{1b}]0;pwned\u{7}\u{1b}[2Jclear".into(),
                kind: "dir".into(),
                ..FileEntry::default()
            },
        ];
        let out = ls_table(&entries);
        assert_eq!(
            out.lines().count(),
            3,
            "a header and one row per entry: {out}"
        );
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(
            out.contains("evil\\n-rw-r--r--  file  0  fake.txt"),
            "{out}"
        );
        assert!(
            out.contains("\\u{1b}]0;pwned\\u{7}\\u{1b}[2Jclear/"),
            "{out}"
        );
    }

    #[test]
    fn modes_are_octal() {
        assert_eq!(parse_mode("644").unwrap(), 0o644);
        assert_eq!(parse_mode("0o755").unwrap(), 0o755);
        assert!(parse_mode("999").is_err());
        assert!(parse_mode("77777").is_err());
    }
}
