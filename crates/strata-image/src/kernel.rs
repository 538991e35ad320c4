//! The guest kernel: resolved through Debian's `linux-image-<flavour>`
//! metapackage, downloaded with `apt-get download` (never installed on the
//! host) and unpacked with `dpkg-deb -x`.

use std::path::{Path, PathBuf};

use crate::error::ImageError;
use crate::modules::ModuleDb;
use crate::os_args;
use crate::tools::{self, APT_CACHE, APT_GET, DEPMOD, DPKG_DEB, XZ, ZSTD};

/// The kernel package a metapackage currently points to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ResolvedKernel {
    /// Package name, e.g. `linux-image-6.1.0-57-amd64`.
    pub package: String,
    /// Kernel ABI version (the `lib/modules/<ver>` name), e.g. `6.1.0-57-amd64`.
    pub version: String,
    /// Debian package version, e.g. `6.1.192-3`.
    pub package_version: String,
}

/// Finds the kernel package in a metapackage's `Depends:` field.
pub(crate) fn parse_depends(depends: &str, flavour: &str) -> Option<ResolvedKernel> {
    let suffix = format!("-{flavour}");
    for alt in depends.split([',', '|']) {
        let alt = alt.trim();
        let (name, rest) = alt.split_once(' ').unwrap_or((alt, ""));
        let Some(version) = name.strip_prefix("linux-image-") else {
            continue;
        };
        if !version.ends_with(&suffix)
            || version == flavour
            || !version.starts_with(|c: char| c.is_ascii_digit())
        {
            continue;
        }
        let package_version = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.trim().strip_prefix('='))
            .map(|v| v.trim().to_string())
            .unwrap_or_default();
        return Some(ResolvedKernel {
            package: name.to_string(),
            version: version.to_string(),
            package_version,
        });
    }
    None
}

fn field<'a>(control: &'a str, name: &str) -> Option<&'a str> {
    control.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::trim)
    })
}

/// Resolves `linux-image-<flavour>` to the kernel it depends on.
///
/// Fast path: the metapackage's control record from apt's local index
/// (`apt-cache show`, the same record `apt-get download` would fetch, no
/// network, so cache hits stay quick). Otherwise the metapackage is
/// downloaded into `workdir` and its `Depends:` read with `dpkg-deb -f`
/// (running `apt-get update` first if apt has no package lists).
pub(crate) fn resolve(
    flavour: &str,
    workdir: &Path,
    log: &dyn Fn(&str),
) -> Result<ResolvedKernel, ImageError> {
    let meta = format!("linux-image-{flavour}");
    let fail = |reason: String| ImageError::KernelResolve {
        metapackage: meta.clone(),
        reason,
    };
    if let Ok(out) = tools::run(
        APT_CACHE,
        os_args!["show", "--no-all-versions", meta],
        None,
        true,
        &|_| {},
    ) {
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(k) = field(&text, "Depends").and_then(|d| parse_depends(d, flavour)) {
            return Ok(k);
        }
    }
    let deb = download(&meta, workdir, log)?;
    let out = tools::run(
        DPKG_DEB,
        os_args!["-f", deb, "Depends"],
        None,
        true,
        &|_| {},
    )?;
    let depends = String::from_utf8_lossy(&out.stdout);
    parse_depends(&depends, flavour).ok_or_else(|| {
        fail(format!(
            "no linux-image-*-{flavour} in Depends: {}",
            depends.trim()
        ))
    })
}

/// Files whose state decides what apt resolves a package to.
const APT_STATE: &[&str] = &[
    "/var/lib/apt/lists",
    "/etc/apt/sources.list",
    "/etc/apt/sources.list.d",
    "/etc/apt/preferences",
    "/etc/apt/preferences.d",
];

