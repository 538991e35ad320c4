//! Lexical normalisation of guest paths before they are matched by globs.

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
}
