//! The MCP gateway's JSON-RPC logic, without I/O: reading a client's
//! message under size bounds, which methods pass, the `tools/list` filter
//! (policy and the admin's catalog), the errors a client understands.

use serde_json::{json, Map, Value};

use crate::call::{CallKind, ToolCall};
use crate::policy::{Connector, Effect, PolicySet};

/// Largest JSON-RPC message the gateway reads from the guest (bytes).
pub const MAX_MESSAGE: usize = 1024 * 1024;
/// Largest message (or SSE event) it reads from an upstream server.
pub const MAX_UPSTREAM_MESSAGE: usize = 8 * 1024 * 1024;
/// Longest method name.
pub const MAX_METHOD: usize = 256;
/// Longest request id (as JSON text).
pub const MAX_ID: usize = 256;
/// Deepest nesting of a message (serde_json refuses beyond 128 anyway).
pub const MAX_DEPTH: usize = 64;

/// JSON-RPC: the message is not JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: not a valid request object.
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC: the method is not offered.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC: bad parameters.
pub const INVALID_PARAMS: i64 = -32602;
/// The policy refused the call (`error.data`: rule, layer, reason,
/// approval id). In the JSON-RPC server-error range; `docs/mcp.md`.
pub const POLICY_DENIED: i64 = -32001;
/// The upstream server could not be reached or answered out of bounds.
pub const UPSTREAM_ERROR: i64 = -32002;

/// One message from the client, checked.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// A request (has an `id`).
    Request {
        /// Its id (string or number).
        id: Value,
        /// Method name.
        method: String,
        /// Params (object, or absent).
        params: Option<Value>,
    },
    /// A notification (no `id`).
    Notification {
        /// Method name.
        method: String,
    },
    /// A response to a request the server made (`result` or `error`).
    Response,
}

/// A message refused before it reaches the server: the JSON-RPC error to
/// answer with (`id` null when it could not be read).
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// Id to answer.
    pub id: Value,
    /// JSON-RPC error code.
    pub code: i64,
    /// Message.
    pub message: String,
}

fn depth(v: &Value) -> usize {
    // Iterative, so a hostile nesting cannot exhaust the stack.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

/// Reads one client message (the POST body). Batches are refused (MCP
/// 2025-06-18 removed them), as are messages over [`MAX_MESSAGE`], deeper
/// than [`MAX_DEPTH`], or with an over-long method or id.
pub fn parse(body: &[u8]) -> Result<(Value, Message), Refusal> {
    let refuse = |id: Value, code, message: &str| Refusal {
        id,
        code,
        message: message.to_string(),
    };
    if body.len() > MAX_MESSAGE {
        return Err(refuse(
            Value::Null,
            INVALID_REQUEST,
            "message larger than the gateway's limit",
        ));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|_| refuse(Value::Null, PARSE_ERROR, "message is not JSON"))?;
    if depth(&v) > MAX_DEPTH {
        return Err(refuse(
            Value::Null,
            INVALID_REQUEST,
            "message nested too deep",
        ));
    }
    let Some(o) = v.as_object() else {
        return Err(refuse(
            Value::Null,
            INVALID_REQUEST,
            "one JSON-RPC object per message (batches are not accepted)",
        ));
    };
    if o.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(refuse(
            Value::Null,
            INVALID_REQUEST,
            "jsonrpc must be \"2.0\"",
        ));
    }
    let id = match o.get("id") {
        None => None,
        Some(id @ (Value::String(_) | Value::Number(_))) if id.to_string().len() <= MAX_ID => {
            Some(id.clone())
        }
        Some(_) => {
            return Err(refuse(
                Value::Null,
                INVALID_REQUEST,
                "id must be a string or a number (at most 256 bytes)",
            ))
        }
    };
    let msg = match o.get("method") {
        Some(Value::String(m)) => {
            if m.is_empty() || m.len() > MAX_METHOD {
                return Err(refuse(
                    id.unwrap_or(Value::Null),
                    INVALID_REQUEST,
                    "bad method name",
                ));
            }
            let params = o.get("params").cloned();
            if params
                .as_ref()
                .is_some_and(|p| !p.is_object() && !p.is_array())
            {
                return Err(refuse(
                    id.unwrap_or(Value::Null),
                    INVALID_REQUEST,
                    "params must be an object",
                ));
            }
            match id {
                Some(id) => Message::Request {
                    id,
                    method: m.clone(),
                    params,
                },
                None => Message::Notification { method: m.clone() },
            }
        }
        Some(_) => {
            return Err(refuse(
                Value::Null,
                INVALID_REQUEST,
                "method must be a string",
            ))
        }
        None if id.is_some() && (o.contains_key("result") || o.contains_key("error")) => {
            Message::Response
        }
        None => return Err(refuse(Value::Null, INVALID_REQUEST, "no method")),
    };
    Ok((v, msg))
}

