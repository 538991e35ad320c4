//! envd's `process` and `filesystem` messages in the proto3 JSON mapping
//! (lowerCamelCase names, enums by name, `bytes` as base64, 64-bit integers
//! as strings, absent fields omitted). Only the fields strata uses.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

/// `bytes` fields: base64 in JSON.
pub mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes bytes as standard base64.
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    /// Accepts standard or URL-safe base64, padded or not (proto3 JSON allows both).
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        super::decode_b64(&s).map_err(serde::de::Error::custom)
    }
}

/// Decodes base64 in any of the alphabets proto3 JSON accepts.
pub fn decode_b64(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    STANDARD
        .decode(s)
        .or_else(|_| STANDARD_NO_PAD.decode(s))
        .or_else(|_| URL_SAFE.decode(s))
        .or_else(|_| URL_SAFE_NO_PAD.decode(s))
}

/// `process.ProcessConfig`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessConfig {
    /// Program.
    pub cmd: String,
    /// Arguments.
    pub args: Vec<String>,
    /// Environment.
    pub envs: BTreeMap<String, String>,
    /// Working directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `process.StartRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StartRequest {
    /// What to run.
    pub process: ProcessConfig,
    /// Run on a pseudo-terminal.
    pub pty: Option<Pty>,
    /// Caller's tag.
    pub tag: Option<String>,
    /// Keep stdin open for `SendInput`.
    pub stdin: Option<bool>,
}

/// `process.PTY`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Pty {
    /// Its window size.
    pub size: Option<PtySize>,
}

/// `process.PTY.Size`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PtySize {
    /// Columns.
    pub cols: u32,
    /// Rows.
    pub rows: u32,
}

/// `process.UpdateRequest`: a PTY's new size.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct UpdateRequest {
    /// Which process.
    pub process: ProcessSelector,
    /// The PTY's new settings.
    pub pty: Option<Pty>,
}

/// `process.ProcessSelector` (a oneof: `pid` or `tag`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessSelector {
    /// By pid.
    pub pid: Option<u32>,
    /// By tag.
    pub tag: Option<String>,
}

/// A request that names a process (`Connect`, `CloseStdin`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SelectRequest {
    /// Which process.
    pub process: ProcessSelector,
}

/// `process.ProcessInput` (a oneof: `stdin` or `pty`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessInput {
    /// Bytes for stdin.
    #[serde(with = "opt_b64")]
    pub stdin: Option<Vec<u8>>,
    /// Bytes for the PTY.
    #[serde(with = "opt_b64")]
    pub pty: Option<Vec<u8>>,
}

mod opt_b64 {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(s) => super::decode_b64(&s)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// `process.SendInputRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SendInputRequest {
    /// Which process.
    pub process: ProcessSelector,
    /// What to send.
    pub input: ProcessInput,
}

/// `process.Signal`, by name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum Signal {
    /// Unspecified.
    #[default]
    #[serde(rename = "SIGNAL_UNSPECIFIED")]
    Unspecified,
    /// SIGTERM.
    #[serde(rename = "SIGNAL_SIGTERM")]
    Term,
    /// SIGKILL.
    #[serde(rename = "SIGNAL_SIGKILL")]
    Kill,
}

/// `process.SendSignalRequest`. The enum may also arrive as its number.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SendSignalRequest {
    /// Which process.
    pub process: ProcessSelector,
    /// The signal (name or number).
    pub signal: serde_json::Value,
}

impl SendSignalRequest {
    /// The signal number to send, if it is one strata forwards.
    pub fn signal_number(&self) -> Option<i32> {
        match &self.signal {
            serde_json::Value::String(s) => match s.as_str() {
                "SIGNAL_SIGTERM" => Some(15),
                "SIGNAL_SIGKILL" => Some(9),
                _ => None,
            },
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(9) => Some(9),
                Some(15) => Some(15),
                _ => None,
            },
            _ => None,
        }
    }
}

/// `process.ProcessInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessInfo {
    /// How it was started.
    pub config: ProcessConfig,
    /// Pid in the guest.
    pub pid: u32,
    /// Caller's tag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `process.ProcessEvent`, serialized as the oneof it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    /// The process started.
    Start {
        /// Its pid.
        pid: u32,
    },
    /// Bytes on stdout.
    Stdout(Vec<u8>),
    /// Bytes on stderr.
    Stderr(Vec<u8>),
    /// Bytes of a PTY process's terminal.
    Pty(Vec<u8>),
    /// The process ended.
    End {
        /// Exit code (`-1` when killed by a signal or unknown).
        exit_code: i32,
        /// Whether it exited (as opposed to an unknown end).
        exited: bool,
        /// `exit status N` or `signal: killed`, as Go's `ProcessState.String()`.
        status: String,
        /// An error, when the end is not a plain exit.
        error: Option<String>,
    },
    /// Nothing happened (keeps proxies from closing the stream).
    KeepAlive,
}

impl ProcessEvent {
    /// The event as the proto3 JSON of `{"event": ProcessEvent}` (the shape
    /// of both `StartResponse` and `ConnectResponse`).
    pub fn to_response_json(&self) -> serde_json::Value {
        use serde_json::json;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let ev = match self {
            ProcessEvent::Start { pid } => json!({ "start": { "pid": pid } }),
            ProcessEvent::Stdout(b) => json!({ "data": { "stdout": b64(b) } }),
            ProcessEvent::Stderr(b) => json!({ "data": { "stderr": b64(b) } }),
            ProcessEvent::Pty(b) => json!({ "data": { "pty": b64(b) } }),
            ProcessEvent::End {
                exit_code,
                exited,
                status,
                error,
            } => {
                let mut end = json!({ "exitCode": exit_code, "exited": exited, "status": status });
                if let Some(e) = error {
                    end["error"] = json!(e);
                }
                json!({ "end": end })
            }
            ProcessEvent::KeepAlive => json!({ "keepalive": {} }),
        };
        json!({ "event": ev })
    }
}

