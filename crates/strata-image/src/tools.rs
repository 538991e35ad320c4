//! Host tools the builder calls, with the Debian package that provides each,
//! and a runner that keeps the tail of a command's output for error messages.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;

use crate::error::ImageError;

/// A host program and the Debian package that installs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tool {
    /// Program name looked up on `PATH` (plus the sbin directories).
    pub name: &'static str,
    /// Debian package providing it.
    pub package: &'static str,
}

pub(crate) const APT_GET: Tool = Tool {
    name: "apt-get",
    package: "apt",
};
pub(crate) const APT_CACHE: Tool = Tool {
    name: "apt-cache",
    package: "apt",
};
pub(crate) const DPKG_DEB: Tool = Tool {
    name: "dpkg-deb",
    package: "dpkg",
};
pub(crate) const DPKG_QUERY: Tool = Tool {
    name: "dpkg-query",
    package: "dpkg",
};
pub(crate) const DEPMOD: Tool = Tool {
    name: "depmod",
    package: "kmod",
};
pub(crate) const DEBOOTSTRAP: Tool = Tool {
    name: "debootstrap",
    package: "debootstrap",
};
pub(crate) const MKFS_EXT4: Tool = Tool {
    name: "mkfs.ext4",
    package: "e2fsprogs",
};
pub(crate) const SHA256SUM: Tool = Tool {
    name: "sha256sum",
    package: "coreutils",
};
pub(crate) const CP: Tool = Tool {
    name: "cp",
    package: "coreutils",
};
pub(crate) const XZ: Tool = Tool {
    name: "xz",
    package: "xz-utils",
};
pub(crate) const ZSTD: Tool = Tool {
    name: "zstd",
    package: "zstd",
};

/// Every tool a cold build needs (checked up front so a build fails fast).
pub(crate) const BUILD_TOOLS: &[Tool] = &[
    APT_GET,
    APT_CACHE,
    DPKG_DEB,
    DPKG_QUERY,
    DEPMOD,
    DEBOOTSTRAP,
    MKFS_EXT4,
    CP,
];

const EXTRA_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Finds `tool` on `PATH` or in the usual sbin directories (which a
/// non-root `PATH` often lacks).
pub(crate) fn find(tool: Tool) -> Result<PathBuf, ImageError> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path_var).chain(EXTRA_DIRS.iter().map(PathBuf::from));
    for dir in dirs {
        let candidate = dir.join(tool.name);
        if is_executable(&candidate) {
            return Ok(candidate);
        }
    }
    Err(ImageError::MissingTool {
        tool: tool.name.to_string(),
        package: tool.package,
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Checks that every tool in `tools` is installed.
pub(crate) fn require_all(tools: &[Tool]) -> Result<(), ImageError> {
    for t in tools {
        find(*t)?;
    }
    Ok(())
}

/// Output of a successful command.
pub(crate) struct Output {
    /// Captured standard output.
    pub stdout: Vec<u8>,
}

const TAIL_LINES: usize = 20;

/// Runs `tool` with `args` (and optional working dir). Standard error lines
/// (and standard output lines when `stream_stdout` is false) are passed to
/// `on_line` as they arrive; the last lines go into the error on failure.
pub(crate) fn run(
    tool: Tool,
    args: &[&std::ffi::OsStr],
    cwd: Option<&Path>,
    capture_stdout: bool,
    on_line: &dyn Fn(&str),
) -> Result<Output, ImageError> {
    let program = find(tool)?;
    let mut cmd = Command::new(&program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Non-interactive and C locale, so output is parseable and apt never asks.
    cmd.env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive");
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let command_line = {
        let mut s = tool.name.to_string();
        for a in args {
            s.push(' ');
            s.push_str(&a.to_string_lossy());
        }
        if s.len() > 300 {
            s.truncate(300);
            s.push('…');
        }
        s
    };
    let mut child = cmd.spawn().map_err(|source| ImageError::Spawn {
        command: tool.name.to_string(),
        source,
    })?;
    let (tx, rx) = mpsc::channel::<String>();
    let mut readers = Vec::new();
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward_lines(err, &tx)));
    }
    let mut stdout_buf = Vec::new();
    let stdout_reader = child.stdout.take().map(|mut out| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if capture_stdout {
                let _ = out.read_to_end(&mut buf);
            } else {
                forward_lines(out, &tx);
            }
            buf
        })
    });
    drop(tx);
    let mut tail: VecDeque<String> = VecDeque::with_capacity(TAIL_LINES);
    for line in rx {
        on_line(&line);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    for r in readers {
        let _ = r.join();
    }
    if let Some(r) = stdout_reader {
        stdout_buf = r.join().unwrap_or_default();
    }
    let status = child.wait().map_err(|source| ImageError::Spawn {
        command: tool.name.to_string(),
        source,
    })?;
    if !status.success() {
        if capture_stdout {
            let text = String::from_utf8_lossy(&stdout_buf);
            for line in text.lines().rev().take(5) {
                tail.push_back(line.to_string());
            }
        }
        return Err(ImageError::CommandFailed {
            command: command_line,
            status: status.to_string(),
            output_tail: tail.into_iter().collect::<Vec<_>>().join("\n"),
        });
    }
    Ok(Output { stdout: stdout_buf })
}

fn forward_lines(r: impl Read, tx: &mpsc::Sender<String>) {
    for line in BufReader::new(r).lines() {
        match line {
            Ok(l) => {
                if tx.send(l).is_err() {
                    break;
                }
            }
            Err(_) => break,
        }
    }
}

/// Shorthand for building an argument list of `OsStr`s.
#[macro_export]
#[doc(hidden)]
macro_rules! os_args {
    ($($a:expr),* $(,)?) => {
        &[$(::std::convert::AsRef::<::std::ffi::OsStr>::as_ref(&$a)),*]
    };
}
