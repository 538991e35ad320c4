//! SVG plots (plotters, no font files needed): latency CDFs, grouped bars and
//! lines over time.

use std::path::Path;

use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::prelude::*;

use crate::stats::fmt_num;

/// Plot errors (plotters' drawing errors as text).
#[derive(Debug, thiserror::Error)]
#[error("plot {file}: {message}")]
pub struct PlotError {
    file: String,
    message: String,
}

type Res<T> = Result<T, PlotError>;

/// Names `file` in an error of plotters (as text).
pub(crate) fn err(file: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError {
        file: file.display().to_string(),
        message,
    }
}

/// A named series of points.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// (x, y) points.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A series.
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }
}

const W: u32 = 900;
const H: u32 = 520;

fn color(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi <= lo {
        hi = lo + lo.abs().max(1.0);
    }
    (lo, hi)
}

fn label(v: &f64) -> String {
    fmt_num(*v)
}

/// The drawing area of one SVG file.
pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A chart over `x` × `y` drawn on an [`Area`].
pub(crate) type Chart<'a, 'b, X, Y> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<<X as AsRangedCoord>::CoordDescType, <Y as AsRangedCoord>::CoordDescType>,
>;

/// A white canvas of the report's plot size, drawing to `file`.
pub(crate) fn canvas(file: &Path) -> Res<Area<'_>> {
    let root = SVGBackend::new(file, (W, H)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| err(file)(x.to_string()))?;
    Ok(root)
}

/// Writes `root` out to `file`.
pub(crate) fn finish(file: &Path, root: &Area<'_>) -> Res<()> {
    root.present().map_err(|x| err(file)(x.to_string()))
}

/// A chart titled `title` over `x` × `y`, with the report's margins and
/// label areas.
pub(crate) fn chart<'a, 'b, X, Y>(
    root: &'a Area<'b>,
    title: &str,
    x: X,
    y: Y,
) -> Result<Chart<'a, 'b, X, Y>, String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
{
    ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(|e| e.to_string())
}

/// The grid and the axes of a chart of numbers: named axes, numeric labels.
pub(crate) fn number_mesh<X, Y>(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<X, Y>>,
    x_desc: &str,
    y_desc: &str,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&label)
        .y_label_formatter(&label)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())
}

/// The legend, upper left on a translucent white box.
pub(crate) fn legend<'a, 'b: 'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<X, Y>>,
) -> Result<(), String>
where
    X: Ranged,
    Y: Ranged,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())
}

/// A legend mark: a short line of colour `c`.
pub(crate) fn line_mark(c: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3))
}

/// What a chart of lines shows, whatever its axes.
struct Lines<'a> {
    title: &'a str,
    x_desc: &'a str,
    y_desc: &'a str,
    series: &'a [Series],
    /// Draw each series as a step function (a CDF).
    steps: bool,
}

/// Empirical CDF of each series' samples (x = value in `unit`, y = fraction of
/// samples ≤ x). The x axis is logarithmic when the values span more than 20×,
/// so a 50× gap between strata and a peer stays readable.
pub fn cdf(file: &Path, title: &str, unit: &str, series: &[(String, Vec<f64>)]) -> Res<()> {
    let e = err(file);
    let curves: Vec<Series> = series
        .iter()
        .map(|(name, v)| {
            let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
            s.sort_by(f64::total_cmp);
            let n = s.len() as f64;
            let pts = s
                .iter()
                .enumerate()
                .map(|(i, x)| (*x, (i + 1) as f64 / n))
                .collect();
            Series::new(format!("{name} (n={})", s.len()), pts)
        })
        .collect();
    let (lo, hi) = bounds(curves.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let root = canvas(file)?;
    let x_desc = format!("{unit} (≤ x)");
    let spec = Lines {
        title,
        x_desc: &x_desc,
        y_desc: "fraction of samples",
        series: &curves,
        steps: true,
    };
    if lo > 0.0 && hi / lo > 20.0 {
        draw_lines(&root, &spec, (lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0).map_err(e)?;
    } else {
        let pad = (hi - lo) * 0.05;
        draw_lines(&root, &spec, (lo - pad).max(0.0)..hi + pad, 0.0..1.0).map_err(e)?;
    }
    finish(file, &root)
}

/// Lines (with point marks) of y over x; `log_y` for a logarithmic y axis.
pub fn lines(
    file: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
    log_y: bool,
) -> Res<()> {
    let e = err(file);
    let (xlo, xhi) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (ylo, yhi) = bounds(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let root = canvas(file)?;
    let spec = Lines {
        title,
        x_desc,
        y_desc,
        series,
        steps: false,
    };
    if log_y && ylo > 0.0 {
        draw_lines(&root, &spec, xlo..xhi, (ylo * 0.8..yhi * 1.25).log_scale()).map_err(e)?;
    } else {
        let y0 = if ylo >= 0.0 { 0.0 } else { ylo * 1.1 };
        draw_lines(&root, &spec, xlo..xhi, y0..yhi * 1.1).map_err(e)?;
    }
    finish(file, &root)
}

fn draw_lines<X, Y>(root: &Area<'_>, spec: &Lines<'_>, x: X, y: Y) -> Result<(), String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let mut chart = chart(root, spec.title, x, y)?;
    number_mesh(&mut chart, spec.x_desc, spec.y_desc)?;
    for (i, s) in spec.series.iter().enumerate() {
        let c = color(i);
        let pts: Vec<(f64, f64)> = if spec.steps {
            // A CDF is a step function: hold each level until the next sample.
            let mut v = Vec::with_capacity(s.points.len() * 2);
            let mut prev = 0.0;
            for &(x, y) in &s.points {
                v.push((x, prev));
                v.push((x, y));
                prev = y;
            }
            v
        } else {
            s.points.clone()
        };
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(s.name.clone())
            .legend(line_mark(c));
        if !spec.steps && s.points.len() <= 400 {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 2, c.filled())))
                .map_err(|e| e.to_string())?;
        }
    }
    legend(&mut chart)
}

