//! The size-capped serial console log.
//!
//! QEMU writes the serial console to a unix socket chardev (`server=on,wait=off`); a
//! copier task in the driver's process reads it and appends to `console.log`, and when
//! the file would pass its cap, keeps only its newest half (rewritten through a temp
//! file and a rename). Why a socket and not `-chardev file`: a file cannot be capped
//! from QEMU's side, and growing it until the next daemon arrives is unbounded. Why
//! not a pipe: with no reader a pipe fills and then stalls the guest's serial port.
//! A socket chardev with no client connected drops the output instead, so a VM keeps
//! running when the daemon is killed; the next daemon adopts the VM and reconnects.
//! The price is that console output printed while no daemon runs is lost.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

/// Connects to the console socket, retrying until `timeout`.
pub(crate) async fn connect(sock: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match UnixStream::connect(sock).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// Copies the console stream into `log`, keeping the file at most `max` bytes.
/// The file work (appends, and the rewrites of a trim) runs on the blocking
/// pool, one chunk at a time: a guest spamming its console never blocks a
/// runtime worker, and while a chunk is written the socket's buffer (then
/// QEMU's chardev, which drops output with nobody reading) holds the rest.
pub(crate) async fn copier(mut stream: UnixStream, log: PathBuf, max: u64) {
    let log = std::sync::Arc::new(log);
    let opened = {
        let log = log.clone();
        tokio::task::spawn_blocking(move || open_capped(&log, max)).await
    };
    let mut file = match opened {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            tracing::warn!(path = %log.display(), error = %e, "cannot open console log");
            return;
        }
        Err(_) => return,
    };
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let chunk = buf[..n].to_vec();
        let l = log.clone();
        let written = tokio::task::spawn_blocking(move || {
            let r = append_capped(&mut file, &l, max, &chunk);
            (file, r)
        })
        .await;
        match written {
            Ok((f, Ok(()))) => file = f,
            Ok((_, Err(e))) => {
                tracing::warn!(path = %log.display(), error = %e, "console log write failed");
                return;
            }
            Err(_) => return,
        }
    }
}

fn open_append(log: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
}

fn open_capped(log: &Path, max: u64) -> std::io::Result<std::fs::File> {
    let f = open_append(log)?;
    if f.metadata()?.len() > max {
        drop(f);
        return trim(log, max / 2);
    }
    Ok(f)
}

/// Appends `data`, trimming first if the cap would be passed. Never exceeds `max`.
pub(crate) fn append_capped(
    file: &mut std::fs::File,
    log: &Path,
    max: u64,
    data: &[u8],
) -> std::io::Result<()> {
    let keep_new = &data[data.len().saturating_sub((max / 2) as usize)..];
    let size = file.metadata()?.len();
    if size + keep_new.len() as u64 > max {
        let keep_old = (max / 2).saturating_sub(keep_new.len() as u64);
        *file = trim(log, keep_old)?;
    }
    file.write_all(keep_new)
}

/// Rewrites `log` to its last `keep` bytes and returns it opened for appending.
fn trim(log: &Path, keep: u64) -> std::io::Result<std::fs::File> {
    let mut old = std::fs::File::open(log)?;
    let len = old.metadata()?.len();
    old.seek(SeekFrom::Start(len.saturating_sub(keep)))?;
    let mut tail = Vec::new();
    old.take(keep).read_to_end(&mut tail)?;
    let tmp = log.with_extension("log.tmp");
    std::fs::write(&tmp, &tail)?;
    std::fs::rename(&tmp, log)?;
    open_append(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_never_passes_its_cap_and_keeps_the_newest_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let max = 4096;
        let mut f = open_capped(&log, max).unwrap();
        for i in 0..2000u32 {
            let line = format!("line {i:05}\n");
            append_capped(&mut f, &log, max, line.as_bytes()).unwrap();
            assert!(std::fs::metadata(&log).unwrap().len() <= max);
        }
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            text.ends_with("line 01999\n"),
            "{}",
            &text[text.len() - 20..]
        );
        // One chunk bigger than the cap.
        append_capped(&mut f, &log, max, &vec![b'z'; 10_000]).unwrap();
        assert!(std::fs::metadata(&log).unwrap().len() <= max);
        // Re-opening an oversized file (e.g. left by an older version) trims it.
        std::fs::write(&log, vec![b'a'; 10_000]).unwrap();
        let _f = open_capped(&log, max).unwrap();
        assert!(std::fs::metadata(&log).unwrap().len() <= max);
    }
}