/// What the gateway does with a request method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Sent on unchanged (`initialize`, `ping`, `notifications/*`,
    /// responses to the server's requests).
    Pass,
    /// `tools/list`: sent on, its answer filtered.
    ListTools,
    /// `tools/call`: judged first.
    CallTool,
    /// Refused with [`METHOD_NOT_FOUND`]: resources, prompts, completion,
    /// logging and anything else the gateway does not govern.
    Refuse,
}

/// The route of `method`.
pub fn route(method: &str) -> Route {
    match method {
        "initialize" | "ping" => Route::Pass,
        "tools/list" => Route::ListTools,
        "tools/call" => Route::CallTool,
        m if m.starts_with("notifications/") => Route::Pass,
        _ => Route::Refuse,
    }
}

/// The tool name and arguments of a `tools/call`'s params.
pub fn tool_call(params: Option<&Value>) -> Result<(String, Value), &'static str> {
    let p = params
        .and_then(Value::as_object)
        .ok_or("tools/call needs params")?;
    let name = p
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty() && n.len() <= MAX_METHOD)
        .ok_or("tools/call needs a tool name (at most 256 bytes)")?;
    let args = match p.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return Err("tools/call arguments must be an object"),
    };
    Ok((name.to_string(), args))
}

/// The progress token a request's `_meta` carries.
pub fn progress_token(params: Option<&Value>) -> Option<Value> {
    params?
        .get("_meta")?
        .get("progressToken")
        .filter(|t| t.is_string() || t.is_number())
        .cloned()
}

/// A JSON-RPC error response.
pub fn error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut e = json!({ "code": code, "message": message });
    if let (Some(d), Some(o)) = (data, e.as_object_mut()) {
        o.insert("data".into(), d);
    }
    json!({ "jsonrpc": "2.0", "id": id, "error": e })
}

/// A progress notification.
pub fn progress(token: &Value, progress: u64, message: &str) -> Value {
    json!({
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": { "progressToken": token, "progress": progress, "message": message },
    })
}

/// The tool call `tool` on `connector` with `arguments`, as policy sees it.
pub fn call(
    tenant: &str,
    sandbox: Option<&str>,
    actor: &str,
    connector: &str,
    tool: &str,
    arguments: Option<&Value>,
) -> ToolCall {
    ToolCall {
        tenant: tenant.to_string(),
        sandbox: sandbox.map(str::to_string),
        actor: actor.to_string(),
        kind: CallKind::mcp(connector, tool, arguments),
    }
}

