//! The tool-call model: every action an agent takes through the platform.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One action an agent asks the platform to perform, as seen by the policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Tenant the call runs for.
    pub tenant: String,
    /// Sandbox the call targets, when there is one.
    pub sandbox: Option<String>,
    /// Who asks: token id or user name.
    pub actor: String,
    /// What is asked.
    pub kind: CallKind,
}

/// What a tool call does, with its arguments.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CallKind {
    /// Run a program in the sandbox.
    Exec {
        /// Program and arguments (`argv[0]` is the program).
        argv: Vec<String>,
        /// A shell script run as `sh -c <script>`; when set, `argv` is ignored
        /// and the policy sees `["sh", "-c", script]`.
        #[serde(default)]
        shell: Option<String>,
        /// Environment variables the command gets besides the guest's own:
        /// names, and each value as `sha256:<hex>` of the value (values often
        /// hold secrets; the digest binds an approval to the exact value
        /// without writing it to the audit log). Build it with
        /// [`CallKind::with_context`].
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        env: BTreeMap<String, String>,
        /// Working directory, when the caller gives one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
        /// What the command reads on stdin.
        #[serde(default, skip_serializing_if = "ExecStdin::is_none")]
        stdin: ExecStdin,
    },
    /// Read a file in the sandbox.
    FileRead {
        /// Path in the guest.
        path: String,
    },
    /// Write (create, replace, delete) a file in the sandbox.
    FileWrite {
        /// Path in the guest.
        path: String,
    },
    /// An outbound network request through the egress proxy.
    Egress {
        /// Connector the host belongs to; always recomputed from `host` by
        /// the evaluator, so a caller cannot claim another connector.
        #[serde(default)]
        connector: Option<String>,
        /// Destination host name (lower case, no trailing dot).
        host: String,
        /// Destination port.
        port: u16,
        /// HTTP method (`CONNECT` for a tunnel).
        method: String,
        /// Request path (empty for a tunnel).
        path: String,
        /// `http` or `https`.
        scheme: String,
        /// The request was read inside a TLS connection the proxy
        /// terminated (interception of a connector host,
        /// `docs/tls-interception.md`). Left out of the serialised form
        /// when false, so entries written before it hash the same.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        tls: bool,
    },
    /// Take a snapshot of the sandbox.
    Snapshot,
    /// Fork the sandbox or one of its snapshots.
    Fork,
    /// Rewind the sandbox to one of its snapshots.
    Rewind,
    /// Another lifecycle operation (`create`, `delete`, `pause`, `resume`, `hibernate`, `wake` …).
    Lifecycle {
        /// The operation name.
        op: String,
    },
    /// A connection from outside to a TCP port of the sandbox (over the
    /// agent channel). Decided when it opens; audited once, when it closes,
    /// with its byte counts.
    Port {
        /// Guest TCP port.
        port: u16,
        /// Bytes carried, once the connection closed (absent while deciding).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bytes: Option<PortBytes>,
    },
    /// A `tools/call` through the MCP gateway (`docs/mcp.md`) to a
    /// connector of kind `mcp`.
    Mcp {
        /// The `mcp` connector (the server).
        connector: String,
        /// The tool's name.
        tool: String,
        /// `sha256:<hex>` of the arguments' canonical JSON text (what the
        /// audit log keeps, and what binds an approval). Recomputed from
        /// `arguments` by whoever builds the call ([`CallKind::mcp`]).
        #[serde(default)]
        arguments_sha256: String,
        /// The arguments as canonical JSON text, shown to approvers; left
        /// out of audit entries (they keep the digest) and absent when
        /// unknown (a `tools/list` check).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        arguments: Option<String>,
    },
}

/// What an exec call feeds the command on stdin, as the policy sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecStdin {
    /// Nothing (`/dev/null`).
    #[default]
    None,
    /// These many bytes, then end of file (their content is not kept).
    Bytes(u64),
    /// A stream the caller keeps writing (interactive exec, a terminal).
    Stream,
}

