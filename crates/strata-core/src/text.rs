//! Text from outside (a guest, an agent, a remote name) made safe to print:
//! in a log line, an error message or a terminal. Control characters (a
//! newline that would start a fake log line, an ESC that starts a terminal
//! escape sequence), Unicode line separators and bidirectional overrides
//! are written as Rust-style escapes (`\n`, `\r`, `\t`, `\u{1b}`); every
//! other character, backslash included, is kept as it is.

use std::borrow::Cow;
use std::fmt;

/// Whether `c` is written escaped: a control character (C0, DEL, C1), a
/// line or paragraph separator, or a bidirectional embedding, override or
/// isolate (which reorder what a reader sees).
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

fn write_escaped(c: char, f: &mut impl fmt::Write) -> fmt::Result {
    match c {
        '\n' => f.write_str("\\n"),
        '\r' => f.write_str("\\r"),
        '\t' => f.write_str("\\t"),
        c => write!(f, "\\u{{{:x}}}", u32::from(c)),
    }
}

/// `s` with [`needs_escape`] characters escaped (borrowed when there is
/// none).
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if needs_escape(c) {
            // Writing to a String cannot fail.
            let _ = write_escaped(c, &mut out);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// [`escape`] that keeps newlines and tabs: for multi-line text shown to a
/// person (a page of CLI output, an error with a console tail), where
/// lines are meant but a terminal escape sequence never is.
pub fn escape_text(s: &str) -> Cow<'_, str> {
    let bad = |c: char| needs_escape(c) && c != '\n' && c != '\t';
    if !s.chars().any(bad) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if bad(c) {
            let _ = write_escaped(c, &mut out);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Displays a string with [`escape`]'s escapes, without allocating: for
/// log fields (`tracing::warn!(peer = %Escaped(&peer), …)`) and
/// `format!`.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if needs_escape(c) {
                write_escaped(c, f)?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        let guest = "evil.example\n2026-01-01T00:00:00Z  INFO fake line \u{1b}[31mred\u{1b}[0m\r\t\u{7f}\u{9b}";
        let e = escape(guest);
        assert_eq!(
            e,
            "evil.example\\n2026-01-01T00:00:00Z  INFO fake line \\u{1b}[31mred\\u{1b}[0m\\r\\t\\u{7f}\\u{9b}"
        );
        assert!(!e.chars().any(needs_escape));
        assert_eq!(Escaped(guest).to_string(), e);
        // Multi-line text keeps its lines and tabs, nothing else.
        assert_eq!(
            escape_text("a\n\tb\u{1b}]0;title\u{7}\r"),
            "a\n\tb\\u{1b}]0;title\\u{7}\\r"
        );
        // Separators and bidi overrides too.
        assert_eq!(
            escape("a\u{2028}b\u{202e}c\u{2066}"),
            "a\\u{2028}b\\u{202e}c\\u{2066}"
        );
        // Nothing to escape: the same text, not copied; backslashes and
        // non-ASCII kept.
        for clean in ["plain", "C:\\path\\n", "héllo wörld ✓", ""] {
            assert!(matches!(escape(clean), Cow::Borrowed(_)), "{clean}");
            assert_eq!(Escaped(clean).to_string(), clean);
        }
    }
}
