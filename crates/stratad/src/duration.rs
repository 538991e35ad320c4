//! Human durations (`90s`, `10m`, `1h30m`, `7d`): the parser lives in
//! `strata-core` so the CLI reads the same syntax; this module adds serde.

pub use strata_core::duration::{format_duration, parse_duration, DurationError};

pub mod serde_human {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes as e.g. `"10m"`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    /// Deserializes from e.g. `"10m"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}
