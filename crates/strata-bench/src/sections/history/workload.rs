//! The agent workload of the `history` section: a local git repository made
//! on the host, a folder of small wheels (zip files written here), the guest
//! scripts (a wheel installer, a long-running counter, an editor), and the
//! schedule of activity steps.

use std::path::Path;
use std::process::Command;

use anyhow::{anyhow, Context as _, Result};
use base64::Engine as _;
use sha2::{Digest, Sha256};

/// Where the workload lives in the guest.
pub const GUEST_REPO: &str = "/srv/repo";
/// The wheel folder in the guest.
pub const GUEST_WHEELS: &str = "/srv/wheels";
/// Guest scripts.
pub const GUEST_TOOLS: &str = "/srv/tools";
/// The agent's workspace (checksummed).
pub const GUEST_WORK: &str = "/work";
/// A tmpfs of the guest (RAM state): the counter and the step marker.
pub const GUEST_RAM_DIR: &str = "/run/hist";

/// A small deterministic pseudo-random generator (xorshift64*), for file contents.
pub struct Gen(u64);

impl Gen {
    /// A generator from `seed` (any value).
    pub fn new(seed: u64) -> Gen {
        Gen(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// `n` lines of plausible source text.
    pub fn text(&mut self, n: usize) -> String {
        const WORDS: &[&str] = &[
            "value", "index", "result", "buffer", "config", "request", "handle", "state", "item",
            "count", "parse", "render", "token", "cache", "error", "node", "path", "client",
        ];
        let mut s = String::new();
        for i in 0..n {
            let a = WORDS[(self.next_u64() % WORDS.len() as u64) as usize];
            let b = WORDS[(self.next_u64() % WORDS.len() as u64) as usize];
            let k = self.next_u64() % 10_000;
            s.push_str(&format!("    {a}_{i} = {b}_{k} + {k}  # {a} {b}\n"));
        }
        s
    }
}

// ------------------------------------------------------------------ zip / wheels

/// CRC-32 (IEEE 802.3, the one zip uses).
pub fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A zip archive of `entries` (name, bytes), stored without compression.
pub fn stored_zip(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
    fn u16le(v: &mut Vec<u8>, x: u16) {
        v.extend_from_slice(&x.to_le_bytes());
    }
    fn u32le(v: &mut Vec<u8>, x: u32) {
        v.extend_from_slice(&x.to_le_bytes());
    }
    const DOS_DATE: u16 = (2026 - 1980) << 9 | 1 << 5 | 1;
    // The fields a local header and a central directory entry share, from
    // "version needed" to "extra field length".
    let common = |v: &mut Vec<u8>, crc: u32, len: u32, name_len: u16| {
        u16le(v, 20); // version needed
        u16le(v, 0); // flags
        u16le(v, 0); // stored
        u16le(v, 0); // time
        u16le(v, DOS_DATE);
        u32le(v, crc);
        u32le(v, len); // compressed size
        u32le(v, len); // uncompressed size
        u16le(v, name_len);
        u16le(v, 0); // extra
    };
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in entries {
        let crc = crc32(data);
        let offset = out.len() as u32;
        // Local file header.
        u32le(&mut out, 0x0403_4b50);
        common(&mut out, crc, data.len() as u32, name.len() as u16);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        // Central directory entry.
        u32le(&mut central, 0x0201_4b50);
        u16le(&mut central, 3 << 8 | 20); // made by: unix, 2.0
        common(&mut central, crc, data.len() as u32, name.len() as u16);
        u16le(&mut central, 0); // comment
        u16le(&mut central, 0); // disk
        u16le(&mut central, 0); // internal attributes
        u32le(&mut central, 0o100644 << 16); // external: regular file, rw-r--r--
        u32le(&mut central, offset);
        central.extend_from_slice(name.as_bytes());
    }
    let cd_offset = out.len() as u32;
    let cd_size = central.len() as u32;
    out.extend_from_slice(&central);
    u32le(&mut out, 0x0605_4b50);
    u16le(&mut out, 0);
    u16le(&mut out, 0);
    u16le(&mut out, entries.len() as u16);
    u16le(&mut out, entries.len() as u16);
    u32le(&mut out, cd_size);
    u32le(&mut out, cd_offset);
    u16le(&mut out, 0);
    out
}

/// A pure-Python wheel `<name>-<version>-py3-none-any.whl` holding `files`
/// (paths inside the package directory) plus its `.dist-info` (METADATA,
/// WHEEL, RECORD with sha256 of every file, as pip checks).
pub fn wheel(name: &str, version: &str, files: &[(&str, Vec<u8>)]) -> (String, Vec<u8>) {
    let di = format!("{name}-{version}.dist-info");
    let mut entries: Vec<(String, Vec<u8>)> = files
        .iter()
        .map(|(p, d)| (format!("{name}/{p}"), d.clone()))
        .collect();
    entries.push((
        format!("{di}/METADATA"),
        format!("Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: strata-bench workload package\n").into_bytes(),
    ));
    entries.push((
        format!("{di}/WHEEL"),
        b"Wheel-Version: 1.0\nGenerator: strata-bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            .to_vec(),
    ));
    let mut record = String::new();
    for (p, d) in &entries {
        let h = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(d));
        record.push_str(&format!("{p},sha256={h},{}\n", d.len()));
    }
    record.push_str(&format!("{di}/RECORD,,\n"));
    entries.push((format!("{di}/RECORD"), record.into_bytes()));
    (
        format!("{name}-{version}-py3-none-any.whl"),
        stored_zip(&entries),
    )
}

/// The wheel folder: three packages, two of them in two versions (upgrades).
pub fn wheels() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, version, kib) in [
        ("agentkit", "1.0.0", 96),
        ("agentkit", "1.1.0", 112),
        ("tinyjson", "0.3.0", 48),
        ("tinyjson", "0.4.0", 56),
        ("textwrapx", "2.0.1", 64),
    ] {
        let mut g = Gen::new(name.len() as u64 * 1000 + kib);
        let mut data = vec![0u8; kib as usize * 1024];
        for c in data.chunks_mut(8) {
            let v = g.next_u64().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
        let blob = base64::engine::general_purpose::STANDARD.encode(&data);
        let init = format!(
            "\"\"\"{name}: a workload package of strata-bench.\"\"\"\n__version__ = \"{version}\"\nfrom . import core\n"
        );
        let core = format!(
            "def run(x):\n    return x * 2\n\n\ndef table():\n{}",
            g.text(40)
        );
        let w = wheel(
            name,
            version,
            &[
                ("__init__.py", init.into_bytes()),
                ("core.py", core.into_bytes()),
                ("data/blob.b64", blob.into_bytes()),
            ],
        );
        out.push(w);
    }
    out
}

