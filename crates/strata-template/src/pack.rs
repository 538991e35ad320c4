//! The client side of `copy`: a deterministic tar of a source, its sha256,
//! and the guest-side script that installs it.
//!
//! Archive layout (self-describing, so the installer needs nothing else):
//! - a directory source: first entry `./` (the directory itself, its
//!   permission bits), then every entry below it by relative path, each
//!   directory's children sorted by name bytes, depth first;
//! - a file (or a symlink to a file, resolved inside the context) source:
//!   exactly one regular-file entry named by the source's last component.
//!
//! Every header is GNU, with mtime 0, uid/gid 0, no user/group names and the
//! source's permission bits (`& 0o7777`); symlinks below a directory source
//! are stored as symlinks (their targets are not followed); sockets, FIFOs
//! and devices are refused. Same tree ⇒ same bytes ⇒ same sha256.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::shell::quote;
use crate::{Recipe, RecipeError, Step};

const BLOCK: u64 = 512;

fn padded(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// Bytes a header for `name` takes (a GNU long-name record when it does
/// not fit the 100-byte field).
fn header_bytes(name_len: usize) -> u64 {
    if name_len >= 100 {
        2 * BLOCK + padded(name_len as u64 + 1)
    } else {
        BLOCK
    }
}

struct Packer<'a> {
    src: &'a str,
    max: u64,
    tar: tar::Builder<Vec<u8>>,
}

