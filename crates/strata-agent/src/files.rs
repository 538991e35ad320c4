//! File operations: streaming upload/download with bounded memory, list,
//! stat, mkdir -p, remove.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use strata_proto::client::WRITE_WINDOW;
use strata_proto::frame::{FrameKind, MAX_FILE_CHUNK};
use strata_proto::{
    DirEntry, EntryExt, FileKind, FileStat, RemoteErrorKind, Response, MAX_XATTR_BYTES,
};
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
            ext: Some(ext_of(&path, &m, &mut Names::default())),
        })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Fail::io(&e, p)),
    }
}

/// Lists a directory, sorted by name.
pub fn list_dir(p: &str) -> Result<Vec<DirEntry>, Fail> {
    let path = check_path(p)?;
    let rd = std::fs::read_dir(&path).map_err(|e| Fail::io(&e, p))?;
    let mut names = Names::default();
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
            ext: Some(ext_of(&entry.path(), &m, &mut names)),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// uid → login and gid → group names of the guest, read once per call from
/// `/etc/passwd` and `/etc/group` (a missing or unreadable file: no names).
#[derive(Default)]
struct Names {
    users: Option<std::collections::HashMap<u32, String>>,
    groups: Option<std::collections::HashMap<u32, String>>,
}

/// `name:x:id:…` lines of a passwd/group file: id → name.
fn id_names(text: &str) -> std::collections::HashMap<u32, String> {
    let mut out = std::collections::HashMap::new();
    for line in text.lines() {
        let mut f = line.split(':');
        let (Some(name), Some(_), Some(id)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if let Ok(id) = id.parse::<u32>() {
            out.entry(id).or_insert_with(|| name.to_owned());
        }
    }
    out
}

impl Names {
    fn user(&mut self, uid: u32) -> Option<String> {
        self.users
            .get_or_insert_with(|| {
                id_names(&std::fs::read_to_string("/etc/passwd").unwrap_or_default())
            })
            .get(&uid)
            .cloned()
    }

    fn group(&mut self, gid: u32) -> Option<String> {
        self.groups
            .get_or_insert_with(|| {
                id_names(&std::fs::read_to_string("/etc/group").unwrap_or_default())
            })
            .get(&gid)
            .cloned()
    }
}

/// Owner names, link target (all links followed) and `user.` attributes of
/// the entry at `path` whose lstat is `m`.
fn ext_of(path: &Path, m: &std::fs::Metadata, names: &mut Names) -> EntryExt {
    let mut ext = EntryExt {
        uid: m.uid(),
        gid: m.gid(),
        owner: names.user(m.uid()),
        group: names.group(m.gid()),
        ..EntryExt::default()
    };
    if m.file_type().is_symlink() {
        match std::fs::canonicalize(path) {
            Ok(t) => {
                if let Ok(tm) = std::fs::metadata(&t) {
                    ext.target_kind = Some(kind_of(tm.file_type()));
                    ext.target_mode = Some(tm.mode() & 0o7777);
                }
                ext.symlink_target = Some(t.to_string_lossy().into_owned());
            }
            Err(_) => ext.symlink_target = Some(path.to_string_lossy().into_owned()),
        }
    }
    ext.xattrs = user_xattrs(path);
    ext
}

fn c_path(path: &Path) -> Option<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).ok()
}

