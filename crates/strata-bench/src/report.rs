//! The report: sections of tables, plots and notes, written as `report.md`
//! (for people) and `report.json` (for tools and the CI smoke check) into the
//! run's output folder, next to the plots.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::stats::{fmt_ms, Summary};

/// One piece of a section, in order.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Block {
    /// A paragraph of markdown.
    Text {
        /// The markdown.
        text: String,
    },
    /// A table.
    Table(Table),
    /// A plot written into the output folder.
    Plot {
        /// File name relative to the output folder (e.g. `snapshot-pause.svg`).
        file: String,
        /// What it shows.
        caption: String,
    },
}

/// A table of strings, first column usually the case.
#[derive(Debug, Clone, Serialize)]
pub struct Table {
    /// Line above the table.
    pub caption: String,
    /// Column headers.
    pub headers: Vec<String>,
    /// Rows (same length as `headers`).
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these headers.
    pub fn new(caption: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            caption: caption.into(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// The latency table every section uses: case, n, p50, p95, p99, max, and
    /// `extra` columns after them.
    pub fn latency(caption: impl Into<String>, extra: &[&str]) -> Table {
        let mut h = vec!["case", "n", "p50", "p95", "p99", "max"];
        h.extend_from_slice(extra);
        Table::new(caption, &h)
    }

    /// Adds a row of a latency table: `case`, the summary in ms, then `extra` cells.
    pub fn latency_row(&mut self, case: impl Into<String>, s: &Summary, extra: Vec<String>) {
        let mut r = vec![
            case.into(),
            s.n.to_string(),
            fmt_ms(s.p50),
            fmt_ms(s.p95),
            fmt_ms(s.p99),
            fmt_ms(s.max),
        ];
        r.extend(extra);
        self.rows.push(r);
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn markdown(&self) -> String {
        let esc = |s: &str| s.replace('|', "\\|").replace('\n', " ");
        let mut out = String::new();
        if !self.caption.is_empty() {
            out.push_str(&format!("**{}**\n\n", self.caption));
        }
        out.push_str(&format!(
            "| {} |\n",
            self.headers
                .iter()
                .map(|h| esc(h))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        out.push_str(&format!(
            "|{}\n",
            self.headers
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        ));
        for r in &self.rows {
            out.push_str(&format!(
                "| {} |\n",
                r.iter().map(|c| esc(c)).collect::<Vec<_>>().join(" | ")
            ));
        }
        out
    }
}

/// One part of the benchmark (snapshot, restore, load, …).
#[derive(Debug, Clone, Serialize)]
pub struct Section {
    /// Short key (`snapshot`, `restore`, …): also the prefix of its plot files.
    pub key: String,
    /// Heading.
    pub title: String,
    /// The headline lines quoted at the top of the report.
    pub headline: Vec<String>,
    /// Tables, plots and text in order.
    pub blocks: Vec<Block>,
    /// Raw figures for tools (samples, parameters).
    pub data: serde_json::Value,
    /// Wall time the section took, seconds.
    pub seconds: f64,
    /// Set when the section failed: what went wrong. Its blocks hold what was
    /// measured before the failure.
    pub error: Option<String>,
}

impl Section {
    /// An empty section.
    pub fn new(key: &str, title: impl Into<String>) -> Section {
        Section {
            key: key.into(),
            title: title.into(),
            headline: Vec::new(),
            blocks: Vec::new(),
            data: serde_json::Value::Null,
            seconds: 0.0,
            error: None,
        }
    }

    /// Appends a paragraph.
    pub fn text(&mut self, t: impl Into<String>) {
        self.blocks.push(Block::Text { text: t.into() });
    }

    /// Appends a table.
    pub fn table(&mut self, t: Table) {
        self.blocks.push(Block::Table(t));
    }

    /// Appends a plot already written to `file` in the output folder.
    pub fn plot(&mut self, file: impl Into<String>, caption: impl Into<String>) {
        self.blocks.push(Block::Plot {
            file: file.into(),
            caption: caption.into(),
        });
    }

    /// Adds a headline line (quoted in the report's summary).
    pub fn headline(&mut self, line: impl Into<String>) {
        self.headline.push(line.into());
    }
}

/// The machine a run was measured on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Host name.
    pub hostname: String,
    /// CPU model.
    pub cpu: String,
    /// Online CPUs.
    pub cpus: usize,
    /// RAM in bytes.
    pub memory_bytes: u64,
    /// Kernel release.
    pub kernel: String,
    /// OS name.
    pub os: String,
    /// QEMU version line.
    pub qemu: String,
    /// Accelerator the guests ran under.
    pub accel: String,
}

impl Machine {
    /// Reads the machine facts (best effort: unknown fields say so).
    pub fn probe(qemu_binary: &Path, accel: &str) -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".into());
        let memory_bytes = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0);
        let os = read("/etc/os-release")
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_owned())
            .unwrap_or_else(|| "unknown".into());
        let qemu = std::process::Command::new(qemu_binary)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| "unknown".into());
        Machine {
            hostname: read("/proc/sys/kernel/hostname").trim().to_owned(),
            cpu,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory_bytes,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            os,
            qemu,
            accel: accel.to_owned(),
        }
    }
}

