//! Resource identifiers.
//!
//! Ids are short, URL- and path-safe strings with a type prefix
//! (`sb-`, `snap-`, `tpl-`) so that a human reading a log knows what an id
//! names. Parsing is strict: ids end up in file system paths.

use std::fmt;
use std::str::FromStr;

use rand::Rng;
use serde::{Deserialize, Serialize};

/// Error returned when a string is not a valid id of the expected kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid {kind} id {value:?}: expected `{prefix}` followed by 1-64 characters of [a-z0-9-]"
)]
pub struct IdError {
    /// Which kind of id was expected.
    pub kind: &'static str,
    /// The expected prefix.
    pub prefix: &'static str,
    /// The rejected input (truncated to 80 characters).
    pub value: String,
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::thread_rng();
    (0..12)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect()
}

fn validate(kind: &'static str, prefix: &'static str, s: &str) -> Result<(), IdError> {
    let ok = s.len() <= prefix.len() + 64
        && s.len() > prefix.len()
        && s.starts_with(prefix)
        && s[prefix.len()..]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(IdError {
            kind,
            prefix,
            value: s.chars().take(80).collect(),
        })
    }
}

macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The prefix every id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A new random id.
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, random_suffix()))
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                validate($kind, $prefix, s)?;
                Ok(Self(s.to_owned()))
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                validate($kind, $prefix, &s)?;
                Ok(Self(s))
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

define_id!(
    /// Identifies a sandbox (`sb-…`).
    SandboxId, "sandbox", "sb-"
);
define_id!(
    /// Identifies a snapshot (`snap-…`).
    SnapshotId, "snapshot", "snap-"
);
define_id!(
    /// Identifies a template (`tpl-…`).
    TemplateId, "template", "tpl-"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_parse_back() {
        let id = SandboxId::generate();
        assert!(id.as_str().starts_with("sb-"));
        let parsed: SandboxId = id.as_str().parse().unwrap();
        assert_eq!(parsed, id);
    }

    #[test]
    fn rejects_path_tricks_and_wrong_prefix() {
        for bad in [
            "", "sb-", "sb-../x", "sb-A", "snap-abc", "sb-a/b", "sb-a\0b",
        ] {
            assert!(bad.parse::<SandboxId>().is_err(), "{bad:?} accepted");
        }
        assert!("snap-abc".parse::<SnapshotId>().is_ok());
    }

    #[test]
    fn serde_validates() {
        let ok: SandboxId = serde_json::from_str("\"sb-abc\"").unwrap();
        assert_eq!(ok.as_str(), "sb-abc");
        assert!(serde_json::from_str::<SandboxId>("\"../etc\"").is_err());
    }
}
