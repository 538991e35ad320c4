//! File metadata (envd 0.6.2): `X-Metadata-<key>: <value>` upload headers
//! become the file's `user.e2b.<key>` extended attributes; entry infos
//! report them back as `metadata`.

use std::collections::BTreeMap;

use axum::http::HeaderMap;

use super::METADATA_XATTR_PREFIX;

/// The request-header prefix of upload metadata.
pub const HEADER_PREFIX: &str = "x-metadata-";

/// Longest key: the VFS caps a whole xattr name at 255 bytes.
pub const MAX_KEY_LEN: usize = 255 - METADATA_XATTR_PREFIX.len();

/// Most bytes of one file's metadata (prefixed names plus values), as envd.
pub const MAX_TOTAL_LEN: usize = 4096;

/// The metadata of an upload: every `X-Metadata-*` header, the prefix
/// stripped and the key lowercased (HTTP header names are
/// case-insensitive; envd lowercases them), the first value of a repeated
/// one. Checked as envd checks it: keys non-empty, at most
/// [`MAX_KEY_LEN`] bytes; keys and values printable US-ASCII; at most
/// [`MAX_TOTAL_LEN`] bytes together. `Err` says what is wrong.
pub fn from_headers(headers: &HeaderMap) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        if out.contains_key(key) {
            continue;
        }
        let v = value.to_str().map_err(|_| {
            format!("invalid metadata: value for key {key:?} is not printable US-ASCII")
        })?;
        out.insert(key.to_owned(), v.to_owned());
    }
    validate(&out)?;
    Ok(out)
}

/// envd's `ValidateMetadata`.
pub fn validate(m: &BTreeMap<String, String>) -> Result<(), String> {
    let printable = |s: &str| s.bytes().all(|b| (0x20..=0x7e).contains(&b));
    let mut total = 0usize;
    for (k, v) in m {
        if k.is_empty() {
            return Err("invalid metadata: metadata key must not be empty".into());
        }
        if k.len() > MAX_KEY_LEN {
            return Err(format!(
                "invalid metadata: metadata key {k:?} exceeds {MAX_KEY_LEN} bytes"
            ));
        }
        if !printable(k) {
            return Err(format!(
                "invalid metadata: metadata key {k:?} is not printable US-ASCII"
            ));
        }
        if !printable(v) {
            return Err(format!(
                "invalid metadata: value for key {k:?} is not printable US-ASCII"
            ));
        }
        total += METADATA_XATTR_PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_TOTAL_LEN {
        return Err(format!(
            "invalid metadata: total metadata size {total} exceeds {MAX_TOTAL_LEN} bytes"
        ));
    }
    Ok(())
}

/// The extended attributes `m` is stored as.
pub fn to_xattrs(m: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    m.iter()
        .map(|(k, v)| (format!("{METADATA_XATTR_PREFIX}{k}"), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                axum::http::HeaderValue::from_bytes(v).unwrap(),
            );
        }
        m
    }

    #[test]
    fn headers_become_lowercase_keys() {
        let m = from_headers(&h(&[
            ("X-Metadata-Author", b"mish"),
            ("x-metadata-purpose", b"upload"),
            ("content-type", b"x"),
        ]))
        .unwrap();
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [
                ("author".to_owned(), "mish".to_owned()),
                ("purpose".to_owned(), "upload".to_owned())
            ]
        );
        assert_eq!(
            to_xattrs(&from_headers(&h(&[("X-Metadata-A", b"1")])).unwrap())
                .into_keys()
                .collect::<Vec<_>>(),
            ["user.e2b.a"]
        );
        assert!(from_headers(&HeaderMap::new()).unwrap().is_empty());
    }

    #[test]
    fn bad_metadata_is_refused() {
        assert!(from_headers(&h(&[("x-metadata-", b"v")])).is_err());
        assert!(from_headers(&h(&[("x-metadata-k", b"caf\xc3\xa9")])).is_err());
        assert!(from_headers(&h(&[("x-metadata-k", b"tab\there")])).is_err());
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(from_headers(&h(&[(&format!("x-metadata-{long}"), b"v")])).is_err());
        let big = vec![b'v'; MAX_TOTAL_LEN];
        assert!(from_headers(&h(&[("x-metadata-k", &big)])).is_err());
        let ok = vec![b'v'; MAX_TOTAL_LEN - METADATA_XATTR_PREFIX.len() - 1];
        assert!(from_headers(&h(&[("x-metadata-k", &ok)])).is_ok());
    }
}
