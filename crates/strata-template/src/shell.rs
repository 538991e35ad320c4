//! Shell quoting and the package-name charset.

/// Quotes `s` for a POSIX shell: one single-quoted word (`'` becomes `'\''`).
/// The empty string becomes `''`.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        if c == '\'' {
            out.push_str("'\\''");
        } else {
            out.push(c);
        }
    }
    out.push('\'');
    out
}

/// Joins words into one shell command line, each quoted (a Dockerfile's
/// exec form `["a", "b c"]` → `'a' 'b c'`).
pub fn join(words: &[String]) -> String {
    words.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
}

/// Whether `c` may appear in a package name or spec: letters, digits and
/// `. _ + - = < > ! ~ [ ] , @ / : * ^`. That covers `pkg==1.2`,
/// `pkg[extra]>=1,<2`, `@scope/pkg@^1.2`, `pkg=1.2-1`, `pkg/bookworm-backports`,
/// and no shell metacharacter, quote, space or control character.
pub fn is_package_char(c: char) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(
            c,
            '.' | '_'
                | '+'
                | '-'
                | '='
                | '<'
                | '>'
                | '!'
                | '~'
                | '['
                | ']'
                | ','
                | '@'
                | '/'
                | ':'
                | '*'
                | '^'
        )
}

/// Checks one package name: non-empty, the charset of [`is_package_char`],
/// and not starting with `-` (which the installer would read as an option).
pub fn check_package(p: &str) -> Result<(), String> {
    if p.is_empty() {
        return Err("a package name is empty".into());
    }
    if p.starts_with('-') {
        return Err(format!(
            "package {p:?} starts with '-' (options are not allowed)"
        ));
    }
    if let Some(c) = p.chars().find(|c| !is_package_char(*c)) {
        return Err(format!(
            "package {:?} contains {c:?} (allowed: letters, digits and . _ + - = < > ! ~ [ ] , @ / : * ^)",
            p.escape_debug().to_string()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The quoted word, evaluated by a real `sh`, is the original string.
    #[test]
    fn quote_round_trips_through_sh() {
        for s in [
            "",
            "plain",
            "it's",
            "a b",
            "$(touch /tmp/x)",
            "`id`",
            "\"dq\"",
            "back\\slash",
            "new\nline",
            "'''",
            "ünïcødé",
        ] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(s)))
                .output()
                .expect("sh runs");
            assert!(out.status.success());
            assert_eq!(String::from_utf8_lossy(&out.stdout), s, "for {s:?}");
        }
    }

    #[test]
    fn package_charset() {
        for ok in [
            "requests",
            "requests==2.32.3",
            "uvicorn[standard]>=0.30,<1",
            "@scope/pkg@1.2.3",
            "typescript@^5",
            "libssl3=3.0.15-1~deb12u1",
            "curl/bookworm-backports",
            "numpy==1.*",
            "git+https://github.com/a/b",
        ] {
            assert!(check_package(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-e",
            "--index-url=http://evil",
            "a;b",
            "a b",
            "$(id)",
            "a`b`",
            "a|b",
            "a&b",
            "a'b",
            "a\"b",
            "a\nb",
            "a\\b",
            "a>$HOME",
        ] {
            assert!(check_package(bad).is_err(), "{bad:?}");
        }
    }
}
