//! Process logs: what the commands of each sandbox printed, kept by the
//! daemon as they stream through it (every front door's exec goes through
//! the service: `/v1` exec, `strata exec`, the E2B door's processes and
//! PTYs). One bounded ring per sandbox: a start entry (argv), the output
//! chunks (stdout/stderr, lossy UTF-8) and an exit entry, each with its
//! time, a per-sandbox sequence number (the cursor) and the number of the
//! exec it belongs to.
//!
//! Bounds (nothing a guest prints grows them): at most
//! [`LogsConfig::max_bytes_per_sandbox`] bytes of entries per sandbox (the
//! oldest go first; a chunk larger than the cap keeps its tail), at most
//! [`LogsConfig::max_sandboxes`] rings (the least recently written goes for
//! a new one). A ring goes when its sandbox is deleted. In memory only: a
//! daemon restart starts empty (documented; output a user needs kept
//! belongs in a file of the sandbox).
//!
//! Readers: `GET /v1/sandboxes/{id}/logs` ([`Service::sandbox_logs`],
//! tenancy through the caller), `strata logs`, the E2B door's
//! `/sandboxes/{id}/logs` and `/v2/sandboxes/{id}/logs`.

use std::collections::VecDeque;

use super::prelude::*;
use crate::config::LogsConfig;
use crate::engine::ExitStatus;

/// Bytes an entry counts for besides its text (time, numbers, the deque).
const ENTRY_OVERHEAD: usize = 64;
/// Longest argv text a start entry keeps.
const MAX_ARGV_TEXT: usize = 1024;

/// Which stream an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogStream {
    /// A command started (`text` is its argv).
    Start,
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
    /// The command ended (`text`: `exit 0`, `signal 9`).
    Exit,
}

/// One entry of a sandbox's process log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// Position in the sandbox's log (increasing; the cursor of `after`).
    pub seq: u64,
    /// When the daemon saw it.
    pub at: DateTime<Utc>,
    /// Number of the exec it belongs to (per sandbox, from 1).
    pub exec: u64,
    /// Which stream.
    pub stream: LogStream,
    /// The text (output as lossy UTF-8; it may end mid-line).
    pub text: String,
}

/// A page of a sandbox's log ([`Service::sandbox_logs`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogPage {
    /// The sandbox.
    pub sandbox_id: SandboxId,
    /// Entries after the cursor, oldest first.
    pub entries: Vec<LogEntry>,
    /// The cursor for the next page (the last entry's `seq`, or the one
    /// given when there is nothing new).
    pub next: u64,
    /// Entries dropped by the byte cap since the ring began (a reader whose
    /// cursor is older than the oldest entry missed some).
    pub dropped: u64,
}

#[derive(Debug, Default)]
struct Ring {
    entries: VecDeque<LogEntry>,
    bytes: usize,
    next_seq: u64,
    execs: u64,
    dropped: u64,
    written: Option<Instant>,
}

/// Every sandbox's ring. See the module documentation.
#[derive(Debug)]
pub struct ProcessLogs {
    cfg: LogsConfig,
    rings: Mutex<HashMap<SandboxId, Ring>>,
}

impl ProcessLogs {
    /// Empty logs under `cfg`'s bounds.
    pub fn new(cfg: &LogsConfig) -> Self {
        ProcessLogs {
            cfg: cfg.clone(),
            rings: Mutex::new(HashMap::new()),
        }
    }

    fn enabled(&self) -> bool {
        self.cfg.max_bytes_per_sandbox > 0 && self.cfg.max_sandboxes > 0
    }

    /// Records the start of `command` of sandbox `id` (its argv or shell
    /// string, never its environment or stdin); the tap records the rest.
    /// `None` when logs are off.
    pub fn start(self: &Arc<Self>, id: &SandboxId, command: &Command, pty: bool) -> Option<LogTap> {
        if !self.enabled() {
            return None;
        }
        let mut text = match command {
            Command::Argv(argv) => argv.join(" "),
            Command::Shell(script) => format!("sh -c {script}"),
        };
        if pty {
            text.push_str("  [pty]");
        }
        truncate_utf8(&mut text, MAX_ARGV_TEXT);
        let exec = {
            let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
            let ring = self.ring(&mut rings, id);
            ring.execs += 1;
            ring.execs
        };
        let tap = LogTap {
            logs: self.clone(),
            id: id.clone(),
            exec,
            skip_line: false,
        };
        tap.push(LogStream::Start, text);
        Some(tap)
    }