/// Filters a `tools/list` response in place: a tool whose call the policy
/// denies whatever its arguments is removed; every listed tool's
/// `readOnlyHint` and `destructiveHint` are set from the connector's
/// catalog (a tool the catalog does not list: not read-only,
/// destructive), whatever the server said. Returns the names removed.
pub fn filter_tools(
    response: &mut Value,
    policy: &PolicySet,
    template: &ToolCall,
    connector: &Connector,
) -> Vec<String> {
    let mut removed = Vec::new();
    let Some(tools) = response
        .get_mut("result")
        .and_then(|r| r.get_mut("tools"))
        .and_then(Value::as_array_mut)
    else {
        return removed;
    };
    let Some(server) = &connector.mcp else {
        tools.clear();
        return removed;
    };
    tools.retain_mut(|t| {
        let Some(name) = t.get("name").and_then(Value::as_str).map(str::to_string) else {
            return false;
        };
        let c = ToolCall {
            kind: CallKind::mcp(&connector.name, &name, None),
            ..template.clone()
        };
        if policy.evaluate(&c).effect == Effect::Deny {
            removed.push(name);
            return false;
        }
        let (ro, destructive) = match server.tool(&name) {
            Some(e) => (e.read_only, e.is_destructive()),
            None => (false, true),
        };
        if let Some(o) = t.as_object_mut() {
            let a = o
                .entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()));
            if !a.is_object() {
                *a = Value::Object(Map::new());
            }
            if let Some(a) = a.as_object_mut() {
                a.insert("readOnlyHint".into(), Value::Bool(ro));
                a.insert("destructiveHint".into(), Value::Bool(destructive));
            }
        }
        true
    });
    removed
}

/// One server-sent event's `data` lines, joined; events without data
/// (comments, keep-alives) are skipped. Bounded: `None` once `buf` holds
/// more than [`MAX_UPSTREAM_MESSAGE`] without an event end.
pub fn sse_take_event(buf: &mut Vec<u8>) -> Option<Result<Option<String>, ()>> {
    let end = find_event_end(buf);
    let Some((at, len)) = end else {
        return if buf.len() > MAX_UPSTREAM_MESSAGE {
            Some(Err(()))
        } else {
            None
        };
    };
    let raw: Vec<u8> = buf.drain(..at + len).collect();
    let text = String::from_utf8_lossy(&raw[..at]);
    let mut data = Vec::new();
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some(d) = line.strip_prefix("data:") {
            data.push(d.strip_prefix(' ').unwrap_or(d).to_string());
        }
    }
    Some(Ok((!data.is_empty()).then(|| data.join("\n"))))
}

fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// One SSE event carrying `msg`.
pub fn sse_event(msg: &Value) -> bytes::Bytes {
    bytes::Bytes::from(format!("event: message\ndata: {msg}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Policy;
    use std::sync::Arc;

    fn set(text: &str) -> PolicySet {
        let p = Policy::parse(text).unwrap_or_else(|e| panic!("{e}"));
        PolicySet::new(None, Some(Arc::new(p)), None).unwrap_or_else(|e| panic!("{e}"))
    }

    const SLACK: &str = r#"
default = "allow"
[[connector]]
name = "slack"
kind = "mcp"
url = "http://127.0.0.1:9/mcp"
headers = { Authorization = "Bearer xoxb-secret" }
[[connector.tool]]
name = "search"
read_only = true
[[connector.tool]]
name = "post_message"
"#;

    fn listing() -> Value {
        json!({"jsonrpc":"2.0","id":1,"result":{"tools":[
            {"name":"search","inputSchema":{}},
            {"name":"post_message","inputSchema":{},"annotations":{"readOnlyHint":true,"destructiveHint":false}},
            {"name":"delete_channel","inputSchema":{},"annotations":{"readOnlyHint":true}},
            {"inputSchema":{}}
        ]}})
    }

    fn names(v: &Value) -> Vec<String> {
        v["result"]["tools"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn tmpl() -> ToolCall {
        call("t", Some("sb"), "sandbox:sb", "slack", "x", None)
    }

    #[test]
    fn tools_list_hides_denied_tools_and_takes_annotations_from_the_catalog() {
        let p = set(&format!(
            "{SLACK}\n[[rule]]\neffect = \"deny\"\nconnector = \"slack\"\ntool = \"delete_*\"\n"
        ));
        let c = p
            .connectors()
            .find(|(_, c)| c.name == "slack")
            .map(|(_, c)| c.clone());
        let c = c.unwrap_or_else(|| panic!("no connector"));
        let mut v = listing();
        let removed = filter_tools(&mut v, &p, &tmpl(), &c);
        assert_eq!(removed, vec!["delete_channel".to_string()]);
        // A nameless entry goes too.
        assert_eq!(names(&v), vec!["search", "post_message"]);
        // The server claimed post_message reads; the catalog does not.
        assert_eq!(
            v["result"]["tools"][1]["annotations"]["readOnlyHint"],
            false
        );
        assert_eq!(
            v["result"]["tools"][1]["annotations"]["destructiveHint"],
            true
        );
        assert_eq!(v["result"]["tools"][0]["annotations"]["readOnlyHint"], true);
        assert_eq!(
            v["result"]["tools"][0]["annotations"]["destructiveHint"],
            false
        );
    }

    #[test]
    fn write_block_refuses_every_tool_not_read_only_in_the_catalog() {
        let p = set(&SLACK.replace("kind = \"mcp\"", "kind = \"mcp\"\nread_only = true"));
        let c = p
            .connectors()
            .find(|(_, c)| c.name == "slack")
            .map(|(_, c)| c.clone())
            .unwrap_or_else(|| panic!("no connector"));
        let ev =
            |tool: &str, args: Value| p.evaluate(&call("t", None, "a", "slack", tool, Some(&args)));
        assert_eq!(ev("search", json!({"q": "x"})).effect, Effect::Allow);
        let d = ev("post_message", json!({"channel": "c", "text": "hi"}));
        assert_eq!(d.effect, Effect::Deny);
        assert_eq!(d.rule_id, "connector:slack:read-only");
        // Not in the catalog: a write, whatever the server says.
        assert_eq!(ev("delete_channel", json!({})).effect, Effect::Deny);
        // And the listing shows only the read tool.
        let mut v = listing();
        filter_tools(&mut v, &p, &tmpl(), &c);
        assert_eq!(names(&v), vec!["search"]);
    }

    #[test]
    fn argument_matchers_decide_on_the_values_sent() {
        let p = set(&format!(
            "{SLACK}\n[[rule]]\nid = \"general-needs-ok\"\neffect = \"approve\"\ntool = \"post_message\"\narguments = {{ channel = [\"general\", \"#general\"] }}\n[[rule]]\neffect = \"deny\"\ntool = \"post_message\"\narguments = {{ \"opts.broadcast\" = \"true\" }}\n"
        ));
        let ev = |args: Value| {
            p.evaluate(&call("t", None, "a", "slack", "post_message", Some(&args)))
                .effect
        };
        assert_eq!(
            ev(json!({"channel": "general", "text": "x"})),
            Effect::Approve
        );
        assert_eq!(ev(json!({"channel": "#general"})), Effect::Approve);
        assert_eq!(ev(json!({"channel": "random"})), Effect::Allow);
        assert_eq!(
            ev(json!({"channel": "random", "opts": {"broadcast": true}})),
            Effect::Deny
        );
        // Unknown arguments (a listing check): argument rules do not decide.
        let d = p.evaluate(&call("t", None, "a", "slack", "post_message", None));
        assert_eq!(d.effect, Effect::Allow);
        // A call naming a connector that is not an MCP one is refused.
        let d = p.evaluate(&call(
            "t",
            None,
            "a",
            "nope",
            "post_message",
            Some(&json!({})),
        ));
        assert_eq!(
            (d.effect, d.rule_id.as_str()),
            (Effect::Deny, "invalid-call")
        );
    }

    #[test]
    fn hostile_messages_are_refused_with_bounds() {
        assert_eq!(parse(b"{").map(|_| ()).unwrap_err().code, PARSE_ERROR);
        let big = vec![b' '; MAX_MESSAGE + 1];
        assert_eq!(parse(&big).map(|_| ()).unwrap_err().code, INVALID_REQUEST);
        let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
        assert!(parse(deep.as_bytes()).is_err());
        let nested = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"x","arguments":{}1{}}}}}"#,
            "{\"a\":".repeat(70),
            "}".repeat(70)
        );
        assert_eq!(
            parse(nested.as_bytes()).map(|_| ()).unwrap_err().code,
            INVALID_REQUEST
        );
        let batch = br#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#;
        assert_eq!(parse(batch).map(|_| ()).unwrap_err().code, INVALID_REQUEST);
        let long = format!(
            r#"{{"jsonrpc":"2.0","id":1,"method":"{}"}}"#,
            "m".repeat(300)
        );
        assert!(parse(long.as_bytes()).is_err());
        let long_id = format!(
            r#"{{"jsonrpc":"2.0","id":"{}","method":"ping"}}"#,
            "i".repeat(300)
        );
        assert!(parse(long_id.as_bytes()).is_err());
        assert!(parse(br#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#).is_err());
        assert!(parse(br#"{"jsonrpc":"2.0","id":{},"method":"ping"}"#).is_err());
        // Good ones.
        let (_, m) =
            parse(br#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"t"}}"#)
                .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(matches!(m, Message::Request { ref method, .. } if method == "tools/call"));
        let (_, m) = parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            m,
            Message::Notification {
                method: "notifications/initialized".into()
            }
        );
        let (_, m) =
            parse(br#"{"jsonrpc":"2.0","id":3,"result":{}}"#).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(m, Message::Response);
        assert!(tool_call(Some(&json!({"name": "x", "arguments": [1]}))).is_err());
        assert!(tool_call(Some(&json!({"arguments": {}}))).is_err());
        assert_eq!(route("resources/read"), Route::Refuse);
        assert_eq!(route("notifications/cancelled"), Route::Pass);
    }

    #[test]
    fn sse_events_are_split_and_bounded() {
        let mut b = b"event: message\ndata: {\"a\":1}\n\n: keepalive\n\ndata: x".to_vec();
        assert_eq!(sse_take_event(&mut b), Some(Ok(Some("{\"a\":1}".into()))));
        assert_eq!(sse_take_event(&mut b), Some(Ok(None)));
        assert_eq!(sse_take_event(&mut b), None);
        let mut big = vec![b'x'; MAX_UPSTREAM_MESSAGE + 1];
        assert_eq!(sse_take_event(&mut big), Some(Err(())));
    }

    #[test]
    fn catalog_parsing_refuses_mixed_or_incomplete_connectors() {
        for bad in [
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\n",
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\nurl = \"http://a/mcp\"\ncommand = [\"a\"]\n",
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\nurl = \"ftp://a/mcp\"\n",
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\nurl = \"http://a/mcp\"\nhosts = \"a\"\n",
            "[[connector]]\nname = \"x\"\nhosts = \"a.test\"\ncommand = [\"a\"]\n",
            "[[connector]]\nname = \"x\"\nkind = \"ftp\"\nhosts = \"a.test\"\n",
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\ncommand = [\"a\"]\n[[connector.tool]]\nname = \"t\"\nread_onyl = true\n",
            "[[rule]]\neffect = \"deny\"\ntool = \"x\"\nmethod = \"GET\"\n",
            "[[rule]]\neffect = \"deny\"\narguments = { \"a..b\" = \"x\" }\n",
        ] {
            assert!(Policy::parse(bad).is_err(), "accepted:\n{bad}");
        }
        let p = Policy::parse(
            "[[connector]]\nname = \"x\"\nkind = \"mcp\"\ncommand = [\"python3\", \"-m\", \"srv\"]\nenv = { TOKEN = \"s3cret\" }\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        // Credentials never print.
        assert!(!format!("{p:?}").contains("s3cret"));
    }
}
