//! Lexical normalisation of guest paths, and strict decoding of HTTP request
//! paths, before either is matched by globs.

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The path contains a NUL byte.
    #[error("path contains a NUL byte")]
    Nul,
    /// The path is not absolute.
    #[error("path is not absolute")]
    Relative,
    /// A `..` component climbs above `/`.
    #[error("path escapes the root with `..`")]
    Escape,
    /// The path is empty.
    #[error("path is empty")]
    Empty,
}

/// Normalise an absolute guest path lexically: collapse `//` and `.`, resolve
/// `..` against the components before it, refuse NUL bytes, relative paths and
/// `..` that would climb above `/`.
///
/// This is lexical only: symbolic links inside the guest are not seen here.
pub fn normalize(path: &str) -> Result<String, PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.contains('\0') {
        return Err(PathError::Nul);
    }
    if !path.starts_with('/') {
        return Err(PathError::Relative);
    }
    let mut parts: Vec<&str> = Vec::new();
    for comp in path.split('/') {
        match comp {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(PathError::Escape);
                }
            }
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Ok("/".to_string());
    }
    let mut out = String::with_capacity(path.len());
    for p in parts {
        out.push('/');
        out.push_str(p);
    }
    Ok(out)
}

/// Why an HTTP request path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpPathError {
    /// The path does not start with `/`.
    #[error("request path does not start with `/`")]
    Relative,
    /// A `%` not followed by two hex digits.
    #[error("bad percent-escape `{0}`")]
    BadEscape(String),
    /// `%2F`: a server may decode it into a separator the rules never saw.
    #[error("encoded `/` (%2F) in the request path")]
    EncodedSlash,
    /// `\` (literal or `%5C`): some servers read it as `/`.
    #[error("`\\` in the request path")]
    Backslash,
    /// A `.` or `..` segment, literal or encoded.
    #[error("dot segment (`.` or `..`, in any encoding) in the request path")]
    DotSegment,
    /// A `;` (literal or `%3B`): path parameters some servers strip.
    #[error("`;` (path parameter) in the request path")]
    Parameter,
    /// A NUL or another control character.
    #[error("control character in the request path")]
    Control,
    /// The decoded path is not UTF-8.
    #[error("request path does not decode to UTF-8")]
    NotUtf8,
    /// An escape that decodes to another escape (`%252e`).
    #[error("double percent-encoding in the request path")]
    DoubleEncoded,
}

/// An HTTP request path, decoded and put in canonical form by
/// [`http_path`]: two spellings of the same path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpPath {
    /// Fully decoded, empty segments collapsed, no trailing `/` (except the
    /// root `/`): what `http_path` rules match.
    pub matched: String,
    /// What is sent upstream: the same segments, escapes of unreserved
    /// characters decoded, every other escape in upper-case hex, bytes a URI
    /// cannot carry literally escaped, a trailing `/` kept. Decoding it gives
    /// `matched` back.
    pub canonical: String,
}

