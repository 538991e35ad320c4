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
//! and devices are refused; entries the context's `.dockerignore` excludes
//! are left out (see `ignore.rs`). Same tree ⇒ same bytes ⇒ same sha256.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::ignore::Ignore;
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
    ignore: Ignore,
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

    /// Depth first, each directory's children sorted by name bytes;
    /// entries `.dockerignore` excludes are left out. `ctx_rel` is the
    /// directory's path relative to the context (what patterns match).
    fn add_subtree(&mut self, dir: PathBuf, ctx_rel: &str) -> Result<(), RecipeError> {
        /// A directory being walked: its path, its name in the archive, its
        /// context-relative path, its sorted children, and its own entry if
        /// not written yet (an excluded directory is written only when a
        /// re-included entry below it is).
        struct Frame {
            dir: PathBuf,
            name: PathBuf,
            ctx_rel: String,
            children: std::vec::IntoIter<std::ffi::OsString>,
            pending: Option<fs::Metadata>,
        }
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
        let children = list(self, &dir)?;
        let mut stack = vec![Frame {
            dir,
            name: PathBuf::new(),
            ctx_rel: ctx_rel.to_string(),
            children,
            pending: None,
        }];
        let descend_excluded = self.ignore.has_negations();
        while let Some(top) = stack.last_mut() {
            let Some(c) = top.children.next() else {
                stack.pop();
                continue;
            };
            let path = top.dir.join(&c);
            let name = top.name.join(&c);
            let rel = if top.ctx_rel.is_empty() {
                c.to_string_lossy().into_owned()
            } else {
                format!("{}/{}", top.ctx_rel, c.to_string_lossy())
            };
            let meta = fs::symlink_metadata(&path).map_err(|e| self.io(&path, e))?;
            let ft = meta.file_type();
            let excluded = self.ignore.excluded(&rel);
            if excluded && !(ft.is_dir() && descend_excluded) {
                continue;
            }
            if !excluded {
                // The directories above it that were held back go first.
                for f in stack.iter_mut() {
                    if let Some(m) = f.pending.take() {
                        self.add_dir_entry(&f.dir, &f.name, &m)?;
                    }
                }
            }
            if ft.is_symlink() {
                self.add_symlink(&path, &name)?;
            } else if ft.is_dir() {
                let pending = if excluded {
                    Some(meta)
                } else {
                    self.add_dir_entry(&path, &name, &meta)?;
                    None
                };
                let children = list(self, &path)?;
                stack.push(Frame {
                    dir: path,
                    name,
                    ctx_rel: rel,
                    children,
                    pending,
                });
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
    let ignore = Ignore::load(&ctx, src)?;
    // The source's path relative to the context, `/`-separated: what
    // `.dockerignore` patterns match.
    let src_rel = real
        .strip_prefix(&ctx)
        .map(|r| {
            r.components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/")
        })
        .unwrap_or_default();
    let mut p = Packer {
        src,
        max: max_bytes,
        ignore,
        tar: tar::Builder::new(Vec::new()),
    };
    let meta = fs::metadata(&real).map_err(|e| p.io(&real, e))?;
    if meta.is_dir() {
        p.add_dir_entry(&real, Path::new("./"), &meta)?;
        p.add_subtree(real.clone(), &src_rel)?;
    } else if meta.is_file() {
        if p.ignore.excluded(&src_rel) {
            return Err(bad(format!(
                "{src_rel} is excluded by the context's .dockerignore"
            )));
        }
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

/// The mode a `copy` with `mode` gives directories: `mode` plus search
/// (`x`) wherever it grants read, so `0o644` files sit in `0o755`
/// directories and `0o600` files in `0o700` ones.
pub fn dir_mode(mode: u32) -> u32 {
    mode | ((mode & 0o444) >> 2)
}

/// The guest-side installer of a `copy` ([`crate::Action::Copy`]): a script
/// for `sh -c`, run as root, that unpacks the archive at `archive` (already
/// uploaded and its sha256 checked) into a fresh temporary directory, gives
/// every entry `owner` (and `mode` to files, [`dir_mode`] of it to
/// directories, if set; symlinks keep theirs), puts it in place with
/// `cp -a` and removes the temporary files.
///
/// A directory archive's contents go under `dest`: into it if it exists
/// (its own owner and mode unchanged, existing files overwritten, others
/// kept), or as a new directory with the archived root's mode. A file
/// archive's one file is written at `dest`, or into it when `dest` ends with
/// `/`. Missing parent directories are created (root-owned, like Docker).
/// Needs `tar`, `cp`, `chown`, `chmod`, `find`, `mktemp` (in every Debian).
pub fn copy_install_script(archive: &str, dest: &str, owner: &str, mode: Option<u32>) -> String {
    let a = quote(archive);
    let trimmed = dest.trim_end_matches('/');
    let d = quote(if trimmed.is_empty() { "/" } else { trimmed });
    let chmod = match mode {
        Some(m) => format!(
            "find \"$t\" -type f -exec chmod {m:o} {{}} +; find \"$t\" -type d -exec chmod {:o} {{}} +; ",
            dir_mode(m)
        ),
        None => String::new(),
    };
    let file = if dest.ends_with('/') {
        format!("mkdir -p -- {d}; cp -a -- \"$t/$n\" {d}/")
    } else {
        format!("mkdir -p -- \"$(dirname -- {d})\"; cp -a -- \"$t/$n\" {d}")
    };
    format!(
        "set -e; t=$(mktemp -d /tmp/strata-copy.XXXXXX); trap 'rm -rf \"$t\"' EXIT; \
first=$(tar --quoting-style=literal -tf {a} | head -n 1); \
tar -xpf {a} -C \"$t\" --no-same-owner; \
chown -hR -- {o} \"$t\"; {chmod}\
if [ \"$first\" = ./ ]; then \
if [ -d {d} ]; then find \"$t\" -mindepth 1 -maxdepth 1 -exec cp -a -- {{}} {d}/ \\;; \
else mkdir -p -- \"$(dirname -- {d})\"; cp -a -- \"$t\" {d}; fi; \
else n=$first; {file}; fi",
        o = quote(owner),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::process::Command;

    const MAX: u64 = 16 * 1024 * 1024;

    fn write(p: &Path, data: &[u8], mode: u32) {
        fs::create_dir_all(p.parent().expect("has a parent")).expect("mkdir");
        fs::write(p, data).expect("write");
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// A context with a tree: files of several modes, a nested directory, a
    /// symlink, a long name.
    fn tree(root: &Path) {
        write(&root.join("site/index.html"), b"<h1>hi</h1>\n", 0o644);
        write(&root.join("site/run.sh"), b"#!/bin/sh\necho run\n", 0o755);
        write(&root.join("site/b/c/deep.txt"), b"deep", 0o600);
        write(&root.join("site/a.txt"), b"a", 0o640);
        let long = "l".repeat(150);
        write(&root.join("site/b").join(&long), b"long name", 0o644);
        symlink("index.html", root.join("site/link")).expect("symlink");
        symlink("/etc/passwd", root.join("site/abs-link")).expect("symlink");
        write(&root.join("req.txt"), b"requests==2.32.3\n", 0o644);
    }

    /// (path, type, mode, mtime, uid, gid, link target) of every entry.
    type Entry = (String, tar::EntryType, u32, u64, u64, u64, Option<String>);

    fn entries(data: &[u8]) -> Vec<Entry> {
        let mut a = tar::Archive::new(data);
        a.entries()
            .expect("entries")
            .map(|e| {
                let e = e.expect("entry");
                let h = e.header();
                (
                    e.path().expect("path").display().to_string(),
                    h.entry_type(),
                    h.mode().expect("mode"),
                    h.mtime().expect("mtime"),
                    h.uid().expect("uid"),
                    h.gid().expect("gid"),
                    e.link_name()
                        .expect("link")
                        .map(|l| l.display().to_string()),
                )
            })
            .collect()
    }

    #[test]
    fn directory_archive_is_sorted_normalised_and_keeps_modes_and_symlinks() {
        let ctx = tempfile::tempdir().expect("tmp");
        tree(ctx.path());
        let (data, hash) = pack(ctx.path(), "site", MAX).expect("packs");
        assert_eq!(hash, sha256_hex(&data));
        let e = entries(&data);
        let names: Vec<&str> = e.iter().map(|e| e.0.as_str()).collect();
        let long = format!("b/{}", "l".repeat(150));
        assert_eq!(
            names,
            [
                "./",
                "a.txt",
                "abs-link",
                "b/",
                "b/c/",
                "b/c/deep.txt",
                long.as_str(),
                "index.html",
                "link",
                "run.sh"
            ]
        );
        for (name, _, _, mtime, uid, gid, _) in &e {
            assert_eq!((*mtime, *uid, *gid), (0, 0, 0), "{name}");
        }
        let mode = |n: &str| e.iter().find(|x| x.0 == n).map(|x| x.2 & 0o7777);
        assert_eq!(mode("run.sh"), Some(0o755));
        assert_eq!(mode("b/c/deep.txt"), Some(0o600));
        assert_eq!(mode("a.txt"), Some(0o640));
        let link = e.iter().find(|x| x.0 == "link").expect("link");
        assert_eq!(
            (link.1, link.6.as_deref()),
            (tar::EntryType::Symlink, Some("index.html"))
        );
        let abs = e.iter().find(|x| x.0 == "abs-link").expect("abs-link");
        assert_eq!(
            abs.6.as_deref(),
            Some("/etc/passwd"),
            "kept as a link, not followed"
        );
        // GNU tar reads it the same way.
        let dir = tempfile::tempdir().expect("tmp");
        let a = dir.path().join("a.tar");
        fs::write(&a, &data).expect("write");
        let out = Command::new("tar")
            .arg("-tvf")
            .arg(&a)
            .output()
            .expect("tar");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(listing.contains("link -> index.html"), "{listing}");
    }

    /// Same tree ⇒ same bytes, whatever the mtimes, owners and creation
    /// order; a changed byte or mode ⇒ another hash.
    #[test]
    fn same_tree_same_hash() {
        let a = tempfile::tempdir().expect("tmp");
        let b = tempfile::tempdir().expect("tmp");
        tree(a.path());
        // b: created in another order, with other mtimes.
        write(&b.path().join("site/a.txt"), b"a", 0o640);
        let long = "l".repeat(150);
        write(&b.path().join("site/b").join(&long), b"long name", 0o644);
        write(&b.path().join("site/b/c/deep.txt"), b"deep", 0o600);
        symlink("/etc/passwd", b.path().join("site/abs-link")).expect("symlink");
        symlink("index.html", b.path().join("site/link")).expect("symlink");
        write(
            &b.path().join("site/run.sh"),
            b"#!/bin/sh\necho run\n",
            0o755,
        );
        write(&b.path().join("site/index.html"), b"<h1>hi</h1>\n", 0o644);
        let touch = Command::new("touch")
            .args(["-d", "2001-02-03"])
            .arg(b.path().join("site/index.html"))
            .status()
            .expect("touch");
        assert!(touch.success());
        let (_, ha) = pack(a.path(), "site", MAX).expect("packs");
        let (_, hb) = pack(b.path(), "site/", MAX).expect("packs");
        assert_eq!(ha, hb);
        assert_eq!(pack(a.path(), "site", MAX).expect("again").1, ha);
        fs::set_permissions(
            b.path().join("site/a.txt"),
            fs::Permissions::from_mode(0o644),
        )
        .expect("chmod");
        assert_ne!(
            pack(b.path(), "site", MAX).expect("packs").1,
            ha,
            "mode is hashed"
        );
        fs::set_permissions(
            b.path().join("site/a.txt"),
            fs::Permissions::from_mode(0o640),
        )
        .expect("chmod");
        fs::write(b.path().join("site/b/c/deep.txt"), b"deeP").expect("write");
        assert_ne!(
            pack(b.path(), "site", MAX).expect("packs").1,
            ha,
            "content is hashed"
        );
    }

    #[test]
    fn file_archive_is_one_entry_named_by_the_source() {
        let ctx = tempfile::tempdir().expect("tmp");
        tree(ctx.path());
        symlink("req.txt", ctx.path().join("req-link")).expect("symlink");
        let (data, _) = pack(ctx.path(), "req.txt", MAX).expect("packs");
        let e = entries(&data);
        assert_eq!(e.len(), 1);
        assert_eq!(
            (e[0].0.as_str(), e[0].1, e[0].2),
            ("req.txt", tar::EntryType::Regular, 0o644)
        );
        // A symlink inside the context is resolved; the entry keeps the source's name.
        let (data, _) = pack(ctx.path(), "req-link", MAX).expect("packs");
        assert_eq!(entries(&data)[0].0, "req-link");
        assert_eq!(entries(&data)[0].1, tar::EntryType::Regular);
    }

    #[test]
    fn escapes_special_files_and_missing_sources_are_refused() {
        let outer = tempfile::tempdir().expect("tmp");
        let ctx = outer.path().join("ctx");
        tree(&ctx);
        write(&outer.path().join("secret"), b"s", 0o600);
        symlink("../secret", ctx.join("out-link")).expect("symlink");
        symlink(outer.path(), ctx.join("out-dir")).expect("symlink");
        for src in [
            "../secret",
            "/etc/passwd",
            "out-link",
            "out-dir",
            "out-dir/secret",
            "site/../../secret",
            "nope",
            "",
        ] {
            let e = pack(&ctx, src, MAX).expect_err(src);
            assert_eq!(e.code(), "copy_source_invalid", "{src}: {e}");
        }
        let fifo = ctx.join("site/fifo");
        let st = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(st.success());
        let e = pack(&ctx, "site", MAX).expect_err("fifo");
        assert_eq!(e.code(), "copy_source_invalid");
        assert!(e.to_string().contains("fifo"), "{e}");
        fs::remove_file(&fifo).expect("rm");
        write(&ctx.join("site/new\nline"), b"x", 0o644);
        assert_eq!(
            pack(&ctx, "site", MAX).expect_err("newline").code(),
            "copy_source_invalid"
        );
    }

    #[test]
    fn the_byte_limit_holds_before_reading_everything() {
        let ctx = tempfile::tempdir().expect("tmp");
        write(&ctx.path().join("d/small"), b"x", 0o644);
        // Sparse: 1 GiB that would take a while to read; refused up front.
        let big = fs::File::create(ctx.path().join("d/big")).expect("create");
        big.set_len(1 << 30).expect("truncate");
        let e = pack(ctx.path(), "d", 64 * 1024).expect_err("too large");
        assert_eq!((e.code(), e.status()), ("copy_too_large", 413));
        let e = pack(ctx.path(), "d/big", 64 * 1024).expect_err("too large");
        assert_eq!(e.code(), "copy_too_large");
        let (data, _) = pack(ctx.path(), "d/small", 2048).expect("fits");
        assert_eq!(data.len(), 2048);
        assert!(pack(ctx.path(), "d/small", 2047).is_err());
    }

    /// A `.dockerignore` in the context leaves entries out (a re-included
    /// file brings its excluded parents along), refuses an excluded file
    /// source, and an excluded directory is not even read.
    #[test]
    fn dockerignore_is_honoured() {
        let ctx = tempfile::tempdir().expect("tmp");
        tree(ctx.path());
        write(&ctx.path().join("site/x.log"), b"log", 0o644);
        let (plain, _) = pack(ctx.path(), "site", MAX).expect("packs");
        fs::write(
            ctx.path().join(".dockerignore"),
            "# build junk\n**/*.log\nsite/b\n!site/b/c/deep.txt\n",
        )
        .expect("write");
        let (data, _) = pack(ctx.path(), "site", MAX).expect("packs");
        let names: Vec<String> = entries(&data).into_iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "./",
                "a.txt",
                "abs-link",
                "b/",
                "b/c/",
                "b/c/deep.txt",
                "index.html",
                "link",
                "run.sh"
            ]
        );
        assert_ne!(data, plain);
        let e = pack(ctx.path(), "site/x.log", MAX).expect_err("excluded");
        assert_eq!(e.code(), "copy_source_invalid");
        assert!(e.to_string().contains(".dockerignore"), "{e}");
        // Without a `!`, an excluded directory is skipped unread: a FIFO in
        // it (which pack refuses) does not matter.
        fs::write(ctx.path().join(".dockerignore"), "site/b\n").expect("write");
        let st = Command::new("mkfifo")
            .arg(ctx.path().join("site/b/fifo"))
            .status()
            .expect("mkfifo");
        assert!(st.success());
        let (data, _) = pack(ctx.path(), "site", MAX).expect("packs");
        assert!(entries(&data).iter().all(|e| !e.0.starts_with("b/")));
        fs::remove_file(ctx.path().join(".dockerignore")).expect("rm");
        assert_eq!(
            pack(ctx.path(), "site", MAX).expect_err("fifo").code(),
            "copy_source_invalid"
        );
    }

    #[test]
    fn pack_all_fills_hashes_and_dedups_blobs() {
        let ctx = tempfile::tempdir().expect("tmp");
        tree(ctx.path());
        let mut r = Recipe::from_toml(
            "[[step]]\ncopy = { src = \"site\", dest = \"/www\" }\n[[step]]\nrun = \"true\"\n\
             [[step]]\ncopy = { src = \"req.txt\", dest = \"/app/\" }\n[[step]]\ncopy = { src = \"site/\", dest = \"/www2\" }\n",
        )
        .expect("parses");
        assert_eq!(r.plan("b").expect_err("unpacked").code(), "copy_not_packed");
        let blobs = pack_all(&mut r, ctx.path(), MAX).expect("packs");
        assert_eq!(blobs.len(), 2, "site and site/ pack the same");
        for (h, data) in &blobs {
            assert_eq!(&sha256_hex(data), h);
        }
        let p = r.plan("b").expect("plans now");
        let hashes: Vec<&str> = p
            .steps
            .iter()
            .filter_map(|s| match &s.action {
                crate::Action::Copy { sha256, .. } => Some(sha256.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(hashes.len(), 3);
        assert!(hashes.iter().all(|h| blobs.contains_key(*h)));
        assert_eq!(hashes[0], hashes[2]);
        // The budget is for all blobs together.
        let one = blobs.values().map(Vec::len).max().expect("blobs") as u64;
        let mut r2 = r.clone();
        let e = pack_all(&mut r2, ctx.path(), one).expect_err("budget");
        assert_eq!(e.code(), "copy_too_large");
    }

    fn install(data: &[u8], dest: &str, owner: &str, mode: Option<u32>) {
        let dir = tempfile::tempdir().expect("tmp");
        let a = dir.path().join("blob.tar");
        fs::write(&a, data).expect("write");
        let script = copy_install_script(&a.display().to_string(), dest, owner, mode);
        let out = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .output()
            .expect("sh");
        assert!(
            out.status.success(),
            "{script}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn uid_of(name: &str) -> u32 {
        let out = Command::new("id").args(["-u", name]).output().expect("id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("uid")
    }

    /// The guest-side installer, run for real with sh, tar and cp: a
    /// directory's contents merge into dest, files land at dest or into
    /// dest/, owners and modes applied, symlinks stay symlinks.
    #[test]
    fn install_script_puts_files_where_docker_would() {
        use std::os::unix::fs::MetadataExt;
        let ctx = tempfile::tempdir().expect("tmp");
        tree(ctx.path());
        let out = tempfile::tempdir().expect("tmp");
        let root = out.path();
        let me =
            String::from_utf8_lossy(&Command::new("id").arg("-un").output().expect("id").stdout)
                .trim()
                .to_string();
        // As root, give the files away (and check it happened); else to oneself.
        let owner = if me == "root" { "nobody" } else { me.as_str() };
        let want_uid = uid_of(owner);

        // A directory into an existing directory with a file already there.
        let m = |p: &Path| fs::symlink_metadata(p).expect("stat");
        write(&root.join("www/keep.txt"), b"keep", 0o644);
        fs::set_permissions(root.join("www"), fs::Permissions::from_mode(0o711)).expect("chmod");
        let (dir_tar, _) = pack(ctx.path(), "site", MAX).expect("packs");
        let www = root.join("www");
        let before = m(&www);
        install(&dir_tar, &www.display().to_string(), owner, None);
        let after = m(&www);
        assert_eq!(
            (after.uid(), after.mode()),
            (before.uid(), before.mode()),
            "an existing dest keeps its owner and mode"
        );
        assert_eq!(
            fs::read(www.join("index.html")).expect("copied"),
            b"<h1>hi</h1>\n"
        );
        assert_eq!(fs::read(www.join("b/c/deep.txt")).expect("copied"), b"deep");
        assert_eq!(fs::read(www.join("keep.txt")).expect("kept"), b"keep");
        assert_eq!(m(&www.join("run.sh")).mode() & 0o7777, 0o755);
        assert_eq!(m(&www.join("b/c/deep.txt")).mode() & 0o7777, 0o600);
        assert_eq!(m(&www.join("b/c/deep.txt")).uid(), want_uid);
        assert_eq!(m(&www.join("b")).uid(), want_uid);
        assert_eq!(
            fs::read_link(www.join("link"))
                .expect("link")
                .display()
                .to_string(),
            "index.html"
        );
        assert_eq!(
            m(&www.join("link")).uid(),
            want_uid,
            "the link itself (chown -h)"
        );
        assert_eq!(
            fs::read_link(www.join("abs-link"))
                .expect("link")
                .display()
                .to_string(),
            "/etc/passwd"
        );

        // A directory to a new nested dest, with a mode.
        let fresh = root.join("new/nested");
        install(
            &dir_tar,
            &format!("{}/", fresh.display()),
            owner,
            Some(0o750),
        );
        assert_eq!(m(&fresh).mode() & 0o7777, 0o750);
        assert_eq!(m(&fresh).uid(), want_uid, "a new dest is the owner's");
        let files_644 = root.join("m644");
        install(
            &dir_tar,
            &files_644.display().to_string(),
            owner,
            Some(0o644),
        );
        assert_eq!(m(&files_644.join("run.sh")).mode() & 0o7777, 0o644);
        assert_eq!(
            m(&files_644.join("b/c")).mode() & 0o7777,
            0o755,
            "directories stay searchable"
        );
        assert_eq!(m(&files_644).mode() & 0o7777, 0o755);
        let plain = root.join("plain");
        install(&dir_tar, &plain.display().to_string(), owner, None);
        let site_mode = m(&ctx.path().join("site")).mode() & 0o7777;
        assert_eq!(
            m(&plain).mode() & 0o7777,
            site_mode,
            "a new dest gets the source directory's mode"
        );
        assert_eq!(m(&fresh.join("index.html")).mode() & 0o7777, 0o750);
        assert_eq!(m(&fresh.join("b/c")).mode() & 0o7777, 0o750);

        // A file at a path, and into a directory.
        let (file_tar, _) = pack(ctx.path(), "req.txt", MAX).expect("packs");
        let at = root.join("etc/app/requirements.txt");
        install(&file_tar, &at.display().to_string(), owner, None);
        assert_eq!(fs::read(&at).expect("file"), b"requests==2.32.3\n");
        assert_eq!(m(&at).uid(), want_uid);
        let into = root.join("opt/app");
        install(
            &file_tar,
            &format!("{}/", into.display()),
            owner,
            Some(0o600),
        );
        assert_eq!(
            fs::read(into.join("req.txt")).expect("file"),
            b"requests==2.32.3\n"
        );
        assert_eq!(m(&into.join("req.txt")).mode() & 0o7777, 0o600);
        // A name that needs quoting.
        write(&ctx.path().join("we'ird $(name).txt"), b"w", 0o644);
        let (t, _) = pack(ctx.path(), "we'ird $(name).txt", MAX).expect("packs");
        install(&t, &format!("{}/", into.display()), owner, None);
        assert_eq!(
            fs::read(into.join("we'ird $(name).txt")).expect("file"),
            b"w"
        );
    }
}