/// What a chart of grouped bars shows, whatever its y axis.
struct Bars<'a> {
    title: &'a str,
    y_desc: &'a str,
    categories: &'a [String],
    series: &'a [(String, Vec<f64>)],
}

/// Grouped bars: one group per category, one bar per series in each group
/// (`values[series][category]`, NaN = no bar). The y axis is logarithmic when
/// `log_y` (ratios of 10× and more between bars).
pub fn bars(
    file: &Path,
    title: &str,
    y_desc: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
    log_y: bool,
) -> Res<()> {
    let e = err(file);
    let (lo, hi) = bounds(series.iter().flat_map(|s| s.1.iter().copied()));
    let root = canvas(file)?;
    let x = 0.0..categories.len().max(1) as f64;
    let spec = Bars {
        title,
        y_desc,
        categories,
        series,
    };
    if log_y && lo > 0.0 {
        let base = lo * 0.5;
        draw_bars(&root, &spec, x, (base..hi * 2.0).log_scale(), base).map_err(e)?;
    } else {
        draw_bars(&root, &spec, x, 0.0..hi * 1.15, 0.0).map_err(e)?;
    }
    finish(file, &root)
}

fn draw_bars<Y>(
    root: &Area<'_>,
    spec: &Bars<'_>,
    x: std::ops::Range<f64>,
    y: Y,
    base: f64,
) -> Result<(), String>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let cats = spec.categories.to_vec();
    // Labels every 0.5: the category's name at its centre (i + 0.5), nothing
    // at the group edges.
    let cat_label = move |v: &f64| -> String {
        if (v.fract() - 0.5).abs() > 1e-6 {
            return String::new();
        }
        cats.get(v.floor() as usize).cloned().unwrap_or_default()
    };
    let n_labels = spec.categories.len() * 2 + 1;
    let mut chart = chart(root, spec.title, x, y)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n_labels)
        .y_desc(spec.y_desc)
        .x_label_formatter(&cat_label)
        .y_label_formatter(&label)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())?;
    let k = spec.series.len().max(1) as f64;
    let width = 0.8 / k;
    for (j, (name, vals)) in spec.series.iter().enumerate() {
        let c = color(j);
        let rects: Vec<Rectangle<(f64, f64)>> = vals
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite() && **v > base)
            .map(|(i, v)| {
                let x0 = i as f64 + 0.1 + j as f64 * width;
                Rectangle::new([(x0, base), (x0 + width * 0.92, *v)], c.filled())
            })
            .collect();
        chart
            .draw_series(rects)
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = d.path().join("cdf.svg");
        cdf(
            &f,
            "pause",
            "ms",
            &[
                ("strata".into(), vec![10.0, 12.0, 30.0]),
                ("full save".into(), vec![700.0, 800.0]),
            ],
        )
        .expect("cdf");
        let svg = std::fs::read_to_string(&f).expect("read");
        assert!(svg.starts_with("<svg") && svg.contains("strata (n=3)"));
        let f = d.path().join("bars.svg");
        bars(
            &f,
            "pause by size",
            "ms",
            &["256 MiB".into(), "1 GiB".into()],
            &[
                ("strata".into(), vec![10.0, 20.0]),
                ("savevm".into(), vec![500.0, f64::NAN]),
            ],
            true,
        )
        .expect("bars");
        assert!(std::fs::read_to_string(&f).expect("read").contains("1 GiB"));
        let f = d.path().join("lines.svg");
        lines(
            &f,
            "bytes",
            "hours",
            "MiB",
            &[Series::new("used", vec![(0.0, 1.0), (1.0, 3.0)])],
            false,
        )
        .expect("lines");
        // Empty input still draws an (empty) chart rather than failing.
        lines(&f, "empty", "x", "y", &[], true).expect("empty lines");
    }
}
