//! Connector secrets applied by the egress proxy (`docs/secrets.md`).
//!
//! A secret is bound to a connector and carries an [`Injection`] rule: the
//! proxy puts its value on an allowed request to the connector's hosts
//! ([`apply`]), replacing whatever credential the guest sent under the same
//! name and any placeholder `strata:secret/<name>` ([`placeholder`]) in a
//! header value. What the value (and its encoded forms) looks like in an
//! answer is given back as needles; [`strip_headers`] and [`strip_body`]
//! replace them in the response headers and in a response body up to
//! [`STRIP_BODY_MAX`] bytes with [`REDACTED`].
//!
//! This module knows rules and bytes only; where values are kept (sealed)
//! and which secret applies to a call is the daemon's (`stratad::security::secrets`).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use bytes::Bytes;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, AUTHORIZATION};
use serde::{Deserialize, Serialize};

/// What replaces a secret's value in an answer the proxy strips.
pub const REDACTED: &str = "[strata:redacted]";

/// Response bodies up to this many bytes are searched for injected values
/// (longer ones, streams and compressed ones pass unchanged).
pub const STRIP_BODY_MAX: usize = 1024 * 1024;

/// Prefix of a placeholder a guest may send in place of a credential.
pub const PLACEHOLDER_PREFIX: &str = "strata:secret/";

/// Longest secret name.
pub const MAX_NAME: usize = 64;

/// How a secret's value is put on a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Injection {
    /// `Authorization: Bearer <value>`.
    Bearer,
    /// A header `name`, its value `template` with `{value}` replaced.
    Header {
        /// Header name (`X-Api-Key`).
        name: String,
        /// Value template, `{value}` once (default `{value}`).
        #[serde(default = "value_template")]
        template: String,
    },
    /// `Authorization: Basic base64(<user>:<value>)`.
    Basic {
        /// The user name (not secret).
        user: String,
    },
    /// A query parameter `param=<value>` (any the guest sent is replaced).
    Query {
        /// Parameter name.
        param: String,
    },
}

fn value_template() -> String {
    "{value}".into()
}

/// Why a rule or name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RuleError(pub String);

/// Checks a secret name: 1–[`MAX_NAME`] of `[A-Za-z0-9_.-]`, starting
/// with a letter or digit.
pub fn check_name(name: &str) -> Result<(), RuleError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.bytes().all(is_name_byte);
    if ok {
        Ok(())
    } else {
        Err(RuleError(format!(
            "secret name {name:?}: 1-{MAX_NAME} of [A-Za-z0-9_.-], starting with a letter or digit"
        )))
    }
}

/// Whether `b` may appear in a secret name (`[A-Za-z0-9_.-]`).
fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')
}

/// A piece of a text that may hold placeholders ([`placeholder_pieces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text kept as it is.
    Text(&'a str),
    /// `strata:secret/<name>`: the name (the longest run of name
    /// characters after the prefix; possibly empty, which names no secret).
    Secret(&'a str),
}

/// `v` cut into text and `strata:secret/<name>` placeholders, in order.
pub fn placeholder_pieces(v: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut rest = v;
    while let Some(i) = rest.find(PLACEHOLDER_PREFIX) {
        if i > 0 {
            out.push(Piece::Text(&rest[..i]));
        }
        let after = &rest[i + PLACEHOLDER_PREFIX.len()..];
        let end = after
            .bytes()
            .position(|b| !is_name_byte(b))
            .unwrap_or(after.len());
        out.push(Piece::Secret(&after[..end]));
        rest = &after[end..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest));
    }
    out
}