impl Packer<'_> {
    fn bad(&self, message: impl Into<String>) -> RecipeError {
        RecipeError::CopySource {
            src: self.src.to_string(),
            message: message.into(),
        }
    }

    fn io(&self, path: &Path, source: std::io::Error) -> RecipeError {
        RecipeError::CopyIo {
            src: self.src.to_string(),
            path: path.display().to_string(),
            source,
        }
    }

    /// Refuses to go on if `more` bytes plus the end-of-archive blocks would
    /// pass the limit.
    fn reserve(&self, more: u64) -> Result<(), RecipeError> {
        let now = self.tar.get_ref().len() as u64;
        if now.saturating_add(more).saturating_add(2 * BLOCK) > self.max {
            return Err(RecipeError::CopyTooLarge {
                src: self.src.to_string(),
                limit: self.max,
            });
        }
        Ok(())
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode & 0o7777);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(size);
        h
    }

    fn check_name(&self, name: &Path) -> Result<(), RecipeError> {
        if name.as_os_str().as_bytes().contains(&b'\n') {
            return Err(self.bad(format!("{} has a newline in its name", name.display())));
        }
        Ok(())
    }

    fn add_file(
        &mut self,
        path: &Path,
        name: &Path,
        meta: &fs::Metadata,
    ) -> Result<(), RecipeError> {
        self.check_name(name)?;
        let len = meta.len();
        self.reserve(header_bytes(name.as_os_str().len()) + padded(len))?;
        let mut f = fs::File::open(path).map_err(|e| self.io(path, e))?;
        let mut data = Vec::with_capacity(len as usize);
        (&mut f)
            .take(len + 1)
            .read_to_end(&mut data)
            .map_err(|e| self.io(path, e))?;
        if data.len() as u64 != len {
            return Err(self.bad(format!(
                "{} changed size while being packed",
                name.display()
            )));
        }
        let mut h = Self::header(tar::EntryType::Regular, meta.permissions().mode(), len);
        self.tar
            .append_data(&mut h, name, data.as_slice())
            .map_err(|e| self.io(path, e))
    }

    fn add_dir_entry(
        &mut self,
        path: &Path,
        name: &Path,
        meta: &fs::Metadata,
    ) -> Result<(), RecipeError> {
        self.check_name(name)?;
        self.reserve(header_bytes(name.as_os_str().len() + 1))?;
        let mut h = Self::header(tar::EntryType::Directory, meta.permissions().mode(), 0);
        let mut n = name.as_os_str().to_owned();
        if !n.as_bytes().ends_with(b"/") {
            n.push("/");
        }
        self.tar
            .append_data(&mut h, &n, std::io::empty())
            .map_err(|e| self.io(path, e))
    }

    fn add_symlink(&mut self, path: &Path, name: &Path) -> Result<(), RecipeError> {
        self.check_name(name)?;
        let target = fs::read_link(path).map_err(|e| self.io(path, e))?;
        self.reserve(
            header_bytes(name.as_os_str().len()) + header_bytes(target.as_os_str().len()),
        )?;
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.tar
            .append_link(&mut h, name, &target)
            .map_err(|e| self.io(path, e))
    }

    /// Depth first, each directory's children sorted by name bytes.
    fn add_subtree(&mut self, (dir, rel): (PathBuf, PathBuf)) -> Result<(), RecipeError> {
        // An explicit stack of directory iterators (sorted child lists), so
        // deep trees do not recurse on the Rust stack.
        let mut stack: Vec<(PathBuf, PathBuf, std::vec::IntoIter<std::ffi::OsString>)> = Vec::new();
        let list =
            |me: &Self, d: &Path| -> Result<std::vec::IntoIter<std::ffi::OsString>, RecipeError> {
                let mut v: Vec<_> = fs::read_dir(d)
                    .map_err(|e| me.io(d, e))?
                    .map(|e| e.map(|e| e.file_name()))
                    .collect::<Result<_, _>>()
                    .map_err(|e| me.io(d, e))?;
                v.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
                Ok(v.into_iter())
            };
        let it = list(self, &dir)?;
        stack.push((dir, rel, it));
        while let Some((dir, rel, it)) = stack.last_mut() {
            let Some(c) = it.next() else {
                stack.pop();
                continue;
            };
            let path = dir.join(&c);
            let name = rel.join(&c);
            let meta = fs::symlink_metadata(&path).map_err(|e| self.io(&path, e))?;
            let ft = meta.file_type();
            if ft.is_symlink() {
                self.add_symlink(&path, &name)?;
            } else if ft.is_dir() {
                self.add_dir_entry(&path, &name, &meta)?;
                let it = list(self, &path)?;
                stack.push((path, name, it));
            } else if ft.is_file() {
                self.add_file(&path, &name, &meta)?;
            } else {
                return Err(self.bad(format!(
                    "{} is not a regular file, directory or symlink",
                    name.display()
                )));
            }
        }
        Ok(())
    }
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Client side of `copy`: packs `src` (file or directory, relative to
/// `context_dir`) as a deterministic tar (see the module docs: entries
/// sorted, mtime 0, uid/gid 0, permission bits kept, symlinks kept as
/// symlinks); refuses paths escaping the context (`..`, absolute, a symlink
/// followed outside) and special files; at most `max_bytes` of archive.
/// Returns the archive and its hex sha256.
pub fn pack(
    context_dir: &Path,
    src: &str,
    max_bytes: u64,
) -> Result<(Vec<u8>, String), RecipeError> {
    let bad = |m: String| RecipeError::CopySource {
        src: src.to_string(),
        message: m,
    };
    crate::validate::check_src(None, src).map_err(|e| bad(e.to_string()))?;
    let ctx = fs::canonicalize(context_dir).map_err(|e| RecipeError::CopyIo {
        src: src.to_string(),
        path: context_dir.display().to_string(),
        source: e,
    })?;
    let full = ctx.join(src);
    let real = match fs::canonicalize(&full) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad(format!("does not exist in {}", ctx.display())))
        }
        Err(e) => {
            return Err(RecipeError::CopyIo {
                src: src.to_string(),
                path: full.display().to_string(),
                source: e,
            })
        }
    };
    if !real.starts_with(&ctx) {
        return Err(bad(format!(
            "resolves to {} (through a symlink), outside the context {}",
            real.display(),
            ctx.display()
        )));
    }
    let mut p = Packer {
        src,
        max: max_bytes,
        tar: tar::Builder::new(Vec::new()),
    };
    let meta = fs::metadata(&real).map_err(|e| p.io(&real, e))?;
    if meta.is_dir() {
        p.add_dir_entry(&real, Path::new("./"), &meta)?;
        p.add_subtree((real.clone(), PathBuf::new()))?;
    } else if meta.is_file() {
        let name = Path::new(src)
            .file_name()
            .ok_or_else(|| bad("has no file name".to_string()))?
            .to_owned();
        p.add_file(&real, Path::new(&name), &meta)?;
    } else {
        return Err(bad("is not a regular file or directory".to_string()));
    }
    let data = p.tar.into_inner().map_err(|e| RecipeError::CopyIo {
        src: src.to_string(),
        path: real.display().to_string(),
        source: e,
    })?;
    if data.len() as u64 > max_bytes {
        return Err(RecipeError::CopyTooLarge {
            src: src.to_string(),
            limit: max_bytes,
        });
    }
    let hash = sha256_hex(&data);
    Ok((data, hash))
}