impl ExecStdin {
    /// No stdin at all.
    pub fn is_none(&self) -> bool {
        *self == ExecStdin::None
    }
}

/// How an env value is kept in a [`CallKind::Exec`]: `sha256:<hex>`.
pub fn env_value_digest(value: &str) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(value.as_bytes())))
}

/// Bytes one port connection carried ([`CallKind::Port`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortBytes {
    /// From the outside client to the guest port.
    pub to_guest: u64,
    /// From the guest port to the outside client.
    pub from_guest: u64,
}

/// Kinds of tool call, as named in policy files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KindName {
    /// [`CallKind::Exec`]
    Exec,
    /// [`CallKind::FileRead`]
    FileRead,
    /// [`CallKind::FileWrite`]
    FileWrite,
    /// [`CallKind::Egress`]
    Egress,
    /// [`CallKind::Snapshot`]
    Snapshot,
    /// [`CallKind::Fork`]
    Fork,
    /// [`CallKind::Rewind`]
    Rewind,
    /// [`CallKind::Lifecycle`]
    Lifecycle,
    /// [`CallKind::Port`]
    Port,
    /// [`CallKind::Mcp`]
    Mcp,
}

impl KindName {
    /// Every kind, in a fixed order (index = [`KindName::index`]).
    pub const ALL: [KindName; 10] = [
        KindName::Exec,
        KindName::FileRead,
        KindName::FileWrite,
        KindName::Egress,
        KindName::Snapshot,
        KindName::Fork,
        KindName::Rewind,
        KindName::Lifecycle,
        KindName::Port,
        KindName::Mcp,
    ];

    /// Stable small index of this kind.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name used in policy files.
    pub fn as_str(self) -> &'static str {
        match self {
            KindName::Exec => "exec",
            KindName::FileRead => "file_read",
            KindName::FileWrite => "file_write",
            KindName::Egress => "egress",
            KindName::Snapshot => "snapshot",
            KindName::Fork => "fork",
            KindName::Rewind => "rewind",
            KindName::Lifecycle => "lifecycle",
            KindName::Port => "port",
            KindName::Mcp => "mcp",
        }
    }
}

impl std::fmt::Display for KindName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl CallKind {
    /// The kind of this call.
    pub fn kind(&self) -> KindName {
        match self {
            CallKind::Exec { .. } => KindName::Exec,
            CallKind::FileRead { .. } => KindName::FileRead,
            CallKind::FileWrite { .. } => KindName::FileWrite,
            CallKind::Egress { .. } => KindName::Egress,
            CallKind::Snapshot => KindName::Snapshot,
            CallKind::Fork => KindName::Fork,
            CallKind::Rewind => KindName::Rewind,
            CallKind::Lifecycle { .. } => KindName::Lifecycle,
            CallKind::Port { .. } => KindName::Port,
            CallKind::Mcp { .. } => KindName::Mcp,
        }
    }
}

impl CallKind {
    /// An exec of `argv`, with no env, cwd or stdin.
    pub fn exec(argv: Vec<String>) -> CallKind {
        CallKind::Exec {
            argv,
            shell: None,
            env: BTreeMap::new(),
            cwd: None,
            stdin: ExecStdin::None,
        }
    }

    /// An exec of a shell script (`sh -c <script>`), with no env, cwd or stdin.
    pub fn shell(script: String) -> CallKind {
        CallKind::Exec {
            argv: Vec::new(),
            shell: Some(script),
            env: BTreeMap::new(),
            cwd: None,
            stdin: ExecStdin::None,
        }
    }