/// The `user.` attributes of `path` (not following a symlink) with UTF-8
/// names and values, at most [`MAX_XATTR_BYTES`] of them together (the
/// rest, in name order, left out). Errors (no xattr support …): none.
pub fn user_xattrs(path: &Path) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let Some(cp) = c_path(path) else {
        return out;
    };
    let mut list = vec![0u8; 4096];
    let n = loop {
        // SAFETY: `cp` is a NUL-terminated path; `list` is writable for
        // `list.len()` bytes and the kernel writes at most that many.
        let n = unsafe { libc::llistxattr(cp.as_ptr(), list.as_mut_ptr().cast(), list.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && list.len() < (1 << 16) {
            list.resize(list.len() * 4, 0);
            continue;
        }
        return out;
    };
    let mut names: Vec<&[u8]> = list[..n]
        .split(|b| *b == 0)
        .filter(|x| x.starts_with(b"user."))
        .collect();
    names.sort();
    let mut total = 0usize;
    let mut value = vec![0u8; MAX_XATTR_BYTES];
    for name in names {
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        // SAFETY: both strings are NUL-terminated; `value` is writable for
        // `value.len()` bytes and the kernel writes at most that many.
        let len = unsafe {
            libc::lgetxattr(
                cp.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len < 0 {
            continue; // removed meanwhile, or larger than the whole budget
        }
        let (Ok(k), Ok(v)) = (
            std::str::from_utf8(name),
            std::str::from_utf8(&value[..len as usize]),
        ) else {
            continue;
        };
        total += k.len() + v.len();
        if total > MAX_XATTR_BYTES {
            break;
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    out
}

/// [`strata_proto::Request::SetXattrs`]: the attributes of `p` named
/// `prefix…` become exactly `set`.
pub fn set_xattrs(
    p: &str,
    prefix: &str,
    set: &std::collections::BTreeMap<String, String>,
) -> Result<(), Fail> {
    let path = check_path(p)?;
    let bad = |m: String| Fail::new(RemoteErrorKind::InvalidArgument, m);
    if !prefix.starts_with("user.") {
        return Err(bad(format!(
            "attribute prefix {prefix:?} is not under user."
        )));
    }
    let size: usize = set.iter().map(|(k, v)| k.len() + v.len()).sum();
    if size > MAX_XATTR_BYTES {
        return Err(bad(format!(
            "attributes of {size} bytes (at most {MAX_XATTR_BYTES})"
        )));
    }
    for k in set.keys() {
        if !k.starts_with(prefix) || k.len() == prefix.len() || k.len() > 255 || k.contains('\0') {
            return Err(bad(format!(
                "attribute name {k:?} is not a name under {prefix}"
            )));
        }
    }
    let cp = c_path(&path).ok_or_else(|| bad("path contains a NUL byte".into()))?;
    std::fs::symlink_metadata(&path).map_err(|e| Fail::io(&e, p))?;
    for old in user_xattrs(&path).keys() {
        if old.starts_with(prefix) && !set.contains_key(old) {
            let Ok(cname) = std::ffi::CString::new(old.as_bytes()) else {
                continue;
            };
            // SAFETY: both strings are NUL-terminated.
            let r = unsafe { libc::lremovexattr(cp.as_ptr(), cname.as_ptr()) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENODATA) {
                    return Err(Fail::io(&e, p));
                }
            }
        }
    }
    for (k, v) in set {
        let cname = std::ffi::CString::new(k.as_bytes())
            .map_err(|_| bad(format!("attribute name {k:?} contains a NUL byte")))?;
        // SAFETY: `cp` and `cname` are NUL-terminated; `v` is readable for
        // `v.len()` bytes.
        let r =
            unsafe { libc::lsetxattr(cp.as_ptr(), cname.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if r != 0 {
            return Err(Fail::io(&std::io::Error::last_os_error(), p));
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn passwd_lines_name_ids() {
        let m = id_names("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\nbad\nx:x:nope:1\ndup:x:0:0::/:/bin/sh\n");
        assert_eq!(m.get(&0).map(String::as_str), Some("root"));
        assert_eq!(m.get(&1000).map(String::as_str), Some("user"));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn set_xattrs_replaces_its_namespace_and_stat_reports_it() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let p = f.to_str().unwrap();
        set_xattrs(
            p,
            "user.e2b.",
            &map(&[("user.e2b.a", "1"), ("user.e2b.b", "2")]),
        )
        .unwrap();
        set_xattrs(p, "user.other.", &map(&[("user.other.keep", "k")])).unwrap();
        // Replacing the namespace drops what is not named again, keeps others.
        set_xattrs(p, "user.e2b.", &map(&[("user.e2b.b", "3")])).unwrap();
        let ext = stat(p).unwrap().unwrap().ext.unwrap();
        assert_eq!(
            ext.xattrs,
            map(&[("user.e2b.b", "3"), ("user.other.keep", "k")])
        );
        assert_eq!(ext.uid, std::fs::metadata(&f).unwrap().uid());
        assert!(ext.symlink_target.is_none());
        // Outside the namespace or `user.`, too big: refused, nothing changes.
        assert!(set_xattrs(p, "user.e2b.", &map(&[("user.x", "1")])).is_err());
        assert!(set_xattrs(p, "trusted.", &map(&[("trusted.x", "1")])).is_err());
        let big = "v".repeat(MAX_XATTR_BYTES);
        assert!(set_xattrs(p, "user.e2b.", &map(&[("user.e2b.k", &big)])).is_err());
        assert_eq!(user_xattrs(&f), ext.xattrs);
    }

    #[test]
    fn a_symlink_reports_what_it_resolves_to() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir(real.join("sub")).unwrap();
        std::os::unix::fs::symlink("sub", real.join("l")).unwrap();
        std::os::unix::fs::symlink("nowhere", real.join("dangling")).unwrap();
        let listed = list_dir(real.to_str().unwrap()).unwrap();
        let l = listed.iter().find(|e| e.name == "l").unwrap();
        assert_eq!(l.kind, FileKind::Symlink);
        let ext = l.ext.as_ref().unwrap();
        assert_eq!(ext.symlink_target.as_deref(), real.join("sub").to_str());
        assert_eq!(ext.target_kind, Some(FileKind::Dir));
        let d = listed.iter().find(|e| e.name == "dangling").unwrap();
        let ext = d.ext.as_ref().unwrap();
        assert_eq!(
            ext.symlink_target.as_deref(),
            real.join("dangling").to_str()
        );
        assert_eq!(ext.target_kind, None);
    }
}
