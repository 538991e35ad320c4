//! The agent under test (its binary on a unix socket in a temp dir) and the
//! helpers the tests share, raw socket ones included.

use std::io::Read;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::Duration;

use strata_proto::frame::{decode_frame, Decoded, Frame, SYNC_MAGIC};
use strata_proto::{AgentClient, ExecRequest, Request, Response};

pub(crate) struct Agent {
    pub(crate) child: Child,
    pub(crate) dir: tempfile::TempDir,
    pub(crate) sock: PathBuf,
}

impl Agent {
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    pub(crate) fn start_with(extra: &[&str]) -> Self {
        Self::start_binary(
            std::path::Path::new(env!("CARGO_BIN_EXE_strata-agent")),
            extra,
        )
    }

    /// Like [`Agent::start_with`], with another agent binary (e.g. an older
    /// release's).
    pub(crate) fn start_binary(bin: &std::path::Path, extra: &[&str]) -> Self {
        Self::spawn(bin, extra, &[])
    }

    /// This tree's agent started with `ignored` signals set to SIG_IGN, as
    /// a shell's background job (SIGINT, SIGQUIT) or `nohup` (SIGHUP)
    /// starts it: what it runs must still get default dispositions.
    pub(crate) fn start_ignoring(ignored: &'static [i32]) -> Self {
        Self::spawn(
            std::path::Path::new(env!("CARGO_BIN_EXE_strata-agent")),
            &[],
            ignored,
        )
    }

    fn spawn(bin: &std::path::Path, extra: &[&str], ignored: &'static [i32]) -> Self {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::Builder::new()
            .prefix("strata-agent-test-")
            .tempdir_in("/tmp")
            .unwrap();
        let sock = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("--listen-unix")
            .arg(&sock)
            .arg("--dry-system")
            .args(extra)
            .env("STRATA_AGENT_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if !ignored.is_empty() {
            // SAFETY: between fork and exec, only signal(2), which is
            // async-signal-safe, on a static list.
            unsafe {
                cmd.pre_exec(move || {
                    for &sig in ignored {
                        libc::signal(sig, libc::SIG_IGN);
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().unwrap();
        Self { child, dir, sock }
    }

    pub(crate) async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.sock, Duration::from_secs(10))
            .await
            .unwrap()
    }

    pub(crate) fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_str().unwrap().to_owned()
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    pub(crate) fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn sh(s: &str) -> ExecRequest {
    ExecRequest::shell(s)
}

/// Processes whose process group is `pgid` (from /proc).
pub(crate) fn group_members(pgid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let state = fields.first().copied().unwrap_or("");
        if fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid) && state != "Z" {
            let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            out.push((pid, cmd));
        }
    }
    out
}

/// Raw socket helper: read until a control frame decodes (or timeout).
pub(crate) fn raw_read_response(s: &mut StdUnixStream) -> Option<(u32, Response)> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        let mut off = 0;
        while let Ok(Some((item, used))) = decode_frame(&buf[off..]) {
            off += used;
            if let Decoded::Frame(f) = item {
                if let Ok(r) = f.parse::<Response>() {
                    return Some((f.id, r));
                }
            }
        }
        let n = s.read(&mut tmp).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

pub(crate) fn raw_hello(version: u32) -> Vec<u8> {
    let mut v = SYNC_MAGIC.to_vec();
    v.extend_from_slice(
        &Frame::control(0, &Request::Hello { version, nonce: 77 })
            .unwrap()
            .encode()
            .unwrap(),
    );
    v
}
