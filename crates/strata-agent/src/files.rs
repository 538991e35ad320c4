//! File operations: streaming upload/download with bounded memory, list,
//! stat, mkdir -p, remove.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use strata_proto::client::WRITE_WINDOW;
use strata_proto::frame::{FrameKind, MAX_FILE_CHUNK};
use strata_proto::{DirEntry, FileKind, FileStat, RemoteErrorKind, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

use crate::error::Fail;
use crate::requests::{Slot, UploadMsg};

/// Validates a request path: absolute, no NUL.
pub fn check_path(p: &str) -> Result<PathBuf, Fail> {
    if p.contains('\0') {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            "path contains a NUL byte",
        ));
    }
    if !p.starts_with('/') {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            format!("path {p:?} is not absolute"),
        ));
    }
    Ok(PathBuf::from(p))
}

fn kind_of(ft: std::fs::FileType) -> FileKind {
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

/// lstat; `None` if the path does not exist.
pub fn stat(p: &str) -> Result<Option<FileStat>, Fail> {
    let path = check_path(p)?;
    match std::fs::symlink_metadata(&path) {
        Ok(m) => Ok(Some(FileStat {
            kind: kind_of(m.file_type()),
            size: m.len(),
            mode: m.mode() & 0o7777,
            mtime: m.mtime(),
            uid: m.uid(),
            gid: m.gid(),
        })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Fail::io(&e, p)),
    }
}

/// Lists a directory, sorted by name.
pub fn list_dir(p: &str) -> Result<Vec<DirEntry>, Fail> {
    let path = check_path(p)?;
    let rd = std::fs::read_dir(&path).map_err(|e| Fail::io(&e, p))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Fail::io(&e, p))?;
        let Ok(m) = std::fs::symlink_metadata(entry.path()) else {
            continue; // vanished meanwhile
        };
        out.push(DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            kind: kind_of(m.file_type()),
            size: m.len(),
            mode: m.mode() & 0o7777,
            mtime: m.mtime(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// `mkdir -p`.
pub fn mkdir_all(p: &str, mode: Option<u32>) -> Result<(), Fail> {
    let path = check_path(p)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode.unwrap_or(0o755) & 0o7777)
        .create(&path)
        .map_err(|e| Fail::io(&e, p))?;
    if !path.is_dir() {
        return Err(Fail::new(
            RemoteErrorKind::NotADirectory,
            format!("{p} exists and is not a directory"),
        ));
    }
    Ok(())
}

/// Removes a file, symlink or directory.
pub fn remove(p: &str, recursive: bool) -> Result<(), Fail> {
    let path = check_path(p)?;
    if path.components().count() <= 1 {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            "refusing to remove /",
        ));
    }
    let m = std::fs::symlink_metadata(&path).map_err(|e| Fail::io(&e, p))?;
    let r = if m.is_dir() {
        if recursive {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_dir(&path)
        }
    } else {
        std::fs::remove_file(&path)
    };
    r.map_err(|e| Fail::io(&e, p))
}

fn temp_path(dest: &Path, id: u32) -> Result<PathBuf, Fail> {
    let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
        return Err(Fail::new(
            RemoteErrorKind::InvalidArgument,
            "path has no file name",
        ));
    };
    Ok(parent.join(format!(
        ".{}.strata-upload-{}-{id}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Prepares an upload: validates and creates the temporary file.
pub fn open_upload(p: &str, id: u32) -> Result<(PathBuf, PathBuf, std::fs::File), Fail> {
    let dest = check_path(p)?;
    if dest.is_dir() {
        return Err(Fail::new(
            RemoteErrorKind::IsADirectory,
            format!("{p} is a directory"),
        ));
    }
    let tmp = temp_path(&dest, id)?;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| Fail::io(&e, p))?;
    Ok((dest, tmp, f))
}

/// Upload task: writes chunks, acks them, renames into place at the end.
/// On any failure (or a vanished session) the temporary file is removed.
pub async fn upload(
    dest: PathBuf,
    tmp: PathBuf,
    file: std::fs::File,
    mode: Option<u32>,
    mut rx: mpsc::Receiver<UploadMsg>,
    slot: Slot,
) {
    let (id, out) = (slot.id, &slot.out);
    let mut file = tokio::fs::File::from_std(file);
    let mut total = 0u64;
    let shown = dest.display().to_string();
    let result: Result<Option<u64>, Fail> = async {
        loop {
            match rx.recv().await {
                None => return Ok(None),
                Some(UploadMsg::Data(b)) => {
                    file.write_all(&b).await.map_err(|e| Fail::io(&e, &shown))?;
                    total += b.len() as u64;
                    out.msg(id, &Response::Ack { bytes: total }).await;
                }
                Some(UploadMsg::End) => {
                    file.flush().await.map_err(|e| Fail::io(&e, &shown))?;
                    file.sync_data().await.map_err(|e| Fail::io(&e, &shown))?;
                    let perm = std::fs::Permissions::from_mode(mode.unwrap_or(0o644) & 0o7777);
                    tokio::fs::set_permissions(&tmp, perm)
                        .await
                        .map_err(|e| Fail::io(&e, &shown))?;
                    tokio::fs::rename(&tmp, &dest)
                        .await
                        .map_err(|e| Fail::io(&e, &shown))?;
                    return Ok(Some(total));
                }
            }
        }
    }
    .await;
    drop(file);
    match result {
        Ok(Some(bytes)) => out.msg(id, &Response::Done { bytes }).await,
        Ok(None) => {
            tracing::info!(path = %shown, "upload abandoned by the host; removing partial file");
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        Err(f) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            out.error(id, f).await;
        }
    }
    slot.release();
}

/// Opens a file for download.
pub fn open_download(p: &str) -> Result<(std::fs::File, u64), Fail> {
    let path = check_path(p)?;
    let f = std::fs::File::open(&path).map_err(|e| Fail::io(&e, p))?;
    let m = f.metadata().map_err(|e| Fail::io(&e, p))?;
    if m.is_dir() {
        return Err(Fail::new(
            RemoteErrorKind::IsADirectory,
            format!("{p} is a directory"),
        ));
    }
    Ok((f, m.len()))
}

/// Download task: sends chunks while the host's window allows.
pub async fn download(file: std::fs::File, size: u64, mut acks: watch::Receiver<u64>, slot: Slot) {
    let (id, out) = (slot.id, &slot.out);
    let mut file = tokio::fs::File::from_std(file);
    out.msg(id, &Response::FileStart { size }).await;
    let mut sent = 0u64;
    let mut buf = vec![0u8; MAX_FILE_CHUNK];
    loop {
        while sent.saturating_sub(*acks.borrow()) >= WRITE_WINDOW {
            if acks.changed().await.is_err() {
                // Session gone.
                slot.release();
                return;
            }
        }
        // Fill a whole chunk when possible.
        let mut n = 0;
        let mut err = None;
        while n < buf.len() {
            match file.read(&mut buf[n..]).await {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = err {
            out.error(id, Fail::io(&e, "read")).await;
            break;
        }
        if n == 0 {
            out.msg(id, &Response::Done { bytes: sent }).await;
            break;
        }
        sent += n as u64;
        out.data(FrameKind::FileData, id, Bytes::copy_from_slice(&buf[..n]))
            .await;
    }
    slot.release();
}