/// The strata commit the harness was built from: `$STRATA_COMMIT`, else
/// `git describe` of the workspace it was built in (with `-dirty`), else `unknown`.
pub fn commit() -> String {
    if let Ok(c) = std::env::var("STRATA_COMMIT") {
        return c;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .current_dir(dir)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Format version of `report.json`.
    pub format: u32,
    /// strata commit.
    pub commit: String,
    /// When the run started (UTC, RFC 3339).
    pub started: String,
    /// Wall time of the run, seconds.
    pub seconds: f64,
    /// The machine.
    pub machine: Machine,
    /// The command line.
    pub command: String,
    /// Whether this was the CI smoke size.
    pub smoke: bool,
    /// The sections in order.
    pub sections: Vec<Section>,
}

impl Report {
    /// The report as markdown.
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let mut out = String::new();
        out.push_str("# strata benchmark report\n\n");
        out.push_str(&format!(
            "- **Date:** {}, run time {:.0} s{}\n- **strata commit:** `{}`\n- **Machine:** {} × {}, {:.1} GiB RAM, {}, Linux {}\n- **Guests:** {}, accelerator **{}**\n- **Command:** `{}`\n\n",
            self.started,
            self.seconds,
            if self.smoke { " (smoke size: the figures are not meaningful)" } else { "" },
            self.commit,
            m.cpus,
            m.cpu,
            m.memory_bytes as f64 / (1u64 << 30) as f64,
            m.os,
            m.kernel,
            m.qemu,
            m.accel,
            self.command,
        ));
        out.push_str("Percentiles are nearest-rank over `n` samples: with n < 100 the p99 is the maximum.\n\n");
        out.push_str("## Headlines\n\n");
        for s in &self.sections {
            for h in &s.headline {
                out.push_str(&format!("- **{}:** {h}\n", s.title));
            }
            if let Some(e) = &s.error {
                out.push_str(&format!("- **{}:** FAILED: {e}\n", s.title));
            }
        }
        out.push('\n');
        for s in &self.sections {
            out.push_str(&format!("## {}\n\n", s.title));
            if let Some(e) = &s.error {
                out.push_str(&format!("> **This section failed:** {e}\n\n"));
            }
            for b in &s.blocks {
                match b {
                    Block::Text { text } => {
                        out.push_str(text.trim_end());
                        out.push_str("\n\n");
                    }
                    Block::Table(t) => {
                        out.push_str(&t.markdown());
                        out.push('\n');
                    }
                    Block::Plot { file, caption } => {
                        out.push_str(&format!("![{caption}]({file})\n\n*{caption}*\n\n"));
                    }
                }
            }
            out.push_str(&format!("*Section time: {:.0} s.*\n\n", s.seconds));
        }
        out
    }

    /// Writes `report.md` and `report.json` into `dir`; returns the markdown's path.
    pub fn write(&self, dir: &Path) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let md = dir.join("report.md");
        std::fs::write(&md, self.markdown())?;
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(dir.join("report.json"), json)?;
        Ok(md)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_tables_and_failures() {
        let mut s = Section::new("x", "Example");
        let mut t = Table::latency("pause", &["ratio"]);
        t.latency_row("a|b", &Summary::of(&[1.0, 2.0, 3.0]), vec!["2×".into()]);
        s.table(t);
        s.plot("x-plot.svg", "a plot");
        s.headline("fast");
        let mut f = Section::new("y", "Broken");
        f.error = Some("boom".into());
        let r = Report {
            format: 1,
            commit: "abc".into(),
            started: "now".into(),
            seconds: 1.0,
            machine: Machine::probe(Path::new("/nonexistent"), "tcg"),
            command: "strata-bench".into(),
            smoke: true,
            sections: vec![s, f],
        };
        let md = r.markdown();
        assert!(md.contains("| a\\|b | 3 | 2.00 ms | 3.00 ms | 3.00 ms | 3.00 ms | 2× |"));
        assert!(md.contains("![a plot](x-plot.svg)"));
        assert!(md.contains("- **Example:** fast"));
        assert!(md.contains("- **Broken:** FAILED: boom"));
        assert!(md.contains("|---|---:|"));
    }
}
