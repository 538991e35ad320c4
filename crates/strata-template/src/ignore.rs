//! `.dockerignore` in a copy's context directory, as Docker (and E2B's
//! SDK) read it: one pattern a line, `#` comments, `!` re-includes, the
//! last matching pattern decides, and a pattern that matches a directory
//! excludes everything below it.
//!
//! Patterns are relative to the context (a leading `/` is dropped, `.`/`..`
//! folded); `*` matches within one path component, `?` one character,
//! `[a-z]`/`[^a-z]` a class, `\` escapes, and a whole component `**` matches
//! any number of components (elsewhere `**` is `*`).

use std::path::Path;

use crate::RecipeError;

/// Largest `.dockerignore` read, in bytes.
pub const MAX_IGNORE_BYTES: usize = 1024 * 1024;

/// One pattern: its components, and whether it re-includes (`!`).
#[derive(Debug, Clone)]
struct Pattern {
    parts: Vec<String>,
    negated: bool,
}

/// The patterns of a context's `.dockerignore` (none if it has no file).
#[derive(Debug, Clone, Default)]
pub(crate) struct Ignore {
    patterns: Vec<Pattern>,
}

impl Ignore {
    /// Reads `<context>/.dockerignore` if there is one.
    pub(crate) fn load(context: &Path, src: &str) -> Result<Ignore, RecipeError> {
        let path = context.join(".dockerignore");
        let io = |e: std::io::Error| RecipeError::CopyIo {
            src: src.to_string(),
            path: path.display().to_string(),
            source: e,
        };
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ignore::default()),
            Err(e) => return Err(io(e)),
        };
        if meta.len() > MAX_IGNORE_BYTES as u64 {
            return Err(RecipeError::CopySource {
                src: src.to_string(),
                message: format!("{} is larger than {MAX_IGNORE_BYTES} bytes", path.display()),
            });
        }
        let bytes = std::fs::read(&path).map_err(io)?;
        Ok(Ignore::parse(&String::from_utf8_lossy(&bytes)))
    }

    /// Parses the text of a `.dockerignore`.
    pub(crate) fn parse(text: &str) -> Ignore {
        let mut patterns = Vec::new();
        for line in text.lines() {
            let l = line.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let (negated, body) = match l.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, l),
            };
            let mut parts: Vec<String> = Vec::new();
            for c in body.split('/') {
                match c {
                    "" | "." => {}
                    ".." => {
                        parts.pop();
                    }
                    c => parts.push(c.to_string()),
                }
            }
            if !parts.is_empty() {
                patterns.push(Pattern { parts, negated });
            }
        }
        Ignore { patterns }
    }

    /// Whether some pattern re-includes (so an excluded directory may still
    /// hold included entries).
    pub(crate) fn has_negations(&self) -> bool {
        self.patterns.iter().any(|p| p.negated)
    }

    /// Whether the context-relative path `rel` (components joined by `/`)
    /// is excluded.
    pub(crate) fn excluded(&self, rel: &str) -> bool {
        let comps: Vec<&str> = rel.split('/').filter(|c| !c.is_empty()).collect();
        if comps.is_empty() {
            return false;
        }
        let mut out = false;
        for p in &self.patterns {
            // The path itself or one of its parents.
            let hit = (1..=comps.len()).any(|n| match_parts(&p.parts, &comps[..n]));
            if hit {
                out = !p.negated;
            }
        }
        out
    }
}

/// Pattern components against path components; `**` spans any number.
fn match_parts(pat: &[String], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((p, rest)) if p == "**" => (0..=path.len()).any(|k| match_parts(rest, &path[k..])),
        Some((p, rest)) => match path.split_first() {
            Some((c, tail)) => {
                match_component(p.as_bytes(), c.as_bytes()) && match_parts(rest, tail)
            }
            None => false,
        },
    }
}

