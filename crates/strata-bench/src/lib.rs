//! strata's benchmark harness (the `strata-bench` binary): six sections
//! measured against the alternatives side by side in one run, written up as
//! `report.md` + `report.json` + SVG plots. See `docs/bench.md`.

pub mod ctx;
pub mod pauses;
pub mod plot;
pub mod report;
pub mod sections;
pub mod stats;
