//! A deterministic writer of the `newc` cpio format (what the kernel unpacks
//! as an initramfs): entries sorted by path, fixed owner, mtime and inode
//! numbers, so the same inputs give the same bytes.

use std::collections::BTreeMap;
use std::io::{self, Write};

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A directory.
    Dir,
    /// A regular file with its contents.
    File(Vec<u8>),
    /// A symbolic link to the given target.
    Symlink(String),
    /// A character device (major, minor).
    CharDev(u32, u32),
}

#[derive(Debug, Clone)]
struct Entry {
    mode: u32,
    kind: Kind,
}

/// An in-memory archive; paths are relative (no leading `/`).
#[derive(Debug, Default)]
pub(crate) struct Archive {
    entries: BTreeMap<String, Entry>,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

impl Archive {
    /// Adds an entry with permission bits `perm`; parent directories are
    /// added (mode 0755) if missing. A later entry for the same path replaces it.
    pub fn add(&mut self, path: &str, perm: u32, kind: Kind) {
        let path = path
            .trim_start_matches('/')
            .trim_end_matches('/')
            .to_string();
        let mut parent = String::new();
        for part in path
            .split('/')
            .take(path.split('/').count().saturating_sub(1))
        {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(part);
            self.entries.entry(parent.clone()).or_insert(Entry {
                mode: S_IFDIR | 0o755,
                kind: Kind::Dir,
            });
        }
        let type_bits = match kind {
            Kind::Dir => S_IFDIR,
            Kind::File(_) => S_IFREG,
            Kind::Symlink(_) => S_IFLNK,
            Kind::CharDev(..) => S_IFCHR,
        };
        self.entries.insert(
            path,
            Entry {
                mode: type_bits | (perm & 0o7777),
                kind,
            },
        );
    }

    /// Writes the archive in `newc` format, all entries owned by root with
    /// mtime `mtime`, followed by the trailer.
    pub fn write_to(&self, mut w: impl Write, mtime: u32) -> io::Result<()> {
        for (ino, (path, entry)) in self.entries.iter().enumerate() {
            let data: &[u8] = match &entry.kind {
                Kind::File(d) => d,
                Kind::Symlink(t) => t.as_bytes(),
                Kind::Dir | Kind::CharDev(..) => &[],
            };
            let (rmaj, rmin) = match entry.kind {
                Kind::CharDev(a, b) => (a, b),
                _ => (0, 0),
            };
            let nlink = if matches!(entry.kind, Kind::Dir) {
                2
            } else {
                1
            };
            write_entry(
                &mut w,
                path,
                ino as u32 + 1,
                entry.mode,
                nlink,
                mtime,
                data,
                rmaj,
                rmin,
            )?;
        }
        write_entry(&mut w, "TRAILER!!!", 0, 0, 1, 0, &[], 0, 0)?;
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn write_entry(
    w: &mut impl Write,
    name: &str,
    ino: u32,
    mode: u32,
    nlink: u32,
    mtime: u32,
    data: &[u8],
    rdev_major: u32,
    rdev_minor: u32,
) -> io::Result<usize> {
    let size = u32::try_from(data.len())
        .map_err(|_| io::Error::other(format!("{name}: too large for cpio")))?;
    let namesize = name.len() as u32 + 1;
    let header = format!(
        "070701{ino:08X}{mode:08X}{uid:08X}{gid:08X}{nlink:08X}{mtime:08X}{size:08X}{dmaj:08X}{dmin:08X}{rdev_major:08X}{rdev_minor:08X}{namesize:08X}{check:08X}",
        uid = 0,
        gid = 0,
        dmaj = 0,
        dmin = 0,
        check = 0,
    );
    w.write_all(header.as_bytes())?;
    w.write_all(name.as_bytes())?;
    w.write_all(&[0])?;
    let mut n = header.len() + name.len() + 1;
    let pad = (4 - n % 4) % 4;
    w.write_all(&[0u8; 3][..pad])?;
    n += pad;
    w.write_all(data)?;
    n += data.len();
    let pad = (4 - n % 4) % 4;
    w.write_all(&[0u8; 3][..pad])?;
    Ok(n + pad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn sample() -> Archive {
        let mut a = Archive::default();
        a.add("init", 0o755, Kind::File(b"#!/bin/sh\necho hi\n".to_vec()));
        a.add("bin/sh", 0o777, Kind::Symlink("busybox".into()));
        a.add("dev/console", 0o600, Kind::CharDev(5, 1));
        a.add("lib/modules/order", 0o644, Kind::File(b"a\nb\n".to_vec()));
        a.add("empty", 0o644, Kind::File(Vec::new()));
        a
    }

    #[test]
    fn output_is_deterministic_and_aligned() {
        let mut one = Vec::new();
        sample().write_to(&mut one, 0).unwrap();
        let mut two = Vec::new();
        sample().write_to(&mut two, 0).unwrap();
        assert_eq!(one, two);
        assert_eq!(one.len() % 4, 0);
        assert!(one.starts_with(b"070701"));
        // Parents are created and come before their children (sorted order).
        let text = String::from_utf8_lossy(&one);
        let bin = text.find("bin\0").unwrap();
        let sh = text.find("bin/sh\0").unwrap();
        assert!(bin < sh);
        assert!(text.contains("TRAILER!!!\0"));
    }

    /// Checks the bytes with GNU cpio, the reference reader, when it is installed.
    #[test]
    fn gnu_cpio_reads_it() {
        if Command::new("cpio").arg("--version").output().is_err() {
            eprintln!("cpio not installed; skipping");
            return;
        }
        let mut bytes = Vec::new();
        sample().write_to(&mut bytes, 1_700_000_000).unwrap();
        let mut child = Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listing = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(lines.len(), 9, "{listing}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("lrwxrwxrwx") && l.contains("bin/sh -> busybox")),
            "{listing}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("crw-------") && l.contains("dev/console")),
            "{listing}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("-rwxr-xr-x") && l.contains(" 18 ") && l.ends_with("init")),
            "{listing}"
        );
    }
}