/// A fingerprint (names, sizes, mtimes) of apt's package lists and sources.
fn apt_fingerprint(flavour: &str) -> String {
    let mut text = format!("flavour={flavour}\n");
    let mut add = |p: &Path| {
        if let Ok(m) = p.metadata() {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .unwrap_or_default();
            text.push_str(&format!(
                "{} {} {}\n",
                p.display(),
                m.len(),
                mtime.as_nanos()
            ));
        }
    };
    for root in APT_STATE {
        let root = Path::new(root);
        add(root);
        if let Ok(entries) = std::fs::read_dir(root) {
            let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            paths.sort();
            paths.iter().for_each(|p| add(p));
        }
    }
    crate::recipe::sha256_hex(text.as_bytes())
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ResolveMemo {
    fingerprint: String,
    kernel: ResolvedKernel,
}

/// [`resolve`], remembered in `memo` until apt's lists or sources change
/// (`apt-cache` alone takes seconds on a busy machine; a cache hit should not).
pub(crate) fn resolve_memo(
    flavour: &str,
    memo: &Path,
    workdir: &Path,
    log: &dyn Fn(&str),
) -> Result<ResolvedKernel, ImageError> {
    let fingerprint = apt_fingerprint(flavour);
    if let Some(m) = std::fs::read(memo)
        .ok()
        .and_then(|b| serde_json::from_slice::<ResolveMemo>(&b).ok())
    {
        if m.fingerprint == fingerprint {
            return Ok(m.kernel);
        }
    }
    let kernel = resolve(flavour, workdir, log)?;
    // The lists may have changed during resolve (apt-get update): fingerprint again.
    let m = ResolveMemo {
        fingerprint: apt_fingerprint(flavour),
        kernel,
    };
    if let Ok(json) = serde_json::to_vec(&m) {
        let tmp = memo.with_extension("tmp");
        if std::fs::write(&tmp, json).is_ok() {
            let _ = std::fs::rename(&tmp, memo); // best effort: only a speed-up
        }
    }
    Ok(m.kernel)
}

/// `apt-get download <spec>` into `dir`, with one `apt-get update` retry
/// when apt does not know the package. Returns the downloaded `.deb`.
pub(crate) fn download(spec: &str, dir: &Path, log: &dyn Fn(&str)) -> Result<PathBuf, ImageError> {
    std::fs::create_dir_all(dir).map_err(ImageError::io("cannot create", dir))?;
    let name = spec.split('=').next().unwrap_or(spec);
    let attempt = || {
        tools::run(
            APT_GET,
            os_args!["-q", "-o", "APT::Sandbox::User=root", "download", spec],
            Some(dir),
            false,
            log,
        )
    };
    if let Err(first) = attempt() {
        log("apt-get download failed; running apt-get update and retrying");
        tools::run(APT_GET, os_args!["-q", "update"], None, false, log).map_err(|e| {
            ImageError::Download {
                package: spec.to_string(),
                detail: format!("{first}; then apt-get update: {e}"),
            }
        })?;
        attempt().map_err(|e| ImageError::Download {
            package: spec.to_string(),
            detail: e.to_string(),
        })?;
    }
    let prefix = format!("{name}_");
    let entries = std::fs::read_dir(dir).map_err(ImageError::io("cannot read", dir))?;
    for e in entries.flatten() {
        let fname = e.file_name().to_string_lossy().into_owned();
        if fname.starts_with(&prefix) && fname.ends_with(".deb") {
            return Ok(e.path());
        }
    }
    Err(ImageError::Download {
        package: spec.to_string(),
        detail: format!("no {prefix}*.deb in {}", dir.display()),
    })
}

/// The unpacked kernel package.
pub(crate) struct ExtractedKernel {
    /// `boot/vmlinuz-<ver>`.
    pub vmlinuz: PathBuf,
    /// `lib/modules/<ver>`.
    pub modules_dir: PathBuf,
    /// Parsed dependency database.
    pub db: ModuleDb,
}

/// Downloads and unpacks `k` into `workdir`, generating `modules.dep` with
/// `depmod -b` when the package does not ship one (Debian's does not).
pub(crate) fn fetch(
    k: &ResolvedKernel,
    workdir: &Path,
    log: &dyn Fn(&str),
) -> Result<ExtractedKernel, ImageError> {
    let spec = if k.package_version.is_empty() {
        k.package.clone()
    } else {
        format!("{}={}", k.package, k.package_version)
    };
    let deb = download(&spec, &workdir.join("deb"), log)?;
    let root = workdir.join("x");
    log(&format!(
        "unpacking {}",
        deb.file_name().unwrap_or_default().to_string_lossy()
    ));
    tools::run(DPKG_DEB, os_args!["-x", deb, root], None, false, log)?;
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{}", k.version));
    if !vmlinuz.is_file() {
        return Err(ImageError::KernelContent(format!(
            "{} has no boot/vmlinuz-{}",
            k.package, k.version
        )));
    }
    // Merged-/usr packages ship usr/lib/modules; depmod -b looks in lib/modules.
    if !root.join("lib/modules").exists() && root.join("usr/lib/modules").exists() {
        std::os::unix::fs::symlink("usr/lib", root.join("lib"))
            .map_err(ImageError::io("cannot symlink", root.join("lib")))?;
    }
    let modules_dir = root.join("lib/modules").join(&k.version);
    if !modules_dir.is_dir() {
        return Err(ImageError::KernelContent(format!(
            "{} has no lib/modules/{}",
            k.package, k.version
        )));
    }
    let dep = modules_dir.join("modules.dep");
    if !dep.is_file() {
        log("generating modules.dep with depmod");
        tools::run(DEPMOD, os_args!["-b", root, k.version], None, false, log)?;
    }
    let read = |name: &str| std::fs::read_to_string(modules_dir.join(name)).unwrap_or_default();
    let dep_text = std::fs::read_to_string(&dep).map_err(ImageError::io("cannot read", &dep))?;
    let mut db = ModuleDb::parse_dep(&dep_text);
    db.add_softdeps(&read("modules.softdep"));
    db.add_aliases(&read("modules.alias"));
    Ok(ExtractedKernel {
        vmlinuz,
        modules_dir,
        db,
    })
}

/// Reads a module file, decompressing `.ko.xz` / `.ko.zst` so busybox
/// `insmod` can load it.
pub(crate) fn read_module(path: &Path) -> Result<Vec<u8>, ImageError> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some(XZ)
    } else if name.ends_with(".zst") {
        Some(ZSTD)
    } else {
        None
    };
    match tool {
        None => std::fs::read(path).map_err(ImageError::io("cannot read", path)),
        Some(t) => Ok(tools::run(t, os_args!["-dc", path], None, true, &|_| {})?.stdout),
    }
}