/// One component against a glob (`*`, `?`, `[…]`, `\`), bytewise.
fn match_component(pat: &[u8], s: &[u8]) -> bool {
    // Iterative matcher with backtracking to the last `*`.
    let (mut p, mut i) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    loop {
        if p < pat.len() {
            match pat[p] {
                b'*' => {
                    while p < pat.len() && pat[p] == b'*' {
                        p += 1;
                    }
                    star = Some((p, i));
                    continue;
                }
                b'?' if i < s.len() => {
                    p += 1;
                    i += 1;
                    continue;
                }
                b'[' if i < s.len() => {
                    if let Some((ok, next)) = match_class(pat, p, s[i]) {
                        if ok {
                            p = next;
                            i += 1;
                            continue;
                        }
                    } else if s[i] == b'[' {
                        // An unterminated class is a literal `[`.
                        p += 1;
                        i += 1;
                        continue;
                    }
                }
                b'\\' if p + 1 < pat.len() && i < s.len() && pat[p + 1] == s[i] => {
                    p += 2;
                    i += 1;
                    continue;
                }
                c if c != b'?' && c != b'[' && c != b'\\' && i < s.len() && c == s[i] => {
                    p += 1;
                    i += 1;
                    continue;
                }
                _ => {}
            }
        } else if i == s.len() {
            return true;
        }
        // Mismatch: let the last `*` take one more byte.
        match star {
            Some((sp, si)) if si < s.len() => {
                star = Some((sp, si + 1));
                p = sp;
                i = si + 1;
            }
            _ => return false,
        }
    }
}

/// `[…]` at `pat[p]` against `c`: `(matched, index after the class)`, or
/// `None` if the class is not terminated.
fn match_class(pat: &[u8], p: usize, c: u8) -> Option<(bool, usize)> {
    let mut j = p + 1;
    let negate = matches!(pat.get(j), Some(b'^' | b'!'));
    if negate {
        j += 1;
    }
    let mut hit = false;
    let mut first = true;
    while j < pat.len() {
        if pat[j] == b']' && !first {
            return Some((hit != negate, j + 1));
        }
        first = false;
        let mut lo = pat[j];
        if lo == b'\\' && j + 1 < pat.len() {
            j += 1;
            lo = pat[j];
        }
        let mut hi = lo;
        if pat.get(j + 1) == Some(&b'-') && pat.get(j + 2).is_some_and(|b| *b != b']') {
            hi = pat[j + 2];
            j += 2;
        }
        if lo <= c && c <= hi {
            hit = true;
        }
        j += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ig(text: &str) -> Ignore {
        Ignore::parse(text)
    }

    #[test]
    fn components_and_wildcards() {
        assert!(match_component(b"*.txt", b"a.txt"));
        assert!(!match_component(b"*.txt", b"a.txt.bak"));
        assert!(match_component(b"a?c", b"abc"));
        assert!(!match_component(b"a?c", b"ac"));
        assert!(match_component(b"[a-c]x", b"bx"));
        assert!(!match_component(b"[^a-c]x", b"bx"));
        assert!(match_component(b"[!a-c]x", b"dx"));
        assert!(match_component(b"\\*", b"*"));
        assert!(!match_component(b"\\*", b"a"));
        assert!(match_component(b"*", b""));
        assert!(match_component(b"a*b*c", b"aXXbYYc"));
        assert!(!match_component(b"a*b*c", b"aXXbYY"));
        assert!(match_component(b"[", b"["));
    }

    #[test]
    fn dockerignore_semantics() {
        let i = ig("# comment\n\n.git\nnode_modules/\n*.log\n/build\n**/*.pyc\ndocs/**/draft-*\n!keep.log\n");
        for (path, want) in [
            (".git", true),
            (".git/config", true),
            ("node_modules/x/index.js", true),
            ("src/node_modules/x", false), // not anchored by **: only at the root
            ("a.log", true),
            ("keep.log", false),
            ("sub/a.log", false), // `*.log` is one component at the root
            ("build/out.o", true),
            ("src/build", false),
            ("x.pyc", true),
            ("deep/er/x.pyc", true),
            ("docs/draft-1", true),
            ("docs/a/b/draft-2", true),
            ("docs/final", false),
            ("src/main.rs", false),
        ] {
            assert_eq!(i.excluded(path), want, "{path}");
        }
        // The last match decides; `!` re-includes below an excluded dir.
        let i = ig("data\n!data/keep\n");
        assert!(i.excluded("data/drop"));
        assert!(!i.excluded("data/keep"));
        assert!(!i.excluded("data/keep/inner"));
        assert!(i.has_negations());
        let i = ig("!x\nx\n");
        assert!(i.excluded("x"));
        assert!(ig("").patterns.is_empty() && ig("# only\n\n").patterns.is_empty());
        // Cleaned like a path.
        let i = ig("./a/../b//c/\n");
        assert!(i.excluded("b/c/d"));
    }
}