    /// The ring of `id`, made (evicting the least recently written ring at
    /// the cap) when missing.
    fn ring<'a>(&self, rings: &'a mut HashMap<SandboxId, Ring>, id: &SandboxId) -> &'a mut Ring {
        if !rings.contains_key(id) && rings.len() >= self.cfg.max_sandboxes {
            if let Some(old) = rings
                .iter()
                .min_by_key(|(_, r)| r.written)
                .map(|(k, _)| k.clone())
            {
                rings.remove(&old);
            }
        }
        rings.entry(id.clone()).or_default()
    }

    fn push(&self, id: &SandboxId, exec: u64, stream: LogStream, mut text: String) {
        let cap = self.cfg.max_bytes_per_sandbox;
        if text.len() + ENTRY_OVERHEAD > cap {
            // Keep the tail: the end of a flood is what explains it.
            let keep = cap.saturating_sub(ENTRY_OVERHEAD);
            let mut cut = text.len() - keep;
            while !text.is_char_boundary(cut) {
                cut += 1;
            }
            text.drain(..cut);
        }
        let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let ring = self.ring(&mut rings, id);
        ring.next_seq += 1;
        ring.bytes += text.len() + ENTRY_OVERHEAD;
        ring.written = Some(Instant::now());
        ring.entries.push_back(LogEntry {
            seq: ring.next_seq,
            at: Utc::now(),
            exec,
            stream,
            text,
        });
        while ring.bytes > cap {
            match ring.entries.pop_front() {
                Some(e) => {
                    ring.bytes -= e.text.len() + ENTRY_OVERHEAD;
                    ring.dropped += 1;
                }
                None => break,
            }
        }
    }

    /// Entries of `id` after `after` (0: from the oldest kept), at most
    /// `limit`.
    pub fn page(&self, id: &SandboxId, after: u64, limit: usize) -> LogPage {
        let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let (entries, dropped) = match rings.get(id) {
            Some(r) => (
                r.entries
                    .iter()
                    .filter(|e| e.seq > after)
                    .take(limit)
                    .cloned()
                    .collect::<Vec<_>>(),
                r.dropped,
            ),
            None => (Vec::new(), 0),
        };
        LogPage {
            sandbox_id: id.clone(),
            next: entries.last().map_or(after, |e| e.seq),
            entries,
            dropped,
        }
    }

    /// Drops the ring of a deleted sandbox.
    pub fn forget(&self, id: &SandboxId) {
        self.rings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Rings and bytes held (for tests and `/v1/stats`).
    pub fn usage(&self) -> (usize, usize) {
        let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        (rings.len(), rings.values().map(|r| r.bytes).sum())
    }
}

/// Records one command's events into its sandbox's ring.
#[derive(Debug, Clone)]
pub struct LogTap {
    logs: Arc<ProcessLogs>,
    id: SandboxId,
    exec: u64,
    /// Leave out stdout up to its first newline (a wrapper's own line).
    skip_line: bool,
}

impl LogTap {
    fn push(&self, stream: LogStream, text: String) {
        self.logs.push(&self.id, self.exec, stream, text);
    }

    /// Leaves out the first line of stdout (a front door's wrapper prints
    /// its own marker line before the command's output).
    pub fn skip_first_stdout_line(mut self) -> Self {
        self.skip_line = true;
        self
    }

    /// Records an event of the command's stream.
    pub fn record(&mut self, ev: &ExecEvent) {
        match ev {
            ExecEvent::Started { .. } => {}
            ExecEvent::Stdout(b) if self.skip_line => {
                if let Some(nl) = b.iter().position(|&c| c == b'\n') {
                    self.skip_line = false;
                    if nl + 1 < b.len() {
                        self.push(
                            LogStream::Stdout,
                            String::from_utf8_lossy(&b[nl + 1..]).into_owned(),
                        );
                    }
                }
            }
            ExecEvent::Stdout(b) if !b.is_empty() => {
                self.push(LogStream::Stdout, String::from_utf8_lossy(b).into_owned())
            }
            ExecEvent::Stderr(b) if !b.is_empty() => {
                self.push(LogStream::Stderr, String::from_utf8_lossy(b).into_owned())
            }
            ExecEvent::Stdout(_) | ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(st) => self.push(LogStream::Exit, exit_text(st)),
        }
    }
}

