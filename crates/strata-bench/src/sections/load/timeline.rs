//! The `load` section's timeline plot.

use std::path::Path;

use plotters::prelude::*;

use super::report::Bounds;
use crate::plot::{self, PlotError};

/// The timeline plot: exec p50/p99 per window in both phases, phase (b)
/// shaded, rolling snapshots as stems of their pause.
pub(super) fn timeline(
    path: &Path,
    wa: &[(f64, f64, f64)],
    wb: &[(f64, f64, f64)],
    stems: &[(f64, f64)],
    bounds: &Bounds,
) -> Result<(), PlotError> {
    let e = plot::err(path);
    let ymax = wa
        .iter()
        .chain(wb)
        .map(|w| w.2)
        .chain(stems.iter().map(|s| s.1))
        .filter(|v| v.is_finite())
        .fold(1.0_f64, f64::max)
        * 1.4;
    let xmax = bounds.b_end.max(bounds.a_end).max(1.0);
    let root = plot::canvas(path)?;
    let mut chart =
        plot::chart(&root, "exec `true` latency over time", 0.0..xmax, 0.0..ymax).map_err(&e)?;
    plot::number_mesh(&mut chart, "seconds since the baseline started", "ms").map_err(&e)?;
    let shade = RGBColor(255, 240, 220);
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(bounds.b_start, 0.0), (bounds.b_end, ymax)],
            shade.filled(),
        )))
        .map_err(|x| e(x.to_string()))?
        .label("phase (b): rolling schedule on")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 18, y + 5)], shade.filled()));
    let stem = RGBColor(214, 39, 40);
    chart
        .draw_series(
            stems
                .iter()
                .map(|&(t, ms)| PathElement::new(vec![(t, 0.0), (t, ms)], stem.stroke_width(1))),
        )
        .map_err(|x| e(x.to_string()))?
        .label("rolling snapshot (height: its vCPU pause, ms)")
        .legend(plot::line_mark(stem));
    type Line = Vec<(f64, f64)>;
    let p99 = |w: &[(f64, f64, f64)]| -> Line { w.iter().map(|w| (w.0, w.2)).collect() };
    let p50 = |w: &[(f64, f64, f64)]| -> Line { w.iter().map(|w| (w.0, w.1)).collect() };
    let lines: [(&str, RGBColor, Line); 4] = [
        ("exec p99, baseline", RGBColor(31, 119, 180), p99(wa)),
        ("exec p50, baseline", RGBColor(140, 190, 230), p50(wa)),
        ("exec p99, rolling", RGBColor(255, 127, 14), p99(wb)),
        ("exec p50, rolling", RGBColor(250, 190, 130), p50(wb)),
    ];
    for (name, c, pts) in lines {
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|x| e(x.to_string()))?
            .label(name)
            .legend(plot::line_mark(c));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 2, c.filled())))
            .map_err(|x| e(x.to_string()))?;
    }
    plot::legend(&mut chart).map_err(&e)?;
    plot::finish(path, &root)
}