/// Go's `ProcessState.String()` for an exit code or a signal.
pub fn exit_status(code: Option<i32>, signal: Option<i32>) -> (i32, String) {
    match (code, signal) {
        (Some(c), _) => (c, format!("exit status {c}")),
        (None, Some(s)) => (-1, format!("signal: {}", signal_name(s))),
        (None, None) => (-1, "unknown".into()),
    }
}

fn signal_name(s: i32) -> String {
    match s {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// `filesystem.FileType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FileType {
    /// Anything else.
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    /// Regular file.
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    /// Directory.
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    /// Symbolic link.
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    /// Last path component.
    pub name: String,
    /// Kind.
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Absolute path.
    pub path: String,
    /// Size (int64: a string in proto3 JSON).
    pub size: String,
    /// Permission bits.
    pub mode: u32,
    /// `rwxr-xr-x` form.
    pub permissions: String,
    /// Owner name.
    pub owner: String,
    /// Group name.
    pub group: String,
    /// RFC 3339 modification time.
    pub modified_time: String,
    /// For a symlink: what it resolves to (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// The `user.e2b.*` extended attributes, prefix stripped (envd 0.6.2).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// `ls -l`-style permission string of `mode` for `kind`.
pub fn permissions(kind: FileType, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileType::Directory => 'd',
        FileType::Symlink => 'l',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// Requests that carry one `path` (`Stat`, `MakeDir`, `Remove`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PathRequest {
    /// The guest path.
    pub path: String,
}

/// `filesystem.ListDirRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ListDirRequest {
    /// The directory.
    pub path: String,
    /// How deep to list (0 or 1: the directory's own entries).
    pub depth: u32,
}

/// `filesystem.MoveRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MoveRequest {
    /// From.
    pub source: String,
    /// To.
    pub destination: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn process_events_in_proto3_json() {
        assert_eq!(
            ProcessEvent::Start { pid: 42 }.to_response_json(),
            json!({"event": {"start": {"pid": 42}}})
        );
        assert_eq!(
            ProcessEvent::Stdout(b"hi\n".to_vec()).to_response_json(),
            json!({"event": {"data": {"stdout": "aGkK"}}})
        );
        assert_eq!(
            ProcessEvent::Stderr(vec![0xff, 0]).to_response_json(),
            json!({"event": {"data": {"stderr": "/wA="}}})
        );
        let (code, status) = exit_status(Some(3), None);
        assert_eq!(
            ProcessEvent::End {
                exit_code: code,
                exited: true,
                status,
                error: None
            }
            .to_response_json(),
            json!({"event": {"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}}})
        );
        assert_eq!(
            ProcessEvent::KeepAlive.to_response_json(),
            json!({"event": {"keepalive": {}}})
        );
    }

    #[test]
    fn exit_status_strings() {
        assert_eq!(exit_status(Some(0), None), (0, "exit status 0".into()));
        assert_eq!(exit_status(None, Some(9)), (-1, "signal: killed".into()));
        assert_eq!(exit_status(None, None), (-1, "unknown".into()));
    }

    #[test]
    fn start_request_from_the_sdk() {
        let r: StartRequest = serde_json::from_value(json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": false
        }))
        .unwrap();
        assert_eq!(r.process.cmd, "/bin/bash");
        assert_eq!(r.process.args, ["-l", "-c", "echo hi"]);
        assert_eq!(r.process.envs["A"], "1");
        assert_eq!(r.stdin, Some(false));
        assert_eq!(r.process.cwd, None);
    }

    #[test]
    fn input_and_signal_requests() {
        let r: SendInputRequest =
            serde_json::from_value(json!({"process": {"pid": 7}, "input": {"stdin": "aGVsbG8="}}))
                .unwrap();
        assert_eq!(r.process.pid, Some(7));
        assert_eq!(r.input.stdin.as_deref(), Some(&b"hello"[..]));
        let s: SendSignalRequest =
            serde_json::from_value(json!({"process": {"pid": 7}, "signal": "SIGNAL_SIGKILL"}))
                .unwrap();
        assert_eq!(s.signal_number(), Some(9));
        let s: SendSignalRequest =
            serde_json::from_value(json!({"process": {"tag": "x"}, "signal": 15})).unwrap();
        assert_eq!(s.signal_number(), Some(15));
        assert_eq!(s.process.tag.as_deref(), Some("x"));
    }

    #[test]
    fn entry_info_json() {
        let e = EntryInfo {
            name: "a.txt".into(),
            kind: FileType::File,
            path: "/root/a.txt".into(),
            size: "5".into(),
            mode: 0o644,
            permissions: permissions(FileType::File, 0o644),
            owner: "root".into(),
            group: "root".into(),
            modified_time: "2024-01-01T00:00:00Z".into(),
            symlink_target: None,
            metadata: BTreeMap::new(),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["modifiedTime"], "2024-01-01T00:00:00Z");
        assert_eq!(v["size"], "5");
        assert_eq!(permissions(FileType::Directory, 0o755), "drwxr-xr-x");
    }
}