// ------------------------------------------------------------------ git repo

/// Writes a repository of `files` files into `dir` with host `git`, in
/// `commits` commits (the first adds everything, each later one edits some
/// files and adds one), and packs it into a tar at `tar`.
pub fn make_repo(dir: &Path, tar: &Path, files: usize, commits: usize) -> Result<()> {
    let git = |args: &[&str]| -> Result<()> {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args([
                "-c",
                "user.name=strata-bench",
                "-c",
                "user.email=bench@localhost",
                "-c",
                "init.defaultBranch=main",
            ])
            .args(args)
            .output()
            .with_context(|| format!("run host git {args:?} (is git installed?)"))?;
        if !out.status.success() {
            return Err(anyhow!(
                "host git {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    };
    std::fs::create_dir_all(dir)?;
    let mut g = Gen::new(7);
    let path_of = |i: usize| -> String {
        match i % 10 {
            0 => format!("docs/page_{i:03}.md"),
            1 => format!("tests/test_{i:03}.py"),
            _ => format!("src/pkg{:02}/mod_{i:03}.py", i % 12),
        }
    };
    let write = |rel: &str, body: &str| -> Result<()> {
        let p = dir.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&p, body).with_context(|| format!("write {}", p.display()))
    };
    write(
        "README.md",
        "# workload\n\nA repository the history benchmark clones.\n",
    )?;
    for i in 0..files {
        let n = 20 + (g.next_u64() % 80) as usize;
        write(&path_of(i), &format!("def f_{i}():\n{}", g.text(n)))?;
    }
    git(&["init", "-q"])?;
    git(&["add", "-A"])?;
    git(&["commit", "-qm", "initial import"])?;
    for c in 1..commits {
        for _ in 0..8 {
            let i = (g.next_u64() % files as u64) as usize;
            let p = dir.join(path_of(i));
            let mut body = std::fs::read_to_string(&p)?;
            body.push_str(&g.text(5));
            std::fs::write(&p, body)?;
        }
        write(
            &format!("src/added/feature_{c:02}.py"),
            &format!("def feature_{c}():\n{}", g.text(30)),
        )?;
        git(&["add", "-A"])?;
        git(&["commit", "-qm", &format!("change {c}")])?;
    }
    let out = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg(tar)
        .arg(".")
        .output()
        .context("run host tar")?;
    if !out.status.success() {
        return Err(anyhow!("tar: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

// ------------------------------------------------------------------ guest scripts

/// Installs wheels the way pip does for pure-Python wheels (the image has
/// python3 but no pip): checks every file against RECORD, removes an
/// installed older/newer version first, extracts into site-packages, writes
/// INSTALLER, byte-compiles.
pub const INSTALLER_PY: &str = r#"import base64, compileall, csv, hashlib, io, os, shutil, sys, sysconfig, zipfile
site = sysconfig.get_path("purelib")
os.makedirs(site, exist_ok=True)
for whl in sys.argv[1:]:
    name, version = os.path.basename(whl).split("-")[:2]
    for d in os.listdir(site):
        if d.endswith(".dist-info") and d.split("-")[0] == name:
            with open(os.path.join(site, d, "RECORD")) as f:
                tops = {row[0].split("/")[0] for row in csv.reader(f) if row}
            for t in tops:
                shutil.rmtree(os.path.join(site, t), ignore_errors=True)
    with zipfile.ZipFile(whl) as z:
        bad = z.testzip()
        if bad:
            sys.exit(f"{whl}: bad CRC in {bad}")
        rows = list(csv.reader(io.StringIO(z.read(f"{name}-{version}.dist-info/RECORD").decode())))
        for path, h, size in rows:
            if not h:
                continue
            algo, want = h.split("=", 1)
            data = z.read(path)
            got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
            if got != want or len(data) != int(size):
                sys.exit(f"{whl}: {path} does not match RECORD")
        z.extractall(site)
    with open(os.path.join(site, f"{name}-{version}.dist-info", "INSTALLER"), "w") as f:
        f.write("strata-bench\n")
    compileall.compile_dir(os.path.join(site, name), quiet=1)
    print(f"installed {name} {version}")
"#;

/// The long-running process: a counter kept in memory, written to the tmpfs
/// every second (with its pid).
pub const COUNTER_PY: &str = r#"import os, time
n = 0
pid = os.getpid()
while True:
    n += 1
    with open("/run/hist/counter.tmp", "w") as f:
        f.write(f"{n} {pid}\n")
    os.replace("/run/hist/counter.tmp", "/run/hist/counter")
    time.sleep(1)
"#;

/// Edits files of the clone as an agent would: appends to some, rewrites one,
/// adds a new one (argv: repo dir, step number).
pub const EDIT_PY: &str = r#"import os, random, sys
root, step = sys.argv[1], int(sys.argv[2])
rng = random.Random(step)
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "src")) for f in fs if f.endswith(".py"))
for p in rng.sample(files, min(6, len(files))):
    with open(p, "a") as f:
        f.write(f"\n# edited at step {step}\ndef patch_{step}():\n    return {rng.randint(0, 10**6)}\n")
p = rng.choice(files)
with open(p, "w") as f:
    f.write("".join(f"line_{i} = {rng.random()!r}\n" for i in range(200)))
os.makedirs(os.path.join(root, "src", "agent"), exist_ok=True)
with open(os.path.join(root, "src", "agent", f"step_{step}.py"), "w") as f:
    f.write("".join(f"def g_{i}():\n    return {i * step}\n" for i in range(100)))
"#;

/// The shell text that prints the workspace checksum: sha256 over the sorted
/// list of `sha256sum` lines of every file under the workspace and the
/// installed packages' site-packages.
pub fn checksum_cmd(site: &str) -> String {
    format!(
        "cd / && find {w} {site} -type f 2>/dev/null | LC_ALL=C sort | xargs -d '\\n' -r sha256sum | sha256sum | cut -d' ' -f1",
        w = GUEST_WORK.trim_start_matches('/'),
        site = site.trim_start_matches('/'),
    )
}

/// One activity step: what it is called and its shell script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Short label (table, data).
    pub label: &'static str,
    /// Shell script run with `sh -c` (`set -e` is prepended).
    pub script: String,
}

/// The `k`-th activity step of the agent (cycles through 6 kinds: clone,
/// install, edit + commit, build, upgrade, edit + commit + tidy).
pub fn step(k: u64) -> Step {
    let cycle = k / 6;
    // An identity for every git command: without one git looks the host name
    // up to make one (a DNS query in a guest with no network: seconds).
    let git = "git -c user.name=agent -c user.email=agent@sandbox -c gc.auto=0";
    let proj = format!("{GUEST_WORK}/proj");
    let commit = format!(
        "python3 {GUEST_TOOLS}/edit.py {proj} {k} && cd {proj} && {git} add -A && {git} commit -qm 'agent step {k}'"
    );
    let (v_agent, v_json) = if cycle.is_multiple_of(2) {
        ("1.0.0", "0.3.0")
    } else {
        ("1.1.0", "0.4.0")
    };
    let (u_agent, u_json) = if cycle.is_multiple_of(2) {
        ("1.1.0", "0.4.0")
    } else {
        ("1.0.0", "0.3.0")
    };
    let whl = |n: &str, v: &str| format!("{GUEST_WHEELS}/{n}-{v}-py3-none-any.whl");
    match k % 6 {
        0 => Step {
            label: "git clone",
            script: format!(
                "rm -rf {proj} && mkdir -p {GUEST_WORK} && {git} clone -q {GUEST_REPO} {proj} && {git} -C {proj} log --oneline | wc -l >/dev/null"
            ),
        },
        1 => Step {
            label: "pip install",
            script: format!(
                "python3 {GUEST_TOOLS}/install.py {} {} {} >/dev/null && python3 -c 'import agentkit, tinyjson, textwrapx; assert agentkit.core.run(2) == 4'",
                whl("agentkit", v_agent),
                whl("tinyjson", v_json),
                whl("textwrapx", "2.0.1")
            ),
        },
        2 => Step {
            label: "edit + commit",
            script: commit,
        },
        3 => Step {
            label: "build",
            script: format!(
                "mkdir -p {proj}/build && head -c $((1024 * 1024 * (1 + {k} % 3))) /dev/urandom > {proj}/build/out-{k}.bin && tar -C {proj} -cf {proj}/build/src-{k}.tar src && ls -t {proj}/build/* | tail -n +5 | xargs -r rm -f"
            ),
        },
        4 => Step {
            label: "pip upgrade",
            script: format!(
                "python3 {GUEST_TOOLS}/install.py {} {} >/dev/null && python3 -c 'import agentkit; print(agentkit.__version__)' | grep -qx {u_agent}",
                whl("agentkit", u_agent),
                whl("tinyjson", u_json)
            ),
        },
        _ => Step {
            label: "edit + commit + gc",
            script: format!("{commit} && {git} -C {proj} gc -q"),
        },
    }
}

/// Sectors written (field 7) of a `/sys/block/<dev>/stat` line, in bytes.
pub fn disk_written_bytes(stat: &str) -> Result<u64> {
    let f: Vec<&str> = stat.split_whitespace().collect();
    let sectors: u64 = f
        .get(6)
        .ok_or_else(|| anyhow!("block stat has {} fields: {stat:?}", f.len()))?
        .parse()
        .with_context(|| format!("block stat {stat:?}"))?;
    Ok(sectors * 512)
}

/// `counter pid` as written by [`COUNTER_PY`].
pub fn parse_counter(s: &str) -> Result<(u64, u32)> {
    let mut it = s.split_whitespace();
    let n = it
        .next()
        .ok_or_else(|| anyhow!("empty counter file"))?
        .parse()
        .with_context(|| format!("counter {s:?}"))?;
    let pid = it
        .next()
        .ok_or_else(|| anyhow!("counter file without pid: {s:?}"))?
        .parse()
        .with_context(|| format!("counter pid {s:?}"))?;
    Ok((n, pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_known_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn zip_layout() {
        let z = stored_zip(&[("a.txt".into(), b"hello".to_vec()), ("b/c".into(), vec![])]);
        assert_eq!(&z[..4], &[0x50, 0x4b, 0x03, 0x04]);
        let eocd = &z[z.len() - 22..];
        assert_eq!(&eocd[..4], &[0x50, 0x4b, 0x05, 0x06]);
        assert_eq!(u16::from_le_bytes([eocd[10], eocd[11]]), 2);
        let cd_size = u32::from_le_bytes([eocd[12], eocd[13], eocd[14], eocd[15]]) as usize;
        let cd_off = u32::from_le_bytes([eocd[16], eocd[17], eocd[18], eocd[19]]) as usize;
        assert_eq!(cd_off + cd_size, z.len() - 22);
        assert_eq!(&z[cd_off..cd_off + 4], &[0x50, 0x4b, 0x01, 0x02]);
        // The local header of the first entry holds the data right after the name.
        assert_eq!(&z[30..35], b"a.txt");
        assert_eq!(&z[35..40], b"hello");
    }

    #[test]
    fn wheel_has_a_record_of_every_file() {
        let (name, z) = wheel("pkg", "1.0", &[("__init__.py", b"x = 1\n".to_vec())]);
        assert_eq!(name, "pkg-1.0-py3-none-any.whl");
        let s = String::from_utf8_lossy(&z);
        assert!(s.contains("pkg/__init__.py,sha256="));
        assert!(s.contains("pkg-1.0.dist-info/RECORD,,"));
        assert!(s.contains("Root-Is-Purelib: true"));
        assert_eq!(wheels().len(), 5);
    }

    #[test]
    fn steps_cycle_and_parse_helpers() {
        let labels: Vec<_> = (0..6).map(|k| step(k).label).collect();
        assert_eq!(labels[0], "git clone");
        assert_eq!(step(6).label, "git clone");
        assert!(step(1).script.contains("agentkit-1.0.0"));
        assert!(step(7).script.contains("agentkit-1.1.0"));
        assert!(step(4).script.contains("grep -qx 1.1.0"));
        let st = "  100 0 2000 30 55 1 4096 70 0 90 100 0 0 0 0";
        assert_eq!(disk_written_bytes(st).unwrap(), 4096 * 512);
        assert!(disk_written_bytes("1 2").is_err());
        assert_eq!(parse_counter("42 117\n").unwrap(), (42, 117));
        assert!(parse_counter("x").is_err());
        assert!(checksum_cmd("/usr/lib/x").contains("find work usr/lib/x"));
    }
}
