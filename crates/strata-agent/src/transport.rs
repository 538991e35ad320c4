//! Byte transports to the host: the virtio-serial port in the guest, or a
//! unix socket (`--listen-unix`) for tests on the host.
//!
//! Both run blocking threads with non-blocking fds and `poll(2)`, so a host
//! that is absent (virtio-serial: reads return EOF, `poll` reports `POLLHUP`,
//! writes would block) never blocks the agent: outgoing frames are dropped
//! while no host is connected or when they belong to an ended session.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

/// What the reader side reports to the session loop.
#[derive(Debug)]
pub enum Event {
    /// A host connected (connection generation).
    Connected(u64),
    /// Bytes from connection `gen`.
    Bytes(u64, Vec<u8>),
    /// Connection `gen` is gone.
    Disconnected(u64),
}

/// One encoded frame (or marker + frame) to send.
#[derive(Debug)]
pub struct Outgoing {
    /// Session epoch the bytes belong to; `None`: send regardless.
    pub epoch: Option<u64>,
    /// Encoded bytes.
    pub data: Bytes,
}

/// The session loop's ends of a transport.
pub struct Transport {
    /// Incoming events.
    pub events: mpsc::Receiver<Event>,
    /// Outgoing frames.
    pub out: mpsc::Sender<Outgoing>,
    /// Current session epoch; the writer drops frames of older epochs.
    pub epoch: Arc<AtomicU64>,
}

type Current = Arc<Mutex<Option<Arc<OwnedFd>>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// poll(2) one fd; returns revents (0 on timeout).
fn poll1(fd: RawFd, events: i16, timeout: Duration) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: `p` is a valid pollfd for the duration of the call; nfds = 1.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(if r == 0 { 0 } else { p.revents })
}

fn read_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: buf is valid for writes of buf.len() bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn write_fd(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: buf is valid for reads of buf.len() bytes.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Writes all of `data`, giving up when the peer is gone or `valid()` turns false.
fn write_all(fd: RawFd, mut data: &[u8], valid: &dyn Fn() -> bool) -> io::Result<()> {
    while !data.is_empty() {
        match write_fd(fd, data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let rev = poll1(fd, libc::POLLOUT, Duration::from_millis(200))?;
                if rev & libc::POLLOUT == 0
                    && rev & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
                {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
                if !valid() {
                    return Err(io::Error::other("session ended"));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn spawn_writer(
    mut rx: mpsc::Receiver<Outgoing>,
    current: Current,
    epoch: Arc<AtomicU64>,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("agent-writer".into())
        .spawn(move || {
            while let Some(item) = rx.blocking_recv() {
                let valid = || item.epoch.is_none_or(|e| e == epoch.load(Ordering::SeqCst));
                if !valid() {
                    continue;
                }
                let Some(fd) = lock(&current).clone() else {
                    continue;
                };
                if let Err(e) = write_all(fd.as_raw_fd(), &item.data, &valid) {
                    tracing::debug!(error = %e, "dropping outgoing frame");
                }
            }
        })?;
    Ok(())
}

fn channels() -> (mpsc::Sender<Event>, mpsc::Receiver<Outgoing>, Transport) {
    let (ev_tx, ev_rx) = mpsc::channel(64);
    let (out_tx, out_rx) = mpsc::channel(64);
    let t = Transport {
        events: ev_rx,
        out: out_tx,
        epoch: Arc::new(AtomicU64::new(1)),
    };
    (ev_tx, out_rx, t)
}

/// Serves one host connection at a time on a unix socket; a new connection
/// replaces the current one.
pub fn listen_unix(path: &Path) -> io::Result<Transport> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    let (ev_tx, out_rx, t) = channels();
    let current: Current = Arc::new(Mutex::new(None));
    spawn_writer(out_rx, current.clone(), t.epoch.clone())?;
    std::thread::Builder::new()
        .name("agent-accept".into())
        .spawn(move || {
            let mut gen = 0u64;
            loop {
                let stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        std::thread::sleep(Duration::from_millis(50));
                        continue;
                    }
                };
                if let Err(e) = stream.set_nonblocking(true) {
                    tracing::warn!(error = %e, "set_nonblocking failed");
                    continue;
                }
                gen += 1;
                let fd: Arc<OwnedFd> = Arc::new(stream.into());
                if let Some(old) = lock(&current).replace(fd.clone()) {
                    // SAFETY: shutdown on a live fd we own; wakes its reader thread.
                    unsafe { libc::shutdown(old.as_raw_fd(), libc::SHUT_RDWR) };
                }
                tracing::info!(conn = gen, "host connected");
                if ev_tx.blocking_send(Event::Connected(gen)).is_err() {
                    return;
                }
                let ev_tx = ev_tx.clone();
                let current = current.clone();
                let spawned = std::thread::Builder::new()
                    .name("agent-reader".into())
                    .spawn(move || socket_reader(fd, gen, ev_tx, current));
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "cannot spawn reader thread");
                }
            }
        })?;
    Ok(t)
}

fn socket_reader(fd: Arc<OwnedFd>, gen: u64, ev_tx: mpsc::Sender<Event>, current: Current) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match read_fd(fd.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if ev_tx
                    .blocking_send(Event::Bytes(gen, buf[..n].to_vec()))
                    .is_err()
                {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(e) = poll1(fd.as_raw_fd(), libc::POLLIN, Duration::from_millis(500)) {
                    tracing::debug!(error = %e, "poll failed");
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(error = %e, "connection read failed");
                break;
            }
        }
    }
    tracing::info!(conn = gen, "host disconnected");
    {
        let mut cur = lock(&current);
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, &fd)) {
            *cur = None;
        }
    }
    let _ = ev_tx.blocking_send(Event::Disconnected(gen));
}