impl Injection {
    /// Checks the rule (a header name that is a token and no hop-by-hop or
    /// framing header, a template with `{value}` once, a user without `:`,
    /// a parameter name that needs no encoding).
    pub fn check(&self) -> Result<(), RuleError> {
        match self {
            Injection::Bearer => Ok(()),
            Injection::Header { name, template } => {
                let n = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| RuleError(format!("header {name:?}: not a header name")))?;
                const FORBIDDEN: [&str; 10] = [
                    "host",
                    "content-length",
                    "transfer-encoding",
                    "connection",
                    "upgrade",
                    "te",
                    "trailer",
                    "keep-alive",
                    "proxy-authorization",
                    "proxy-connection",
                ];
                if FORBIDDEN.contains(&n.as_str()) {
                    return Err(RuleError(format!(
                        "header {name:?}: framing and hop-by-hop headers cannot carry a secret"
                    )));
                }
                if template.matches("{value}").count() != 1 {
                    return Err(RuleError(format!(
                        "template {template:?}: must contain `{{value}}` exactly once"
                    )));
                }
                if HeaderValue::from_str(&template.replace("{value}", "")).is_err() {
                    return Err(RuleError(format!(
                        "template {template:?}: not a header value"
                    )));
                }
                Ok(())
            }
            Injection::Basic { user } => {
                if user.contains(':') || user.chars().any(char::is_control) {
                    return Err(RuleError("basic user: no `:` or control characters".into()));
                }
                Ok(())
            }
            Injection::Query { param } => {
                if param.is_empty()
                    || !param
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
                {
                    return Err(RuleError(format!(
                        "query param {param:?}: 1+ of [A-Za-z0-9_.-]"
                    )));
                }
                Ok(())
            }
        }
    }

    /// A short description (`bearer`, `header X-Api-Key`, `basic bob`,
    /// `query api_key`).
    pub fn describe(&self) -> String {
        match self {
            Injection::Bearer => "bearer".into(),
            Injection::Header { name, .. } => format!("header {name}"),
            Injection::Basic { user } => format!("basic {user}"),
            Injection::Query { param } => format!("query {param}"),
        }
    }
}

