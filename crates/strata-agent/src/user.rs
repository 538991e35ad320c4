//! `/etc/passwd` and `/etc/group` lookups (no NSS: the guest uses files).

use std::path::Path;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
    /// Home directory.
    pub home: String,
    /// Primary plus supplementary groups.
    pub groups: Vec<u32>,
}

/// Looks `spec` (a name or a numeric uid) up under `root` (normally `/`).
pub fn lookup(root: &Path, spec: &str) -> Option<User> {
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).ok()?;
    let numeric: Option<u32> = spec.parse().ok();
    let mut user = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid: u32 = f[2].parse().ok()?;
        let gid: u32 = f[3].parse().ok()?;
        let hit = f[0] == spec || numeric == Some(uid);
        hit.then(|| User {
            name: f[0].to_owned(),
            uid,
            gid,
            home: f[5].to_owned(),
            groups: vec![gid],
        })
    })?;
    if let Ok(group) = std::fs::read_to_string(root.join("etc/group")) {
        for line in group.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 {
                continue;
            }
            let Ok(gid) = f[2].parse::<u32>() else {
                continue;
            };
            if f[3].split(',').any(|m| m == user.name) && !user.groups.contains(&gid) {
                user.groups.push(gid);
            }
        }
    }
    Some(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_passwd_and_groups() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/bash\nbroken\nalice:x:1000:1000::/home/alice:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("etc/group"),
            "root:x:0:\nwheel:x:10:alice,bob\nalice:x:1000:\n",
        )
        .unwrap();
        let a = lookup(d.path(), "alice").unwrap();
        assert_eq!((a.uid, a.gid, a.home.as_str()), (1000, 1000, "/home/alice"));
        assert_eq!(a.groups, vec![1000, 10]);
        assert_eq!(lookup(d.path(), "0").unwrap().name, "root");
        assert!(lookup(d.path(), "mallory").is_none());
    }
}
