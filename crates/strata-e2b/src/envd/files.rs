//! `/files`: `GET /files?path=` (download) and `POST /files?path=`
//! (multipart, field `file`, or octet-stream) with errors as
//! `{"code": <http status>, "message": "…"}`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::json;
use strata_core::SandboxId;
use stratad::engine::{FileKind, RuntimeError};

use super::{parent, read, write};
use crate::connect::{Code, ConnectError};
use crate::error::service_err;
use crate::E2b;

fn files_err(e: ConnectError) -> Response {
    let status = match e.code {
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        c => c.http_status(),
    };
    (
        status,
        Json(json!({"code": status.as_u16(), "message": e.message})),
    )
        .into_response()
}

fn query_path(st: &E2b, raw: Option<&str>) -> Option<String> {
    form_urlencoded::parse(raw.unwrap_or("").as_bytes())
        .find(|(k, _)| k == "path")
        .map(|(_, v)| st.guest_path(&v))
}

/// `GET /files?path=` → the file's bytes (404 when missing).
pub async fn download(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Response {
    let id = match st.envd_sandbox(&headers) {
        Ok(id) => id,
        Err(e) => return files_err(e),
    };
    let Some(path) = query_path(&st, raw.as_deref()) else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    let g = match st.envd_grant(&id, read(&path)).await {
        Ok(g) => g,
        Err(e) => return files_err(e),
    };
    match st.svc.stat(&g, &path).await {
        Ok(s) if s.kind == FileKind::Dir => {
            return files_err(ConnectError::new(
                Code::InvalidArgument,
                format!("path {path} is a directory"),
            ))
        }
        Ok(_) => {}
        Err(e) => return files_err(service_err(e)),
    }
    match st.svc.read_file(&g, &path).await {
        Ok(stream) => {
            let body = Body::from_stream(stream.map_err(std::io::Error::other));
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                body,
            )
                .into_response()
        }
        Err(e) => files_err(service_err(e)),
    }
}

/// One part of a `multipart/form-data` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// Form field name.
    pub name: String,
    /// File name, when given.
    pub filename: Option<String>,
    /// Content.
    pub data: Bytes,
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

fn disposition_param(line: &str, key: &str) -> Option<String> {
    for item in line.split(';').skip(1) {
        let item = item.trim();
        if let Some(v) = item
            .strip_prefix(key)
            .and_then(|r| r.trim_start().strip_prefix('='))
        {
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|s| s.strip_suffix('"'))
                .unwrap_or(v);
            return Some(v.replace("\\\"", "\"").replace("%22", "\""));
        }
    }
    None
}

/// Parses a complete `multipart/form-data` body.
pub fn parse_multipart(body: &Bytes, boundary: &str) -> Result<Vec<Part>, String> {
    let delim = format!("--{boundary}");
    let d = delim.as_bytes();
    let mut pos = find(body, d, 0).ok_or("no multipart boundary in the body")? + d.len();
    let mut parts = Vec::new();
    loop {
        if body.get(pos..pos + 2) == Some(b"--") {
            return Ok(parts);
        }
        if body.get(pos..pos + 2) == Some(b"\r\n") {
            pos += 2;
        }
        let hend = find(body, b"\r\n\r\n", pos).ok_or("truncated part headers")?;
        let head = String::from_utf8_lossy(&body[pos..hend]).into_owned();
        let start = hend + 4;
        let next_delim = format!("\r\n{delim}");
        let end = find(body, next_delim.as_bytes(), start).ok_or("unterminated part")?;
        let mut name = String::new();
        let mut filename = None;
        for line in head.split("\r\n") {
            if line
                .to_ascii_lowercase()
                .starts_with("content-disposition:")
            {
                name = disposition_param(line, "name").unwrap_or_default();
                filename = disposition_param(line, "filename");
            }
        }
        parts.push(Part {
            name,
            filename,
            data: body.slice(start..end),
        });
        pos = end + next_delim.len();
    }
}

async fn write_one(
    st: &Arc<E2b>,
    id: &SandboxId,
    path: &str,
    body: stratad::engine::ByteStream,
) -> Result<serde_json::Value, ConnectError> {
    let g = st.envd_grant(id, write(path)).await?;
    if let Some(dir) = parent(path) {
        if dir != "/" {
            st.svc.mkdir(&g, dir, true).await.map_err(service_err)?;
        }
    }
    st.svc
        .write_file(&g, path, 0o644, body)
        .await
        .map_err(service_err)?;
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    Ok(json!({"name": name, "type": "file", "path": path}))
}

/// `POST /files?path=`: multipart (field `file`) or octet-stream → `[WriteInfo]`.
pub async fn upload(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Body,
) -> Response {
    let id = match st.envd_sandbox(&headers) {
        Ok(id) => id,
        Err(e) => return files_err(e),
    };
    let path = query_path(&st, raw.as_deref());
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    if headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v != "identity")
    {
        return files_err(ConnectError::new(
            Code::Unimplemented,
            "compressed uploads are not supported",
        ));
    }
    if let Some(b) = ctype.strip_prefix("multipart/form-data") {
        let Some(boundary) = disposition_param(b, "boundary") else {
            return files_err(ConnectError::new(
                Code::InvalidArgument,
                "multipart body without boundary",
            ));
        };
        let bytes = match axum::body::to_bytes(body, usize::MAX).await {
            Ok(b) => b,
            Err(e) => return files_err(ConnectError::new(Code::InvalidArgument, e.to_string())),
        };
        let parts = match parse_multipart(&bytes, &boundary) {
            Ok(p) => p,
            Err(e) => return files_err(ConnectError::new(Code::InvalidArgument, e)),
        };
        let files: Vec<Part> = parts.into_iter().filter(|p| p.name == "file").collect();
        let mut out = Vec::new();
        for p in &files {
            let target = match (&path, &p.filename) {
                (Some(q), _) if files.len() == 1 => q.clone(),
                (_, Some(f)) => st.guest_path(f),
                (Some(q), None) => q.clone(),
                (None, None) => {
                    return files_err(ConnectError::new(Code::InvalidArgument, "missing path"))
                }
            };
            let data = p.data.clone();
            let stream = futures::stream::iter([Ok::<_, RuntimeError>(data)]).boxed();
            match write_one(&st, &id, &target, stream).await {
                Ok(v) => out.push(v),
                Err(e) => return files_err(e),
            }
        }
        return Json(out).into_response();
    }
    let Some(path) = path else {
        return files_err(ConnectError::new(Code::InvalidArgument, "missing path"));
    };
    let stream = body
        .into_data_stream()
        .map_err(|e| RuntimeError::Other(format!("upload body: {e}")))
        .boxed();
    match write_one(&st, &id, &path, stream).await {
        Ok(v) => Json(vec![v]).into_response(),
        Err(e) => files_err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_as_httpx_sends_it() {
        let body = Bytes::from_static(
            b"--abc\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/root/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\nworld\r\n--abc\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--abc--\r\n",
        );
        let parts = parse_multipart(&body, "abc").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("/root/a.txt"));
        assert_eq!(&parts[0].data[..], b"hello\r\nworld");
        assert_eq!(parts[1].name, "other");
        assert_eq!(&parts[1].data[..], b"x");
        assert!(parse_multipart(&Bytes::from_static(b"--abc\r\nx"), "abc").is_err());
        assert_eq!(
            disposition_param("multipart/form-data; boundary=xyz", "boundary").as_deref(),
            Some("xyz")
        );
    }
}