/// The placeholder for secret `name` (`strata:secret/<name>`).
pub fn placeholder(name: &str) -> String {
    format!("{PLACEHOLDER_PREFIX}{name}")
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn encode_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The query without any parameter named `param` (in any encoding that
/// decodes to it), then `param=<value>` appended.
fn with_param(query: Option<&str>, param: &str, value: &str) -> String {
    let mut kept: Vec<&str> = query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| {
            let k = p.split('=').next().unwrap_or("");
            decode_lossy(k) != param
        })
        .collect();
    let added = format!("{param}={}", encode_component(value));
    kept.push(&added);
    kept.join("&")
}

fn decode_lossy(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 3 <= b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Puts secret `name`'s `value` on `req` by `rule`: a header of the rule's
/// name the guest sent is removed first, a placeholder
/// `strata:secret/<name>` in any header value is replaced by the value.
/// Returns the needles to strip from the answer (the value and the forms
/// the rule sent it in).
pub fn apply(
    req: &mut hyper::http::request::Parts,
    name: &str,
    rule: &Injection,
    value: &str,
) -> Result<Vec<Vec<u8>>, RuleError> {
    let bad = || {
        RuleError(format!(
            "secret {name}: its value is not a valid header value"
        ))
    };
    let mut needles = vec![value.as_bytes().to_vec()];
    // Placeholders first: a guest header `X-Key: strata:secret/<name>`.
    let ph = placeholder(name);
    let hits: Vec<(HeaderName, HeaderValue)> = req
        .headers
        .iter()
        .filter_map(|(k, v)| {
            let s = v.to_str().ok()?;
            s.contains(&ph).then(|| (k.clone(), s.replace(&ph, value)))
        })
        .map(|(k, s)| HeaderValue::from_str(&s).map(|v| (k, v)).map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    for (k, _) in &hits {
        req.headers.remove(k);
    }
    for (k, v) in hits {
        req.headers.append(k, sensitive(v));
    }
    match rule {
        Injection::Bearer => {
            let v = HeaderValue::from_str(&format!("Bearer {value}")).map_err(|_| bad())?;
            req.headers.insert(AUTHORIZATION, sensitive(v));
        }
        Injection::Header { name: h, template } => {
            let hn = HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| RuleError(format!("header {h:?}: not a header name")))?;
            let text = template.replace("{value}", value);
            let v = HeaderValue::from_str(&text).map_err(|_| bad())?;
            req.headers.insert(hn, sensitive(v));
        }
        Injection::Basic { user } => {
            let enc = STANDARD.encode(format!("{user}:{value}"));
            let v = HeaderValue::from_str(&format!("Basic {enc}")).map_err(|_| bad())?;
            req.headers.insert(AUTHORIZATION, sensitive(v));
            needles.push(enc.into_bytes());
        }
        Injection::Query { param } => {
            let path = req.uri.path().to_string();
            let q = with_param(req.uri.query(), param, value);
            req.uri = format!("{path}?{q}")
                .parse()
                .map_err(|_| RuleError(format!("query {param}: the request URL breaks")))?;
            let enc = encode_component(value);
            if enc != value {
                needles.push(enc.into_bytes());
            }
        }
    }
    needles.retain(|n| !n.is_empty());
    Ok(needles)
}

fn sensitive(mut v: HeaderValue) -> HeaderValue {
    v.set_sensitive(true);
    v
}

/// Replaces every needle in `hay` by [`REDACTED`]; `None` when none occurs.
pub fn redact(hay: &[u8], needles: &[Vec<u8>]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for n in needles.iter().filter(|n| !n.is_empty()) {
        let cur = out.as_deref().unwrap_or(hay);
        if let Some(r) = replace_all(cur, n, REDACTED.as_bytes()) {
            out = Some(r);
        }
    }
    out
}

fn replace_all(hay: &[u8], needle: &[u8], with: &[u8]) -> Option<Vec<u8>> {
    if needle.len() > hay.len() {
        return None;
    }
    let mut out = Vec::with_capacity(hay.len());
    let mut i = 0;
    let mut hit = false;
    while i < hay.len() {
        if hay[i..].starts_with(needle) {
            out.extend_from_slice(with);
            i += needle.len();
            hit = true;
        } else {
            out.push(hay[i]);
            i += 1;
        }
    }
    hit.then_some(out)
}

/// Strips needles from response header values.
pub fn strip_headers(h: &mut HeaderMap, needles: &[Vec<u8>]) {
    let hits: Vec<(HeaderName, Vec<HeaderValue>)> = h
        .keys()
        .filter(|k| {
            h.get_all(*k)
                .iter()
                .any(|v| redact(v.as_bytes(), needles).is_some())
        })
        .map(|k| {
            let vals = h
                .get_all(k)
                .iter()
                .map(|v| match redact(v.as_bytes(), needles) {
                    None => v.clone(),
                    Some(r) => HeaderValue::from_bytes(&r)
                        .unwrap_or_else(|_| HeaderValue::from_static(REDACTED)),
                })
                .collect();
            (k.clone(), vals)
        })
        .collect();
    for (k, vals) in hits {
        h.remove(&k);
        for v in vals {
            h.append(k.clone(), v);
        }
    }
}

/// A whole response body (at most [`STRIP_BODY_MAX`] bytes) with the
/// needles replaced, or `None` when none occurs.
pub fn strip_body(body: &Bytes, needles: &[Vec<u8>]) -> Option<Bytes> {
    redact(body, needles).map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_cut_by_the_name_charset() {
        assert_eq!(
            placeholder_pieces("Bearer strata:secret/a.b-c_1 and strata:secret/x/y"),
            vec![
                Piece::Text("Bearer "),
                Piece::Secret("a.b-c_1"),
                Piece::Text(" and "),
                Piece::Secret("x"),
                Piece::Text("/y"),
            ]
        );
        assert_eq!(placeholder_pieces("plain"), vec![Piece::Text("plain")]);
        assert_eq!(
            placeholder_pieces("strata:secret/"),
            vec![Piece::Secret("")]
        );
        // Every name a placeholder yields is one check_name would judge.
        assert!(check_name("a.b-c_1").is_ok());
    }

    fn req(uri: &str, headers: &[(&str, &str)]) -> hyper::http::request::Parts {
        let mut b = hyper::Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap_or_else(|e| panic!("{e}")).into_parts().0
    }

    #[test]
    fn bearer_replaces_the_guests_authorization() {
        let mut r = req("/a", &[("authorization", "Bearer guest-made-up")]);
        let n = apply(&mut r, "sf", &Injection::Bearer, "s3cr3t").unwrap();
        let all: Vec<_> = r.headers.get_all(AUTHORIZATION).iter().collect();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0], "Bearer s3cr3t");
        assert!(all[0].is_sensitive());
        assert_eq!(n, vec![b"s3cr3t".to_vec()]);
    }

    #[test]
    fn header_rule_uses_its_template_and_replaces_placeholders() {
        let rule = Injection::Header {
            name: "X-Api-Key".into(),
            template: "Token {value}".into(),
        };
        rule.check().unwrap();
        let mut r = req(
            "/a",
            &[
                ("x-api-key", "whatever"),
                ("x-other", "pre strata:secret/k post"),
                ("x-unrelated", "strata:secret/other"),
            ],
        );
        apply(&mut r, "k", &rule, "abc").unwrap();
        assert_eq!(r.headers["x-api-key"], "Token abc");
        assert_eq!(r.headers.get_all("x-api-key").iter().count(), 1);
        assert_eq!(r.headers["x-other"], "pre abc post");
        // Another secret's placeholder is left to that secret.
        assert_eq!(r.headers["x-unrelated"], "strata:secret/other");
    }

    #[test]
    fn basic_and_query_rules() {
        let mut r = req("/a", &[]);
        let n = apply(&mut r, "b", &Injection::Basic { user: "bob".into() }, "pw").unwrap();
        assert_eq!(r.headers[AUTHORIZATION], "Basic Ym9iOnB3");
        assert!(n.contains(&b"Ym9iOnB3".to_vec()));
        let mut r = req("/p/x?a=1&api_key=guest&api%5Fkey=g2&z=2", &[]);
        let n = apply(
            &mut r,
            "q",
            &Injection::Query {
                param: "api_key".into(),
            },
            "v a&l",
        )
        .unwrap();
        assert_eq!(r.uri.to_string(), "/p/x?a=1&z=2&api_key=v%20a%26l");
        assert!(n.contains(&b"v%20a%26l".to_vec()));
        let mut r = req("/p", &[]);
        apply(
            &mut r,
            "q",
            &Injection::Query {
                param: "key".into(),
            },
            "v",
        )
        .unwrap();
        assert_eq!(r.uri.to_string(), "/p?key=v");
    }

    #[test]
    fn bad_rules_and_names_are_refused() {
        for bad in [
            Injection::Header {
                name: "Host".into(),
                template: "{value}".into(),
            },
            Injection::Header {
                name: "x y".into(),
                template: "{value}".into(),
            },
            Injection::Header {
                name: "X-K".into(),
                template: "no value".into(),
            },
            Injection::Header {
                name: "X-K".into(),
                template: "{value}{value}".into(),
            },
            Injection::Basic { user: "a:b".into() },
            Injection::Query { param: "".into() },
            Injection::Query {
                param: "a&b".into(),
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert!(check_name("sf-token.v2").is_ok());
        for n in ["", "-x", "a/b", &"x".repeat(65)] {
            assert!(check_name(n).is_err(), "{n}");
        }
        // A value that is no header value is refused, not sent broken.
        let mut r = req("/a", &[]);
        assert!(apply(&mut r, "x", &Injection::Bearer, "a\nb").is_err());
    }

    #[test]
    fn answers_are_stripped_of_injected_values() {
        let needles = vec![b"s3cr3t".to_vec(), b"Ym9iOnB3".to_vec()];
        let mut h = HeaderMap::new();
        h.insert("x-echo", HeaderValue::from_static("Bearer s3cr3t"));
        h.append("x-echo", HeaderValue::from_static("fine"));
        h.insert("x-basic", HeaderValue::from_static("Basic Ym9iOnB3"));
        strip_headers(&mut h, &needles);
        let echo: Vec<_> = h.get_all("x-echo").iter().collect();
        assert_eq!(echo, ["Bearer [strata:redacted]", "fine"]);
        assert_eq!(h["x-basic"], "Basic [strata:redacted]");
        let b = Bytes::from_static(b"{\"auth\":\"s3cr3ts3cr3t\"}");
        assert_eq!(
            strip_body(&b, &needles).unwrap(),
            Bytes::from_static(b"{\"auth\":\"[strata:redacted][strata:redacted]\"}")
        );
        assert!(strip_body(&Bytes::from_static(b"clean"), &needles).is_none());
    }
}