/// Characters kept literally in [`HttpPath::canonical`]: RFC 3986 `pchar`
/// without `%` and `;` (unreserved, the other sub-delims, `:`, `@`).
fn literal_ok(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,=:@".contains(&b)
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~".contains(&b)
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

/// Decode an HTTP request path (no query, no fragment) strictly, for
/// matching and forwarding. Refused: a path not starting with `/`, bad
/// escapes, an encoded `/` (`%2F`), `\` in any form, `.` and `..` segments
/// in any encoding (`%2e%2e`), `;` in any form (path parameters), control
/// characters, a path that does not decode to UTF-8, and double encoding
/// (`%252e`). Empty segments (`//`) collapse.
///
/// A server that decodes or normalises paths therefore sees the path the
/// rules matched, and one that does not sees it too, because the proxy
/// forwards [`HttpPath::canonical`].
pub fn http_path(raw: &str) -> Result<HttpPath, HttpPathError> {
    if !raw.starts_with('/') {
        return Err(HttpPathError::Relative);
    }
    let mut matched = String::with_capacity(raw.len());
    let mut canonical = String::with_capacity(raw.len());
    let trailing = raw.len() > 1 && raw.ends_with('/');
    for seg in raw.split('/').filter(|s| !s.is_empty()) {
        let bytes = seg.as_bytes();
        // (decoded byte, was it escaped)
        let mut decoded: Vec<(u8, bool)> = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                let esc = seg.get(i..(i + 3).min(seg.len())).unwrap_or("%");
                let (Some(h), Some(l)) = (
                    bytes.get(i + 1).copied().and_then(hex),
                    bytes.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(HttpPathError::BadEscape(esc.to_string()));
                };
                decoded.push(((h << 4) | l, true));
                i += 3;
            } else {
                decoded.push((bytes[i], false));
                i += 1;
            }
        }
        for (n, &(b, escaped)) in decoded.iter().enumerate() {
            match b {
                b'/' => return Err(HttpPathError::EncodedSlash),
                b'\\' => return Err(HttpPathError::Backslash),
                b';' => return Err(HttpPathError::Parameter),
                0..=0x1f | 0x7f => return Err(HttpPathError::Control),
                b'%' if escaped => {
                    let next = |k: usize| decoded.get(n + k).and_then(|&(c, _)| hex(c));
                    if next(1).is_some() && next(2).is_some() {
                        return Err(HttpPathError::DoubleEncoded);
                    }
                }
                _ => {}
            }
        }
        let plain: Vec<u8> = decoded.iter().map(|&(b, _)| b).collect();
        if plain == b"." || plain == b".." {
            return Err(HttpPathError::DotSegment);
        }
        let text = std::str::from_utf8(&plain).map_err(|_| HttpPathError::NotUtf8)?;
        matched.push('/');
        matched.push_str(text);
        canonical.push('/');
        for &(b, escaped) in &decoded {
            if (escaped && unreserved(b)) || (!escaped && literal_ok(b)) {
                canonical.push(char::from(b));
            } else {
                canonical.push_str(&format!("%{b:02X}"));
            }
        }
    }
    if matched.is_empty() {
        return Ok(HttpPath {
            matched: "/".into(),
            canonical: "/".into(),
        });
    }
    if trailing {
        canonical.push('/');
    }
    Ok(HttpPath { matched, canonical })
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let rows: &[(&str, Result<&str, PathError>)] = &[
            ("/", Ok("/")),
            ("//", Ok("/")),
            ("/workspace/a.txt", Ok("/workspace/a.txt")),
            ("/workspace//a/./b/", Ok("/workspace/a/b")),
            ("/workspace/../etc/passwd", Ok("/etc/passwd")),
            ("/workspace/a/../../etc", Ok("/etc")),
            ("/..", Err(PathError::Escape)),
            ("/workspace/../../etc", Err(PathError::Escape)),
            ("workspace/a", Err(PathError::Relative)),
            ("./a", Err(PathError::Relative)),
            ("", Err(PathError::Empty)),
            ("/workspace/a\0b", Err(PathError::Nul)),
            ("/a/.../b", Ok("/a/.../b")),
        ];
        for (input, want) in rows {
            let got = normalize(input);
            assert_eq!(
                got.as_deref().map_err(Clone::clone),
                want.clone(),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn http_paths_decode_strictly() {
        let ok: &[(&str, &str, &str)] = &[
            ("/", "/", "/"),
            ("//", "/", "/"),
            (
                "/api/chat.postMessage",
                "/api/chat.postMessage",
                "/api/chat.postMessage",
            ),
            // the finding's bypass: decoded before matching
            (
                "/api/chat%2EpostMessage",
                "/api/chat.postMessage",
                "/api/chat.postMessage",
            ),
            ("/%61pi//x/", "/api/x", "/api/x/"),
            ("/a%20b/%7e", "/a b/~", "/a%20b/~"),
            ("/a%2bb+c", "/a+b+c", "/a%2Bb+c"),
            ("/%c3%a9/é", "/é/é", "/%C3%A9/%C3%A9"),
            ("/a/.../b", "/a/.../b", "/a/.../b"),
            ("/a%25zz", "/a%zz", "/a%25zz"),
        ];
        for (raw, matched, canonical) in ok {
            let p = http_path(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(
                (p.matched.as_str(), p.canonical.as_str()),
                (*matched, *canonical),
                "{raw}"
            );
            // The canonical form is a fixed point.
            assert_eq!(http_path(&p.canonical).as_ref(), Ok(&p), "{raw}");
        }
        use HttpPathError as E;
        let bad: &[(&str, HttpPathError)] = &[
            ("/api/x/%2e%2e/chat.postMessage", E::DotSegment),
            ("/api/x/%2E./chat.postMessage", E::DotSegment),
            ("/api/x/../chat.postMessage", E::DotSegment),
            ("/api/./x", E::DotSegment),
            ("/api/%2e", E::DotSegment),
            ("/api/chat.postMessage;x", E::Parameter),
            ("/api/chat.postMessage%3bx", E::Parameter),
            ("/api%2fchat.postMessage", E::EncodedSlash),
            ("/api%2Fx", E::EncodedSlash),
            ("/api%5cx", E::Backslash),
            ("/api\\x", E::Backslash),
            ("/a%00", E::Control),
            ("/a\nb", E::Control),
            ("/a%ff", E::NotUtf8),
            ("/a%4", E::BadEscape("%4".into())),
            ("/a%zz", E::BadEscape("%zz".into())),
            ("/%252e%252e/x", E::DoubleEncoded),
            ("/a%252F", E::DoubleEncoded),
            ("api/x", E::Relative),
            ("", E::Relative),
        ];
        for (raw, want) in bad {
            assert_eq!(
                http_path(raw).as_ref().map_err(Clone::clone),
                Err(want.clone()),
                "{raw}"
            );
        }
    }
}