fn exit_text(st: &ExitStatus) -> String {
    if st.timed_out {
        return "timed out".into();
    }
    match (st.code, st.signal) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        (None, None) => "ended".into(),
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

impl Service {
    /// A page of the process log of one of the caller's sandboxes: entries
    /// after `after` (0: from the oldest kept), at most `limit` (1..=1000).
    pub async fn sandbox_logs(
        &self,
        caller: &Caller,
        id: &SandboxId,
        after: u64,
        limit: usize,
    ) -> ServiceResult<LogPage> {
        self.get_sandbox(caller, id).await?;
        if !(1..=MAX_LOG_PAGE).contains(&limit) {
            return Err(ServiceError::InvalidRequest(format!(
                "limit must be 1..={MAX_LOG_PAGE}"
            )));
        }
        Ok(self.logs.page(id, after, limit))
    }

    /// The daemon's process logs (for tests and front doors).
    pub fn process_logs(&self) -> &Arc<ProcessLogs> {
        &self.logs
    }
}

/// Most entries one page answers.
pub const MAX_LOG_PAGE: usize = 1000;

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn id(n: u32) -> SandboxId {
        format!("sb-log{n:08}").parse().unwrap()
    }

    fn logs(bytes: usize, sandboxes: usize) -> Arc<ProcessLogs> {
        Arc::new(ProcessLogs::new(&LogsConfig {
            max_bytes_per_sandbox: bytes,
            max_sandboxes: sandboxes,
        }))
    }

    #[test]
    fn a_command_is_recorded_start_output_exit_and_paged() {
        let l = logs(1 << 20, 4);
        let mut tap = l
            .start(
                &id(1),
                &Command::Argv(vec!["echo".into(), "hi".into()]),
                false,
            )
            .unwrap();
        tap.record(&ExecEvent::Started { pid: 7 });
        tap.record(&ExecEvent::Stdout(Bytes::from_static(b"hi\n")));
        tap.record(&ExecEvent::Stderr(Bytes::from_static(b"warn\xff\n")));
        tap.record(&ExecEvent::Exit(ExitStatus {
            code: Some(3),
            signal: None,
            timed_out: false,
        }));
        let p = l.page(&id(1), 0, 100);
        let got: Vec<_> = p
            .entries
            .iter()
            .map(|e| (e.exec, e.stream, e.text.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, LogStream::Start, "echo hi"),
                (1, LogStream::Stdout, "hi\n"),
                (1, LogStream::Stderr, "warn\u{fffd}\n"),
                (1, LogStream::Exit, "exit 3"),
            ]
        );
        assert_eq!(p.next, 4);
        // Paging: after the cursor, at most `limit`.
        let p2 = l.page(&id(1), 1, 2);
        assert_eq!(p2.entries.len(), 2);
        assert_eq!(p2.entries[0].seq, 2);
        assert_eq!(p2.next, 3);
        assert!(l.page(&id(1), 4, 10).entries.is_empty());
        assert_eq!(l.page(&id(1), 4, 10).next, 4);
        // A second command is exec 2; another sandbox is separate.
        l.start(&id(1), &Command::Shell("true".into()), false)
            .unwrap();
        let second = &l.page(&id(1), 4, 10).entries[0];
        assert_eq!((second.exec, second.text.as_str()), (2, "sh -c true"));
        assert!(l.page(&id(2), 0, 10).entries.is_empty());
        l.forget(&id(1));
        assert!(l.page(&id(1), 0, 10).entries.is_empty());
        // A wrapper's marker line is left out, even split over chunks.
        let mut tap = l
            .start(&id(3), &Command::Shell("x".into()), false)
            .unwrap()
            .skip_first_stdout_line();
        tap.record(&ExecEvent::Stdout(Bytes::from_static(b"\x1emarker ")));
        tap.record(&ExecEvent::Stdout(Bytes::from_static(b"42\nout")));
        tap.record(&ExecEvent::Stdout(Bytes::from_static(b"put\n")));
        let texts: Vec<_> = l
            .page(&id(3), 0, 10)
            .entries
            .into_iter()
            .map(|e| e.text)
            .collect();
        assert_eq!(texts, ["sh -c x", "out", "put\n"]);
    }

    #[test]
    fn a_flood_stays_under_the_caps() {
        let cap = 16 * 1024;
        let l = logs(cap, 3);
        let mut tap = l
            .start(&id(1), &Command::Argv(vec!["yes".into()]), false)
            .unwrap();
        for _ in 0..10_000 {
            tap.record(&ExecEvent::Stdout(Bytes::from(vec![b'y'; 1000])));
        }
        // One chunk far larger than the cap keeps its tail.
        let mut big = vec![b'a'; 100_000];
        big.extend_from_slice(b"THE END");
        tap.record(&ExecEvent::Stdout(Bytes::from(big)));
        let (rings, bytes) = l.usage();
        assert_eq!(rings, 1);
        assert!(bytes <= cap, "{bytes}");
        let p = l.page(&id(1), 0, 1000);
        assert!(p.dropped > 9_000, "{}", p.dropped);
        assert!(p.entries.last().unwrap().text.ends_with("THE END"));
        // More sandboxes than the cap: the least recently written goes.
        for n in 2..=5 {
            l.start(&id(n), &Command::Argv(vec!["true".into()]), false)
                .unwrap();
        }
        let (rings, _) = l.usage();
        assert_eq!(rings, 3);
        assert!(l.page(&id(1), 0, 10).entries.is_empty());
        assert!(!l.page(&id(5), 0, 10).entries.is_empty());
        // Off: nothing kept.
        assert!(logs(0, 3)
            .start(&id(1), &Command::Shell("true".into()), false)
            .is_none());
    }
}