/// Finds `/dev/<port>` whose `/sys/class/virtio-ports/<port>/name` is `name`.
pub fn find_virtio_port(name: &str) -> Option<PathBuf> {
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for entry in dir.flatten() {
        let Ok(n) = std::fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if n.trim() == name {
            return Some(Path::new("/dev").join(entry.file_name()));
        }
    }
    None
}

/// Serves on a virtio-serial port device (or any char device / fifo pair
/// that behaves like one). Host connect / disconnect are detected from
/// `POLLHUP` and end-of-file.
pub fn open_port(path: &Path) -> io::Result<Transport> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c is a valid NUL-terminated path.
    let raw = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a freshly opened fd that nothing else owns.
    let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
    let (ev_tx, out_rx, t) = channels();
    let current: Current = Arc::new(Mutex::new(Some(fd.clone())));
    spawn_writer(out_rx, current, t.epoch.clone())?;
    std::thread::Builder::new()
        .name("agent-port".into())
        .spawn(move || port_reader(fd, ev_tx))?;
    Ok(t)
}

/// How long the port reader waits before polling again while the host side is
/// absent (poll reports POLLHUP at once then). Short: after a restore the host
/// reconnects within milliseconds and the handshake waits on this.
const HUP_BACKOFF: Duration = Duration::from_millis(10);

fn port_reader(fd: Arc<OwnedFd>, ev_tx: mpsc::Sender<Event>) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut gen = 0u64;
    let mut connected = false;
    let raw = fd.as_raw_fd();
    loop {
        let rev = match poll1(raw, libc::POLLIN, Duration::from_millis(500)) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "poll on port failed");
                std::thread::sleep(HUP_BACKOFF);
                continue;
            }
        };
        let hup = rev & libc::POLLHUP != 0;
        if rev & libc::POLLIN != 0 {
            match read_fd(raw, &mut buf) {
                Ok(0) => {}
                Ok(n) => {
                    if !connected {
                        connected = true;
                        gen += 1;
                        tracing::info!(conn = gen, "host connected");
                        if ev_tx.blocking_send(Event::Connected(gen)).is_err() {
                            return;
                        }
                    }
                    if ev_tx
                        .blocking_send(Event::Bytes(gen, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue
                }
                Err(e) => tracing::debug!(error = %e, "port read failed"),
            }
        } else if !hup {
            continue;
        }
        // End of file, a failed read or POLLHUP: the host side closed.
        if connected {
            connected = false;
            tracing::info!(conn = gen, "host disconnected");
            if ev_tx.blocking_send(Event::Disconnected(gen)).is_err() {
                return;
            }
        }
        std::thread::sleep(HUP_BACKOFF);
    }
}