/// Where the compressed kernel sits inside a bzImage, from its setup header
/// (`setup_sects` at 0x1f1, `payload_offset`/`payload_length` at 0x248).
pub(crate) fn bzimage_payload(b: &[u8]) -> Option<&[u8]> {
    if b.get(0x202..0x206)? != b"HdrS" {
        return None;
    }
    let setup_sects = match *b.get(0x1f1)? {
        0 => 4,
        n => usize::from(n),
    };
    let u32_at = |o: usize| {
        b.get(o..o + 4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
    };
    let start = (setup_sects + 1) * 512 + u32_at(0x248)?;
    b.get(start..start.checked_add(u32_at(0x24c)?)?)
}

/// The uncompressed kernel ELF (`vmlinux`) inside a bzImage, for booting
/// through its PVH entry point (`qemu -kernel vmlinux`), which skips the
/// in-guest decompression: seconds under TCG. `Ok(None)` when the payload
/// is not xz-compressed or not an ELF.
pub(crate) fn extract_vmlinux(
    vmlinuz: &Path,
    workdir: &Path,
) -> Result<Option<Vec<u8>>, ImageError> {
    let bytes = std::fs::read(vmlinuz).map_err(ImageError::io("cannot read", vmlinuz))?;
    let Some(payload) = bzimage_payload(&bytes) else {
        return Ok(None);
    };
    if !payload.starts_with(b"\xfd7zXZ\x00") {
        return Ok(None);
    }
    let payload_path = workdir.join("vmlinux.xz");
    std::fs::write(&payload_path, payload)
        .map_err(ImageError::io("cannot write", &payload_path))?;
    let out = tools::run(
        XZ,
        os_args!["-dc", "--single-stream", payload_path],
        None,
        true,
        &|_| {},
    )?;
    let _ = std::fs::remove_file(&payload_path);
    Ok(out.stdout.starts_with(b"\x7fELF").then_some(out.stdout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_bookworm_metapackage_depends() {
        let k = parse_depends("linux-image-6.1.0-57-amd64 (= 6.1.192-3)", "amd64").unwrap();
        assert_eq!(k.package, "linux-image-6.1.0-57-amd64");
        assert_eq!(k.version, "6.1.0-57-amd64");
        assert_eq!(k.package_version, "6.1.192-3");
    }

    #[test]
    fn skips_unrelated_dependencies() {
        let d =
            "initramfs-tools | linux-initramfs-tool, linux-image-6.12.9-cloud-amd64 (= 6.12.9-1)";
        let k = parse_depends(d, "cloud-amd64").unwrap();
        assert_eq!(k.version, "6.12.9-cloud-amd64");
        assert!(parse_depends(d, "arm64").is_none());
        assert!(parse_depends("linux-image-amd64", "amd64").is_none());
    }

    #[test]
    fn reads_control_fields() {
        let c = "Package: linux-image-amd64\nVersion: 6.1.192-3\nDepends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)\n";
        assert_eq!(
            field(c, "Depends"),
            Some("linux-image-6.1.0-57-amd64 (= 6.1.192-3)")
        );
        assert_eq!(field(c, "Version"), Some("6.1.192-3"));
    }

    #[test]
    fn bzimage_payload_needs_a_setup_header() {
        assert!(bzimage_payload(b"not a kernel").is_none());
        let mut b = vec![0u8; 4096];
        b[0x202..0x206].copy_from_slice(b"HdrS");
        b[0x1f1] = 1; // protected-mode code at 1024
        b[0x248..0x24c].copy_from_slice(&16u32.to_le_bytes());
        b[0x24c..0x250].copy_from_slice(&6u32.to_le_bytes());
        b[1040..1046].copy_from_slice(b"\xfd7zXZ\x00");
        assert_eq!(bzimage_payload(&b), Some(&b"\xfd7zXZ\x00"[..]));
        b[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(bzimage_payload(&b).is_none());
    }
}
