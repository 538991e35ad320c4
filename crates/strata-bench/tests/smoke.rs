//! CI smoke run of the benchmark harness: every section at its smallest size
//! against real guests (TCG) and real btrfs pools. Asserts only what the
//! issue asks of CI: the run completes and writes a well-formed report
//! (every section present and not failed, its tables filled, its plots real
//! SVG files next to `report.md`). The figures of a smoke run mean nothing.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const SECTIONS: &[&str] = &["snapshot", "restore", "load", "density", "history", "scale"];

#[test]
fn smoke_run_writes_a_well_formed_report() {
    let image = strata_testkit::test_image();
    let out = tempfile::Builder::new()
        .prefix("strata-bench-smoke-")
        .tempdir_in("/tmp")
        .expect("output dir");
    let status = Command::new(env!("CARGO_BIN_EXE_strata-bench"))
        .args(["--smoke", "--accel", "tcg", "--out"])
        .arg(out.path())
        .arg("--image")
        .arg(&image.dir)
        .status()
        .expect("run strata-bench");
    let report = std::fs::read(out.path().join("report.json")).expect("report.json written");
    let report: Value = serde_json::from_slice(&report).expect("report.json parses");
    let md = std::fs::read_to_string(out.path().join("report.md")).expect("report.md written");
    check(&report, &md, out.path());
    assert!(status.success(), "strata-bench exited with {status}");
}

fn check(report: &Value, md: &str, dir: &Path) {
    assert_eq!(report["format"], 1);
    assert_eq!(report["smoke"], true);
    assert!(report["commit"].as_str().is_some_and(|c| !c.is_empty()));
    assert!(report["machine"]["cpus"].as_u64().is_some_and(|n| n >= 1));
    assert_eq!(report["machine"]["accel"], "tcg");
    let sections = report["sections"].as_array().expect("sections");
    let keys: Vec<&str> = sections.iter().filter_map(|s| s["key"].as_str()).collect();
    assert_eq!(keys, SECTIONS, "every section, in order");
    for s in sections {
        let key = s["key"].as_str().unwrap_or_default();
        assert!(s["error"].is_null(), "section {key} failed: {}", s["error"]);
        let title = s["title"].as_str().expect("title");
        assert!(md.contains(&format!("## {title}")), "{key} in report.md");
        assert!(
            !s["headline"].as_array().expect("headline").is_empty(),
            "{key} headline"
        );
        let blocks = s["blocks"].as_array().expect("blocks");
        let tables: Vec<&Value> = blocks.iter().filter(|b| b["kind"] == "table").collect();
        assert!(!tables.is_empty(), "{key} has a table");
        for t in tables {
            let width = t["headers"].as_array().expect("headers").len();
            let rows = t["rows"].as_array().expect("rows");
            assert!(!rows.is_empty(), "{key}: empty table {}", t["caption"]);
            for r in rows {
                assert_eq!(
                    r.as_array().map(Vec::len),
                    Some(width),
                    "{key}: ragged row {r}"
                );
            }
        }
        let plots: Vec<&str> = blocks
            .iter()
            .filter(|b| b["kind"] == "plot")
            .filter_map(|b| b["file"].as_str())
            .collect();
        assert!(!plots.is_empty(), "{key} has a plot");
        for p in plots {
            let svg = std::fs::read_to_string(dir.join(p)).unwrap_or_default();
            assert!(
                svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
                "{p} is an SVG"
            );
            assert!(md.contains(&format!("]({p})")), "{p} linked from report.md");
        }
    }
}
