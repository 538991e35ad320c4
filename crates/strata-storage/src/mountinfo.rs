//! `/proc/self/mountinfo` parsing and loop-device lookup via sysfs.

use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Root of the mount inside its file system (`/` unless a bind or subvolume mount).
    pub root: PathBuf,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// File system type (`btrfs`, `ext4`, ...).
    pub fs_type: String,
    /// Mount source (`/dev/loop3`, ...).
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
            out.push(b[i]);
            i += 1;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let mut post = post.split(' ');
            let fs_type = post.next()?.to_string();
            let source = unescape(post.next()?);
            Some(MountEntry {
                root: PathBuf::from(unescape(pre.get(3)?)),
                mount_point: PathBuf::from(unescape(pre.get(4)?)),
                fs_type,
                source,
            })
        })
        .collect()
}

/// The top-most mount at exactly `mount_point`, if any.
pub fn mount_at(mount_point: &Path) -> std::io::Result<Option<MountEntry>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse(&text)
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mount_point))
}

/// Loop devices (`/dev/loopN`) whose backing file is `image` (canonical path).
pub fn loop_devices_of(image: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str() else { continue };
        if !n.starts_with("loop") {
            continue;
        }
        if let Some(b) = loop_backing_file(n) {
            if Path::new(&b) == image {
                out.push(PathBuf::from("/dev").join(n));
            }
        }
    }
    out
}

/// The backing file of loop device `name` (`loop3` or `/dev/loop3`).
pub fn loop_backing_file(name: &str) -> Option<String> {
    let n = name.strip_prefix("/dev/").unwrap_or(name);
    let s = std::fs::read_to_string(format!("/sys/block/{n}/loop/backing_file")).ok()?;
    Some(s.trim_end_matches('\n').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_with_optional_fields_and_escapes() {
        let t =
            "36 35 98:0 /mnt1 /mnt\\040x rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                 40 20 0:50 / /tmp/p rw,noatime shared:5 - btrfs /dev/loop3 rw,space_cache=v2\n\
                 garbage\n";
        let m = parse(t);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt x"));
        assert_eq!(m[0].root, PathBuf::from("/mnt1"));
        assert_eq!(m[1].fs_type, "btrfs");
        assert_eq!(m[1].source, "/dev/loop3");
    }

    #[test]
    fn finds_root_mount() {
        let m = mount_at(Path::new("/proc")).expect("read mountinfo");
        assert_eq!(m.map(|m| m.fs_type), Some("proc".to_string()));
    }
}