    /// An exec call with what the command runs with besides its argv: the
    /// environment variables it is given (each value kept as its digest,
    /// [`env_value_digest`]), its working directory and its stdin. Other
    /// kinds are returned unchanged.
    pub fn with_context(
        self,
        env: &BTreeMap<String, String>,
        cwd: Option<String>,
        stdin: ExecStdin,
    ) -> CallKind {
        match self {
            CallKind::Exec { argv, shell, .. } => CallKind::Exec {
                argv,
                shell,
                env: env
                    .iter()
                    .map(|(k, v)| (k.clone(), env_value_digest(v)))
                    .collect(),
                cwd,
                stdin,
            },
            other => other,
        }
    }
}

impl CallKind {
    /// A `tools/call` of `tool` on `connector` with `arguments` (a JSON
    /// value; `None` when unknown, as for a `tools/list` check).
    pub fn mcp(connector: &str, tool: &str, arguments: Option<&serde_json::Value>) -> CallKind {
        let text = arguments.map(|a| a.to_string());
        CallKind::Mcp {
            connector: connector.to_string(),
            tool: tool.to_string(),
            arguments_sha256: env_value_digest(text.as_deref().unwrap_or("")),
            arguments: text,
        }
    }

    /// The call with every derived field recomputed from what it carries
    /// (an MCP call's argument digest from its arguments): for calls that
    /// come from outside (`POST /v1/policy/test`).
    pub fn normalized(self) -> CallKind {
        match self {
            CallKind::Mcp {
                connector,
                tool,
                arguments: Some(text),
                ..
            } => match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) => CallKind::mcp(&connector, &tool, Some(&v)),
                Err(_) => CallKind::Mcp {
                    connector,
                    tool,
                    arguments_sha256: env_value_digest(&text),
                    arguments: Some(text),
                },
            },
            other => other,
        }
    }

    /// This call as the audit log keeps it: an MCP call's arguments
    /// replaced by their digest (already in the call); other kinds as they are.
    pub fn for_audit(&self) -> CallKind {
        match self {
            CallKind::Mcp {
                connector,
                tool,
                arguments_sha256,
                ..
            } => CallKind::Mcp {
                connector: connector.clone(),
                tool: tool.clone(),
                arguments_sha256: arguments_sha256.clone(),
                arguments: None,
            },
            other => other.clone(),
        }
    }
}

impl ToolCall {
    /// The policy-file name of this call's kind (`exec`, `file_read`, …).
    pub fn kind_name(&self) -> &'static str {
        self.kind.kind().as_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_round_trip_through_serde() {
        for k in KindName::ALL {
            let s = serde_json::to_string(&k).unwrap_or_default();
            assert_eq!(s, format!("\"{}\"", k.as_str()));
            assert_eq!(KindName::ALL[k.index()], k);
        }
        let c = ToolCall {
            tenant: "t".into(),
            sandbox: None,
            actor: "a".into(),
            kind: CallKind::Lifecycle { op: "pause".into() },
        };
        assert_eq!(c.kind_name(), "lifecycle");
        let j = serde_json::to_string(&c).unwrap_or_default();
        let back: ToolCall = serde_json::from_str(&j).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, c);
    }

    #[test]
    fn exec_context_keeps_env_names_and_value_digests_and_round_trips() {
        let env = BTreeMap::from([("OPENAI_API_KEY".to_string(), "sk-secret".to_string())]);
        let k = CallKind::exec(vec!["python3".into()]).with_context(
            &env,
            Some("/workspace".into()),
            ExecStdin::Bytes(12),
        );
        let j = serde_json::to_string(&k).unwrap_or_default();
        assert!(!j.contains("sk-secret"), "{j}");
        assert!(j.contains("\"OPENAI_API_KEY\":\"sha256:"), "{j}");
        assert!(j.contains("\"stdin\":{\"bytes\":12}"), "{j}");
        let back: CallKind = serde_json::from_str(&j).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, k);
        // An exec without context serialises as before (old audit lines keep verifying).
        let plain = serde_json::to_string(&CallKind::exec(vec!["true".into()])).unwrap_or_default();
        assert_eq!(plain, r#"{"kind":"exec","argv":["true"],"shell":null}"#);
    }
}