/// Fills every `copy` step's `sha256` from [`pack`], returning the blobs to
/// upload (hash → bytes; one blob for sources that pack the same).
/// `max_bytes` bounds the distinct blobs together, not each one.
pub fn pack_all(
    recipe: &mut Recipe,
    context_dir: &Path,
    max_bytes: u64,
) -> Result<BTreeMap<String, Vec<u8>>, RecipeError> {
    let mut blobs: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut by_src: BTreeMap<String, String> = BTreeMap::new();
    let mut used = 0u64;
    for step in &mut recipe.steps {
        let Step::Copy(c) = step else { continue };
        if let Some(h) = by_src.get(&c.src) {
            c.sha256 = Some(h.clone());
            continue;
        }
        let (data, hash) = pack(context_dir, &c.src, max_bytes - used)?;
        if !blobs.contains_key(&hash) {
            used += data.len() as u64;
            blobs.insert(hash.clone(), data);
        }
        by_src.insert(c.src.clone(), hash.clone());
        c.sha256 = Some(hash);
    }
    Ok(blobs)
}

/// The guest-side installer of a `copy` ([`crate::Action::Copy`]): a script
/// for `sh -c`, run as root, that unpacks the archive at `archive` (already
/// uploaded and its sha256 checked) into a fresh temporary directory, gives
/// every entry `owner` (and `mode`, if set), then copies it into place with
/// `cp -a` (merging into an existing directory) and removes the temporary
/// files. A directory archive's contents go under `dest`; a file archive's
/// one file is written at `dest`, or into it when `dest` ends with `/`.
/// Needs `tar`, `cp`, `chown`, `chmod`, `mktemp` (coreutils, in every base).
pub fn copy_install_script(archive: &str, dest: &str, owner: &str, mode: Option<u32>) -> String {
    let a = quote(archive);
    let d = quote(dest);
    let into = dest.ends_with('/');
    let chmod = match mode {
        Some(m) => format!("chmod -R {m:o} \"$t\"/. && "),
        None => String::new(),
    };
    let file_dest = if into {
        format!("mkdir -p -- {d} && cp -a -- \"$t/$n\" {d}")
    } else {
        format!("mkdir -p -- \"$(dirname -- {d})\" && cp -a -- \"$t/$n\" {d}")
    };
    format!(
        "set -e; t=$(mktemp -d /tmp/strata-copy.XXXXXX); trap 'rm -rf \"$t\"' EXIT; \
first=$(tar --quoting-style=literal -tf {a} | head -n 1); \
tar -xpf {a} -C \"$t\" --no-same-owner; \
chown -hR -- {o} \"$t\"/. && {chmod}\
if [ \"$first\" = ./ ]; then mkdir -p -- {d} && cp -a -- \"$t\"/. {d}; \
else n=$first; {file_dest}; fi",
        o = quote(owner),
    )
}
